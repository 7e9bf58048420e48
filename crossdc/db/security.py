"""API tokens, dashboard sessions and the audit log in SQL (tables ``api_tokens``, ``api_sessions``, ``audit_log``).

Promises:

* a token is made from 32 random bytes (``secrets``), shown once by :func:`create_token`, and stored only as its
  SHA-256 (hex); nothing here ever logs or returns a stored token;
* a token may expire (:func:`create_token`'s ``expires_in``, from :func:`parse_duration`'s ``90d``, ``12h``,
  ``30m``); :func:`check_token` compares hashes in constant time (``hmac.compare_digest``) and accepts only a
  token that is neither revoked nor expired, else says which (``unknown``, ``revoked``, ``expired``); it answers
  with the token's name and role, never the token (:func:`verify_token`: the identity of a live token or None);
* a dashboard session (:func:`open_session`) is 32 random bytes too, stored as its SHA-256, lives at most
  :data:`SESSION_LIFETIME` and never past its token's expiry, and :func:`check_session` accepts it only while its
  token is live: revoking or expiry of the token ends its sessions at once; :func:`close_session` ends one;
* roles: ``admin`` (everything), ``enrollment`` (enroll a datacenter), ``read`` (read the API when reads are
  locked); :func:`role_allows` is the one rule that maps a token's role to what it may do;
* every act worth auditing is one ``audit_log`` row: what (``action``), whether it happened (``outcome``: ok,
  refused, failed), by whom (the token's name, or ``cli:<user>`` for the local operator: :func:`local_operator`),
  on what, from where, and a JSON detail; the one exception is :func:`record_refusal`, for callers without a live
  token: one row per client address, action, token name, status and reason per :data:`REFUSAL_WINDOW`, whose
  ``count`` says how many, and at most :data:`MAX_REFUSAL_ROWS_PER_WINDOW` such rows per window (then one overflow
  row per status), so noise cannot grow the log without bound.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from crossdc.db.models import API_SESSIONS, API_TOKENS, AUDIT_LOG, TOKEN_ROLES
from crossdc.db.queries import as_utc, utcnow

#: tokens start with this, so a leaked one is easy to recognise (and to scan for)
TOKEN_PREFIX = "cdx_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DURATION = re.compile(r"^([1-9][0-9]{0,5})([dhm])$")
_UNITS = {"d": timedelta(days=1), "h": timedelta(hours=1), "m": timedelta(minutes=1)}
#: the longest a dashboard session lives (and never past its token's expiry)
SESSION_LIFETIME = timedelta(hours=12)
#: refusals of callers without a live token from one client, for one action, token name, status and reason, share
#: one audit row per window of this length (windows start at whole multiples of it since the Unix epoch)
REFUSAL_WINDOW = timedelta(minutes=5)
#: at most this many aggregated refusal rows per window; refusals beyond go to one overflow row per status
MAX_REFUSAL_ROWS_PER_WINDOW = 1000
#: the client, action and reason of an overflow row
OVERFLOW = "*"
#: why a token is not accepted (audited; the caller is told only that it is unknown, revoked or expired)
TOKEN_PROBLEMS: tuple[str, ...] = ("unknown", "revoked", "expired")


class TokenError(ValueError):
    """A token cannot be made or revoked as asked (bad name or role, a name already used, no such token)."""


@dataclass(frozen=True)
class TokenIdentity:
    """Who a verified token belongs to."""

    name: str
    role: str


@dataclass(frozen=True)
class TokenCheck:
    """What a presented token (or session) is: `identity` when its token is known (name and role), and `problem`
    None when it may be used, else one of :data:`TOKEN_PROBLEMS`."""

    identity: TokenIdentity | None
    problem: str | None
    #: the known token's row id and expiry (what a session opened with it is tied to)
    token_id: int | None = None
    expires_at: datetime | None = None

    @property
    def live(self) -> TokenIdentity | None:
        """The identity when the token may be used, else None."""
        return self.identity if self.problem is None else None


def parse_duration(text: str) -> timedelta:
    """``90d``, ``12h`` or ``30m`` (a whole number from 1 to 999999 of days, hours or minutes) as a timedelta;
    TokenError for anything else."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise TokenError(f"duration {text!r} must be a whole number of days, hours or minutes, e.g. 90d, 12h or 30m")
    return int(match.group(1)) * _UNITS[match.group(2)]


def token_problem(revoked_at: datetime | None, expires_at: datetime | None, now: datetime) -> str | None:
    """Why a known token may not be used at `now` (``revoked`` first, then ``expired``: from its expiry on), or None."""
    if revoked_at is not None:
        return "revoked"
    if expires_at is not None and as_utc(expires_at) <= now:
        return "expired"
    return None


def local_operator() -> str:
    """Who acts from this machine's command line, for the audit log: ``cli:<login name>`` (``cli:unknown`` when
    the system cannot say)."""
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no login name (no $USER, no passwd entry): still an audit row
        return "cli:unknown"


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


