"""The WAN benchmark's harness (benchmarks/wan_benchmark.py): its pure accounting on exact cases, and every row at
the tiny size end to end (real baselines; Flower's own FedAvg and crossdc's DiLoCo on the Deployment Engine over the
namespace emulator, the asynchronous row in Flower's simulation engine, the rest in-process)."""

from __future__ import annotations

import importlib
import json
import statistics
import sys
from concurrent.futures import Future
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
            if method.asynchronous:  # versions of K = 4 updates of τ steps: the federation's 4 × steps in all
                assert bench.method_rounds(method, size) * len(bench.DATACENTERS) * size.tau == len(bench.DATACENTERS) * size.steps
                continue
            rounds = bench.method_rounds(method, size)
            taus = [bench.tau_for_round(r, **_schedule(bench.tau_spec(method, size))) for r in range(1, rounds + 1)]
            assert sum(taus) == size.steps, method.key
        assert len(size.deployed) <= 6 and set(size.deployed) <= {m.key for m in bench.methods(size)}
    assert bench.SIZES["full"].steps >= 2000
    assert bench.rounds_for_budget({"start": 10, "end": 50, "warmup_rounds": 4}, 800) == 18  # 10+20+30+40 + 14 × 50
    with pytest.raises(ValueError, match="exactly 7 steps"):
        bench.rounds_for_budget(2, 7)


