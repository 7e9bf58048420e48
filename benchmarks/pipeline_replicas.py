"""Pipeline replicas synced by DiLoCo against one pipeline: what four datacenters get from being two pipelines of two
stages instead of one pipeline of four, or of two stages on two of them.

Every row is a real `crossdc run` of the `pipeline` strategy on Flower's Deployment Engine, each datacenter (one
stage) in its own network namespace, the activations and their gradients crossing an emulated 100 Mbps / 150 ms
`[[links]]` link between consecutive stages of a pipeline (gloo); the replicas' weights go to the coordinator and back
over Flower each round. The workload: the character transformer on Shakespeare (d_model 64, 2 heads, 4 blocks,
seq_len 64), batch 32 per pipeline in 4 micro-batches, AdamW 3e-3, GPipe, τ = 6 optimizer steps a round, 30 rounds,
evaluated every round on the shared validation set.

Rows:
- *1x2*: one pipeline of 2 stages on 2 datacenters (the other two idle);
- *1x4*: one pipeline of 4 stages on the 4 datacenters (one block each);
- *2x2-average*: 2 pipelines of 2 stages, synced each round by a plain average (outer lr 1, momentum 0);
- *2x2-diloco*: the same with DiLoCo's outer step (lr 0.7, Nesterov 0.9, the momentum warmed up over half the
  rounds, as the WAN benchmark's DiLoCo recipe).

Read back from SQL: the final validation loss (rounds.val_loss), the examples the run trained on (the first stages'
datacenter_rounds.num_examples), per round the median wall time (rounds.wall_s, rounds after the first), the
activation and gradient bytes across the pipelines' boundaries (pipeline_stages, the link ledger's count) and the
bytes of the replicas' sync (the datacenters' bytes up and down beyond their boundaries': fp32 weights).

Caveat: this machine has 2 cores; 4 stages cannot all compute at once, so the rows on 4 datacenters run slower per
step than they would on 4 machines: compare their losses at equal optimizer steps and their bytes, not their time.

Usage: python benchmarks/pipeline_replicas.py [--only KEY ...] (needs the namespace emulator: root). Writes
benchmarks/results/pipeline_replicas.json (rows not rerun with --only are kept) and prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results_file import merge_rows, write_results

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_datacenter_rounds, list_pipeline_stages, list_rounds
from crossdc.experiment.config import parse_config
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRun, LocalRunOptions

OUT = Path(__file__).parent / "results" / "pipeline_replicas.json"
DATACENTERS = ("us-east", "eu-west", "ap-south", "sa-east")
ROUNDS, TAU, BATCH, MICROBATCHES = 30, 6, 32, 4
LINK = {"bandwidth_mbps": 100.0, "rtt_ms": 150.0}


@dataclass(frozen=True)
class Row:
    key: str
    datacenters: int
    replicas: int
    outer: dict[str, float]


ROWS = [
    Row("1x2", 2, 1, {}),
    Row("1x4", 4, 1, {}),
    Row("2x2-average", 4, 2, {"outer_lr": 1.0, "outer_momentum": 0.0}),
    Row("2x2-diloco", 4, 2, {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_momentum_warmup_rounds": ROUNDS // 2}),
]


def config_doc(row: Row) -> dict[str, Any]:
    names = DATACENTERS[: row.datacenters]
    stages = row.datacenters // row.replicas
    pipelines = [names[r * stages:(r + 1) * stages] for r in range(row.replicas)]
    return {
        "run": {"name": f"pipeline-replicas-{row.key}", "rounds": ROUNDS, "seed": 0, "eval_every": 1,
                "round_timeout_s": 300},
        "workload": {"dataset": "shakespeare", "model": "char-transformer",
                     "model_args": {"d_model": 64, "heads": 2, "layers": 4, "seq_len": 64},
                     "batch_size": BATCH, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": "pipeline", "tau": TAU,
                     "params": {"microbatches": MICROBATCHES, "schedule": "gpipe", "stage_timeout_s": 60,
                                "replicas": row.replicas, **row.outer}},
        "datacenters": [{"name": name} for name in names],
        "links": [{"between": [a, b], **LINK} for pipeline in pipelines for a, b in zip(pipeline, pipeline[1:], strict=False)],
    }


def read_back(db_url: str, run_id: str) -> dict[str, Any]:
    """What SQL says of one row's run (see the module docstring)."""
    engine = make_engine(db_url)
    try:
        rounds, stages, dc_rounds = (list_rounds(engine, run_id), list_pipeline_stages(engine, run_id),
                                     list_datacenter_rounds(engine, run_id))
    finally:
        engine.dispose()
    boundary = sum(s["bytes_forward"] + s["bytes_backward"] for s in stages)
    moved = sum(r["bytes_up"] + r["bytes_down"] for r in dc_rounds)  # each boundary byte counted up and down
    return {"val_loss": rounds[-1]["val_loss"], "curve": [r["val_loss"] for r in rounds],
            "examples": sum(r["num_examples"] or 0 for r in dc_rounds),
            "round_wall_s": statistics.median(r["wall_s"] for r in rounds[1:]),
            "boundary_bytes_per_round": boundary / len(rounds),
            "sync_bytes_per_round": (moved - 2 * boundary) / len(rounds),
            "bubble": statistics.median(s["bubble_fraction"] for s in stages if s["round"] > 1)}


def run_row(row: Row, root: Path) -> dict[str, Any]:
    started = time.perf_counter()
    db_url = f"sqlite:///{root / f'{row.key}.db'}"
    options = LocalRunOptions(db_url=db_url, engine="deployment", superlink_port=free_port(), runs_root=root / row.key)
    result = LocalRun(parse_config(config_doc(row)), options).execute()
    figures = read_back(db_url, result.run_id)
    print(f"  {row.key:<12} val loss {figures['val_loss']:.4f}  ({time.perf_counter() - started:.0f}s)", flush=True)
    return {"key": row.key, "datacenters": row.datacenters, "replicas": row.replicas,
            "stages": row.datacenters // row.replicas, "outer": row.outer, **figures,
            "wall_s": time.perf_counter() - started, "load_after": os.getloadavg()}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| row | datacenters | pipelines × stages | outer step | examples | val loss | round (median) | "
             "boundary bytes / round | sync bytes / round | bubble |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: [row.key for row in ROWS].index(r["key"])):
        outer = ", ".join(f"{k} {v:g}" for k, v in r["outer"].items()) or "—"
        lines.append(f"| {r['key']} | {r['datacenters']} | {r['replicas']} × {r['stages']} | {outer} | "
                     f"{r['examples']:,} | {r['val_loss']:.4f} | {r['round_wall_s']:.2f} s | "
                     f"{r['boundary_bytes_per_round'] / 1e6:.2f} MB | {r['sync_bytes_per_round'] / 1e6:.2f} MB | "
                     f"{r['bubble']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=[row.key for row in ROWS], help="rows to (re)run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as where:
        fresh = [run_row(row, Path(where)) for row in ROWS if not args.only or row.key in args.only]
    rows = merge_rows(args.out, fresh, key=lambda r: r["key"])
    table = markdown(rows)
    write_results(args.out, {"date": time.strftime("%Y-%m-%d"), "rounds": ROUNDS, "tau": TAU, "link": LINK,
                             "rows": rows, "table_markdown": table, "wall_s": time.perf_counter() - started}, table)


if __name__ == "__main__":
    main()
