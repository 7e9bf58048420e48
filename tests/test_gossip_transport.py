"""The gossip transport on loopback: pair exchanges over gloo, a missing neighbour found by the timeout, a rejoin."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_gossip import LR, federation

from crossdc.clients.gossip_agent import GossipAgent
from crossdc.clients.gossip_replica import DELTA, FULL, GossipMessage, GossipReplica
from crossdc.clients.gossip_transport import HANDSHAKE_MIN_S, Exchanged, GossipTransport, exchange_all, handshake_timeout
from crossdc.experiment.processes import free_port, is_running, run_root_env
from crossdc.strategies.base import RunInfo
from crossdc.strategies.gossip import Gossip
from crossdc.strategies.mixing import SKETCH_SIZE

TIMEOUT_S = 2.0
#: where a transport finds some of its neighbours instead of their loopback stores: {transport: {neighbour: address}}
Moved = Mapping[int, Mapping[int, tuple[str, int]]]
#: makes `count` transports on loopback ports with an exchange timeout (closed after the test), optionally with
#: some neighbours moved
Loopback = Callable[..., dict[int, GossipTransport]]


@pytest.fixture
def loopback() -> Iterator[Loopback]:
    made: list[GossipTransport] = []

    def make(count: int, timeout_s: float, moved: Moved | None = None) -> dict[int, GossipTransport]:
        ports = [free_port() for _ in range(count)]
        transports = {i: GossipTransport(i, {j: ("127.0.0.1", ports[j]) for j in range(count)}
                                         | dict((moved or {}).get(i, {})), timeout_s)
                      for i in range(count)}
        made.extend(transports.values())
        return transports

    yield make
    for transport in made:
        transport.close()


def message(sender: int, server_round: int, size: int, holds: int) -> GossipMessage:
    """A recognisable message: its payload encodes the sender, the round and what the receiver said it holds."""
    payload = np.full(size, (sender * 31 + server_round * 7 + holds) % 251, np.uint8)
    kind = DELTA if holds == server_round - 1 else FULL
    return GossipMessage(sender, server_round, kind, server_round, holds if kind == DELTA else None, payload)


def ring_round(transports: dict[int, GossipTransport], server_round: int, present: set[int]) -> dict[int, dict[int, Exchanged]]:
    """Every present datacenter of a ring of 3 exchanges with both neighbours, all at once."""
    results: dict[int, dict[int, Exchanged]] = {}

    def run(i: int) -> None:
        peers = [(i + 1) % 3, (i - 1) % 3]
        results[i] = exchange_all(transports[i], server_round, peers,
                                  lambda peer, holds: message(i, server_round, 1000 + 100 * i, holds),
                                  lambda peer: server_round - 1)
    threads = [threading.Thread(target=run, args=(i,)) for i in present]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def timed_exchanges(transports: dict[int, GossipTransport], pairs: list[tuple[int, int]],
                    join_s: float) -> tuple[dict[int, Exchanged], dict[int, float]]:
    """Round 1's exchange of each (datacenter, neighbour) in `pairs`, all at once: each datacenter's outcome and the
    seconds it took."""
    outcomes: dict[int, Exchanged] = {}
    waited: dict[int, float] = {}

    def exchange(i: int, peer: int) -> None:
        started = time.perf_counter()
        outcomes[i] = transports[i].exchange(1, peer, lambda holds: message(i, 1, 500, holds), 0)
        waited[i] = time.perf_counter() - started

    threads = [threading.Thread(target=exchange, args=pair) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=join_s)
    return outcomes, waited


def test_pairs_exchange_whole_messages_a_missing_neighbour_times_out_and_rejoins(loopback: Loopback) -> None:
    transports = loopback(3, TIMEOUT_S)
    first = ring_round(transports, 1, {0, 1, 2})
    for i in range(3):
        for peer, outcome in first[i].items():
            assert outcome.error is None, outcome.error
            expected = message(peer, 1, 1000 + 100 * peer, 0)  # what the peer sent, knowing we hold version 0
            assert outcome.message is not None and outcome.message.kind == DELTA and outcome.message.base == 0
            assert np.array_equal(outcome.message.payload, expected.payload)
            assert outcome.bytes_received == expected.nbytes + 16 + 40
            assert outcome.bytes_sent == 1000 + 100 * i + 16 + 40
    started = time.perf_counter()
    second = ring_round(transports, 2, {0, 1})  # datacenter 2 is away this round
    waited = time.perf_counter() - started
    assert second[0][1].message is not None and second[1][0].message is not None
    assert second[0][2].message is None and second[0][2].error and second[1][2].message is None
    assert waited < 5 * TIMEOUT_S  # nobody waits forever
    assert transports[0].suspect == {2} and transports[1].suspect == {2}  # the next meetings with 2 only probe
    third = ring_round(transports, 3, {0, 1, 2})  # back: nothing to rebuild, the next round meets afresh
    assert all(o.message is not None for outcomes in third.values() for o in outcomes.values())
    assert not transports[0].suspect and not transports[1].suspect


def test_agents_over_the_transport_end_where_the_in_process_driver_does(tmp_path: Path, loopback: Loopback) -> None:
    """Three datacenters on a ring, each an agent in its own thread exchanging over loopback gloo pairs: the same
    messages as the in-process driver hands over, so the same replicas, and a report per round with every link."""
    dcs = ["a", "b", "c"]
    codecs = ("topk:0.2", "int8")
    info = RunInfo(tuple(dcs), "adamw", LR, seed=5, codecs=codecs)
    reference = federation(Gossip(tau=3, params={"topology": "ring"}, run=info), dcs, tmp_path / "reference", codecs)
    for _ in range(3):
        reference.run_round()
    built = federation(Gossip(tau=3, params={"topology": "ring"}, run=info), dcs, tmp_path / "agents", codecs)
    transports = loopback(3, 20.0)
    agents = {}
    for i, dc in enumerate(dcs):
        replica = GossipReplica(copy.deepcopy(built.strategy), built.trainers[dc], i, built.weights, built.seeds[dc])
        transport = transports[i]
        agents[dc] = GossipAgent(replica, 3, functools.partial(exchange_all, transport),
                                 observe=lambda server_round: server_round == 2)
    finals = {dc: agent.final(120) for dc, agent in agents.items()}
    for dc in dcs:
        for name, value in reference.replica_weights()[dc].items():
            assert np.array_equal(finals[dc][name], value), (dc, name)
    reports, snapshots, finished = agents["a"].reports(acknowledged=1, wait_s=0)
    assert finished and [r.server_round for r in reports] == [2, 3] and list(snapshots) == [2]
    assert all(len(r.sketch) == SKETCH_SIZE for r in reports)
    assert set(reports[0].links) == {1, 2} and all(link["used"] and link["error"] is None
                                                   for link in reports[0].links.values())
    assert agents["a"].reports(acknowledged=3, wait_s=0)[0] == []  # acknowledged: forgotten


def test_the_handshake_gets_thirty_round_trips_at_least_ten_seconds_at_most_the_timeout() -> None:
    assert handshake_timeout(0.001, 60.0) == HANDSHAKE_MIN_S == 10.0
    assert handshake_timeout(0.5, 60.0) == 15.0
    assert handshake_timeout(1.0, 20.0) == 20.0
    assert handshake_timeout(0.001, 4.0) == 4.0


def test_an_end_whose_neighbour_went_away_as_they_met_gives_up_within_the_handshake(loopback: Loopback) -> None:
    """A neighbour that says it has come to the meeting and is gone before the pair connects (a link cut just then)
    costs each end the handshake (10 s here: loopback's round trip is tiny), not the exchange's three timeouts; the
    store it met on serves the next round's meetings."""
    timeout_s = 40.0
    transports = loopback(3, timeout_s)
    # 0 meets 1 on its own store as rank 0; 2 meets 1 on 1's store as rank 1. The "neighbour" only says it came.
    for host, prefix, rank in ((0, "gossip/r1/0-1", 1), (1, "gossip/r1/1-2", 0)):
        store = dist.TCPStore(*transports[host].addresses[host], None, False, wait_for_workers=False)
        store.set(f"{prefix}/here/{rank}", "1")
    outcomes, waited = timed_exchanges(transports, [(0, 1), (2, 1)], 4 * timeout_s)
    for i in (0, 2):
        assert outcomes[i].message is None and outcomes[i].error, outcomes[i]
        assert 1 in transports[i].suspect
        # the handshake's 10 s (its process killed 5 s after); without that bound, a timeout at least (40 s)
        assert waited[i] < HANDSHAKE_MIN_S + 15, (i, waited[i], outcomes[i].error)
    for transport in transports.values():
        transport.end_round(1)
    second = ring_round(transports, 2, {0, 1, 2})
    assert all(o.message is not None for results in second.values() for o in results.values()), second


def test_an_exchange_whose_neighbour_finished_the_round_ends_within_the_handshake(loopback: Loopback) -> None:
    """A neighbour that met, swapped its first words and then left the exchange without this end noticing (a cut
    reset its connection only), and says on its store that it finished the round: the exchange fails within the
    handshake's time after this end sees that (10 s here), not the exchange's timeout."""
    timeout_s = 40.0
    transports = loopback(2, timeout_s)
    prefix = "gossip/r1/0-1"
    stalled = threading.Event()
    swapped = threading.Event()

    def neighbour_that_leaves() -> None:  # datacenter 1's end, rank 1: meets, swaps the first words, then nothing
        store = dist.TCPStore(*transports[0].addresses[0], None, False, wait_for_workers=False)
        store.set(f"{prefix}/here/1", "1")
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timedelta(seconds=timeout_s)
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, options)
        theirs = torch.empty(2, dtype=torch.int64)
        works = [group.send([torch.tensor([1, 0], dtype=torch.int64)], 0, 0), group.recv([theirs], 0, 0)]
        for work in works:
            work.wait()
        swapped.set()
        stalled.wait(2 * timeout_s)

    try:
        transports[1].end_round(1)  # its store says it finished round 1
        leaving = threading.Thread(target=neighbour_that_leaves, daemon=True)
        leaving.start()
        started = time.perf_counter()
        outcome = transports[0].exchange(1, 1, lambda holds: message(0, 1, 500, holds), 0)
        waited = time.perf_counter() - started
        assert swapped.is_set()  # it got as far as the first words: the handshake was over
        assert outcome.message is None and outcome.error == "the peer finished round 1 without this exchange", outcome
        assert waited < HANDSHAKE_MIN_S + 15, waited  # without the watch: the timeout at least (40 s)
    finally:
        stalled.set()


