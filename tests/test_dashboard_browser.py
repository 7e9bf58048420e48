"""The dashboard pages in a real browser: headless Chromium (Playwright) against the real app under uvicorn.

One SQLite run log per module holds: a run written by a real `crossdc run` (synthetic, 2 datacenters,
3 rounds), and runs written with `RunLog` (the platform's own writer) to build exact cases: a running run
that grows while its page is open, an asynchronous run with known staleness, ratios and events, a run to
compare with, a run whose process died, and a long run (5,000 rounds × 4 datacenters, bulk-inserted).

Screenshots land in `test-artifacts/` at the repository root.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from browser_harness import REPO, Site, Tab, browser_fixture, serve, tab_fixture  # noqa: F401
from conftest import CROSSDC
from sqlalchemy import insert, update

from crossdc.dashboard.app import create_app
from crossdc.dashboard.figures import ALERT_COLOR, FIGURE_IDS, NOT_MEASURED_COLOR, OK_COLOR
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.models import DATACENTER_ROUNDS, ROUNDS, RUNS
from crossdc.db.queries import list_datacenter_rounds, list_rounds
from crossdc.db.runlog import RunLog, utcnow
from crossdc.experiment.processes import free_port

RUN_PAGE_FIGURES = [FIGURE_IDS[k] for k in (
    "loss_vs_round", "loss_vs_bytes", "loss_vs_wall_time", "tau_schedule", "bytes_per_round",
    "time_breakdown", "comm_comp_ratio", "exposed_comm_comp_ratio", "drift_per_datacenter")]
#: only on the page of a run with staleness (an asynchronous one)
STALENESS_FIGURES = [FIGURE_IDS["staleness_histogram"], FIGURE_IDS["staleness_over_time"]]

LIVE_RUN = "live-" + uuid.uuid4().hex[:8]
ASYNC_RUN = "async-" + uuid.uuid4().hex[:8]
SCAFFOLD_RUN = "scaffold-" + uuid.uuid4().hex[:8]
STALE_RUN = "stale-" + uuid.uuid4().hex[:8]
LONG_RUN = "long-" + uuid.uuid4().hex[:8]
LONG_ROUNDS, LONG_DATACENTERS = 5000, 4


# ------------------------------------------------------------------- data


def real_run(db_url: str, workdir: Path) -> str:
    """Run examples/synthetic-2dc.toml for real into `db_url`; its run id."""
    completed = subprocess.run(
        [CROSSDC, "run", str(REPO / "examples" / "synthetic-2dc.toml"), "--db", db_url, "--json", "--port", str(free_port())],
        capture_output=True, text=True, timeout=400, cwd=workdir,
    )
    assert completed.returncode == 0, f"crossdc run failed:\n{completed.stdout}\n{completed.stderr}"
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    return str(json.loads(lines[-1])["run_id"])


def log_round(log: RunLog, run_id: str, round_: int, datacenters: dict[str, dict[str, Any]], **values: Any) -> None:
    """One round as the server logs it: the datacenters' rows, then the round, then a heartbeat."""
    for name, dc_values in datacenters.items():
        log.log_datacenter_round(run_id=run_id, round=round_, datacenter=name, **{"status": "ok", **dc_values})
    row = {"tau": 2, "val_loss": 2.0 / round_, "val_accuracy": 0.2 * round_, "bytes_up": 2000, "bytes_down": 2000,
           "bytes_up_raw": 8000, "wall_s": 1.5}
    row.update(values)
    log.log_round(run_id=run_id, round=round_, **row)
    log.heartbeat(run_id=run_id)


def live_dc_values(round_: int) -> dict[str, dict[str, Any]]:
    return {name: {"compute_s": 1.0, "comm_s": 0.02 * (i + 1), "overhead_s": 0.3, "drift_l2": 0.1 * round_ + i,
                   "bytes_up": 1000, "bytes_up_raw": 4000, "bytes_down": 1000}
            for i, name in enumerate(("us-east", "eu-west"))}


