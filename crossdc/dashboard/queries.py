"""What the operators' service reads from the SQL run log, and the rule that says whether a run still runs.

Promises:

* Read-only: nothing here writes, on SQLite or PostgreSQL.
* Rows come back as plain dicts keyed by the column names of crossdc.db.models (the API's field names),
  timestamps as timezone-aware UTC datetimes, and every non-finite float (NaN, ±Inf: a diverged run) as ``None``,
  because JSON cannot carry them.
* Order follows the logical clock (round, datacenter name, sequence number, logging order), never wall-clock time.
* Pages of a run's series are cut by a cursor on that order, not by an offset, so a refresh asks only for what
  is new (see :class:`Page`). Each page costs index range scans on the unique keys (revision 0003 adds the
  indexes the other orders need), whatever the size of the run.
* :func:`effective_status` is the one place that decides that a ``running`` run whose process died is
  ``interrupted``; it is pure, so the pages reuse it.
* A run's stored config is parsed once per process, not once per request (:data:`LINK_PATHS`, a bounded cache keyed
  by the run's id and the config's digest): a poller of a run's link totals costs a SQL read, never a parse.

Every query function takes an open :class:`~sqlalchemy.Connection`. Text arguments that no row can hold (a NUL
character, text that is not valid Unicode, ids longer than the column) simply match nothing.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, DateTime, Float, Table, and_, case, false, func, inspect, or_, select, text, true

from crossdc.dashboard.figures import comm_comp, utilisation
from crossdc.db.models import ASYNC_UPDATES, DATACENTER_ROUNDS, DATACENTERS, EVENTS, LINK_ROUNDS, ROUNDS, RUNS
from crossdc.db.queries import as_utc, list_link_rounds, list_pipeline_stages, list_timeline_spans, utcnow
from crossdc.db.status import STALE_AFTER_MIN_S, STALE_AFTER_SLOWEST_ROUNDS, EffectiveStatus, effective_status, stale_after_s
from crossdc.db.values import finite_float, finite_or_none
from crossdc.experiment.builders import datacenter_rtts
from crossdc.experiment.config import ConfigError, parse_config

#: The most rows (rounds, for a run's per-datacenter rounds) one page may hold.
MAX_PAGE_SIZE = 5000
#: The metrics' comm/comp ratios cover this many of a run's latest rounds.
METRICS_WINDOW_ROUNDS = 10
#: /metrics reports the runs that are running plus this many of the most recently started ones.
METRICS_RECENT_RUNS = 10
#: Longest run id the ``runs`` table stores (``String(64)``).
RUN_ID_MAX_LENGTH = 64

ROUND_FIELDS: tuple[str, ...] = (
    "round", "tau", "val_loss", "val_accuracy", "bytes_up", "bytes_down", "bytes_up_raw", "wall_s", "eval_s",
    "consensus_distance",
)
DATACENTER_ROUND_FIELDS: tuple[str, ...] = (
    "round", "datacenter", "status", "reason", "bytes_up", "bytes_down", "bytes_up_raw",
    "compute_s", "comm_s", "overhead_s", "idle_s", "round_s", "comm_source", "link_bytes_up", "link_bytes_down",
    "train_loss", "num_examples", "drift_l2", "update_cosine", "staleness", "consensus_distance",
)
EVENT_FIELDS: tuple[str, ...] = ("id", "at", "round", "kind", "datacenter", "detail")
ASYNC_UPDATE_FIELDS: tuple[str, ...] = (
    "seq", "datacenter", "base_version", "applied_version", "staleness", "scale", "status", "bytes_up",
)
TIMELINE_SPAN_FIELDS: tuple[str, ...] = (
    "round", "datacenter", "kind", "start_s", "end_s", "fragment", "exchange", "microbatch", "step",
)
PIPELINE_STAGE_FIELDS: tuple[str, ...] = (
    "round", "replica", "stage", "datacenter", "steps", "microbatches", "compute_s", "wall_s", "bubble_fraction",
    "bytes_forward", "bytes_backward", "bytes_source", "train_loss",
)
LINK_ROUND_FIELDS: tuple[str, ...] = ("round", "src", "dst", "bytes", "in_flight_s", "error")
DATACENTER_FIELDS: tuple[str, ...] = (
    "name", "region", "gpus", "public_key", "status", "enrolled_at", "last_seen", "link_bandwidth_mbps", "link_rtt_ms",
    "node_id",
)
_RUN_SUMMARY_COLUMNS = (
    "id", "name", "strategy", "status", "baseline", "started_at", "finished_at", "last_heartbeat", "rounds_planned", "error",
)


# ------------------------------------------------------------------ values


def _clean(row: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    return {f: finite_or_none(as_utc(row[f])) for f in fields}


def _rows(conn: Connection, table: Table, fields: tuple[str, ...], stmt: Any) -> list[dict[str, Any]]:
    """The rows of ``stmt`` (which selects ``fields`` of ``table``, in that order) as cleaned dicts.

    Only the float columns are checked for NaN/±Inf and only the timestamps converted, so a page of a few
    thousand rows costs little more than fetching it.
    """
    floats = [f for f in fields if isinstance(table.c[f].type, Float)]
    times = [f for f in fields if isinstance(table.c[f].type, DateTime)]
    out = []
    for values in conn.execute(stmt):
        row = dict(zip(fields, values, strict=True))
        for f in floats:
            row[f] = finite_or_none(row[f])
        for f in times:
            row[f] = as_utc(row[f])
        out.append(row)
    return out


def storable(value: str) -> bool:
    """Whether a text column could hold ``value`` (PostgreSQL refuses NUL; neither backend takes lone surrogates)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def could_be_run_id(run_id: str) -> bool:
    """Whether ``run_id`` could be the id of a stored run at all (so it is worth a query)."""
    return 0 < len(run_id) <= RUN_ID_MAX_LENGTH and storable(run_id)


