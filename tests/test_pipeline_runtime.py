"""The pipeline stages' runtime on torch.distributed.pipelining over gloo, one process per stage on this machine:
the split model trains to the unsplit model's weights, each stage runs its micro-batches in the schedule's order,
compressed boundaries stay close to the uncompressed ones, a restarted stage goes on bit for bit from its saved
state, and a dead stage fails the others' step within the stage timeout with an error naming the stage."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import tomllib
from typing import Any

import numpy as np
import pytest
import torch

from crossdc.clients.local_training import BatchStream
from crossdc.clients.pipeline_stage import StageFailed, StageRunner, StageSettings
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.processes import free_port
from crossdc.strategies.pipeline import schedule_order, stage_blocks
from crossdc.workloads import make_optimizer
from crossdc.workloads.stages import model_blocks

BATCH, MICROBATCHES, DATA_SEED = 16, 4, 7

CONFIGS = {
    "mlp": """
[run]
name = "p"
rounds = 1
[workload]
dataset = "synthetic"
model = "mlp"
model_args = { hidden = 32, layers = 3 }
batch_size = 16
optimizer = "adamw"
lr = 0.01
[strategy]
name = "fedavg"
tau = 1
[[datacenters]]
name = "a"
""",
    "char-transformer": """
[run]
name = "p"
rounds = 1
[workload]
dataset = "shakespeare"
model = "char-transformer"
model_args = { layers = 4, d_model = 16, heads = 2, seq_len = 16 }
batch_size = 16
optimizer = "sgd"
lr = 0.1
[strategy]
name = "fedavg"
tau = 1
[[datacenters]]
name = "a"
""",
}


def _setup(model_name: str) -> tuple[Any, torch.nn.Module, str, float]:
    """The workload, the initial model, the optimizer and the learning rate of `model_name`'s config. (The
    transformer's key biases get no gradient but float noise, which AdamW would blow up to whole steps: it trains
    with SGD here, where equal gradients mean equal weights.)"""
    config = parse_config(tomllib.loads(CONFIGS[model_name]))
    workload = build_workload(config)
    return workload, initial_model(config, workload), config.workload.optimizer, config.workload.lr


def _stage(index: int, stages: int, master: str, schedule: str, steps: int, codec: str, model_name: str,
           results: Any, die_after: int | None = None, also: str | None = None) -> None:
    """One stage's process: `steps` steps (in two calls, its state saved and loaded into a fresh stage before the last),
    then its weights, order, losses and bytes to `results`; with `die_after`, it exits hard after that many steps;
    with `also`, a further stage of schedule `also` takes one step and reports its order too."""
    torch.set_num_threads(1)
    workload, model, optimizer, lr = _setup(model_name)
    blocks = stage_blocks(model_blocks(model), stages)
    settings = StageSettings(index=index, stages=stages, microbatches=MICROBATCHES, schedule=schedule, master=master,
                             timeout_s=8.0, activation_codec=codec)
    runner = StageRunner(workload, model, blocks, settings, batch_size=BATCH, optimizer=optimizer,
                         lr=lr, data_seed=DATA_SEED, codec_seed=1)
    try:
        if die_after is not None:
            runner.train_steps(die_after)
            os._exit(3)
        first = runner.train_steps(steps - 1)
        state = runner.state_dict()
        runner.close()  # a restarted stage: a fresh runner on the saved state joins a fresh group
        _, model, _, _ = _setup(model_name)
        again = StageRunner(workload, model, blocks, dataclasses.replace(settings, generation=1), batch_size=BATCH,
                            optimizer=optimizer, lr=lr, data_seed=DATA_SEED, codec_seed=1)
        again.load_state_dict(state)
        second = again.train_steps(1)
        entry = {"index": index, "weights": again.weights(), "order": {schedule: first.order}, "loss": second.loss,
                 "bytes": (first.bytes_forward + second.bytes_forward, first.bytes_backward + second.bytes_backward),
                 "bubble": first.bubble_fraction, "spans": len(first.spans) + len(second.spans)}
        again.close()
        if also is not None:
            other = StageRunner(workload, _setup(model_name)[1], blocks,
                                dataclasses.replace(settings, schedule=also, generation=2),
                                batch_size=BATCH, optimizer=optimizer, lr=lr, data_seed=DATA_SEED, codec_seed=1)
            entry["order"][also] = other.train_steps(1).order
            other.close()
        results.put(entry)
    except StageFailed as err:
        results.put({"index": index, "error": str(err)})


def run_stages(stages: int, schedule: str = "1f1b", steps: int = 3, codec: str = "none", model_name: str = "mlp",
               die: int | None = None, also: str | None = None) -> dict[int, dict[str, Any]]:
    """Every stage in its own process; their results by stage (`die`: that stage exits after its first step; `also`:
    see :func:`_stage`)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    master = f"127.0.0.1:{free_port()}"
    processes = [context.Process(target=_stage, args=(i, stages, master, schedule, steps, codec, model_name, results,
                                                      1 if i == die else None, also)) for i in range(stages)]
    for process in processes:
        process.start()
    found: dict[int, dict[str, Any]] = {}
    try:
        while len(found) < stages - (die is not None):
            entry = results.get(timeout=120)
            found[entry["index"]] = entry
    except queue.Empty:
        pytest.fail(f"stages {sorted(set(range(stages)) - set(found))} did not report")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return found


