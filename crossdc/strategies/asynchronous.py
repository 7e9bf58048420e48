"""The base of asynchronous strategies (FedAsync, FedBuff): updates applied as they arrive, scaled by staleness.

Client contract: exactly the base's (:mod:`crossdc.strategies.base`) — a datacenter trains τ steps from the global
weights it was sent and replies with Δy; it cannot tell a synchronous run from an asynchronous one, except that
its ``round`` is its own task number (1, 2, 3, … per datacenter, strictly increasing) instead of a round shared
by all.

Server half (driven by :mod:`crossdc.federation.async_loop`, never by the synchronous loop): the global
model carries a version (a logical clock, 0 at the start). An accepted update computed from version v that
arrives while the global model is at version t has staleness s = t − v. If s > ``max_staleness`` it is
discarded (:meth:`AsyncStrategy.admits`); otherwise it is :meth:`AsyncStrategy.submit`-ted with its scale
from the staleness function (:mod:`crossdc.strategies.staleness`, from the base rate ``lr``). Under
``staleness_policy = "wait"`` the loop keeps that from happening instead: a datacenter is sent no new work while
that work could let a task in flight arrive staler than ``max_staleness`` (:func:`dispatch_keeps_bound`), so a
fast datacenter waits for the slow one rather than having the slow one's work thrown away. When
:meth:`AsyncStrategy.ready` says so, :meth:`AsyncStrategy.step` applies what was submitted and the version
moves to t + 1. A subclass says when a step is due (:meth:`AsyncStrategy.buffer_size`) and what it does
(:meth:`AsyncStrategy.apply`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossdc.strategies.base import Arrays, ClientUpdate, Parameter, RunInfo, Strategy, StrategyError
from crossdc.strategies.staleness import DEFAULT_EXPONENT, STALENESS_FUNCTIONS, staleness_scale

#: ``max_staleness`` when the config does not set it
DEFAULT_MAX_STALENESS = 16
#: what keeps staleness within ``max_staleness``: discard the staler updates, or hold the datacenters running ahead
STALENESS_POLICIES: tuple[str, ...] = ("discard", "wait")


def dispatch_keeps_bound(version: int, in_flight_bases: Sequence[int], buffered: int, buffer_size: int,
                         max_staleness: int) -> bool:
    """Whether a new task sent now (from `version`) keeps every task in flight within `max_staleness` whatever order
    the replies come in.

    `in_flight_bases`: the base versions of the tasks in flight; `buffered`: updates already waiting for a server
    step; `buffer_size`: K, updates per step. The worst case for the oldest task in flight (base v₀) is that every
    other task and the new one arrive and are applied first: they and the buffer make ⌊(buffered + n)/K⌋ server
    steps (n tasks in flight: n − 1 others and the new one), so it arrives at staleness
    version + ⌊(buffered + n)/K⌋ − v₀, which must not exceed `max_staleness`. Nothing in flight: always True.
    """
    if buffer_size < 1:
        raise ValueError(f"the buffer size must be >= 1, got {buffer_size}")
    if not in_flight_bases:
        return True
    steps = (buffered + len(in_flight_bases)) // buffer_size
    return version + steps - min(in_flight_bases) <= max_staleness


def async_parameters(lr_default: float, lr_help: str) -> dict[str, Parameter]:
    """The parameters every asynchronous strategy takes (its base rate `lr` with its own default and help)."""
    return {
        "lr": Parameter(float, lr_default, lr_help, low=0.0),
        "max_staleness": Parameter(int, DEFAULT_MAX_STALENESS, "updates staler than this many versions are discarded, or "
                                   "never made under staleness_policy wait (0: none; a datacenter whose update waits in "
                                   "a buffer then waits for the next version)",
                                   low=0),
        "staleness_policy": Parameter(str, "discard", "discard: an update staler than max_staleness is dropped; wait: a "
                                      "datacenter gets no new work while it could make a task in flight that stale "
                                      "(a fast datacenter waits for the slow one)", choices=STALENESS_POLICIES),
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

    @property
    def waits_for_stragglers(self) -> bool:
        """Whether staleness is bounded by holding datacenters back (``staleness_policy = "wait"``)."""
        return self.params["staleness_policy"] == "wait"

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

    def state_dict(self) -> dict[str, Any]:
        """The buffer of updates waiting for the next server step (FedBuff's; empty right after a step)."""
        return {"submitted": list(self.submitted)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.submitted = list(state.get("submitted", []))

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
