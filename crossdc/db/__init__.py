"""SQL storage of crossdc: models (the schema), engines and migrations, the run log, read helpers.

The schema is crossdc.db.models (its columns are the API's field names). The Alembic history lives in ``migrations/`` at the repo top.
"""

from crossdc.db.engine import (
    DEFAULT_DATABASE_URL,
    current_revision,
    head_revisions,
    make_engine,
    resolve_database_url,
    upgrade,
)
from crossdc.db.errors import DatabaseError, DatabaseUnavailable, InvalidDatabaseUrl, MigrationsNotFound
from crossdc.db.runlog import RunLog

__all__ = [
    "DEFAULT_DATABASE_URL",
    "DatabaseError",
    "DatabaseUnavailable",
    "InvalidDatabaseUrl",
    "MigrationsNotFound",
    "RunLog",
    "current_revision",
    "head_revisions",
    "make_engine",
    "resolve_database_url",
    "upgrade",
]
