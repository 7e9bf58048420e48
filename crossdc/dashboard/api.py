"""The JSON API of `crossdc serve` (`/api/...`) and Prometheus' `/metrics`: thin adapters over :mod:`.queries`.

Promises, for every route:

* read-only, on SQLite and PostgreSQL; the field names are the run log's column names (crossdc.db.models);
* an unknown run id answers 404 with ``{"detail": "run 'ID' not found"}``; a bad query parameter 422 (FastAPI's
  validation body); a database that does not answer 503 with ``{"detail": "..."}``; never a 500;
* numbers that JSON cannot carry (NaN, ±Inf in a diverged run) are ``null``; times are ISO 8601 UTC;
* a run's series (rounds, per-datacenter rounds, events, async updates) come in pages cut by a cursor on their
  logical order: pass ``since_round`` / ``since_id`` / ``since_seq`` (exclusive: only items *after* it) and
  ``limit``; the answer's ``next_since_*`` is what to pass next, both to read on through a long run and to poll a
  running one for what is new, and ``has_more`` says whether more was already there. A ``Link: <...>;
  rel="next"`` header points at the next page while ``has_more`` is true. A run's timeline is not paged: it
  answers the newest ``limit`` spans, and ``truncated`` says whether older ones were left out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

import pydantic_core
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Connection, Engine, exc

from crossdc.dashboard import prometheus, queries
from crossdc.db.engine import head_revisions, safe_url, unavailable

router = APIRouter()

RunStatus = Literal["running", "finished", "failed", "interrupted"]
_INT32_MAX = 2**31 - 1  # rounds are INTEGER columns
_INT64_MAX = 2**63 - 1  # ids and sequence numbers are BIGINT columns


# ------------------------------------------------------------------ models


class ErrorBody(BaseModel):
    """What a 404 or 503 answers."""

    detail: str


class RunSummary(BaseModel):
    """One run as the runs list shows it."""

    id: str
    name: str
    strategy: str
    status: str = Field(description="Effective status: running, finished, failed or interrupted. A run stored as "
                                    "running whose heartbeat stopped is shown as interrupted (see status_detail).")
    status_detail: str | None = Field(description="Why the status is what it is, when that is worth a line "
                                                   "(a run declared interrupted, a failed run's error).")
    stored_status: str = Field(description="The status as the run log stores it.")
    baseline: str
    started_at: datetime
    finished_at: datetime | None
    last_heartbeat: datetime | None
    rounds_planned: int
    rounds_completed: int = Field(description="Rounds logged so far.")
    last_round: int | None
    slowest_round_wall_s: float | None
    val_round: int | None = Field(description="The latest evaluated round (val_loss and val_accuracy are its values).")
    val_loss: float | None
    val_accuracy: float | None


class RunList(BaseModel):
    """A page of runs, newest first (``offset``/``limit`` pagination; ``total`` matching runs in all)."""

    items: list[RunSummary]
    total: int
    limit: int
    offset: int


class RunDetail(RunSummary):
    """One run with its config, result, error, Flower run ids and byte totals."""

    config: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    flower_run_ids: list[str] = Field(description="Flower's run ids, oldest first, as decimal strings (unsigned 64-bit).")
    bytes_up_total: int
    bytes_down_total: int
    bytes_up_raw_total: int
    datacenters: list[str] = Field(description="The datacenters of the run's config, in config order.")


class RoundRow(BaseModel):
    round: int
    tau: int | None
    val_loss: float | None
    val_accuracy: float | None
    bytes_up: int
    bytes_down: int
    bytes_up_raw: int
    wall_s: float | None
    eval_s: float | None
    consensus_distance: float | None = Field(description="A gossip run: the replicas' mean distance to their average "
                                                         "after the round (null otherwise).")


class RoundsPage(BaseModel):
    """Rounds with ``round > since_round``, by round; pass ``next_since_round`` as ``since_round`` for what follows."""

    run_id: str
    items: list[RoundRow]
    next_since_round: int | None = Field(description="The last item's round (the given since_round when the page "
                                                     "is empty; null: nothing seen yet).")
    has_more: bool = Field(description="More rounds were already logged past this page.")


class DatacenterRoundRow(BaseModel):
    round: int = Field(description="The round (in an async run: the global version the update was applied at).")
    datacenter: str
    status: str = Field(description="ok, failed, timeout or rejected.")
    reason: str | None
    bytes_up: int
    bytes_down: int
    bytes_up_raw: int
    compute_s: float | None
    comm_s: float | None
    overhead_s: float | None
    idle_s: float | None
    round_s: float | None
    comm_source: str | None
    link_bytes_up: int | None
    link_bytes_down: int | None
    train_loss: float | None
    num_examples: int | None
    drift_l2: float | None
    update_cosine: float | None
    staleness: int | None
    consensus_distance: float | None = Field(description="A gossip run: this replica's distance to the replicas' "
                                                         "average after the round (null otherwise).")


class DatacenterRoundsPage(BaseModel):
    """Whole rounds with ``round > since_round`` (``limit`` counts rounds), by round then datacenter.

    While the run is running, a round appears once it is closed (its ``rounds`` row is logged), so polling with
    ``since_round = next_since_round`` never skips a datacenter row that was still being written.
    """

    run_id: str
    datacenter: str | None = Field(description="The datacenter filter, if one was given.")
    items: list[DatacenterRoundRow]
    next_since_round: int | None
    has_more: bool


class EventRow(BaseModel):
    id: int = Field(description="Increases in logging order: the events' cursor.")
    at: datetime
    round: int | None
    kind: str
    datacenter: str | None
    detail: Any = Field(description="A JSON object, or a string for a plain message.")


class EventsPage(BaseModel):
    """Events with ``id > since_id``, in logging order; pass ``next_since_id`` as ``since_id`` for what follows."""

    run_id: str
    items: list[EventRow]
    next_since_id: int | None
    has_more: bool


class AsyncUpdateRow(BaseModel):
    seq: int
    datacenter: str
    base_version: int
    applied_version: int | None
    staleness: int
    scale: float | None
    status: str = Field(description="applied or discarded.")
    bytes_up: int


class AsyncUpdatesPage(BaseModel):
    """Updates with ``seq > since_seq``, by sequence number; pass ``next_since_seq`` as ``since_seq`` for what follows."""

    run_id: str
    items: list[AsyncUpdateRow]
    next_since_seq: int | None
    has_more: bool


class TimelineSpanRow(BaseModel):
    round: int
    datacenter: str
    kind: str = Field(description="compute or wait (what the datacenter's trainer did), up (its update on the way to "
                                  "the coordinator) or down (the coordinator's result on the way to it); in a pipeline "
                                  "run, forward or backward (the stage on that datacenter computing one micro-batch).")
    start_s: float = Field(description="Seconds since the run's start: on the datacenter's clock for compute, wait, "
                                       "forward and backward, on the coordinator's for up and down.")
    end_s: float = Field(description="Seconds since the run's start, on the same clock; never before start_s.")
    fragment: int | None = Field(description="A streaming run's fragment (null otherwise).")
    exchange: int | None = Field(description="A streaming run's exchange (null otherwise).")
    microbatch: int | None = Field(description="A forward or backward span's micro-batch, from 0 (null otherwise).")
    step: int | None = Field(description="A forward or backward span's optimizer step, from 1, counted over the run "
                                         "(null otherwise).")


class TimelinePage(BaseModel):
    """The run's newest timeline spans (at most ``limit``), by datacenter then start."""

    run_id: str
    datacenter: str | None = Field(description="The datacenter filter, if one was given.")
    limit: int
    items: list[TimelineSpanRow]
    truncated: bool = Field(description="Older spans were left out: the run has more than limit of them.")


