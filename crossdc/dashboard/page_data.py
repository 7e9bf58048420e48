"""What the dashboard pages read from the SQL run log: bounded, read-only queries.

Promises:

* Read-only, on SQLite and PostgreSQL; every function takes an open ``Connection``
  (one connection per request: SQLite in WAL mode gives it a consistent snapshot).
* Bounded cost whatever the size of a run: per-datacenter series are thinned in SQL
  to at most a fixed number of points per datacenter (every k-th round, plus each
  datacenter's last round); totals come from SQL aggregates over all rows, so they stay
  exact. A run of 10,000 rounds × 16 datacenters reads ~10,000 per-datacenter rows,
  not 160,000.
  The timeline reads only the newest :data:`MAX_TIMELINE_SPANS` spans, picked on an index; a pipeline run's
  per-stage view reads one round's spans (as many at most) and its stages' rows thinned to at most
  :data:`~crossdc.dashboard.figures.MAX_POINTS` rounds per stage.
* Rows are plain dicts keyed by column names (as :mod:`crossdc.db.queries` returns them),
  so they feed :mod:`crossdc.dashboard.figures` unchanged.
* The status shown is the *effective* status of
  :func:`crossdc.dashboard.queries.effective_status` (a ``running`` run whose process
  died shows ``interrupted``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cachetools import LRUCache
from sqlalchemy import Connection, and_, case, func, or_, select

from crossdc.dashboard.figures import MAX_POINTS, comm_comp, finite, summarize_datacenters, utilisation
from crossdc.dashboard.queries import as_utc, could_be_run_id, effective_status, pipeline_stages, run_datacenters
from crossdc.db.models import (
    ASYNC_UPDATES,
    DATACENTER_ROUNDS,
    DATACENTERS,
    EVENTS,
    PIPELINE_STAGES,
    ROUNDS,
    RUNS,
    TIMELINE_SPANS,
)
from crossdc.db.queries import list_timeline_spans

#: Points per datacenter trace summed over all datacenters; each trace gets at most MAX_POINTS.
DATACENTER_POINT_BUDGET = 10_000
#: Fewest points a datacenter trace is thinned to, however many datacenters there are.
MIN_POINTS_PER_DATACENTER = 200
#: The run page reads at most this many of a run's latest events (the chart and the table).
MAX_EVENTS = 5000
#: ... and the timestamp and detail of only this many of the latest (the events table).
EVENTS_WITH_DETAIL = 200
#: The run page's timeline shows at most this many of a run's newest spans.
MAX_TIMELINE_SPANS = 2000
#: The runs list shows at most this many of the newest runs.
MAX_RUNS_LISTED = 500
#: The strategy whose runs get the pipeline views even before they logged anything (pipeline parallelism).
PIPELINE_STRATEGY = "pipeline"
#: A pipeline run's page offers at most this many of its latest rounds to pick from (and the one shown).
MAX_PIPELINE_ROUND_CHOICES = 500

_ROUND_COLUMNS = ("round", "tau", "val_loss", "val_accuracy", "bytes_up", "bytes_down", "bytes_up_raw", "wall_s")
_DC_SAMPLE_COLUMNS = (
    "round", "datacenter", "status", "compute_s", "comm_s", "overhead_s", "drift_l2",
    "bytes_up", "bytes_up_raw", "bytes_down",
)
_RUN_COLUMNS = (
    "id", "name", "strategy", "config", "status", "started_at", "finished_at", "flower_run_ids",
    "baseline", "rounds_planned", "error", "last_heartbeat", "result",
)


def _dicts(conn: Connection, stmt: Any, columns: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of ``stmt`` (selecting ``columns``, no timestamps) as dicts: the fast path for long series."""
    return [dict(zip(columns, row, strict=True)) for row in conn.execute(stmt).all()]


def _row(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: as_utc(v) for k, v in mapping.items()}


