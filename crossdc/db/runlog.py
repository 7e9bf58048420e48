"""The run log: the single writer the platform uses during a run.

Promise: logging never slows training noticeably, and a briefly unavailable
database does not kill a run.

* Every call validates and snapshots its arguments in the caller's thread
  (bad values raise ``ValueError``/``TypeError`` there and then), stamps
  wall-clock times (``at``, ``started_at``, ...) at call time, and enqueues one
  record. It never touches the database and never blocks.
* One background thread writes the records in the order they were made, in
  batches, one transaction per batch.
* When the database cannot be reached (connection refused or reset, timeout,
  SQLite "database is locked"), the batch stays buffered and is retried with
  exponential backoff. Up to ``max_buffered`` records are kept.
* When the database has been unreachable for longer than ``max_outage_s`` (or
  the buffer overflowed, or the schema is missing), the run log is *failed*:
  :meth:`RunLog.raise_if_failed` and :meth:`RunLog.flush` raise
  :class:`~crossdc.db.errors.DatabaseUnavailable` from then on, so the caller
  can checkpoint and stop cleanly. The writer keeps retrying in the background
  until :meth:`RunLog.close`, so records made after the failure (say
  ``finish_run(..., status="interrupted")``) still land if the database comes
  back in time.
* Writes are idempotent where it matters: a batch retried after an error that
  hid a successful commit does not duplicate ``runs``, ``rounds``,
  ``datacenter_rounds``, ``async_updates``, ``checkpoints``, ``pipeline_stages``
  or ``datacenters`` rows (upserts on their unique keys). ``events`` and ``timeline_spans`` rows
  have no natural key; in that rare case (commit succeeded, acknowledgement
  lost) an event or a batch of spans can appear twice.
* A record the database rejects for a reason that retrying cannot fix (an
  integrity error, e.g. a round for a run that was never started) is dropped
  and logged at ERROR level; the others are written. ``stats()["rejected"]``
  counts them.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, and_, delete, exc, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from crossdc.db.engine import make_engine, safe_url
from crossdc.db.errors import DatabaseUnavailable
from crossdc.db.models import (
    ASYNC_UPDATE_STATUSES,
    AUDIT_OUTCOMES,
    BASELINES,
    DATACENTER_ROUND_STATUSES,
    MICROBATCH_SPAN_KINDS,
    RUN_STATUSES,
)
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
from crossdc.db.queries import utcnow
from crossdc.db.records import DatacenterRoundRecord, PipelineStageRecord, TimelineSpanRecord
from crossdc.db.security import record_audit
from crossdc.db.values import json_safe, non_finite_text

log = logging.getLogger(__name__)


_UINT64_MAX = 2**64 - 1


# ------------------------------------------------------------------ validation


def _float(name: str, value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a number or None, got {value!r}") from e


def _int(name: str, value: Any, *, nullable: bool = True, minimum: int | None = None) -> int | None:
    if value is None:
        if nullable:
            return None
        raise TypeError(f"{name} must be an integer, got None")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an integer, got {value!r}") from e
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _text(name: str, value: Any, *, nullable: bool = False) -> str | None:
    if value is None:
        if nullable:
            return None
        raise TypeError(f"{name} must be a string, got None")
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not nullable and not value:
        raise ValueError(f"{name} must not be empty")
    return value


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _timeline_span(index: int, span: Any) -> dict[str, Any]:
    """Span ``index`` of a batch as the columns it is written to; TypeError/ValueError saying which span and why."""
    if not isinstance(span, TimelineSpanRecord):
        raise TypeError(f"spans[{index}] must be a TimelineSpanRecord, got {type(span).__name__}")
    try:
        row = span.validated()
    except (TypeError, ValueError) as err:
        raise type(err)(f"spans[{index}]: {err}") from err
    if not (math.isfinite(row["start_s"]) and math.isfinite(row["end_s"])):
        raise ValueError(f"spans[{index}]: start_s and end_s must be finite, got {row['start_s']} and {row['end_s']}")
    if row["end_s"] < row["start_s"]:
        raise ValueError(f"spans[{index}]: end_s must be >= start_s, got start_s={row['start_s']}, end_s={row['end_s']}")
    if row["kind"] in MICROBATCH_SPAN_KINDS and (row["microbatch"] is None or row["step"] is None):
        raise ValueError(f"spans[{index}]: a {row['kind']} span needs its microbatch and step, got "
                         f"microbatch={row['microbatch']}, step={row['step']}")
    return row


def _json_default(obj: Any) -> Any:
    # numpy scalars / arrays, torch scalars, tuples of those, datetimes, paths ...
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if hasattr(obj, "tolist") and callable(obj.tolist):
        return obj.tolist()
    if isinstance(obj, datetime):
        return obj.isoformat()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def _json(name: str, value: Any) -> Any:
    """A JSON-safe deep copy of ``value`` (the caller may mutate the original afterwards)."""
    if value is None:
        return None
    try:
        text = json.dumps(value, default=_json_default)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} is not JSON-serialisable: {e}") from e
    return json_safe(json.loads(text), non_finite_text)  # NaN/±Inf: not JSON, PostgreSQL rejects them


# -------------------------------------------------------------------- upserts


def _upsert(
    conn: Connection,
    table: Table,
    values: Mapping[str, Any],
    keys: tuple[str, ...],
    update_cols: tuple[str, ...] | None = None,
    update_where: ColumnElement[bool] | None = None,
) -> None:
    """INSERT, or UPDATE ``update_cols`` (default: every non-key column given) on a key conflict; with
    `update_where`, only a conflicting row that meets it is updated (the others are left as they are)."""
    if update_cols is None:
        update_cols = tuple(c for c in values if c not in keys)
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        ins = (sqlite.insert if dialect == "sqlite" else postgresql.insert)(table).values(**values)
        if update_cols:
            stmt = ins.on_conflict_do_update(
                index_elements=list(keys), set_={c: ins.excluded[c] for c in update_cols}, where=update_where
            )
        else:
            stmt = ins.on_conflict_do_nothing(index_elements=list(keys))
        conn.execute(stmt)
        return
    # Portable fallback for other backends (one writer per run, so no race to worry about).
    where = and_(*(table.c[k] == values[k] for k in keys))
    if update_cols:
        condition = where if update_where is None else and_(where, update_where)
        res = conn.execute(update(table).where(condition).values({c: values[c] for c in update_cols}))
        if res.rowcount:
            return
    if conn.execute(select(table.c[keys[0]]).where(where)).first() is not None:
        return
    conn.execute(insert(table).values(**values))


# ------------------------------------------------------------------ writers
# Each op runs inside the batch's transaction, in the writer thread.


def _op_start_run(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _RUNS, v, ("id",))


def _op_resume_run(conn: Connection, v: dict[str, Any]) -> None:
    conn.execute(
        update(_RUNS)
        .where(_RUNS.c.id == v["run_id"])
        .values(status="running", finished_at=None, error=None, last_heartbeat=v["at"])
    )


def _op_add_flower_run_id(conn: Connection, v: dict[str, Any]) -> None:
    current = conn.execute(
        select(_RUNS.c.flower_run_ids).where(_RUNS.c.id == v["run_id"])
    ).scalar_one_or_none()
    if current is None:
        raise LookupError(f"run {v['run_id']!r} does not exist (call start_run first)")
    ids = [s for s in current.split(",") if s]
    if v["flower_run_id"] in ids:  # idempotent under retries
        return
    ids.append(v["flower_run_id"])
    conn.execute(
        update(_RUNS).where(_RUNS.c.id == v["run_id"]).values(flower_run_ids=",".join(ids))
    )


def _op_round(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _ROUNDS, v, ("run_id", "round"))


def _op_datacenter_round(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _DC_ROUNDS, v, ("run_id", "round", "datacenter"))


def _op_async_update(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _ASYNC, v, ("run_id", "seq"))


def _op_fragment_exchange(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _FRAGMENTS, v, ("run_id", "exchange", "datacenter"))


def _op_link_round(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _LINKS, v, ("run_id", "round", "src", "dst"))


def _op_pipeline_stage(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _PIPELINE, v, ("run_id", "round", "replica", "stage"))


def _op_timeline_spans(conn: Connection, v: dict[str, Any]) -> None:
    conn.execute(insert(_SPANS), [{"run_id": v["run_id"], **span} for span in v["spans"]])


def _op_forget_rounds_after(conn: Connection, v: dict[str, Any]) -> None:
    for table in (_ROUNDS, _DC_ROUNDS, _CHECKPOINTS, _FRAGMENTS, _SPANS, _LINKS, _PIPELINE):
        conn.execute(delete(table).where(table.c.run_id == v["run_id"], table.c.round > v["round"]))


def _op_forget_versions_after(conn: Connection, v: dict[str, Any]) -> None:
    conn.execute(delete(_DC_ROUNDS).where(_DC_ROUNDS.c.run_id == v["run_id"], _DC_ROUNDS.c.round >= v["version"]))
    conn.execute(delete(_ASYNC).where(_ASYNC.c.run_id == v["run_id"], _ASYNC.c.seq > v["seq"]))


def _op_checkpoint(conn: Connection, v: dict[str, Any]) -> None:
    _upsert(conn, _CHECKPOINTS, v, ("run_id", "round"))


def _op_event(conn: Connection, v: dict[str, Any]) -> None:
    conn.execute(insert(_EVENTS).values(**v))


def _op_touch_datacenter(conn: Connection, v: dict[str, Any]) -> None:
    """A new name is inserted active; an active one is updated; a suspended or revoked one is left alone (its key is
    unregistered: nothing a run sees is that datacenter)."""
    values = {**v, "status": "active", "enrolled_at": v["last_seen"]}
    optional = ("region", "gpus", "link_bandwidth_mbps", "link_rtt_ms")
    update_cols = ("last_seen",) + tuple(c for c in optional if v.get(c) is not None)
    _upsert(conn, _DATACENTERS, values, ("name",), update_cols, update_where=_DATACENTERS.c.status == "active")


def _op_audit(conn: Connection, v: dict[str, Any]) -> None:
    record_audit(conn, v["action"], v["outcome"], actor=v["actor"], target=v["target"], client=v["client"],
                 detail=v["detail"])


def _op_heartbeat(conn: Connection, v: dict[str, Any]) -> None:
    conn.execute(update(_RUNS).where(_RUNS.c.id == v["run_id"]).values(last_heartbeat=v["at"]))


#: the event with which a resume announces the attempt it starts, before it starts it (detail ``{"attempt": N}``;
#: logged by crossdc.orchestration.local_run): from then on an end recorded by an earlier attempt is ignored
RESUME_REQUESTED = "resume-requested"
#: the event that says an end recorded by an attempt older than the newest was ignored
STALE_END_IGNORED = "stale-end-ignored"


def newest_attempt(details: Iterable[Any]) -> int:
    """The newest attempt named (``{"attempt": N}``, N an int) by the details of a run's RESUME_REQUESTED events;
    1 (the first attempt) if none names one."""
    return max([1, *(d["attempt"] for d in details if isinstance(d, Mapping) and type(d.get("attempt")) is int)])


def _op_finish_run(conn: Connection, v: dict[str, Any]) -> None:
    """The first final status wins: a run that already ended keeps its status, error and result. An end recorded by
    an attempt (``v["attempt"]``) older than the newest one requested is ignored, with a STALE_END_IGNORED event."""
    if v["attempt"] is not None:
        # the run's row locked first (PostgreSQL): a resume committing meanwhile is seen, or waits for this end
        conn.execute(select(_RUNS.c.id).where(_RUNS.c.id == v["run_id"]).with_for_update())
        newest = newest_attempt(conn.execute(select(_EVENTS.c.detail).where(
            _EVENTS.c.run_id == v["run_id"], _EVENTS.c.kind == RESUME_REQUESTED)).scalars())
        if v["attempt"] < newest:
            log.warning("run %s: attempt %d's end (%s) ignored: attempt %d runs now", v["run_id"], v["attempt"],
                        v["status"], newest)
            conn.execute(insert(_EVENTS).values(
                run_id=v["run_id"], at=v["at"], kind=STALE_END_IGNORED,
                detail={"attempt": v["attempt"], "newest_attempt": newest, "status": v["status"], "error": v["error"]}))
            return
    res = conn.execute(
        update(_RUNS)
        .where(_RUNS.c.id == v["run_id"], _RUNS.c.status == "running")
        .values(
            status=v["status"],
            finished_at=v["at"],
            last_heartbeat=v["at"],
            error=v["error"],
            result=v["result"],
        )
    )
    if res.rowcount == 0:
        if conn.execute(select(_RUNS.c.status).where(_RUNS.c.id == v["run_id"])).first() is None:
            raise LookupError(f"run {v['run_id']!r} does not exist (call start_run first)")
        log.info("run %s had already ended; its final status is kept (not %s)", v["run_id"], v["status"])


_Op = Callable[[Connection, dict[str, Any]], None]


def _is_transient(error: BaseException) -> bool:
    """Errors that retrying later can fix: the database is unreachable, restarting or locked."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(
        error,
        (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError),
    ) and not _is_missing_schema(error)


