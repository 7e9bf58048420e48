"""A run's effective status: what operators should see for a ``runs`` row (one rule for the API, pages and CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

from crossdc.db.queries import as_utc
from crossdc.db.values import finite_float

#: A ``running`` run is ``interrupted`` once its heartbeat is older than max(this, ...) seconds.
STALE_AFTER_MIN_S = 300.0
#: ... and older than this many times its slowest round (the server heartbeats after every round).
STALE_AFTER_SLOWEST_ROUNDS = 3.0


class EffectiveStatus(NamedTuple):
    """A run's status as operators should see it: ``status`` and, where useful, a one-line ``detail``."""

    status: str
    detail: str | None


def stale_after_s(slowest_round_wall_s: float | None) -> float:
    """Seconds without a heartbeat after which a ``running`` run counts as dead: max(300 s, 3 × its slowest round)."""
    slowest = finite_float(slowest_round_wall_s) or 0.0
    return max(STALE_AFTER_MIN_S, STALE_AFTER_SLOWEST_ROUNDS * slowest)


def effective_status(run_row: Mapping[str, Any], slowest_round_wall_s: float | None, now: datetime) -> EffectiveStatus:
    """The status to show for a ``runs`` row (the one rule; the API and the pages both use it).

    A run ends with ``finished``, ``failed`` or ``interrupted`` written by its own processes; those are shown as
    stored, with the run's ``error`` (first line) as detail. A run whose processes died without writing an end
    stays ``running`` in the table forever, but its server stops heart-beating (it heartbeats after every round):
    a ``running`` run whose ``last_heartbeat`` (else ``started_at``) is older than :func:`stale_after_s` of its
    slowest round (``rounds.wall_s``, ``None`` when it has none) is shown as ``interrupted``, with a detail that
    says so. ``now`` and the row's timestamps are UTC (naive ones are read as UTC).
    """
    stored = str(run_row["status"])
    if stored != "running":
        error = run_row.get("error")
        return EffectiveStatus(stored, error.strip().splitlines()[0] if isinstance(error, str) and error.strip() else None)
    last = as_utc(run_row.get("last_heartbeat") or run_row.get("started_at"))
    if last is None:
        return EffectiveStatus("running", None)
    silent_s = (as_utc(now) - last).total_seconds()
    limit_s = stale_after_s(slowest_round_wall_s)
    if silent_s <= limit_s:
        return EffectiveStatus("running", None)
    return EffectiveStatus(
        "interrupted",
        f"no heartbeat for {silent_s:.0f} s (the limit is {limit_s:.0f} s: max({STALE_AFTER_MIN_S:.0f} s, "
        f"{STALE_AFTER_SLOWEST_ROUNDS:g} × its slowest round)); its processes ended without finishing it",
    )
