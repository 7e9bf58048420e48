"""A pipeline run on the dashboard: `/api/runs/{id}/pipeline-stages`, micro-batch spans through `/timeline`, and the
run page's per-stage views (one round's micro-batches per stage, the round's stages table, the bubble per round) in
headless Chromium (Playwright) against the real app under uvicorn.

One SQLite run log for the module, filled through `RunLog` the way a pipeline run logs a round: a finished run of two
stages (us-east, then eu-west, in config order) over three rounds of two GPipe steps of two micro-batches, a pipeline
run that is still running, and a federated-averaging run, which must show no pipeline view.

Screenshots land in `test-artifacts/` at the repository root.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from browser_harness import Site, Tab, browser_fixture, serve_fresh, tab_fixture  # noqa: F401

from crossdc.dashboard.figures import FIGURE_IDS, MICROBATCH_COLORS
from crossdc.db.records import PipelineStageRecord, TimelineSpanRecord
from crossdc.db.runlog import RunLog

LANES, BUBBLE = FIGURE_IDS["pipeline_timeline"], FIGURE_IDS["pipeline_bubble"]

PIPELINE_RUN = "pipeline-" + uuid.uuid4().hex[:8]
LIVE_RUN = "pipeline-live-" + uuid.uuid4().hex[:8]
FEDAVG_RUN = "fedavg-" + uuid.uuid4().hex[:8]
ROUNDS = 3
STEPS, MICROBATCHES = 2, 2
DATACENTERS = ("us-east", "eu-west")
LABELS = ["stage 0 · us-east", "stage 1 · eu-west"]
CONFIG: dict[str, Any] = {
    "run": {"name": "pipeline-2", "rounds": ROUNDS},
    "strategy": {"name": "pipeline", "tau": STEPS, "params": {"microbatches": MICROBATCHES, "schedule": "gpipe"}},
    "datacenters": [{"name": name} for name in DATACENTERS],
}
#: seconds one optimizer step takes end to end
STEP_S = 10.0


# ------------------------------------------------------------------- data


def stage_row(stage: int, round_: int) -> dict[str, Any]:
    """Stage `stage`'s part of round `round_`, as the API answers it."""
    last = stage == len(DATACENTERS) - 1
    return {"round": round_, "replica": 0, "stage": stage, "datacenter": DATACENTERS[stage], "steps": STEPS,
            "microbatches": MICROBATCHES, "compute_s": 12.0, "wall_s": 2 * STEP_S, "bubble_fraction": 0.4 - 0.05 * round_,
            "bytes_forward": 0 if last else 4096 * round_, "bytes_backward": 2048 * round_ if stage else 0,
            "bytes_source": "delay-line", "train_loss": 2.0 / round_ if last else None}


def gpipe_spans(round_: int) -> list[Any]:
    """Round `round_`'s micro-batch spans under GPipe: per step, every forward down the stages, then every backward
    back up (one second per forward, two per backward)."""
    spans = []
    for k in range(STEPS):
        step = (round_ - 1) * STEPS + k + 1
        t0 = (step - 1) * STEP_S
        for stage, name in enumerate(DATACENTERS):
            for mb in range(MICROBATCHES):
                start = t0 + stage + mb
                spans.append(TimelineSpanRecord(round=round_, datacenter=name, kind="forward", start_s=start,
                                                end_s=start + 1.0, microbatch=mb, step=step))
                back = t0 + 3.0 + 2 * (len(DATACENTERS) - 1 - stage) + 2 * (MICROBATCHES - 1 - mb)
                spans.append(TimelineSpanRecord(round=round_, datacenter=name, kind="backward", start_s=back,
                                                end_s=back + 2.0, microbatch=mb, step=step))
    return spans


def log_pipeline_round(log: RunLog, run_id: str, round_: int) -> None:
    """One round as a pipeline run logs it: the stages' rows, their micro-batch spans, the round, a heartbeat."""
    for stage in range(len(DATACENTERS)):
        log.log_pipeline_stage(run_id=run_id, round=round_,
                               record=PipelineStageRecord(**{k: v for k, v in stage_row(stage, round_).items() if k != "round"}))
    log.log_timeline_spans(run_id=run_id, spans=gpipe_spans(round_))
    log.log_round(run_id=run_id, round=round_, tau=STEPS, val_loss=2.0 / round_, val_accuracy=None, bytes_up=0,
                  bytes_down=0, bytes_up_raw=0, wall_s=2 * STEP_S)
    log.heartbeat(run_id=run_id)


