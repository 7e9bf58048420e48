"""Latency of the operators' service on a long run, while the run goes on being written.

Fills a database with one run of 10,000 rounds × 16 datacenters (bulk insert), starts the real service
(`crossdc serve`), starts a writer process that keeps logging rounds through the run log (`RunLog`, as a
server does, but two rounds a second: twenty times the pace of the demo's rounds), and measures over HTTP the p50/p95 latency of:

* ``/api/runs/{id}/rounds``: the first page (1000 rounds) and a refresh (``since_round`` = newest − 5);
* ``/api/runs/{id}/datacenter-rounds``: the first page (50 rounds × 16 datacenters = 800 rows) and a refresh;
  the same for one datacenter (``datacenter=``);
* ``/api/runs/{id}``, ``/api/runs``, ``/metrics``;
* the run page ``/runs/{id}`` when the pages router serves it (else a note says it was skipped).

on SQLite and PostgreSQL. The goal is p95 < 100 ms for the API. Writes JSON to
benchmarks/results/dashboard_latency.json and prints a table (medians first).

What makes a page cheap whatever the length of the run: every page is cut by a cursor on the logical clock
(``round > since_round ... LIMIT``), so it is an index range scan, never an offset scan. The unique keys
``rounds (run_id, round)`` and ``datacenter_rounds (run_id, round, datacenter)`` serve the pages in round
order; revision 0003 adds ``rounds (run_id, wall_s)`` (a run's slowest round, needed for its effective
status on every run read, in one index seek instead of a scan of all its rounds: 2.5 ms → 0.3 ms on SQLite
for 10,000 rounds), ``datacenter_rounds (run_id, datacenter, round)`` (one datacenter's rows without reading
the other fifteen) and ``events (run_id, id)`` (PostgreSQL's index on run_id alone does not keep logging order).
Past the indexes, the time of a big page is Python's: the pages' rows are cleaned column by column (only float
columns checked for NaN, only timestamps converted) and serialised straight to JSON rather than validated again
into response models (the models stay the OpenAPI contract the tests check answers against): 1600 rows went
from 31 ms to 17 ms in process. A first page of datacenter rounds is 50 rounds by default (800 rows, 260 kB at
16 datacenters); refreshes ask with since_round and get a few rows.

    python benchmarks/dashboard_latency.py                      # both backends
    python benchmarks/dashboard_latency.py --backends sqlite --requests 50
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import insert
from sqlalchemy.engine import make_url

from crossdc.db.engine import make_engine, upgrade
from crossdc.db.models import DATACENTER_ROUNDS, EVENTS, ROUNDS, RUNS
from crossdc.db.runlog import RunLog
from crossdc.experiment.processes import free_port, wait_for_port

HERE = Path(__file__).resolve().parent
RUN_ID = "bench-run"
PG_ADMIN_URL = os.environ.get("CROSSDC_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
GOAL_P95_MS = 100.0


# ------------------------------------------------------------------ the data


def datacenter_names(n: int) -> list[str]:
    return [f"dc-{i:02d}" for i in range(n)]


def round_row(run_id: str, r: int) -> dict[str, Any]:
    return dict(run_id=run_id, round=r, tau=5, val_loss=2.0 / (1 + r) if r % 5 == 0 else None,
                val_accuracy=min(0.99, r / 12000) if r % 5 == 0 else None, bytes_up=16 * 409_600,
                bytes_down=16 * 1_638_400, bytes_up_raw=16 * 1_638_400, wall_s=1.2 + (r % 7) / 10, eval_s=0.05)


def datacenter_round_row(run_id: str, r: int, dc: str, i: int) -> dict[str, Any]:
    return dict(run_id=run_id, round=r, datacenter=dc, status="ok" if (r + i) % 97 else "timeout",
                reason=None if (r + i) % 97 else "no reply within the round's 30s", bytes_up=409_600,
                bytes_down=1_638_400, bytes_up_raw=1_638_400, compute_s=1.0 + i / 100, comm_s=0.08, overhead_s=0.05,
                round_s=1.13 + i / 100, comm_source="relay", link_bytes_up=410_000, link_bytes_down=1_640_000,
                train_loss=1.0 / (1 + r), num_examples=3200, drift_l2=0.01 * i, update_cosine=0.9, staleness=0)


def fill(url: str, rounds: int, datacenters: int) -> float:
    """Migrate and bulk-insert one running run of `rounds` × `datacenters` (plus some events); seconds taken."""
    started = time.perf_counter()
    upgrade(url)
    names = datacenter_names(datacenters)
    now = datetime.now(UTC)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(insert(RUNS), [dict(
                id=RUN_ID, name="bench-16dc", strategy="fedavg", config={"datacenters": [{"name": n} for n in names]},
                status="running", started_at=now - timedelta(hours=4), finished_at=None, flower_run_ids="1",
                baseline="none", rounds_planned=10 * rounds, error=None, last_heartbeat=now, result=None)])
            for start in range(1, rounds + 1, 1000):
                block = range(start, min(rounds, start + 999) + 1)
                conn.execute(insert(ROUNDS), [round_row(RUN_ID, r) for r in block])
                conn.execute(insert(DATACENTER_ROUNDS),
                             [datacenter_round_row(RUN_ID, r, dc, i) for r in block for i, dc in enumerate(names)])
                conn.execute(insert(EVENTS), [dict(run_id=RUN_ID, at=now, round=r, kind="timeout", datacenter=names[0],
                                                   detail="no reply") for r in block if r % 97 == 0])
    finally:
        engine.dispose()
    return time.perf_counter() - started


def keep_writing(url: str, first_round: int, datacenters: int, interval_s: float, stop: Any, written: Any) -> None:
    """The concurrent writer (own process): one round (its datacenters' rows, the round, a heartbeat) per interval."""
    names = datacenter_names(datacenters)
    with RunLog(url) as log:
        r = first_round
        while not stop.is_set():
            for i, dc in enumerate(names):
                row = datacenter_round_row(RUN_ID, r, dc, i)
                row.pop("run_id"), row.pop("round"), row.pop("datacenter")
                log.log_datacenter_round(run_id=RUN_ID, round=r, datacenter=dc, **row)
                log.touch_datacenter(name=dc)
            row = round_row(RUN_ID, r)
            row.pop("run_id"), row.pop("round")
            log.log_round(run_id=RUN_ID, round=r, **row)
            log.heartbeat(run_id=RUN_ID)
            log.flush(timeout=30)
            written.value = r
            r += 1
            stop.wait(interval_s)


# ------------------------------------------------------------- the backends


@contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="crossdc-dashboard-bench-") as tmp:
        yield f"sqlite:///{Path(tmp) / 'bench.db'}"


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    import psycopg

    admin = make_url(admin_url)
    name = f"crossdc_bench_{uuid.uuid4().hex[:12]}"
    conn = psycopg.connect(host=admin.host or "127.0.0.1", port=admin.port or 5432, user=admin.username or "postgres",
                           password=admin.password, dbname=admin.database or "postgres", autocommit=True)
    try:
        conn.execute(f'CREATE DATABASE "{name}"')
        yield admin.set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@contextmanager
