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
