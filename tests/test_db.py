"""crossdc.db: schema, Alembic history, engines, the run log (incl. database outages), read helpers.

PostgreSQL tests (``-m postgres``) need the server on 127.0.0.1:5432 (trust auth,
database ``test``); each creates its own ``crossdc_test_<random>`` database and drops
it afterwards. Override the admin URL with ``CROSSDC_TEST_PG_ADMIN_URL``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from crossdc.db import engine as dbengine
from crossdc.db import queries
from crossdc.db.engine import (
    DEFAULT_DATABASE_URL,
    current_revision,
    downgrade,
    head_revisions,
    make_engine,
    resolve_database_url,
    upgrade,
)
from crossdc.db.errors import DatabaseUnavailable, InvalidDatabaseUrl
from crossdc.db.models import TIMELINE_SPAN_KINDS, metadata
from crossdc.db.records import TimelineSpanRecord
from crossdc.db.runlog import RESUME_REQUESTED, STALE_END_IGNORED, RunLog, newest_attempt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import via_relay as _via  # noqa: E402
from tcp_relay import TcpRelay  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The schema of the run log: the documented columns plus the agreed extra ones.
EXPECTED_COLUMNS: dict[str, set[str]] = {
    "runs": {
        "id", "name", "strategy", "config", "status", "started_at", "finished_at",
        "flower_run_ids", "baseline", "rounds_planned", "error", "last_heartbeat", "result",
    },
    "rounds": {
        "id", "run_id", "round", "tau", "val_loss", "val_accuracy", "bytes_up", "bytes_down",
        "bytes_up_raw", "wall_s", "eval_s", "consensus_distance",
    },
    "datacenter_rounds": {
        "id", "run_id", "round", "datacenter", "status", "reason", "bytes_up", "bytes_down",
        "bytes_up_raw", "compute_s", "comm_s", "overhead_s", "idle_s", "round_s", "comm_source",
        "link_bytes_up", "link_bytes_down",
        "train_loss", "num_examples", "drift_l2", "update_cosine", "staleness", "consensus_distance",
    },
    "async_updates": {
        "id", "run_id", "seq", "datacenter", "base_version", "applied_version", "staleness",
        "scale", "status", "bytes_up",
    },
    "events": {"id", "run_id", "at", "round", "kind", "datacenter", "detail"},
    "datacenters": {
        "id", "name", "region", "gpus", "public_key", "status", "enrolled_at", "last_seen",
        "link_bandwidth_mbps", "link_rtt_ms", "node_id",
    },
    "checkpoints": {"id", "run_id", "round", "uri", "created_at"},
    "timeline_spans": {"id", "run_id", "round", "datacenter", "kind", "start_s", "end_s", "fragment", "exchange",
                       "microbatch", "step"},
    "link_rounds": {"id", "run_id", "round", "src", "dst", "bytes", "in_flight_s", "error"},
    "pipeline_stages": {
        "id", "run_id", "round", "replica", "stage", "datacenter", "steps", "microbatches", "compute_s", "wall_s",
        "bubble_fraction", "bytes_forward", "bytes_backward", "bytes_source", "train_loss",
    },
    "api_tokens": {"id", "name", "role", "token_hash", "created_at", "revoked_at", "last_used_at", "expires_at"},
    "api_sessions": {"id", "token_id", "session_hash", "created_at", "expires_at"},
    "audit_log": {"id", "at", "action", "outcome", "actor", "target", "client", "detail", "count", "last_at", "window_key"},
}
BIG_FLOWER_ID = 2**63 + 12345  # does not fit a signed BIGINT


# --------------------------------------------------------------- fixtures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ URL / engine


def test_resolve_database_url_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CROSSDC_DATABASE_URL", raising=False)
    assert resolve_database_url(None) == DEFAULT_DATABASE_URL == "sqlite:///crossdc.db"
    monkeypatch.setenv("CROSSDC_DATABASE_URL", "postgresql://env@h/db")
    assert resolve_database_url(None) == "postgresql://env@h/db"
    assert resolve_database_url("sqlite:///cli.db") == "sqlite:///cli.db"
    assert resolve_database_url("") == "postgresql://env@h/db"


def test_make_engine_uses_psycopg3_for_plain_postgres_urls() -> None:
    for url in ("postgresql://u:secret@db.example/x", "postgres://u@db.example/x"):
        eng = make_engine(url)
        assert eng.url.drivername == "postgresql+psycopg"
        assert eng.dialect.driver == "psycopg"
    assert make_engine("postgresql+psycopg://u@h/x").url.drivername == "postgresql+psycopg"
    assert "secret" not in dbengine.safe_url("postgresql://u:secret@db.example/x")


def test_bad_urls_give_clear_errors() -> None:
    with pytest.raises(InvalidDatabaseUrl, match="invalid database URL"):
        make_engine("this is not a url")
    with pytest.raises(InvalidDatabaseUrl, match="cannot use database URL"):
        make_engine("nosuchdialect://h/x")


def test_unreachable_server_is_one_clear_line() -> None:
    url = f"postgresql://postgres:pw@127.0.0.1:{_free_port()}/nowhere"
    with pytest.raises(DatabaseUnavailable) as info:
        upgrade(url)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("database postgresql+psycopg://postgres:***@127.0.0.1:")
    assert "unavailable" in message and "pw" not in message
    with pytest.raises(DatabaseUnavailable):
        dbengine.check_connection(make_engine(url))


def test_sqlite_engine_pragmas(sqlite_url: str) -> None:
    eng = make_engine(sqlite_url)
    with eng.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == dbengine.SQLITE_BUSY_TIMEOUT_MS
    eng.dispose()


# --------------------------------------------------------------- migrations


def test_one_alembic_head() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(dbengine.alembic_config())
    heads = script.get_heads()
    assert len(heads) == 1, f"Alembic history has {len(heads)} heads: {heads}"
    assert head_revisions() == list(heads)
    # every revision is on the single line that ends in that head
    assert len(list(script.walk_revisions())) == len(list(script.iterate_revisions(heads[0], "base")))


def test_alembic_cli_heads_from_repo_top() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "alembic", "heads"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].endswith("(head)"), out.stdout


def _check_schema(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    eng = make_engine(url)
    try:
        insp = inspect(eng)
        tables = set(insp.get_table_names())
        assert set(EXPECTED_COLUMNS) <= tables
        for table, columns in EXPECTED_COLUMNS.items():
            assert {c["name"] for c in insp.get_columns(table)} == columns, table
            if table not in ("datacenters", "runs", "api_tokens", "api_sessions", "audit_log"):
                fks = insp.get_foreign_keys(table)
                assert [(fk["referred_table"], fk["options"].get("ondelete")) for fk in fks] == [
                    ("runs", "CASCADE")
                ], table
                assert any(ix["column_names"] == ["run_id"] for ix in insp.get_indexes(table)), table
        uniques = {t: [u["column_names"] for u in insp.get_unique_constraints(t)] for t in tables}
        assert ["run_id", "round"] in uniques["rounds"]
        assert ["run_id", "round", "datacenter"] in uniques["datacenter_rounds"]
        assert insp.get_pk_constraint("runs")["constrained_columns"] == ["id"]
        # the migrated database is exactly what the models describe
        with eng.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)
        assert diff == [], diff
    finally:
        eng.dispose()


def test_upgrade_fresh_sqlite(sqlite_url: str) -> None:
    assert current_revision(sqlite_url) is None
    upgrade(sqlite_url)
    assert current_revision(sqlite_url) == head_revisions()[0]
    _check_schema(sqlite_url)
    upgrade(sqlite_url)  # idempotent
    downgrade(sqlite_url, "base")
    assert current_revision(sqlite_url) is None
    assert set(inspect(make_engine(sqlite_url)).get_table_names()) <= {"alembic_version"}
    upgrade(sqlite_url)
    _check_schema(sqlite_url)


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_upgrade_fresh_postgres(pg_url: str) -> None:
    assert current_revision(pg_url) is None
    upgrade(pg_url)
    assert current_revision(pg_url) == head_revisions()[0]
    _check_schema(pg_url)
    downgrade(pg_url, "base")
    assert current_revision(pg_url) is None
    upgrade(pg_url)
    _check_schema(pg_url)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_url(request: pytest.FixtureRequest) -> str:
    """An empty database, never migrated, on each backend."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.mark.timeout(60)