def write_runs(db_url: str) -> None:
    with RunLog(db_url) as log:
        log.start_run(run_id=PIPELINE_RUN, name="pipeline-2", strategy="pipeline", config=CONFIG, rounds_planned=ROUNDS)
        for r in range(1, ROUNDS + 1):
            log_pipeline_round(log, PIPELINE_RUN, r)
        log.finish_run(run_id=PIPELINE_RUN, status="finished")

        log.start_run(run_id=LIVE_RUN, name="pipeline-live", strategy="pipeline", config=CONFIG, rounds_planned=ROUNDS)
        log_pipeline_round(log, LIVE_RUN, 1)

        log.start_run(run_id=FEDAVG_RUN, name="fedavg-run", strategy="fedavg", config={}, rounds_planned=1)
        log.log_round(run_id=FEDAVG_RUN, round=1, tau=2, val_loss=1.0, val_accuracy=None, bytes_up=1, bytes_down=1,
                      bytes_up_raw=1, wall_s=1.0)
        log.finish_run(run_id=FEDAVG_RUN, status="finished")
        log.flush(timeout=30)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with serve_fresh(tmp_path_factory, "pipeline-dashboard", write_runs) as served:
        yield served


def stage_table(tab: Tab) -> list[list[str]]:
    """The pipeline stages table's rows, cell texts."""
    return tab.page.eval_on_selector_all("#pipeline-stages-table tbody tr",
                                         "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent.trim()))")


def wait_for_pipeline(tab: Tab) -> None:
    tab.wait_for_charts([LANES, BUBBLE])


# ------------------------------------------------------------------ tests


def test_the_api_answers_the_stages_by_round_then_stage_and_the_microbatch_spans(site: Site) -> None:
    body = site.get(f"/api/runs/{PIPELINE_RUN}/pipeline-stages").json()
    assert body == {"run_id": PIPELINE_RUN, "round": None,
                    "items": [stage_row(s, r) for r in range(1, ROUNDS + 1) for s in range(len(DATACENTERS))]}
    one = site.get(f"/api/runs/{PIPELINE_RUN}/pipeline-stages?round=2").json()
    assert (one["round"], [(i["round"], i["stage"]) for i in one["items"]]) == (2, [(2, 0), (2, 1)])
    assert site.get(f"/api/runs/{FEDAVG_RUN}/pipeline-stages").json() == {"run_id": FEDAVG_RUN, "round": None, "items": []}
    missing = site.get("/api/runs/no-such-run/pipeline-stages")
    assert missing.status_code == 404 and missing.json() == {"detail": "run 'no-such-run' not found"}
    assert site.get(f"/api/runs/{PIPELINE_RUN}/pipeline-stages?round=0").status_code == 422
    paths = site.get("/openapi.json").json()["paths"]
    assert "/api/runs/{run_id}/pipeline-stages" in paths

    timeline = site.get(f"/api/runs/{PIPELINE_RUN}/timeline?round=2").json()
    assert timeline["truncated"] is False and len(timeline["items"]) == len(gpipe_spans(2))
    assert {(i["kind"], i["step"], i["microbatch"]) for i in timeline["items"] if i["datacenter"] == "us-east"} == {
        (kind, step, mb) for kind in ("forward", "backward") for step in (3, 4) for mb in range(MICROBATCHES)}
    first = timeline["items"][0]  # by datacenter, then start: eu-west's first forward of step 3
    assert first == {"round": 2, "datacenter": "eu-west", "kind": "forward", "start_s": 21.0, "end_s": 22.0,
                     "fragment": None, "exchange": None, "microbatch": 0, "step": 3}


def test_the_run_page_draws_each_stage_s_microbatches_of_the_latest_round_and_its_table(site: Site, tab: Tab) -> None:
    tab.open_run(site.base, PIPELINE_RUN)
    wait_for_pipeline(tab)

    # One lane per stage, stage 0 on top; forward and backward bars of round 3 only (steps 5 and 6).
    lanes = tab.traces(LANES)
    assert [t["name"] for t in lanes] == ["forward", "backward"]
    layout = tab.page.evaluate("id => { const l = document.getElementById(id).layout; "
                               "return {lanes: l.yaxis.categoryarray, title: l.title.text}; }", LANES)
    assert layout == {"lanes": LABELS, "title": "Pipeline stages, round 3: micro-batches"}
    expected = gpipe_spans(3)
    for trace in lanes:
        mine = [s for s in expected if s.kind == trace["name"]]
        assert sorted(trace["y"]) == sorted(LABELS[DATACENTERS.index(s.datacenter)] for s in mine)
        assert all(f"round 3 · step {s.step} · micro-batch {s.microbatch}" in "".join(trace["customdata"]) for s in mine)
        assert trace["marker_color"] == MICROBATCH_COLORS[trace["name"]]
    assert MICROBATCH_COLORS["forward"] != MICROBATCH_COLORS["backward"]
    assert lanes[0]["x"] == [1.0] * len(lanes[0]["x"])  # a second per forward

    # The round picker: the three rounds, newest first, the latest chosen; the table: the round's two stages.
    options = tab.page.eval_on_selector_all("#pipeline-round option", "os => os.map(o => [o.value, o.selected])")
    assert options == [["3", True], ["2", False], ["1", False]]
    rows = stage_table(tab)
    assert [row[:4] for row in rows] == [["0", "us-east", "2", "2"], ["1", "eu-west", "2", "2"]]
    assert [row[6] for row in rows] == ["25 %", "25 %"]  # bubble
    assert [row[7:9] for row in rows] == [["12.3 kB", "0 B"], ["0 B", "6.14 kB"]]  # forward after stage 0, backward before stage 1
    assert [row[10] for row in rows] == ["–", "0.6667"]  # the last stage's loss

    # The bubble per round: a line per stage, over the three rounds.
    bubble = tab.traces(BUBBLE)
    assert [t["name"] for t in bubble] == LABELS
    assert all(t["x"] == [1, 2, 3] and t["y"] == pytest.approx([0.35, 0.3, 0.25]) for t in bubble)
    tab.screenshot("run-pipeline.png")
    assert tab.errors == []


