"""The chaos soak's short size (benchmarks/soak.py): a synchronous and an asynchronous run, each under a seeded
schedule of faults (SIGKILLs of SuperNodes, trainers, worker ranks and the coordinator followed by a resume, link
cuts and resets), end with every round logged exactly once, every asynchronous update applied exactly once, no
process, port or namespace left behind, every injected fault recovered from, and a final loss within the stated
tolerance of a fault-free run. Also the schedule's rules on their own."""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("soak")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_schedule_is_seeded_spaced_and_bounded(soak: ModuleType) -> None:
    kinds = soak.SIZES["full"]["kinds"]
    first = soak.schedule(random.Random(7), kinds, 24, 220)
    again = soak.schedule(random.Random(7), kinds, 24, 220)
    assert [(f.kind, f.after_round, f.target) for f in first] == [(f.kind, f.after_round, f.target) for f in again]
    rounds = [f.after_round for f in first]
    assert rounds == sorted(rounds) and all(b - a >= 3 for a, b in zip(rounds, rounds[1:], strict=False))
    assert 2 <= rounds[0] and rounds[-1] <= 220 - 3
    assert set(kinds) <= {f.kind for f in first}  # every kind at least once
    assert sum(f.kind == "kill-coordinator" for f in first) <= soak.MAX_COORDINATOR_KILLS
    assert all(f.target == "us-east" for f in first if f.kind == "kill-worker")
    assert all(f.target in soak.DATACENTERS for f in first if f.kind in ("cut", "reset", "kill-supernode", "kill-trainer"))


@pytest.mark.deployment
@pytest.mark.serial  # four local runs at once load the machine: alone, after the parallel part (and its leftovers
@pytest.mark.timeout(600)  # check, which looks at every namespace on the machine, sees only its own)
def test_short_soak_loses_and_doubles_nothing(soak: ModuleType, tmp_path: Path) -> None:
    rows = soak.run_soak("short", seed=0, work=tmp_path)
    summary = soak.summarize(rows, "short", 0.0)
    assert {r["strategy"] for r in rows} == {"fedavg", "fedbuff"}
    for row in rows:
        assert row["status"] == "finished", row
        assert row["rounds_lost"] == 0 and row["rounds_duplicated"] == 0 and row["datacenter_rows_duplicated"] == 0, row
        assert not row["leftovers_found"], row["leftovers"]
        injected = [f for f in row["faults"] if not f["outcome"].startswith("not injected")]
        assert injected, row["faults"]
        assert all("never" not in f["outcome"] and "not resumed" not in f["outcome"] for f in injected), row["faults"]
        assert row["loss_within_tolerance"], (row["val_loss"], row["reference_val_loss"])
    fedbuff = next(r for r in rows if r["strategy"] == "fedbuff")
    assert fedbuff["updates_lost"] == 0 and fedbuff["updates_duplicated"] == 0
    assert summary["rounds_lost"] == summary["rounds_duplicated"] == summary["updates_duplicated"] == 0
    assert len(summary["faults"]) == sum(len(r["faults"]) for r in rows)
    assert all({"kind", "at_s", "target", "outcome"} <= set(f) for f in summary["faults"])


def test_a_spoiled_update_is_matched_to_its_own_refusal(soak: ModuleType) -> None:
    """A NaN update is credited only with a NaN refusal; one whose reply went to a coordinator killed right after is
    said not to have been judged, not credited with a later fault's refusal."""
    rows = [{"round": r, "datacenter": "us-east", "status": "ok"} for r in range(1, 30)]
    shape = {"kind": "rejected", "datacenter": "us-east", "round": 20, "detail": "tensor 'w' has shape (3,), expected (4,)"}
    nan = {"kind": "rejected", "datacenter": "us-east", "round": 6, "detail": "tensor 'w' contains NaN or Inf"}
    spoiled = soak.Fault("nan-update", 5, "us-east", at_s=10.0, round_at=5, outcome="injected")
    kill = soak.Fault("kill-coordinator", 5, "coordinator", at_s=11.0, round_at=5, outcome="injected")
    assert soak._outcome(spoiled, rows, [nan, shape]).startswith("refused by the update gate at round 6")
    assert soak._outcome(spoiled, rows, [shape]) == "us-east's spoiled update was never refused"
    killed = soak._coordinator_killed_soon_after(spoiled, [spoiled, kill])
    assert killed == 5
    assert soak._outcome(spoiled, rows, [shape], killed).startswith("not judged: the coordinator was killed after round 5")
    later_kill = soak.Fault("kill-coordinator", 15, "coordinator", at_s=10.0 + soak.SPOILED_JUDGED_WITHIN_S + 5, round_at=15)
    assert soak._coordinator_killed_soon_after(spoiled, [spoiled, later_kill]) is None


def test_a_coordinator_kill_is_matched_to_the_attempt_it_started(soak: ModuleType) -> None:
    """The n-th coordinator kill is resumed by attempt n + 1, whatever the round of the checkpoint it resumed from
    (an asynchronous coordinator may checkpoint a version newer than the rounds counted when the kill came)."""
    resumed = [{"kind": "resumed", "round": 6, "detail": {"attempt": 2}},
               {"kind": "resumed", "round": 20, "detail": {"attempt": 3}}]
    first = soak.Fault("kill-coordinator", 5, "coordinator", at_s=10.0, round_at=5, outcome="injected")
    assert soak._outcome(first, [], resumed, resumed_attempt=2) == "resumed from the checkpoint of round 6 (attempt 2)"
    assert soak._outcome(first, [], resumed, resumed_attempt=4) == "not resumed"
