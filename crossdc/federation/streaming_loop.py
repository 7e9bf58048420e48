"""The streaming federated loop on Flower's Grid: the model synced fragment by fragment while the datacenters train.

Promises, per exchange k of the run (round r, fragment p; see :mod:`crossdc.strategies.fragments`): every
datacenter gets one message that asks for the update of exchange k and carries the server's result of exchange
k − 1 (the first carries the initial weights, on which each datacenter's trainer starts training at once); the
exchange closes when every datacenter has replied, or at its deadline (the fixed ``run.round_timeout_s``, or the
adaptive ``run.deadline`` learnt from each datacenter's recent exchanges: :class:`~crossdc.federation.deadline.Deadlines`)
if at least ``min_replies`` have (the others are recorded as timed out, with an event; too few fails the run); every reply
passes the update gate against the fragment's weights, then the round's norm-outlier check; the fragment's
aggregate is computed once and the strategy's outer step applied to that fragment
(:meth:`~crossdc.federation.session.RoundSession.aggregate_fragment`). A round closes with its last fragment: the
global model is evaluated, the round and one row per datacenter (its exchanges merged: bytes, compute and the
trainer's own idle time summed) go to the run log; every datacenter's part of every exchange gets a
``fragment_exchanges`` row (status, bytes, the step the update was taken after, compute and waits since the
previous send).

How it hides Flower's per-message costs: a datacenter's ClientApp blocks until its trainer reaches the exchange's
send step, so the next message is always already posted when an exchange's reply is pushed; what the trainer may
wait for is only the cycle from that reply to the next message's delivery (aggregation, the SuperNode's next pull,
a ClientApp's start), and only if it is longer than τ_o inner steps (with eager updates: a whole round more). Each
message's TTL is the exchange's deadline (the adaptive deadline's ceiling), which covers its wait in the SuperNode's
queue and the time its ClientApp blocks. With ``[compression] downlink_codecs`` the results travel compressed
(:class:`crossdc.compression.downlink.FragmentDownlink`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from crossdc import protocol
from crossdc.db.records import DatacenterRoundRecord
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.rundir import RunDir
from crossdc.federation.deadline import Deadlines
from crossdc.federation.grid_io import FederationError, collect_within
from crossdc.federation.server_checkpoint import SETTINGS_ATTEMPT, SETTINGS_RESUME, ServerCheckpointer
from crossdc.federation.session import RoundSession, merge_rows
from crossdc.federation.sync_loop import MAX_ROUNDS_WITHOUT_UPDATES, down_reason, watched_session
from crossdc.federation.timeline import exchange_spans
from crossdc.protocol import CONFIG_KEY, encode_results, encode_tensors, payload_bytes
from crossdc.strategies.base import StrategyError
from crossdc.strategies.streaming_diloco import StreamingDiLoCo

log = logging.getLogger("crossdc.federation")


def run_streaming(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    """Run a streaming experiment to its end on `grid`; returns the run's summary. A datacenter the heartbeat marks
    down is not waited for (its exchange's reply counts as missing at once)."""
    with watched_session(grid, run_dir, run_id, config, runlog) as (session, nodes):
        return _stream(grid, run_dir, run_id, config, runlog, session, nodes)


def _stream(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog, session: RoundSession,
            nodes: dict[str, int]) -> dict[str, Any]:
    strategy = session.strategy
    if not isinstance(strategy, StreamingDiLoCo):
        raise StrategyError(f"strategy '{strategy.name}' declares the streaming loop but is no StreamingDiLoCo")
    plan = strategy.plan(session.weights)
    schedule = plan.schedule
    eager = bool(strategy.params["eager"])
    needed = config.run.min_replies or len(nodes)
    deadlines = Deadlines(config.run.deadline, config.run.round_timeout_s, list(nodes))
    settings = run_dir.settings()
    attempt = int(settings.get(SETTINGS_ATTEMPT, 1))
    checkpointer = ServerCheckpointer.from_settings(settings, config.checkpoint.every_rounds, config.checkpoint.keep,
                                                    config.run.rounds)
    run_started = time.perf_counter()
    # the server's results of exchanges a datacenter may still need (the next message's load; on a resume, the
    # first message's)
    results: dict[int, dict[str, np.ndarray]] = {}
    exchanges_without_updates = 0
    first_round = 1
    timeline_zero = time.time()  # the timeline's 0 s: the start of the run's first attempt
    if settings.get(SETTINGS_RESUME):
        last_round, carried = session.resume(checkpointer, attempt, nodes)
        first_round = last_round + 1
        exchanges_without_updates = carried["exchanges_without_updates"]
        results = {int(k): v for k, v in carried["results"].items()}
        deadlines = Deadlines(config.run.deadline, config.run.round_timeout_s, list(nodes), carried.get("exchange_times"))
        timeline_zero = float(carried.get("timeline_zero", timeline_zero))
    carried_at: dict[int, float] = {}  # when the message carrying each result was pushed (wall-clock)
    first_exchange = schedule.exchange(first_round, 0)
    pushed: dict[int, float] = {}  # when each exchange's messages were posted (wall-clock, for durations only)
    round_rows: dict[str, list[DatacenterRoundRecord]] = {}
    round_started, bytes_down_round = time.perf_counter(), 0
    for exchange in range(first_exchange, config.run.rounds * schedule.fragments + 1):
        server_round, fragment = schedule.locate(exchange)
        names = plan.fragments[fragment]
        if fragment == 0:
            round_rows, round_started, bytes_down_round = {name: [] for name in nodes}, time.perf_counter(), 0
        if exchange == 1:
            results_of: list[int] = []
            records = encode_tensors(session.weights)
        else:  # the previous exchange's result; a resumed attempt's first message, all a datacenter still needs
            results_of = ([exchange - 1] if exchange > first_exchange
                          else schedule.results_needed_after(exchange - 1, eager))
            records = encode_results({k: results[k] for k in results_of})
        # fixed, or from how long each datacenter's recent exchanges took (one seen too little gets the ceiling)
        timeout_s, deadline_kind = deadlines.next(list(nodes))
        messages: dict[str, Message] = {}
        bytes_down: dict[str, int] = {}
        for name, node in nodes.items():
            cfg = protocol.stream_config(
                exchange=exchange, server_round=server_round, tau=schedule.steps_per_round, run_id=run_id,
                run_dir=str(run_dir.path), datacenter=name, results_of=results_of, attempt=attempt,
                # the datacenter keeps the replica states a resume to the oldest retained checkpoint needs
                checkpoint_round=checkpointer.oldest_round if checkpointer is not None else None,
                resume_round=first_round - 1 if attempt > 1 else None)
            content = RecordDict({**records, CONFIG_KEY: ConfigRecord(cfg)})
            # the TTL (the fixed deadline, or the adaptive one's ceiling) covers the message's wait in the node's queue
            # and the time its ClientApp blocks for the send
            messages[name] = Message(content, dst_node_id=node, message_type=MessageType.TRAIN, ttl=deadlines.ttl_s)
            bytes_down[name] = payload_bytes(content)
        sent = session.sent_now()
        pushed_at = pushed[exchange] = sent.at
        carried_at.update(dict.fromkeys(results_of, pushed_at))
        ids = list(grid.push_messages(list(messages.values())))
        id_of = dict(zip(messages, ids, strict=True))
        replies, timeout_s = collect_within(grid, ids, deadlines, timeout_s, needed, session.given_up(sent, id_of))
        reference = {n: session.weights[n] for n in names}
        timeout_reason = f"no reply within the exchange's {timeout_s:g}s ({deadline_kind})"
        down = session.down_after(sent)
        # a trainer cannot have passed the merge that needed an earlier message before that message was posted: the
        # compute since its previous send began after the push of exchange k − 1 (eager: k − 1 − P)
        since = pushed.get(max(first_exchange, exchange - 1 - (schedule.fragments if eager else 0)), pushed_at)
        judged = {name: session.judge(name, replies.get(id_of[name]), schedule.spacing, pushed_at,
                                      down_reason(config) if name in down else timeout_reason, reference,
                                      compute_since=since) for name in nodes}
        session.reject_outliers(judged)
        for name, outcome in judged.items():
            session.note_outcome(name, outcome, server_round)
        accepted = [j.update for j in judged.values() if j.update is not None]
        replied = sum(j.replied for j in judged.values())
        if replied < needed:
            raise FederationError(f"exchange {exchange} (round {server_round}, fragment {fragment}): {replied} replies "
                                  f"within {timeout_s:g}s, {needed} needed (run.min_replies)")
        mean: dict[str, np.ndarray] | None = None
        cosines: dict[str, float] = {}
        if accepted:
            exchanges_without_updates = 0
            mean, cosines = session.aggregate_fragment(names, accepted)
        else:  # the fragment stays as it is; with eager updates, the datacenters step on their own stand-ins alone
            exchanges_without_updates += 1
            runlog.log_event(run_id=run_id, kind="round-without-updates", round=server_round,
                             detail=f"exchange {exchange} (fragment {fragment}): no usable update; the fragment is unchanged")
        results[exchange] = session.exchange_result(exchange, names, mean)
        kept = set(schedule.results_needed_after(exchange, eager))
        results = {k: v for k, v in results.items() if k in kept}
        spans = []
        for name, outcome in judged.items():
            reply = replies.get(id_of[name])
            if outcome.update is not None and reply is not None:
                spans += exchange_spans(outcome.update.metrics, datacenter=name, exchange=exchange,
                                        run_started=timeline_zero, replied_at=reply.received_at,
                                        carried_at=carried_at, locate=schedule.locate)
        runlog.log_timeline_spans(run_id=run_id, spans=spans)
        # a result's arrival is told with the trainer's next send after it, one or two exchanges on
        carried_at = {k: at for k, at in carried_at.items() if k >= exchange - schedule.fragments - 2}
        for name, outcome in judged.items():
            record = session.finish_record(name, outcome, pushed_at, bytes_down=bytes_down[name],
                                           update_cosine=cosines.get(name))
            sent_step = None
            if record.status == "ok" and outcome.update is not None:
                # the trainer computed all along: its idle time is its own measure of waiting, not round − compute
                metrics = outcome.update.metrics
                record = record.replace(idle_s=float(metrics.get(protocol.IDLE_S, 0.0)), overhead_s=None)
                sent_step = int(metrics[protocol.SENT_STEP]) if protocol.SENT_STEP in metrics else None
            round_rows[name].append(record)
            deadlines.record(name, record.status, record.round_s, timeout_s)
            runlog.log_fragment_exchange(run_id=run_id, round=server_round, exchange=exchange, fragment=fragment,
                                         datacenter=name, status=record.status, reason=record.reason,
                                         bytes_up=int(record.bytes_up or 0), bytes_down=bytes_down[name],
                                         sent_step=sent_step, compute_s=record.compute_s, idle_s=record.idle_s,
                                         round_s=record.round_s)
        bytes_down_round += sum(bytes_down.values())
        if exchanges_without_updates >= MAX_ROUNDS_WITHOUT_UPDATES * schedule.fragments:
            raise FederationError(f"{exchanges_without_updates} exchanges in a row without one usable update; see the events")
        if fragment == schedule.fragments - 1:  # the round's last fragment: the round is complete
            eval_s = session.evaluate_if_due(server_round)
            merged = []
            for name, rows in round_rows.items():
                row = merge_rows(rows)
                runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, record=row)
                merged.append(row)
            session.log_round(server_round, schedule.steps_per_round, merged, bytes_down_round,
                              time.perf_counter() - round_started, eval_s)
            session.check_run_log(f"round-{server_round}")
            if checkpointer is not None and checkpointer.due(server_round):
                # every datacenter saved its replica after this send; what is in flight is `results`
                session.checkpoint(checkpointer, server_round,
                                   {"exchanges_without_updates": exchanges_without_updates, "results": results,
                                    "timeline_zero": timeline_zero, "exchange_times": deadlines.times})
    session.save_final_weights()
    return session.summary(time.perf_counter() - run_started, fragments=schedule.fragments)
