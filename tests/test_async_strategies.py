"""Asynchronous strategies without a run: staleness functions, FedAsync/FedBuff server maths, their buffer and
bound, the row merge of the asynchronous loop, speed emulation, and the config errors. Pure and fast."""

from __future__ import annotations

import json
import math
import statistics
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import CROSSDC

from crossdc.clients import local_training
from crossdc.db.records import DatacenterRoundRecord as Record
from crossdc.experiment.builders import build_strategy, build_workload
from crossdc.experiment.config import ConfigError, parse_config
from crossdc.federation.session import merge_rows
from crossdc.strategies import staleness as st
from crossdc.strategies.asynchronous import dispatch_keeps_bound
from crossdc.strategies.base import ClientUpdate, RunInfo, StrategyError
from crossdc.strategies.fedasync import FedAsync, fedasync_step
from crossdc.strategies.fedbuff import FedBuff, fedbuff_step
from crossdc.strategies.registry import describe_strategies, strategy_class

RUN = RunInfo(datacenters=("a", "b", "c"), optimizer="adamw", lr=0.01)


def arrays(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 2), value, np.float32), "b": np.full(3, value, np.float32)}


def update(name: str, value: float, examples: int = 64) -> ClientUpdate:
    return ClientUpdate(name, arrays(value), examples)


def strategy(cls: type, **params: Any) -> Any:
    return cls(params=params, run=RUN)


# -- staleness functions ------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0, 1, 2, 3, 7, 100])
def test_staleness_functions_exact_values(s: int) -> None:
    assert st.inverse(s, 0.6) == 0.6 / (1 + s)
    assert st.constant(s, 0.6) == 0.6
    assert st.polynomial(s, 0.6, 0.5) == 0.6 * (1 + s) ** -0.5
    assert st.polynomial(s, 1.0, 2.0) == 1.0 / (1 + s) ** 2
    assert st.hinge(s, 0.6, 0) == st.inverse(s, 0.6)  # b = 0: the inverse function
    assert st.hinge(s, 0.6, 2) == (0.6 if s <= 2 else 0.6 / (1 + s - 2))


def test_staleness_functions_start_at_lr_and_never_increase() -> None:
    for kind in st.STALENESS_FUNCTIONS:
        values = [st.staleness_scale(kind, s, 0.5, exponent=0.7, hinge_after=3) for s in range(50)]
        assert values[0] == 0.5
        assert all(later <= earlier for earlier, later in zip(values, values[1:], strict=False))
    assert st.staleness_scale("inverse", 4) == 0.2
    assert st.staleness_scale("hinge", 4, 1.0, hinge_after=4) == 1.0
    assert st.staleness_scale("hinge", 5, 1.0, hinge_after=4) == 0.5


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_staleness_must_be_a_non_negative_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match="staleness must be an integer ≥ 0"):
        st.inverse(bad)


def test_unknown_staleness_function_and_bad_shape_parameters() -> None:
    with pytest.raises(ValueError, match="unknown staleness function 'linear'"):
        st.staleness_scale("linear", 1)
    with pytest.raises(ValueError, match="exponent"):
        st.polynomial(1, 1.0, 0.0)
    with pytest.raises(ValueError, match="hinge point"):
        st.hinge(1, 1.0, -1)


# -- server maths -----------------------------------------------------------------------------


def test_fedasync_step_is_x_plus_scale_delta() -> None:
    x, delta = arrays(1.0), arrays(0.5)
    new = fedasync_step(x, delta, 0.3)
    assert all(new[k].dtype == np.float32 for k in new)
    np.testing.assert_array_equal(new["w"], np.float32(1.0) + np.float32(0.3) * np.float32(0.5))


def test_fedbuff_step_is_the_example_weighted_mean_of_scaled_updates() -> None:
    x = arrays(1.0)
    new = fedbuff_step(x, [arrays(1.0), arrays(-2.0), arrays(4.0)], [1.0, 0.5, 0.25], [10, 10, 20])
    expected = 1.0 + (10 * 1.0 * 1.0 + 10 * 0.5 * -2.0 + 20 * 0.25 * 4.0) / 40
    np.testing.assert_allclose(new["b"], expected, rtol=1e-7)


