"""SQLAlchemy models: the SQL schema of the run log (one Alembic history, one head).

Column names are the API's field names. Conventions:

* timestamps are ``DateTime(timezone=True)`` and always written in UTC
  (SQLite stores them without an offset; :mod:`crossdc.db.queries` hands them
  back as aware UTC datetimes on both backends);
* byte counts are 64-bit integers; durations are float seconds;
* status-like columns are plain strings guarded by named CHECK constraints
  (portable, and cheap to extend in a later revision);
* every table that references a run has ``run_id`` -> ``runs.id``
  ``ON DELETE CASCADE`` and an index on ``run_id``;
* Flower run ids are unsigned 64-bit, so ``runs.flower_run_ids`` is text
  (comma-separated decimal ids, oldest first);
* the dashboard's reads get composite indexes (revision 0003) so that a page
  of a long run is an index range scan: ``rounds (run_id, wall_s)`` (a run's
  slowest round, for its effective status), ``datacenter_rounds (run_id,
  datacenter, round)`` (one datacenter's rows) and ``events (run_id, id)``
  (a run's events in logging order; PostgreSQL's index on ``run_id`` alone
  does not keep that order); revision 0008 adds ``timeline_spans (run_id,
  datacenter, start_s)`` (one datacenter's spans in time order, and the newest
  spans of a run from the index alone) and revision 0010 ``timeline_spans (run_id, round)`` (one round's spans:
  a pipeline run's per-stage view, and a resumed run forgetting the rounds after its checkpoint).

Any change here needs a new Alembic revision in ``migrations/versions/``
(``tests/test_db.py`` checks that the migrated schema matches these models).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Allowed values of the status-like columns.
RUN_STATUSES: tuple[str, ...] = ("running", "finished", "failed", "interrupted")
BASELINES: tuple[str, ...] = ("none", "all-workers", "sequential", "sync-dp")
DATACENTER_ROUND_STATUSES: tuple[str, ...] = ("ok", "failed", "timeout", "rejected")
ASYNC_UPDATE_STATUSES: tuple[str, ...] = ("applied", "discarded")
DATACENTER_STATUSES: tuple[str, ...] = ("active", "suspended", "revoked")
TOKEN_ROLES: tuple[str, ...] = ("admin", "enrollment", "read")
AUDIT_OUTCOMES: tuple[str, ...] = ("ok", "refused", "failed")
#: What a span of a datacenter's timeline is: its trainer computing or waiting (for the WAN or the coordinator), its
#: update on the way up to the coordinator, or the coordinator's result on the way down to it.
TIMELINE_SPAN_KINDS: tuple[str, ...] = ("compute", "wait", "up", "down")
#: What a span of a pipeline stage's timeline is (revision 0010): the stage computing one micro-batch's forward or
#: backward pass (its ``microbatch`` and ``step`` say which).
MICROBATCH_SPAN_KINDS: tuple[str, ...] = ("forward", "backward")
#: Every kind ``timeline_spans.kind`` accepts: the round loops' (TIMELINE_SPAN_KINDS), then the pipeline's.
SPAN_KINDS: tuple[str, ...] = TIMELINE_SPAN_KINDS + MICROBATCH_SPAN_KINDS
#: Who counted a pipeline stage's boundary bytes: the WAN emulator's link ledger, or the stage itself.
PIPELINE_BYTES_SOURCES: tuple[str, ...] = ("delay-line", "stage")

# Deterministic constraint names: Alembic (and SQLite batch mode) need them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# 64-bit surrogate keys on PostgreSQL; SQLite needs INTEGER PRIMARY KEY for its rowid alias.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


def _in(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{v}'" for v in values)
    return f"{column} IN ({quoted})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _run_fk() -> Any:
    return ForeignKey("runs.id", ondelete="CASCADE")


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        CheckConstraint(_in("baseline", BASELINES), name="baseline"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(Text)
    strategy: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Comma-separated decimal Flower run ids (unsigned 64-bit), oldest first; "" if none yet.
    flower_run_ids: Mapped[str] = mapped_column(Text, default="")
    baseline: Mapped[str] = mapped_column(String(16), default="none")
    rounds_planned: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    last_heartbeat: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Final summary (incl. gaps to baselines), written by finish_run.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Round(Base):
    __tablename__ = "rounds"
    __table_args__ = (
        UniqueConstraint("run_id", "round"),
        Index("ix_rounds_run_id_wall_s", "run_id", "wall_s"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    round: Mapped[int] = mapped_column(Integer)
    tau: Mapped[int | None] = mapped_column(Integer)
    val_loss: Mapped[float | None] = mapped_column(Float)
    val_accuracy: Mapped[float | None] = mapped_column(Float)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_up_raw: Mapped[int] = mapped_column(BigInteger, default=0)
    wall_s: Mapped[float | None] = mapped_column(Float)
    eval_s: Mapped[float | None] = mapped_column(Float)
    # A gossip run: the replicas' mean distance to their average after the round (revision 0009).
    consensus_distance: Mapped[float | None] = mapped_column(Float)


class DatacenterRound(Base):
    """One datacenter's part of one round; its non-key columns are the fields of
    crossdc.db.records.DatacenterRoundRecord, checked by their ``info`` (``minimum``, ``choices``)."""

    __tablename__ = "datacenter_rounds"
    __table_args__ = (
        UniqueConstraint("run_id", "round", "datacenter"),
        CheckConstraint(_in("status", DATACENTER_ROUND_STATUSES), name="status"),
        Index("ix_datacenter_rounds_run_id_datacenter_round", "run_id", "datacenter", "round"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    # In an async run: the global version at which the update was applied.
    round: Mapped[int] = mapped_column(Integer)
    datacenter: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), info={"choices": DATACENTER_ROUND_STATUSES})
    reason: Mapped[str | None] = mapped_column(Text)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0, info={"minimum": 0})
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0, info={"minimum": 0})
    bytes_up_raw: Mapped[int] = mapped_column(BigInteger, default=0, info={"minimum": 0})
    compute_s: Mapped[float | None] = mapped_column(Float)
    comm_s: Mapped[float | None] = mapped_column(Float)
    overhead_s: Mapped[float | None] = mapped_column(Float)
    # The time the datacenter's trainer waited for the WAN or the coordinator (revision 0006).
    idle_s: Mapped[float | None] = mapped_column(Float, info={"minimum": 0})
    round_s: Mapped[float | None] = mapped_column(Float)
    # How comm_s was obtained, e.g. "relay" (measured at the datacenter's link relay).
    comm_source: Mapped[str | None] = mapped_column(Text)
    # Bytes that crossed the datacenter's link during the round, framing and polls included (revision 0002).
    link_bytes_up: Mapped[int | None] = mapped_column(BigInteger, info={"minimum": 0})
    link_bytes_down: Mapped[int | None] = mapped_column(BigInteger, info={"minimum": 0})
    train_loss: Mapped[float | None] = mapped_column(Float)
    num_examples: Mapped[int | None] = mapped_column(BigInteger, info={"minimum": 0})
    drift_l2: Mapped[float | None] = mapped_column(Float)
    update_cosine: Mapped[float | None] = mapped_column(Float)
    staleness: Mapped[int | None] = mapped_column(Integer)
    # A gossip run: the replica's distance to the replicas' average after the round (revision 0009).
    consensus_distance: Mapped[float | None] = mapped_column(Float, info={"minimum": 0})


class AsyncUpdate(Base):
    __tablename__ = "async_updates"
    __table_args__ = (
        UniqueConstraint("run_id", "seq"),
        CheckConstraint(_in("status", ASYNC_UPDATE_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    datacenter: Mapped[str] = mapped_column(String(128))
    base_version: Mapped[int] = mapped_column(BigInteger)
    applied_version: Mapped[int | None] = mapped_column(BigInteger)
    staleness: Mapped[int] = mapped_column(Integer)
    scale: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16))
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)


class FragmentExchange(Base):
    """One datacenter's part of one exchange of a streaming run: fragment ``fragment`` of round ``round``, the
    run's ``exchange``-th sync; its status and bytes as the gate judged the reply, the inner step after which the
    update was taken, and the trainer's compute and waits since its previous send (revision 0007)."""

    __tablename__ = "fragment_exchanges"
    __table_args__ = (
        UniqueConstraint("run_id", "exchange", "datacenter"),
        CheckConstraint(_in("status", DATACENTER_ROUND_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    round: Mapped[int] = mapped_column(Integer)
    exchange: Mapped[int] = mapped_column(Integer)
    fragment: Mapped[int] = mapped_column(Integer)
    datacenter: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    sent_step: Mapped[int | None] = mapped_column(BigInteger)
    compute_s: Mapped[float | None] = mapped_column(Float)
    idle_s: Mapped[float | None] = mapped_column(Float)
    round_s: Mapped[float | None] = mapped_column(Float)


class TimelineSpan(Base):
    """One span of a datacenter's timeline (revision 0008): what its trainer did (``compute``; ``wait``, for the WAN
    or the coordinator) or what was in flight (``up``: its update on the way to the coordinator; ``down``: the
    coordinator's result on the way to it), from ``start_s`` to ``end_s``, seconds since the run's start (on the
    datacenter's clock for compute and wait, from the sender's clock to the receiver's for up and down). ``fragment`` and ``exchange``
    place a span of a streaming run; other loops leave them NULL. A pipeline run's stage logs ``forward`` and
    ``backward`` spans (revision 0010): its compute of one micro-batch (``microbatch``, from 0) in optimizer step
    ``step`` (from 1, counted over the run), on the stage's datacenter's clock. Its non-key columns are the fields of
    crossdc.db.records.TimelineSpanRecord, checked by their ``info``."""

    __tablename__ = "timeline_spans"
    __table_args__ = (
        CheckConstraint(_in("kind", SPAN_KINDS), name="kind"),
        CheckConstraint("end_s >= start_s", name="end_after_start"),
        Index("ix_timeline_spans_run_id_datacenter_start_s", "run_id", "datacenter", "start_s"),
        Index("ix_timeline_spans_run_id_round", "run_id", "round"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    round: Mapped[int] = mapped_column(Integer, info={"minimum": 0})
    datacenter: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16), info={"choices": SPAN_KINDS})
    start_s: Mapped[float] = mapped_column(Float)
    end_s: Mapped[float] = mapped_column(Float)
    fragment: Mapped[int | None] = mapped_column(Integer, info={"minimum": 0})
    exchange: Mapped[int | None] = mapped_column(Integer, info={"minimum": 1})
    # A pipeline run's forward and backward spans: which micro-batch, in which optimizer step (revision 0010).
    microbatch: Mapped[int | None] = mapped_column(Integer, info={"minimum": 0})
    step: Mapped[int | None] = mapped_column(Integer, info={"minimum": 1})


class PipelineStage(Base):
    """One stage's part of one round of a pipeline run (revision 0010): stage ``stage`` (0 first, in config order)
    of pipeline ``replica`` (revision 0011; 0 unless the run has several) on ``datacenter`` ran ``steps`` optimizer
    steps of ``microbatches`` micro-batches each; ``compute_s`` is its forward and backward compute over the round,
    ``wall_s`` the round's steps end to end at the stage, and ``bubble_fraction`` the share of ``wall_s`` it was not
    computing. ``bytes_forward``: the activation bytes that crossed the boundary after the stage, toward stage + 1
    (0 for the last stage); ``bytes_backward``: the gradient bytes that crossed the boundary before it, back to
    stage - 1 (0 for the first); ``bytes_source`` says who counted them (``delay-line``: the WAN emulator's link
    ledger; ``stage``: the stage itself). ``train_loss``: the last stage's mean micro-batch loss (NULL on the
    others). Its non-key columns are the fields of crossdc.db.records.PipelineStageRecord, checked by their ``info``
    (``minimum``, ``maximum``, ``choices``)."""

    __tablename__ = "pipeline_stages"
    __table_args__ = (
        UniqueConstraint("run_id", "round", "replica", "stage"),
        CheckConstraint(_in("bytes_source", PIPELINE_BYTES_SOURCES), name="bytes_source"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    round: Mapped[int] = mapped_column(Integer, info={"minimum": 1})
    stage: Mapped[int] = mapped_column(Integer, info={"minimum": 0})
    datacenter: Mapped[str] = mapped_column(String(128))
    # which pipeline the stage belongs to, in a run of several replicas (revision 0011; 0: the first, or the only one)
    replica: Mapped[int] = mapped_column(Integer, default=0, server_default="0", info={"minimum": 0})
    steps: Mapped[int] = mapped_column(Integer, info={"minimum": 0})
    microbatches: Mapped[int] = mapped_column(Integer, info={"minimum": 0})
    compute_s: Mapped[float] = mapped_column(Float, info={"minimum": 0, "finite": True})
    wall_s: Mapped[float] = mapped_column(Float, info={"minimum": 0, "finite": True})
    bubble_fraction: Mapped[float] = mapped_column(Float, info={"minimum": 0, "maximum": 1, "finite": True})
    bytes_forward: Mapped[int] = mapped_column(BigInteger, info={"minimum": 0})
    bytes_backward: Mapped[int] = mapped_column(BigInteger, info={"minimum": 0})
    bytes_source: Mapped[str] = mapped_column(String(16), info={"choices": PIPELINE_BYTES_SOURCES})
    train_loss: Mapped[float | None] = mapped_column(Float)


class LinkRound(Base):
    """What one datacenter-to-datacenter link carried in one round of a gossip run (revision 0009): the bytes
    ``src`` sent ``dst`` (headers and payload as sent), the seconds from the exchange's meeting to its last byte,
    and ``error`` when the exchange failed (the message did not arrive: the receiver mixed without it)."""

    __tablename__ = "link_rounds"
    __table_args__ = (UniqueConstraint("run_id", "round", "src", "dst"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    round: Mapped[int] = mapped_column(Integer)
    src: Mapped[str] = mapped_column(String(128))
    dst: Mapped[str] = mapped_column(String(128))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    in_flight_s: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    round: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(64))
    datacenter: Mapped[str | None] = mapped_column(String(128))
    # A JSON object, or a JSON string for a plain message.
    detail: Mapped[Any | None] = mapped_column(JSON)


class Datacenter(Base):
    __tablename__ = "datacenters"
    __table_args__ = (
        UniqueConstraint("name"),
        CheckConstraint(_in("status", DATACENTER_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    region: Mapped[str | None] = mapped_column(Text)
    gpus: Mapped[int | None] = mapped_column(Integer)
    public_key: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="active")
    enrolled_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_seen: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    link_bandwidth_mbps: Mapped[float | None] = mapped_column(Float)
    link_rtt_ms: Mapped[float | None] = mapped_column(Float)
    # Flower's node id of the enrolled key at the SuperLink (unsigned 64-bit: text); None when not registered
    node_id: Mapped[str | None] = mapped_column(String(20))


class ApiToken(Base):
    """A bearer token of the API. Only its SHA-256 is stored; the token itself is shown once, at creation."""

    __tablename__ = "api_tokens"
    __table_args__ = (
        UniqueConstraint("name"),
        UniqueConstraint("token_hash"),
        CheckConstraint(_in("role", TOKEN_ROLES), name="role"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # revision 0012: refused from then on (None: never expires)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ApiSession(Base):
    """A dashboard login (revision 0012): a browser's session cookie, opened with a read or admin token. Only the
    cookie's SHA-256 is stored; it lets through reads only while its token is live (not revoked, not expired)."""

    __tablename__ = "api_sessions"
    __table_args__ = (UniqueConstraint("session_hash"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    token_id: Mapped[int] = mapped_column(Integer, ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True)
    session_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class AuditEntry(Base):
    """One security-relevant act: an enrollment, a suspension or revocation, a token made, a refused attempt.

    Refusals of callers without a live token are aggregated (revision 0012): one row per client address, action,
    token name, status and reason per window, ``count`` of them from ``at`` to ``last_at``, found again by its
    ``window_key``; every other row is one act (``count`` 1, no ``window_key``)."""

    __tablename__ = "audit_log"
    __table_args__ = (CheckConstraint(_in("outcome", AUDIT_OUTCOMES), name="outcome"), UniqueConstraint("window_key"))

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    action: Mapped[str] = mapped_column(String(64))
    outcome: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(128))  # the token's name (never the token), or None
    target: Mapped[str | None] = mapped_column(String(128))  # e.g. the datacenter's name
    client: Mapped[str | None] = mapped_column(String(128))  # the caller's address
    detail: Mapped[Any | None] = mapped_column(JSON)
    count: Mapped[int] = mapped_column(Integer, server_default="1")  # how many acts the row stands for
    last_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # the last of them (aggregated rows)
    window_key: Mapped[str | None] = mapped_column(String(64))  # an aggregated row's key (its window included)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "round"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), _run_fk(), index=True)
    round: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


metadata = Base.metadata

__all__ = [
    "ASYNC_UPDATE_STATUSES",
    "AUDIT_OUTCOMES",
    "ApiSession",
    "ApiToken",
    "AuditEntry",
    "BASELINES",
    "DATACENTER_ROUND_STATUSES",
    "DATACENTER_STATUSES",
    "MICROBATCH_SPAN_KINDS",
    "PIPELINE_BYTES_SOURCES",
    "RUN_STATUSES",
    "SPAN_KINDS",
    "TIMELINE_SPAN_KINDS",
    "TOKEN_ROLES",
    "AsyncUpdate",
    "Base",
    "Checkpoint",
    "Datacenter",
    "DatacenterRound",
    "Event",
    "FragmentExchange",
    "PipelineStage",
    "Round",
    "Run",
    "TimelineSpan",
    "metadata",
]


# The tables as SQLAlchemy Core objects, for the run log's writes and the read helpers.
RUNS: Table = Run.__table__  # type: ignore[assignment]
ROUNDS: Table = Round.__table__  # type: ignore[assignment]
DATACENTER_ROUNDS: Table = DatacenterRound.__table__  # type: ignore[assignment]
EVENTS: Table = Event.__table__  # type: ignore[assignment]
DATACENTERS: Table = Datacenter.__table__  # type: ignore[assignment]
CHECKPOINTS: Table = Checkpoint.__table__  # type: ignore[assignment]
ASYNC_UPDATES: Table = AsyncUpdate.__table__  # type: ignore[assignment]
FRAGMENT_EXCHANGES: Table = FragmentExchange.__table__  # type: ignore[assignment]
TIMELINE_SPANS: Table = TimelineSpan.__table__  # type: ignore[assignment]
LINK_ROUNDS: Table = LinkRound.__table__  # type: ignore[assignment]
PIPELINE_STAGES: Table = PipelineStage.__table__  # type: ignore[assignment]
API_TOKENS: Table = ApiToken.__table__  # type: ignore[assignment]
API_SESSIONS: Table = ApiSession.__table__  # type: ignore[assignment]
AUDIT_LOG: Table = AuditEntry.__table__  # type: ignore[assignment]
