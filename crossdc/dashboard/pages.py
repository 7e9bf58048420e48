"""The dashboard's HTML pages: server-rendered (Jinja2) with plotly charts, plotly.js served locally.

Routes (all read-only, none in the OpenAPI schema):

* ``/``: the runs, newest first, with status and headline numbers; pick runs to compare.
* ``/runs/{run_id}``: one run's charts and tables (the staleness charts only for a run with
  staleness, i.e. an asynchronous one; the timeline only for a run with timeline spans; the
  gossip views, topology and consensus curve, only for a gossip run: see :func:`gossip_views`; the
  pipeline views, per-stage micro-batch timeline of one round, its stages' table and the bubble per
  round, only for a pipeline run: see :func:`crossdc.dashboard.page_data.load_pipeline_view`, with
  ``?round=N`` picking the round, the latest by default); 404 page for an unknown id. While the run
  is running the page polls ``/runs/{run_id}/live.json`` every ~2 s and redraws itself
  (``Plotly.react``) when the run's version marker changed; it stops when the run stops.
* ``/runs/{run_id}/live.json``: ``{"version", "changed", "running", "status"}``, plus
  ``figures`` (div id → plotly JSON) and ``fragments`` (element id → HTML) when the
  version differs from the ``version`` query parameter (``round``: as the run page's).
* ``/compare?runs=ID,ID,...``: two or more runs overlaid; 400 page for a bad list, 404 for
  an unknown id.
* ``/datacenters``: enrolled datacenters, status and last seen.
* ``/static/plotly.min.js``: the plotly.js bundled with the ``plotly`` Python package (no CDN).

The figures come from :mod:`crossdc.dashboard.figures`, the data from
:mod:`crossdc.dashboard.page_data`; this module only wires them to HTTP. A built run page
(data + figures' JSON) is kept in a small in-process cache keyed by the run's version
marker, so reloads, several viewers and polls of an unchanged run cost one cheap query.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import plotly
import plotly.graph_objects as go
from cachetools import LRUCache
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from crossdc.dashboard import figures
from crossdc.dashboard.figures import FIGURE_IDS, figure_json
from crossdc.dashboard.page_data import (
    EVENTS_WITH_DETAIL,
    MAX_TIMELINE_SPANS,
    AggregateCache,
    PipelineView,
    RunPageData,
    compare_data,
    datacenter_list,
    load_run_page,
    run_list,
    run_version,
)
from crossdc.dashboard.queries import has_gossip_rows, utcnow
from crossdc.db.engine import safe_url

TEMPLATES_DIR = Path(__file__).parent / "templates"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
#: How often a run page asks for news while its run is running (milliseconds).
POLL_INTERVAL_MS = 2000
#: The most runs one compare page overlays.
MAX_COMPARED_RUNS = 12
#: The strategy whose runs get the gossip views even before they logged anything (decentralized gossip).
GOSSIP_STRATEGY = "gossip"
#: How many rounds the gossip views ask the API for per page (rounds, and per-datacenter rounds: every datacenter's
#: row of each round).
GOSSIP_PAGE_ROUNDS = 1000

router = APIRouter(include_in_schema=False)


# ------------------------------------------------------------ formatting


def human_bytes(value: Any) -> str:
    """``1234567`` → ``"1.23 MB"`` (decimal units); missing → ``"–"``."""
    number = figures.finite(value)
    if number is None:
        return "–"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(number) < 1000 or unit == "TB":
            return f"{number:.0f} {unit}" if unit == "B" else f"{number:.3g} {unit}"
        number /= 1000
    return f"{number:.3g} PB"  # pragma: no cover - unreachable


def number(value: Any, digits: int = 4) -> str:
    """A number with ``digits`` significant digits; missing (None, NaN) → ``"–"``."""
    x = figures.finite(value)
    if x is None:
        return "–"
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:.{digits}g}"


def seconds(value: Any) -> str:
    """A duration: ``0.0123`` → ``"12.3 ms"``, ``75`` → ``"1m 15s"``; missing → ``"not measured"``."""
    x = figures.finite(value)
    if x is None:
        return "not measured"
    if x < 1:
        return f"{x * 1000:.3g} ms"
    if x < 60:
        return f"{x:.3g} s"
    minutes, secs = divmod(int(round(x)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def utc(value: Any) -> str:
    """A datetime as ``"2026-01-31 12:00:05 UTC"``; missing → ``"–"``."""
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if isinstance(value, datetime) else "–"


def age(value: Any) -> str:
    """Seconds ago as ``"12 s ago"``, ``"5 min ago"``, ``"3 h ago"``, ``"2 d ago"``; missing → ``"never"``."""
    x = figures.finite(value)
    if x is None:
        return "never"
    if x < 60:
        return f"{x:.0f} s ago"
    if x < 3600:
        return f"{x / 60:.0f} min ago"
    if x < 86400:
        return f"{x / 3600:.1f} h ago"
    return f"{x / 86400:.1f} d ago"


def percent(value: Any) -> str:
    """A fraction as a percentage: ``0.125`` → ``"12.5 %"``; missing → ``"–"``."""
    x = figures.finite(value)
    return "–" if x is None else f"{100 * x:.3g} %"


def detail_text(value: Any) -> str:
    """An event's ``detail`` (a JSON object or string) as one short line."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


