"""The one gate every datacenter update passes before aggregation.

Per reply, :func:`judge_reply` (a Flower reply, or none) and :func:`judge_content` (a reply's content, also what
the in-process driver judges): :func:`size_rejection_reason` (before anything is decoded), the codec payload's
decoding, then :func:`rejection_reason` (names, shapes, dtypes, finite values) for the update and every tensor
group the strategy needs, then the metrics the contract asks for. Per round, once every reply is judged:
:func:`norm_outliers` over the accepted updates. A rejected update never touches the global model; the outcome
(:class:`Judged`) carries its datacenter-round record with the reason, for the caller to log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import RecordDict
from flwr.common.constant import ErrorCode

from crossdc import protocol
from crossdc.compression.uplink import decode_update
from crossdc.compression.wire import CodecError
from crossdc.db.records import DatacenterRoundRecord
from crossdc.federation.grid_io import Reply
from crossdc.protocol import METRICS_KEY, decode_tensors, payload_bytes, raw_fp32_bytes
from crossdc.strategies.aggregation import l2_norm
from crossdc.strategies.base import ClientUpdate

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


@dataclass
class Judged:
    """One datacenter's outcome in one round: its datacenter-round record, and its update if accepted."""

    record: DatacenterRoundRecord
    update: ClientUpdate | None = None
    worker_pids: tuple[int, ...] | None = None  # the datacenter's worker group, rank 0 first
    replied: bool = True  # False: nothing came from the datacenter (timeout, expired message)

    def rejected(self, reason: str) -> Judged:
        """This accepted outcome rejected after all, by a check of the whole round (norm outliers): no update to
        aggregate; the record keeps its measurements but not what only an aggregated update has (bytes_up_raw,
        num_examples)."""
        record = self.record.replace(status="rejected", reason=reason, bytes_up_raw=0, num_examples=None)
        return Judged(record, None, self.worker_pids, self.replied)


@dataclass(frozen=True)
class GateRules:
    """What the gate checks a reply against, fixed for a run: the inner batch size, the strategy's tensor
    groups, whether the update must come as a codec payload, and the size limit (None: none)."""

    batch_size: int
    reply_groups: tuple[str, ...] = ()
    compressed: bool = False
    max_bytes: int | None = None


def judge_reply(reply: Reply | None, datacenter: str, weights: Mapping[str, np.ndarray], tau: int, pushed_at: float,
                timeout_reason: str, rules: GateRules, compute_since: float | None = None) -> Judged:
    """Pass one Flower reply through the gate: a record with status ok, failed, timeout or rejected (with its
    reason). None (nothing came) and an expired message are timeouts; an error reply is a failure. The reported
    compute must fit between `compute_since` (wall-clock; default `pushed_at`) and the reply's arrival."""
    if reply is None:
        return Judged(DatacenterRoundRecord(status="timeout", reason=timeout_reason), replied=False)
    round_s = reply.received_at - pushed_at
    if reply.message.has_error():
        error = reply.message.error
        if error.code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE):
            # the SuperLink's answer for a message that expired undelivered (or whose reply did): no reply came
            return Judged(DatacenterRoundRecord(status="timeout", reason=f"{timeout_reason} (message expired)"),
                          replied=False)
        return Judged(DatacenterRoundRecord(status="failed", reason=str(error.reason).splitlines()[0][:500],
                                            round_s=round_s))
    compute_window_s = None if compute_since is None else reply.received_at - compute_since
    return judge_content(reply.message.content, datacenter, weights, tau, round_s, rules, compute_window_s)


def judge_content(content: RecordDict, datacenter: str, weights: Mapping[str, np.ndarray], tau: int, round_s: float,
                  rules: GateRules, compute_window_s: float | None = None) -> Judged:
    """Pass one reply's content (the update, the strategy's tensor groups, the metrics) through the gate.

    A payload over ``rules.max_bytes`` is rejected before decoding. Every tensor group the strategy needs
    (``rules.reply_groups``, e.g. SCAFFOLD's ``control``) must be present and pass the same checks as the update
    (names, shapes, dtypes of the weights, finite values); a missing one rejects. With ``rules.compressed`` (the
    run has codecs) the update must come as a codec payload that decodes cleanly. The reported examples must be
    possible in τ steps and the reported compute must fit in the round (or in `compute_window_s`, for a trainer that
    computed before the message came: a streaming exchange)."""
    size = payload_bytes(content)

    def rejected(reason: str) -> Judged:
        return Judged(DatacenterRoundRecord(status="rejected", reason=reason[:500], round_s=round_s, bytes_up=size))

    if rules.max_bytes is not None and (too_big := size_rejection_reason(size, rules.max_bytes)) is not None:
        return rejected(too_big)
    try:
        delta = decode_update(content, weights, rules.compressed)
    except CodecError as err:
        return rejected(f"undecodable update: {err}")
    try:
        metrics = dict(content[METRICS_KEY])
        num_examples = int(metrics[protocol.NUM_EXAMPLES])
        compute_s = float(metrics[protocol.COMPUTE_S])
        train_loss = float(metrics.get(protocol.TRAIN_LOSS, float("nan")))
        worker_pids = tuple(int(p) for p in metrics.get(protocol.WORKER_PIDS, [metrics.get(protocol.TRAINER_PID, -1)]))
        reason = rejection_reason(delta, weights)
        extras = {group: decode_tensors(content, group) for group in rules.reply_groups}
        for group, arrays in extras.items():
            if reason is None and (problem := rejection_reason(arrays, weights)) is not None:
                reason = f"tensor group '{group}': {problem}"
    except Exception as err:  # a reply that is not what the contract says
        return rejected(f"malformed reply: {type(err).__name__}: {err}")
    if reason is None and not 0 < num_examples <= tau * rules.batch_size:
        reason = f"reply reports {num_examples} examples; at most τ × batch = {tau * rules.batch_size} are possible"
    window_s = round_s if compute_window_s is None else compute_window_s
    if reason is None and not 0 <= compute_s <= window_s:
        reason = f"reply reports {compute_s:.3f}s of compute in a {window_s:.3f}s round"
    if reason is not None:
        return rejected(reason)
    # the reply's tensors as dense fp32: the update and the strategy's groups (SCAFFOLD sends twice the model)
    raw = raw_fp32_bytes(delta) + sum(raw_fp32_bytes(arrays) for arrays in extras.values())
    record = DatacenterRoundRecord(status="ok", round_s=round_s, bytes_up=size, bytes_up_raw=raw, compute_s=compute_s,
                                   train_loss=train_loss, num_examples=num_examples, drift_l2=l2_norm(delta))
    return Judged(record, ClientUpdate(datacenter, delta, num_examples, metrics, extras), worker_pids)