class LinkRoundRow(BaseModel):
    round: int
    src: str = Field(description="The sending datacenter.")
    dst: str = Field(description="The receiving datacenter.")
    bytes: int = Field(description="Bytes src sent dst in the round's exchange (headers and payload).")
    in_flight_s: float | None = Field(description="Seconds from the pair's meeting to the last byte received.")
    error: str | None = Field(description="Why the exchange failed (null: it worked).")


class LinksPage(BaseModel):
    """A gossip run's datacenter-to-datacenter links, per round and direction."""

    run_id: str
    items: list[LinkRoundRow]


class LinkTotalRow(BaseModel):
    """One pair of datacenters whose link carried gossip exchanges: both directions, over the whole run."""

    a: str = Field(description="The pair's first datacenter (a < b, by name).")
    b: str = Field(description="The pair's second datacenter.")
    bytes: int = Field(description="Bytes both ends sent each other over the run (failed exchanges included).")
    bytes_a_to_b: int = Field(description="Bytes a sent b.")
    bytes_b_to_a: int = Field(description="Bytes b sent a.")
    rounds: int = Field(description="Rounds with an exchange on the pair.")
    failed_rounds: int = Field(description="Of those, the rounds where a direction failed.")
    in_flight_s_median: float | None = Field(description="Median seconds in flight of the transfers that worked "
                                                         "(each direction of each round); null when none did.")
    route: Literal["direct", "coordinator"] | None = Field(
        description="From the run's config: direct (a link of [[links]]) or coordinator (not listed: the exchanges "
                    "cross the coordinator's site on both datacenters' own links); null when the config does not "
                    "name both datacenters.")
    rtt_ms: float | None = Field(description="The emulated round-trip time of the pair's path in the run's config "
                                             "(coordinator: the sum of both datacenters' link RTTs); null when the "
                                             "config gives none.")