templates = Jinja2Templates(directory=TEMPLATES_DIR)
_FILTERS: dict[str, Callable[..., str]] = {
    "bytes": human_bytes, "num": number, "seconds": seconds, "utc": utc, "age": age, "detail": detail_text,
    "percent": percent,
}
templates.env.filters.update(_FILTERS)
templates.env.globals.update(plotly_version=plotly.__version__, figure_ids=FIGURE_IDS)


def script_json(text: str) -> str:
    """JSON text made safe inside ``<script type="application/json">`` (no ``</script>`` can end it early)."""
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def figures_payload(figs: dict[str, go.Figure]) -> str:
    """``{div id: plotly JSON}`` as one JSON text (the figures are serialised once, by plotly)."""
    return "{" + ",".join(f"{json.dumps(k)}:{figure_json(f)}" for k, f in figs.items()) + "}"


# --------------------------------------------------------------- plumbing


@contextmanager
def _connection(request: Request) -> Iterator[Connection]:
    engine: Engine = request.app.state.engine
    with engine.connect() as conn:
        yield conn


def _error_page(request: Request, status_code: int, title: str, message: str) -> HTMLResponse:
    return templates.TemplateResponse(
        request, "error.html", {"title": title, "message": message, "status_code": status_code},
        status_code=status_code,
    )


def _unavailable(request: Request, error: SQLAlchemyError) -> HTMLResponse:
    engine: Engine = request.app.state.engine
    first_line = " ".join(str(getattr(error, "orig", None) or error).split())[:300]
    return _error_page(request, 503, "Database unavailable",
                       f"Cannot read the run log at {safe_url(engine.url)}: {first_line}")


# ------------------------------------------------------------------ routes


@router.get("/static/plotly.min.js")
def plotly_js() -> FileResponse:
    """plotly.js as shipped inside the installed ``plotly`` package (so no CDN is needed)."""
    return FileResponse(PLOTLY_JS, media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request) -> HTMLResponse:
    """All runs, newest first, with headline numbers and a form to compare some of them."""
    try:
        with _connection(request) as conn:
            runs = run_list(conn, utcnow())
    except SQLAlchemyError as e:
        return _unavailable(request, e)
    return templates.TemplateResponse(request, "runs.html", {"runs": runs, "title": "Runs"})


def run_figures(data: RunPageData) -> dict[str, go.Figure]:
    """The run page's figures by div id (the staleness charts only for a run that has staleness, the timeline only
    for a run that has spans)."""
    rounds, run = data.rounds, data.run
    figs = {
        FIGURE_IDS["loss_vs_round"]: figures.loss_vs_round(rounds, data.events),
        FIGURE_IDS["loss_vs_bytes"]: figures.loss_vs_bytes(rounds),
        FIGURE_IDS["loss_vs_wall_time"]: figures.loss_vs_wall_time(rounds),
        FIGURE_IDS["bytes_per_round"]: figures.bytes_per_round(
            rounds, compression=figures.has_compression(run.get("config"))),
        FIGURE_IDS["time_breakdown"]: figures.time_breakdown(data.dc_summary),
        FIGURE_IDS["comm_comp_ratio"]: figures.comm_comp_ratio(data.dc_summary),
        FIGURE_IDS["exposed_comm_comp_ratio"]: figures.exposed_comm_comp_ratio(data.dc_summary),
        FIGURE_IDS["drift_per_datacenter"]: figures.drift_per_datacenter(data.dc_sample),
        FIGURE_IDS["tau_schedule"]: figures.tau_schedule(rounds),
    }
    if data.has_staleness:
        figs[FIGURE_IDS["staleness_histogram"]] = figures.staleness_histogram(data.staleness_counts)
        figs[FIGURE_IDS["staleness_over_time"]] = figures.staleness_over_time(data.staleness_series)
    if data.timeline:
        figs[FIGURE_IDS["timeline"]] = figures.timeline(data.timeline, max_spans=MAX_TIMELINE_SPANS)
    if data.pipeline is not None:
        figs.update(pipeline_figures(data.pipeline))
    return figs


