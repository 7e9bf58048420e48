"""One datacenter's stage of a pipeline run: its blocks of the model, their optimizer, and its place in the schedule.

Promises:

- a :class:`StageRunner` holds stage ``index`` of ``stages``: the model's blocks that
  crossdc.strategies.pipeline.stage_blocks gives it (crossdc.workloads.stages.split_model: the same parameters as
  the unsplit model's, so chaining the stages computes the model exactly), wrapped in the boundary codec's modules
  (crossdc.compression.activations: the encoder at its end unless it is the last stage, the decoder at its start
  unless it is the first), and an optimizer over its own parameters only;
- the stages form one torch.distributed group (gloo, rank = stage index) whose every operation times out after
  ``timeout_s``: a dead or unreachable stage fails the others' step within that time, with a
  :class:`StageFailed` naming the stage, never a hang; after a failure the group is gone and the next call
  (:meth:`StageRunner.train_steps`) forms it again; each forming (``generation``, the run's attempt) meets at its own
  rendezvous port, so stages that re-form at different moments never meet in the forming that is going away;
- each optimizer step runs the schedule (``gpipe`` or ``1f1b``: the compute order of torch.distributed.pipelining's
  ScheduleGPipe and Schedule1F1B, on torch's PipelineStage) over ``microbatches`` equal micro-batches of one
  batch, with every receive of the step posted when it starts (:class:`PrepostedSchedule`: a crossing costs a
  one-way delay, not gloo's round trip), averages the micro-batches' gradients (the whole batch's mean loss, as the
  unsplit model) and steps the optimizer: the same update as the unsplit model on that batch, up to float rounding
  and what the codec loses;
- the data: the first stage draws the batches from the workload's whole training set (datacenter partitions do not
  apply to a pipeline: every example passes through every stage), in the seeded order of
  crossdc.clients.local_training.BatchStream; the last stage draws the same batches from the same seed and keeps
  only their targets, so no target ever crosses the WAN; middle stages draw nothing;
- what a round did (:class:`StageRound`): the compute seconds of every micro-batch's forward and backward (spans
  on this machine's wall clock, with the micro-batch and the run's step), the wall time of the steps, the bytes this
  stage sent forward (activations to the next stage) and backward (gradients to the previous one), the last stage's
  mean micro-batch loss, and the order in which it ran its forwards and backwards;
- :meth:`StageRunner.state_dict` holds everything a restarted stage needs to go on bit for bit (its weights, the
  optimizer, the data position, the step counter); :meth:`StageRunner.weights` its weights under the unsplit
  model's names.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from crossdc.clients.local_training import BatchStream
from crossdc.compression.activations import boundary_modules
from crossdc.strategies.pipeline import schedule_order
from crossdc.workloads import InnerOptions, Workload, make_optimizer, set_lr
from crossdc.workloads.stages import split_model, stage_tensors

log = logging.getLogger("crossdc.pipeline")

FORWARD, BACKWARD = "forward", "backward"


#: how many consecutive ports, from the master's, the formings of a group take in turn
RENDEZVOUS_PORTS = 16


class StageFailed(RuntimeError):
    """A pipeline step failed at this stage (a peer died, a link was cut longer than the timeout, bad input); the
    message names the stage and what failed."""


@dataclass(frozen=True)
class StageSettings:
    """Where a stage sits and how the pipeline runs (the same for every stage but `index`)."""

    index: int
    stages: int
    microbatches: int
    schedule: str  # "gpipe" or "1f1b"
    activation_codec: str = "none"
    #: the subspace codec's rank (None: its default)
    codec_rank: int | None = None
    #: HOST:PORT of the group's rendezvous (served by the first stage); each forming of the group meets at its own
    #: port (:meth:`rendezvous`)
    master: str = "127.0.0.1:29800"
    #: which forming of the group this is (a run's attempt: every stage of one forming gives the same number)
    generation: int = 0
    timeout_s: float = 30.0
    #: the network interface gloo uses to reach the other stages (None: gloo's default)
    interface: str | None = None

    def rendezvous(self) -> str:
        """HOST:PORT where this forming of the group meets: the master's port + generation (mod
        RENDEZVOUS_PORTS). A stage that leaves a group and forms the next one while the first stage still holds the
        previous rendezvous then waits for the next one instead of joining a group that is going away."""
        host, port = self.master.rsplit(":", 1)
        return f"{host}:{int(port) + self.generation % RENDEZVOUS_PORTS}"


@dataclass
class StageRound:
    """What one call of :meth:`StageRunner.train_steps` did at this stage (see the module docstring)."""

    steps: int
    #: when the steps began (time.time())
    started: float
    compute_s: float
    wall_s: float
    bytes_forward: int
    bytes_backward: int
    examples: int
    loss: float | None
    #: (kind, micro-batch, step of the run, start, end): wall-clock seconds (time.time())
    spans: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    #: the schedule's order at this stage in the first step: ("F" | "B", micro-batch)
    order: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """The share of the wall time this stage was not computing (waiting for its neighbours or the links)."""
        return max(0.0, 1.0 - self.compute_s / self.wall_s) if self.wall_s > 0 else 0.0


class _TimedStage(PipelineStage):
    """torch's PipelineStage that records when each micro-batch's forward and backward computed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[str, int, float, float]] = []

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.spans.append((FORWARD, fwd_chunk_id, started, time.time()))

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        started = time.time()
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self.spans.append((BACKWARD, bwd_chunk_id, started, time.time()))


