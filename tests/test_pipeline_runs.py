"""A pipeline run on Flower's Deployment Engine: two stages in their datacenters' namespaces, the activations and
their gradients crossing an emulated 150 ms link between them. One run, shared by the tests here: the second stage's
trainer is killed after round 2, which fails the run with an error naming the stage; `crossdc resume` then takes it
from its newest checkpoint to its end."""

from __future__ import annotations

import json
import tomllib
from typing import Any

import numpy as np
import pytest
from conftest import kill_stage_then_resume, read_run

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_pipeline_stages, list_timeline_spans
from crossdc.experiment.config import parse_config
from crossdc.experiment.rundir import RunDir

pytestmark = [pytest.mark.deployment, pytest.mark.usefixtures("namespaces")]

ROUNDS, TAU, MICROBATCHES = 4, 3, 4
VICTIM = "eu-west"

CONFIG = f"""
[run]
name = "pipeline-e2e"
rounds = {ROUNDS}
seed = 0
eval_every = 2
round_timeout_s = 120

[workload]
dataset = "synthetic"
model = "mlp"
model_args = {{ hidden = 64, layers = 3 }}
batch_size = 32
optimizer = "adamw"
lr = 0.01

[strategy]
name = "pipeline"
tau = {TAU}
params = {{ microbatches = {MICROBATCHES}, schedule = "1f1b", stage_timeout_s = 15 }}

[checkpoint]
every_rounds = 1

[[datacenters]]
name = "us-east"

[[datacenters]]
name = "{VICTIM}"

[[links]]
between = ["us-east", "{VICTIM}"]
bandwidth_mbps = 100
rtt_ms = 150
"""


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipeline")
    db_url = f"sqlite:///{root / 'runs.db'}"
    doc = tomllib.loads(CONFIG)
    doc["checkpoint"]["dir"] = str(root / "checkpoints")
    # the second stage's trainer is killed once round 2 is logged
    run = kill_stage_then_resume(parse_config(doc), root, db_url, VICTIM, after_round=2)
    engine = make_engine(db_url)
    try:
        stages = list_pipeline_stages(engine, run["run_id"])
        spans = list_timeline_spans(engine, run["run_id"])
    finally:
        engine.dispose()
    return {**run, **read_run(db_url, run["run_id"]), "stages": stages, "spans": spans,
            "run_dir": RunDir(root / run["run_id"]), "db_url": db_url}


@pytest.mark.timeout(420)
def test_a_killed_stage_fails_the_run_with_an_error_naming_it(pipeline_run: dict[str, Any]) -> None:
    assert pipeline_run["failed"]["run"]["status"] == "failed"
    error = pipeline_run["failed"]["run"]["error"]
    assert f"stage 1 ({VICTIM})" in error and "crossdc resume" in error, error
    assert any(e["kind"] == "pipeline-stage-failed" for e in pipeline_run["failed"]["events"])


@pytest.mark.timeout(420)
def test_the_resumed_run_goes_on_from_its_checkpoint_to_the_end(pipeline_run: dict[str, Any]) -> None:
    resumed = pipeline_run["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["rounds"] == ROUNDS and np.isfinite(summary["val_loss"])
    assert pipeline_run["run"]["status"] == "finished"
    assert [r["round"] for r in pipeline_run["rounds"]] == list(range(1, ROUNDS + 1))
    assert any(e["kind"] == "resumed" for e in pipeline_run["events"])
    losses = [r["val_loss"] for r in pipeline_run["rounds"] if r["val_loss"] is not None]
    assert len(losses) == ROUNDS // 2 and losses[-1] < losses[0]  # evaluated every 2 rounds, and it learns
    final = np.load(pipeline_run["run_dir"].final_weights)
    assert {"net.0.weight", "net.6.weight"} <= set(final.files)  # both stages' layers in the assembled model


@pytest.mark.timeout(420)
def test_every_round_logs_each_stage_with_the_bytes_its_link_carried(pipeline_run: dict[str, Any]) -> None:
    stages = pipeline_run["stages"]
    assert sorted((s["round"], s["stage"]) for s in stages) == [(r, s) for r in range(1, ROUNDS + 1) for s in (0, 1)]
    activation = TAU * 32 * 64 * 4  # τ steps of (batch, hidden) fp32 activations, in micro-batches
    for row in stages:
        assert row["bytes_source"] == "delay-line"
        assert row["steps"] == TAU and row["microbatches"] == MICROBATCHES
        assert 0.0 < row["compute_s"] < row["wall_s"] and 0.0 < row["bubble_fraction"] < 1.0
        if row["stage"] == 0:  # the first stage sends activations forward, the second gradients back
            assert activation <= row["bytes_forward"] < 1.5 * activation and row["bytes_backward"] == 0
            assert row["train_loss"] is None
        else:
            assert activation <= row["bytes_backward"] < 1.5 * activation and row["bytes_forward"] == 0
            assert np.isfinite(row["train_loss"])
    ok = [r for r in pipeline_run["dc_rounds"] if r["status"] == "ok"]
    assert len(ok) == 2 * ROUNDS and all(r["idle_s"] > 0 for r in ok)


@pytest.mark.timeout(420)
def test_every_micro_batch_of_every_step_is_on_the_timeline(pipeline_run: dict[str, Any]) -> None:
    spans = [s for s in pipeline_run["spans"] if s["kind"] in ("forward", "backward")]
    for stage in ("us-east", VICTIM):
        mine = [s for s in spans if s["datacenter"] == stage]
        assert len(mine) == ROUNDS * TAU * MICROBATCHES * 2, stage
        assert {s["microbatch"] for s in mine} == set(range(MICROBATCHES))
        assert {s["step"] for s in mine} == set(range(1, ROUNDS * TAU + 1))


@pytest.mark.timeout(420)
def test_the_dashboard_shows_the_runs_stages(pipeline_run: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient

    from crossdc.dashboard.app import create_app

    run_id = pipeline_run["run"]["id"]
    with TestClient(create_app(pipeline_run["db_url"])) as client:
        listed = client.get(f"/api/runs/{run_id}/pipeline-stages")
        page = client.get(f"/runs/{run_id}")
    assert listed.status_code == 200 and page.status_code == 200
    assert [(i["round"], i["stage"]) for i in listed.json()["items"]] == [(r, s) for r in range(1, ROUNDS + 1)
                                                                          for s in (0, 1)]
    assert 'id="pipeline-stages-table"' in page.text and VICTIM in page.text
