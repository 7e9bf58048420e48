"""Checkpoints and `crossdc resume`: `crossdc run`'s whole process group is SIGKILLed mid-run (every process of the run
dies with it, recording nothing), its newest checkpoint is damaged, and the resumed run still ends with exactly the
model of an uninterrupted run, each round logged once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import CROSSDC, read_run, rounds_logged, run_and_kill_when

from crossdc.clients.state_store import DatacenterStateStore, StateStoreError
from crossdc.experiment.processes import (
    RUN_ROOT_ENV,
    die_with_run_root,
    free_port,
    is_running,
    kill_processes_with_env,
    parse_process_identity,
    process_identity,
    process_start,
    run_root_env,
)
from crossdc.experiment.rundir import RunDir
from crossdc.orchestration.local_run import COORDINATOR_PID_FILE, coordinator_alive

REPO = Path(__file__).resolve().parents[1]
MARKER = "CROSSDC_TEST_RESUME"
ROUNDS = 6


def _config(tmp: Path) -> Path:
    """DiLoCo (server momentum, inner AdamW state, data position, the inner and outer learning-rate schedules'
    positions: everything a resume must restore), 2 datacenters, checkpoints every 2 rounds, keeping 3."""
    text = (REPO / "examples" / "synthetic-2dc.toml").read_text()
    doc = tomllib.loads(text)
    assert doc["strategy"]["name"] == "fedavg"
    text = text.replace('name = "fedavg"', 'name = "diloco"\nparams = { outer_lr = 0.7, outer_momentum = 0.9, '
                        'outer_warmup_rounds = 2, outer_schedule = "cosine", outer_min_lr = 0.1 }')
    # the inner schedule counts each datacenter's steps since the run began: a resume must go on where it was
    text = text.replace("lr = 0.01\n", 'lr = 0.01\nbetas = [0.9, 0.95]\ngrad_clip = 1.0\n'
                        'schedule = { kind = "cosine", warmup_steps = 5, min_lr = 0.001 }\n')
    text = text.replace("rounds = 3", f"rounds = {ROUNDS}")
    text += f'\n[checkpoint]\nevery_rounds = 2\nkeep = 3\ndir = "{tmp / "checkpoints"}"\n'
    path = tmp / "resume.toml"
    path.write_text(text)
    return path


def test_state_store_keeps_history_and_rewinds(tmp_path: Path) -> None:
    store = DatacenterStateStore(tmp_path, "run", "dc")
    store.keep_from = 0
    for r in range(1, 6):
        store.save("trainer", {"step": r}, r)
    store.save("codec", "residual", 4)  # a key that began after round 3
    store.keep_from = 2  # the server's oldest retained checkpoint moved on: versions before 2 are not needed
    store.save("trainer", {"step": 6}, 6)
    assert not (store.history / "trainer.r000001.pt").exists() and (store.history / "trainer.r000002.pt").exists()
    assert store.rewind(3) == {"trainer": 3, "codec": 0}
    assert store.load("trainer") == ({"step": 3}, 3) and store.load("codec") is None
    assert store.rewind(3) == {}  # nothing newer left
    plain = DatacenterStateStore(tmp_path, "run", "no-history")
    plain.save("trainer", 1, 1)
    plain.save("trainer", 2, 2)
    with pytest.raises(StateStoreError, match="no past versions"):
        plain.rewind(1)


def test_process_identities_on_exact_cases(tmp_path: Path) -> None:
    assert parse_process_identity("123:456") == (123, 456)
    assert parse_process_identity(" 7:0\n") == (7, 0)
    for bad in ("", "123", "123:", ":5", "0:5", "-1:5", "a:1", "1:b", "1:2:3"):
        assert parse_process_identity(bad) is None, bad
    me = process_identity(os.getpid())
    assert me is not None and parse_process_identity(me) == (os.getpid(), process_start(os.getpid()))
    assert run_root_env() == {RUN_ROOT_ENV: me}
    assert die_with_run_root({RUN_ROOT_ENV: me}) is None and die_with_run_root({}) is None  # nothing to watch
    # the coordinator named by its identity (its command line need not say crossdc); a pid alone must name crossdc
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        run_dir = RunDir(tmp_path / "run")
        run_dir.path.mkdir()
        pid_file = run_dir.path / COORDINATOR_PID_FILE
        pid_file.write_text(process_identity(sleeper.pid) or "")
        assert coordinator_alive(run_dir) == sleeper.pid
        pid_file.write_text(f"{sleeper.pid}:{process_start(sleeper.pid) + 1}")  # a recycled pid: not the coordinator
        assert coordinator_alive(run_dir) is None
        pid_file.write_text(str(sleeper.pid))
        assert coordinator_alive(run_dir) is None
        pid_file.write_text(process_identity(sleeper.pid) or "")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert coordinator_alive(run_dir) is None  # dead


#: a process of a run: dies with its root (die_with_run_root), ignores SIGTERM (slow to act on it), prints its pid and
#: then, if asked, starts another such process from a thread that ends at once
WATCHED = """
import os, signal, subprocess, sys, threading, time
from crossdc.experiment.processes import die_with_run_root
die_with_run_root()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
if sys.argv[1:] == ["spawn"]:
    threading.Thread(target=subprocess.Popen, args=([sys.executable, "-c", WATCHED],),
                     kwargs={"start_new_session": True}).start()
