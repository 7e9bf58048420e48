"""The pipeline strategy's pure parts: how blocks are cut into stages, the schedule's bubble, the run checks, and a
model split into stage modules that compute exactly what the unsplit model computes (forward, gradients, and the
weights after a few steps, whole batch or summed micro-batches)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from crossdc.experiment.config import ExperimentConfig, parse_config
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRunOptions, RunFailed, run_local
from crossdc.strategies.base import RunInfo, StrategyError
from crossdc.strategies.pipeline import Pipeline, bubble_fraction, replica_groups, stage_blocks
from crossdc.workloads.errors import WorkloadError
from crossdc.workloads.models import MLP, CharTransformer, Conv1dNet
from crossdc.workloads.stages import model_blocks, split_model


def test_blocks_are_cut_as_evenly_as_possible_or_as_the_layers_list_says() -> None:
    assert stage_blocks(4, 2) == [2, 2]
    assert stage_blocks(5, 2) == [3, 2]
    assert stage_blocks(7, 3) == [3, 2, 2]
    assert stage_blocks(4, 4) == [1, 1, 1, 1]
    assert stage_blocks(5, 2, [1, 4]) == [1, 4]


@pytest.mark.parametrize(("blocks", "stages", "layers", "message"), [
    (2, 3, None, "3 stages for a model of 2 blocks"),
    (4, 2, [1, 2, 1], "'layers' gives 3 stages' blocks for 2 datacenters"),
    (4, 2, [0, 4], "every stage needs at least one block"),
    (4, 2, [1, 2], "'layers' = [1, 2] adds up to 3; the model has 4 blocks"),
])
def test_a_cut_that_cannot_be_made_is_a_clear_error(blocks: int, stages: int, layers: list[int] | None,
                                                    message: str) -> None:
    with pytest.raises(StrategyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        stage_blocks(blocks, stages, layers)


def test_the_bubble_is_the_schedules_fill_and_drain() -> None:
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    with pytest.raises(ValueError):
        bubble_fraction(2, 0)


def run_info(batch_size: int) -> RunInfo:
    return RunInfo(datacenters=("a", "b"), optimizer="adamw", lr=1e-3, batch_size=batch_size)


def test_the_strategy_refuses_microbatches_that_do_not_divide_the_batch_and_a_malformed_layers_list() -> None:
    Pipeline(tau=4, params={"microbatches": 4}, run=run_info(32))
    with pytest.raises(StrategyError, match="microbatches = 3 does not divide the batch size 32"):
        Pipeline(tau=4, params={"microbatches": 3}, run=run_info(32))
    with pytest.raises(StrategyError, match="layers = '2,x' is not a comma-separated list"):
        Pipeline(tau=4, params={"layers": "2,x"}, run=run_info(32))
    assert Pipeline(tau=4, params={"layers": "1, 3"}, run=run_info(32)).layers() == [1, 3]
    with pytest.raises(StrategyError, match="schedule"):
        Pipeline(tau=4, params={"schedule": "zigzag"}, run=run_info(32))


def models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    """Two models of 4 blocks each, with a batch of 8 inputs and targets."""
    torch.manual_seed(0)
    mlp = MLP(in_features=12, classes=5, hidden=16, layers=3)
    transformer = CharTransformer(vocab_size=20, seq_len=10, d_model=16, heads=2, layers=4)
    return {"mlp": (mlp, torch.randn(8, 12), torch.randint(0, 5, (8,))),
            "char-transformer": (transformer, torch.randint(0, 20, (8, 10)), torch.randint(0, 20, (8, 10)))}


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def through(stages: list[nn.Module], inputs: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        inputs = stage(inputs)
    return inputs


@pytest.mark.parametrize("name", ["mlp", "char-transformer"])
@pytest.mark.parametrize("cut", [[2, 2], [1, 1, 1, 1], [3, 1]])
def test_a_split_model_computes_exactly_what_the_whole_model_does(name: str, cut: list[int]) -> None:
    model, inputs, targets = models()[name]
    assert model_blocks(model) == 4
    stages = split_model(model, cut)
    owned = [{id(p) for p in stage.parameters()} for stage in stages]
    assert sum(len(o) for o in owned) == len(list(model.parameters()))  # every parameter on exactly one stage
    assert set().union(*owned) == {id(p) for p in model.parameters()}
    whole = model(inputs)
    assert torch.equal(through(stages, inputs), whole)
    loss_of(whole, targets).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    loss_of(through(stages, inputs), targets).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n


@pytest.mark.parametrize("name", ["mlp", "char-transformer"])
def test_summed_micro_batches_train_the_split_model_to_the_whole_models_weights(name: str) -> None:
    model, inputs, targets = models()[name]
    reference = copy.deepcopy(model)
    stages = split_model(model, [1, 1, 1, 1])
    optimizers = [torch.optim.SGD(stage.parameters(), lr=0.1) for stage in stages]
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        reference_optimizer.zero_grad()
        loss_of(reference(inputs), targets).backward()
        reference_optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        for micro_inputs, micro_targets in zip(inputs.chunk(4), targets.chunk(4), strict=True):  # 4 micro-batches
            (loss_of(through(stages, micro_inputs), micro_targets) / 4).backward()
        for optimizer in optimizers:
            optimizer.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_a_model_that_cannot_be_cut_or_a_cut_that_does_not_fit_is_a_clear_error() -> None:
    with pytest.raises(WorkloadError, match="Conv1dNet cannot be cut into pipeline stages"):
        model_blocks(Conv1dNet(length=16, classes=3, channels=4))
    model, _, _ = models()["mlp"]
    with pytest.raises(WorkloadError, match=r"stages of \[2, 3\] blocks do not cut a model of 4 blocks"):
        split_model(model, [2, 3])


def pipeline_config(*, workers: int = 1) -> ExperimentConfig:
    return parse_config({
        "run": {"name": "pipeline", "rounds": 1},
        "workload": {"dataset": "synthetic", "model": "mlp", "batch_size": 16},
        "strategy": {"name": "pipeline", "tau": 2, "params": {"microbatches": 4}},
        "datacenters": [{"name": "a", "workers": workers}, {"name": "b"}],
    })


@pytest.mark.parametrize(("options", "workers", "message"), [
    ({"engine": "simulation"}, 1, r"strategy 'pipeline' \(pipeline\) runs on a local deployment only"),
    ({"superlink": "127.0.0.1:9093"}, 1, r"strategy 'pipeline' \(pipeline\) runs on a local deployment only"),
    ({}, 2, "a pipeline stage runs on one worker: a have more"),
])
def test_crossdc_run_refuses_what_a_pipeline_cannot_run_yet(tmp_path: pytest.TempPathFactory, options: dict,
                                                            workers: int, message: str) -> None:
    with pytest.raises(RunFailed, match=message):
        run_local(pipeline_config(workers=workers),
                  LocalRunOptions(db_url=f"sqlite:///{tmp_path}/runs.db", superlink_port=free_port(),
                                  runs_root=tmp_path, **options))


def test_1f1b_needs_as_many_micro_batches_as_stages() -> None:
    info = RunInfo(datacenters=("a", "b", "c"), optimizer="adamw", lr=1e-3, batch_size=16)
    Pipeline(tau=1, params={"microbatches": 2, "schedule": "gpipe"}, run=info)
    with pytest.raises(StrategyError, match="schedule '1f1b' needs at least as many micro-batches as stages"):
        Pipeline(tau=1, params={"microbatches": 2, "schedule": "1f1b"}, run=info)


def test_replicas_cut_the_datacenters_replica_major_into_pipelines_of_equal_length() -> None:
    names = ["a", "b", "c", "d", "e", "f"]
    assert replica_groups(names, 1) == [names]
    assert replica_groups(names, 2) == [["a", "b", "c"], ["d", "e", "f"]]
    assert replica_groups(names, 3) == [["a", "b"], ["c", "d"], ["e", "f"]]
    with pytest.raises(StrategyError, match="6 datacenters cannot form 4 pipelines of equal length"):
        replica_groups(names, 4)
    info = RunInfo(datacenters=tuple(names[:4]), optimizer="adamw", lr=1e-3, batch_size=16)
    with pytest.raises(StrategyError, match="4 datacenters cannot form 3 pipelines"):
        Pipeline(tau=1, params={"replicas": 3}, run=info)
    # 1F1B's micro-batches are checked against a replica's stages (2), not all the datacenters (4)
    Pipeline(tau=1, params={"replicas": 2, "microbatches": 2, "schedule": "1f1b"}, run=info)
    with pytest.raises(StrategyError, match="replicas"):
        Pipeline(tau=1, params={"replicas": 0}, run=info)


def replicas_strategy(**params: float) -> Pipeline:
    info = RunInfo(datacenters=("a", "b", "c", "d"), optimizer="adamw", lr=1e-3, batch_size=16, rounds=10)
    return Pipeline(tau=1, params={"replicas": 2, **params}, run=info)


def test_the_replicas_step_is_diloco_s_outer_step_on_the_mean_of_their_models() -> None:
    x = {"w": np.array([1.0, 2.0], np.float32)}
    replicas = [{"w": np.array([0.0, 2.0], np.float32)}, {"w": np.array([1.0, 4.0], np.float32)}]
    # lr 1, no momentum: the plain average
    np.testing.assert_allclose(replicas_strategy(outer_lr=1.0, outer_momentum=0.0).replica_step(x, replicas)["w"],
                               [0.5, 3.0])
    # lr 0.5, Nesterov 0.9: g = x − mean = (0.5, −1); step 1 x − 0.5·(g + 0.9·g), step 2 b = 0.9·g + g'
    strategy = replicas_strategy(outer_lr=0.5, outer_momentum=0.9)
    first = strategy.replica_step(x, replicas)
    np.testing.assert_allclose(first["w"], [1.0 - 0.5 * 1.9 * 0.5, 2.0 + 0.5 * 1.9 * 1.0], rtol=1e-6)
    resumed = replicas_strategy(outer_lr=0.5, outer_momentum=0.9)
    resumed.load_state_dict(strategy.state_dict())  # a checkpoint carries the outer momentum
    g2 = first["w"] - np.array([0.5, 3.0])
    buffer = 0.9 * np.array([0.5, -1.0]) + g2
    expected = first["w"] - 0.5 * (g2 + 0.9 * buffer)
    for stepping in (strategy, resumed):
        np.testing.assert_allclose(stepping.replica_step(first, replicas)["w"], expected, rtol=1e-5)
    assert resumed.round_metrics(2, [])["outer_steps"] == 2
    with pytest.raises(StrategyError, match="replicas > 1"):
        Pipeline(tau=1, params={}, run=run_info(16)).replica_step(x, replicas)


def test_a_replica_stage_s_weights_that_are_not_its_blocks_or_not_finite_stop_the_sync_naming_it() -> None:
    from crossdc.federation.grid_io import FederationError
    from crossdc.federation.pipeline_loop import assemble_replicas

    replicas, names = [["a", "b"], ["c", "d"]], [["w0"], ["w1"]]
    reference = {"w0": np.zeros(2, np.float32), "w1": np.zeros((1, 2), np.float32)}
    good = {dc: {key: np.ones_like(reference[key])} for dcs in replicas for dc, key in zip(dcs, ["w0", "w1"], strict=True)}
    models = assemble_replicas(3, replicas, good, names, reference)
    assert [sorted(m) for m in models] == [["w0", "w1"], ["w0", "w1"]]
    for spoiled, message in [({"d": {"w0": np.ones(2, np.float32)}}, r"stage 1 \(d\) sent \['w0'\], not its blocks"),
                             ({"c": {"w0": np.ones(3, np.float32)}}, r"stage 0 \(c\) sent w0 of shape \(3,\)"),
                             ({"b": {"w1": np.array([[1.0, np.nan]], np.float32)}}, r"stage 1 \(b\) sent w1 with non-finite"),
                             ({"a": None}, r"stage 0 \(a\) sent no weights")]:
        weights = {**good, **spoiled}
        weights = {k: v for k, v in weights.items() if v is not None}
        with pytest.raises(FederationError, match=r"round 3: " + message):
            assemble_replicas(3, replicas, weights, names, reference)