def _start(ops: list[dist.P2POp]) -> list[dist.Work]:
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


class PrepostedSchedule(PipelineScheduleSingle):
    """One stage's optimizer step: its forwards and backwards in the order of `schedule`
    (crossdc.strategies.pipeline.schedule_order: GPipe or 1F1B, the same compute order as torch's ScheduleGPipe and
    Schedule1F1B), with **every receive of the step posted when the step starts** and each send posted as soon as its
    op ends, all sends waited for at the step's end.

    torch's schedules post each receive just before the op that needs it; over gloo a message's data leaves only
    once the receiver's ready-to-receive notice has reached the sender, so every crossing there costs a round trip.
    Posted in advance, the notice is already at the sender when the data is ready: a crossing costs a one-way delay
    and the time on the wire. Each micro-batch has its own receive buffer in torch's stage, so posting them all at
    once is safe, and gloo matches a peer's messages to the posted receives in order. The step's result (losses,
    gradients averaged over the micro-batches) is the same as torch's schedules'."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Any, schedule: str) -> None:
        super().__init__(stage=stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
        self._order = schedule_order(schedule, stage.stage_index, stage.num_stages, n_microbatches)

    def _step_microbatches(self, arg_mbs: list | None = None, kwarg_mbs: list | None = None,  # type: ignore[override]
                           target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
                           loss_kwargs: dict[str, Any] | None = None) -> None:
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        stage, count = self._stage, self._n_microbatches
        forward_inputs = [_start(stage.get_fwd_recv_ops(m)) for m in range(count)]
        backward_inputs = [_start(stage.get_bwd_recv_ops(m)) for m in range(count)]
        sends: list[dist.Work] = []
        for kind, m in self._order:
            if kind == "F":
                _wait(forward_inputs[m])
                output = stage.forward_one_chunk(m, arg_mbs[m], kwarg_mbs[m], save_forward_output=return_outputs)
                sends += _start(stage.get_fwd_send_ops(m))
                self._maybe_compute_loss(stage, output, target_mbs, m, loss_kwargs)
            else:
                _wait(backward_inputs[m])
                stage.backward_one_chunk(m, loss=self._maybe_get_loss(stage, m), last_backward=m == count - 1)
                sends += _start(stage.get_bwd_send_ops(m))
        _wait(sends)
        self._update_losses(stage, losses)
        stage.perform_reduce_grad(count if self.scale_grads else 1)

    def _get_pipeline_order(self) -> None:
        return None


def stage_modules(model: nn.Module, blocks_per_stage: Sequence[int], codec: str, sample: torch.Tensor, *, seed: int,
                  codec_rank: int | None = None) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """Every stage of `model` with its boundary codec's modules, and the tensor each stage receives for the micro-batch
    `sample` (the first stage: `sample` itself; the others: the wire tensor the previous stage sends), plus, last,
    the model's output. Boundary b (between stages b and b + 1) uses codec seed `seed` + b on both sides."""
    cores = split_model(model, blocks_per_stage)
    wrapped: list[nn.Module] = []
    passed = [sample]
    decode: nn.Module | None = None  # the decoder of the boundary before the stage being built
    with torch.no_grad():
        hidden = sample
        for index, core in enumerate(cores):
            parts = [decode, core] if decode is not None else [core]
            hidden = core(decode(hidden) if decode is not None else hidden)
            decode = None
            if index < len(cores) - 1 and codec != "none":
                encode, decode = boundary_modules(codec, int(hidden.shape[-1]), seed=seed + index, boundary=index,
                                                  rank=codec_rank if codec == "subspace" else None)
                parts.append(encode)
                hidden = encode(hidden)
            wrapped.append(parts[0] if len(parts) == 1 else nn.Sequential(*parts))
            passed.append(hidden)
    return wrapped, passed


