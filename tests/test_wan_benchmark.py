"""The WAN benchmark's harness (benchmarks/wan_benchmark.py): its pure accounting on exact cases, and every row at
the tiny size end to end (real baselines, Flower's own FedAvg in Flower's simulation engine, crossdc in-process)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from crossdc.platform.cost_model import flower_round_trips, ring_allreduce_time
from crossdc.platform.links import LINK_PROFILES, LinkSpec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("wan_benchmark")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_every_method_spends_exactly_the_budget(bench) -> None:
    for size in bench.SIZES.values():
        for method in bench.methods(size):
            rounds = bench.rounds_for_budget(bench.tau_spec(method, size), size.steps)
            taus = [bench.tau_for_round(r, **_schedule(bench.tau_spec(method, size))) for r in range(1, rounds + 1)]
            assert sum(taus) == size.steps, method.key
    assert bench.rounds_for_budget({"start": 10, "end": 50, "warmup_rounds": 4}, 800) == 18  # 10+20+30+40 + 14 × 50
    with pytest.raises(ValueError, match="exactly 7 steps"):
        bench.rounds_for_budget(2, 7)


def _schedule(tau):
    return {"start": tau, "end": tau, "warmup_rounds": 0} if isinstance(tau, int) else tau


def test_timeline_adds_the_slowest_datacenter_and_the_platform_time(bench) -> None:
    link = LinkSpec("test", bandwidth_mbps=8.0, rtt_ms=100.0)  # 1 MB/s, 0.1 s per round trip
    rounds = [{"round": 1, "tau": 5, "compute_s": [1.0, 2.0], "bytes_down": [1_000_000, 1_000_000], "bytes_up": [500_000, 0],
               "overhead_s": 0.25, "val_loss": 3.0, "val_accuracy": 0.1},
              {"round": 2, "tau": 5, "compute_s": [1.0, 1.0], "bytes_down": [0, 0], "bytes_up": [0, 0], "overhead_s": 0.0}]
    out = bench.timeline(rounds, link, tensors=1)
    trips = [flower_round_trips(1_000_000, 500_000), flower_round_trips(1_000_000, 0), flower_round_trips(0, 0)]
    first = max(1.0 + 1.5 + trips[0] * 0.1, 2.0 + 1.0 + trips[1] * 0.1)
    assert out["wall_s"] == pytest.approx(first + 0.25 + 1.0 + trips[2] * 0.1)
    assert out["compute_s"] == pytest.approx(3.0) and out["bytes"] == 2_500_000 and out["steps"] == 10
    assert out["curve"] == [{"steps": 5, "bytes": 2_500_000, "wall_s": pytest.approx(first + 0.25), "val_loss": 3.0, "val_accuracy": 0.1}]
    # Flower's FedAvg: one Array per tensor, more objects, more round trips on the same bytes
    assert bench.timeline(rounds, link, tensors=30, records=2)["wall_s"] > out["wall_s"]


def test_sync_data_parallel_pays_a_ring_all_reduce_per_step(bench) -> None:
    link = LINK_PROFILES["transoceanic"]
    all_workers = {"compute_s": 10.0, "steps": 100, "curve": [{"steps": 100, "bytes": 0, "wall_s": 10.0, "val_loss": 2.0, "val_accuracy": 0.4}]}
    row = bench.sync_dp_row(all_workers, params=1000, n=4, link=link)
    assert row["bytes"] == 100 * 2 * 3 * 4000
    assert row["wall_s"] == pytest.approx(10.0 + 100 * ring_allreduce_time(4000, 4, link.bandwidth_mbps, link.rtt_ms))
    assert bench.time_to_loss([{"wall_s": 1.0, "val_loss": 3.0}, {"wall_s": 2.0, "val_loss": 1.9}], 2.0) == 2.0
    assert bench.time_to_loss([{"wall_s": 1.0, "val_loss": 3.0}], 2.0) is None


@pytest.mark.timeout(900)
def test_every_row_runs_at_the_tiny_size(bench, tmp_path: Path) -> None:
    result = bench.run("tiny", tmp_path)
    rows = {r["key"]: r for r in result["rows"]}
    size = bench.SIZES["tiny"]
    assert list(rows) == ["all-workers", "sequential", "sync-dp", *(m.key for m in bench.methods(size))]
    for key, row in rows.items():
        assert row["steps"] == size.steps, key  # the same gradient computations per datacenter for everyone
        assert row["curve"] and all(p["val_loss"] > 0 for p in row["curve"]), key
    params = result["setting"]["params"]
    assert rows["sync-dp"]["bytes"] == size.steps * 2 * 3 * 4 * params
    # dense rows move about the model both ways per datacenter and round; the codecs move less
    dense = rows["diloco"]["bytes"]
    assert dense >= 2 * 4 * 4 * params * (size.steps // size.tau)
    assert rows["diloco-int8"]["bytes"] < dense / 2
    assert rows["flower-fedavg"]["bytes"] >= dense  # Flower: one Array (and its header) per tensor
    assert rows["scaffold"]["bytes"] > 1.9 * dense  # the control variates travel too
    for name in ("wan_benchmark-tiny.json", "wan_benchmark-tiny.md", "wan_benchmark-tiny.html"):
        assert (tmp_path / name).stat().st_size > 0
    written = json.loads((tmp_path / "wan_benchmark-tiny.json").read_text())
    assert written["table_markdown"] == (tmp_path / "wan_benchmark-tiny.md").read_text().strip()
    assert "| Flower FedAvg" in written["table_markdown"]
