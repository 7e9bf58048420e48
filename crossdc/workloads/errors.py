"""The one error type of the workloads subpackage (torch-free, so partition.py can raise it)."""

from __future__ import annotations

__all__ = ["WorkloadError"]


class WorkloadError(ValueError):
    """A bad workload request: unknown dataset/model/partition, bad model_args, impossible split.

    The message is one line and, where there is a fixed set of choices, lists them.
    It subclasses ValueError so callers that validate configs generically catch it.
    """
