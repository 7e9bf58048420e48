"""Plotly figures of the dashboard, built from query results (lists of row dicts).

Every function here is pure: it takes rows as returned by :mod:`crossdc.db.queries`
(or the JSON API, whose field names are the column names) and returns a
``plotly.graph_objects.Figure``. Nothing here touches a database, so researchers can
use the same charts in a notebook::

    from crossdc.db.engine import make_engine
    from crossdc.db import queries
    from crossdc.dashboard import figures

    engine = make_engine("sqlite:///crossdc.db")
    rounds = queries.list_rounds(engine, run_id)
    figures.loss_vs_round(rounds, events=queries.list_events(engine, run_id)).show()
    figures.comm_comp_ratio(queries.list_datacenter_rounds(engine, run_id)).show()

Promises shared by all figures:

* a missing value (``None``, NaN or ±Inf) is left out of its trace, never drawn as 0;
* no trace holds more than ``max_points`` points (default :data:`MAX_POINTS`): longer
  series are stride-downsampled, always keeping the first and the last point;
* traces have stable names (tests and notebooks find them by name), and an empty
  figure says why in an annotation ("no async updates", ...);
* vocabulary follows docs/glossary.md: the comm/comp ratio is ``comm_s / compute_s`` and the
  exposed comm/comp ``idle_s / compute_s``, each with an alert above :data:`COMM_COMP_ALERT`;
  ``overhead_s`` is shown on its own; a ``comm_s`` or ``idle_s`` that was never measured
  (simulation) is shown as "not measured", not as 0.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from crossdc.db.models import MICROBATCH_SPAN_KINDS, SPAN_KINDS, TIMELINE_SPAN_KINDS
from crossdc.db.values import finite_float

Row = Mapping[str, Any]

#: Most points one trace may hold; longer series are stride-downsampled (last point kept).
MAX_POINTS = 2000
#: The comm/comp ratio (comm_s / compute_s) above which a datacenter is flagged (docs/glossary.md).
COMM_COMP_ALERT = 0.1

#: Stable ids of the figures' divs on the dashboard pages.
FIGURE_IDS: dict[str, str] = {
    "loss_vs_round": "fig-loss-round",
    "loss_vs_bytes": "fig-loss-bytes",
    "loss_vs_wall_time": "fig-loss-wall",
    "bytes_per_round": "fig-bytes-round",
    "time_breakdown": "fig-time-breakdown",
    "comm_comp_ratio": "fig-comm-comp",
    "exposed_comm_comp_ratio": "fig-exposed-comm-comp",
    "timeline": "fig-timeline",
    "pipeline_timeline": "fig-pipeline-timeline",
    "pipeline_bubble": "fig-pipeline-bubble",
    "drift_per_datacenter": "fig-drift",
    "staleness_histogram": "fig-staleness",
    "staleness_over_time": "fig-staleness-time",
    "tau_schedule": "fig-tau",
    "compare_round": "fig-compare-round",
    "compare_bytes": "fig-compare-bytes",
    "compare_accuracy": "fig-compare-accuracy",
}

ALERT_COLOR = "#d62728"
OK_COLOR = "#1f77b4"
NOT_MEASURED_COLOR = "#b0b0b0"
COMPUTE_COLOR = "#2ca02c"
COMM_COLOR = "#ff7f0e"
OVERHEAD_COLOR = "#9e9e9e"
#: The timeline's colour of each span kind (crossdc.db.models.TIMELINE_SPAN_KINDS: compute, wait, up, down).
TIMELINE_COLORS: dict[str, str] = dict(zip(TIMELINE_SPAN_KINDS, (COMPUTE_COLOR, ALERT_COLOR, COMM_COLOR, "#9467bd"),
                                           strict=True))
#: The timeline's colour of a pipeline stage's micro-batch spans (crossdc.db.models.MICROBATCH_SPAN_KINDS).
MICROBATCH_COLORS: dict[str, str] = dict(zip(MICROBATCH_SPAN_KINDS, ("#1f77b4", "#e377c2"), strict=True))
#: The colour of every kind a span may have (crossdc.db.models.SPAN_KINDS).
_SPAN_COLORS: dict[str, str] = {**TIMELINE_COLORS, **MICROBATCH_COLORS}
#: The lane of each span kind in a datacenter's row: the trainer's (compute, wait, and a stage's forward and
#: backward, which never overlap them), then one per transfer (up, down).
_TIMELINE_LANES: dict[str, str] = dict(zip(SPAN_KINDS, ("trainer", "trainer", "up", "down", "trainer", "trainer"),
                                           strict=True))
#: What a span's hover text names after its times, when the span has it: the column, and how it is called.
_SPAN_PLACES: tuple[tuple[str, str], ...] = (
    ("round", "round"), ("fragment", "fragment"), ("exchange", "exchange"), ("step", "step"),
    ("microbatch", "micro-batch"),
)
_COLORWAY = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
]

# A small template of our own: plotly's default one weighs ~8 kB of JSON per figure.
_TEMPLATE = go.layout.Template(
    layout=dict(
        font=dict(family="system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", size=12, color="#222"),
        colorway=_COLORWAY,
        paper_bgcolor="white",
        plot_bgcolor="white",
        margin=dict(l=60, r=30, t=78, b=50),
        hovermode="closest",
        legend=dict(orientation="h", yanchor="bottom", y=1.01, xanchor="left", x=0, traceorder="normal"),
        xaxis=dict(gridcolor="#ececec", zerolinecolor="#d0d0d0", linecolor="#999", automargin=True),
        yaxis=dict(gridcolor="#ececec", zerolinecolor="#d0d0d0", linecolor="#999", automargin=True),
    )
)

_TEMPLATE_JSON: dict[str, Any] = _TEMPLATE.to_plotly_json()

# Event kinds by family, for marker colour and symbol on the timeline.
_EVENT_STYLES: list[tuple[tuple[str, ...], str, str]] = [
    (("checkpoint",), "#2ca02c", "diamond"),
    (("restart", "resume", "rejoin", "ready"), "#1f77b4", "triangle-up"),
    (("timeout", "drop", "link-", "cut"), "#ff7f0e", "x"),
    (("reject", "fail", "diverged", "unknown", "without"), "#d62728", "x"),
]


# ----------------------------------------------------------------- helpers


#: ``value`` as a float, or ``None`` when it is missing, not a number, NaN or ±Inf (the run log's one rule).
finite = finite_float


def floats(values: Iterable[Any]) -> np.ndarray:
    """``values`` as a float64 array in which every missing or non-finite value is NaN."""
    values = list(values)
    try:
        arr = np.array(values, dtype=float)  # None becomes NaN
    except (TypeError, ValueError):
        arr = np.array([np.nan if (f := finite(v)) is None else f for v in values], dtype=float)
    if arr.ndim != 1:
        arr = np.array([np.nan if (f := finite(v)) is None else f for v in values], dtype=float)
    arr[~np.isfinite(arr)] = np.nan
    return arr


def downsample_indices(n: int, max_points: int = MAX_POINTS) -> list[int]:
    """Indices of at most ``max_points`` of ``n`` points, evenly strided, first and last included."""
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    if n <= max_points:
        return list(range(n))
    stride = math.ceil((n - 1) / (max_points - 1))
    return list(range(0, n - 1, stride))[: max_points - 1] + [n - 1]


def downsample(xs: Sequence[Any], ys: Sequence[Any], max_points: int = MAX_POINTS) -> tuple[list[Any], list[Any]]:
    """``(xs, ys)`` stride-downsampled to at most ``max_points`` points, keeping the last one."""
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length ({len(xs)} != {len(ys)})")
    idx = downsample_indices(len(xs), max_points)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def cumulative(values: Iterable[Any]) -> list[float]:
    """Running sums of ``values``; a missing value adds nothing."""
    arr = floats(values)
    return np.where(np.isnan(arr), 0.0, arr).cumsum().tolist()


def _points(xs: Sequence[Any], ys: Sequence[Any], max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """The (x, y) pairs whose y is finite, downsampled, as numpy arrays.

    Numpy arrays keep plotly fast (no per-element validation) and its JSON small (typed arrays).
    """
    y = floats(ys)
    x = np.asarray(list(xs))
    if len(x) != len(y):
        raise ValueError(f"xs and ys differ in length ({len(x)} != {len(y)})")
    keep = ~np.isnan(y)
    x, y = x[keep], y[keep]
    idx = np.asarray(downsample_indices(len(y), max_points), dtype=np.int64)
    return x[idx], y[idx]


def _mode(n: int) -> str:
    return "lines+markers" if n <= 60 else "lines"


def _figure(title: str, xaxis: str, yaxis: str, **layout: Any) -> go.Figure:
    """An empty figure in the dashboard's style (built in one go: plotly's setters are slow)."""
    return go.Figure(layout=dict(
        template=_TEMPLATE_JSON,
        title=dict(text=title, x=0.01, xanchor="left", xref="container", y=0.97, yanchor="top",
                   yref="container", font=dict(size=14)),
        xaxis=dict(title=dict(text=xaxis)),
        yaxis=dict(title=dict(text=yaxis)),
        **layout,
    ))


def _round_axis(fig: go.Figure, xs: Sequence[Any]) -> None:
    """Whole-number ticks on a round axis (no "1.5" rounds) when few rounds span it."""
    if len(xs) and float(max(xs)) - float(min(xs)) <= 12:
        fig.update_xaxes(dtick=1, tickformat="d")


def _note(fig: go.Figure, text: str) -> go.Figure:
    """Mark ``fig`` as empty with a centred message, axes hidden."""
    fig.add_annotation(
        text=text, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
        font=dict(size=14, color="#777"), name="empty",
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def figure_json(fig: go.Figure) -> str:
    """The figure as plotly JSON text (``{"data": [...], "layout": {...}}``), unvalidated for speed."""
    return pio.to_json(fig, validate=False)


def _event_style(kind: str) -> tuple[str, str]:
    lowered = kind.lower()
    for needles, color, symbol in _EVENT_STYLES:
        if any(n in lowered for n in needles):
            return color, symbol
    return "#7f7f7f", "circle"


def _short(value: Any, limit: int = 120) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------- validation metric


def _metric_traces(
    fig: go.Figure, xs: Sequence[Any], rounds: Sequence[Row], max_points: int, x_label: str
) -> int:
    """Add the validation loss (left axis) and accuracy (right axis) traces; returns their count."""
    added = 0
    lx, ly = _points(xs, [r.get("val_loss") for r in rounds], max_points)
    fig.add_trace(go.Scatter(
        x=lx, y=ly, name="validation loss", mode=_mode(len(lx)), line=dict(color=_COLORWAY[0], width=2),
        hovertemplate=f"{x_label} %{{x}}<br>loss %{{y:.4g}}<extra></extra>",
    ))
    added += 1
    ax, ay = _points(xs, [r.get("val_accuracy") for r in rounds], max_points)
    if len(ax):
        fig.add_trace(go.Scatter(
            x=ax, y=ay, name="validation accuracy", mode=_mode(len(ax)), yaxis="y2",
            line=dict(color=_COLORWAY[2], width=1.5, dash="dot"),
            hovertemplate=f"{x_label} %{{x}}<br>accuracy %{{y:.4g}}<extra></extra>",
        ))
        fig.update_layout(yaxis2=dict(title="validation accuracy", overlaying="y", side="right", showgrid=False,
                                      automargin=True, tickmode="auto", tickformat=".3~g", zeroline=False))
        fig.update_layout(margin_r=60)
        added += 1
    return added


def loss_vs_round(
    rounds: Sequence[Row], events: Sequence[Row] = (), *, max_points: int = MAX_POINTS
) -> go.Figure:
    """Validation loss (and accuracy, right axis) vs. round, with the run's events as markers.

    Traces, in order: "validation loss"; "validation accuracy" if any round has one; then
    one marker trace per event kind, named ``"event: KIND"``, each marker sitting on the
    loss curve at the event's round (events without a round are left out: see the table).
    """
    ordered = sorted(rounds, key=lambda r: r["round"])
    fig = _figure("Validation metric vs. round", "round", "validation loss")
    _metric_traces(fig, [r["round"] for r in ordered], ordered, max_points, "round")
    _round_axis(fig, [r["round"] for r in ordered] + [e["round"] for e in events if e.get("round") is not None])

    # Where a marker sits: the last known loss at or before the event's round.
    known = [(r["round"], finite(r.get("val_loss"))) for r in ordered]
    known = [(x, y) for x, y in known if y is not None]
    kx = [x for x, _ in known]

    def loss_at(round_: int) -> float:
        if not known:
            return 0.0
        i = bisect_right(kx, round_) - 1
        return known[max(i, 0)][1]

    by_kind: dict[str, list[Row]] = {}
    for event in events:
        if event.get("round") is not None:
            by_kind.setdefault(str(event.get("kind") or "event"), []).append(event)
    for kind, items in by_kind.items():
        items = sorted(items, key=lambda e: e["round"])
        color, symbol = _event_style(kind)
        ex = [int(e["round"]) for e in items]
        texts = [
            f"{kind} · round {e['round']}" + (f" · {e['datacenter']}" if e.get("datacenter") else "")
            + (f"<br>{_short(e.get('detail'))}" if e.get("detail") not in (None, "", {}) else "")
            for e in items
        ]
        idx = downsample_indices(len(items), max_points)
        fig.add_trace(go.Scatter(
            x=np.asarray([ex[i] for i in idx]), y=np.asarray([loss_at(ex[i]) for i in idx], dtype=float),
            text=[texts[i] for i in idx],
            name=f"event: {kind}", mode="markers",
            marker=dict(color=color, symbol=symbol, size=10, line=dict(width=1, color="white")),
            hovertemplate="%{text}<extra></extra>",
        ))
    return fig


def loss_vs_bytes(rounds: Sequence[Row], *, max_points: int = MAX_POINTS) -> go.Figure:
    """Validation loss (and accuracy) vs. cumulative payload bytes on the WAN (bytes_up + bytes_down)."""
    ordered = sorted(rounds, key=lambda r: r["round"])
    xs = cumulative((finite(r.get("bytes_up")) or 0) + (finite(r.get("bytes_down")) or 0) for r in ordered)
    fig = _figure("Validation metric vs. cumulative bytes", "cumulative bytes (up + down)", "validation loss")
    fig.update_xaxes(tickformat="~s", ticksuffix="B")
    _metric_traces(fig, xs, ordered, max_points, "bytes")
    return fig


def loss_vs_wall_time(rounds: Sequence[Row], *, max_points: int = MAX_POINTS) -> go.Figure:
    """Validation loss (and accuracy) vs. elapsed wall time: the cumulative sum of the rounds' ``wall_s``."""
    ordered = sorted(rounds, key=lambda r: r["round"])
    xs = cumulative(r.get("wall_s") for r in ordered)
    fig = _figure("Validation metric vs. wall time", "wall time (s, sum of round times)", "validation loss")
    _metric_traces(fig, xs, ordered, max_points, "s")
    return fig


