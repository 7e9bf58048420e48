"""Adaptive round deadlines: derived from how long each datacenter's recent rounds took.

A fixed deadline either mistakes a slow WAN for a failure (too short) or waits for a dead datacenter
for a long time (too long). The adaptive deadline promises:

- while a datacenter has fewer than `min_history` completed rounds, the round may take up to the ceiling;
- afterwards the round waits until max over datacenters of max(median + k · MAD, (1 + slack) · median)
  of their recent round times (MAD scaled by 1.4826, so k is in standard deviations for normal noise; the
  relative slack keeps a datacenter whose rounds were all alike from being dropped for a slightly slower
  one), never less than the floor and never more than the ceiling.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from crossdc.experiment.config import DeadlinePolicy

MAD_TO_SIGMA = 1.4826


def datacenter_deadline(round_times: Sequence[float], policy: DeadlinePolicy) -> float:
    """How long one datacenter with these recent round times is waited for (see the module docstring)."""
    recent = [t for t in round_times if t >= 0][-policy.window:]
    if len(recent) < policy.min_history:
        return policy.ceiling_s
    median = statistics.median(recent)
    mad = statistics.median(abs(t - median) for t in recent) * MAD_TO_SIGMA
    return min(policy.ceiling_s, max(policy.floor_s, median + policy.k_mad * mad, (1 + policy.slack) * median))


def round_deadline(history: Mapping[str, Sequence[float]], datacenters: Sequence[str], policy: DeadlinePolicy) -> float:
    """The round's deadline in seconds: the longest any participating datacenter is waited for."""
    return max((datacenter_deadline(history.get(name, ()), policy) for name in datacenters), default=policy.ceiling_s)


class Deadlines:
    """The deadlines of one run's rounds (or, in a streaming run, its exchanges): the fixed ``run.round_timeout_s``,
    or the adaptive ``run.deadline`` (:func:`round_deadline`) learnt from each datacenter's recent times.

    Promises: :meth:`next` gives the wait of the next round and how it was set; :attr:`ttl_s` is how long a message
    may stay undelivered (the fixed deadline, or the adaptive ceiling: a round may wait on up to it for enough
    replies); :meth:`record` learns a datacenter's time — a reply's, or, for a datacenter that timed out, the
    deadline it missed (a lower bound of its pace, so one that slowed down is learnt too); :attr:`times` is what a
    checkpoint keeps."""

    def __init__(self, policy: DeadlinePolicy | None, fixed_s: float, datacenters: Sequence[str],
                 times: Mapping[str, Sequence[float]] | None = None) -> None:
        self.policy, self.fixed_s = policy, fixed_s
        self.times: dict[str, list[float]] = {name: [] for name in datacenters}
        self.times.update({name: list(t) for name, t in (times or {}).items() if name in self.times})

    @property
    def ttl_s(self) -> float:
        return self.policy.ceiling_s if self.policy is not None else self.fixed_s

    def next(self, datacenters: Sequence[str]) -> tuple[float, str]:
        """(seconds to wait for the next round's replies, what set it: ``fixed run.round_timeout_s`` or
        ``adaptive run.deadline``)."""
        if self.policy is None:
            return self.fixed_s, "fixed run.round_timeout_s"
        return round_deadline(self.times, datacenters, self.policy), "adaptive run.deadline"

    def can_wait_on(self, waited_s: float) -> float:
        """How much longer a round that waited `waited_s` without enough replies may wait (up to the ceiling)."""
        return max(0.0, self.policy.ceiling_s - waited_s) if self.policy is not None else 0.0

    def record(self, name: str, status: str, seconds: float | None, deadline_s: float) -> None:
        if status == "ok" and seconds is not None:
            self.times.setdefault(name, []).append(seconds)
        elif status == "timeout":
            self.times.setdefault(name, []).append(deadline_s)
