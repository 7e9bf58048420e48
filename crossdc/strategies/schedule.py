"""Schedules for the number of local steps τ per round (pure functions)."""

from __future__ import annotations

import math


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