# ------------------------------------------------------------ bytes, tau


def has_compression(config: Mapping[str, Any] | None) -> bool:
    """Whether a run's config (``runs.config``) compresses its uplink (``compression.codecs`` not empty)."""
    compression = (config or {}).get("compression") or {}
    return bool(compression.get("codecs")) if isinstance(compression, Mapping) else False


def bytes_per_round(
    rounds: Sequence[Row], *, compression: bool | None = None, max_points: int = MAX_POINTS
) -> go.Figure:
    """Payload bytes per round: uplink sent (``bytes_up``), downlink sent (``bytes_down``) and,
    when compression is on, the uplink's raw fp32 size (``bytes_up_raw``) beside it.

    ``compression=None`` guesses: raw is shown when some round's raw size exceeds what was sent.
    Traces, in order: "uplink sent", ["uplink raw (fp32)"], "downlink sent".
    """
    ordered = sorted(rounds, key=lambda r: r["round"])
    xs = [r["round"] for r in ordered]
    if compression is None:
        compression = any((finite(r.get("bytes_up_raw")) or 0) > (finite(r.get("bytes_up")) or 0) for r in ordered)
    fig = _figure("Bytes per round", "round", "bytes")
    fig.update_yaxes(tickformat="~s", ticksuffix="B", rangemode="tozero")
    _round_axis(fig, xs)
    series = [("uplink sent", "bytes_up", _COLORWAY[0], "solid")]
    if compression:
        series.append(("uplink raw (fp32)", "bytes_up_raw", _COLORWAY[3], "dot"))
    series.append(("downlink sent", "bytes_down", _COLORWAY[1], "solid"))
    for name, key, color, dash in series:
        px, py = _points(xs, [r.get(key) for r in ordered], max_points)
        fig.add_trace(go.Scatter(
            x=px, y=py, name=name, mode=_mode(len(px)), line=dict(color=color, dash=dash),
            hovertemplate=f"round %{{x}}<br>{name} %{{y:,.0f}} B<extra></extra>",
        ))
    return fig


