"""Checkpoints and `crossdc resume`: the coordinator is SIGKILLed mid-run, its newest checkpoint is damaged, and the
resumed run still ends with exactly the model of an uninterrupted run, each round logged once."""

from __future__ import annotations

import json
import os
import subprocess
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import CROSSDC, read_run, rounds_logged, run_and_kill_when

from crossdc.clients.state_store import DatacenterStateStore, StateStoreError
from crossdc.experiment.processes import free_port, kill_processes_with_env

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

        # the same run, its coordinator SIGKILLed once round 5 is logged (checkpoints of rounds 2 and 4 exist)
        runs = tmp_path / "runs"
        run_id = run_and_kill_when(config, db_url, runs, env, lambda run: rounds_logged(db_url, run) >= 5,
                                    within_s=200, poll_s=0.2)
        time.sleep(1.0)
        kill_processes_with_env(MARKER, str(tmp_path))  # what the dead coordinator's children left (they die with it)
        logged = read_run(db_url, run_id)
        done = len(logged["rounds"])
        # the dead coordinator's ServerApp may have recorded the interruption on its way down, or not
        assert 5 <= done < ROUNDS and logged["run"]["status"] in ("running", "interrupted")
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