def test_revision_0008_adds_and_drops_timeline_spans(fresh_url: str) -> None:
    upgrade(fresh_url, "0007")
    engine = make_engine(fresh_url)
    try:
        assert "timeline_spans" not in inspect(engine).get_table_names()
        upgrade(fresh_url, "0008")
        assert current_revision(fresh_url) == "0008"
        insp = inspect(engine)
        # revision 0010 adds microbatch and step
        assert {c["name"] for c in insp.get_columns("timeline_spans")} == EXPECTED_COLUMNS["timeline_spans"] - {"microbatch", "step"}
        indexes = {ix["name"]: ix["column_names"] for ix in insp.get_indexes("timeline_spans")}
        assert indexes["ix_timeline_spans_run_id_datacenter_start_s"] == ["run_id", "datacenter", "start_s"]
        nullable = {c["name"]: c["nullable"] for c in insp.get_columns("timeline_spans")}
        assert [c for c, n in nullable.items() if n] == ["fragment", "exchange"]
        upgrade(fresh_url)
        _check_schema(fresh_url)
        downgrade(fresh_url, "0007")
        insp = inspect(engine)
        assert current_revision(fresh_url) == "0007"
        assert "timeline_spans" not in insp.get_table_names() and "fragment_exchanges" in insp.get_table_names()
        upgrade(fresh_url)
        _check_schema(fresh_url)
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_revision_0009_adds_and_drops_gossip_columns_and_link_rounds(fresh_url: str) -> None:
    upgrade(fresh_url, "0008")
    engine = make_engine(fresh_url)
    try:
        assert "link_rounds" not in inspect(engine).get_table_names()
        upgrade(fresh_url, "0009")
        assert current_revision(fresh_url) == "0009"
        insp = inspect(engine)
        assert {c["name"] for c in insp.get_columns("link_rounds")} == EXPECTED_COLUMNS["link_rounds"]
        assert ["run_id", "round", "src", "dst"] in [u["column_names"] for u in insp.get_unique_constraints("link_rounds")]
        for table in ("rounds", "datacenter_rounds"):
            assert "consensus_distance" in {c["name"] for c in insp.get_columns(table)}
        upgrade(fresh_url)
        _check_schema(fresh_url)
        downgrade(fresh_url, "0008")
        insp = inspect(engine)
        assert "link_rounds" not in insp.get_table_names()
        assert "consensus_distance" not in {c["name"] for c in insp.get_columns("rounds")}
        upgrade(fresh_url)
        _check_schema(fresh_url)
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_revision_0012_adds_token_expiry_sessions_and_audit_windows_and_goes_back(fresh_url: str) -> None:
    upgrade(fresh_url, "0011")
    engine = make_engine(fresh_url)
    try:
        with engine.begin() as conn:  # a token and an audit row written before the revision
            conn.execute(text("INSERT INTO api_tokens (name, role, token_hash, created_at) VALUES "
                              "('ops', 'admin', :h, CURRENT_TIMESTAMP)"), {"h": "a" * 64})
            conn.execute(text("INSERT INTO audit_log (at, action, outcome) VALUES (CURRENT_TIMESTAMP, 'enroll', 'ok')"))
        upgrade(fresh_url, "0012")
        assert current_revision(fresh_url) == "0012"
        insp = inspect(engine)
        for table in ("api_tokens", "api_sessions", "audit_log"):
            assert {c["name"] for c in insp.get_columns(table)} == EXPECTED_COLUMNS[table], table
        assert [fk["referred_table"] for fk in insp.get_foreign_keys("api_sessions")] == ["api_tokens"]
        assert ["window_key"] in [u["column_names"] for u in insp.get_unique_constraints("audit_log")]
        with engine.connect() as conn:  # what was there before: a token that never expires, a row of one act
            assert conn.execute(text("SELECT expires_at FROM api_tokens")).one() == (None,)
            assert conn.execute(text("SELECT count, window_key FROM audit_log")).one() == (1, None)
        upgrade(fresh_url)
        _check_schema(fresh_url)
        downgrade(fresh_url, "0011")
        insp = inspect(engine)
        assert "api_sessions" not in insp.get_table_names()
        assert "expires_at" not in {c["name"] for c in insp.get_columns("api_tokens")}
        assert {c["name"] for c in insp.get_columns("audit_log")} == EXPECTED_COLUMNS["audit_log"] - {
            "count", "last_at", "window_key"}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM audit_log")).scalar() == 1
        upgrade(fresh_url)
        _check_schema(fresh_url)
    finally:
        engine.dispose()


