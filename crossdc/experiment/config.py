"""The experiment config: a TOML file parsed into typed, validated dataclasses.

Promises:
- every key is checked: an unknown or misspelt key is an error naming the key
  (with a suggestion when one is close); the keys accepted are listed once, in
  :data:`CONFIG_KEYS`, which docs/configuration.md documents key by key;
- a documented key whose feature is not built yet (:data:`NOT_YET`) fails with
  "not implemented yet" instead of being silently ignored;
- every error is a :class:`ConfigError` whose message is one line;
- what a config may ask for is bounded (:data:`LIMITS`: rounds, τ, datacenters, workers, batch size, model sizes,
  codecs, faults), so parsing any config takes bounded time, checked before the work a value would cost; the
  planned inner steps are computed in closed form (:func:`inner_steps_planned`), not round by round.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.lr_schedule import LrSchedule, ScheduleError
from crossdc.strategies.robust import DEFAULT_TRIM_FRACTION, ROBUST_AGGREGATIONS
from crossdc.strategies.schedule import TauSchedule
from crossdc.workloads.options import InnerOptions


class ConfigError(ValueError):
    """A config file is malformed; the message names the key and the problem."""


_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


@dataclass(frozen=True)
class DeadlinePolicy:
    """`run.deadline = { floor_s, ceiling_s, k_mad }` of the config (window: rounds of history used)."""

    floor_s: float = 30.0
    ceiling_s: float = 3600.0
    k_mad: float = 4.0
    window: int = 20
    min_history: int = 3
    slack: float = 0.5


@dataclass(frozen=True)
class RunSection:
    name: str = "crossdc-run"
    rounds: int = 10
    seed: int = 0
    eval_every: int = 1
    min_replies: int = 0
    round_timeout_s: float = 3600.0
    #: adaptive round deadline (`run.deadline`); None: the fixed `round_timeout_s`
    deadline: DeadlinePolicy | None = None
    #: keep the evaluated global model with the lowest validation loss (best-weights.npz) beside the final one
    keep_best: bool = True
    #: seconds without a heartbeat after which a datacenter is marked down (0: no heartbeat)
    heartbeat_timeout_s: float = 30.0


@dataclass(frozen=True)
class WorkloadSection:
    dataset: str = "synthetic"
    #: None: the workload's own default model (its class attribute ``default_model``), chosen where it is built
    model: str | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    partition: dict[str, Any] = field(default_factory=lambda: {"kind": "iid"})
    batch_size: int = 32
    optimizer: str = "adamw"
    lr: float = 1e-3
    precision: str = "fp32"  # "bf16": bf16 autocast in local forward passes
    #: betas, weight decay, gradient clipping and the learning-rate schedule (all default: the optimizer's own)
    options: InnerOptions = field(default_factory=InnerOptions)


@dataclass(frozen=True)
class StrategySection:
    name: str = "fedavg"
    tau: TauSchedule = field(default_factory=TauSchedule)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompressionSection:
    """What crosses the WAN: the uplink codec pipeline and the downlink one (empty: dense float32)."""

    codecs: tuple[str, ...] = ()
    downlink_codecs: tuple[str, ...] = ()


@dataclass(frozen=True)
class DatacenterSection:
    name: str
    workers: int = 1
    link: LinkSpec | None = None
    #: relative compute speed in (0, 1]: the datacenter's trainer takes 1/speed times as long per local step
    #: (emulated: it sleeps (1/speed − 1) × each measured step; see crossdc.clients.local_training.LocalTrainer)
    speed: float = 1.0
    region: str | None = None


@dataclass(frozen=True)
class MeshLink:
    """A direct link between two datacenters (`[[links]]`), described like a datacenter's own link to the
    coordinator (its star link). A pair of datacenters not listed is routed through the coordinator: its one-way
    delays add, and its bandwidth is the smaller of the two star links'."""

    between: tuple[str, str]
    link: LinkSpec


