"""Who may call what on the API: bearer tokens with roles (see :mod:`crossdc.db.security`).

Promises:

* every write endpoint depends on :func:`require` with the role it needs: no token, or an unknown or revoked one,
  answers ``401`` (with ``WWW-Authenticate: Bearer``); a live token of another role answers ``403``; both are
  recorded in the audit log (the token's name when known, never the token) before the answer goes out;
* reads are open unless the service locks them (``crossdc serve --lock-reads``): then every ``/api`` read,
  ``/metrics`` and the pages need a token of any role (:func:`read_access`);
* tokens are read from the ``Authorization: Bearer`` header only (never from the URL, which ends up in logs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from crossdc.db.security import TokenIdentity, record_audit, role_allows, verify_token

bearer = HTTPBearer(auto_error=False, description="A token from `crossdc admin create-token` (roles: admin, enrollment, read).")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def client_address(request: Request) -> str | None:
    """The caller's address as the server saw it."""
    return request.client.host if request.client else None


def authenticate(request: Request, credentials: HTTPAuthorizationCredentials | None, needed: str) -> TokenIdentity:
    """The identity behind the request's bearer token if its role allows `needed`; else 401/403, audited."""
    action = f"{request.method} {request.url.path}"
    identity: TokenIdentity | None = None
    refusal: tuple[int, str] | None = None
    with request.app.state.engine.begin() as conn:
        if credentials is None or not credentials.credentials:
            refusal = (401, "a bearer token is needed (Authorization: Bearer <token>)")
        elif (identity := verify_token(conn, credentials.credentials)) is None:
            refusal = (401, "unknown or revoked token")
        elif not role_allows(identity.role, needed):
            refusal = (403, f"a token of role '{identity.role}' may not do this (it needs '{needed}')")
        if refusal is not None:
            record_audit(conn, action, "refused", actor=identity.name if identity else None, client=client_address(request),
                         detail={"status": refusal[0], "reason": refusal[1]})
    if refusal is not None:
        headers = {"WWW-Authenticate": "Bearer"} if refusal[0] == 401 else None
        raise HTTPException(status_code=refusal[0], detail=refusal[1], headers=headers)
    assert identity is not None
    return identity


def require(needed: str) -> Callable[[Request, HTTPAuthorizationCredentials | None], TokenIdentity]:
    """A dependency that lets through only tokens whose role allows `needed` (admin allows everything)."""

    def dependency(request: Request, credentials: Credentials) -> TokenIdentity:
        return authenticate(request, credentials, needed)

    return dependency


def read_access(request: Request) -> None:
    """Nothing when reads are open; with reads locked, a token of any live role is needed. (The header is read here
    rather than declared, so the OpenAPI schema of a service with open reads does not claim they need a token.)"""
    if getattr(request.app.state, "lock_reads", False):
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        credentials = (HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip())
                       if scheme.lower() == "bearer" and token.strip() else None)
        authenticate(request, credentials, "read")


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