def test_a_neighbour_gone_between_its_probe_and_the_meeting_costs_seconds_not_the_timeout(loopback: Loopback) -> None:
    """A neighbour whose store answers the probe and is gone a moment later (its datacenter killed just then): the
    meeting's connect to that store fails within seconds, whichever end hosts the meeting, instead of torch's
    retried connects for the exchange's timeout and more (138 s measured at a 60-s timeout)."""
    timeout_s = 40.0

    def store_gone_after_one_probe() -> tuple[str, int]:
        listener = socket.create_server(("127.0.0.1", 0))

        def answer_once() -> None:
            connection, _ = listener.accept()
            connection.close()
            listener.close()  # later connects are refused, as to a killed datacenter's port

        threading.Thread(target=answer_once, daemon=True).start()
        return listener.getsockname()[:2]

    # 0 hosts the meeting with its neighbour 1 (rank 0); 1 meets its neighbour 0 on 0's store (rank 1)
    transports = loopback(2, timeout_s, {0: {1: store_gone_after_one_probe()}, 1: {0: store_gone_after_one_probe()}})
    outcomes, waited = timed_exchanges(transports, [(0, 1), (1, 0)], 4 * timeout_s)
    for i in (0, 1):
        assert outcomes[i].message is None and outcomes[i].error and not outcomes[i].unreachable, outcomes[i]
        assert waited[i] < 20, (i, waited[i], outcomes[i].error)  # before: 2 × 40 s and a random delay at least


