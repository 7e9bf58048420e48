"""The JSON API and /metrics of `crossdc serve`, over real HTTP, on what a real run wrote, on SQLite and PostgreSQL.

Per backend (module scope): one real run (`crossdc run examples/synthetic-2dc.toml`, Flower's Deployment Engine),
then a few runs written through the run log (`RunLog`) for what a 3-round run cannot show: a long run for
pagination, a run that diverged (NaN), a run whose process died (its heartbeat set an hour back), a slow run
whose heartbeat is old but not yet stale, and a live run with a round in progress. The service is the real
command (`crossdc serve --db URL`) in its own process.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import COMM_SOURCE, CROSSDC, _pg_admin, read_run  # noqa: E402
from sqlalchemy import update

from crossdc.dashboard import prometheus
from crossdc.dashboard.queries import (
    STALE_AFTER_MIN_S,
    DatacenterWindow,
    EffectiveStatus,
    MetricsSnapshot,
    RunMetrics,
    effective_status,
    stale_after_s,
)
from crossdc.db.engine import head_revisions, make_engine, upgrade
from crossdc.db.models import RUNS
from crossdc.db.queries import list_async_updates, list_events, list_timeline_spans
from crossdc.db.records import TimelineSpanRecord
from crossdc.db.runlog import RunLog
from crossdc.experiment.processes import free_port, wait_for_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "synthetic-2dc.toml"
LONG_ROUNDS, LONG_DCS = 23, ("dc-a", "dc-b", "dc-c")
ROUND_FIELDS = {"round", "tau", "val_loss", "val_accuracy", "bytes_up", "bytes_down", "bytes_up_raw", "wall_s"}
DC_ROUND_FIELDS = {"round", "datacenter", "status", "reason", "bytes_up", "bytes_down", "bytes_up_raw", "compute_s",
                   "comm_s", "overhead_s", "idle_s", "train_loss", "num_examples", "drift_l2", "update_cosine", "staleness",
                   "round_s", "comm_source", "link_bytes_up", "link_bytes_down", "consensus_distance"}
TIMELINE_FIELDS = {"round", "datacenter", "kind", "start_s", "end_s", "fragment", "exchange", "microbatch", "step"}
LINK_FIELDS = {"round", "src", "dst", "bytes", "in_flight_s", "error"}


# ---------------------------------------------------------------- fixtures


@dataclass
class Served:
    """A `crossdc serve` process over a database holding one real run and the written ones."""

    base: str
    db_url: str
    backend: str
    real_run: dict[str, Any]  # the real run's `--json` summary
    long_run: str
    diverged_run: str
    dead_run: str
    slow_run: str
    live_run: str

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.base + path, params=params, timeout=30)


@contextmanager
def crossdc_serve(db_url: str, log_path: Path) -> Iterator[str]:
    """`crossdc serve --db URL` on a free port, stopped afterwards; yields its base URL."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen([CROSSDC, "serve", "--port", str(port), "--db", db_url], stdout=log, stderr=log)
        try:
            wait_for_port("127.0.0.1", port, 60)
            assert process.poll() is None, log_path.read_text()
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh PostgreSQL database for a whole module (conftest's `pg_url` lives for one test only)."""
    conn, admin = _pg_admin()
    name = f"crossdc_test_{uuid.uuid4().hex[:12]}"
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def write_runs(db_url: str) -> dict[str, str]:
    """The runs a 3-round run cannot show, written through the run log as a server would. Their ids by role."""
    ids = {role: f"{role}-{uuid.uuid4().hex[:8]}" for role in ("long", "diverged", "dead", "slow", "live")}
    with RunLog(db_url) as log:
        for role, rounds, wall_s in (("long", LONG_ROUNDS, 1.0), ("diverged", 3, 1.0), ("dead", 2, 1.0),
                                     ("slow", 2, 400.0), ("live", 2, 2.0)):
            run_id = ids[role]
            log.start_run(run_id=run_id, name=f"{role} run", strategy="fedavg", rounds_planned=rounds + 5,
                          config={"datacenters": [{"name": dc} for dc in LONG_DCS]})
            for r in range(1, rounds + 1):
                for i, dc in enumerate(LONG_DCS):
                    ok = bool((r + i) % 5)
                    # idle_s: 1/8 s of waiting a round where the reply was accepted (what the exposed comm/comp counts)
                    log.log_datacenter_round(run_id=run_id, round=r, datacenter=dc, status="ok" if ok else "timeout",
                                             reason=None if ok else "no reply", bytes_up=100 + i, bytes_down=200,
                                             bytes_up_raw=400, compute_s=1.0 + i, comm_s=0.25, overhead_s=0.5,
                                             idle_s=0.125 if ok else 5.0, train_loss=1.0 / r, num_examples=32,
                                             drift_l2=0.1 * i, update_cosine=0.9, staleness=0)
                diverged = role == "diverged" and r == rounds
                log.log_round(run_id=run_id, round=r, tau=2, bytes_up=300, bytes_down=600, bytes_up_raw=1200, wall_s=wall_s,
                              val_loss=float("nan") if diverged else (1.0 / r if r % 2 == 0 else None),
                              val_accuracy=float("inf") if diverged else (0.5 if r % 2 == 0 else None))
                log.heartbeat(run_id=run_id)
            if role in ("long", "diverged"):
                log.finish_run(run_id=run_id, status="finished" if role == "long" else "failed",
                               error=None if role == "long" else "validation loss nan\nsecond line")
        for k in range(9):
            log.log_event(run_id=ids["long"], kind="timeout", round=k, datacenter="dc-b", detail={"k": k})
        # the long run's timeline: per datacenter and round, 1 + i s of compute, then its update up and the result down
        for r in range(1, LONG_ROUNDS + 1):
            t = 2.0 * (r - 1)
            log.log_timeline_spans(run_id=ids["long"], spans=[
                TimelineSpanRecord(round=r, datacenter=dc, kind=kind, start_s=t + start, end_s=t + end, fragment=fragment,
                                   exchange=r if fragment is not None else None)
                for i, dc in enumerate(LONG_DCS)
                for kind, start, end, fragment in (("compute", 0.0, 1.0 + i * 0.25, None), ("up", 1.0 + i * 0.25, 1.75, i),
                                                   ("down", 1.75, 2.0, i))])
        # the long run as if it gossiped: a ring of its three datacenters, one failed exchange in round 2
        for r in (1, 2):
            for i, src in enumerate(LONG_DCS):
                for dst in (LONG_DCS[(i + 1) % 3], LONG_DCS[(i - 1) % 3]):
                    failed = r == 2 and {src, dst} == {"dc-a", "dc-b"}
                    log.log_link_round(run_id=ids["long"], round=r, src=src, dst=dst, bytes=56 if failed else 1000,
                                       in_flight_s=1.5 if failed else 0.25, error="TimeoutError: timed out" if failed else None)
        for seq in range(13):
            log.log_async_update(run_id=ids["long"], seq=seq, datacenter=LONG_DCS[seq % 3], base_version=seq,
                                 applied_version=seq + 1, staleness=seq % 4, scale=1.0 / (1 + seq % 4), status="applied",
                                 bytes_up=100)
        # the live run's third round is under way: its datacenters have reported, the round is not closed yet
        for dc in LONG_DCS[:2]:
            log.log_datacenter_round(run_id=ids["live"], round=3, datacenter=dc, status="ok", compute_s=1.0, comm_s=0.1)
        log.flush(timeout=60)
    now = datetime.now(UTC)
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:  # their processes died (or slowed down) a while ago
            conn.execute(update(RUNS).where(RUNS.c.id == ids["dead"]).values(last_heartbeat=now - timedelta(hours=1)))
            conn.execute(update(RUNS).where(RUNS.c.id == ids["slow"]).values(last_heartbeat=now - timedelta(minutes=15)))
    finally:
        engine.dispose()
    return ids


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp(f"dashboard-{request.param}")
    with (postgres_database() if request.param == "postgres" else _sqlite(tmp)) as db_url:
        completed = subprocess.run(
            [CROSSDC, "run", str(CONFIG), "--db", db_url, "--json", "--port", str(free_port()), "--runs-dir", str(tmp / "runs")],
            capture_output=True, text=True, timeout=400, cwd=tmp)
        assert completed.returncode == 0, completed.stderr[-3000:]
        real_run = json.loads(completed.stdout.strip().splitlines()[-1])
        ids = write_runs(db_url)
        with crossdc_serve(db_url, tmp / "serve.log") as base:
            yield Served(base=base, db_url=db_url, backend=request.param, real_run=real_run, long_run=ids["long"],
                         diverged_run=ids["diverged"], dead_run=ids["dead"], slow_run=ids["slow"], live_run=ids["live"])


@contextmanager
def _sqlite(tmp: Path) -> Iterator[str]:
    yield f"sqlite:///{tmp / 'crossdc.db'}"


def strict_json(response: httpx.Response) -> Any:
    """The body as JSON, refusing NaN/Infinity tokens (which JSON does not have)."""
    def refuse(token: str) -> None:
        raise AssertionError(f"non-JSON number {token} in {response.url}")

    assert response.headers["content-type"].startswith("application/json"), response.headers["content-type"]
    return json.loads(response.text, parse_constant=refuse)


def all_pages(served: Served, path: str, cursor: str, **params: Any) -> tuple[list[dict[str, Any]], int]:
    """Follow `next_since_*` until `has_more` is false; the concatenated items and the number of pages."""
    items: list[dict[str, Any]] = []
    since = None
    pages = 0
    while True:
        query = dict(params, **({cursor: since} if since is not None else {}))
        response = served.get(path, **query)
        body = strict_json(response)
        pages += 1
        items.extend(body["items"])
        assert ('rel="next"' in response.headers.get("link", "")) == body["has_more"]
        if not body["has_more"]:
            return items, pages
        assert body[f"next_{cursor}"] is not None and body[f"next_{cursor}"] != since
        since = body[f"next_{cursor}"]
        assert pages < 100


# ------------------------------------------------------------ the real run


def test_health_says_the_database_answers(served: Served) -> None:
    body = strict_json(served.get("/api/health"))
    assert body["status"] == "ok" and body["detail"] is None
    db = body["database"]
    assert db["answers"] and db["backend"] == ("sqlite" if served.backend == "sqlite" else "postgresql")
    assert db["schema_revision"] == db["schema_head"] == head_revisions()[0]


def test_runs_list_shows_the_real_run(served: Served) -> None:
    run_id = served.real_run["run_id"]
    body = strict_json(served.get("/api/runs", limit=1000))
    runs = {r["id"]: r for r in body["items"]}
    assert body["total"] == len(runs) == 6
    run = runs[run_id]
    assert (run["name"], run["strategy"], run["status"], run["stored_status"]) == ("synthetic-2dc", "fedavg", "finished", "finished")
    assert run["rounds_completed"] == run["last_round"] == run["val_round"] == 3
    assert run["val_loss"] == pytest.approx(served.real_run["val_loss"])
    assert run["val_accuracy"] == pytest.approx(served.real_run["val_accuracy"])
    started = [datetime.fromisoformat(r["started_at"]) for r in body["items"]]
    assert started == sorted(started, reverse=True) and all(t.tzinfo is not None for t in started)
    # offset pagination concatenates to the same list
    pages = [strict_json(served.get("/api/runs", limit=4, offset=o))["items"] for o in (0, 4)]
    assert [r["id"] for page in pages for r in page] == [r["id"] for r in body["items"]]
    finished = strict_json(served.get("/api/runs", status="finished"))
    assert {r["id"] for r in finished["items"]} == {run_id, served.long_run}
    assert strict_json(served.get("/api/runs", strategy="nosuch"))["total"] == 0


def test_run_and_its_series_are_what_the_run_log_holds(served: Served) -> None:
    run_id = served.real_run["run_id"]
    logged = read_run(served.db_url, run_id)
    run = strict_json(served.get(f"/api/runs/{run_id}"))
    assert run["id"] == run_id and run["config"]["run"]["name"] == "synthetic-2dc"
    assert run["datacenters"] == ["us-east", "eu-west"]
    assert run["bytes_up_total"] == served.real_run["bytes_up_total"] and run["bytes_down_total"] == served.real_run["bytes_down_total"]
    assert run["flower_run_ids"] == [served.real_run["flower_run_id"]]  # a string: 64 unsigned bits
    rounds = strict_json(served.get(f"/api/runs/{run_id}/rounds"))
    assert rounds["run_id"] == run_id and not rounds["has_more"] and rounds["next_since_round"] == 3
    assert [r["tau"] for r in rounds["items"]] == [2, 5, 8]
    for api_row, row in zip(rounds["items"], logged["rounds"], strict=True):
        assert ROUND_FIELDS <= set(api_row)
        assert {k: api_row[k] for k in ROUND_FIELDS} == pytest.approx({k: row[k] for k in ROUND_FIELDS})
    dc_rounds = strict_json(served.get(f"/api/runs/{run_id}/datacenter-rounds"))["items"]
    assert [(r["round"], r["datacenter"]) for r in dc_rounds] == [(r, dc) for r in (1, 2, 3) for dc in ("eu-west", "us-east")]
    for api_row, row in zip(dc_rounds, logged["dc_rounds"], strict=True):
        assert set(api_row) == DC_ROUND_FIELDS
        assert {k: api_row[k] for k in DC_ROUND_FIELDS} == pytest.approx({k: row[k] for k in DC_ROUND_FIELDS})
    assert all(r["status"] == "ok" and r["comm_source"] == COMM_SOURCE and r["compute_s"] > 0 for r in dc_rounds)
    one = strict_json(served.get(f"/api/runs/{run_id}/datacenter-rounds", datacenter="us-east"))
    assert one["datacenter"] == "us-east" and [r["datacenter"] for r in one["items"]] == ["us-east"] * 3
    events = strict_json(served.get(f"/api/runs/{run_id}/events"))["items"]
    assert [e["kind"] for e in events] == [e["kind"] for e in logged["events"]] and events
    assert strict_json(served.get(f"/api/runs/{run_id}/async-updates"))["items"] == []


def test_datacenters_and_strategies(served: Served) -> None:
    datacenters = {d["name"]: d for d in strict_json(served.get("/api/datacenters"))}
    assert {"us-east", "eu-west"} <= set(datacenters)
    assert all(d["status"] == "active" and d["last_seen_age_s"] >= 0 for d in datacenters.values())
    cli = subprocess.run([CROSSDC, "strategies", "list", "--json"], capture_output=True, text=True, timeout=60)
    api = served.get("/api/strategies")
    if cli.returncode == 0:
        assert api.status_code == 200 and strict_json(api) == json.loads(cli.stdout)
        assert "fedavg" in {s["name"] for s in json.loads(cli.stdout)}
    else:  # an installed plug-in that does not load: both say which, neither crashes
        assert cli.returncode == 2 and api.status_code == 503
        assert strict_json(api)["detail"] in cli.stderr
    codecs_cli = subprocess.run([CROSSDC, "codecs", "list", "--json"], capture_output=True, text=True, timeout=60)
    assert codecs_cli.returncode == 0, codecs_cli.stderr
    codecs = strict_json(served.get("/api/codecs"))
    assert codecs == json.loads(codecs_cli.stdout)
    assert {"topk", "int8", "qsgd", "powersgd"} <= {c["name"] for c in codecs}


def test_openapi_schema_and_docs(served: Served) -> None:
    schema = strict_json(served.get("/openapi.json"))
    for path in ("/api/health", "/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/rounds",
                 "/api/runs/{run_id}/datacenter-rounds", "/api/runs/{run_id}/events", "/api/runs/{run_id}/async-updates",
                 "/api/runs/{run_id}/timeline", "/api/runs/{run_id}/links", "/api/datacenters", "/api/strategies",
                 "/metrics"):
        assert path in schema["paths"], path
    row = schema["components"]["schemas"]["DatacenterRoundRow"]["properties"]
    assert DC_ROUND_FIELDS <= set(row)
    assert set(schema["components"]["schemas"]["TimelineSpanRow"]["properties"]) == TIMELINE_FIELDS
    docs = served.get("/docs")
    assert docs.status_code == 200 and "openapi.json" in docs.text
    # Swagger UI comes from this server, not a CDN (none is reachable from the machines it runs on)
    assert "cdn." not in docs.text and "/static/swagger-ui/swagger-ui-bundle.js" in docs.text
    assert served.get("/static/swagger-ui/swagger-ui-bundle.js").status_code == 200


# --------------------------------------------------------------- pagination


def test_pages_concatenate_to_the_whole_series(served: Served) -> None:
    run = f"/api/runs/{served.long_run}"
    whole = strict_json(served.get(f"{run}/rounds", limit=5000))["items"]
    assert [r["round"] for r in whole] == list(range(1, LONG_ROUNDS + 1))
    paged, pages = all_pages(served, f"{run}/rounds", "since_round", limit=5)
    assert paged == whole and pages == 5

    whole_dc = strict_json(served.get(f"{run}/datacenter-rounds", limit=5000))["items"]
    assert len(whole_dc) == LONG_ROUNDS * len(LONG_DCS)
    paged_dc, pages = all_pages(served, f"{run}/datacenter-rounds", "since_round", limit=4)
    assert paged_dc == whole_dc and pages == 6  # 4 whole rounds a page: never a round cut in two
    assert len({(r["round"], r["datacenter"]) for r in paged_dc}) == len(paged_dc)
    one_dc, _ = all_pages(served, f"{run}/datacenter-rounds", "since_round", limit=10, datacenter="dc-c")
    assert one_dc == [r for r in whole_dc if r["datacenter"] == "dc-c"]
    assert {r["status"] for r in whole_dc} == {"ok", "timeout"}

    events, pages = all_pages(served, f"{run}/events", "since_id", limit=4)
    assert [e["detail"] for e in events] == [{"k": k} for k in range(9)] and pages == 3
    assert len({e["id"] for e in events}) == 9
    updates, pages = all_pages(served, f"{run}/async-updates", "since_seq", limit=6)
    assert [u["seq"] for u in updates] == list(range(13)) and pages == 3
    engine = make_engine(served.db_url)
    try:
        assert updates == [{k: v for k, v in u.items() if k not in ("id", "run_id")}
                           for u in list_async_updates(engine, served.long_run)]
        assert [e["id"] for e in events] == [e["id"] for e in list_events(engine, served.long_run)]
    finally:
        engine.dispose()

    # a page past the end is empty, keeps the cursor, and says there is no more
    tail = strict_json(served.get(f"{run}/rounds", since_round=LONG_ROUNDS))
    assert tail == {"run_id": served.long_run, "items": [], "next_since_round": LONG_ROUNDS, "has_more": False}


def test_polling_a_live_run_never_skips_a_round_still_being_written(served: Served) -> None:
    path = f"/api/runs/{served.live_run}/datacenter-rounds"
    first = strict_json(served.get(path))
    # round 3's datacenters have reported but the round is not closed: not shown yet
    assert [r["round"] for r in first["items"]] == [1, 1, 1, 2, 2, 2] and first["next_since_round"] == 2
    with RunLog(served.db_url) as log:
        log.log_datacenter_round(run_id=served.live_run, round=3, datacenter=LONG_DCS[2], status="ok", compute_s=1.0)
        log.log_round(run_id=served.live_run, round=3, tau=2, val_loss=None, val_accuracy=None, bytes_up=1,
                      bytes_down=1, bytes_up_raw=1, wall_s=2.0)
        log.heartbeat(run_id=served.live_run)
    polled = strict_json(served.get(path, since_round=first["next_since_round"]))
    assert [(r["round"], r["datacenter"]) for r in polled["items"]] == [(3, dc) for dc in LONG_DCS]
    assert polled["next_since_round"] == 3 and not polled["has_more"]
    rounds = strict_json(served.get(f"/api/runs/{served.live_run}/rounds", since_round=2))
    assert [r["round"] for r in rounds["items"]] == [3]


def test_the_timeline_is_the_newest_spans_by_datacenter_then_start(served: Served) -> None:
    path = f"/api/runs/{served.long_run}/timeline"
    engine = make_engine(served.db_url)
    try:
        logged = [{k: v for k, v in s.items() if k not in ("id", "run_id")} for s in list_timeline_spans(engine, served.long_run)]
    finally:
        engine.dispose()
    whole = strict_json(served.get(path))
    assert whole["run_id"] == served.long_run and whole["limit"] == 1000 and whole["truncated"] is False
    assert whole["items"] == logged and len(logged) == LONG_ROUNDS * len(LONG_DCS) * 3
    assert all(set(item) == TIMELINE_FIELDS for item in whole["items"])
    assert [(s["datacenter"], s["start_s"]) for s in whole["items"]] == sorted((s["datacenter"], s["start_s"]) for s in logged)
    first = whole["items"][0]
    assert first == {"round": 1, "datacenter": "dc-a", "kind": "compute", "start_s": 0.0, "end_s": 1.0, "fragment": None,
                     "exchange": None, "microbatch": None, "step": None}
    # the newest 4: the last round's downs (start 45.75 s) and dc-c's up (45.5 s)
    newest = strict_json(served.get(path, limit=4))
    assert newest["truncated"] is True and newest["limit"] == 4
    assert [(s["datacenter"], s["kind"], s["start_s"]) for s in newest["items"]] == [
        ("dc-a", "down", 45.75), ("dc-b", "down", 45.75), ("dc-c", "up", 45.5), ("dc-c", "down", 45.75)]
    one = strict_json(served.get(path, datacenter="dc-b", limit=2))
    assert one["datacenter"] == "dc-b" and one["truncated"] is True
    assert [(s["round"], s["kind"], s["fragment"], s["exchange"]) for s in one["items"]] == [
        (LONG_ROUNDS, "up", 1, LONG_ROUNDS), (LONG_ROUNDS, "down", 1, LONG_ROUNDS)]
    assert strict_json(served.get(path, datacenter="nowhere"))["items"] == []
    real = strict_json(served.get(f"/api/runs/{served.real_run['run_id']}/timeline"))
    assert (real["items"], real["truncated"]) == ([], False)  # a synchronous run records no timeline (yet)


def test_the_run_page_shows_the_timeline_and_the_exposed_comm_comp(served: Served) -> None:
    long_page = served.get(f"/runs/{served.long_run}")
    assert long_page.status_code == 200
    assert 'id="fig-timeline"' in long_page.text and 'id="fig-exposed-comm-comp"' in long_page.text
    assert "No timeline recorded" not in long_page.text
    figures = strict_json(served.get(f"/runs/{served.long_run}/live.json"))["figures"]
    assert [t["name"] for t in figures["fig-timeline"]["data"]] == ["compute", "up", "down"]
    assert sum(len(t["y"]) for t in figures["fig-timeline"]["data"]) == LONG_ROUNDS * len(LONG_DCS) * 3
    exposed = figures["fig-exposed-comm-comp"]["data"][0]
    # idle over compute of the accepted rounds only (a timeout row's 5 s of idle is left out): 1/8, 1/16, 1/24
    assert exposed["x"] == list(LONG_DCS) and exposed["text"] == ["0.125 ⚠", "0.0625", "0.0417"]
    row = re.search(r'<tr data-datacenter="dc-a">.*?</tr>', long_page.text, re.S)
    assert row is not None
    cells = re.findall(r'<td class="num (exposed|utilisation) alert">([^<]*)</td>', row.group(0))
    assert cells == [("exposed", "0.125"), ("utilisation", "88.9 %")]
    real_page = served.get(f"/runs/{served.real_run['run_id']}")
    assert real_page.status_code == 200 and 'id="fig-timeline"' not in real_page.text
    assert "No timeline recorded" in real_page.text and 'id="fig-exposed-comm-comp"' in real_page.text


# ------------------------------------------------------------ status rules


def test_a_running_run_whose_heartbeat_stopped_is_interrupted(served: Served) -> None:
    runs = {r["id"]: r for r in strict_json(served.get("/api/runs"))["items"]}
    dead, slow, live = runs[served.dead_run], runs[served.slow_run], runs[served.live_run]
    assert (dead["status"], dead["stored_status"]) == ("interrupted", "running")
    assert "heartbeat" in dead["status_detail"]
    # a 400 s round: silence is allowed up to 3 × 400 s, and 15 minutes is less
    assert (slow["status"], slow["status_detail"]) == ("running", None)
    assert live["status"] == "running"
    assert strict_json(served.get(f"/api/runs/{served.dead_run}"))["status"] == "interrupted"
    interrupted = strict_json(served.get("/api/runs", status="interrupted"))
    assert {r["id"] for r in interrupted["items"]} == {served.dead_run} and interrupted["total"] == 1
    running = strict_json(served.get("/api/runs", status="running"))
    assert {r["id"] for r in running["items"]} == {served.slow_run, served.live_run}
    failed = runs[served.diverged_run]
    assert (failed["status"], failed["status_detail"]) == ("failed", "validation loss nan")


def test_non_finite_numbers_are_null(served: Served) -> None:
    run = strict_json(served.get(f"/api/runs/{served.diverged_run}"))
    assert (run["val_round"], run["val_loss"], run["val_accuracy"]) == (3, None, None)
    last = strict_json(served.get(f"/api/runs/{served.diverged_run}/rounds", since_round=2))["items"][0]
    assert (last["val_loss"], last["val_accuracy"]) == (None, None)


def test_links_are_each_direction_of_each_exchange_by_round(served: Served) -> None:
    links = strict_json(served.get(f"/api/runs/{served.long_run}/links"))
    assert links["run_id"] == served.long_run and len(links["items"]) == 2 * 3 * 2
    assert all(set(item) == LINK_FIELDS for item in links["items"])
    assert [(r["round"], r["src"], r["dst"]) for r in links["items"]] == sorted((r["round"], r["src"], r["dst"])
                                                                                 for r in links["items"])
    failed = [(r["round"], r["src"], r["dst"]) for r in links["items"] if r["error"]]
    assert failed == [(2, "dc-a", "dc-b"), (2, "dc-b", "dc-a")]
    assert strict_json(served.get(f"/api/runs/{served.real_run['run_id']}/links"))["items"] == []  # not a gossip run


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("suffix", ["", "/rounds", "/datacenter-rounds", "/events", "/async-updates", "/timeline",
                                    "/links"])
def test_unknown_run_is_404_json(served: Served, suffix: str) -> None:
    for run_id in ("nosuchrun", "x" * 300, "a%00b", "%F0%9F%98%80"):
        response = httpx.get(f"{served.base}/api/runs/{run_id}{suffix}", timeout=30)
        assert response.status_code == 404, (run_id, response.text)
        detail = strict_json(response)["detail"]
        assert detail.startswith("run '") and detail.endswith("' not found")
    assert strict_json(served.get(f"/api/runs/nosuchrun{suffix}")) == {"detail": "run 'nosuchrun' not found"}


@pytest.mark.parametrize("path, params", [
    ("/rounds", {"limit": 0}), ("/rounds", {"limit": 5001}), ("/rounds", {"since_round": -1}),
    ("/rounds", {"since_round": "abc"}), ("/rounds", {"since_round": 2**40}),
    ("/datacenter-rounds", {"limit": "1.5"}), ("/events", {"since_id": 2**70}), ("/async-updates", {"since_seq": "x"}),
    ("/timeline", {"limit": 0}), ("/timeline", {"limit": 5001}), ("/timeline", {"limit": "all"}),
    ("/timeline", {"datacenter": "x" * 300}), ("", {}),
])
def test_bad_query_parameters_are_422(served: Served, path: str, params: dict[str, Any]) -> None:
    if not path:  # the runs list's own parameters
        for bad in ({"status": "bogus"}, {"limit": 0}, {"offset": -1}):
            response = served.get("/api/runs", **bad)
            assert response.status_code == 422 and strict_json(response)["detail"], bad
        return
    response = served.get(f"/api/runs/{served.long_run}{path}", **params)
    assert response.status_code == 422, response.text
    assert strict_json(response)["detail"][0]["loc"][0] == "query"


# ----------------------------------------------------------------- metrics


def test_metrics_parse_and_report_every_datacenter(served: Served) -> None:
    response = served.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = parse_prometheus(response.text)
    assert families["crossdc_database_up"] == [({}, 1.0)]
    run_id = served.real_run["run_id"]
    by_run = {labels["run_id"]: value for labels, value in families["crossdc_run_rounds_completed"]}
    assert by_run[run_id] == 3 and by_run[served.long_run] == LONG_ROUNDS
    bytes_up = {labels["run_id"]: v for labels, v in families["crossdc_run_bytes_up_total"]}
    assert bytes_up[run_id] == served.real_run["bytes_up_total"]
    ratios = {(labels["run_id"], labels["datacenter"]): v for labels, v in families["crossdc_datacenter_comm_comp_ratio"]}
    assert {(run_id, "us-east"), (run_id, "eu-west")} <= set(ratios)
    assert all(v >= 0 and math.isfinite(v) for v in ratios.values())
    assert ratios[(served.long_run, "dc-a")] == pytest.approx(0.25 / 1.0)
    exposed = {(labels["run_id"], labels["datacenter"]): v
               for labels, v in families["crossdc_datacenter_exposed_comm_comp_ratio"]}
    utilisation = {(labels["run_id"], labels["datacenter"]): v
                   for labels, v in families["crossdc_datacenter_trainer_utilisation"]}
    # accepted rounds only: 1/8 s of idle per 1 + i s of compute (a timeout row's 5 s of idle is left out)
    assert [exposed[(served.long_run, dc)] for dc in LONG_DCS] == pytest.approx([0.125, 0.0625, 0.125 / 3])
    assert [utilisation[(served.long_run, dc)] for dc in LONG_DCS] == pytest.approx([1 / 1.125, 2 / 2.125, 3 / 3.125])
    for dc in ("us-east", "eu-west"):  # the real run measured its trainers' waits
        assert exposed[(run_id, dc)] >= 0 and 0 < utilisation[(run_id, dc)] <= 1
        assert utilisation[(run_id, dc)] == pytest.approx(1 / (1 + exposed[(run_id, dc)]))
    seen = {labels["datacenter"]: v for labels, v in families["crossdc_datacenter_last_seen_age_seconds"]}
    assert {"us-east", "eu-west"} <= set(seen) and all(v >= 0 for v in seen.values())
    statuses = {labels["status"] for labels, _ in families["crossdc_run_info"] if labels["run_id"] == served.dead_run}
    assert statuses == {"interrupted"}


# ------------------------------------------------- what needs no real run


def test_a_database_that_does_not_answer_is_503_json(tmp_path: Path) -> None:
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    with crossdc_serve(dead, tmp_path / "serve.log") as base:
        health = httpx.get(f"{base}/api/health", timeout=30)
        assert health.status_code == 503
        body = strict_json(health)
        assert body["status"] == "degraded" and not body["database"]["answers"]
        assert "unavailable" in body["detail"] and "\n" not in body["detail"]
        for path in ("/api/runs", "/api/runs/x", "/api/runs/x/rounds", "/api/datacenters"):
            response = httpx.get(base + path, timeout=30)
            assert response.status_code == 503 and "unavailable" in strict_json(response)["detail"], path
        metrics = httpx.get(f"{base}/metrics", timeout=30)
        assert metrics.status_code == 200 and parse_prometheus(metrics.text) == {"crossdc_database_up": [({}, 0.0)]}


def test_a_database_without_the_schema_is_degraded(tmp_path: Path) -> None:
    with crossdc_serve(f"sqlite:///{tmp_path / 'empty.db'}", tmp_path / "serve.log") as base:
        health = httpx.get(f"{base}/api/health", timeout=30)
        assert health.status_code == 503 and "crossdc db upgrade" in strict_json(health)["detail"]
        assert httpx.get(f"{base}/api/runs", timeout=30).status_code == 503
    upgrade(f"sqlite:///{tmp_path / 'empty.db'}")
    with crossdc_serve(f"sqlite:///{tmp_path / 'empty.db'}", tmp_path / "serve2.log") as base:
        assert strict_json(httpx.get(f"{base}/api/runs", timeout=30)) == {"items": [], "total": 0, "limit": 50, "offset": 0}


def test_serve_on_a_busy_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        completed = subprocess.run([CROSSDC, "serve", "--port", str(port), "--db", f"sqlite:///{tmp_path / 'x.db'}"],
                                   capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2
    assert completed.stderr.strip().count("\n") == 0 and "already in use" in completed.stderr
    assert "Traceback" not in completed.stderr


T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _row(status: str = "running", heartbeat: datetime | None = T0, error: str | None = None) -> dict[str, Any]:
    return {"status": status, "started_at": T0 - timedelta(hours=1), "last_heartbeat": heartbeat, "error": error}


def test_effective_status_rule() -> None:
    assert stale_after_s(None) == STALE_AFTER_MIN_S == 300
    assert stale_after_s(200.0) == 600 and stale_after_s(float("nan")) == 300
    s = timedelta(seconds=1)
    assert effective_status(_row(), None, T0 + 300 * s) == EffectiveStatus("running", None)
    late = effective_status(_row(), None, T0 + 301 * s)
    assert late.status == "interrupted" and "301 s" in late.detail
    assert effective_status(_row(), 200.0, T0 + 599 * s).status == "running"  # 3 × its slowest round
    assert effective_status(_row(), 200.0, T0 + 601 * s).status == "interrupted"
    # no heartbeat yet: counted from the start; naive times are UTC (SQLite)
    assert effective_status(_row(heartbeat=None), None, T0).status == "interrupted"
    naive = {**_row(), "last_heartbeat": T0.replace(tzinfo=None)}
    assert effective_status(naive, None, T0 + 10 * s).status == "running"
    # an ended run keeps the status its processes wrote, whatever its heartbeat
    assert effective_status(_row("finished", T0 - timedelta(days=9)), None, T0) == EffectiveStatus("finished", None)
    assert effective_status(_row("failed", error="boom\ntrace"), None, T0) == EffectiveStatus("failed", "boom")


def test_prometheus_text_escapes_label_values() -> None:
    odd = 'a "quoted" back\\slash\nnew line'
    snapshot = MetricsSnapshot(
        runs=[RunMetrics(run_id="r", name=odd, strategy="fedavg", status="running", baseline="none", rounds_completed=2,
                         rounds_planned=3, bytes_up=2**60, bytes_down=5, bytes_up_raw=7, heartbeat_age_s=1.5)],
        windows=[DatacenterWindow(run_id="r", datacenter=odd, rounds=2, compute_s=2.0, comm_s=0.5, overhead_s=0.1,
                                  by_status={"ok": 2}),
                 DatacenterWindow(run_id="r", datacenter="idle", rounds=1, compute_s=0.0, comm_s=0.0, overhead_s=0.0,
                                  by_status={"timeout": 1})],
        datacenters=[], window_rounds=10)
    families = parse_prometheus(prometheus.render(prometheus.crossdc_families(snapshot)))
    assert families["crossdc_run_info"][0][0]["name"] == odd
    assert families["crossdc_datacenter_comm_comp_ratio"] == [({"run_id": "r", "datacenter": odd}, 0.25)]
    assert "crossdc_datacenter_exposed_comm_comp_ratio" not in families  # idle_s not measured: no sample
    assert families["crossdc_run_bytes_up_total"] == [({"run_id": "r"}, float(2**60))]
    assert ({"run_id": "r", "datacenter": "idle", "status": "timeout"}, 1.0) in families["crossdc_datacenter_rounds"]


# --------------------------------------------- a strict exposition parser

_METRIC_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_METRIC_NAME})(?:\{{(.*)\}})? (\S+)(?: (-?\d+))?$")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')


