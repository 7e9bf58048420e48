"""Gossip messages datacenter to datacenter: torch.distributed point-to-point over a two-rank gloo group per exchange.

Why gloo groups and not hivemind: crossdc's datacenters already run torch.distributed (their worker groups, the
sync-dp baseline), gloo's point-to-point send/recv crosses the emulated links like any TCP traffic, and a pair group
has no state beyond one exchange — nothing to repair after a failure. hivemind's averager is a group all-reduce; a
ring or CHOCO exchange would use only its P2P layer, for a second engine and its daemon in every datacenter.

Promises:

- every datacenter hosts one rendezvous store (a torch ``TCPStore``) at its own address and port (:class:`GossipTransport`);
- an exchange between datacenters i < j in round r meets on i's store under the prefix ``gossip/r{r}/{i}-{j}``,
  builds a two-rank gloo group there (rank 0 is i) bound to the datacenter's own address (so in a namespace it
  crosses the emulated WAN device), swaps what each holds of the other's public copy, then each side's message
  (a header, then the payload), and drops the group. Nothing outlives an exchange: a failure leaves nothing to
  rebuild, and the next round meets afresh;
- both ends must be at the same round to meet (the round is in the prefix); a neighbour that does not come, dies or
  stalls within ``timeout_s`` makes :meth:`GossipTransport.exchange` return with the reason and no message: nobody
  waits forever, and a message is returned whole or not at all;
- before meeting a neighbour, a datacenter checks that it can reach the neighbour's rendezvous store at all (a TCP
  connection within ``probe_s``, over the same link: one round trip); if not (a cut link, a dead datacenter), the
  exchange fails at once, so a cut costs each round a probe, not a whole timeout. If it can, the meeting gets the
  whole ``timeout_s`` (the neighbour may simply be a little behind). Both ends of a cut link probe each other, so
  they meet again the round the link is back; a datacenter whose last exchange with a neighbour failed counts it
  as *suspect* until one works (reported, nothing else changes);
- the bytes of an exchange are its headers and payloads as sent (what gloo puts on the wire, less TCP/IP framing),
  and its time in flight is measured from the group's creation to the last payload received.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from crossdc.clients.gossip_replica import DELTA, FULL, GossipMessage

log = logging.getLogger("crossdc.gossip")

_KINDS = {FULL: 0, DELTA: 1}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
#: the int64 words of a message header: present, kind, version, base (−1: none), payload length
_HEADER_WORDS = 5
#: how long a datacenter tries to reach a neighbour's store before it gives up on it for the round
PROBE_S = 1.5


@dataclass(frozen=True)
class Exchanged:
    """One exchange with one neighbour: what arrived (None: nothing, see `error`), the bytes each way, the seconds from
    the meeting to the last byte received."""

    peer: int
    message: GossipMessage | None
    bytes_sent: int
    bytes_received: int
    in_flight_s: float
    error: str | None = None


class GossipTransport:
    """This datacenter's end of the gossip exchanges (see the module docstring). `addresses` maps every datacenter's
    index to the (host, port) of its rendezvous store; this datacenter's own entry is where it hosts its store."""

    def __init__(self, index: int, addresses: dict[int, tuple[str, int]], timeout_s: float,
                 probe_s: float = PROBE_S) -> None:
        self.index, self.addresses, self.timeout = index, dict(addresses), timedelta(seconds=timeout_s)
        self.probe = timedelta(seconds=min(probe_s, timeout_s))
        #: the neighbours whose last exchange failed (see the module docstring)
        self.suspect: set[int] = set()
        host, port = addresses[index]
        self.host = host
        #: one gloo device for every exchange (bound to this datacenter's address): a device per group would leave
        #: a listener and a loop thread behind each failed exchange
        self.device = dist.ProcessGroupGloo.create_device(hostname=host)
        self.store: dist.TCPStore | None = self._host_store()

    def _host_store(self) -> dist.TCPStore:
        host, port = self.addresses[self.index]
        return dist.TCPStore(host, port, None, True, timeout=self.timeout, wait_for_workers=False)

    def close(self) -> None:
        """Stop hosting the rendezvous store."""
        self.store = None

    def exchange(self, server_round: int, peer: int, message_for: Callable[[int], GossipMessage | None],
                 held_of_peer: int) -> Exchanged:
        """Round `server_round`'s exchange with `peer`: tell it `held_of_peer` (the version of its public copy held
        here), learn what it holds of ours, send ``message_for(what it holds)`` (None: nothing for it this round),
        receive its message. Never raises for the peer's or the link's failure: the reason is in ``error``."""
        started = time.perf_counter()
        sent = received = 0
        group = None
        try:
            # can the link reach the neighbour at all? if not, give up on it for this round now
            with socket.create_connection(self.addresses[peer], timeout=self.probe.total_seconds()):
                pass
            low, high = sorted((self.index, peer))
            host, port = self.addresses[low]
            # a client of its own per exchange, also to this datacenter's own store
            store = dist.TCPStore(host, port, None, False, timeout=self.timeout, wait_for_workers=False)
            options = dist.ProcessGroupGloo._Options()
            options._devices = [self.device]
            options._timeout = self.timeout
            rank = 0 if self.index == low else 1
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"gossip/r{server_round}/{low}-{high}", store), rank, 2,
                                          options)
            met = time.perf_counter()
            theirs = self._swap(group, rank, torch.tensor([server_round, held_of_peer], dtype=torch.int64))
            sent += 16
            received += 16
            if int(theirs[0]) != server_round:
                raise RuntimeError(f"the peer is at round {int(theirs[0])}")
            message = message_for(int(theirs[1]))
            header = (torch.tensor([1, _KINDS[message.kind], message.version,
                                    -1 if message.base is None else message.base, message.nbytes], dtype=torch.int64)
                      if message is not None else torch.zeros(_HEADER_WORDS, dtype=torch.int64))
            their_header = self._swap(group, rank, header)
            sent += 8 * _HEADER_WORDS
            received += 8 * _HEADER_WORDS
            payload = torch.from_numpy(np.ascontiguousarray(message.payload)) if message is not None else None
            incoming = torch.empty(int(their_header[4]), dtype=torch.uint8) if int(their_header[0]) else None
            self._transfer(group, rank, payload, incoming)
            sent += 0 if payload is None else payload.numel()
            received += 0 if incoming is None else incoming.numel()
            arrived = None
            if incoming is not None:
                base = int(their_header[3])
                arrived = GossipMessage(peer, server_round, _KIND_NAMES[int(their_header[1])], int(their_header[2]),
                                        None if base < 0 else base, incoming.numpy())
            self.suspect.discard(peer)
            return Exchanged(peer, arrived, sent, received, time.perf_counter() - met)
        except Exception as err:  # noqa: BLE001 - a failed exchange is a missing neighbour, never a crash
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
            log.info("round %d: exchange with datacenter %d failed: %s", server_round, peer, reason)
            self.suspect.add(peer)
            return Exchanged(peer, None, sent, received, time.perf_counter() - started, reason)
        finally:
            del group

    def _swap(self, group: dist.ProcessGroup, rank: int, mine: torch.Tensor) -> torch.Tensor:
        theirs = torch.empty_like(mine)
        self._transfer(group, rank, mine, theirs)
        return theirs

    def _transfer(self, group: dist.ProcessGroup, rank: int, outgoing: torch.Tensor | None,
                  incoming: torch.Tensor | None) -> None:
        """Send `outgoing` and receive into `incoming` at once (either may be None), within the timeout."""
        works = []
        if outgoing is not None:
            works.append(group.send([outgoing], 1 - rank, 0))
        if incoming is not None:
            works.append(group.recv([incoming], 1 - rank, 0))
        for work in works:
            work.wait(self.timeout)


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
    return results
