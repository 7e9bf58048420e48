"""Checkpoint store (atomic commit, damaged checkpoints skipped, retention) and adaptive deadlines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from crossdc.experiment.config import DeadlinePolicy
from crossdc.federation.checkpoints import CheckpointError, CheckpointStore
from crossdc.federation.deadline import Deadlines, datacenter_deadline, round_deadline


def _state(server_round: int) -> dict:
    return {"round": server_round, "weights": {"w": np.full((3, 2), float(server_round), np.float32)},
            "strategy": {"momentum": [server_round * 0.5]}}


@pytest.mark.parametrize("url", ["dir", "memory://crossdc-test-ckpt"])
def test_save_load_latest_and_retention(tmp_path: Path, url: str) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt") if url == "dir" else f"{url}/{tmp_path.name}", keep=2)
    for server_round in (5, 10, 15):
        store.save(server_round, _state(server_round))
    assert [info.round for info in store.committed()] == [10, 15]
    info, state = store.load_latest()
    assert info.round == 15 and state["round"] == 15
    assert np.array_equal(state["weights"]["w"], np.full((3, 2), 15.0, np.float32))


def test_half_written_checkpoints_are_never_loaded(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=0)
    store.save(1, _state(1))
    store.save(2, _state(2))
    # a writer that died after the data but before the commit record: round 3 does not exist
    (tmp_path / "round-000003.ckpt").write_bytes(b"partial")
    # a commit record whose data was cut short: round 2 is damaged
    data = (tmp_path / "round-000002.ckpt").read_bytes()
    (tmp_path / "round-000002.ckpt").write_bytes(data[: len(data) // 2])
    info, state = store.load_latest()
    assert info.round == 1 and state["round"] == 1
    (tmp_path / "round-000001.json").write_text("{not json")
    assert store.load_latest() is None


def test_bad_keep_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep"):
        CheckpointStore(str(tmp_path), keep=-1)


def test_deadline_uses_the_ceiling_until_there_is_history() -> None:
    policy = DeadlinePolicy(floor_s=10, ceiling_s=300, k_mad=4, min_history=3)
    assert datacenter_deadline([], policy) == 300
    assert datacenter_deadline([15, 15], policy) == 300


def test_deadline_is_median_plus_k_mad_clamped() -> None:
    policy = DeadlinePolicy(floor_s=10, ceiling_s=300, k_mad=4, min_history=3, slack=0.0)
    # median 15, MAD 1 → 15 + 4 × 1.4826
    assert datacenter_deadline([14, 15, 16, 15, 15, 14, 16], policy) == pytest.approx(15 + 4 * 1.4826)
    # rounds that were all alike (MAD 0) still leave the relative slack: 1.5 × the median by default
    assert datacenter_deadline([20, 20, 20], DeadlinePolicy(floor_s=10, ceiling_s=300, k_mad=4)) == pytest.approx(30)
    assert datacenter_deadline([1, 1, 1], policy) == 10  # the floor
    assert datacenter_deadline([500, 500, 500], policy) == 300  # the ceiling


def test_round_deadline_waits_for_the_slowest_datacenter() -> None:
    policy = DeadlinePolicy(floor_s=5, ceiling_s=600, k_mad=3, min_history=3)
    history = {"fast": [2.0, 2.1, 1.9], "slow": [15.0, 15.5, 14.5]}
    deadline = round_deadline(history, ["fast", "slow"], policy)
    assert deadline == pytest.approx(1.5 * 15.0)  # the slack beats median + 3 MAD here
    assert round_deadline(history, ["fast"], policy) == 5
    assert round_deadline(history, ["fast", "newcomer"], policy) == 600


def test_deadlines_learn_replies_and_missed_deadlines_of_rounds_or_exchanges() -> None:
    fixed = Deadlines(None, 300.0, ["a", "b"])
    assert fixed.next(["a", "b"]) == (300.0, "fixed run.round_timeout_s")
    assert fixed.ttl_s == 300.0 and fixed.can_wait_on(300.0) == 0.0
    policy = DeadlinePolicy(floor_s=1.0, ceiling_s=100.0, k_mad=4.0, min_history=2, slack=0.5)
    adaptive = Deadlines(policy, 100.0, ["a", "b"], times={"a": [2.0], "gone": [9.0]})
    assert adaptive.times == {"a": [2.0], "b": []}  # a datacenter no longer in the run is forgotten
    assert adaptive.next(["a", "b"]) == (100.0, "adaptive run.deadline")  # too little history: the ceiling
    adaptive.record("a", "ok", 2.0, 100.0)
    adaptive.record("b", "ok", 4.0, 100.0)
    adaptive.record("b", "timeout", None, 5.0)  # a missed deadline: a lower bound of b's pace
    adaptive.record("a", "rejected", 1.0, 100.0)  # a rejected update says nothing of the pace
    assert adaptive.times == {"a": [2.0, 2.0], "b": [4.0, 5.0]}
    assert adaptive.next(["a", "b"]) == (round_deadline(adaptive.times, ["a", "b"], policy), "adaptive run.deadline")
    assert adaptive.ttl_s == 100.0 and adaptive.can_wait_on(30.0) == 70.0 and adaptive.can_wait_on(120.0) == 0.0