def create_token(engine: Engine, name: str, role: str, *, expires_in: timedelta | None = None,
                 actor: str | None = None, now: datetime | None = None) -> str:
    """Store a new token of `role` under the unique `name`, refused from `expires_in` after `now` on (never, when
    None); returns the token (the only time it is seen). `actor`: who made it, for the audit log."""
    check_name(name, "token name")
    if role not in TOKEN_ROLES:
        raise TokenError(f"role {role!r} is not one of {', '.join(TOKEN_ROLES)}")
    if expires_in is not None and expires_in <= timedelta(0):
        raise TokenError("a token's lifetime must be positive")
    now = now or utcnow()
    expires_at = now + expires_in if expires_in is not None else None
    token = generate_token()
    with engine.begin() as conn:
        if conn.execute(select(API_TOKENS.c.id).where(API_TOKENS.c.name == name)).first() is not None:
            raise TokenError(f"a token named {name!r} exists already; revoke it or choose another name")
        conn.execute(insert(API_TOKENS).values(name=name, role=role, token_hash=hash_token(token), created_at=now,
                                               expires_at=expires_at))
        detail = {"role": role, "expires_at": expires_at.isoformat() if expires_at else None}
        record_audit(conn, "token-created", "ok", actor=actor, target=name, detail=detail)
    return token


def revoke_token(engine: Engine, name: str, *, actor: str | None = None) -> None:
    """Revoke the token `name` from now on, its dashboard sessions with it (TokenError if there is no such unrevoked
    token). `actor`: who revoked it, for the audit log."""
    with engine.begin() as conn:
        done = conn.execute(update(API_TOKENS).where(API_TOKENS.c.name == name, API_TOKENS.c.revoked_at.is_(None))
                            .values(revoked_at=utcnow()))
        if done.rowcount != 1:
            raise TokenError(f"no live token named {name!r}")
        record_audit(conn, "token-revoked", "ok", actor=actor, target=name)


def list_tokens(engine: Engine) -> list[dict[str, Any]]:
    """Every token's name, role and dates, expiry included (never the token nor its hash)."""
    columns = [API_TOKENS.c.name, API_TOKENS.c.role, API_TOKENS.c.created_at, API_TOKENS.c.revoked_at,
               API_TOKENS.c.last_used_at, API_TOKENS.c.expires_at]
    with engine.connect() as conn:
        return [{key: as_utc(value) for key, value in row.items()}
                for row in conn.execute(select(*columns).order_by(API_TOKENS.c.id)).mappings()]


def check_token(conn: Connection, token: str, now: datetime | None = None) -> TokenCheck:
    """What `token` is at `now`: a live token's identity (marked used), or why it is refused. Hashes are compared
    in constant time."""
    now = now or utcnow()
    presented = hash_token(token)
    row = conn.execute(select(API_TOKENS.c.id, API_TOKENS.c.name, API_TOKENS.c.role, API_TOKENS.c.token_hash,
                              API_TOKENS.c.revoked_at, API_TOKENS.c.expires_at)
                       .where(API_TOKENS.c.token_hash == presented)).first()
    if row is None or not hmac.compare_digest(row.token_hash, presented):
        return TokenCheck(None, "unknown")
    problem = token_problem(row.revoked_at, row.expires_at, now)
    if problem is None:
        conn.execute(update(API_TOKENS).where(API_TOKENS.c.id == row.id).values(last_used_at=now))
    return TokenCheck(TokenIdentity(row.name, row.role), problem, row.id, as_utc(row.expires_at))


def verify_token(conn: Connection, token: str) -> TokenIdentity | None:
    """The identity of a live token (neither revoked nor expired), or None; marks it used."""
    return check_token(conn, token).live


# ------------------------------------------------------------------ dashboard sessions


def open_session(conn: Connection, checked: TokenCheck, now: datetime | None = None) -> tuple[str, datetime]:
    """Open a dashboard session with the live token `checked` (from :func:`check_token`): the session's secret (the
    cookie's value; only its hash is stored) and when it ends: :data:`SESSION_LIFETIME` after `now`, or the token's
    expiry if sooner. Sessions that have ended are forgotten on the way. ValueError for a token that is not live."""
    if checked.live is None or checked.token_id is None:
        raise ValueError("a session needs a live token")
    now = now or utcnow()
    ends = now + SESSION_LIFETIME if checked.expires_at is None else min(now + SESSION_LIFETIME, checked.expires_at)
    conn.execute(delete(API_SESSIONS).where(API_SESSIONS.c.expires_at <= now))
    secret = secrets.token_urlsafe(32)
    conn.execute(insert(API_SESSIONS).values(token_id=checked.token_id, session_hash=hash_token(secret), created_at=now,
                                             expires_at=ends))
    return secret, ends