def test_picking_a_round_shows_that_round(site: Site, tab: Tab) -> None:
    tab.open_run(site.base, PIPELINE_RUN)
    wait_for_pipeline(tab)
    with tab.page.expect_navigation():
        tab.page.select_option("#pipeline-round", "1")
    assert tab.page.url.endswith(f"/runs/{PIPELINE_RUN}?round=1")
    wait_for_pipeline(tab)
    assert tab.page.evaluate("id => document.getElementById(id).layout.title.text", LANES).endswith("round 1: micro-batches")
    steps = {text.split("step ")[1].split(" ")[0] for t in tab.traces(LANES) for text in t["customdata"]}
    assert steps == {"1", "2"}
    assert tab.page.get_attribute("#pipeline-stages-table", "data-round") == "1"
    assert [row[7] for row in stage_table(tab)] == ["4.1 kB", "0 B"]
    assert tab.page.eval_on_selector("#pipeline-round", "s => s.value") == "1"
    # a round the run did not log, or no round at all: the latest
    assert 'data-round="3"' in site.get(f"/runs/{PIPELINE_RUN}?round=99").text
    assert 'data-round="3"' in site.get(f"/runs/{PIPELINE_RUN}?round=latest").text
    assert tab.errors == []


def test_a_running_pipeline_run_shows_each_new_round_without_a_reload(site: Site, tab: Tab) -> None:
    tab.open_run(site.base, LIVE_RUN)
    wait_for_pipeline(tab)
    assert tab.page.get_attribute("#pipeline-stages-table", "data-round") == "1"
    assert tab.page.evaluate("window.crossdc.polling") is True
    tab.page.evaluate("window.notReloaded = true")
    with RunLog(site.db_url) as log:
        log_pipeline_round(log, LIVE_RUN, 2)
        log.flush(timeout=30)
    tab.page.wait_for_function(
        "id => { const t = document.getElementById('pipeline-stages-table');"
        " return t && t.dataset.round === '2' && document.getElementById(id).layout.title.text.includes('round 2'); }",
        arg=LANES, timeout=20_000)
    assert tab.page.evaluate("window.notReloaded") is True
    assert tab.page.eval_on_selector_all("#pipeline-round option", "os => os.map(o => o.value)") == ["2", "1"]
    assert [t["x"] for t in tab.traces(BUBBLE)] == [[1, 2], [1, 2]]
    with RunLog(site.db_url) as log:
        log.finish_run(run_id=LIVE_RUN, status="finished")
        log.flush(timeout=30)
    tab.page.wait_for_function("() => window.crossdc.polling === false", timeout=15_000)
    assert tab.errors == []


def test_a_pipeline_run_without_a_round_yet_says_so(site: Site) -> None:
    run_id = "pipeline-new-" + uuid.uuid4().hex[:8]
    with RunLog(site.db_url) as log:
        log.start_run(run_id=run_id, name="pipeline-new", strategy="pipeline", config=CONFIG, rounds_planned=ROUNDS)
        log.flush(timeout=30)
    page = site.get(f"/runs/{run_id}").text
    assert 'id="pipeline"' in page and "No pipeline stage logged yet." in page and 'id="pipeline-round"' not in page
    figures = site.get(f"/runs/{run_id}/live.json").json()["figures"]
    assert figures[LANES]["data"] == [] and figures[BUBBLE]["data"] == []


def test_other_runs_pages_have_no_pipeline_view(site: Site) -> None:
    page = site.get(f"/runs/{FEDAVG_RUN}").text
    for marker in ('id="pipeline"', f'id="{LANES}"', f'id="{BUBBLE}"', 'id="pipeline-round"'):
        assert marker not in page, marker
    live = site.get(f"/runs/{FEDAVG_RUN}/live.json").json()
    assert LANES not in live["figures"] and live["fragments"]["pipeline-stages"].strip() == ""
    assert 'id="pipeline"' in site.get(f"/runs/{PIPELINE_RUN}").text