def test_check_constraints_reject_unknown_status(migrated_sqlite_url: str) -> None:
    from sqlalchemy.exc import IntegrityError

    eng = make_engine(migrated_sqlite_url)
    with pytest.raises(IntegrityError):
        with eng.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO runs (id, name, strategy, config, status, started_at, flower_run_ids,"
                    " baseline, rounds_planned) VALUES ('x', 'x', 's', '{}', 'bogus', '2024-01-01',"
                    " '', 'none', 1)"
                )
            )
    eng.dispose()


def test_check_constraints_guard_timeline_spans(migrated_sqlite_url: str) -> None:
    """Past the run log's own checks, the table itself refuses an unknown kind and a span that ends before it starts."""
    from sqlalchemy.exc import IntegrityError

    with RunLog(migrated_sqlite_url) as log:
        log.start_run(run_id="r", name="r", strategy="s", config={}, rounds_planned=1)
    eng = make_engine(migrated_sqlite_url)
    insert = ("INSERT INTO timeline_spans (run_id, round, datacenter, kind, start_s, end_s) "
              "VALUES ('r', 1, 'a', :kind, :start, :end)")
    try:
        with eng.begin() as conn:
            conn.execute(text(insert), {"kind": "compute", "start": 1.0, "end": 1.0})  # zero length is a span
        for values in ({"kind": "sleep", "start": 0.0, "end": 1.0}, {"kind": "up", "start": 2.0, "end": 1.0}):
            with pytest.raises(IntegrityError):
                with eng.begin() as conn:
                    conn.execute(text(insert), values)
    finally:
        eng.dispose()


# ------------------------------------------------------------------ RunLog


def _start(log: RunLog, run_id: str, rounds: int = 10) -> None:
    log.start_run(
        run_id=run_id,
        name="test-run",
        strategy="fedavg",
        config={"run": {"rounds": rounds}, "datacenters": [{"name": "us-east"}]},
        rounds_planned=rounds,
        baseline="all-workers",
    )


def _round(log: RunLog, run_id: str, r: int, *, loss: float | None = None) -> None:
    log.log_round(
        run_id=run_id,
        round=r,
        tau=r + 1,
        val_loss=loss if loss is not None else 1.0 / (r + 1),
        val_accuracy=0.5 + r / 100,
        bytes_up=1000 * r,
        bytes_down=2000 * r,
        bytes_up_raw=4000 * r,
        wall_s=0.5,
    )


