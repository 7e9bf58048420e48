"""Where a round's time goes: compute, communication (measured at the link relay) and overhead.

Runs a small federation on Flower's Deployment Engine (or reads an existing run
from a database) and reports, per datacenter and round, the median and spread
of round_s = compute_s + comm_s + overhead_s. Writes JSON to
benchmarks/results/round_breakdown.json and prints a table.

    python benchmarks/round_breakdown.py                      # 6-round synthetic run, 2 datacenters
    python benchmarks/round_breakdown.py --config examples/shakespeare-4dc.toml --rounds 4
    python benchmarks/round_breakdown.py --db sqlite:///crossdc.db --run-id RUN_ID   # e.g. the demo's run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

from crossdc.db.engine import make_engine
from crossdc.db.queries import get_run, list_datacenter_rounds
from crossdc.experiment.config import load_config, with_rounds
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRunOptions, run_local

HERE = Path(__file__).resolve().parent
FIELDS = ("round_s", "compute_s", "comm_s", "overhead_s")


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max of each duration over the accepted (datacenter, round) rows."""
    out: dict[str, dict[str, float]] = {}
    for field in FIELDS:
        values = [float(r[field]) for r in rows if r["status"] == "ok" and r.get(field) is not None]
        if values:
            out[field] = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE.parent / "examples" / "synthetic-2dc.toml"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--db", help="read an existing run from this database instead of running one")
    parser.add_argument("--run-id")
    parser.add_argument("--out", default=str(HERE / "results" / "round_breakdown.json"))
    args = parser.parse_args()
    if args.db:
        if not args.run_id:
            parser.error("--db needs --run-id")
        db_url, run_id, source = args.db, args.run_id, f"existing run {args.run_id}"
    else:
        tmp = Path(tempfile.mkdtemp(prefix="crossdc-bench-"))
        db_url = f"sqlite:///{tmp / 'bench.db'}"
        config = with_rounds(load_config(args.config), args.rounds)
        result = run_local(config, LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=tmp / "runs"))
        run_id, source = result.run_id, f"{Path(args.config).name}, {args.rounds} rounds"
    engine = make_engine(db_url)
    try:
        run = get_run(engine, run_id)
        rows = list_datacenter_rounds(engine, run_id)
    finally:
        engine.dispose()
    stats = summarize(rows)
    report = {"source": source, "run_id": run_id, "strategy": run["strategy"] if run else None,
              "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
              "per_datacenter_round": stats}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"round time breakdown — {source} (run {run_id})")
    print(f"{'':<12}{'median s':>10}{'min s':>10}{'max s':>10}{'share':>8}")
    total = stats.get("round_s", {}).get("median", float("nan"))
    for field in FIELDS:
        if field in stats:
            s = stats[field]
            print(f"{field:<12}{s['median']:>10.3f}{s['min']:>10.3f}{s['max']:>10.3f}{100 * s['median'] / total:>7.1f}%")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
