"""The coordinator's side of Flower's Grid: finding the datacenters and collecting replies as they arrive.

Promises: :func:`discover_datacenters` maps every configured datacenter to its SuperNode (asking each node who it
is) or raises :class:`FederationError` naming the missing ones (and the reason of every node whose hello failed on
its side); :func:`rediscover` moves a datacenter that came
back under a new node id; :func:`collect_replies` pulls replies as they arrive (polling every 20–250 ms, faster
while replies come in; no fixed 3-second barrier) and polls only messages still pending.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from crossdc import protocol
from crossdc.db.runlog import RunLog
from crossdc.deployment.heartbeat import HeartbeatOffer
from crossdc.experiment.config import ExperimentConfig
from crossdc.federation.deadline import Deadlines
from crossdc.federation.reply_inbox import inbox_of
from crossdc.protocol import CONFIG_KEY

POLL_INTERVAL_S = 0.02
MAX_POLL_INTERVAL_S = 0.25
DISCOVERY_TIMEOUT_S = 180.0
#: how long a round waits for a newly seen SuperNode (a restarted datacenter) to say who it is; one that does not say
#: by then is not asked again (a node whose connection was reset may leave a registration nobody answers for)
REDISCOVERY_TIMEOUT_S = 20.0


class FederationError(RuntimeError):
    """The federation cannot go on (missing datacenters, too few replies)."""


@dataclass
class Reply:
    """A datacenter's reply and when it was pulled (wall-clock, for durations only)."""

    message: Message
    received_at: float


def pull_replies(grid: Grid, pending: set[str]) -> dict[str, Reply]:
    """One poll: the replies to the `pending` message ids that are in now, by message id (removed from `pending`).
    Never waits on a reply still being uploaded (crossdc.federation.reply_inbox)."""
    replies: dict[str, Reply] = {}
    if not pending:
        return replies
    for message in inbox_of(grid).pull(pending):
        reply_to = message.metadata.reply_to_message_id
        if reply_to in pending:
            pending.discard(reply_to)
            replies[reply_to] = Reply(message, time.time())
    return replies


def collect_replies(grid: Grid, message_ids: list[str], timeout_s: float,
                    after_error_s: float | None = None, given_up: Callable[[], set[str]] | None = None) -> dict[str, Reply]:
    """Pull replies as they arrive until all are in or the timeout passes; returns what came, by message id. With
    `after_error_s`, a reply that carries an error shortens the wait to that many seconds more (a loop whose round
    fails with any one failure collects the others' reasons, and does not wait out the timeout for a dead node).
    `given_up()` names message ids not worth waiting for any more (their datacenter is down): once only those are
    missing, the wait ends (a reply of theirs that is already in is still taken)."""
    pending = set(message_ids)
    replies: dict[str, Reply] = {}
    deadline = time.monotonic() + timeout_s
    interval = POLL_INTERVAL_S
    while pending and time.monotonic() < deadline and not (given_up is not None and pending <= given_up()):
        arrived = pull_replies(grid, pending)
        replies.update(arrived)
        if after_error_s is not None and any(reply.message.has_error() for reply in arrived.values()):
            deadline = min(deadline, time.monotonic() + after_error_s)
        # poll fast while replies come in, back off (to MAX_POLL_INTERVAL_S) while nothing does
        interval = POLL_INTERVAL_S if arrived else min(MAX_POLL_INTERVAL_S, interval * 1.5)
        if pending:
            time.sleep(interval)
    return replies


def collect_within(grid: Grid, message_ids: list[str], deadlines: Deadlines, timeout_s: float,
                   needed: int, given_up: Callable[[], set[str]] | None = None) -> tuple[dict[str, Reply], float]:
    """:func:`collect_replies` up to the deadline `timeout_s`; with fewer than `needed` replies by then, on up to
    the adaptive deadline's ceiling rather than fail the round (not for replies `given_up()` names: their datacenter
    is down). (replies, the seconds waited at most)."""
    replies = collect_replies(grid, message_ids, timeout_s, given_up=given_up)
    more = deadlines.can_wait_on(timeout_s)
    still = [i for i in message_ids if i not in replies and not (given_up is not None and i in given_up())]
    if len(replies) < needed and more > 0 and still:
        replies.update(collect_replies(grid, [i for i in message_ids if i not in replies], more, given_up=given_up))
        timeout_s += more
    return replies, timeout_s


