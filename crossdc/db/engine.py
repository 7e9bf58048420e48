"""Database URL resolution, engines and Alembic migrations.

URL order (the same for every command): ``--db``, else ``CROSSDC_DATABASE_URL``,
else ``sqlite:///crossdc.db`` (relative to the working directory).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import URL, make_url

from crossdc.db.errors import DatabaseUnavailable, InvalidDatabaseUrl, MigrationsNotFound

DEFAULT_DATABASE_URL = "sqlite:///crossdc.db"
DATABASE_URL_ENV = "CROSSDC_DATABASE_URL"

#: SQLite waits this long for a lock held by another connection/process.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: libpq connection options applied to PostgreSQL unless the URL sets them.
PG_CONNECT_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def resolve_database_url(cli_value: str | None) -> str:
    """``--db`` value if given, else ``$CROSSDC_DATABASE_URL``, else the SQLite default."""
    if cli_value is not None and cli_value.strip():
        return cli_value.strip()
    env = os.environ.get(DATABASE_URL_ENV, "").strip()
    if env:
        return env
    return DEFAULT_DATABASE_URL


def absolute_database_url(url: str) -> str:
    """The same URL, with a relative SQLite file made absolute (so another process in another folder opens the same file)."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:" or os.path.isabs(parsed.database):
        return url
    return parsed.set(database=os.path.abspath(parsed.database)).render_as_string(hide_password=False)


def parse_url(url: str | URL) -> URL:
    """Parse ``url``; a plain ``postgresql://`` / ``postgres://`` URL gets the psycopg 3 driver."""
    if isinstance(url, URL):
        parsed = url
    else:
        try:
            parsed = make_url(url)
        except (exc.ArgumentError, ValueError) as e:
            raise InvalidDatabaseUrl(
                f"invalid database URL {url!r}: expected e.g. sqlite:///crossdc.db or "
                f"postgresql://user@host:5432/dbname"
            ) from e
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def safe_url(url: str | URL) -> str:
    """The URL with its password masked, for messages and logs."""
    try:
        return parse_url(url).render_as_string(hide_password=True)
    except InvalidDatabaseUrl:
        return "<invalid database URL>"


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys = ON")
        # WAL: readers (the dashboard, another process) never block the writer and vice versa.
        # In-memory databases answer "memory"; that is fine.
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
    finally:
        cur.close()


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An engine for ``url``.

    SQLite: WAL, foreign keys and a busy timeout on every connection.
    PostgreSQL: psycopg 3 (``postgresql://`` is rewritten to ``postgresql+psycopg://``),
    a connect timeout, pre-ping so a connection broken by an outage is replaced.
    Extra ``kwargs`` go to :func:`sqlalchemy.create_engine`.
    """
    parsed = parse_url(url)
    backend = parsed.get_backend_name()
    kwargs.setdefault("pool_pre_ping", True)
    if backend == "postgresql" and parsed.get_driver_name() == "psycopg":
        # Fail fast instead of hanging when the server or the path to it goes away without
        # a reset (a dropped link): a connect timeout, TCP keepalives, and a bound on how
        # long sent data may stay unacknowledged. Options given in the URL win.
        connect_args = dict(kwargs.pop("connect_args", {}))
        for key, value in PG_CONNECT_DEFAULTS.items():
            if key not in parsed.query:
                connect_args.setdefault(key, value)
        kwargs["connect_args"] = connect_args
    try:
        engine = create_engine(parsed, **kwargs)
    except (exc.ArgumentError, exc.NoSuchModuleError, ImportError) as e:
        raise InvalidDatabaseUrl(
            f"cannot use database URL {safe_url(parsed)}: {_one_line(e)}"
        ) from e
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_on_connect)
    return engine


def check_connection(engine: Engine) -> None:
    """Open one connection; raise :class:`DatabaseUnavailable` with a one-line message if it fails."""
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except exc.SQLAlchemyError as e:
        raise unavailable(engine.url, e) from e


def unavailable(url: str | URL, error: BaseException) -> DatabaseUnavailable:
    """A :class:`DatabaseUnavailable` for ``error`` raised while talking to ``url``."""
    return DatabaseUnavailable(f"database {safe_url(url)} is unavailable: {_one_line(error)}")


def _one_line(error: BaseException) -> str:
    if isinstance(error, exc.DBAPIError) and error.orig is not None:
        error = error.orig
    text = " ".join(str(error).split()) or type(error).__name__
    # SQLAlchemy appends "(Background on this error at: https://sqlalche.me/...)".
    cut = text.find("(Background on this error")
    if cut > 0:
        text = text[:cut].strip()
    return text[:500]


# ---------------------------------------------------------------- migrations


def repo_root() -> Path:
    """The directory holding ``alembic.ini`` and ``migrations/`` (the checkout of an editable install)."""
    import crossdc

    return Path(crossdc.__file__).resolve().parents[1]


def alembic_config(url: str | URL | None = None) -> Any:
    """An ``alembic.config.Config`` for this project, with ``sqlalchemy.url`` set to ``url``."""
    from alembic.config import Config

    root = repo_root()
    ini = root / "alembic.ini"
    scripts = root / "migrations"
    if not ini.is_file() or not (scripts / "env.py").is_file():
        raise MigrationsNotFound(
            f"Alembic files not found next to the crossdc package (looked for {ini} and "
            f"{scripts / 'env.py'}); install crossdc editable from its checkout (pip install -e .)"
        )
    cfg = Config(str(ini))
    cfg.set_main_option("script_location", str(scripts))
    # Do not let env.py reconfigure the caller's logging.
    cfg.attributes["configure_logger"] = False
    if url is not None:
        rendered = parse_url(url).render_as_string(hide_password=False)
        cfg.set_main_option("sqlalchemy.url", rendered.replace("%", "%%"))
    return cfg


#: Alembic's commands keep their context in module globals: one command at a time in a process (a service that
#: submits two runs at once, threads that start runs side by side)
_ALEMBIC_LOCK = threading.Lock()


def _alembic(url: str | URL, action: str, revision: str) -> None:
    """Run the Alembic command `action` ("upgrade" or "downgrade") to `revision` on `url` (one at a time)."""
    from alembic import command

    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with _ALEMBIC_LOCK, engine.begin() as conn:
            cfg.attributes["connection"] = conn
            getattr(command, action)(cfg, revision)
    except (exc.OperationalError, exc.InterfaceError) as e:
        raise unavailable(url, e) from e
    finally:
        engine.dispose()


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Run ``alembic upgrade head`` (or to ``revision``) on ``url``."""
    _alembic(url, "upgrade", revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Run ``alembic downgrade REVISION`` on ``url`` (tests, manual repair)."""
    _alembic(url, "downgrade", revision)


def current_revision(url: str | URL) -> str | None:
    """The revision the database at ``url`` is at (``None`` if it was never migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except (exc.OperationalError, exc.InterfaceError) as e:
        raise unavailable(url, e) from e
    finally:
        engine.dispose()


def head_revisions() -> list[str]:
    """The head revision(s) of the migration scripts (exactly one, when the history is sane)."""
    from alembic.script import ScriptDirectory

    return list(ScriptDirectory.from_config(alembic_config()).get_heads())


__all__ = [
    "DATABASE_URL_ENV",
    "DEFAULT_DATABASE_URL",
    "alembic_config",
    "check_connection",
    "current_revision",
    "downgrade",
    "head_revisions",
    "make_engine",
    "parse_url",
    "repo_root",
    "resolve_database_url",
    "safe_url",
    "unavailable",
    "upgrade",
]
