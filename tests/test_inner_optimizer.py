"""The inner optimizer's options (betas, weight decay, gradient clipping, learning-rate schedule) and the outer
learning-rate schedule of DiLoCo: exact values on small cases, carried across calls and resumes, and their errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from crossdc.clients.local_training import LocalTrainer
from crossdc.experiment.builders import build_strategy
from crossdc.experiment.config import ConfigError, inner_steps_planned, parse_config
from crossdc.lr_schedule import LrSchedule, ScheduleError, lr_at
from crossdc.strategies.base import ClientUpdate, StrategyError
from crossdc.workloads import InnerOptions, WorkloadError, WorkloadSpec, load_workload, make_optimizer

# -- the pure schedule --------------------------------------------------------------------------------------------


def test_warmup_rises_linearly_from_a_nonzero_first_step() -> None:
    assert [lr_at(s, 1.0, 100, "constant", warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_and_linear_decay_reach_min_lr_at_the_horizon_and_stay() -> None:
    # warm-up 10 of 110 steps: the decay runs over steps 10..110
    assert lr_at(10, 1.0, 110, "cosine", 10, 0.1) == pytest.approx(1.0)
    assert lr_at(60, 1.0, 110, "cosine", 10, 0.1) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(35, 1.0, 110, "cosine", 10, 0.1) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(110, 1.0, 110, "cosine", 10, 0.1) == pytest.approx(0.1)
    assert lr_at(500, 1.0, 110, "cosine", 10, 0.1) == pytest.approx(0.1)
    assert lr_at(60, 2.0, 110, "linear", 10, 0.0) == pytest.approx(1.0)
    assert lr_at(85, 2.0, 110, "linear", 10, 0.4) == pytest.approx(2.0 - 1.6 * 0.75)
    assert lr_at(7, 3e-4, 10, "constant") == 3e-4


@pytest.mark.parametrize(("schedule", "horizon", "fragment"), [
    (LrSchedule(kind="step"), None, "'s.kind' must be one of constant, cosine, linear"),
    (LrSchedule(warmup_steps=-1), None, "'s.warmup_steps' must be ≥ 0"),
    (LrSchedule(kind="cosine", min_lr=2.0), None, "'s.min_lr' must be in [0, 1]"),
    (LrSchedule(warmup_steps=11), 10, "'s.warmup_steps' (11) is longer than the run (10 steps)"),
])
def test_schedule_check_names_the_fault(schedule: LrSchedule, horizon: int | None, fragment: str) -> None:
    with pytest.raises(ScheduleError) as info:
        schedule.check(1.0, horizon, "s")
    assert fragment in str(info.value)


# -- the trainer --------------------------------------------------------------------------------------------------


def _workload(optimizer: str = "adamw") -> Any:
    spec = WorkloadSpec(dataset="synthetic", model="mlp", partition={"kind": "iid"}, batch_size=16, optimizer=optimizer,
                        lr=0.05)
    return load_workload(spec, ["a"], seed=3)


def _trainer(workload: Any, options: InnerOptions, optimizer: str = "adamw", lr: float = 0.05,
             horizon: int | None = 40) -> LocalTrainer:
    return LocalTrainer(workload, workload.shard("a"), 16, optimizer, lr, seed=5, options=options, horizon_steps=horizon)


def test_defaults_are_unchanged_for_existing_configs() -> None:
    config = parse_config({"run": {"rounds": 2}, "workload": {"dataset": "synthetic", "model": "linear"},
                           "strategy": {"name": "fedavg"}, "datacenters": [{"name": "a"}]})
    assert config.workload.options == InnerOptions()
    group = make_optimizer("adamw", [torch.zeros(2, requires_grad=True)], 1e-3).param_groups[0]
    assert group["betas"] == (0.9, 0.999) and group["weight_decay"] == 0.01
    assert make_optimizer("momentum", [torch.zeros(2, requires_grad=True)], 1e-3).param_groups[0]["weight_decay"] == 0.0


def test_betas_and_weight_decay_reach_the_optimizer() -> None:
    trainer = _trainer(_workload(), InnerOptions(betas=(0.9, 0.95), weight_decay=0.1))
    group = trainer.optimizer.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1
    with pytest.raises(WorkloadError, match="betas apply to the \"adamw\" optimizer only"):
        make_optimizer("sgd", [torch.zeros(2, requires_grad=True)], 0.1, InnerOptions(betas=(0.9, 0.95)))


def test_the_schedule_counts_the_runs_steps_across_calls_and_a_resume() -> None:
    workload = _workload()
    options = InnerOptions(schedule=LrSchedule(kind="cosine", warmup_steps=4, min_lr=0.005))
    whole = _trainer(workload, options)
    whole.train_steps(12)
    first = _trainer(workload, options)
    first.train_steps(5)
    seen = [first.lr_now()]
    first.train_steps(3)
    restarted = _trainer(workload, options)  # a restarted trainer: the weights come from the server, the rest from state
    restarted.set_weights(first.get_weights())
    restarted.load_state_dict(first.state_dict())
    assert restarted.inner_steps == 8 and restarted.lr_now() == lr_at(8, 0.05, 40, "cosine", 4, 0.005)
    restarted.train_steps(4)
    assert seen == [lr_at(5, 0.05, 40, "cosine", 4, 0.005)]
    assert restarted.optimizer.param_groups[0]["lr"] == lr_at(11, 0.05, 40, "cosine", 4, 0.005)
    for name, value in whole.get_weights().items():
        np.testing.assert_array_equal(restarted.get_weights()[name], value)


def test_a_round_reports_the_mean_learning_rate_of_its_steps() -> None:
    trainer = _trainer(_workload(), InnerOptions(schedule=LrSchedule(warmup_steps=4)))
    assert trainer.mean_lr(4) == pytest.approx(0.05 * (0.25 + 0.5 + 0.75 + 1.0) / 4)
    trainer.train_steps(4)
    assert trainer.mean_lr(3) == pytest.approx(0.05)


def test_a_decaying_schedule_needs_the_runs_length() -> None:
    with pytest.raises(ValueError, match="needs the run's length"):
        _trainer(_workload(), InnerOptions(schedule=LrSchedule(kind="linear")), horizon=None)


def test_clipping_bounds_the_steps_gradient_norm() -> None:
    """Plain SGD at lr 1: the step is minus the gradient, so a clipped step's norm is the clip exactly."""
    workload = _workload("sgd")
    clip = 1e-3
    clipped = _trainer(workload, InnerOptions(grad_clip=clip), optimizer="sgd", lr=1.0)
    free = _trainer(workload, InnerOptions(), optimizer="sgd", lr=1.0)
    before = clipped.get_weights()
    for trainer in (clipped, free):
        trainer.train_steps(1)

    def moved(trainer: LocalTrainer) -> float:
        after = trainer.get_weights()
        return math.sqrt(sum(float(np.sum((after[n].astype(np.float64) - before[n]) ** 2)) for n in before))

    assert moved(free) > 10 * clip  # the clip acted
    assert moved(clipped) == pytest.approx(clip, rel=1e-4)