def tau_schedule(rounds: Sequence[Row], *, max_points: int = MAX_POINTS) -> go.Figure:
    """Local steps τ per round (``rounds.tau``) as a step line; one trace named "tau"."""
    ordered = sorted(rounds, key=lambda r: r["round"])
    px, py = _points([r["round"] for r in ordered], [r.get("tau") for r in ordered], max_points)
    fig = _figure("τ schedule (local steps per round)", "round", "τ")
    _round_axis(fig, px)
    fig.update_yaxes(rangemode="tozero")
    fig.add_trace(go.Scatter(
        x=px, y=py, name="tau", mode=_mode(len(px)), line=dict(shape="hv", color=_COLORWAY[4]),
        hovertemplate="round %{x}<br>τ %{y}<extra></extra>",
    ))
    if not len(px):
        _note(fig, "no τ recorded")
    return fig


# ------------------------------------------------------ per datacenter

#: Keys of one row of :func:`summarize_datacenters` (and of ``page_data.datacenter_summary``).
SUMMARY_KEYS: tuple[str, ...] = (
    "datacenter", "rounds", "ok", "failed", "timeout", "rejected",
    "compute_s_total", "comm_s_total", "overhead_s_total",
    "compute_s_mean", "comm_s_mean", "overhead_s_mean",
    "compute_s_median", "comm_s_median", "overhead_s_median",
    "comm_measured", "comm_comp_ratio", "exposed_comm_comp_ratio", "trainer_utilisation",
    "bytes_up", "bytes_up_raw", "bytes_down", "drift_l2_last",
)


