"""The workload interface: a dataset + model family, split among datacenters.

A workload is built once per process from ``(spec, datacenter names, seed)``
and is deterministic given those: the same arguments give identical shards,
validation set and (under the same ``torch.manual_seed``) identical models.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from crossdc.workloads.errors import WorkloadError
from crossdc.workloads.options import ADAMW_BETAS, InnerOptions

__all__ = [
    "WorkloadError",
    "WorkloadSpec",
    "Workload",
    "TensorWorkload",
    "OPTIMIZERS",
    "ADAMW_WEIGHT_DECAY",
    "MOMENTUM",
    "evaluate",
    "make_optimizer",
    "set_lr",
    "InnerOptions",
    "ADAMW_BETAS",
]

#: Weight decay of the "adamw" optimizer (torch's own AdamW default).
ADAMW_WEIGHT_DECAY = 0.01
#: Momentum of the "momentum" optimizer (heavy-ball SGD, no Nesterov, no dampening).
MOMENTUM = 0.9
#: Names ``make_optimizer`` knows.
OPTIMIZERS: tuple[str, ...] = ("adamw", "momentum", "sgd")

_PARTITION_KEYS = ("alpha", "kind")


@dataclass(frozen=True)
class WorkloadSpec:
    """The ``[workload]`` table of the experiment config.

    ``model`` None means the workload's default model (:meth:`Workload.default_model_name`).
    ``partition`` is ``{"kind": "natural" | "iid" | "dirichlet", "alpha": float}``
    (``alpha`` only, and always, for ``"dirichlet"``). The dicts are copied on
    construction so later edits to the caller's dicts do not leak in.
    Deeper checks (known model, model_args keys, alpha > 0, ...) happen when a
    workload is built and fail with WorkloadError.
    """

    dataset: str
    model: str | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    partition: dict[str, Any] = field(default_factory=lambda: {"kind": "iid"})
    batch_size: int = 32
    optimizer: str = "adamw"
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if not isinstance(self.model_args, Mapping):
            raise WorkloadError(f"model_args must be a table, got {type(self.model_args).__name__}")
        if not isinstance(self.partition, Mapping):
            raise WorkloadError(f"partition must be a table like {{ kind = \"iid\" }}, got {self.partition!r}")
        object.__setattr__(self, "model_args", dict(self.model_args))
        object.__setattr__(self, "partition", dict(self.partition))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _known(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


class Workload(abc.ABC):
    """A dataset + model family. Built once per process from (spec, datacenter names, seed); deterministic given those.

    Subclasses set ``name`` (the dataset key), ``models`` and ``partitions``
    (the kinds they support), ``default_model`` (the model of a spec without
    one; None: the only entry of ``models``, if there is just one), and
    ``model_defaults``: for each model, its accepted ``model_args`` keys with
    their default values (all positive integers). ``__init__`` resolves the
    default model, checks the spec against these and raises WorkloadError;
    ``self.spec`` carries the resolved model, ``self.model_args`` the resolved
    arguments.
    """

    name: ClassVar[str]
    models: ClassVar[tuple[str, ...]]
    #: the model of a config that names none (``workload.model`` left out); None: the only model, if just one
    default_model: ClassVar[str | None] = None
    partitions: ClassVar[tuple[str, ...]]
    model_defaults: ClassVar[Mapping[str, Mapping[str, int]]] = {}

    def __init__(self, spec: WorkloadSpec, datacenters: list[str], seed: int) -> None:
        if spec.model is None:
            spec = dataclasses.replace(spec, model=self.default_model_name())
        self.spec = spec
        self.datacenters: tuple[str, ...] = self._check_datacenters(datacenters)
        if not _is_int(seed) or seed < 0:
            raise WorkloadError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed = int(seed)
        self._check_training_options(spec)
        if spec.model not in self.models:
            raise WorkloadError(f"unknown model {spec.model!r} for dataset {self.name!r}; known: {_known(self.models)}")
        self.partition_kind, self.alpha = self._check_partition(spec.partition)
        self.model_args: dict[str, int] = self._resolve_model_args(spec.model, spec.model_args)
        self._check_model_args()

    @classmethod
    def default_model_name(cls) -> str:
        """The model a spec without one gets: ``default_model``, else the only entry of ``models``; WorkloadError
        when the workload has several models and declares no default."""
        if cls.default_model is not None:
            return cls.default_model
        if len(cls.models) == 1:
            return cls.models[0]
        raise WorkloadError(f"dataset {cls.name!r} has no default model: set workload.model to one of "
                            f"{_known(cls.models)}")

    # -- the interface -------------------------------------------------------

    @abc.abstractmethod
    def shard(self, datacenter: str) -> TensorDataset:
        """That datacenter's training data (the same tensors every call)."""

    @abc.abstractmethod
    def validation(self) -> TensorDataset:
        """The one validation set: identical for every strategy, partition and datacenter count given the seed."""

    @abc.abstractmethod
    def all_training(self) -> TensorDataset:
        """All training data: the union of every datacenter's shard (for single-datacenter baselines)."""

    @abc.abstractmethod
    def make_model(self) -> nn.Module:
        """A fresh model; ``forward(inputs) -> logits``. Deterministic given ``torch.manual_seed`` set by the caller."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every target (for a sequence model: over all tokens)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # -- checks shared by all workloads --------------------------------------

    @staticmethod
    def _check_datacenters(datacenters: list[str]) -> tuple[str, ...]:
        names = tuple(datacenters)
        if not names:
            raise WorkloadError("a workload needs at least one datacenter")
        for dc in names:
            if not isinstance(dc, str) or not dc:
                raise WorkloadError(f"datacenter names must be non-empty strings, got {dc!r}")
        duplicates = sorted({dc for dc in names if names.count(dc) > 1})
        if duplicates:
            raise WorkloadError(f"datacenter names must be unique; repeated: {', '.join(duplicates)}")
        return names

    @staticmethod
    def _check_training_options(spec: WorkloadSpec) -> None:
        if not _is_int(spec.batch_size) or spec.batch_size < 1:
            raise WorkloadError(f"batch_size must be a positive integer, got {spec.batch_size!r}")
        if not _is_real(spec.lr) or not math.isfinite(spec.lr) or spec.lr <= 0:
            raise WorkloadError(f"lr must be a finite number > 0, got {spec.lr!r}")
        if spec.optimizer not in OPTIMIZERS:
            raise WorkloadError(f"unknown optimizer {spec.optimizer!r}; known: {_known(OPTIMIZERS)}")

    def _check_partition(self, partition: Mapping[str, Any]) -> tuple[str, float | None]:
        unknown = sorted(set(partition) - set(_PARTITION_KEYS))
        if unknown:
            raise WorkloadError(f"unknown partition key {unknown[0]!r}; known: {_known(_PARTITION_KEYS)}")
        kind = partition.get("kind")
        if kind not in self.partitions:
            raise WorkloadError(
                f"unknown partition kind {kind!r} for dataset {self.name!r}; known: {_known(self.partitions)}"
            )
        if kind != "dirichlet":
            if "alpha" in partition:
                raise WorkloadError(f"partition key 'alpha' only applies to kind 'dirichlet', not {kind!r}")
            return kind, None
        if "alpha" not in partition:
            raise WorkloadError("partition kind 'dirichlet' needs alpha, e.g. { kind = \"dirichlet\", alpha = 0.3 }")
        alpha = partition["alpha"]
        if not _is_real(alpha) or not math.isfinite(alpha) or alpha <= 0:
            raise WorkloadError(f"dirichlet alpha must be a finite number > 0, got {alpha!r}")
        return kind, float(alpha)

    def _resolve_model_args(self, model: str, given: Mapping[str, Any]) -> dict[str, int]:
        defaults = dict(self.model_defaults.get(model, {}))
        for key, value in given.items():
            if key not in defaults:
                known = _known(defaults) if defaults else "(none)"
                raise WorkloadError(f"unknown model_args key {key!r} for model {model!r}; known: {known}")
            if not _is_int(value) or value < 1:
                raise WorkloadError(f"model_args {key!r} must be a positive integer, got {value!r}")
            defaults[key] = int(value)
        return defaults

    def _check_model_args(self) -> None:  # noqa: B027 (a hook: nothing by default)
        """Hook for checks across ``self.model_args`` (runs before any data are loaded); raise WorkloadError."""

    def _check_datacenter(self, datacenter: str) -> int:
        try:
            return self.datacenters.index(datacenter)
        except ValueError:
            raise WorkloadError(
                f"unknown datacenter {datacenter!r}; known: {', '.join(self.datacenters)}"
            ) from None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model={self.spec.model!r}, partition={self.partition_kind!r}, "
            f"datacenters={len(self.datacenters)}, seed={self.seed})"
        )


class TensorWorkload(Workload):
    """A workload whose data fit in memory as (inputs, targets) tensors.

    Subclasses supply the full training set, the validation set, a partition
    of training indices into ``len(datacenters)`` parts, and the model. The
    partition is computed eagerly in ``__init__`` (so impossible splits fail
    at construction); a shard's tensors are built on first use and cached.
    Datacenter ``i`` of the list gets part ``i``.
    """

    def __init__(self, spec: WorkloadSpec, datacenters: list[str], seed: int) -> None:
        super().__init__(spec, datacenters, seed)
        self._train_inputs, self._train_targets = self._training_tensors()
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, 0x5A4D]))
        parts = self._partition(len(self.datacenters), rng)
        if len(parts) != len(self.datacenters):  # pragma: no cover - a subclass bug
            raise AssertionError(f"{type(self).__name__}._partition returned {len(parts)} parts")
        self._parts: tuple[np.ndarray, ...] = tuple(np.asarray(p, dtype=np.int64) for p in parts)
        self._shards: dict[str, TensorDataset] = {}
        self._validation: TensorDataset | None = None

    @abc.abstractmethod
    def _training_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full training set as (inputs, targets); must not depend on the seed or the datacenters."""

    @abc.abstractmethod
    def _validation_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The validation set as (inputs, targets); must not depend on the seed, partition or datacenters."""

    @abc.abstractmethod
    def _partition(self, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Disjoint index arrays into the training set, one per datacenter, covering it."""

    def shard_indices(self, datacenter: str) -> np.ndarray:
        """Indices into ``all_training()`` of that datacenter's items (sorted, read-only)."""
        part = self._parts[self._check_datacenter(datacenter)].view()
        part.flags.writeable = False
        return part

    def shard(self, datacenter: str) -> TensorDataset:
        self._check_datacenter(datacenter)
        if datacenter not in self._shards:
            index = torch.from_numpy(self.shard_indices(datacenter).copy())
            self._shards[datacenter] = TensorDataset(self._train_inputs[index], self._train_targets[index])
        return self._shards[datacenter]

    def validation(self) -> TensorDataset:
        if self._validation is None:
            self._validation = TensorDataset(*self._validation_tensors())
        return self._validation

    def all_training(self) -> TensorDataset:
        """Every training item, in canonical (seed-independent) order; shard i is ``all_training()[shard_indices(i)]``."""
        return TensorDataset(self._train_inputs, self._train_targets)