def with_status(run: Mapping[str, Any], slowest_round_wall_s: float | None, now: datetime) -> dict[str, Any]:
    """The ``runs`` row plus ``stored_status``, the effective ``status``, ``status_detail`` and ``running``."""
    shown = effective_status(run, finite(slowest_round_wall_s), now)
    return {**run, "stored_status": run["status"], "status": shown.status, "status_detail": shown.detail,
            "running": shown.status == "running"}


# ------------------------------------------------------------------ run page


@dataclass
class RunPageData:
    """Everything the run page shows of one run (see the module doc for the bounds)."""

    run: dict[str, Any]
    rounds: list[dict[str, Any]]
    dc_sample: list[dict[str, Any]]
    dc_summary: list[dict[str, Any]]
    dc_stride: int
    events: list[dict[str, Any]]
    events_total: int
    staleness_counts: list[dict[str, Any]]
    async_total: int
    version: str
    totals: dict[str, Any] = field(default_factory=dict)
    #: the async updates' (seq, datacenter, applied_version, staleness, status), thinned to every k-th (by seq)
    staleness_series: list[dict[str, Any]] = field(default_factory=list)
    #: whether the run has staleness to show (async updates, or datacenter rounds with a staleness): a synchronous
    #: run has none, and its page leaves the staleness charts out
    has_staleness: bool = False
    #: the run's newest MAX_TIMELINE_SPANS timeline spans (crossdc.db.queries.list_timeline_spans), and how many it has
    timeline: list[dict[str, Any]] = field(default_factory=list)
    timeline_total: int = 0
    #: a pipeline run's per-stage views (``None`` for a run that gets none: see :func:`load_pipeline_view`)
    pipeline: PipelineView | None = None


@dataclass
class PipelineView:
    """What a pipeline run's page shows of one of its rounds, and of its stages over the rounds.

    ``round``: the round shown (the one asked for when the run logged its stage rows, else the latest that did;
    ``None`` before the first). ``rounds``: the rounds to pick from, newest first (at most MAX_PIPELINE_ROUND_CHOICES,
    the shown one always among them); ``rounds_total``: how many rounds logged stage rows. ``stages``: the
    shown round's ``pipeline_stages`` rows, by stage; ``lanes``: each stage's datacenter → its stage index (from
    those rows, else the run's config order); ``spans``: the shown round's newest MAX_TIMELINE_SPANS
    ``timeline_spans`` rows, of ``spans_total``. ``series``: every stage's rows over the run, thinned to every k-th
    round (the last kept) so that each stage has at most MAX_POINTS, for the charts over rounds.
    """

    round: int | None
    rounds: list[int]
    rounds_total: int
    stages: list[dict[str, Any]]
    lanes: dict[str, int]
    spans: list[dict[str, Any]]
    spans_total: int
    series: list[dict[str, Any]]


def run_version(conn: Connection, run_id: str, now: datetime) -> tuple[str, bool] | None:
    """A marker that changes whenever the run page would change, and whether the run is running.

    ``None`` when there is no such run. Cheap (a few indexed aggregates): live polling
    asks for it every few seconds and rebuilds the figures only when it changes.
    """
    if not could_be_run_id(run_id):
        return None
    run = conn.execute(
        select(RUNS.c.status, RUNS.c.started_at, RUNS.c.last_heartbeat, RUNS.c.error, RUNS.c.finished_at)
        .where(RUNS.c.id == run_id)
    ).mappings().first()
    if run is None:
        return None
    rounds = conn.execute(
        select(func.count(), func.max(ROUNDS.c.round), func.max(ROUNDS.c.wall_s)).where(ROUNDS.c.run_id == run_id)
    ).one()
    n_dc = conn.execute(select(func.count()).where(DATACENTER_ROUNDS.c.run_id == run_id)).scalar()
    last_event = conn.execute(select(func.max(EVENTS.c.id)).where(EVENTS.c.run_id == run_id)).scalar()
    n_async = conn.execute(select(func.count()).where(ASYNC_UPDATES.c.run_id == run_id)).scalar()
    n_spans = _timeline_total(conn, run_id)
    n_stages = conn.execute(select(func.count()).where(PIPELINE_STAGES.c.run_id == run_id)).scalar()
    shown = with_status(_row(run), rounds[2], now)
    marker = "|".join(str(part) for part in (
        shown["status"], as_utc(run["last_heartbeat"]), as_utc(run["finished_at"]),
        rounds[0], rounds[1], n_dc, last_event, n_async, n_spans, n_stages,
    ))
    return marker, bool(shown["running"])