def comm_comp(comm_s_total: float | None, compute_s_total: float | None) -> float | None:
    """The comm/comp ratio ``comm_s / compute_s``, or ``None`` when comm was not measured or compute is 0.
    With ``idle_s`` for ``comm_s``: the exposed comm/comp."""
    if comm_s_total is None or compute_s_total is None or compute_s_total <= 0:
        return None
    return comm_s_total / compute_s_total


def utilisation(compute_s_total: float | None, idle_s_total: float | None) -> float | None:
    """Trainer utilisation ``compute_s / (compute_s + idle_s)``, or ``None`` when either was not measured or both are 0."""
    if compute_s_total is None or idle_s_total is None or compute_s_total + idle_s_total <= 0:
        return None
    return compute_s_total / (compute_s_total + idle_s_total)


def _sums_where_measured(a: np.ndarray, b: np.ndarray, keep: np.ndarray) -> tuple[float | None, float | None]:
    """(Σa, Σb) over the rows in ``keep`` where both were measured; ``(None, None)`` when there is none."""
    both = keep & ~np.isnan(a) & ~np.isnan(b)
    return (float(a[both].sum()), float(b[both].sum())) if both.any() else (None, None)


def summarize_datacenters(dc_rounds: Sequence[Row]) -> list[dict[str, Any]]:
    """One summary row per datacenter (by name) from its ``datacenter_rounds`` rows.

    Totals, means and medians of ``compute_s``, ``comm_s``, ``overhead_s`` are over the
    rounds where that value was measured; a component never measured is ``None``.
    ``comm_comp_ratio`` is Σcomm_s / Σcompute_s over the rounds where both were measured
    (``None`` when comm_s was never measured); ``exposed_comm_comp_ratio`` is Σidle_s /
    Σcompute_s and ``trainer_utilisation`` Σcompute_s / Σ(compute_s + idle_s), both over the
    ok rounds where idle_s and compute_s were measured (``None`` when idle_s never was).
    ``drift_l2_last`` is the latest measured drift.
    """
    groups: dict[str, list[Row]] = {}
    for row in dc_rounds:
        groups.setdefault(str(row["datacenter"]), []).append(row)
    out = []
    for name in sorted(groups):
        rows = sorted(groups[name], key=lambda r: r.get("round") or 0)
        summary: dict[str, Any] = {"datacenter": name, "rounds": len(rows)}
        statuses = [r.get("status") for r in rows]
        for status in ("ok", "failed", "timeout", "rejected"):
            summary[status] = statuses.count(status)
        columns = {key: floats(r.get(key) for r in rows) for key in ("compute_s", "comm_s", "overhead_s")}
        for key, arr in columns.items():
            values = arr[~np.isnan(arr)]
            summary[f"{key}_total"] = float(values.sum()) if len(values) else None
            summary[f"{key}_mean"] = float(values.mean()) if len(values) else None
            summary[f"{key}_median"] = float(np.median(values)) if len(values) else None
        comm, compute = columns["comm_s"], columns["compute_s"]
        summary["comm_measured"] = int((~np.isnan(comm)).sum())
        summary["comm_comp_ratio"] = comm_comp(*_sums_where_measured(comm, compute, np.ones(len(rows), dtype=bool)))
        ok = np.array([status == "ok" for status in statuses], dtype=bool)
        idle_total, compute_total = _sums_where_measured(floats(r.get("idle_s") for r in rows), compute, ok)
        summary["exposed_comm_comp_ratio"] = comm_comp(idle_total, compute_total)
        summary["trainer_utilisation"] = utilisation(compute_total, idle_total)
        for key in ("bytes_up", "bytes_up_raw", "bytes_down"):
            summary[key] = int(np.nansum(floats(r.get(key) for r in rows)))
        drifts = floats(r.get("drift_l2") for r in rows)
        drifts = drifts[~np.isnan(drifts)]
        summary["drift_l2_last"] = float(drifts[-1]) if len(drifts) else None
        out.append(summary)
    return out


