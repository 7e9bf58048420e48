"""Streaming DiLoCo survives its coordinator: SIGKILLed with a fragment in flight, resumed from its checkpoint, it ends
with the weights of the uninterrupted in-process run (a file of its own, so the suite runs it beside the
synchronous resume test)."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import CROSSDC, read_run, run_and_kill_when, streaming_toml

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_fragment_exchanges
from crossdc.experiment.config import parse_config
from crossdc.experiment.processes import free_port, kill_processes_with_env
from crossdc.testing.inprocess import InProcessFederation

MARKER = "CROSSDC_TEST_STREAMING_RESUME"


def _streaming_config(speed: float, checkpoints: Path | None = None) -> str:
    # int4 outer gradients up with error feedback, int8 mean updates down with error feedback: both codecs' states
    # are in flight at the kill
    extra = '\n[compression]\ncodecs = ["int4:ef=true"]\ndownlink_codecs = ["int8:ef=true"]\n'
    if checkpoints is not None:
        extra += f'\n[checkpoint]\nevery_rounds = 2\nkeep = 3\ndir = "{checkpoints}"\n'
    return streaming_toml(name="streaming-resume", rounds=4, tau=40, speed=speed, extra=extra,
                          params="{ fragments = 2, overlap = 1, alpha = 0.5, eager = true }")


def _exchanges_logged(db_url: str, run_id: str) -> list[dict]:
    engine = make_engine(db_url)
    try:
        return list_fragment_exchanges(engine, run_id)
    except Exception:
        return []
    finally:
        engine.dispose()


@pytest.mark.deployment
@pytest.mark.timeout(600)
def test_streaming_run_killed_with_a_fragment_in_flight_resumes_to_the_same_model(tmp_path: Path) -> None:
    """Eager Streaming DiLoCo with 4-bit outer gradients and error feedback (every kind of state a datacenter keeps:
    the inner AdamW, the data position, its own outer momentum, the updates in flight, the codec residuals):
    `crossdc run`'s process group is SIGKILLed after round 3's first exchange, while its result is on the way and
    the second fragment's update is being computed, and everything the run started dies with it; `crossdc resume`
    continues from the checkpoint of round 2 and ends with the weights of the in-process driver, each exchange logged
    once."""
    config = tmp_path / "streaming.toml"
    # a step at 2% of its speed: an exchange every ~1 s, so the kill lands inside round 3
    config.write_text(_streaming_config(0.02, tmp_path / "checkpoints"))
    db_url = f"sqlite:///{tmp_path / 'runs.db'}"
    env = {**os.environ, MARKER: str(tmp_path)}
    runs = tmp_path / "runs"
    try:
        run_id = run_and_kill_when(
            config, db_url, runs, env, lambda run: any(e["round"] == 3 for e in _exchanges_logged(db_url, run)),
            within_s=300, poll_s=0.1, marker=MARKER)
        logged = read_run(db_url, run_id)
        assert len(logged["rounds"]) == 2, "the kill was to land inside round 3"
        assert logged["run"]["status"] == "running"  # nothing of the killed run recorded an end of its own
        assert {(e["round"], e["fragment"]) for e in _exchanges_logged(db_url, run_id)} >= {(3, 0)}
        assert [p.name for p in sorted((tmp_path / "checkpoints" / run_id).glob("round-*.ckpt"))] == ["round-000002.ckpt"]

        resumed = subprocess.run([CROSSDC, "resume", run_id, "--db", db_url, "--json", "--port", str(free_port()),
                                  "--runs-dir", str(runs)], capture_output=True, text=True, timeout=300, env=env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert json.loads(resumed.stdout.strip().splitlines()[-1])["rounds"] == 4

        reference = parse_config(tomllib.loads(_streaming_config(1.0)))  # the pace changes no result
        fed = InProcessFederation.from_config(reference, tmp_path / "in-process")
        for _ in range(reference.run.rounds):
            fed.run_round()
        got = np.load(runs / run_id / "final-weights.npz")
        assert sorted(got.files) == sorted(fed.weights)
        for name, value in fed.weights.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        logged = read_run(db_url, run_id)
        assert logged["run"]["status"] == "finished"
        assert [r["round"] for r in logged["rounds"]] == [1, 2, 3, 4]
        assert sorted((e["exchange"], e["datacenter"]) for e in _exchanges_logged(db_url, run_id)) == sorted(
            (k, dc) for k in range(1, 9) for dc in ("us-east", "eu-west"))
        resumes = [e for e in logged["events"] if e["kind"] == "resumed"]
        assert len(resumes) == 1 and resumes[0]["round"] == 2 and resumes[0]["detail"]["attempt"] == 2
    finally:
        kill_processes_with_env(MARKER, str(tmp_path))
