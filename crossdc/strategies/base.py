"""The one base of every crossdc strategy: server half, datacenter half, and the contract between them.

Client contract (what every strategy built on this base relies on):

- **Down.** The server sends each datacenter a train message holding the
  current global weights x (packed by :func:`crossdc.protocol.encode_tensors`:
  records ``arrays`` and ``layout``), the strategy's extra tensor groups from
  :meth:`Strategy.client_arrays` (each under its own named record, e.g.
  ``control`` = SCAFFOLD's server control variate c), and a config record with
  at least ``round``, ``tau`` (local optimizer steps to run) and
  ``crossdc-run-id``, plus the strategy's own entries from
  :meth:`Strategy.client_config`.
- **Local work.** The datacenter loads x, runs exactly ``tau`` steps of its
  inner optimizer on its own data — with the strategy's local hooks from
  :meth:`Strategy.local_hooks` (a term added to every step's loss, a
  correction of every step's gradients) — and keeps the strategy's
  per-datacenter state (:attr:`Strategy.client_state_key`) in its durable
  state store, written once per round by local rank 0.
- **Up.** It replies with its **update** Δy = y − x (packed the same way,
  same names and shapes as sent), every tensor group the strategy lists in
  :attr:`Strategy.reply_groups` (same names and shapes as the weights; a
  missing one makes the reply rejected, never silently zero), and a metrics
  record with ``num-examples`` (examples seen in those steps), ``train-loss``
  and ``compute-s``.

The base owns what every strategy shares: the τ schedule, the
example-weighted mean of the updates (:meth:`Strategy.mean_update`; a
coordinate-wise median or trimmed mean instead when the run sets
``[security] robust_aggregation``, see :meth:`Strategy.use_robust_aggregation`),
the plain "x + mean Δy" step, per-round metrics for the run log, and the
checkpoint hooks. A strategy overrides only
what differs (FedProx: the local loss; SCAFFOLD: local gradients, reply and
server state; DiLoCo: the server's outer step).

Both halves of a strategy live in one class, built from the same config on
the server (``aggregate`` …) and in every datacenter's trainer (``local_*``).
The datacenter half never keeps anything in memory between rounds: what must
outlive a round goes to the state store, so a SuperNode or trainer restart
loses nothing.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from crossdc.parameters import Parameter, ParameterError, check_parameters
from crossdc.strategies.aggregation import add
from crossdc.strategies.robust import DEFAULT_TRIM_FRACTION, check_robust_aggregation, robust_mean
from crossdc.strategies.schedule import tau_for_round

if TYPE_CHECKING:
    import torch

Arrays = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ClientUpdate:
    """One datacenter's accepted reply for one round: Δy, its extra tensor groups (``reply_groups``), its metrics."""

    datacenter: str
    delta: Mapping[str, np.ndarray]
    num_examples: int
    metrics: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)

    def group(self, name: str) -> Mapping[str, np.ndarray]:
        """The reply's tensor group `name`; StrategyError if the reply does not carry it (never an empty default)."""
        if name not in self.extras:
            raise StrategyError(f"the update of datacenter '{self.datacenter}' has no tensor group '{name}'")
        return self.extras[name]


class StrategyError(ValueError):
    """A strategy was configured with bad parameters, or a reply breaks its contract."""


@dataclass(frozen=True)
class RunInfo:
    """What a strategy may check and use about the run it serves (both halves get the same)."""

    datacenters: tuple[str, ...]
    optimizer: str  # the inner optimizer's name (workload.optimizer)
    lr: float  # the inner optimizer's learning rate η_l


@dataclass(frozen=True)
class LocalContext:
    """One datacenter's round, as its trainer (local rank 0) sees it."""

    datacenter: str
    server_round: int
    tau: int
    lr: float
    parameter_names: frozenset[str]  # trainable tensors; the others (buffers) get no gradient
    state_round: int = 0  # the round the stored strategy state belongs to (0: none stored yet)


@dataclass
class LocalHooks:
    """What every local rank does in each optimizer step, on top of the plain loss.

    `extra_loss(model)` is added to the step's loss before backward; `after_backward(model)` runs after the
    gradients are complete (with W > 1 ranks: after DistributedDataParallel averaged them) and before the step.
    """

    extra_loss: Callable[["torch.nn.Module"], "torch.Tensor"] | None = None
    after_backward: Callable[["torch.nn.Module"], None] | None = None


@dataclass
class LocalResult:
    """What local rank 0 adds to its reply after the τ steps, and the state it stores for the next round."""

    extras: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # tensor groups, by record name
    state: Any = None  # written to the state store under client_state_key (if the strategy has one)
    metrics: dict[str, float] = field(default_factory=dict)


