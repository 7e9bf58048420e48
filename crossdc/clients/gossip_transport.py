"""Gossip messages datacenter to datacenter: torch.distributed point-to-point over a two-rank gloo group per exchange,
each exchange in a process of its own.

Why gloo groups and not hivemind: crossdc's datacenters already run torch.distributed (their worker groups, the
sync-dp baseline), gloo's point-to-point send/recv crosses the emulated links like any TCP traffic, and a pair group
has no state beyond one exchange. hivemind's averager is a group all-reduce; a ring or CHOCO exchange would use only
its P2P layer, for a second engine and its daemon in every datacenter.

Why processes: a meeting that fails part-way (a link cut between the two ends' probes, or inside the meeting) can
leave the host's rendezvous store unable to serve later meetings (seen with torch's libuv and threaded store servers
alike), and a gloo group that fails part-way leaves state behind in the process that built it. So the store runs in
a process of its own, started again after a meeting it hosted hung past every timeout, and each exchange runs in a
child process
(forked from a server that has torch loaded already: milliseconds, not an import) that builds the group, exchanges,
hands back what arrived and exits; a failed or stalled one is killed, and everything it held goes with it.

Promises:

- every datacenter hosts one rendezvous store (a torch ``TCPStore``) at its own address and port (:class:`GossipTransport`),
  in a process of its own; after a round in which a meeting it hosted hung past every timeout (its process was
  killed), the store is started afresh (with the replica it offers) before the next round;
- an exchange between datacenters i < j in round r meets on i's store under the prefix ``gossip/r{r}/{i}-{j}``,
  builds a two-rank gloo group there (rank 0 is i) bound to the datacenter's own address (so in a namespace it
  crosses the emulated WAN device), swaps what each holds of the other's public copy, then each side's message
  (a header, then the payload), and drops the group with the process that built it. Nothing outlives an exchange:
  a failure leaves nothing to rebuild, and the next round meets afresh;
- both ends must be at the same round to meet (the round is in the prefix). Each end says on the meeting's store
  that it has come, and waits for the other (an end that gives up says so too, so that one coming later does not
  build a group with it); each datacenter's store also says the last round whose exchanges it
  finished. An end whose neighbour finished this round already (it gave up on this meeting and went on) stops
  waiting at once, so two datacenters a round apart meet again at the next round instead of each waiting a whole
  timeout for the other's round. A neighbour that does not come, dies or stalls makes
  :meth:`GossipTransport.exchange` return with the reason and no message within 3 × ``timeout_s`` (the meeting,
  the swap, the payload): nobody waits forever, and a message is returned whole or not at all. Once both ends
  have come, connecting the pair and swapping the first words gets :func:`handshake_timeout` (30 round trips of
  the link, the least time a probe of it took; at least 10 s; the exchange's process is killed 5 s after): an end
  whose neighbour went away as they met (a link cut just then) gives up within seconds, and its other neighbours
  do not wait on it for a whole timeout. And an exchange under way ends as failed once its neighbour has finished the
  round (its store says so) and the handshake's time has passed since: a cut can reset one end's connection and
  not the other's, whose gloo receive would otherwise wait out the whole timeout;
- before meeting a neighbour, a datacenter checks that it can reach the neighbour's rendezvous store at all (a TCP
  connection within ``probe_s``, over the same link: one round trip); if not (a cut link, a dead datacenter), the
  exchange fails at once, so a cut costs each round a probe, not a whole timeout. If it can, the meeting gets the
  whole ``timeout_s`` (the neighbour may simply be a little behind). Both ends of a cut link probe each other, so
  they meet again the round the link is back; a datacenter whose last exchange with a neighbour failed counts it
  as *suspect* until one works (reported, nothing else changes);
- after each round a datacenter offers its replica (the outer weights after the mix, in the wire format) on its own
  store (:meth:`GossipTransport.publish`: the newest two rounds are kept, so the store holds up to two copies of the
  model); a datacenter that restarts behind its neighbours asks them which round they offer
  (:meth:`~GossipTransport.offered_round`) and takes the newest replica (:meth:`~GossipTransport.fetch_replica`),
  each within ``timeout_s``, in a process of its own like an exchange;
- the bytes of an exchange are its headers and payloads as sent (what gloo puts on the wire, less TCP/IP framing),
  and its time in flight is measured from the group's creation to the last payload received;
- every process of the transport (the store, an exchange, a read of an offer) dies with the run's root
  (:func:`crossdc.experiment.processes.die_with_run_root`, its first step: a process forked from the fork server
  inherits no thread, so it starts its own watch), never living on to its timeout after a killed run.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from crossdc.clients.gossip_replica import DELTA, FULL, GossipMessage
from crossdc.experiment.processes import die_with_run_root

log = logging.getLogger("crossdc.gossip")

_KINDS = {FULL: 0, DELTA: 1}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
#: the int64 words of a message header: present, kind, version, base (−1: none), payload length
_HEADER_WORDS = 5
#: how long a datacenter tries to reach a neighbour's store before it gives up on it for the round
PROBE_S = 1.5
#: how long an exchange's process tries to connect to a store that answered the probe a moment ago: torch retries a
#: refused connect for a store client's whole timeout, then once more after a random delay (138 s measured at a 60-s
#: timeout when the neighbour died just after the probe), so the connect gets its own short timeout
STORE_CONNECT_S = 3.0
#: the least time two ends that have both come to a meeting get to connect their pair and swap their first words, and
#: that time in round trips of the link (the least time its probe took): these steps cross the link a few times each, so
#: an end whose neighbour went away in between (a link cut as they met) gives up within seconds, not a whole timeout
HANDSHAKE_MIN_S, HANDSHAKE_ROUND_TRIPS = 10.0, 30
#: how much longer than that the datacenter waits for the exchange's process before it kills it (gloo retries a
#: failed connect of the pair past the timeout it was given)
HANDSHAKE_GRACE_S = 5.0
#: how long a datacenter tries to start its rendezvous store (the first start waits for the fork server's import of
#: torch; a restart for the port a killed store held)
STORE_START_S = 60.0
#: the store keys of the replica a datacenter offers: the round, and the replica of a round under "replica/<round>"
REPLICA_ROUND_KEY, REPLICA_KEY = "replica-round", "replica"
#: the store key of the last round whose exchanges the datacenter finished
DONE_ROUND_KEY = "done-round"
#: why an exchange whose process did not answer in time failed
DEADLINE_PASSED = "the exchange did not finish in time"
#: how often an end that waits for its neighbour at a meeting looks again
MEETING_POLL_S = 0.2
#: how often an exchange under way looks whether its neighbour has finished the round without it
WATCH_POLL_S = 1.0
#: the processes that run the exchanges fork from a server that has this module (so torch) loaded
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([__name__])


@dataclass(frozen=True)
class Exchanged:
    """One exchange with one neighbour: what arrived (None: nothing, see `error`), the bytes each way, the seconds from
    the meeting to the last byte received; `unreachable`: the probe found no way to the neighbour at all."""

    peer: int
    message: GossipMessage | None
    bytes_sent: int
    bytes_received: int
    in_flight_s: float
    error: str | None = None
    unreachable: bool = False


def handshake_timeout(round_trip_s: float, timeout_s: float) -> float:
    """How long two ends that have both come to a meeting wait for their pair to connect and their first swap: at
    least HANDSHAKE_MIN_S and HANDSHAKE_ROUND_TRIPS round trips of the link, at most the exchange's timeout."""
    return min(timeout_s, max(HANDSHAKE_MIN_S, HANDSHAKE_ROUND_TRIPS * round_trip_s))


