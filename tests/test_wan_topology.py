"""The emulated WAN's pure parts on exact cases: the topology (hops, paths), a hop's pacing and drops
(HopState.admit), the HTTP-exchange labels of the delay line's ledgers (_Flows.label), and the delay line
itself carrying packets between fake devices (Unix datagram sockets) at explicit times, and how a run's slot file
names its owner (network.owner_state)."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.experiment.processes import process_start
from crossdc.wan.delay_line import DelayLine, HopState, _Flows, data_bytes
from crossdc.wan.ledger import LedgerReader, Transfer, ledger_line, payload_transfers, time_in_flight, within_exchanges
from crossdc.wan.network import _owner_alive, owner_state
from crossdc.wan.topology import COORDINATOR, MIN_QUEUE_PACKETS, Hop, build_topology, mesh_ledger

TRANSOCEANIC = LINK_PROFILES["transoceanic"]
METRO = LINK_PROFILES["metro"]
CONSTRAINED = LINK_PROFILES["constrained"]


# ------------------------------------------------------------------ topology
def test_star_paths_go_through_the_coordinator_and_listed_pairs_go_direct() -> None:
    topo = build_topology([("a", TRANSOCEANIC), ("b", METRO), ("c", None)], [("a", "c", METRO)], mtu=65_000)
    assert topo.nodes == (COORDINATOR, "a", "b", "c")
    assert set(topo.hops) == {"a:up", "a:down", "b:up", "b:down", "c:up", "c:down", "a>c", "c>a"}
    # the star
    assert topo.path(0, 1) == ("a:down",) and topo.path(1, 0) == ("a:up",)
    assert topo.path(0, 3) == ("c:down",) and topo.path(3, 0) == ("c:up",)
    # an unlisted pair: up the source's star link, down the target's
    assert topo.path(1, 2) == ("a:up", "b:down") and topo.path(2, 1) == ("b:up", "a:down")
    assert topo.path(2, 3) == ("b:up", "c:down")
    # a listed pair: its own hop, each way
    assert topo.path(1, 3) == ("a>c",) and topo.path(3, 1) == ("c>a",)
    assert len(topo.paths) == 4 * 3  # every ordered pair of distinct nodes, no self path
    assert (1, 1) not in topo.paths


def test_hops_take_their_numbers_from_the_link() -> None:
    topo = build_topology([("a", TRANSOCEANIC), ("b", CONSTRAINED), ("c", None)], [("a", "b", METRO)], mtu=65_000)
    up = topo.hops["a:up"]
    assert up == Hop("a:up", 100e6, 0.075, 0.0, 0.0, 1_875_000, "a", "up")  # BDP = 12.5 MB/s × 0.15 s
    assert topo.hops["a:down"] == Hop("a:down", 100e6, 0.075, 0.0, 0.0, 1_875_000, "a", "down")
    # constrained: BDP 1.25 MB/s × 0.3 s = 375 kB is under 16 packets of 65 000 bytes, which win
    assert topo.hops["b:up"].queue_bytes == MIN_QUEUE_PACKETS * 65_000 == 1_040_000
    assert topo.hops["b:up"].one_way_s == pytest.approx(0.15) and topo.hops["b:up"].bandwidth_bps == 10e6
    # no link: unshaped, but still a hop that writes to the datacenter's ledger
    assert topo.hops["c:up"] == Hop("c:up", None, 0.0, 0.0, 0.0, 0, "c", "up")
    assert topo.hops["c:down"] == Hop("c:down", None, 0.0, 0.0, 0.0, 0, "c", "down")
    # a mesh pair: one ledger for both directions, the hop name as its direction
    assert mesh_ledger("b", "a") == mesh_ledger("a", "b") == "a--b"
    assert topo.hops["a>b"] == Hop("a>b", 10e9, 0.001, 0.0, 0.0, 2_500_000, "a--b", "a>b")
    assert topo.hops["b>a"].ledger == "a--b" and topo.hops["b>a"].direction == "b>a"
    # the same constrained link at MTU 1500: the BDP (375 kB) is more than 16 × 1500
    assert build_topology([("b", CONSTRAINED)], [], mtu=1500).hops["b:up"].queue_bytes == 375_000
    jittery = LinkSpec("j", bandwidth_mbps=8.0, rtt_ms=10.0, jitter_ms=4.0, loss=0.25)
    hop = Hop.from_link("x", jittery, 1500, "x", "up")
    assert (hop.jitter_s, hop.loss, hop.one_way_s, hop.queue_bytes) == (0.004, 0.25, 0.005, 16 * 1500)


@pytest.mark.parametrize(("star", "mesh", "match"), [
    ([("a", None), ("b", None)], [("a", "z", METRO)], "two different datacenters"),
    ([("a", None), ("b", None)], [("z", "a", METRO)], "two different datacenters"),
    ([("a", None), ("b", None)], [("a", "a", METRO)], "two different datacenters"),
    ([("a", None), ("b", None)], [("a", "b", METRO), ("a", "b", METRO)], "twice"),
    ([("a", None), ("b", None)], [("a", "b", METRO), ("b", "a", TRANSOCEANIC)], "twice"),
    ([("a", None), ("a", METRO)], [], "unique"),
    ([("a", None), (COORDINATOR, METRO)], [], "unique"),
])
def test_bad_topologies_are_refused(star, mesh, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_topology(star, mesh, mtu=1500)


# ------------------------------------------------------------------ a hop
def _hop(bandwidth_bps: float | None = 8000.0, one_way_s: float = 0.1, jitter_s: float = 0.0, loss: float = 0.0,
         queue_bytes: int = 10_000, seed: int = 1) -> HopState:
    return HopState(Hop("h", bandwidth_bps, one_way_s, jitter_s, loss, queue_bytes, "h", "up"), random.Random(seed))


def test_a_hop_paces_back_to_back_packets() -> None:
    hop = _hop()  # 1000 bytes/s: a 100-byte packet occupies the hop 0.1 s, then flies 0.1 s
    assert hop.admit(10.0, 100) == pytest.approx(10.2)
    assert hop.admit(10.0, 100) == pytest.approx(10.3)  # waits for the first to be sent
    assert hop.free_at == pytest.approx(10.2)
    assert hop.admit(11.0, 50) == pytest.approx(11.15)  # an idle hop again: no wait
    assert (hop.packets, hop.bytes) == (3, 250)
    unshaped = _hop(bandwidth_bps=None)
    assert unshaped.admit(5.0, 65_000) == 5.0 and unshaped.admit(4.0, 1) == 5.0  # never before an earlier packet
    assert unshaped.counters() == {"packets": 2, "bytes": 65_001, "dropped_loss": 0, "dropped_queue": 0, "dropped_cut": 0}


def test_jitter_never_reorders_a_hop() -> None:
    hop = _hop(bandwidth_bps=1e9, one_way_s=0.01, jitter_s=0.05, queue_bytes=10**9)
    departures = [hop.admit(1.0 + i * 0.001, 100) for i in range(500)]
    assert departures == sorted(departures)
    # the jitter is there: deliveries spread over [one-way, one-way + jitter] after the sends, and some wait for
    # an earlier, more delayed packet
    lags = [d - (1.0 + i * 0.001) for i, d in enumerate(departures)]
    assert min(lags) >= 0.01 and max(lags) <= 0.01 + 0.05 + 1e-6 and max(lags) - min(lags) > 0.03
    assert sum(1 for a, b in zip(departures, departures[1:], strict=False) if a == b) > 0


def test_a_full_queue_drops_the_tail() -> None:
    # 1024 bytes/s, 128-byte packets (0.125 s each, exact in binary): the queue holds ten of them
    hop = _hop(bandwidth_bps=8192.0, queue_bytes=1280)
    results = [hop.admit(0.0, 128) for _ in range(15)]
    assert [r is not None for r in results] == [True] * 10 + [False] * 5
    assert hop.dropped_queue == 5 and hop.packets == 10 and hop.free_at == 1.25
    # 0.625 s later half the queue has gone out: five more fit, the sixth does not
    later = [hop.admit(0.625, 128) for _ in range(6)]
    assert [r is not None for r in later] == [True] * 5 + [False]
    assert hop.dropped_queue == 6 and hop.dropped_loss == hop.dropped_cut == 0


def test_loss_drops_about_its_fraction() -> None:
    hop = _hop(bandwidth_bps=None, loss=0.1, seed=7)
    kept = sum(hop.admit(float(i), 100) is not None for i in range(20_000))
    assert hop.dropped_loss == 20_000 - kept
    assert abs(hop.dropped_loss - 2000) < 200  # σ = √(20000·0.1·0.9) ≈ 42
    again = _hop(bandwidth_bps=None, loss=0.1, seed=7)  # seeded: the same packets are lost
    assert sum(again.admit(float(i), 100) is not None for i in range(20_000)) == kept


def test_a_cut_hop_drops_everything_until_the_cut_ends() -> None:
    hop = _hop(loss=0.0)
    hop.cut_until = 5.0
    assert hop.admit(4.0, 100) is None and hop.admit(4.999, 100) is None
    assert hop.dropped_cut == 2 and hop.packets == 0 and hop.free_at == 0.0
    assert hop.admit(5.0, 100) == pytest.approx(5.2)
    assert hop.counters() == {"packets": 1, "bytes": 100, "dropped_loss": 0, "dropped_queue": 0, "dropped_cut": 2}


# ------------------------------------------------------------------ packets and their labels
DC, COORD = "10.9.0.10", "10.9.0.1"


def _ip(address: str) -> bytes:
    return bytes(int(part) for part in address.split("."))


def tcp_packet(src: str, dst: str, sport: int, dport: int, seq: int, payload: bytes = b"") -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x18, 65535, 0, 0)
    total = 20 + len(tcp) + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, total, 1, 0, 64, 6, 0, _ip(src), _ip(dst))
    return ip + tcp + payload


def udp_packet(src: str, dst: str, payload: bytes = b"POST /v1/fleet/pull-object HTTP/1.1\r\n") -> bytes:
    udp = struct.pack("!HHHH", 5000, 6000, 8 + len(payload), 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 1, 0, 64, 17, 0, _ip(src), _ip(dst))
    return ip + udp + payload


REQUEST = b"POST /v1/fleet/pull-object HTTP/1.1\r\nHost: x\r\n\r\n"


def test_flows_label_http_exchanges() -> None:
    flows = _Flows()
    syn = tcp_packet(DC, COORD, 40000, 9092, seq=100)
    assert (flows.label(syn, upward=True).exchange, flows.label(syn, upward=True).path) == ("-", "-")
    request = tcp_packet(DC, COORD, 40000, 9092, seq=101, payload=REQUEST)
    label = flows.label(request, upward=True)
    assert (label.exchange, label.path) == ("1.1", "/v1/fleet/pull-object")
    # the answer, the other way on the same connection, belongs to the same exchange
    answer = tcp_packet(COORD, DC, 9092, 40000, seq=7000, payload=b"HTTP/1.1 200 OK\r\n\r\n")
    label = flows.label(answer, upward=False)
    assert (label.exchange, label.path) == ("1.1", "/v1/fleet/pull-object")
    # a retransmission of the request (same sequence number) is not a new exchange
    assert flows.label(request, upward=True).exchange == "1.1"
    # the body's next segment is not a request line either
    body = tcp_packet(DC, COORD, 40000, 9092, seq=101 + len(REQUEST), payload=b"\x00" * 100)
    assert flows.label(body, upward=True).exchange == "1.1"
    # the next request on the same connection is
    second = tcp_packet(DC, COORD, 40000, 9092, seq=101 + len(REQUEST) + 100, payload=b"GET /v1/fleet/get-run HTTP/1.1\r\n\r\n")
    label = flows.label(second, upward=True)
    assert (label.exchange, label.path) == ("1.2", "/v1/fleet/get-run")
    # another connection (another source port) counts its own exchanges
    other = tcp_packet(DC, COORD, 40001, 9092, seq=5, payload=REQUEST)
    assert flows.label(other, upward=True).exchange == "2.1"
    assert flows.label(tcp_packet(COORD, DC, 9092, 40000, seq=7100), upward=False).exchange == "1.2"
    # not TCP: no label, whatever it carries
    label = flows.label(udp_packet(DC, COORD), upward=True)
    assert (label.exchange, label.path) == ("-", "-")


def test_data_bytes_is_the_tcp_payload() -> None:
    assert data_bytes(tcp_packet(DC, COORD, 40000, 9092, seq=1)) == 0  # a bare acknowledgement
    assert data_bytes(tcp_packet(DC, COORD, 40000, 9092, seq=1, payload=REQUEST)) == len(REQUEST)
    assert data_bytes(udp_packet(DC, COORD, payload=b"x" * 10)) == 8 + 10  # not TCP: all after the IP header


def test_an_exchange_ends_when_its_last_data_is_delivered() -> None:
    """The bare packets a connection sends after its exchange (the last ACK, the closing FIN handshake, seconds
    later) are not the exchange's time on the link; the ACKs in the middle of a transfer are."""
    exchange = [Transfer("up", 900, 0.0, 0.075, "1.1", "/v1/fleet/push-object", 848),
                Transfer("down", 52, 0.075, 0.150, "1.1", "/v1/fleet/push-object", 0),  # mid-transfer ACK: kept
                Transfer("up", 65000, 0.150, 0.230, "1.1", "/v1/fleet/push-object", 64948),
                Transfer("down", 200, 0.240, 0.315, "1.1", "/v1/fleet/push-object", 148),  # the response
                Transfer("up", 52, 0.316, 0.391, "1.1", "/v1/fleet/push-object", 0),  # its ACK: after the end
                Transfer("down", 52, 1.000, 1.075, "1.1", "/v1/fleet/push-object", 0),  # FIN handshake
                Transfer("up", 52, 1.076, 1.151, "1.1", "/v1/fleet/push-object", 0)]
    kept = within_exchanges(exchange)
    assert kept == exchange[:4]
    assert time_in_flight(kept) == pytest.approx(0.230 + 0.075)
    assert payload_transfers(exchange) == exchange[:4]
    # unknown data (the relay's chunks, old ledgers) and traffic of no exchange are kept whole
    unknown = [Transfer("up", 52, 0.0, 0.1, "1.1", "/v1/fleet/push-object"), Transfer("up", 52, 2.0, 2.1, "-", "-", 0)]
    assert within_exchanges(unknown) == unknown
    # the ledger keeps the data column; a line without it reads as all data
    assert ledger_line(exchange[1]).split()[-1] == "0"
    assert len(ledger_line(unknown[0]).split()) == 6


