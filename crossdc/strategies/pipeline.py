"""Pipeline split across datacenters (GPipe, Huang et al., 2019; 1F1B, Narayanan et al., 2019): one model's blocks cut
into consecutive stages, one stage per datacenter, each mini-batch cut into micro-batches that flow through them.

Client contract (what every datacenter does): the ``[[datacenters]]`` in config order are the stages; stage i holds
blocks :func:`stage_blocks`\\ (blocks, stages, layers)[i] of the model (crossdc.workloads.stages.split_model) and
their optimizer state, and nothing else of the model. Each optimizer step cuts the batch into ``microbatches``
equal micro-batches; stage i runs each micro-batch's forward on what stage i − 1 sent and sends its output to
stage i + 1, and each backward on the gradient stage i + 1 sent back, in the order ``schedule`` gives (:func:`schedule_order`;
``gpipe``: every forward, then every backward; ``1f1b``: after a warm-up of S − i forwards, one backward and one
forward in turn); then every stage takes its optimizer step on the mean of the micro-batches' gradients (the whole
batch's, as the unsplit model). A round is τ optimizer steps. With ``activation_codec`` the activations and their
gradients cross each boundary encoded (crossdc.compression.activations). The first stage reads the workload's whole
training set (datacenter partitions do not apply); the last stage draws the same batches from the same seed for
their targets, so targets never cross the WAN. A stage runs on one worker (``workers`` = 1).

With ``replicas`` = R > 1 the datacenters form R pipelines of S = N / R stages each, replica-major in config order
(:func:`replica_groups`: replica r holds datacenters r·S … r·S + S − 1, its stage i the i-th of them). Each replica
trains on its own order of the whole training set (its first datacenter's data seed) and forms its own group; after
every round each stage returns its weights, the coordinator takes one DiLoCo outer step (``outer_lr``,
``outer_momentum``, ``outer_momentum_warmup_rounds``; :meth:`Pipeline.replica_step`) on the mean of the replicas'
whole models, and each stage begins the next round from its blocks of the new global model, its inner optimizer's
state kept (DiLoCo's inner loop, run by a pipeline). With ``outer_lr`` = 1 and ``outer_momentum`` = 0 that is a
plain average of the replicas.

The pure parts here: the cut of the blocks (:func:`stage_blocks`), the schedule's order and the idle share it leaves
(:func:`schedule_order`, :func:`bubble_fraction`), and the checks a run's settings must pass. The stages' runtime is
crossdc.clients.pipeline_stage; the loop that drives it on Flower, crossdc.federation.pipeline_loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from crossdc.strategies.aggregation import mean, subtract
from crossdc.strategies.base import Parameter, RunInfo, Strategy, StrategyError
from crossdc.strategies.diloco import DiLoCo

SCHEDULES = ("gpipe", "1f1b")
ACTIVATION_CODECS = ("none", "int8", "subspace")


def stage_blocks(blocks: int, stages: int, layers: Sequence[int] | None = None) -> list[int]:
    """How many of a model's `blocks` each of `stages` stages holds: `layers` if given (checked), else as even as
    possible, the first stages holding one more when they do not divide evenly. StrategyError naming what is wrong:
    more stages than blocks, a `layers` list of another length, with a stage of none, or not adding up."""
    if stages < 1:
        raise StrategyError("a pipeline needs at least one stage")
    if stages > blocks:
        raise StrategyError(f"{stages} stages for a model of {blocks} blocks: every stage needs at least one block")
    if layers is not None:
        counts = [int(count) for count in layers]
        if len(counts) != stages:
            raise StrategyError(f"'layers' gives {len(counts)} stages' blocks for {stages} datacenters (stages)")
        if any(count < 1 for count in counts):
            raise StrategyError(f"'layers' = {counts}: every stage needs at least one block")
        if sum(counts) != blocks:
            raise StrategyError(f"'layers' = {counts} adds up to {sum(counts)}; the model has {blocks} blocks")
        return counts
    base, extra = divmod(blocks, stages)
    return [base + (1 if stage < extra else 0) for stage in range(stages)]


def replica_groups(datacenters: Sequence[str], replicas: int) -> list[list[str]]:
    """The `datacenters` (config order) cut into `replicas` pipelines of equal length, replica-major: replica r is
    datacenters[r·S : (r + 1)·S], its stage i the i-th. StrategyError when they cannot be cut so."""
    if replicas < 1:
        raise StrategyError(f"replicas = {replicas}: a pipeline run needs at least one replica")
    if len(datacenters) % replicas:
        raise StrategyError(f"{len(datacenters)} datacenters cannot form {replicas} pipelines of equal length (replicas "
                            "must divide the number of datacenters)")
    stages = len(datacenters) // replicas
    return [list(datacenters[r * stages:(r + 1) * stages]) for r in range(replicas)]


def schedule_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which stage `stage` of `stages` runs its micro-batches' forwards ("F", m) and backwards ("B", m)
    in one optimizer step: ``gpipe`` every forward, then every backward; ``1f1b`` min(M, S − stage) forwards, then
    one backward and one forward in turn while forwards remain, then the remaining backwards (torch's Schedule1F1B)."""
    if schedule not in SCHEDULES:
        raise StrategyError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if not 0 <= stage < stages or microbatches < 1:
        raise ValueError(f"stage {stage} of {stages} with {microbatches} micro-batches")
    forwards = [("F", m) for m in range(microbatches)]
    if schedule == "gpipe":
        return forwards + [("B", m) for m in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    order = forwards[:warmup]
    for m in range(microbatches - warmup):
        order += [("B", m), ("F", warmup + m)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]


def schedule_problem(schedule: str, stages: int, microbatches: int) -> str | None:
    """Why `schedule` cannot run `stages` stages on `microbatches` micro-batches (None when it can): 1F1B needs at
    least as many micro-batches as stages (its warm-up and steady phases assume M ≥ S; torch's Schedule1F1B refuses
    fewer)."""
    if schedule == "1f1b" and microbatches < stages:
        return (f"schedule '1f1b' needs at least as many micro-batches as stages ({microbatches} < {stages}); use more "
                "micro-batches or 'gpipe'")
    return None


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a step a stage idles in the schedule's fill and drain, with equal stages and free transfers:
    (S − 1) / (M + S − 1), the same for GPipe and 1F1B (1F1B holds fewer activations, not fewer bubbles)."""
    if stages < 1 or microbatches < 1:
        raise ValueError("a pipeline needs at least one stage and one micro-batch")
    return (stages - 1) / (microbatches + stages - 1)


class Pipeline(Strategy):
    """One model's blocks split across the datacenters in order; GPipe or 1F1B micro-batches over the WAN."""

    name = "pipeline"
    loop = "pipeline"
    parameters = {
        "microbatches": Parameter(int, 4, "micro-batches per optimizer step (must divide the batch size)", low=1),
        "schedule": Parameter(str, "1f1b", "the order of each stage's forwards and backwards", choices=SCHEDULES),
        "activation_codec": Parameter(str, "none", "how activations and their gradients cross each boundary",
                                      choices=ACTIVATION_CODECS),
        "layers": Parameter(str, "", "blocks per stage, comma-separated, in the datacenters' order (empty: as even "
                            "as possible)"),
        "codec_rank": Parameter(int, 0, "the subspace codec's rank (0: the boundary's features // 8)", low=0),
        "stage_timeout_s": Parameter(float, 30.0, "how long a stage waits for another before the step fails (a dead "
                                     "stage fails the run in this time, not in gloo's 30 minutes)", low=1.0),
        "replicas": Parameter(int, 1, "pipelines the datacenters form, replica-major in config order, synced by a "
                              "DiLoCo outer step after every round (1: one pipeline over all of them)", low=1),
        "outer_lr": Parameter(float, 0.7, "with replicas > 1: the outer learning rate of the replicas' DiLoCo step",
                              low=0.0),
        "outer_momentum": Parameter(float, 0.9, "with replicas > 1: the outer Nesterov momentum of that step", low=0.0,
                                    high=0.999),
        "outer_momentum_warmup_rounds": Parameter(int, 0, "with replicas > 1: outer steps over which the outer "
                                                  "momentum rises linearly to outer_momentum", low=0),
    }

    #: with replicas > 1, the DiLoCo whose outer step syncs the replicas (its momentum is this strategy's state)
    outer: DiLoCo | None = None

    def setup(self) -> None:
        super().setup()
        if int(self.params["replicas"]) > 1:
            self.outer = DiLoCo(params={key: self.params[key] for key in
                                        ("outer_lr", "outer_momentum", "outer_momentum_warmup_rounds")})
            self.outer.run = self.run  # the outer schedule counts the run's rounds

    def replicas(self, datacenters: Sequence[str]) -> list[list[str]]:
        """The run's pipelines (:func:`replica_groups` with this strategy's ``replicas``)."""
        return replica_groups(datacenters, int(self.params["replicas"]))

    def replica_step(self, global_weights: Mapping[str, np.ndarray],
                     replica_weights: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The new global model after a round of replicas > 1: one DiLoCo outer step from `global_weights` on the
        mean over the replicas of (replica's whole model − global), every replica weighing the same (each trained
        the same batches per step)."""
        if self.outer is None:
            raise StrategyError(f"strategy '{self.name}': a replica step needs replicas > 1")
        return self.outer.outer_step(dict(global_weights), subtract(mean(replica_weights), global_weights))

    def round_metrics(self, server_round: int, updates: Sequence[Any]) -> dict[str, Any]:
        return self.outer.round_metrics(server_round, updates) if self.outer is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict()} if self.outer is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.outer is not None and state.get("outer") is not None:
            self.outer.load_state_dict(state["outer"])

    def check_run(self, run: RunInfo) -> None:
        super().check_run(run)
        microbatches = int(self.params["microbatches"])
        if run.batch_size % microbatches:
            raise StrategyError(f"strategy '{self.name}': microbatches = {microbatches} does not divide the batch size "
                                f"{run.batch_size}")
        self.check_within_run(run, "outer_momentum_warmup_rounds")
        stages = len(self.replicas(run.datacenters)[0])
        problem = schedule_problem(str(self.params["schedule"]), stages, microbatches)
        if problem is not None:
            raise StrategyError(f"strategy '{self.name}': {problem}")
        if run.grad_clip is not None:
            raise StrategyError(f"strategy '{self.name}' cannot clip gradients yet (workload.grad_clip): each stage holds "
                                f"only its own layers' gradients, and the global norm across stages is not built")
        self.layers()  # a malformed list fails here; whether it fits the model is checked when the model is built

    def layers(self) -> list[int] | None:
        """The `layers` parameter as a list of block counts (None when not given)."""
        text = str(self.params["layers"]).strip()
        if not text:
            return None
        try:
            return [int(part) for part in text.split(",")]
        except ValueError:
            raise StrategyError(f"strategy '{self.name}': layers = {text!r} is not a comma-separated list of whole "
                                "numbers") from None