@dataclass(frozen=True)
class LinkFault:
    """A fault injected on one link: a datacenter's link to the coordinator (`datacenter`) or a
    datacenter-to-datacenter link of `[[links]]` (`between`, the pair in the order that `[[links]]` gives it);
    exactly one of the two is set. It acts once `after_round` rounds are logged, or `after_s` seconds after the
    run started (for modes without rounds); exactly one of the two is set. It cuts the link for `cut_s` seconds
    (kind "cut"), or resets its open connections (kind "reset")."""

    datacenter: str | None = None
    between: tuple[str, str] | None = None
    after_round: int | None = None
    after_s: float | None = None
    kind: str = "cut"
    cut_s: float = 0.0

    @property
    def target(self) -> str:
        """The link's readable name: "us-east" (a datacenter's link) or "us-east<->eu-west" (a mesh link)."""
        if self.between is not None:
            return f"{self.between[0]}<->{self.between[1]}"
        return str(self.datacenter)


@dataclass(frozen=True)
class SecuritySection:
    """The server's defences against bad updates beyond the per-reply checks (see crossdc.federation.update_gate).

    `robust_aggregation`: how the strategy combines the accepted updates ("none": example-weighted mean,
    "median", "trimmed_mean" cutting `trim_fraction` at each end; crossdc.strategies.robust);
    `norm_rejection_factor`: 0 = off, else reject an update whose norm exceeds this × the median norm of the
    round's other accepted updates; `max_update_mb`: the largest reply payload in MB (10^6 bytes), None = derived
    from the model (update_gate.update_size_limit).
    """

    robust_aggregation: str = "none"
    trim_fraction: float = DEFAULT_TRIM_FRACTION
    norm_rejection_factor: float = 0.0
    max_update_mb: float | None = None


