"""The update gate's size limit and norm-outlier check, and robust aggregation, on small exact cases.

- norm_outliers: leave-one-out median, 2 and 3+ datacenters, ties, the check off (factor 0);
- the size limit: its default derived from the model, the configured one, and judge_reply refusing an oversized
  reply (a real Flower Message) before decoding it;
- robust_mean: Flower's median and trimmed mean by tensor name, float32 out; every strategy's server step uses
  it, SCAFFOLD's control variates stay a plain mean;
- the in-process federation wires both checks: an update 1000× too large is rejected and the global weights are
  exactly those of a round without that datacenter.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message, MessageType, Metadata, MetricRecord, RecordDict

from crossdc.db.records import DatacenterRoundRecord
from crossdc.experiment.builders import build_strategy
from crossdc.experiment.config import parse_config
from crossdc.federation.grid_io import Reply
from crossdc.federation.update_gate import (
    GateRules,
    judge_reply,
    norm_outliers,
    size_rejection_reason,
    update_norm_outliers,
    update_size_limit,
)
from crossdc.protocol import CONTROL_KEY, METRICS_KEY, encode_compressed, encode_tensors, payload_bytes
from crossdc.strategies.aggregation import weighted_average
from crossdc.strategies.base import ClientUpdate, RunInfo, Strategy, StrategyError
from crossdc.strategies.diloco import DiLoCo
from crossdc.strategies.fedavg import FedAvgTau
from crossdc.strategies.fedprox import FedProx
from crossdc.strategies.robust import robust_mean
from crossdc.strategies.scaffold import Scaffold
from crossdc.testing import inprocess
from crossdc.testing.inprocess import InProcessFederation

pytestmark = pytest.mark.timeout(120)


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# -- norm outliers -------------------------------------------------------------------------------------------


def test_two_datacenters_the_huge_update_goes_and_the_honest_one_stays() -> None:
    outliers = norm_outliers({"honest": 1.0, "huge": 1000.0}, factor=10)
    assert list(outliers) == ["huge"]
    assert outliers["huge"] == ("update norm 1000 exceeds 10 × 1, the median norm of the round's other accepted "
                                "updates (security.norm_rejection_factor = 10)")


def test_two_datacenters_within_the_factor_both_stay() -> None:
    assert norm_outliers({"a": 1.0, "b": 9.0}, factor=10) == {}
    assert norm_outliers({"a": 1.0, "b": 10.0}, factor=10) == {}  # exactly factor × median: not greater
    assert list(norm_outliers({"a": 1.0, "b": 10.001}, factor=10)) == ["b"]


def test_three_datacenters_leave_one_out_median() -> None:
    # c: others {1, 2} → median 1.5, 100 > 15; b: others {1, 100} → 50.5; a: others {2, 100} → 51
    outliers = norm_outliers({"a": 1.0, "b": 2.0, "c": 100.0}, factor=10)
    assert list(outliers) == ["c"] and "exceeds 10 × 1.5," in outliers["c"]
    # the median of an odd number of others is the middle one: d's others {1, 2, 3} → 2, 21 > 20
    assert list(norm_outliers({"a": 1.0, "b": 2.0, "c": 3.0, "d": 21.0}, factor=10)) == ["d"]
    assert norm_outliers({"a": 1.0, "b": 2.0, "c": 3.0, "d": 20.0}, factor=10) == {}


def test_two_outliers_among_four_are_both_rejected() -> None:
    # c: others {1, 1.2, 100} → 1.2 ⇒ 100 > 12; the same for d; a: others {1.2, 100, 100} → 100
    assert sorted(norm_outliers({"a": 1.0, "b": 1.2, "c": 100.0, "d": 100.0}, factor=10)) == ["c", "d"]


def test_ties_are_never_outliers() -> None:
    assert norm_outliers({"a": 3.0, "b": 3.0, "c": 3.0}, factor=1.0) == {}
    assert norm_outliers({"a": 0.0, "b": 0.0}, factor=2.0) == {}


def test_the_others_median_zero_rejects_any_non_zero_update() -> None:
    assert list(norm_outliers({"a": 0.0, "b": 0.0, "c": 1e-3}, factor=10)) == ["c"]


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_factor_zero_is_off(factor: float) -> None:
    assert norm_outliers({"a": 1.0, "b": 1e9}, factor) == {}


def test_fewer_than_two_updates_nothing_is_rejected() -> None:
    assert norm_outliers({"a": 1e9}, factor=10) == {}
    assert norm_outliers({}, factor=10) == {}


def test_update_norm_outliers_takes_the_norm_over_all_tensors() -> None:
    deltas = {"a": {"x": arr(3), "y": arr(4)}, "b": {"x": arr(0), "y": arr(50.1)}}  # norms 5 and 50.1
    assert list(update_norm_outliers(deltas, factor=10)) == ["b"]
    assert update_norm_outliers({"a": deltas["a"], "b": {"x": arr(0), "y": arr(50)}}, factor=10) == {}
    assert update_norm_outliers(deltas, factor=0) == {}


# -- size limit ---------------------------------------------------------------------------------------------


def test_default_size_limit_is_derived_from_the_model() -> None:
    mib = 1 << 20
    assert update_size_limit(400, reply_groups=0) == 400 * 2 + mib
    assert update_size_limit(400, reply_groups=1) == 2 * 400 * 2 + mib  # SCAFFOLD: update and control
    assert update_size_limit(400, reply_groups=0, max_update_mb=2.5) == 2_500_000
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_update_mb"):
            update_size_limit(400, 0, bad)


def test_size_rejection_reason() -> None:
    assert size_rejection_reason(100, 100) is None
    assert size_rejection_reason(101, 100) == "payload of 101 bytes exceeds the limit of 100 bytes"


WEIGHTS = {"w": np.zeros((2, 2), np.float32)}


def reply_with(content: RecordDict) -> Reply:
    """`content` as a real Flower message replying to a train message (metadata as the SuperLink hands it over)."""
    metadata = Metadata(run_id=1, message_id="reply", src_node_id=2, dst_node_id=1, reply_to_message_id="train",
                        group_id="", created_at=0.5, ttl=60.0, message_type=MessageType.TRAIN)
    return Reply(Message(content=content, metadata=metadata), received_at=1.0)


def metrics() -> MetricRecord:
    return MetricRecord({"num-examples": 4, "compute-s": 0.0, "train-loss": 1.0})


def test_judge_reply_refuses_an_oversized_payload_before_decoding() -> None:
    content = RecordDict({**encode_tensors({"w": np.ones((2, 2), np.float32)}), METRICS_KEY: metrics()})
    size = payload_bytes(content)

    def judged(content: RecordDict, max_bytes: int | None, compressed: bool = False) -> DatacenterRoundRecord:
        rules = GateRules(batch_size=4, compressed=compressed, max_bytes=max_bytes)
        return judge_reply(reply_with(content), "us-east", WEIGHTS, tau=1, pushed_at=0.0, timeout_reason="",
                           rules=rules).record

    assert judged(content, max_bytes=size).status == "ok"
    assert judged(content, max_bytes=None).status == "ok"
    row = judged(content, max_bytes=size - 1)
    assert row == DatacenterRoundRecord(round_s=1.0, bytes_up=size, status="rejected",
                                        reason=f"payload of {size} bytes exceeds the limit of {size - 1} bytes")
    # a codec payload of garbage: under the limit the codec's error rejects it, over it the size does, first
    garbage = RecordDict({**encode_compressed(np.frombuffer(b"\x07" * 5000, np.uint8)), METRICS_KEY: metrics()})
    assert judged(garbage, max_bytes=10**6, compressed=True).reason.startswith("undecodable update")
    assert "exceeds the limit of 1000 bytes" in judged(garbage, max_bytes=1000, compressed=True).reason


# -- robust aggregation ---------------------------------------------------------------------------------------


UPDATES = [{"w": arr(1, 5), "b": arr(-3)}, {"w": arr(2, -1), "b": arr(0)}, {"w": arr(100, 0), "b": arr(7)}]


def test_median_is_coordinate_wise_and_ignores_example_counts() -> None:
    out = robust_mean(UPDATES, [100, 1, 1], "median")
    assert list(out) == ["w", "b"] and all(v.dtype == np.float32 for v in out.values())
    np.testing.assert_array_equal(out["w"], arr(2, 0))
    np.testing.assert_array_equal(out["b"], arr(0))
    # an even count: the mean of the two middle values
    np.testing.assert_array_equal(robust_mean([{"x": arr(v)} for v in (1, 2, 3, 100)], [1] * 4, "median")["x"], arr(2.5))


def test_trimmed_mean_cuts_the_fraction_at_each_end() -> None:
    five = [{"x": arr(v)} for v in (4, 100, 1, 3, 2)]
    np.testing.assert_array_equal(robust_mean(five, [1] * 5, "trimmed_mean", 0.2)["x"], arr(3))  # mean(2, 3, 4)
    np.testing.assert_array_equal(robust_mean(five, [1] * 5, "trimmed_mean", 0.0)["x"], arr(22))  # 110 / 5
    # int(0.2 × 3) = 0: nothing is cut from three updates, the unweighted mean
    out = robust_mean(UPDATES, [100, 1, 1], "trimmed_mean", 0.2)
    np.testing.assert_array_equal(out["w"], arr(103 / 3, 4 / 3))
    np.testing.assert_array_equal(out["b"], arr(4 / 3))
    np.testing.assert_array_equal(robust_mean(UPDATES, [1] * 3, "trimmed_mean", 0.34)["w"], arr(2, 0))  # cuts 1 of 3


def test_none_is_the_example_weighted_mean() -> None:
    out = robust_mean(UPDATES, [2, 1, 1], "none")
    for name, value in weighted_average(UPDATES, [2, 1, 1]).items():
        np.testing.assert_array_equal(out[name], value)


def test_bad_robust_aggregation_arguments() -> None:
    with pytest.raises(ValueError, match="unknown robust aggregation 'mean'"):
        robust_mean(UPDATES, [1] * 3, "mean")
    with pytest.raises(ValueError, match=r"trim fraction must be in \[0, 0.5\)"):
        robust_mean(UPDATES, [1] * 3, "trimmed_mean", 0.5)
    with pytest.raises(StrategyError, match="strategy 'fedavg': unknown robust aggregation 'mode'"):
        FedAvgTau(robust_aggregation="mode")


def by_median(cls: type[Strategy], optimizer: str, params: dict[str, Any] | None = None) -> Strategy:
    return cls(params=params, run=RunInfo(("a", "b", "c"), optimizer, 0.1), robust_aggregation="median")


def client_updates(control: bool = False) -> list[ClientUpdate]:
    return [ClientUpdate(dc, u, n, extras={CONTROL_KEY: {"w": arr(c, c), "b": arr(c)}} if control else {})
            for dc, u, n, c in zip("abc", UPDATES, (100, 1, 1), (3, 6, 30), strict=False)]


@pytest.mark.parametrize("cls, params", [(FedAvgTau, None), (FedProx, None),
                                         (DiLoCo, {"outer_lr": 1.0, "outer_momentum": 0.0})], ids=["fedavg", "fedprox", "diloco"])
def test_strategies_step_by_the_median(cls: type[Strategy], params: dict[str, Any] | None) -> None:
    x = {"w": arr(10, 10), "b": arr(1)}
    strategy, updates = by_median(cls, "adamw", params), client_updates()
    new = strategy.aggregate(1, x, updates, strategy.mean_update(updates))
    np.testing.assert_array_equal(new["w"], arr(12, 10))
    np.testing.assert_array_equal(new["b"], arr(1))


def test_scaffold_steps_by_the_median_but_averages_control_variates_plainly() -> None:
    s, updates = by_median(Scaffold, "sgd"), client_updates(control=True)
    new = s.aggregate(1, {"w": arr(0, 0), "b": arr(0)}, updates, s.mean_update(updates))
    np.testing.assert_array_equal(new["w"], arr(2, 0))
    assert s.control is not None
    np.testing.assert_array_equal(s.control["w"], arr(13, 13))  # (3/3) · mean(3, 6, 30), not the median 6


SYNTHETIC_3DC: dict[str, Any] = {
    "run": {"name": "gate-3dc", "rounds": 2, "seed": 0},
    "workload": {"dataset": "synthetic", "model": "linear", "partition": {"kind": "iid"}, "batch_size": 16,
                 "optimizer": "adamw", "lr": 0.01},
    "strategy": {"name": "fedavg", "tau": 2},
    "datacenters": [{"name": "us-east"}, {"name": "eu-west"}, {"name": "ap-south"}],
}


def with_security(**security: Any) -> dict[str, Any]:
    doc = copy.deepcopy(SYNTHETIC_3DC)
    doc["security"] = security
    return doc


def test_build_strategy_takes_the_robust_aggregation_from_the_config() -> None:
    assert build_strategy(parse_config(SYNTHETIC_3DC)).robust_aggregation == "none"
    strategy = build_strategy(parse_config(with_security(robust_aggregation="trimmed_mean", trim_fraction=0.1)))
    assert (strategy.robust_aggregation, strategy.trim_fraction) == ("trimmed_mean", 0.1)


def test_in_process_rounds_reject_the_outlier_and_aggregate_only_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_round = inprocess.run_local_round

    def inflating(strategy: Any, trainer: Any, store: Any, dc: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        answer = real_round(strategy, trainer, store, dc, *args, **kwargs)
        if dc == "ap-south":
            answer["delta"] = {name: value * np.float32(1000) for name, value in answer["delta"].items()}
        return answer

    config = parse_config(with_security(norm_rejection_factor=10))
    honest = InProcessFederation.from_config(config, tmp_path / "honest")
    monkeypatch.setattr(inprocess, "run_local_round", inflating)
    attacked = InProcessFederation.from_config(config, tmp_path / "attacked")
    for _ in range(2):
        result = attacked.run_round()
        assert list(result.rejected) == ["ap-south"] and "exceeds 10 × " in result.rejected["ap-south"]
        assert [u.datacenter for u in result.updates] == ["us-east", "eu-west"]
        assert not honest.run_round(participants=["us-east", "eu-west"]).rejected
    for name, value in honest.weights.items():
        np.testing.assert_array_equal(attacked.weights[name], value)


def test_in_process_size_limit(tmp_path: Path) -> None:
    result = InProcessFederation.from_config(parse_config(with_security(max_update_mb=1e-4)), tmp_path).run_round()
    assert not result.updates and sorted(result.rejected) == ["ap-south", "eu-west", "us-east"]
    assert all(reason.endswith("exceeds the limit of 100 bytes") for reason in result.rejected.values())


class _UndeclaredGroup(FedAvgTau):
    """Sends a tensor group down that it never declared in client_groups."""

    name = "undeclared-group"

    def client_arrays(self, server_round: int, global_weights: Any) -> dict[str, dict[str, np.ndarray]]:
        return {"extra": {name: np.zeros_like(value) for name, value in global_weights.items()}}


def test_a_tensor_group_sent_down_must_be_declared(tmp_path: Path) -> None:
    config = parse_config(SYNTHETIC_3DC)
    run = RunInfo(tuple(config.datacenter_names), config.workload.optimizer, config.workload.lr)
    fed = InProcessFederation(config, tmp_path, strategy=_UndeclaredGroup(tau=1, run=run))
    with pytest.raises(StrategyError, match=r"strategy 'undeclared-group' sent the tensor groups \['extra'\] but declares "
                                            r"client_groups = \(\)"):
        fed.run_round()
    declared = type("DeclaredGroup", (_UndeclaredGroup,), {"name": "declared-group", "client_groups": ("extra",)})
    assert not InProcessFederation(config, tmp_path / "declared", strategy=declared(tau=1, run=run)).run_round().rejected