@torch.no_grad()
def model_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's state (parameters and persistent buffers) as float32 numpy copies, in state_dict order."""
    return {name: tensor.detach().cpu().numpy().astype(np.float32, copy=True) for name, tensor in model.state_dict().items()}


def load_model_weights(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> None:
    """Load named numpy arrays into the model; names and shapes must match exactly."""
    state = model.state_dict()
    if set(arrays) != set(state):
        missing, extra = sorted(set(state) - set(arrays)), sorted(set(arrays) - set(state))
        raise ValueError(f"weights do not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            value = arrays[name]
            if tuple(value.shape) != tuple(tensor.shape):
                raise ValueError(f"weight '{name}' has shape {tuple(value.shape)}, model expects {tuple(tensor.shape)}")
            tensor.copy_(torch.from_numpy(np.asarray(value)).to(tensor.dtype))


def evaluate(workload: Workload, model: nn.Module, batch_size: int = 512) -> tuple[float, float]:
    """(mean validation loss, accuracy in [0, 1]) of ``model`` on ``workload.validation()``.

    Loss and accuracy are averaged over every target (per token for a
    sequence model), computed without gradients in eval mode on the device of
    the model's first parameter. The model's train/eval mode is restored.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    dataset = workload.validation()
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    total_loss = 0.0
    correct = 0
    count = 0
    try:
        with torch.no_grad():
            inputs_all, targets_all = dataset.tensors
            for start in range(0, len(dataset), batch_size):
                inputs = inputs_all[start : start + batch_size].to(device)
                targets = targets_all[start : start + batch_size].to(device)
                logits = model(inputs)
                n = targets.numel()
                total_loss += float(workload.loss(logits, targets)) * n
                correct += int((logits.argmax(dim=-1) == targets).sum())
                count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("the validation set is empty")
    return total_loss / count, correct / count


def make_optimizer(name: str, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float,
                   options: InnerOptions | None = None) -> torch.optim.Optimizer:
    """The local optimizer called ``name``, tuned by `options` (betas, weight decay; see InnerOptions).

    - ``"sgd"``: plain SGD (no momentum; no weight decay unless given);
    - ``"momentum"``: SGD with heavy-ball momentum ``MOMENTUM`` (0.9; no weight decay unless given);
    - ``"adamw"``: ``torch.optim.AdamW`` with betas ADAMW_BETAS (0.9, 0.999) and weight decay
      ``ADAMW_WEIGHT_DECAY`` (0.01, torch's default) unless given.

    Unknown names raise WorkloadError (a ValueError) listing the known ones.
    """
    options = options or InnerOptions()
    if name not in OPTIMIZERS:
        raise WorkloadError(f"unknown optimizer {name!r}; known: {_known(OPTIMIZERS)}")
    options.check(name)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=options.weight_decay or 0.0)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM, weight_decay=options.weight_decay or 0.0)
    weight_decay = ADAMW_WEIGHT_DECAY if options.weight_decay is None else options.weight_decay
    return torch.optim.AdamW(params, lr=lr, betas=options.betas or ADAMW_BETAS, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Make `lr` the learning rate of every parameter group of `optimizer` (what a schedule does before a step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
