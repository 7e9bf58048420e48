"""Schedules for the number of local steps τ per round: the pure function, and the schedule a strategy is built with."""

from __future__ import annotations

import math
from dataclasses import dataclass


def tau_for_round(server_round: int, start: int, end: int, warmup_rounds: int, kind: str = "linear") -> int:
    """τ for a 1-based round: `start` at round 1, `end` from round `warmup_rounds` + 1 on.

    Over the warm-up rounds 1..warmup_rounds the value moves from `start`
    towards `end`:
    - ``linear``: start + (end − start) · (r − 1) / warmup_rounds, rounded to the nearest integer;
    - ``geometric``: start · (end / start) ^ ((r − 1) / warmup_rounds), rounded.
    With warmup_rounds = 0, τ = end from the first round. The result is always ≥ 1.
    """
    if server_round < 1:
        raise ValueError(f"rounds are numbered from 1, got {server_round}")
    if start < 1 or end < 1:
        raise ValueError(f"tau must be ≥ 1, got start={start}, end={end}")
    if warmup_rounds <= 0 or server_round > warmup_rounds:
        return end
    progress = (server_round - 1) / warmup_rounds
    if kind == "linear":
        value = start + (end - start) * progress
    elif kind == "geometric":
        value = start * math.pow(end / start, progress)
    else:
        raise ValueError(f"unknown tau schedule kind {kind!r}; known: linear, geometric")
    return max(1, int(math.floor(value + 0.5)))


def tau_sum(rounds: int, start: int, end: int, warmup_rounds: int, kind: str = "linear") -> int:
    """Σ :func:`tau_for_round` over rounds 1..`rounds` (0 for rounds ≤ 0), exactly: the warm-up's rounds one by one
    (at most `warmup_rounds`, which the config bounds), every later round at once as `end` × their count.
    ValueError for the schedules tau_for_round refuses."""
    if start < 1 or end < 1:
        raise ValueError(f"tau must be ≥ 1, got start={start}, end={end}")
    if rounds <= 0:
        return 0
    warm = min(rounds, max(warmup_rounds, 0))
    return sum(tau_for_round(r, start, end, warmup_rounds, kind) for r in range(1, warm + 1)) + end * (rounds - warm)


@dataclass(frozen=True)
class TauSchedule:
    """Local steps per round: from `start` to `end` over `warmup_rounds`, moving as `kind` says (see
    :func:`tau_for_round`). The default is a constant τ = 1; ``TauSchedule(5, 5)`` is a constant τ = 5."""

    start: int = 1
    end: int = 1
    warmup_rounds: int = 0
    kind: str = "linear"

    def tau(self, server_round: int) -> int:
        """τ for a 1-based round (ValueError for a schedule :func:`tau_for_round` refuses)."""
        return tau_for_round(server_round, self.start, self.end, self.warmup_rounds, self.kind)

    def total(self, rounds: int) -> int:
        """τ summed over rounds 1..`rounds` (:func:`tau_sum`: no loop over the rounds after the warm-up)."""
        return tau_sum(rounds, self.start, self.end, self.warmup_rounds, self.kind)
