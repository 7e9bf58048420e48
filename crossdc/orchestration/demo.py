"""`crossdc demo`: the main job on one machine, start to finish, with a comparison table."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from crossdc.db.engine import absolute_database_url, make_engine, resolve_database_url, safe_url, upgrade
from crossdc.db.queries import list_datacenter_rounds
from crossdc.deployment.background_server import BackgroundServer, start_background, uvicorn_config
from crossdc.experiment.config import load_config, with_rounds
from crossdc.experiment.processes import PortInUse, ensure_port_free
from crossdc.orchestration.baselines import LOCAL_BASELINES, gap_to, run_baseline
from crossdc.orchestration.local_run import LocalRunOptions, run_local

QUICK_ROUNDS = 2


#: builds the ASGI app that serves a database's run log (the CLI passes the dashboard's: orchestration sits below it)
DashboardFactory = Callable[[str], Any]


def start_dashboard(db_url: str, port: int, console: Console, create_app: DashboardFactory) -> BackgroundServer | None:
    """The dashboard over the demo's database on 127.0.0.1:`port`, or None (and why) if it cannot start."""
    try:
        ensure_port_free("127.0.0.1", port)
        return start_background(uvicorn_config(create_app(db_url), "127.0.0.1", port), "dashboard")
    except (PortInUse, RuntimeError) as err:
        console.print(f"dashboard: not started ({err}); run `crossdc serve --db {safe_url(db_url)} --port N` to see this run")
        return None


def run_demo(config_path: Path, quick: bool, db: str | None, port: int, runs_dir: Path, dashboard_port: int = 8080,
             keep_serving: bool = False, dashboard: DashboardFactory | None = None) -> dict[str, Any]:
    """Run the demo federation, then both single-datacenter baselines; print progress and a final table.

    With a `dashboard` factory (the CLI passes crossdc.dashboard.app.create_app) the dashboard serves the run log
    while the demo runs (its URL is printed first); with `keep_serving` it stays up after the table until Ctrl-C."""
    console = Console(stderr=True)
    if not console.is_terminal:  # a log file or a pipe: do not wrap the table at 80 columns
        console = Console(stderr=True, width=150)
    config = load_config(config_path)
    if quick:
        config = with_rounds(config, QUICK_ROUNDS)
    db_url = absolute_database_url(resolve_database_url(db))
    upgrade(db_url)
    names = ", ".join(config.datacenter_names)
    console.print(f"[bold]crossdc demo[/]: {len(config.datacenters)} datacenters ({names}), {config.workload.dataset} "
                  f"{config.workload.partition['kind']} partition, {config.strategy.name}, {config.run.rounds} rounds")
    links = sorted({dc.link.describe() if dc.link else "loopback (not emulated)" for dc in config.datacenters})
    console.print(f"database: {safe_url(db_url)}")
    console.print(f"WAN links, emulated packet by packet between each datacenter's network namespace and the coordinator: "
                  f"{', '.join(links)}")
    console.print("security: everything on loopback (127.0.0.1), plain HTTP, no TLS and no SuperNode authentication; "
                  "a real federation enrolls its datacenters (see docs/deployment.md)")
    server = start_dashboard(db_url, dashboard_port, console, dashboard) if dashboard is not None else None
    if server is not None:
        console.print(f"dashboard: [bold]{server.url}/[/] (live while the demo runs)")
    try:
        return _run_and_report(console, config, db_url, port, runs_dir, server, keep_serving)
    finally:
        if server is not None:
            server.stop()


#: what run_local and run_baseline report after each round: the run's rounds so far
RoundCallback = Callable[[list[dict[str, Any]]], None]


def round_facts(row: dict[str, Any]) -> str:
    """A finished round in short: ``τ=5 val_loss=0.693 val_acc=51.2% 3.4s`` (what it has of its validation loss,
    accuracy and seconds)."""
    parts = [f"τ={row['tau']}"]
    if row.get("val_loss") is not None:
        parts.append(f"val_loss={row['val_loss']:.3f}")
    if row.get("val_accuracy") is not None:
        parts.append(f"val_acc={100 * row['val_accuracy']:.1f}%")
    if row.get("wall_s") is not None:
        parts.append(f"{row['wall_s']:.1f}s")
    return " ".join(parts)