# ------------------------------------------------------------------- pages


@dataclass(frozen=True)
class Page:
    """One page of a run's series, cut by a cursor on the series' logical order.

    ``items``: the rows, in order. ``next_cursor``: the cursor to pass for what follows — the key of the last
    item, or the cursor that was given when the page is empty (``None``: nothing seen yet, start from the
    beginning). It serves both to page through a finished run and to poll a running one. ``has_more``: whether
    more rows existed past this page when it was read (fetch again right away rather than on the next refresh).
    """

    items: list[dict[str, Any]]
    next_cursor: int | None
    has_more: bool


def _page(rows: list[dict[str, Any]], key: str, since: int | None, limit: int) -> Page:
    """A :class:`Page` from up to ``limit + 1`` rows read in order (the extra one only says there is more)."""
    has_more = len(rows) > limit
    items = rows[:limit]
    return Page(items=items, next_cursor=items[-1][key] if items else since, has_more=has_more)


def _after(column: Any, since: int | None) -> ColumnElement[bool]:
    return column > since if since is not None else true()


def rounds_page(conn: Connection, run_id: str, *, since_round: int | None, limit: int) -> Page:
    """Rows of ``rounds`` with ``round > since_round`` (all when ``None``), by round, at most ``limit``."""
    stmt = (select(*(ROUNDS.c[f] for f in ROUND_FIELDS))
            .where(ROUNDS.c.run_id == run_id, _after(ROUNDS.c.round, since_round))
            .order_by(ROUNDS.c.round).limit(limit + 1))
    return _page(_rows(conn, ROUNDS, ROUND_FIELDS, stmt), "round", since_round, limit)


def datacenter_rounds_page(
    conn: Connection,
    run_id: str,
    *,
    since_round: int | None,
    limit: int,
    datacenter: str | None = None,
    closed_through: int | None = None,
) -> Page:
    """Rows of ``datacenter_rounds`` with ``round > since_round``: whole rounds, at most ``limit`` of them.

    A page never splits a round: ``limit`` counts rounds, and each comes with all its datacenters' rows (only
    ``datacenter``'s, when given), by round then datacenter name. ``closed_through``, when given, hides rounds
    after it: the caller passes the run's last logged round while the run is running, because the server logs a
    round's ``rounds`` row after its datacenters' rows, so a round is complete in the table once that row is
    there; a poller that moves its cursor past a round never misses a datacenter row still being written.
    """
    dc = DATACENTER_ROUNDS
    if datacenter is not None and not storable(datacenter):
        return Page([], since_round, False)
    where: list[ColumnElement[bool]] = [dc.c.run_id == run_id, _after(dc.c.round, since_round)]
    if datacenter is not None:
        where.append(dc.c.datacenter == datacenter)
    if closed_through is not None:
        where.append(dc.c.round <= closed_through)
    bounds = [r for (r,) in conn.execute(
        select(dc.c.round).where(*where).group_by(dc.c.round).order_by(dc.c.round).limit(limit + 1))]
    if not bounds:
        return Page([], since_round, False)
    last = bounds[min(limit, len(bounds)) - 1]
    stmt = (select(*(dc.c[f] for f in DATACENTER_ROUND_FIELDS)).where(*where, dc.c.round <= last)
            .order_by(dc.c.round, dc.c.datacenter))
    return Page(_rows(conn, dc, DATACENTER_ROUND_FIELDS, stmt), last, len(bounds) > limit)