def write_constructed_runs(db_url: str) -> None:
    """The exact cases, written with RunLog (plus the long run, bulk-inserted)."""
    with RunLog(db_url) as log:
        log.touch_datacenter(name="ap-south", region="Mumbai", gpus=8, link_bandwidth_mbps=100, link_rtt_ms=180)
        # A running run: the live test adds rounds while its page is open.
        log.start_run(run_id=LIVE_RUN, name="live-run", strategy="fedavg",
                      config={"compression": {"codecs": ["topk:0.1"]}}, rounds_planned=10)
        for r in (1, 2, 3):
            log_round(log, LIVE_RUN, r, live_dc_values(r))

        # An asynchronous run with exact staleness counts, comm/comp ratios and events.
        log.start_run(run_id=ASYNC_RUN, name="async-exact", strategy="fedasync", config={}, rounds_planned=4)
        ratios = {"slow-wan": {"compute_s": 2.0, "comm_s": 1.0, "overhead_s": 0.5},  # 0.5: above the alert
                  "fast-lan": {"compute_s": 2.0, "comm_s": 0.1, "overhead_s": 0.5},  # 0.05: fine
                  "simulated": {"compute_s": 2.0, "comm_s": None, "overhead_s": 0.5}}  # not measured
        for r in (1, 2, 3, 4):
            log_round(log, ASYNC_RUN, r, {k: {**v, "drift_l2": 0.1 * r} for k, v in ratios.items()}, tau=r)
        for seq, (staleness, status) in enumerate([(0, "applied"), (0, "applied"), (1, "applied"), (2, "applied"),
                                                    (2, "applied"), (2, "applied"), (5, "discarded")]):
            log.log_async_update(run_id=ASYNC_RUN, seq=seq, datacenter="slow-wan", base_version=seq,
                                 applied_version=seq + staleness, staleness=staleness, scale=1.0 / (1 + staleness),
                                 status=status, bytes_up=100)
        log.log_event(run_id=ASYNC_RUN, kind="timeout", round=2, datacenter="slow-wan", detail="no reply in 30 s")
        log.log_event(run_id=ASYNC_RUN, kind="rejected", round=3, datacenter="fast-lan", detail={"reason": "NaN"})
        log.log_event(run_id=ASYNC_RUN, kind="checkpoint", round=4, detail={"uri": "file:///tmp/ckpt-4"})
        log.log_event(run_id=ASYNC_RUN, kind="run-finished")
        log.finish_run(run_id=ASYNC_RUN, status="finished")

        # A second strategy to compare with the real run.
        log.start_run(run_id=SCAFFOLD_RUN, name="scaffold-run", strategy="scaffold", config={}, rounds_planned=5)
        for r in range(1, 6):
            log_round(log, SCAFFOLD_RUN, r, live_dc_values(r), val_loss=1.2 / r, bytes_up=1500, bytes_down=1500)
        log.finish_run(run_id=SCAFFOLD_RUN, status="finished")

        # A run whose processes died: stored "running", no heartbeat for an hour.
        log.start_run(run_id=STALE_RUN, name="died-run", strategy="fedavg", config={}, rounds_planned=5)
        log_round(log, STALE_RUN, 1, live_dc_values(1))
        log.flush(timeout=30)
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            an_hour_ago = utcnow() - timedelta(hours=1)
            conn.execute(update(RUNS).where(RUNS.c.id == STALE_RUN).values(started_at=an_hour_ago,
                                                                           last_heartbeat=an_hour_ago))
            write_long_run(conn)
    finally:
        engine.dispose()


def write_long_run(conn: Any) -> None:
    """LONG_ROUNDS rounds × LONG_DATACENTERS datacenters, inserted in bulk (RunLog would take minutes)."""
    started = utcnow() - timedelta(days=1)
    conn.execute(insert(RUNS).values(id=LONG_RUN, name="long-run", strategy="diloco", config={}, status="finished",
                                     started_at=started, finished_at=started, flower_run_ids="", baseline="none",
                                     rounds_planned=LONG_ROUNDS, last_heartbeat=started))
    conn.execute(insert(ROUNDS), [
        {"run_id": LONG_RUN, "round": r, "tau": min(r, 50), "val_loss": 3.0 / (1 + r / 200), "val_accuracy": r / LONG_ROUNDS,
         "bytes_up": 4000, "bytes_down": 4000, "bytes_up_raw": 16000, "wall_s": 2.0} for r in range(1, LONG_ROUNDS + 1)])
    conn.execute(insert(DATACENTER_ROUNDS), [
        {"run_id": LONG_RUN, "round": r, "datacenter": f"dc-{d}", "status": "ok", "bytes_up": 1000, "bytes_down": 1000,
         "bytes_up_raw": 4000, "compute_s": 1.5, "comm_s": 0.05 * d, "overhead_s": 0.3, "drift_l2": 0.01 * d + 1 / r}
        for r in range(1, LONG_ROUNDS + 1) for d in range(LONG_DATACENTERS)])


