"""The synchronous federated loop on Flower's Grid (the body of crossdc's ServerApp).

Promises, per round: every datacenter gets the global weights and τ; the
round closes when every datacenter has replied, or at the round's deadline
(fixed `run.round_timeout_s`, or adaptive `run.deadline`: median + k·MAD of
each datacenter's recent round times, within a floor and a ceiling; see
crossdc.federation.deadline) if at least `min_replies` (0 = all) have — the others
are recorded as timed out, with an event — and otherwise fails the run; every
reply passes the update gate (its size before decoding, then its tensors), and
once all are judged the round's accepted updates pass the norm-outlier check
(``security.norm_rejection_factor``); the
accepted updates are aggregated by the strategy; the global model is
evaluated on the one shared validation set; the round and one row per
datacenter go to the run log. Replies are pulled as they arrive (polling every
20–250 ms, faster while replies come in; no fixed
3-second barrier): only messages still pending are polled.

Asynchronous strategies (FedAsync, FedBuff) run :mod:`crossdc.federation.async_loop`'s loop instead, built
on the same pieces (discovery, the update gate, the run log).
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from crossdc import protocol as proto
from crossdc import protocol as wire
from crossdc.workloads import load_model_weights, model_weights
from crossdc.protocol import CONFIG_KEY, METRICS_KEY, decode_tensors, encode_tensors, payload_bytes, raw_fp32_bytes
from crossdc.compression.downlink import DownlinkSender
from crossdc.compression.uplink import decode_update
from crossdc.compression.wire import CodecError
from crossdc.db.errors import DatabaseUnavailable
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig, parse_config
from crossdc.wan.link_relay import LedgerReader, bytes_by_direction, payload_transfers, time_in_flight
from crossdc.federation.deadline import round_deadline
from crossdc.experiment.builders import build_strategy, build_workload, initial_model
from crossdc.experiment.rundir import RunDir
from crossdc.federation.server_checkpoint import (SETTINGS_ATTEMPT, SETTINGS_RESUME, ResumeError, ServerCheckpointer,
                                                loop_state, restore_rng)
from crossdc.federation.update_gate import rejection_reason, size_rejection_reason, update_norm_outliers, update_size_limit
from crossdc.strategies.aggregation import cosine, l2_norm
from crossdc.strategies.base import ClientUpdate
from crossdc.strategies.registry import strategy_class
from crossdc.workloads import evaluate

log = logging.getLogger("crossdc.federation")

POLL_INTERVAL_S = 0.02
MAX_POLL_INTERVAL_S = 0.25
#: a run stops when this many rounds in a row produced no usable update
MAX_ROUNDS_WITHOUT_UPDATES = 3
DISCOVERY_TIMEOUT_S = 180.0
#: how long a round waits for a newly seen SuperNode (a restarted datacenter) to say who it is
REDISCOVERY_TIMEOUT_S = 60.0


class FederationError(RuntimeError):
    """The federation cannot go on (missing datacenters, too few replies)."""


@dataclass
class Reply:
    message: Message
    received_at: float


def pull_replies(grid: Grid, pending: set[str]) -> dict[str, Reply]:
    """One poll: the replies to the `pending` message ids that are in now, by message id (removed from `pending`)."""
    replies: dict[str, Reply] = {}
    if not pending:
        return replies
    for message in grid.pull_messages(list(pending)):
        reply_to = message.metadata.reply_to_message_id
        if reply_to in pending:
            pending.discard(reply_to)
            replies[reply_to] = Reply(message, time.time())
    return replies


def collect_replies(grid: Grid, message_ids: list[str], timeout_s: float) -> dict[str, Reply]:
    """Pull replies as they arrive until all are in or the timeout passes; returns what came, by message id."""
    pending = set(message_ids)
    replies: dict[str, Reply] = {}
    deadline = time.monotonic() + timeout_s
    interval = POLL_INTERVAL_S
    while pending and time.monotonic() < deadline:
        arrived = pull_replies(grid, pending)
        replies.update(arrived)
        # poll fast while replies come in, back off (to MAX_POLL_INTERVAL_S) while nothing does
        interval = POLL_INTERVAL_S if arrived else min(MAX_POLL_INTERVAL_S, interval * 1.5)
        if pending:
            time.sleep(interval)
    return replies


def hello_content(config: ExperimentConfig, run_id: str) -> RecordDict:
    """The hello query: the datacenters' names, the run id and the experiment's config (a production node
    prepares the run's trainer from it; see crossdc.clients.node)."""
    return RecordDict({CONFIG_KEY: ConfigRecord({wire.HELLO_DATACENTERS: ",".join(config.datacenter_names),
                                                 wire.RUN_ID: run_id, wire.RUN_CONFIG: config.to_json()})})


def discover_datacenters(grid: Grid, config: ExperimentConfig, runlog: RunLog, run_id: str) -> dict[str, int]:
    """Map every configured datacenter to its SuperNode by asking each node who it is."""
    names = config.datacenter_names
    deadline = time.monotonic() + DISCOVERY_TIMEOUT_S
    node_ids: list[int] = []
    while time.monotonic() < deadline:
        node_ids = list(grid.get_node_ids())
        if len(node_ids) >= len(names):
            break
        time.sleep(0.2)
    if len(node_ids) < len(names):
        raise FederationError(f"only {len(node_ids)} of {len(names)} datacenters connected within {DISCOVERY_TIMEOUT_S:.0f}s")
    content = hello_content(config, run_id)
    messages = [Message(content, dst_node_id=node, message_type=MessageType.QUERY) for node in node_ids]
    ids = list(grid.push_messages(messages))
    replies = collect_replies(grid, ids, DISCOVERY_TIMEOUT_S)
    mapping: dict[str, int] = {}
    for reply in replies.values():
        try:
            name = str(reply.message.content[CONFIG_KEY][wire.DATACENTER])
        except Exception:  # an error reply, or one without a name: that node stays unknown
            continue
        if name in mapping:
            raise FederationError(f"two SuperNodes claim to be datacenter '{name}'")
        if name not in names:
            runlog.log_event(run_id=run_id, kind="unknown-datacenter", detail=f"node {reply.message.metadata.src_node_id} says it is '{name}'")
            continue
        mapping[name] = reply.message.metadata.src_node_id
    missing = [n for n in names if n not in mapping]
    if missing:
        raise FederationError(f"datacenters did not answer: {', '.join(missing)}")
    return mapping


def rediscover(grid: Grid, nodes: dict[str, int], seen: set[int], config: ExperimentConfig, runlog: RunLog, run_id: str,
               server_round: int, timeout_s: float = REDISCOVERY_TIMEOUT_S) -> None:
    """A SuperNode that restarts registers under a new node id: ask every node not seen before who it is, and
    move its datacenter to the new id (in `nodes`, in place), with a ``datacenter-rejoined`` event. `seen` holds
    the node ids already placed (current, replaced, or not a configured datacenter); it grows here. Costs one
    call to the SuperLink per round when nothing changed."""
    new_ids = [node for node in grid.get_node_ids() if node not in seen and node not in nodes.values()]
    if not new_ids:
        return
    content = hello_content(config, run_id)
    ids = list(grid.push_messages([Message(content, dst_node_id=node, message_type=MessageType.QUERY, ttl=timeout_s)
                                   for node in new_ids]))
    for reply in collect_replies(grid, ids, timeout_s).values():
        node = reply.message.metadata.src_node_id
        try:
            name = str(reply.message.content[CONFIG_KEY][wire.DATACENTER])
        except Exception:  # an error reply: ask again next round
            continue
        seen.add(node)
        if name not in nodes:
            runlog.log_event(run_id=run_id, kind="unknown-datacenter", round=server_round, detail=f"node {node} says it is '{name}'")
            continue
        runlog.log_event(run_id=run_id, kind="datacenter-rejoined", round=server_round, datacenter=name,
                         detail={"old_node_id": str(nodes[name]), "new_node_id": str(node)})
        seen.add(nodes[name])
        nodes[name] = node


def _link_measurements(link: LedgerReader, start: float, end: float) -> dict[str, Any]:
    """What the datacenter's link carried for the round's messages during [start, end]: comm_s (seconds
    the link was busy with them), how that was obtained, and their bytes in each direction (protocol
    framing included; idle polls and heartbeats left out, see link_relay.payload_transfers)."""
    if not link.path.exists():
        return {"comm_s": None, "comm_source": "not measured (no link relay: simulation or external SuperNode)"}
    transfers = payload_transfers(link.window(start, end))
    moved = bytes_by_direction(transfers)
    return {"comm_s": time_in_flight(transfers), "comm_source": "relay",
            "link_bytes_up": moved["up"], "link_bytes_down": moved["down"]}


def _evaluate(model: torch.nn.Module, workload: Any, weights: dict[str, np.ndarray]) -> tuple[float, float, float]:
    started = time.perf_counter()
    load_model_weights(model, weights)
    loss, accuracy = evaluate(workload, model)
    return loss, accuracy, time.perf_counter() - started


def run_federation(grid: Grid, run_dir: RunDir) -> dict[str, Any]:
    """Run the experiment of `run_dir` to its end on `grid`; returns the run's summary."""
    settings = run_dir.settings()  # unreadable: nothing to log to; the orchestrator sees Flower end the run
    run_id: str = settings["run_id"]
    runlog = RunLog(settings["db_url"], max_outage_s=float(settings.get("db_max_outage_s", 300.0)))
    try:
        config = parse_config(settings["config"])
        if getattr(strategy_class(config.strategy.name), "asynchronous", False):  # FedAsync, FedBuff: no rounds
            from crossdc.federation.async_loop import run_async

            summary = run_async(grid, run_dir, run_id, config, runlog)
        else:
            summary = _run(grid, run_dir, run_id, config, runlog)
        runlog.finish_run(run_id=run_id, status="finished", result=summary)
        runlog.flush(timeout=60)
        return summary
    except BaseException as err:
        # Flower ends a ServerApp it is told to stop with SystemExit (SIGINT/SIGTERM)
        status = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "failed"
        message = f"{type(err).__name__}: {err}".splitlines()[0]
        log.error("run %s %s: %s\n%s", run_id, status, message, traceback.format_exc())
        try:
            runlog.log_event(run_id=run_id, kind="run-" + status, detail=message)
            runlog.finish_run(run_id=run_id, status=status, error=message)
            runlog.flush(timeout=30)
        except Exception:
            log.exception("could not record the end of the run in the run log")
        raise
    finally:
        runlog.close(timeout=10)


@dataclass
class Judged:
    """One datacenter's outcome in one round: its datacenter_rounds row, and its update if accepted."""

    row: dict[str, Any]
    update: ClientUpdate | None = None
    worker_pids: tuple[int, ...] | None = None  # the datacenter's worker group, rank 0 first
    replied: bool = True  # False: nothing came from the datacenter (timeout, expired message)

    def rejected(self, reason: str) -> "Judged":
        """This accepted outcome rejected after all, by a check of the whole round (norm outliers): no update to
        aggregate; the row keeps its measurements but not what only an aggregated update has (bytes_up_raw,
        num_examples)."""
        row = {key: value for key, value in self.row.items() if key not in ("bytes_up_raw", "num_examples")}
        return Judged({**row, "status": "rejected", "reason": reason}, None, self.worker_pids, self.replied)


def judge_reply(reply: Reply | None, weights: dict[str, np.ndarray], tau: int, batch_size: int, pushed_at: float,
                timeout_reason: str, reply_groups: tuple[str, ...] = (), compressed: bool = False,
                max_bytes: int | None = None) -> Judged:
    """Pass one reply through the gate: a row with status ok, failed, timeout or rejected (with its reason).

    A payload over `max_bytes` (None: no limit; see update_gate.update_size_limit) is rejected before decoding.

    Every tensor group the strategy needs (`reply_groups`, e.g. SCAFFOLD's ``control``) must be present and pass
    the same checks as the update (names, shapes, dtypes of the weights, finite values); a missing one rejects.
    With `compressed` (the run has codecs) the update must come as a codec payload that decodes cleanly."""
    if reply is None:
        return Judged({"status": "timeout", "reason": timeout_reason}, replied=False)
    row: dict[str, Any] = {"round_s": reply.received_at - pushed_at}
    if reply.message.has_error():
        error = reply.message.error
        if error.code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE):
            # the SuperLink's answer for a message that expired undelivered (or whose reply did): no reply came
            return Judged({"status": "timeout", "reason": f"{timeout_reason} (message expired)"}, replied=False)
        return Judged({**row, "status": "failed", "reason": str(error.reason).splitlines()[0][:500]})
    content = reply.message.content
    row["bytes_up"] = payload_bytes(content)
    if max_bytes is not None and (too_big := size_rejection_reason(row["bytes_up"], max_bytes)) is not None:
        return Judged({**row, "status": "rejected", "reason": too_big})
    try:
        delta = decode_update(content, weights, compressed)
    except CodecError as err:
        return Judged({**row, "status": "rejected", "reason": f"undecodable update: {err}"[:500]})
    try:
        metrics = dict(content[METRICS_KEY])
        num_examples = int(metrics[proto.NUM_EXAMPLES])
        compute_s = float(metrics[proto.COMPUTE_S])
        train_loss = float(metrics.get(proto.TRAIN_LOSS, float("nan")))
        worker_pids = tuple(int(p) for p in metrics.get(proto.WORKER_PIDS, [metrics.get(proto.TRAINER_PID, -1)]))
        reason = rejection_reason(delta, weights)
        extras = {group: decode_tensors(content, group) for group in reply_groups}
        for group, arrays in extras.items():
            if reason is None and (problem := rejection_reason(arrays, weights)) is not None:
                reason = f"tensor group '{group}': {problem}"
    except Exception as err:  # a reply that is not what the contract says
        return Judged({**row, "status": "rejected", "reason": f"malformed reply: {type(err).__name__}: {err}"[:500]})
    if reason is None and not 0 < num_examples <= tau * batch_size:
        reason = f"reply reports {num_examples} examples; at most τ × batch = {tau * batch_size} are possible"
    if reason is None and not 0 <= compute_s <= row["round_s"]:
        reason = f"reply reports {compute_s:.3f}s of compute in a {row['round_s']:.3f}s round"
    if reason is not None:
        return Judged({**row, "status": "rejected", "reason": reason})
    # the reply's tensors as dense fp32: the update and the strategy's groups (SCAFFOLD sends twice the model)
    raw = raw_fp32_bytes(delta) + sum(raw_fp32_bytes(arrays) for arrays in extras.values())
    row.update(status="ok", bytes_up_raw=raw, compute_s=compute_s, train_loss=train_loss,
               num_examples=num_examples, drift_l2=l2_norm(delta))
    return Judged(row, ClientUpdate("", delta, num_examples, metrics, extras), worker_pids)