def events_page(conn: Connection, run_id: str, *, since_id: int | None, limit: int) -> Page:
    """Rows of ``events`` with ``id > since_id``, in the order they were logged, at most ``limit``."""
    stmt = (select(*(EVENTS.c[f] for f in EVENT_FIELDS))
            .where(EVENTS.c.run_id == run_id, _after(EVENTS.c.id, since_id))
            .order_by(EVENTS.c.id).limit(limit + 1))
    return _page(_rows(conn, EVENTS, EVENT_FIELDS, stmt), "id", since_id, limit)


def async_updates_page(conn: Connection, run_id: str, *, since_seq: int | None, limit: int) -> Page:
    """Rows of ``async_updates`` with ``seq > since_seq``, by sequence number, at most ``limit``."""
    au = ASYNC_UPDATES
    stmt = (select(*(au.c[f] for f in ASYNC_UPDATE_FIELDS))
            .where(au.c.run_id == run_id, _after(au.c.seq, since_seq))
            .order_by(au.c.seq).limit(limit + 1))
    return _page(_rows(conn, au, ASYNC_UPDATE_FIELDS, stmt), "seq", since_seq, limit)


def link_rounds(conn: Connection, run_id: str) -> list[dict[str, Any]]:
    """A gossip run's ``link_rounds`` rows, by round, sender, receiver."""
    return [_clean(r, LINK_ROUND_FIELDS) for r in list_link_rounds(conn, run_id)]


def link_totals(conn: Connection, run_id: str) -> dict[str, Any]:
    """What each pair of datacenters' link carried over a gossip run, both directions together, with the RTT the
    run's config gives the pair's path: ``{"datacenters": [...], "items": [...]}`` (no items for another run).

    ``datacenters``: the run's datacenters, those of its config in config order, then any other that its link rows
    name, by name. ``items``: one per unordered pair with at least one ``link_rounds`` row, by (``a``, ``b``) with
    ``a < b``: ``bytes`` (what both ends sent, failed exchanges included), ``bytes_a_to_b``, ``bytes_b_to_a``,
    ``rounds`` (rounds with an exchange on the pair), ``failed_rounds`` (of those, the rounds where a direction
    failed), ``in_flight_s_median`` (the median seconds in flight of the transfers that worked, each direction of
    each round; ``None`` when none did), and from the config (:func:`config_link_paths`) ``route`` and ``rtt_ms``.
    Reads the run's link rows once, six narrow columns of each.
    """
    lr = LINK_ROUNDS
    stmt = (select(lr.c.round, lr.c.src, lr.c.dst, lr.c.bytes, lr.c.in_flight_s, lr.c.error.is_not(None))
            .where(lr.c.run_id == run_id))
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for round_, src, dst, sent, in_flight_s, failed in conn.execute(stmt):
        a, b = sorted((src, dst))
        pair = pairs.setdefault((a, b), {"a_to_b": 0, "b_to_a": 0, "rounds": set(), "failed": set(), "in_flight": []})
        pair["a_to_b" if src == a else "b_to_a"] += int(sent or 0)
        pair["rounds"].add(round_)
        if failed:
            pair["failed"].add(round_)
        elif (seconds := finite_float(in_flight_s)) is not None:
            pair["in_flight"].append(seconds)
    config_row = conn.execute(select(RUNS.c.config).where(RUNS.c.id == run_id)).first()
    config = config_row[0] if config_row is not None and isinstance(config_row[0], dict) else {}
    configured = run_datacenters({"config": config})
    named = sorted({name for pair in pairs for name in pair} - set(configured))
    paths = LINK_PATHS.get(run_id, config)
    items = []
    for (a, b), pair in sorted(pairs.items()):
        route, rtt_ms = paths.get((a, b), (None, None))
        items.append({
            "a": a, "b": b, "bytes": pair["a_to_b"] + pair["b_to_a"], "bytes_a_to_b": pair["a_to_b"],
            "bytes_b_to_a": pair["b_to_a"], "rounds": len(pair["rounds"]), "failed_rounds": len(pair["failed"]),
            "in_flight_s_median": statistics.median(pair["in_flight"]) if pair["in_flight"] else None,
            "route": route, "rtt_ms": rtt_ms,
        })
    return {"datacenters": configured + named, "items": items}


