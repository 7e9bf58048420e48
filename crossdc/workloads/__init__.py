"""Workloads: datasets, models and partitioners (IID, Dirichlet label skew, natural).

Public names are re-exported here. The partitioners and WorkloadError are
imported eagerly (numpy only); everything that needs torch is imported on
first attribute access, so ``import crossdc.workloads.partition`` never
imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from crossdc.workloads.errors import WorkloadError
from crossdc.workloads.options import InnerOptions
from crossdc.workloads.partition import dirichlet_partition, iid_partition, natural_partition

if TYPE_CHECKING:
    from crossdc.workloads.base import (
        OPTIMIZERS,
        TensorWorkload,
        Workload,
        WorkloadSpec,
        evaluate,
        load_model_weights,
        make_optimizer,
        model_weights,
        set_lr,
    )
    from crossdc.workloads.images import DigitsWorkload, Mnist1dWorkload
    from crossdc.workloads.registry import available_workloads, load_workload, register_workload
    from crossdc.workloads.shakespeare import ShakespeareWorkload
    from crossdc.workloads.synthetic import SyntheticWorkload

_LAZY = {
    "OPTIMIZERS": "crossdc.workloads.base",
    "TensorWorkload": "crossdc.workloads.base",
    "Workload": "crossdc.workloads.base",
    "WorkloadSpec": "crossdc.workloads.base",
    "evaluate": "crossdc.workloads.base",
    "make_optimizer": "crossdc.workloads.base",
    "set_lr": "crossdc.workloads.base",
    "model_weights": "crossdc.workloads.base",
    "load_model_weights": "crossdc.workloads.base",
    "DigitsWorkload": "crossdc.workloads.images",
    "Mnist1dWorkload": "crossdc.workloads.images",
    "available_workloads": "crossdc.workloads.registry",
    "load_workload": "crossdc.workloads.registry",
    "register_workload": "crossdc.workloads.registry",
    "ShakespeareWorkload": "crossdc.workloads.shakespeare",
    "SyntheticWorkload": "crossdc.workloads.synthetic",
}

__all__ = [  # every name the package offers (the lazy ones load on first use)
    "DigitsWorkload", "InnerOptions", "Mnist1dWorkload", "OPTIMIZERS", "ShakespeareWorkload", "SyntheticWorkload", "TensorWorkload",
    "Workload", "WorkloadError", "WorkloadSpec", "available_workloads", "dirichlet_partition", "evaluate",
    "iid_partition", "load_model_weights", "load_workload", "make_optimizer", "model_weights", "natural_partition",
    "register_workload", "set_lr",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
