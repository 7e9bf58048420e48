"""Errors raised by ``crossdc.db``: one-line messages meant for the operator."""

from __future__ import annotations


class DatabaseError(RuntimeError):
    """Base class of crossdc's database errors (not SQLAlchemy's ``DatabaseError``)."""


class DatabaseUnavailable(DatabaseError):
    """The database cannot be reached (or stayed unreachable too long for the run log)."""


class InvalidDatabaseUrl(DatabaseError, ValueError):
    """The database URL cannot be parsed, or names a driver that is not installed."""


class MigrationsNotFound(DatabaseError):
    """``alembic.ini`` / ``migrations/`` are not where the installed package expects them."""


__all__ = ["DatabaseError", "DatabaseUnavailable", "InvalidDatabaseUrl", "MigrationsNotFound"]