# -- the config ---------------------------------------------------------------------------------------------------


def _config(workload: dict[str, Any], strategy: dict[str, Any] | None = None, rounds: int = 5) -> dict[str, Any]:
    return {"run": {"rounds": rounds}, "workload": {"dataset": "synthetic", "model": "linear", **workload},
            "strategy": strategy or {"name": "fedavg", "tau": 4}, "datacenters": [{"name": "a"}, {"name": "b"}]}


def test_options_parse_and_the_horizon_is_the_runs_inner_steps() -> None:
    config = parse_config(_config({"betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 1,
                                   "schedule": {"kind": "cosine", "warmup_steps": 20, "min_lr": 1e-4}}))
    assert config.workload.options == InnerOptions(betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0,
                                                   schedule=LrSchedule("cosine", 20, 1e-4))
    assert inner_steps_planned(config) == 20  # 5 rounds of τ = 4
    warm = parse_config(_config({}, {"name": "fedavg", "tau": {"start": 1, "end": 5, "warmup_rounds": 4}}))
    assert inner_steps_planned(warm) == 1 + 2 + 3 + 4 + 5


@pytest.mark.parametrize(("workload", "fragment"), [
    ({"schedule": {"kind": "step"}}, "'workload.schedule.kind' must be one of constant, cosine, linear"),
    ({"schedule": {"warmup_steps": 21}}, "'workload.schedule.warmup_steps' (21) is longer than the run (20 steps)"),
    ({"schedule": {"kind": "cosine", "min_lr": 0.5}}, "'workload.schedule.min_lr' must be in [0, 0.001]"),
    ({"schedule": {"decay": 1}}, "unknown key 'workload.schedule.decay'"),
    ({"grad_clip": -1.0}, "'workload.grad_clip' must be > 0"),
    ({"grad_clip": 0}, "'workload.grad_clip' must be > 0"),
    ({"weight_decay": -0.1}, "'workload.weight_decay' must be ≥ 0"),
    ({"betas": [0.9, 1.0]}, "'workload.betas' must each be in [0, 1)"),
    ({"betas": [-0.1, 0.9]}, "'workload.betas' must each be in [0, 1)"),
    ({"betas": [0.9]}, "'workload.betas' must be two numbers"),
    ({"betas": 0.9}, "'workload.betas' must be"),
    ({"betas": [0.9, 0.95], "optimizer": "sgd"}, "applies to optimizer \"adamw\" only"),
])
def test_bad_options_are_refused_with_a_clear_error(workload: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config(workload))
    assert fragment in str(info.value) and "\n" not in str(info.value)