def _as_summary(rows: Sequence[Row]) -> list[Row]:
    """Summary rows as they are, or per-round ``datacenter_rounds`` rows summarised."""
    if rows and "compute_s_total" not in rows[0]:
        return summarize_datacenters(rows)
    return sorted(rows, key=lambda r: str(r["datacenter"]))


def time_breakdown(dc_rows: Sequence[Row]) -> go.Figure:
    """Where each datacenter's round time goes: mean ``compute_s``, ``comm_s`` and ``overhead_s``
    per round, as stacked bars (x = datacenter).

    Takes ``datacenter_rounds`` rows or rows of :func:`summarize_datacenters`. Traces, in
    order: "compute", "communication (WAN)", "overhead"; a datacenter whose comm_s was
    never measured gets 0 there and a "comm not measured" label above its bar.
    """
    summary = _as_summary(dc_rows)
    names = [s["datacenter"] for s in summary]
    fig = _figure("Where round time goes (mean per round)", "datacenter", "seconds per round", barmode="stack")
    parts = [("compute", "compute_s", COMPUTE_COLOR), ("communication (WAN)", "comm_s", COMM_COLOR),
             ("overhead", "overhead_s", OVERHEAD_COLOR)]
    for label, key, color in parts:
        values = [finite(s.get(f"{key}_mean")) for s in summary]
        fig.add_trace(go.Bar(
            x=names, y=[v or 0.0 for v in values], name=label, marker_color=color,
            customdata=["not measured" if v is None else f"{v:.4g} s" for v in values],
            hovertemplate=f"%{{x}}<br>{label}: %{{customdata}}<extra></extra>",
        ))
    for s in summary:
        if finite(s.get("comm_s_mean")) is None:
            top = sum(finite(s.get(f"{k}_mean")) or 0.0 for k in ("compute_s", "comm_s", "overhead_s"))
            fig.add_annotation(x=s["datacenter"], y=top, text="comm not measured", showarrow=False,
                               yshift=10, font=dict(size=11, color="#777"), name="not-measured")
    if not summary:
        _note(fig, "no datacenter rounds yet")
    return fig


