"""A non-zero local rank of a datacenter's worker group (see crossdc.clients.trainer).

Started by rank 0 (the trainer that talks to the ClientApp) with its rank, the group size and a
rendezvous file; builds the same local trainer on its slice of every global batch (its own GPU with NCCL, or the CPU with gloo) and follows
rank 0's commands, received by broadcast, until told to stop or until rank 0 goes away.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from crossdc import protocol as proto
from crossdc.clients.devices import local_placement
from crossdc.clients.local_round import TRAINER_STATE_KEY, train_with_plan
from crossdc.clients.local_training import LocalTrainer, StepsResult
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.experiment.builders import build_strategy, build_workload, datacenter_seed
from crossdc.experiment.config import inner_steps_planned, parse_config
from crossdc.experiment.processes import die_with_run_root
from crossdc.experiment.rundir import RunDir
from crossdc.strategies.base import Strategy

log = logging.getLogger("crossdc.worker")

GROUP_TIMEOUT = timedelta(seconds=120)
__all__ = ["GROUP_TIMEOUT", "TRAINER_STATE_KEY", "GroupTrainer", "backend", "build_rank", "follow", "use_device"]


def build_rank(run_dir: RunDir, datacenter: str, rank: int, world: int) -> tuple[LocalTrainer, DatacenterStateStore, int, Strategy]:
    """This rank's local trainer (at the datacenter's configured ``speed``), restored from the datacenter's state
    store, and the run's strategy (its datacenter half); (trainer, store, last round, strategy)."""
    settings = run_dir.settings()
    config = parse_config(settings["config"])
    strategy = build_strategy(config)
    workload = build_workload(config)
    w = config.workload
    speed = next(dc.speed for dc in config.datacenters if dc.name == datacenter)
    trainer = LocalTrainer(workload, workload.shard(datacenter), w.batch_size, w.optimizer, w.lr,
                           datacenter_seed(config, datacenter), rank=rank, world=world,
                           device=local_placement(rank, world).device, precision=w.precision, speed=speed,
                           options=w.options, horizon_steps=inner_steps_planned(config))
    store = DatacenterStateStore(run_dir.state_root, settings["run_id"], datacenter)
    last_round = 0
    stored = store.load(TRAINER_STATE_KEY)
    if stored is not None:
        state, last_round = stored
        trainer.load_state_dict(state)
    return trainer, store, last_round, strategy


def backend(world: int) -> str:
    """The collective backend of a group of `world` local ranks on this machine: NCCL on GPUs, gloo on the CPU."""
    return local_placement(0, world).backend


def use_device(rank: int, world: int) -> None:
    """Make this rank's GPU the current CUDA device (NCCL's collectives and object broadcasts use it)."""
    device = torch.device(local_placement(rank, world).device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def follow(trainer: LocalTrainer, strategy: Strategy) -> None:
    """Run rank 0's commands until "stop": each "train" (a round) with the strategy's hooks, built from rank 0's
    plan; in a streaming run, what :class:`GroupTrainer` hands on ("steps", "set-weights", "load-state")."""
    while True:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if not isinstance(command, dict) or command.get("op") == proto.STOP_OP:
            return
        op = command.get("op")
        if op == proto.TRAIN_OP:
            train_with_plan(strategy, trainer, int(command["tau"]), command["weights"], command.get("plan") or {})
        elif op == proto.STEPS_OP:
            trainer.train_steps(int(command["steps"]))
        elif op == proto.SET_WEIGHTS_OP:
            trainer.set_weights(command["weights"])
        elif op == proto.LOAD_STATE_OP:
            trainer.load_state_dict(command["state"])


class GroupTrainer:
    """Rank 0's local trainer, whose every inner step and every change of its weights or state the group's other
    ranks make too: a streaming replica drives a datacenter of W ranks through it as it drives one LocalTrainer.

    Promises: :meth:`train_steps`, :meth:`set_weights` and :meth:`load_state_dict` hand the same command to the other
    ranks (by `broadcast`, which they :func:`follow`) before rank 0 does it, so every rank runs the same steps
    (DistributedDataParallel averages their gradients: one step on the whole global batch) from the same weights;
    the weights and state read from rank 0 are every rank's."""

    def __init__(self, trainer: LocalTrainer, broadcast: Callable[[dict[str, Any]], None]) -> None:
        self.trainer, self.broadcast = trainer, broadcast

    def train_steps(self, steps: int, **hooks: Any) -> StepsResult:
        if hooks:
            raise ValueError("a worker group's streaming replica runs plain inner steps (no strategy hooks)")
        self.broadcast({"op": proto.STEPS_OP, "steps": steps})
        return self.trainer.train_steps(steps)

    def set_weights(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.broadcast({"op": proto.SET_WEIGHTS_OP, "weights": dict(arrays)})
        self.trainer.set_weights(arrays)

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.trainer.get_weights()

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.broadcast({"op": proto.LOAD_STATE_OP, "state": dict(state)})
        self.trainer.load_state_dict(state)


def main(argv: list[str] | None = None) -> None:
    die_with_run_root()
    parser = argparse.ArgumentParser(description="crossdc local worker (a non-zero rank of a datacenter's group)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--datacenter", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(max(1, int(os.environ.get("CROSSDC_TRAINER_THREADS", "1"))))
    use_device(args.rank, args.world)
    dist.init_process_group(backend(args.world), init_method=f"file://{args.rendezvous}", rank=args.rank, world_size=args.world,
                            timeout=GROUP_TIMEOUT)
    try:
        trainer, _, _, strategy = build_rank(RunDir(Path(args.run_dir)), args.datacenter, args.rank, args.world)
        follow(trainer, strategy)
    except Exception as err:  # rank 0 went away or the group broke: this rank ends, rank 0 decides
        log.warning("rank %d of %s stops: %s", args.rank, args.datacenter, err)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":
    main()