@pytest.mark.timeout(60)
def test_runlog_round_trip(migrated_url: str) -> None:
    run_id = str(uuid.uuid4())
    with RunLog(migrated_url) as log:
        _start(log, run_id, rounds=3)
        log.add_flower_run_id(run_id=run_id, flower_run_id=BIG_FLOWER_ID)
        log.add_flower_run_id(run_id=run_id, flower_run_id=2**64 - 1)
        log.add_flower_run_id(run_id=run_id, flower_run_id=BIG_FLOWER_ID)  # already there: no-op
        log.touch_datacenter(name="us-east", region="us", gpus=8, link_bandwidth_mbps=100, link_rtt_ms=80)
        log.touch_datacenter(name="us-east", gpus=16)  # region etc. kept
        for r in range(1, 4):
            _round(log, run_id, r)
            for dc, status in (("us-east", "ok"), ("eu-west", "rejected" if r == 2 else "ok")):
                log.log_datacenter_round(
                    run_id=run_id, round=r, datacenter=dc, status=status,
                    reason="norm outlier" if status == "rejected" else None,
                    bytes_up=100, bytes_down=200, bytes_up_raw=400, compute_s=1.5, comm_s=0.2,
                    overhead_s=0.1, round_s=1.8, comm_source="relay", train_loss=0.9,
                    num_examples=64, drift_l2=0.01, update_cosine=0.99, staleness=0,
                )
            log.heartbeat(run_id=run_id)
        log.log_event(run_id=run_id, kind="rejection", round=2, datacenter="eu-west", detail={"norm": 12.5})
        log.log_event(run_id=run_id, kind="checkpoint", round=3, detail="saved")
        log.log_checkpoint(run_id=run_id, round=3, uri="file:///ckpt/3")
        log.log_async_update(
            run_id=run_id, seq=0, datacenter="us-east", base_version=1, applied_version=2,
            staleness=1, scale=0.5, status="applied", bytes_up=10,
        )
        # upsert: the same round (and dc round) again keeps one row with the new values
        _round(log, run_id, 2, loss=0.125)
        log.log_datacenter_round(run_id=run_id, round=2, datacenter="us-east", status="timeout", reason="late")
        log.finish_run(run_id=run_id, status="finished", result={"gap_all_workers": {"loss": 0.02, "acc_points": -0.4}})
        log.flush(timeout=20)
        assert log.stats()["rejected"] == 0
        assert log.stats()["written"] == log.stats()["enqueued"]

    eng = make_engine(migrated_url)
    try:
        run = queries.get_run(eng, run_id)
        assert run is not None
        assert run["status"] == "finished" and run["baseline"] == "all-workers"
        assert run["rounds_planned"] == 3 and run["error"] is None
        assert run["config"] == {"run": {"rounds": 3}, "datacenters": [{"name": "us-east"}]}
        assert run["result"] == {"gap_all_workers": {"loss": 0.02, "acc_points": -0.4}}
        assert run["flower_run_ids"] == f"{BIG_FLOWER_ID},{2**64 - 1}"
        assert queries.parse_flower_run_ids(run["flower_run_ids"]) == [BIG_FLOWER_ID, 2**64 - 1]
        assert run["started_at"].tzinfo is not None
        assert run["started_at"] <= run["last_heartbeat"] <= run["finished_at"]

        rounds = queries.list_rounds(eng, run_id)
        assert [r["round"] for r in rounds] == [1, 2, 3]
        assert rounds[1]["val_loss"] == 0.125 and rounds[1]["bytes_up_raw"] == 8000
        assert rounds[0]["tau"] == 2 and rounds[2]["val_accuracy"] == pytest.approx(0.53)

        dcr = queries.list_datacenter_rounds(eng, run_id)
        assert [(d["round"], d["datacenter"]) for d in dcr] == [
            (1, "eu-west"), (1, "us-east"), (2, "eu-west"), (2, "us-east"), (3, "eu-west"), (3, "us-east")
        ]
        assert dcr[2]["status"] == "rejected" and dcr[2]["reason"] == "norm outlier"
        assert dcr[3]["status"] == "timeout" and dcr[3]["reason"] == "late" and dcr[3]["compute_s"] is None
        assert dcr[0]["comm_source"] == "relay" and dcr[0]["round_s"] == 1.8

        events = queries.list_events(eng, run_id)
        assert [(e["kind"], e["round"], e["datacenter"], e["detail"]) for e in events] == [
            ("rejection", 2, "eu-west", {"norm": 12.5}),
            ("checkpoint", 3, None, "saved"),
        ]
        assert queries.list_checkpoints(eng, run_id)[0]["uri"] == "file:///ckpt/3"
        assert queries.list_async_updates(eng, run_id)[0]["scale"] == 0.5

        (dc,) = queries.list_datacenters(eng)
        assert (dc["name"], dc["region"], dc["gpus"], dc["status"]) == ("us-east", "us", 16, "active")
        assert dc["link_rtt_ms"] == 80 and dc["last_seen"] >= dc["enrolled_at"]

        # deleting a run cascades to its rows
        with eng.begin() as conn:
            conn.execute(text("DELETE FROM runs WHERE id = :id"), {"id": run_id})
        assert queries.list_rounds(eng, run_id) == [] and queries.list_events(eng, run_id) == []
    finally:
        eng.dispose()


