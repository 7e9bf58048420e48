"""The delay line: the process that carries every IPv4 packet between the emulated datacenters and the
coordinator, through the emulated links, whatever protocol sent it.

Each node (the coordinator in the root network namespace, each datacenter in its own) has a TUN device;
the kernel of the sending node hands the packet to this process, which passes it along its path of hops
(crossdc.wan.topology) and writes it into the receiving node's TUN device at its due time.

Per hop, per packet of s bytes arriving at t (the same pacing model as the relay, crossdc.wan.ledger.pace):
- **loss**: dropped at random with the hop's probability;
- **queue**: dropped when the bytes still waiting for the hop exceed its queue (tail drop, as a router);
- **bandwidth**: the hop sends one packet at a time: it starts at max(t, hop free) and occupies the hop
  s·8 / bandwidth seconds;
- **delay**: it arrives one-way delay (+ uniform jitter) after it was sent, never before an earlier packet
  of the same hop (packets stay in order);
- **cut**: while a hop is cut, every packet is dropped.
Every packet that crosses a hop is written to that hop's ledger (crossdc.wan.ledger: one line per packet,
its IP length, when it entered the hop and when it left it, its TCP connection's HTTP exchange).

Control: JSON lines on standard input — ``{"op": "cut", "hops": [...], "seconds": s}``,
``{"op": "restore", "hops": [...]}`` (ends a cut now) and ``{"op": "stats"}``; each is answered by one JSON line
on standard output. End of standard input (the parent closed it, or died) ends the process; its TUN devices go
with it.

Run as ``python -m crossdc.wan.delay_line SPEC.json``: the spec names the nodes, their addresses and
network namespaces, the topology, the MTU and the ledger folder (see :func:`main`). It prints ``ready``
once every device is up.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from crossdc.experiment.links import LinkSpec
from crossdc.wan.ledger import ExchangeTracker, Transfer, ledger_line, pace
from crossdc.wan.topology import Hop, Topology, build_topology

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
#: reads per device per turn of the loop, so one busy device cannot starve the timers
_READ_BURST = 64
#: below this wait the loop sleeps precisely instead of polling (epoll's timeout is in milliseconds)
_SPIN_S = 0.0015
_TCP = 6
_PR_SET_TIMERSLACK = 29
_REALTIME_PRIORITY = 10


@dataclass
class HopState:
    """What a hop is doing now, and what it has counted."""

    hop: Hop
    rng: random.Random
    free_at: float = 0.0
    last_delivery: float = 0.0
    cut_until: float = 0.0
    packets: int = 0
    bytes: int = 0
    dropped_loss: int = 0
    dropped_queue: int = 0
    dropped_cut: int = 0

    def admit(self, now: float, size: int) -> float | None:
        """The time the packet leaves this hop, or None if the hop drops it."""
        hop = self.hop
        if now < self.cut_until:
            self.dropped_cut += 1
            return None
        if hop.loss and self.rng.random() < hop.loss:
            self.dropped_loss += 1
            return None
        if hop.bandwidth_bps is None:
            departure = max(now, self.last_delivery)
        else:
            backlog = max(0.0, self.free_at - now) * hop.bandwidth_bps / 8.0
            if backlog + size > hop.queue_bytes:
                self.dropped_queue += 1
                return None
            jitter = self.rng.uniform(0.0, hop.jitter_s) if hop.jitter_s else 0.0
            self.free_at, departure = pace(now, size, self.free_at, self.last_delivery, hop.bandwidth_bps,
                                           hop.one_way_s, jitter)
        self.last_delivery = departure
        self.packets += 1
        self.bytes += size
        return departure

    def counters(self) -> dict[str, Any]:
        return {"packets": self.packets, "bytes": self.bytes, "dropped_loss": self.dropped_loss,
                "dropped_queue": self.dropped_queue, "dropped_cut": self.dropped_cut}


def data_bytes(packet: bytes) -> int:
    """Bytes of data an IPv4 packet carries for its connection: the TCP payload (0 for a bare acknowledgement or
    FIN), or everything after the IP header for other protocols."""
    ihl = (packet[0] & 0x0F) * 4
    total = int.from_bytes(packet[2:4], "big") or len(packet)
    if packet[9] != _TCP or len(packet) < ihl + 20:
        return max(0, total - ihl)
    return max(0, total - ihl - (packet[ihl + 12] >> 4) * 4)


@dataclass(frozen=True)
class FlowLabel:
    exchange: str
    path: str


@dataclass
class _Flows:
    """The TCP connections seen on one ledger, each following its HTTP exchanges (crossdc.wan.ledger.ExchangeTracker)."""

    trackers: dict[tuple[bytes, bytes], ExchangeTracker] = field(default_factory=dict)
    request_seq: dict[tuple[bytes, bytes], bytes] = field(default_factory=dict)

    def label(self, packet: bytes, upward: bool) -> FlowLabel:
        ihl = (packet[0] & 0x0F) * 4
        if packet[9] != _TCP or len(packet) < ihl + 20:
            return FlowLabel("-", "-")
        near, far = (packet[12:16], packet[16:20]) if upward else (packet[16:20], packet[12:16])
        ports = packet[ihl:ihl + 4] if upward else packet[ihl + 2:ihl + 4] + packet[ihl:ihl + 2]
        key = (near + far, ports)
        tracker = self.trackers.get(key)
        if tracker is None:
            tracker = self.trackers[key] = ExchangeTracker(len(self.trackers) + 1)
        if upward:
            offset = ihl + (packet[ihl + 12] >> 4) * 4
            seq = packet[ihl + 4:ihl + 8]
            if len(packet) > offset and self.request_seq.get(key) != seq:  # a retransmitted request line is not a new request
                before = tracker.count
                tracker.on_up(packet[offset:offset + 256])
                if tracker.count != before:
                    self.request_seq[key] = seq
        return FlowLabel(tracker.exchange, tracker.path)


class DelayLine:
    """Carries packets between `devices` (node index → TUN file descriptor) along `topology`'s paths."""

    def __init__(self, topology: Topology, addresses: list[str], devices: list[int], ledger_dir: Path, seed: int = 0,
                 control: IO[str] | None = None, answers: IO[str] | None = None) -> None:
        self.topology = topology
        self.node_of = {bytes(int(part) for part in address.split(".")): index for index, address in enumerate(addresses)}
        self.devices = devices
        self.hops = {name: HopState(hop, random.Random(f"{seed}:{name}")) for name, hop in topology.hops.items()}
        ledger_dir.mkdir(parents=True, exist_ok=True)
        self.ledgers: dict[str, IO[str]] = {}
        for hop in topology.hops.values():
            if hop.ledger not in self.ledgers:
                self.ledgers[hop.ledger] = open(ledger_dir / f"{hop.ledger}.ledger", "a")
        self.flows = {ledger: _Flows() for ledger in self.ledgers}
        self.control, self.answers = control, answers
        self.timers: list[tuple[float, int, bytes, int, tuple[str, ...], int, float]] = []
        self._sequence = 0
        self.unroutable = 0
        self.running = True

    # ----------------------------------------------------------------- packets
    def arrive(self, packet: bytes, source: int, now: float) -> None:
        """A packet the kernel of node `source` sent."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return  # IPv4 only: the emulated network has no IPv6 (the kernel's own neighbour discovery stays out)
        destination = self.node_of.get(packet[16:20])
        if destination is None or destination == source:
            self.unroutable += 1
            return
        self._enter(packet, destination, self.topology.path(source, destination), 0, now)

    def _enter(self, packet: bytes, destination: int, path: tuple[str, ...], index: int, now: float) -> None:
        departure = self.hops[path[index]].admit(now, len(packet))
        if departure is None:
            return
        self._sequence += 1
        heapq.heappush(self.timers, (departure, self._sequence, packet, destination, path, index, now))

    def release_due(self, now: float) -> None:
        """Hand on every packet whose time at its hop is up."""
        while self.timers and self.timers[0][0] <= now:
            departure, _, packet, destination, path, index, entered = heapq.heappop(self.timers)
            hop = self.hops[path[index]].hop
            upward = hop.direction == "up"
            flows = self.flows[hop.ledger]
            label = flows.label(packet, upward) if hop.direction in ("up", "down") else FlowLabel("-", "-")
            left = departure
            if index + 1 < len(path):
                self._enter(packet, destination, path, index + 1, departure)
            else:
                try:
                    os.write(self.devices[destination], packet)
                except OSError:
                    pass  # the receiving device is gone or full: the packet is lost, as on a real network
                left = max(departure, now)  # the last hop ends when the packet is handed to the receiver
            self.ledgers[hop.ledger].write(ledger_line(Transfer(hop.direction, len(packet), entered, left,
                                                                label.exchange, label.path, data_bytes(packet))))

    # ----------------------------------------------------------------- control
    def command(self, line: str) -> None:
        try:
            request = json.loads(line)
        except json.JSONDecodeError:
            self._answer({"error": f"not JSON: {line[:80]!r}"})
            return
        op = request.get("op")
        if op == "cut":
            until = time.time() + float(request["seconds"])
            for name in request["hops"]:
                self.hops[name].cut_until = until
            self._answer({"ok": True})
        elif op == "restore":
            for name in request["hops"]:
                self.hops[name].cut_until = 0.0
            self._answer({"ok": True})
        elif op == "stats":
            self._answer({"hops": {name: state.counters() for name, state in self.hops.items()},
                          "unroutable": self.unroutable, "cpu_s": time.process_time()})
        else:
            self._answer({"error": f"unknown op {op!r}"})

    def _answer(self, answer: dict[str, Any]) -> None:
        if self.answers is not None:
            self.answers.write(json.dumps(answer) + "\n")
            self.answers.flush()

    # -------------------------------------------------------------------- loop
    def run(self) -> None:
        poller = select.epoll()
        for fd in self.devices:
            os.set_blocking(fd, False)
            poller.register(fd, select.EPOLLIN)
        source_of = {fd: index for index, fd in enumerate(self.devices)}
        control_fd = self.control.fileno() if self.control is not None else None
        if control_fd is not None:
            poller.register(control_fd, select.EPOLLIN)
        pending = b""
        while self.running:
            wait = (self.timers[0][0] - time.time()) if self.timers else 1.0
            if 0 < wait < _SPIN_S:
                time.sleep(wait)
                wait = 0.0
            events = poller.poll(max(0.0, wait - _SPIN_S / 2) if wait > _SPIN_S else 0)
            for fd, _ in events:
                if fd == control_fd:
                    data = os.read(fd, 65536)
                    if not data:
                        self.running = False
                        break
                    pending += data
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        self.command(line.decode())
                    continue
                source = source_of[fd]
                for _ in range(_READ_BURST):
                    try:
                        packet = os.read(fd, 65536)
                    except BlockingIOError:
                        break
                    self.arrive(packet, source, time.time())
            self.release_due(time.time())
            for ledger in self.ledgers.values():
                ledger.flush()
        for ledger in self.ledgers.values():
            ledger.close()


def _fine_timers() -> None:
    """Packets leave on time even on a busy machine: exact wake-ups (timer slack 1 ns instead of 50 µs) and a
    real-time scheduling class above the trainers (the loop sleeps whenever no packet is due, so it takes only the CPU
    its packets need), else the highest nice priority this process may take."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(_PR_SET_TIMERSLACK, 1)
    except OSError:
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(_REALTIME_PRIORITY))
    except (OSError, AttributeError):
        try:
            os.nice(-10)
        except OSError:
            pass