@dataclass
class RealRunSite(Site):
    """The served app, its database and the id of the run the real `crossdc run` wrote."""

    real_run_id: str


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealRunSite]:
    workdir = tmp_path_factory.mktemp("dashboard")
    db_url = f"sqlite:///{workdir / 'crossdc.db'}"
    upgrade(db_url)
    run_id = real_run(db_url, workdir)
    write_constructed_runs(db_url)
    with serve(db_url) as served:
        yield RealRunSite(served.base, served.db_url, run_id)


# ------------------------------------------------------------------ tests


def test_run_page_of_a_real_run_draws_every_chart_from_its_rows(site: RealRunSite, tab: Tab) -> None:
    engine = make_engine(site.db_url)
    try:
        rounds, dc_rows = list_rounds(engine, site.real_run_id), list_datacenter_rounds(engine, site.real_run_id)
    finally:
        engine.dispose()
    evaluated = sum(1 for r in rounds if r["val_loss"] is not None)
    datacenters = sorted({r["datacenter"] for r in dc_rows})
    per_dc = {name: sum(1 for r in dc_rows if r["datacenter"] == name and r["drift_l2"] is not None) for name in datacenters}
    assert evaluated >= 3 and len(datacenters) == 2

    response = tab.goto(f"{site.base}/runs/{site.real_run_id}")
    assert response.status == 200
    tab.wait_for_charts(RUN_PAGE_FIGURES)
    loss = tab.counts(FIGURE_IDS["loss_vs_round"])
    assert loss[:2] == [evaluated, evaluated]  # loss, accuracy; then the event markers
    assert tab.counts(FIGURE_IDS["loss_vs_bytes"]) == [evaluated, evaluated]
    assert tab.counts(FIGURE_IDS["loss_vs_wall_time"]) == [evaluated, evaluated]
    assert tab.counts(FIGURE_IDS["tau_schedule"]) == [len(rounds)]
    assert tab.counts(FIGURE_IDS["bytes_per_round"]) == [len(rounds)] * 2  # no codec: sent up, sent down
    assert tab.counts(FIGURE_IDS["time_breakdown"]) == [len(datacenters)] * 3
    assert tab.counts(FIGURE_IDS["comm_comp_ratio"]) == [len(datacenters)]
    assert tab.counts(FIGURE_IDS["drift_per_datacenter"]) == [per_dc[name] for name in datacenters]
    assert [tab.page.query_selector(f"#{div_id}") for div_id in STALENESS_FIGURES] == [None, None]  # synchronous
    assert len(tab.page.query_selector_all(".chart")) == len(RUN_PAGE_FIGURES)  # no empty panel
    assert tab.page.inner_text(".headline .status") == "finished"
    assert len(tab.page.query_selector_all("#datacenter-summary tbody tr")) == len(datacenters)
    assert tab.page.evaluate("window.crossdc.polling") is False  # a finished run is not polled
    tab.screenshot("run-real.png")
    assert tab.errors == []


