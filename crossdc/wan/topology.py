"""Who reaches whom over which emulated link: the star (every datacenter ↔ the coordinator) and the
datacenter-to-datacenter mesh, as one-directional hops and the path of hops between any two nodes.

Promises:
- node 0 is the coordinator; node i (1…N) is the i-th datacenter;
- every datacenter has two star hops, ``<dc>:up`` (datacenter → coordinator) and ``<dc>:down``;
  a datacenter without a link gets unshaped hops (no delay, no bandwidth limit) that are still measured;
- a listed mesh pair has two hops, ``<a>><b>`` and ``<b>><a>``; the path between two datacenters is
  that hop, or else the two star hops through the coordinator ``[<a>:up, <b>:down]`` (one-way delays add,
  the bandwidth is the smaller of the two, and the capacity is shared with the star traffic, as it is
  when a packet really goes through the coordinator's site).
Pure: no sockets, no kernel; the delay line (crossdc.wan.delay_line) carries packets along these paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from crossdc.experiment.links import LinkSpec

COORDINATOR = "coordinator"
#: the smallest queue a hop keeps, in packets of the emulated MTU (a link with a tiny bandwidth-delay product
#: still buffers a burst)
MIN_QUEUE_PACKETS = 16


@dataclass(frozen=True)
class Hop:
    """One direction of one emulated link. `bandwidth_bps` None: unshaped (loopback speed). `queue_bytes`: the most
    bytes waiting for the hop before it drops (the link's bandwidth-delay product, at least MIN_QUEUE_PACKETS)."""

    name: str
    bandwidth_bps: float | None
    one_way_s: float
    jitter_s: float
    loss: float
    queue_bytes: int
    #: the ledger the hop writes to (a datacenter's name, or "<a>--<b>" for a mesh pair) and the direction it writes
    ledger: str
    direction: str

    @classmethod
    def from_link(cls, name: str, link: LinkSpec | None, mtu: int, ledger: str, direction: str) -> Hop:
        if link is None:  # unshaped: nothing queues at it
            return cls(name, None, 0.0, 0.0, 0.0, 0, ledger, direction)
        bandwidth = link.bandwidth_mbps * 1e6
        bdp = int(bandwidth / 8 * link.rtt_ms / 1000.0)
        return cls(name, bandwidth, link.rtt_ms / 2000.0, link.jitter_ms / 1000.0, link.loss,
                   max(bdp, MIN_QUEUE_PACKETS * mtu), ledger, direction)


def star_hops(datacenter: str) -> tuple[str, str]:
    """The names of a datacenter's star hops: (to the coordinator, from it)."""
    return f"{datacenter}:up", f"{datacenter}:down"


def mesh_hops(a: str, b: str) -> tuple[str, str]:
    """The names of the two hops of the mesh link between `a` and `b`: (a → b, b → a)."""
    return f"{a}>{b}", f"{b}>{a}"


def mesh_ledger(a: str, b: str) -> str:
    """The ledger name of the mesh link between datacenters `a` and `b` (order-insensitive)."""
    first, second = sorted((a, b))
    return f"{first}--{second}"


@dataclass(frozen=True)
class Topology:
    """The hops of a run's emulated WAN and the path between every ordered pair of nodes."""

    nodes: tuple[str, ...]  # COORDINATOR first, then the datacenters in config order
    hops: dict[str, Hop]
    paths: dict[tuple[int, int], tuple[str, ...]]

    def path(self, source: int, destination: int) -> tuple[str, ...]:
        return self.paths[(source, destination)]


def build_topology(star: Sequence[tuple[str, LinkSpec | None]], mesh: Sequence[tuple[str, str, LinkSpec]],
                   mtu: int) -> Topology:
    """The topology of datacenters `star` ((name, link to the coordinator) in order) and direct links `mesh`
    ((a, b, link), each pair at most once, both named in `star`)."""
    names = [name for name, _ in star]
    if len(set(names)) != len(names) or COORDINATOR in names:
        raise ValueError(f"datacenter names must be unique and not {COORDINATOR!r}: {names}")
    hops: dict[str, Hop] = {}
    for name, link in star:
        for hop, direction in zip(star_hops(name), ("up", "down"), strict=True):
            hops[hop] = Hop.from_link(hop, link, mtu, name, direction)
    direct: dict[tuple[str, str], str] = {}
    for a, b, link in mesh:
        if a not in names or b not in names or a == b:
            raise ValueError(f"a mesh link joins two different datacenters of the run, not {a!r} and {b!r}")
        if (a, b) in direct:
            raise ValueError(f"the mesh lists {a!r} and {b!r} twice")
        for (source, target), hop in zip(((a, b), (b, a)), mesh_hops(a, b), strict=True):
            hops[hop] = Hop.from_link(hop, link, mtu, mesh_ledger(a, b), hop)
            direct[(source, target)] = hop
    nodes = (COORDINATOR, *names)
    paths: dict[tuple[int, int], tuple[str, ...]] = {}
    for i, source in enumerate(nodes):
        for j, target in enumerate(nodes):
            if i == j:
                continue
            if source == COORDINATOR:
                paths[(i, j)] = (star_hops(target)[1],)
            elif target == COORDINATOR:
                paths[(i, j)] = (star_hops(source)[0],)
            elif (source, target) in direct:
                paths[(i, j)] = (direct[(source, target)],)
            else:
                paths[(i, j)] = (star_hops(source)[0], star_hops(target)[1])
    return Topology(nodes, hops, paths)
