"""`crossdc demo`: the main job on one machine, start to finish, with a comparison table."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from statistics import median
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from crossdc.db.engine import make_engine, resolve_database_url, safe_url, upgrade
from crossdc.db.queries import list_datacenter_rounds
from crossdc.platform.baselines import gap_to, run_baseline
from crossdc.platform.config import load_config, with_rounds
from crossdc.platform.local_run import LocalRunOptions, run_local

QUICK_ROUNDS = 2


def run_demo(config_path: Path, quick: bool, db: str | None, port: int, runs_dir: Path) -> dict[str, Any]:
    """Run the demo federation, then its all-workers baseline; print progress and a final table."""
    console = Console(stderr=True)
    config = load_config(config_path)
    if quick:
        config = with_rounds(config, QUICK_ROUNDS)
    db_url = resolve_database_url(db)
    upgrade(db_url)
    names = ", ".join(config.datacenter_names)
    console.print(f"[bold]crossdc demo[/]: {len(config.datacenters)} datacenters ({names}), {config.workload.dataset} "
                  f"{config.workload.partition['kind']} partition, {config.strategy.name}, {config.run.rounds} rounds")
    console.print(f"database: {safe_url(db_url)}   links: loopback through crossdc's measuring relay (no WAN emulation yet)")
    console.print("dashboard: not built yet (see `crossdc serve`); the run log is in the database above")
    started = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console) as progress:
        task = progress.add_task("federation", total=config.run.rounds, status="starting trainers and Flower…")

        def on_round(rows: list[dict[str, Any]]) -> None:
            row = rows[-1]
            loss = row.get("val_loss")
            status = f"τ={row['tau']} val_loss={loss:.3f}" if loss is not None else f"τ={row['tau']}"
            progress.update(task, completed=len(rows), status=status)

        federated = run_local(config, LocalRunOptions(db_url=db_url, superlink_port=port, runs_root=runs_dir, progress=on_round)).summary
        progress.update(task, status="done")
        base_task = progress.add_task("all-workers baseline", total=config.run.rounds, status="")
        baseline = run_baseline(config, "all-workers", db_url, uuid.uuid4().hex,
                                progress=lambda rows: progress.update(base_task, completed=len(rows)))
    breakdown = _time_breakdown(db_url, federated["run_id"])
    _print_table(console, config, federated, baseline, breakdown, time.perf_counter() - started)
    typer.echo(federated["run_id"])
    return {"federated": federated, "baseline": baseline, "breakdown": breakdown}


def _time_breakdown(db_url: str, run_id: str) -> dict[str, float]:
    """Median per (datacenter, round) of compute, communication and overhead seconds."""
    engine = make_engine(db_url)
    try:
        rows = [r for r in list_datacenter_rounds(engine, run_id) if r["status"] == "ok"]
    finally:
        engine.dispose()
    pick = lambda key: [float(r[key]) for r in rows if r.get(key) is not None]  # noqa: E731
    return {key: (median(pick(key)) if pick(key) else float("nan")) for key in ("compute_s", "comm_s", "overhead_s", "round_s")}


def _print_table(console: Console, config: Any, federated: dict[str, Any], baseline: dict[str, Any], breakdown: dict[str, float], wall_s: float) -> None:
    gap = gap_to(baseline, federated)
    table = Table(title=f"{config.run.name}: {config.run.rounds} rounds")
    for column in ("method", "val loss", "val acc", "gap to all-workers", "bytes up", "bytes down", "wall s"):
        table.add_column(column, justify="right" if column != "method" else "left")
    table.add_row(f"{config.strategy.name} ({len(config.datacenters)} datacenters)", f"{federated['val_loss']:.4f}",
                  f"{100 * federated['val_accuracy']:.1f}%",
                  f"{100 * gap['val_loss_gap_rel']:+.2f}% loss, {gap['val_accuracy_gap_points']:+.1f} pts",
                  f"{federated['bytes_up_total'] / 1e6:.2f} MB", f"{federated['bytes_down_total'] / 1e6:.2f} MB", f"{federated['wall_s']:.1f}")
    table.add_row("one datacenter, all workers", f"{baseline['val_loss']:.4f}", f"{100 * baseline['val_accuracy']:.1f}%", "—",
                  "0", "0", f"{baseline['wall_s']:.1f}")
    console.print(table)
    comm = breakdown["comm_s"]
    comm_text = "not measured" if comm != comm else f"{comm:.3f}s"
    console.print(f"per datacenter and round (median): round {breakdown['round_s']:.2f}s = compute {breakdown['compute_s']:.2f}s"
                  f" + communication {comm_text} (measured at the link relay)"
                  f" + Flower/process overhead {breakdown['overhead_s']:.2f}s")
    console.print(f"demo wall time {wall_s:.0f}s")