def comm_comp_ratio(dc_rows: Sequence[Row], alert: float = COMM_COMP_ALERT, *, key: str = "comm_comp_ratio",
                    name: str = "comm/comp", title: str = "Comm/comp ratio", yaxis: str = "comm_s / compute_s") -> go.Figure:
    """The comm/comp ratio (Σcomm_s / Σcompute_s) per datacenter, with the alert line at ``alert``.

    Takes ``datacenter_rounds`` rows or rows of :func:`summarize_datacenters`. One bar
    trace named ``name`` ("comm/comp"); bars above ``alert`` are coloured :data:`ALERT_COLOR`, the
    others :data:`OK_COLOR`; a datacenter whose comm_s was never measured gets an empty
    grey bar labelled "not measured". The alert is a dashed horizontal line (a layout shape
    with ``y0 == y1 == alert``). ``key`` (a ratio of the summary rows), ``title`` and ``yaxis``
    draw another ratio the same way: :func:`exposed_comm_comp_ratio`.
    """
    summary = _as_summary(dc_rows)
    names = [s["datacenter"] for s in summary]
    ratios = [finite(s.get(key)) for s in summary]
    colors = [NOT_MEASURED_COLOR if r is None else (ALERT_COLOR if r > alert else OK_COLOR) for r in ratios]
    labels = ["not measured" if r is None else (f"{r:.3g} ⚠" if r > alert else f"{r:.3g}") for r in ratios]
    fig = _figure(f"{title} per datacenter (alert above {alert:g})", "datacenter", yaxis)
    fig.add_trace(go.Bar(
        x=names, y=[r or 0.0 for r in ratios], name=name, marker_color=colors,
        text=labels, textposition="outside", cliponaxis=False,
        hovertemplate=f"%{{x}}<br>{name} %{{text}}<extra></extra>",
    ))
    fig.add_hline(y=alert, line=dict(color=ALERT_COLOR, dash="dash", width=1.5))
    fig.add_annotation(x=1, xref="paper", xanchor="left", y=alert, yref="y", text=f"alert {alert:g}",
                       showarrow=False, font=dict(color=ALERT_COLOR, size=11), name="alert")
    fig.update_layout(margin_r=70)
    top = max([alert] + [r for r in ratios if r is not None])
    fig.update_yaxes(range=[0, top * 1.25], rangemode="tozero")
    fig.update_layout(showlegend=False)
    if not summary:
        _note(fig, "no datacenter rounds yet")
    return fig


def exposed_comm_comp_ratio(dc_rows: Sequence[Row], alert: float = COMM_COMP_ALERT) -> go.Figure:
    """The exposed comm/comp (Σidle_s / Σcompute_s over the ok rounds where both were measured) per datacenter:
    the WAN and coordinator time its trainer waited for, as :func:`comm_comp_ratio` draws it (one bar trace named
    "exposed comm/comp", the alert line at ``alert``, "not measured" where idle_s never was)."""
    return comm_comp_ratio(dc_rows, alert, key="exposed_comm_comp_ratio", name="exposed comm/comp",
                           title="Exposed comm/comp", yaxis="idle_s / compute_s")


def timeline(spans: Sequence[Row], *, max_spans: int = MAX_POINTS, lanes: Mapping[str, str] | None = None,
             title: str = "Timeline per datacenter", yaxis: str = "datacenter",
             empty: str = "no timeline recorded") -> go.Figure:
    """What each datacenter's trainer did and what was in flight, against seconds since the run's start.

    Takes ``timeline_spans`` rows (``datacenter``, ``kind``, ``start_s``, ``end_s``, and ``round``, ``fragment``,
    ``exchange``, ``step``, ``microbatch`` for the hover text). A Gantt-like chart of horizontal bars: one row per
    datacenter (by name, top to bottom), one bar trace per kind present, in the order of ``SPAN_KINDS`` and named
    after it ("compute", "wait", "up", "down", then a pipeline stage's "forward" and "backward"), coloured by
    :data:`TIMELINE_COLORS` and :data:`MICROBATCH_COLORS`; a bar spans [start_s, end_s]. In each row the trainer's
    spans (compute, wait, forward, backward) share one lane and the transfers (up, down) have one each, so that what
    overlaps stays visible. Only the newest ``max_spans`` spans (the latest ``start_s``) are drawn; spans of another
    kind or without finite times are left out. No span: a figure that says ``empty`` ("no timeline recorded").

    ``lanes`` (datacenter → row label, in the order the rows go top to bottom) names and orders the rows instead:
    each of its rows is drawn, with spans or not, then any other datacenter's by name; ``title`` and ``yaxis`` name
    the chart and its rows (a pipeline run's stages: :func:`pipeline_timeline`).
    """
    usable = [s for s in spans if s.get("kind") in _SPAN_COLORS
              and finite(s.get("start_s")) is not None and finite(s.get("end_s")) is not None]
    if len(usable) > max_spans:
        usable = sorted(usable, key=lambda s: float(s["start_s"]))[-max_spans:]
    labels = dict(lanes or {})
    others = sorted({str(s["datacenter"]) for s in usable} - set(labels))
    names = ([labels[name] for name in labels] if usable else []) + others
    fig = _figure(title, "seconds since the run's start", yaxis, barmode="group", bargap=0.25, bargroupgap=0.05)
    fig.update_yaxes(categoryorder="array", categoryarray=names, autorange="reversed")
    for kind in SPAN_KINDS:
        rows = [s for s in usable if s["kind"] == kind]
        if not rows:
            continue
        start, end = floats(s["start_s"] for s in rows), floats(s["end_s"] for s in rows)
        texts = [f"{a:.6g} s to {b:.6g} s" + "".join(f" · {label} {s[key]}" for key, label in _SPAN_PLACES
                                                     if s.get(key) is not None)
                 for a, b, s in zip(start, end, rows, strict=True)]
        fig.add_trace(go.Bar(
            y=[labels.get(str(s["datacenter"]), str(s["datacenter"])) for s in rows], x=end - start, base=start,
            orientation="h", name=kind, offsetgroup=_TIMELINE_LANES[kind], marker_color=_SPAN_COLORS[kind],
            marker_line=dict(color="white", width=0.5), customdata=texts,
            hovertemplate=f"%{{y}} · {kind}<br>%{{customdata}}<extra></extra>",
        ))
    if not usable:
        _note(fig, empty)
    return fig