def _is_missing_schema(error: BaseException) -> bool:
    text = str(getattr(error, "orig", None) or error).lower()
    if "no such table" in text:  # SQLite
        return True
    orig = getattr(error, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None) or getattr(getattr(orig, "diag", None), "sqlstate", None)
    return sqlstate == "42P01"  # PostgreSQL undefined_table


def _one_line(error: BaseException) -> str:
    if isinstance(error, exc.DBAPIError) and error.orig is not None:
        error = error.orig
    text = " ".join(str(error).split()) or type(error).__name__
    cut = text.find("(Background on this error")
    return (text[:cut].strip() if cut > 0 else text)[:300]


# ------------------------------------------------------------------- RunLog


class RunLog:
    """Buffered, ordered, retrying writer of one process's run records.

    Use as a context manager, or call :meth:`close` at the end. Thread-safe:
    any thread may log; records are written in the order the calls returned.
    """

    def __init__(
        self,
        url: str,
        *,
        max_outage_s: float = 300.0,
        max_buffered: int = 100_000,
        batch_size: int = 500,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 2.0,
    ) -> None:
        if max_outage_s <= 0:
            raise ValueError("max_outage_s must be > 0")
        if max_buffered < 1 or batch_size < 1:
            raise ValueError("max_buffered and batch_size must be >= 1")
        self.url = url
        self.max_outage_s = float(max_outage_s)
        self.max_buffered = int(max_buffered)
        self._batch_size = int(batch_size)
        self._retry_initial_s = float(retry_initial_s)
        self._retry_max_s = float(retry_max_s)
        self._engine = make_engine(url)  # raises InvalidDatabaseUrl now, not in the writer

        self._cond = threading.Condition()
        self._queue: deque[tuple[str, _Op, dict[str, Any]]] = deque()
        self._enqueued = 0  # records accepted
        self._done = 0  # records written, rejected or abandoned
        self._written = 0
        self._rejected = 0
        self._overflowed = 0
        self._write_failures = 0
        self._attempt_since: float | None = None  # monotonic start of the current unfinished write
        self._last_error: str | None = None
        self._in_outage = False  # writes are failing for a retryable reason right now
        self._failure: str | None = None  # sticky failure message
        self._closing = False
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._writer, name="crossdc-runlog-writer", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------- public API

    def start_run(
        self,
        *,
        run_id: str,
        name: str,
        strategy: str,
        config: dict[str, Any],
        rounds_planned: int,
        baseline: str = "none",
    ) -> None:
        """Create the run (status ``running``, ``started_at`` now).

        Calling it again with the same ``run_id`` overwrites the run's metadata
        (use :meth:`resume_run` to continue an existing run).
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        now = utcnow()
        self._put(
            "start_run",
            _op_start_run,
            {
                "id": _text("run_id", run_id),
                "name": _text("name", name, nullable=False),
                "strategy": _text("strategy", strategy),
                "config": _json("config", dict(config)),
                "status": "running",
                "started_at": now,
                "finished_at": None,
                "flower_run_ids": "",
                "baseline": _choice("baseline", baseline, BASELINES),
                "rounds_planned": _int("rounds_planned", rounds_planned, nullable=False, minimum=0),
                "error": None,
                "last_heartbeat": now,
                "result": None,
            },
        )

    def resume_run(self, *, run_id: str) -> None:
        """Mark an existing run ``running`` again (clears ``finished_at`` and ``error``)."""
        self._put("resume_run", _op_resume_run, {"run_id": _text("run_id", run_id), "at": utcnow()})

    def forget_rounds_after(self, *, run_id: str, round: int) -> None:  # noqa: A002
        """Delete the run's ``rounds``, ``datacenter_rounds``, ``checkpoints``, ``fragment_exchanges``,
        ``timeline_spans``, ``link_rounds`` and ``pipeline_stages`` rows after ``round``: a run resumed from the
        checkpoint of ``round`` trains them again, and each round is in the log once."""
        self._put("forget_rounds_after", _op_forget_rounds_after,
                  {"run_id": _text("run_id", run_id), "round": _int("round", round, nullable=False, minimum=0)})

    def forget_versions_after(self, *, run_id: str, version: int, seq: int) -> None:
        """For an asynchronous run resumed from the checkpoint of `version` (taken once `seq` replies had arrived):
        delete what :meth:`forget_rounds_after` leaves of what came after it, the ``datacenter_rounds`` rows of
        `version` on (a version's rows are written when the next one is made) and the ``async_updates`` rows after
        `seq`; the resumed run logs them again, each once."""
        self._put("forget_versions_after", _op_forget_versions_after,
                  {"run_id": _text("run_id", run_id), "version": _int("version", version, nullable=False, minimum=0),
                   "seq": _int("seq", seq, nullable=False, minimum=0)})

    def add_flower_run_id(self, *, run_id: str, flower_run_id: int) -> None:
        """Append a Flower run id (unsigned 64-bit) to the run's ``flower_run_ids`` (stored as text)."""
        fid = _int("flower_run_id", flower_run_id, nullable=False, minimum=0)
        assert fid is not None
        if fid > _UINT64_MAX:
            raise ValueError(f"flower_run_id must fit in 64 unsigned bits, got {fid}")
        self._put(
            "add_flower_run_id",
            _op_add_flower_run_id,
            {"run_id": _text("run_id", run_id), "flower_run_id": str(fid)},
        )

    def log_round(
        self,
        *,
        run_id: str,
        round: int,  # noqa: A002 - the column's name
        tau: int | None,
        val_loss: float | None,
        val_accuracy: float | None,
        bytes_up: int,
        bytes_down: int,
        bytes_up_raw: int,
        wall_s: float | None,
        eval_s: float | None = None,
        consensus_distance: float | None = None,
    ) -> None:
        """Record (or overwrite) one round of a run (`consensus_distance`: a gossip run's)."""
        self._put(
            "round",
            _op_round,
            {
                "run_id": _text("run_id", run_id),
                "round": _int("round", round, nullable=False, minimum=0),
                "tau": _int("tau", tau),
                "val_loss": _float("val_loss", val_loss),
                "val_accuracy": _float("val_accuracy", val_accuracy),
                "bytes_up": _int("bytes_up", bytes_up, nullable=False, minimum=0),
                "bytes_down": _int("bytes_down", bytes_down, nullable=False, minimum=0),
                "bytes_up_raw": _int("bytes_up_raw", bytes_up_raw, nullable=False, minimum=0),
                "wall_s": _float("wall_s", wall_s),
                "eval_s": _float("eval_s", eval_s),
                "consensus_distance": _float("consensus_distance", consensus_distance),
            },
        )

    def log_datacenter_round(self, *, run_id: str, round: int, datacenter: str,  # noqa: A002
                             record: DatacenterRoundRecord | None = None, **columns: Any) -> None:
        """Record (or overwrite) one datacenter's part of a round (async: ``round`` = applied version): a
        :class:`~crossdc.db.records.DatacenterRoundRecord`, or its columns as keywords (an unknown name is a
        TypeError naming it). Every value is checked against its column before anything is queued."""
        if record is None:
            record = DatacenterRoundRecord(**columns)
        elif columns:
            raise TypeError("give a DatacenterRoundRecord or its columns, not both")
        self._put(
            "datacenter_round",
            _op_datacenter_round,
            {
                "run_id": _text("run_id", run_id),
                "round": _int("round", round, nullable=False, minimum=0),
                "datacenter": _text("datacenter", datacenter),
                **record.validated(),
            },
        )

    def log_async_update(
        self,
        *,
        run_id: str,
        seq: int,
        datacenter: str,
        base_version: int,
        applied_version: int | None,
        staleness: int,
        scale: float | None,
        status: str,
        bytes_up: int = 0,
    ) -> None:
        """Record (or overwrite) one update of an asynchronous run, keyed by (run_id, seq)."""
        self._put(
            "async_update",
            _op_async_update,
            {
                "run_id": _text("run_id", run_id),
                "seq": _int("seq", seq, nullable=False, minimum=0),
                "datacenter": _text("datacenter", datacenter),
                "base_version": _int("base_version", base_version, nullable=False, minimum=0),
                "applied_version": _int("applied_version", applied_version, minimum=0),
                "staleness": _int("staleness", staleness, nullable=False),
                "scale": _float("scale", scale),
                "status": _choice("status", status, ASYNC_UPDATE_STATUSES),
                "bytes_up": _int("bytes_up", bytes_up, nullable=False, minimum=0),
            },
        )

    def log_fragment_exchange(self, *, run_id: str, round: int, exchange: int, fragment: int,  # noqa: A002
                              datacenter: str, status: str, reason: str | None = None, bytes_up: int = 0,
                              bytes_down: int = 0, sent_step: int | None = None, compute_s: float | None = None,
                              idle_s: float | None = None, round_s: float | None = None) -> None:
        """Record (or overwrite) one datacenter's part of one exchange of a streaming run, keyed by (run_id,
        exchange, datacenter)."""
        self._put(
            "fragment_exchange",
            _op_fragment_exchange,
            {
                "run_id": _text("run_id", run_id),
                "round": _int("round", round, nullable=False, minimum=1),
                "exchange": _int("exchange", exchange, nullable=False, minimum=1),
                "fragment": _int("fragment", fragment, nullable=False, minimum=0),
                "datacenter": _text("datacenter", datacenter),
                "status": _choice("status", status, DATACENTER_ROUND_STATUSES),
                "reason": _text("reason", reason, nullable=True),
                "bytes_up": _int("bytes_up", bytes_up, nullable=False, minimum=0),
                "bytes_down": _int("bytes_down", bytes_down, nullable=False, minimum=0),
                "sent_step": _int("sent_step", sent_step, minimum=0),
                "compute_s": _float("compute_s", compute_s),
                "idle_s": _float("idle_s", idle_s),
                "round_s": _float("round_s", round_s),
            },
        )

    def log_link_round(self, *, run_id: str, round: int, src: str, dst: str, bytes: int,  # noqa: A002
                       in_flight_s: float | None = None, error: str | None = None) -> None:
        """Record (or overwrite) what the link from datacenter `src` to `dst` carried in one round of a gossip run,
        keyed by (run_id, round, src, dst)."""
        self._put(
            "link_round",
            _op_link_round,
            {
                "run_id": _text("run_id", run_id),
                "round": _int("round", round, nullable=False, minimum=1),
                "src": _text("src", src),
                "dst": _text("dst", dst),
                "bytes": _int("bytes", bytes, nullable=False, minimum=0),
                "in_flight_s": _float("in_flight_s", in_flight_s),
                "error": _text("error", error, nullable=True),
            },
        )

    def log_pipeline_stage(self, *, run_id: str, round: int, record: PipelineStageRecord) -> None:  # noqa: A002
        """Record (or overwrite) one stage's part of one round of a pipeline run, keyed by (run_id, round,
        ``record.replica``, ``record.stage``): a round logged again (after a resume) replaces its row. Every value is checked against its
        column before anything is queued (a negative byte count, a bubble fraction outside [0, 1], a non-finite
        duration or an unknown ``bytes_source`` is a ValueError naming the field; a value of the wrong type a
        TypeError)."""
        if not isinstance(record, PipelineStageRecord):
            raise TypeError(f"record must be a PipelineStageRecord, got {type(record).__name__}")
        self._put(
            "pipeline_stage",
            _op_pipeline_stage,
            {
                "run_id": _text("run_id", run_id),
                "round": _int("round", round, nullable=False, minimum=1),
                **record.validated(),
            },
        )

    def log_timeline_spans(self, *, run_id: str, spans: Sequence[TimelineSpanRecord]) -> None:
        """Record a batch of spans of the run's per-datacenter timelines (one record, one transaction; none: nothing).

        Each span is checked against its column (a ``kind`` outside ``SPAN_KINDS`` is a ValueError), its
        times must be finite with ``end_s >= start_s``, and a pipeline's ``forward`` or ``backward`` span needs its
        ``microbatch`` and ``step``; a bad span raises naming its place in ``spans``, and then
        nothing of the batch is queued. Spans have no natural key: like an event, a batch retried after an error
        that hid its commit can appear twice.
        """
        rows = [_timeline_span(i, span) for i, span in enumerate(spans)]
        if rows:
            self._put("timeline_spans", _op_timeline_spans, {"run_id": _text("run_id", run_id), "spans": rows})

    def log_checkpoint(self, *, run_id: str, round: int, uri: str) -> None:  # noqa: A002
        """Record a checkpoint of ``run_id`` taken after ``round`` (``created_at`` now)."""
        self._put(
            "checkpoint",
            _op_checkpoint,
            {
                "run_id": _text("run_id", run_id),
                "round": _int("round", round, nullable=False, minimum=0),
                "uri": _text("uri", uri),
                "created_at": utcnow(),
            },
        )

    def log_event(
        self,
        *,
        run_id: str,
        kind: str,
        round: int | None = None,  # noqa: A002
        datacenter: str | None = None,
        detail: dict[str, Any] | str | None = None,
    ) -> None:
        """Record an event (drop, rejoin, timeout, rejection, checkpoint, resume, ...) at now."""
        if detail is not None and not isinstance(detail, (str, Mapping)):
            raise TypeError(f"detail must be a dict, a string or None, got {type(detail).__name__}")
        self._put(
            "event",
            _op_event,
            {
                "run_id": _text("run_id", run_id),
                "at": utcnow(),
                "round": _int("round", round),
                "kind": _text("kind", kind),
                "datacenter": _text("datacenter", datacenter, nullable=True),
                "detail": _json("detail", dict(detail) if isinstance(detail, Mapping) else detail),
            },
        )

    def touch_datacenter(
        self,
        *,
        name: str,
        region: str | None = None,
        gpus: int | None = None,
        link_bandwidth_mbps: float | None = None,
        link_rtt_ms: float | None = None,
    ) -> None:
        """Insert the datacenter (status ``active``) or update it; ``last_seen`` = now. A suspended or revoked
        datacenter is left alone: its key is unregistered, so no node a run sees is it.

        Fields given as ``None`` leave the stored value alone.
        """
        self._put(
            "touch_datacenter",
            _op_touch_datacenter,
            {
                "name": _text("name", name),
                "region": _text("region", region, nullable=True),
                "gpus": _int("gpus", gpus, minimum=0),
                "link_bandwidth_mbps": _float("link_bandwidth_mbps", link_bandwidth_mbps),
                "link_rtt_ms": _float("link_rtt_ms", link_rtt_ms),
                "last_seen": utcnow(),
            },
        )

    def audit(
        self,
        *,
        action: str,
        outcome: str,
        actor: str | None = None,
        target: str | None = None,
        client: str | None = None,
        detail: dict[str, Any] | str | None = None,
    ) -> None:
        """Append one ``audit_log`` row (:func:`crossdc.db.security.record_audit`), in order with this log's other
        records and, like them, kept through an outage: what a run refused (a node that claimed a datacenter its key
        is not enrolled as). The row's ``at`` is when it is written (record_audit's clock), normally within the
        writer's batch of the call. ``actor``, ``target`` and ``client`` are at most 128 characters, ``action`` 64."""
        if detail is not None and not isinstance(detail, (str, Mapping)):
            raise TypeError(f"detail must be a dict, a string or None, got {type(detail).__name__}")
        values = {"action": _text("action", action), "outcome": _choice("outcome", outcome, AUDIT_OUTCOMES),
                  "actor": _text("actor", actor, nullable=True), "target": _text("target", target, nullable=True),
                  "client": _text("client", client, nullable=True),
                  "detail": _json("detail", dict(detail) if isinstance(detail, Mapping) else detail)}
        for name, limit in (("action", 64), ("actor", 128), ("target", 128), ("client", 128)):
            if values[name] is not None and len(values[name]) > limit:
                raise ValueError(f"{name} must be at most {limit} characters, got {len(values[name])}")
        self._put("audit", _op_audit, values)

    def heartbeat(self, *, run_id: str) -> None:
        """Set the run's ``last_heartbeat`` to now (a stale heartbeat marks a dead run)."""
        self._put("heartbeat", _op_heartbeat, {"run_id": _text("run_id", run_id), "at": utcnow()})

    def finish_run(
        self,
        *,
        run_id: str,
        status: str,
        error: str | None = None,
        result: dict[str, Any] | None = None,
        attempt: int | None = None,
    ) -> None:
        """End the run: ``status`` (finished, failed, interrupted), ``finished_at`` now.

        The first final status wins: ending a run that has already ended changes nothing
        (so a ServerApp killed during teardown cannot overwrite the orchestrator's verdict).
        With ``attempt`` (the attempt at the run that ends it: a ServerApp's), an end from an attempt older than the
        newest one a resume requested (:data:`RESUME_REQUESTED`) changes nothing either, and is logged as a
        :data:`STALE_END_IGNORED` event: an older attempt's ServerApp still ending cannot end the newer one's run.
        """
        if status == "running":
            raise ValueError("finish_run needs a final status: finished, failed or interrupted")
        if result is not None and not isinstance(result, Mapping):
            raise TypeError(f"result must be a dict or None, got {type(result).__name__}")
        self._put(
            "finish_run",
            _op_finish_run,
            {
                "run_id": _text("run_id", run_id),
                "status": _choice("status", status, RUN_STATUSES),
                "error": _text("error", error, nullable=True),
                "result": _json("result", dict(result) if result is not None else None),
                "attempt": _int("attempt", attempt, minimum=1),
                "at": utcnow(),
            },
        )

    # ------------------------------------------------------------- control

    @property
    def failed(self) -> bool:
        with self._cond:
            return self._check_failure_locked() is not None

    def raise_if_failed(self) -> None:
        """Raise :class:`DatabaseUnavailable` if the run log has failed (see the module doc)."""
        with self._cond:
            message = self._check_failure_locked()
        if message is not None:
            raise DatabaseUnavailable(message)

    def mark(self) -> int:
        """A mark of every record made before this call, for :meth:`written`."""
        with self._cond:
            return self._enqueued

    def written(self, mark: int) -> bool:
        """Whether every record made before `mark` was taken is written (or rejected by the database): never blocks."""
        with self._cond:
            return self._done >= mark

    def flush(self, timeout: float | None = None) -> None:
        """Block until every record made before this call is written.

        Raises :class:`DatabaseUnavailable` if the run log fails meanwhile (or had
        failed), and ``TimeoutError`` if ``timeout`` seconds pass first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while True:
                message = self._check_failure_locked()
                if message is not None:
                    raise DatabaseUnavailable(message)
                if self._done >= target:
                    return
                wait = 0.1
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"run log flush timed out after {timeout:g}s with "
                            f"{target - self._done} record(s) not yet written to {safe_url(self.url)}"
                            + (f" (last error: {self._last_error})" if self._last_error else "")
                        )
                    wait = min(wait, remaining)
                self._cond.wait(wait)

    def close(self, timeout: float = 30.0) -> int:
        """Write what is buffered (for up to ``timeout`` s), stop the writer, release the engine.

        Returns the number of records that could not be written (0 when all
        landed); a nonzero count is also logged. Never raises for database
        errors, so it is safe in ``finally`` blocks. Idempotent.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._done < self._enqueued and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            lost = self._enqueued - self._done
        self._abort.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        if lost:
            log.error(
                "run log closed with %d record(s) not written to %s (last error: %s)",
                lost,
                safe_url(self.url),
                self._last_error,
            )
        self._engine.dispose()
        return lost + self._overflowed

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring and tests."""
        with self._cond:
            outage = (
                time.monotonic() - self._attempt_since
                if self._attempt_since is not None and self._in_outage
                else 0.0
            )
            return {
                "enqueued": self._enqueued,
                "written": self._written,
                "buffered": self._enqueued - self._done,
                "rejected": self._rejected,
                "overflowed": self._overflowed,
                "write_failures": self._write_failures,
                "outage_s": outage,
                "last_error": self._last_error,
                "failed": self._check_failure_locked() is not None,
            }

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _check_failure_locked(self) -> str | None:
        if self._failure is None and self._attempt_since is not None:
            stuck = time.monotonic() - self._attempt_since
            if stuck > self.max_outage_s:
                self._failure = (
                    f"database {safe_url(self.url)} unreachable for {stuck:.1f}s "
                    f"(max_outage_s={self.max_outage_s:g}); "
                    f"{self._enqueued - self._done} run-log record(s) not written"
                    + (f"; last error: {self._last_error}" if self._last_error else "")
                )
                log.error("run log failed: %s", self._failure)
        return self._failure

    def _put(self, kind: str, op: _Op, values: dict[str, Any]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("RunLog is closed")
            if self._enqueued - self._done >= self.max_buffered:
                self._overflowed += 1
                if self._failure is None:
                    self._failure = (
                        f"run log buffer full: {self.max_buffered} record(s) waiting for database "
                        f"{safe_url(self.url)}; newer records are being dropped"
                        + (f"; last error: {self._last_error}" if self._last_error else "")
                    )
                    log.error("run log failed: %s", self._failure)
                return
            self._queue.append((kind, op, values))
            self._enqueued += 1
            self._cond.notify_all()

    def _writer(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._abort.is_set():
                    self._cond.wait()
                if self._abort.is_set():
                    return
                n = min(len(self._queue), self._batch_size)
                batch = [self._queue.popleft() for _ in range(n)]
            try:
                self._write_batch(batch)
            except Exception:  # never let the writer die: nobody would notice
                log.exception("run log writer: unexpected error; %d record(s) dropped", len(batch))
                with self._cond:
                    self._rejected += len(batch)
                    self._done += len(batch)
                    self._cond.notify_all()
            if self._abort.is_set():
                return

    def _write_batch(self, batch: list[tuple[str, _Op, dict[str, Any]]]) -> None:
        delay = self._retry_initial_s
        while True:
            if self._abort.is_set():
                return  # close() gave up; the records stay counted as not written
            with self._cond:
                if self._attempt_since is None:
                    self._attempt_since = time.monotonic()
            try:
                with self._engine.begin() as conn:
                    for _kind, op, values in batch:
                        op(conn, values)
            except Exception as e:  # noqa: BLE001 - classified below
                if _is_transient(e) or _is_missing_schema(e):
                    self._note_failure(e)
                    self._abort.wait(delay)
                    delay = min(delay * 2, self._retry_max_s)
                    continue
                if len(batch) > 1:
                    # Something in the batch is bad: write the records one by one, dropping
                    # only the bad ones. (This stays an "attempt" for the outage clock.)
                    for record in batch:
                        self._write_batch([record])
                        if self._abort.is_set():
                            return
                    return
                kind, _op, values = batch[0]
                log.error(
                    "run log: dropped a %s record the database rejected: %s (values: %r)",
                    kind,
                    _one_line(e),
                    {k: values[k] for k in list(values)[:6]},
                )
                with self._cond:
                    self._rejected += 1
                    self._done += 1
                    self._attempt_since = None
                    self._in_outage = False
                    self._cond.notify_all()
                return
            with self._cond:
                if self._in_outage and self._attempt_since is not None:
                    log.warning(
                        "run log: database %s reachable again after %.1fs",
                        safe_url(self.url),
                        time.monotonic() - self._attempt_since,
                    )
                self._in_outage = False
                self._attempt_since = None
                self._written += len(batch)
                self._done += len(batch)
                self._cond.notify_all()
            return

    def _note_failure(self, error: BaseException) -> None:
        message = _one_line(error)
        with self._cond:
            first = not self._in_outage
            self._in_outage = True
            self._write_failures += 1
            self._last_error = message
            if _is_missing_schema(error) and self._failure is None:
                self._failure = (
                    f"database {safe_url(self.url)} has no crossdc schema ({message}); "
                    f"run `crossdc db upgrade --db URL` first"
                )
                log.error("run log failed: %s", self._failure)
            self._check_failure_locked()
        if first:
            log.warning(
                "run log: cannot write to %s (%s); buffering and retrying", safe_url(self.url), message
            )


__all__ = ["RunLog", "utcnow"]