# ------------------------------------------------------------------ the delay line between fake devices
@pytest.fixture
def devices() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Three fake TUN devices: the delay line writes to [i][0], the test reads what arrived at node i from [i][1]."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(3)]
    for _, far in pairs:
        far.setblocking(False)
    yield pairs
    for near, far in pairs:
        near.close()
        far.close()


def _received(pair: tuple[socket.socket, socket.socket]) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(pair[1].recv(65536))
        except BlockingIOError:
            return out


def _ledger(line: DelayLine, ledger_dir: Path, name: str) -> list:
    for handle in line.ledgers.values():
        handle.flush()
    return LedgerReader(ledger_dir / f"{name}.ledger").window(0.0, 1e12)


def _close(line: DelayLine) -> None:
    for handle in line.ledgers.values():
        handle.close()


ADDRESSES = ["10.9.0.1", "10.9.0.10", "10.9.0.11"]  # coordinator, a, b


def test_the_delay_line_carries_a_packet_over_both_star_hops_in_time(tmp_path: Path, devices) -> None:
    link = LinkSpec("t", bandwidth_mbps=8.0, rtt_ms=200.0)  # 1 MB/s, 0.1 s one way
    topo = build_topology([("a", link), ("b", link)], [], mtu=1500)
    line = DelayLine(topo, ADDRESSES, [near.fileno() for near, _ in devices], tmp_path / "ledgers")
    packet = tcp_packet(ADDRESSES[1], ADDRESSES[2], 40000, 8080, seq=1, payload=REQUEST)
    size = len(packet)
    tx = size * 8 / 8e6
    line.arrive(packet, source=1, now=100.0)
    line.release_due(100.0 + 0.1 + tx - 1e-4)  # a:up not yet done
    assert [_received(p) for p in devices] == [[], [], []] and _ledger(line, tmp_path / "ledgers", "a") == []
    line.release_due(100.0 + 0.1 + tx + 1e-4)  # off a:up, on b:down
    up = _ledger(line, tmp_path / "ledgers", "a")
    assert [(t.direction, t.size, t.exchange, t.path) for t in up] == [("up", size, "1.1", "/v1/fleet/pull-object")]
    assert up[0].entered == pytest.approx(100.0) and up[0].left == pytest.approx(100.1 + tx, abs=1e-6)
    assert [_received(p) for p in devices] == [[], [], []] and _ledger(line, tmp_path / "ledgers", "b") == []
    line.release_due(100.0 + 0.2 + 2 * tx - 1e-4)
    assert _received(devices[2]) == []
    line.release_due(100.0 + 0.2 + 2 * tx + 1e-4)
    assert [_received(p) for p in devices] == [[], [], [packet]]
    down = _ledger(line, tmp_path / "ledgers", "b")
    assert [(t.direction, t.size) for t in down] == [("down", size)]
    assert down[0].entered == pytest.approx(100.1 + tx, abs=1e-6) and down[0].left == pytest.approx(100.2 + 2 * tx + 1e-4, abs=1e-6)
    assert line.hops["a:up"].packets == line.hops["b:down"].packets == 1 and line.hops["a:down"].packets == 0
    # the answer to the coordinator goes down nothing: one hop, a:up
    line.arrive(tcp_packet(ADDRESSES[1], ADDRESSES[0], 40001, 9092, seq=1), source=1, now=200.0)
    line.release_due(201.0)
    assert len(_received(devices[0])) == 1 and len(_ledger(line, tmp_path / "ledgers", "a")) == 2
    _close(line)


