"""Following a run from its SQL log alone (`crossdc runs follow RUN_ID`): no process of the run need be ours.

`follow_run` promises: it reports each round once, in round order, to `progress` with the rounds the run planned
(``runs.rounds_planned``: "round 2/3", not "2/2"; :func:`rounds_to_report`), returns the run's summary once the run has
finished, and raises RunFailed when it failed, was interrupted, or went silent (a ``running`` run whose
heartbeat stopped: the dashboard's effective-status rule), or when no run has that id. The database may be
unreachable for a while; following goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import inspect
from sqlalchemy.exc import OperationalError

from crossdc.db.engine import make_engine, safe_url
from crossdc.db.queries import get_run, list_rounds, utcnow
from crossdc.db.status import effective_status
from crossdc.orchestration.local_run import RunFailed


def rounds_to_report(rows: list[dict[str, Any]], last_reported: int) -> list[dict[str, Any]]:
    """The ``rounds`` rows after round `last_reported`, by round: what a follower has not shown yet (a resumed run's
    rounds logged again are shown once it passes the last one shown)."""
    return sorted((row for row in rows if int(row["round"]) > last_reported), key=lambda row: int(row["round"]))


def follow_run(db_url: str, run_id: str, progress: Callable[[dict[str, Any], int], None] | None = None,
               poll_s: float = 1.0, max_outage_s: float = 300.0) -> dict[str, Any]:
    """Follow run `run_id` in the run log at `db_url` until it ends (see the module docstring); `progress(row,
    planned)` gets each new ``rounds`` row and the run's planned rounds."""
    engine = make_engine(db_url)
    reported = 0
    answered_at = time.monotonic()
    schema_checked = False
    try:
        while True:
            try:
                if not schema_checked:
                    if not inspect(engine).has_table("runs"):
                        raise RunFailed(f"no crossdc run log at {safe_url(db_url)} (no 'runs' table)")
                    schema_checked = True
                run = get_run(engine, run_id)
                rounds = list_rounds(engine, run_id)
                answered_at = time.monotonic()
            except OperationalError as err:
                if time.monotonic() - answered_at > max_outage_s:
                    raise RunFailed(f"the database has not answered for {max_outage_s:.0f}s: {str(err).splitlines()[0]}") from None
                time.sleep(poll_s)
                continue
            if run is None:
                raise RunFailed(f"no run '{run_id}' in the run log")
            if progress is not None:
                for row in rounds_to_report(rounds, reported):
                    progress(row, int(run["rounds_planned"]))
                    reported = int(row["round"])
            slowest = max((r["wall_s"] for r in rounds if r.get("wall_s") is not None), default=None)
            status, detail = effective_status(run, slowest, utcnow())
            if status == "finished":
                return dict(run.get("result") or {"run_id": run_id})
            if status != "running":
                raise RunFailed(f"run {run_id} {status}: {detail or run.get('error') or 'see the run log'}")
            time.sleep(poll_s)
    finally:
        engine.dispose()