class StageRunner:
    """One stage of a pipeline run (see the module docstring)."""

    def __init__(self, workload: Workload, model: nn.Module, blocks_per_stage: Sequence[int], settings: StageSettings, *,
                 batch_size: int, optimizer: str, lr: float, data_seed: int, codec_seed: int,
                 options: InnerOptions | None = None, horizon_steps: int | None = None) -> None:
        if batch_size % settings.microbatches:
            raise StageFailed(f"microbatches = {settings.microbatches} does not divide the batch size {batch_size}")
        self.settings = settings
        self.workload = workload
        self.first, self.last = settings.index == 0, settings.index == settings.stages - 1
        self.stream = BatchStream(workload.all_training(), batch_size, data_seed) if self.first or self.last else None
        sample = workload.all_training().tensors[0][: batch_size // settings.microbatches]
        modules, passed = stage_modules(model, blocks_per_stage, settings.activation_codec, sample, seed=codec_seed,
                                        codec_rank=settings.codec_rank)
        self.module = modules[settings.index]
        self.input_example, self.output_example = passed[settings.index], passed[settings.index + 1]
        # what crosses a boundary carries a gradient back: torch's stage reads that off the examples
        if not self.first:
            self.input_example = self.input_example.detach().requires_grad_(True)
        if not self.last:
            self.output_example = self.output_example.detach().requires_grad_(True)
        #: this stage's tensors under the unsplit model's names (the codec's own buffers are not the model's)
        self.named = stage_tensors(model, [self.module])[0]
        self.options, self.base_lr, self.horizon_steps = options or InnerOptions(), lr, horizon_steps or 0
        self.optimizer = make_optimizer(optimizer, [p for p in self.module.parameters() if p.requires_grad], lr,
                                        self.options)
        self.steps_taken = 0
        self._stage: _TimedStage | None = None
        self._schedule: PrepostedSchedule | None = None

    # ------------------------------------------------------------------ the group
    def _connect(self) -> None:
        s = self.settings
        if s.interface:  # gloo picks its interface when the group is made: the emulated link to the other stages
            os.environ["GLOO_SOCKET_IFNAME"] = s.interface
        where = s.rendezvous()
        log.info("stage %d of %d: joining the pipeline group at %s (forming %d)", s.index, s.stages, where, s.generation)
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{where}", rank=s.index, world_size=s.stages,
                                    timeout=timedelta(seconds=s.timeout_s))
        except Exception as err:
            raise StageFailed(f"stage {s.index} could not join the pipeline group at {where} within "
                              f"{s.timeout_s:g}s ({type(err).__name__}: {err})".splitlines()[0]) from err
        # every shape given up front: torch then never runs a stage on uninitialised buffers to find them
        stage = _TimedStage(self.module, s.index, s.stages, torch.device("cpu"),
                            input_args=(self.input_example,), output_args=(self.output_example,),
                            output_grads=None if self.last else (torch.zeros_like(self.output_example),),
                            input_grads=None if self.first else (torch.zeros_like(self.input_example),))
        # every stage names the loss: torch runs the backward half of the schedule only where a loss is given
        self._stage = stage
        self._schedule = PrepostedSchedule(stage, s.microbatches, self.workload.loss, s.schedule)

    def close(self) -> None:
        """Leave the group (the next step forms it again)."""
        self._stage = self._schedule = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group cannot always be torn down cleanly; it is gone either way
                log.debug("the pipeline group did not tear down cleanly", exc_info=True)

    # ------------------------------------------------------------------ training
    def train_steps(self, steps: int) -> StageRound:
        """Run `steps` optimizer steps of the schedule with the other stages; StageFailed (the group is left) if
        any step fails."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if self._schedule is None:
            self._connect()
        assert self._stage is not None and self._schedule is not None
        s = self.settings
        self.module.train()
        losses_all: list[float] = []
        spans: list[tuple[str, int, int, float, float]] = []
        order: list[tuple[str, int]] = []
        examples = 0
        started = time.time()
        for _ in range(steps):
            step = self.steps_taken + 1
            self._stage.spans = []
            self.optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            try:
                if self.stream is not None:
                    inputs, targets = self.stream.next()
                    examples += int(inputs.shape[0])
                if self.first and self.last:
                    self._schedule.step(inputs, target=targets, losses=losses)
                elif self.first:
                    self._schedule.step(inputs)
                elif self.last:
                    self._schedule.step(target=targets, losses=losses)
                else:
                    self._schedule.step()
            except Exception as err:
                self.close()
                raise StageFailed(f"stage {s.index} of {s.stages}: step {step} failed "
                                  f"({type(err).__name__}: {err})".splitlines()[0]) from err
            # the schedule counts the run's steps from 0
            set_lr(self.optimizer, self.options.schedule.lr(step - 1, self.base_lr, self.horizon_steps))
            self.optimizer.step()
            self.steps_taken = step
            losses_all += [float(loss.detach()) for loss in losses]
            spans += [(kind, micro, step, start, end) for kind, micro, start, end in self._stage.spans]
            if not order:
                order = [("F" if kind == FORWARD else "B", micro) for kind, micro, _, _ in self._stage.spans]
        wall_s = time.time() - started
        per_micro_forward = 0 if self.last else int(self.output_example.nelement() * self.output_example.element_size())
        per_micro_backward = 0 if self.first else int(self.input_example.nelement() * self.input_example.element_size())
        return StageRound(steps=steps, started=started, compute_s=sum(end - start for *_, start, end in spans), wall_s=wall_s,
                          bytes_forward=per_micro_forward * s.microbatches * steps,
                          bytes_backward=per_micro_backward * s.microbatches * steps,
                          examples=examples if self.first else 0,
                          loss=float(np.mean(losses_all)) if losses_all else None, spans=spans, order=order)

    # ------------------------------------------------------------------ state
    def weights(self) -> dict[str, np.ndarray]:
        """This stage's weights under the unsplit model's names (float32 copies)."""
        return {name: t.detach().cpu().numpy().astype(np.float32, copy=True) for name, t in self.named.items()}

    def set_weights(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Load this stage's weights (the unsplit model's names; other names are ignored, a missing one or one of
        another shape is a StageFailed naming it)."""
        missing = sorted(set(self.named) - set(arrays))
        if missing:
            raise StageFailed(f"stage {self.settings.index}: weights without {missing[:3]}")
        wrong = [f"{name} {tuple(np.shape(arrays[name]))} (expected {tuple(t.shape)})" for name, t in self.named.items()
                 if tuple(np.shape(arrays[name])) != tuple(t.shape)]
        if wrong:
            raise StageFailed(f"stage {self.settings.index}: weights of the wrong shape: {', '.join(wrong[:3])}")
        with torch.no_grad():
            for name, tensor in self.named.items():
                tensor.copy_(torch.from_numpy(np.asarray(arrays[name])).to(tensor.dtype))

    def state_dict(self) -> dict[str, Any]:
        """Everything a restarted stage needs to continue exactly (see the module docstring)."""
        return {"weights": self.weights(), "optimizer": self.optimizer.state_dict(), "steps_taken": self.steps_taken,
                "stream": self.stream.state_dict() if self.stream is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.set_weights(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = int(state["steps_taken"])
        if self.stream is not None and state.get("stream") is not None:
            self.stream.load_state_dict(state["stream"])
