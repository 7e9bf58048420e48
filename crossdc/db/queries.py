"""Small read helpers (tests, CLI). Rows come back as plain dicts keyed by column name.

Every helper takes an ``Engine``, a ``Connection`` or an ORM ``Session``.
Timestamps are returned as timezone-aware UTC datetimes on every backend
(SQLite stores them without an offset). Ordering follows the logical clock
(round, datacenter name, insertion order), never wall-clock time.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, Executable, Table, select
from sqlalchemy.orm import Session

from crossdc.db.models import ASYNC_UPDATES as _ASYNC
from crossdc.db.models import CHECKPOINTS as _CHECKPOINTS
from crossdc.db.models import DATACENTER_ROUNDS as _DC_ROUNDS
from crossdc.db.models import DATACENTERS as _DATACENTERS
from crossdc.db.models import EVENTS as _EVENTS
from crossdc.db.models import FRAGMENT_EXCHANGES as _FRAGMENTS
from crossdc.db.models import LINK_ROUNDS as _LINKS
from crossdc.db.models import PIPELINE_STAGES as _PIPELINE
from crossdc.db.models import ROUNDS as _ROUNDS
from crossdc.db.models import RUNS as _RUNS
from crossdc.db.models import TIMELINE_SPANS as _SPANS

Bind = Engine | Connection | Session



def utcnow() -> datetime:
    """Now, timezone-aware UTC (the one clock every run-log timestamp comes from)."""
    return datetime.now(UTC)


def as_utc(value: Any) -> Any:
    """A datetime as aware UTC (SQLite hands back naive UTC); anything else unchanged."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    return value


def _rows(bind: Bind, stmt: Executable) -> list[dict[str, Any]]:
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            result = conn.execute(stmt).mappings().all()
    else:
        result = bind.execute(stmt).mappings().all()
    return [{k: as_utc(v) for k, v in row.items()} for row in result]


def _ordered(table: Table, run_id: str | None, order: Iterable[Any]) -> Any:
    stmt = select(table)
    if run_id is not None:
        stmt = stmt.where(table.c.run_id == run_id)
    return stmt.order_by(*order)


def get_run(bind: Bind, run_id: str) -> dict[str, Any] | None:
    """The ``runs`` row of ``run_id``, or ``None``."""
    rows = _rows(bind, select(_RUNS).where(_RUNS.c.id == run_id))
    return rows[0] if rows else None


def get_run_at(db_url: str, run_id: str) -> dict[str, Any] | None:
    """The ``runs`` row of ``run_id`` in the database at `db_url` (read over an engine made for it), or ``None``."""
    from crossdc.db.engine import make_engine

    engine = make_engine(db_url)
    try:
        return get_run(engine, run_id)
    finally:
        engine.dispose()


