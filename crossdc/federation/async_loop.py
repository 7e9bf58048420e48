"""The asynchronous federated loop on Flower's Grid (FedAsync, FedBuff): each update is applied as it arrives.

Flower has no asynchronous strategy; this loop builds one on the Grid's push and pull, with the synchronous
loop's pieces (:mod:`crossdc.federation.sync_loop`: discovery and rediscovery, the update gate
:func:`~crossdc.federation.sync_loop.judge_reply`, link measurements; the downlink codecs; the run log).

Promises:

- **Logical clock.** The global model has a version: 0 at the start, +1 at every server step of the strategy
  (FedAsync: every applied update; FedBuff: every K). An update computed from version v that arrives while the
  model is at version t has staleness s = t − v; if applied, it is applied *at* version t (to version t's
  weights, making version t + 1). Order comes from versions and arrival sequence numbers, never from wall-clock.
- **Nobody waits for the slowest.** Every datacenter has one task in flight; when its reply comes — applied,
  discarded, rejected, failed or timed out — it is sent the current global model at once (so a datacenter
  whose update was too stale trains next on a fresh model, never on a stale one). One exception: with
  ``max_staleness = 0``, a datacenter whose update waits in FedBuff's buffer gets its next task when the buffer
  is applied (a second task from the same version could only race the flush; with K = number of datacenters
  this makes FedBuff exactly synchronous FedAvg).
- **Task numbers.** A task carries the datacenter's own task number as its ``round``: 1, 2, 3, … per
  datacenter, strictly increasing and never reused (also after a timeout), which is what the datacenter's
  trainer and its state store check (a message older than the last task trained there is refused). The
  task's base version is in its config as ``global-version``; τ is the strategy's schedule at version + 1.
- **The gate and the bound.** Every reply passes the update gate; an accepted update with s > ``max_staleness``
  is discarded: it never touches the model, and is recorded (``async_updates.status = discarded``, a
  ``discarded`` event, its ``datacenter_rounds`` row ``rejected`` with the reason).
- **Run log.** Per update, an ``async_updates`` row (``seq`` = arrival order from 1; a discarded one has
  ``applied_version`` = the version it arrived at, so staleness = applied − base holds for every row). Per
  version t and datacenter, one ``datacenter_rounds`` row with ``round`` = t and ``staleness`` set, for every
  reply that arrived while the model was at version t (a fast datacenter's several FedBuff updates share one
  row: bytes, seconds and examples add up, train loss is example-weighted, staleness and drift the largest);
  these rows are written when version t + 1 is made, before its ``rounds`` row, so a version's rows are
  complete once the next ``rounds`` row exists. One ``rounds`` row per version 1 … R (validation every
  ``run.eval_every`` versions and at R); its bytes are those of the replies that arrived at the version before
  (up) and of the tasks sent then (down).
- **The end.** ``run.rounds`` = R is the number of versions to produce: the run ends when version R exists,
  with the final weights saved. Tasks still in flight are abandoned: their replies are never pulled and
  recorded nowhere, their trainers finish the task and are stopped with the run. Nothing is left in a buffer
  (version R is made by a step, which empties it).
- **Failure.** A task not answered within ``run.round_timeout_s`` is recorded as timed out and the datacenter
  is sent a new one; a datacenter that rejoins under a new node loses its task the same way. The run fails after
  MAX_ROUNDS_WITHOUT_UPDATES × (number of datacenters) unusable replies in a row (failed, rejected, timed out).
  ``run.min_replies`` has no meaning here (no round to close) and is ignored.

Cost: on Flower's Deployment Engine an idle SuperNode pulls every 3 s, so each update there pays up to a few
seconds of delivery overhead (under the simulation engine ≈ 0.1 s); τ should make local compute well above it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from crossdc import protocol as wire
from crossdc.workloads import model_weights
from crossdc.compression.downlink import DownlinkSender
from crossdc.protocol import CONFIG_KEY, encode_tensors, payload_bytes, raw_fp32_bytes
from crossdc.db.errors import DatabaseUnavailable
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.builders import build_strategy, build_workload, initial_model
from crossdc.federation.sync_loop import (MAX_ROUNDS_WITHOUT_UPDATES, POLL_INTERVAL_S, FederationError, Judged, Reply,
                                         _evaluate, _link_measurements, discover_datacenters, judge_reply, pull_replies,
                                         rediscover)
from crossdc.wan.link_relay import LedgerReader
from crossdc.experiment.rundir import RunDir
from crossdc.federation.update_gate import update_size_limit
from crossdc.strategies.aggregation import cosine, subtract
from crossdc.strategies.asynchronous import AsyncStrategy, Submitted
from crossdc.strategies.base import ClientUpdate, StrategyError

log = logging.getLogger("crossdc.async_federation")

#: config key of a task: the global version its weights are
GLOBAL_VERSION = wire.GLOBAL_VERSION
#: the longest pause between two polls while nothing arrives (kept short: every reply starts a datacenter's next task)
MAX_POLL_INTERVAL_S = 0.1
#: how long past its deadline a task may still answer before the loop records a timeout itself
TIMEOUT_GRACE_S = 5.0
#: how often the loop looks for datacenters that came back under a new node (also at every version)
REDISCOVER_EVERY_S = 10.0

_SUMMED = ("bytes_up", "bytes_down", "bytes_up_raw", "compute_s", "comm_s", "overhead_s", "round_s", "link_bytes_up",
           "link_bytes_down", "num_examples")
_LARGEST = ("staleness", "drift_l2")


@dataclass(frozen=True)
class Task:
    """One piece of work in flight: a datacenter training from one global version."""

    datacenter: str
    number: int  # the datacenter's own task number, sent as `round`
    base_version: int
    tau: int
    pushed_at: float  # wall-clock (time.time), for durations only
    bytes_down: int
    downlink_version: int | None = None  # the downlink reference version it was sent (downlink codecs only)


def merge_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``datacenter_rounds`` row for several replies of one datacenter at one version (see the module doc):
    status ok if any was, reasons joined, counts and seconds summed, train loss example-weighted over the replies
    that kept their example count (else their plain mean), staleness and drift the largest, update cosine the mean."""
    if len(rows) == 1:
        return dict(rows[0])
    merged: dict[str, Any] = {"status": "ok" if any(r["status"] == "ok" for r in rows) else rows[-1]["status"]}
    reasons = list(dict.fromkeys(r["reason"] for r in rows if r.get("reason")))
    if reasons:
        merged["reason"] = "; ".join(reasons)[:500]
    for keys, combine in ((_SUMMED, sum), (_LARGEST, max)):
        for key in keys:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                merged[key] = combine(values)
    losses = [(r["train_loss"], r["num_examples"]) for r in rows if r.get("train_loss") is not None and r.get("num_examples")]
    if not losses:  # only discarded or rejected updates (their example counts are not kept): a plain mean
        losses = [(r["train_loss"], 1) for r in rows if r.get("train_loss") is not None]
    if losses:
        merged["train_loss"] = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    cosines = [r["update_cosine"] for r in rows if r.get("update_cosine") is not None]
    if cosines:
        merged["update_cosine"] = sum(cosines) / len(cosines)
    source = next((r["comm_source"] for r in rows if r.get("comm_source")), None)
    if source is not None:
        merged["comm_source"] = source
    return merged


