"""The base of asynchronous strategies (FedAsync, FedBuff): updates applied as they arrive, scaled by staleness.

Client contract: exactly the base's (:mod:`crossdc.strategies.base`) — a datacenter trains τ steps from the global
weights it was sent and replies with Δy; it cannot tell a synchronous run from an asynchronous one, except that
its ``round`` is its own task number (1, 2, 3, … per datacenter, strictly increasing) instead of a round shared
by all.

Server half (driven by :mod:`crossdc.federation.async_loop`, never by the synchronous loop): the global
model carries a version (a logical clock, 0 at the start). An accepted update computed from version v that
arrives while the global model is at version t has staleness s = t − v. If s > ``max_staleness`` it is
discarded (:meth:`AsyncStrategy.admits`); otherwise it is :meth:`AsyncStrategy.submit`-ted with its scale
from the staleness function (:mod:`crossdc.strategies.staleness`, from the base rate ``lr``). When
:meth:`AsyncStrategy.ready` says so, :meth:`AsyncStrategy.step` applies what was submitted and the version
moves to t + 1. A subclass says when a step is due (:meth:`AsyncStrategy.buffer_size`) and what it does
(:meth:`AsyncStrategy.apply`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from crossdc.strategies.base import Arrays, ClientUpdate, Parameter, RunInfo, Strategy, StrategyError
from crossdc.strategies.staleness import DEFAULT_EXPONENT, STALENESS_FUNCTIONS, staleness_scale

#: ``max_staleness`` when the config does not set it
DEFAULT_MAX_STALENESS = 16


def async_parameters(lr_default: float, lr_help: str) -> dict[str, Parameter]:
    """The parameters every asynchronous strategy takes (its base rate `lr` with its own default and help)."""
    return {
        "lr": Parameter(float, lr_default, lr_help, low=0.0),
        "max_staleness": Parameter(int, DEFAULT_MAX_STALENESS, "updates staler than this many versions are discarded "
                                   "(0: none; a datacenter whose update waits in a buffer then waits for the next version)",
                                   low=0),
        "staleness": Parameter(str, "inverse", "scale of an update with staleness s: inverse lr/(1+s), hinge, constant, "
                               "polynomial lr·(1+s)^-a", choices=STALENESS_FUNCTIONS),
        "staleness_exponent": Parameter(float, DEFAULT_EXPONENT, "a of the polynomial staleness function", low=1e-6),
        "hinge_after": Parameter(int, 0, "b of the hinge staleness function: full scale up to staleness b", low=0),
    }


@dataclass(frozen=True)
class Submitted:
    """One accepted update waiting for (or taken by) a server step: its staleness and the scale it is applied with.

    `seq` (arrival order) and `base_version` are the loop's bookkeeping, carried through unchanged."""

    update: ClientUpdate
    staleness: int
    scale: float
    seq: int = 0
    base_version: int = 0


def scaled(delta: Arrays, scale: float) -> dict[str, np.ndarray]:
    """scale · Δ per tensor, in float32 (scale 1.0 leaves every value exactly as it was)."""
    return {name: (np.asarray(value, np.float32) * np.float32(scale)).astype(np.float32) for name, value in delta.items()}


class AsyncStrategy(Strategy):
    """Base of asynchronous strategies (see the module docstring), driven by the ``async`` loop; not a strategy of its own."""

    loop = "async"
    parameters = async_parameters(1.0, "base rate of the staleness function")

    def setup(self) -> None:
        super().setup()
        self.submitted: list[Submitted] = []

    @property
    def max_staleness(self) -> int:
        return int(self.params["max_staleness"])

    def buffer_size(self) -> int:
        """K: accepted updates per server step (1 unless a subclass buffers)."""
        return 1

    def scale(self, staleness: int) -> float:
        """The scale an update of this staleness is applied with (the configured staleness function)."""
        p = self.params
        return staleness_scale(p["staleness"], staleness, float(p["lr"]), float(p["staleness_exponent"]), int(p["hinge_after"]))

    def admits(self, staleness: int) -> bool:
        """Whether an update this stale may be applied (0 ≤ staleness ≤ max_staleness)."""
        return 0 <= staleness <= self.max_staleness

    def submit(self, update: ClientUpdate, staleness: int, seq: int = 0, base_version: int = 0) -> Submitted:
        """Queue an admitted update for the next server step; StrategyError if it is too stale."""
        if not self.admits(staleness):
            raise StrategyError(f"strategy '{self.name}': an update with staleness {staleness} exceeds "
                                f"max_staleness = {self.max_staleness}; discard it instead")
        entry = Submitted(update, staleness, self.scale(staleness), seq, base_version)
        self.submitted.append(entry)
        return entry

    def waiting(self, datacenter: str) -> bool:
        """Whether an update of `datacenter` waits for the next server step."""
        return any(s.update.datacenter == datacenter for s in self.submitted)

    def ready(self) -> bool:
        """Whether a server step is due (K updates submitted)."""
        return len(self.submitted) >= self.buffer_size()

    def step(self, global_weights: Arrays) -> tuple[dict[str, np.ndarray], list[Submitted]]:
        """Apply every submitted update: (the next version's weights, what was applied, in the order applied)."""
        if not self.submitted:
            raise StrategyError(f"strategy '{self.name}': a server step needs at least one submitted update")
        order = {name: i for i, name in enumerate(self.run.datacenters if self.run else ())}
        taken = sorted(self.submitted, key=lambda s: (order.get(s.update.datacenter, len(order)), s.seq))
        self.submitted = []
        return self.apply(global_weights, taken), taken

    def apply(self, global_weights: Arrays, updates: Sequence[Submitted]) -> dict[str, np.ndarray]:
        """The next version's weights from the current ones and the updates of one step (a subclass's maths)."""
        raise NotImplementedError

    def aggregate(self, server_round: int, global_weights: Arrays, updates: Sequence[ClientUpdate],
                  mean: Arrays) -> dict[str, np.ndarray]:
        raise StrategyError(f"strategy '{self.name}' is asynchronous: the asynchronous loop drives it, not rounds")

    def check_run(self, run: RunInfo) -> None:
        super().check_run(run)
        if self.buffer_size() < 1:
            raise StrategyError(f"strategy '{self.name}': the buffer size must be ≥ 1, got {self.buffer_size()}")