class ExchangeFailed(RuntimeError):
    """An exchange ended without the neighbour's message (the reason in one line)."""


class GossipTransport:
    """This datacenter's end of the gossip exchanges (see the module docstring). `addresses` maps every datacenter's
    index to the (host, port) of its rendezvous store; this datacenter's own entry is where it hosts its store."""

    def __init__(self, index: int, addresses: dict[int, tuple[str, int]], timeout_s: float,
                 probe_s: float = PROBE_S) -> None:
        self.index, self.addresses, self.timeout_s = index, dict(addresses), timeout_s
        self.probe_s = min(probe_s, timeout_s)
        #: the neighbours whose last exchange failed (see the module docstring)
        self.suspect: set[int] = set()
        #: per neighbour, the least time its probe took (a round trip of the link)
        self.round_trips: dict[int, float] = {}
        host, port = addresses[index]
        self.host = host
        multiprocessing.forkserver.ensure_running()  # its start-up (an import of torch) is not a round's idle time
        self._store: multiprocessing.process.BaseProcess | None = None
        self._store_pipe: multiprocessing.connection.Connection | None = None
        self._offer: tuple[int, np.ndarray] | None = None
        self._done_round = 0
        #: a meeting hosted here failed this round: the store starts afresh before the next one
        self.store_suspect = False
        self.store_restarts = 0
        self._start_store()

    def _start_store(self) -> None:
        """Start the rendezvous store's process (trying for up to STORE_START_S while the port is still held)."""
        host, port = self.addresses[self.index]
        deadline = time.perf_counter() + STORE_START_S
        while True:
            ours, theirs = _CONTEXT.Pipe()
            process = _CONTEXT.Process(target=_serve_store, args=(theirs, host, port, self.timeout_s),
                                       name=f"gossip-store-{self.index}", daemon=True)
            process.start()
            theirs.close()
            try:
                _receive(ours, deadline)
                break
            except ExchangeFailed as err:
                ours.close()
                _reap(process)
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the gossip rendezvous store did not start at {host}:{port}: {err}") from None
                time.sleep(0.2)
        self._store, self._store_pipe = process, ours
        ours.send(("done", self._done_round, None))
        if self._offer is not None:
            ours.send(("publish", *self._offer))

    def _stop_store(self) -> None:
        if self._store_pipe is not None:
            self._store_pipe.close()
        if self._store is not None:
            _reap(self._store)
        self._store = self._store_pipe = None

    def close(self) -> None:
        """Stop hosting the rendezvous store."""
        self._stop_store()

    def end_round(self, server_round: int) -> None:
        """After round `server_round`'s exchanges: say so on the store, which starts afresh first if a meeting it
        hosted failed (module docstring)."""
        self._done_round = server_round
        if self.store_suspect and self._store is not None:
            log.info("a meeting hosted here failed: the rendezvous store starts afresh")
            self._stop_store()
            self._start_store()
            self.store_restarts += 1
        self.store_suspect = False
        if self._store_pipe is not None:
            self._store_pipe.send(("done", server_round, None))

    def publish(self, server_round: int, payload: np.ndarray) -> None:
        """Offer `payload` (this replica after `server_round`, in the wire format) to datacenters that rejoin."""
        self._offer = (server_round, payload)
        if self._store_pipe is not None:
            self._store_pipe.send(("publish", server_round, payload))

    def offered_round(self, peer: int) -> int | None:
        """The round of the replica `peer` offers (None: it offers none, or cannot be reached within the timeout)."""
        try:
            return self._ask_store(peer, None)
        except ExchangeFailed as err:
            log.info("datacenter %d offers no replica: %s", peer, err)
            return None

    def fetch_replica(self, peer: int, server_round: int) -> np.ndarray | None:
        """The replica `peer` offers for `server_round` (wire format; None: not within the timeout, or gone)."""
        try:
            return self._ask_store(peer, server_round)
        except ExchangeFailed as err:
            log.info("datacenter %d's replica of round %d not fetched: %s", peer, server_round, err)
            return None

    def _ask_store(self, peer: int, server_round: int | None) -> Any:
        started = time.perf_counter()
        try:
            with socket.create_connection(self.addresses[peer], timeout=self.probe_s):
                pass
        except OSError as err:
            raise ExchangeFailed(f"unreachable: {err}") from None
        ours, theirs = _CONTEXT.Pipe()
        child = _CONTEXT.Process(target=_read_offer, args=(theirs, self.addresses[peer], self.timeout_s, server_round),
                                 name=f"gossip-offer-{peer}", daemon=True)
        try:
            child.start()
            theirs.close()
            return _receive(ours, started + self.timeout_s + self.probe_s)
        finally:
            ours.close()
            _reap(child)

    def exchange(self, server_round: int, peer: int, message_for: Callable[[int], GossipMessage | None],
                 held_of_peer: int) -> Exchanged:
        """Round `server_round`'s exchange with `peer`: tell it `held_of_peer` (the version of its public copy held
        here), learn what it holds of ours, send ``message_for(what it holds)`` (None: nothing for it this round),
        receive its message. Never raises for the peer's or the link's failure: the reason is in ``error``."""
        started = time.perf_counter()
        sent = received = 0
        child = None
        ours, theirs = _CONTEXT.Pipe()
        try:
            # can the link reach the neighbour at all? if not, give up on it for this round now
            try:
                with socket.create_connection(self.addresses[peer], timeout=self.probe_s):
                    # a connection takes one round trip (more if a packet was lost: the least seen is the link's)
                    round_trip_s = min(time.perf_counter() - started, self.round_trips.get(peer, self.probe_s))
                    self.round_trips[peer] = round_trip_s
            except OSError as err:
                reason = f"{type(err).__name__}: {err}"[:300]
                log.info("round %d: datacenter %d unreachable: %s", server_round, peer, reason)
                self.suspect.add(peer)
                return Exchanged(peer, None, 0, 0, time.perf_counter() - started, reason, unreachable=True)
            low, high = sorted((self.index, peer))
            meeting = {"store": self.addresses[low], "peer_store": self.addresses[peer],
                       "prefix": f"gossip/r{server_round}/{low}-{high}",
                       "rank": 0 if self.index == low else 1, "hostname": self.host, "timeout_s": self.timeout_s,
                       "handshake_s": handshake_timeout(round_trip_s, self.timeout_s),
                       "round": server_round, "held_of_peer": held_of_peer}
            child = _CONTEXT.Process(target=_meet, args=(theirs, meeting), name=f"gossip-{self.index}-{peer}",
                                     daemon=True)
            child.start()
            theirs.close()
            deadline = started + 3 * self.timeout_s + self.probe_s
            _receive(ours, deadline)  # both ends have come: the pair connects and swaps its first words, or gives up
            handshake_deadline = time.perf_counter() + meeting["handshake_s"] + HANDSHAKE_GRACE_S
            holds = _receive(ours, min(deadline, handshake_deadline),
                             f"the pair did not connect within {meeting['handshake_s']:.3g}s of meeting")
            sent += 16
            received += 16
            message = message_for(int(holds))
            ours.send(None if message is None else (_KINDS[message.kind], message.version, message.base,
                                                    np.ascontiguousarray(message.payload)))
            header, payload, in_flight_s = _receive(ours, deadline)
            sent += 8 * _HEADER_WORDS + (0 if message is None else message.nbytes)
            received += 8 * _HEADER_WORDS + (0 if payload is None else payload.size)
            arrived = None
            if payload is not None:
                kind, version, base = header
                arrived = GossipMessage(peer, server_round, _KIND_NAMES[kind], version, None if base < 0 else base,
                                        payload)
            self.suspect.discard(peer)
            return Exchanged(peer, arrived, sent, received, in_flight_s)
        except Exception as err:  # noqa: BLE001 - a failed exchange is a missing neighbour, never a crash
            reason = str(err)[:300] if isinstance(err, ExchangeFailed) else _reason(err)
            log.info("round %d: exchange with datacenter %d failed: %s", server_round, peer, reason)
            self.suspect.add(peer)
            if self.index < peer and str(err) == DEADLINE_PASSED:  # a meeting on this store hung past every timeout
                self.store_suspect = True
            return Exchanged(peer, None, sent, received, time.perf_counter() - started, reason)
        finally:
            ours.close()
            if child is not None:
                _reap(child)


