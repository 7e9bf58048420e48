"""Round deadlines in a real run (Flower's simulation engine): a fixed deadline shorter than a slow datacenter's
local phase drops it every round; the adaptive deadline (run.deadline) learns its pace and never drops it."""

from __future__ import annotations

import copy
import statistics
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import read_run

from crossdc.experiment.config import parse_config
from crossdc.orchestration.local_run import LocalRunOptions, run_local

#: these tests assert paces and deadlines on the wall clock: they run alone, after the parallel part of the suite
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[1]
SLOW, FAST = "eu-west", "us-east"


def _doc(rounds: int) -> dict[str, Any]:
    doc = tomllib.loads((REPO / "examples" / "synthetic-2dc.toml").read_text())
    doc["run"].update(rounds=rounds, min_replies=1)
    doc["strategy"]["tau"] = 300
    for dc in doc["datacenters"]:
        if dc["name"] == SLOW:
            dc["speed"] = 0.05  # emulated: its local phase takes 20× as long
    return doc


def _run(doc: dict[str, Any], tmp: Path, label: str) -> list[dict[str, Any]]:
    db_url = f"sqlite:///{tmp / f'{label}.db'}"
    result = run_local(parse_config(doc), LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp / label))
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished"
    return logged["dc_rounds"]


@pytest.mark.timeout(300)
def test_adaptive_deadline_keeps_a_slow_datacenter_a_fixed_one_drops_it(tmp_path: Path) -> None:
    adaptive = _doc(rounds=5)
    adaptive["run"]["deadline"] = {"floor_s": 0.2, "ceiling_s": 60, "k_mad": 4, "min_history": 2}
    rows = _run(adaptive, tmp_path, "adaptive")
    assert all(r["status"] == "ok" for r in rows), [(r["round"], r["datacenter"], r["status"], r["reason"]) for r in rows]
    slow_pace = statistics.median(r["round_s"] for r in rows if r["datacenter"] == SLOW)
    fast_worst = max(r["round_s"] for r in rows if r["datacenter"] == FAST)
    # between the paces, nearer the slow one (whose pace is emulated, 20× its compute): the slow datacenter cannot
    # make it, and the fast one keeps room for a stall of a shared machine
    fixed_s = max((fast_worst + slow_pace) / 2, 0.7 * slow_pace)
    # the emulated speed makes the slow datacenter's rounds far longer than the fast one's slowest
    assert slow_pace >= 2.5 * fast_worst, f"paces not separated: fast {fast_worst:.2f}s, slow {slow_pace:.2f}s"

    fixed = copy.deepcopy(_doc(rounds=3))
    fixed["run"]["round_timeout_s"] = round(fixed_s, 3)
    rows = _run(fixed, tmp_path, "fixed")
    assert all(r["status"] == "ok" for r in rows if r["datacenter"] == FAST)
    dropped = [r for r in rows if r["datacenter"] == SLOW]
    assert len(dropped) == 3 and all(r["status"] == "timeout" and "fixed" in r["reason"] for r in dropped), \
        (fixed_s, slow_pace, fast_worst, dropped)
