"""One datacenter's part of one round, the same code for the persistent trainer and in-process drivers.

Promises (the datacenter half of :mod:`crossdc.strategies.base`'s contract): the strategy's stored state is
read from the durable state store at the start of every round (never kept in memory between rounds, so a
restarted trainer or SuperNode changes nothing); exactly τ steps run with the strategy's hooks on every local
rank; the new strategy state and the trainer's own state (inner optimizer, data position) are written once,
by local rank 0, tagged with the round, before the reply leaves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from crossdc import protocol as proto
from crossdc.clients.local_training import LocalTrainer, StepsResult
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.compression.uplink import encode_update
from crossdc.strategies.base import Arrays, LocalContext, Strategy

#: the state-store key the datacenter's local trainer state lives under (written by rank 0 only)
TRAINER_STATE_KEY = "local-trainer"


def train_with_plan(strategy: Strategy, trainer: LocalTrainer, tau: int, weights: Arrays, plan: Mapping[str, Any]) -> StepsResult:
    """Every local rank: load the global weights, build the strategy's hooks from the plan, run τ steps."""
    trainer.set_weights(weights)
    hooks = strategy.local_hooks(plan, weights, trainer.model)
    return trainer.train_steps(tau, extra_loss=hooks.extra_loss, after_backward=hooks.after_backward)


def run_local_round(strategy: Strategy, trainer: LocalTrainer, store: DatacenterStateStore, datacenter: str,
                    server_round: int, tau: int, weights: Arrays, received: Mapping[str, Arrays],
                    broadcast: Callable[[dict[str, Any]], None] | None = None, codecs: Sequence[str] = (),
                    codec_seed: int = 0) -> dict[str, Any]:
    """Local rank 0's round: returns ``{"delta", "extras", "metrics"}`` (see the module docstring); with `codecs`,
    ``"payload"`` (the update through the codec pipeline, crossdc.compression.uplink) instead of ``"delta"``.

    `broadcast(command)` (W > 1) hands ``{"op": "train", "tau", "weights", "plan"}`` to the other ranks before
    rank 0 trains; they run :func:`train_with_plan` on it.
    """
    stored = store.load(strategy.client_state_key) if strategy.client_state_key else None
    state, state_round = stored if stored is not None else (None, 0)
    context = LocalContext(datacenter=datacenter, server_round=server_round, tau=tau, lr=trainer.mean_lr(tau),
                           parameter_names=trainer.parameter_names(), state_round=state_round)
    plan = strategy.local_plan(context, weights, received, state)
    if broadcast is not None:
        broadcast({"op": proto.TRAIN_OP, "tau": tau, "weights": weights, "plan": plan})
    result = train_with_plan(strategy, trainer, tau, weights, plan)
    local = trainer.get_weights()
    delta = {name: local[name] - np.asarray(weights[name], dtype=np.float32) for name in local}
    finished = strategy.local_finish(context, weights, local, received, state)
    started = time.perf_counter()
    if strategy.client_state_key and finished.state is not None:
        store.save(strategy.client_state_key, finished.state, server_round)
    store.save(TRAINER_STATE_KEY, trainer.state_dict(), server_round)
    metrics: dict[str, Any] = {
        proto.NUM_EXAMPLES: result.num_examples,
        proto.TRAIN_LOSS: result.mean_loss,
        proto.COMPUTE_S: result.compute_s,
        proto.STATE_SAVE_S: time.perf_counter() - started,
        **finished.metrics,
    }
    if codecs:
        payload, codec_metrics = encode_update(delta, codecs, server_round, codec_seed, store)
        metrics.update(codec_metrics)
        return {"payload": payload, "extras": finished.extras, "metrics": metrics}
    return {"delta": delta, "extras": finished.extras, "metrics": metrics}
