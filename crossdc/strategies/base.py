"""The one base of every crossdc strategy.

Client contract (what every strategy built on this base relies on):

- The server sends each datacenter a train message holding the current global
  weights (packed by :func:`crossdc.compression.payload.encode_tensors`: records
  ``arrays`` and ``layout``) and a config record with at least ``round``,
  ``tau`` (local optimizer steps to run) and ``crossdc-run-id``; a strategy
  may add its own entries through :meth:`Strategy.client_config`.
- The datacenter loads the global weights, runs exactly ``tau`` optimizer
  steps of its inner optimizer on its own data, and replies with its
  **update** ``w_local − w_global`` (packed the same way, same names and shapes
  as sent) and a metrics record with ``num-examples`` (examples seen in
  those steps), ``train-loss`` and ``compute-s``.

The base owns what every strategy shares: the τ schedule and the
example-weighted mean of the updates. A strategy overrides only what differs.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from crossdc.strategies.aggregation import add, weighted_average
from crossdc.strategies.schedule import tau_for_round


@dataclass(frozen=True)
class ClientUpdate:
    """One datacenter's accepted reply for one round."""

    datacenter: str
    delta: Mapping[str, np.ndarray]
    num_examples: int
    metrics: Mapping[str, float] = field(default_factory=dict)


class StrategyError(ValueError):
    """A strategy was configured with bad parameters."""


@dataclass(frozen=True)
class Parameter:
    """One configurable parameter of a strategy (``[strategy] params`` in the config).

    `kind` is the Python type a value must have (``float`` also takes an ``int``; ``bool`` is never a number);
    `low`/`high` bound numbers (inclusive) where given.
    """

    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None

    def check(self, strategy: str, name: str, value: Any) -> Any:
        """`value` converted to `kind`, or StrategyError naming the strategy and the parameter."""
        where = f"strategy '{strategy}' parameter '{name}'"
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            raise StrategyError(f"{where} must be {self.kind.__name__}, got {type(value).__name__} {value!r}")
        if isinstance(value, float) and value != value:
            raise StrategyError(f"{where} must be a number, got NaN")
        if self.low is not None and value < self.low:
            raise StrategyError(f"{where} must be ≥ {self.low:g}, got {value!r}")
        if self.high is not None and value > self.high:
            raise StrategyError(f"{where} must be ≤ {self.high:g}, got {value!r}")
        return value

    def describe(self) -> dict[str, Any]:
        """JSON-able description (CLI and API)."""
        return {"type": self.kind.__name__, "default": self.default, "help": self.help, "low": self.low, "high": self.high}


class Strategy(ABC):
    """Base of all crossdc strategies (see the module docstring for the client contract)."""

    name: ClassVar[str]
    #: parameter name → its declaration; checked before a run starts, shown by `crossdc strategies list`.
    parameters: ClassVar[dict[str, Parameter]] = {}

    def __init__(self, tau_start: int, tau_end: int, warmup_rounds: int, tau_kind: str = "linear", params: Mapping[str, Any] | None = None) -> None:
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.parameters))
        if unknown:
            known = ", ".join(sorted(self.parameters)) or "none"
            raise StrategyError(f"unknown parameter '{unknown[0]}' for strategy '{self.name}'; known: {known}")
        self.params: dict[str, Any] = {key: spec.check(self.name, key, params[key]) if key in params else spec.default
                                       for key, spec in self.parameters.items()}
        self.tau_start, self.tau_end, self.warmup_rounds, self.tau_kind = tau_start, tau_end, warmup_rounds, tau_kind
        tau_for_round(1, tau_start, tau_end, warmup_rounds, tau_kind)  # validates the schedule now, not mid-run

    def tau(self, server_round: int) -> int:
        """Local optimizer steps each datacenter runs in this round."""
        return tau_for_round(server_round, self.tau_start, self.tau_end, self.warmup_rounds, self.tau_kind)

    def client_config(self, server_round: int) -> dict[str, int | float | str | bool]:
        """Extra entries for the train message's config record (none by default)."""
        return {}

    def mean_update(self, updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
        """The example-weighted mean of the accepted updates."""
        return weighted_average([u.delta for u in updates], [u.num_examples for u in updates])

    def aggregate(self, server_round: int, global_weights: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
        """New global weights from the accepted updates (default: w + mean update)."""
        return add(global_weights, self.mean_update(updates))

    def state_dict(self) -> dict[str, Any]:
        """Server-side state to checkpoint (none by default)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
