"""Who may call what on the API and the dashboard: bearer tokens with roles, and browser sessions for reading (see
:mod:`crossdc.db.security`).

Promises:

* every write endpoint depends on :func:`require` with the role it needs, and reads the token from the
  ``Authorization: Bearer`` header only, never from a cookie (so no other site can make a browser write) nor the
  URL (which ends up in logs): no token, or an unknown, revoked or expired one, answers ``401`` (with
  ``WWW-Authenticate: Bearer``); a live token of another role answers ``403``. Both go to the audit log (the
  token's name when known, never the token) before the answer goes out: a 403, done with a live token, as a row of
  its own; a 401 through :func:`crossdc.db.security.record_refusal`, counted on one row per client, route, token
  name and reason per window;
* reads are open unless the service locks them (``crossdc serve --lock-reads``). Then every ``/api`` read and every
  page needs a token of role ``read`` or ``admin`` (:func:`read_access`, :func:`page_access`): a bearer token, or
  the session cookie of a dashboard login; ``/metrics`` takes a bearer token only (what Prometheus sends), and
  ``/api/health`` is open (it says more to a reader: :func:`may_read`). A page asked for by a browser (one that
  accepts HTML) without either is redirected to ``/login``; the API answers 401;
* ``/login`` takes a pasted read or admin token and opens a session: an opaque cookie (:data:`SESSION_COOKIE`,
  ``HttpOnly``, ``SameSite=Strict``, ``Secure`` when served over TLS, for at most
  :data:`crossdc.db.security.SESSION_LIFETIME` and never past the token's expiry) that stops working as soon as
  its token is revoked or expires; ``POST /logout`` ends it. Logins and logouts are audited.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from crossdc.db.queries import utcnow
from crossdc.db.security import (
    TokenCheck,
    TokenIdentity,
    check_session,
    check_token,
    close_session,
    open_session,
    record_audit,
    record_refusal,
    role_allows,
)

bearer = HTTPBearer(auto_error=False, description="A token from `crossdc admin create-token` (roles: admin, enrollment, read).")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]

#: the dashboard session's cookie
SESSION_COOKIE = "crossdc_session"
#: reads open even when reads are locked (what they show depends on :func:`may_read`)
OPEN_READS = frozenset({"/api/health"})
#: reads that take a bearer token only, never the session cookie (machines read them: Prometheus)
BEARER_ONLY_READS = frozenset({"/metrics"})
#: the largest login form taken (a token is under 50 characters)
MAX_LOGIN_BODY = 4096
NO_TOKEN = "a bearer token is needed (Authorization: Bearer <token>)"
BAD_TOKEN = "unknown, revoked or expired token"

router = APIRouter(include_in_schema=False)


class LoginRequired(Exception):
    """A browser asked for a page with locked reads and no live session: it goes to the login page."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


# ------------------------------------------------------------------ pure pieces


def safe_next(value: str | None) -> str:
    """Where to go after logging in: `value` if it is a path on this site (one leading ``/``, no scheme, host, back-
    slash or control character, not the login or logout page itself), else ``/``: a login link cannot send the
    user to another site."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in value):
        return "/"
    if value.split("?", 1)[0] in ("/login", "/logout"):
        return "/"
    return value


def parse_login_form(body: bytes) -> tuple[str, str | None]:
    """The ``token`` and ``next`` fields of an ``application/x-www-form-urlencoded`` login form (the token stripped;
    ``""`` when missing)."""
    try:
        fields = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True, max_num_fields=10)
    except ValueError:  # more fields than a login form has
        return "", None
    token = (fields.get("token") or [""])[0].strip()
    return token, (fields.get("next") or [None])[0]


def wants_html(request: Request) -> bool:
    """Whether the caller is a browser navigating (it accepts HTML): redirected to log in rather than told 401."""
    return "text/html" in request.headers.get("accept", "")


# ------------------------------------------------------------------ adapters


def client_address(request: Request) -> str | None:
    """The caller's address as the server saw it."""
    return request.client.host if request.client else None


def route_action(request: Request) -> str:
    """The method and route template of the request (``GET /api/runs/{run_id}``): an aggregated refusal's action,
    so that made-up ids do not make rows of their own."""
    return f"{request.method} {_route_path(request)}"