def hello_content(config: ExperimentConfig, run_id: str, heartbeat: HeartbeatOffer | None = None) -> RecordDict:
    """The hello query: the datacenters' names, the run id and the experiment's config (a production node
    prepares the run's trainer from it; see crossdc.clients.node), and the coordinator's `heartbeat` offer if any."""
    fields: dict[str, str | int] = {protocol.HELLO_DATACENTERS: ",".join(config.datacenter_names),
                                    protocol.RUN_ID: run_id, protocol.RUN_CONFIG: config.to_json()}
    if heartbeat is not None:
        fields.update({protocol.HELLO_HEARTBEAT_PORT: heartbeat.port, protocol.HELLO_HEARTBEAT_KEY: heartbeat.key.hex()})
    return RecordDict({CONFIG_KEY: ConfigRecord(fields)})


def _claimed_name(reply: Reply) -> str | None:
    """The datacenter a hello reply says its node is; None for an error reply or one without a name."""
    try:
        return str(reply.message.content[CONFIG_KEY][protocol.DATACENTER])
    except Exception:
        return None


def discover_datacenters(grid: Grid, config: ExperimentConfig, runlog: RunLog, run_id: str,
                         heartbeat: HeartbeatOffer | None = None) -> dict[str, int]:
    """Map every configured datacenter to its SuperNode by asking each node who it is (the hello offering
    `heartbeat`, if any)."""
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
    content = hello_content(config, run_id, heartbeat)
    messages = [Message(content, dst_node_id=node, message_type=MessageType.QUERY) for node in node_ids]
    ids = list(grid.push_messages(messages))
    replies = collect_replies(grid, ids, DISCOVERY_TIMEOUT_S)
    mapping: dict[str, int] = {}
    failed: list[str] = []  # the nodes whose hello failed on their side, with the reason their ClientApp gave
    for reply in replies.values():
        name = _claimed_name(reply)
        if name is None:  # that node stays unknown
            if reply.message.has_error():
                failed.append(f"node {reply.message.metadata.src_node_id} answered with an error: "
                              f"{reply.message.error.reason}")
            continue
        if name in mapping:
            raise FederationError(f"two SuperNodes claim to be datacenter '{name}'")
        if name not in names:
            runlog.log_event(run_id=run_id, kind="unknown-datacenter",
                             detail=f"node {reply.message.metadata.src_node_id} says it is '{name}'")
            continue
        mapping[name] = reply.message.metadata.src_node_id
    missing = [n for n in names if n not in mapping]
    if missing:
        raise FederationError(f"datacenters did not answer: {', '.join(missing)}" + "".join(f"; {f}" for f in failed))
    return mapping


def rediscover(grid: Grid, nodes: dict[str, int], seen: set[int], config: ExperimentConfig, runlog: RunLog, run_id: str,
               server_round: int, timeout_s: float = REDISCOVERY_TIMEOUT_S, heartbeat: HeartbeatOffer | None = None,
               ) -> list[str]:
    """A SuperNode that restarts registers under a new node id: ask every node not seen before who it is, and
    move its datacenter to the new id (in `nodes`, in place), with a ``datacenter-rejoined`` event. `seen` holds
    the node ids already placed (current, replaced, not a configured datacenter, or silent: no answer within
    `timeout_s`, a ``silent-node`` event); it grows here. The hello offers `heartbeat`, if any. Returns the
    datacenters that moved. Costs one call to the SuperLink when nothing changed."""
    new_ids = [node for node in grid.get_node_ids() if node not in seen and node not in nodes.values()]
    if not new_ids:
        return []
    content = hello_content(config, run_id, heartbeat)
    ids = list(grid.push_messages([Message(content, dst_node_id=node, message_type=MessageType.QUERY, ttl=timeout_s)
                                   for node in new_ids]))
    moved: list[str] = []
    replies = collect_replies(grid, ids, timeout_s)
    answered = {reply.message.metadata.src_node_id for reply in replies.values()}
    for node in new_ids:
        if node not in answered:  # silent: never asked again (each ask would hold the loop for the whole timeout)
            seen.add(node)
            runlog.log_event(run_id=run_id, kind="silent-node", round=server_round,
                             detail=f"node {node} did not say who it is within {timeout_s:g}s; not asked again")
    for reply in replies.values():
        node = reply.message.metadata.src_node_id
        name = _claimed_name(reply)
        if name is None:  # an error reply: ask again next time
            continue
        seen.add(node)
        if name not in nodes:
            runlog.log_event(run_id=run_id, kind="unknown-datacenter", round=server_round, detail=f"node {node} says it is '{name}'")
            continue
        runlog.log_event(run_id=run_id, kind="datacenter-rejoined", round=server_round, datacenter=name,
                         detail={"old_node_id": str(nodes[name]), "new_node_id": str(node)})
        seen.add(nodes[name])
        nodes[name] = node
        moved.append(name)
    return moved