def reference_weights(steps: int, model_name: str = "mlp") -> tuple[dict[str, np.ndarray], float]:
    """The unsplit model after `steps` optimizer steps on the stages' batches, and its last step's loss."""
    workload, model, name, lr = _setup(model_name)
    optimizer = make_optimizer(name, model.parameters(), lr)
    stream = BatchStream(workload.all_training(), BATCH, DATA_SEED)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        inputs, targets = stream.next()
        optimizer.zero_grad()
        loss = workload.loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
    return {n: t.detach().numpy() for n, t in model.state_dict().items()}, float(loss.detach())


def expected_bytes(stages: int, steps: int, features: int) -> int:
    """fp32 bytes one boundary carries each way in `steps` steps: every micro-batch's (batch/M, features) activation."""
    return steps * BATCH * features * 4


def assert_orders(found: dict[int, dict[str, Any]], stages: int) -> None:
    """Every stage ran each schedule it reports in that schedule's order (crossdc.strategies.pipeline)."""
    for index, entry in found.items():
        for schedule, order in entry["order"].items():
            assert [tuple(step) for step in order] == schedule_order(schedule, index, stages, MICROBATCHES), schedule


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model_name", "stages", "schedule", "also"), [("mlp", 4, "1f1b", None),
                                                                        ("char-transformer", 2, "gpipe", "1f1b")])
def test_the_split_model_trains_to_the_unsplit_models_weights_in_the_schedules_order(
        model_name: str, stages: int, schedule: str, also: str | None) -> None:
    found = run_stages(stages, schedule, steps=3, model_name=model_name, also=also)
    weights = {name: value for entry in found.values() for name, value in entry["weights"].items()}
    expected, loss = reference_weights(3, model_name)
    assert set(weights) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(weights[name], value, rtol=1e-4, atol=2e-6, err_msg=name)
    assert found[stages - 1]["loss"] == pytest.approx(loss, rel=1e-5)
    assert all(found[i]["loss"] is None for i in range(stages - 1))  # only the last stage sees the targets
    assert_orders(found, stages)
    for entry in found.values():
        assert entry["spans"] == 2 * 3 * MICROBATCHES  # a forward and a backward per micro-batch and step
        assert 0.0 <= entry["bubble"] < 1.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("codec", "stages", "schedule", "also"), [("int8", 3, "gpipe", "1f1b"),
                                                                   ("subspace", 2, "1f1b", None)])
def test_compressed_boundaries_send_fewer_bytes_and_train_close_to_uncompressed(codec: str, stages: int, schedule: str,
                                                                               also: str | None) -> None:
    found = run_stages(stages, schedule, steps=3, codec=codec, also=also)
    _, loss = reference_weights(3)  # what the uncompressed split computes (the test above: exactly the unsplit's)
    hidden = 32  # the MLP's width: what crosses every boundary
    for index in range(stages - 1):
        assert 0 < found[index]["bytes"][0] < expected_bytes(stages, 3, hidden) / 3  # activations forward
        assert 0 < found[index + 1]["bytes"][1] < expected_bytes(stages, 3, hidden) / 3  # their gradients backward
    tolerance = 0.02 if codec == "int8" else 0.2  # the subspace codec drops what lies outside its subspace
    assert found[stages - 1]["loss"] == pytest.approx(loss, rel=tolerance)
    assert_orders(found, stages)


@pytest.mark.timeout(300)
def test_a_dead_stage_fails_the_others_step_naming_the_stage() -> None:
    found = run_stages(3, die=1)  # (run_stages waits at most two minutes for the others' reports, not gloo's 30)
    for index in (0, 2):
        assert "error" in found[index], found[index]
        assert f"stage {index} of 3: step 2 failed" in found[index]["error"]
