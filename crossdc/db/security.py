"""API tokens and the audit log in SQL (tables ``api_tokens`` and ``audit_log``).

Promises:

* a token is made from 32 random bytes (``secrets``), shown once by :func:`create_token`, and stored only as its
  SHA-256 (hex); nothing here ever logs or returns a stored token;
* :func:`verify_token` compares hashes in constant time (``hmac.compare_digest``) and accepts only tokens that
  are not revoked; it answers with the token's name and role, never the token;
* roles: ``admin`` (everything), ``enrollment`` (enroll a datacenter), ``read`` (read the API when reads are
  locked); :func:`role_allows` is the one rule that maps a token's role to what it may do;
* every act worth auditing is one ``audit_log`` row: what (``action``), whether it happened (``outcome``: ok,
  refused, failed), by whom (the token's name), on what, from where, and a JSON detail.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update

from crossdc.db.models import API_TOKENS, AUDIT_LOG, TOKEN_ROLES
from crossdc.db.queries import as_utc, utcnow

#: tokens start with this, so a leaked one is easy to recognise (and to scan for)
TOKEN_PREFIX = "cdx_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TokenError(ValueError):
    """A token cannot be made or revoked as asked (bad name or role, a name already used, no such token)."""


@dataclass(frozen=True)
class TokenIdentity:
    """Who a verified token belongs to."""

    name: str
    role: str


def generate_token() -> str:
    """A new random bearer token (256 bits of entropy, URL-safe)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The SHA-256 of `token`, hex: what the database stores (tokens are random, so no salt is needed)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def role_allows(role: str, needed: str) -> bool:
    """Whether a token of `role` may do what needs `needed` (admin may do everything)."""
    return role == "admin" or role == needed


def check_name(name: str, what: str = "name") -> str:
    """`name` if it is 1–128 of letters, digits, '.', '_', '-' (starting with a letter or digit); else TokenError."""
    if not _NAME.match(name):
        raise TokenError(f"{what} {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name


def create_token(engine: Engine, name: str, role: str) -> str:
    """Store a new token of `role` under the unique `name`; returns the token (the only time it is seen)."""
    check_name(name, "token name")
    if role not in TOKEN_ROLES:
        raise TokenError(f"role {role!r} is not one of {', '.join(TOKEN_ROLES)}")
    token = generate_token()
    with engine.begin() as conn:
        if conn.execute(select(API_TOKENS.c.id).where(API_TOKENS.c.name == name)).first() is not None:
            raise TokenError(f"a token named {name!r} exists already; revoke it or choose another name")
        conn.execute(insert(API_TOKENS).values(name=name, role=role, token_hash=hash_token(token), created_at=utcnow()))
        record_audit(conn, "token-created", "ok", actor=None, target=name, detail={"role": role})
    return token


def revoke_token(engine: Engine, name: str) -> None:
    """Revoke the token `name` from now on (TokenError if there is no such live token)."""
    with engine.begin() as conn:
        done = conn.execute(update(API_TOKENS).where(API_TOKENS.c.name == name, API_TOKENS.c.revoked_at.is_(None))
                            .values(revoked_at=utcnow()))
        if done.rowcount != 1:
            raise TokenError(f"no live token named {name!r}")
        record_audit(conn, "token-revoked", "ok", actor=None, target=name)


def list_tokens(engine: Engine) -> list[dict[str, Any]]:
    """Every token's name, role and dates (never the token nor its hash)."""
    columns = [API_TOKENS.c.name, API_TOKENS.c.role, API_TOKENS.c.created_at, API_TOKENS.c.revoked_at, API_TOKENS.c.last_used_at]
    with engine.connect() as conn:
        return [dict(row) for row in conn.execute(select(*columns).order_by(API_TOKENS.c.id)).mappings()]


def verify_token(conn: Connection, token: str) -> TokenIdentity | None:
    """The identity of a live token, or None; marks it used. Hashes are compared in constant time."""
    presented = hash_token(token)
    row = conn.execute(select(API_TOKENS.c.id, API_TOKENS.c.name, API_TOKENS.c.role, API_TOKENS.c.token_hash)
                       .where(API_TOKENS.c.token_hash == presented, API_TOKENS.c.revoked_at.is_(None))).first()
    if row is None or not hmac.compare_digest(row.token_hash, presented):
        return None
    conn.execute(update(API_TOKENS).where(API_TOKENS.c.id == row.id).values(last_used_at=utcnow()))
    return TokenIdentity(row.name, row.role)


def record_audit(conn: Connection, action: str, outcome: str, *, actor: str | None, target: str | None = None,
                 client: str | None = None, detail: Any = None) -> None:
    """Append one row to the audit log (in the caller's transaction)."""
    conn.execute(insert(AUDIT_LOG).values(at=utcnow(), action=action, outcome=outcome, actor=actor, target=target,
                                          client=client, detail=detail))


def audit_entries(conn: Connection, *, since_id: int | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Audit rows with ``id > since_id``, oldest first, at most `limit`."""
    query = select(AUDIT_LOG).order_by(AUDIT_LOG.c.id).limit(limit)
    if since_id is not None:
        query = query.where(AUDIT_LOG.c.id > since_id)
    return [{key: as_utc(value) for key, value in row.items()} for row in conn.execute(query).mappings()]
