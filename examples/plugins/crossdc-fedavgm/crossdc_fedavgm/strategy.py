"""FedAvgM (Hsu et al., 2019): FedAvg with momentum on the server.

Client contract: exactly crossdc's base contract (plain local steps; reply Δy). Only the server's step
differs: v ← β·v + mean Δy, x ← x + η·v (β = server_momentum, η = server_lr). β = 0, η = 1 is FedAvg.
The momentum v is server state, checkpointed with state_dict / load_state_dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from crossdc.strategies.base import Arrays, ClientUpdate, Parameter, Strategy


def server_momentum_step(weights: Arrays, mean_delta: Arrays, velocity: Arrays | None, lr: float, momentum: float
                         ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(x + η·v, v) with v = β·v + mean Δy (v = mean Δy at the first step). Pure; float32 in and out."""
    new_v = {n: (np.float32(momentum) * velocity[n] + mean_delta[n] if velocity is not None else mean_delta[n].copy()).astype(np.float32)
             for n in weights}
    return {n: (weights[n] + np.float32(lr) * new_v[n]).astype(np.float32) for n in weights}, new_v


class FedAvgM(Strategy):
    """FedAvg with server momentum: v ← β·v + mean Δy, x ← x + η·v."""

    name = "fedavgm"
    parameters = {
        "server_lr": Parameter(float, 1.0, "server learning rate η", low=0.0),
        "server_momentum": Parameter(float, 0.9, "server momentum β", low=0.0, high=0.999),
    }
    velocity: dict[str, np.ndarray] | None = None  # v: server state, replaced by each step

    def aggregate(self, server_round: int, global_weights: Arrays, updates: Sequence[ClientUpdate], mean: Arrays) -> dict[str, np.ndarray]:
        weights, self.velocity = server_momentum_step(global_weights, mean, self.velocity,
                                                      float(self.params["server_lr"]), float(self.params["server_momentum"]))
        return weights

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.velocity = state.get("velocity")
