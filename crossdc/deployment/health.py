"""Health checks of the operator's long-lived services (compose.yaml's ``healthcheck``s), each a real request to what
the service serves rather than a bare TCP connect: ``python -m crossdc.deployment.health KIND URL --ca CA``.

Promises, for each kind (the certificate is verified against `CA` and must name the host of `URL`):

* ``api``: ``GET URL/api/health`` answers 200 (the API serves and its database answers);
* ``superlink``: ``GET URL/health``, Flower's own health route on the SuperLink's one HTTPS port (the port that also
  serves its Fleet, Control and ServerAppIo APIs), answers 200;
* ``front``: the Fleet API front answers as itself: ``403`` with its JSON reason to a path it never forwards (the
  SuperLink behind it is the ``superlink`` check's);

exit status 0 when healthy, else 1 with one line on stderr saying what failed. Only the standard library is imported
(a check runs every few seconds). A datacenter's node has its own check, ``crossdc node health``.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

#: how long one check waits for its answer
TIMEOUT_S = 5.0
#: the path the ``front`` check asks for (the front refuses everything but ``POST /v1/fleet/...``)
FRONT_PROBE = "/v1/control/health"


class Unhealthy(RuntimeError):
    """The service did not answer as a healthy one does (the message says what it did)."""


def _get(url: str, ca: Path) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(url, context=context, timeout=TIMEOUT_S) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()
    except (urllib.error.URLError, OSError) as err:
        raise Unhealthy(f"{url}: {getattr(err, 'reason', err)}") from None


def check(kind: str, url: str, ca: Path) -> str:
    """Run the `kind` check against the service at `url` (``https://host:port``); what it found, or Unhealthy."""
    base = url.rstrip("/")
    if kind == "api":
        status, body = _get(base + "/api/health", ca)
        if status != 200:
            raise Unhealthy(f"{base}/api/health answered {status}: {body[:200].decode(errors='replace')}")
        return f"api {base}: healthy"
    if kind == "superlink":
        status, _ = _get(base + "/health", ca)
        if status != 200:
            raise Unhealthy(f"the SuperLink's {base}/health answered {status}")
        return f"SuperLink {base}: healthy"
    if kind == "front":
        status, body = _get(base + FRONT_PROBE, ca)
        try:
            reason = json.loads(body).get("detail", "")
        except (ValueError, AttributeError):
            reason = ""
        if status != 403 or "Fleet API" not in str(reason):
            raise Unhealthy(f"the front {base} answered {status} to {FRONT_PROBE}, not its own 403")
        return f"front {base}: healthy"
    raise ValueError(f"unknown kind {kind!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Health check of a crossdc service (compose.yaml's healthcheck).")
    parser.add_argument("kind", choices=("api", "superlink", "front"))
    parser.add_argument("url", help="https://HOST:PORT of the service")
    parser.add_argument("--ca", type=Path, required=True, help="the CA of the service's certificate")
    args = parser.parse_args(argv)
    try:
        print(check(args.kind, args.url, args.ca))
    except Unhealthy as err:
        sys.exit(f"crossdc: error: unhealthy: {err}")


if __name__ == "__main__":
    main()
