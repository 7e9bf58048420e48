"""Checkpoints and `crossdc resume` for an asynchronous run: FedBuff with error-feedback top-k (codec residuals at the
datacenters), one slow datacenter, checkpoints every 2 versions; `crossdc run`'s whole process group is SIGKILLed after
version 5 (whose updates came after the last checkpoint; every process of the run dies with it) and resumed. The
resumed run rolls back what came after its checkpoint and applies every later update exactly once: each version logged
once, K updates applied per version, the update sequence numbers without gaps or repeats, each datacenter's task numbers
strictly increasing within each attempt."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import CROSSDC, read_run, rounds_logged, run_and_kill_when

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_async_updates
from crossdc.experiment.processes import free_port, kill_processes_with_env

REPO = Path(__file__).resolve().parents[1]
MARKER = "CROSSDC_TEST_ASYNC_RESUME"
VERSIONS = 8
K = 2


def _config(tmp: Path) -> Path:
    text = f"""
[run]
name = "async-resume"
rounds = {VERSIONS}
seed = 0
eval_every = 2

[workload]
dataset = "synthetic"
model = "linear"
partition = {{ kind = "dirichlet", alpha = 0.5 }}
batch_size = 32
optimizer = "adamw"
lr = 0.005

[strategy]
name = "fedbuff"
tau = 20
params = {{ buffer_size = {K}, max_staleness = 6 }}

[compression]
codecs = ["topk:0.3:ef=true"]

[[datacenters]]
name = "us-east"

[[datacenters]]
name = "eu-west"
speed = 0.5

[checkpoint]
every_rounds = 2
keep = 2
dir = "{tmp / 'checkpoints'}"
"""
    path = tmp / "async-resume.toml"
    path.write_text(text)
    return path


@pytest.mark.deployment
@pytest.mark.timeout(600)
def test_killed_asynchronous_coordinator_resumes_and_applies_every_update_once(tmp_path: Path) -> None:
    config = _config(tmp_path)
    db_url = f"sqlite:///{tmp_path / 'async.db'}"
    env = {**os.environ, MARKER: str(tmp_path)}
    runs = tmp_path / "runs"
    try:
        run_id = run_and_kill_when(config, db_url, runs, env, lambda run: rounds_logged(db_url, run) >= 5,
                                   within_s=300, poll_s=0.2, marker=MARKER)
        before = read_run(db_url, run_id)
        # nothing of the killed run recorded an end (an orphaned ServerApp once wrote "interrupted: KeyboardInterrupt")
        assert 5 <= len(before["rounds"]) < VERSIONS and before["run"]["status"] == "running"
        checkpoint = max(int(p.stem.split("-")[1]) for p in (tmp_path / "checkpoints" / run_id).glob("round-*.ckpt"))
        assert checkpoint in (4, 6) and checkpoint < len(before["rounds"])  # something after it is rolled back

        resumed = subprocess.run([CROSSDC, "resume", run_id, "--db", db_url, "--json", "--port", str(free_port()),
                                  "--runs-dir", str(runs)], capture_output=True, text=True, timeout=400, env=env)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        summary = json.loads(resumed.stdout.strip().splitlines()[-1])
        assert summary["run_id"] == run_id and summary["versions"] == VERSIONS
        assert (runs / run_id / "final-weights.npz").exists()
        assert all(np.isfinite(v).all() for v in np.load(runs / run_id / "final-weights.npz").values())

        logged = read_run(db_url, run_id)
        assert logged["run"]["status"] == "finished"
        assert [r["round"] for r in logged["rounds"]] == list(range(1, VERSIONS + 1))
        rows = Counter((r["round"], r["datacenter"]) for r in logged["dc_rounds"])
        assert max(rows.values()) == 1, rows  # one row per version and datacenter
        resumes = [e for e in logged["events"] if e["kind"] == "resumed"]
        assert len(resumes) == 1 and resumes[0]["round"] == checkpoint and resumes[0]["detail"]["attempt"] == 2

        engine = make_engine(db_url)
        try:
            updates = list_async_updates(engine, run_id)
        finally:
            engine.dispose()
        seqs = [u["seq"] for u in updates]
        assert seqs == list(range(1, len(seqs) + 1)), seqs  # unique, in order, no gap
        applied = [u for u in updates if u["status"] == "applied"]
        # every version is made by exactly K applied updates, none applied twice, none lost
        assert Counter(u["applied_version"] for u in applied) == {v: K for v in range(VERSIONS)}
        assert all(u["staleness"] == u["applied_version"] - u["base_version"] for u in updates)
    finally:
        kill_processes_with_env(MARKER, str(tmp_path))