@dataclass(frozen=True)
class CheckpointSection:
    """Server checkpoints (crossdc.federation.checkpoints): after every `every_rounds` rounds (0 = never) and after
    the last, under `dir`/<run id> (a directory or any fsspec URL), keeping the newest `keep` (0 = all)."""

    every_rounds: int = 0
    dir: str = "checkpoints/"
    keep: int = 3


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment, validated. `raw` keeps the parsed TOML for the run log."""

    run: RunSection
    workload: WorkloadSection
    strategy: StrategySection
    datacenters: tuple[DatacenterSection, ...]
    link_faults: tuple[LinkFault, ...] = ()
    #: direct datacenter-to-datacenter links (`[[links]]`); a pair not listed goes through the coordinator
    links: tuple[MeshLink, ...] = ()
    compression: CompressionSection = field(default_factory=CompressionSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def datacenter_names(self) -> list[str]:
        return [dc.name for dc in self.datacenters]

    def mesh_link(self, a: str, b: str) -> MeshLink | None:
        """The direct link between datacenters `a` and `b` (in either order), or None: they talk through the
        coordinator. One dictionary look-up (a run's every pair asks)."""
        return self._mesh_links.get(frozenset((a, b)))

    @functools.cached_property
    def _mesh_links(self) -> dict[frozenset[str], MeshLink]:
        """`links` by their pair of datacenters (built once, on first use)."""
        return {frozenset(mesh.between): mesh for mesh in self.links}

    def to_json(self) -> str:
        return json.dumps(self.raw, sort_keys=True)


#: the numbers of a link, in a datacenter's link table and in each [[links]] table
_LINK_KEYS = frozenset({"profile", "bandwidth_mbps", "rtt_ms", "jitter_ms", "loss"})

#: Every key the parser accepts, by table: the one list, used by the parser's own key checks (an unknown key is an
#: error naming it) and by the configuration reference (docs/configuration.md, kept in step by
#: tests/test_config_reference.py). "" is the document's top level; "datacenters", "links" and "link_faults" are the
#: keys of each [[datacenters]] / [[links]] / [[link_faults]] table; "datacenters.link" those of a link given as a table;
#: "run.deadline", "workload.partition" and "strategy.tau" those of the inline tables of that name.
CONFIG_KEYS: dict[str, frozenset[str]] = {
    "": frozenset({"run", "workload", "strategy", "datacenters", "links", "link_faults", "compression", "security",
                   "checkpoint"}),
    "run": frozenset({"name", "rounds", "seed", "eval_every", "min_replies", "round_timeout_s", "deadline",
                      "keep_best", "heartbeat_timeout_s"}),
    "run.deadline": frozenset({"floor_s", "ceiling_s", "k_mad", "window", "min_history"}),
    "workload": frozenset({"dataset", "model", "model_args", "partition", "batch_size", "optimizer", "lr", "precision",
                           "betas", "weight_decay", "grad_clip", "schedule"}),
    "workload.partition": frozenset({"kind", "alpha"}),
    "workload.schedule": frozenset({"kind", "warmup_steps", "min_lr"}),
    "strategy": frozenset({"name", "tau", "params"}),
    "strategy.tau": frozenset({"start", "end", "warmup_rounds", "kind"}),
    "datacenters": frozenset({"name", "workers", "link", "speed", "region"}),
    "datacenters.link": _LINK_KEYS,
    "links": _LINK_KEYS | {"between"},
    "link_faults": frozenset({"datacenter", "between", "after_round", "after_s", "kind", "cut_s"}),
    "compression": frozenset({"codecs", "downlink_codecs"}),
    "security": frozenset({"robust_aggregation", "trim_fraction", "norm_rejection_factor", "max_update_mb"}),
    "checkpoint": frozenset({"every_rounds", "dir", "keep"}),
}

#: The most a config may ask for, by documented key (inclusive): generous for every shipped example, benchmark and
#: demo, and finite, so that one submitted config cannot make the service, or a run's coordinator, work without end
#: (docs/configuration.md#limits). "strategy.tau" bounds the integer τ and a schedule's start and end;
#: "datacenters" the number of [[datacenters]] tables; "workload.model_args" each value of the table, and
#: "workload.model_args.layers" its `layers`; "compression.codecs" the length of each codec list (up and down);
#: "link_faults" the number of [[link_faults]] tables.
LIMITS: dict[str, int] = {
    "run.rounds": 1_000_000,
    "strategy.tau": 1_000_000,
    "strategy.tau.warmup_rounds": 100_000,
    "datacenters": 256,
    "datacenters.workers": 1_024,
    "workload.batch_size": 1_048_576,
    "workload.model_args": 65_536,
    "workload.model_args.layers": 1_024,
    "compression.codecs": 16,
    "link_faults": 1_000,
}

#: Keys of the documented format whose feature belongs to later work, by table, with their neutral value: they are
#: in CONFIG_KEYS (so they are documented), and any other value fails with "not implemented yet". None at present.
NOT_YET: dict[str, dict[str, Any]] = {}


def _check_keys(table: dict[str, Any], name: str, where: str) -> None:
    """Refuse a key of `table` (the config's table `name`, a key of CONFIG_KEYS, spelt `where` in messages) that
    the parser does not accept, and a not-yet-built key set to anything but its neutral value."""
    allowed = CONFIG_KEYS[name]
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            known = ", ".join(sorted(allowed))
            raise ConfigError(f"unknown key '{where}{key}'{hint}; known keys here: {known}")
    for key, neutral in NOT_YET.get(name, {}).items():
        if key in table and table[key] != neutral:
            raise ConfigError(f"'{where}{key}' is not implemented yet")


def _table(doc: dict[str, Any], name: str, required: bool) -> dict[str, Any]:
    if name not in doc:
        if required:
            raise ConfigError(f"missing section [{name}]")
        return {}
    value = doc[name]
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table")
    return value


def _typed(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = dataclasses.MISSING) -> Any:
    if key not in table:
        if default is dataclasses.MISSING:
            raise ConfigError(f"missing key '{where}{key}'")
        return default
    value = table[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"'{where}{key}' must be {_kind_name(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise ConfigError(f"'{where}{key}' must be {_kind_name(kinds)}, got {value!r}")
    return value


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", dict: "a table", list: "a list", bool: "true/false"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _positive(value: float, key: str, allow_zero: bool = False) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"'{key}' must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"'{key}' must be {'≥ 0' if allow_zero else '> 0'}, got {value!r}")


def _at_most(value: int, key: str, limit: str | None = None) -> None:
    """Refuse `value` of the config key `key` above its bound LIMITS[`limit` or `key`]."""
    most = LIMITS[limit or key]
    if value > most:
        raise ConfigError(f"'{key}' must be ≤ {most} (the most a config may ask for), got {value}")


def _parse_run(doc: dict[str, Any]) -> RunSection:
    t = _table(doc, "run", required=True)
    _check_keys(t, "run", "run.")
    name = _typed(t, "name", str, "run.", "crossdc-run")
    rounds = _typed(t, "rounds", int, "run.")
    _positive(rounds, "run.rounds")
    _at_most(rounds, "run.rounds")
    seed = _typed(t, "seed", int, "run.", 0)
    eval_every = _typed(t, "eval_every", int, "run.", 1)
    _positive(eval_every, "run.eval_every")
    min_replies = _typed(t, "min_replies", int, "run.", 0)
    _positive(min_replies, "run.min_replies", allow_zero=True)
    timeout = _typed(t, "round_timeout_s", float, "run.", 3600.0)
    _positive(timeout, "run.round_timeout_s")
    keep_best = _typed(t, "keep_best", bool, "run.", True)
    heartbeat_timeout_s = _typed(t, "heartbeat_timeout_s", float, "run.", 30.0)
    _positive(heartbeat_timeout_s, "run.heartbeat_timeout_s", allow_zero=True)
    deadline = _parse_deadline(t["deadline"]) if "deadline" in t else None
    if deadline is not None and "round_timeout_s" in t:
        raise ConfigError("give 'run.deadline' (adaptive) or 'run.round_timeout_s' (fixed), not both")
    return RunSection(name=name, rounds=rounds, seed=seed, eval_every=eval_every, min_replies=min_replies,
                      round_timeout_s=deadline.ceiling_s if deadline else timeout, deadline=deadline,
                      keep_best=keep_best, heartbeat_timeout_s=heartbeat_timeout_s)


def _parse_deadline(value: Any) -> DeadlinePolicy:
    if not isinstance(value, dict):
        raise ConfigError("'run.deadline' must be a table: { floor_s = 30, ceiling_s = 3600, k_mad = 4 }")
    _check_keys(value, "run.deadline", "run.deadline.")
    floor = _typed(value, "floor_s", float, "run.deadline.", 30.0)
    ceiling = _typed(value, "ceiling_s", float, "run.deadline.", 3600.0)
    k_mad = _typed(value, "k_mad", float, "run.deadline.", 4.0)
    window = _typed(value, "window", int, "run.deadline.", 20)
    min_history = _typed(value, "min_history", int, "run.deadline.", 3)
    _positive(floor, "run.deadline.floor_s")
    _positive(k_mad, "run.deadline.k_mad", allow_zero=True)
    _positive(window, "run.deadline.window")
    _positive(min_history, "run.deadline.min_history")
    if not (math.isfinite(ceiling) and ceiling >= floor):
        raise ConfigError(f"'run.deadline.ceiling_s' must be ≥ floor_s ({floor:g}), got {ceiling!r}")
    if min_history > window:
        raise ConfigError(f"'run.deadline.min_history' ({min_history}) must be ≤ window ({window})")
    return DeadlinePolicy(floor_s=floor, ceiling_s=ceiling, k_mad=k_mad, window=window, min_history=min_history)


def _parse_workload(doc: dict[str, Any]) -> WorkloadSection:
    t = _table(doc, "workload", required=True)
    _check_keys(t, "workload", "workload.")
    precision = _typed(t, "precision", str, "workload.", "fp32")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"'workload.precision' must be 'fp32' or 'bf16', got {precision!r}")
    partition = _typed(t, "partition", dict, "workload.", {"kind": "iid"})
    _check_keys(partition, "workload.partition", "workload.partition.")
    if "kind" not in partition:
        raise ConfigError("missing key 'workload.partition.kind'")
    batch_size = _typed(t, "batch_size", int, "workload.", 32)
    _positive(batch_size, "workload.batch_size")
    _at_most(batch_size, "workload.batch_size")
    model_args = dict(_typed(t, "model_args", dict, "workload.", {}))
    for key, value in model_args.items():  # its type and sign are the workload's to check (it knows its keys)
        if isinstance(value, int) and not isinstance(value, bool):
            limit = "workload.model_args.layers" if key == "layers" else "workload.model_args"
            _at_most(value, f"workload.model_args.{key}", limit)
    lr = _typed(t, "lr", float, "workload.", 1e-3)
    _positive(lr, "workload.lr")
    optimizer = _typed(t, "optimizer", str, "workload.", "adamw")
    options = _parse_inner_options(t, optimizer, lr)
    return WorkloadSection(
        dataset=_typed(t, "dataset", str, "workload."),
        model=_typed(t, "model", str, "workload.", None),
        model_args=model_args,
        partition=dict(partition),
        batch_size=batch_size,
        optimizer=optimizer,
        lr=lr,
        precision=precision,
        options=options,
    )


