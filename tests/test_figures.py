"""The dashboard's plotly figures on small exact cases (pure functions: rows in, figure out)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from crossdc.dashboard import figures
from crossdc.dashboard.figures import (
    ALERT_COLOR,
    COMM_COMP_ALERT,
    NOT_MEASURED_COLOR,
    OK_COLOR,
    TIMELINE_COLORS,
    bytes_per_round,
    comm_comp_ratio,
    compare_runs,
    downsample,
    downsample_indices,
    drift_per_datacenter,
    exposed_comm_comp_ratio,
    loss_vs_bytes,
    loss_vs_round,
    loss_vs_wall_time,
    staleness_histogram,
    summarize_datacenters,
    tau_schedule,
    time_breakdown,
    timeline,
)
from crossdc.db.models import TIMELINE_SPAN_KINDS


def rnd(round_: int, **values: Any) -> dict[str, Any]:
    """A ``rounds`` row with defaults."""
    row = {"round": round_, "tau": None, "val_loss": None, "val_accuracy": None, "bytes_up": 0,
           "bytes_down": 0, "bytes_up_raw": 0, "wall_s": None}
    row.update(values)
    return row


def dcr(round_: int, datacenter: str, **values: Any) -> dict[str, Any]:
    """A ``datacenter_rounds`` row with defaults."""
    row = {"round": round_, "datacenter": datacenter, "status": "ok", "compute_s": None, "comm_s": None,
           "overhead_s": None, "drift_l2": None, "bytes_up": 0, "bytes_up_raw": 0, "bytes_down": 0}
    row.update(values)
    return row


def trace(fig: Any, name: str) -> Any:
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, f"expected one trace named {name!r}, found {[t.name for t in fig.data]}"
    return found[0]


def annotations(fig: Any) -> list[str]:
    return [a.text for a in fig.layout.annotations]


# ------------------------------------------------------------ downsampling


@pytest.mark.parametrize("n,max_points", [(0, 10), (1, 10), (10, 10), (11, 10), (10_000, 2000), (3, 2), (2001, 2000)])
def test_downsample_indices_bounded_and_keep_first_and_last(n: int, max_points: int) -> None:
    idx = downsample_indices(n, max_points)
    assert len(idx) <= max_points
    assert idx == sorted(set(idx))
    if n:
        assert idx[0] == 0 and idx[-1] == n - 1
    if n <= max_points:
        assert idx == list(range(n))


def test_downsample_keeps_the_last_point_of_a_long_series() -> None:
    xs = list(range(1, 10_001))
    ys = [1.0 / x for x in xs]
    dx, dy = downsample(xs, ys, 2000)
    assert len(dx) <= 2000 and dx[-1] == 10_000 and dy[-1] == pytest.approx(1e-4)
    assert dx[0] == 1


def test_downsample_rejects_a_useless_bound() -> None:
    with pytest.raises(ValueError):
        downsample_indices(5, 1)


def test_finite_and_floats_treat_none_nan_inf_as_missing() -> None:
    assert figures.finite(None) is None and figures.finite(float("nan")) is None
    assert figures.finite(float("inf")) is None and figures.finite("x") is None
    assert figures.finite(2) == 2.0
    arr = figures.floats([1, None, float("nan"), float("-inf"), 2.5])
    assert [None if math.isnan(v) else v for v in arr] == [1.0, None, None, None, 2.5]
    assert figures.cumulative([1, None, float("nan"), 2]) == [1.0, 1.0, 1.0, 3.0]


# ------------------------------------------------------------- validation


def test_loss_vs_round_points_accuracy_axis_and_event_markers() -> None:
    rounds = [rnd(1, val_loss=2.0, val_accuracy=0.1), rnd(2, val_loss=None, val_accuracy=None),
              rnd(3, val_loss=float("nan"), val_accuracy=0.3), rnd(4, val_loss=1.0, val_accuracy=0.5)]
    events = [{"round": 2, "kind": "timeout", "datacenter": "eu", "detail": "late"},
              {"round": 4, "kind": "timeout", "datacenter": "us", "detail": None},
              {"round": 3, "kind": "checkpoint", "datacenter": None, "detail": {"uri": "x"}},
              {"round": None, "kind": "run-failed", "datacenter": None, "detail": "boom"}]
    fig = loss_vs_round(rounds, events)
    assert [t.name for t in fig.data] == ["validation loss", "validation accuracy", "event: timeout", "event: checkpoint"]
    loss = trace(fig, "validation loss")
    assert list(loss.x) == [1, 4] and list(loss.y) == [2.0, 1.0]  # None and NaN left out, not drawn as 0
    acc = trace(fig, "validation accuracy")
    assert list(acc.x) == [1, 3, 4] and acc.yaxis == "y2"
    timeouts = trace(fig, "event: timeout")
    assert list(timeouts.x) == [2, 4]
    # A marker sits on the loss curve: the last known loss at or before its round.
    assert list(timeouts.y) == [2.0, 1.0]
    assert "eu" in timeouts.text[0] and "late" in timeouts.text[0]
    assert list(trace(fig, "event: checkpoint").y) == [2.0]


def test_loss_vs_round_without_accuracy_or_events_has_one_trace() -> None:
    fig = loss_vs_round([rnd(r, val_loss=1.0 / r) for r in range(1, 6)])
    assert [t.name for t in fig.data] == ["validation loss"]
    assert len(fig.data[0].x) == 5


def test_loss_vs_round_downsamples_and_keeps_the_last_round() -> None:
    rounds = [rnd(r, val_loss=1.0 / r) for r in range(1, 10_001)]
    fig = loss_vs_round(rounds, max_points=2000)
    loss = fig.data[0]
    assert len(loss.x) <= 2000 and loss.x[-1] == 10_000 and loss.y[-1] == pytest.approx(1e-4)


def test_loss_vs_bytes_and_wall_time_use_cumulative_sums() -> None:
    rounds = [rnd(1, val_loss=3.0, bytes_up=100, bytes_down=50, wall_s=2.0),
              rnd(2, val_loss=None, bytes_up=100, bytes_down=50, wall_s=None),
              rnd(3, val_loss=1.0, bytes_up=100, bytes_down=50, wall_s=3.0)]
    by_bytes = loss_vs_bytes(rounds).data[0]
    assert list(by_bytes.x) == [150.0, 450.0] and list(by_bytes.y) == [3.0, 1.0]
    by_time = loss_vs_wall_time(rounds).data[0]
    assert list(by_time.x) == [2.0, 5.0]


# ----------------------------------------------------------------- bytes, τ


def test_bytes_per_round_shows_raw_only_when_compressed() -> None:
    rounds = [rnd(r, bytes_up=10, bytes_down=40, bytes_up_raw=40) for r in (1, 2, 3)]
    compressed = bytes_per_round(rounds, compression=True)
    assert [t.name for t in compressed.data] == ["uplink sent", "uplink raw (fp32)", "downlink sent"]
    assert list(trace(compressed, "uplink raw (fp32)").y) == [40.0, 40.0, 40.0]
    assert [t.name for t in bytes_per_round(rounds, compression=False).data] == ["uplink sent", "downlink sent"]
    # Left to guess: raw > sent means a codec shrank the update.
    assert len(bytes_per_round(rounds).data) == 3
    framed = [rnd(1, bytes_up=1464, bytes_up_raw=544, bytes_down=1442)]  # no codec: framing makes sent > raw
    assert len(bytes_per_round(framed).data) == 2


def test_figures_config_helper_reads_the_codec_list() -> None:
    assert figures.has_compression({"compression": {"codecs": ["topk:0.01"]}})
    assert not figures.has_compression({"compression": {"codecs": []}})
    assert not figures.has_compression({}) and not figures.has_compression(None)


def test_tau_schedule_is_a_step_line_of_the_recorded_tau() -> None:
    fig = tau_schedule([rnd(1, tau=2), rnd(2, tau=5), rnd(3, tau=None), rnd(4, tau=8)])
    assert len(fig.data) == 1 and list(fig.data[0].x) == [1, 2, 4] and list(fig.data[0].y) == [2, 5, 8]
    assert fig.data[0].line.shape == "hv"
    assert "no τ recorded" in annotations(tau_schedule([rnd(1)]))


# ------------------------------------------------------------ datacenters

DC_ROWS = [
    # us: comm/comp = (0.1 + 0.3) / (2 + 2) = 0.1 exactly: at the line, not above it.
    dcr(1, "us", compute_s=2.0, comm_s=0.1, overhead_s=1.0, drift_l2=0.5, bytes_up=10, bytes_up_raw=40),
    dcr(2, "us", compute_s=2.0, comm_s=0.3, overhead_s=3.0, drift_l2=float("nan"), bytes_up=10, bytes_up_raw=40),
    # eu: comm/comp = 1 / 2 = 0.5, above the alert.
    dcr(1, "eu", compute_s=1.0, comm_s=0.5, overhead_s=0.0, drift_l2=0.2),
    dcr(2, "eu", compute_s=1.0, comm_s=0.5, overhead_s=0.0, drift_l2=0.4),
    dcr(3, "eu", status="timeout"),
    # sim: comm never measured (a simulation): "not measured", never 0.
    dcr(1, "sim", compute_s=1.0, comm_s=None, overhead_s=0.5),
]


def test_summarize_datacenters_totals_medians_and_ratio() -> None:
    summary = {s["datacenter"]: s for s in summarize_datacenters(DC_ROWS)}
    assert list(summary) == ["eu", "sim", "us"]
    assert set(summary["us"]) == set(figures.SUMMARY_KEYS)
    us, eu, sim = summary["us"], summary["eu"], summary["sim"]
    assert us["compute_s_total"] == 4.0 and us["overhead_s_median"] == 2.0 and us["comm_s_mean"] == pytest.approx(0.2)
    assert us["comm_comp_ratio"] == pytest.approx(0.1)
    assert us["bytes_up"] == 20 and us["bytes_up_raw"] == 80 and us["drift_l2_last"] == 0.5
    assert eu["rounds"] == 3 and eu["ok"] == 2 and eu["timeout"] == 1 and eu["comm_comp_ratio"] == pytest.approx(0.5)
    assert sim["comm_s_total"] is None and sim["comm_comp_ratio"] is None and sim["comm_measured"] == 0


def test_comm_comp_ratio_draws_the_alert_line_and_highlights_the_datacenter_above_it() -> None:
    fig = comm_comp_ratio(DC_ROWS)
    assert len(fig.data) == 1
    bars = fig.data[0]
    assert list(bars.x) == ["eu", "sim", "us"]
    assert list(bars.y) == pytest.approx([0.5, 0.0, 0.1])
    assert list(bars.marker.color) == [ALERT_COLOR, NOT_MEASURED_COLOR, OK_COLOR]
    assert list(bars.text)[1] == "not measured"
    lines = [s for s in fig.layout.shapes if s.y0 == s.y1]
    assert [(s.y0, s.y1) for s in lines] == [(COMM_COMP_ALERT, COMM_COMP_ALERT)]
    # A custom alert moves the line and the highlighting.
    strict = comm_comp_ratio(DC_ROWS, alert=0.05)
    assert list(strict.data[0].marker.color) == [ALERT_COLOR, NOT_MEASURED_COLOR, ALERT_COLOR]
    assert strict.layout.shapes[0].y0 == 0.05


def test_comm_comp_ratio_accepts_summary_rows_too() -> None:
    fig = comm_comp_ratio(summarize_datacenters(DC_ROWS))
    assert list(fig.data[0].y) == pytest.approx([0.5, 0.0, 0.1])


def test_time_breakdown_stacks_mean_compute_comm_overhead() -> None:
    fig = time_breakdown(DC_ROWS)
    assert fig.layout.barmode == "stack"
    assert [t.name for t in fig.data] == ["compute", "communication (WAN)", "overhead"]
    assert all(list(t.x) == ["eu", "sim", "us"] for t in fig.data)
    assert list(trace(fig, "compute").y) == pytest.approx([1.0, 1.0, 2.0])
    assert list(trace(fig, "communication (WAN)").y) == pytest.approx([0.5, 0.0, 0.2])
    assert list(trace(fig, "overhead").y) == pytest.approx([0.0, 0.5, 2.0])
    assert list(trace(fig, "communication (WAN)").customdata)[1] == "not measured"
    assert [a.x for a in fig.layout.annotations if a.text == "comm not measured"] == ["sim"]


def test_drift_has_one_trace_per_datacenter_with_measured_values_only() -> None:
    fig = drift_per_datacenter(DC_ROWS)
    assert [t.name for t in fig.data] == ["eu", "us"]  # sim never measured drift
    assert list(trace(fig, "eu").x) == [1, 2] and list(trace(fig, "us").x) == [1]  # NaN and None left out
    assert "no drift measured" in annotations(drift_per_datacenter([dcr(1, "a")]))


def test_drift_downsamples_each_datacenter_and_keeps_its_last_round() -> None:
    rows = [dcr(r, name, drift_l2=float(r)) for r in range(1, 5001) for name in ("a", "b")]
    rows += [dcr(5001, "a", drift_l2=9.0)]
    fig = drift_per_datacenter(rows, max_points=500)
    assert all(250 < len(t.x) <= 500 for t in fig.data)
    assert trace(fig, "a").x[-1] == 5001 and trace(fig, "b").x[-1] == 5000


def test_empty_datacenter_figures_say_so() -> None:
    assert "no datacenter rounds yet" in annotations(time_breakdown([]))
    assert "no datacenter rounds yet" in annotations(comm_comp_ratio([]))


IDLE_ROWS = [
    # a: exposed comm/comp = (0.25 + 0.75) / (5 + 5) = 0.1 exactly (at the line, not above it), utilisation 10 / 11;
    # a round without compute_s and a rejected one are left out.
    dcr(1, "a", compute_s=5.0, idle_s=0.25),
    dcr(2, "a", compute_s=5.0, idle_s=0.75),
    dcr(3, "a", compute_s=None, idle_s=1.0),
    dcr(4, "a", status="rejected", compute_s=5.0, idle_s=5.0),
    # b: 0.5 / 2 = 0.25, above the alert; utilisation 2 / 2.5 = 0.8.
    dcr(1, "b", compute_s=2.0, idle_s=0.5),
    # c: idle_s never measured.
    dcr(1, "c", compute_s=2.0),
]


def test_summarize_datacenters_exposed_comm_comp_and_utilisation() -> None:
    summary = {s["datacenter"]: s for s in summarize_datacenters(IDLE_ROWS)}
    assert summary["a"]["exposed_comm_comp_ratio"] == 0.1 and summary["a"]["trainer_utilisation"] == 10 / 11
    assert summary["b"]["exposed_comm_comp_ratio"] == 0.25 and summary["b"]["trainer_utilisation"] == 0.8
    assert summary["c"]["exposed_comm_comp_ratio"] is None and summary["c"]["trainer_utilisation"] is None
    assert figures.utilisation(0.0, 0.0) is None and figures.utilisation(3.0, 1.0) == 0.75


def test_exposed_comm_comp_ratio_is_drawn_like_comm_comp_with_its_alert_line() -> None:
    fig = exposed_comm_comp_ratio(IDLE_ROWS)
    (bars,) = fig.data
    assert bars.name == "exposed comm/comp" and list(bars.x) == ["a", "b", "c"]
    assert list(bars.y) == [0.1, 0.25, 0.0]
    assert list(bars.marker.color) == [OK_COLOR, ALERT_COLOR, NOT_MEASURED_COLOR]
    assert list(bars.text) == ["0.1", "0.25 ⚠", "not measured"]
    assert [(s.y0, s.y1) for s in fig.layout.shapes] == [(COMM_COMP_ALERT, COMM_COMP_ALERT)]
    assert fig.layout.title.text.startswith("Exposed comm/comp") and fig.layout.yaxis.title.text == "idle_s / compute_s"
    assert list(exposed_comm_comp_ratio(IDLE_ROWS, alert=0.05).data[0].marker.color)[0] == ALERT_COLOR
    # the same from summary rows; and the comm/comp figure of the same rows is unchanged by idle_s
    assert list(exposed_comm_comp_ratio(summarize_datacenters(IDLE_ROWS)).data[0].y) == [0.1, 0.25, 0.0]
    assert comm_comp_ratio(IDLE_ROWS).data[0].name == "comm/comp"
    assert "no datacenter rounds yet" in annotations(exposed_comm_comp_ratio([]))


def span(datacenter: str, kind: str, start_s: float, end_s: float, round_: int = 1, **more: Any) -> dict[str, Any]:
    """A ``timeline_spans`` row."""
    return {"round": round_, "datacenter": datacenter, "kind": kind, "start_s": start_s, "end_s": end_s,
            "fragment": None, "exchange": None, **more}


def test_timeline_has_one_bar_trace_per_kind_one_row_per_datacenter() -> None:
    spans = [
        span("us", "compute", 0.0, 4.0), span("us", "wait", 4.0, 4.5), span("us", "up", 3.0, 4.25, fragment=0, exchange=1),
        span("eu", "compute", 0.5, 4.5), span("eu", "down", 4.5, 5.0, round_=2, fragment=1, exchange=2),
        span("eu", "compute", 5.0, 9.0, round_=2),
        span("eu", "sleep", 0.0, 1.0), span("us", "wait", float("nan"), 1.0),  # left out
    ]
    fig = timeline(spans)
    assert [t.name for t in fig.data] == ["compute", "wait", "up", "down"] == list(TIMELINE_SPAN_KINDS)
    assert all(t.type == "bar" and t.orientation == "h" for t in fig.data)
    compute = trace(fig, "compute")
    assert list(compute.y) == ["us", "eu", "eu"]
    assert list(compute.base) == [0.0, 0.5, 5.0] and list(compute.x) == [4.0, 4.0, 4.0]
    assert list(trace(fig, "wait").x) == [0.5] and list(trace(fig, "up").base) == [3.0]
    assert "fragment 1 · exchange 2" in trace(fig, "down").customdata[0]
    assert {t.name: t.marker.color for t in fig.data} == TIMELINE_COLORS
    assert [t.offsetgroup for t in fig.data] == ["trainer", "trainer", "up", "down"]  # compute and wait share a lane
    assert list(fig.layout.yaxis.categoryarray) == ["eu", "us"] and fig.layout.yaxis.autorange == "reversed"
    assert fig.layout.xaxis.title.text == "seconds since the run's start"
    assert not annotations(fig)


def test_timeline_keeps_the_newest_spans_and_says_when_there_are_none() -> None:
    spans = [span("a", "compute", float(i), i + 0.5) for i in range(100)] + [span("b", "wait", 99.5, 100.0)]
    fig = timeline(spans, max_spans=10)
    assert sum(len(t.x) for t in fig.data) == 10
    assert list(trace(fig, "compute").base) == [float(i) for i in range(91, 100)] and list(trace(fig, "wait").y) == ["b"]
    empty = timeline([])
    assert not empty.data and "no timeline recorded" in annotations(empty)


# -------------------------------------------------------------- staleness


def test_staleness_histogram_counts_exactly_by_status() -> None:
    updates = [{"staleness": s, "status": st} for s, st in
               [(0, "applied"), (0, "applied"), (1, "applied"), (3, "applied"), (5, "discarded"), (5, "discarded")]]
    fig = staleness_histogram(updates)
    assert [t.name for t in fig.data] == ["applied", "discarded"]
    assert list(fig.data[0].x) == [0, 1, 3] and list(fig.data[0].y) == [2, 1, 1]
    assert list(fig.data[1].x) == [5] and list(fig.data[1].y) == [2]
    grouped = staleness_histogram([{"staleness": 0, "status": "applied", "count": 7}])
    assert list(grouped.data[0].y) == [7]


def test_staleness_histogram_of_a_synchronous_run_says_no_async_updates() -> None:
    fig = staleness_histogram([])
    assert len(fig.data) == 0 and annotations(fig) == ["no async updates"]


# ---------------------------------------------------------------- compare


def test_compare_runs_overlays_one_trace_per_run_on_rounds_and_bytes() -> None:
    fedavg = [rnd(r, val_loss=2.0 / r, val_accuracy=0.1 * r, bytes_up=100, bytes_down=100) for r in (1, 2, 3)]
    scaffold = [rnd(r, val_loss=1.5 / r, bytes_up=200, bytes_down=200) for r in (1, 2, 3, 4, 5)]
    runs = {"FedAvg": fedavg, "SCAFFOLD": scaffold}
    by_round = compare_runs(runs)
    assert [t.name for t in by_round.data] == ["FedAvg", "SCAFFOLD"]
    assert [len(t.x) for t in by_round.data] == [3, 5]
    by_bytes = compare_runs(runs, x="bytes")
    assert list(by_bytes.data[1].x) == [400.0, 800.0, 1200.0, 1600.0, 2000.0]
    by_acc = compare_runs(runs, metric="val_accuracy")
    assert [len(t.x) for t in by_acc.data] == [3, 0]


# ------------------------------------------------------------------ JSON


def test_figures_serialise_to_plotly_json_without_nan() -> None:
    fig = loss_vs_round([rnd(1, val_loss=float("nan")), rnd(2, val_loss=1.0)])
    text = figures.figure_json(fig)
    assert "NaN" not in text and "Infinity" not in text
    parsed = json.loads(text)
    assert set(parsed) >= {"data", "layout"}
    assert len(text) < 5000  # a small template of our own, not plotly's 8 kB default
