"""Learning-rate schedules: the pure function shared by the inner optimizers and the outer (server) optimizers.

A schedule is counted in steps of the optimizer it drives (a datacenter's own inner steps; a server's outer
steps, i.e. rounds) over a horizon: the steps planned for the whole run. It imports nothing else of crossdc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: the shapes a schedule can take after its warm-up
SCHEDULE_KINDS: tuple[str, ...] = ("constant", "cosine", "linear")


class ScheduleError(ValueError):
    """A schedule that cannot be run: an unknown kind, a negative warm-up, a min_lr outside [0, lr]."""


@dataclass(frozen=True)
class LrSchedule:
    """Warm-up then decay (see :func:`lr_at`). The default is a constant learning rate, no warm-up."""

    kind: str = "constant"
    warmup_steps: int = 0
    #: the learning rate the decay ends at, in absolute units (≤ the base learning rate)
    min_lr: float = 0.0

    def check(self, base_lr: float, horizon: int | None = None, where: str = "schedule") -> None:
        """ScheduleError, naming `where`, for a schedule that cannot run with `base_lr` over `horizon` steps
        (None: the horizon is not known yet and only the schedule itself is checked)."""
        if self.kind not in SCHEDULE_KINDS:
            raise ScheduleError(f"'{where}.kind' must be one of {', '.join(SCHEDULE_KINDS)}, got {self.kind!r}")
        if self.warmup_steps < 0:
            raise ScheduleError(f"'{where}.warmup_steps' must be ≥ 0, got {self.warmup_steps}")
        if not (math.isfinite(self.min_lr) and 0.0 <= self.min_lr <= base_lr):
            raise ScheduleError(f"'{where}.min_lr' must be in [0, {base_lr:g}] (the base learning rate), "
                                f"got {self.min_lr!r}")
        if horizon is not None and self.warmup_steps > horizon:
            raise ScheduleError(f"'{where}.warmup_steps' ({self.warmup_steps}) is longer than the run "
                                f"({horizon} steps)")

    def lr(self, step: int, base_lr: float, horizon: int) -> float:
        """The learning rate of 0-based `step` (:func:`lr_at`)."""
        return lr_at(step, base_lr, horizon, self.kind, self.warmup_steps, self.min_lr)


def warmed_up(value: float, step: int, warmup_steps: int) -> float:
    """`value` during and after a linear warm-up over `warmup_steps`: value · (step + 1) / warmup_steps for the 0-based
    steps 0 … warmup_steps − 1 (never 0), `value` from then on (and always when warmup_steps is 0)."""
    if step < warmup_steps:
        return value * (step + 1) / warmup_steps
    return value


def lr_at(step: int, base_lr: float, horizon: int, kind: str = "constant", warmup_steps: int = 0,
          min_lr: float = 0.0) -> float:
    """The learning rate of the 0-based `step` of a run of `horizon` steps.

    - warm-up, steps 0 … warmup_steps − 1: base_lr · (step + 1) / warmup_steps (linear, never 0);
    - then, with progress p = (step − warmup_steps) / (horizon − warmup_steps) clipped to [0, 1]:
      ``constant`` base_lr; ``linear`` base_lr − (base_lr − min_lr) · p;
      ``cosine`` min_lr + (base_lr − min_lr) · (1 + cos(π p)) / 2.
    Steps past the horizon keep the last value (min_lr for a decay). ValueError for a negative step or an
    unknown kind.
    """
    if step < 0:
        raise ValueError(f"steps are counted from 0, got {step}")
    if kind not in SCHEDULE_KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; known: {', '.join(SCHEDULE_KINDS)}")
    if step < warmup_steps:
        return warmed_up(base_lr, step, warmup_steps)
    if kind == "constant":
        return base_lr
    decay_steps = horizon - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if kind == "linear":
        return base_lr - (base_lr - min_lr) * progress
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
