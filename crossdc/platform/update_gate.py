"""The one gate every datacenter update passes before aggregation (pure function).

A rejected update never touches the global model; the caller records why.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def rejection_reason(update: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> str | None:
    """Why `update` cannot be aggregated against the global weights `reference`, or None if it can.

    Checks: the same tensor names, shapes and dtypes as the global weights, and only finite values.
    """
    missing = [name for name in reference if name not in update]
    if missing:
        return f"missing tensors: {', '.join(missing[:3])}"
    extra = [name for name in update if name not in reference]
    if extra:
        return f"unexpected tensors: {', '.join(extra[:3])}"
    for name, expected in reference.items():
        value = update[name]
        if tuple(value.shape) != tuple(expected.shape):
            return f"tensor '{name}' has shape {tuple(value.shape)}, expected {tuple(expected.shape)}"
        if value.dtype != expected.dtype:
            return f"tensor '{name}' has dtype {value.dtype}, expected {expected.dtype}"
        if not np.all(np.isfinite(value)):
            return f"tensor '{name}' contains NaN or Inf"
    return None
