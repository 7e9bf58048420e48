"""The planner for a pipeline split across datacenters (`crossdc plan --pipeline`), beside data parallel and DiLoCo.

Pure functions, no I/O and no torch. What it promises:

- :func:`pipeline_step` predicts one optimizer step of a model cut into S stages, one stage per datacenter, each
  batch cut into M micro-batches, by **simulating what crossdc's runtime does** event by event, not by a closed
  formula. The runtime (crossdc.clients.pipeline_stage) runs torch.distributed.pipelining's ScheduleGPipe or
  Schedule1F1B over gloo; the order of each stage's ops is `strategies.pipeline.schedule_order`, the one definition
  of both schedules (GPipe every forward, then every backward; 1F1B a warm-up of min(M, S − s) forwards on stage s,
  then one backward and one forward in turn while forwards remain, then the remaining backwards):

  * stage s runs its forwards F[s][m] and backwards B[s][m] one at a time, in that order; each op waits for its
    receive (the activation from stage s − 1, the gradient from stage s + 1; the last stage's backward needs only
    its own forward: the loss is there); after the op it posts the op's send;
  * **when a receive is posted and a message's data leaves** (``transport``): gloo's TCP transport sends a
    message's data only once the receiver has posted its receive and that notice has crossed the link (gloo's
    pair.cc: a send with no remote pending receive waits for the receiver's ready-to-receive notice), so the data
    leaves at max(send posted, receive posted + RTT/2, the wire free). With ``"gloo"``, the default and what
    crossdc's runtime does (crossdc.clients.pipeline_stage.PrepostedSchedule), a stage posts **every receive of the
    step when the step starts**, posts each send when its op ends and waits for its sends at the step's end: a
    crossing costs a one-way delay and its time on the wire, plus, for the step's first messages, whatever is
    left of the notice's one-way trip. With ``"torch"``, what torch's own ScheduleGPipe and Schedule1F1B do over
    gloo: each receive posted just before the op that needs it (so a micro-batch whose receiver is already
    waiting costs a round trip plus its time on the wire), GPipe posting each send right after its op and waiting
    for a phase's sends at the phase's end, 1F1B posting a warm-up forward's send at once and waiting for it after
    the next forward, holding the last warm-up forward's send and every send of the one-backward-one-forward phase
    back until the stage's next receive (Schedule1F1B's fused ``fwd_send_bwd_recv`` and ``bwd_send_fwd_recv``), and
    posting the cool-down's backward sends at once, waiting for each after the next backward; a send completes when
    its data leaves. With ``"streaming"`` (an ideal engine: no notice to wait for) the data leaves at max(send
    posted, the wire free) and no send is waited for;
  * a boundary's link carries each direction on its own (full duplex), one micro-batch after another: data occupies
    the wire ``activation_bytes / bandwidth`` (`cost_model.transfer_time`) and arrives one one-way delay (RTT/2)
    after it left;
  * the step is the last op's end plus ``optimizer_s``.

  A stage's compute per step is ``step_time_s`` × its share of the parameters (or ``stage_compute_s``), split
  over M micro-batches as forward : backward = 1 : ``backward_ratio``. With free links and equal stages the
  simulation reproduces the textbook bubble (S−1)/(M+S−1) (`strategies.pipeline.bubble_fraction`) exactly, for
  both schedules and every transport; what the WAN adds (the links' delays, the notices, a link slower than a stage)
  comes out of the same simulation, reported as ``exposed_comm_s`` (the step minus the same schedule's step over
  free links). benchmarks/pipeline_bench.py measures the gloo model against real runs over the namespace emulator
  (docs/benchmarks.md).

- :func:`compare` sets it beside the two strategies that keep the whole model in every datacenter, on the same S
  datacenters, the **same batch per optimizer step** (each datacenter of data parallel or DiLoCo computes 1/S of it,
  ``step_time_s / S``) and the slowest boundary's link (lowest bandwidth, highest RTT: a ring or a star is as slow
  as its slowest hop):

  * data parallel: `cost_model.sync_dp_step`, a ring all-reduce of the fp32 gradients (4·P bytes) every step;
  * DiLoCo: `cost_model.star_round`, a sync of the whole model through the coordinator every τ steps, per step
    ``round_s / τ``.

  Its verdict names the fastest feasible strategy per step and why, with the rule of thumb stated as a number:
  pipelining pays when the activations and gradients crossing a boundary per step, 2·M·activation_bytes, are much
  smaller than the 4·P bytes data parallel all-reduces. With ``max_params_per_datacenter`` a strategy whose
  datacenters must hold more parameters than that is infeasible (data parallel and DiLoCo hold all P, the
  pipeline its largest stage).

Not modelled: the activations' memory (1F1B holds fewer than GPipe; the step time is the same with free links),
compute/communication interference, TCP's window growth and loss (see cost_model), the notices sharing a TCP
connection with the data going the other way, and the micro-batches' effect on the per-op efficiency of the
accelerators (a micro-batch's forward is taken as 1/M of the batch's).

Units: bandwidth in Mbps, RTT in ms, sizes in bytes, times in s (as in `cost_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from crossdc.experiment.links import LinkSpec
from crossdc.strategies.pipeline import SCHEDULES, bubble_fraction, schedule_order, schedule_problem
from crossdc.wan.cost_model import (
    BYTES_PER_FP32,
    CostModelError,
    RoundEstimate,
    StarPlan,
    SyncDPEstimate,
    _non_negative,
    _positive,
    _positive_int,
    resolve_link,
    star_round,
    sync_dp_step,
    transfer_time,
    uniform_datacenters,
)

DEFAULT_BACKWARD_RATIO = 2.0
DEFAULT_TAU = 100
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}
#: when a message's data leaves (see the module docstring): "gloo" (the runtime's: after the receiver's notice),
#: "streaming" (an ideal engine: as soon as it is sent)
TRANSPORTS = ("gloo", "torch", "streaming")
DEFAULT_TRANSPORT = "gloo"

OpKind = Literal["forward", "backward"]


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PipelinePlan:
    """The inputs of one pipeline-parallel optimizer step (see the module docstring for the model).

    stage_params: parameters per stage, in pipeline order (S ≥ 2 stages, one per datacenter).
    activation_bytes: bytes one micro-batch's activation takes on the wire at a boundary; its gradient, sent back,
    is as large. The same at every boundary.
    microbatches: M, micro-batches per optimizer step.
    step_time_s: compute seconds of one optimizer step of the whole model on one datacenter (forward and backward
    of the whole batch). Stage s computes step_time_s · stage_params[s] / Σ stage_params of it, unless
    stage_compute_s gives each stage's seconds per step explicitly (e.g. datacenters of different speeds).
    backward_ratio: a backward's time over its forward's (2 for a transformer's matmuls).
    links: one link per boundary (S − 1), a `LinkSpec` or a profile name; boundary i joins stages i and i + 1.
    schedule: "gpipe" (every forward, then every backward) or "1f1b".
    transport: "gloo" (the runtime's: every receive of a step posted when it starts, a message's data leaving once
    the receiver's notice has crossed the link), "torch" (torch's own schedules: each receive posted just before its
    op) or "streaming" (an ideal engine whose data leaves as soon as it is sent); see the module docstring.
    optimizer_s: seconds of the optimizer step after the last backward (0: ignored).
    max_params_per_datacenter: the most parameters one datacenter can hold (None: no limit).
    """

    stage_params: Sequence[float]
    activation_bytes: float
    microbatches: int
    step_time_s: float
    links: Sequence[LinkSpec | str]
    schedule: str = "1f1b"
    backward_ratio: float = DEFAULT_BACKWARD_RATIO
    stage_compute_s: Sequence[float] | None = None
    optimizer_s: float = 0.0
    max_params_per_datacenter: float | None = None
    transport: str = DEFAULT_TRANSPORT

    def __post_init__(self) -> None:
        params = tuple(self.stage_params)
        if len(params) < 2:
            raise CostModelError(f"a pipeline split needs at least two stages, got {len(params)}")
        for index, count in enumerate(params):
            _positive(f"parameters of stage {index}", count)
        object.__setattr__(self, "stage_params", tuple(float(count) for count in params))
        _non_negative("activation bytes", self.activation_bytes)
        _positive_int("micro-batches", self.microbatches)
        _positive("step time (s)", self.step_time_s)
        _positive("backward/forward ratio", self.backward_ratio)
        _non_negative("optimizer time (s)", self.optimizer_s)
        if self.schedule not in SCHEDULES:
            raise CostModelError(f"unknown pipeline schedule '{self.schedule}'; known: {', '.join(SCHEDULES)}")
        problem = schedule_problem(self.schedule, len(params), self.microbatches)
        if problem is not None:
            raise CostModelError(problem)
        _check_transport(self.transport)
        links = tuple(self.links)
        if len(links) != len(params) - 1:
            raise CostModelError(f"{len(params)} stages have {len(params) - 1} boundaries, but {len(links)} links "
                                 "were given (one per boundary)")
        object.__setattr__(self, "links", tuple(resolve_link(link) for link in links))
        if self.stage_compute_s is not None:
            compute = tuple(self.stage_compute_s)
            if len(compute) != len(params):
                raise CostModelError(f"stage compute times are given for {len(compute)} stages, the split has "
                                     f"{len(params)}")
            for index, seconds in enumerate(compute):
                _positive(f"compute time of stage {index} (s)", seconds)
            object.__setattr__(self, "stage_compute_s", tuple(float(seconds) for seconds in compute))
        if self.max_params_per_datacenter is not None:
            _positive("parameters per datacenter", self.max_params_per_datacenter)

    @property
    def stages(self) -> int:
        return len(self.stage_params)

    @property
    def total_params(self) -> float:
        return float(sum(self.stage_params))

    @property
    def boundary_links(self) -> tuple[LinkSpec, ...]:
        """The links, resolved (`__post_init__` turned profile names into `LinkSpec`s)."""
        return tuple(link for link in self.links if isinstance(link, LinkSpec))

    def compute_per_stage(self) -> tuple[float, ...]:
        """Each stage's compute seconds per optimizer step (forward and backward of all M micro-batches)."""
        if self.stage_compute_s is not None:
            return tuple(self.stage_compute_s)
        total = self.total_params
        return tuple(self.step_time_s * count / total for count in self.stage_params)


# ----------------------------------------------------------------------------- the schedule


#: the runtime's op names (`strategies.pipeline.schedule_order`: "F", "B") as the simulation's
_OP_KINDS: dict[str, OpKind] = {"F": "forward", "B": "backward"}


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise CostModelError(f"unknown pipeline transport '{transport}'; known: {', '.join(TRANSPORTS)}")


def _stage_orders(schedule: str, stages: int, microbatches: int) -> list[list[tuple[OpKind, int]]]:
    """Each stage's ops in the order the runtime runs them: `strategies.pipeline.schedule_order`, the one definition
    of GPipe and 1F1B (torch's ScheduleGPipe and Schedule1F1B), its "F"/"B" named as the simulation's op kinds."""
    if schedule not in SCHEDULES:
        raise CostModelError(f"unknown pipeline schedule '{schedule}'; known: {', '.join(SCHEDULES)}")
    _positive_int("micro-batches", microbatches)
    return [[(_OP_KINDS[kind], m) for kind, m in schedule_order(schedule, stage, stages, microbatches)]
            for stage in range(stages)]


#: a message between two stages: (direction, boundary, micro-batch), an activation ("forward") going from stage
#: boundary to boundary + 1 or a gradient ("backward") from boundary + 1 to boundary
_Message = tuple[OpKind, int, int]
#: one end of a message: ("send" | "recv", the message)
_End = tuple[Literal["send", "recv"], _Message]


@dataclass(frozen=True)
class _Instruction:
    """One thing a stage does, in order: post message ends, wait for them (a receive until its data has arrived, a
    send until its data has left), or compute an op."""

    action: Literal["post", "wait", "compute"]
    ends: tuple[_End, ...] = ()
    kind: OpKind = "forward"
    microbatch: int = -1


def _stage_program(schedule: str, transport: str, stage: int, stages: int,
                   order: Sequence[tuple[OpKind, int]]) -> list[_Instruction]:
    """What stage `stage` does in one step (see the module docstring): its ops in `order`, each after its receive;
    "gloo": every receive posted at the step's start, the sends waited for at its end (crossdc's PrepostedSchedule);
    "torch": receives and sends posted and waited for as torch's ScheduleGPipe / Schedule1F1B do (torch 2.13,
    torch/distributed/pipelining/schedules.py); "streaming": sends posted at once and never waited for."""

    def receive(kind: OpKind, m: int) -> tuple[_End, ...]:
        if kind == "forward":
            return (("recv", ("forward", stage - 1, m)),) if stage > 0 else ()
        return (("recv", ("backward", stage, m)),) if stage < stages - 1 else ()

    def send(kind: OpKind, m: int) -> tuple[_End, ...]:
        if kind == "forward":
            return (("send", ("forward", stage, m)),) if stage < stages - 1 else ()
        return (("send", ("backward", stage - 1, m)),) if stage > 0 else ()

    program: list[_Instruction] = []

    def post_and_wait(ends: tuple[_End, ...]) -> None:
        program.extend((_Instruction("post", ends), _Instruction("wait", ends)))

    if transport == "gloo":
        # crossdc's PrepostedSchedule: the step's receives posted at its start, each send after its op, all sends
        # waited for at the step's end
        program.append(_Instruction("post", tuple(end for kind, m in order for end in receive(kind, m))))
        sent: tuple[_End, ...] = ()
        for kind, m in order:
            program += [_Instruction("wait", receive(kind, m)), _Instruction("compute", kind=kind, microbatch=m),
                        _Instruction("post", send(kind, m))]
            sent += send(kind, m)
        program.append(_Instruction("wait", sent))
        return program
    if transport == "streaming":
        for kind, m in order:
            post_and_wait(receive(kind, m))
            program += [_Instruction("compute", kind=kind, microbatch=m), _Instruction("post", send(kind, m))]
        return program
    if schedule == "gpipe":
        # each send posted after its op; a phase's sends waited for at the phase's end (fwd_sends_to_wait, ...)
        unwaited: tuple[_End, ...] = ()
        for index, (kind, m) in enumerate(order):
            post_and_wait(receive(kind, m))
            program += [_Instruction("compute", kind=kind, microbatch=m), _Instruction("post", send(kind, m))]
            unwaited += send(kind, m)
            if index == len(order) - 1 or order[index + 1][0] != kind:
                program.append(_Instruction("wait", unwaited))
                unwaited = ()
        return program
    # 1F1B: the warm-up's forwards, then backward and forward in turn up to the backward after the last forward
    # (the loop's break), then the cool-down's backwards. A send is held back, and posted with the next op's receive,
    # from the warm-up's last forward up to the op before the break; the others are fired at once and waited for
    # after the next op (send_work).
    warmup = next(index for index, (kind, _) in enumerate(order) if kind == "backward")
    last_forward = max(index for index, (kind, _) in enumerate(order) if kind == "forward")
    held: tuple[_End, ...] = ()
    fired: tuple[_End, ...] = ()
    for index, (kind, m) in enumerate(order):
        post_and_wait(held + receive(kind, m))
        held = ()
        program.append(_Instruction("compute", kind=kind, microbatch=m))
        if fired:
            program.append(_Instruction("wait", fired))
            fired = ()
        if warmup - 1 <= index <= last_forward:
            held = send(kind, m)
        else:
            fired = send(kind, m)
            program.append(_Instruction("post", fired))
    program.append(_Instruction("wait", fired))
    return program


@dataclass(frozen=True)
class ScheduledOp:
    """One forward or backward of one micro-batch on one stage, as the simulation placed it (seconds from the step's
    start)."""

    stage: int
    kind: OpKind
    microbatch: int
    start_s: float
    end_s: float


def simulate_schedule(schedule: str, forward_s: Sequence[float], backward_s: Sequence[float],
                      transfer_s: Sequence[float], latency_s: Sequence[float], microbatches: int,
                      transport: str = DEFAULT_TRANSPORT) -> list[ScheduledOp]:
    """Every op of one step, placed by the rules of the module docstring.

    forward_s / backward_s: one micro-batch's forward / backward on each stage; transfer_s / latency_s: each
    boundary's time on the wire for one micro-batch and its one-way delay (the same both ways); transport: "gloo",
    "torch" or "streaming". Returns the ops in the order they were placed. A send leaves before its receiver's op can
    start, so no stage's wait for a send outlasts the first stage's last backward: the last op's end is the step's.
    """
    stages = len(forward_s)
    if len(backward_s) != stages or len(transfer_s) != stages - 1 or len(latency_s) != stages - 1:
        raise CostModelError("simulate_schedule needs a forward and a backward time per stage, a transfer and a "
                             "latency per boundary")
    _check_transport(transport)
    handshake = transport != "streaming"
    orders = _stage_orders(schedule, stages, microbatches)
    programs = [_stage_program(schedule, transport, stage, stages, orders[stage]) for stage in range(stages)]
    counter = [0] * stages
    clock = [0.0] * stages
    posted: dict[_End, float] = {}
    leaves: dict[_Message, float] = {}
    arrives: dict[_Message, float] = {}
    wire_free: dict[tuple[OpKind, int], float] = {}
    ops: list[ScheduledOp] = []

    def resolve(message: _Message) -> None:
        """Place the message on its wire once both of its ends are known (with gloo; its send alone otherwise)."""
        send: _End = ("send", message)
        receive: _End = ("recv", message)
        if message in arrives or send not in posted or (handshake and receive not in posted):
            return
        direction, boundary, _ = message
        ready = max(posted[send], posted[receive] + latency_s[boundary]) if handshake else posted[send]
        leave = max(ready, wire_free.get((direction, boundary), 0.0))
        wire_free[(direction, boundary)] = leave + transfer_s[boundary]
        leaves[message] = leave
        arrives[message] = leave + transfer_s[boundary] + latency_s[boundary]

    while any(counter[stage] < len(programs[stage]) for stage in range(stages)):
        progressed = False
        for stage in range(stages):
            while counter[stage] < len(programs[stage]):
                instruction = programs[stage][counter[stage]]
                if instruction.action == "post":
                    for end in instruction.ends:
                        posted[end] = clock[stage]
                        resolve(end[1])
                elif instruction.action == "wait":
                    if any(message not in arrives for _, message in instruction.ends):
                        break  # waits on another stage
                    clock[stage] = max([clock[stage], *(leaves[message] if role == "send" else arrives[message]
                                                        for role, message in instruction.ends)])
                else:
                    seconds = forward_s[stage] if instruction.kind == "forward" else backward_s[stage]
                    ops.append(ScheduledOp(stage, instruction.kind, instruction.microbatch, clock[stage],
                                           clock[stage] + seconds))
                    clock[stage] += seconds
                counter[stage] += 1
                progressed = True
        if not progressed:  # cannot happen for GPipe or 1F1B; a guard for a schedule that waits on itself
            raise CostModelError(f"the {schedule} schedule deadlocks with {stages} stages and {microbatches} "
                                 "micro-batches")
    return ops


# ----------------------------------------------------------------------------- one pipeline step


@dataclass(frozen=True)
class PipelineEstimate:
    """One optimizer step of the pipeline split.

    transport: the plan's ("gloo" or "streaming"). step_s = makespan_s + optimizer_s, makespan_s = the last
    backward's end. free_links_step_s: the same schedule and transport with transfers and latency of 0;
    exposed_comm_s = step_s − free_links_step_s, what the WAN adds.
    stage_compute_s: each stage's compute per step; forward_s / backward_s: one micro-batch's on each stage.
    stage_idle_s: makespan_s − stage_compute_s, the time a stage idles (its bubble, waits on the WAN included).
    bubble_fraction: Σ idle / (S · makespan_s), the predicted share of the stages' time spent idle, beside the
    schedule's theoretical_bubble_fraction (S−1)/(M+S−1) (equal stages, free links).
    transfer_s / latency_s: per boundary, one micro-batch's time on the wire and the one-way delay.
    bytes_per_boundary_per_step = 2·M·activation_bytes (activations forward, gradients back);
    wan_bytes_per_step = (S−1) times that. utilisation = Σ stage_compute_s / (S · step_s).
    timeline: every op as simulated.
    """

    stages: int
    microbatches: int
    schedule: str
    transport: str
    step_s: float
    makespan_s: float
    optimizer_s: float
    free_links_step_s: float
    exposed_comm_s: float
    stage_compute_s: tuple[float, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    stage_idle_s: tuple[float, ...]
    bubble_fraction: float
    theoretical_bubble_fraction: float
    transfer_s: tuple[float, ...]
    latency_s: tuple[float, ...]
    bytes_per_boundary_per_step: float
    wan_bytes_per_step: float
    max_stage_params: float
    utilisation: float
    timeline: tuple[ScheduledOp, ...] = field(default=(), repr=False)


def pipeline_step(plan: PipelinePlan) -> PipelineEstimate:
    """Predict one optimizer step of `plan` by simulating its schedule over its transport (see the module
    docstring)."""
    stages, m = plan.stages, plan.microbatches
    compute = plan.compute_per_stage()
    forward = tuple(seconds / (m * (1.0 + plan.backward_ratio)) for seconds in compute)
    backward = tuple(f * plan.backward_ratio for f in forward)
    links = plan.boundary_links
    transfer = tuple(transfer_time(plan.activation_bytes, link.bandwidth_mbps) for link in links)
    latency = tuple(link.rtt_ms / 2000.0 for link in links)
    ops = simulate_schedule(plan.schedule, forward, backward, transfer, latency, m, plan.transport)
    free_ops = simulate_schedule(plan.schedule, forward, backward, (0.0,) * (stages - 1), (0.0,) * (stages - 1), m,
                                 plan.transport)
    makespan = max(op.end_s for op in ops)
    free_makespan = max(op.end_s for op in free_ops)
    idle = tuple(makespan - seconds for seconds in compute)
    step = makespan + plan.optimizer_s
    per_boundary = 2.0 * m * plan.activation_bytes
    return PipelineEstimate(
        stages=stages, microbatches=m, schedule=plan.schedule, transport=plan.transport,
        step_s=step, makespan_s=makespan, optimizer_s=plan.optimizer_s,
        free_links_step_s=free_makespan + plan.optimizer_s, exposed_comm_s=makespan - free_makespan,
        stage_compute_s=compute, forward_s=forward, backward_s=backward, stage_idle_s=idle,
        bubble_fraction=sum(idle) / (stages * makespan),
        theoretical_bubble_fraction=bubble_fraction(stages, m),
        transfer_s=transfer, latency_s=latency,
        bytes_per_boundary_per_step=per_boundary, wan_bytes_per_step=(stages - 1) * per_boundary,
        max_stage_params=max(plan.stage_params),
        utilisation=sum(compute) / (stages * step),
        timeline=tuple(sorted(ops, key=lambda op: (op.start_s, op.stage))),
    )


# ----------------------------------------------------------------------------- against data parallel and DiLoCo


@dataclass(frozen=True)
class StrategyCost:
    """One strategy's step on the plan's datacenters: step_s per optimizer step (the same batch for all three),
    wan_bytes_per_step summed over every datacenter's sends, exposed_comm_s the step's time not spent computing
    that the WAN causes, params_per_datacenter the most one datacenter holds; feasible is False when that exceeds
    the plan's max_params_per_datacenter (note says why)."""

    name: str
    step_s: float
    wan_bytes_per_step: float
    exposed_comm_s: float
    params_per_datacenter: float
    feasible: bool
    note: str = ""


@dataclass(frozen=True)
class Comparison:
    """The pipeline split against data parallel and DiLoCo on the same datacenters (see `compare`).

    other_schedule / other_schedule_step_s: the pipeline's step under the other schedule (GPipe for 1F1B and back;
    None when that schedule cannot run this split, e.g. 1F1B with fewer micro-batches than stages).
    costs: pipeline, data parallel, DiLoCo, in that order. link: the link data parallel and DiLoCo are costed
    over (the slowest boundary's). activation_to_gradient_ratio = 2·M·activation_bytes / (4·P): what crosses a
    boundary per step in the pipeline over what data parallel all-reduces per step. winner: the name of the
    fastest feasible strategy per step (None when none fits).
    """

    tau: int
    link: LinkSpec
    pipeline: PipelineEstimate
    other_schedule: str
    other_schedule_step_s: float | None
    data_parallel: SyncDPEstimate
    diloco: RoundEstimate
    costs: tuple[StrategyCost, ...]
    activation_to_gradient_ratio: float
    winner: str | None
    verdict: str


def slowest_link(links: Sequence[LinkSpec]) -> LinkSpec:
    """One link as slow as the slowest of `links` on both counts: the lowest bandwidth and the highest RTT (the link
    itself when one link is both, e.g. when every boundary has the same link)."""
    if not links:
        raise CostModelError("no links to choose the slowest of")
    bandwidth = min(link.bandwidth_mbps for link in links)
    rtt = max(link.rtt_ms for link in links)
    for link in links:
        if link.bandwidth_mbps == bandwidth and link.rtt_ms == rtt:
            return link
    return LinkSpec("slowest boundary", bandwidth, rtt)


def compare(plan: PipelinePlan, tau: int = DEFAULT_TAU) -> Comparison:
    """The pipeline split against data parallel and DiLoCo for the same model, datacenters and batch.

    Data parallel and DiLoCo run on S datacenters (S = the pipeline's stages), each holding the whole model and
    computing 1/S of the batch per step (step_time_s / S), over the slowest boundary's link (`slowest_link`):
    data parallel's step is `sync_dp_step` (a ring all-reduce of 4·P bytes every step), DiLoCo's is
    `star_round(τ)` / τ (the whole model down and up through the coordinator once every τ steps).
    """
    _positive_int("tau", tau)
    pipe = pipeline_step(plan)
    other_schedule = next(name for name in SCHEDULES if name != plan.schedule)
    other = (None if schedule_problem(other_schedule, plan.stages, plan.microbatches)
             else pipeline_step(replace(plan, schedule=other_schedule)))
    stages, total = plan.stages, plan.total_params
    link = slowest_link(plan.boundary_links)
    share_s = plan.step_time_s / stages
    dp = sync_dp_step(total, stages, link, share_s)
    diloco = star_round(StarPlan(params=total, datacenters=uniform_datacenters(stages, link), step_time_s=share_s,
                                 tau=tau))
    limit = plan.max_params_per_datacenter

    def fits(params: float) -> tuple[bool, str]:
        if limit is None or params <= limit:
            return True, ""
        return False, f"does not fit: {params:.3g} parameters in one datacenter, at most {limit:.3g}"

    pipe_fits, pipe_note = fits(pipe.max_stage_params)
    whole_fits, whole_note = fits(total)
    costs = (
        StrategyCost(f"pipeline ({plan.schedule})", pipe.step_s, pipe.wan_bytes_per_step, pipe.exposed_comm_s,
                     pipe.max_stage_params, pipe_fits, pipe_note),
        StrategyCost("data parallel", dp.step_s, stages * dp.bytes_sent_per_datacenter, dp.comm_s, total,
                     whole_fits, whole_note),
        StrategyCost(f"DiLoCo (tau {tau})", diloco.round_s / tau,
                     stages * (diloco.bytes_up + diloco.bytes_down) / tau,
                     (diloco.round_s - diloco.compute_s) / tau, total, whole_fits, whole_note),
    )
    ratio = pipe.bytes_per_boundary_per_step / (BYTES_PER_FP32 * total)
    feasible = [cost for cost in costs if cost.feasible]
    winner = min(feasible, key=lambda cost: cost.step_s) if feasible else None
    verdict = _verdict(plan, pipe, dp, costs, winner, ratio, tau)
    if costs[0].feasible and other is not None and other.step_s < 0.99 * pipe.step_s:
        verdict += f" {SCHEDULE_NAMES[other_schedule]} would take {other.step_s:.3g} s per step here"
        if plan.transport == "torch" and plan.schedule == "gpipe":
            verdict += (": GPipe posts each receive only when it needs it, so every micro-batch's activation and then "
                        "its gradient wait a round trip for the receiver's notice, where 1F1B posts a stage's held "
                        "send with its next receive and a micro-batch's activation and gradient share one.")
        elif plan.transport != "torch" and plan.schedule == "1f1b":
            verdict += (": 1F1B keeps at most S micro-batches in flight, so the WAN's round trips are paid again and "
                        "again, where GPipe pays them once in the fill and once in the drain (at the cost of holding "
                        "all M micro-batches' activations).")
        else:
            verdict += "."
    return Comparison(tau=tau, link=link, pipeline=pipe, other_schedule=other_schedule,
                      other_schedule_step_s=None if other is None else other.step_s, data_parallel=dp, diloco=diloco, costs=costs,
                      activation_to_gradient_ratio=ratio, winner=None if winner is None else winner.name,
                      verdict=verdict)


def _verdict(plan: PipelinePlan, pipe: PipelineEstimate, dp: SyncDPEstimate, costs: tuple[StrategyCost, ...],
             winner: StrategyCost | None, ratio: float, tau: int) -> str:
    pipeline_cost, dp_cost, diloco_cost = costs
    total = plan.total_params
    rule = (f"each step a boundary carries {_bytes(pipe.bytes_per_boundary_per_step)} of activations and their "
            f"gradients (2·M·activation), {ratio:.3g}× the {_bytes(BYTES_PER_FP32 * total)} of fp32 gradients data "
            "parallel all-reduces (pipelining pays when this ratio is well below 1)")
    memory = ""
    if not dp_cost.feasible:
        memory = (f" Data parallel and DiLoCo need the whole model ({total:.3g} parameters) in every datacenter, more "
                  f"than the {plan.max_params_per_datacenter:.3g} one holds")
        memory += (f"; the pipeline's largest stage holds {pipe.max_stage_params:.3g}: the per-stage memory is the "
                   "reason to pipeline." if pipeline_cost.feasible else
                   f", and the pipeline's largest stage ({pipe.max_stage_params:.3g}) does not fit either.")
    if winner is None:
        return f"Nothing fits.{memory} For the record, {rule}."
    others = ", ".join(f"{cost.name} {cost.step_s:.3g} s" + ("" if cost.feasible else " (does not fit)")
                       for cost in costs if cost is not winner)
    head = f"{winner.name} wins per step: {winner.step_s:.3g} s against {others}."
    if winner is pipeline_cost:
        why = (f" {rule[0].upper()}{rule[1:]}; the WAN adds {pipe.exposed_comm_s:.3g} s to the step and the stages "
               f"idle {pipe.bubble_fraction:.0%} of it (the schedule alone: {pipe.theoretical_bubble_fraction:.0%})")
        faster = [cost for cost in (dp_cost, diloco_cost) if cost.step_s < pipe.step_s]
        if faster:  # it wins only because the others do not fit
            best = min(faster, key=lambda cost: cost.step_s)
            why += f"; were memory no limit, {best.name} would take {best.step_s:.3g} s."
        else:
            why += (f", less than data parallel's {dp.comm_s:.3g} s all-reduce and DiLoCo's "
                    f"{diloco_cost.exposed_comm_s:.3g} s of sync per step.")
    elif winner is dp_cost:
        why = (f" Its all-reduce costs {dp.comm_s:.3g} s per step, less than what the pipeline loses to its bubble "
               f"({pipe.bubble_fraction:.0%} of the stages' time idle) and the WAN ({pipe.exposed_comm_s:.3g} s "
               f"exposed): {rule}.")
    else:
        why = (f" Syncing the whole model once every {tau} steps costs {diloco_cost.exposed_comm_s:.3g} s per step, "
               f"less than the pipeline's bubble ({pipe.bubble_fraction:.0%} idle) and WAN "
               f"({pipe.exposed_comm_s:.3g} s exposed) or data parallel's {dp.comm_s:.3g} s all-reduce; {rule}. "
               "DiLoCo's steps are local between syncs, so weigh its convergence per step too.")
    return head + why + memory


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} B" if n else "0 B"


def uniform_links(stages: int, link: LinkSpec | str) -> tuple[LinkSpec, ...]:
    """The same link at every one of the S − 1 boundaries of `stages` stages."""
    _positive_int("stages", stages)
    spec = resolve_link(link)
    return (spec,) * (stages - 1)


__all__ = [
    "DEFAULT_BACKWARD_RATIO", "DEFAULT_TAU", "DEFAULT_TRANSPORT", "TRANSPORTS", "Comparison", "PipelineEstimate",
    "PipelinePlan", "ScheduledOp", "StrategyCost", "compare", "pipeline_step", "simulate_schedule", "slowest_link", "uniform_links",
]
