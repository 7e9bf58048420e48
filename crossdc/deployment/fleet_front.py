"""The only door to a SuperLink from outside: a reverse proxy that forwards the Fleet API and nothing else.

In flwr 1.42's open-source build the SuperLink serves the Fleet API (what SuperNodes call), the
Control API (submit runs, register nodes) and the ServerAppIo API on one port, and authenticates
nobody on the Control API. So the SuperLink listens on a private address only, and datacenters reach
it through this front, which promises:

- ``POST /v1/fleet/<method>`` is forwarded to the SuperLink unchanged (body, protobuf content type,
  status, streamed response);
- every other request (the Control API ``/v1/control/...``, ServerAppIo, any other path or method)
  is answered ``403`` with a JSON reason, never forwarded, and counted as refused;
- TLS is terminated here when a certificate is given (``crossdc certs`` makes one), so SuperNodes use
  ``--root-certificates ca.pem``; the SuperLink behind it is plain HTTP on loopback, or HTTPS verified
  against `upstream_ca` (needed with SuperNode authentication, which Flower allows only over TLS; the
  SuperNodes' signed request headers pass through unchanged).
"""

from __future__ import annotations

import contextlib
import logging
import re
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from crossdc.deployment.background_server import BackgroundServer, start_background, uvicorn_config

log = logging.getLogger("crossdc.fleet_front")

FLEET_PREFIX = "/v1/fleet/"
#: hop-by-hop headers (RFC 9110 §7.6.1) and those the proxy recomputes
_NOT_FORWARDED = {"host", "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                  "upgrade", "content-length"}


@dataclass
class FrontStats:
    """What the front did, by path: requests forwarded (with the SuperLink's status) and refused."""

    forwarded: Counter = field(default_factory=Counter)  # (path, status) → count
    refused: Counter = field(default_factory=Counter)  # (method, path) → count


#: a Fleet API method's (decoded) path: one segment of letters, digits, '-' and '_' (flwr's are like ``pull-messages``).
#: Nothing else passes: the path is forwarded as decoded here, so a '%', '?', '#' or '..' in it would reach the
#: SuperLink as another path (``/v1/fleet/%252e%252e/control/...`` arrives there as ``/v1/fleet/%2e%2e/control/...``).
_FLEET_PATH = re.compile(re.escape(FLEET_PREFIX) + r"[A-Za-z0-9_-]+")


def is_fleet_request(method: str, path: str) -> bool:
    """Whether a request may pass the front: a POST to a Fleet API method."""
    return method == "POST" and _FLEET_PATH.fullmatch(path) is not None


def create_front(upstream: str, stats: FrontStats | None = None, timeout_s: float = 120.0,
                 upstream_ca: Path | None = None) -> Starlette:
    """The front's ASGI app, forwarding Fleet API calls to the SuperLink at `upstream` (``http://host:port``, or
    ``https://host:port`` whose certificate `upstream_ca` signed)."""
    stats = stats if stats is not None else FrontStats()
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(upstream_ca)) if upstream_ca else True
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=timeout_s, verify=verify)

    async def handle(request: Request) -> Response:
        path = request.url.path
        if not is_fleet_request(request.method, path):
            stats.refused[(request.method, path)] += 1
            log.warning("refused %s %s from %s", request.method, path, request.client.host if request.client else "?")
            return JSONResponse({"detail": "only the Fleet API (POST /v1/fleet/...) is served here"}, status_code=403)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED]
        outgoing = client.build_request("POST", path, content=await request.body(), headers=headers)
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.HTTPError as err:
            stats.forwarded[(path, 502)] += 1
            return JSONResponse({"detail": f"the SuperLink did not answer: {type(err).__name__}"}, status_code=502)
        stats.forwarded[(path, answer.status_code)] += 1
        reply_headers = {k: v for k, v in answer.headers.items() if k.lower() not in _NOT_FORWARDED}
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=reply_headers,
                                 background=BackgroundTask(answer.aclose))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])],
                    lifespan=lifespan)
    app.state.stats = stats
    return app


def front_config(upstream: str, host: str, port: int, certfile: Path | None, keyfile: Path | None,
                 stats: FrontStats, upstream_ca: Path | None = None) -> uvicorn.Config:
    """uvicorn settings of a front (TLS when a certificate is given)."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("give both the certificate and its key, or neither")
    return uvicorn_config(create_front(upstream, stats, upstream_ca=upstream_ca), host, port,
                          ssl_certfile=str(certfile) if certfile else None, ssl_keyfile=str(keyfile) if keyfile else None)


@dataclass
class RunningFront:
    """A front serving in a background thread, with its counters."""

    server: BackgroundServer
    stats: FrontStats

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


def start_front(upstream: str, host: str, port: int, certfile: Path | None = None, keyfile: Path | None = None,
                upstream_ca: Path | None = None) -> RunningFront:
    """Start a front in a background thread; returns once it accepts connections."""
    stats = FrontStats()
    config = front_config(upstream, host, port, certfile, keyfile, stats, upstream_ca)
    return RunningFront(start_background(config, "fleet-front"), stats)