def pipeline_figures(view: PipelineView) -> dict[str, go.Figure]:
    """A pipeline run's figures by div id: the shown round's micro-batches per stage, and the bubble per round."""
    return {
        FIGURE_IDS["pipeline_timeline"]: figures.pipeline_timeline(view.spans, view.lanes, round_=view.round,
                                                                    max_spans=MAX_TIMELINE_SPANS),
        FIGURE_IDS["pipeline_bubble"]: figures.pipeline_bubble(view.series),
    }


#: The run page's parts that live updates replace: element id → template.
RUN_FRAGMENTS: dict[str, str] = {
    "run-headline": "_run_headline.html",
    "dc-table": "_dc_table.html",
    "events-table": "_events_table.html",
    "timeline-note": "_timeline_note.html",
    "pipeline-stages": "_pipeline_stages.html",
}
#: The events table shows at most this many of the latest events (those with timestamp and detail).
EVENTS_IN_TABLE = EVENTS_WITH_DETAIL


#: A built run page's key: (engine, run id, version marker, pipeline round asked for).
_PageKey = tuple[int, str, str, int | None]


class _RunPageCache:
    """The last few run pages built, by (engine, run id, version marker, pipeline round asked for): a reload, a
    second viewer or a poll that finds nothing new reuses them instead of re-reading a long run. Thread-safe."""

    def __init__(self, size: int = 8) -> None:
        self._items: LRUCache[_PageKey, tuple[RunPageData, str]] = LRUCache(maxsize=size)
        self._lock = threading.Lock()

    def get(self, key: _PageKey) -> tuple[RunPageData, str] | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: _PageKey, value: tuple[RunPageData, str]) -> None:
        with self._lock:
            self._items[key] = value


_run_cache = _RunPageCache()
_aggregate_cache = AggregateCache()


def _load_run(request: Request, conn: Connection, run_id: str,
              pipeline_round: int | None = None) -> tuple[RunPageData, str] | None:
    """The run page's data and its figures' JSON (from the cache when the run has not changed), a pipeline run's
    views at ``pipeline_round`` (``None``: the latest)."""
    now = utcnow()
    current = run_version(conn, run_id, now)
    if current is None:
        return None
    key = (id(request.app.state.engine), run_id, current[0], pipeline_round)
    cached = _run_cache.get(key)
    if cached is not None:
        return cached
    data = load_run_page(conn, run_id, now, cache=_aggregate_cache, cache_key=key[0], pipeline_round=pipeline_round)
    if data is None:
        return None
    built = (data, figures_payload(run_figures(data)))
    _run_cache.put((key[0], run_id, data.version, pipeline_round), built)
    return built


#: The ``round`` query parameter of a run page (and its live.json): a pipeline run's round to show.
RoundParam = Annotated[str | None, Query(alias="round")]


def parse_round(text: str | None) -> int | None:
    """``?round=N`` as a round (a whole number from 0 that a round column holds), or ``None`` (the latest) for
    anything else: a page never fails on it."""
    if text is None or not re.fullmatch(r"[0-9]{1,10}", text.strip()):
        return None
    value = int(text.strip())
    return value if value < 2**31 else None


