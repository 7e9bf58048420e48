"""The one base of every crossdc strategy: server half, datacenter half, and the contract between them.

Client contract (what every strategy built on this base relies on):

- **Down.** The server sends each datacenter a train message holding the
  current global weights x (packed by :func:`crossdc.protocol.encode_tensors`:
  records ``arrays`` and ``layout``), the strategy's extra tensor groups from
  :meth:`Strategy.client_arrays` (each under its own named record, declared in
  :attr:`Strategy.client_groups`, e.g. ``control`` = SCAFFOLD's server control
  variate c), and a config record with at least ``round``, ``tau`` (local
  optimizer steps to run) and ``crossdc-run-id``, plus the strategy's own
  entries from :meth:`Strategy.client_config`.
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

No tensor group of a strategy (down or up) may take a record name of the
protocol (:data:`crossdc.protocol.RESERVED_RECORDS`, or a group's layout record
``<group>-layout``): a class that declares one is refused when it is defined.

The base owns what every strategy shares: the τ schedule, the
example-weighted mean of the updates (:meth:`Strategy.mean_update`; a
coordinate-wise median or trimmed mean instead when the run sets
``[security] robust_aggregation``, the constructor's ``robust_aggregation``),
which the round loop computes once per round and hands to
:meth:`Strategy.aggregate` as ``mean``; the plain "x + mean" step, per-round
metrics for the run log, and the checkpoint hooks. A strategy overrides only
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
from crossdc.protocol import RESERVED_RECORDS, layout_key
from crossdc.strategies.aggregation import add
from crossdc.strategies.robust import DEFAULT_TRIM_FRACTION, check_robust_aggregation, robust_mean
from crossdc.strategies.schedule import TauSchedule

if TYPE_CHECKING:
    import torch

Arrays = Mapping[str, np.ndarray]

#: the loops that can drive a strategy (:attr:`Strategy.loop`): ``sync`` — rounds, every datacenter trains from the
#: same global weights and one aggregate ends the round (crossdc.federation.sync_loop); ``async`` — updates applied as
#: they arrive, scaled by staleness (crossdc.federation.async_loop, :class:`crossdc.strategies.asynchronous.AsyncStrategy`);
#: ``streaming`` — the model synced fragment by fragment while the datacenters keep training
#: (:class:`crossdc.strategies.streaming_diloco.StreamingDiLoCo`); ``gossip`` — every datacenter its own replica, mixed
#: with its neighbours', no server step (:class:`crossdc.strategies.gossip.Gossip`); ``pipeline`` — one model's blocks
#: split across the datacenters in order (:class:`crossdc.strategies.pipeline.Pipeline`; its loop is not built yet)
LOOPS: tuple[str, ...] = ("sync", "async", "streaming", "gossip", "pipeline")


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
    seed: int = 0  # the run's seed (run.seed)
    #: the round-trip time between each pair of datacenters (a pair's direct link, else the two links through the
    #: coordinator), keyed by the pair in config order; empty where the links are not known
    rtt_ms: Mapping[tuple[str, str], float] = field(default_factory=dict)
    codecs: tuple[str, ...] = ()  # the uplink codec pipeline ([compression] codecs)
    batch_size: int = 1  # the inner steps' batch size (workload.batch_size)
    grad_clip: float | None = None  # the inner steps' bound on the gradient's global norm (workload.grad_clip)
    rounds: int = 0  # the rounds planned (run.rounds; 0: not known), the horizon of an outer learning-rate schedule


@dataclass(frozen=True)
class LocalContext:
    """One datacenter's round, as its trainer (local rank 0) sees it."""

    datacenter: str
    server_round: int
    tau: int
    lr: float  # the mean inner learning rate of this round's τ steps (the base lr unless a schedule moves it)
    parameter_names: frozenset[str]  # trainable tensors; the others (buffers) get no gradient
    state_round: int = 0  # the round the stored strategy state belongs to (0: none stored yet)


@dataclass
class LocalHooks:
    """What every local rank does in each optimizer step, on top of the plain loss.

    `extra_loss(model)` is added to the step's loss before backward; `after_backward(model)` runs after the
    gradients are complete (with W > 1 ranks: after DistributedDataParallel averaged them) and before the step.
    """

    extra_loss: Callable[[torch.nn.Module], torch.Tensor] | None = None
    after_backward: Callable[[torch.nn.Module], None] | None = None


@dataclass
class LocalResult:
    """What local rank 0 adds to its reply after the τ steps, and the state it stores for the next round."""

    extras: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # tensor groups, by record name
    state: Any = None  # written to the state store under client_state_key (if the strategy has one)
    metrics: dict[str, float] = field(default_factory=dict)