def round_line(label: str, row: dict[str, Any], total: int) -> str:
    """A finished round as one plain line: ``federation round 2/5: τ=5 val_loss=0.693 val_acc=51.2% 3.4s``."""
    return f"{label} round {row['round']}/{total}: {round_facts(row)}"


class RoundProgress:
    """The demo's progress, one task per run: rich progress bars on a terminal; on a pipe or a log file (where rich
    shows nothing until the end) one plain line per finished round instead."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.fields[status]}"), console=console) if console.is_terminal else None
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RoundProgress:
        if self.bars is not None:
            self.bars.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bars is not None:
            self.bars.stop()

    def track(self, label: str, total: int, status: str = "") -> RoundCallback:
        """The progress callback of a new task of `total` rounds, shown as `label`, starting with `status`."""
        if self.bars is None:
            if status:
                self.console.print(f"{label}: {status}", markup=False, highlight=False)
            printed = 0

            def print_rounds(rows: list[dict[str, Any]]) -> None:
                nonlocal printed  # rounds may arrive several at a time: one line each
                for row in rows[printed:]:
                    self.console.print(round_line(label, row, total), markup=False, highlight=False)
                printed = max(printed, len(rows))

            return print_rounds
        bars = self.bars
        task = self.tasks[label] = bars.add_task(label, total=total, status=status)
        return lambda rows: bars.update(task, completed=len(rows), status=round_facts(rows[-1]))

    def done(self, label: str) -> None:
        """Mark the task `label` done (its bar says so; plain lines need no more)."""
        if self.bars is not None:
            self.bars.update(self.tasks[label], status="done")


def _run_and_report(console: Console, config: Any, db_url: str, port: int, runs_dir: Path, dashboard: BackgroundServer | None,
                    keep_serving: bool) -> dict[str, Any]:
    started = time.perf_counter()
    with RoundProgress(console) as progress:
        on_round = progress.track("federation", config.run.rounds, status="starting trainers and Flower…")
        federation_started = time.perf_counter()
        federated = run_local(config, LocalRunOptions(db_url=db_url, superlink_port=port, runs_root=runs_dir, progress=on_round)).summary
        federation_s = time.perf_counter() - federation_started
        progress.done("federation")
        baselines: dict[str, dict[str, Any]] = {}
        for kind in LOCAL_BASELINES:
            baselines[kind] = run_baseline(config, kind, db_url, uuid.uuid4().hex,
                                           progress=progress.track(f"{kind} baseline", config.run.rounds))
    breakdown = time_breakdown(db_url, federated["run_id"], federated["wall_s"], federation_s)
    _print_table(console, config, federated, baselines, breakdown, time.perf_counter() - started)
    if dashboard is not None:
        console.print(f"this run on the dashboard: {dashboard.url}/runs/{federated['run_id']}")
    typer.echo(federated["run_id"])
    if dashboard is not None and keep_serving:
        console.print("the dashboard keeps serving; Ctrl-C stops it")
        try:
            while dashboard.thread.is_alive():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return {"federated": federated, "baselines": baselines, "breakdown": breakdown}


def time_breakdown(db_url: str, run_id: str, training_s: float, total_s: float) -> dict[str, float]:
    """Where a federated run's time went: the medians per (datacenter, round) of compute, communication, overhead,
    idle and round seconds; the trainers' utilisation Σcompute / (Σcompute + Σidle) and the exposed comm/comp
    Σidle / Σcompute over every datacenter and round; `training_s` (the federation's own wall time, from its first
    message to its last round) against the compute-only time, the slowest datacenter's summed compute_s; and the
    start-up and shut-down around it (`total_s` − `training_s`: trainers, namespaces, Flower)."""
    engine = make_engine(db_url)
    try:
        rows = [r for r in list_datacenter_rounds(engine, run_id) if r["status"] == "ok"]
    finally:
        engine.dispose()
    values = {key: [float(r[key]) for r in rows if r.get(key) is not None]
              for key in ("compute_s", "comm_s", "overhead_s", "idle_s", "round_s")}
    breakdown = {key: (median(found) if found else float("nan")) for key, found in values.items()}
    compute, idle = sum(values["compute_s"]), sum(values["idle_s"])
    per_datacenter: dict[str, float] = {}
    for row in rows:
        per_datacenter[row["datacenter"]] = per_datacenter.get(row["datacenter"], 0.0) + float(row["compute_s"] or 0.0)
    slowest = max(per_datacenter.values(), default=float("nan"))
    breakdown.update(utilisation=compute / (compute + idle) if compute + idle else float("nan"),
                     exposed_comm_comp=idle / compute if compute else float("nan"), training_s=training_s,
                     slowest_compute_s=slowest, wall_over_compute=training_s / slowest if slowest else float("nan"),
                     startup_s=total_s - training_s)
    return breakdown


def _print_table(console: Console, config: Any, federated: dict[str, Any], baselines: dict[str, dict[str, Any]],
                 breakdown: dict[str, float], wall_s: float) -> None:
    table = Table(title=f"{config.run.name}: {config.run.rounds} rounds")
    for column in ("method", "val loss", "val acc", "gap (loss, acc)", "bytes up", "bytes down", "wall s"):
        table.add_column(column, justify="right" if column != "method" else "left")
    table.add_row(f"{config.strategy.name}, {len(config.datacenters)} datacenters", f"{federated['val_loss']:.4f}",
                  f"{100 * federated['val_accuracy']:.1f}%", "", f"{federated['bytes_up_total'] / 1e6:.2f} MB",
                  f"{federated['bytes_down_total'] / 1e6:.2f} MB", f"{federated['wall_s']:.1f}")
    descriptions = {"all-workers": "one datacenter, all workers", "sequential": "one worker, sequential"}
    for kind, baseline in baselines.items():
        gap = gap_to(baseline, federated)
        table.add_row(f"{descriptions[kind]} ({baseline['steps']} steps × batch {baseline['batch_size']})",
                      f"{baseline['val_loss']:.4f}", f"{100 * baseline['val_accuracy']:.1f}%",
                      f"fed. {100 * gap['val_loss_gap_rel']:+.2f}%, {gap['val_accuracy_gap_points']:+.1f} pts",
                      "0", "0", f"{baseline['wall_s']:.1f}")
    console.print(table)
    console.print("gap = (L_federated − L_baseline) / L_baseline on validation loss; accuracy difference in points")
    comm = breakdown["comm_s"]
    comm_text = "not measured" if comm != comm else f"{comm:.3f}s"
    if math.isnan(breakdown["overhead_s"]):  # streaming: the WAN and Flower's work run while the trainers compute
        console.print(f"per datacenter and round (median): compute {breakdown['compute_s']:.2f}s, idle "
                      f"{breakdown['idle_s']:.2f}s; communication {comm_text} on the emulated link and Flower's work "
                      "ran while the trainers computed")
    else:
        console.print(f"per datacenter and round (median): round {breakdown['round_s']:.2f}s = compute "
                      f"{breakdown['compute_s']:.2f}s + communication {comm_text} (measured on the emulated link; "
                      f"ratio comm/comp {breakdown['comm_s'] / breakdown['compute_s']:.2f})"
                      f" + Flower/process overhead {breakdown['overhead_s']:.2f}s")
    console.print(f"trainer utilisation {100 * breakdown['utilisation']:.1f}% (exposed comm/comp "
                  f"{breakdown['exposed_comm_comp']:.3f}: the trainers' waits over their compute); the federation's "
                  f"{breakdown['training_s']:.1f}s from its first message to its last round = "
                  f"{breakdown['wall_over_compute']:.2f}× the slowest datacenter's compute "
                  f"({breakdown['slowest_compute_s']:.1f}s), plus {breakdown['startup_s']:.1f}s of start-up and shut-down")
    console.print(f"demo wall time {wall_s:.0f}s")
