"""One run's coordinator state and every step the round loops share (written once).

The synchronous loop (:mod:`crossdc.federation.sync_loop`), the asynchronous loop
(:mod:`crossdc.federation.async_loop`) and the in-process driver (:mod:`crossdc.testing.inprocess`) each hold
only what differs between them; everything else is a :class:`RoundSession` method:

- **the run's pieces**: workload, strategy, global weights, the downlink sender, the gate's rules;
- **building a train message** (:meth:`RoundSession.train_message`): the global model (dense, or through the
  downlink codecs), the strategy's tensor groups and config, crossdc's own config keys
  (:func:`crossdc.protocol.train_config`);
- **judging a reply** at the update gate (:meth:`RoundSession.judge`, :meth:`RoundSession.judge_content`) and the
  round's norm-outlier check (:meth:`RoundSession.reject_outliers`);
- **the server step** (:meth:`RoundSession.aggregate`): the round's aggregate of the accepted updates computed
  once, handed to the strategy, and each update's ``update_cosine`` against it (:func:`update_cosines`);
- **recording**: a reply's outcome (the datacenter seen, an event for what went wrong, a trainer restart), a
  datacenter-round record finished with its link measurements, a round's row, the DB-outage dump of the
  weights, the run summary;
- **the best model** (``run.keep_best``): after every evaluation whose validation loss is the lowest so far, the
  global weights are written to the run folder's best-weights.npz (and the round to the summary's ``best_round``),
  so a run that overfits or ends on a bad version still hands over its best evaluated model; a checkpoint carries
  the best model (a second copy of the weights when it is not the current one), so a resumed run keeps the same
  best model as an uninterrupted one.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from crossdc.compression.downlink import DownlinkSender, FragmentDownlink, weights_digest
from crossdc.db.errors import DatabaseUnavailable
from crossdc.db.records import DatacenterRoundRecord
from crossdc.db.runlog import RunLog
from crossdc.deployment.heartbeat import HeartbeatMonitor, HeartbeatOffer, NodeKeys
from crossdc.experiment.builders import build_strategy, build_workload, initial_model
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.rundir import SETTINGS_HEARTBEAT, SETTINGS_LINK_EMULATOR, SETTINGS_SUPERLINK, RunDir
from crossdc.federation.grid_io import Reply
from crossdc.federation.server_checkpoint import ResumeError, ServerCheckpointer, loop_state, restore_rng
from crossdc.federation.update_gate import GateRules, Judged, judge_content, judge_reply, update_norm_outliers, update_size_limit
from crossdc.protocol import CONFIG_KEY, encode_tensors, raw_fp32_bytes
from crossdc.strategies.aggregation import cosine
from crossdc.strategies.base import Arrays, ClientUpdate, Strategy, StrategyError
from crossdc.wan.ledger import LedgerReader, bytes_by_direction, payload_transfers, time_in_flight
from crossdc.workloads import Workload, evaluate, load_model_weights, model_weights

log = logging.getLogger("crossdc.federation")


@dataclass(frozen=True)
class Dispatch:
    """When a loop's messages went out (wall clock, for durations; monotonic, for the heartbeat) and which
    datacenters the heartbeat had marked down then (RoundSession.sent_now)."""

    at: float
    at_mono: float
    down: frozenset[str]


def update_cosines(updates: Sequence[ClientUpdate], aggregate: Arrays) -> dict[str, float]:
    """``update_cosine`` of each update a server step combined: the cosine between the datacenter's update Δy and
    the step's aggregate of all of them (:meth:`Strategy.mean_update`). Empty when the step combined a single
    update (a cosine with itself says nothing)."""
    if len(updates) < 2:
        return {}
    return {update.datacenter: cosine(update.delta, aggregate) for update in updates}


_SUMMED = ("bytes_up", "bytes_down", "bytes_up_raw", "compute_s", "comm_s", "overhead_s", "idle_s", "round_s", "link_bytes_up",
           "link_bytes_down", "num_examples")
_LARGEST = ("staleness", "drift_l2")


def merge_rows(rows: Sequence[DatacenterRoundRecord]) -> DatacenterRoundRecord:
    """One datacenter-round record for several replies of one datacenter at one version (async) or for one round's
    exchanges (streaming): status ok if any was, reasons joined, counts and seconds summed, train loss example-weighted over the replies
    that kept their example count (else their plain mean), staleness and drift the largest, update cosine the mean."""
    if len(rows) == 1:
        return rows[0]
    merged: dict[str, Any] = {"status": "ok" if any(r.status == "ok" for r in rows) else rows[-1].status}
    reasons = list(dict.fromkeys(r.reason for r in rows if r.reason))
    if reasons:
        merged["reason"] = "; ".join(reasons)[:500]
    for keys, combine in ((_SUMMED, sum), (_LARGEST, max)):
        for key in keys:
            values = [getattr(r, key) for r in rows if getattr(r, key) is not None]
            if values:
                merged[key] = combine(values)
    losses = [(r.train_loss, r.num_examples) for r in rows if r.train_loss is not None and r.num_examples]
    if not losses:  # only discarded or rejected updates (their example counts are not kept): a plain mean
        losses = [(r.train_loss, 1) for r in rows if r.train_loss is not None]
    if losses:
        merged["train_loss"] = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
    cosines = [r.update_cosine for r in rows if r.update_cosine is not None]
    if cosines:
        merged["update_cosine"] = sum(cosines) / len(cosines)
    source = next((r.comm_source for r in rows if r.comm_source), None)
    if source is not None:
        merged["comm_source"] = source
    return DatacenterRoundRecord(**merged)


def link_measurements(link: LedgerReader, start: float, end: float, source: str) -> dict[str, Any]:
    """What the datacenter's link carried for the round's messages during [start, end]: comm_s (seconds
    the link was busy with them), how that was obtained, and their bytes in each direction (protocol
    framing included; idle polls and heartbeats left out, see crossdc.wan.ledger.payload_transfers)."""
    if not link.path.exists():
        return {"comm_s": None, "comm_source": "not measured (no link relay: simulation or external SuperNode)"}
    transfers = payload_transfers(link.window(start, end))
    moved = bytes_by_direction(transfers)
    return {"comm_s": time_in_flight(transfers), "comm_source": source,
            "link_bytes_up": moved["up"], "link_bytes_down": moved["down"]}


class RoundSession:
    """The coordinator side of one run (see the module docstring).

    `runlog` and `run_dir` are None for the in-process driver (nothing is logged, no link is measured)."""

    def __init__(self, config: ExperimentConfig, run_id: str, runlog: RunLog | None = None,
                 run_dir: RunDir | None = None, *, workload: Workload | None = None, strategy: Strategy | None = None,
                 initial_weights: Mapping[str, np.ndarray] | None = None) -> None:
        self.config, self.run_id, self.runlog, self.run_dir = config, run_id, runlog, run_dir
        self.workload = workload if workload is not None else build_workload(config)
        self.strategy = strategy if strategy is not None else build_strategy(config)
        self.model: torch.nn.Module = initial_model(config, self.workload)
        self.weights: dict[str, np.ndarray] = (
            model_weights(self.model) if initial_weights is None
            else {k: np.asarray(v, np.float32).copy() for k, v in initial_weights.items()})
        codecs = config.compression
        streaming = self.strategy.loop == "streaming"
        self.downlink = (DownlinkSender(codecs.downlink_codecs, seed=config.run.seed,
                                        initial_digest=weights_digest(model_weights(self.model)))
                         if codecs.downlink_codecs and not streaming else None)
        #: a streaming run's downlink: its exchanges' results, compressed (the sync loops' is :attr:`downlink`)
        self.fragment_downlink = (FragmentDownlink(codecs.downlink_codecs, self.weights,
                                                   bool(self.strategy.params.get("eager")), seed=config.run.seed)
                                  if codecs.downlink_codecs and streaming else None)
        self.rules = GateRules(batch_size=config.workload.batch_size, reply_groups=tuple(self.strategy.reply_groups),
                               compressed=bool(codecs.codecs),
                               max_bytes=update_size_limit(raw_fp32_bytes(self.weights), len(self.strategy.reply_groups),
                                                           config.security.max_update_mb))
        self.regions = {dc.name: dc.region for dc in config.datacenters}
        self.links = {name: LedgerReader(run_dir.link_ledger(name)) for name in config.datacenter_names} if run_dir else {}
        #: what measured the links: "delay-line" (every packet, namespaces) or "relay" (Flower's connections)
        self.link_source = str(run_dir.settings().get(SETTINGS_LINK_EMULATOR, "relay")) if run_dir else "relay"
        #: per datacenter, the worker groups that served it in order (a new entry only when the group changed)
        self.worker_pids: dict[str, list[list[int]]] = {name: [] for name in config.datacenter_names}
        self.totals = {"bytes_up": 0, "bytes_down": 0}
        self.val_loss = self.val_accuracy = float("nan")
        #: the lowest validation loss evaluated so far and its round/version (run.keep_best); None: none yet
        self.best_val_loss: float | None = None
        self.best_round: int | None = None
        self._records: tuple[int, dict[str, Any]] | None = None  # (model version, its encoded records)
        #: crossdc's heartbeat monitor of the datacenters (None: no heartbeat, see :meth:`watch_liveness`)
        self.liveness: HeartbeatMonitor | None = None
        #: on a standing federation, what the hello offers the datacenters for their heartbeat (see bind_liveness)
        self.heartbeat_offer: HeartbeatOffer | None = None

    # ------------------------------------------------------------------ liveness
    def bind_liveness(self) -> None:
        """Open the heartbeat monitor's socket (judging starts with :meth:`watch_liveness`) when the run asks for a
        heartbeat (``run.heartbeat_timeout_s`` > 0): where its settings say (a local run: its datacenters reach the
        coordinator there, signing with the run's key), or, for a run on a standing federation, on a free port of
        every interface with a secret made now, the port and each node's own key offered in the hello
        (:attr:`heartbeat_offer`; a datacenter's beats verified with the key of the node discovery bound it to:
        beats that come before, once the hello started its trainer, wait in the socket until judging starts).
        A port that cannot be had leaves the run without a heartbeat (a ``heartbeat-off`` event)."""
        timeout_s = self.config.run.heartbeat_timeout_s
        if self.liveness is not None or timeout_s <= 0 or self.run_dir is None:
            return
        settings = self.run_dir.settings()
        address, keys = settings.get(SETTINGS_HEARTBEAT), None
        if not address and settings.get(SETTINGS_SUPERLINK):
            address, keys = ["0.0.0.0", 0], NodeKeys(secrets.token_bytes(32))
        if not address:
            return
        try:
            self.liveness = HeartbeatMonitor(str(address[0]), int(address[1]), self.run_id,
                                             keys.key_of if keys is not None else self.run_dir.authkey(),
                                             self.config.datacenter_names, timeout_s, self._liveness_changed)
        except OSError as err:  # the port is taken: the run goes on, dead datacenters are found by the deadline
            log.warning("no heartbeat monitor on %s: %s", address, err)
            if self.runlog is not None:
                self.runlog.log_event(run_id=self.run_id, kind="heartbeat-off", detail=f"{address}: {err}")
            return
        if keys is not None:
            self.heartbeat_offer = HeartbeatOffer(self.liveness.port, keys)

    def watch_liveness(self) -> None:
        """Start judging the datacenters' heartbeats (binding the monitor first if :meth:`bind_liveness` has not): a
        datacenter silent for longer than ``run.heartbeat_timeout_s`` is marked down at once (a ``datacenter-down``
        event; ``datacenter-up`` when it beats again), and :meth:`down` names it."""
        self.bind_liveness()
        if self.liveness is not None:
            self.liveness.start()

    def _liveness_changed(self, datacenter: str, up: bool, silent_s: float) -> None:
        if self.runlog is not None:
            self.runlog.log_event(run_id=self.run_id, kind="datacenter-up" if up else "datacenter-down",
                                  datacenter=datacenter, detail={"silent_s": round(silent_s, 1),
                                                                 "heartbeat_timeout_s": self.config.run.heartbeat_timeout_s})

    def down(self) -> set[str]:
        """The datacenters marked down by the heartbeat now (empty without one)."""
        return self.liveness.down() if self.liveness is not None else set()

    def down_since(self, since: float) -> set[str]:
        """The datacenters down now or gone down since `since` (time.monotonic), see HeartbeatMonitor.down_since."""
        return self.liveness.down_since(since) if self.liveness is not None else set()

    def came_up_since(self, since: float) -> set[str]:
        """The datacenters back up since `since` (time.monotonic) (empty without a heartbeat)."""
        return self.liveness.came_up_since(since) if self.liveness is not None else set()

    def sent_now(self) -> Dispatch:
        """Mark messages going out now: when, and which datacenters the heartbeat has down (see :meth:`down_after`)."""
        return Dispatch(time.time(), time.monotonic(), frozenset(self.down()))

    def down_after(self, sent: Dispatch) -> set[str]:
        """The datacenters down when `sent` went out or gone down since: they may never answer it (a node that died
        comes back under a new id), so a loop does not wait for their replies."""
        return set(sent.down) | self.down_since(sent.at_mono)

    def given_up(self, sent: Dispatch, message_ids: Mapping[str, str]) -> Callable[[], set[str]]:
        """For :func:`crossdc.federation.grid_io.collect_replies`: the ids, among `message_ids` (by datacenter), of
        the messages sent to a datacenter in :meth:`down_after` `sent`, at the moment of asking."""
        return lambda: {message_ids[name] for name in self.down_after(sent) if name in message_ids}

    def close(self) -> None:
        """Stop what the session runs beside the loop (the heartbeat monitor)."""
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None

    # ------------------------------------------------------------------ messages
    def prepare_model(self, version: int, server_round: int) -> None:
        """Encode the global model of `version` for the train messages of `server_round` (once per version): the
        dense weights (or the downlink's next reference) and the strategy's tensor groups, exactly the ones it
        declares in ``client_groups`` (StrategyError naming the strategy otherwise)."""
        if self._records is not None and self._records[0] == version:
            return
        records: dict[str, Any] = encode_tensors(self.weights) if self.downlink is None else {}
        groups = self.strategy.client_arrays(server_round, self.weights)
        if set(groups) != set(self.strategy.client_groups):
            raise StrategyError(f"strategy '{self.strategy.name}' sent the tensor groups {sorted(groups)} but declares "
                                f"client_groups = {tuple(self.strategy.client_groups)}")
        for group, arrays in groups.items():
            records.update(encode_tensors(arrays, group))
        if self.downlink is not None:
            self.downlink.prepare(self.weights, server_round)
        self._records = (version, records)

    def train_message(self, datacenter: str, server_round: int, task: Mapping[str, Any]) -> tuple[RecordDict, int | None]:
        """The content of `datacenter`'s train message (after :meth:`prepare_model`): the model, the strategy's
        groups and config, and `task` (crossdc's config keys, :func:`crossdc.protocol.train_config`). Also the
        downlink reference version it carries (None without downlink codecs)."""
        if self._records is None:
            raise RuntimeError("prepare_model must come before train_message")
        cfg: dict[str, Any] = {**task, **self.strategy.client_config(server_round)}
        model_records: dict[str, Any] = {}
        downlink_version = None
        if self.downlink is not None:
            model_records, downlink_cfg = self.downlink.message_for(datacenter)
            cfg.update(downlink_cfg)
            downlink_version = self.downlink.version
        return RecordDict({**model_records, **self._records[1], CONFIG_KEY: ConfigRecord(cfg)}), downlink_version

    # ------------------------------------------------------------------ the gate
    def judge(self, datacenter: str, reply: Reply | None, tau: int, pushed_at: float, timeout_reason: str,
              reference: Mapping[str, np.ndarray] | None = None, compute_since: float | None = None) -> Judged:
        """One Flower reply (None: none came) through the update gate, checked against the global weights or, for
        one fragment's update, that fragment's (`reference`); its compute must fit since `compute_since` (default:
        the push)."""
        return judge_reply(reply, datacenter, self.weights if reference is None else reference, tau, pushed_at,
                           timeout_reason, self.rules, compute_since)

    def judge_content(self, datacenter: str, content: RecordDict, tau: int, round_s: float,
                      reference: Mapping[str, np.ndarray] | None = None) -> Judged:
        """One reply's content through the update gate (the in-process driver's replies), checked against the
        global weights or, for one fragment's update, that fragment's (`reference`)."""
        return judge_content(content, datacenter, self.weights if reference is None else reference, tau, round_s,
                             self.rules)

    def reject_outliers(self, judged: dict[str, Judged]) -> None:
        """The round's norm-outlier check (``security.norm_rejection_factor``) over its accepted updates, in place."""
        deltas = {name: j.update.delta for name, j in judged.items() if j.update is not None}
        for name, reason in update_norm_outliers(deltas, self.config.security.norm_rejection_factor).items():
            judged[name] = judged[name].rejected(reason)

    # ------------------------------------------------------------------ the server step
    def aggregate(self, server_round: int, updates: Sequence[ClientUpdate]) -> dict[str, float]:
        """The strategy's server step on the accepted `updates` (their aggregate computed once); the new weights
        replace the global ones. Returns each update's ``update_cosine`` (see :func:`update_cosines`)."""
        mean = self.strategy.mean_update(updates)
        self.weights = self.strategy.aggregate(server_round, self.weights, updates, mean)
        return update_cosines(updates, mean)

    def aggregate_fragment(self, names: Sequence[str],
                           updates: Sequence[ClientUpdate]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """A streaming strategy's server step of one exchange: the aggregate of the fragment's accepted `updates`
        computed once, the strategy's step of those tensors (``fragment_step``), the new values written into the
        global weights. Returns the aggregate and each update's ``update_cosine``."""
        fragment_step = getattr(self.strategy, "fragment_step", None)
        if fragment_step is None:
            raise StrategyError(f"strategy '{self.strategy.name}' has no fragment_step: it is not a streaming strategy")
        mean = self.strategy.mean_update(updates)
        self.weights.update(fragment_step({n: self.weights[n] for n in names}, mean))
        return mean, update_cosines(updates, mean)

    def exchange_result(self, exchange: int, names: Sequence[str], mean: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """What the datacenters are sent of a streaming exchange once its step is done (the strategy's
        ``exchange_result`` of the fragment `names`), through the downlink codecs when the run has some."""
        exchange_result = getattr(self.strategy, "exchange_result", None)
        if exchange_result is None:
            raise StrategyError(f"strategy '{self.strategy.name}' has no exchange_result: it is not a streaming strategy")
        result = exchange_result({n: self.weights[n] for n in names}, mean)
        return result if self.fragment_downlink is None else self.fragment_downlink.encode(exchange, result)

    def evaluate(self, weights: Mapping[str, np.ndarray] | None = None) -> tuple[float, float, float]:
        """(validation loss, accuracy, seconds) of the global weights (or of `weights`, leaving the global ones as they
        are) on the workload's one validation set."""
        started = time.perf_counter()
        load_model_weights(self.model, self.weights if weights is None else weights)
        loss, accuracy = evaluate(self.workload, self.model)
        return loss, accuracy, time.perf_counter() - started

    def evaluate_if_due(self, made: int) -> float | None:
        """Evaluate the model of round/version `made` if ``run.eval_every`` (or the run's end) asks for it; the
        seconds it took, else None. A non-finite loss is logged as ``diverged``."""
        if made % self.config.run.eval_every and made != self.config.run.rounds:
            return None
        self.val_loss, self.val_accuracy, eval_s = self.evaluate()
        if not np.isfinite(self.val_loss):
            self._event("diverged", made, detail=f"validation loss {self.val_loss}")
        elif self.config.run.keep_best and (self.best_val_loss is None or self.val_loss < self.best_val_loss):
            self.best_val_loss, self.best_round = float(self.val_loss), made
            self._write_best(self.weights)
        return eval_s

    def _write_best(self, weights: Mapping[str, np.ndarray] | None) -> None:
        """best-weights.npz := `weights` (None: remove it, no model is the best yet)."""
        if self.run_dir is None:
            return
        if weights is None:
            self.run_dir.best_weights.unlink(missing_ok=True)
        else:
            np.savez(self.run_dir.best_weights, **weights)

    # ------------------------------------------------------------------ recording
    def _event(self, kind: str, at: int, datacenter: str | None = None, detail: Any = None) -> None:
        if self.runlog is not None:
            self.runlog.log_event(run_id=self.run_id, kind=kind, round=at, datacenter=datacenter, detail=detail)

    def note_outcome(self, datacenter: str, outcome: Judged, at: int, downlink_version: int | None = None) -> None:
        """What a judged reply tells about its datacenter, at round/version `at`: it was seen (unless it timed
        out), an event if its reply was not ok, the downlink reference it now holds, a restart of its trainer."""
        status = outcome.record.status
        if status == "ok" and self.downlink is not None:
            self.downlink.acknowledge(datacenter, downlink_version)
        if self.runlog is not None and status != "timeout":
            self.runlog.touch_datacenter(name=datacenter, region=self.regions[datacenter])
        if status != "ok":
            self._event(status, at, datacenter, outcome.record.reason)
        if outcome.worker_pids is not None:
            pids, history = list(outcome.worker_pids), self.worker_pids.setdefault(datacenter, [])
            if history and history[-1] != pids:
                self._event("trainer-restarted", at, datacenter, {"before": history[-1], "now": pids})
            if not history or history[-1] != pids:
                history.append(pids)

    def finish_record(self, datacenter: str, outcome: Judged, pushed_at: float, **columns: Any) -> DatacenterRoundRecord:
        """The datacenter-round record of a judged reply with `columns` set (bytes_down, staleness, ...), the
        link's measurements over its round trip, and, when it is ok, its overhead (round − compute − comm) and its
        trainer's idle time (round − compute: a round loop that does not overlap waits for everything else)."""
        record = outcome.record.replace(**columns)
        link = self.links.get(datacenter)
        if record.round_s is not None and link is not None:
            record = record.replace(**link_measurements(link, pushed_at, pushed_at + record.round_s, self.link_source))
        if record.status == "ok" and record.round_s is not None and record.compute_s is not None:
            # the trainer computes only while it trains (no overlap): the rest of the round it waits
            record = record.replace(overhead_s=record.round_s - record.compute_s - (record.comm_s or 0.0),
                                    idle_s=max(0.0, record.round_s - record.compute_s))
        return record

    def log_round(self, made: int, tau: int, records: Sequence[DatacenterRoundRecord], bytes_down: int, wall_s: float,
                  eval_s: float | None) -> None:
        """The ``rounds`` row of round/version `made` (its bytes: the replies' `records` up, `bytes_down` sent),
        added to the run's totals, then a heartbeat."""
        bytes_up = sum(int(r.bytes_up or 0) for r in records)
        self.totals["bytes_up"] += bytes_up
        self.totals["bytes_down"] += bytes_down
        if self.runlog is None:
            return
        self.runlog.log_round(
            run_id=self.run_id, round=made, tau=tau,
            val_loss=self.val_loss if eval_s is not None else None,
            val_accuracy=self.val_accuracy if eval_s is not None else None,
            bytes_up=bytes_up, bytes_down=bytes_down, bytes_up_raw=sum(int(r.bytes_up_raw or 0) for r in records),
            wall_s=wall_s, eval_s=eval_s,
        )
        self.runlog.heartbeat(run_id=self.run_id)

    def check_run_log(self, label: str) -> None:
        """Raise DatabaseUnavailable if the run log has been down too long — after saving the global weights to
        ``weights-<label>.npz`` in the run folder, so the run stops but its model is not lost with it."""
        if self.runlog is None:
            return
        try:
            self.runlog.raise_if_failed()
        except DatabaseUnavailable:
            if self.run_dir is not None:
                path = self.run_dir.path / f"weights-{label}.npz"
                np.savez(path, **self.weights)
                log.error("database unavailable for too long: stopping at %s; global weights saved to %s", label, path)
            raise

    def resume(self, checkpointer: ServerCheckpointer | None, attempt: int, nodes: Mapping[str, int]) -> tuple[int, dict[str, Any]]:
        """Load the run's newest intact checkpoint into the session (weights, the strategy's state, the latest
        evaluation, byte totals, the downlink sender, worker pids of the datacenters in `nodes`, the RNGs), forget
        what the run log holds past it and record the resume; returns (its round, what the loop carried).
        ResumeError when there is nothing to resume from."""
        if checkpointer is None:
            raise ResumeError("the run has no checkpoints ([checkpoint] every_rounds = 0): nothing to resume from")
        info, state = checkpointer.load_latest(self.run_id)
        server_round = int(state["round"])
        self.weights = state["weights"]
        self.strategy.load_state_dict(state["strategy"])
        carried = state["carried"]
        self.val_loss, self.val_accuracy = carried["val_loss"], carried["val_accuracy"]
        best = carried.get("best") or {}
        self.best_val_loss, self.best_round = best.get("val_loss"), best.get("round")
        if self.config.run.keep_best:  # what was best after the checkpoint is rolled back with its rounds
            self._write_best(best.get("weights") if best.get("weights") is not None
                             else self.weights if self.best_round == server_round else None)
        self.totals = dict(carried["totals"])
        for downlink in (self.downlink, self.fragment_downlink):
            if downlink is not None and carried.get("downlink") is not None:
                downlink.load_state_dict(carried["downlink"])
        self.worker_pids.update({name: list(pids) for name, pids in carried["worker_pids"].items() if name in nodes})
        restore_rng(state["rng"])
        if self.runlog is not None:
            self.runlog.forget_rounds_after(run_id=self.run_id, round=server_round)
            self.runlog.log_event(run_id=self.run_id, kind="resumed", round=server_round,
                                  detail={"checkpoint": info.uri, "attempt": attempt, "next_round": server_round + 1})
        return server_round, carried

    def checkpoint(self, checkpointer: ServerCheckpointer, server_round: int, carried: Mapping[str, Any]) -> bool:
        """Checkpoint the run after `server_round` (what :meth:`resume` restores, with what the loop carries,
        `carried`), once the rounds it covers are in the run log (a resume never re-runs them); False, with a
        warning, when the run log could not be written in time (no checkpoint this round)."""
        assert self.runlog is not None
        try:
            self.runlog.flush(timeout=60)
        except (TimeoutError, DatabaseUnavailable) as err:
            log.warning("round %d: no checkpoint, the run log is not written yet (%s)", server_round, err)
            return False
        everything = {"val_loss": self.val_loss, "val_accuracy": self.val_accuracy, "totals": dict(self.totals),
                      "worker_pids": self.worker_pids,
                      "downlink": next((d.state_dict() for d in (self.downlink, self.fragment_downlink) if d is not None), None),
                      "best": self._best_state(server_round), **carried}
        info = checkpointer.save(loop_state(self.run_id, server_round, self.weights, self.strategy.state_dict(), everything))
        self.runlog.log_checkpoint(run_id=self.run_id, round=server_round, uri=info.uri)
        self.runlog.log_event(run_id=self.run_id, kind="checkpoint", round=server_round,
                              detail={"uri": info.uri, "bytes": info.size})
        return True

    def _best_state(self, server_round: int) -> dict[str, Any]:
        """What a checkpoint after `server_round` carries of the best model: its loss and round, and its weights
        unless they are the checkpoint's own (best at `server_round`) or there is none."""
        weights = None
        if self.best_round is not None and self.best_round != server_round and self.run_dir is not None:
            with np.load(self.run_dir.best_weights) as npz:
                weights = {name: npz[name] for name in npz.files}
        return {"val_loss": self.best_val_loss, "round": self.best_round, "weights": weights}

    def save_final_weights(self) -> None:
        if self.run_dir is not None:
            np.savez(self.run_dir.final_weights, **self.weights)

    def summary(self, wall_s: float, **extra: Any) -> dict[str, Any]:
        """The run's summary: its last validation, bytes both ways, wall time, worker groups, and `extra`."""
        return {"run_id": self.run_id, "rounds": self.config.run.rounds, "val_loss": self.val_loss,
                "val_accuracy": self.val_accuracy, "best_val_loss": self.best_val_loss, "best_round": self.best_round,
                "bytes_up_total": self.totals["bytes_up"],
                "bytes_down_total": self.totals["bytes_down"], "wall_s": wall_s, **extra,
                "worker_pids": self.worker_pids, **self._heartbeat_summary()}

    def _heartbeat_summary(self) -> dict[str, Any]:
        """With a heartbeat: the beats received from each datacenter and the datagrams refused (forged, another
        run's, malformed)."""
        if self.liveness is None:
            return {}
        return {"heartbeats": {"beats": dict(self.liveness.beats), "refused": self.liveness.refused}}

