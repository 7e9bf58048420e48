"""The FastAPI app of `crossdc serve`: the JSON API (`/api/...`, `/metrics`) and the dashboard pages.

`create_app(db_url)` promises an app that reads the SQL run log at `db_url` (SQLite or PostgreSQL)
and writes only what its authenticated write endpoints own (enrollment, the audit log, submitted and stopped runs;
see :mod:`crossdc.dashboard.enrollment` and :mod:`crossdc.dashboard.run_control`), serves its OpenAPI schema at
`/openapi.json` and an interactive reference at `/docs` (Swagger UI served from this machine: no CDN is needed), answers unknown ids of the
API with 404 and bad query parameters with 422, both as JSON (the HTML pages answer with HTML
error pages).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import swagger_ui_bundle
from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import Engine

from crossdc.db.engine import make_engine, resolve_database_url
from crossdc.deployment.superlink_control import SuperLinkControl

if TYPE_CHECKING:  # (importing it would load torch and Flower into every service)
    from crossdc.orchestration.submission import StandingFederation

STATIC_DIR = Path(__file__).parent / "static"


def create_app(db_url: str | None = None, *, engine: Engine | None = None, lock_reads: bool = False,
               superlink_control: SuperLinkControl | None = None,
               standing_federation: StandingFederation | None = None) -> FastAPI:
    """The API + dashboard app over the run log at `db_url` (resolved as the CLI does), or over `engine`.

    `lock_reads`: every read (API, /metrics, pages) needs a read or admin token too: a bearer token, or for the
    pages and the API the session cookie of a login at ``/login`` (see :mod:`crossdc.dashboard.auth`);
    ``/api/health`` stays open, and says only ``ok`` or ``degraded`` to others. `superlink_control`: the SuperLink that
    enrollments register keys with (without it, enrollment answers 503). `standing_federation`: where
    ``POST /api/runs`` submits runs (without it, submission answers 503).
    """
    from crossdc.dashboard import api, auth, enrollment, pages, run_control

    app = FastAPI(title="crossdc", description="Runs, rounds and datacenters of crossdc's SQL run log.", version="1",
                  docs_url=None, redoc_url=None)
    app.state.engine = engine if engine is not None else make_engine(resolve_database_url(db_url))
    app.state.lock_reads = lock_reads
    app.state.superlink_control = superlink_control
    app.state.standing_federation = standing_federation
    api.install_error_handlers(app)
    app.include_router(api.router, dependencies=[Depends(auth.read_access)])
    app.include_router(enrollment.router)
    app.include_router(run_control.router)
    app.include_router(pages.router, dependencies=[Depends(auth.page_access)])
    auth.install(app)
    app.mount("/static/swagger-ui", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-ui")
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="crossdc API",
                                   swagger_js_url="/static/swagger-ui/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger-ui/swagger-ui.css",
                                   swagger_favicon_url="/static/swagger-ui/favicon-32x32.png")

    return app