def _reason(err: BaseException) -> str:
    """A failure in one line: its type and its message's first line, at most 300 characters."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def _reap(child: multiprocessing.process.BaseProcess) -> None:
    """Wait a moment for an exchange process to end, then kill it (with whatever it held)."""
    child.join(1.0)
    if child.is_alive():
        child.kill()
        child.join()
    child.close()


def _serve_store(connection: multiprocessing.connection.Connection, host: str, port: int, timeout_s: float) -> None:
    """The rendezvous store's process: hosts the store, says ("ready", None) (or ("error", reason)), then keeps
    the replica offered with each ("publish", round, payload) (the newest two rounds) until the parent goes."""
    die_with_run_root()
    try:
        store = dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except Exception as err:  # noqa: BLE001 - the parent reports it
        connection.send(("error", _reason(err)))
        return
    connection.send(("ready", None))
    offered: list[int] = []
    while True:
        try:
            word, server_round, payload = connection.recv()
        except (EOFError, OSError):
            return  # the datacenter's trainer is gone (or stopped hosting)
        if word == "done":
            store.set(DONE_ROUND_KEY, str(server_round))
            continue
        store.set(f"{REPLICA_KEY}/{server_round}", payload.tobytes())
        store.set(REPLICA_ROUND_KEY, str(server_round))
        offered.append(server_round)
        while len(offered) > 2:
            store.delete_key(f"{REPLICA_KEY}/{offered.pop(0)}")


def _read_offer(connection: multiprocessing.connection.Connection, address: tuple[str, int], timeout_s: float,
                server_round: int | None) -> None:
    """The process that reads a neighbour's offer: the round it offers (`server_round` None; None if it offers
    none) or that round's replica as uint8 (None if gone), as ("done", value); a failure as ("error", reason)."""
    die_with_run_root()
    try:
        store = _connect(address, timedelta(seconds=timeout_s))
        if server_round is None:
            value: Any = int(store.get(REPLICA_ROUND_KEY)) if store.check([REPLICA_ROUND_KEY]) else None
        else:
            key = f"{REPLICA_KEY}/{server_round}"
            value = np.frombuffer(store.get(key), np.uint8).copy() if store.check([key]) else None
        connection.send(("done", value))
    except Exception as err:  # noqa: BLE001 - the parent reports it
        connection.send(("error", _reason(err)))


