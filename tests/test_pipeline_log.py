"""What a pipeline run logs (revisions 0010 and 0011), on SQLite and PostgreSQL: each stage's part of each round
(``pipeline_stages``, through ``RunLog.log_pipeline_stage``) and its micro-batches' forward and backward spans
(``timeline_spans`` with ``microbatch`` and ``step``), from the migration up and down to the rows a resumed run forgets.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from crossdc.db.engine import current_revision, downgrade, head_revisions, make_engine, upgrade
from crossdc.db.models import MICROBATCH_SPAN_KINDS, PIPELINE_BYTES_SOURCES, SPAN_KINDS, TIMELINE_SPAN_KINDS
from crossdc.db.queries import list_pipeline_stages, list_timeline_spans
from crossdc.db.records import PipelineStageRecord, TimelineSpanRecord
from crossdc.db.runlog import RunLog

PIPELINE_COLUMNS = {
    "id", "run_id", "round", "replica", "stage", "datacenter", "steps", "microbatches", "compute_s", "wall_s", "bubble_fraction",
    "bytes_forward", "bytes_backward", "bytes_source", "train_loss",
}
DATACENTERS = ("us-east", "eu-west")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_url(request: pytest.FixtureRequest) -> str:
    """An empty database, never migrated, on each backend."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def stage_record(index: int, round_: int, **changes: Any) -> Any:
    """Stage `index` of a two-stage pipeline in round `round_`: the first sends activations on, the second gradients
    back and has the loss; `changes` replace fields."""
    last = index == len(DATACENTERS) - 1
    record = PipelineStageRecord(
        stage=index, datacenter=DATACENTERS[index], steps=2, microbatches=4, compute_s=1.5 + index, wall_s=3.0,
        bubble_fraction=0.25 + 0.1 * index, bytes_forward=0 if last else 1000 * round_,
        bytes_backward=900 * round_ if index else 0, bytes_source="delay-line", train_loss=2.0 / round_ if last else None)
    return record.replace(**changes)


def microbatch_spans(round_: int) -> list[Any]:
    """Round `round_`'s micro-batch spans: both stages, two steps of two micro-batches, a forward and a backward each."""
    spans = []
    for stage, name in enumerate(DATACENTERS):
        for step in (2 * round_ - 1, 2 * round_):
            for mb in (0, 1):
                t = 10.0 * step + 2.0 * mb + stage
                spans.append(TimelineSpanRecord(round=round_, datacenter=name, kind="forward", start_s=t, end_s=t + 0.5,
                                                microbatch=mb, step=step))
                spans.append(TimelineSpanRecord(round=round_, datacenter=name, kind="backward", start_s=t + 5.0,
                                                end_s=t + 6.0, microbatch=mb, step=step))
    return spans


def fields(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("id", "run_id")}


# -------------------------------------------------------------- migration


