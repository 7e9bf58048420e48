"""The synchronous federated loop on Flower's Grid (the body of crossdc's ServerApp).

Promises, per round: every datacenter gets the global weights and τ; the
round closes when every datacenter has replied, or at the round's deadline
(fixed `run.round_timeout_s`, or adaptive `run.deadline`: median + k·MAD of
each datacenter's recent round times, within a floor and a ceiling; see
crossdc.federation.deadline) if at least `min_replies` (0 = all) have — the others
are recorded as timed out, with an event — and otherwise fails the run; every
reply passes the update gate (its size before decoding, then its tensors), and
once all are judged the round's accepted updates pass the norm-outlier check
(``security.norm_rejection_factor``); the round's aggregate of the accepted
updates is computed once and handed to the strategy's server step; the global
model is evaluated on the one shared validation set; the round and one row per
datacenter go to the run log. Replies are pulled as they arrive
(:mod:`crossdc.federation.grid_io`): only messages still pending are polled.

Everything the loops share lives in :class:`crossdc.federation.session.RoundSession`; this module holds what
only the synchronous loop does (rounds, deadlines, checkpoints and resume). :func:`run_federation` picks the
loop the strategy declares (``Strategy.loop``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from crossdc import protocol
from crossdc.db.runlog import RunLog
from crossdc.deployment.heartbeat import HeartbeatOffer
from crossdc.experiment.config import ExperimentConfig, parse_config
from crossdc.experiment.rundir import RunDir
from crossdc.federation.deadline import Deadlines
from crossdc.federation.grid_io import FederationError, collect_within, discover_datacenters, rediscover
from crossdc.federation.server_checkpoint import SETTINGS_ATTEMPT, SETTINGS_RESUME, ServerCheckpointer
from crossdc.federation.session import RoundSession
from crossdc.protocol import payload_bytes
from crossdc.strategies.base import Strategy
from crossdc.strategies.registry import strategy_class

log = logging.getLogger("crossdc.federation")

#: a run stops when this many rounds in a row produced no usable update
MAX_ROUNDS_WITHOUT_UPDATES = 3


def run_federation(grid: Grid, run_dir: RunDir) -> dict[str, Any]:
    """Run the experiment of `run_dir` to its end on `grid`; returns the run's summary. The run's end is recorded as
    this attempt's (the settings' attempt): ignored if a resume has started a newer one (:meth:`RunLog.finish_run`)."""
    settings = run_dir.settings()  # unreadable: nothing to log to; the orchestrator sees Flower end the run
    run_id: str = settings["run_id"]
    attempt = int(settings.get(SETTINGS_ATTEMPT, 1))
    runlog = RunLog(settings["db_url"], max_outage_s=float(settings.get("db_max_outage_s", 300.0)))
    try:
        config = parse_config(settings["config"])
        loop = strategy_class(config.strategy.name).loop
        if loop == "streaming":  # Streaming DiLoCo: exchanges of fragments while the datacenters train
            from crossdc.federation.streaming_loop import run_streaming

            summary = run_streaming(grid, run_dir, run_id, config, runlog)
        elif loop == "gossip":  # decentralized: the datacenters train and mix on their own; this loop observes
            from crossdc.federation.gossip_loop import run_gossip

            summary = run_gossip(grid, run_dir, run_id, config, runlog)
        elif loop == "pipeline":  # a model split across the datacenters: the stages pass activations directly
            from crossdc.federation.pipeline_loop import run_pipeline

            summary = run_pipeline(grid, run_dir, run_id, config, runlog)
        elif loop == "async":  # FedAsync, FedBuff: no rounds
            from crossdc.federation.async_loop import run_async

            summary = run_async(grid, run_dir, run_id, config, runlog)
        else:
            summary = _run(grid, run_dir, run_id, config, runlog)
        runlog.finish_run(run_id=run_id, status="finished", result=summary, attempt=attempt)
        runlog.flush(timeout=60)
        return summary
    except BaseException as err:
        # Flower ends a ServerApp it is told to stop with SystemExit (SIGINT/SIGTERM)
        status = "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else "failed"
        message = f"{type(err).__name__}: {err}".splitlines()[0]
        log.error("run %s %s: %s\n%s", run_id, status, message, traceback.format_exc())
        try:
            runlog.log_event(run_id=run_id, kind="run-" + status, detail=message)
            runlog.finish_run(run_id=run_id, status=status, error=message, attempt=attempt)
            runlog.flush(timeout=30)
        except Exception:
            log.exception("could not record the end of the run in the run log")
        raise
    finally:
        runlog.close(timeout=10)


def down_reason(config: ExperimentConfig) -> str:
    """Why a datacenter marked down by the heartbeat has no reply (the loops stop waiting for it)."""
    return f"no reply: the datacenter is down (no heartbeat for more than {config.run.heartbeat_timeout_s:g}s)"


#: how often a round that waits for a returning datacenter's new node looks for it, and how long it waits at least
REJOIN_POLL_S = 0.5
REJOIN_MIN_WAIT_S = 15.0


def await_rejoin(grid: Grid, nodes: dict[str, int], seen: set[int], config: ExperimentConfig, runlog: RunLog, run_id: str,
                 server_round: int, returning: set[str], heartbeat: HeartbeatOffer | None = None) -> None:
    """Before a round, wait up to max(``run.heartbeat_timeout_s``, REJOIN_MIN_WAIT_S) for the `returning` datacenters
    (back up by the heartbeat since the last round began) to be found under a new node (rediscovery), so the round's
    message goes to the node that can answer it; one whose node did not change (a cut link, not a crash) is sent its
    message when the wait ends. The hellos offer `heartbeat`, if any."""
    deadline = time.monotonic() + max(config.run.heartbeat_timeout_s, REJOIN_MIN_WAIT_S)
    waiting = set(returning)
    while waiting and time.monotonic() < deadline:
        waiting -= set(rediscover(grid, nodes, seen, config, runlog, run_id, server_round, heartbeat=heartbeat))
        if waiting:
            time.sleep(REJOIN_POLL_S)


def start_session(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog,
                  ready_detail: Callable[[Strategy], dict[str, Any]] | None = None, liveness: bool = False,
                  ) -> tuple[RoundSession, dict[str, int]]:
    """The run's session and its datacenters' nodes: discovered, seen (with their configured links: a datacenter
    without one keeps what it enrolled with), announced (``federation-ready``, with what `ready_detail` of the run's
    strategy adds; it may refuse the strategy by raising). With `liveness` (a loop that watches the heartbeat) the
    session's heartbeat monitor is bound first, so the hellos can offer it (a run on a standing federation)."""
    runlog.add_flower_run_id(run_id=run_id, flower_run_id=int(grid.run.run_id))
    session = RoundSession(config, run_id, runlog, run_dir)
    try:
        extra = ready_detail(session.strategy) if ready_detail is not None else {}
        if liveness:
            session.bind_liveness()
        nodes = discover_datacenters(grid, config, runlog, run_id, session.heartbeat_offer)
    except BaseException:
        session.close()
        raise
    links = {dc.name: dc.link for dc in config.datacenters}
    for name in nodes:
        link = links[name]
        runlog.touch_datacenter(name=name, region=session.regions[name],
                                link_bandwidth_mbps=link.bandwidth_mbps if link is not None else None,
                                link_rtt_ms=link.rtt_ms if link is not None else None)
    runlog.log_event(run_id=run_id, kind="federation-ready", round=0, detail={"datacenters": sorted(nodes), **extra})
    return session, nodes


