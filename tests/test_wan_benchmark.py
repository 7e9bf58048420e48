"""The WAN benchmark's harness (benchmarks/wan_benchmark.py): its pure accounting on exact cases, and every row at
the tiny size end to end (real baselines, Flower's own FedAvg in Flower's simulation engine, crossdc in-process)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.wan.cost_model import flower_message_pair_time, ring_allreduce_time

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
    # each way: the chunk on one connection (RTT + its bytes), the 6 small objects on the other (6 RTTs), so
    # 3 RTTs + 0.6 s + 0.6 s with data; 3 RTTs + two ways of 6 objects over 2 connections (3 RTTs) with none
    links = [flower_message_pair_time(1_000_000, 500_000, 0.1, 1.0, 0.5), flower_message_pair_time(1_000_000, 0, 0.1, 1.0, 0.0),
             flower_message_pair_time(0, 0, 0.1, 0.0, 0.0)]
    assert links == pytest.approx([0.3 + 1.1 + 0.6, 0.3 + 1.1 + 0.3, 0.3 + 0.3 + 0.3])
    first = max(1.0 + links[0], 2.0 + links[1])
    assert out["wall_s"] == pytest.approx(first + 0.25 + 1.0 + links[2])
    assert out["compute_s"] == pytest.approx(3.0) and out["bytes"] == 2_500_000 and out["steps"] == 10
    assert out["curve"] == [{"steps": 5, "bytes": 2_500_000, "wall_s": pytest.approx(first + 0.25), "val_loss": 3.0, "val_accuracy": 0.1}]
    # Flower's FedAvg: one Array per tensor, more objects, more round trips on the same bytes
    assert bench.timeline(rounds, link, tensors=30, records=2)["wall_s"] > out["wall_s"]


def test_sync_data_parallel_adds_its_measured_wan_time_to_every_step(bench) -> None:
    link = LINK_PROFILES["transoceanic"]
    all_workers = {"compute_s": 10.0, "steps": 100,
                   "curve": [{"steps": 100, "bytes": 0, "wall_s": 10.0, "val_loss": 2.0, "val_accuracy": 0.4}]}
    measured = {"per_step_s": 0.6, "per_step_compute_s": 0.1, "per_step_bytes": 30_000}
    row = bench.sync_dp_row(all_workers, params=1000, n=4, link=link, measured=measured)
    assert row["bytes"] == 100 * 30_000 and row["comm_s"] == pytest.approx(100 * 0.5)
    assert row["wall_s"] == pytest.approx(10.0 + 100 * 0.5)  # the measured WAN time per step, added to every step
    assert row["cost_model_per_step_comm_s"] == pytest.approx(ring_allreduce_time(4000, 4, link.bandwidth_mbps, link.rtt_ms))
    assert row["cost_model_per_step_bytes"] == 2 * 3 * 4000
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
    # measured at the delay line: each of the 4 ranks sends 2(N−1)/N of the fp32 gradient per step, plus headers
    assert size.steps * 2 * 3 * 4 * params <= rows["sync-dp"]["bytes"] <= 1.2 * size.steps * 2 * 3 * 4 * params
    assert rows["sync-dp"]["measured_stretch"]["per_step_comm_s"] > 0
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


def test_a_diverging_row_is_recorded_with_the_rounds_it_completed(bench, tmp_path: Path) -> None:
    size = bench.SIZES["tiny"]
    method = next(m for m in bench.methods(size) if m.key == "diloco")
    doc = bench.experiment(method, size, rounds=2)
    doc["workload"]["lr"] = 1e12  # AdamW's first step moves every weight by ~lr: the model overflows
    with pytest.raises(bench.RowFailed, match="round 1: updates refused by the update gate") as failure:
        bench.drive_crossdc(doc, tmp_path, size.eval_every_steps)
    assert failure.value.rounds == []


def test_a_failed_row_is_reported_and_left_out_of_the_goals(bench) -> None:
    link = LINK_PROFILES["transoceanic"]
    size = bench.SIZES["tiny"]

    def row(key: str, loss: float, bytes_: int, tau: int = size.tau, **extra):
        curve = [{"steps": 4, "bytes": bytes_, "wall_s": 2.0, "val_loss": loss, "val_accuracy": 0.3}]
        return {"key": key, "label": key, "time_from": "test", "wall_s": 2.0, "compute_s": 1.0, "comm_s": 0.5,
                "overhead_s": 0.5, "bytes": bytes_, "steps": 4, "curve": curve, "per_round": [{"tau": tau}],
                "projected_comm_comp_ratio": None, **extra}

    rows = [row("all-workers", 2.0, 0), row("sequential", 2.1, 0), row("sync-dp", 2.0, 10_000_000),
            row("flower-fedavg", 2.3, 50_000), row("diloco", 2.2, 40_000),
            {**row("fedavg-dgc", 9.0, 1_000, tau=1), "failed": "round 3: NaN", "curve": [], "steps": 2}]
    bench.finish_rows(rows)
    failed = rows[-1]
    assert failed["val_loss"] is None and failed["gap_all-workers"] is None and failed["time_to_sync_loss_s"] is None
    assert rows[4]["gap_all-workers"] == pytest.approx(0.1) and rows[4]["bytes_ratio_vs_sync"] == pytest.approx(250)
    verdicts = bench.goals(rows, size)
    assert "best crossdc row diloco at +10.0 %" in verdicts[0] and "fedavg-dgc" not in "".join(verdicts)
    assert "rows: diloco (Flower" in verdicts[3]
    table = bench.markdown(rows, "tiny", size, link, verdicts)
    line = next(li for li in table.splitlines() if li.startswith("| fedavg-dgc"))
    assert "failed after 2 of 4 steps" in line and line.count("|") == table.splitlines()[2].count("|")
    assert "- fedavg-dgc failed: round 3: NaN" in table
