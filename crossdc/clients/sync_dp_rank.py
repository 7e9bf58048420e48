"""One rank of the synchronous data-parallel baseline (``crossdc run CONFIG --baseline sync-dp``).

Every datacenter's workers are ranks of one torch.distributed group (gloo) that spans the datacenters, so
DistributedDataParallel all-reduces the gradients at every step across the WAN — each rank in its
datacenter's network namespace, the all-reduce crossing the emulated links. Each datacenter trains on its
own shard with its own data order, exactly as in the federation (crossdc.clients.local_training.LocalTrainer
with ``all_ranks``/``datacenters``); every rank starts from the federation's initial weights.

The rank runs the federation's schedule: in "round" r it takes the strategy's τ(r) optimizer steps. After each
round it appends one JSON line to its report file: when the round started and ended (wall clock), its steps, its
compute time (the steps' time less the time spent waiting for the gradient all-reduce, timed around DDP's
communication) and its training loss; the first rank also evaluates on the validation set (every
``eval_every`` rounds and after the last) and, at the end, saves the final weights. It never touches the
database: the driver (crossdc.orchestration.sync_dp), in the root namespace, logs the reports with the
link measurements of the delay line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from crossdc.clients.local_training import LocalTrainer
from crossdc.experiment.builders import build_strategy, build_workload, datacenter_seed, initial_model
from crossdc.experiment.config import inner_steps_planned, parse_config
from crossdc.experiment.rundir import RunDir
from crossdc.wan.ledger import union_length
from crossdc.workloads import evaluate, model_weights

log = logging.getLogger("crossdc.sync_dp")

GROUP_TIMEOUT = timedelta(minutes=30)
FINAL_WEIGHTS = "sync-dp-final.npz"


class CommunicationTimer:
    """Times DistributedDataParallel's gradient all-reduce: a DDP communication hook (the default all-reduce, mean over
    the group) that records when each bucket's all-reduce was launched and when it completed."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations at run time: none here
        """The hook for ``DistributedDataParallel.register_comm_hook`` (state: the process group, None = default)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        launched = time.perf_counter()
        future = default_hooks.allreduce_hook(state, bucket)

        def completed(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.intervals.append((launched, time.perf_counter()))
            return done.value()

        return future.then(completed)

    def take_waiting_s(self) -> float:
        """The length of the union of the recorded intervals (time the rank had an all-reduce outstanding); resets."""
        waiting = union_length(self.intervals)
        self.intervals.clear()
        return waiting


def report_path(run_dir: RunDir, rank: int) -> Path:
    return run_dir.logs / f"sync-dp-rank-{rank}.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="crossdc synchronous data-parallel rank")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--datacenter", required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True, help="HOST:PORT of the group's rendezvous (the first rank's address)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(max(1, int(os.environ.get("CROSSDC_TRAINER_THREADS", "1"))))
    run_dir = RunDir(Path(args.run_dir))
    config = parse_config(run_dir.settings()["config"])
    dc = next(d for d in config.datacenters if d.name == args.datacenter)
    workload = build_workload(config)
    strategy = build_strategy(config)
    w = config.workload
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
                            timeout=GROUP_TIMEOUT)
    try:
        trainer = LocalTrainer(workload, workload.shard(dc.name), w.batch_size, w.optimizer, w.lr,
                               datacenter_seed(config, dc.name), rank=args.local_rank, world=dc.workers,
                               precision=w.precision, speed=dc.speed, all_ranks=args.world,
                               datacenters=len(config.datacenters), options=w.options,
                               horizon_steps=inner_steps_planned(config))
        trainer.set_weights(model_weights(initial_model(config, workload)))
        timer = CommunicationTimer()
        trainer.forward.register_comm_hook(None, timer.hook)  # type: ignore[operator]
        with open(report_path(run_dir, args.rank), "a") as report:
            for server_round in range(1, config.run.rounds + 1):
                steps = strategy.tau(server_round)
                started, started_clock = time.time(), time.perf_counter()
                result = trainer.train_steps(steps)
                took = time.perf_counter() - started_clock
                line: dict[str, Any] = {"round": server_round, "datacenter": dc.name, "rank": args.rank,
                                        "started": started, "ended": time.time(), "steps": steps,
                                        "compute_s": max(0.0, took - timer.take_waiting_s()),
                                        "train_loss": result.mean_loss}
                if args.rank == 0 and (server_round % config.run.eval_every == 0 or server_round == config.run.rounds):
                    eval_started = time.perf_counter()
                    line["val_loss"], line["val_accuracy"] = evaluate(workload, trainer.model)
                    line["eval_s"] = time.perf_counter() - eval_started
                report.write(json.dumps(line) + "\n")
                report.flush()
        if args.rank == 0:
            np.savez(run_dir.path / FINAL_WEIGHTS, **trainer.get_weights())
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