# -- the outer schedule -------------------------------------------------------------------------------------------


def _diloco(params: dict[str, Any], rounds: int = 4) -> Any:
    return build_strategy(parse_config(_config({}, {"name": "diloco", "tau": 2, "params": params}, rounds=rounds)))


def test_diloco_outer_warmup_scales_its_first_steps() -> None:
    strategy = _diloco({"outer_lr": 1.0, "outer_momentum": 0.0, "outer_warmup_rounds": 2, "outer_schedule": "linear",
                        "outer_min_lr": 0.5})
    weights = {"w": np.zeros(3, np.float32)}
    mean = {"w": np.ones(3, np.float32)}  # the datacenters moved +1: x ← x + lr · 1
    update = [ClientUpdate(datacenter="a", delta=mean, num_examples=1)]
    moved = []
    for server_round in range(1, 5):
        new = strategy.aggregate(server_round, weights, update, mean)
        moved.append(float(new["w"][0] - weights["w"][0]))
        weights = new
    # warm-up 0.5, 1.0; then linear from 1.0 (step 2) to 0.5 at the horizon (step 4): 1.0 at step 2, 0.75 at step 3
    assert moved == pytest.approx([0.5, 1.0, 1.0, 0.75])
    assert strategy.round_metrics(4, [])["outer_lr"] == pytest.approx(0.75)


def test_diloco_outer_momentum_warmup_is_torch_sgd_with_its_momentum_set_each_step() -> None:
    strategy = _diloco({"outer_lr": 0.7, "outer_momentum": 0.9, "outer_momentum_warmup_rounds": 3})
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal(5).astype(np.float32)}
    reference = torch.nn.Parameter(torch.tensor(weights["w"]))
    outer = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    momenta = []
    for server_round in range(1, 5):
        mean = {"w": rng.standard_normal(5).astype(np.float32)}
        weights = strategy.aggregate(server_round, weights, [ClientUpdate(datacenter="a", delta=mean, num_examples=1)],
                                     mean)
        momentum = 0.9 * min(1.0, server_round / 3)  # 0.3, 0.6, 0.9, 0.9
        momenta.append(momentum)
        outer.param_groups[0]["momentum"] = momentum
        outer.zero_grad()
        reference.grad = -torch.tensor(mean["w"])
        outer.step()
        np.testing.assert_allclose(weights["w"], reference.detach().numpy(), rtol=1e-6, atol=1e-6)
    assert momenta == pytest.approx([0.3, 0.6, 0.9, 0.9])


def test_gossip_warms_its_outer_momentum_up_as_diloco_does() -> None:
    doc = _config({}, {"name": "gossip", "tau": 2, "params": {"outer_momentum": 0.6, "outer_momentum_warmup_rounds": 3}},
                  rounds=4)
    gossip = build_strategy(parse_config(doc))
    assert [gossip.momentum(r) for r in range(1, 6)] == pytest.approx([0.2, 0.4, 0.6, 0.6, 0.6])
    # a replica's step in round 2 is torch's SGD at that round's momentum
    outer, buffer = {"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([0.5, -0.5], np.float32)}
    mixed = {"w": np.array([0.0, 1.0], np.float32)}
    stepped, new_buffer = gossip.outer_step(outer, mixed, buffer, server_round=2)
    np.testing.assert_allclose(new_buffer["w"], 0.4 * buffer["w"] + (outer["w"] - mixed["w"]))
    np.testing.assert_allclose(stepped["w"], outer["w"] - 0.7 * new_buffer["w"], rtol=1e-6)
    doc["strategy"]["params"]["outer_momentum_warmup_rounds"] = 5
    with pytest.raises(StrategyError, match=r"outer_momentum_warmup_rounds \(5\) is longer than the run \(4 rounds\)"):
        build_strategy(parse_config(doc))


@pytest.mark.parametrize(("params", "fragment"), [
    ({"outer_min_lr": 0.9}, "outer_min_lr (0.9) is above outer_lr (0.7)"),
    ({"outer_warmup_rounds": 5}, "outer_warmup_rounds (5) is longer than the run (4 rounds)"),
    ({"outer_momentum_warmup_rounds": 5}, "outer_momentum_warmup_rounds (5) is longer than the run (4 rounds)"),
    ({"outer_schedule": "step"}, "outer_schedule' must be one of constant, cosine, linear"),
])
def test_bad_outer_schedules_are_refused(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises((StrategyError, ConfigError, ValueError)) as info:
        _diloco(params)
    assert fragment in str(info.value)


def test_a_pipeline_refuses_clipping_it_cannot_do() -> None:
    doc = _config({"model": "mlp", "grad_clip": 1.0}, {"name": "pipeline", "tau": 2, "params": {"microbatches": 2}})
    with pytest.raises(StrategyError, match="cannot clip gradients yet"):
        build_strategy(parse_config(doc))