def config_link_paths(config: Mapping[str, Any]) -> dict[tuple[str, str], tuple[str, float | None]]:
    """For each unordered pair (a, b), a < b, of the datacenters of a run's config (as stored with the run): the
    pair's ``route`` and its emulated RTT in ms (crossdc.experiment.builders.datacenter_rtts). ``"direct"``: the
    pair is a link of ``[[links]]``; ``"coordinator"``: its exchanges cross the coordinator's site on both
    datacenters' own links. Empty for a config that does not parse any more."""
    try:
        parsed = parse_config(dict(config))
    except (ConfigError, TypeError, ValueError):
        return {}
    return {(a, b) if a < b else (b, a): ("direct" if parsed.mesh_link(a, b) is not None else "coordinator", rtt)
            for (a, b), rtt in datacenter_rtts(parsed).items()}


class ParsedConfigCache:
    """What `derive` makes of a run's stored config, kept for the newest `size` (run id, config) pairs used: the
    config is parsed once, then served from memory while its text is unchanged. Thread-safe (the API answers from a
    thread pool); `parses` counts the calls of `derive`. Callers must not change what :meth:`get` returns."""

    def __init__(self, derive: Callable[[Mapping[str, Any]], Any], size: int = 256) -> None:
        self.derive, self.size, self.parses = derive, size, 0
        self._entries: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, run_id: str, config: Mapping[str, Any]) -> Any:
        """`derive(config)`, from the cache when the run's config is the one derived before (by SHA-256 of its
        canonical JSON, so the cache holds no config text)."""
        text = json.dumps(config, sort_keys=True, default=str, allow_nan=True)
        key = (run_id, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = self.derive(config)  # outside the lock: two first requests may both derive; the result is the same
        with self._lock:
            self.parses += 1
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value


#: each run's :func:`config_link_paths`, parsed once per (run, config) while the process serves
LINK_PATHS = ParsedConfigCache(config_link_paths)


def has_gossip_rows(conn: Connection, run_id: str) -> bool:
    """Whether the run logged what a gossip run logs: a ``link_rounds`` row, or a round's consensus distance."""
    if not could_be_run_id(run_id):
        return False
    links = select(LINK_ROUNDS.c.id).where(LINK_ROUNDS.c.run_id == run_id).limit(1)
    consensus = (select(ROUNDS.c.round).where(ROUNDS.c.run_id == run_id, ROUNDS.c.consensus_distance.is_not(None))
                 .limit(1))
    return conn.execute(links).first() is not None or conn.execute(consensus).first() is not None


def pipeline_stages(conn: Connection, run_id: str, *, round: int | None = None) -> list[dict[str, Any]]:  # noqa: A002
    """A pipeline run's ``pipeline_stages`` rows (only ``round``'s, when given), by round then stage."""
    return [_clean(r, PIPELINE_STAGE_FIELDS) for r in list_pipeline_stages(conn, run_id, round=round)]


def timeline_spans(conn: Connection, run_id: str, *, limit: int, datacenter: str | None = None,
                   round: int | None = None) -> tuple[list[dict[str, Any]], bool]:  # noqa: A002
    """The run's newest ``limit`` timeline spans (only ``datacenter``'s, only ``round``'s, when given) by datacenter
    then start, and whether older ones were left out."""
    if datacenter is not None and not storable(datacenter):
        return [], False
    rows = list_timeline_spans(conn, run_id, datacenter=datacenter, round=round, limit=limit + 1)
    truncated = len(rows) > limit
    if truncated:  # the extra one only says there is more: the oldest goes
        rows.remove(min(rows, key=lambda r: (r["start_s"], r["id"])))
    return [_clean(r, TIMELINE_SPAN_FIELDS) for r in rows], truncated


def last_round(conn: Connection, run_id: str) -> int | None:
    """The run's highest logged round (``rounds``), or ``None`` before its first."""
    return conn.execute(select(func.max(ROUNDS.c.round)).where(ROUNDS.c.run_id == run_id)).scalar()


# -------------------------------------------------------------------- runs


def _round_stats(conn: Connection, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per run: rounds_completed, last_round, slowest_round_wall_s (``rounds`` aggregates).

    One scalar subquery per aggregate, so each is answered by the index that covers it: the count and the
    highest round by the unique (run_id, round), the slowest round by (run_id, wall_s) in one seek.
    """
    if not run_ids:
        return {}

    def per_run(aggregate: Any) -> Any:
        return select(aggregate).select_from(ROUNDS).where(ROUNDS.c.run_id == RUNS.c.id).correlate(RUNS).scalar_subquery()

    stmt = select(RUNS.c.id.label("run_id"), per_run(func.count()).label("rounds_completed"),
                  per_run(func.max(ROUNDS.c.round)).label("last_round"),
                  per_run(func.max(ROUNDS.c.wall_s)).label("slowest_round_wall_s")).where(RUNS.c.id.in_(run_ids))
    return {r["run_id"]: dict(r) for r in conn.execute(stmt).mappings()}


def _latest_evaluation(conn: Connection, run_id: str) -> dict[str, Any]:
    """The run's latest evaluated round: val_round, val_loss, val_accuracy (``None`` each if never evaluated)."""
    stmt = (select(ROUNDS.c.round, ROUNDS.c.val_loss, ROUNDS.c.val_accuracy)
            .where(ROUNDS.c.run_id == run_id, or_(ROUNDS.c.val_loss.is_not(None), ROUNDS.c.val_accuracy.is_not(None)))
            .order_by(ROUNDS.c.round.desc()).limit(1))
    row = conn.execute(stmt).mappings().first()
    if row is None:
        return {"val_round": None, "val_loss": None, "val_accuracy": None}
    return {"val_round": row["round"], "val_loss": finite_or_none(row["val_loss"]),
            "val_accuracy": finite_or_none(row["val_accuracy"])}


def _summaries(conn: Connection, rows: list[Mapping[str, Any]], now: datetime) -> list[dict[str, Any]]:
    stats = _round_stats(conn, [r["id"] for r in rows])
    out = []
    for row in rows:
        s = stats.get(row["id"], {})
        slowest = finite_or_none(s.get("slowest_round_wall_s"))
        status = effective_status(row, slowest, now)
        summary = {k: as_utc(row[k]) for k in _RUN_SUMMARY_COLUMNS if k != "error"}
        summary.update(status=status.status, status_detail=status.detail, stored_status=row["status"],
                       rounds_completed=int(s.get("rounds_completed") or 0), last_round=s.get("last_round"),
                       slowest_round_wall_s=slowest, **_latest_evaluation(conn, row["id"]))
        out.append(summary)
    return out


def stale_running_run_ids(conn: Connection, now: datetime) -> set[str]:
    """Ids of the runs stored as ``running`` that :func:`effective_status` shows as ``interrupted``."""
    running = list(conn.execute(
        select(RUNS.c.id, RUNS.c.status, RUNS.c.started_at, RUNS.c.last_heartbeat).where(RUNS.c.status == "running")
    ).mappings())
    stats = _round_stats(conn, [r["id"] for r in running])
    return {r["id"] for r in running
            if effective_status(r, finite_or_none(stats.get(r["id"], {}).get("slowest_round_wall_s")), now).status != "running"}


def _status_filter(conn: Connection, status: str | None, now: datetime) -> ColumnElement[bool]:
    """The WHERE clause that selects runs whose *effective* status is ``status``."""
    if status is None:
        return true()
    if status == "running":
        return and_(RUNS.c.status == "running", RUNS.c.id.not_in(stale_running_run_ids(conn, now)))
    if status == "interrupted":
        return or_(RUNS.c.status == "interrupted", RUNS.c.id.in_(stale_running_run_ids(conn, now)))
    return RUNS.c.status == status


def list_run_summaries(
    conn: Connection,
    *,
    now: datetime,
    status: str | None = None,
    strategy: str | None = None,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[dict[str, Any]], int]:
    """A page of runs, newest first, and how many runs match in all.

    Each summary: the ``runs`` columns (``error`` aside), the effective ``status`` with ``status_detail`` and the
    ``stored_status``, ``rounds_completed``, ``last_round``, ``slowest_round_wall_s``, and the latest evaluation
    (``val_round``, ``val_loss``, ``val_accuracy``). ``status`` filters on the effective status.
    """
    where = [_status_filter(conn, status, now)]
    if strategy is not None:
        where.append(RUNS.c.strategy == strategy if storable(strategy) else false())
    total = int(conn.execute(select(func.count()).select_from(RUNS).where(*where)).scalar_one())
    stmt = (select(*(RUNS.c[k] for k in _RUN_SUMMARY_COLUMNS)).where(*where)
            .order_by(RUNS.c.started_at.desc(), RUNS.c.id).limit(limit).offset(offset))
    return _summaries(conn, list(conn.execute(stmt).mappings()), now), total


def run_detail(conn: Connection, run_id: str, *, now: datetime) -> dict[str, Any] | None:
    """Everything about one run (``None`` if there is no such run).

    The summary of :func:`list_run_summaries`, plus ``config``, ``result``, ``error``, ``flower_run_ids`` (a list
    of decimal strings: they are unsigned 64-bit, beyond what a JSON number keeps exactly), the run's byte totals
    (``bytes_up_total``, ``bytes_down_total``, ``bytes_up_raw_total``) and the ``datacenters`` named in its rows.
    """
    if not could_be_run_id(run_id):
        return None
    row = conn.execute(select(RUNS).where(RUNS.c.id == run_id)).mappings().first()
    if row is None:
        return None
    detail = _summaries(conn, [row], now)[0]
    totals = conn.execute(
        select(func.coalesce(func.sum(ROUNDS.c.bytes_up), 0), func.coalesce(func.sum(ROUNDS.c.bytes_down), 0),
               func.coalesce(func.sum(ROUNDS.c.bytes_up_raw), 0)).where(ROUNDS.c.run_id == run_id)
    ).one()
    config, result = row["config"], row["result"]
    detail.update(
        config=config if isinstance(config, dict) else {},
        result=result if isinstance(result, dict) or result is None else {"value": result},
        error=row["error"],
        flower_run_ids=[part.strip() for part in (row["flower_run_ids"] or "").split(",") if part.strip()],
        bytes_up_total=int(totals[0]), bytes_down_total=int(totals[1]), bytes_up_raw_total=int(totals[2]),
        datacenters=run_datacenters(row),
    )
    return detail


def run_datacenters(row: Mapping[str, Any]) -> list[str]:
    """The datacenter names of the run's config (``[[datacenters]] name``), in config order."""
    config = row["config"] if isinstance(row["config"], dict) else {}
    entries = config.get("datacenters")
    if not isinstance(entries, list):
        return []
    return [str(e["name"]) for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)]


def run_exists(conn: Connection, run_id: str) -> bool:
    """Whether the run is in ``runs``."""
    if not could_be_run_id(run_id):
        return False
    return conn.execute(select(RUNS.c.id).where(RUNS.c.id == run_id)).first() is not None


def run_is_running(conn: Connection, run_id: str, *, now: datetime) -> bool | None:
    """Whether the run's effective status is ``running`` (``None``: no such run)."""
    if not could_be_run_id(run_id):
        return None
    row = conn.execute(select(RUNS.c.id, RUNS.c.status, RUNS.c.started_at, RUNS.c.last_heartbeat, RUNS.c.error)
                       .where(RUNS.c.id == run_id)).mappings().first()
    if row is None:
        return None
    if row["status"] != "running":
        return False
    slowest = conn.execute(select(func.max(ROUNDS.c.wall_s)).where(ROUNDS.c.run_id == run_id)).scalar()
    return effective_status(row, finite_or_none(slowest), now).status == "running"


# ------------------------------------------------------------- datacenters


def datacenters(conn: Connection, *, now: datetime) -> list[dict[str, Any]]:
    """All enrolled datacenters by name, each with ``last_seen_age_s`` (seconds since ``last_seen``, or ``None``)."""
    out = []
    for row in conn.execute(select(DATACENTERS).order_by(DATACENTERS.c.name)).mappings():
        item = _clean(row, DATACENTER_FIELDS)
        seen = item["last_seen"]
        item["last_seen_age_s"] = max(0.0, (now - seen).total_seconds()) if seen is not None else None
        out.append(item)
    return out


# ----------------------------------------------------------------- metrics


@dataclass(frozen=True)
class RunMetrics:
    """What /metrics reports of one run."""

    run_id: str
    name: str
    strategy: str
    status: str
    baseline: str
    rounds_completed: int
    rounds_planned: int
    bytes_up: int
    bytes_down: int
    bytes_up_raw: int
    heartbeat_age_s: float | None


@dataclass(frozen=True)
class DatacenterWindow:
    """One datacenter's rows of a run's latest rounds (the metrics window): sums of durations, rows by status."""

    run_id: str
    datacenter: str
    rounds: int
    compute_s: float
    comm_s: float
    overhead_s: float
    by_status: dict[str, int]
    #: Σidle_s and Σcompute_s over the accepted rows where both were measured (``None``: idle_s never measured)
    idle_s: float | None = None
    compute_idle_s: float | None = None

    @property
    def comm_comp_ratio(self) -> float | None:
        """``comm_s / compute_s`` over the window (flagged above 0.1, docs/glossary.md); ``None`` without compute time."""
        return comm_comp(self.comm_s, self.compute_s)

    @property
    def exposed_comm_comp_ratio(self) -> float | None:
        """Σidle_s / Σcompute_s over the window (flagged above 0.1, docs/glossary.md); ``None`` when not measured."""
        return comm_comp(self.idle_s, self.compute_idle_s)

    @property
    def trainer_utilisation(self) -> float | None:
        """Σcompute_s / Σ(compute_s + idle_s) over the window (docs/glossary.md); ``None`` when not measured."""
        return utilisation(self.compute_idle_s, self.idle_s)


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything /metrics reports, read in one go."""

    runs: list[RunMetrics]
    windows: list[DatacenterWindow]
    datacenters: list[dict[str, Any]]
    window_rounds: int


def metrics_snapshot(conn: Connection, *, now: datetime, recent_runs: int = METRICS_RECENT_RUNS,
                     window_rounds: int = METRICS_WINDOW_ROUNDS) -> MetricsSnapshot:
    """The runs that are running plus the ``recent_runs`` most recently started, with their datacenters' latest rounds."""
    recent = [r for (r,) in conn.execute(select(RUNS.c.id).order_by(RUNS.c.started_at.desc(), RUNS.c.id).limit(recent_runs))]
    running = [r for (r,) in conn.execute(select(RUNS.c.id).where(RUNS.c.status == "running"))]
    ids = list(dict.fromkeys(recent + running))
    summaries = {s["id"]: s for s in _summaries(conn, list(conn.execute(
        select(*(RUNS.c[k] for k in _RUN_SUMMARY_COLUMNS)).where(RUNS.c.id.in_(ids))).mappings()), now)} if ids else {}
    chosen = [i for i in ids if i in summaries and (i in recent or summaries[i]["status"] == "running")]
    totals = {r["run_id"]: r for r in conn.execute(
        select(ROUNDS.c.run_id, func.sum(ROUNDS.c.bytes_up).label("up"), func.sum(ROUNDS.c.bytes_down).label("down"),
               func.sum(ROUNDS.c.bytes_up_raw).label("raw")).where(ROUNDS.c.run_id.in_(chosen)).group_by(ROUNDS.c.run_id)
    ).mappings()} if chosen else {}
    runs = []
    windows: list[DatacenterWindow] = []
    for run_id in chosen:
        s, t = summaries[run_id], totals.get(run_id, {})
        beat = s["last_heartbeat"] or s["started_at"]
        runs.append(RunMetrics(
            run_id=run_id, name=s["name"], strategy=s["strategy"], status=s["status"], baseline=s["baseline"],
            rounds_completed=s["rounds_completed"], rounds_planned=s["rounds_planned"],
            bytes_up=int(t.get("up") or 0), bytes_down=int(t.get("down") or 0), bytes_up_raw=int(t.get("raw") or 0),
            heartbeat_age_s=max(0.0, (now - beat).total_seconds()) if beat is not None else None,
        ))
        windows.extend(_datacenter_windows(conn, run_id, window_rounds))
    return MetricsSnapshot(runs=runs, windows=windows, datacenters=datacenters(conn, now=now), window_rounds=window_rounds)


def _datacenter_windows(conn: Connection, run_id: str, window_rounds: int) -> list[DatacenterWindow]:
    dc = DATACENTER_ROUNDS
    newest = conn.execute(select(func.max(dc.c.round)).where(dc.c.run_id == run_id)).scalar()
    if newest is None:
        return []
    waited = and_(dc.c.idle_s.is_not(None), dc.c.compute_s.is_not(None))
    stmt = (select(dc.c.datacenter, dc.c.status, func.count().label("n"),
                   func.sum(dc.c.compute_s).label("compute_s"), func.sum(dc.c.comm_s).label("comm_s"),
                   func.sum(dc.c.overhead_s).label("overhead_s"), func.sum(case((waited, dc.c.idle_s))).label("idle_s"),
                   func.sum(case((waited, dc.c.compute_s))).label("compute_idle_s"))
            .where(dc.c.run_id == run_id, dc.c.round > newest - window_rounds)
            .group_by(dc.c.datacenter, dc.c.status).order_by(dc.c.datacenter, dc.c.status))
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for row in conn.execute(stmt).mappings():
        grouped.setdefault(row["datacenter"], []).append(row)
    out = []
    for name, rows in grouped.items():
        ok = [r for r in rows if r["status"] == "ok"]  # durations of accepted rounds only

        def total(field: str, ok: list[Any] = ok) -> float:
            return float(sum(finite_or_none(r[field]) or 0.0 for r in ok))

        measured = any(r["idle_s"] is not None for r in ok)
        out.append(DatacenterWindow(run_id=run_id, datacenter=name, rounds=sum(int(r["n"]) for r in rows),
                                    compute_s=total("compute_s"), comm_s=total("comm_s"), overhead_s=total("overhead_s"),
                                    by_status={r["status"]: int(r["n"]) for r in rows},
                                    idle_s=total("idle_s") if measured else None,
                                    compute_idle_s=total("compute_idle_s") if measured else None))
    return out


# ------------------------------------------------------------------ health


def database_health(conn: Connection) -> dict[str, Any]:
    """Whether the database answers and holds crossdc's schema: ``answers``, ``schema_revision``, ``latency_ms``.

    Raises SQLAlchemy's errors when the database does not answer; a database without the schema answers with
    ``schema_revision`` ``None``.
    """
    started = time.perf_counter()
    conn.exec_driver_sql("SELECT 1").scalar()
    latency_ms = 1000 * (time.perf_counter() - started)
    revision = None
    if inspect(conn).has_table("alembic_version"):  # else never migrated
        revision = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    return {"answers": True, "schema_revision": revision, "latency_ms": latency_ms}


__all__ = [
    "MAX_PAGE_SIZE",
    "STALE_AFTER_MIN_S",
    "STALE_AFTER_SLOWEST_ROUNDS",
    "DatacenterWindow",
    "EffectiveStatus",
    "MetricsSnapshot",
    "Page",
    "RunMetrics",
    "as_utc",
    "async_updates_page",
    "config_link_paths",
    "could_be_run_id",
    "database_health",
    "datacenter_rounds_page",
    "datacenters",
    "effective_status",
    "events_page",
    "finite_or_none",
    "has_gossip_rows",
    "last_round",
    "link_totals",
    "list_run_summaries",
    "metrics_snapshot",
    "pipeline_stages",
    "rounds_page",
    "run_datacenters",
    "run_detail",
    "run_exists",
    "run_is_running",
    "stale_after_s",
    "stale_running_run_ids",
    "storable",
    "timeline_spans",
    "utcnow",
]
