"""The gossip loop on Flower's Grid: the coordinator starts a decentralized run and observes it, never on its path.

Promises:

- one ``start`` message to every datacenter starts its replica's agent (crossdc.clients.gossip_agent), which then
  trains and exchanges with its neighbours directly, datacenter to datacenter; no model crosses the coordinator's
  links while the run trains;
- the coordinator then asks every datacenter for its **reports** (``report`` messages, each answered as soon as a
  round the coordinator has not acknowledged is filed, or after a short wait): per round, compute and idle seconds,
  training loss, examples, what each of its links carried and a CountSketch of its replica right after the round's
  mix; and, on the rounds ``run.eval_every`` names (and the last), the **snapshot** of that replica;
- a round is logged once every datacenter has reported it (or, for one that has not reported anything new for
  ``run.round_timeout_s``, without it: a ``timeout`` row): a ``datacenter_rounds`` row per datacenter (bytes sent and
  received on its datacenter-to-datacenter links, compute, idle, and its distance to the replicas' average: exact on
  an observed round, from the snapshots; estimated from the sketches on the others), a ``link_rounds`` row per link
  and direction, and a ``rounds`` row (the mean consensus distance, and on an observed round the average replica's
  validation loss); each replica's own validation loss on an observed round goes to a ``replica-losses`` event;
- what a datacenter reported is acknowledged in its next message once the round's rows are written to the run log
  (and the coordinator's progress file, ``gossip-progress.json`` in the run folder, says so), and only then
  forgotten there: a coordinator that was away (a ServerApp killed and started again: attempt 2 and on) goes on from
  its progress file, forgets what it logged after it, and catches up on every round it missed; the datacenters
  never stop training meanwhile;
- a datacenter whose SuperNode restarts is found under its new node id; one that was down and rejoined from a
  neighbour's replica skips the rounds in between: they get a ``failed`` row for it (the reason says from whom it
  rejoined, also in a ``gossip-rejoined`` event), and the next rounds count it again;
- at the end, a ``final`` message brings each replica's final weights: the run's model is their plain average (saved
  as the run's final weights, with every replica beside it) and the summary reports both.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from crossdc import protocol
from crossdc.db.records import DatacenterRoundRecord
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.rundir import RunDir
from crossdc.federation.grid_io import FederationError, Reply, collect_replies, rediscover
from crossdc.federation.server_checkpoint import SETTINGS_ATTEMPT
from crossdc.federation.session import RoundSession
from crossdc.federation.sync_loop import watched_session
from crossdc.protocol import CONFIG_KEY, PayloadError, decode_gossip_reply
from crossdc.strategies.base import StrategyError
from crossdc.strategies.gossip import Gossip
from crossdc.strategies.mixing import consensus_distances, sketched_distances

log = logging.getLogger("crossdc.federation")

#: how long a datacenter's trainer may hold a report message before it answers with nothing new
REPORT_WAIT_S = 5.0
#: how long the coordinator waits for report replies beyond that (a ClientApp's start): a datacenter that is down
#: delays the others' reports by this much, and nothing is lost by a reply that comes too late (it is asked again)
REPORT_GRACE_S = 25.0
#: the coordinator's progress, in the run folder: the last round whose rows are written, and the run's byte totals
PROGRESS_FILE = "gossip-progress.json"
#: the file beside the run's final weights holding every replica's (one .npz, tensors named "<datacenter>/<name>")
REPLICAS_FILE = "final-replicas.npz"


def _ask(grid: Grid, session: RoundSession, nodes: Mapping[str, int], action: str, run_id: str, run_dir: RunDir,
         attempt: int, acknowledged: Mapping[str, int], wait_s: float, timeout_s: float,
         received: Mapping[str, int] | None = None) -> dict[str, Reply]:
    """One gossip message to every datacenter, and the replies that came within `timeout_s`, by datacenter (not
    waiting for those the heartbeat marks down)."""
    messages = {}
    for name, node in nodes.items():
        config = protocol.gossip_config(action=action, run_id=run_id, run_dir=str(run_dir.path), datacenter=name,
                                        acknowledged=acknowledged.get(name, 0), wait_s=wait_s, attempt=attempt,
                                        received=None if received is None else received.get(name, 0))
        messages[name] = Message(RecordDict({CONFIG_KEY: ConfigRecord(config)}), dst_node_id=node,
                                 message_type=MessageType.TRAIN, ttl=timeout_s)
    sent = session.sent_now()
    ids = list(grid.push_messages(list(messages.values())))
    by_id = dict(zip(ids, messages, strict=True))
    replies = collect_replies(grid, ids, timeout_s, given_up=session.given_up(sent, dict(zip(messages, ids, strict=True))))
    return {by_id[message_id]: reply for message_id, reply in replies.items()}


def _error(reply: Reply) -> str | None:
    if reply.message.has_error():
        return str(reply.message.error.reason).splitlines()[0][:500]
    return None


def run_gossip(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    """Run a gossip experiment to its end on `grid` (see the module docstring); returns the run's summary."""
    with watched_session(grid, run_dir, run_id, config, runlog) as (session, nodes):
        return _gossip(grid, run_dir, run_id, config, runlog, session, nodes)


