"""Find workloads: the built-ins and plug-ins all register in the entry-point group ``crossdc.workloads``."""

from __future__ import annotations

import warnings
from importlib.metadata import entry_points

from crossdc.workloads.base import Workload, WorkloadSpec
from crossdc.workloads.errors import WorkloadError

__all__ = ["ENTRY_POINT_GROUP", "available_workloads", "load_workload"]

ENTRY_POINT_GROUP = "crossdc.workloads"


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
    return dict(sorted(found.items()))


def load_workload(spec: WorkloadSpec, datacenters: list[str], seed: int) -> Workload:
    """Build the workload registered under ``spec.dataset``; WorkloadError if none is, listing the known names."""
    known = available_workloads()
    cls = known.get(spec.dataset)
    if cls is None:
        raise WorkloadError(f"unknown dataset {spec.dataset!r}; known: {', '.join(known) or '(none registered)'}")
    return cls(spec, datacenters, seed)