def test_the_delay_line_uses_a_mesh_hop_and_drops_what_it_cannot_route(tmp_path: Path, devices) -> None:
    topo = build_topology([("a", TRANSOCEANIC), ("b", TRANSOCEANIC)], [("a", "b", METRO)], mtu=1500)
    line = DelayLine(topo, ADDRESSES, [near.fileno() for near, _ in devices], tmp_path / "ledgers")
    packet = udp_packet(ADDRESSES[2], ADDRESSES[1])
    line.arrive(packet, source=2, now=50.0)
    line.release_due(50.0 + 0.0009)
    assert _received(devices[1]) == []
    line.release_due(50.0 + 0.0011)  # metro: 1 ms one way (plus 0.03 µs on the wire), not 150 ms
    assert _received(devices[1]) == [packet]
    mesh = _ledger(line, tmp_path / "ledgers", "a--b")
    assert [(t.direction, t.size, t.exchange) for t in mesh] == [("b>a", len(packet), "-")]
    assert _ledger(line, tmp_path / "ledgers", "a") == [] == _ledger(line, tmp_path / "ledgers", "b")
    line.arrive(udp_packet(ADDRESSES[1], "10.9.0.99"), source=1, now=51.0)  # nobody's address
    line.arrive(udp_packet(ADDRESSES[1], ADDRESSES[1]), source=1, now=51.0)  # its own
    line.arrive(b"\x60" + b"\x00" * 39, source=1, now=51.0)  # IPv6: ignored, not counted
    line.release_due(60.0)
    assert line.unroutable == 2 and [_received(p) for p in devices] == [[], [], []]
    _close(line)


def test_a_slot_file_names_its_owner_by_pid_and_start_time() -> None:
    """The owner is this process by pid and start time (text, as slot files have always had it); a recycled pid
    (another start time), a gone process or a malformed entry is not a live owner."""
    me = owner_state(os.getpid())
    assert me == {"pid": os.getpid(), "pid_start": str(process_start(os.getpid()))}
    assert _owner_alive(me) and _owner_alive({**me, "network": "0.0.0.0/32", "namespaces": []})
    assert not _owner_alive({**me, "pid_start": str(int(me["pid_start"]) + 1)})
    for malformed in ({}, {"pid": os.getpid()}, {**me, "pid_start": None}, {**me, "pid": "me"}):
        assert not _owner_alive(malformed), malformed
    gone = subprocess.Popen(["sleep", "30"])
    started = owner_state(gone.pid)
    gone.kill()
    gone.wait()
    assert started["pid_start"] is not None and not _owner_alive(started)
    assert owner_state(gone.pid) == {"pid": gone.pid, "pid_start": None}
