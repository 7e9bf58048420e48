"""Asynchronous vs synchronous with one slow datacenter: time to a target validation loss for FedAvg, FedAsync, FedBuff.

Engine: real runs (crossdc.orchestration.local_run.run_local) on Flower's simulation engine — the real ServerApp (the
synchronous loop for FedAvg, crossdc.federation.async_loop for FedAsync and FedBuff), the real ClientApp and
the persistent trainers; no WAN links (simulation has none). Time is the federation's own wall clock (the sum of
the ``rounds`` rows' ``wall_s``, from the first task to the version that reaches the target), so process start-up
is left out.

Set-up: MNIST-1D, MLP (2 × 128), IID partition over 4 datacenters, batch 32, inner AdamW lr 3e-4, τ = 300 local
steps per update for every strategy. Three datacenters at relative speed 1 and one at 0.25 (4× slower). The
speeds are emulated by the trainers' pacing (crossdc.clients.local_training.LocalTrainer) and all scaled by
SPEED_SCALE, so that the four trainers need about 1.3 of this machine's 2 cores and do not slow each other down
(the relative speeds are what matter). FedAsync: mixing rate 0.6, inverse staleness scale, max_staleness 16;
FedBuff: K = 4 (the number of datacenters), lr 1, inverse staleness scale, max_staleness 16.

Two policies bound staleness (``staleness_policy``): ``discard`` (the update of a datacenter that comes back staler
than ``max_staleness`` is thrown away) and ``wait`` (a fast datacenter is sent no new work while it could make a
task in flight that stale). With max_staleness 16 the slow datacenter's updates (staleness ≤ 12) are never too
stale, so the policies are compared side by side at a tight bound: FedAsync at max_staleness 4 and FedBuff at 1.

Per row: time and versions to the target, final and best validation loss and the model the run kept
(``run.keep_best``: best-weights.npz, its version), updates per datacenter, the busy share of the fast datacenters
(their compute seconds over the federation's wall time), the seconds the fast datacenters were held (wait) and the
staleness distribution of the updates (applied and discarded).

Usage: python benchmarks/async_strategies.py [--quick] [--target 1.15] [--out benchmarks/results/async_strategies.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from results_file import write_results

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_async_updates, list_datacenter_rounds, list_events, list_rounds
from crossdc.experiment.config import parse_config
from crossdc.orchestration.local_run import LocalRunOptions, run_local

ENGINE = ("real runs on Flower's simulation engine (crossdc.orchestration.local_run, engine=simulation): real ServerApp "
          "(synchronous loop / crossdc.federation.async_loop), ClientApp and persistent trainers; no WAN links")
DATACENTERS = (("dc-1", 1.0), ("dc-2", 1.0), ("dc-3", 1.0), ("slow", 0.25))
SPEED_SCALE = 0.4
TAU = 300
TARGET_VAL_LOSS = 1.15
#: (row, strategy, global versions, parameters, label): about the same wall time for each policy-free row (one slow
#: round ≈ 3 fast FedBuff steps ≈ 13 FedAsync ones); the wait rows produce as many versions as their discard twins
ROWS: tuple[tuple[str, str, int, dict[str, Any], str], ...] = (
    ("fedavg", "fedavg", 20, {}, "FedAvg (synchronous)"),
    ("fedasync", "fedasync", 240, {"lr": 0.6, "max_staleness": 16}, "FedAsync (α 0.6, 1/(1+s), max_staleness 16)"),
    ("fedbuff", "fedbuff", 60, {"max_staleness": 16}, "FedBuff (K = 4, 1/(1+s), max_staleness 16)"),
    ("fedasync-s4-discard", "fedasync", 240, {"lr": 0.6, "max_staleness": 4, "staleness_policy": "discard"},
     "FedAsync, max_staleness 4, discard"),
    ("fedasync-s4-wait", "fedasync", 240, {"lr": 0.6, "max_staleness": 4, "staleness_policy": "wait"},
     "FedAsync, max_staleness 4, wait"),
    ("fedbuff-s1-discard", "fedbuff", 60, {"max_staleness": 1, "staleness_policy": "discard"},
     "FedBuff, max_staleness 1, discard"),
    ("fedbuff-s1-wait", "fedbuff", 60, {"max_staleness": 1, "staleness_policy": "wait"}, "FedBuff, max_staleness 1, wait"),
)


def config(row: str, strategy: str, versions: int, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": {"name": f"async-bench-{row}", "rounds": versions, "seed": 0, "eval_every": 1},
        "workload": {"dataset": "mnist1d", "model": "mlp", "partition": {"kind": "iid"}, "batch_size": 32,
                     "optimizer": "adamw", "lr": 3e-4},
        "strategy": {"name": strategy, "tau": TAU, "params": params},
        "datacenters": [{"name": name, "speed": speed * SPEED_SCALE} for name, speed in DATACENTERS],
    }


def measure(row_name: str, strategy: str, versions: int, params: dict[str, Any], target: float, root: Path) -> dict[str, Any]:
    """One run; what the table and the JSON show about it."""
    db_url = f"sqlite:///{root / f'{row_name}.db'}"
    started = time.perf_counter()
    result = run_local(parse_config(config(row_name, strategy, versions, params)),
                       LocalRunOptions(db_url=db_url, engine="simulation", runs_root=root / row_name))
    engine = make_engine(db_url)
    try:
        rounds = list_rounds(engine, result.run_id)
        dc_rounds = list_datacenter_rounds(engine, result.run_id)
        updates = list_async_updates(engine, result.run_id)
        events = list_events(engine, result.run_id)
    finally:
        engine.dispose()
    elapsed, curve, reached = 0.0, [], None
    for row in rounds:
        elapsed += row["wall_s"] or 0.0
        curve.append((row["round"], round(elapsed, 3), row["val_loss"]))
        if reached is None and row["val_loss"] is not None and row["val_loss"] <= target:
            reached = (row["round"], elapsed)
    wall = elapsed
    fast = [name for name, speed in DATACENTERS if speed == 1.0]
    busy = {name: sum(r["compute_s"] or 0.0 for r in dc_rounds if r["datacenter"] == name) / wall for name, _ in DATACENTERS}
    if updates:
        per_dc = Counter(u["datacenter"] for u in updates)
        staleness = {status: dict(sorted(Counter(u["staleness"] for u in updates if u["status"] == status).items()))
                     for status in ("applied", "discarded")}
    else:  # synchronous: one update per datacenter and round, all from the current model
        per_dc = Counter(r["datacenter"] for r in dc_rounds if r["status"] == "ok")
        staleness = {"applied": {0: sum(per_dc.values())}, "discarded": {}}
    losses = [v for _, _, v in curve if v is not None]
    held_s = sum(e["detail"]["waited_s"] for e in events if e["kind"] == "released")
    return {
        "row": row_name, "strategy": strategy, "params": params, "versions": len(rounds), "wall_s": wall,
        "kept_val_loss": result.summary["best_val_loss"], "kept_version": result.summary["best_round"],
        "held_s": held_s, "discarded": sum(u["status"] == "discarded" for u in updates),
        "versions_to_target": reached[0] if reached else None, "time_to_target_s": reached[1] if reached else None,
        "final_val_loss": losses[-1], "best_val_loss": min(losses), "final_val_accuracy": rounds[-1]["val_accuracy"],
        "updates_per_datacenter": dict(sorted(per_dc.items())), "busy_share": busy,
        "fast_busy_share": sum(busy[n] for n in fast) / len(fast), "staleness": staleness,
        "curve": curve, "run_s_with_startup": time.perf_counter() - started,
    }


def _staleness_cell(staleness: dict[str, dict[int, int]]) -> str:
    applied = " ".join(f"{s}:{n}" for s, n in staleness["applied"].items())
    discarded = " ".join(f"{s}:{n}" for s, n in staleness["discarded"].items())
    return applied + (f"; discarded {discarded}" if discarded else "")


def markdown(rows: list[dict[str, Any]], target: float) -> str:
    speeds = ", ".join(f"{n} {s:g}" for n, s in DATACENTERS)
    lines = [f"MNIST-1D MLP, IID, 4 datacenters (relative speeds {speeds}; emulated × {SPEED_SCALE}), τ = {TAU}, "
             f"Flower simulation: time to validation loss ≤ {target}",
             "", "| row | time to target | versions to target | final / best val loss | kept model (version) "
             "| updates per datacenter (dc-1 dc-2 dc-3 slow) | fast datacenters busy | held (summed over datacenters) "
             "| staleness (applied s:count) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    labels = {name: label for name, *_, label in ROWS}
    for r in rows:
        counts = " ".join(str(r["updates_per_datacenter"].get(n, 0)) for n, _ in DATACENTERS)
        reached = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else f"> {r['wall_s']:.0f} s"
        versions = str(r["versions_to_target"]) if r["versions_to_target"] is not None else f"> {r['versions']}"
        lines.append(f"| {labels[r['row']]} | {reached} | {versions} | {r['final_val_loss']:.3f} / {r['best_val_loss']:.3f} "
                     f"| {r['kept_val_loss']:.3f} ({r['kept_version']}) | {counts} | {100 * r['fast_busy_share']:.0f} % "
                     f"| {r['held_s']:.1f} s | {_staleness_cell(r['staleness'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the versions (a smoke test)")
    parser.add_argument("--target", type=float, default=TARGET_VAL_LOSS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "async_strategies.json"))
    args = parser.parse_args()
    print(f"engine: {ENGINE}", flush=True)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, strategy, full_versions, params, _ in ROWS:
            versions = max(4, full_versions // 4) if args.quick else full_versions
            row = measure(name, strategy, versions, params, args.target, Path(tmp))
            rows.append(row)
            print(f"  {name:<19} {row['versions']} versions in {row['wall_s']:.1f}s: to {args.target}: "
                  f"{row['time_to_target_s'] and round(row['time_to_target_s'], 1)}s; final val loss "
                  f"{row['final_val_loss']:.3f}; updates {row['updates_per_datacenter']}", flush=True)
    table = markdown(rows, args.target)
    result = {"engine": ENGINE, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "quick": args.quick,
              "target_val_loss": args.target, "datacenters": dict(DATACENTERS), "speed_scale": SPEED_SCALE, "tau": TAU,
              "strategies": rows, "wall_s": time.perf_counter() - started, "table_markdown": table}
    write_results(args.out, result, table)


if __name__ == "__main__":
    main()
