"""Find workloads: the built-ins and plug-ins all register in the entry-point group ``crossdc.workloads``;
code in the same process may also use the ``@register_workload("name")`` class decorator.

A datacenter brings its own dataset and model as a plug-in package that declares
``[project.entry-points."crossdc.workloads"] mydata = "mypackage.module:MyWorkload"`` (a
:class:`~crossdc.workloads.base.Workload` subclass); see ``examples/plugins/crossdc-fedavgm``. The entry point
is what every process of a run (server, trainers, worker ranks) sees; the decorator only reaches the process
that imported the module.
"""

from __future__ import annotations

from collections.abc import Callable

from crossdc.plugins import PluginRegistry
from crossdc.workloads.base import Workload, WorkloadSpec
from crossdc.workloads.errors import WorkloadError

__all__ = ["ENTRY_POINT_GROUP", "available_workloads", "load_workload", "register_workload", "unregister_workload"]

ENTRY_POINT_GROUP = "crossdc.workloads"
#: a broken workload plug-in is left out with a warning naming it: one must not hide the others
REGISTRY: PluginRegistry[type[Workload]] = PluginRegistry(ENTRY_POINT_GROUP, Workload, "workload", WorkloadError, broken="warn")


def register_workload(name: str) -> Callable[[type[Workload]], type[Workload]]:
    """Class decorator: register a Workload subclass under dataset name `name` for this process (sets ``cls.name``)."""
    return REGISTRY.register(name)


def unregister_workload(name: str) -> None:
    """Forget a workload registered with the decorator (tests)."""
    REGISTRY.unregister(name)


def available_workloads() -> dict[str, type[Workload]]:
    """Dataset name -> Workload class for every registered workload, sorted by name (broken plug-ins left out, with
    a warning naming them)."""
    return REGISTRY.load()


def load_workload(spec: WorkloadSpec, datacenters: list[str], seed: int) -> Workload:
    """Build the workload registered under ``spec.dataset``; WorkloadError if none is, listing the known names."""
    known = available_workloads()
    cls = known.get(spec.dataset)
    if cls is None:
        raise WorkloadError(f"unknown dataset {spec.dataset!r}; known: {', '.join(known) or '(none registered)'}")
    return cls(spec, datacenters, seed)