def served(url: str, log_path: Path) -> Iterator[str]:
    """`crossdc serve` on a free port; its base URL."""
    port = free_port()
    crossdc = str(Path(sys.executable).with_name("crossdc"))
    with open(log_path, "wb") as log:
        process = subprocess.Popen([crossdc, "serve", "--port", str(port), "--db", url], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"crossdc serve exited with {process.returncode}; see {log_path}")
                try:
                    wait_for_port("127.0.0.1", port, 0.5)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# -------------------------------------------------------------- measurement


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation (statistics.quantiles' 'inclusive' method)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def serves_run_page(base: str) -> bool:
    """Whether the service has a run page at /runs/{id} (the pages router answers it; without one: a JSON 404)."""
    response = httpx.get(f"{base}/runs/{RUN_ID}", timeout=120)
    return response.status_code == 200 and response.headers.get("content-type", "").startswith("text/html")


def measure(base: str, requests: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Round-robin over the endpoints, `requests` timed requests each (after 3 untimed ones); per endpoint stats."""
    newest = {"round": rounds}

    def refresh_since() -> str:
        return str(max(0, newest["round"] - 5))

    endpoints: dict[str, Callable[[], str]] = {
        "rounds (first page, 1000 rounds)": lambda: f"/api/runs/{RUN_ID}/rounds",
        "rounds (refresh, since_round=newest-5)": lambda: f"/api/runs/{RUN_ID}/rounds?since_round={refresh_since()}",
        "datacenter-rounds (first page, 50 rounds x 16 dc)": lambda: f"/api/runs/{RUN_ID}/datacenter-rounds",
        "datacenter-rounds (refresh, since_round=newest-5)":
            lambda: f"/api/runs/{RUN_ID}/datacenter-rounds?since_round={refresh_since()}",
        "datacenter-rounds (one dc, refresh)":
            lambda: f"/api/runs/{RUN_ID}/datacenter-rounds?datacenter=dc-07&since_round={refresh_since()}",
        "run (/api/runs/{id})": lambda: f"/api/runs/{RUN_ID}",
        "runs list (/api/runs)": lambda: "/api/runs",
        "metrics (/metrics)": lambda: "/metrics",
    }
    if serves_run_page(base):
        endpoints["run page (/runs/{id})"] = lambda: f"/runs/{RUN_ID}"
    samples: dict[str, list[float]] = {name: [] for name in endpoints}
    sizes: dict[str, list[int]] = {name: [] for name in endpoints}
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(requests + 3):
            for name, path in endpoints.items():
                started = time.perf_counter()
                response = client.get(path())
                elapsed_ms = 1000 * (time.perf_counter() - started)
                if response.status_code != 200:
                    raise RuntimeError(f"GET {path()} answered {response.status_code}: {response.text[:300]}")
                if name.startswith("rounds (refresh") and response.json()["next_since_round"] is not None:
                    newest["round"] = max(newest["round"], response.json()["next_since_round"])
                if i >= 3:
                    samples[name].append(elapsed_ms)
                    sizes[name].append(len(response.content))
    return {name: {"p50_ms": round(statistics.median(v), 2), "p95_ms": round(percentile(v, 0.95), 2),
                   "max_ms": round(max(v), 2), "n": len(v), "median_bytes": int(statistics.median(sizes[name]))}
            for name, v in samples.items()}


def bench_backend(backend: str, url: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    fill_s = fill(url, args.rounds, args.datacenters)
    print(f"{backend}: filled {args.rounds} rounds x {args.datacenters} datacenters in {fill_s:.1f}s", file=sys.stderr)
    ctx = multiprocessing.get_context("spawn")
    stop, written = ctx.Event(), ctx.Value("q", 0)
    writer = ctx.Process(target=keep_writing, args=(url, args.rounds + 1, args.datacenters, args.write_interval, stop, written))
    with served(url, workdir / f"serve-{backend}.log") as base:
        writer.start()
        try:
            time.sleep(1.0)  # the writer is under way
            started = time.perf_counter()
            endpoints = measure(base, args.requests, args.rounds)
            measured_s = time.perf_counter() - started
        finally:
            stop.set()
            writer.join(timeout=60)
    rounds_written = max(0, int(written.value) - args.rounds)
    if writer.exitcode != 0:
        raise RuntimeError(f"the writer process failed (exit code {writer.exitcode})")
    return {"fill_s": round(fill_s, 2), "measured_s": round(measured_s, 1), "rounds_written_meanwhile": rounds_written,
            "endpoints": endpoints}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--datacenters", type=int, default=16)
    parser.add_argument("--requests", type=int, default=100, help="timed requests per endpoint")
    parser.add_argument("--write-interval", type=float, default=0.5, help="seconds between the writer's rounds")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL)
    parser.add_argument("--out", default=str(HERE / "results" / "dashboard_latency.json"))
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    notes: list[str] = []
    report: dict[str, Any] = {
        "what": f"p50/p95 latency over HTTP (crossdc serve, one process) of a run with {args.rounds} rounds x "
                f"{args.datacenters} datacenters while a writer logs a round every {args.write_interval:g}s",
        "goal": f"API p95 < {GOAL_P95_MS:g} ms",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rounds": args.rounds, "datacenters": args.datacenters, "requests_per_endpoint": args.requests,
        "write_interval_s": args.write_interval, "notes": notes, "backends": {},
    }
    with tempfile.TemporaryDirectory(prefix="crossdc-dashboard-bench-logs-") as tmp:
        for backend in backends:
            database = sqlite_database() if backend == "sqlite" else postgres_database(args.pg_admin_url)
            with database as url:
                report["backends"][backend] = bench_backend(backend, url, args, Path(tmp))
                if "run page (/runs/{id})" not in report["backends"][backend]["endpoints"]:
                    notes.append(f"{backend}: the run page /runs/{{id}} was skipped: the service does not serve it (yet)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(report["what"])
    header = f"{'endpoint':<52}" + "".join(f"{b + ' p50':>17}{b + ' p95':>17}" for b in backends)
    print(header)
    names = list(dict.fromkeys(n for b in backends for n in report["backends"][b]["endpoints"]))
    for name in names:
        cells = ""
        for b in backends:
            stats = report["backends"][b]["endpoints"].get(name)
            cells += f"{stats['p50_ms']:>14.1f} ms{stats['p95_ms']:>14.1f} ms" if stats else f"{'-':>17}{'-':>17}"
        print(f"{name:<52}{cells}")
    for b in backends:
        print(f"{b}: {report['backends'][b]['rounds_written_meanwhile']} rounds written during the measurement "
              f"({report['backends'][b]['measured_s']} s)")
    for note in notes:
        print(f"note: {note}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