def test_fedasync_applies_each_update_on_arrival_scaled_by_staleness() -> None:
    s = strategy(FedAsync, lr=0.6)
    assert s.buffer_size() == 1 and not s.ready()
    entry = s.submit(update("a", 2.0), staleness=2, seq=7, base_version=3)
    assert entry.scale == pytest.approx(0.6 / 3) and entry.seq == 7 and entry.base_version == 3
    assert s.waiting("a") and s.ready()
    x = arrays(1.0)
    new, applied = s.step(x)
    assert applied == [entry] and not s.submitted and not s.waiting("a")
    np.testing.assert_array_equal(new["w"], fedasync_step(x, arrays(2.0), entry.scale)["w"])


def test_fedbuff_buffers_k_updates_default_the_number_of_datacenters() -> None:
    s = strategy(FedBuff)
    assert s.buffer_size() == 3
    s.submit(update("c", 3.0), 0, seq=1)
    s.submit(update("a", 1.0), 1, seq=2)
    assert not s.ready()
    s.submit(update("a", -1.0, examples=32), 2, seq=3)  # a fast datacenter may fill two slots
    assert s.ready()
    x = arrays(0.0)
    new, applied = s.step(x)
    assert [e.seq for e in applied] == [2, 3, 1]  # in the run's datacenter order, then arrival
    expected = fedbuff_step(x, [e.update.delta for e in applied], [e.scale for e in applied],
                            [e.update.num_examples for e in applied])
    for name in x:
        np.testing.assert_array_equal(new[name], expected[name])
    assert [e.scale for e in applied] == [1.0 / 2, 1.0 / 3, 1.0]
    assert strategy(FedBuff, buffer_size=2).buffer_size() == 2


def test_fedbuff_at_staleness_zero_and_lr_one_is_fedavg_exactly() -> None:
    from crossdc.strategies.fedavg import FedAvgTau

    fedavg = strategy(FedAvgTau)
    s = strategy(FedBuff)
    ups = [update("a", 0.3, 64), update("b", -0.7, 32), update("c", 0.11, 64)]
    for i, u in enumerate(ups):
        s.submit(u, 0, seq=i + 1)
    x = arrays(0.25)
    new, _ = s.step(x)
    reference = fedavg.aggregate(1, x, ups, fedavg.mean_update(ups))
    for name in x:
        np.testing.assert_array_equal(new[name], reference[name])


def test_updates_beyond_max_staleness_are_not_admitted() -> None:
    s = strategy(FedAsync, max_staleness=4)
    assert s.admits(0) and s.admits(4) and not s.admits(5) and not s.admits(-1)
    with pytest.raises(StrategyError, match="exceeds max_staleness = 4"):
        s.submit(update("a", 1.0), 5)
    assert not s.submitted
    with pytest.raises(StrategyError, match="at least one submitted update"):
        s.step(arrays(0.0))


def test_dispatch_keeps_bound_assumes_every_other_task_arrives_first() -> None:
    # FedAsync (K = 1), bound 4: the oldest task in flight is from version 10, the model is at 12
    assert dispatch_keeps_bound(12, [10], 0, 1, 4)  # worst case: the new task lands first, 13 − 10 = 3
    assert dispatch_keeps_bound(12, [10, 12], 0, 1, 4)  # two land first: 14 − 10 = 4, just within
    assert not dispatch_keeps_bound(12, [10, 12, 12], 0, 1, 4)  # three: 15 − 10 = 5
    assert not dispatch_keeps_bound(14, [10], 0, 1, 4)  # already at the bound: one more step is too many
    # FedBuff (K = 4): three updates in the buffer and one new task make a step before the oldest lands
    assert not dispatch_keeps_bound(14, [10], 3, 4, 4)
    assert dispatch_keeps_bound(14, [10], 2, 4, 4)  # (2 + 1) // 4 = 0 steps: the oldest lands at staleness 4
    assert dispatch_keeps_bound(13, [10, 13], 3, 4, 4)  # (3 + 2) // 4 = 1: 14 − 10 = 4
    # nothing in flight: nothing can become stale; bound 0 then still lets one task out at a time
    assert dispatch_keeps_bound(99, [], 5, 1, 0)
    assert not dispatch_keeps_bound(3, [3], 0, 1, 0)
    with pytest.raises(ValueError, match="buffer size"):
        dispatch_keeps_bound(0, [0], 0, 0, 4)


def test_the_staleness_policy_defaults_to_discard() -> None:
    assert not strategy(FedAsync).waits_for_stragglers
    assert strategy(FedBuff, staleness_policy="wait").waits_for_stragglers


