"""Local training speed of a datacenter's worker group: W = 1 and W = 2 ranks (gloo on CPU, NCCL on GPU).

Starts the real persistent trainer (crossdc.clients.trainer) for one datacenter of the Shakespeare
char-transformer experiment, as `crossdc run` does, and measures:
- the worker group's start-up cost (paid once per run, not per round: the group lives across rounds),
- local optimizer steps per second at the same global batch, median over rounds,
- the per-round cost outside local compute seen by the ClientApp's call (hand-over, state save).

    python benchmarks/local_workers.py [--workers 1 2] [--tau 20] [--rounds 4] [--batch 32]

Writes benchmarks/results/local_workers.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crossdc.clients.channel import call_trainer
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.rundir import RunDir
from crossdc.workloads import model_weights

HERE = Path(__file__).resolve().parent


def experiment(workers: int, batch: int) -> dict:
    return {
        "run": {"name": "local-workers", "rounds": 10, "seed": 0},
        "workload": {"dataset": "shakespeare", "model": "char-transformer", "partition": {"kind": "natural"},
                     "batch_size": batch, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": "fedavg", "tau": 1},
        "datacenters": [{"name": "dc-a", "workers": workers}, {"name": "dc-b"}],
    }


def measure(workers: int, tau: int, rounds: int, batch: int) -> dict:
    doc = experiment(workers, batch)
    config = parse_config(doc)
    weights = model_weights(initial_model(config, build_workload(config)))
    run_dir = RunDir(Path(tempfile.mkdtemp(prefix=f"crossdc-w{workers}-")))
    run_dir.create({"run_id": "bench", "db_url": "sqlite://", "config": doc})
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "crossdc.clients.trainer", "--run-dir", str(run_dir.path), "--datacenter", "dc-a"],
                               stdout=open(run_dir.path / "trainer.log", "wb"), stderr=subprocess.STDOUT, env={**os.environ})
    try:
        ping = call_trainer(run_dir.trainer_socket("dc-a"), run_dir.authkey(), {"op": "ping"}, connect_timeout_s=300)
        ready_s = time.perf_counter() - started
        steps_per_s, outside = [], []
        for r in range(1, rounds + 1):
            called = time.perf_counter()
            answer = call_trainer(run_dir.trainer_socket("dc-a"), run_dir.authkey(),
                                  {"op": "train", "run_id": "bench", "round": r, "tau": tau, "weights": weights})
            wall = time.perf_counter() - called
            compute = answer["metrics"]["compute-s"]
            steps_per_s.append(tau / compute)
            outside.append((wall - compute) / wall)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        run_dir.remove_sockets()
    return {"workers": workers, "batch": batch, "tau": tau, "process_to_ready_s": ready_s, "group_start_s": ping["group_start_s"],
            "steps_per_s_median": statistics.median(steps_per_s[1:] or steps_per_s),
            "outside_compute_fraction_median": statistics.median(outside[1:] or outside), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tau", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=str(HERE / "results" / "local_workers.json"))
    args = parser.parse_args()
    rows = [measure(w, args.tau, args.rounds, args.batch) for w in args.workers]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "cpus": os.cpu_count()}, indent=1))
    print(f"{'W':>3}{'start-up s (process → ready)':>30}{'of which group s':>18}{'steps/s':>10}{'outside compute':>17}")
    for r in rows:
        print(f"{r['workers']:>3}{r['process_to_ready_s']:>30.2f}{r['group_start_s']:>18.2f}{r['steps_per_s_median']:>10.1f}"
              f"{100 * r['outside_compute_fraction_median']:>16.1f}%")
    print("(medians over rounds after the first; the start-up is paid once per run)")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
