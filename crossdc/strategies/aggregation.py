"""The maths of aggregation, as pure functions on dicts of numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Arrays = Mapping[str, np.ndarray]


def weighted_average(updates: Sequence[Arrays], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Σ_i w_i · u_i / Σ_i w_i for every tensor name, computed in float64, returned as float32.

    All updates must have the same names and shapes; weights must be ≥ 0 with a positive sum.
    """
    if not updates:
        raise ValueError("weighted_average needs at least one update")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be ≥ 0 with a positive sum, got {list(weights)}")
    names = list(updates[0])
    result: dict[str, np.ndarray] = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][name]), dtype=np.float64)
        for update, weight in zip(updates, weights):
            acc += (weight / total) * np.asarray(update[name], dtype=np.float64)
        result[name] = acc.astype(np.float32)
    return result


def add(base: Arrays, delta: Arrays, scale: float = 1.0) -> dict[str, np.ndarray]:
    """base + scale · delta, per tensor, keeping base's dtype."""
    return {name: (base[name] + scale * delta[name]).astype(base[name].dtype) for name in base}


def l2_norm(arrays: Arrays) -> float:
    """‖a‖₂ over all tensors together."""
    return float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values())))


def cosine(a: Arrays, b: Arrays) -> float:
    """cos(a, b) over all tensors flattened together; 0.0 if either is zero."""
    dot = sum(float(np.sum(np.asarray(a[n], np.float64) * np.asarray(b[n], np.float64))) for n in a)
    norms = l2_norm(a) * l2_norm(b)
    return dot / norms if norms > 0 else 0.0