def _timeline_total(conn: Connection, run_id: str) -> int:
    """How many timeline spans the run has (counted on the index on run_id)."""
    return int(conn.execute(select(func.count()).where(TIMELINE_SPANS.c.run_id == run_id)).scalar() or 0)


def _datacenter_aggregates(
    conn: Connection, run_id: str, *, after_round: int | None = None, through_round: int | None = None
) -> list[dict[str, Any]]:
    """Per datacenter, SQL aggregates (exact sums and counts) over its rows with
    ``after_round < round <= through_round`` (each bound only when given), by name."""
    dc = DATACENTER_ROUNDS
    both = and_(dc.c.comm_s.is_not(None), dc.c.compute_s.is_not(None))
    waited = and_(dc.c.status == "ok", dc.c.idle_s.is_not(None), dc.c.compute_s.is_not(None))

    def count_status(status: str) -> Any:
        return func.sum(case((dc.c.status == status, 1), else_=0)).label(status)

    where = [dc.c.run_id == run_id]
    if after_round is not None:
        where.append(dc.c.round > after_round)
    if through_round is not None:
        where.append(dc.c.round <= through_round)
    stmt = (
        select(
            dc.c.datacenter, func.count().label("rounds"), func.max(dc.c.round).label("last_round"),
            count_status("ok"), count_status("failed"), count_status("timeout"), count_status("rejected"),
            func.sum(dc.c.compute_s).label("compute_s_total"), func.count(dc.c.compute_s).label("compute_n"),
            func.sum(dc.c.comm_s).label("comm_s_total"), func.count(dc.c.comm_s).label("comm_measured"),
            func.sum(dc.c.overhead_s).label("overhead_s_total"), func.count(dc.c.overhead_s).label("overhead_n"),
            func.sum(case((both, dc.c.comm_s))).label("comm_both"),
            func.sum(case((both, dc.c.compute_s))).label("compute_both"),
            func.sum(case((waited, dc.c.idle_s))).label("idle_both"),
            func.sum(case((waited, dc.c.compute_s))).label("compute_idle_both"),
            func.coalesce(func.sum(dc.c.bytes_up), 0).label("bytes_up"),
            func.coalesce(func.sum(dc.c.bytes_up_raw), 0).label("bytes_up_raw"),
            func.coalesce(func.sum(dc.c.bytes_down), 0).label("bytes_down"),
            func.count(dc.c.staleness).label("staleness_n"),
        )
        .where(*where)
        .group_by(dc.c.datacenter)
        .order_by(dc.c.datacenter)
    )
    return [dict(r) for r in conn.execute(stmt).mappings()]


#: The additive fields of a row of ``_datacenter_aggregates`` (``None`` = no value yet).
_ADDITIVE = (
    "rounds", "ok", "failed", "timeout", "rejected", "compute_s_total", "compute_n", "comm_s_total",
    "comm_measured", "overhead_s_total", "overhead_n", "comm_both", "compute_both", "idle_both", "compute_idle_both",
    "bytes_up", "bytes_up_raw", "bytes_down", "staleness_n",
)


