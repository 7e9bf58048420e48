"""Find workloads: the built-ins and plug-ins all register in the entry-point group ``crossdc.workloads``;
code in the same process may also use the ``@register_workload("name")`` class decorator.

A datacenter brings its own dataset and model as a plug-in package that declares
``[project.entry-points."crossdc.workloads"] mydata = "mypackage.module:MyWorkload"`` (a
:class:`~crossdc.workloads.base.Workload` subclass); see ``examples/plugins/crossdc-fedavgm``. The entry point
is what every process of a run (server, trainers, worker ranks) sees; the decorator only reaches the process
that imported the module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TypeVar

from crossdc.workloads.base import Workload, WorkloadSpec
from crossdc.workloads.errors import WorkloadError

__all__ = ["ENTRY_POINT_GROUP", "available_workloads", "load_workload", "register_workload", "unregister_workload"]

ENTRY_POINT_GROUP = "crossdc.workloads"

_DECORATED: dict[str, type[Workload]] = {}

W = TypeVar("W", bound=type[Workload])


def register_workload(name: str) -> Callable[[W], W]:
    """Class decorator: register a Workload subclass under dataset name `name` for this process (sets ``cls.name``)."""

    def decorate(cls: W) -> W:
        if not (isinstance(cls, type) and issubclass(cls, Workload)):
            raise WorkloadError(f"@register_workload({name!r}) needs a Workload subclass, got {cls!r}")
        taken = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if (name in taken or name in _DECORATED) and _DECORATED.get(name) is not cls:
            raise WorkloadError(f"workload name {name!r} is already registered")
        cls.name = name
        _DECORATED[name] = cls
        return cls

    return decorate


def unregister_workload(name: str) -> None:
    """Forget a workload registered with the decorator (tests)."""
    _DECORATED.pop(name, None)


def available_workloads() -> dict[str, type[Workload]]:
    """Dataset name -> Workload class for every entry point in ``crossdc.workloads``, sorted by name.

    An entry point that fails to import, or does not name a Workload subclass,
    is left out with a warning naming it (one broken plug-in must not hide the
    others). If a name is registered twice, the first distribution wins.
    """
    found: dict[str, type[Workload]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plug-in: report it, keep the rest
            warnings.warn(f"workload plug-in {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Workload)):
            warnings.warn(f"workload plug-in {ep.name!r} ({ep.value}) is not a Workload subclass", stacklevel=2)
            continue
        found[ep.name] = cls
    found.update(_DECORATED)
    return dict(sorted(found.items()))


def load_workload(spec: WorkloadSpec, datacenters: list[str], seed: int) -> Workload:
    """Build the workload registered under ``spec.dataset``; WorkloadError if none is, listing the known names."""
    known = available_workloads()
    cls = known.get(spec.dataset)
    if cls is None:
        raise WorkloadError(f"unknown dataset {spec.dataset!r}; known: {', '.join(known) or '(none registered)'}")
    return cls(spec, datacenters, seed)
