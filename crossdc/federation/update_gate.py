"""The one gate every datacenter update passes before aggregation (pure functions).

Per reply: :func:`size_rejection_reason` (before anything is decoded), then :func:`rejection_reason` (names,
shapes, dtypes, finite values). Per round, once every reply is judged: :func:`norm_outliers` over the accepted
updates. A rejected update never touches the global model; the caller records why.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from crossdc.strategies.aggregation import l2_norm

#: the fixed allowance of the default size limit, for the metrics record and protobuf framing
SIZE_LIMIT_SLACK_BYTES = 1 << 20
#: bytes in one "MB" of `security.max_update_mb` (decimal, as everywhere crossdc prints MB)
BYTES_PER_MB = 1_000_000


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


def update_size_limit(dense_fp32_bytes: int, reply_groups: int, max_update_mb: float | None = None) -> int:
    """The most bytes one reply's payload may have.

    `max_update_mb` (``security.max_update_mb``, in MB of 10^6 bytes) when given. Otherwise a generous bound
    derived from the model: (1 + `reply_groups`) × `dense_fp32_bytes` × 2 + 1 MiB, i.e. twice what the update
    and the strategy's extra tensor groups weigh as dense float32 (room for any codec's worst case, e.g. top-k
    values plus their indices), plus 1 MiB for the metrics and the framing. `dense_fp32_bytes` is the dense
    float32 size of the global weights.
    """
    if max_update_mb is not None:
        if not (np.isfinite(max_update_mb) and max_update_mb > 0):
            raise ValueError(f"max_update_mb must be a finite number > 0, got {max_update_mb!r}")
        return int(max_update_mb * BYTES_PER_MB)
    return (1 + reply_groups) * dense_fp32_bytes * 2 + SIZE_LIMIT_SLACK_BYTES


def size_rejection_reason(payload_bytes: int, limit_bytes: int) -> str | None:
    """Why a reply of `payload_bytes` is refused before decoding (over `limit_bytes`), or None if it is not."""
    if payload_bytes > limit_bytes:
        return f"payload of {payload_bytes} bytes exceeds the limit of {limit_bytes} bytes"
    return None


def norm_outliers(norms: Mapping[str, float], factor: float) -> dict[str, str]:
    """The updates to reject for their norm, with the reason: {datacenter: reason}.

    `norms` holds the L2 norm of every update accepted so far in the round, by datacenter. An update is an
    outlier when its norm is strictly greater than `factor` × the median norm of the round's OTHER accepted
    updates (leave-one-out, so that with two datacenters the huge one is rejected and the honest one stays; with
    an even number of others the median is the mean of the two middle norms). Nothing is rejected when
    `factor` ≤ 0 (the check is off) or fewer than two updates were accepted. Equal norms are never outliers of
    each other; if the others' median is 0, any non-zero update is an outlier.
    """
    if factor <= 0 or len(norms) < 2:
        return {}
    outliers: dict[str, str] = {}
    for name, norm in norms.items():
        median = float(np.median([other for key, other in norms.items() if key != name]))
        if norm > factor * median:
            outliers[name] = (f"update norm {norm:.6g} exceeds {factor:g} × {median:.6g}, the median norm of the "
                              f"round's other accepted updates (security.norm_rejection_factor = {factor:g})")
    return outliers


def update_norm_outliers(deltas: Mapping[str, Mapping[str, np.ndarray]], factor: float) -> dict[str, str]:
    """:func:`norm_outliers` of a round's accepted updates Δy (by datacenter), their norms taken over all their
    tensors together. The strategy's extra tensor groups (SCAFFOLD's Δc) are not compared. The one call the
    federation and the in-process federation make after judging every reply of a round."""
    if factor <= 0 or len(deltas) < 2:
        return {}
    return norm_outliers({name: l2_norm(delta) for name, delta in deltas.items()}, factor)
