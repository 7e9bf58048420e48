"""The synchronous federated loop on Flower's Grid (the body of crossdc's ServerApp).

Promises, per round: every datacenter gets the global weights and τ; the
round closes when every datacenter has replied, or at the round timeout with
at least `min_replies` (0 = all) replies; every reply passes the update gate;
accepted updates are aggregated by the strategy; the global model is
evaluated on the one shared validation set; the round and one row per
datacenter go to the run log. Replies are pulled as they arrive (no fixed
3-second barrier): only messages still pending are polled.
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
from flwr.serverapp import Grid

from crossdc.clients import client_app as wire
from crossdc.clients.local_training import load_model_weights, model_weights
from crossdc.compression.payload import ARRAYS_KEY, CONFIG_KEY, METRICS_KEY, from_array_record, payload_bytes, raw_fp32_bytes, to_array_record
from crossdc.db.errors import DatabaseUnavailable
from crossdc.db.runlog import RunLog
from crossdc.platform.config import ExperimentConfig, parse_config
from crossdc.platform.link_relay import LedgerReader, time_in_flight
from crossdc.platform.experiment import build_strategy, build_workload, initial_model
from crossdc.platform.rundir import RunDir
from crossdc.platform.update_gate import rejection_reason
from crossdc.strategies.aggregation import cosine, l2_norm
from crossdc.strategies.base import ClientUpdate
from crossdc.workloads import evaluate

log = logging.getLogger("crossdc.federation")

POLL_INTERVAL_S = 0.02
DISCOVERY_TIMEOUT_S = 180.0


class FederationError(RuntimeError):
    """The federation cannot go on (missing datacenters, too few replies)."""


@dataclass
class Reply:
    message: Message
    received_at: float


def collect_replies(grid: Grid, message_ids: list[str], timeout_s: float) -> dict[str, Reply]:
    """Pull replies as they arrive until all are in or the timeout passes; returns what came, by message id."""
    pending = set(message_ids)
    replies: dict[str, Reply] = {}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for message in grid.pull_messages(list(pending)):
            reply_to = message.metadata.reply_to_message_id
            if reply_to in pending:
                pending.discard(reply_to)
                replies[reply_to] = Reply(message, time.time())
        if pending:
            time.sleep(POLL_INTERVAL_S)
    return replies


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
    content = RecordDict({CONFIG_KEY: ConfigRecord({wire.HELLO_DATACENTERS: ",".join(names)})})
    messages = [Message(content, dst_node_id=node, message_type=MessageType.QUERY) for node in node_ids]
    ids = list(grid.push_messages(messages))
    replies = collect_replies(grid, ids, DISCOVERY_TIMEOUT_S)
    mapping: dict[str, int] = {}
    for reply in replies.values():
        if reply.message.has_error():
            continue
        name = str(reply.message.content[CONFIG_KEY][wire.DATACENTER])
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


def _time_on_link(link: LedgerReader, start: float, end: float) -> tuple[float | None, str]:
    """Seconds the datacenter's payloads spent on its link during [start, end], and how that was obtained."""
    if not link.path.exists():
        return None, "not measured (no link relay: simulation or external SuperNode)"
    return time_in_flight(link.window(start, end)), "relay"


def _evaluate(model: torch.nn.Module, workload: Any, weights: dict[str, np.ndarray]) -> tuple[float, float, float]:
    started = time.perf_counter()
    load_model_weights(model, weights)
    loss, accuracy = evaluate(workload, model)
    return loss, accuracy, time.perf_counter() - started


def run_federation(grid: Grid, run_dir: RunDir) -> dict[str, Any]:
    """Run the experiment of `run_dir` to its end on `grid`; returns the run's summary."""
    settings = run_dir.settings()
    run_id: str = settings["run_id"]
    config = parse_config(settings["config"])
    runlog = RunLog(settings["db_url"])
    try:
        summary = _run(grid, run_dir, run_id, config, runlog)
        runlog.finish_run(run_id=run_id, status="finished", result=summary)
        runlog.flush(timeout=60)
        return summary
    except BaseException as err:
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        message = f"{type(err).__name__}: {err}".splitlines()[0]
        log.error("run %s %s: %s\n%s", run_id, status, message, traceback.format_exc())
        try:
            runlog.log_event(run_id=run_id, kind="run-" + status, detail=message)
            runlog.finish_run(run_id=run_id, status=status, error=message)
            runlog.flush(timeout=30)
        except Exception:
            log.exception("could not record the failure in the run log")
        raise
    finally:
        runlog.close()