def stage_label(stage: int, datacenter: str) -> str:
    """How the pipeline views name a stage: ``"stage 0 · us-east"``."""
    return f"stage {stage} · {datacenter}"


def pipeline_timeline(spans: Sequence[Row], stages: Mapping[str, int], *, round_: int | None = None,
                      max_spans: int = MAX_POINTS) -> go.Figure:
    """One round of a pipeline run, per stage: its micro-batches' forward and backward spans (and any other span the
    stage logged) against seconds since the run's start, one row per stage labelled "stage i · datacenter",
    stage 0 on top; the hover text names each span's step and micro-batch. ``stages`` maps each stage's datacenter
    to its index; ``spans`` are the round's ``timeline_spans`` rows. Drawn by :func:`timeline`."""
    lanes = {name: stage_label(index, name) for name, index in sorted(stages.items(), key=lambda item: item[1])}
    title = "Pipeline stages" + (f", round {round_}" if round_ is not None else "") + ": micro-batches"
    return timeline(spans, max_spans=max_spans, lanes=lanes, title=title, yaxis="stage",
                    empty="no micro-batch spans in this round")


def _lines_per_group(fig: go.Figure, groups: Mapping[str, Sequence[Row]], key: str, label: str,
                     max_points: int) -> None:
    """One line of ``key`` vs. round per group (in the mapping's order, named after it, the dashboard's colours in
    turn); a group without a finite value of ``key`` gets no trace."""
    for i, (name, group) in enumerate(groups.items()):
        rows = sorted(group, key=lambda r: r["round"])
        px, py = _points([r["round"] for r in rows], [r.get(key) for r in rows], max_points)
        if len(px):
            fig.add_trace(go.Scatter(
                x=px, y=py, name=name, mode=_mode(len(px)), line=dict(color=_COLORWAY[i % len(_COLORWAY)]),
                hovertemplate=f"{name}<br>round %{{x}}<br>{label} %{{y:.4g}}<extra></extra>",
            ))


def drift_per_datacenter(dc_rounds: Sequence[Row], *, max_points: int = MAX_POINTS) -> go.Figure:
    """Drift (``drift_l2``) vs. round, one line per datacenter (traces named by datacenter, sorted).

    A datacenter with no measured drift gets no trace; with none at all the figure says so.
    """
    groups: dict[str, list[Row]] = {}
    for row in dc_rounds:
        groups.setdefault(str(row["datacenter"]), []).append(row)
    fig = _figure("Drift per datacenter (drift_l2)", "round", "drift_l2")
    _round_axis(fig, [r["round"] for r in dc_rounds])
    _lines_per_group(fig, {name: groups[name] for name in sorted(groups)}, "drift_l2", "drift", max_points)
    if not fig.data:
        _note(fig, "no drift measured")
    return fig


def pipeline_bubble(stage_rows: Sequence[Row], *, max_points: int = MAX_POINTS) -> go.Figure:
    """A pipeline run's bubble fraction (the share of a stage's wall time it was not computing) vs. round, one line
    per stage, stage 0 first, each named "stage i · datacenter" (after the datacenter of the stage's latest row).

    Takes ``pipeline_stages`` rows; with none, the figure says "no pipeline stage logged yet".
    """
    groups: dict[int, list[Row]] = {}
    for row in stage_rows:
        groups.setdefault(int(row["stage"]), []).append(row)
    named = {stage_label(stage, str(max(rows, key=lambda r: r["round"])["datacenter"])): rows
             for stage, rows in sorted(groups.items())}
    fig = _figure("Pipeline bubble per stage", "round", "bubble fraction (of the stage's wall time)")
    _round_axis(fig, [r["round"] for r in stage_rows])
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    _lines_per_group(fig, named, "bubble_fraction", "bubble", max_points)
    if not fig.data:
        _note(fig, "no pipeline stage logged yet")
    return fig


def staleness_histogram(async_updates: Sequence[Row]) -> go.Figure:
    """How stale the updates of an asynchronous run were: count of updates per staleness.

    Takes ``async_updates`` rows, or grouped rows that carry a ``count`` (rows without one
    count 1). Stacked bar traces "applied" and "discarded" (each only when present), with
    exact integer counts; an empty list gives a figure that says "no async updates".
    """
    counts: dict[str, dict[int, int]] = {}
    for row in async_updates:
        staleness = row.get("staleness")
        if staleness is None:
            continue
        status = str(row.get("status") or "applied")
        bucket = counts.setdefault(status, {})
        bucket[int(staleness)] = bucket.get(int(staleness), 0) + int(row.get("count", 1) or 0)
    fig = _figure("Staleness of async updates", "staleness (versions behind)", "updates", barmode="stack")
    colors = {"applied": _COLORWAY[0], "discarded": ALERT_COLOR}
    for status in sorted(counts, key=lambda s: (s != "applied", s)):
        xs = sorted(counts[status])
        fig.add_trace(go.Bar(
            x=xs, y=[counts[status][x] for x in xs], name=status, marker_color=colors.get(status, "#7f7f7f"),
            hovertemplate=f"staleness %{{x}}<br>{status}: %{{y}}<extra></extra>",
        ))
    if not fig.data:
        _note(fig, "no async updates")
    else:
        fig.update_xaxes(dtick=1 if max(max(c) for c in counts.values()) <= 20 else None)
    return fig