def _receive(connection: multiprocessing.connection.Connection, deadline: float, late: str = DEADLINE_PASSED) -> Any:
    """The exchange process's next word: its value, or ExchangeFailed with its reason (or `late` past the deadline)."""
    if not connection.poll(max(0.0, deadline - time.perf_counter())):
        raise ExchangeFailed(late)
    try:
        word, value = connection.recv()
    except EOFError as err:
        raise ExchangeFailed("the exchange process ended without a word") from err
    if word == "error":
        raise ExchangeFailed(value)
    return value


def _meet(connection: multiprocessing.connection.Connection, meeting: dict[str, Any]) -> None:
    """The exchange process (see the module docstring): meets the neighbour ("met" once both ends have come), sends
    the parent what the neighbour holds ("holds"), takes the message to send (kind, version, base, payload; or
    None), and sends back the neighbour's ("done": its header, its payload or None, the seconds in flight); any
    failure as ("error", reason)."""
    die_with_run_root()
    lock = threading.Lock()

    def say(word: tuple[str, Any]) -> None:
        with lock:
            connection.send(word)

    try:
        timeout = timedelta(seconds=meeting["timeout_s"])
        store = _connect(meeting["store"], timeout)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=meeting["hostname"])]
        rank = meeting["rank"]
        _wait_for_peer(store, meeting, timeout)
        say(("met", None))
        threading.Thread(target=_watch_peer, args=(meeting, say), name="gossip-watch", daemon=True).start()
        # both ends have come: connecting the pair and the first swap take a few round trips, unless the other end
        # went away meanwhile (a cut as they met leaves this end waiting on gloo's rendezvous and its retried connects)
        handshake = timedelta(seconds=meeting["handshake_s"])
        options._timeout = handshake
        store.set_timeout(handshake)
        group = dist.ProcessGroupGloo(dist.PrefixStore(meeting["prefix"], store), rank, 2, options)
        store.set_timeout(timeout)
        met = time.perf_counter()
        theirs = _swap(group, rank, torch.tensor([meeting["round"], meeting["held_of_peer"]], dtype=torch.int64),
                       handshake)
        if int(theirs[0]) != meeting["round"]:
            raise ExchangeFailed(f"the peer is at round {int(theirs[0])}")
        say(("holds", int(theirs[1])))
        message = connection.recv()
        header = (torch.tensor([1, message[0], message[1], -1 if message[2] is None else message[2], message[3].size],
                               dtype=torch.int64) if message is not None else torch.zeros(_HEADER_WORDS, dtype=torch.int64))
        their_header = _swap(group, rank, header, timeout)
        payload = torch.from_numpy(message[3]) if message is not None else None
        incoming = torch.empty(int(their_header[4]), dtype=torch.uint8) if int(their_header[0]) else None
        _transfer(group, rank, payload, incoming, timeout)
        in_flight_s = time.perf_counter() - met
        say(("done", ((int(their_header[1]), int(their_header[2]), int(their_header[3])),
                      None if incoming is None else incoming.numpy(), in_flight_s)))
    except Exception as err:  # noqa: BLE001 - the parent reports it
        say(("error", _reason(err)))