def _parse_inner_options(t: dict[str, Any], optimizer: str, lr: float) -> InnerOptions:
    """`[workload]`'s betas, weight_decay, grad_clip and schedule (the run's length is checked in parse_config)."""
    betas = _typed(t, "betas", list, "workload.", None)
    if betas is not None:
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
            raise ConfigError(f"'workload.betas' must be two numbers [β1, β2], got {betas!r}")
        betas = tuple(float(b) for b in betas)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"'workload.betas' must each be in [0, 1), got {list(betas)!r}")
        if optimizer != "adamw":
            raise ConfigError(f"'workload.betas' applies to optimizer \"adamw\" only, not \"{optimizer}\"")
    weight_decay = _typed(t, "weight_decay", float, "workload.", None)
    if weight_decay is not None:
        _positive(weight_decay, "workload.weight_decay", allow_zero=True)
    grad_clip = _typed(t, "grad_clip", float, "workload.", None)
    if grad_clip is not None:
        _positive(grad_clip, "workload.grad_clip")
    table = _typed(t, "schedule", dict, "workload.", {})
    _check_keys(table, "workload.schedule", "workload.schedule.")
    schedule = LrSchedule(kind=_typed(table, "kind", str, "workload.schedule.", "constant"),
                          warmup_steps=_typed(table, "warmup_steps", int, "workload.schedule.", 0),
                          min_lr=_typed(table, "min_lr", float, "workload.schedule.", 0.0))
    try:
        schedule.check(lr, where="workload.schedule")
    except ScheduleError as err:
        raise ConfigError(str(err)) from None
    return InnerOptions(betas=betas, weight_decay=weight_decay, grad_clip=grad_clip, schedule=schedule)


