"""Streaming DiLoCo (Douillard et al., 2025): DiLoCo synced fragment by fragment, each exchange overlapped with compute.

Client contract (what a datacenter must do; the fragments and their schedule are
:mod:`crossdc.strategies.fragments`' :func:`~crossdc.strategies.fragments.split_fragments` and
:class:`~crossdc.strategies.fragments.FragmentSchedule`, built from the run's model by :meth:`StreamingDiLoCo.plan`):

- train continuously with the inner AdamW (its moments and the data order carry on across exchanges), H = τ inner
  steps a round;
- after inner step s_k of exchange k (fragment p), send the fragment's update Δ = θ_local,p − θ_ref,p, where
  θ_ref,p is the fragment's global value it last merged (the initial weights before the first merge); keep
  training;
- after inner step s_k + τ_o (``overlap``), merge: with ``eager`` off, take the fragment's new global value θ_g
  the server sent for exchange k (waiting for it if it has not arrived: the wait is the datacenter's idle time);
  with ``eager`` on, compute θ_g itself with its own copy of the outer optimizer from the eager stand-in
  ḡ_prev + w·(g_own − g_own_prev) (g = −Δ, ḡ_prev the server's average pseudo-gradient of the fragment's previous
  exchange, w = 1/N), so the network has a whole round more to deliver ḡ; then θ_local,p ← (1 − α)·θ_g + α·θ_local,p
  and θ_ref,p ← θ_g.

Server: per exchange, the example-weighted (or robust) mean of the fragment's updates, and DiLoCo's outer Nesterov
step on that fragment only (:meth:`DiLoCo.outer_step`: each tensor keeps its own momentum, so every fragment has its
own outer state). The server's global model, evaluated and checkpointed, is that of these steps. It sends a
datacenter θ_g of the fragment (eager off) or ḡ (eager on).

With P = 1, τ_o = 0, α = 0 and eager off this is exactly DiLoCo (same updates, same outer steps, same weights).
Defaults: outer lr 0.7 and momentum 0.9 as DiLoCo; overlap τ_o = 1 and α = 0.5 as the paper's runs; P = 2 (the
paper keeps 3 layers a fragment on models of 24 layers and more; the default 2-layer model has two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossdc.strategies.base import Parameter, RunInfo, StrategyError
from crossdc.strategies.diloco import DiLoCo
from crossdc.strategies.fragments import FragmentError, FragmentSchedule, split_fragments


@dataclass(frozen=True)
class StreamingPlan:
    """The fragments (tensor names, in the model's order) and the schedule of a streaming run."""

    fragments: tuple[tuple[str, ...], ...]
    schedule: FragmentSchedule


class StreamingDiLoCo(DiLoCo):
    """DiLoCo whose model is synced in P fragments at staggered steps, each exchange overlapped with τ_o steps."""

    name = "streaming-diloco"
    loop = "streaming"
    parameters = {
        **DiLoCo.parameters,
        "fragments": Parameter(int, 2, "P: the fragments the model is synced in, one at a time", low=1),
        "overlap": Parameter(int, 1, "τ_o: inner steps between sending a fragment's update and merging its outer "
                             "update (at most tau / fragments)", low=0),
        "alpha": Parameter(float, 0.5, "α: the merge keeps (1 − α) of the global fragment and α of the local one",
                           low=0.0, high=1.0),
        "eager": Parameter(bool, False, "merge with the datacenter's own fresh pseudo-gradient in place of its share "
                           "of the average, which may then arrive a whole round later"),
    }

    def check_run(self, run: RunInfo) -> None:
        super().check_run(run)
        schedule = self.schedule
        if schedule.start != schedule.end:
            raise StrategyError(f"strategy '{self.name}' needs a constant tau (the inner steps of every round), got a "
                                f"schedule from {schedule.start} to {schedule.end}")
        try:
            fragment_schedule = self.fragment_schedule()
        except FragmentError as err:
            raise StrategyError(f"strategy '{self.name}': {err}") from None
        if fragment_schedule.overlap == fragment_schedule.spacing and float(self.params["alpha"]) == 0.0:
            # the merge of a fragment's previous exchange and its next send fall on one step: α = 0 replaces the
            # local fragment by the global one just before the send, so every update sent would be zero
            raise StrategyError(f"strategy '{self.name}': overlap = H/P = {fragment_schedule.spacing} with alpha = 0 "
                                "discards every inner step (the merge before each send replaces the local fragment); "
                                "use alpha > 0 or a shorter overlap")

    def schedule_position(self) -> tuple[int, int]:
        """Each fragment takes one outer step a round: the P-th outer step of a round is the round's."""
        step, rounds = super().schedule_position()
        return step // int(self.params["fragments"]), rounds

    def fragment_schedule(self) -> FragmentSchedule:
        """When each fragment is sent and merged (FragmentError if τ, P and τ_o do not fit together)."""
        return FragmentSchedule(self.schedule.end, int(self.params["fragments"]), int(self.params["overlap"]))

    def plan(self, model_weights: Mapping[str, np.ndarray]) -> StreamingPlan:
        """The run's fragments of the model whose tensors are `model_weights` (StrategyError if they cannot be
        made), with the schedule."""
        try:
            fragments = split_fragments({n: int(np.asarray(v).nbytes) for n, v in model_weights.items()},
                                        int(self.params["fragments"]))
            return StreamingPlan(tuple(fragments), self.fragment_schedule())
        except FragmentError as err:
            raise StrategyError(f"strategy '{self.name}': {err}") from None

    def fragment_step(self, global_fragment: Mapping[str, np.ndarray], mean: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The server's step of one exchange: the fragment's new global values from its mean update."""
        return self.outer_step(global_fragment, mean)

    def exchange_result(self, fragment_weights: Mapping[str, np.ndarray],
                        mean: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """What the server sends the datacenters for one exchange, once its step is done: the fragment's new global
        values (eager off), or its mean update (eager on; zeros when no update was accepted)."""
        if not self.params["eager"]:
            return {n: np.asarray(v, np.float32).copy() for n, v in fragment_weights.items()}
        if mean is None:
            return {n: np.zeros_like(v) for n, v in fragment_weights.items()}
        return dict(mean)

    def round_metrics(self, server_round: int, updates: Sequence[Any]) -> dict[str, Any]:
        return {**super().round_metrics(server_round, updates), "fragments": int(self.params["fragments"])}
