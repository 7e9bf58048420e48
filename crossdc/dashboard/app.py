"""The FastAPI app of `crossdc serve`: the JSON API (`/api/...`, `/metrics`) and the dashboard pages.

`create_app(db_url)` promises an app that reads (never writes) the SQL run log at `db_url`
(SQLite or PostgreSQL), serves its OpenAPI schema at `/docs` and `/openapi.json`, answers
unknown ids with 404 and bad query parameters with 422, both as JSON.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from sqlalchemy import Engine

from crossdc.db.engine import make_engine, resolve_database_url

STATIC_DIR = Path(__file__).parent / "static"


def create_app(db_url: str | None = None, *, engine: Engine | None = None) -> FastAPI:
    """The API + dashboard app over the run log at `db_url` (resolved as the CLI does), or over `engine`."""
    from crossdc.dashboard import api, pages

    app = FastAPI(title="crossdc", description="Runs, rounds and datacenters of crossdc's SQL run log.", version="1")
    app.state.engine = engine if engine is not None else make_engine(resolve_database_url(db_url))
    app.include_router(api.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