def _parse_tau(value: Any) -> TauSchedule:
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ConfigError(f"'strategy.tau' must be > 0, got {value}")
        _at_most(value, "strategy.tau")
        return TauSchedule(start=value, end=value, warmup_rounds=0)
    if not isinstance(value, dict):
        raise ConfigError(f"'strategy.tau' must be an integer or a table {{ start, end, warmup_rounds }}, got {value!r}")
    _check_keys(value, "strategy.tau", "strategy.tau.")
    start = _typed(value, "start", int, "strategy.tau.")
    end = _typed(value, "end", int, "strategy.tau.", start)
    warmup = _typed(value, "warmup_rounds", int, "strategy.tau.", 0)
    kind = _typed(value, "kind", str, "strategy.tau.", "linear")
    _positive(start, "strategy.tau.start")
    _positive(end, "strategy.tau.end")
    _positive(warmup, "strategy.tau.warmup_rounds", allow_zero=True)
    _at_most(start, "strategy.tau.start", "strategy.tau")
    _at_most(end, "strategy.tau.end", "strategy.tau")
    _at_most(warmup, "strategy.tau.warmup_rounds")
    if kind not in ("linear", "geometric"):
        raise ConfigError(f"'strategy.tau.kind' must be 'linear' or 'geometric', got {kind!r}")
    return TauSchedule(start=start, end=end, warmup_rounds=warmup, kind=kind)


def _parse_strategy(doc: dict[str, Any]) -> StrategySection:
    t = _table(doc, "strategy", required=True)
    _check_keys(t, "strategy", "strategy.")
    return StrategySection(
        name=_typed(t, "name", str, "strategy."),
        tau=_parse_tau(t.get("tau", 1)),
        params=dict(_typed(t, "params", dict, "strategy.", {})),
    )


