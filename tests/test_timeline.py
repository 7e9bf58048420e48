"""A datacenter's timeline from a streaming reply's timing metrics, on exact cases (crossdc.federation.timeline)."""

from __future__ import annotations

from crossdc import protocol
from crossdc.federation.timeline import exchange_spans
from crossdc.strategies.fragments import FragmentSchedule

SCHEDULE = FragmentSchedule(8, 2, 1)  # exchange k: round (k − 1) // 2 + 1, fragment (k − 1) % 2


def spans(metrics: dict, **overrides: object) -> list[tuple]:
    arguments = {"datacenter": "a", "exchange": 3, "run_started": 100.0, "replied_at": 112.0,
                 "carried_at": {2: 104.0}, "locate": SCHEDULE.locate, **overrides}
    return [(s.kind, s.round, s.fragment, s.exchange, s.start_s, s.end_s) for s in exchange_spans(metrics, **arguments)]


def test_compute_waits_and_transfers_in_seconds_since_the_run_began() -> None:
    metrics = {protocol.SPANS_COMPUTE: [101.0, 105.0, 106.5, 110.0], protocol.SPANS_WAIT: [105.0, 106.5],
               protocol.SENT_AT: 110.0, protocol.RESULTS_RECEIVED: [2.0, 106.0]}
    assert spans(metrics) == [
        ("compute", 2, 0, 3, 1.0, 5.0), ("compute", 2, 0, 3, 6.5, 10.0), ("wait", 2, 0, 3, 5.0, 6.5),
        ("up", 2, 0, 3, 10.0, 12.0),
        ("down", 1, 1, 2, 4.0, 6.0),  # result 2 (round 1, fragment 1): pushed at 104, with the trainer at 106
    ]


def test_what_cannot_be_a_span_is_left_out_and_nothing_raises() -> None:
    assert spans({}) == []
    odd = {protocol.SPANS_COMPUTE: [101.0, 105.0, 106.0], protocol.SPANS_WAIT: ["x", 1.0],
           protocol.SENT_AT: float("nan"), protocol.RESULTS_RECEIVED: [9.0, 106.0, 2.5, 107.0]}
    assert spans(odd) == []  # an odd list, a string, a NaN send time, results of no message pushed / not whole
    skewed = {protocol.SENT_AT: 113.0, protocol.RESULTS_RECEIVED: [2.0, 103.0]}  # the datacenter's clock is ahead
    assert spans(skewed) == []