def _route_path(request: Request) -> str:
    """The route template the request matched (its path when it matched none)."""
    return str(getattr(request.scope.get("route"), "path", request.url.path))


def _bearer_credentials(request: Request) -> HTTPAuthorizationCredentials | None:
    """The request's bearer token, read from its header here rather than declared (so that the OpenAPI schema of a
    service with open reads does not claim its reads need a token)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip())
    return None


def _refusal(conn: Connection, request: Request, checked: TokenCheck | None, needed: str) -> tuple[int, str] | None:
    """The HTTP refusal (status, message) of a request whose token or session is `checked` (None: neither), recorded
    in the audit log; None when it may do what needs `needed`."""
    if checked is None or checked.problem is not None:
        actor = checked.identity.name if checked is not None and checked.identity else None
        reason = "no token" if checked is None else str(checked.problem)
        record_refusal(conn, route_action(request), actor=actor, client=client_address(request), status=401,
                       reason=reason)
        return 401, NO_TOKEN if checked is None else BAD_TOKEN
    assert checked.identity is not None
    if not role_allows(checked.identity.role, needed):
        message = f"a token of role '{checked.identity.role}' may not do this (it needs '{needed}')"
        record_audit(conn, f"{request.method} {request.url.path}", "refused", actor=checked.identity.name,
                     client=client_address(request), detail={"status": 403, "reason": message})
        return 403, message
    return None


def _raise(refusal: tuple[int, str]) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if refusal[0] == 401 else None
    raise HTTPException(status_code=refusal[0], detail=refusal[1], headers=headers)


def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None, needed: str) -> TokenIdentity:
    """The identity behind the request's bearer token if its role allows `needed`; else 401/403, audited."""
    with request.app.state.engine.begin() as conn:
        checked = check_token(conn, credentials.credentials) if credentials and credentials.credentials else None
        refusal = _refusal(conn, request, checked, needed)
    if refusal is not None:
        _raise(refusal)
    assert checked is not None and checked.identity is not None
    return checked.identity


def require(needed: str) -> Callable[[Request, HTTPAuthorizationCredentials | None], TokenIdentity]:
    """A dependency that lets through only bearer tokens whose role allows `needed` (admin allows everything)."""

    def dependency(request: Request, credentials: Credentials) -> TokenIdentity:
        return authenticate(request, credentials, needed)

    return dependency