time.sleep(300)
"""


def _watched(*args: str) -> list[str]:
    """The command line of a WATCHED process (with "spawn": one that starts another)."""
    return [sys.executable, "-c", f"WATCHED = {WATCHED!r}\n{WATCHED}", *args]


def test_a_process_started_after_its_run_root_died_dies_at_once() -> None:
    """The race of a late parent-death signal: the root named in the environment is gone (or its pid names a later
    process) before the process gets to die_with_run_root; it is SIGKILLed there, not left running."""
    gone = subprocess.Popen(["sleep", "30"])
    identity = process_identity(gone.pid)
    gone.kill()
    gone.wait()
    recycled = f"{os.getpid()}:{process_start(os.getpid()) + 1}"
    for root in (identity, recycled):
        assert root is not None
        child = subprocess.run(_watched(), env={**os.environ, RUN_ROOT_ENV: root}, capture_output=True, timeout=60)
        assert child.returncode == -signal.SIGKILL and child.stdout == b"", (root, child.stdout, child.stderr[-500:])
    alive = subprocess.Popen(_watched(), env={**os.environ, **run_root_env()}, stdout=subprocess.PIPE)
    try:
        assert alive.stdout is not None and alive.stdout.readline().strip().isdigit()  # its root lives: it goes on
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.serial  # bounds the seconds from the root's death to its processes' on the wall clock
def test_every_process_of_a_run_dies_within_3_s_of_its_root(tmp_path: Path) -> None:
    """A root (as `crossdc run`) starts a process the way Flower starts its ServerApp (a session of its own, no
    parent-death signal), which starts another from a thread that ends at once (a parent-death signal would fire at
    that thread's end, or never); both ignore SIGTERM. SIGKILL the root: both are gone within 3 s."""
    pids_file = tmp_path / "pids"
    root = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
from crossdc.experiment.processes import run_root_env
out = open({str(pids_file)!r}, "w")
subprocess.Popen({_watched("spawn")!r}, env={{**os.environ, **run_root_env()}}, stdout=out, start_new_session=True)
time.sleep(300)
"""])
    def started() -> list[int]:
        return [int(pid) for pid in pids_file.read_text().split()] if pids_file.exists() else []

    try:
        deadline = time.monotonic() + 60
        while len(started()) < 2:
            assert time.monotonic() < deadline and root.poll() is None, "the run's processes did not start"
            time.sleep(0.05)
        pids = started()
        assert all(is_running(pid) for pid in pids)
        root.kill()
        killed_at = time.monotonic()
        root.wait()
        while any(is_running(pid) for pid in pids) and time.monotonic() - killed_at < 3.0:
            time.sleep(0.02)
        assert not any(is_running(pid) for pid in pids), [pid for pid in pids if is_running(pid)]
    finally:
        root.kill()
        for pid in started():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.deployment
@pytest.mark.timeout(800)
def test_killed_coordinator_resumes_to_the_same_model(tmp_path: Path) -> None:
    config = _config(tmp_path)
    db_url = f"sqlite:///{tmp_path / 'resume.db'}"
    env = {**os.environ, MARKER: str(tmp_path)}
    try:
        # the uninterrupted run
        reference = subprocess.run([CROSSDC, "run", str(config), "--db", f"sqlite:///{tmp_path / 'reference.db'}", "--json",
                                    "--port", str(free_port()), "--runs-dir", str(tmp_path / "reference-runs")],
                                   capture_output=True, text=True, timeout=400, env=env)
        assert reference.returncode == 0, reference.stderr[-3000:]
        reference_summary = json.loads(reference.stdout.strip().splitlines()[-1])
        reference_id = reference_summary["run_id"]
        expected = np.load(tmp_path / "reference-runs" / reference_id / "final-weights.npz")
        expected_best = np.load(tmp_path / "reference-runs" / reference_id / "best-weights.npz")
        assert 1 <= reference_summary["best_round"] <= ROUNDS

        # the same run, `crossdc run` and its process group SIGKILLed once round 5 is logged (checkpoints of rounds 2
        # and 4 exist); every process of the run is gone soon after (run_and_kill_when checks)
        runs = tmp_path / "runs"
        run_id = run_and_kill_when(config, db_url, runs, env, lambda run: rounds_logged(db_url, run) >= 5,
                                    within_s=200, poll_s=0.2, marker=MARKER)
        logged = read_run(db_url, run_id)
        done = len(logged["rounds"])
        # nothing of the killed run recorded an end of its own (an orphaned ServerApp once wrote "interrupted: SystemExit:
        # 0" over the resumed attempt's "running")
        assert 5 <= done < ROUNDS and logged["run"]["status"] == "running"
        checkpoints = sorted((tmp_path / "checkpoints" / run_id).glob("round-*.ckpt"))
        assert [p.name for p in checkpoints][:2] == ["round-000002.ckpt", "round-000004.ckpt"]
        # the newest checkpoint is damaged (a crash while it was written): the resume falls back to round 2
        newest = checkpoints[-1]
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

        resumed = subprocess.run([CROSSDC, "resume", run_id, "--db", db_url, "--json", "--port", str(free_port()),
                                  "--runs-dir", str(runs)], capture_output=True, text=True, timeout=400, env=env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        summary = json.loads(resumed.stdout.strip().splitlines()[-1])
        assert summary["run_id"] == run_id and summary["rounds"] == ROUNDS

        got = np.load(runs / run_id / "final-weights.npz")
        assert sorted(got.files) == sorted(expected.files)
        for name in expected.files:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
        # the best model too: what the first attempt found best after the checkpoint was rolled back with its rounds
        assert (summary["best_round"], summary["best_val_loss"]) == (reference_summary["best_round"],
                                                                      reference_summary["best_val_loss"])
        got_best = np.load(runs / run_id / "best-weights.npz")
        for name in expected_best.files:
            np.testing.assert_array_equal(got_best[name], expected_best[name], err_msg=name)
        logged = read_run(db_url, run_id)
        assert logged["run"]["status"] == "finished"
        assert [r["round"] for r in logged["rounds"]] == list(range(1, ROUNDS + 1))
        assert sorted((r["round"], r["datacenter"]) for r in logged["dc_rounds"]) == sorted(
            (r, dc) for r in range(1, ROUNDS + 1) for dc in ("us-east", "eu-west"))
        assert len(logged["run"]["flower_run_ids"].split(",")) == 2
        resumes = [e for e in logged["events"] if e["kind"] == "resumed"]
        assert len(resumes) == 1 and resumes[0]["round"] == 2 and resumes[0]["detail"]["attempt"] == 2
        assert sum(e["kind"] == "checkpoint" for e in logged["events"]) >= 4  # rounds 2, 4 (first attempt), 4, 6

        # a finished run is not resumed again
        again = subprocess.run([CROSSDC, "resume", run_id, "--db", db_url, "--runs-dir", str(runs)],
                               capture_output=True, text=True, timeout=60, env=env)
        assert again.returncode == 2 and "nothing to resume" in again.stderr
    finally:
        kill_processes_with_env(MARKER, str(tmp_path))