def _run(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    runlog.add_flower_run_id(run_id=run_id, flower_run_id=int(grid.run.run_id))
    workload = build_workload(config)
    strategy = build_strategy(config)
    model = initial_model(config, workload)
    weights = model_weights(model)
    nodes = discover_datacenters(grid, config, runlog, run_id)
    seen_nodes = set(nodes.values())
    regions = {dc.name: dc.region for dc in config.datacenters}
    for name in nodes:
        runlog.touch_datacenter(name=name, region=regions[name])
    runlog.log_event(run_id=run_id, kind="federation-ready", round=0, detail={"datacenters": sorted(nodes)})
    run_started = time.perf_counter()
    totals = {"bytes_up": 0, "bytes_down": 0}
    worker_pids: dict[str, list[list[int]]] = {name: [] for name in nodes}
    links = {name: LedgerReader(run_dir.link_ledger(name)) for name in nodes}
    val_loss = val_accuracy = float("nan")
    needed = config.run.min_replies or len(nodes)
    max_bytes = update_size_limit(raw_fp32_bytes(weights), len(strategy.reply_groups), config.security.max_update_mb)
    rounds_without_updates = 0
    # with downlink codecs the datacenters get the global model as compressed deltas of a shared reference
    downlink = DownlinkSender(config.compression.downlink_codecs, seed=config.run.seed) if config.compression.downlink_codecs else None
    settings = run_dir.settings()
    attempt = int(settings.get(SETTINGS_ATTEMPT, 1))
    checkpointer = ServerCheckpointer.from_settings(settings, config.checkpoint.every_rounds, config.checkpoint.keep,
                                                    config.run.rounds)
    policy = config.run.deadline
    round_times: dict[str, list[float]] = {name: [] for name in nodes}  # per datacenter, its completed rounds' seconds
    first_round = 1
    if settings.get(SETTINGS_RESUME):
        if checkpointer is None:
            raise ResumeError("the run has no checkpoints ([checkpoint] every_rounds = 0): nothing to resume from")
        info, state = checkpointer.load_latest(run_id)
        first_round = int(state["round"]) + 1
        weights = state["weights"]
        strategy.load_state_dict(state["strategy"])
        carried = state["carried"]
        val_loss, val_accuracy, rounds_without_updates = carried["val_loss"], carried["val_accuracy"], carried["rounds_without_updates"]
        totals = dict(carried["totals"])
        if downlink is not None and carried.get("downlink") is not None:
            downlink.load_state_dict(carried["downlink"])
        round_times.update({name: list(times) for name, times in carried.get("round_times", {}).items() if name in round_times})
        worker_pids.update({name: list(pids) for name, pids in carried["worker_pids"].items() if name in worker_pids})
        restore_rng(state["rng"])
        runlog.forget_rounds_after(run_id=run_id, round=first_round - 1)
        runlog.log_event(run_id=run_id, kind="resumed", round=first_round - 1,
                         detail={"checkpoint": info.uri, "attempt": attempt, "next_round": first_round})
    for server_round in range(first_round, config.run.rounds + 1):
        round_started = time.perf_counter()
        if server_round > 1:
            rediscover(grid, nodes, seen_nodes, config, runlog, run_id, server_round)
        tau = strategy.tau(server_round)
        if policy is None:
            timeout_s, deadline_kind = config.run.round_timeout_s, "fixed run.round_timeout_s"
        else:  # from how long each datacenter's recent rounds took; a datacenter seen too little gets the ceiling
            timeout_s, deadline_kind = round_deadline(round_times, list(nodes), policy), "adaptive run.deadline"
        global_records = encode_tensors(weights) if downlink is None else {}
        for group, arrays in strategy.client_arrays(server_round, weights).items():
            global_records.update(encode_tensors(arrays, group))
        if downlink is not None:
            downlink.prepare(weights, server_round)
        messages: dict[str, Message] = {}
        bytes_down: dict[str, int] = {}
        for name, node in nodes.items():
            cfg = {wire.ROUND: server_round, wire.TAU: tau, wire.RUN_ID: run_id, wire.RUN_DIR: str(run_dir.path),
                   wire.DATACENTER: name, wire.ATTEMPT: attempt}
            if checkpointer is not None:  # the datacenter keeps the local state a rewind to this round may need
                cfg[wire.CHECKPOINT_ROUND] = checkpointer.oldest_round
            if attempt > 1:  # a resumed run: datacenters rewind to the checkpoint it continues from
                cfg[wire.RESUME_ROUND] = first_round - 1
            cfg.update(strategy.client_config(server_round))
            model_records: dict[str, Any] = {}
            if downlink is not None:
                model_records, downlink_cfg = downlink.message_for(name)
                cfg.update(downlink_cfg)
            content = RecordDict({**model_records, **global_records, CONFIG_KEY: ConfigRecord(cfg)})
            # a message not delivered by the round's deadline expires: a datacenter that comes back late
            # gets the next round's model instead of training on a stale one
            # (with the adaptive deadline: its ceiling, the longest this round may wait on for enough replies)
            messages[name] = Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                                     ttl=policy.ceiling_s if policy is not None else timeout_s)
            bytes_down[name] = payload_bytes(content)
        pushed_at = time.time()
        ids = list(grid.push_messages(list(messages.values())))
        id_of = dict(zip(messages, ids))
        replies = collect_replies(grid, ids, timeout_s)
        if policy is not None and len(replies) < needed and timeout_s < policy.ceiling_s:
            # too few replies by the adaptive deadline: wait on, up to the ceiling, rather than fail the run
            late = [i for i in ids if i not in replies]
            replies.update(collect_replies(grid, late, policy.ceiling_s - timeout_s))
            timeout_s = policy.ceiling_s
        timeout_reason = f"no reply within the round's {timeout_s:g}s ({deadline_kind})"
        judged = {name: judge_reply(replies.get(id_of[name]), weights, tau, config.workload.batch_size, pushed_at,
                                    timeout_reason, strategy.reply_groups, compressed=bool(config.compression.codecs),
                                    max_bytes=max_bytes)
                  for name in nodes}
        outliers = update_norm_outliers({name: j.update.delta for name, j in judged.items() if j.update is not None},
                                        config.security.norm_rejection_factor)
        for name, reason in outliers.items():
            judged[name] = judged[name].rejected(reason)
        for name, outcome in judged.items():
            outcome.row["bytes_down"] = bytes_down[name]
            if downlink is not None and outcome.row["status"] == "ok":
                downlink.acknowledge(name)
            if outcome.row["status"] != "timeout":
                runlog.touch_datacenter(name=name, region=regions[name])
            if outcome.row["status"] != "ok":
                runlog.log_event(run_id=run_id, kind=outcome.row["status"], round=server_round, datacenter=name,
                                 detail=outcome.row["reason"])
            if outcome.worker_pids is not None:
                if worker_pids[name] and worker_pids[name][-1] != list(outcome.worker_pids):
                    runlog.log_event(run_id=run_id, kind="trainer-restarted", round=server_round, datacenter=name,
                                     detail={"before": worker_pids[name][-1], "now": list(outcome.worker_pids)})
                worker_pids[name].append(list(outcome.worker_pids))
        accepted = [ClientUpdate(name, j.update.delta, j.update.num_examples, j.update.metrics, j.update.extras)
                    for name, j in judged.items() if j.update is not None]
        replied = sum(j.replied for j in judged.values())
        enough_replies = replied >= needed
        if enough_replies and accepted:
            rounds_without_updates = 0
            mean_update = strategy.mean_update(accepted)
            for update in accepted:
                judged[update.datacenter].row["update_cosine"] = cosine(update.delta, mean_update)
            weights = strategy.aggregate(server_round, weights, accepted)
            strategy_metrics = strategy.round_metrics(server_round, accepted)
            if strategy_metrics:
                runlog.log_event(run_id=run_id, kind="strategy-metrics", round=server_round,
                                 detail={"strategy": strategy.name, **strategy_metrics})
        elif enough_replies:  # every reply was rejected or failed: the global model stays as it was
            rounds_without_updates += 1
            runlog.log_event(run_id=run_id, kind="round-without-updates", round=server_round,
                             detail="no usable update this round; the global model is unchanged")
        eval_s = None
        if enough_replies and (server_round % config.run.eval_every == 0 or server_round == config.run.rounds):
            val_loss, val_accuracy, eval_s = _evaluate(model, workload, weights)
            if not np.isfinite(val_loss):
                runlog.log_event(run_id=run_id, kind="diverged", round=server_round, detail=f"validation loss {val_loss}")
        # time on the link is read once the round is over, so the relay has recorded the last reply's bytes
        for name, outcome in judged.items():
            row = outcome.row
            if "round_s" in row:
                row.update(_link_measurements(links[name], pushed_at, pushed_at + row["round_s"]))
            if row["status"] == "ok":
                row["overhead_s"] = row["round_s"] - row["compute_s"] - (row["comm_s"] or 0.0)
            if row["status"] == "ok":
                round_times.setdefault(name, []).append(row["round_s"])
            elif row["status"] == "timeout":  # a lower bound of its pace: a datacenter that slowed down is learnt too
                round_times.setdefault(name, []).append(timeout_s)
            runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, **row)
        round_bytes_up = sum(j.row.get("bytes_up", 0) for j in judged.values())
        round_bytes_down = sum(bytes_down.values())
        totals["bytes_up"] += round_bytes_up
        totals["bytes_down"] += round_bytes_down
        runlog.log_round(
            run_id=run_id, round=server_round, tau=tau,
            val_loss=val_loss if eval_s is not None else None,
            val_accuracy=val_accuracy if eval_s is not None else None,
            bytes_up=round_bytes_up, bytes_down=round_bytes_down,
            bytes_up_raw=sum(j.row.get("bytes_up_raw", 0) for j in judged.values()),
            wall_s=time.perf_counter() - round_started, eval_s=eval_s,
        )
        runlog.heartbeat(run_id=run_id)
        if not enough_replies:
            raise FederationError(f"round {server_round}: {replied} replies within {timeout_s:g}s, "
                                  f"{needed} needed (run.min_replies)")
        if rounds_without_updates >= MAX_ROUNDS_WITHOUT_UPDATES:
            raise FederationError(f"{rounds_without_updates} rounds in a row without one usable update; see the events")
        try:
            runlog.raise_if_failed()
        except DatabaseUnavailable:
            # the run stops, but its model does not get lost with it
            path = run_dir.path / f"weights-round-{server_round}.npz"
            np.savez(path, **weights)
            log.error("database unavailable for too long: stopping after round %d; global weights saved to %s", server_round, path)
            raise
        if checkpointer is not None and checkpointer.due(server_round):
            try:  # a checkpoint only once the rounds it covers are in the run log (a resume never re-runs them)
                runlog.flush(timeout=60)
            except (TimeoutError, DatabaseUnavailable) as err:
                log.warning("round %d: no checkpoint, the run log is not written yet (%s)", server_round, err)
                continue
            carried = {"val_loss": val_loss, "val_accuracy": val_accuracy, "rounds_without_updates": rounds_without_updates,
                       "totals": dict(totals), "worker_pids": worker_pids, "round_times": round_times,
                       "downlink": downlink.state_dict() if downlink is not None else None}
            info = checkpointer.save(loop_state(run_id, server_round, weights, strategy.state_dict(), carried))
            runlog.log_checkpoint(run_id=run_id, round=server_round, uri=info.uri)
            runlog.log_event(run_id=run_id, kind="checkpoint", round=server_round, detail={"uri": info.uri, "bytes": info.size})
    np.savez(run_dir.final_weights, **weights)
    return {
        "run_id": run_id,
        "rounds": config.run.rounds,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "bytes_up_total": totals["bytes_up"],
        "bytes_down_total": totals["bytes_down"],
        "wall_s": time.perf_counter() - run_started,
        "worker_pids": worker_pids,
    }
