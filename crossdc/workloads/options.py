"""How the inner optimizer is tuned (``[workload]`` betas, weight_decay, grad_clip, schedule): a plain value, with
no torch, so that configs are checked without importing it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from crossdc.lr_schedule import LrSchedule
from crossdc.workloads.errors import WorkloadError

__all__ = ["ADAMW_BETAS", "InnerOptions"]

#: Betas of the "adamw" optimizer unless ``[workload] betas`` says otherwise (torch's own AdamW default).
ADAMW_BETAS = (0.9, 0.999)


@dataclass(frozen=True)
class InnerOptions:
    """How the inner optimizer is tuned beyond its name and learning rate (``[workload]`` betas, weight_decay,
    grad_clip, schedule). None keeps the optimizer's default: betas ADAMW_BETAS, weight decay
    ADAMW_WEIGHT_DECAY for "adamw" and 0 for "sgd"/"momentum", no clipping; the default schedule is constant.
    ``grad_clip`` is a bound on the global L2 norm of a step's gradient (torch's ``clip_grad_norm_``)."""

    betas: tuple[float, float] | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    schedule: LrSchedule = field(default_factory=LrSchedule)

    def check(self, optimizer: str) -> None:
        """WorkloadError for options `optimizer` cannot take or values out of range."""
        if self.betas is not None:
            if optimizer != "adamw":
                raise WorkloadError(f"betas apply to the \"adamw\" optimizer only, not \"{optimizer}\"")
            if len(self.betas) != 2 or not all(isinstance(b, float) and 0.0 <= b < 1.0 for b in self.betas):
                raise WorkloadError(f"betas must be two numbers in [0, 1), got {list(self.betas)!r}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise WorkloadError(f"weight_decay must be ≥ 0, got {self.weight_decay!r}")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0.0):
            raise WorkloadError(f"grad_clip must be > 0 (a bound on the gradient's global norm), got {self.grad_clip!r}")