def _watch_peer(meeting: dict[str, Any], say: Callable[[tuple[str, Any]], None]) -> None:
    """In the exchange process, once both ends have come: look at the neighbour's store every WATCH_POLL_S, and
    once it says the neighbour finished this round (its end of this exchange is over: it failed, e.g. its
    connection was reset by a cut that this end's connection did not notice) and this exchange has not ended
    within the handshake's time after that, say the exchange failed (the parent then kills this process)."""
    finished_at = None
    store = None
    while True:
        time.sleep(WATCH_POLL_S)
        try:
            if store is None:
                store = _connect(meeting["peer_store"], timedelta(seconds=PROBE_S), connect_s=PROBE_S)
            done = _done_round(store)
        except Exception:  # noqa: BLE001 - the link may be cut: look again
            store = None
            continue
        if done < meeting["round"]:
            continue
        if finished_at is None:
            finished_at = time.perf_counter()
        elif time.perf_counter() - finished_at > meeting["handshake_s"]:
            say(("error", f"the peer finished round {done} without this exchange"))
            return


def _wait_for_peer(store: dist.TCPStore, meeting: dict[str, Any], timeout: timedelta) -> None:
    """Say on the meeting's store that this end has come, and return once the other has; ExchangeFailed when the
    neighbour finished this round without this meeting, gave up on it, or does not come within the timeout."""
    prefix, rank = meeting["prefix"], meeting["rank"]
    store.set(f"{prefix}/here/{rank}", "1")
    try:
        _await_peer(store, meeting, timeout)
    except ExchangeFailed:
        store.set(f"{prefix}/gone/{rank}", "1")  # a peer that comes later must not wait for this end
        raise
    if store.check([f"{prefix}/gone/{1 - rank}"]):
        raise ExchangeFailed("the peer gave up on this meeting as it came")


