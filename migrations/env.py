"""Alembic environment of crossdc.

The URL comes from ``config.get_main_option("sqlalchemy.url")``, which the caller
sets (``crossdc.db.engine.upgrade`` does). A caller may instead hand over an open
connection in ``config.attributes["connection"]``. When neither is given (plain
``alembic`` on the command line), ``-x db=URL``, then ``$CROSSDC_DATABASE_URL``,
then ``sqlite:///crossdc.db`` is used.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import pool

from crossdc.db.engine import make_engine, resolve_database_url
from crossdc.db.models import metadata

config = context.config

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    return resolve_database_url(context.get_x_argument(as_dictionary=True).get("db"))


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        **kwargs,
    )


def run_migrations_offline() -> None:
    url = _url()
    _configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection) -> None:  # type: ignore[no-untyped-def]
    _configure(
        connection=connection,
        # SQLite cannot ALTER most things: batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    engine = make_engine(_url(), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run_on(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