def test_runlog_validates_in_the_callers_thread(migrated_sqlite_url: str) -> None:
    with RunLog(migrated_sqlite_url) as log:
        with pytest.raises(ValueError, match="status must be one of"):
            log.log_datacenter_round(run_id="r", round=1, datacenter="a", status="weird")
        with pytest.raises(ValueError, match="baseline"):
            log.start_run(run_id="r", name="n", strategy="s", config={}, rounds_planned=1, baseline="x")
        with pytest.raises(ValueError, match="64 unsigned bits"):
            log.add_flower_run_id(run_id="r", flower_run_id=2**64)
        with pytest.raises(ValueError):
            log.add_flower_run_id(run_id="r", flower_run_id=-1)
        with pytest.raises(ValueError, match="final status"):
            log.finish_run(run_id="r", status="running")
        with pytest.raises(TypeError, match="JSON"):
            log.log_event(run_id="r", kind="k", detail={"x": _Unserialisable()})
        with pytest.raises(TypeError):
            log.log_round(run_id="r", round=1.5, tau=1, val_loss=None, val_accuracy=None,  # type: ignore[arg-type]
                          bytes_up=0, bytes_down=0, bytes_up_raw=0, wall_s=None)
        assert log.stats()["enqueued"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        log.heartbeat(run_id="r")


def _span(round_: int, datacenter: str, kind: str, start_s: float, end_s: float, **more: int) -> TimelineSpanRecord:
    return TimelineSpanRecord(round=round_, datacenter=datacenter, kind=kind, start_s=start_s, end_s=end_s, **more)


@pytest.mark.timeout(60)
def test_timeline_spans_round_trip_newest_first_and_forgotten_with_their_rounds(migrated_url: str) -> None:
    run_id = str(uuid.uuid4())
    with RunLog(migrated_url) as log:
        _start(log, run_id, rounds=3)
        for r in (1, 2, 3):
            t = 10.0 * (r - 1)
            log.log_timeline_spans(run_id=run_id, spans=[
                _span(r, "us-east", "compute", t, t + 8),
                _span(r, "us-east", "wait", t + 8, t + 9.5),
                _span(r, "us-east", "up", t + 7, t + 8.5, fragment=0, exchange=r),
                _span(r, "eu-west", "compute", t + 0.25, t + 9),
                _span(r, "eu-west", "down", t + 9, t + 9.75, fragment=1, exchange=r),
            ])
        log.log_timeline_spans(run_id=run_id, spans=[])  # nothing to write: nothing queued
        log.flush(timeout=20)
        assert log.stats()["rejected"] == 0 and log.stats()["written"] == 4  # the run and one record per batch

    eng = make_engine(migrated_url)
    try:
        spans = queries.list_timeline_spans(eng, run_id)
        assert len(spans) == 15
        assert [(s["datacenter"], s["start_s"]) for s in spans] == sorted((s["datacenter"], s["start_s"]) for s in spans)
        first = spans[0]
        assert {k: first[k] for k in ("round", "datacenter", "kind", "start_s", "end_s", "fragment", "exchange")} == {
            "round": 1, "datacenter": "eu-west", "kind": "compute", "start_s": 0.25, "end_s": 9.0, "fragment": None,
            "exchange": None}
        assert {s["kind"] for s in spans} == set(TIMELINE_SPAN_KINDS)
        up = [s for s in spans if s["kind"] == "up"]
        assert [(s["fragment"], s["exchange"]) for s in up] == [(0, 1), (0, 2), (0, 3)]
        # limited: the newest spans (latest start), still by datacenter then start
        newest = queries.list_timeline_spans(eng, run_id, limit=4)
        assert [(s["datacenter"], s["kind"], s["start_s"]) for s in newest] == [
            ("eu-west", "compute", 20.25), ("eu-west", "down", 29.0), ("us-east", "up", 27.0), ("us-east", "wait", 28.0)]
        one = queries.list_timeline_spans(eng, run_id, datacenter="eu-west", limit=3)
        assert [(s["round"], s["kind"]) for s in one] == [(2, "down"), (3, "compute"), (3, "down")]
        assert queries.list_timeline_spans(eng, run_id, datacenter="nowhere") == []
    finally:
        eng.dispose()

    with RunLog(migrated_url) as log:  # resumed from the checkpoint of round 1: rounds 2 and 3 are trained again
        log.forget_rounds_after(run_id=run_id, round=1)
        log.flush(timeout=20)
    eng = make_engine(migrated_url)
    try:
        assert {s["round"] for s in queries.list_timeline_spans(eng, run_id)} == {1}
        assert len(queries.list_timeline_spans(eng, run_id)) == 5
        with eng.begin() as conn:  # deleting a run cascades to its spans
            conn.execute(text("DELETE FROM runs WHERE id = :id"), {"id": run_id})
        assert queries.list_timeline_spans(eng, run_id) == []
    finally:
        eng.dispose()


def test_timeline_spans_are_checked_in_the_callers_thread(migrated_sqlite_url: str) -> None:
    good = _span(1, "a", "compute", 0.0, 1.0)
    with RunLog(migrated_sqlite_url) as log:
        with pytest.raises(ValueError, match=r"^spans\[1\]: kind must be one of compute, wait, up, down, forward, backward; got 'sleep'$"):
            log.log_timeline_spans(run_id="r", spans=[good, good.replace(kind="sleep")])
        with pytest.raises(ValueError, match=r"^spans\[0\]: end_s must be >= start_s, got start_s=2.0, end_s=1.5$"):
            log.log_timeline_spans(run_id="r", spans=[_span(1, "a", "up", 2.0, 1.5)])
        with pytest.raises(ValueError, match=r"spans\[0\]: start_s and end_s must be finite"):
            log.log_timeline_spans(run_id="r", spans=[_span(1, "a", "wait", 0.0, float("inf"))])
        with pytest.raises(TypeError, match=r"spans\[0\] must be a TimelineSpanRecord, got dict"):
            log.log_timeline_spans(run_id="r", spans=[{"round": 1}])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"spans\[0\]: round must be >= 0"):
            log.log_timeline_spans(run_id="r", spans=[good.replace(round=-1)])
        with pytest.raises(TypeError, match=r"spans\[0\]: start_s must be a number"):
            log.log_timeline_spans(run_id="r", spans=[good.replace(start_s="soon")])
        with pytest.raises(ValueError, match=r"spans\[0\]: datacenter must not be empty"):
            log.log_timeline_spans(run_id="r", spans=[good.replace(datacenter="")])
        with pytest.raises(TypeError, match="unexpected keyword argument 'note'"):
            TimelineSpanRecord(round=1, datacenter="a", kind="up", start_s=0.0, end_s=1.0, note="x")  # type: ignore[call-arg]
        assert log.stats()["enqueued"] == 0


