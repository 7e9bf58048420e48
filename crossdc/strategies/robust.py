"""Robust aggregation of a round's updates (``[security] robust_aggregation``), as pure functions.

``none`` is the example-weighted mean (:func:`crossdc.strategies.aggregation.weighted_average`). ``median`` and
``trimmed_mean`` are Flower's own implementations (``flwr.server.strategy.aggregate.aggregate_median`` and
``aggregate_trimmed_avg``), applied tensor by tensor, coordinate-wise; both ignore the example counts (every
datacenter runs the same τ × batch examples anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from crossdc.strategies.aggregation import weighted_average

Arrays = Mapping[str, np.ndarray]

#: the values of ``security.robust_aggregation``
ROBUST_AGGREGATIONS = ("none", "median", "trimmed_mean")
#: ``security.trim_fraction`` when absent
DEFAULT_TRIM_FRACTION = 0.2


def check_robust_aggregation(kind: str, trim_fraction: float) -> None:
    """ValueError (one line) unless `kind` is one of ROBUST_AGGREGATIONS and 0 ≤ `trim_fraction` < 0.5."""
    if kind not in ROBUST_AGGREGATIONS:
        raise ValueError(f"unknown robust aggregation {kind!r}; known: {', '.join(ROBUST_AGGREGATIONS)}")
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {trim_fraction!r}")


def robust_mean(updates: Sequence[Arrays], num_examples: Sequence[int], kind: str = "none",
                trim_fraction: float = DEFAULT_TRIM_FRACTION) -> dict[str, np.ndarray]:
    """The aggregate of `updates` (same names and shapes; names in the first update's order), as float32.

    - ``none``: Σ_i n_i · u_i / Σ_i n_i with n_i = `num_examples` (in float64);
    - ``median``: the coordinate-wise median (with an even count: the mean of the two middle values);
    - ``trimmed_mean``: per coordinate, drop the int(`trim_fraction` × count) smallest and as many largest
      values and average the rest (so with fewer than 1/`trim_fraction` updates nothing is dropped: the plain
      mean).

    ``median`` and ``trimmed_mean`` compute in float64 and ignore `num_examples`.
    """
    check_robust_aggregation(kind, trim_fraction)
    if kind == "none":
        return weighted_average(updates, num_examples)
    if not updates:
        raise ValueError("robust_mean needs at least one update")
    from flwr.server.strategy.aggregate import aggregate_median, aggregate_trimmed_avg  # server side only

    names = list(updates[0])
    results = [([np.asarray(update[name], np.float64) for name in names], int(n)) for update, n in zip(updates, num_examples, strict=True)]
    layers = aggregate_median(results) if kind == "median" else aggregate_trimmed_avg(results, trim_fraction)
    return {name: np.asarray(layer, np.float32) for name, layer in zip(names, layers, strict=True)}