class LinkTotals(BaseModel):
    """A gossip run's datacenters and, per pair of them whose link carried exchanges, what it carried over the run."""

    run_id: str
    datacenters: list[str] = Field(description="The run's config's datacenters in config order, then any other "
                                               "that its link rows name, by name.")
    items: list[LinkTotalRow] = Field(description="One per pair with at least one link_rounds row, by (a, b).")


class PipelineStageRow(BaseModel):
    """One stage's part of one round of a pipeline run."""

    round: int
    stage: int = Field(description="The stage, from 0: the run's config's datacenters in order hold stages 0..S-1.")
    datacenter: str = Field(description="The datacenter the stage ran on.")
    steps: int = Field(description="Optimizer steps the stage ran this round.")
    microbatches: int = Field(description="Micro-batches per step.")
    compute_s: float = Field(description="The stage's forward and backward compute over the round, seconds.")
    wall_s: float = Field(description="The round's steps end to end at the stage, seconds.")
    bubble_fraction: float = Field(description="The share of wall_s the stage was not computing (0 to 1).")
    bytes_forward: int = Field(description="Activation bytes that crossed the boundary after the stage, toward "
                                           "stage + 1, this round (0 for the last stage).")
    bytes_backward: int = Field(description="Gradient bytes that crossed the boundary before the stage, back to "
                                            "stage - 1, this round (0 for the first stage).")
    bytes_source: str = Field(description="Who counted the bytes: delay-line (the WAN emulator's link ledger) or "
                                          "stage (the stage itself).")
    train_loss: float | None = Field(description="The last stage's mean micro-batch loss this round (null on the "
                                                 "other stages).")


class PipelineStages(BaseModel):
    """A pipeline run's stages per round, by round then stage."""

    run_id: str
    round: int | None = Field(description="The round filter, if one was given.")
    items: list[PipelineStageRow]


class DatacenterInfo(BaseModel):
    name: str
    region: str | None
    gpus: int | None
    public_key: str | None
    status: str = Field(description="active, suspended or revoked.")
    enrolled_at: datetime
    last_seen: datetime | None
    last_seen_age_s: float | None = Field(description="Seconds since last_seen, at the time of the request.")
    link_bandwidth_mbps: float | None
    link_rtt_ms: float | None
    node_id: str | None = Field(description="The SuperLink's node id of the enrolled key (None: not registered).")