def test_a_round_written_while_the_page_is_open_appears_without_a_reload(site: RealRunSite, tab: Tab) -> None:
    tab.goto(f"{site.base}/runs/{LIVE_RUN}")
    tab.wait_for_charts(RUN_PAGE_FIGURES)
    assert tab.counts(FIGURE_IDS["loss_vs_round"]) == [3, 3]
    assert tab.counts(FIGURE_IDS["drift_per_datacenter"]) == [3, 3]
    assert tab.counts(FIGURE_IDS["bytes_per_round"]) == [3, 3, 3]  # compressed: raw beside sent
    assert tab.page.evaluate("window.crossdc.polling") is True
    tab.page.evaluate("window.notReloaded = true")

    with RunLog(site.db_url) as log:
        log_round(log, LIVE_RUN, 4, live_dc_values(4))
        log.flush(timeout=30)
    tab.page.wait_for_function(
        "id => document.getElementById(id).data[0].x.length === 4", arg=FIGURE_IDS["loss_vs_round"], timeout=15_000)
    assert tab.counts(FIGURE_IDS["drift_per_datacenter"]) == [4, 4]
    assert tab.counts(FIGURE_IDS["tau_schedule"]) == [4]
    assert tab.page.inner_text("#fact-rounds") == "4 / 10"
    assert tab.page.evaluate("window.notReloaded") is True
    tab.screenshot("run-live.png")

    with RunLog(site.db_url) as log:
        log.finish_run(run_id=LIVE_RUN, status="finished")
        log.flush(timeout=30)
    tab.page.wait_for_function("() => window.crossdc.polling === false", timeout=15_000)
    assert tab.page.inner_text(".headline .status") == "finished"
    assert tab.page.evaluate("window.notReloaded") is True
    assert tab.errors == []


def test_exact_async_run_shows_staleness_alerts_not_measured_and_events(site: RealRunSite, tab: Tab) -> None:
    tab.goto(f"{site.base}/runs/{ASYNC_RUN}")
    tab.wait_for_charts(RUN_PAGE_FIGURES + STALENESS_FIGURES)
    staleness = tab.page.evaluate(
        "id => document.getElementById(id).data.map(t => [t.name, Array.from(t.x), Array.from(t.y)])",
        FIGURE_IDS["staleness_histogram"])
    assert staleness == [["applied", [0, 1, 2], [2, 1, 3]], ["discarded", [5], [1]]]
    bars = tab.page.evaluate("id => { const t = document.getElementById(id).data[0];"
                             " return [Array.from(t.x), Array.from(t.marker.color)]; }", FIGURE_IDS["comm_comp_ratio"])
    assert bars == [["fast-lan", "simulated", "slow-wan"], [OK_COLOR, NOT_MEASURED_COLOR, ALERT_COLOR]]
    shapes = tab.page.evaluate("id => document.getElementById(id).layout.shapes.map(s => [s.y0, s.y1])",
                               FIGURE_IDS["comm_comp_ratio"])
    assert shapes == [[0.1, 0.1]]
    assert "comm not measured" in tab.page.inner_text(f"#{FIGURE_IDS['time_breakdown']}")
    markers = tab.page.evaluate("id => document.getElementById(id).data.slice(2).map(t => [t.name, Array.from(t.x)])",
                                FIGURE_IDS["loss_vs_round"])
    assert markers == [["event: timeout", [2]], ["event: rejected", [3]], ["event: checkpoint", [4]]]
    kinds = tab.page.eval_on_selector_all("#events tbody tr .kind", "els => els.map(e => e.textContent)")
    assert kinds == ["run-finished", "checkpoint", "rejected", "timeout"]  # newest first
    row = tab.page.inner_text("#datacenter-summary tr[data-datacenter='simulated']")
    assert "not measured" in row
    assert tab.page.inner_text("#datacenter-summary tr[data-datacenter='slow-wan'] td.alert") == "0.5"
    tab.screenshot("run-async-exact.png")
    assert tab.errors == []


