"""Pipeline replicas synced by DiLoCo, deployed: four datacenters as two pipelines of two stages on Flower's
Deployment Engine, each stage in its datacenter's namespace, each pipeline's activations crossing an emulated link of
its own. After every round the coordinator takes DiLoCo's outer step on the replicas' models. One run, shared by the
tests here: the second pipeline's last stage is killed once round 1 is logged, which fails the run naming it, and
`crossdc resume` takes it to its end; the final weights are checked against a plain torch loop (two unsplit models,
AdamW inside, torch.optim.SGD with Nesterov momentum outside) on the same batches, so the resume is exact too."""

from __future__ import annotations

import json
import tomllib
from typing import Any

import numpy as np
import pytest
import torch
from conftest import kill_stage_then_resume, read_run

from crossdc.clients.local_training import BatchStream
from crossdc.db.engine import make_engine
from crossdc.db.queries import list_pipeline_stages
from crossdc.experiment.builders import build_workload, datacenter_seed, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.rundir import RunDir
from crossdc.workloads import make_optimizer

pytestmark = [pytest.mark.deployment, pytest.mark.usefixtures("namespaces")]

ROUNDS, TAU, MICROBATCHES, BATCH, HIDDEN = 2, 3, 2, 16, 32
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
REPLICAS = [["us-east", "eu-west"], ["ap-south", "sa-east"]]

CONFIG = f"""
[run]
name = "pipeline-replicas-e2e"
rounds = {ROUNDS}
seed = 0
eval_every = 1
round_timeout_s = 120

[checkpoint]
every_rounds = 1

[workload]
dataset = "synthetic"
model = "mlp"
model_args = {{ hidden = {HIDDEN}, layers = 3 }}
batch_size = {BATCH}
optimizer = "adamw"
lr = 0.01

[strategy]
name = "pipeline"
tau = {TAU}

[strategy.params]
microbatches = {MICROBATCHES}
schedule = "gpipe"
replicas = 2
outer_lr = {OUTER_LR}
outer_momentum = {OUTER_MOMENTUM}
stage_timeout_s = 15
""" + "".join(f'\n[[datacenters]]\nname = "{name}"\n' for replica in REPLICAS for name in replica) + "".join(
    f'\n[[links]]\nbetween = ["{a}", "{b}"]\nbandwidth_mbps = 100\nrtt_ms = 40\n' for a, b in REPLICAS)


VICTIM = REPLICAS[1][1]