class PluginParameter(BaseModel):
    """A declared parameter of a strategy or codec (crossdc.parameters.Parameter)."""

    type: str
    default: Any
    help: str
    low: float | None
    high: float | None
    choices: list[str] | None


class StrategyInfo(BaseModel):
    """A registered strategy, as `crossdc strategies list --json` prints it."""

    model_config = ConfigDict(populate_by_name=True)

    name: str
    source: str = Field(description="built-in or plug-in.")
    class_: str = Field(alias="class", description="The entry point's target, module:Class.")
    parameters: dict[str, PluginParameter]
    summary: str


class CodecInfo(BaseModel):
    """A registered codec, as `crossdc codecs list --json` prints it."""

    model_config = ConfigDict(populate_by_name=True)

    name: str
    stage: str = Field(description="structure (which values are sent) or values (how each is written).")
    source: str = Field(description="built-in or plug-in.")
    class_: str = Field(alias="class", description="The entry point's target, module:Class.")
    positional: str | None = Field(description="The parameter a bare `name:arg` sets.")
    error_feedback: bool = Field(description="Whether the pipeline keeps a residual for it unless `ef=false`.")
    parameters: dict[str, PluginParameter]
    summary: str


class DatabaseHealth(BaseModel):
    url: str = Field(description="The database URL, password masked.")
    backend: str
    answers: bool
    schema_revision: str | None = Field(description="The Alembic revision the database is at (null: no crossdc schema).")
    schema_head: str | None = Field(description="The revision this code expects.")
    latency_ms: float | None
    error: str | None


class Health(BaseModel):
    """``ok`` when the database answers and holds crossdc's schema, else ``degraded`` (and HTTP 503). With locked
    reads, only a caller with a read or admin token (or dashboard session) gets ``detail`` and ``database``."""

    status: Literal["ok", "degraded"]
    detail: str | None = None
    database: DatabaseHealth | None = None


# ------------------------------------------------------------ dependencies


def _engine(request: Request) -> Engine:
    return request.app.state.engine  # type: ignore[no-any-return]


def connection(request: Request) -> Iterator[Connection]:
    """One connection (and one read transaction) per request."""
    with _engine(request).connect() as conn:
        yield conn


Conn = Annotated[Connection, Depends(connection)]
RunId = Annotated[str, Path(description="The run's id (crossdc's own, e.g. a UUID).")]
Limit = Annotated[int, Query(ge=1, le=queries.MAX_PAGE_SIZE, description=f"Page size (at most {queries.MAX_PAGE_SIZE}).")]
SinceRound = Annotated[int | None, Query(ge=0, le=_INT32_MAX, description="Only rounds after this one (exclusive); "
                                                                          "omit to start at the beginning.")]


def _not_found(run_id: str) -> HTTPException:
    return HTTPException(status_code=404, detail=f"run '{run_id}' not found")


def _require_run(conn: Connection, run_id: str) -> None:
    if not queries.run_exists(conn, run_id):
        raise _not_found(run_id)


def _page_response(request: Request, body: dict[str, Any], page: queries.Page, cursor_param: str) -> Response:
    """A page as JSON, with a ``Link: <...>; rel="next"`` header while more is there.

    The body is serialised straight from the plain dicts (the declared response model stays the OpenAPI
    contract, which the tests check every answer against): validating a few thousand rows again per request
    would cost more than reading them.
    """
    headers = {}
    if page.has_more and page.next_cursor is not None:
        url = request.url.include_query_params(**{cursor_param: page.next_cursor})
        headers["Link"] = f'<{url}>; rel="next"'
    return _json_response(body, headers)


