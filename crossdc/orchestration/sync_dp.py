"""The synchronous data-parallel baseline, measured through the emulated WAN: ``crossdc run CONFIG --baseline sync-dp``.

What it runs: every worker of every datacenter is a rank of one gloo group (crossdc.clients.sync_dp_rank), each in
its datacenter's network namespace, so DistributedDataParallel's gradient all-reduce crosses the emulated links at
every step — the traffic crossdc's algorithms exist to avoid. Each datacenter trains on its own shard, as in the
federation; the gradient of a step is that of the datacenters' batches concatenated.

What it logs (``runs.baseline = 'sync-dp'``): for every stretch of steps that equals one federated round (τ(r)
steps), a ``rounds`` row (validation on the federation's set, bytes that crossed the WAN) and one
``datacenter_rounds`` row per datacenter: its compute time (its slowest worker's steps, less the time waiting for
the all-reduce), its ``comm_s`` (the time its links carried packets, from the delay line's ledgers, comm_source
``delay-line``) and the bytes it sent and received. The whole budget is trained, never extrapolated.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crossdc.clients.sync_dp_rank import FINAL_WEIGHTS, report_path
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.processes import ProcessGroup, kill_processes_with_env
from crossdc.experiment.rundir import SETTINGS_LINK_EMULATOR, RunDir
from crossdc.orchestration.local_run import EMULATOR_NAMESPACES, RUN_MARKER_ENV, RunFailed, run_env
from crossdc.wan.ledger import LedgerReader, Transfer, bytes_of_datacenter, read_new_lines, time_in_flight
from crossdc.wan.network import EmulatedNetwork, namespaces_unavailable
from crossdc.wan.topology import mesh_ledger

log = logging.getLogger("crossdc.sync_dp")

KIND = "sync-dp"
RENDEZVOUS_PORT = 29500
#: how long after a round's last step its packets are certainly in the ledgers (the delay line writes them as they leave)
LEDGER_SETTLE_S = 0.5
POLL_S = 0.2


class SyncDPFailed(RunFailed):
    """The baseline could not run or a rank failed (the message says which and where its log is)."""


def _datacenter_ledgers(config: ExperimentConfig, run_dir: RunDir, datacenter: str) -> list[LedgerReader]:
    """Readers of every ledger that carries `datacenter`'s WAN traffic: its star link and its mesh links."""
    paths = [run_dir.link_ledger(datacenter)]
    paths += [run_dir.logs / "links" / f"{mesh_ledger(*link.between)}.ledger" for link in config.links if datacenter in link.between]
    return [LedgerReader(path) for path in paths]


def _read_reports(run_dir: RunDir, world: int, offsets: list[int], lines: dict[int, list[dict[str, Any]]]) -> None:
    """Add the complete new report lines of every rank to `lines` (by round)."""
    for rank in range(world):
        new, offsets[rank] = read_new_lines(report_path(run_dir, rank), offsets[rank])
        for line in new:
            entry = json.loads(line)
            lines.setdefault(int(entry["round"]), []).append(entry)


def run_sync_dp(config: ExperimentConfig, db_url: str, run_id: str, runs_root: Path = Path("runs"),
                progress: Callable[[list[dict[str, Any]]], None] | None = None) -> dict[str, Any]:
    """Train the sync-dp baseline of `config` across the emulated WAN, log it as run `run_id`; return its summary."""
    reason = namespaces_unavailable()
    if reason is not None:
        raise SyncDPFailed(f"the sync-dp baseline all-reduces across the emulated WAN, which needs network namespaces: {reason}")
    run_dir = RunDir(Path(runs_root).resolve() / run_id)
    run_dir.create({"run_id": run_id, "db_url": db_url, "config": config.raw, SETTINGS_LINK_EMULATOR: EMULATOR_NAMESPACES})
    ranks = [(dc.name, local) for dc in config.datacenters for local in range(dc.workers)]
    world = len(ranks)
    network = EmulatedNetwork([(dc.name, dc.link) for dc in config.datacenters],
                              [(*link.between, link.link) for link in config.links], run_dir.logs / "links",
                              seed=config.run.seed, log_path=run_dir.logs / "delay-line.log")
    processes = ProcessGroup()
    history: list[dict[str, Any]] = []
    with RunLog(db_url) as runlog:
        runlog.start_run(run_id=run_id, name=f"{config.run.name} [{KIND} baseline]", strategy=config.strategy.name,
                         config=config.raw, rounds_planned=config.run.rounds, baseline=KIND)
        try:
            network.start()
            master = f"{network.address(ranks[0][0])}:{RENDEZVOUS_PORT}"
            for rank, (name, local) in enumerate(ranks):
                env = run_env(run_dir)
                env["GLOO_SOCKET_IFNAME"] = network.device(name)  # the rank's emulated interface: the WAN
                processes.start(f"rank-{rank}", [
                    sys.executable, "-m", "crossdc.clients.sync_dp_rank",
                    "--run-dir", str(run_dir.path), "--datacenter", name, "--local-rank", str(local), "--rank", str(rank),
                    "--world", str(world), "--master", master],
                    run_dir.logs / f"sync-dp-rank-{rank}.log", env=env, preexec=network.preexec(name))
            summary = _follow(config, run_dir, runlog, run_id, processes, world, history, progress)
            runlog.finish_run(run_id=run_id, status="finished", result=summary)
        except BaseException as err:
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            runlog.finish_run(run_id=run_id, status=status, error=f"{type(err).__name__}: {err}".splitlines()[0])
            raise
        finally:
            processes.stop_all(grace_s=5)
            kill_processes_with_env(RUN_MARKER_ENV, str(run_dir.path))
            network.close()
        runlog.flush(timeout=60)
    return summary