class _Unserialisable:
    def __str__(self) -> str:
        raise TypeError("no string form")


def test_runlog_non_finite_values_and_numpy_like_scalars(migrated_sqlite_url: str) -> None:
    class Scalar:  # what numpy/torch scalars look like to the run log
        def __init__(self, v: float) -> None:
            self.v = v

        def item(self) -> float:
            return self.v

        def __float__(self) -> float:
            return self.v

    with RunLog(migrated_sqlite_url) as log:
        _start(log, "r")
        log.log_round(run_id="r", round=1, tau=1, val_loss=Scalar(0.25), val_accuracy=None,  # type: ignore[arg-type]
                      bytes_up=0, bytes_down=0, bytes_up_raw=0, wall_s=None)
        log.finish_run(run_id="r", status="failed", error="diverged",
                       result={"loss": float("nan"), "best": Scalar(1.5), "inf": float("-inf")})
        log.flush(timeout=10)
    eng = make_engine(migrated_sqlite_url)
    run = queries.get_run(eng, "r")
    assert run["result"] == {"loss": "NaN", "best": 1.5, "inf": "-Infinity"}
    assert run["status"] == "failed" and run["error"] == "diverged"
    assert queries.list_rounds(eng, "r")[0]["val_loss"] == 0.25
    eng.dispose()


def test_runlog_drops_only_the_record_the_database_rejects(migrated_sqlite_url: str) -> None:
    with RunLog(migrated_sqlite_url) as log:
        _start(log, "r")
        _round(log, "r", 1)
        _round(log, "no-such-run", 1)  # foreign key violation
        _round(log, "r", 2)
        log.flush(timeout=10)
        stats = log.stats()
    assert stats["rejected"] == 1 and stats["written"] == 3 and not stats["failed"]
    eng = make_engine(migrated_sqlite_url)
    assert [r["round"] for r in queries.list_rounds(eng, "r")] == [1, 2]
    eng.dispose()


@pytest.mark.timeout(60)
def test_runlog_missing_schema_fails_with_a_hint(sqlite_url: str) -> None:
    log = RunLog(sqlite_url)
    _start(log, "r")
    with pytest.raises(DatabaseUnavailable, match="crossdc db upgrade"):
        log.flush(timeout=10)
    assert log.close(timeout=0.2) == 1


@pytest.mark.timeout(60)
def test_sqlite_reader_does_not_block_the_writer(migrated_sqlite_url: str) -> None:
    """WAL: a dashboard holding a read transaction open does not stall the run log."""
    reader = make_engine(migrated_sqlite_url)
    with RunLog(migrated_sqlite_url) as log, reader.connect() as conn:
        _start(log, "r")
        log.flush(timeout=10)
        conn.exec_driver_sql("BEGIN")
        assert conn.exec_driver_sql("SELECT count(*) FROM runs").scalar() == 1
        t0 = time.monotonic()
        for r in range(1, 51):
            _round(log, "r", r)
        log.flush(timeout=10)
        assert time.monotonic() - t0 < 5
        # the reader's snapshot is unchanged until it ends its transaction
        assert conn.exec_driver_sql("SELECT count(*) FROM rounds").scalar() == 0
        conn.exec_driver_sql("COMMIT")
        assert conn.exec_driver_sql("SELECT count(*) FROM rounds").scalar() == 50
    reader.dispose()