def _reader(request: Request, *, page: bool) -> None:
    """With locked reads: let through a read or admin bearer token, else (but on bearer-only routes) a live session
    cookie; refuse the rest, audited (a browser on a page goes to log in). A session's identity is kept in
    ``request.state.dashboard_user`` for the pages."""
    if not getattr(request.app.state, "lock_reads", False):
        return
    route = _route_path(request)
    if route in OPEN_READS:
        return
    credentials = _bearer_credentials(request)
    session = request.cookies.get(SESSION_COOKIE) if credentials is None and route not in BEARER_ONLY_READS else None
    with request.app.state.engine.begin() as conn:
        checked = (check_token(conn, credentials.credentials) if credentials is not None
                   else check_session(conn, session) if session else None)
        refusal = _refusal(conn, request, checked, "read")
    if refusal is None:
        if session and checked is not None:
            request.state.dashboard_user = checked.identity
        return
    if page and credentials is None and wants_html(request):
        raise LoginRequired(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
    _raise(refusal)


def read_access(request: Request) -> None:
    """The API's reads: nothing when reads are open; with reads locked, a read or admin token (bearer, or the
    dashboard's session cookie but on ``/metrics``), else 401."""
    _reader(request, page=False)


def page_access(request: Request) -> None:
    """The pages: as :func:`read_access`, but a browser without a live session is sent to ``/login``."""
    _reader(request, page=True)


def may_read(request: Request) -> bool:
    """Whether the caller may read: always with open reads; with locked reads, when it brings a live read or admin
    bearer token or session. Never refuses nor audits anything; False when the database cannot say."""
    if not getattr(request.app.state, "lock_reads", False):
        return True
    credentials = _bearer_credentials(request)
    session = request.cookies.get(SESSION_COOKIE)
    if credentials is None and not session:
        return False
    try:
        with request.app.state.engine.begin() as conn:
            checked = (check_token(conn, credentials.credentials) if credentials is not None
                       else check_session(conn, str(session)))
    except SQLAlchemyError:
        return False
    return checked.live is not None and role_allows(checked.live.role, "read")


def audit(request: Request, action: str, outcome: str, who: TokenIdentity, target: str | None, detail: Any = None) -> None:
    """One row of the audit log for an authenticated act: `outcome` ok, refused or failed."""
    with request.app.state.engine.begin() as conn:
        record_audit(conn, action, outcome, actor=who.name, target=target, client=client_address(request), detail=detail)


def refuse(request: Request, action: str, who: TokenIdentity, target: str | None, status: int, reason: str) -> HTTPException:
    """Audit a refusal (4xx) or failure (5xx) of an authenticated act, and the HTTP error to raise for it."""
    audit(request, action, "failed" if status >= 500 else "refused", who, target, {"status": status, "reason": reason})
    return HTTPException(status_code=status, detail=reason)


Admin = Annotated[TokenIdentity, Depends(require("admin"))]
Enroller = Annotated[TokenIdentity, Depends(require("enrollment"))]


# ------------------------------------------------------------------ login and logout


@dataclass(frozen=True)
class Login:
    """What a login came to: a session (its secret and lifetime in seconds), or a refusal (status, message)."""

    secret: str | None = None
    lifetime_s: float = 0.0
    refusal: tuple[int, str] | None = None


def _login_page(request: Request, next_path: str, error: str | None = None, status_code: int = 200) -> HTMLResponse:
    from crossdc.dashboard.pages import templates  # (the pages' templates and filters; loads plotly)

    return templates.TemplateResponse(request, "login.html", {"title": "Log in", "next": next_path, "error": error},
                                      status_code=status_code)


def _log_in(request: Request, token: str) -> Login:
    """Open a session with `token` if it is a live read or admin token; audited either way."""
    now = utcnow()
    with request.app.state.engine.begin() as conn:
        checked = check_token(conn, token, now) if token else None
        refusal = _refusal(conn, request, checked, "read")
        if refusal is not None or checked is None or checked.identity is None:
            return Login(refusal=refusal)
        secret, ends = open_session(conn, checked, now)
        record_audit(conn, "login", "ok", actor=checked.identity.name, client=client_address(request),
                     detail={"session_ends": ends.isoformat()})
    return Login(secret, (ends - now).total_seconds())


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str | None = None) -> HTMLResponse:  # noqa: A002 - the query parameter's name
    """The login form: paste a read or admin token."""
    return _login_page(request, safe_next(next))


@router.post("/login")
async def log_in(request: Request) -> Response:
    """Open a session with the pasted token (form field ``token``) and go on to ``next`` (303); the form again with
    401 (no token, or an unknown, revoked or expired one) or 403 (a token of another role) otherwise."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY:
            return _login_page(request, "/", "That is far longer than a token.", 413)
    token, next_value = parse_login_form(body)
    next_path = safe_next(next_value)
    login = await run_in_threadpool(_log_in, request, token)
    if login.secret is None:
        status = login.refusal[0] if login.refusal else 401
        message = ("Paste a token." if not token else "That token is unknown, revoked or expired." if status == 401
                   else "That token may not read the dashboard: it needs the role read or admin.")
        return _login_page(request, next_path, message, status)
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(SESSION_COOKIE, login.secret, max_age=max(1, int(login.lifetime_s)), path="/", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


def _log_out(request: Request, secret: str) -> None:
    with request.app.state.engine.begin() as conn:
        who = close_session(conn, secret)
        if who is not None:
            record_audit(conn, "logout", "ok", actor=who.name, client=client_address(request))


@router.post("/logout")
async def log_out(request: Request) -> Response:
    """End this browser's session (if any) and go to the login page."""
    secret = request.cookies.get(SESSION_COOKIE)
    if secret:
        await run_in_threadpool(_log_out, request, secret)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return response


async def _to_login(request: Request, error: Exception) -> Response:
    assert isinstance(error, LoginRequired)
    response = RedirectResponse(f"/login?next={quote(error.next_path, safe='')}", status_code=303)
    if request.cookies.get(SESSION_COOKIE):  # a session that no longer works
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict",
                               secure=request.url.scheme == "https")
    return response


def install(app: FastAPI) -> None:
    """Add the login and logout pages and the redirect of a browser that must log in to `app`."""
    app.include_router(router)
    app.add_exception_handler(LoginRequired, _to_login)
