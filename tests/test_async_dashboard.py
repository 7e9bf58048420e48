"""The dashboard reads an asynchronous run's updates: the staleness histogram and per-datacenter staleness over time
(pure figure, the run page's bounded query, the page's figures)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from crossdc.dashboard import figures, page_data
from crossdc.dashboard.pages import run_figures
from crossdc.db.engine import make_engine
from crossdc.db.runlog import RunLog

UPDATES = [  # (datacenter, base_version, applied_version, status)
    ("fast", 0, 0, "applied"), ("fast", 1, 1, "applied"), ("slow", 0, 2, "applied"), ("fast", 2, 3, "applied"),
    ("fast", 4, 4, "applied"), ("slow", 2, 9, "discarded"), ("fast", 5, 5, "applied"), ("fast", 6, 6, "applied"),
    ("slow", 5, 7, "applied"), ("fast", 7, 7, "applied"),
]


def test_staleness_over_time_has_a_trace_per_datacenter_and_marks_discards() -> None:
    rows = [{"datacenter": dc, "applied_version": t, "staleness": t - v, "status": status}
            for dc, v, t, status in UPDATES]
    fig = figures.staleness_over_time(rows)
    traces = {t.name: t for t in fig.data}
    assert set(traces) == {"fast", "slow", "slow discarded"}
    assert list(traces["slow"].x) == [2, 7] and list(traces["slow"].y) == [2, 2]
    assert list(traces["slow discarded"].x) == [9] and list(traces["slow discarded"].y) == [7]
    assert traces["slow discarded"].marker.symbol == "x" and traces["slow"].marker.color == traces["slow discarded"].marker.color
    assert len(traces["fast"].x) == 7
    empty = figures.staleness_over_time([])
    assert not empty.data and "no async updates" in empty.layout.annotations[0].text


def test_run_page_reads_the_async_updates_thinned_in_sql(migrated_sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with RunLog(migrated_sqlite_url) as log:
        log.start_run(run_id="async-run", name="async", strategy="fedasync", config={}, rounds_planned=8)
        for seq, (dc, v, t, status) in enumerate(UPDATES, start=1):
            log.log_async_update(run_id="async-run", seq=seq, datacenter=dc, base_version=v, applied_version=t,
                                 staleness=t - v, scale=None if status == "discarded" else 1.0 / (1 + t - v),
                                 status=status, bytes_up=100)
        log.flush(timeout=30)
    engine = make_engine(migrated_sqlite_url)
    now = datetime.now(UTC)
    try:
        with engine.connect() as conn:
            data = page_data.load_run_page(conn, "async-run", now)
            assert data is not None and data.async_total == len(UPDATES)
            assert [r["seq"] for r in data.staleness_series] == list(range(1, len(UPDATES) + 1))
            assert {(r["status"], r["staleness"]): r["count"] for r in data.staleness_counts} == \
                {("applied", 0): 6, ("applied", 1): 1, ("applied", 2): 2, ("discarded", 7): 1}
            shown = run_figures(data)
            assert {t.name for t in shown[figures.FIGURE_IDS["staleness_over_time"]].data} == {"fast", "slow", "slow discarded"}
            assert {t.name for t in shown[figures.FIGURE_IDS["staleness_histogram"]].data} == {"applied", "discarded"}
            monkeypatch.setattr(page_data, "DATACENTER_POINT_BUDGET", 4)  # a long run: every 3rd update is read
            thinned = page_data.load_run_page(conn, "async-run", now)
            assert thinned is not None and [r["seq"] for r in thinned.staleness_series] == [3, 6, 9]
            assert thinned.async_total == len(UPDATES)  # the histogram's counts stay exact
    finally:
        engine.dispose()
