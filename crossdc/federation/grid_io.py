"""The coordinator's side of Flower's Grid: finding the datacenters and collecting replies as they arrive.

Promises: :func:`discover_datacenters` maps every configured datacenter to its SuperNode (asking each node who it
is) or raises :class:`FederationError` naming the missing ones (and the reason of every node whose hello failed on
its side or whose claim was refused); :func:`rediscover` moves a datacenter that came
back under a new node id; :func:`collect_replies` pulls replies as they arrive (polling every 20–250 ms, faster
while replies come in; no fixed 3-second barrier) and polls only messages still pending.

On a grid bound to a standing federation's enrollments (:func:`bind_identities`), a node is the datacenter its key
was enrolled as, never merely the one it claims (the rule: :func:`crossdc.federation.identity.judge_claim`, against
the ``datacenters`` table read at each discovery and rediscovery): a claim that does not match is refused, with an
``identity-refused`` event and an audit row, and the node takes no part in the run; the datacenter its key is
enrolled as, if any, is the one marked seen. Discovery waits for the nodes the configured datacenters' keys are
enrolled under. A grid not bound (a local run) takes each node at its word, as before.

A hello that offers the coordinator's heartbeat offers each node its own key
(:meth:`crossdc.deployment.heartbeat.NodeKeys.for_node`, never the attempt's secret); where discovery places a
datacenter, and where rediscovery moves it, its beats are from then on verified with the key of that node alone
(:meth:`~crossdc.deployment.heartbeat.NodeKeys.bind`): a node refused, or one asked before it was known, holds no key
another datacenter's beats are verified with.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from sqlalchemy.exc import SQLAlchemyError

from crossdc import protocol
from crossdc.db.queries import enrolled_identities_at
from crossdc.db.runlog import RunLog
from crossdc.deployment.heartbeat import HeartbeatOffer
from crossdc.experiment.config import ExperimentConfig
from crossdc.federation.deadline import Deadlines
from crossdc.federation.identity import CLAIM_ACTION, REFUSED_EVENT, Enrollments, Refusal, judge_claim, shown
from crossdc.federation.reply_inbox import inbox_of
from crossdc.protocol import CONFIG_KEY

log = logging.getLogger("crossdc.federation")

POLL_INTERVAL_S = 0.02
MAX_POLL_INTERVAL_S = 0.25
DISCOVERY_TIMEOUT_S = 180.0
#: how long a round waits for a newly seen SuperNode (a restarted datacenter) to say who it is; one that does not say
#: by then is not asked again (a node whose connection was reset may leave a registration nobody answers for)
REDISCOVERY_TIMEOUT_S = 20.0


class FederationError(RuntimeError):
    """The federation cannot go on (missing datacenters, too few replies)."""


@dataclass
class _Binding:
    """A grid's tie to a standing federation's enrollments: the database whose ``datacenters`` table says who its
    nodes are, and the nodes refused so far (never asked again: a key's enrolled name does not change)."""

    db_url: str
    refused: set[int] = field(default_factory=set)


_BINDINGS: weakref.WeakKeyDictionary[Grid, _Binding] = weakref.WeakKeyDictionary()
#: how often discovery tries again to read the enrollments while the database does not answer
ENROLLMENTS_RETRY_S = 1.0


def bind_identities(grid: Grid, db_url: str) -> None:
    """From now on, every node found on `grid` must be the datacenter its key is enrolled as in the database at
    `db_url` (a run on a standing federation, whose SuperLink authenticates each SuperNode by its key)."""
    _BINDINGS[grid] = _Binding(db_url)


def _enrollments(grid: Grid) -> Enrollments | None:
    """The grid's enrollments as they stand now; None for a grid not bound (its nodes are taken at their word).
    Raises SQLAlchemyError (or ValueError, for a table that holds no node id) when they cannot be read."""
    binding = _BINDINGS.get(grid)
    return None if binding is None else Enrollments.from_rows(enrolled_identities_at(binding.db_url))


def _refuse(grid: Grid, runlog: RunLog, run_id: str, refusal: Refusal, config: ExperimentConfig,
            enrollments: Enrollments, server_round: int | None) -> None:
    """Record a refused claim: an event and an audit row (the claimed name in their datacenter and target columns
    when it is one of the run's or an enrolled one, whatever its status), the datacenter the node's key is enrolled
    as, if any, seen, and the node as one not to ask again."""
    _BINDINGS[grid].refused.add(refusal.node_id)
    known = refusal.claimed in config.datacenter_names or enrollments.status_of(refusal.claimed) is not None
    claimed = refusal.claimed if known else None
    detail = {"node_id": str(refusal.node_id), "claimed": shown(refusal.claimed), "key_enrolled_as": refusal.holder,
              "reason": refusal.reason}
    log.warning("run %s: node %s refused: %s", run_id, refusal.node_id, refusal.reason)
    runlog.log_event(run_id=run_id, kind=REFUSED_EVENT, round=server_round, datacenter=claimed, detail=detail)
    runlog.audit(action=CLAIM_ACTION, outcome="refused", target=claimed,
                 detail={**detail, "run_id": run_id, "round": server_round})
    if refusal.holder is not None:
        runlog.touch_datacenter(name=refusal.holder)


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


def hello_content(config: ExperimentConfig, run_id: str, node_id: int, heartbeat: HeartbeatOffer | None = None) -> RecordDict:
    """The hello query to the node `node_id`: the datacenters' names, the run id and the experiment's config (a
    production node prepares the run's trainer from it; see crossdc.clients.node), and the coordinator's `heartbeat`
    offer if any, with that node's own key."""
    fields: dict[str, str | int] = {protocol.HELLO_DATACENTERS: ",".join(config.datacenter_names),
                                    protocol.RUN_ID: run_id, protocol.RUN_CONFIG: config.to_json()}
    if heartbeat is not None:
        fields.update({protocol.HELLO_HEARTBEAT_PORT: heartbeat.port,
                       protocol.HELLO_HEARTBEAT_KEY: heartbeat.keys.for_node(node_id).hex()})
    return RecordDict({CONFIG_KEY: ConfigRecord(fields)})


def _claimed_name(reply: Reply) -> str | None:
    """The datacenter a hello reply says its node is; None for an error reply or one without a name."""
    try:
        return str(reply.message.content[CONFIG_KEY][protocol.DATACENTER])
    except Exception:
        return None


def _enrollments_within(grid: Grid, deadline: float) -> Enrollments | None:
    """:func:`_enrollments`, tried again every ENROLLMENTS_RETRY_S while the database does not answer, up to the
    monotonic `deadline`; then FederationError."""
    while True:
        try:
            return _enrollments(grid)
        except (SQLAlchemyError, ValueError) as err:
            if time.monotonic() + ENROLLMENTS_RETRY_S >= deadline:
                raise FederationError(f"could not read the enrolled datacenters: {err}".splitlines()[0]) from err
            time.sleep(ENROLLMENTS_RETRY_S)


def discover_datacenters(grid: Grid, config: ExperimentConfig, runlog: RunLog, run_id: str,
                         heartbeat: HeartbeatOffer | None = None) -> dict[str, int]:
    """Map every configured datacenter to its SuperNode by asking each node who it is (the hello offering
    `heartbeat`, if any, each datacenter's beats then verified with its node's key), once as many nodes as
    datacenters are connected (and, on a bound grid, the nodes the configured datacenters' keys are enrolled under
    among them)."""
    names = config.datacenter_names
    deadline = time.monotonic() + DISCOVERY_TIMEOUT_S
    enrollments = _enrollments_within(grid, deadline)
    awaited = enrollments.nodes_of(names) if enrollments is not None else set()
    node_ids: list[int] = []
    while time.monotonic() < deadline:
        node_ids = list(grid.get_node_ids())
        if len(node_ids) >= len(names) and awaited <= set(node_ids):
            break
        time.sleep(0.2)
    if len(node_ids) < len(names):
        raise FederationError(f"only {len(node_ids)} of {len(names)} datacenters connected within {DISCOVERY_TIMEOUT_S:.0f}s")
    if enrollments is not None:  # as they stand when the nodes are asked
        enrollments = _enrollments_within(grid, deadline)
    messages = [Message(hello_content(config, run_id, node, heartbeat), dst_node_id=node, message_type=MessageType.QUERY)
                for node in node_ids]
    ids = list(grid.push_messages(messages))
    asked = dict(zip(ids, node_ids, strict=True))  # each hello's node: the only one the SuperLink let receive it
    replies = collect_replies(grid, ids, DISCOVERY_TIMEOUT_S)
    mapping: dict[str, int] = {}
    failed: list[str] = []  # the nodes whose hello failed on their side, with the reason their ClientApp gave
    for message_id, reply in replies.items():
        node = asked[message_id]
        name = _claimed_name(reply)
        if name is None:  # that node stays unknown
            if reply.message.has_error():
                failed.append(f"node {node} answered with an error: {reply.message.error.reason}")
            continue
        if enrollments is not None and (refusal := judge_claim(node, name, enrollments)) is not None:
            _refuse(grid, runlog, run_id, refusal, config, enrollments, None)
            failed.append(f"node {node} refused: {refusal.reason}")
            continue
        if name in mapping:
            raise FederationError(f"two SuperNodes claim to be datacenter {shown(name)}")
        if name not in names:
            runlog.log_event(run_id=run_id, kind="unknown-datacenter", detail=f"node {node} says it is {shown(name)}")
            continue
        mapping[name] = node
    missing = [n for n in names if n not in mapping]
    if missing:
        raise FederationError(f"datacenters did not answer: {', '.join(missing)}" + "".join(f"; {f}" for f in failed))
    if heartbeat is not None:
        for name, node in mapping.items():
            heartbeat.keys.bind(name, node)
    return mapping


def rediscover(grid: Grid, nodes: dict[str, int], seen: set[int], config: ExperimentConfig, runlog: RunLog, run_id: str,
               server_round: int, timeout_s: float = REDISCOVERY_TIMEOUT_S, heartbeat: HeartbeatOffer | None = None,
               ) -> list[str]:
    """A SuperNode that restarts registers under a new node id: ask every node not seen before who it is, and
    move its datacenter to the new id (in `nodes`, in place), with a ``datacenter-rejoined`` event. On a bound grid
    its claim is checked first, against the enrollments as they stand now; a node refused here or at discovery is
    never asked again. `seen` holds the node ids already placed (current, replaced, not a configured datacenter, refused, or
    silent: no answer within `timeout_s`, a ``silent-node`` event); it grows here. The hello offers `heartbeat`, if
    any (each node its own key; a datacenter that moves has its beats verified with its new node's key from then
    on). Returns the datacenters that moved. Costs one call to the SuperLink when nothing changed (and, on a bound
    grid, one read of the enrollments when a new node is there; unreadable, nobody is asked until the next call)."""
    binding = _BINDINGS.get(grid)
    refused = binding.refused if binding is not None else set()
    new_ids = [node for node in grid.get_node_ids() if node not in seen and node not in nodes.values() and node not in refused]
    if not new_ids:
        return []
    try:
        enrollments = _enrollments(grid)
    except (SQLAlchemyError, ValueError) as err:  # nobody can be placed now: ask at the next rediscovery
        log.warning("run %s: new nodes %s not asked who they are: the enrolled datacenters could not be read: %s",
                    run_id, new_ids, str(err).splitlines()[0])
        return []
    ids = list(grid.push_messages([Message(hello_content(config, run_id, node, heartbeat), dst_node_id=node,
                                           message_type=MessageType.QUERY, ttl=timeout_s) for node in new_ids]))
    asked = dict(zip(ids, new_ids, strict=True))  # each hello's node: the only one the SuperLink let receive it
    moved: list[str] = []
    replies = collect_replies(grid, ids, timeout_s)
    answered = {asked[message_id] for message_id in replies}
    for node in new_ids:
        if node not in answered:  # silent: never asked again (each ask would hold the loop for the whole timeout)
            seen.add(node)
            runlog.log_event(run_id=run_id, kind="silent-node", round=server_round,
                             detail=f"node {node} did not say who it is within {timeout_s:g}s; not asked again")
    for message_id, reply in replies.items():
        node = asked[message_id]
        name = _claimed_name(reply)
        if name is None:  # an error reply: ask again next time
            continue
        seen.add(node)
        if enrollments is not None and (refusal := judge_claim(node, name, enrollments)) is not None:
            _refuse(grid, runlog, run_id, refusal, config, enrollments, server_round)
            continue
        if name not in nodes:
            runlog.log_event(run_id=run_id, kind="unknown-datacenter", round=server_round,
                             detail=f"node {node} says it is {shown(name)}")
            continue
        runlog.log_event(run_id=run_id, kind="datacenter-rejoined", round=server_round, datacenter=name,
                         detail={"old_node_id": str(nodes[name]), "new_node_id": str(node)})
        seen.add(nodes[name])
        nodes[name] = node
        if heartbeat is not None:
            heartbeat.keys.bind(name, node)
        moved.append(name)
    return moved