#: a trainer's gossip under a run root named in its environment: datacenter 1 meets datacenter 0 on 0's store, and 0
#: never comes (the exchange's process waits out its 120-s timeout); prints {process name: pid} of the transport's
#: processes (both stores, the exchange) once they run. It watches no root itself, nor does its fork server.
UNDER_A_ROOT = """
import json, multiprocessing, threading, time
from crossdc.clients.gossip_transport import GossipTransport
from crossdc.experiment.processes import free_port
addresses = {i: ("127.0.0.1", free_port()) for i in range(2)}
stores = [GossipTransport(i, addresses, 120.0) for i in range(2)]
threading.Thread(target=stores[1].exchange, args=(1, 0, lambda holds: None, 0), daemon=True).start()
while "gossip-1-0" not in [p.name for p in multiprocessing.active_children()]:
    time.sleep(0.05)
print(json.dumps({p.name: p.pid for p in multiprocessing.active_children()}), flush=True)
time.sleep(300)
"""


def test_the_transports_processes_die_with_the_run_root() -> None:
    """A killed run leaves no gossip process behind: the stores and an exchange under way (forked from the fork
    server, which starts no watch) die once the run's root dies, long before the exchange's timeout (120 s)."""
    root = subprocess.Popen(["sleep", "300"])
    trainer = subprocess.Popen([sys.executable, "-c", UNDER_A_ROOT], env={**os.environ, **run_root_env(root.pid)},
                               stdout=subprocess.PIPE, text=True)
    pids: dict[str, int] = {}
    try:
        assert trainer.stdout is not None
        assert select.select([trainer.stdout], [], [], 120)[0], "the transport's processes did not start"
        pids = json.loads(trainer.stdout.readline())
        assert {"gossip-store-0", "gossip-store-1", "gossip-1-0"} <= set(pids), pids
        assert all(is_running(pid) for pid in pids.values())
        root.kill()
        root.wait()
        deadline = time.monotonic() + 10  # generous: the promise is 3 s (test_resume.py, serial)
        while any(is_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [name for name, pid in pids.items() if is_running(pid)]
        assert trainer.poll() is None  # the trainer watches no root here: what died, died of its own watch
    finally:
        root.kill()
        trainer.kill()
        trainer.wait()
        for pid in pids.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
