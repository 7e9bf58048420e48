"""Small exact cases for the τ schedule, the aggregation maths, the strategy base, the registry and the update gate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crossdc.federation.update_gate import rejection_reason
from crossdc.strategies.aggregation import add, cosine, l2_norm, weighted_average
from crossdc.strategies.base import ClientUpdate, Parameter, Strategy, StrategyError
from crossdc.strategies.fedavg import FedAvgTau
from crossdc.strategies.registry import available_strategies, strategy_class
from crossdc.strategies.schedule import TauSchedule, tau_for_round, tau_sum

# -- tau_for_round ----------------------------------------------------------------


def test_linear_warmup_exact_values() -> None:
    # start + (end - start) * (r - 1) / warmup, nearest integer:
    # r=1: 1; r=2: 1 + 49*0.2 = 10.8 -> 11; r=3: 20.6 -> 21; r=4: 30.4 -> 30; r=5: 40.2 -> 40; then end.
    got = [tau_for_round(r, 1, 50, 5, "linear") for r in range(1, 8)]
    assert got == [1, 11, 21, 30, 40, 50, 50]
    assert all(type(t) is int for t in got)


def test_linear_is_the_default_kind() -> None:
    assert [tau_for_round(r, 1, 50, 5) for r in range(1, 8)] == [1, 11, 21, 30, 40, 50, 50]


def test_linear_decreasing_schedule() -> None:
    # 50 + (1 - 50) * (r - 1) / 5: 50, 40.2 -> 40, 30.4 -> 30, 20.6 -> 21, 10.8 -> 11, then 1.
    assert [tau_for_round(r, 50, 1, 5) for r in range(1, 8)] == [50, 40, 30, 21, 11, 1, 1]


def test_geometric_warmup_exact_values() -> None:
    # 1 * 16 ** ((r - 1) / 4): 1, 2, 4, 8, then 16.
    assert [tau_for_round(r, 1, 16, 4, "geometric") for r in range(1, 7)] == [1, 2, 4, 8, 16, 16]
    # 50 ** 0.2 = 2.187 -> 2, 50 ** 0.4 = 4.78 -> 5, 50 ** 0.6 = 10.46 -> 10, 50 ** 0.8 = 22.87 -> 23.
    assert [tau_for_round(r, 1, 50, 5, "geometric") for r in range(1, 8)] == [1, 2, 5, 10, 23, 50, 50]


def test_warmup_zero_gives_end_from_round_one() -> None:
    assert [tau_for_round(r, 1, 50, 0) for r in range(1, 4)] == [50, 50, 50]
    assert [tau_for_round(r, 3, 9, 0, "geometric") for r in range(1, 4)] == [9, 9, 9]


def test_constant_schedule() -> None:
    assert [tau_for_round(r, 7, 7, 3) for r in range(1, 6)] == [7] * 5
    assert [tau_for_round(r, 7, 7, 3, "geometric") for r in range(1, 6)] == [7] * 5


@pytest.mark.parametrize(
    ("server_round", "start", "end", "warmup", "kind", "match"),
    [
        (0, 1, 5, 2, "linear", "rounds are numbered from 1"),
        (-3, 1, 5, 2, "linear", "rounds are numbered from 1"),
        (1, 0, 5, 2, "linear", "tau must be ≥ 1"),
        (1, 1, 0, 2, "linear", "tau must be ≥ 1"),
        (1, -1, 5, 0, "linear", "tau must be ≥ 1"),
        (1, 1, 5, 2, "cubic", "unknown tau schedule kind 'cubic'"),
    ],
)
def test_bad_schedule_inputs_raise(server_round: int, start: int, end: int, warmup: int, kind: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tau_for_round(server_round, start, end, warmup, kind)


def test_tau_sum_is_the_loop_over_the_rounds_in_closed_form() -> None:
    """The planned inner steps of a run, Σ τ(r) over its rounds, without a loop over the rounds after the warm-up: equal to the loop
    for every small schedule (rising, falling, constant; linear and geometric; before, during and after the warm-up)."""
    for start in range(1, 14):
        for end in (1, 2, 5, 13, 86):
            for warmup in range(0, 11):
                for kind in ("linear", "geometric"):
                    for rounds in (0, 1, 2, warmup, warmup + 1, 17):
                        looped = sum(tau_for_round(r, start, end, warmup, kind) for r in range(1, rounds + 1))
                        assert tau_sum(rounds, start, end, warmup, kind) == looped, (rounds, start, end, warmup, kind)
    assert TauSchedule(10, 50, 4).total(6) == 10 + 20 + 30 + 40 + 50 + 50
    # 1 → 3 over W = 1000 rounds: τ = 1 for the first W/4 rounds, 2 for the next W/2, 3 for the last W/4 and after;
    # summed over 10^12 rounds without a loop over them
    assert TauSchedule(1, 3, 1000).total(10**12) == 250 * 1 + 500 * 2 + 250 * 3 + 3 * (10**12 - 1000)
    with pytest.raises(ValueError, match="tau must be ≥ 1"):
        tau_sum(3, 0, 5, 2)
    with pytest.raises(ValueError, match="unknown tau schedule kind"):
        tau_sum(3, 1, 5, 2, "cubic")


# -- aggregation ------------------------------------------------------------------


def test_weighted_average_exact() -> None:
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([[0.0]], np.float32)}
    b = {"w": np.array([5.0, 6.0], np.float32), "b": np.array([[4.0]], np.float32)}
    out = weighted_average([a, b], [1, 3])
    # (1*1 + 3*5)/4 = 4, (1*2 + 3*6)/4 = 5, (0 + 12)/4 = 3
    assert set(out) == {"w", "b"}
    np.testing.assert_array_equal(out["w"], np.array([4.0, 5.0], np.float32))
    np.testing.assert_array_equal(out["b"], np.array([[3.0]], np.float32))
    assert out["w"].dtype == np.float32 and out["b"].dtype == np.float32
    assert out["b"].shape == (1, 1)


def test_weighted_average_returns_float32_from_float64_and_int_inputs() -> None:
    out = weighted_average([{"x": np.array([1, 2], np.int64)}, {"x": np.array([2.0, 4.0], np.float64)}], [1.0, 1.0])
    assert out["x"].dtype == np.float32
    np.testing.assert_array_equal(out["x"], np.array([1.5, 3.0], np.float32))


def test_weighted_average_zero_weight_ignores_that_update() -> None:
    out = weighted_average([{"x": np.array([1.0])}, {"x": np.array([100.0])}], [2, 0])
    np.testing.assert_array_equal(out["x"], np.array([1.0], np.float32))


def test_weighted_average_does_not_modify_inputs() -> None:
    a = {"x": np.array([1.0, 2.0], np.float32)}
    b = {"x": np.array([3.0, 4.0], np.float32)}
    weighted_average([a, b], [1, 1])
    np.testing.assert_array_equal(a["x"], [1.0, 2.0])
    np.testing.assert_array_equal(b["x"], [3.0, 4.0])


@pytest.mark.parametrize(
    ("updates", "weights", "match"),
    [
        ([], [], "at least one update"),
        ([{"x": np.zeros(2)}, {"x": np.zeros(2)}], [1.0], "2 updates but 1 weights"),
        ([{"x": np.zeros(2)}], [1.0, 2.0], "1 updates but 2 weights"),
        ([{"x": np.zeros(2)}, {"x": np.zeros(2)}], [0, 0], "positive sum"),
        ([{"x": np.zeros(2)}, {"x": np.zeros(2)}], [3, -1], "≥ 0"),
    ],
)
def test_weighted_average_bad_inputs_raise(updates: list, weights: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        weighted_average(updates, weights)


def test_add_with_scale_keeps_dtype() -> None:
    base = {"x": np.array([1.0, 2.0], np.float32)}
    delta = {"x": np.array([0.5, -1.0], np.float64)}
    out = add(base, delta)
    np.testing.assert_array_equal(out["x"], np.array([1.5, 1.0], np.float32))
    assert out["x"].dtype == np.float32
    np.testing.assert_array_equal(add(base, delta, scale=-2.0)["x"], np.array([0.0, 4.0], np.float32))
    np.testing.assert_array_equal(base["x"], [1.0, 2.0])  # not modified in place


def test_l2_norm_over_all_tensors() -> None:
    assert l2_norm({"a": np.array([3.0], np.float32), "b": np.array([[4.0]], np.float32)}) == 5.0
    assert l2_norm({"a": np.array([1.0, 2.0, 2.0])}) == 3.0
    assert l2_norm({"a": np.zeros(3)}) == 0.0


def test_cosine_exact() -> None:
    x = {"a": np.array([1.0, 0.0]), "b": np.array([0.0])}
    assert cosine(x, x) == pytest.approx(1.0, abs=1e-12)
    assert cosine(x, {"a": np.array([-2.0, 0.0]), "b": np.array([0.0])}) == pytest.approx(-1.0, abs=1e-12)
    assert cosine(x, {"a": np.array([0.0, 5.0]), "b": np.array([0.0])}) == 0.0
    assert cosine(x, {"a": np.array([1.0, 1.0]), "b": np.array([0.0])}) == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    # flattened across tensors: (1,0 | 0) . (1,0 | 1) = 1, norms 1 and sqrt(2)
    assert cosine(x, {"a": np.array([1.0, 0.0]), "b": np.array([1.0])}) == pytest.approx(1 / math.sqrt(2), abs=1e-12)


def test_cosine_with_a_zero_vector_is_zero() -> None:
    zero = {"a": np.zeros(2)}
    assert cosine(zero, {"a": np.array([1.0, 2.0])}) == 0.0
    assert cosine(zero, zero) == 0.0


# -- strategies -------------------------------------------------------------------


def test_fedavg_aggregate_is_weights_plus_weighted_mean_delta() -> None:
    strategy = FedAvgTau()
    w = {"w": np.array([1.0, 1.0], np.float32), "b": np.array([0.5], np.float32)}
    updates = [
        ClientUpdate("a", {"w": np.array([2.0, 0.0], np.float32), "b": np.array([1.0], np.float32)}, num_examples=1),
        ClientUpdate("b", {"w": np.array([-2.0, 4.0], np.float32), "b": np.array([-1.0], np.float32)}, num_examples=3),
    ]
    # mean delta: w: ((2 - 6)/4, 12/4) = (-1, 3); b: (1 - 3)/4 = -0.5
    mean = strategy.mean_update(updates)
    np.testing.assert_array_equal(mean["w"], np.array([-1.0, 3.0], np.float32))
    np.testing.assert_array_equal(mean["b"], np.array([-0.5], np.float32))
    new = strategy.aggregate(1, w, updates, mean)
    np.testing.assert_array_equal(new["w"], np.array([0.0, 4.0], np.float32))
    np.testing.assert_array_equal(new["b"], np.array([0.0], np.float32))
    assert new["w"].dtype == np.float32
    np.testing.assert_array_equal(w["w"], [1.0, 1.0])  # the old global weights are untouched


def test_fedavg_single_update_is_applied_fully() -> None:
    w = {"x": np.array([1.0, -1.0], np.float32)}
    updates = [ClientUpdate("a", {"x": np.array([0.25, 0.5], np.float32)}, 10)]
    s = FedAvgTau()
    new = s.aggregate(3, w, updates, s.mean_update(updates))
    np.testing.assert_array_equal(new["x"], np.array([1.25, -0.5], np.float32))


def test_fedavg_tau_follows_schedule() -> None:
    s = FedAvgTau(tau=TauSchedule(1, 50, 5))
    assert [s.tau(r) for r in range(1, 8)] == [1, 11, 21, 30, 40, 50, 50]
    g = FedAvgTau(tau=TauSchedule(1, 16, 4, "geometric"))
    assert [g.tau(r) for r in range(1, 6)] == [1, 2, 4, 8, 16]
    assert FedAvgTau(tau=TauSchedule(4, 4, 0)).tau(1) == 4


def test_fedavg_defaults() -> None:
    s = FedAvgTau()
    assert isinstance(s, Strategy)
    assert s.name == "fedavg"
    assert s.params == {}
    assert s.client_config(1) == {}
    assert s.state_dict() == {}
    s.load_state_dict({})


def test_unknown_strategy_parameter_is_named() -> None:
    with pytest.raises(StrategyError, match="unknown parameter 'mu' for strategy 'fedavg'") as info:
        FedAvgTau(params={"mu": 0.01})
    assert "\n" not in str(info.value)


def test_bad_schedule_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="tau must be ≥ 1"):
        FedAvgTau(tau=TauSchedule(0, 5, 2))
    with pytest.raises(ValueError, match="unknown tau schedule kind"):
        FedAvgTau(tau=TauSchedule(1, 5, 2, "cubic"))


def test_strategy_parameters_defaults_and_overrides() -> None:
    class WithParams(Strategy):
        name = "with-params"
        parameters = {"mu": Parameter(float, 0.01, "proximal weight"), "beta": Parameter(float, 0.9, "momentum")}

    s = WithParams(params={"mu": 0.5})
    assert s.params == {"mu": 0.5, "beta": 0.9}
    with pytest.raises(StrategyError, match="unknown parameter 'gamma' for strategy 'with-params'; known: beta, mu"):
        WithParams(params={"gamma": 1})


def test_registry_finds_fedavg() -> None:
    strategies = available_strategies()
    assert strategies["fedavg"] is FedAvgTau
    assert strategy_class("fedavg") is FedAvgTau


def test_registry_unknown_name_lists_known_ones() -> None:
    with pytest.raises(StrategyError, match=r"unknown strategy 'fedprocs'; known: .*fedavg") as info:
        strategy_class("fedprocs")
    assert "\n" not in str(info.value)


# -- the update gate --------------------------------------------------------------


def _reference() -> dict[str, np.ndarray]:
    return {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}


def test_gate_accepts_a_well_formed_update() -> None:
    assert rejection_reason({"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}, _reference()) is None


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"w": np.zeros((2, 3), np.float32)}, "missing tensors: b"),
        ({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32), "z": np.zeros(1, np.float32)}, "unexpected tensors: z"),
        ({"w": np.zeros((3, 2), np.float32), "b": np.zeros(3, np.float32)}, r"tensor 'w' has shape \(3, 2\), expected \(2, 3\)"),
        ({"w": np.zeros((2, 3), np.float64), "b": np.zeros(3, np.float32)}, "tensor 'w' has dtype float64, expected float32"),
        ({"w": np.zeros((2, 3), np.float32), "b": np.array([0, np.nan, 0], np.float32)}, "tensor 'b' contains NaN or Inf"),
        ({"w": np.full((2, 3), np.inf, np.float32), "b": np.zeros(3, np.float32)}, "tensor 'w' contains NaN or Inf"),
    ],
)
def test_gate_rejects_with_a_reason(update: dict[str, np.ndarray], match: str) -> None:
    import re

    reason = rejection_reason(update, _reference())
    assert reason is not None and re.search(match, reason), reason
