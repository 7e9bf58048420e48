"""The node service of `crossdc node start`: one persistent trainer per run, from the coordinator's config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from multiprocessing import AuthenticationError
from pathlib import Path

import pytest

from crossdc.clients.channel import TrainerFailed, TrainerUnavailable, call_trainer
from crossdc.clients.node import node_authkey, node_socket
from crossdc.deployment.heartbeat import HeartbeatMonitor
from crossdc.experiment.rundir import SETTINGS_HEARTBEAT, SETTINGS_HEARTBEAT_KEY

EXAMPLE = Path(__file__).parent.parent / "examples" / "synthetic-2dc.toml"


def _config(**run: object) -> str:
    doc = tomllib.loads(EXAMPLE.read_text())
    doc["run"].update(run)
    return json.dumps(doc)


@pytest.fixture
def node(tmp_path: Path):
    state_dir = tmp_path / "node-state"
    process = subprocess.Popen([sys.executable, "-m", "crossdc.clients.node", "--state-dir", str(state_dir), "--datacenter", "us-east",
                                "--coordinator-host", "127.0.0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    key = node_authkey(state_dir)
    deadline = time.monotonic() + 60
    while not node_socket(state_dir).exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read().decode() if process.stdout else ""
        time.sleep(0.1)
    yield state_dir, key
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=30)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.deployment
def test_prepare_starts_one_trainer_per_run_and_restarts_a_dead_one(node) -> None:
    state_dir, key = node
    sock = node_socket(state_dir)
    first = call_trainer(sock, key, {"op": "prepare", "run_id": "run-a", "config": _config()})
    again = call_trainer(sock, key, {"op": "prepare", "run_id": "run-a", "config": _config()})
    assert first["worker_pids"] == again["worker_pids"]
    ping = call_trainer(first["socket"], key, {"op": "ping"})
    assert ping["run_id"] == "run-a" and ping["datacenter"] == "us-east"
    assert (state_dir / "runs" / "run-a" / "run.json").exists()
    os.kill(first["worker_pids"][0], signal.SIGKILL)
    time.sleep(0.5)
    restarted = call_trainer(sock, key, {"op": "prepare", "run_id": "run-a", "config": _config()})
    assert restarted["worker_pids"] != first["worker_pids"]


@pytest.mark.deployment
def test_bad_requests_are_refused_and_the_service_goes_on(node) -> None:
    state_dir, key = node
    sock = node_socket(state_dir)
    call_trainer(sock, key, {"op": "prepare", "run_id": "run-b", "config": _config()})
    with pytest.raises(TrainerFailed, match="different config"):
        call_trainer(sock, key, {"op": "prepare", "run_id": "run-b", "config": _config(rounds=7)})
    doc = json.loads(_config())
    doc["datacenters"] = [{"name": "ap-south"}]
    with pytest.raises(TrainerFailed, match="no datacenter 'us-east'"):
        call_trainer(sock, key, {"op": "prepare", "run_id": "run-c", "config": json.dumps(doc)})
    with pytest.raises(TrainerFailed, match="not valid"):
        call_trainer(sock, key, {"op": "prepare", "run_id": "run-d", "config": "{not json"})
    with pytest.raises(TrainerFailed, match="bad run id"):
        call_trainer(sock, key, {"op": "prepare", "run_id": "../escape", "config": _config()})
    with pytest.raises((AuthenticationError, TrainerUnavailable, EOFError, ConnectionError)):
        call_trainer(sock, b"x" * 32, {"op": "ping"}, connect_timeout_s=2)
    assert call_trainer(sock, key, {"op": "ping"})["runs"] == ["run-b"]


@pytest.mark.deployment
def test_least_recently_used_trainer_is_stopped_beyond_max_runs(node) -> None:
    state_dir, key = node
    sock = node_socket(state_dir)
    pids = {run: call_trainer(sock, key, {"op": "prepare", "run_id": run, "config": _config()})["worker_pids"]
            for run in ("r1", "r2", "r3")}
    time.sleep(0.5)
    assert _pids_alive(pids["r1"]) == []
    assert _pids_alive(pids["r2"]) == pids["r2"] and _pids_alive(pids["r3"]) == pids["r3"]


@pytest.mark.deployment
def test_a_hellos_heartbeat_offer_makes_the_trainer_beat_to_the_coordinator(node) -> None:
    """What a standing federation's coordinator offers in its hello (port and key) reaches the run's settings on the
    node, and the run's trainer beats there, signed with that key; a later offer (a resumed attempt) is followed; a
    malformed offer is refused with the reason."""
    state_dir, key = node
    sock = node_socket(state_dir)
    offered_key = os.urandom(32)
    monitor = HeartbeatMonitor("0.0.0.0", 0, "run-h", offered_key, ["us-east"], timeout_s=60, on_change=lambda *_: None).start()
    again = HeartbeatMonitor("0.0.0.0", 0, "run-h", b"n" * 32, ["us-east"], timeout_s=60, on_change=lambda *_: None).start()
    try:
        config = _config(heartbeat_timeout_s=0.6)
        call_trainer(sock, key, {"op": "prepare", "run_id": "run-h", "config": config,
                                 "heartbeat": [monitor.port, offered_key.hex()]})
        settings = json.loads((state_dir / "runs" / "run-h" / "run.json").read_text())
        assert settings[SETTINGS_HEARTBEAT] == ["127.0.0.1", monitor.port] and settings[SETTINGS_HEARTBEAT_KEY] == offered_key.hex()
        deadline = time.monotonic() + 60
        while monitor.beats["us-east"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert monitor.beats["us-east"] >= 2 and monitor.refused == 0
        call_trainer(sock, key, {"op": "prepare", "run_id": "run-h", "config": config, "heartbeat": [again.port, (b"n" * 32).hex()]})
        deadline = time.monotonic() + 30
        while again.beats["us-east"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert again.beats["us-east"] >= 2
        for bad in ([0, offered_key.hex()], ["port", "key"], [monitor.port, "zz"], [monitor.port, "ab"], "offer"):
            with pytest.raises(TrainerFailed, match="bad heartbeat offer"):
                call_trainer(sock, key, {"op": "prepare", "run_id": "run-h", "config": config, "heartbeat": bad})
    finally:
        monitor.stop()
        again.stop()