def _gossip(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog, session: RoundSession,
            nodes: dict[str, int]) -> dict[str, Any]:
    strategy = session.strategy
    if not isinstance(strategy, Gossip):
        raise StrategyError(f"strategy '{strategy.name}' declares the gossip loop but is no Gossip")
    names = config.datacenter_names
    attempt = int(run_dir.settings().get(SETTINGS_ATTEMPT, 1))
    timeout_s = config.run.round_timeout_s
    run_started = time.perf_counter()
    progress_file = run_dir.path / PROGRESS_FILE
    progress = json.loads(progress_file.read_text()) if attempt > 1 and progress_file.exists() else {}
    logged = int(progress.get("logged", 0))
    totals = {"bytes_up": 0, "bytes_down": 0, **progress.get("totals", {})}
    if attempt > 1:  # the coordinator was away: what it logged after its progress file is logged again
        runlog.forget_rounds_after(run_id=run_id, round=logged)
        runlog.log_event(run_id=run_id, kind="coordinator-restarted", round=logged, detail={"attempt": attempt})
    # a start message to a datacenter whose replica runs already (a restarted coordinator's) changes nothing there
    started = _ask(grid, session, nodes, protocol.GOSSIP_START, run_id, run_dir, attempt, {}, 0.0, timeout_s)
    refused = {name: _error(started[name]) or "" for name in names if name not in started or _error(started[name])}
    if refused:
        raise FederationError("gossip could not start on " + "; ".join(f"{n}: {why or 'no reply'}" for n, why in
                                                                        sorted(refused.items())))
    if attempt == 1:
        runlog.log_event(run_id=run_id, kind="gossip-started", round=0,
                         detail={"topology": strategy.params["topology"], "datacenters": names})
    seen_nodes = set(nodes.values())
    #: by datacenter, the last round the coordinator took from it (acknowledged once written)
    taken = dict.fromkeys(names, logged)
    acknowledged = dict.fromkeys(names, logged)
    marks: list[tuple[int, int, dict[str, int]]] = []  # (round, the run log's mark after its rows, totals then)
    reports: dict[int, dict[str, dict[str, Any]]] = {}
    snapshots: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    rejoined: dict[str, int] = {}  # datacenter → the round it rejoined at (it has no report of the rounds before)
    last_news = dict.fromkeys(names, time.monotonic())
    while logged < config.run.rounds:
        rediscover(grid, nodes, seen_nodes, config, runlog, run_id, logged + 1, heartbeat=session.heartbeat_offer)
        replies = _ask(grid, session, nodes, protocol.GOSSIP_REPORT, run_id, run_dir, attempt, acknowledged, REPORT_WAIT_S,
                       REPORT_WAIT_S + REPORT_GRACE_S, received=taken)
        for name, reply in replies.items():
            error = _error(reply)
            if error is not None:
                runlog.log_event(run_id=run_id, kind="gossip-report-failed", round=logged + 1, datacenter=name,
                                 detail=error)
                continue
            try:
                filed, pictures, _, _ = decode_gossip_reply(reply.message.content)
            except PayloadError as err:
                runlog.log_event(run_id=run_id, kind="gossip-report-failed", round=logged + 1, datacenter=name,
                                 detail=str(err))
                continue
            for report in filed:
                if int(report["round"]) <= logged:
                    continue  # logged already (a restarted coordinator asks from its progress file)
                reports.setdefault(int(report["round"]), {})[name] = report
                back = report.get("rejoined")
                if back and rejoined.get(name) != int(back["at_round"]):  # (a report comes again until acknowledged)
                    rejoined[name] = int(back["at_round"])
                    runlog.log_event(run_id=run_id, kind="gossip-rejoined", round=int(report["round"]),
                                     datacenter=name, detail=back)
            for server_round, weights in pictures.items():
                if server_round > logged:
                    snapshots.setdefault(server_round, {})[name] = weights
            if filed:
                taken[name] = max(taken[name], max(int(r["round"]) for r in filed))
                last_news[name] = time.monotonic()
        while logged < config.run.rounds:
            server_round = logged + 1
            have = reports.get(server_round, {})
            # down: rejoined from a neighbour after this round, so it has no report of it
            down = [n for n in names if n not in have and rejoined.get(n, 0) >= server_round]
            silent = [n for n in names if n not in have and n not in down and time.monotonic() - last_news[n] > timeout_s]
            if len(have) + len(silent) + len(down) < len(names):
                break
            if not have:
                raise FederationError(f"round {server_round}: no datacenter reported for {timeout_s:g}s")
            _log_round(session, runlog, run_id, strategy, server_round, have, snapshots.pop(server_round, {}), silent,
                       totals, timeout_s)
            for name in down:
                runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name,
                                            record=DatacenterRoundRecord(status="failed", reason=(
                                                f"down; rejoined at round {rejoined[name]} from a neighbour's replica")))
            reports.pop(server_round, None)
            logged = server_round
            marks.append((logged, runlog.mark(), dict(totals)))
            session.check_run_log(f"round-{server_round}")
        written = [(r, then) for r, mark, then in marks if runlog.written(mark)]
        if written:  # acknowledge what is in the run log, and say so in the progress file
            durable, then = written[-1]
            marks = [entry for entry in marks if entry[0] > durable]
            progress_file.write_text(json.dumps({"logged": durable, "totals": then}))
            acknowledged = {name: min(taken[name], durable) for name in names}
    finals = _ask(grid, session, nodes, protocol.GOSSIP_FINAL, run_id, run_dir, attempt, acknowledged, 0.0, timeout_s)
    replicas: dict[str, dict[str, np.ndarray]] = {}
    for name, reply in finals.items():
        if _error(reply) is None:
            final = decode_gossip_reply(reply.message.content)[2]
            if final is not None:
                replicas[name] = final
    if not replicas:
        raise FederationError("no datacenter returned its final replica")
    _, distance, average = consensus_distances([replicas[n] for n in names if n in replicas])
    session.weights = average
    session.val_loss, session.val_accuracy, _ = session.evaluate()
    replica_losses = {name: session.evaluate(weights)[0] for name, weights in replicas.items()}
    session.save_final_weights()
    np.savez(run_dir.path / REPLICAS_FILE, **{f"{n}/{k}": v for n, w in replicas.items() for k, v in w.items()})
    session.totals["bytes_up"], session.totals["bytes_down"] = totals["bytes_up"], totals["bytes_down"]
    return session.summary(time.perf_counter() - run_started, final_model="average of the replicas",
                           replica_val_loss=replica_losses, final_consensus_distance=distance,
                           replicas_missing=sorted(set(names) - set(replicas)))