def _await_peer(store: dist.TCPStore, meeting: dict[str, Any], timeout: timedelta) -> None:
    prefix, rank, server_round = meeting["prefix"], meeting["rank"], meeting["round"]
    # rank 1: the host's store is the meeting's
    peer_store = store if rank == 1 else _connect(meeting["peer_store"], timeout)
    deadline = time.perf_counter() + timeout.total_seconds()
    while not store.check([f"{prefix}/here/{1 - rank}"]):
        done = _done_round(peer_store)
        if done >= server_round:
            raise ExchangeFailed(f"the peer finished round {done} without this meeting")
        if time.perf_counter() > deadline:
            raise ExchangeFailed(f"the peer did not come within {timeout.total_seconds():g}s")
        time.sleep(MEETING_POLL_S)


def _connect(address: tuple[str, int], timeout: timedelta, connect_s: float = STORE_CONNECT_S) -> dist.TCPStore:
    """A client of the store at `address` whose operations wait up to `timeout`; DistNetworkError if it cannot connect
    within `connect_s` (the store answered a probe a moment ago: a refused connect means it has gone)."""
    store = dist.TCPStore(address[0], address[1], None, False, timeout=timedelta(seconds=connect_s),
                          wait_for_workers=False)
    store.set_timeout(timeout)
    return store


def _done_round(store: dist.TCPStore) -> int:
    """The last round whose exchanges the datacenter hosting `store` finished (0: none yet)."""
    return int(store.get(DONE_ROUND_KEY)) if store.check([DONE_ROUND_KEY]) else 0


def _swap(group: dist.ProcessGroup, rank: int, mine: torch.Tensor, timeout: timedelta) -> torch.Tensor:
    theirs = torch.empty_like(mine)
    _transfer(group, rank, mine, theirs, timeout)
    return theirs


def _transfer(group: dist.ProcessGroup, rank: int, outgoing: torch.Tensor | None, incoming: torch.Tensor | None,
              timeout: timedelta) -> None:
    """Send `outgoing` and receive into `incoming` at once (either may be None), within the timeout."""
    works = []
    if outgoing is not None:
        works.append(group.send([outgoing], 1 - rank, 0))
    if incoming is not None:
        works.append(group.recv([incoming], 1 - rank, 0))
    for work in works:
        work.wait(timeout)


def exchange_all(transport: GossipTransport, server_round: int, peers: list[int],
                 message_for: Callable[[int, int], GossipMessage | None],
                 held_of: Callable[[int], int]) -> dict[int, Exchanged]:
    """Round `server_round`'s exchanges with every peer at once (one thread each): `message_for(peer, what it holds)`
    and `held_of(peer)` as for :meth:`GossipTransport.exchange`."""
    results: dict[int, Exchanged] = {}
    lock = threading.Lock()

    def one(peer: int) -> None:
        outcome = transport.exchange(server_round, peer, lambda holds: message_for(peer, holds), held_of(peer))
        with lock:
            results[peer] = outcome

    threads = [threading.Thread(target=one, args=(peer,), name=f"gossip-{peer}", daemon=True) for peer in peers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    transport.end_round(server_round)
    return results