def test_a_running_async_run_gets_its_staleness_charts_once_it_has_staleness(site: RealRunSite, tab: Tab) -> None:
    run_id = "async-live-" + uuid.uuid4().hex[:8]
    with RunLog(site.db_url) as log:  # started, no update yet
        log.start_run(run_id=run_id, name="async-live", strategy="fedbuff", config={}, rounds_planned=5)
        log.heartbeat(run_id=run_id)
        log.flush(timeout=30)
    tab.goto(f"{site.base}/runs/{run_id}")
    tab.wait_for_charts(RUN_PAGE_FIGURES)
    assert [tab.page.query_selector(f"#{div_id}") for div_id in STALENESS_FIGURES] == [None, None]
    assert tab.page.evaluate("window.crossdc.polling") is True

    with tab.page.expect_event("load", timeout=20_000):  # its first update: the page reloads to lay the charts out
        with RunLog(site.db_url) as log:
            log.log_async_update(run_id=run_id, seq=0, datacenter="us-east", base_version=0, applied_version=1,
                                 staleness=1, scale=0.5, status="applied", bytes_up=100)
            log_round(log, run_id, 1, {"us-east": {"compute_s": 1.0, "comm_s": 0.1, "staleness": 1}})
            log.flush(timeout=30)
    tab.wait_for_charts(RUN_PAGE_FIGURES + STALENESS_FIGURES)
    assert tab.page.evaluate("id => document.getElementById(id).data.map(t => t.name)", STALENESS_FIGURES[1]) == ["us-east"]
    histogram = tab.page.evaluate(
        "id => document.getElementById(id).data.map(t => [t.name, Array.from(t.x), Array.from(t.y)])", STALENESS_FIGURES[0])
    assert histogram == [["applied", [1], [1]]]
    with RunLog(site.db_url) as log:
        log.finish_run(run_id=run_id, status="finished")
        log.flush(timeout=30)
    assert tab.errors == []


def test_long_run_traces_are_bounded_and_keep_the_last_round(site: RealRunSite, tab: Tab) -> None:
    started = time.monotonic()
    response = tab.goto(f"{site.base}/runs/{LONG_RUN}")
    assert response.status == 200
    tab.wait_for_charts(RUN_PAGE_FIGURES)
    loaded_s = time.monotonic() - started
    for div_id in RUN_PAGE_FIGURES:
        assert all(n <= 2000 for n in tab.counts(div_id)), div_id
    last_x = tab.page.evaluate("id => document.getElementById(id).data.map(t => t.x[t.x.length - 1])",
                               FIGURE_IDS["drift_per_datacenter"])
    assert last_x == [LONG_ROUNDS] * LONG_DATACENTERS
    loss = tab.page.evaluate("id => { const t = document.getElementById(id).data[0]; return [t.x.length, t.x[t.x.length - 1]]; }",
                             FIGURE_IDS["loss_vs_round"])
    assert 1000 <= loss[0] <= 2000 and loss[1] == LONG_ROUNDS
    # Totals in the table are exact even though the series are thinned.
    assert tab.page.inner_text("#datacenter-summary tr[data-datacenter='dc-0'] td:nth-child(2)") == f"{LONG_ROUNDS:,}"
    assert loaded_s < 30
    assert tab.errors == []


def test_compare_page_overlays_two_runs(site: RealRunSite, tab: Tab) -> None:
    tab.goto(f"{site.base}/compare?runs={site.real_run_id},{SCAFFOLD_RUN}")
    ids = [FIGURE_IDS["compare_round"], FIGURE_IDS["compare_bytes"]]
    tab.wait_for_charts(ids)
    engine = make_engine(site.db_url)
    try:
        real_points = sum(1 for r in list_rounds(engine, site.real_run_id) if r["val_loss"] is not None)
    finally:
        engine.dispose()
    for div_id in ids:
        assert tab.counts(div_id) == [real_points, 5]
    names = tab.page.evaluate("id => document.getElementById(id).data.map(t => t.name)", ids[0])
    assert "synthetic-2dc" in names[0] and "scaffold-run" in names[1]
    rows = tab.page.eval_on_selector_all("#compare-table tbody tr", "els => els.map(e => e.dataset.runId)")
    assert rows == [site.real_run_id, SCAFFOLD_RUN]
    tab.screenshot("compare.png")
    assert tab.errors == []


def test_bad_compare_lists_and_unknown_runs_get_clear_error_pages(site: RealRunSite, tab: Tab) -> None:
    response = tab.goto(f"{site.base}/compare?runs={SCAFFOLD_RUN}")
    assert response.status == 400
    assert "at least two different run ids" in tab.page.inner_text(".error-message")
    response = tab.goto(f"{site.base}/compare?runs={SCAFFOLD_RUN},no-such-run")
    assert response.status == 404
    assert "no-such-run" in tab.page.inner_text(".error-message")
    response = tab.goto(f"{site.base}/runs/no-such-run")
    assert response.status == 404
    assert "no run with id 'no-such-run'" in tab.page.inner_text(".error-message")
    tab.screenshot("run-not-found.png")