def _log_round(session: Any, runlog: RunLog, run_id: str, strategy: Gossip, server_round: int,
               reports: Mapping[str, Mapping[str, Any]], pictures: Mapping[str, Mapping[str, np.ndarray]],
               silent: list[str], totals: dict[str, int], timeout_s: float) -> None:
    """One gossip round to the run log (see the module docstring)."""
    names = list(strategy.run.datacenters) if strategy.run else sorted(reports)
    distances: dict[str, float] = {}
    val_loss = val_accuracy = mean_distance = None
    order = [n for n in names if n in reports]
    if pictures and set(pictures) == set(reports):  # an observed round: every reporting replica's snapshot, exact
        each, mean_distance, average = consensus_distances([pictures[n] for n in order])
        distances = dict(zip(order, each, strict=True))
        session.weights = average
        val_loss, val_accuracy, _ = session.evaluate()
        runlog.log_event(run_id=run_id, kind="replica-losses", round=server_round,
                         detail={n: session.evaluate(pictures[n])[0] for n in order})
    elif len(order) > 1 and all(reports[n].get("sketch") for n in order):  # else estimated from the sketches
        each, mean_distance = sketched_distances([np.asarray(reports[n]["sketch"], np.float64) for n in order])
        distances = dict(zip(order, each, strict=True))
    sent_total = received_total = 0
    wall = 0.0
    for name, report in reports.items():
        links = report.get("links", {})
        sent = sum(int(link["bytes_sent"]) for link in links.values())
        received = sum(int(link["bytes_received"]) for link in links.values())
        sent_total, received_total = sent_total + sent, received_total + received
        wall = max(wall, float(report["compute_s"]) + float(report["idle_s"]))
        failed = {names[int(peer)]: link.get("error") for peer, link in links.items() if not link.get("used")}
        runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, record=DatacenterRoundRecord(
            status="ok", reason=("mixed without " + ", ".join(sorted(failed))) if failed else None,
            bytes_up=sent, bytes_down=received, compute_s=float(report["compute_s"]), idle_s=float(report["idle_s"]),
            round_s=float(report["compute_s"]) + float(report["idle_s"]), train_loss=float(report["train_loss"]),
            num_examples=int(report["num_examples"]), consensus_distance=distances.get(name)))
        for peer, link in links.items():
            runlog.log_link_round(run_id=run_id, round=server_round, src=name, dst=names[int(peer)],
                                  bytes=int(link["bytes_sent"]), in_flight_s=float(link["in_flight_s"]),
                                  error=link.get("error"))
    for name in silent:
        runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, record=DatacenterRoundRecord(
            status="timeout", reason=f"no report for {timeout_s:g}s"))
    totals["bytes_up"] += sent_total
    totals["bytes_down"] += received_total
    if val_loss is not None:
        session.val_loss, session.val_accuracy = val_loss, val_accuracy
    runlog.log_round(run_id=run_id, round=server_round, tau=strategy.tau(server_round), val_loss=val_loss,
                     val_accuracy=val_accuracy, bytes_up=sent_total, bytes_down=received_total, bytes_up_raw=0,
                     wall_s=wall, consensus_distance=mean_distance)