def open_tun(name: str) -> int:
    """A new TUN device `name` (IP packets without extra header); it lives as long as the descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def configure_devices(spec: dict[str, Any]) -> list[int]:
    """Create each node's TUN device, move it into the node's namespace, give it its address, MTU and the route to the
    emulated network; returns the descriptors in node order."""
    from pyroute2 import IPRoute, NetNS

    devices = []
    for node in spec["nodes"]:
        fd = open_tun(node["device"])
        devices.append(fd)
        namespace = node.get("netns")
        with IPRoute() as root:
            index = root.link_lookup(ifname=node["device"])[0]
            if namespace:
                root.link("set", index=index, net_ns_fd=namespace)
        handle = NetNS(namespace) if namespace else IPRoute()
        with handle as ipr:
            index = ipr.link_lookup(ifname=node["device"])[0]
            ipr.addr("add", index=index, address=node["address"], prefixlen=32)
            ipr.link("set", index=index, state="up", mtu=int(spec["mtu"]))
            if namespace:
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
                ipr.route("add", dst=spec["network"], oif=index)
            else:
                for other in spec["nodes"]:
                    if other is not node:
                        ipr.route("add", dst=f"{other['address']}/32", oif=index)
    return devices


def topology_from_spec(spec: dict[str, Any]) -> Topology:
    def link(value: dict[str, Any] | None) -> LinkSpec | None:
        return LinkSpec(**value) if value is not None else None

    return build_topology([(name, link(value)) for name, value in spec["star"]],
                          [(a, b, LinkSpec(**value)) for a, b, value in spec["mesh"]], int(spec["mtu"]))


def main(argv: list[str] | None = None) -> int:
    """``python -m crossdc.wan.delay_line SPEC.json``; the spec: ``nodes`` ([{device, address, netns}], the coordinator
    first, netns null for the root namespace), ``network`` (the emulated range, CIDR), ``mtu``, ``star``
    ([[name, link fields or null]]), ``mesh`` ([[a, b, link fields]]), ``ledger_dir``, ``seed``."""
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _fine_timers()
    devices = configure_devices(spec)
    line = DelayLine(topology_from_spec(spec), [node["address"] for node in spec["nodes"]], devices,
                     Path(spec["ledger_dir"]), seed=int(spec.get("seed", 0)), control=sys.stdin, answers=sys.stdout)
    print("ready", flush=True)
    line.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