class Strategy(ABC):
    """Base of all crossdc strategies (see the module docstring for the client contract).

    Defaults: FedAvg on both halves — plain local steps, no state, x ← x + example-weighted mean Δy.

    Built by keyword, in one step (:func:`crossdc.experiment.builders.build_strategy` does it from a config)::

        Strategy(tau=TauSchedule(1, 50, 5), params={...}, run=RunInfo(...), robust_aggregation="median")

    A subclass declares what it is in class attributes (``name``, ``loop``, ``parameters``, ``client_groups``,
    ``reply_groups``, ``client_state_key``, ``combines_updates``) and overrides only the hooks that differ:

    - :meth:`check_run` — refuse a run it cannot serve (e.g. the wrong inner optimizer);
    - :meth:`setup` — create its server state (or give it class-level defaults instead);
    - server half: :meth:`client_config`, :meth:`client_arrays`, :meth:`aggregate`, :meth:`round_metrics`,
      :meth:`state_dict` / :meth:`load_state_dict`;
    - datacenter half: :meth:`local_plan`, :meth:`local_hooks`, :meth:`local_finish`.
    """

    name: ClassVar[str]
    #: the loop that drives the strategy, one of LOOPS (``sync``: rounds; ``async``: see AsyncStrategy)
    loop: ClassVar[str] = "sync"
    #: parameter name → its declaration; checked before a run starts, shown by `crossdc strategies list`.
    parameters: ClassVar[dict[str, Parameter]] = {}
    #: tensor groups (record names) :meth:`client_arrays` sends down besides the weights.
    client_groups: ClassVar[tuple[str, ...]] = ()
    #: tensor groups (record names) every reply must carry besides the update; a reply without one is rejected.
    reply_groups: ClassVar[tuple[str, ...]] = ()
    #: the state-store key of the datacenter half's state (None: it keeps none beyond the trainer's own).
    client_state_key: ClassVar[str | None] = None
    #: whether a server step combines several updates; False (one update per step, FedAsync) refuses
    #: ``[security] robust_aggregation``, which would have nothing to combine.
    combines_updates: ClassVar[bool] = True

    #: set by the constructor: the checked parameters, the τ schedule, the run (None: built without one), and how
    #: :meth:`mean_update` combines the updates (server half only)
    params: dict[str, Any]
    schedule: TauSchedule
    run: RunInfo | None
    robust_aggregation: str
    trim_fraction: float

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse, when the class is defined, an unknown loop or a tensor group that takes a protocol record name."""
        super().__init_subclass__(**kwargs)
        if cls.loop not in LOOPS:
            raise StrategyError(f"strategy class {cls.__qualname__}: unknown loop {cls.loop!r}; known: {', '.join(LOOPS)}")
        groups = (*cls.client_groups, *cls.reply_groups)
        reserved = RESERVED_RECORDS | {layout_key(group) for group in (*RESERVED_RECORDS, *groups)}
        for group in groups:
            if group in reserved:
                raise StrategyError(f"strategy class {cls.__qualname__}: tensor group '{group}' is a record name the "
                                    f"protocol reserves (reserved: {', '.join(sorted(RESERVED_RECORDS))} and every "
                                    f"'<group>-layout')")

    def __init__(self, *, tau: TauSchedule | int | None = None, params: Mapping[str, Any] | None = None,
                 run: RunInfo | None = None, robust_aggregation: str = "none",
                 trim_fraction: float = DEFAULT_TRIM_FRACTION) -> None:
        """Check `params` against :attr:`parameters` (defaults filled in), validate the τ schedule (`tau`: a
        TauSchedule, an int for a constant τ, None for τ = 1), check the strategy fits `run` (:meth:`check_run`;
        skipped without a run, which only the datacenter-count-free parts of a strategy tolerate), make
        :meth:`mean_update` the `robust_aggregation` (``none``, ``median``, ``trimmed_mean`` with `trim_fraction`;
        see :func:`crossdc.strategies.robust.robust_mean`), then call :meth:`setup`. Every refusal is a one-line
        StrategyError naming the strategy."""
        try:
            self.params = check_parameters(f"strategy '{self.name}'", self.parameters, dict(params or {}))
        except ParameterError as err:
            raise StrategyError(str(err)) from None
        self.schedule = TauSchedule(tau, tau) if isinstance(tau, int) else tau or TauSchedule()
        try:
            self.schedule.tau(1)  # validates the schedule now, not mid-run
            check_robust_aggregation(robust_aggregation, trim_fraction)
        except ValueError as err:
            raise StrategyError(f"strategy '{self.name}': {err}") from None
        if robust_aggregation != "none" and not self.combines_updates:
            raise StrategyError(f"strategy '{self.name}' applies one update at a time: security.robust_aggregation = "
                                f"\"{robust_aggregation}\" has nothing to combine")
        self.robust_aggregation, self.trim_fraction = robust_aggregation, trim_fraction
        self.run = run
        if run is not None:
            self.check_run(run)
        self.setup()

    def check_run(self, run: RunInfo) -> None:  # noqa: B027 (a hook: nothing by default)
        """Refuse a run this strategy cannot serve: raise StrategyError naming the strategy and the key. Nothing by
        default. Called by the constructor when it is given a run (before any process starts, `crossdc run`, and
        again in every trainer), with :attr:`params`, :attr:`schedule` and :attr:`run` already set; an override
        calls ``super().check_run(run)``."""

    def check_within_run(self, run: RunInfo, *names: str) -> None:
        """StrategyError for any of the parameters `names` this strategy has (counts of rounds, such as a warm-up's)
        that is longer than the run's rounds; nothing when the run's length is not known."""
        for name in names:
            if name in self.params and run.rounds and int(self.params[name]) > run.rounds:
                raise StrategyError(f"strategy '{self.name}': {name} ({self.params[name]}) is longer than the run "
                                    f"({run.rounds} rounds)")

    def setup(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """Create the strategy's own state; called last by the constructor, with :attr:`params`, :attr:`schedule`,
        :attr:`run` and the robust aggregation set. Nothing by default (state may also be a class-level default,
        e.g. ``velocity = None``, replaced rather than mutated); an override calls ``super().setup()``."""

    @property
    def num_datacenters(self) -> int:
        """N, the number of configured datacenters (needs a run)."""
        if self.run is None:
            raise StrategyError(f"strategy '{self.name}' was built without a run (pass run=RunInfo(...))")
        return len(self.run.datacenters)

    # -- server half -----------------------------------------------------------------------

    def tau(self, server_round: int) -> int:
        """Local optimizer steps each datacenter runs in this round (from :attr:`schedule`)."""
        return self.schedule.tau(server_round)

    def client_config(self, server_round: int) -> dict[str, int | float | str | bool]:
        """Extra entries for the train message's config record (none by default)."""
        return {}

    def client_arrays(self, server_round: int, global_weights: Arrays) -> dict[str, dict[str, np.ndarray]]:
        """Extra tensor groups for the train message, by record name, one per :attr:`client_groups` (none by default)."""
        return {}

    def mean_update(self, updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
        """The aggregate of the accepted updates Δy: their example-weighted mean, or the robust aggregate the run
        asked for (the constructor's `robust_aggregation`). The round loop calls it once per round and hands the
        result to :meth:`aggregate`; an asynchronous strategy's step calls it on what it applies."""
        return robust_mean([u.delta for u in updates], [u.num_examples for u in updates], self.robust_aggregation,
                           self.trim_fraction)

    def aggregate(self, server_round: int, global_weights: Arrays, updates: Sequence[ClientUpdate],
                  mean: Arrays) -> dict[str, np.ndarray]:
        """New global weights from this round's accepted updates; `mean` is their aggregate, computed once by the
        loop as :meth:`mean_update` (``updates``). Default: x + mean."""
        return add(global_weights, mean)

    def round_metrics(self, server_round: int, updates: Sequence[ClientUpdate]) -> dict[str, Any]:
        """JSON-able numbers about this round's aggregation, for the run log (an event); none by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Server-side state to checkpoint (none by default)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (a hook: nothing by default)
        """Restore what :meth:`state_dict` returned."""

    # -- datacenter half (runs in the datacenter's trainer) ------------------------------------

    def local_plan(self, context: LocalContext, global_weights: Arrays, received: Mapping[str, Arrays],
                   state: Any) -> dict[str, Any]:
        """Local rank 0, before the steps: what every rank needs to build its hooks (picklable; broadcast to the
        other ranks). `received` holds the message's extra tensor groups, `state` the stored strategy state (None
        if none yet). Nothing by default."""
        return {}

    def local_hooks(self, plan: Mapping[str, Any], global_weights: Arrays, model: torch.nn.Module) -> LocalHooks:
        """Every local rank: the hooks of this round's steps, built from the plan (none by default)."""
        return LocalHooks()

    def local_finish(self, context: LocalContext, global_weights: Arrays, local_weights: Arrays,
                     received: Mapping[str, Arrays], state: Any) -> LocalResult:
        """Local rank 0, after the steps: extra tensor groups for the reply and the state to store (none by default)."""
        return LocalResult()