@pytest.mark.timeout(60)
def test_runlog_calls_do_not_wait_for_a_locked_sqlite(migrated_sqlite_url: str) -> None:
    locker = make_engine(migrated_sqlite_url)
    with RunLog(migrated_sqlite_url) as log, locker.connect() as conn:
        _start(log, "r")
        log.flush(timeout=10)
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # another process holds the write lock
        t0 = time.monotonic()
        for r in range(1, 21):
            _round(log, "r", r)
        assert time.monotonic() - t0 < 0.2
        time.sleep(0.5)
        assert log.stats()["buffered"] == 20
        conn.exec_driver_sql("COMMIT")
        log.flush(timeout=20)
        assert len(queries.list_rounds(locker, "r")) == 20
    locker.dispose()


@pytest.mark.timeout(60)
def test_runlog_buffer_is_bounded() -> None:
    url = f"postgresql://postgres@127.0.0.1:{_free_port()}/nowhere"
    log = RunLog(url, max_buffered=10, max_outage_s=60)
    for r in range(12):
        _round(log, "r", r)  # never blocks, never raises
    with pytest.raises(DatabaseUnavailable, match="buffer full"):
        log.raise_if_failed()
    assert log.stats()["overflowed"] == 2
    assert log.close(timeout=0.1) == 12


# ----------------------------------------------------- database outages (PostgreSQL)


def _count_rounds(url: str, run_id: str) -> list[tuple[int, int]]:
    eng = make_engine(url)
    try:
        with eng.connect() as conn:
            rows = conn.execute(
                text('SELECT round, count(*) FROM rounds WHERE run_id = :r GROUP BY round ORDER BY round'),
                {"r": run_id},
            )
            return [tuple(row) for row in rows]  # type: ignore[misc]
    finally:
        eng.dispose()


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_runlog_survives_a_short_database_outage(migrated_pg_url: str, relay: TcpRelay) -> None:
    run_id = "outage-run"
    log = RunLog(_via(migrated_pg_url, relay), max_outage_s=30, retry_max_s=0.25)
    try:
        _start(log, run_id, rounds=30)
        log.add_flower_run_id(run_id=run_id, flower_run_id=BIG_FLOWER_ID)
        for r in range(1, 11):
            _round(log, run_id, r)
        log.flush(timeout=10)
        assert relay.connections_accepted >= 1

        relay.cut()
        slowest = 0.0
        for r in range(11, 26):
            t0 = time.perf_counter()
            _round(log, run_id, r)
            log.log_datacenter_round(run_id=run_id, round=r, datacenter="us-east", status="ok", compute_s=1.0)
            log.raise_if_failed()
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.1)
        time.sleep(1.0)
        stats = log.stats()
        assert slowest < 0.05, f"a run-log call took {slowest:.3f}s during the outage"
        assert stats["write_failures"] >= 1, stats  # the writer really hit the outage
        assert stats["buffered"] == 30 and not stats["failed"], stats
        _round(log, run_id, 12, loss=0.0625)  # an overwrite made during the outage

        relay.restore()
        log.flush(timeout=30)
        log.finish_run(run_id=run_id, status="finished")
        log.flush(timeout=10)
    finally:
        log.close(timeout=5)

    assert _count_rounds(migrated_pg_url, run_id) == [(r, 1) for r in range(1, 26)]
    eng = make_engine(migrated_pg_url)
    try:
        rounds = {r["round"]: r for r in queries.list_rounds(eng, run_id)}
        assert rounds[12]["val_loss"] == 0.0625 and rounds[13]["val_loss"] == pytest.approx(1 / 14)
        assert len(queries.list_datacenter_rounds(eng, run_id)) == 15
        run = queries.get_run(eng, run_id)
        assert run["status"] == "finished" and run["flower_run_ids"] == str(BIG_FLOWER_ID)
    finally:
        eng.dispose()


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_runlog_fails_cleanly_when_the_outage_lasts_too_long(migrated_pg_url: str, relay: TcpRelay) -> None:
    run_id = "long-outage"
    log = RunLog(_via(migrated_pg_url, relay), max_outage_s=1.0, retry_max_s=0.2)
    try:
        _start(log, run_id)
        _round(log, run_id, 1)
        log.flush(timeout=10)

        relay.cut()
        t0 = time.perf_counter()
        _round(log, run_id, 2)
        _round(log, run_id, 3)
        assert time.perf_counter() - t0 < 0.05
        log.raise_if_failed()  # not yet: the outage is younger than max_outage_s
        deadline = time.monotonic() + 10
        while not log.failed and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(DatabaseUnavailable) as info:
            log.raise_if_failed()
        message = str(info.value)
        assert "unreachable for" in message and "max_outage_s=1" in message, message
        assert f"127.0.0.1:{relay.port}" in message and "2 run-log record(s) not written" in message
        assert "\n" not in message
        with pytest.raises(DatabaseUnavailable, match="unreachable"):
            log.flush(timeout=5)

        # the caller stops the run; once the database is back, its last words still land
        log.finish_run(run_id=run_id, status="interrupted", error=message)
        relay.restore()
        assert log.close(timeout=20) == 0
    finally:
        log.close(timeout=1)

    assert _count_rounds(migrated_pg_url, run_id) == [(1, 1), (2, 1), (3, 1)]
    eng = make_engine(migrated_pg_url)
    run = queries.get_run(eng, run_id)
    eng.dispose()
    assert run["status"] == "interrupted" and "unreachable" in run["error"]


