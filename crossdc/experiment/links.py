"""WAN link descriptions: named profiles and explicit (bandwidth, RTT, jitter, loss) numbers.

The link relay (crossdc/wan/link_relay.py) emulates them; the planner
(crossdc plan) models them: one vocabulary for configs, docs, emulator and planner.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """A symmetric WAN link: bandwidth in each direction, round-trip time, jitter of the one-way delay, and loss:
    the fraction of packets dropped at random, in each direction, independently (0 ≤ loss < 1)."""

    name: str
    bandwidth_mbps: float
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0

    def describe(self) -> str:
        jitter = f" ± {self.jitter_ms:g} ms jitter" if self.jitter_ms else ""
        loss = f", {self.loss * 100:g}% loss" if self.loss else ""
        return f"{self.name} ({self.bandwidth_mbps:g} Mbps, {self.rtt_ms:g} ms RTT{jitter}{loss})"


LINK_PROFILES: dict[str, LinkSpec] = {
    "metro": LinkSpec("metro", bandwidth_mbps=10_000.0, rtt_ms=2.0),
    "continental": LinkSpec("continental", bandwidth_mbps=1_000.0, rtt_ms=40.0),
    "transoceanic": LinkSpec("transoceanic", bandwidth_mbps=100.0, rtt_ms=150.0),
    "constrained": LinkSpec("constrained", bandwidth_mbps=10.0, rtt_ms=300.0),
}