def test_tuned_settings_reach_the_rows(bench) -> None:
    size = bench.SIZES["full"]
    tuned = {"fedavg": {"lr": 0.005}, "diloco": {"outer_lr": 0.9, "outer_momentum": 0.8},
             "sparseloco": {"chunk_k": 128, "outer_lr": 1.5}}
    rows = bench.method_catalogue(size, tuned)
    assert rows["fedavg-warmup"].lr == rows["flower-fedavg"].lr == rows["fedavg-dgc"].lr == 0.005
    for key in ("diloco", "streaming-diloco", "gossip"):  # the DiLoCo family shares the tuned outer step
        assert rows[key].params["outer_lr"] == 0.9 and rows[key].params["outer_momentum"] == 0.8, key
    assert rows["sparseloco"].codecs[0].startswith("chunk-topk:128:") and rows["sparseloco"].params == {"outer_lr": 1.5}
    doc = bench.row_experiment(rows["fedavg-warmup"], size, seed=2)
    assert doc["run"]["seed"] == 2 and doc["workload"]["lr"] == 0.005 and doc["workload"]["grad_clip"] == 1.0
    assert doc["workload"]["schedule"] == {"kind": "cosine", "warmup_steps": 100, "min_lr": 0.0005}
    assert all(dc["link"] == "transoceanic" for dc in doc["datacenters"]) and "links" not in doc
    assert len(bench.row_experiment(rows["gossip"], size)["links"]) == 6  # every pair of the 4 datacenters
    slow = bench.row_experiment(rows["fedbuff-slow"], size)
    assert [dc.get("speed", 1.0) for dc in slow["datacenters"]] == [1.0, 1.0, 1.0, 0.25]


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
    # each datacenter idles for the rest of every round after its own compute
    second = 1.0 + links[2]
    assert out["utilisation"] == pytest.approx([2.0 / (first + 0.25 + second), 3.0 / (first + 0.25 + second)])
    assert out["exposed_comm_comp"] == pytest.approx((2 * (first + 0.25 + second) - 5.0) / 5.0)


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
    result = bench.run("tiny", tmp_path, jobs=3)  # the deployed rows mostly wait on the emulated WAN
    rows = {r["key"]: r for r in result["rows"]}
    size = bench.SIZES["tiny"]
    assert list(rows) == ["all-workers", "sequential", "sync-dp", *(m.key for m in bench.methods(size)), "diloco-inprocess"]
    for key, row in rows.items():
        assert not row.get("failed"), (key, row.get("failed"))
        assert row["steps"] == size.steps, key  # the same gradient computations per datacenter for everyone
        assert row["curve"] and all(p["val_loss"] > 0 for p in row["curve"]), key
    assert rows["diloco"]["how_run"] == "deployed" and rows["diloco-inprocess"]["how_run"] == "in-process"
    assert rows["fedbuff-slow"]["how_run"] == "simulation" and rows["gossip"]["how_run"] == "in-process"
    # deployed: the trainers' own clocks and the delay line; every datacenter computed and waited
    deployed = rows["diloco"]
    assert all(0 < u < 1 for u in deployed["utilisation"]) and deployed["exposed_comm_comp"] > 0
    assert deployed["comm_s"] > 0 and deployed["wall_s"] > deployed["compute_s"] > 0
    # plain Flower on the Deployment Engine too: its ServerApp's rounds, its clients' compute, the delay line's seconds
    flower = rows["flower-fedavg"]
    assert flower["how_run"] == "deployed" and flower["time_from"].startswith("deployed: plain Flower")
    assert flower["comm_s"] > 0 and flower["wall_s"] > flower["compute_s"] > 0 and all(0 < u < 1 for u in flower["utilisation"])
    for r in flower["per_round"]:  # the ledger saw at least the message sizes each way, framing included
        assert all(link >= payload > 0 for link, payload in zip(r["link_bytes_up"], r["bytes_up"], strict=True))
        assert all(link >= payload > 0 for link, payload in zip(r["link_bytes_down"], r["bytes_down"], strict=True))
    # the calibration: the same training both ways; the weights and bytes agree, the time is what differs
    (calibration,) = result["calibration"]
    assert calibration["row"] == "diloco" and abs(calibration["val_loss_difference"]) < 1e-3
    # the all-workers baseline and the two best crossdc rows over 2 seeds, the other rows over 1
    seeded = [key for key, row in rows.items() if row.get("seed_losses")]
    assert len(seeded) == 4 and "all-workers" in seeded and "sync-dp" in seeded  # sync-dp trains as all-workers
    assert all(len(rows[k]["seed_losses"]) == 2 and rows[k]["val_loss"] == pytest.approx(statistics.median(rows[k]["seed_losses"]))
               for k in seeded)
    params = result["setting"]["params"]
    # measured at the delay line: each of the 4 ranks sends 2(N−1)/N of the fp32 gradient per step, plus headers
    assert size.steps * 2 * 3 * 4 * params <= rows["sync-dp"]["bytes"] <= 1.2 * size.steps * 2 * 3 * 4 * params
    assert rows["sync-dp"]["measured_stretch"]["per_step_comm_s"] > 0
    # dense rows move about the model both ways per datacenter and round; the codecs move less
    dense = rows["diloco-inprocess"]["bytes"]
    assert dense >= 2 * 4 * 4 * params * (size.steps // size.tau)
    assert rows["diloco-int8"]["bytes"] < dense / 2

    def uplink(key: str) -> int:
        return sum(sum(r["bytes_up"]) for r in rows[key]["per_round"])

    def downlink(key: str) -> int:
        return sum(sum(r["bytes_down"]) for r in rows[key]["per_round"])

    # SparseLoCo: sparse both ways; round 1's downlink is the initial weights' digest (every trainer builds them)
    assert uplink("sparseloco") < uplink("diloco-inprocess") / 10 and downlink("sparseloco") < downlink("diloco-inprocess") / 10
    assert all(b < 1_000 for b in rows["diloco-int8"]["per_round"][0]["bytes_down"])
    assert rows["flower-fedavg"]["bytes"] >= dense  # Flower: one Array (and its header) per tensor
    assert rows["streaming-diloco-int4"]["peak_sync_bytes"] < rows["streaming-diloco"]["peak_sync_bytes"] / 4
    assert [g["name"] for g in result["goals"]] == ["loss_gap", "bytes_ratio", "wall_over_compute", "beats_flower"]
    assert all(set(g) == {"name", "row", "figure", "threshold", "met"} for g in result["goals"])
    assert result["pareto_front"] and set(result["pareto_front"]) <= set(rows)
    for name in ("wan_benchmark-tiny.json", "wan_benchmark-tiny.md", "wan_benchmark-tiny.html"):
        assert (tmp_path / name).stat().st_size > 0
    written = json.loads((tmp_path / "wan_benchmark-tiny.json").read_text())
    assert written["table_markdown"] == (tmp_path / "wan_benchmark-tiny.md").read_text().strip()
    assert "| Flower FedAvg" in written["table_markdown"] and "`beats_flower`" in written["table_markdown"]
    # the report is remade from what the run kept, to the same table
    (tmp_path / "wan_benchmark-tiny.md").unlink()
    assert bench.report(json.loads((tmp_path / "wan_benchmark-raw-tiny.json").read_text()), tmp_path)["table_markdown"] \
        == written["table_markdown"]
    # rows measured again in place of the first run's (a calibrated row with its calibration), the others kept as
    # measured; the report says which
    again = bench.rerun("tiny", tmp_path, ["fedavg-warmup", "diloco"])
    assert again["remeasured"][0]["rows"] == ["fedavg-warmup", "diloco"] and again["remeasured"][0]["added"] == []
    assert "Rows measured again on" in again["table_markdown"] and "Rows added on" not in again["table_markdown"]
    kept = {r["key"]: r for r in again["rows"]}
    assert list(kept) == list(rows) and kept["gossip"]["benchmark_wall_s"] == rows["gossip"]["benchmark_wall_s"]
    for key in ("fedavg-warmup", "diloco", "diloco-inprocess"):
        assert kept[key]["benchmark_wall_s"] != rows[key]["benchmark_wall_s"], key
    assert [c["row"] for c in again["calibration"]] == ["diloco"]
    with pytest.raises(SystemExit, match="--rerun takes row keys"):
        bench.rerun("tiny", tmp_path, ["no-such-row"])
    # a row the last run did not have is added, and the report says so
    raw_file = tmp_path / "wan_benchmark-raw-tiny.json"
    raw = json.loads(raw_file.read_text())
    raw["federated"].remove("diloco-short")
    raw["done"] = [r for r in raw["done"] if r["key"] != "diloco-short"]
    raw_file.write_text(json.dumps(raw))
    added = bench.rerun("tiny", tmp_path, ["diloco-short"])
    assert added["remeasured"][-1]["added"] == ["diloco-short"] and "Rows added on" in added["table_markdown"]
    assert [r["key"] for r in added["rows"]] == list(rows)


def test_a_diverging_row_is_recorded_with_the_rounds_it_completed(bench, tmp_path: Path) -> None:
    size = bench.SIZES["tiny"]
    method = next(m for m in bench.methods(size) if m.key == "diloco")
    doc = bench.experiment(method, size, rounds=2)
    doc["workload"]["lr"] = 1e12  # AdamW's first step moves every weight by ~lr: the model overflows
    with pytest.raises(bench.RowFailed, match="round 1: updates refused by the update gate") as failure:
        bench.drive_crossdc(doc, tmp_path, size.eval_every_steps)
    assert failure.value.rounds == []


def _row(key: str, loss: float, bytes_: int, tau: int = 2, wall: float = 2.0, compute: float = 1.0, **extra):
    curve = [{"steps": 4, "bytes": bytes_, "wall_s": wall, "val_loss": loss, "val_accuracy": 0.3}]
    return {"key": key, "label": key, "time_from": "test", "wall_s": wall, "compute_s": compute, "comm_s": 0.5,
            "overhead_s": 0.5, "bytes": bytes_, "steps": 4, "curve": curve, "per_round": [{"tau": tau}],
            "utilisation": [compute / wall], "exposed_comm_comp": (wall - compute) / compute, "peak_sync_bytes": bytes_,
            "projected_comm_comp_ratio": None, **extra}


def test_a_row_measured_again_runs_its_seeds_once_it_is_one_of_the_two_best(bench) -> None:
    done = [_row("all-workers", 1.50, 0), _row("sequential", 1.49, 0), _row("flower-fedavg", 1.40, 9),
            _row("diloco", 1.59, 9), _row("gossip", 1.60, 9), _row("diloco-short", 1.54, 9), _row("fedbuff-slow", 1.55, 9),
            {**_row("diloco-inprocess", 1.30, 9), "calibration": True}]
    repeated = ["all-workers", "diloco", "gossip"]
    # the new rows measured: diloco-short is now one of the two best (fedbuff-slow is too, but was not measured again)
    assert bench.repeated_after_rerun(done, repeated, ["diloco-short"]) == [*repeated, "diloco-short"]
    assert bench.repeated_after_rerun(done, repeated, ["gossip"]) == repeated  # measured again, not one of the best
    # already repeated: listed once
    assert bench.repeated_after_rerun(done, [*repeated, "diloco-short"], ["diloco-short"]) == [*repeated, "diloco-short"]
    assert bench.repeated_after_rerun(done, repeated, ["diloco-short", "fedbuff-slow"]) == \
        [*repeated, "diloco-short", "fedbuff-slow"]


def test_a_failed_row_is_reported_and_left_out_of_the_goals(bench) -> None:
    link = LINK_PROFILES["transoceanic"]
    size = bench.SIZES["tiny"]
    rows = [_row("all-workers", 2.0, 0), _row("sequential", 2.1, 0), _row("sync-dp", 2.0, 10_000_000),
            _row("flower-fedavg", 2.3, 50_000), _row("diloco", 2.2, 40_000),
            {**_row("fedavg-dgc", 9.0, 1_000, tau=1), "failed": "round 2: NaN", "curve": [], "steps": 1}]
    bench.finish_rows(rows)
    failed = rows[-1]
    assert failed["val_loss"] is None and failed["gap_all-workers"] is None and failed["time_to_all_workers_loss_s"] is None
    assert rows[4]["gap_all-workers"] == pytest.approx(0.1) and rows[4]["bytes_ratio_vs_sync"] == pytest.approx(250)
    goals = {g["name"]: g for g in bench.goal_list(rows, size)}
    assert all(g["row"] == "diloco" for g in goals.values())  # the failed row is judged on nothing
    table = bench.markdown(rows, "tiny", size, link, list(goals.values()), bench.pareto_front(rows), "defaults")
    line = next(li for li in table.splitlines() if li.startswith("| fedavg-dgc"))
    assert "failed after 1 of 2 steps" in line and line.count("|") == table.splitlines()[2].count("|")
    assert "- fedavg-dgc failed: round 2: NaN" in table


def test_each_goal_is_judged_on_the_row_that_does_best_on_it(bench) -> None:
    size = bench.SIZES["tiny"]
    common = [_row("all-workers", 2.0, 0), _row("sequential", 2.1, 0), _row("sync-dp", 2.0, 10_000_000, wall=50.0),
              _row("flower-fedavg", 2.3, 50_000, wall=5.0)]
    # met: a row 0.5 % above all-workers; 10,000× fewer bytes; 1.04× its compute; better than Flower at equal τ
    met = [*common, _row("diloco", 2.01, 40_000, wall=3.0), _row("sparseloco", 2.5, 1_000, wall=4.0),
           _row("streaming", 2.2, 60_000, wall=1.04), _row("dgc", 2.05, 30_000, tau=1, wall=9.0)]
    bench.finish_rows(met)
    goals = bench.goal_list(met, size)
    assert goals == [
        {"name": "loss_gap", "row": "diloco", "figure": pytest.approx(0.005), "threshold": 0.01, "met": True},
        {"name": "bytes_ratio", "row": "sparseloco", "figure": pytest.approx(10_000), "threshold": 1000.0, "met": True},
        {"name": "wall_over_compute", "row": "streaming", "figure": pytest.approx(1.04), "threshold": 1.05, "met": True},
        {"name": "beats_flower", "row": "diloco", "figure": 1.0, "threshold": 1.0, "met": True}]
    # missed: 1.5 % above; 999×; 1.06×; the only row better than Flower on both runs at another τ
    missed = [*common, _row("diloco", 2.03, 10_010, tau=1, wall=1.06), _row("fedavg", 2.4, 60_000, wall=3.0)]
    bench.finish_rows(missed)
    goals = bench.goal_list(missed, size)
    assert [(g["row"], g["met"]) for g in goals] == [("diloco", False), ("diloco", False), ("diloco", False), (None, False)]
    assert goals[0]["figure"] == pytest.approx(0.015) and goals[1]["figure"] == pytest.approx(10_000_000 / 10_010)
    assert goals[2]["figure"] == pytest.approx(1.06) and goals[3]["figure"] == 0.0


def test_pareto_front_and_seeds(bench) -> None:
    rows = [_row("all-workers", 1.0, 0, wall=1.0), _row("sync-dp", 2.0, 1_000_000, wall=10.0),
            _row("a", 2.1, 1_000, wall=5.0), _row("b", 2.2, 2_000, wall=6.0),  # b: beaten by a on all three
            _row("c", 2.3, 500, wall=20.0), {**_row("d", 1.5, 10, wall=1.0), "failed": "NaN"},
            {**_row("e", 1.9, 100, wall=1.0), "calibration": True}]
    bench.finish_rows([*rows[:1], _row("sequential", 1.0, 0), *rows[1:]])
    assert bench.pareto_front(rows) == ["sync-dp", "a", "c"]
    assert bench.seed_spread([2.0, 1.8, 2.3]) == {"median": 2.0, "min": 1.8, "max": 2.3, "seeds": 3}
    assert bench.seed_rows([*rows, _row("sequential", 1.0, 0), _row("flower-fedavg", 0.5, 10)]) == ["all-workers", "a", "b"]


def test_an_asynchronous_rows_compute_only_time_is_its_steps_at_the_summed_step_rates(bench) -> None:
    # three datacenters at 10 steps/s, one 4x slower and always busy: the slowest one's compute (40 s) would be the
    # whole run; without the WAN the 325 steps take 325 / 30.625 s
    rounds = [{"round": 1, "tau": 81.25, "compute_s": [10.0, 10.0, 10.0, 40.0], "idle_s": [1.0, 1.0, 1.0, 0.0],
               "comm_s": [0.5] * 4, "bytes_up": [1] * 4, "bytes_down": [1] * 4, "steps_each": [100, 100, 100, 25],
               "round_wall_s": 42.0, "eval_s": 1.0, "val_loss": 2.0, "val_accuracy": 0.1}]
    out = bench.measured_timeline(rounds, asynchronous=True)
    assert out["compute_s"] == pytest.approx(325 / 30.625) and out["wall_s"] == 41.0  # evaluation left out
    assert bench.measured_timeline(rounds)["compute_s"] == 40.0  # a synchronous run: the slowest datacenter's
    assert out["utilisation"] == pytest.approx([10 / 11, 10 / 11, 10 / 11, 1.0]) and out["exposed_comm_comp"] == pytest.approx(3 / 70)


def test_the_tau_probe_keeps_the_rows_that_ran_when_one_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/wan_tau_probe.py: a row whose run raised is reported and left out; the rows that ran are kept, in
    order (before, one failed row lost the whole batch's results)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        probe = importlib.import_module("wan_tau_probe")
    finally:
        sys.path.remove(str(BENCHMARKS))
    futures: dict[str, Future[dict[str, object]]] = {name: Future() for name in ("a@10", "b@10", "c@10")}
    futures["a@10"].set_result({"row": "a@10"})
    futures["b@10"].set_exception(TypeError("Method.__init__() got an unexpected keyword argument 'x'"))
    futures["c@10"].set_result({"row": "c@10"})
    fresh, failed = probe.gather(futures)
    assert fresh == [{"row": "a@10"}, {"row": "c@10"}] and failed == ["b@10"]
    assert "b@10 failed: TypeError: Method.__init__() got an unexpected keyword argument 'x'" in capsys.readouterr().out