class Strategy(ABC):
    """Base of all crossdc strategies (see the module docstring for the client contract).

    Defaults: FedAvg on both halves — plain local steps, no state, x ← x + example-weighted mean Δy.
    """

    name: ClassVar[str]
    #: parameter name → its declaration; checked before a run starts, shown by `crossdc strategies list`.
    parameters: ClassVar[dict[str, Parameter]] = {}
    #: tensor groups (record names) every reply must carry besides the update; a reply without one is rejected.
    reply_groups: ClassVar[tuple[str, ...]] = ()
    #: the state-store key of the datacenter half's state (None: it keeps none beyond the trainer's own).
    client_state_key: ClassVar[str | None] = None
    #: how :meth:`mean_update` combines the updates (set by :meth:`use_robust_aggregation`; server half only)
    robust_aggregation: str = "none"
    trim_fraction: float = DEFAULT_TRIM_FRACTION

    def __init__(self, tau_start: int, tau_end: int, warmup_rounds: int, tau_kind: str = "linear", params: Mapping[str, Any] | None = None) -> None:
        try:
            self.params: dict[str, Any] = check_parameters(f"strategy '{self.name}'", self.parameters, dict(params or {}))
        except ParameterError as err:
            raise StrategyError(str(err)) from None
        self.tau_start, self.tau_end, self.warmup_rounds, self.tau_kind = tau_start, tau_end, warmup_rounds, tau_kind
        tau_for_round(1, tau_start, tau_end, warmup_rounds, tau_kind)  # validates the schedule now, not mid-run
        self.run: RunInfo | None = None

    def bind(self, run: RunInfo) -> None:
        """Check the strategy fits the run (raise StrategyError naming the strategy and the key) and remember it.

        Called before any process starts (`crossdc run`), and again in every trainer. Override to add checks,
        calling ``super().bind(run)``.
        """
        self.run = run

    @property
    def num_datacenters(self) -> int:
        """N, the number of configured datacenters (needs :meth:`bind`)."""
        if self.run is None:
            raise StrategyError(f"strategy '{self.name}' is not bound to a run yet (call bind first)")
        return len(self.run.datacenters)

    # -- server half -----------------------------------------------------------------------

    def tau(self, server_round: int) -> int:
        """Local optimizer steps each datacenter runs in this round."""
        return tau_for_round(server_round, self.tau_start, self.tau_end, self.warmup_rounds, self.tau_kind)

    def client_config(self, server_round: int) -> dict[str, int | float | str | bool]:
        """Extra entries for the train message's config record (none by default)."""
        return {}

    def client_arrays(self, server_round: int, global_weights: Arrays) -> dict[str, dict[str, np.ndarray]]:
        """Extra tensor groups for the train message, by record name (none by default)."""
        return {}

    def use_robust_aggregation(self, kind: str, trim_fraction: float = DEFAULT_TRIM_FRACTION) -> None:
        """Make :meth:`mean_update` the robust aggregate `kind` (``[security] robust_aggregation``: ``none``,
        ``median`` or ``trimmed_mean`` with `trim_fraction`; see :func:`crossdc.strategies.robust.robust_mean`).
        Set once after construction (:func:`crossdc.experiment.builders.build_strategy`); StrategyError if unknown."""
        try:
            check_robust_aggregation(kind, trim_fraction)
        except ValueError as err:
            raise StrategyError(f"strategy '{self.name}': {err}") from None
        self.robust_aggregation, self.trim_fraction = kind, trim_fraction

    def mean_update(self, updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
        """The aggregate of the accepted updates Δy: their example-weighted mean, or the robust aggregate the run
        asked for (:meth:`use_robust_aggregation`). Every strategy's server step goes through it."""
        return robust_mean([u.delta for u in updates], [u.num_examples for u in updates], self.robust_aggregation,
                           self.trim_fraction)

    def aggregate(self, server_round: int, global_weights: Arrays, updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
        """New global weights from the accepted updates (default: x + mean Δy)."""
        return add(global_weights, self.mean_update(updates))

    def round_metrics(self, server_round: int, updates: Sequence[ClientUpdate]) -> dict[str, Any]:
        """JSON-able numbers about this round's aggregation, for the run log (an event); none by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Server-side state to checkpoint (none by default)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    # -- datacenter half (runs in the datacenter's trainer) ------------------------------------

    def local_plan(self, context: LocalContext, global_weights: Arrays, received: Mapping[str, Arrays],
                   state: Any) -> dict[str, Any]:
        """Local rank 0, before the steps: what every rank needs to build its hooks (picklable; broadcast to the
        other ranks). `received` holds the message's extra tensor groups, `state` the stored strategy state (None
        if none yet). Nothing by default."""
        return {}

    def local_hooks(self, plan: Mapping[str, Any], global_weights: Arrays, model: "torch.nn.Module") -> LocalHooks:
        """Every local rank: the hooks of this round's steps, built from the plan (none by default)."""
        return LocalHooks()

    def local_finish(self, context: LocalContext, global_weights: Arrays, local_weights: Arrays,
                     received: Mapping[str, Arrays], state: Any) -> LocalResult:
        """Local rank 0, after the steps: extra tensor groups for the reply and the state to store (none by default)."""
        return LocalResult()