def test_runs_list_shows_every_run_with_its_effective_status(site: RealRunSite, tab: Tab) -> None:
    with RunLog(site.db_url) as log:  # the live run may have finished meanwhile: this one keeps running
        running = "running-" + uuid.uuid4().hex[:8]
        log.start_run(run_id=running, name="still-running", strategy="fedprox", config={}, rounds_planned=3)
        log_round(log, running, 1, live_dc_values(1))
        log.flush(timeout=30)
    tab.goto(f"{site.base}/")
    statuses = dict(tab.page.eval_on_selector_all(
        "#runs-table tbody tr", "els => els.map(e => [e.dataset.runId, e.querySelector('.status').textContent])"))
    assert statuses[site.real_run_id] == "finished"
    assert statuses[running] == "running"
    assert statuses[STALE_RUN] == "interrupted"  # stored "running", but its heartbeat stopped an hour ago
    assert {ASYNC_RUN, SCAFFOLD_RUN, LONG_RUN} <= set(statuses)
    real_row = tab.page.inner_text(f"#runs-table tr[data-run-id='{site.real_run_id}']")
    assert "synthetic-2dc" in real_row and "3 / 3" in real_row
    # Picking two runs and submitting leads to the compare page.
    tab.page.check(f"input[value='{site.real_run_id}']")
    tab.page.check(f"input[value='{SCAFFOLD_RUN}']")
    tab.screenshot("runs.png")
    tab.page.click("#compare-button")
    tab.page.wait_for_url("**/compare?**")
    tab.wait_for_charts([FIGURE_IDS["compare_round"]])
    assert len(tab.counts(FIGURE_IDS["compare_round"])) == 2
    assert tab.errors == []


def test_datacenters_page_lists_enrolled_datacenters(site: RealRunSite, tab: Tab) -> None:
    tab.goto(f"{site.base}/datacenters")
    names = tab.page.eval_on_selector_all("#datacenters tbody tr", "els => els.map(e => e.dataset.datacenter)")
    assert {"us-east", "eu-west", "ap-south"} <= set(names)
    assert names == sorted(names)
    row = tab.page.inner_text("#datacenters tr[data-datacenter='ap-south']")
    assert "Mumbai" in row and "active" in row and "100 Mbps" in row and "180 ms" in row and "ago" in row
    tab.screenshot("datacenters.png")
    assert tab.errors == []


def test_plotly_js_is_served_locally(site: RealRunSite, tab: Tab) -> None:
    response = tab.goto(f"{site.base}/static/plotly.min.js")
    assert response.status == 200 and "javascript" in response.headers["content-type"]
    tab.goto(f"{site.base}/runs/{site.real_run_id}")
    sources = tab.page.eval_on_selector_all("script[src]", "els => els.map(e => e.src)")
    assert sources and all(src.startswith(site.base) for src in sources)


# ------------------------------------------- server side, on both backends


def test_only_runs_with_staleness_get_the_staleness_charts(migrated_url: str) -> None:
    """The rendered run page (its chart divs) and live.json (its figures) of a synchronous run, of an asynchronous
    run with async updates, and of one whose datacenter rounds alone carry a staleness."""
    from fastapi.testclient import TestClient

    runs = {kind: f"{kind}-" + uuid.uuid4().hex[:8] for kind in ("sync", "async", "staleness-only")}
    with RunLog(migrated_url) as log:
        for kind, run_id in runs.items():
            log.start_run(run_id=run_id, name=kind, strategy="fedavg" if kind == "sync" else "fedasync", config={},
                          rounds_planned=2)
            staleness = None if kind == "sync" else 0
            for r in (1, 2):
                log_round(log, run_id, r, {"a": {"compute_s": 1.0, "comm_s": 0.1, "staleness": staleness}})
            log.finish_run(run_id=run_id, status="finished")
        log.log_async_update(run_id=runs["async"], seq=0, datacenter="a", base_version=0, applied_version=0, staleness=0,
                             scale=1.0, status="applied", bytes_up=100)
        log.flush(timeout=30)
    engine = make_engine(migrated_url)
    try:
        client = TestClient(create_app(engine=engine))
        for kind, run_id in runs.items():
            page = client.get(f"/runs/{run_id}")
            figures = client.get(f"/runs/{run_id}/live.json").json()["figures"]
            assert page.status_code == 200
            shown = kind != "sync"
            for div_id in STALENESS_FIGURES:
                assert (f'id="{div_id}"' in page.text) is shown, (kind, div_id)
                assert (div_id in figures) is shown, (kind, div_id)
            assert all(f'id="{div_id}"' in page.text and div_id in figures for div_id in RUN_PAGE_FIGURES)
    finally:
        engine.dispose()