@pytest.fixture(scope="module")
def replicas_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("pipeline-replicas")
    db_url = f"sqlite:///{root / 'runs.db'}"
    doc = tomllib.loads(CONFIG)
    doc["checkpoint"]["dir"] = str(root / "checkpoints")
    config = parse_config(doc)
    # the second pipeline's last stage is killed once round 1 is logged: round 2 fails, and the resumed run takes the
    # outer momentum across the checkpoint
    run = kill_stage_then_resume(config, root, db_url, VICTIM, after_round=1)
    resumed = run["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    engine = make_engine(db_url)
    try:
        stages = list_pipeline_stages(engine, run["run_id"])
    finally:
        engine.dispose()
    return {"config": config, "summary": summary, "stages": stages, "run_dir": RunDir(root / run["run_id"]),
            "db_url": db_url, "failure": run["failure"], "failed": run["failed"], **read_run(db_url, run["run_id"])}


def reference_weights(config: Any) -> dict[str, np.ndarray]:
    """The global model after ROUNDS rounds of plain-torch DiLoCo over the two replicas: each an unsplit model on its
    first datacenter's batches, τ AdamW steps a round from the global model (its AdamW state kept across rounds), then
    torch.optim.SGD(nesterov=True) on the global model with the gradient global − mean of the replicas."""
    torch.manual_seed(0)
    workload = build_workload(config)
    global_model = initial_model(config, workload)
    outer = torch.optim.SGD(global_model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    w = config.workload
    replicas = []
    for names in REPLICAS:
        model = initial_model(config, workload)
        replicas.append((model, make_optimizer(w.optimizer, list(model.parameters()), w.lr, w.options),
                         BatchStream(workload.all_training(), BATCH, datacenter_seed(config, names[0]))))
    for _ in range(ROUNDS):
        for model, optimizer, stream in replicas:
            model.load_state_dict(global_model.state_dict())
            for _ in range(TAU):
                inputs, targets = stream.next()
                optimizer.zero_grad()
                workload.loss(model(inputs), targets).backward()
                optimizer.step()
        with torch.no_grad():
            for name, param in global_model.named_parameters():
                replica_params = [dict(model.named_parameters())[name] for model, _, _ in replicas]
                param.grad = param - torch.stack(replica_params).mean(0)
        outer.step()
    return {n: t.detach().numpy() for n, t in global_model.state_dict().items()}


@pytest.mark.timeout(420)
def test_a_killed_stage_of_one_replica_fails_the_run_naming_it(replicas_run: dict[str, Any]) -> None:
    assert replicas_run["failed"]["run"]["status"] == "failed"
    error = replicas_run["failed"]["run"]["error"]
    assert f"({VICTIM})" in error and "crossdc resume" in error, error


@pytest.mark.timeout(420)
def test_the_replicas_global_model_is_plain_torch_diloco_over_the_pipelines(replicas_run: dict[str, Any]) -> None:
    assert replicas_run["run"]["status"] == "finished"
    assert any(e["kind"] == "resumed" for e in replicas_run["events"])
    assert replicas_run["summary"]["replicas"] == REPLICAS
    final = np.load(replicas_run["run_dir"].final_weights)
    expected = reference_weights(replicas_run["config"])
    assert set(final.files) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    synced = [e for e in replicas_run["events"] if e["kind"] == "replicas-synced"]
    assert [e["round"] for e in synced] == list(range(1, ROUNDS + 1))
    assert [e["detail"]["outer_steps"] for e in synced] == list(range(1, ROUNDS + 1))
    losses = [r["val_loss"] for r in replicas_run["rounds"]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.timeout(420)
def test_each_replica_logs_its_stages_with_the_bytes_of_its_own_link_and_the_sync(replicas_run: dict[str, Any]) -> None:
    stages = replicas_run["stages"]
    assert sorted((s["round"], s["datacenter"], s["stage"]) for s in stages) == sorted(
        (r, name, stage) for r in range(1, ROUNDS + 1) for replica in REPLICAS for stage, name in enumerate(replica))
    activation = TAU * BATCH * HIDDEN * 4  # τ steps of (batch, hidden) fp32 activations, in micro-batches
    for row in stages:
        assert row["bytes_source"] == "delay-line"
        if row["stage"] == 0:
            assert activation <= row["bytes_forward"] < 1.5 * activation and row["bytes_backward"] == 0
        else:
            assert activation <= row["bytes_backward"] < 1.5 * activation and row["bytes_forward"] == 0
    final = np.load(replicas_run["run_dir"].final_weights)
    model_bytes = sum(final[n].nbytes for n in final.files)
    for round_ in range(1, ROUNDS + 1):
        rows = {r["datacenter"]: r for r in replicas_run["dc_rounds"] if r["round"] == round_}
        assert set(rows) == {name for replica in REPLICAS for name in replica}
        for replica in REPLICAS:
            # each replica's stages sent their blocks up (together the whole model) and, after round 1, got them back
            boundary = sum(row["bytes_forward"] + row["bytes_backward"] for row in stages
                           if row["round"] == round_ and row["datacenter"] in replica)
            assert sum(rows[n]["bytes_up"] for n in replica) == boundary + model_bytes
            down = sum(rows[n]["bytes_down"] for n in replica) - boundary
            assert down == (model_bytes if round_ > 1 else 0)


@pytest.mark.timeout(420)
def test_the_run_page_lists_each_replica_s_stages(replicas_run: dict[str, Any]) -> None:
    from fastapi.testclient import TestClient

    from crossdc.dashboard.app import create_app

    run_id = replicas_run["run"]["id"]
    with TestClient(create_app(replicas_run["db_url"])) as client:
        listed = client.get(f"/api/runs/{run_id}/pipeline-stages?round={ROUNDS}").json()["items"]
        page = client.get(f"/runs/{run_id}").text
    assert [(i["replica"], i["stage"], i["datacenter"]) for i in listed] == [
        (r, s, name) for r, replica in enumerate(REPLICAS) for s, name in enumerate(replica)]
    assert ">replica</th>" in page and 'data-replica="1"' in page