def test_asynchronous_strategies_refuse_the_synchronous_loop() -> None:
    with pytest.raises(StrategyError, match="asynchronous"):
        strategy(FedBuff).aggregate(1, arrays(0.0), [update("a", 1.0)], arrays(1.0))


# -- the loop's row merge ----------------------------------------------------------------------


def test_merge_rows_of_one_datacenter_at_one_version() -> None:
    one = Record(status="ok", bytes_up=10, compute_s=1.0, train_loss=2.0, num_examples=30, staleness=1)
    assert merge_rows([one]) == one
    merged = merge_rows([
        one,
        Record(status="rejected", reason="stale update discarded: staleness 6 > max_staleness 4", bytes_up=10,
               compute_s=2.0, train_loss=5.0, staleness=6, comm_s=None, comm_source="relay"),
        Record(status="ok", bytes_up=10, compute_s=0.5, train_loss=1.0, num_examples=10, staleness=0, update_cosine=0.5),
    ])
    assert merged.status == "ok" and merged.reason.startswith("stale update discarded")
    assert merged.bytes_up == 30 and merged.compute_s == 3.5 and merged.num_examples == 40
    assert merged.staleness == 6 and merged.update_cosine == 0.5 and merged.comm_source == "relay"
    assert merged.train_loss == pytest.approx((2.0 * 30 + 1.0 * 10) / 40)  # the discarded one kept no example count
    assert merged.comm_s is None
    assert merge_rows([Record(status="timeout", reason="x"), Record(status="failed", reason="y")]).status == "failed"


# -- speed emulation ---------------------------------------------------------------------------


@pytest.mark.serial  # asserts a pace on the wall clock: runs alone, after the parallel part of the suite
def test_a_slow_datacenter_takes_one_over_speed_times_as_long_and_counts_it_as_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = {"run": {"rounds": 1}, "workload": {"dataset": "synthetic", "model": "linear", "batch_size": 16},
           "strategy": {"name": "fedavg"}, "datacenters": [{"name": "a"}]}
    workload = build_workload(parse_config(doc))
    real_sleep = time.sleep
    slept: list[float] = []

    def recording_sleep(seconds: float) -> None:
        started = time.perf_counter()
        real_sleep(seconds)
        slept.append(time.perf_counter() - started)

    monkeypatch.setattr(local_training.time, "sleep", recording_sleep)
    normal = local_training.LocalTrainer(workload, workload.shard("a"), 16, "adamw", 0.01, seed=1)
    normal.train_steps(20)
    assert slept == [] and not normal.hot_step_s  # speed 1: no pacing at all
    slow = local_training.LocalTrainer(workload, workload.shard("a"), 16, "adamw", 0.01, seed=1, speed=0.1)
    slow.train_steps(20)  # warm-up: the pace learns a step's time
    slept.clear()
    result = slow.train_steps(200)
    step = slow.paced_step_s()
    assert 0.0 < step <= statistics.median(slow.hot_step_s)  # a low quantile: a busy host's slow steps are not multiplied
    # the sleeps are part of compute_s; how large a share they are depends on how busy the machine is (a step
    # that was descheduled counts as a long step), so only the pace itself is asserted: 1/s = 10 × each step,
    # where the same steps without pacing take 200 × step
    assert result.compute_s >= sum(slept) > 0
    assert 0.7 * 10 * 200 * step <= result.compute_s
    with pytest.raises(ValueError, match="speed"):
        local_training.LocalTrainer(workload, workload.shard("a"), 16, "adamw", 0.01, seed=1, speed=0.0)


def test_a_very_slow_datacenter_keeps_measuring_its_steps_on_warm_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """At speed 0.001 one step's pace (999 × a step) is past the sleep quantum: were the trainer to sleep after every
    step, no step would run on warm caches and the pace would keep the first steps' measure for good (a trainer that
    started on a busy machine would stay several times slower than configured). The trainer's clock is moved on by
    its sleeps instead of sleeping (each step's own time stays real), so the test takes no pace's worth of time."""
    doc = {"run": {"rounds": 1}, "workload": {"dataset": "synthetic", "model": "linear", "batch_size": 16},
           "strategy": {"name": "fedavg"}, "datacenters": [{"name": "a"}]}
    workload = build_workload(parse_config(doc))
    slept = [0.0]
    real_clock = time.perf_counter

    def sleep(seconds: float) -> None:
        slept[0] += seconds

    monkeypatch.setattr(local_training, "time", SimpleNamespace(perf_counter=lambda: real_clock() + slept[0], sleep=sleep))
    slow = local_training.LocalTrainer(workload, workload.shard("a"), 16, "adamw", 0.01, seed=1, speed=0.001)
    slow.train_steps(3 * local_training.STEPS_BETWEEN_SLEEPS)
    assert slept[0] > 0.0  # it paced
    # after each sleep the first step is cold and the next ones (until it is STEPS_BETWEEN_SLEEPS steps ahead) are
    # measured: pausing after every step would measure none
    assert len(slow.hot_step_s) >= local_training.STEPS_BETWEEN_SLEEPS, list(slow.hot_step_s)
    assert slow.paced_step_s() > 0.0