def _unescape(value: str) -> str:
    return re.sub(r"\\([\\\"n])", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _number(text: str) -> float:
    special = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}
    if text in special:
        return special[text]
    assert re.fullmatch(r"[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?)", text), text
    return float(text)


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format 0.0.4, strictly: HELP/TYPE once per family and before its samples, samples of a
    family together, well-formed escaped labels (no duplicates), numbers Go's ParseFloat takes; name → samples."""
    assert text.endswith("\n")
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    typed: dict[str, str] = {}
    helped: set[str] = set()
    current: str | None = None
    for line in text[:-1].split("\n"):
        assert line.strip(), "blank line"
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(_METRIC_NAME, name) and name not in helped
            helped.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert re.fullmatch(_METRIC_NAME, name) and name not in typed and name not in families
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped")
            typed[name] = kind
            current = name
            continue
        assert not line.startswith("#"), line
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, raw_labels, value, _timestamp = match.groups()
        assert name == current and name in typed, f"{name} outside its family"
        labels: dict[str, str] = {}
        rest = raw_labels or ""
        while rest:
            pair = _LABEL_PAIR.match(rest)
            assert pair, f"bad labels in {line!r}"
            assert pair.group(1) not in labels
            labels[pair.group(1)] = _unescape(pair.group(2))
            rest = rest[pair.end():]
        families.setdefault(name, []).append((labels, _number(value)))
    return families
