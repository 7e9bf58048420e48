"""The run page's timeline and exposed comm/comp, from what the run log wrote, on SQLite and PostgreSQL.

The real app (``create_app``) over HTTP (Starlette's test client), on runs written with ``RunLog``: a run with
more spans than the page shows, and a running run that gets its first spans while its page is polled.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from crossdc.dashboard import page_data
from crossdc.dashboard.app import create_app
from crossdc.dashboard.figures import FIGURE_IDS
from crossdc.db.engine import make_engine
from crossdc.db.records import TimelineSpanRecord
from crossdc.db.runlog import RunLog, utcnow

TIMELINE = FIGURE_IDS["timeline"]
EXPOSED = FIGURE_IDS["exposed_comm_comp_ratio"]


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    engine = make_engine(migrated_url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def client(engine: Engine) -> TestClient:
    return TestClient(create_app(engine=engine))


def _round(log: RunLog, run_id: str, r: int, idle_s: float | None) -> None:
    for dc in ("a", "b"):
        log.log_datacenter_round(run_id=run_id, round=r, datacenter=dc, status="ok", compute_s=2.0, comm_s=0.5,
                                 idle_s=idle_s)
    log.log_round(run_id=run_id, round=r, tau=2, val_loss=1.0 / r, val_accuracy=None, bytes_up=1, bytes_down=1,
                  bytes_up_raw=1, wall_s=2.5)
    log.heartbeat(run_id=run_id)


def _spans(r: int) -> list[TimelineSpanRecord]:
    t = 3.0 * (r - 1)
    return [TimelineSpanRecord(round=r, datacenter=dc, kind=kind, start_s=t + start, end_s=t + end)
            for dc in ("a", "b") for kind, start, end in (("compute", 0.0, 2.0), ("wait", 2.0, 2.5), ("up", 2.0, 2.25))]


def test_a_long_timeline_shows_its_newest_spans_and_says_so(migrated_url: str, client: TestClient,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_data, "MAX_TIMELINE_SPANS", 10)
    run_id = "timeline-" + uuid.uuid4().hex[:8]
    with RunLog(migrated_url) as log:
        log.start_run(run_id=run_id, name="timeline", strategy="streaming-diloco", config={}, rounds_planned=4)
        for r in (1, 2, 3, 4):
            _round(log, run_id, r, idle_s=0.5)
            log.log_timeline_spans(run_id=run_id, spans=_spans(r))
        log.finish_run(run_id=run_id, status="finished")
    page = client.get(f"/runs/{run_id}")
    assert page.status_code == 200 and f'id="{TIMELINE}"' in page.text
    assert "The newest 10 of 24 spans." in page.text
    figures = client.get(f"/runs/{run_id}/live.json").json()["figures"]
    bars = {t["name"]: t for t in figures[TIMELINE]["data"]}
    assert sum(len(t["y"]) for t in bars.values()) == 10
    # the newest ten: rounds 3 and 4 but round 3's compute spans (which start first)
    assert sorted(bars["compute"]["y"]) == ["a", "b"] and len(bars["wait"]["y"]) == len(bars["up"]["y"]) == 4
    exposed = figures[EXPOSED]["data"][0]
    assert exposed["x"] == ["a", "b"] and exposed["text"] == ["0.25 ⚠", "0.25 ⚠"]  # 0.5 s waited per 2 s of compute


def test_a_running_run_gets_its_timeline_once_it_has_spans(migrated_url: str, engine: Engine, client: TestClient) -> None:
    run_id = "timeline-live-" + uuid.uuid4().hex[:8]
    with RunLog(migrated_url) as log:
        log.start_run(run_id=run_id, name="timeline-live", strategy="streaming-diloco", config={}, rounds_planned=4)
        _round(log, run_id, 1, idle_s=None)
    page = client.get(f"/runs/{run_id}")
    assert f'id="{TIMELINE}"' not in page.text and "No timeline recorded." in page.text
    first = client.get(f"/runs/{run_id}/live.json").json()
    assert first["running"] is True and TIMELINE not in first["figures"]
    assert first["figures"][EXPOSED]["data"][0]["text"] == ["not measured", "not measured"]
    assert "No timeline recorded." in first["fragments"]["timeline-note"]

    with RunLog(migrated_url) as log:  # spans only: the page's version marker still moves
        log.log_timeline_spans(run_id=run_id, spans=_spans(1))
    update = client.get(f"/runs/{run_id}/live.json", params={"version": first["version"]}).json()
    assert update["changed"] is True and update["version"] != first["version"]
    assert [t["name"] for t in update["figures"][TIMELINE]["data"]] == ["compute", "wait", "up"]
    assert "No timeline recorded." not in update["fragments"]["timeline-note"]
    assert f'id="{TIMELINE}"' in client.get(f"/runs/{run_id}").text
    with engine.connect() as conn:
        data = page_data.load_run_page(conn, run_id, utcnow())
    assert data is not None and data.timeline_total == 6 and len(data.timeline) == 6
    assert [s["exposed_comm_comp_ratio"] for s in data.dc_summary] == [None, None]