def _json_response(body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    """``body`` (plain dicts) as JSON, NaN and ±Inf as null."""
    return Response(pydantic_core.to_json(body, inf_nan_mode="null"), media_type="application/json", headers=headers)


_404 = {404: {"model": ErrorBody, "description": "No such run."}}
_503 = {503: {"model": ErrorBody, "description": "The database does not answer."}}


# ------------------------------------------------------------------ routes


@router.get("/api/health", response_model=Health, responses={503: {"model": Health, "description": "Degraded."}},
            tags=["service"])
def health(request: Request) -> JSONResponse:
    """Whether the service can read the run log: ``ok``, or ``degraded`` with HTTP 503 and the reason. Open even with
    locked reads, where it tells the reason and the database (its masked URL, errors) only to a reader."""
    from crossdc.dashboard.auth import may_read

    engine = _engine(request)
    database: dict[str, Any] = {"url": safe_url(engine.url), "backend": engine.dialect.name, "answers": False,
                                "schema_revision": None, "schema_head": _schema_head(), "latency_ms": None, "error": None}
    try:
        with engine.connect() as conn:
            database.update(queries.database_health(conn))
    except exc.SQLAlchemyError as err:
        database["error"] = str(unavailable(engine.url, err))
    detail = None
    if not database["answers"]:
        detail = database["error"]
    elif database["schema_revision"] is None:
        detail = "the database has no crossdc schema; run `crossdc db upgrade --db URL` (or a run) first"
    body = Health(status="ok" if detail is None else "degraded", detail=detail, database=DatabaseHealth(**database))
    shown = body.model_dump(mode="json") if may_read(request) else {"status": body.status}
    return JSONResponse(shown, status_code=200 if detail is None else 503)


@functools.lru_cache(maxsize=1)
def _schema_head() -> str | None:
    """The head revision of the migration scripts this code ships (read once)."""
    try:
        heads = head_revisions()
    except Exception:  # noqa: BLE001 - an installed package without migrations/: health still answers
        return None
    return heads[0] if len(heads) == 1 else None


@router.get("/api/runs", response_model=RunList, responses=_503, tags=["runs"])
def list_runs(
    conn: Conn,
    status: Annotated[RunStatus | None, Query(description="Only runs with this effective status.")] = None,
    strategy: Annotated[str | None, Query(max_length=256, description="Only runs of this strategy.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Page size (at most 1000).")] = 50,
    offset: Annotated[int, Query(ge=0, le=_INT32_MAX)] = 0,
) -> dict[str, Any]:
    """Runs, newest first, with their effective status, progress and latest validation values."""
    items, total = queries.list_run_summaries(conn, now=queries.utcnow(), status=status, strategy=strategy,
                                              limit=limit, offset=offset)
    return {"items": items, "total": total, "limit": limit, "offset": offset}


@router.get("/api/runs/{run_id}", response_model=RunDetail, responses={**_404, **_503}, tags=["runs"])
def get_run(run_id: RunId, conn: Conn) -> dict[str, Any]:
    """One run: its summary, config, result, error, Flower run ids and byte totals."""
    detail = queries.run_detail(conn, run_id, now=queries.utcnow())
    if detail is None:
        raise _not_found(run_id)
    return detail


@router.get("/api/runs/{run_id}/rounds", response_model=RoundsPage, responses={**_404, **_503}, tags=["runs"])
def get_rounds(request: Request, run_id: RunId, conn: Conn, since_round: SinceRound = None,
               limit: Limit = 1000) -> Response:
    """The run's rounds after ``since_round`` (exclusive), by round, at most ``limit`` of them."""
    _require_run(conn, run_id)
    page = queries.rounds_page(conn, run_id, since_round=since_round, limit=limit)
    body = {"run_id": run_id, "items": page.items, "next_since_round": page.next_cursor, "has_more": page.has_more}
    return _page_response(request, body, page, "since_round")


@router.get("/api/runs/{run_id}/datacenter-rounds", response_model=DatacenterRoundsPage, responses={**_404, **_503},
            tags=["runs"])
def get_datacenter_rounds(
    request: Request,
    run_id: RunId,
    conn: Conn,
    since_round: SinceRound = None,
    limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE_SIZE,
                                description=f"Rounds per page (at most {queries.MAX_PAGE_SIZE}); each round comes "
                                            f"with all its datacenters' rows.")] = 50,
    datacenter: Annotated[str | None, Query(max_length=256, description="Only this datacenter's rows.")] = None,
) -> Response:
    """Per round and datacenter: status, bytes, time split (compute, comm, overhead), loss, drift, staleness.

    Pages hold whole rounds after ``since_round`` (exclusive); ``limit`` counts rounds, not rows.
    """
    now = queries.utcnow()
    running = queries.run_is_running(conn, run_id, now=now)
    if running is None:
        raise _not_found(run_id)
    closed_through = (queries.last_round(conn, run_id) or 0) if running else None
    page = queries.datacenter_rounds_page(conn, run_id, since_round=since_round, limit=limit, datacenter=datacenter,
                                          closed_through=closed_through)
    body = {"run_id": run_id, "datacenter": datacenter, "items": page.items, "next_since_round": page.next_cursor,
            "has_more": page.has_more}
    return _page_response(request, body, page, "since_round")