@contextmanager
def watched_session(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog,
                    ready_detail: Callable[[Strategy], dict[str, Any]] | None = None,
                    ) -> Iterator[tuple[RoundSession, dict[str, int]]]:
    """:func:`start_session` for a loop that watches the heartbeat: judging starts once the datacenters are found
    (``datacenter-down`` / ``datacenter-up`` events, :meth:`RoundSession.down`), and stops when the loop ends."""
    session, nodes = start_session(grid, run_dir, run_id, config, runlog, ready_detail, liveness=True)
    session.watch_liveness()
    try:
        yield session, nodes
    finally:
        session.close()


def _run(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    with watched_session(grid, run_dir, run_id, config, runlog) as (session, nodes):
        return _rounds(grid, run_dir, run_id, config, runlog, session, nodes)


def _rounds(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog, session: RoundSession,
            nodes: dict[str, int]) -> dict[str, Any]:
    strategy = session.strategy
    seen_nodes = set(nodes.values())
    run_started = time.perf_counter()
    needed = config.run.min_replies or len(nodes)
    rounds_without_updates = 0
    settings = run_dir.settings()
    attempt = int(settings.get(SETTINGS_ATTEMPT, 1))
    checkpointer = ServerCheckpointer.from_settings(settings, config.checkpoint.every_rounds, config.checkpoint.keep,
                                                    config.run.rounds)
    deadlines = Deadlines(config.run.deadline, config.run.round_timeout_s, list(nodes))
    first_round = 1
    if settings.get(SETTINGS_RESUME):
        last_round, carried = session.resume(checkpointer, attempt, nodes)
        first_round = last_round + 1
        rounds_without_updates = carried["rounds_without_updates"]
        deadlines = Deadlines(config.run.deadline, config.run.round_timeout_s, list(nodes), carried.get("round_times"))
    last_start = time.monotonic()
    for server_round in range(first_round, config.run.rounds + 1):
        round_started = time.perf_counter()
        if server_round > 1:
            rediscover(grid, nodes, seen_nodes, config, runlog, run_id, server_round, heartbeat=session.heartbeat_offer)
            await_rejoin(grid, nodes, seen_nodes, config, runlog, run_id, server_round, session.came_up_since(last_start),
                         session.heartbeat_offer)
        last_start = time.monotonic()
        tau = strategy.tau(server_round)
        # fixed, or from how long each datacenter's recent rounds took (one seen too little gets the ceiling)
        timeout_s, deadline_kind = deadlines.next(list(nodes))
        session.prepare_model(server_round, server_round)
        messages: dict[str, Message] = {}
        bytes_down: dict[str, int] = {}
        for name, node in nodes.items():
            task = protocol.train_config(
                server_round=server_round, tau=tau, run_id=run_id, run_dir=str(run_dir.path), datacenter=name,
                attempt=attempt,
                # the datacenter keeps the local state a rewind to this round may need
                checkpoint_round=checkpointer.oldest_round if checkpointer is not None else None,
                # a resumed run: datacenters rewind to the checkpoint it continues from
                resume_round=first_round - 1 if attempt > 1 else None)
            content, _ = session.train_message(name, server_round, task)
            # a message not delivered by the round's deadline expires: a datacenter that comes back late
            # gets the next round's model instead of training on a stale one
            # (with the adaptive deadline: its ceiling, the longest this round may wait on for enough replies)
            messages[name] = Message(content, dst_node_id=node, message_type=MessageType.TRAIN, ttl=deadlines.ttl_s)
            bytes_down[name] = payload_bytes(content)
        sent = session.sent_now()
        pushed_at = sent.at
        ids = list(grid.push_messages(list(messages.values())))
        id_of = dict(zip(messages, ids, strict=True))
        # a datacenter down when its message was sent, or since, may never answer it: the round does not wait for it
        replies, timeout_s = collect_within(grid, ids, deadlines, timeout_s, needed, session.given_up(sent, id_of))
        timeout_reason = f"no reply within the round's {timeout_s:g}s ({deadline_kind})"
        down = session.down_after(sent)
        judged = {name: session.judge(name, replies.get(id_of[name]), tau, pushed_at,
                                      down_reason(config) if name in down else timeout_reason) for name in nodes}
        session.reject_outliers(judged)
        for name, outcome in judged.items():
            session.note_outcome(name, outcome, server_round)
        accepted = [j.update for j in judged.values() if j.update is not None]
        replied = sum(j.replied for j in judged.values())
        enough_replies = replied >= needed
        cosines: dict[str, float] = {}
        if enough_replies and accepted:
            rounds_without_updates = 0
            cosines = session.aggregate(server_round, accepted)
            strategy_metrics = strategy.round_metrics(server_round, accepted)
            if strategy_metrics:
                runlog.log_event(run_id=run_id, kind="strategy-metrics", round=server_round,
                                 detail={"strategy": strategy.name, **strategy_metrics})
        elif enough_replies:  # every reply was rejected or failed: the global model stays as it was
            rounds_without_updates += 1
            runlog.log_event(run_id=run_id, kind="round-without-updates", round=server_round,
                             detail="no usable update this round; the global model is unchanged")
        eval_s = session.evaluate_if_due(server_round) if enough_replies else None
        # time on the link is read once the round is over, so the relay has recorded the last reply's bytes
        records = []
        for name, outcome in judged.items():
            record = session.finish_record(name, outcome, pushed_at, bytes_down=bytes_down[name],
                                           update_cosine=cosines.get(name))
            deadlines.record(name, record.status, record.round_s, timeout_s)
            runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, record=record)
            records.append(record)
        session.log_round(server_round, tau, records, sum(bytes_down.values()), time.perf_counter() - round_started, eval_s)
        if not enough_replies:
            raise FederationError(f"round {server_round}: {replied} replies within {timeout_s:g}s, "
                                  f"{needed} needed (run.min_replies)")
        if rounds_without_updates >= MAX_ROUNDS_WITHOUT_UPDATES:
            raise FederationError(f"{rounds_without_updates} rounds in a row without one usable update; see the events")
        session.check_run_log(f"round-{server_round}")
        if checkpointer is not None and checkpointer.due(server_round):
            session.checkpoint(checkpointer, server_round,
                               {"rounds_without_updates": rounds_without_updates, "round_times": deadlines.times})
    session.save_final_weights()
    return session.summary(time.perf_counter() - run_started)
