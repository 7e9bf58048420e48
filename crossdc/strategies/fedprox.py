"""FedProx (Li et al., 2020): FedAvg whose local loss carries a proximal term.

Client contract: the base's (:mod:`crossdc.strategies.base`), with one change to the local work: every
local step minimises  F_i(w) + (μ/2)·‖w − x‖²  where x are the global weights the round started from and
the norm runs over the trainable parameters (buffers have no gradient). With W > 1 local ranks, each rank
adds the same term, so DistributedDataParallel's average of the gradients is the gradient of the global
batch's loss plus μ·(w − x), exactly as with one process. μ comes from the config (``params = { mu = 0.01 }``);
μ = 0 is exactly FedAvg. Server: the base's example-weighted mean update.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from crossdc.strategies.base import Arrays, LocalHooks, Parameter, Strategy


def proximal_term(model: torch.nn.Module, anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """(μ/2)·Σ_p ‖p − anchor_p‖² over the model's trainable parameters (the names in `anchor`)."""
    total = torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    for name, param in model.named_parameters():
        if param.requires_grad and name in anchor:
            total = total + torch.sum((param - anchor[name]) ** 2)
    return 0.5 * mu * total


class FedProx(Strategy):
    """FedAvg plus the proximal term (μ/2)·‖w − w_global‖² in every local step's loss."""

    name = "fedprox"
    parameters = {"mu": Parameter(float, 0.01, "weight μ of the proximal term (μ/2)·‖w − w_global‖²; 0 = FedAvg", low=0.0)}

    def local_hooks(self, plan: Mapping[str, Any], global_weights: Arrays, model: torch.nn.Module) -> LocalHooks:
        mu = float(self.params["mu"])
        if mu == 0.0:
            return LocalHooks()
        anchor = {name: torch.from_numpy(np.array(global_weights[name], dtype=np.float32)).to(param.device)
                  for name, param in model.named_parameters()}
        return LocalHooks(extra_loss=lambda m: proximal_term(m, anchor, mu))
