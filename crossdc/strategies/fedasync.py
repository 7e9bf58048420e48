"""FedAsync (Xie et al., 2019): every accepted update is applied the moment it arrives, scaled by its staleness.

Client contract: exactly the base's (:mod:`crossdc.strategies.base`); see :mod:`crossdc.strategies.asynchronous`
for the server's clock and the staleness bound.

Server: an update Δ computed from version v, arriving at version t, with staleness s = t − v ≤ ``max_staleness``,
makes version t + 1:  x ← x + α(s)·Δ  with α(s) the staleness function of the mixing rate ``lr`` (default
``inverse``: lr / (1 + s)). This is the paper's x ← (1 − α)·x + α·x_new written on the update (x_new = x_v + Δ);
the two agree when s = 0. An update staler than ``max_staleness`` is discarded. One update per version, so
``[security] robust_aggregation`` has nothing to combine and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crossdc.strategies.aggregation import add
from crossdc.strategies.asynchronous import AsyncStrategy, Submitted, async_parameters
from crossdc.strategies.base import Arrays


def fedasync_step(global_weights: Arrays, delta: Arrays, scale: float) -> dict[str, np.ndarray]:
    """FedAsync's server update as a pure function: x + scale · Δ per tensor (float32)."""
    return add(global_weights, delta, scale)


class FedAsync(AsyncStrategy):
    """Asynchronous: each update applied on arrival, x ← x + lr/(1+s)·Δ (staleness s), staler than max_staleness discarded."""

    name = "fedasync"
    parameters = async_parameters(0.6, "mixing rate α: an update with staleness 0 is applied × α")
    combines_updates = False  # one update per step: security.robust_aggregation is refused

    def apply(self, global_weights: Arrays, updates: Sequence[Submitted]) -> dict[str, np.ndarray]:
        weights = {name: np.asarray(value, np.float32) for name, value in global_weights.items()}
        for entry in updates:  # one per step; several would be applied one after the other
            weights = fedasync_step(weights, entry.update.delta, entry.scale)
        return weights
