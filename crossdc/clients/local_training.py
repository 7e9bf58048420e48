"""Local optimisation on one datacenter's data (also used by the single-datacenter baselines).

Promises: `train_steps(n)` runs exactly n optimizer steps; the optimizer state,
the inner step count (which drives the learning-rate schedule) and the position
in the (seeded, reshuffled every epoch) data order carry over between calls, so
several short calls equal one long call.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from crossdc.clients.devices import autocast
from crossdc.workloads import InnerOptions, Workload, load_model_weights, make_optimizer, model_weights, set_lr

#: the shortest sleep of the speed emulation (see LocalTrainer): the trainer runs ahead of its pace until this much
SLEEP_QUANTUM_S = 0.2
#: the speed emulation sleeps only after this many paced steps in a row (see LocalTrainer), so that every run of steps
#: between two sleeps has steps on warm caches to measure
STEPS_BETWEEN_SLEEPS = 3
#: which quantile of recent undisturbed step times the speed emulation takes as a step's time (see LocalTrainer)
PACED_STEP_QUANTILE = 0.1


@dataclass(frozen=True)
class StepsResult:
    """What `train_steps` did: mean loss over the steps, examples seen, seconds of compute."""

    steps: int
    mean_loss: float
    num_examples: int
    compute_s: float


class BatchStream:
    """Endless mini-batches over a dataset: a seeded permutation per epoch, no example repeated within an epoch."""

    def __init__(self, dataset: TensorDataset, batch_size: int, seed: int) -> None:
        if len(dataset) == 0:
            raise ValueError("cannot train on an empty dataset")
        self.tensors = dataset.tensors
        self.size = len(dataset)
        self.batch_size = min(batch_size, self.size)
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.size, generator=self.generator)
        self.position = 0

    def next(self) -> tuple[torch.Tensor, ...]:
        if self.position + self.batch_size > self.size:
            self.order = torch.randperm(self.size, generator=self.generator)
            self.position = 0
        index = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return tuple(t[index] for t in self.tensors)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "order": self.order.clone(), "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.order = state["order"].clone()
        self.position = int(state["position"])


class LocalTrainer:
    """One model, one optimizer, one data stream: the unit of local training.

    With `world` > 1 this is one rank of a data-parallel group (torch.distributed must be
    initialised): every rank draws the same global batch from the same seeded stream and
    trains on its own slice of it (rank r takes examples [r·B/W, (r+1)·B/W)), and
    DistributedDataParallel averages the gradients, so a step equals one step of a single
    process on the whole global batch (same batch semantics, same model, to float tolerance).
    The model lives on `device` (a rank's GPU, or the CPU); with ``precision = "bf16"`` each forward pass runs
    under bf16 autocast while weights, gradients and optimizer state stay fp32.

    `speed` s in (0, 1] (the datacenter's ``speed`` in the config) *emulates* a slower datacenter: the steps are
    paced so that each takes 1/s times a step's measured time on the wall clock — the trainer sleeps whenever it
    is ahead of that pace by at least SLEEP_QUANTUM_S and by STEPS_BETWEEN_SLEEPS paced steps, and at the end of the
    call until the pace is met; the sleep is part of the reported ``compute_s``. Nothing else changes (same steps,
    same maths). A step's time is
    :meth:`paced_step_s`, a low quantile of recent steps that did not follow a pause (:attr:`hot_step_s`): a step
    right after a sleep runs on cold caches and can take several times longer, and a step that shared its CPU with
    other work on a busy host takes longer too; multiplying either by 1/s would emulate a far slower datacenter than
    configured, and make the emulated speed depend on the host's load (1/s times its noise).
    With W > 1 ranks only rank 0 sleeps: the others wait for it in the next step's gradient all-reduce, so the
    whole group runs at the emulated speed (were every rank to sleep, each would also stretch the time it waited
    for the others' sleep, and the sleeps would grow without bound).

    Synchronous data parallel across datacenters (crossdc.clients.sync_dp_rank): `all_ranks` ranks in `datacenters`
    datacenters share one process group; `rank`/`world` stay the rank's place in its own datacenter (which slice of
    the datacenter's batch it takes). Each rank's objective is scaled by all_ranks / (datacenters · world), so the
    gradient DistributedDataParallel averages over all ranks is the mean over datacenters of each datacenter's batch
    gradient — the gradient of the datacenters' batches concatenated, whatever their worker counts.

    `options` tune the optimizer (:class:`crossdc.workloads.InnerOptions`): betas and weight decay at its
    construction; ``grad_clip`` bounds the global norm of each step's gradient (after `after_backward`, so a
    strategy's correction is clipped with it); the schedule sets each step's learning rate from :attr:`inner_steps`
    (this trainer's steps since the run began, saved with its state) over `horizon_steps`, the steps it will take
    in the whole run (required for a decaying schedule).
    """

    def __init__(self, workload: Workload, dataset: TensorDataset, batch_size: int, optimizer: str, lr: float, seed: int,
                 rank: int = 0, world: int = 1, device: str = "cpu", precision: str = "fp32", speed: float = 1.0,
                 all_ranks: int | None = None, datacenters: int = 1, options: InnerOptions | None = None,
                 horizon_steps: int | None = None) -> None:
        if batch_size % world:
            raise ValueError(f"the batch size {batch_size} must be divisible by the {world} local workers")
        if not 0.0 < speed <= 1.0:
            raise ValueError(f"speed must be in (0, 1], got {speed!r}")
        self.slowdown = 1.0 / speed - 1.0 if rank == 0 else 0.0  # seconds slept per second of measured step time
        #: durations of recent steps that did not follow a pause (the speed emulation's measure of a step)
        self.hot_step_s: deque[float] = deque(maxlen=256)
        torch.manual_seed(seed)
        self.workload = workload
        self.device, self.precision = torch.device(device), precision
        autocast(precision, device)  # an unknown precision fails here, not at the first step
        self.model = workload.make_model().to(self.device)
        self.rank, self.world = rank, world
        self.all_ranks = world if all_ranks is None else all_ranks
        self.objective_scale = self.all_ranks / (datacenters * world)
        self.forward: torch.nn.Module = self.model
        if self.all_ranks > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.forward = DistributedDataParallel(self.model, device_ids=ids)
        self.options = options or InnerOptions()
        schedule = self.options.schedule
        if schedule.kind != "constant" and horizon_steps is None:
            raise ValueError(f"a {schedule.kind} learning-rate schedule needs the run's length (horizon_steps)")
        schedule.check(lr, horizon_steps)
        self.base_lr, self.horizon_steps = lr, horizon_steps or 0
        self.optimizer = make_optimizer(optimizer, self.model.parameters(), lr, self.options)
        #: optimizer steps this trainer has taken since it was built (a liveness counter, not saved)
        self.steps_taken = 0
        #: optimizer steps since the run began (saved in state_dict; the learning-rate schedule counts these)
        self.inner_steps = 0
        self.stream = BatchStream(dataset, batch_size, seed)

    def set_weights(self, arrays: Mapping[str, np.ndarray]) -> None:
        load_model_weights(self.model, arrays)

    def get_weights(self) -> dict[str, np.ndarray]:
        return model_weights(self.model)

    def parameter_names(self) -> frozenset[str]:
        """Names of the trainable tensors (the rest of the weights are buffers)."""
        return frozenset(name for name, p in self.model.named_parameters() if p.requires_grad)

    def train_steps(self, steps: int, extra_loss: Any = None, after_backward: Any = None) -> StepsResult:
        """Run exactly `steps` optimizer steps (each stretched to 1/speed of its time, see the class doc).

        `extra_loss(model)` (optional) is added to each step's loss (not to the reported loss); `after_backward(model)`
        (optional) runs once the step's gradients are complete — with W > 1 ranks after DistributedDataParallel
        averaged them — and before the optimizer steps (a strategy's gradient correction)."""
        if steps < 1:
            raise ValueError(f"steps must be ≥ 1, got {steps}")
        self.model.train()
        total_loss, examples = 0.0, 0
        started = time.perf_counter()
        deadline, woke = started, True  # speed emulation: when the steps so far should end; the last step followed a pause
        for _ in range(steps):
            step_started = time.perf_counter()
            inputs, targets = self.stream.next()
            examples += int(inputs.shape[0])
            if self.world > 1:
                part = inputs.shape[0] // self.world
                inputs, targets = (t[self.rank * part : (self.rank + 1) * part] for t in (inputs, targets))
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            with autocast(self.precision, str(self.device)):
                loss = self.workload.loss(self.forward(inputs), targets)
            loss = loss.float()
            objective = loss if extra_loss is None else loss + extra_loss(self.model)
            (objective if self.objective_scale == 1.0 else objective * self.objective_scale).backward()
            if after_backward is not None:
                after_backward(self.model)
            if self.options.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.options.grad_clip)
            set_lr(self.optimizer, self.lr_now())
            self.optimizer.step()
            self.steps_taken += 1
            self.inner_steps += 1
            total_loss += float(loss.detach())
            if self.slowdown > 0.0:  # speed emulation: this step takes 1/speed times as long (see the class doc)
                took = time.perf_counter() - step_started
                if not woke:
                    self.hot_step_s.append(took)
                paced_s = (1.0 + self.slowdown) * (self.paced_step_s() if self.hot_step_s else took)
                deadline += paced_s
                ahead = deadline - time.perf_counter()
                # were it to sleep after every step (1/s times a step ≥ the quantum), no step would run on warm
                # caches, and the pace would keep the first steps' measure for good
                woke = ahead >= max(SLEEP_QUANTUM_S, STEPS_BETWEEN_SLEEPS * paced_s)
                if woke:
                    time.sleep(ahead)
        if self.slowdown > 0.0 and (ahead := deadline - time.perf_counter()) > 0.0:
            time.sleep(ahead)
        mean_loss = total_loss / steps
        if self.all_ranks > 1:  # the mean over ranks of equal slices is the global batch's mean loss
            import torch.distributed as dist

            summed = torch.tensor([mean_loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed)
            mean_loss = float(summed) / self.all_ranks
        return StepsResult(steps=steps, mean_loss=mean_loss, num_examples=examples, compute_s=time.perf_counter() - started)

    def paced_step_s(self) -> float:
        """The step time the speed emulation multiplies: the PACED_STEP_QUANTILE quantile of :attr:`hot_step_s`
        (0.0 before the first such step), a step's time on this host when nothing else ran on its CPU."""
        if not self.hot_step_s:
            return 0.0
        ordered = sorted(self.hot_step_s)
        return ordered[int(PACED_STEP_QUANTILE * (len(ordered) - 1))]

    def lr_now(self) -> float:
        """The learning rate of the next step (the schedule at :attr:`inner_steps`)."""
        return self.options.schedule.lr(self.inner_steps, self.base_lr, self.horizon_steps)

    def mean_lr(self, steps: int) -> float:
        """The mean learning rate of the next `steps` steps (what a round of that many steps is trained at)."""
        schedule = self.options.schedule
        if schedule.kind == "constant" and self.inner_steps >= schedule.warmup_steps:
            return self.base_lr  # exactly, not a sum of equal terms divided back
        return sum(schedule.lr(self.inner_steps + k, self.base_lr, self.horizon_steps) for k in range(steps)) / steps

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state, inner step count and data position (what must survive a restart), not the weights."""
        return {"optimizer": self.optimizer.state_dict(), "stream": self.stream.state_dict(),
                "inner_steps": self.inner_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.stream.load_state_dict(state["stream"])
        self.inner_steps = int(state.get("inner_steps", 0))  # a state saved before the count existed: 0
