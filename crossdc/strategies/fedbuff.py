"""FedBuff (Nguyen et al., 2022): accepted updates are buffered; every K of them make one server step.

Client contract: exactly the base's (:mod:`crossdc.strategies.base`); see :mod:`crossdc.strategies.asynchronous`
for the server's clock and the staleness bound.

Server: each accepted update Δ_k (staleness s_k ≤ ``max_staleness``) is scaled by the staleness function of
``lr`` (default ``inverse``: lr / (1 + s_k)) and buffered; when K = ``buffer_size`` are in (0 = the number of
datacenters), x ← x + mean_k(scale_k · Δ_k), the mean weighted by examples like FedAvg's (the run's
``[security] robust_aggregation`` if it asks for a median or trimmed mean), and the buffer empties. A fast
datacenter may put several updates into one buffer; a datacenter keeps training while its update waits (unless
``max_staleness = 0``, see crossdc.federation.async_loop). With K = number of datacenters, equal speeds,
``max_staleness = 0`` and lr = 1 every step is one update from every datacenter, all from the current version:
exactly synchronous FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crossdc.strategies.aggregation import add, weighted_average
from crossdc.strategies.asynchronous import AsyncStrategy, Submitted, async_parameters, scaled
from crossdc.strategies.base import Arrays, ClientUpdate, Parameter, RunInfo, StrategyError


def fedbuff_step(global_weights: Arrays, deltas: Sequence[Arrays], scales: Sequence[float],
                 num_examples: Sequence[int]) -> dict[str, np.ndarray]:
    """FedBuff's server update as a pure function: x + Σ_k n_k·(scale_k·Δ_k) / Σ_k n_k (float32)."""
    return add(global_weights, weighted_average([scaled(d, s) for d, s in zip(deltas, scales, strict=True)], num_examples))


class FedBuff(AsyncStrategy):
    """Asynchronous, buffered: every K accepted updates (each × lr/(1+s)) are averaged into one server step."""

    name = "fedbuff"
    parameters = {
        **async_parameters(1.0, "server learning rate η_g: the buffer's mean update is applied × η_g (staleness 0)"),
        "buffer_size": Parameter(int, 0, "K: accepted updates per server step (0 = the number of datacenters)", low=0),
    }

    def buffer_size(self) -> int:
        k = int(self.params["buffer_size"])
        return k if k > 0 else self.num_datacenters

    def check_run(self, run: RunInfo) -> None:
        super().check_run(run)
        if self.max_staleness == 0 and self.buffer_size() > len(run.datacenters):
            raise StrategyError(f"strategy '{self.name}': with max_staleness = 0 each datacenter puts at most one update "
                                f"into a buffer, so buffer_size = {self.buffer_size()} can never fill with "
                                f"{len(run.datacenters)} datacenters")

    def apply(self, global_weights: Arrays, updates: Sequence[Submitted]) -> dict[str, np.ndarray]:
        mean = self.mean_update([ClientUpdate(s.update.datacenter, scaled(s.update.delta, s.scale), s.update.num_examples)
                                 for s in updates])
        return add(global_weights, mean)