@router.get("/api/runs/{run_id}/events", response_model=EventsPage, responses={**_404, **_503}, tags=["runs"])
def get_events(
    request: Request,
    run_id: RunId,
    conn: Conn,
    since_id: Annotated[int | None, Query(ge=0, le=_INT64_MAX, description="Only events after this id (exclusive).")] = None,
    limit: Limit = 1000,
) -> Response:
    """The run's events (drops, rejoins, timeouts, rejections, checkpoints, resumes, ...) in logging order."""
    _require_run(conn, run_id)
    page = queries.events_page(conn, run_id, since_id=since_id, limit=limit)
    body = {"run_id": run_id, "items": page.items, "next_since_id": page.next_cursor, "has_more": page.has_more}
    return _page_response(request, body, page, "since_id")


@router.get("/api/runs/{run_id}/async-updates", response_model=AsyncUpdatesPage, responses={**_404, **_503},
            tags=["runs"])
def get_async_updates(
    request: Request,
    run_id: RunId,
    conn: Conn,
    since_seq: Annotated[int | None, Query(ge=0, le=_INT64_MAX, description="Only updates after this sequence "
                                                                            "number (exclusive).")] = None,
    limit: Limit = 1000,
) -> Response:
    """The updates of an asynchronous run: base and applied version, staleness, scale, status, bytes."""
    _require_run(conn, run_id)
    page = queries.async_updates_page(conn, run_id, since_seq=since_seq, limit=limit)
    body = {"run_id": run_id, "items": page.items, "next_since_seq": page.next_cursor, "has_more": page.has_more}
    return _page_response(request, body, page, "since_seq")


@router.get("/api/runs/{run_id}/timeline", response_model=TimelinePage, responses={**_404, **_503}, tags=["runs"])
def get_timeline(
    run_id: RunId,
    conn: Conn,
    limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE_SIZE,
                                description=f"How many of the newest spans (at most {queries.MAX_PAGE_SIZE}).")] = 1000,
    datacenter: Annotated[str | None, Query(max_length=256, description="Only this datacenter's spans.")] = None,
    round: Annotated[int | None, Query(ge=0, le=_INT32_MAX, description="Only this round's spans.")] = None,  # noqa: A002
) -> Response:
    """Per datacenter, what its trainer did (compute, wait; in a pipeline run, each micro-batch's forward and
    backward) and what was in flight (up, down), in seconds since the run's start: the run's newest ``limit`` spans,
    by datacenter then start."""
    _require_run(conn, run_id)
    items, truncated = queries.timeline_spans(conn, run_id, limit=limit, datacenter=datacenter, round=round)
    return _json_response({"run_id": run_id, "datacenter": datacenter, "limit": limit, "items": items,
                           "truncated": truncated})