def _run(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    runlog.add_flower_run_id(run_id=run_id, flower_run_id=int(grid.run.run_id))
    workload = build_workload(config)
    strategy = build_strategy(config)
    model = initial_model(config, workload)
    weights = model_weights(model)
    nodes = discover_datacenters(grid, config, runlog, run_id)
    for name in nodes:
        runlog.touch_datacenter(name=name)
    runlog.log_event(run_id=run_id, kind="federation-ready", round=0, detail={"datacenters": sorted(nodes)})
    run_started = time.perf_counter()
    totals = {"bytes_up": 0, "bytes_down": 0}
    trainer_pids: dict[str, list[int]] = {name: [] for name in nodes}
    links = {name: LedgerReader(run_dir.link_ledger(name)) for name in nodes}
    val_loss = val_accuracy = float("nan")
    needed = config.run.min_replies or len(nodes)
    for server_round in range(1, config.run.rounds + 1):
        round_started = time.perf_counter()
        tau = strategy.tau(server_round)
        global_record = to_array_record(weights)
        sent: dict[str, tuple[Message, int]] = {}
        for name, node in nodes.items():
            cfg = {wire.ROUND: server_round, wire.TAU: tau, wire.RUN_ID: run_id, wire.RUN_DIR: str(run_dir.path), wire.DATACENTER: name}
            cfg.update(strategy.client_config(server_round))
            content = RecordDict({ARRAYS_KEY: global_record, CONFIG_KEY: ConfigRecord(cfg)})
            message = Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
            sent[name] = (message, payload_bytes(content))
        pushed_at = time.time()
        ids = list(grid.push_messages([m for m, _ in sent.values()]))
        id_of = {name: msg_id for name, msg_id in zip(sent, ids)}
        replies = collect_replies(grid, ids, config.run.round_timeout_s)
        accepted: list[ClientUpdate] = []
        rows: dict[str, dict[str, Any]] = {}
        for name in nodes:
            bytes_down = sent[name][1]
            reply = replies.get(id_of[name])
            row: dict[str, Any] = {"bytes_down": bytes_down}
            rows[name] = row
            if reply is None:
                row.update(status="timeout", reason=f"no reply within {config.run.round_timeout_s:.0f}s")
                runlog.log_event(run_id=run_id, kind="timeout", round=server_round, datacenter=name, detail=row["reason"])
                continue
            round_s = reply.received_at - pushed_at
            row["round_s"] = round_s
            runlog.touch_datacenter(name=name)
            if reply.message.has_error():
                row.update(status="failed", reason=str(reply.message.error.reason).splitlines()[0][:500])
                runlog.log_event(run_id=run_id, kind="failed", round=server_round, datacenter=name, detail=row["reason"])
                continue
            content = reply.message.content
            row["bytes_up"] = payload_bytes(content)
            try:
                delta = from_array_record(content[ARRAYS_KEY])
                metrics = dict(content[METRICS_KEY])
                reason = rejection_reason(delta, weights)
            except Exception as err:  # undecodable reply
                delta, metrics, reason = {}, {}, f"undecodable reply: {type(err).__name__}: {err}"
            if reason is None and int(metrics.get("num-examples", 0)) <= 0:
                reason = "reply reports no examples"
            if reason is not None:
                row.update(status="rejected", reason=reason)
                runlog.log_event(run_id=run_id, kind="rejected", round=server_round, datacenter=name, detail=reason)
                continue
            compute_s = float(metrics.get("compute-s", 0.0))
            comm_s, comm_source = _time_on_link(links[name], pushed_at, reply.received_at)
            row.update(
                status="ok",
                bytes_up_raw=raw_fp32_bytes(delta),
                compute_s=compute_s,
                comm_s=comm_s,
                comm_source=comm_source,
                overhead_s=max(0.0, round_s - compute_s - (comm_s or 0.0)),
                train_loss=float(metrics.get("train-loss", float("nan"))),
                num_examples=int(metrics["num-examples"]),
                drift_l2=l2_norm(delta),
            )
            accepted.append(ClientUpdate(name, delta, int(metrics["num-examples"]), metrics))
            pid = int(metrics.get("trainer-pid", -1))
            if trainer_pids[name] and trainer_pids[name][-1] != pid:
                runlog.log_event(run_id=run_id, kind="trainer-restarted", round=server_round, datacenter=name,
                                 detail={"before": trainer_pids[name][-1], "now": pid})
            trainer_pids[name].append(pid)
        if len(replies) < needed:
            raise FederationError(f"round {server_round}: {len(replies)} replies within {config.run.round_timeout_s:.0f}s, "
                                  f"{needed} needed (run.min_replies)")
        if accepted:
            mean_update = strategy.mean_update(accepted)
            for update in accepted:
                rows[update.datacenter]["update_cosine"] = cosine(update.delta, mean_update)
            weights = strategy.aggregate(server_round, weights, accepted)
        else:  # every reply was rejected or failed: the global model stays as it was
            runlog.log_event(run_id=run_id, kind="round-without-updates", round=server_round,
                             detail="no usable update this round; the global model is unchanged")
        eval_s = None
        if server_round % config.run.eval_every == 0 or server_round == config.run.rounds:
            val_loss, val_accuracy, eval_s = _evaluate(model, workload, weights)
            if not np.isfinite(val_loss):
                runlog.log_event(run_id=run_id, kind="diverged", round=server_round, detail=f"validation loss {val_loss}")
        round_bytes_up = sum(r.get("bytes_up", 0) for r in rows.values())
        round_bytes_down = sum(r["bytes_down"] for r in rows.values())
        totals["bytes_up"] += round_bytes_up
        totals["bytes_down"] += round_bytes_down
        for name, row in rows.items():
            runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, **row)
        runlog.log_round(
            run_id=run_id, round=server_round, tau=tau,
            val_loss=val_loss if eval_s is not None else None,
            val_accuracy=val_accuracy if eval_s is not None else None,
            bytes_up=round_bytes_up, bytes_down=round_bytes_down,
            bytes_up_raw=sum(r.get("bytes_up_raw", 0) for r in rows.values()),
            wall_s=time.perf_counter() - round_started, eval_s=eval_s,
        )
        runlog.heartbeat(run_id=run_id)
        try:
            runlog.raise_if_failed()
        except DatabaseUnavailable:
            # the run stops, but its model does not get lost with it
            path = run_dir.path / f"weights-round-{server_round}.npz"
            np.savez(path, **weights)
            log.error("database unavailable for too long: stopping after round %d; global weights saved to %s", server_round, path)
            raise
    np.savez(run_dir.final_weights, **weights)
    return {
        "run_id": run_id,
        "rounds": config.run.rounds,
        "val_loss": val_loss,
        "val_accuracy": val_accuracy,
        "bytes_up_total": totals["bytes_up"],
        "bytes_down_total": totals["bytes_down"],
        "wall_s": time.perf_counter() - run_started,
        "trainer_pids": trainer_pids,
    }