# -- config and strategy errors -----------------------------------------------------------------


def config_doc(strategy_name: str = "fedbuff", params: dict[str, Any] | None = None, **dc: Any) -> dict[str, Any]:
    return {"run": {"rounds": 2}, "workload": {"dataset": "synthetic", "model": "linear"},
            "strategy": {"name": strategy_name, "params": params or {}},
            "datacenters": [{"name": "a", **dc}, {"name": "b"}]}


def test_speed_is_parsed_and_bounded() -> None:
    assert [d.speed for d in parse_config(config_doc(speed=0.25)).datacenters] == [0.25, 1.0]
    for bad, words in ((0, "must be > 0"), (-0.5, "must be > 0"), (1.5, "must be ≤ 1"), (float("nan"), "finite"),
                       ("fast", "must be a number"), (True, "must be a number")):
        with pytest.raises(ConfigError) as err:
            parse_config(config_doc(speed=bad))
        message = str(err.value)
        assert "datacenters[0].speed" in message and words in message and "\n" not in message


@pytest.mark.parametrize(("name", "params", "words"), [
    ("fedasync", {"max_staleness": -1}, "parameter 'max_staleness' must be ≥ 0"),
    ("fedbuff", {"max_staleness": 2.5}, "parameter 'max_staleness' must be int"),
    ("fedbuff", {"max_staleness": True}, "parameter 'max_staleness' must be int"),
    ("fedasync", {"staleness": "linear"}, "parameter 'staleness' must be one of inverse, hinge, constant, polynomial"),
    ("fedasync", {"lr": -0.1}, "parameter 'lr' must be ≥ 0"),
    ("fedbuff", {"buffer_size": -2}, "parameter 'buffer_size' must be ≥ 0"),
    ("fedbuff", {"max_staleness": 0, "buffer_size": 3}, "buffer_size = 3 can never fill with 2 datacenters"),
    ("fedasync", {"buffer_size": 2}, "unknown parameter 'buffer_size' for strategy 'fedasync'"),
    ("fedbuff", {"staleness_policy": "block"}, "parameter 'staleness_policy' must be one of discard, wait"),
])
def test_bad_async_parameters_are_one_line_strategy_errors(name: str, params: dict[str, Any], words: str) -> None:
    with pytest.raises(StrategyError) as err:
        build_strategy(parse_config(config_doc(name, params)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_async_strategies_refuse_what_they_cannot_honour() -> None:
    doc = config_doc("fedasync")
    doc["security"] = {"robust_aggregation": "median"}
    with pytest.raises(StrategyError, match="nothing to combine"):
        build_strategy(parse_config(doc))
    doc = config_doc("fedbuff")
    doc["security"] = {"norm_rejection_factor": 3}
    with pytest.raises(StrategyError, match="norm_rejection_factor.*not implemented yet"):
        build_strategy(parse_config(doc))


def test_the_new_strategies_are_registered_and_listed() -> None:
    import subprocess

    assert strategy_class("fedasync") is FedAsync and strategy_class("fedbuff") is FedBuff
    rows = {r["name"]: r for r in describe_strategies()}
    assert set(rows["fedasync"]["parameters"]) == {"lr", "max_staleness", "staleness_policy", "staleness",
                                                   "staleness_exponent", "hinge_after"}
    assert set(rows["fedbuff"]["parameters"]) == set(rows["fedasync"]["parameters"]) | {"buffer_size"}
    listed = subprocess.run([CROSSDC, "strategies", "list", "--json"], capture_output=True, text=True, timeout=60)
    names = {r["name"]: r for r in json.loads(listed.stdout)}
    assert names["fedbuff"]["parameters"]["max_staleness"]["default"] == 16
    assert names["fedasync"]["source"] == "built-in" and math.isclose(names["fedasync"]["parameters"]["lr"]["default"], 0.6)