def list_runs(bind: Bind, *, limit: int | None = None) -> list[dict[str, Any]]:
    """All runs, newest first."""
    stmt = select(_RUNS).order_by(_RUNS.c.started_at.desc(), _RUNS.c.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return _rows(bind, stmt)


def list_rounds(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``rounds`` rows, by round."""
    return _rows(bind, _ordered(_ROUNDS, run_id, (_ROUNDS.c.round,)))


def list_datacenter_rounds(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``datacenter_rounds`` rows, by round then datacenter."""
    return _rows(bind, _ordered(_DC_ROUNDS, run_id, (_DC_ROUNDS.c.round, _DC_ROUNDS.c.datacenter)))


def list_events(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``events`` rows, in the order they were logged."""
    return _rows(bind, _ordered(_EVENTS, run_id, (_EVENTS.c.id,)))


def list_async_updates(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``async_updates`` rows, by sequence number."""
    return _rows(bind, _ordered(_ASYNC, run_id, (_ASYNC.c.seq,)))


def list_fragment_exchanges(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``fragment_exchanges`` rows (a streaming run), by exchange then datacenter."""
    return _rows(bind, _ordered(_FRAGMENTS, run_id, (_FRAGMENTS.c.exchange, _FRAGMENTS.c.datacenter)))


def list_link_rounds(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``link_rounds`` rows (a gossip run), by round, then sender, then receiver."""
    return _rows(bind, _ordered(_LINKS, run_id, (_LINKS.c.round, _LINKS.c.src, _LINKS.c.dst)))


def list_pipeline_stages(bind: Bind, run_id: str, *, round: int | None = None) -> list[dict[str, Any]]:  # noqa: A002
    """The run's ``pipeline_stages`` rows (a pipeline run; only ``round``'s when given), by round, then replica, then
    stage."""
    stmt = _ordered(_PIPELINE, run_id, (_PIPELINE.c.round, _PIPELINE.c.replica, _PIPELINE.c.stage))
    if round is not None:
        stmt = stmt.where(_PIPELINE.c.round == round)
    return _rows(bind, stmt)


def list_timeline_spans(bind: Bind, run_id: str, *, datacenter: str | None = None, round: int | None = None,  # noqa: A002
                        limit: int | None = None) -> list[dict[str, Any]]:
    """The run's ``timeline_spans`` rows (only ``datacenter``'s, only ``round``'s, when given), by datacenter, then
    start, then id.

    With ``limit``, only the newest ``limit`` spans (the latest ``start_s``, the last logged among equal ones): a
    long run has many, and a timeline shows its end. They are picked from the index on (run_id, datacenter,
    start_s), or on (run_id, round) for one round's, before any row is read.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    chosen = select(_SPANS.c.id).where(_SPANS.c.run_id == run_id)
    if datacenter is not None:
        chosen = chosen.where(_SPANS.c.datacenter == datacenter)
    if round is not None:
        chosen = chosen.where(_SPANS.c.round == round)
    if limit is not None:
        chosen = chosen.order_by(_SPANS.c.start_s.desc(), _SPANS.c.id.desc()).limit(limit)
    ids = chosen.subquery()
    stmt = (select(_SPANS).join(ids, _SPANS.c.id == ids.c.id)
            .order_by(_SPANS.c.datacenter, _SPANS.c.start_s, _SPANS.c.id))
    return _rows(bind, stmt)


def list_checkpoints(bind: Bind, run_id: str) -> list[dict[str, Any]]:
    """The run's ``checkpoints`` rows, by round."""
    return _rows(bind, _ordered(_CHECKPOINTS, run_id, (_CHECKPOINTS.c.round,)))


def list_datacenters(bind: Bind) -> list[dict[str, Any]]:
    """All ``datacenters`` rows, by name."""
    return _rows(bind, select(_DATACENTERS).order_by(_DATACENTERS.c.name))


def enrolled_identities(bind: Bind) -> list[dict[str, Any]]:
    """``name``, ``status`` and ``node_id`` (Flower's node id of the enrolled key, as text; None when not
    registered) of every ``datacenters`` row, by name: who each SuperNode of a standing federation is."""
    columns = (_DATACENTERS.c.name, _DATACENTERS.c.status, _DATACENTERS.c.node_id)
    return _rows(bind, select(*columns).order_by(_DATACENTERS.c.name))


def enrolled_identities_at(db_url: str) -> list[dict[str, Any]]:
    """:func:`enrolled_identities` of the database at `db_url` (read over an engine made for it, then let go)."""
    from crossdc.db.engine import make_engine

    engine = make_engine(db_url)
    try:
        return enrolled_identities(engine)
    finally:
        engine.dispose()


def parse_flower_run_ids(text: str | None) -> list[int]:
    """``runs.flower_run_ids`` ("123,456") as integers, oldest first."""
    return [int(part) for part in (text or "").split(",") if part.strip()]


__all__ = [
    "enrolled_identities",
    "enrolled_identities_at",
    "get_run",
    "get_run_at",
    "list_async_updates",
    "list_checkpoints",
    "list_fragment_exchanges",
    "list_datacenter_rounds",
    "list_datacenters",
    "list_events",
    "list_pipeline_stages",
    "list_rounds",
    "list_runs",
    "list_timeline_spans",
    "parse_flower_run_ids",
]