def check_session(conn: Connection, secret: str, now: datetime | None = None) -> TokenCheck:
    """What the session `secret` is at `now`: its token's identity while the session has not ended and its token
    is live; else why not (``unknown`` also for a session that ended or was closed)."""
    now = now or utcnow()
    presented = hash_token(secret)
    row = conn.execute(select(API_SESSIONS.c.session_hash, API_SESSIONS.c.expires_at, API_TOKENS.c.name,
                              API_TOKENS.c.role, API_TOKENS.c.revoked_at, API_TOKENS.c.expires_at.label("token_expires_at"))
                       .join(API_TOKENS, API_TOKENS.c.id == API_SESSIONS.c.token_id)
                       .where(API_SESSIONS.c.session_hash == presented)).first()
    if row is None or not hmac.compare_digest(row.session_hash, presented) or as_utc(row.expires_at) <= now:
        return TokenCheck(None, "unknown")
    return TokenCheck(TokenIdentity(row.name, row.role), token_problem(row.revoked_at, row.token_expires_at, now))


def close_session(conn: Connection, secret: str) -> TokenIdentity | None:
    """End the session `secret` (nothing if there is none); the identity of its token, if it had one."""
    checked = check_session(conn, secret)
    conn.execute(delete(API_SESSIONS).where(API_SESSIONS.c.session_hash == hash_token(secret)))
    return checked.identity


# ------------------------------------------------------------------ the audit log


def record_audit(conn: Connection, action: str, outcome: str, *, actor: str | None, target: str | None = None,
                 client: str | None = None, detail: Any = None) -> None:
    """Append one row to the audit log (in the caller's transaction)."""
    conn.execute(insert(AUDIT_LOG).values(at=utcnow(), action=action, outcome=outcome, actor=actor, target=target,
                                          client=client, detail=detail))


def record_audit_now(engine: Engine, action: str, outcome: str, *, actor: str | None, target: str | None = None,
                     client: str | None = None, detail: Any = None) -> None:
    """Append one row to the audit log in a transaction of its own (an act outside the API's requests, such as a
    run submitted from the command line)."""
    with engine.begin() as conn:
        record_audit(conn, action, outcome, actor=actor, target=target, client=client, detail=detail)


def window_start(at: datetime, window: timedelta = REFUSAL_WINDOW) -> datetime:
    """The start of the window `at` falls in: the last whole multiple of `window` since the Unix epoch (UTC)."""
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    return epoch + ((as_utc(at) - epoch) // window) * window


def refusal_key(start: datetime, client: str | None, action: str, actor: str | None, status: int, reason: str) -> str:
    """The ``window_key`` of the aggregated refusal row of these, in the window that starts at `start` (SHA-256 hex
    of them: fixed length whatever the client and action)."""
    parts = [as_utc(start).isoformat(), client, action, actor, status, reason]
    return hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()


def record_refusal(conn: Connection, action: str, *, actor: str | None, client: str | None, status: int, reason: str,
                   now: datetime | None = None, window: timedelta = REFUSAL_WINDOW,
                   max_rows: int = MAX_REFUSAL_ROWS_PER_WINDOW) -> None:
    """Count one refused request of a caller without a live token (in the caller's transaction): the first of its
    client, `action`, `actor` (a revoked or expired token's name, else None), `status` and `reason` in its window
    adds a row (outcome ``refused``, ``detail`` ``{"status", "reason"}``, ``count`` 1), each later one adds 1 to
    that row's ``count`` and moves its ``last_at``. Past `max_rows` such rows in the window, it counts on one
    overflow row per status instead (client, action and reason :data:`OVERFLOW`)."""
    now = now or utcnow()
    start = window_start(now, window)
    key = refusal_key(start, client, action, actor, status, reason)
    if conn.execute(select(AUDIT_LOG.c.id).where(AUDIT_LOG.c.window_key == key)).first() is None:
        rows = conn.execute(select(func.count()).select_from(AUDIT_LOG).where(
            AUDIT_LOG.c.window_key.is_not(None), AUDIT_LOG.c.at >= start, AUDIT_LOG.c.at < start + window)).scalar_one()
        if rows >= max_rows:
            client, action, actor, reason = OVERFLOW, OVERFLOW, None, OVERFLOW
            key = refusal_key(start, client, action, actor, status, reason)
    values = {"at": now, "last_at": now, "action": action, "outcome": "refused", "actor": actor, "client": client,
              "detail": {"status": status, "reason": reason}, "count": 1, "window_key": key}
    more = {"count": AUDIT_LOG.c["count"] + 1, "last_at": now}
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):  # one statement: concurrent refusals never lose a count
        ins = (sqlite.insert if dialect == "sqlite" else postgresql.insert)(AUDIT_LOG).values(**values)
        conn.execute(ins.on_conflict_do_update(index_elements=["window_key"], set_=more))
        return
    if conn.execute(update(AUDIT_LOG).where(AUDIT_LOG.c.window_key == key).values(**more)).rowcount == 0:
        conn.execute(insert(AUDIT_LOG).values(**values))


def audit_entries(conn: Connection, *, since_id: int | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Audit rows with ``id > since_id``, oldest first, at most `limit` (without their internal ``window_key``)."""
    columns = [column for column in AUDIT_LOG.c if column.name != "window_key"]
    query = select(*columns).order_by(AUDIT_LOG.c.id).limit(limit)
    if since_id is not None:
        query = query.where(AUDIT_LOG.c.id > since_id)
    return [{key: as_utc(value) for key, value in row.items()} for row in conn.execute(query).mappings()]