def _follow(config: ExperimentConfig, run_dir: RunDir, runlog: RunLog, run_id: str, processes: ProcessGroup, world: int,
            history: list[dict[str, Any]], progress: Callable[[list[dict[str, Any]]], None] | None) -> dict[str, Any]:
    """Log every round once all ranks reported it and its packets are in the ledgers; fail if a rank fails."""
    readers = {dc.name: _datacenter_ledgers(config, run_dir, dc.name) for dc in config.datacenters}
    offsets = [0] * world
    lines: dict[int, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    next_round = 1
    totals = {"up": 0, "down": 0, "comm_s": 0.0}
    last: dict[str, Any] = {}
    while next_round <= config.run.rounds:
        for managed in processes.processes:
            code = managed.process.poll()
            if code not in (None, 0):
                raise SyncDPFailed(f"{managed.name} exited with code {code}; see {managed.log_path}")
        _read_reports(run_dir, world, offsets, lines)
        entries = lines.get(next_round, [])
        if len(entries) < world or time.time() < max(e["ended"] for e in entries) + LEDGER_SETTLE_S:
            if all(m.process.poll() == 0 for m in processes.processes) and len(entries) < world:
                raise SyncDPFailed(f"the ranks ended without reporting round {next_round}; see {run_dir.logs}")
            time.sleep(POLL_S)
            continue
        row = _log_round(config, runlog, run_id, next_round, entries, readers, totals)
        history.append(row)
        last = row
        if progress:
            progress(history)
        next_round += 1
    for managed in processes.processes:  # the first rank saves the final weights, then all leave the group
        managed.process.wait(timeout=120)
        if managed.process.returncode != 0:
            raise SyncDPFailed(f"{managed.name} exited with code {managed.process.returncode}; see {managed.log_path}")
    steps = sum(int(rows[0]["steps"]) for rows in (lines[r] for r in range(1, config.run.rounds + 1)))
    return {"run_id": run_id, "baseline": KIND, "rounds": config.run.rounds, "batch_size": config.workload.batch_size,
            "datacenters": len(config.datacenters), "ranks": world, "steps": steps,
            "val_loss": last.get("val_loss"), "val_accuracy": last.get("val_accuracy"),
            "bytes_up_total": totals["up"], "bytes_down_total": totals["down"], "comm_s_total": totals["comm_s"],
            "wall_s": time.perf_counter() - started, "final_weights": str(run_dir.path / FINAL_WEIGHTS)}


def _log_round(config: ExperimentConfig, runlog: RunLog, run_id: str, server_round: int, entries: list[dict[str, Any]],
               readers: dict[str, list[LedgerReader]], totals: dict[str, Any]) -> dict[str, Any]:
    """The rounds row and the datacenter rows of one stretch of τ(r) steps."""
    bytes_up = bytes_down = 0
    for dc in config.datacenters:
        mine = [e for e in entries if e["datacenter"] == dc.name]
        start, end = min(e["started"] for e in mine), max(e["ended"] for e in mine)
        transfers: list[Transfer] = [t for reader in readers[dc.name] for t in reader.window(start, end)]
        comm_s = time_in_flight(transfers)
        moved = bytes_of_datacenter(transfers, dc.name)
        compute_s = max(float(e["compute_s"]) for e in mine)
        round_s = end - start
        runlog.log_datacenter_round(
            run_id=run_id, round=server_round, datacenter=dc.name, status="ok", bytes_up=moved["up"], bytes_down=moved["down"],
            bytes_up_raw=moved["up"], compute_s=compute_s, comm_s=comm_s, round_s=round_s,
            overhead_s=round_s - compute_s - comm_s, idle_s=max(0.0, round_s - compute_s), comm_source=EMULATOR_NAMESPACES,
            link_bytes_up=moved["up"],
            link_bytes_down=moved["down"], train_loss=float(mine[0]["train_loss"]),
            num_examples=int(mine[0]["steps"]) * config.workload.batch_size)
        bytes_up += moved["up"]
        bytes_down += moved["down"]
        totals["comm_s"] += comm_s
    totals["up"] += bytes_up
    totals["down"] += bytes_down
    first = next(e for e in entries if e["rank"] == 0)
    row = {"round": server_round, "tau": int(first["steps"]), "val_loss": first.get("val_loss"),
           "val_accuracy": first.get("val_accuracy"), "bytes_up": bytes_up, "bytes_down": bytes_down, "bytes_up_raw": bytes_up,
           "wall_s": max(e["ended"] for e in entries) - min(e["started"] for e in entries), "eval_s": first.get("eval_s")}
    runlog.log_round(run_id=run_id, **row)
    return row
