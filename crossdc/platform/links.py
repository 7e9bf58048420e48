"""WAN link descriptions: named profiles and explicit (bandwidth, RTT) pairs.

The emulator that shapes traffic to these links is separate work; this module
only names them so configs, docs and the planner share one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """A symmetric WAN link: bandwidth in each direction and round-trip time."""

    name: str
    bandwidth_mbps: float
    rtt_ms: float


LINK_PROFILES: dict[str, LinkSpec] = {
    "metro": LinkSpec("metro", bandwidth_mbps=10_000.0, rtt_ms=2.0),
    "continental": LinkSpec("continental", bandwidth_mbps=1_000.0, rtt_ms=40.0),
    "transoceanic": LinkSpec("transoceanic", bandwidth_mbps=100.0, rtt_ms=150.0),
    "constrained": LinkSpec("constrained", bandwidth_mbps=10.0, rtt_ms=300.0),
}