class AsyncFederation:
    """One asynchronous run on a Grid (see the module docstring); :meth:`run` drives it to its end."""

    def __init__(self, grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> None:
        self.grid, self.run_dir, self.run_id, self.config, self.runlog = grid, run_dir, run_id, config, runlog
        runlog.add_flower_run_id(run_id=run_id, flower_run_id=int(grid.run.run_id))
        self.workload = build_workload(config)
        strategy = build_strategy(config)
        if not isinstance(strategy, AsyncStrategy):
            raise FederationError(f"strategy '{strategy.name}' is not asynchronous")
        self.strategy: AsyncStrategy = strategy
        self.model = initial_model(config, self.workload)
        self.weights = model_weights(self.model)
        self.nodes = discover_datacenters(grid, config, runlog, run_id)
        self.seen_nodes = set(self.nodes.values())
        self.regions = {dc.name: dc.region for dc in config.datacenters}
        for name in self.nodes:
            runlog.touch_datacenter(name=name, region=self.regions[name])
        runlog.log_event(run_id=run_id, kind="federation-ready", round=0,
                         detail={"datacenters": sorted(self.nodes), "asynchronous": True,
                                 "buffer_size": self.strategy.buffer_size(), "max_staleness": self.strategy.max_staleness})
        self.links = {name: LedgerReader(run_dir.link_ledger(name)) for name in self.nodes}
        self.downlink = (DownlinkSender(config.compression.downlink_codecs, seed=config.run.seed)
                         if config.compression.downlink_codecs else None)
        self.max_bytes = update_size_limit(raw_fp32_bytes(self.weights), len(self.strategy.reply_groups),
                                           config.security.max_update_mb)
        self.version = 0
        self.seq = 0
        self.tasks_sent = {name: 0 for name in self.nodes}
        self.in_flight: dict[str, Task] = {}  # by message id
        self.held: list[str] = []  # datacenters waiting for the next version (max_staleness = 0)
        self.rows: list[tuple[str, dict[str, Any]]] = []  # the current version's datacenter_rounds rows
        self.row_by_seq: dict[int, dict[str, Any]] = {}  # the same rows, by the update's sequence number
        self.bytes_down_now = 0  # bytes of the tasks sent at the current version
        self.records: tuple[int, dict[str, Any]] | None = None  # (version, encoded weights) for the tasks
        self.unusable_in_a_row = 0
        self.counts = {"applied": 0, "discarded": 0, "unusable": 0}
        self.totals = {"bytes_up": 0, "bytes_down": 0}
        self.worker_pids: dict[str, list[list[int]]] = {name: [] for name in self.nodes}
        self.val_loss = self.val_accuracy = float("nan")

    # ------------------------------------------------------------------ tasks
    def dispatch(self, name: str) -> None:
        """Send `name` its next task: the current global model, its next task number, τ for the next version."""
        self.tasks_sent[name] += 1
        number, upcoming = self.tasks_sent[name], self.version + 1
        tau = self.strategy.tau(upcoming)
        cfg: dict[str, Any] = {wire.ROUND: number, wire.TAU: tau, wire.RUN_ID: self.run_id,
                               wire.RUN_DIR: str(self.run_dir.path), wire.DATACENTER: name, GLOBAL_VERSION: self.version}
        cfg.update(self.strategy.client_config(upcoming))
        if self.records is None or self.records[0] != self.version:
            records = encode_tensors(self.weights) if self.downlink is None else {}
            for group, arrays in self.strategy.client_arrays(upcoming, self.weights).items():
                records.update(encode_tensors(arrays, group))
            if self.downlink is not None:
                self.downlink.prepare(self.weights, upcoming)
            self.records = (self.version, records)
        model_records: dict[str, Any] = {}
        downlink_version = None
        if self.downlink is not None:
            model_records, downlink_cfg = self.downlink.message_for(name)
            cfg.update(downlink_cfg)
            downlink_version = self.downlink.version
        content = RecordDict({**model_records, **self.records[1], CONFIG_KEY: ConfigRecord(cfg)})
        message = Message(content, dst_node_id=self.nodes[name], message_type=MessageType.TRAIN,
                          ttl=self.config.run.round_timeout_s)
        size = payload_bytes(content)
        (message_id,) = list(self.grid.push_messages([message]))
        self.in_flight[message_id] = Task(name, number, self.version, tau, time.time(), size, downlink_version)
        self.bytes_down_now += size

    def handle(self, task: Task, reply: Reply | None, timeout_reason: str = "") -> None:
        """Judge one reply (None: none came), decide its fate, record it, and start the datacenter's next task."""
        self.seq += 1
        name, staleness = task.datacenter, self.version - task.base_version
        outcome = judge_reply(reply, self.weights, task.tau, self.config.workload.batch_size, task.pushed_at,
                              timeout_reason or f"no reply within {self.config.run.round_timeout_s:g}s",
                              self.strategy.reply_groups, compressed=bool(self.config.compression.codecs),
                              max_bytes=self.max_bytes)
        row = outcome.row
        row.update(bytes_down=task.bytes_down, staleness=staleness)
        if "round_s" in row:
            row.update(_link_measurements(self.links[name], task.pushed_at, task.pushed_at + row["round_s"]))
        if row["status"] == "ok":
            row["overhead_s"] = row["round_s"] - row["compute_s"] - (row["comm_s"] or 0.0)
        if row["status"] != "timeout":
            self.runlog.touch_datacenter(name=name, region=self.regions[name])
        self._note_workers(name, outcome)
        if row["status"] == "ok" and self.downlink is not None:
            self.downlink.acknowledge(name, task.downlink_version)  # it holds that reference, whatever happens next
        if row["status"] != "ok":
            self.unusable_in_a_row += 1
            self.counts["unusable"] += 1
            self.runlog.log_event(run_id=self.run_id, kind=row["status"], round=self.version, datacenter=name,
                                  detail=row["reason"])
        elif not self.strategy.admits(staleness):
            self.unusable_in_a_row = 0
            self._discard(task, row, staleness)
        else:
            self.unusable_in_a_row = 0
            assert outcome.update is not None
            update = ClientUpdate(name, outcome.update.delta, outcome.update.num_examples, outcome.update.metrics,
                                  outcome.update.extras)
            self.strategy.submit(update, staleness, seq=self.seq, base_version=task.base_version)
        self.rows.append((name, row))
        self.row_by_seq[self.seq] = row
        self.totals["bytes_up"] += int(row.get("bytes_up", 0))
        if self.unusable_in_a_row >= MAX_ROUNDS_WITHOUT_UPDATES * len(self.nodes):
            raise FederationError(f"{self.unusable_in_a_row} replies in a row without one usable update; see the events")
        if self.strategy.ready():
            self.step()
        if self.version >= self.config.run.rounds:
            return
        if self.strategy.max_staleness == 0 and self.strategy.waiting(name):
            self.held.append(name)  # its next task starts from the next version (see the module docstring)
        else:
            self.dispatch(name)

    def _discard(self, task: Task, row: dict[str, Any], staleness: int) -> None:
        bound = self.strategy.max_staleness
        self.counts["discarded"] += 1
        row.update(status="rejected", reason=f"stale update discarded: staleness {staleness} > max_staleness {bound}")
        row.pop("bytes_up_raw", None)  # only what is applied counts as raw bytes (as for rejected updates)
        row.pop("num_examples", None)
        self.runlog.log_async_update(run_id=self.run_id, seq=self.seq, datacenter=task.datacenter,
                                     base_version=task.base_version, applied_version=self.version, staleness=staleness,
                                     scale=None, status="discarded", bytes_up=int(row.get("bytes_up", 0)))
        self.runlog.log_event(run_id=self.run_id, kind="discarded", round=self.version, datacenter=task.datacenter,
                              detail={"staleness": staleness, "max_staleness": bound, "base_version": task.base_version,
                                      "version": self.version, "task": task.number})

    def _note_workers(self, name: str, outcome: Judged) -> None:
        if outcome.worker_pids is None:
            return
        history = self.worker_pids[name]
        if history and history[-1] != list(outcome.worker_pids):
            self.runlog.log_event(run_id=self.run_id, kind="trainer-restarted", round=self.version, datacenter=name,
                                  detail={"before": history[-1], "now": list(outcome.worker_pids)})
        if not history or history[-1] != list(outcome.worker_pids):
            history.append(list(outcome.worker_pids))

    # ------------------------------------------------------------------ versions
    def step(self) -> None:
        """The strategy's server step: version t → t + 1; log version t's updates and rows, then version t + 1."""
        applied_at = self.version
        new_weights, applied = self.strategy.step(self.weights)
        self._log_applied(applied, subtract(new_weights, self.weights) if len(applied) > 1 else None)
        self.weights = new_weights
        self.version += 1
        self._close_version(applied_at)
        held, self.held = self.held, []
        if self.version < self.config.run.rounds:
            self._rediscover()
            for name in held:
                self.dispatch(name)

    def _log_applied(self, applied: Sequence[Submitted], direction: dict[str, np.ndarray] | None) -> None:
        """The async_updates rows of a step's updates (all arrived at the current version: their rows are at hand);
        with several updates, each row's update_cosine against the step actually taken."""
        for entry in applied:
            self.counts["applied"] += 1
            row = self.row_by_seq[entry.seq]
            self.runlog.log_async_update(run_id=self.run_id, seq=entry.seq, datacenter=entry.update.datacenter,
                                         base_version=entry.base_version, applied_version=self.version,
                                         staleness=entry.staleness, scale=entry.scale, status="applied",
                                         bytes_up=int(row.get("bytes_up", 0)))
            if direction is not None:
                row["update_cosine"] = cosine(entry.update.delta, direction)

    def _close_version(self, version: int) -> None:
        """Write version `version`'s datacenter rows, evaluate if due, and log the rounds row of version + 1."""
        by_datacenter: dict[str, list[dict[str, Any]]] = {}
        for name, row in self.rows:
            by_datacenter.setdefault(name, []).append(row)
        for name, rows in by_datacenter.items():
            self.runlog.log_datacenter_round(run_id=self.run_id, round=version, datacenter=name, **merge_rows(rows))
        made = self.version
        eval_s = None
        if made % self.config.run.eval_every == 0 or made == self.config.run.rounds:
            self.val_loss, self.val_accuracy, eval_s = _evaluate(self.model, self.workload, self.weights)
            if not np.isfinite(self.val_loss):
                self.runlog.log_event(run_id=self.run_id, kind="diverged", round=made, detail=f"validation loss {self.val_loss}")
        now = time.perf_counter()
        self.totals["bytes_down"] += self.bytes_down_now
        self.runlog.log_round(
            run_id=self.run_id, round=made, tau=self.strategy.tau(made),
            val_loss=self.val_loss if eval_s is not None else None,
            val_accuracy=self.val_accuracy if eval_s is not None else None,
            bytes_up=sum(int(r.get("bytes_up", 0)) for _, r in self.rows), bytes_down=self.bytes_down_now,
            bytes_up_raw=sum(int(r.get("bytes_up_raw", 0)) for _, r in self.rows),
            wall_s=now - self.version_started, eval_s=eval_s,
        )
        self.version_started = now
        self.rows, self.row_by_seq, self.bytes_down_now = [], {}, 0
        self.runlog.heartbeat(run_id=self.run_id)
        try:
            self.runlog.raise_if_failed()
        except DatabaseUnavailable:
            path = self.run_dir.path / f"weights-version-{made}.npz"
            np.savez(path, **self.weights)
            log.error("database unavailable for too long: stopping at version %d; global weights saved to %s", made, path)
            raise

    def _rediscover(self) -> None:
        """Move datacenters that came back under a new node; their tasks on the old node are lost (timeouts)."""
        self.last_rediscovery = time.monotonic()
        before = dict(self.nodes)
        rediscover(self.grid, self.nodes, self.seen_nodes, self.config, self.runlog, self.run_id, self.version)
        for name in [n for n in self.nodes if self.nodes[n] != before[n]]:
            for message_id, task in list(self.in_flight.items()):
                if task.datacenter == name:
                    del self.in_flight[message_id]
                    self.handle(task, None, "the datacenter rejoined under a new node; its task was lost")

    # ------------------------------------------------------------------ driver
    def run(self) -> dict[str, Any]:
        started = self.version_started = time.perf_counter()
        self.last_rediscovery = time.monotonic()
        for name in self.nodes:
            self.dispatch(name)
        interval = POLL_INTERVAL_S
        target = self.config.run.rounds
        while self.version < target:
            pending = set(self.in_flight)
            replies = pull_replies(self.grid, pending)
            for message_id, reply in sorted(replies.items(), key=lambda item: item[1].received_at):
                if self.version >= target:
                    break  # the run is complete: what else came is abandoned
                task = self.in_flight.pop(message_id, None)
                if task is not None:  # (None: given up on meanwhile, when its datacenter rejoined)
                    self.handle(task, reply)
            late = time.time() - self.config.run.round_timeout_s - TIMEOUT_GRACE_S
            for message_id, task in list(self.in_flight.items()):
                if self.version < target and task.pushed_at < late and message_id in self.in_flight:
                    del self.in_flight[message_id]
                    self.handle(task, None)
            if self.version < target and time.monotonic() - self.last_rediscovery > REDISCOVER_EVERY_S:
                self._rediscover()
            if self.version < target and not self.in_flight and not self.held:
                raise FederationError("no task in flight and none waiting: the asynchronous loop cannot go on")
            interval = POLL_INTERVAL_S if replies else min(MAX_POLL_INTERVAL_S, interval * 1.5)
            if self.version < target:
                time.sleep(interval)
        np.savez(self.run_dir.final_weights, **self.weights)
        if self.in_flight:
            self.runlog.log_event(run_id=self.run_id, kind="in-flight-abandoned", round=self.version,
                                  detail={"tasks": sorted(f"{t.datacenter}#{t.number}" for t in self.in_flight.values())})
        return {
            "run_id": self.run_id,
            "rounds": target,
            "versions": self.version,
            "val_loss": self.val_loss,
            "val_accuracy": self.val_accuracy,
            "bytes_up_total": self.totals["bytes_up"],
            "bytes_down_total": self.totals["bytes_down"],
            "wall_s": time.perf_counter() - started,
            "updates": dict(self.counts),
            "worker_pids": self.worker_pids,
        }


def run_async(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    """Run an asynchronous strategy's experiment to its end on `grid` (see the module docstring); the summary."""
    try:
        federation = AsyncFederation(grid, run_dir, run_id, config, runlog)
    except StrategyError as err:
        raise FederationError(str(err)) from None
    return federation.run()
