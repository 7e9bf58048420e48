"""A datacenter's timeline from what its replies say: spans of compute, waits and transfers in flight.

Promises: :func:`exchange_spans` turns one streaming reply's timing metrics (see :mod:`crossdc.protocol`:
``sent-at``, ``spans-compute``, ``spans-wait``, ``results-received``) into ``timeline_spans`` records, in seconds
since the run's start: the trainer's compute and waits since its previous send, its update in flight up (from its
send to the coordinator's pull of the reply) and each server result in flight down (from the push of the message
that carried it to its arrival at the trainer). Compute and waits are on the datacenter's clock, transfers span
both clocks: a span that comes out reversed (clocks apart by more than the transfer) is left out, as is anything
malformed. Nothing here raises on what a datacenter sent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from crossdc import protocol
from crossdc.db.models import TIMELINE_SPAN_KINDS
from crossdc.db.records import TimelineSpanRecord

log = logging.getLogger("crossdc.federation")

COMPUTE, WAIT, UP, DOWN = TIMELINE_SPAN_KINDS


def _pairs(value: Any) -> list[tuple[float, float]]:
    """A flat [a, b, a, b, ...] list as pairs of finite floats; [] for anything else."""
    if not isinstance(value, (list, tuple)) or len(value) % 2:
        return []
    try:
        numbers = [float(v) for v in value]
    except (TypeError, ValueError):
        return []
    if not all(math.isfinite(v) for v in numbers):
        return []
    return list(zip(numbers[::2], numbers[1::2], strict=True))


def exchange_spans(metrics: Mapping[str, Any], *, datacenter: str, exchange: int, run_started: float,
                   replied_at: float, carried_at: Mapping[int, float],
                   locate: Callable[[int], tuple[int, int]]) -> list[TimelineSpanRecord]:
    """The spans one reply to exchange `exchange` tells of (see the module docstring). `run_started` and
    `replied_at` are wall-clock seconds (the coordinator's); `carried_at` maps a result's exchange to when the
    message that carried it was pushed; `locate(k)` gives exchange k's (round, fragment)."""
    server_round, fragment = locate(exchange)
    found: list[tuple[str, float, float, int]] = []  # kind, start, end, exchange it belongs to
    for kind, key in ((COMPUTE, protocol.SPANS_COMPUTE), (WAIT, protocol.SPANS_WAIT)):
        found += [(kind, start, end, exchange) for start, end in _pairs(metrics.get(key))]
    sent_at = _pairs([metrics.get(protocol.SENT_AT), replied_at])
    found += [(UP, start, end, exchange) for start, end in sent_at]
    for result_of, arrived in _pairs(metrics.get(protocol.RESULTS_RECEIVED)):
        k = int(result_of)
        if k == result_of and k in carried_at:
            found.append((DOWN, carried_at[k], arrived, k))
    spans = []
    for kind, start, end, k in found:
        if end < start:
            log.debug("%s: a %s span of exchange %d ends before it starts (clocks apart?): left out", datacenter, kind, k)
            continue
        span_round, span_fragment = (server_round, fragment) if k == exchange else locate(k)
        spans.append(TimelineSpanRecord(round=span_round, datacenter=datacenter, kind=kind, start_s=start - run_started,
                                        end_s=end - run_started, fragment=span_fragment, exchange=k))
    return spans