def staleness_over_time(async_updates: Sequence[Row], max_points: int = MAX_POINTS) -> go.Figure:
    """Per datacenter, how stale its updates were as the run went on: staleness against ``applied_version``.

    Takes ``async_updates`` rows (``datacenter``, ``applied_version``, ``staleness``, ``status``), in any order.
    One marker trace per datacenter named after it (its applied updates), and one named "<datacenter>
    discarded" (✕ markers, same colour) when it had discarded ones; rows without a version or a staleness are
    left out. An empty list gives a figure that says "no async updates".
    """
    groups: dict[str, dict[str, list[Row]]] = {}
    for row in async_updates:
        if row.get("applied_version") is None or row.get("staleness") is None:
            continue
        status = "discarded" if row.get("status") == "discarded" else "applied"
        groups.setdefault(str(row["datacenter"]), {}).setdefault(status, []).append(row)
    fig = _figure("Staleness per datacenter over time", "global version (applied at)", "staleness (versions behind)")
    for i, name in enumerate(sorted(groups)):
        color = _COLORWAY[i % len(_COLORWAY)]
        for status in ("applied", "discarded"):
            rows = sorted(groups[name].get(status, []), key=lambda r: r["applied_version"])
            px, py = _points([r["applied_version"] for r in rows], [r["staleness"] for r in rows], max_points)
            if not len(px):
                continue
            label = name if status == "applied" else f"{name} discarded"
            fig.add_trace(go.Scatter(
                x=px, y=py, name=label, mode="markers",
                marker=dict(color=color, symbol="circle" if status == "applied" else "x", size=6),
                hovertemplate=f"{label}<br>version %{{x}}<br>staleness %{{y}}<extra></extra>",
            ))
    if not fig.data:
        _note(fig, "no async updates")
    return fig


# -------------------------------------------------------------- compare


def compare_runs(
    runs: Mapping[str, Sequence[Row]],
    *,
    x: Literal["round", "bytes", "wall"] = "round",
    metric: Literal["val_loss", "val_accuracy"] = "val_loss",
    max_points: int = MAX_POINTS,
) -> go.Figure:
    """Several runs overlaid: ``metric`` vs. round, cumulative bytes (up + down) or wall time.

    ``runs`` maps a display name (legend entry, trace name) to that run's ``rounds`` rows;
    one trace per run, in the mapping's order.
    """
    axis = {"round": "round", "bytes": "cumulative bytes (up + down)", "wall": "wall time (s)"}[x]
    label = {"val_loss": "validation loss", "val_accuracy": "validation accuracy"}[metric]
    fig = _figure(f"{label} vs. {axis}", axis, label)
    if x == "bytes":
        fig.update_xaxes(tickformat="~s", ticksuffix="B")
    for i, (name, rounds) in enumerate(runs.items()):
        ordered = sorted(rounds, key=lambda r: r["round"])
        if x == "round":
            xs: list[Any] = [r["round"] for r in ordered]
        elif x == "bytes":
            xs = cumulative((finite(r.get("bytes_up")) or 0) + (finite(r.get("bytes_down")) or 0) for r in ordered)
        else:
            xs = cumulative(r.get("wall_s") for r in ordered)
        px, py = _points(xs, [r.get(metric) for r in ordered], max_points)
        fig.add_trace(go.Scatter(
            x=px, y=py, name=name, mode=_mode(len(px)), line=dict(color=_COLORWAY[i % len(_COLORWAY)], width=2),
            hovertemplate=f"{name}<br>{axis} %{{x:{'d' if x == 'round' else '.4~s'}}}<br>{label} %{{y:.4g}}<extra></extra>",
        ))
    if x == "round":
        _round_axis(fig, [r["round"] for rounds in runs.values() for r in rounds])
    return fig


__all__ = [
    "ALERT_COLOR",
    "COMM_COMP_ALERT",
    "TIMELINE_COLORS",
    "FIGURE_IDS",
    "MAX_POINTS",
    "MICROBATCH_COLORS",
    "SUMMARY_KEYS",
    "bytes_per_round",
    "comm_comp",
    "comm_comp_ratio",
    "compare_runs",
    "cumulative",
    "downsample",
    "downsample_indices",
    "drift_per_datacenter",
    "exposed_comm_comp_ratio",
    "figure_json",
    "finite",
    "floats",
    "has_compression",
    "loss_vs_bytes",
    "loss_vs_round",
    "loss_vs_wall_time",
    "pipeline_bubble",
    "pipeline_timeline",
    "staleness_histogram",
    "stage_label",
    "staleness_over_time",
    "summarize_datacenters",
    "tau_schedule",
    "time_breakdown",
    "timeline",
    "utilisation",
]