def merge_aggregates(*parts: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per-datacenter aggregates of disjoint round ranges combined into those of their union, by name."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for row in part:
            name = row["datacenter"]
            if name not in merged:
                merged[name] = dict(row)
                continue
            into = merged[name]
            for key in _ADDITIVE:
                a, b = into.get(key), row.get(key)
                into[key] = b if a is None else (a if b is None else a + b)
            lasts = [v for v in (into.get("last_round"), row.get("last_round")) if v is not None]
            into["last_round"] = max(lasts) if lasts else None
    return [merged[name] for name in sorted(merged)]


class AggregateCache:
    """Per-datacenter aggregates of the *closed* rounds of recently viewed runs.

    A round is closed once a later round has rows (the server writes rounds in order), so
    its rows no longer change, except when a run is resumed from a checkpoint and re-logs
    rounds: a resume adds a Flower run id, and the entry is keyed by ``generation`` (the
    run's ``started_at`` and ``flower_run_ids``), which drops it. A page of a long running
    run then aggregates only the rounds logged since the last visit. Thread-safe; keeps the
    ``size`` most recently used runs.
    """

    def __init__(self, size: int = 32) -> None:
        self._entries: LRUCache[Hashable, tuple[Hashable, int, list[dict[str, Any]]]] = LRUCache(maxsize=size)
        self._lock = threading.Lock()

    def aggregates(
        self, conn: Connection, key: Hashable, run_id: str, generation: Hashable, last_round: int
    ) -> list[dict[str, Any]]:
        """The run's aggregates over all its rows; ``last_round`` is its highest datacenter round."""
        closed = last_round - 1
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or entry[0] != generation or entry[1] > closed:
            base = _datacenter_aggregates(conn, run_id, through_round=closed)
        elif entry[1] < closed:
            base = merge_aggregates(entry[2], _datacenter_aggregates(
                conn, run_id, after_round=entry[1], through_round=closed))
        else:
            base = entry[2]
        with self._lock:
            self._entries[key] = (generation, closed, base)
        return merge_aggregates(base, _datacenter_aggregates(conn, run_id, after_round=closed))


def datacenter_summary(aggregates: Sequence[Mapping[str, Any]], sample: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows shaped like :func:`crossdc.dashboard.figures.summarize_datacenters`: totals, means and the
    ratio from the exact SQL ``aggregates``; medians and the latest drift from the (thinned) ``sample``."""
    sampled = {s["datacenter"]: s for s in summarize_datacenters(sample)}
    out = []
    for agg in aggregates:
        name = agg["datacenter"]
        row: dict[str, Any] = {"datacenter": name}
        for key in ("rounds", "ok", "failed", "timeout", "rejected", "comm_measured"):
            row[key] = int(agg[key] or 0)
        for key, n_key in (("compute_s", "compute_n"), ("comm_s", "comm_measured"), ("overhead_s", "overhead_n")):
            total, n = finite(agg[f"{key}_total"]), int(agg[n_key] or 0)
            row[f"{key}_total"] = total if n else None
            row[f"{key}_mean"] = total / n if n and total is not None else None
            row[f"{key}_median"] = sampled.get(name, {}).get(f"{key}_median")
        row["comm_comp_ratio"] = comm_comp(finite(agg["comm_both"]), finite(agg["compute_both"]))
        idle, compute = finite(agg["idle_both"]), finite(agg["compute_idle_both"])
        row["exposed_comm_comp_ratio"] = comm_comp(idle, compute)
        row["trainer_utilisation"] = utilisation(compute, idle)
        for key in ("bytes_up", "bytes_up_raw", "bytes_down"):
            row[key] = int(agg[key] or 0)
        row["drift_l2_last"] = sampled.get(name, {}).get("drift_l2_last")
        out.append(row)
    return out


def points_per_datacenter(n_datacenters: int) -> int:
    """How many points each datacenter's series gets: the budget shared out, within [200, MAX_POINTS]."""
    if n_datacenters <= 0:
        return MAX_POINTS
    return max(MIN_POINTS_PER_DATACENTER, min(MAX_POINTS, DATACENTER_POINT_BUDGET // n_datacenters))


def _datacenter_sample(
    conn: Connection, run_id: str, aggregates: Sequence[Mapping[str, Any]], first: int, last: int
) -> tuple[list[dict[str, Any]], int]:
    """The run's ``datacenter_rounds`` rows thinned to every k-th round from ``first`` (plus each
    datacenter's last round), read by index lookups; and k."""
    dc = DATACENTER_ROUNDS
    if not aggregates:
        return [], 1
    per_trace = points_per_datacenter(len(aggregates))
    longest = max(int(a["rounds"]) for a in aggregates)
    stride = 1 if longest <= per_trace else math.ceil((last - first + 1) / (per_trace - 1))
    where = [dc.c.run_id == run_id]
    if stride > 1:
        wanted = set(range(first, last + 1, stride)) | {int(a["last_round"]) for a in aggregates}
        where.append(dc.c.round.in_(sorted(wanted)))
    stmt = select(*(dc.c[c] for c in _DC_SAMPLE_COLUMNS)).where(*where).order_by(dc.c.round, dc.c.datacenter)
    rows = _dicts(conn, stmt, _DC_SAMPLE_COLUMNS)
    if stride > 1:  # another datacenter's last round is not on the grid: leave it out of this one's trace
        lasts = {a["datacenter"]: int(a["last_round"]) for a in aggregates}
        rows = [r for r in rows if (r["round"] - first) % stride == 0 or r["round"] == lasts.get(r["datacenter"])]
    return rows, stride


_STALENESS_COLUMNS = ("seq", "datacenter", "applied_version", "staleness", "status")


def _staleness_series(conn: Connection, run_id: str, total: int) -> list[dict[str, Any]]:
    """The run's async updates for the staleness-over-time chart, read in SQL thinned to every k-th sequence number
    so that at most about DATACENTER_POINT_BUDGET rows are read, by sequence number."""
    if total <= 0:
        return []
    au = ASYNC_UPDATES
    where = [au.c.run_id == run_id]
    stride = math.ceil(total / DATACENTER_POINT_BUDGET)
    if stride > 1:
        where.append(au.c.seq % stride == 0)
    stmt = select(*(au.c[c] for c in _STALENESS_COLUMNS)).where(*where).order_by(au.c.seq)
    return _dicts(conn, stmt, _STALENESS_COLUMNS)


def _pipeline_rounds(conn: Connection, run_id: str) -> tuple[list[int], int]:
    """The run's rounds with ``pipeline_stages`` rows, newest first (at most MAX_PIPELINE_ROUND_CHOICES), and how many
    there are; from the unique index on (run_id, round, stage)."""
    ps = PIPELINE_STAGES
    total = int(conn.execute(select(func.count(func.distinct(ps.c.round))).where(ps.c.run_id == run_id)).scalar() or 0)
    newest = [int(r) for (r,) in conn.execute(
        select(ps.c.round).where(ps.c.run_id == run_id).group_by(ps.c.round).order_by(ps.c.round.desc())
        .limit(MAX_PIPELINE_ROUND_CHOICES))]
    return newest, total


def _has_round(conn: Connection, run_id: str, round_: int) -> bool:
    """Whether the run logged ``pipeline_stages`` rows in ``round_``."""
    ps = PIPELINE_STAGES
    return conn.execute(select(ps.c.id).where(ps.c.run_id == run_id, ps.c.round == round_).limit(1)).first() is not None


def _stage_series(conn: Connection, run_id: str) -> list[dict[str, Any]]:
    """The run's ``pipeline_stages`` rows by round then stage, thinned to every k-th round from the first (the last
    round kept) so that each stage has at most MAX_POINTS rows."""
    ps = PIPELINE_STAGES
    first, last, count = conn.execute(
        select(func.min(ps.c.round), func.max(ps.c.round), func.count(func.distinct(ps.c.round))).where(ps.c.run_id == run_id)
    ).one()
    if first is None:
        return []
    stride = 1 if count <= MAX_POINTS else math.ceil((last - first + 1) / (MAX_POINTS - 1))
    stmt = select(*(ps.c[c] for c in _STAGE_SERIES_COLUMNS)).where(ps.c.run_id == run_id)
    if stride > 1:
        stmt = stmt.where(or_((ps.c.round - first) % stride == 0, ps.c.round == last))
    return _dicts(conn, stmt.order_by(ps.c.round, ps.c.stage), _STAGE_SERIES_COLUMNS)


_STAGE_SERIES_COLUMNS = ("round", "stage", "datacenter", "compute_s", "wall_s", "bubble_fraction", "bytes_forward",
                         "bytes_backward")


def load_pipeline_view(conn: Connection, run: Mapping[str, Any], *, round_: int | None = None) -> PipelineView | None:
    """The pipeline views' data of ``run`` (its ``runs`` row) at round ``round_`` (``None``, or a round without stage
    rows: the latest with some), or ``None`` for a run that gets none: one whose strategy is not pipeline and that
    logged no ``pipeline_stages`` row. A few indexed reads, whatever the size of the run (see the module doc)."""
    run_id = str(run["id"])
    rounds, total = _pipeline_rounds(conn, run_id)
    if run["strategy"] != PIPELINE_STRATEGY and not total:
        return None
    shown = round_ if round_ is not None and _has_round(conn, run_id, round_) else (rounds[0] if rounds else None)
    if shown is None:
        return PipelineView(round=None, rounds=[], rounds_total=0, stages=[], lanes={}, spans=[], spans_total=0,
                            series=[])
    if shown not in rounds:
        rounds = sorted([*rounds, shown], reverse=True)
    stages = pipeline_stages(conn, run_id, round=shown)
    lanes = {str(row["datacenter"]): int(row["stage"]) for row in stages}
    for index, name in enumerate(run_datacenters(run)):  # stages 0..S-1 are the config's datacenters, in order
        if index not in lanes.values():
            lanes.setdefault(name, index)
    ts = TIMELINE_SPANS
    spans_total = int(conn.execute(select(func.count()).where(ts.c.run_id == run_id, ts.c.round == shown)).scalar() or 0)
    spans = list_timeline_spans(conn, run_id, round=shown, limit=MAX_TIMELINE_SPANS) if spans_total else []
    return PipelineView(round=shown, rounds=rounds, rounds_total=total, stages=stages, lanes=lanes, spans=spans,
                        spans_total=spans_total, series=_stage_series(conn, run_id))


def _run_rounds(conn: Connection, run_id: str) -> list[dict[str, Any]]:
    """The run's ``rounds`` rows (the columns the charts need), by round."""
    stmt = select(*(ROUNDS.c[c] for c in _ROUND_COLUMNS)).where(ROUNDS.c.run_id == run_id).order_by(ROUNDS.c.round)
    return _dicts(conn, stmt, _ROUND_COLUMNS)


def load_run_page(
    conn: Connection, run_id: str, now: datetime, *, cache: AggregateCache | None = None, cache_key: Hashable = None,
    pipeline_round: int | None = None,
) -> RunPageData | None:
    """The run page's data for ``run_id``, or ``None`` when there is no such run.

    With ``cache`` (one per database; ``cache_key`` names the database), the per-datacenter
    totals of a long run are updated from the rounds logged since the last call. ``pipeline_round``: the round a
    pipeline run's per-stage views show (default: its latest; see :func:`load_pipeline_view`).
    """
    if not could_be_run_id(run_id):
        return None
    found = conn.execute(select(*(RUNS.c[c] for c in _RUN_COLUMNS)).where(RUNS.c.id == run_id)).mappings().first()
    if found is None:
        return None
    version = run_version(conn, run_id, now)
    assert version is not None
    rounds = _run_rounds(conn, run_id)
    slowest = max((w for w in (finite(r["wall_s"]) for r in rounds) if w is not None), default=None)
    run = with_status(_row(found), slowest, now)

    first, last = conn.execute(
        select(func.min(DATACENTER_ROUNDS.c.round), func.max(DATACENTER_ROUNDS.c.round))
        .where(DATACENTER_ROUNDS.c.run_id == run_id)
    ).one()
    if first is None:
        aggregates: list[dict[str, Any]] = []
    elif cache is None:
        aggregates = _datacenter_aggregates(conn, run_id)
    else:
        generation = (str(found["started_at"]), found["flower_run_ids"])
        aggregates = cache.aggregates(conn, (cache_key, run_id), run_id, generation, int(last))
    sample, stride = _datacenter_sample(conn, run_id, aggregates, int(first or 0), int(last or 0))

    events_total = int(conn.execute(select(func.count()).where(EVENTS.c.run_id == run_id)).scalar() or 0)
    # Every event (up to MAX_EVENTS) for the chart's markers, but timestamps and details (slow to
    # decode) only for the latest EVENTS_WITH_DETAIL, which the table shows.
    marker_columns = ("id", "round", "kind", "datacenter")
    events = _dicts(conn, select(*(EVENTS.c[c] for c in marker_columns)).where(EVENTS.c.run_id == run_id)
                    .order_by(EVENTS.c.id.desc()).limit(MAX_EVENTS), marker_columns)[::-1]
    detailed = {r["id"]: _row(r) for r in conn.execute(
        select(EVENTS.c.id, EVENTS.c.at, EVENTS.c.detail).where(EVENTS.c.run_id == run_id)
        .order_by(EVENTS.c.id.desc()).limit(EVENTS_WITH_DETAIL)
    ).mappings().all()}
    for event in events:
        event.update(detailed.get(event["id"], {"at": None, "detail": None}))

    au = ASYNC_UPDATES
    staleness = [dict(r) for r in conn.execute(
        select(au.c.status, au.c.staleness, func.count().label("count"))
        .where(au.c.run_id == run_id).group_by(au.c.status, au.c.staleness).order_by(au.c.status, au.c.staleness)
    ).mappings()]

    totals = {
        "bytes_up": sum(int(r["bytes_up"] or 0) for r in rounds),
        "bytes_down": sum(int(r["bytes_down"] or 0) for r in rounds),
        "bytes_up_raw": sum(int(r["bytes_up_raw"] or 0) for r in rounds),
        "wall_s": sum(finite(r["wall_s"]) or 0.0 for r in rounds),
        "rounds": len(rounds),
        "last_round": rounds[-1]["round"] if rounds else None,
    }
    latest = next((r for r in reversed(rounds) if finite(r["val_loss"]) is not None
                   or finite(r["val_accuracy"]) is not None), None)
    totals.update(val_round=latest["round"] if latest else None,
                  val_loss=finite(latest["val_loss"]) if latest else None,
                  val_accuracy=finite(latest["val_accuracy"]) if latest else None)
    async_total = sum(int(r["count"]) for r in staleness)
    timeline_total = _timeline_total(conn, run_id)
    timeline = list_timeline_spans(conn, run_id, limit=MAX_TIMELINE_SPANS) if timeline_total else []
    return RunPageData(
        run=run, rounds=rounds, dc_sample=sample, dc_summary=datacenter_summary(aggregates, sample), dc_stride=stride,
        events=events, events_total=events_total, staleness_counts=staleness,
        async_total=async_total, version=version[0], totals=totals,
        staleness_series=_staleness_series(conn, run_id, async_total),
        has_staleness=async_total > 0 or any(int(a.get("staleness_n") or 0) for a in aggregates),
        timeline=timeline, timeline_total=timeline_total,
        pipeline=load_pipeline_view(conn, found, round_=pipeline_round),
    )


# ----------------------------------------------------------------- runs list


def run_list(conn: Connection, now: datetime, *, limit: int = MAX_RUNS_LISTED) -> list[dict[str, Any]]:
    """The newest runs (at most ``limit``), newest first, each with its headline numbers.

    Each row: the ``runs`` columns but ``config`` and ``result``, the effective status
    (see :func:`with_status`), ``rounds_completed``, ``last_round``, ``bytes_total``
    (up + down), and the latest evaluation (``val_round``, ``val_loss``, ``val_accuracy``).
    """
    columns = [c for c in _RUN_COLUMNS if c not in ("config", "result")]
    runs = [_row(r) for r in conn.execute(
        select(*(RUNS.c[c] for c in columns)).order_by(RUNS.c.started_at.desc(), RUNS.c.id).limit(limit)
    ).mappings()]
    if not runs:
        return []
    ids = [r["id"] for r in runs]
    stats = {r["run_id"]: r for r in conn.execute(
        select(ROUNDS.c.run_id, func.count().label("rounds_completed"), func.max(ROUNDS.c.round).label("last_round"),
               func.max(ROUNDS.c.wall_s).label("slowest"),
               func.coalesce(func.sum(ROUNDS.c.bytes_up), 0).label("up"),
               func.coalesce(func.sum(ROUNDS.c.bytes_down), 0).label("down"))
        .where(ROUNDS.c.run_id.in_(ids)).group_by(ROUNDS.c.run_id)
    ).mappings()}
    # The latest evaluated round of each run: one small indexed query per run.
    out = []
    for run in runs:
        s = stats.get(run["id"], {})
        latest = conn.execute(
            select(ROUNDS.c.round, ROUNDS.c.val_loss, ROUNDS.c.val_accuracy)
            .where(ROUNDS.c.run_id == run["id"],
                   or_(ROUNDS.c.val_loss.is_not(None), ROUNDS.c.val_accuracy.is_not(None)))
            .order_by(ROUNDS.c.round.desc()).limit(1)
        ).mappings().first()
        row = with_status(run, s.get("slowest"), now)
        row.update(
            rounds_completed=int(s.get("rounds_completed") or 0), last_round=s.get("last_round"),
            bytes_total=int(s.get("up") or 0) + int(s.get("down") or 0),
            val_round=latest["round"] if latest else None,
            val_loss=finite(latest["val_loss"]) if latest else None,
            val_accuracy=finite(latest["val_accuracy"]) if latest else None,
        )
        out.append(row)
    return out


# ------------------------------------------------------------------- compare


def compare_data(conn: Connection, run_ids: Sequence[str], now: datetime) -> tuple[list[dict[str, Any]], list[str]]:
    """For each of ``run_ids`` (in order): its ``runs`` row with effective status and its ``rounds`` rows
    (key ``rounds``); and the ids that match no run."""
    found, missing = [], []
    for run_id in run_ids:
        row = None
        if could_be_run_id(run_id):
            row = conn.execute(
                select(*(RUNS.c[c] for c in _RUN_COLUMNS if c != "result")).where(RUNS.c.id == run_id)
            ).mappings().first()
        if row is None:
            missing.append(run_id)
            continue
        rounds = _run_rounds(conn, run_id)
        slowest = max((w for w in (finite(r["wall_s"]) for r in rounds) if w is not None), default=None)
        run = with_status(_row(row), slowest, now)
        run["rounds"] = rounds
        found.append(run)
    return found, missing


# --------------------------------------------------------------- datacenters


def datacenter_list(conn: Connection, now: datetime) -> list[dict[str, Any]]:
    """All enrolled datacenters, by name, each with ``last_seen_age_s`` (seconds, or ``None`` if never seen)."""
    out = []
    for row in conn.execute(select(DATACENTERS).order_by(DATACENTERS.c.name)).mappings():
        item = _row(row)
        seen = item.get("last_seen")
        item["last_seen_age_s"] = max(0.0, (now - seen).total_seconds()) if seen is not None else None
        out.append(item)
    return out


__all__ = [
    "AggregateCache",
    "DATACENTER_POINT_BUDGET",
    "MAX_EVENTS",
    "MAX_PIPELINE_ROUND_CHOICES",
    "MAX_TIMELINE_SPANS",
    "PIPELINE_STRATEGY",
    "PipelineView",
    "RunPageData",
    "compare_data",
    "datacenter_list",
    "datacenter_summary",
    "load_pipeline_view",
    "load_run_page",
    "merge_aggregates",
    "points_per_datacenter",
    "run_list",
    "run_version",
    "with_status",
]