@pytest.mark.timeout(60)
def test_runlog_unreachable_from_the_start() -> None:
    url = f"postgresql://postgres@127.0.0.1:{_free_port()}/nowhere"
    log = RunLog(url, max_outage_s=0.5, retry_max_s=0.1)
    _start(log, "r")
    with pytest.raises(DatabaseUnavailable, match="unreachable for .*last error: .*"):
        log.flush(timeout=10)
    assert log.close(timeout=0.1) == 1


def test_runlog_is_thread_safe(migrated_sqlite_url: str) -> None:
    with RunLog(migrated_sqlite_url) as log:
        _start(log, "r")

        def worker(dc: str) -> None:
            for r in range(50):
                log.log_datacenter_round(run_id="r", round=r, datacenter=dc, status="ok")

        threads = [threading.Thread(target=worker, args=(f"dc{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log.flush(timeout=20)
    eng = make_engine(migrated_sqlite_url)
    assert len(queries.list_datacenter_rounds(eng, "r")) == 200
    eng.dispose()


def test_first_final_status_wins(migrated_sqlite_url: str) -> None:
    with RunLog(migrated_sqlite_url) as log:
        _start(log, "r-final")
        log.finish_run(run_id="r-final", status="interrupted", error="Ctrl-C")
        log.finish_run(run_id="r-final", status="failed", error="SystemExit: 0")
        log.flush(timeout=10)
    engine = make_engine(migrated_sqlite_url)
    try:
        run = queries.get_run(engine, "r-final")
    finally:
        engine.dispose()
    assert (run["status"], run["error"]) == ("interrupted", "Ctrl-C")


def test_the_newest_attempt_is_the_highest_a_resume_named() -> None:
    assert newest_attempt([]) == 1
    assert newest_attempt([{"attempt": 3}, {"attempt": 2}, "a message", None, {"other": 9}]) == 3
    assert newest_attempt([{"attempt": True}, {"attempt": "4"}, {"attempt": 4.0}]) == 1  # only an int names one


@pytest.mark.timeout(60)
def test_an_older_attempts_end_is_ignored_once_a_resume_started_a_newer_one(migrated_url: str) -> None:
    """Attempt 1's ServerApp records its end after `crossdc resume` started attempt 2 (the run is running again):
    the run stays running, with a stale-end-ignored event; attempt 2's end is the run's. An end without an attempt
    (the orchestrator's) is recorded as before."""
    run_id, unattempted = str(uuid.uuid4()), str(uuid.uuid4())
    with RunLog(migrated_url) as log:
        _start(log, run_id)
        log.finish_run(run_id=run_id, status="interrupted", error="SystemExit: 0", attempt=1)  # before any resume
        log.resume_run(run_id=run_id)
        log.log_event(run_id=run_id, kind=RESUME_REQUESTED, detail={"attempt": 2})
        log.flush(timeout=20)
        log.finish_run(run_id=run_id, status="interrupted", error="SystemExit: 0", attempt=1)
        log.flush(timeout=20)
        engine = make_engine(migrated_url)
        try:
            run = queries.get_run(engine, run_id)
            assert run is not None and (run["status"], run["error"], run["finished_at"]) == ("running", None, None)
            assert [(e["kind"], e["detail"]) for e in queries.list_events(engine, run_id)][-1] == (
                STALE_END_IGNORED, {"attempt": 1, "newest_attempt": 2, "status": "interrupted", "error": "SystemExit: 0"})
            log.finish_run(run_id=run_id, status="finished", result={"rounds": 10}, attempt=2)
            _start(log, unattempted)
            log.log_event(run_id=unattempted, kind=RESUME_REQUESTED, detail={"attempt": 2})
            log.finish_run(run_id=unattempted, status="failed", error="the SuperLink died")
            log.flush(timeout=20)
            assert log.stats()["rejected"] == 0
            run = queries.get_run(engine, run_id)
            assert run is not None and (run["status"], run["result"]) == ("finished", {"rounds": 10})
            assert run["finished_at"] is not None
            other = queries.get_run(engine, unattempted)
            assert other is not None and (other["status"], other["error"]) == ("failed", "the SuperLink died")
        finally:
            engine.dispose()