@router.get("/api/runs/{run_id}/links", response_model=LinksPage, responses={**_404, **_503}, tags=["runs"])
def get_links(run_id: RunId, conn: Conn) -> Response:
    """What each datacenter-to-datacenter link carried per round of a gossip run (empty for other runs)."""
    _require_run(conn, run_id)
    return _json_response({"run_id": run_id, "items": queries.link_rounds(conn, run_id)})


@router.get("/api/runs/{run_id}/link-totals", response_model=LinkTotals, responses={**_404, **_503}, tags=["runs"])
def get_link_totals(run_id: RunId, conn: Conn) -> Response:
    """Per pair of datacenters, what their link carried over a gossip run (both directions, failed rounds, median
    seconds in flight) and the route and RTT the run's config gives it; the dashboard's topology view draws these.
    Empty for other runs."""
    _require_run(conn, run_id)
    return _json_response({"run_id": run_id, **queries.link_totals(conn, run_id)})


@router.get("/api/runs/{run_id}/pipeline-stages", response_model=PipelineStages, responses={**_404, **_503},
            tags=["runs"])
def get_pipeline_stages(
    run_id: RunId,
    conn: Conn,
    round: Annotated[int | None, Query(ge=1, le=_INT32_MAX, description="Only this round's stages.")] = None,  # noqa: A002
) -> Response:
    """Per round and stage of a pipeline run: the stage's datacenter, steps and micro-batches, its compute and wall
    seconds and bubble fraction, the bytes across its boundaries (forward: after it; backward: before it) and the
    last stage's training loss; by round then stage (empty for other runs)."""
    _require_run(conn, run_id)
    return _json_response({"run_id": run_id, "round": round, "items": queries.pipeline_stages(conn, run_id, round=round)})


@router.get("/api/datacenters", response_model=list[DatacenterInfo], responses=_503, tags=["datacenters"])
def list_datacenters(conn: Conn) -> list[dict[str, Any]]:
    """Enrolled datacenters, by name, with how long ago each was last heard from."""
    return queries.datacenters(conn, now=queries.utcnow())


@router.get("/api/strategies", response_model=list[StrategyInfo], responses=_503, tags=["registry"])
def list_strategies() -> list[dict[str, object]]:
    """Registered strategies (built-in and plug-in) with their parameters."""
    from crossdc.strategies.base import StrategyError
    from crossdc.strategies.registry import describe_strategies

    try:
        return describe_strategies()
    except StrategyError as err:
        raise HTTPException(status_code=503, detail=str(err)) from err


@router.get("/api/codecs", response_model=list[CodecInfo], responses=_503, tags=["registry"])
def list_codecs() -> list[dict[str, Any]]:
    """Registered update codecs (built-in and plug-in) with their parameters, as `crossdc codecs list --json`."""
    from crossdc.compression.base import CodecConfigError, describe_codecs

    try:
        return describe_codecs()
    except CodecConfigError as err:
        raise HTTPException(status_code=503, detail=str(err)) from err


@router.get("/metrics", response_class=Response, tags=["service"],
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format 0.0.4."}})
def metrics(request: Request) -> Response:
    """Prometheus metrics: per run (rounds, bytes), per datacenter (comm/comp of the latest rounds, last seen).

    Always 200: when the database does not answer, ``crossdc_database_up`` is 0 and nothing else is reported.
    """
    try:
        with _engine(request).connect() as conn:
            snapshot: queries.MetricsSnapshot | None = queries.metrics_snapshot(conn, now=queries.utcnow())
    except exc.SQLAlchemyError:
        snapshot = None
    return Response(prometheus.exposition(snapshot), media_type=prometheus.CONTENT_TYPE)


# ------------------------------------------------------------------ errors


def install_error_handlers(app: FastAPI) -> None:
    """A database that fails mid-request answers 503 with a one-line JSON ``detail`` (password masked), not 500."""

    async def database_error(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(unavailable(_engine(request).url, error))}, status_code=503)

    app.add_exception_handler(exc.SQLAlchemyError, database_error)


__all__ = ["install_error_handlers", "router"]