def _parse_link(value: Any, where: str, table: str = "datacenters.link") -> LinkSpec | None:
    """A link spelt `where` in messages: a profile name, or a table of CONFIG_KEYS[`table`] whose link keys are
    read here (a [[links]] table's `between` is its caller's)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in LINK_PROFILES:
            raise ConfigError(f"unknown link profile '{value}' in '{where}'; known: {', '.join(sorted(LINK_PROFILES))}")
        return LINK_PROFILES[value]
    if not isinstance(value, dict):
        raise ConfigError(f"'{where}' must be a profile name or a table {{ bandwidth_mbps, rtt_ms, jitter_ms, loss }}")
    _check_keys(value, table, where + ".")
    base = _parse_link(value["profile"], where + ".profile") if "profile" in value else None
    bandwidth = _typed(value, "bandwidth_mbps", float, where + ".", base.bandwidth_mbps if base else dataclasses.MISSING)
    rtt = _typed(value, "rtt_ms", float, where + ".", base.rtt_ms if base else dataclasses.MISSING)
    jitter = _typed(value, "jitter_ms", float, where + ".", base.jitter_ms if base else 0.0)
    _positive(bandwidth, where + ".bandwidth_mbps")
    _positive(rtt, where + ".rtt_ms", allow_zero=True)
    _positive(jitter, where + ".jitter_ms", allow_zero=True)
    loss = _typed(value, "loss", float, where + ".", base.loss if base else 0.0)
    if not (math.isfinite(loss) and 0.0 <= loss < 1.0):
        raise ConfigError(f"'{where}.loss' must be in [0, 1) (a fraction of packets), got {loss!r}")
    name = base.name if base and (bandwidth, rtt) == (base.bandwidth_mbps, base.rtt_ms) else "custom"
    return LinkSpec(name=name, bandwidth_mbps=bandwidth, rtt_ms=rtt, jitter_ms=jitter, loss=loss)


def _parse_datacenters(doc: dict[str, Any]) -> tuple[DatacenterSection, ...]:
    items = doc.get("datacenters")
    if items is None or items == []:
        raise ConfigError("no datacenters: add at least one [[datacenters]] table with a name")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ConfigError("'datacenters' must be an array of tables ([[datacenters]])")
    if len(items) > LIMITS["datacenters"]:
        raise ConfigError(f"at most {LIMITS['datacenters']} datacenters (the most a config may ask for), got "
                          f"{len(items)} [[datacenters]] tables")
    result = []
    seen: set[str] = set()
    for index, t in enumerate(items):
        where = f"datacenters[{index}]."
        _check_keys(t, "datacenters", where)
        name = _typed(t, "name", str, where)
        if not _NAME_RE.match(name):
            raise ConfigError(f"datacenter name {name!r} must be lower-case letters, digits and '-' (at most 63)")
        if name in seen:
            raise ConfigError(f"datacenter name '{name}' appears twice")
        seen.add(name)
        workers = _typed(t, "workers", int, where, 1)
        _positive(workers, where + "workers")
        _at_most(workers, where + "workers", "datacenters.workers")
        speed = _typed(t, "speed", float, where, 1.0)
        _positive(speed, where + "speed")
        if speed > 1.0:
            raise ConfigError(f"'{where}speed' must be ≤ 1 (compute can be slowed down to emulate an uneven "
                              f"datacenter, not sped up), got {speed!r}")
        link = _parse_link(t.get("link"), where + "link")
        result.append(DatacenterSection(name=name, workers=workers, link=link, speed=speed, region=_typed(t, "region", str, where, None)))
    return tuple(result)


def _parse_between(t: dict[str, Any], where: str, names: list[str]) -> tuple[str, str]:
    """`between` of the table `where`: two different configured datacenters."""
    pair = t["between"]
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
        raise ConfigError(f"'{where}between' must be a list of two datacenter names like [\"us-east\", \"eu-west\"], "
                          f"got {pair!r}")
    for name in pair:
        if name not in names:
            raise ConfigError(f"'{where}between' names {name!r}, not a configured datacenter ({', '.join(names)})")
    if pair[0] == pair[1]:
        raise ConfigError(f"'{where}between' pairs datacenter {pair[0]!r} with itself; a link joins two datacenters")
    return (pair[0], pair[1])


def _parse_links(doc: dict[str, Any], datacenters: tuple[DatacenterSection, ...]) -> tuple[MeshLink, ...]:
    items = doc.get("links", [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ConfigError("'links' must be an array of tables ([[links]])")
    names = [dc.name for dc in datacenters]
    links: list[MeshLink] = []
    index_of: dict[frozenset[str], int] = {}  # each pair's [[links]] index: a second table for it is an error
    for index, t in enumerate(items):
        where = f"links[{index}]."
        _check_keys(t, "links", where)
        if "between" not in t:
            raise ConfigError(f"missing key '{where}between'")
        pair = _parse_between(t, where, names)
        other = index_of.setdefault(frozenset(pair), index)
        if other != index:
            raise ConfigError(f"'links[{other}]' and 'links[{index}]' both join {pair[0]!r} and {pair[1]!r}: "
                              f"give each pair one link")
        spec = _parse_link({k: v for k, v in t.items() if k != "between"}, f"links[{index}]", table="links")
        assert spec is not None  # a table always gives a link
        links.append(MeshLink(between=pair, link=spec))
    return tuple(links)


def _parse_link_faults(doc: dict[str, Any], datacenters: tuple[DatacenterSection, ...],
                       links: tuple[MeshLink, ...]) -> tuple[LinkFault, ...]:
    items = doc.get("link_faults", [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ConfigError("'link_faults' must be an array of tables ([[link_faults]])")
    if len(items) > LIMITS["link_faults"]:
        raise ConfigError(f"at most {LIMITS['link_faults']} link faults (the most a config may ask for), got "
                          f"{len(items)} [[link_faults]] tables")
    names = [dc.name for dc in datacenters]
    mesh_of = {frozenset(m.between): m for m in links}
    faults = []
    for index, t in enumerate(items):
        where = f"link_faults[{index}]."
        _check_keys(t, "link_faults", where)
        if ("datacenter" in t) == ("between" in t):
            given = "gives both" if "datacenter" in t else "needs one of"
            raise ConfigError(f"'link_faults[{index}]' {given} 'datacenter' (a datacenter's link) and 'between' "
                              f"(a link of [[links]]): give exactly one")
        name: str | None = None
        between: tuple[str, str] | None = None
        if "datacenter" in t:
            name = _typed(t, "datacenter", str, where)
            if name not in names:
                raise ConfigError(f"'{where}datacenter' = {name!r} is not a configured datacenter ({', '.join(names)})")
        else:
            pair = _parse_between(t, where, names)
            mesh = mesh_of.get(frozenset(pair))
            if mesh is None:
                listed = ", ".join(f"{m.between[0]}<->{m.between[1]}" for m in links) or "none"
                raise ConfigError(f"'{where}between' = {list(pair)!r} is not a link listed in [[links]] (listed: {listed})")
            between = mesh.between
        if ("after_round" in t) == ("after_s" in t):
            given = "gives both" if "after_round" in t else "needs one of"
            raise ConfigError(f"'link_faults[{index}]' {given} 'after_round' (rounds logged) and 'after_s' "
                              f"(seconds since the run started): give exactly one")
        after_round: int | None = None
        after_s: float | None = None
        if "after_round" in t:
            after_round = _typed(t, "after_round", int, where)
            _positive(after_round, where + "after_round", allow_zero=True)
        else:
            after_s = _typed(t, "after_s", float, where)
            _positive(after_s, where + "after_s", allow_zero=True)
        kind = _typed(t, "kind", str, where, "cut")
        if kind not in ("cut", "reset"):
            raise ConfigError(f"'{where}kind' must be 'cut' or 'reset', got {kind!r}")
        cut_s = _typed(t, "cut_s", float, where, 0.0)
        if kind == "cut":
            _positive(cut_s, where + "cut_s")
        faults.append(LinkFault(datacenter=name, between=between, after_round=after_round, after_s=after_s, kind=kind,
                                cut_s=cut_s))
    return tuple(faults)


def _codec_list(t: dict[str, Any], key: str) -> tuple[str, ...]:
    codecs = t.get(key, [])
    if not isinstance(codecs, list) or not all(isinstance(c, str) for c in codecs):
        raise ConfigError(f"'compression.{key}' must be a list of strings like [\"topk:0.01\", \"int8\"], got {codecs!r}")
    if len(codecs) > LIMITS["compression.codecs"]:
        raise ConfigError(f"'compression.{key}' may list at most {LIMITS['compression.codecs']} codecs (the most a "
                          f"config may ask for), got {len(codecs)}")
    if codecs:
        from crossdc.compression.base import CodecConfigError  # torch: only when compression is asked for
        from crossdc.compression.pipeline import build_pipeline_codecs

        try:
            build_pipeline_codecs(codecs)
        except CodecConfigError as err:
            raise ConfigError(f"'compression.{key}': {err}") from None
    return tuple(codecs)


def _parse_compression(doc: dict[str, Any]) -> CompressionSection:
    t = _table(doc, "compression", required=False)
    _check_keys(t, "compression", "compression.")
    return CompressionSection(_codec_list(t, "codecs"), _codec_list(t, "downlink_codecs"))


def _parse_security(doc: dict[str, Any]) -> SecuritySection:
    t = _table(doc, "security", required=False)
    _check_keys(t, "security", "security.")
    kind = _typed(t, "robust_aggregation", str, "security.", "none")
    if kind not in ROBUST_AGGREGATIONS:
        known = ", ".join(f'"{k}"' for k in ROBUST_AGGREGATIONS)
        raise ConfigError(f"'security.robust_aggregation' must be one of {known}, got {kind!r}")
    trim = _typed(t, "trim_fraction", float, "security.", DEFAULT_TRIM_FRACTION)
    if not (math.isfinite(trim) and 0.0 <= trim < 0.5):
        raise ConfigError(f"'security.trim_fraction' must be in [0, 0.5), got {trim!r}")
    if "trim_fraction" in t and kind != "trimmed_mean":
        raise ConfigError(f"'security.trim_fraction' only applies with robust_aggregation = \"trimmed_mean\", not {kind!r}")
    factor = _typed(t, "norm_rejection_factor", float, "security.", 0.0)
    _positive(factor, "security.norm_rejection_factor", allow_zero=True)
    if 0.0 < factor <= 1.0:
        raise ConfigError(f"'security.norm_rejection_factor' must be 0 (off) or > 1 (at most 1 would reject "
                          f"ordinary updates), got {factor!r}")
    max_mb = _typed(t, "max_update_mb", float, "security.", None)
    if max_mb is not None:
        _positive(max_mb, "security.max_update_mb")
    return SecuritySection(robust_aggregation=kind, trim_fraction=trim, norm_rejection_factor=factor, max_update_mb=max_mb)


def _parse_checkpoint(doc: dict[str, Any]) -> CheckpointSection:
    t = _table(doc, "checkpoint", required=False)
    _check_keys(t, "checkpoint", "checkpoint.")
    every = _typed(t, "every_rounds", int, "checkpoint.", 0)
    keep = _typed(t, "keep", int, "checkpoint.", 3)
    directory = _typed(t, "dir", str, "checkpoint.", "checkpoints/")
    if every < 0:
        raise ConfigError(f"'checkpoint.every_rounds' must be ≥ 0 (0 = no checkpoints), got {every}")
    if keep < 0:
        raise ConfigError(f"'checkpoint.keep' must be ≥ 0 (0 = keep all), got {keep}")
    if not directory.strip():
        raise ConfigError("'checkpoint.dir' must not be empty")
    return CheckpointSection(every_rounds=every, dir=directory, keep=keep)


def parse_config(doc: dict[str, Any]) -> ExperimentConfig:
    """Validate a parsed TOML document and return the typed config."""
    if not isinstance(doc, dict):
        raise ConfigError("a config must be a TOML document of tables")
    _check_keys(doc, "", "")
    run = _parse_run(doc)
    datacenters = _parse_datacenters(doc)
    workload = _parse_workload(doc)
    batch_size = workload.batch_size
    for dc in datacenters:
        if batch_size % dc.workers:
            raise ConfigError(f"'workload.batch_size' = {batch_size} must be divisible by datacenter '{dc.name}''s "
                              f"{dc.workers} workers (each takes an equal slice of every batch)")
    if run.min_replies > len(datacenters):
        raise ConfigError(f"'run.min_replies' = {run.min_replies} but there are only {len(datacenters)} datacenters")
    links = _parse_links(doc, datacenters)
    config = ExperimentConfig(
        run=run,
        workload=workload,
        strategy=_parse_strategy(doc),
        datacenters=datacenters,
        link_faults=_parse_link_faults(doc, datacenters, links),
        links=links,
        compression=_parse_compression(doc),
        security=_parse_security(doc),
        checkpoint=_parse_checkpoint(doc),
        raw=doc,
    )
    try:
        config.workload.options.schedule.check(config.workload.lr, inner_steps_planned(config), "workload.schedule")
    except ScheduleError as err:
        raise ConfigError(str(err)) from None
    return config


def inner_steps_planned(config: ExperimentConfig) -> int:
    """The inner steps each datacenter is planned to take in the whole run: τ summed over run.rounds (the horizon of
    the inner learning-rate schedule; an asynchronous datacenter may take more or fewer, see docs), in closed form
    (:meth:`TauSchedule.total`)."""
    return config.strategy.tau.total(config.run.rounds)


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate a TOML experiment config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    return parse_config_text(text, str(path))


def parse_config_text(text: str, source: str = "the config") -> ExperimentConfig:
    """Read and validate the TOML text of an experiment config (`source` names it in the error of invalid TOML)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source} is not valid TOML: {err}") from None
    return parse_config(doc)



def with_rounds(config: ExperimentConfig, rounds: int) -> ExperimentConfig:
    """The same experiment with another number of rounds (typed fields and `raw` kept in step)."""
    doc = json.loads(config.to_json())
    doc["run"]["rounds"] = rounds
    return parse_config(doc)