def test_run_page_thins_series_in_sql_on_both_backends(migrated_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run page's SQL (aggregates, thinning, live marker) on SQLite and PostgreSQL, without a browser."""
    from fastapi.testclient import TestClient

    from crossdc.dashboard import page_data

    monkeypatch.setattr(page_data, "points_per_datacenter", lambda n: 10)  # force thinning on a small run
    run_id = "thin-" + uuid.uuid4().hex[:8]
    with RunLog(migrated_url) as log:
        log.start_run(run_id=run_id, name="thin", strategy="fedavg", config={}, rounds_planned=40)
        for r in range(1, 41):
            values = {"a": {"compute_s": 1.0, "comm_s": 0.5, "overhead_s": 0.1, "drift_l2": float(r)}}
            if r <= 30:  # "b" stops at round 30: its last point must still be drawn
                values["b"] = {"compute_s": 2.0, "comm_s": None, "overhead_s": 0.1, "drift_l2": float(r)}
            log_round(log, run_id, r, values)
        log.flush(timeout=30)
    engine = make_engine(migrated_url)
    try:
        client = TestClient(create_app(engine=engine))
        page = client.get(f"/runs/{run_id}")
        assert page.status_code == 200
        live = client.get(f"/runs/{run_id}/live.json").json()
        assert live["running"] is True and live["changed"] is True
        drift = {t["name"]: t for t in live["figures"][FIGURE_IDS["drift_per_datacenter"]]["data"]}
        assert set(drift) == {"a", "b"}
        ratio = live["figures"][FIGURE_IDS["comm_comp_ratio"]]["data"][0]
        assert ratio["x"] == ["a", "b"] and ratio["text"] == ["0.5 ⚠", "not measured"]
        assert "40 / 40" in live["fragments"]["run-headline"]
        table = live["fragments"]["dc-table"]
        assert "one round in every 5" in table and "20 s" in table  # totals stay exact: 40 × 0.5 s of comm on "a"
        same = client.get(f"/runs/{run_id}/live.json", params={"version": live["version"]}).json()
        assert same == {"version": live["version"], "running": True, "changed": False}
        assert client.get("/runs/nope/live.json").status_code == 404
        # Two more rounds: the totals are updated from the new rows only, and stay exact.
        with RunLog(migrated_url) as log:
            for r in (41, 42):
                log_round(log, run_id, r, {"a": {"compute_s": 1.0, "comm_s": 0.5, "overhead_s": 0.1, "drift_l2": 1.0}})
            log.flush(timeout=30)
        newer = client.get(f"/runs/{run_id}/live.json", params={"version": live["version"]}).json()
        assert newer["changed"] is True and "42 / 40" in newer["fragments"]["run-headline"]
        assert "21 s" in newer["fragments"]["dc-table"]  # 42 × 0.5 s
    finally:
        engine.dispose()
    # The thinned rows themselves: at most 10 per datacenter, every 5th round from the first, plus each one's last.
    engine = make_engine(migrated_url)
    try:
        with engine.connect() as conn:
            data = page_data.load_run_page(conn, run_id, utcnow())
    finally:
        engine.dispose()
    assert data is not None and data.dc_stride == 5
    rounds_of = {name: [r["round"] for r in data.dc_sample if r["datacenter"] == name] for name in ("a", "b")}
    assert rounds_of["a"] == [1, 6, 11, 16, 21, 26, 31, 36, 41, 42]
    assert rounds_of["b"] == [1, 6, 11, 16, 21, 26, 30]
    summary = {s["datacenter"]: s for s in data.dc_summary}
    assert summary["a"]["rounds"] == 42 and summary["a"]["comm_s_total"] == pytest.approx(21.0)
    assert summary["b"]["comm_comp_ratio"] is None and summary["b"]["comm_measured"] == 0