@pytest.mark.timeout(60)
def test_revision_0010_adds_pipeline_stages_and_microbatch_spans_and_goes_back(fresh_url: str) -> None:
    upgrade(fresh_url, "0009")
    engine = make_engine(fresh_url)
    try:
        assert "pipeline_stages" not in inspect(engine).get_table_names()
        upgrade(fresh_url)
        assert current_revision(fresh_url) == head_revisions()[0]
        insp = inspect(engine)
        assert {c["name"] for c in insp.get_columns("pipeline_stages")} == PIPELINE_COLUMNS
        nullable = {c["name"]: c["nullable"] for c in insp.get_columns("pipeline_stages")}
        assert [c for c, n in nullable.items() if n] == ["train_loss"]
        assert [(fk["referred_table"], fk["options"].get("ondelete")) for fk in insp.get_foreign_keys("pipeline_stages")] \
            == [("runs", "CASCADE")]
        span_columns = {c["name"]: c["nullable"] for c in insp.get_columns("timeline_spans")}
        assert span_columns["microbatch"] is True and span_columns["step"] is True
        indexes = {ix["name"]: ix["column_names"] for ix in insp.get_indexes("timeline_spans")}
        assert indexes["ix_timeline_spans_run_id_round"] == ["run_id", "round"]
        assert indexes["ix_timeline_spans_run_id_datacenter_start_s"] == ["run_id", "datacenter", "start_s"]
        checks = {c["name"] for c in insp.get_check_constraints("timeline_spans")}
        assert {"ck_timeline_spans_kind", "ck_timeline_spans_end_after_start"} <= checks

        # the tables themselves refuse an unknown span kind, an unknown bytes source, a second row of a stage
        with RunLog(fresh_url) as log:
            log.start_run(run_id="r", name="r", strategy="pipeline", config={}, rounds_planned=1)
            log.log_timeline_spans(run_id="r", spans=[*microbatch_spans(1)[:2], TimelineSpanRecord(
                round=1, datacenter="us-east", kind="wait", start_s=0.0, end_s=1.0)])
            log.log_pipeline_stage(run_id="r", round=1, record=stage_record(0, 1))
            log.flush(timeout=30)
        def insert(table: str, **changes: Any) -> None:
            """A copy of the table's first row, with `changes`."""
            row = {**(fields(list_timeline_spans(engine, "r")[0]) if table == "timeline_spans"
                      else {"round": 1, **dataclasses.asdict(stage_record(0, 1))}), "run_id": "r", **changes}
            with engine.begin() as conn:
                conn.execute(text(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join(':' + k for k in row)})"), row)

        for table, changes in [("timeline_spans", {"kind": "sleep"}), ("pipeline_stages", {"stage": 0}),
                               ("pipeline_stages", {"stage": 1, "bytes_source": "guess"})]:
            with pytest.raises(IntegrityError):
                insert(table, **changes)
        insert("timeline_spans", kind="backward")
        insert("pipeline_stages", stage=1, bytes_source="stage")

        # the downgrade drops the pipeline's spans with its stages (0009's check refuses their kinds)
        downgrade(fresh_url, "0009")
        insp = inspect(engine)
        assert current_revision(fresh_url) == "0009"
        assert "pipeline_stages" not in insp.get_table_names()
        assert not {"microbatch", "step"} & {c["name"] for c in insp.get_columns("timeline_spans")}
        assert "ix_timeline_spans_run_id_round" not in {ix["name"] for ix in insp.get_indexes("timeline_spans")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT kind FROM timeline_spans")).scalars().all() == ["wait"]
        with pytest.raises(IntegrityError), engine.begin() as conn:  # 0009's check is back
            conn.execute(text("INSERT INTO timeline_spans (run_id, round, datacenter, kind, start_s, end_s) "
                              "VALUES ('r', 1, 'a', 'forward', 0, 1)"))
        upgrade(fresh_url)
        assert {c["name"] for c in inspect(engine).get_columns("pipeline_stages")} == PIPELINE_COLUMNS
    finally:
        engine.dispose()


# ------------------------------------------------------------------ RunLog


def test_records_are_the_columns() -> None:
    assert [f.name for f in dataclasses.fields(PipelineStageRecord)] == [
        "stage", "datacenter", "steps", "microbatches", "compute_s", "wall_s", "bubble_fraction", "bytes_forward",
        "bytes_backward", "bytes_source", "replica", "train_loss"]
    assert PipelineStageRecord.__dataclass_fields__["replica"].default == 0  # one pipeline unless told
    assert [f.name for f in dataclasses.fields(TimelineSpanRecord)][-2:] == ["microbatch", "step"]
    assert SPAN_KINDS == TIMELINE_SPAN_KINDS + MICROBATCH_SPAN_KINDS == ("compute", "wait", "up", "down", "forward", "backward")
    assert PIPELINE_BYTES_SOURCES == ("delay-line", "stage")


@pytest.mark.timeout(60)
def test_stage_rows_and_microbatch_spans_round_trip_replace_and_are_forgotten(migrated_url: str) -> None:
    run_id = "pipeline-" + uuid.uuid4().hex[:8]
    engine = make_engine(migrated_url)
    try:
        with RunLog(migrated_url) as log:
            log.start_run(run_id=run_id, name="pipeline", strategy="pipeline", config={}, rounds_planned=3)
            for r in (1, 2, 3):
                for stage in (0, 1):
                    log.log_pipeline_stage(run_id=run_id, round=r, record=stage_record(stage, r))
                log.log_timeline_spans(run_id=run_id, spans=microbatch_spans(r))
            log.flush(timeout=30)
            rows = list_pipeline_stages(engine, run_id)
            assert [(row["round"], row["stage"]) for row in rows] == [(r, s) for r in (1, 2, 3) for s in (0, 1)]
            assert fields(rows[1]) == {"round": 1, **dataclasses.asdict(stage_record(1, 1))}
            assert rows[1]["bytes_forward"] == 0 and rows[1]["bytes_backward"] == 900 and rows[1]["train_loss"] == 2.0
            assert rows[0]["bytes_backward"] == 0 and rows[0]["train_loss"] is None
            assert [row["stage"] for row in list_pipeline_stages(engine, run_id, round=2)] == [0, 1]
            spans = list_timeline_spans(engine, run_id, round=2)
            assert len(spans) == 16 and {s["kind"] for s in spans} == set(MICROBATCH_SPAN_KINDS)
            assert {(s["step"], s["microbatch"]) for s in spans} == {(3, 0), (3, 1), (4, 0), (4, 1)}
            assert fields(spans[0]) == {"round": 2, "datacenter": "eu-west", "kind": "forward", "start_s": 31.0, "end_s": 31.5,
                                        "fragment": None, "exchange": None, "microbatch": 0, "step": 3}

            # round 2 logged again (a resume): its rows are replaced, not doubled
            log.log_pipeline_stage(run_id=run_id, round=2, record=stage_record(0, 2, bubble_fraction=0.5, bytes_source="stage"))
            log.flush(timeout=30)
            again = list_pipeline_stages(engine, run_id, round=2)
            assert len(again) == 2 and (again[0]["bubble_fraction"], again[0]["bytes_source"]) == (0.5, "stage")

            # resumed from round 1's checkpoint: rounds 2 and 3 go, rows and spans
            log.forget_rounds_after(run_id=run_id, round=1)
            log.flush(timeout=30)
        assert [(row["round"], row["stage"]) for row in list_pipeline_stages(engine, run_id)] == [(1, 0), (1, 1)]
        assert {s["round"] for s in list_timeline_spans(engine, run_id)} == {1}
    finally:
        engine.dispose()


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"bytes_forward": -1}, ValueError, "bytes_forward must be >= 0, got -1"),
    ({"bytes_backward": -5}, ValueError, "bytes_backward must be >= 0"),
    ({"bubble_fraction": 1.5}, ValueError, "bubble_fraction must be <= 1"),
    ({"bubble_fraction": -0.1}, ValueError, "bubble_fraction must be >= 0"),
    ({"compute_s": float("nan")}, ValueError, "compute_s must be a finite number"),
    ({"wall_s": float("inf")}, ValueError, "wall_s must be a finite number"),
    ({"bytes_source": "guess"}, ValueError, "bytes_source must be one of delay-line, stage; got 'guess'"),
    ({"stage": -1}, ValueError, "stage must be >= 0"),
    ({"microbatches": -1}, ValueError, "microbatches must be >= 0"),
    ({"steps": 1.5}, TypeError, "steps must be an integer"),
    ({"datacenter": ""}, ValueError, "datacenter must not be empty"),
    ({"datacenter": None}, TypeError, "datacenter must not be None"),
])
def test_a_bad_stage_record_raises_naming_the_field_and_nothing_is_queued(
        migrated_sqlite_url: str, changes: dict[str, Any], error: type[Exception], message: str) -> None:
    with RunLog(migrated_sqlite_url) as log:
        before = log.stats()["enqueued"]
        with pytest.raises(error, match=message.replace("(", r"\(")):
            log.log_pipeline_stage(run_id="r", round=1, record=stage_record(0, 1, **changes))
        with pytest.raises(ValueError, match="round must be >= 1"):
            log.log_pipeline_stage(run_id="r", round=0, record=stage_record(0, 1))
        with pytest.raises(TypeError, match="record must be a PipelineStageRecord"):
            log.log_pipeline_stage(run_id="r", round=1, record=dataclasses.asdict(stage_record(0, 1)))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'bytes_source'"):
            PipelineStageRecord(stage=0, datacenter="a", steps=1, microbatches=1, compute_s=1.0, wall_s=1.0,
                                bubble_fraction=0.0, bytes_forward=0, bytes_backward=0)
        assert log.stats()["enqueued"] == before


