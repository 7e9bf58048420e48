"""The asynchronous federated loop on Flower's Grid (FedAsync, FedBuff): each update is applied as it arrives.

Flower has no asynchronous strategy; this loop builds one on the Grid's push and pull, with the synchronous
loop's pieces: discovery and rediscovery (:mod:`crossdc.federation.grid_io`) and the round session
(:class:`crossdc.federation.session.RoundSession`: train messages, the update gate, records, the run log).

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
- **Waiting instead of discarding.** Under ``staleness_policy = "wait"`` a datacenter whose reply came is sent its
  next task only while that cannot make any task in flight arrive staler than ``max_staleness``
  (crossdc.strategies.asynchronous.dispatch_keeps_bound, the worst order of arrivals assumed); otherwise it is
  held (a ``held`` event) and sent its task as soon as the replies in flight allow (a ``released`` event with the
  seconds it waited). No update is then discarded for staleness; the price is that fast datacenters wait for the
  slowest when they run more than ``max_staleness`` versions ahead of it, and for a dead one until its task times
  out.
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

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from crossdc import protocol
from crossdc.db.records import DatacenterRoundRecord
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.rundir import RunDir
from crossdc.federation.grid_io import POLL_INTERVAL_S, FederationError, Reply, pull_replies, rediscover
from crossdc.federation.server_checkpoint import SETTINGS_ATTEMPT, SETTINGS_RESUME, ServerCheckpointer
from crossdc.federation.session import merge_rows, update_cosines
from crossdc.federation.sync_loop import MAX_ROUNDS_WITHOUT_UPDATES, down_reason, start_session
from crossdc.protocol import payload_bytes
from crossdc.strategies.asynchronous import AsyncStrategy, Submitted, dispatch_keeps_bound
from crossdc.strategies.base import StrategyError

log = logging.getLogger("crossdc.async_federation")

#: the longest pause between two polls while nothing arrives (kept short: every reply starts a datacenter's next task)
MAX_POLL_INTERVAL_S = 0.1
#: how long past its deadline a task may still answer before the loop records a timeout itself
TIMEOUT_GRACE_S = 5.0
#: how often the loop looks for datacenters that came back under a new node (also at every version)
REDISCOVER_EVERY_S = 10.0

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


class AsyncFederation:
    """One asynchronous run on a Grid (see the module docstring); :meth:`run` drives it to its end."""

    def __init__(self, grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> None:
        self.grid, self.run_dir, self.run_id, self.config, self.runlog = grid, run_dir, run_id, config, runlog
        def ready_detail(strategy: Any) -> dict[str, Any]:
            if not isinstance(strategy, AsyncStrategy):
                raise FederationError(f"strategy '{strategy.name}' is not asynchronous")
            return {"asynchronous": True, "buffer_size": strategy.buffer_size(), "max_staleness": strategy.max_staleness}

        self.session, self.nodes = start_session(grid, run_dir, run_id, config, runlog, ready_detail, liveness=True)
        self.strategy: AsyncStrategy = self.session.strategy  # type: ignore[assignment]  # checked by ready_detail
        self.seen_nodes = set(self.nodes.values())
        self.version = 0
        self.seq = 0
        self.tasks_sent = {name: 0 for name in self.nodes}
        #: per datacenter, the number of its newest task whose reply (or timeout) the loop has handled
        self.handled = {name: 0 for name in self.nodes}
        #: `handled` as it was at each retained checkpoint's version (a resume to one rewinds each datacenter to it)
        self.handled_at: dict[int, dict[str, int]] = {}
        settings = run_dir.settings()
        self.attempt = int(settings.get(SETTINGS_ATTEMPT, 1))
        self.checkpointer = ServerCheckpointer.from_settings(settings, config.checkpoint.every_rounds,
                                                             config.checkpoint.keep, config.run.rounds)
        #: in a resumed attempt, per datacenter, the task its state rewinds to (its newest handled at the checkpoint)
        self.resumed_from: dict[str, int] = {}
        self.in_flight: dict[str, Task] = {}  # by message id
        #: datacenters with no task, waiting to be sent one (FedBuff's max_staleness = 0, or staleness_policy wait)
        self.held: list[str] = []
        self.held_since: dict[str, float] = {}  # by datacenter, under staleness_policy wait: when it was held
        self.rows: list[tuple[str, DatacenterRoundRecord]] = []  # the current version's datacenter-round records
        self.row_at: dict[int, int] = {}  # an update's sequence number → its record's index in self.rows
        self.bytes_down_now = 0  # bytes of the tasks sent at the current version
        self.unusable_in_a_row = 0
        self.counts = {"applied": 0, "discarded": 0, "unusable": 0}
        self.all_down_since: float | None = None  # (monotonic) since when every datacenter is marked down
        if settings.get(SETTINGS_RESUME):
            self._resume()

    def _carried(self) -> dict[str, Any]:
        """What a checkpoint keeps of the loop (besides the session's weights, strategy state, totals, best model)."""
        return {"version": self.version, "seq": self.seq, "tasks_sent": dict(self.tasks_sent), "handled": dict(self.handled),
                "handled_at": {v: dict(h) for v, h in self.handled_at.items()}, "counts": dict(self.counts),
                "unusable_in_a_row": self.unusable_in_a_row}

    def _resume(self) -> None:
        """Continue from the newest intact checkpoint: the run log forgets every version, datacenter row and update
        after it; each datacenter is sent its next task as attempt + 1, rewinding to its state after the task it had
        last answered when the checkpoint was taken (what it trained past that is trained again)."""
        version, carried = self.session.resume(self.checkpointer, self.attempt, self.nodes)
        self.version, self.seq = int(carried["version"]), int(carried["seq"])
        assert version == self.version
        self.runlog.forget_versions_after(run_id=self.run_id, version=self.version, seq=self.seq)
        for name in self.nodes:  # numbers go on from the checkpoint's; a datacenter new to the run starts at 0
            self.tasks_sent[name] = int(carried["tasks_sent"].get(name, 0))
            self.handled[name] = self.resumed_from[name] = int(carried["handled"].get(name, 0))
        self.handled_at = {int(v): dict(h) for v, h in carried["handled_at"].items()}
        self.counts = dict(carried["counts"])
        self.unusable_in_a_row = int(carried["unusable_in_a_row"])

    def _keep_from(self, name: str) -> int | None:
        """The task number from which `name` keeps past states: its newest handled one at the oldest retained
        checkpoint (0 before the first); None when the run takes no checkpoints."""
        if self.checkpointer is None:
            return None
        return self.handled_at.get(self.checkpointer.oldest_round, {}).get(name, 0)

    def _checkpoint(self) -> None:
        """Checkpoint the run at the version just made (right after a server step: no update waits in a buffer, the
        version's rows are written), keeping `handled` of every checkpoint still retained."""
        assert self.checkpointer is not None
        self.handled_at[self.version] = dict(self.handled)
        if self.session.checkpoint(self.checkpointer, self.version, self._carried()):
            # what no rewind can go back to any more (the checkpointer just read which checkpoints are retained)
            oldest = self.checkpointer.oldest_round
            self.handled_at = {v: h for v, h in self.handled_at.items() if v >= oldest}

    @property
    def weights(self) -> dict[str, Any]:
        return self.session.weights

    # ------------------------------------------------------------------ tasks
    def dispatch(self, name: str) -> None:
        """Send `name` its next task: the current global model, its next task number, τ for the next version."""
        self.tasks_sent[name] += 1
        number, upcoming = self.tasks_sent[name], self.version + 1
        tau = self.strategy.tau(upcoming)
        task = protocol.train_config(server_round=number, tau=tau, run_id=self.run_id, run_dir=str(self.run_dir.path),
                                     datacenter=name, global_version=self.version, attempt=self.attempt,
                                     checkpoint_round=self._keep_from(name), resume_round=self.resumed_from.get(name))
        self.session.prepare_model(self.version, upcoming)
        content, downlink_version = self.session.train_message(name, upcoming, task)
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
        self.handled[name] = max(self.handled.get(name, 0), task.number)
        outcome = self.session.judge(name, reply, task.tau, task.pushed_at,
                                     timeout_reason or f"no reply within {self.config.run.round_timeout_s:g}s")
        record = self.session.finish_record(name, outcome, task.pushed_at, bytes_down=task.bytes_down, staleness=staleness)
        self.session.note_outcome(name, outcome, self.version, task.downlink_version)
        if record.status != "ok":
            self.unusable_in_a_row += 1
            self.counts["unusable"] += 1
        elif not self.strategy.admits(staleness):
            self.unusable_in_a_row = 0
            record = self._discard(task, record, staleness)
        else:
            self.unusable_in_a_row = 0
            assert outcome.update is not None
            self.strategy.submit(outcome.update, staleness, seq=self.seq, base_version=task.base_version)
        self.row_at[self.seq] = len(self.rows)
        self.rows.append((name, record))
        if self.unusable_in_a_row >= MAX_ROUNDS_WITHOUT_UPDATES * len(self.nodes):
            raise FederationError(f"{self.unusable_in_a_row} replies in a row without one usable update; see the events")
        if self.strategy.ready():
            self.step()
        if self.version >= self.config.run.rounds:
            return
        self.held.append(name)
        self.release_held()

    def may_dispatch(self, name: str) -> bool:
        """Whether `name` may be sent a task now (see the module docstring: the three reasons to hold it)."""
        if name in self.session.down():
            return False  # marked down by the heartbeat: no work until it beats again
        strategy = self.strategy
        if strategy.max_staleness == 0 and strategy.waiting(name):
            return False  # its next task starts from the next version
        if not strategy.waits_for_stragglers:
            return True
        return dispatch_keeps_bound(self.version, [task.base_version for task in self.in_flight.values()],
                                    len(strategy.submitted), strategy.buffer_size(), strategy.max_staleness)

    def release_held(self) -> None:
        """Send a task to every held datacenter that may have one now, in the order they were held."""
        if self.version >= self.config.run.rounds:
            return
        pending, self.held = self.held, []
        for name in pending:
            if self.may_dispatch(name):
                since = self.held_since.pop(name, None)
                if since is not None:
                    self._held_event("released", name, waited_s=round(time.time() - since, 3))
                self.dispatch(name)
            else:
                if self.strategy.waits_for_stragglers and name not in self.held_since:
                    self.held_since[name] = time.time()
                    self._held_event("held", name)
                self.held.append(name)

    def _fail_if_all_down(self, down: set[str]) -> None:
        """FederationError once every datacenter has been marked down for longer than a task's deadline (nobody is
        left to send work to; without a heartbeat, their tasks' timeouts end the run the same way)."""
        if not set(self.nodes) <= down:
            self.all_down_since = None
            return
        now = time.monotonic()
        if self.all_down_since is None:
            self.all_down_since = now
        elif now - self.all_down_since > self.config.run.round_timeout_s:
            raise FederationError(f"every datacenter has been down (no heartbeat) for over "
                                  f"{self.config.run.round_timeout_s:g}s: the asynchronous run cannot go on")

    def _held_event(self, kind: str, name: str, **detail: Any) -> None:
        bases = [task.base_version for task in self.in_flight.values()]
        self.runlog.log_event(run_id=self.run_id, kind=kind, round=self.version, datacenter=name,
                              detail={"version": self.version, "oldest_in_flight": min(bases) if bases else None,
                                      "max_staleness": self.strategy.max_staleness, **detail})

    def _discard(self, task: Task, record: DatacenterRoundRecord, staleness: int) -> DatacenterRoundRecord:
        bound = self.strategy.max_staleness
        self.counts["discarded"] += 1
        self.runlog.log_async_update(run_id=self.run_id, seq=self.seq, datacenter=task.datacenter,
                                     base_version=task.base_version, applied_version=self.version, staleness=staleness,
                                     scale=None, status="discarded", bytes_up=int(record.bytes_up or 0))
        self.runlog.log_event(run_id=self.run_id, kind="discarded", round=self.version, datacenter=task.datacenter,
                              detail={"staleness": staleness, "max_staleness": bound, "base_version": task.base_version,
                                      "version": self.version, "task": task.number})
        # only what is applied counts as raw bytes and examples (as for rejected updates)
        return record.replace(status="rejected", bytes_up_raw=0, num_examples=None,
                              reason=f"stale update discarded: staleness {staleness} > max_staleness {bound}")

    # ------------------------------------------------------------------ versions
    def step(self) -> None:
        """The strategy's server step: version t → t + 1; log version t's updates and rows, then version t + 1."""
        applied_at = self.version
        new_weights, applied = self.strategy.step(self.weights)
        self._log_applied(applied)
        self.session.weights = new_weights
        self.version += 1
        self._close_version(applied_at)
        if self.checkpointer is not None and self.checkpointer.due(self.version):
            self._checkpoint()
        if self.version < self.config.run.rounds:
            self._rediscover()
            self.release_held()

    def _log_applied(self, applied: Sequence[Submitted]) -> None:
        """The async_updates rows of a step's updates (all arrived at the current version: their rows are at hand),
        and each row's update_cosine against the step's aggregate (see crossdc.federation.session.update_cosines)."""
        updates = [entry.update for entry in applied]
        cosines = update_cosines(updates, self.strategy.mean_update(updates)) if len(updates) > 1 else {}
        for entry in applied:
            self.counts["applied"] += 1
            index = self.row_at[entry.seq]
            name, record = self.rows[index]
            self.runlog.log_async_update(run_id=self.run_id, seq=entry.seq, datacenter=entry.update.datacenter,
                                         base_version=entry.base_version, applied_version=self.version,
                                         staleness=entry.staleness, scale=entry.scale, status="applied",
                                         bytes_up=int(record.bytes_up or 0))
            if entry.update.datacenter in cosines:
                self.rows[index] = (name, record.replace(update_cosine=cosines[entry.update.datacenter]))

    def _close_version(self, version: int) -> None:
        """Write version `version`'s datacenter rows, evaluate if due, and log the rounds row of version + 1."""
        by_datacenter: dict[str, list[DatacenterRoundRecord]] = {}
        for name, record in self.rows:
            by_datacenter.setdefault(name, []).append(record)
        for name, records in by_datacenter.items():
            self.runlog.log_datacenter_round(run_id=self.run_id, round=version, datacenter=name, record=merge_rows(records))
        made = self.version
        eval_s = self.session.evaluate_if_due(made)
        now = time.perf_counter()
        self.session.log_round(made, self.strategy.tau(made), [record for _, record in self.rows], self.bytes_down_now,
                               now - self.version_started, eval_s)
        self.version_started = now
        self.rows, self.row_at, self.bytes_down_now = [], {}, 0
        self.session.check_run_log(f"version-{made}")

    def _rediscover(self) -> None:
        """Move datacenters that came back under a new node; their tasks on the old node are lost (timeouts)."""
        self.last_rediscovery = time.monotonic()
        moved = rediscover(self.grid, self.nodes, self.seen_nodes, self.config, self.runlog, self.run_id, self.version,
                           heartbeat=self.session.heartbeat_offer)
        for name in moved:
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
            down = self.session.down()
            for message_id, task in list(self.in_flight.items()):
                # a datacenter down since its task was sent may never answer it (its node may have died)
                lost = task.datacenter in self.session.down_since(time.monotonic() - (time.time() - task.pushed_at))
                if self.version < target and message_id in self.in_flight and (task.pushed_at < late or lost):
                    del self.in_flight[message_id]
                    self.handle(task, None, down_reason(self.config) if lost else "")
            if self.held and self.version < target:
                self.release_held()  # (a datacenter held while down goes back to work once it beats again)
            self._fail_if_all_down(down)
            if self.version < target and time.monotonic() - self.last_rediscovery > REDISCOVER_EVERY_S:
                self._rediscover()
            if self.version < target and not self.in_flight and not self.held:
                raise FederationError("no task in flight and none waiting: the asynchronous loop cannot go on")
            interval = POLL_INTERVAL_S if replies else min(MAX_POLL_INTERVAL_S, interval * 1.5)
            if self.version < target:
                time.sleep(interval)
        self.session.save_final_weights()
        if self.in_flight:
            self.runlog.log_event(run_id=self.run_id, kind="in-flight-abandoned", round=self.version,
                                  detail={"tasks": sorted(f"{t.datacenter}#{t.number}" for t in self.in_flight.values())})
        return self.session.summary(time.perf_counter() - started, versions=self.version, updates=dict(self.counts))


def run_async(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    """Run an asynchronous strategy's experiment to its end on `grid` (see the module docstring); the summary."""
    try:
        federation = AsyncFederation(grid, run_dir, run_id, config, runlog)
    except StrategyError as err:
        raise FederationError(str(err)) from None
    federation.session.watch_liveness()
    try:
        return federation.run()
    finally:
        federation.session.close()