def _run_context(data: RunPageData) -> dict[str, Any]:
    events = data.events[-EVENTS_IN_TABLE:][::-1]
    return {
        "run": data.run, "totals": data.totals, "dc_summary": data.dc_summary, "dc_stride": data.dc_stride,
        "events": events, "events_total": data.events_total, "async_total": data.async_total,
        "has_staleness": data.has_staleness, "timeline_shown": len(data.timeline), "timeline_total": data.timeline_total,
        "alert": figures.COMM_COMP_ALERT, "compression": figures.has_compression(data.run.get("config")),
        "pipeline": data.pipeline,
    }


def gossip_views(request: Request, conn: Connection, run: dict[str, Any]) -> dict[str, Any] | None:
    """What the run page's gossip views (topology, consensus curve) need, or ``None`` for a run that gets none.

    A run gets them when its strategy is gossip (from its start, so that a live run fills them in as its rounds come)
    or when it logged what a gossip run logs (link rows, consensus distances). The page's script reads the data from
    the JSON API at the URLs given here and draws the views itself (``dashboard.js``), with at most ``max_points``
    points per curve, like the server-drawn figures.
    """
    if run["strategy"] != GOSSIP_STRATEGY and not has_gossip_rows(conn, run["id"]):
        return None
    return {
        "link_totals_url": request.url_for("get_link_totals", run_id=run["id"]).path,
        "rounds_url": request.url_for("get_rounds", run_id=run["id"]).path,
        "datacenter_rounds_url": request.url_for("get_datacenter_rounds", run_id=run["id"]).path,
        "page_size": GOSSIP_PAGE_ROUNDS,
        "max_points": figures.MAX_POINTS,
    }


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str, pipeline_round: RoundParam = None) -> HTMLResponse:
    """One run: its charts, its per-datacenter table and its events, a gossip run's topology and consensus curve, a
    pipeline run's per-stage views of the round ``?round=`` picks (the latest by default); live while it runs."""
    gossip = None
    shown_round = parse_round(pipeline_round)
    try:
        with _connection(request) as conn:
            loaded = _load_run(request, conn, run_id, shown_round)
            if loaded is not None:
                gossip = gossip_views(request, conn, loaded[0].run)
    except SQLAlchemyError as e:
        return _unavailable(request, e)
    if loaded is None:
        return _error_page(request, 404, "Run not found", f"There is no run with id {run_id!r}.")
    data, figures_text = loaded
    live_url = request.url_for("run_live", run_id=run_id).path + (f"?round={shown_round}" if shown_round is not None else "")
    live = {"url": live_url, "version": data.version, "running": data.run["running"], "interval_ms": POLL_INTERVAL_MS}
    context = _run_context(data)
    context.update(
        title=f"Run {data.run['name']}",
        figures_json=script_json(figures_text),
        live_json=script_json(json.dumps(live)),
        gossip_json=script_json(json.dumps(gossip)) if gossip is not None else None,
    )
    return templates.TemplateResponse(request, "run.html", context)


@router.get("/runs/{run_id}/live.json", name="run_live")
def run_live(request: Request, run_id: str, version: str | None = None, pipeline_round: RoundParam = None) -> Response:
    """The run's version marker; with the figures and page fragments when it differs from ``version`` (a pipeline
    run's views at ``?round=``, as on the run page)."""
    try:
        with _connection(request) as conn:
            now = utcnow()
            current = run_version(conn, run_id, now)
            if current is None:
                return Response(json.dumps({"detail": f"no run with id {run_id!r}"}), status_code=404,
                                media_type="application/json")
            marker, running = current
            head = {"version": marker, "running": running}
            if marker == version:
                return Response(json.dumps({**head, "changed": False}), media_type="application/json",
                                headers={"Cache-Control": "no-store"})
            loaded = _load_run(request, conn, run_id, parse_round(pipeline_round))
    except SQLAlchemyError as e:
        return Response(json.dumps({"detail": f"database unavailable: {type(e).__name__}"}), status_code=503,
                        media_type="application/json")
    if loaded is None:  # deleted between the two reads
        return Response(json.dumps({"detail": f"no run with id {run_id!r}"}), status_code=404,
                        media_type="application/json")
    data, figures_text = loaded
    context = _run_context(data)
    fragments = {element: templates.env.get_template(name).render(context) for element, name in RUN_FRAGMENTS.items()}
    body = (
        "{" + f'"version":{json.dumps(data.version)},"running":{json.dumps(data.run["running"])},'
        f'"status":{json.dumps(data.run["status"])},"changed":true,'
        f'"fragments":{json.dumps(fragments)},"figures":{figures_text}' + "}"
    )
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