@pytest.mark.parametrize(("span", "message"), [
    (TimelineSpanRecord(round=1, datacenter="a", kind="sideways", start_s=0.0, end_s=1.0, microbatch=0, step=1),
     "spans\\[1\\]: kind must be one of compute, wait, up, down, forward, backward; got 'sideways'"),
    (TimelineSpanRecord(round=1, datacenter="a", kind="forward", start_s=0.0, end_s=1.0, step=1),
     "spans\\[1\\]: a forward span needs its microbatch and step, got microbatch=None, step=1"),
    (TimelineSpanRecord(round=1, datacenter="a", kind="backward", start_s=0.0, end_s=1.0, microbatch=0),
     "spans\\[1\\]: a backward span needs its microbatch and step"),
    (TimelineSpanRecord(round=1, datacenter="a", kind="forward", start_s=0.0, end_s=1.0, microbatch=-1, step=1),
     "spans\\[1\\]: microbatch must be >= 0"),
    (TimelineSpanRecord(round=1, datacenter="a", kind="backward", start_s=0.0, end_s=1.0, microbatch=0, step=0),
     "spans\\[1\\]: step must be >= 1"),
])
def test_a_bad_microbatch_span_raises_and_nothing_of_its_batch_is_queued(migrated_sqlite_url: str, span: Any,
                                                                          message: str) -> None:
    with RunLog(migrated_sqlite_url) as log:
        before = log.stats()["enqueued"]
        with pytest.raises(ValueError, match=message):
            log.log_timeline_spans(run_id="r", spans=[microbatch_spans(1)[0], span])
        assert log.stats()["enqueued"] == before