def parse_run_ids(values: list[str] | None) -> list[str]:
    """Run ids from ``?runs=A,B`` and/or ``?runs=A&runs=B``: split on commas, stripped, duplicates dropped."""
    ids: list[str] = []
    for value in values or []:
        for part in value.split(","):
            part = part.strip()
            if part and part not in ids:
                ids.append(part)
    return ids


def _gap(value: float | None, reference: float | None) -> float | None:
    """The relative gap (value − reference) / reference (docs/glossary.md, "gap to a baseline")."""
    ref = figures.finite(reference)
    if value is None or not ref:  # no reference, or 0
        return None
    return (value - ref) / ref


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, runs: list[str] | None = Query(default=None)) -> HTMLResponse:
    """Two or more runs overlaid, on rounds and on cumulative bytes; the first run is the reference."""
    ids = parse_run_ids(runs)
    example = "/compare?runs=RUN_ID_1,RUN_ID_2"
    if len(ids) < 2:
        got = "none" if not ids else f"only {ids[0]!r}"
        return _error_page(request, 400, "Bad compare list",
                           f"Compare needs at least two different run ids, e.g. {example} (got {got}).")
    if len(ids) > MAX_COMPARED_RUNS:
        return _error_page(request, 400, "Bad compare list",
                           f"Compare overlays at most {MAX_COMPARED_RUNS} runs (got {len(ids)}).")
    try:
        with _connection(request) as conn:
            found, missing = compare_data(conn, ids, utcnow())
    except SQLAlchemyError as e:
        return _unavailable(request, e)
    if missing:
        names = ", ".join(repr(m) for m in missing)
        return _error_page(request, 404, "Run not found", f"There is no run with id {names}.")
    series: dict[str, list[dict[str, Any]]] = {}
    for run in found:
        run["label"] = f"{run['name']} · {run['strategy']} · {run['id'][:8]}"
        series[run["label"]] = run["rounds"]
        latest = next((r for r in reversed(run["rounds"]) if figures.finite(r["val_loss"]) is not None), None)
        run["final_loss"] = figures.finite(latest["val_loss"]) if latest else None
        run["final_accuracy"] = figures.finite(latest["val_accuracy"]) if latest else None
        run["bytes_total"] = sum(int(r["bytes_up"] or 0) + int(r["bytes_down"] or 0) for r in run["rounds"])
        run["wall_total"] = sum(figures.finite(r["wall_s"]) or 0.0 for r in run["rounds"])
    reference = found[0]
    for run in found:
        run["loss_gap"] = _gap(run["final_loss"], reference["final_loss"])
        both = run["final_accuracy"] is not None and reference["final_accuracy"] is not None
        run["accuracy_diff_points"] = 100 * (run["final_accuracy"] - reference["final_accuracy"]) if both else None
    figs = {
        FIGURE_IDS["compare_round"]: figures.compare_runs(series, x="round"),
        FIGURE_IDS["compare_bytes"]: figures.compare_runs(series, x="bytes"),
    }
    if any(figures.finite(r["val_accuracy"]) is not None for run in found for r in run["rounds"]):
        figs[FIGURE_IDS["compare_accuracy"]] = figures.compare_runs(series, x="round", metric="val_accuracy")
    return templates.TemplateResponse(request, "compare.html", {
        "title": "Compare runs", "runs": found, "reference": reference, "figure_divs": list(figs),
        "figures_json": script_json(figures_payload(figs)),
    })


@router.get("/datacenters", response_class=HTMLResponse)
def datacenters_page(request: Request) -> HTMLResponse:
    """Enrolled datacenters: region, GPUs, link, status and when each was last seen."""
    try:
        with _connection(request) as conn:
            rows = datacenter_list(conn, utcnow())
    except SQLAlchemyError as e:
        return _unavailable(request, e)
    return templates.TemplateResponse(request, "datacenters.html", {"title": "Datacenters", "datacenters": rows})


__all__ = ["router", "run_figures", "pipeline_figures", "parse_round", "parse_run_ids", "human_bytes", "number",
           "percent", "seconds", "utc", "age"]