@pytest.mark.timeout(60)
def test_revision_0011_gives_each_stage_row_its_replica_and_goes_back(fresh_url: str) -> None:
    upgrade(fresh_url, "0010")
    engine = make_engine(fresh_url)
    row = {"run_id": "r", "round": 1, **{k: v for k, v in dataclasses.asdict(stage_record(0, 1)).items()
                                         if k != "replica"}}

    def insert(**changes: Any) -> None:
        values = {**row, **changes}
        with engine.begin() as conn:
            conn.execute(text(f"INSERT INTO pipeline_stages ({', '.join(values)}) VALUES "
                              f"({', '.join(':' + k for k in values)})"), values)

    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name, strategy, status, config, rounds_planned, started_at, "
                              "flower_run_ids, baseline) VALUES ('r', 'r', 'pipeline', 'running', '{}', 1, "
                              "CURRENT_TIMESTAMP, '', 'none')"))
        insert()  # a row written before the revision
        upgrade(fresh_url)
        assert current_revision(fresh_url) == head_revisions()[0]
        insp = inspect(engine)
        assert {c["name"] for c in insp.get_columns("pipeline_stages")} == PIPELINE_COLUMNS
        assert ["run_id", "round", "replica", "stage"] in [u["column_names"]
                                                           for u in insp.get_unique_constraints("pipeline_stages")]
        assert [r["replica"] for r in list_pipeline_stages(engine, "r")] == [0]  # the old row is replica 0's
        insert(replica=1)  # the same round and stage of another replica
        with pytest.raises(IntegrityError):
            insert(replica=1)
        # 0010 keeps one row per round and stage: the downgrade drops the other replicas' rows
        downgrade(fresh_url, "0010")
        assert "replica" not in {c["name"] for c in inspect(engine).get_columns("pipeline_stages")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM pipeline_stages")).scalar() == 1
        upgrade(fresh_url)
        assert current_revision(fresh_url) == head_revisions()[0]
    finally:
        engine.dispose()
