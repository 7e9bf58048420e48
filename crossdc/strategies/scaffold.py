"""SCAFFOLD (Karimireddy et al., 2020), option II: control variates that correct client drift.

State: the server keeps the control variate c (here, checkpointed with :meth:`Scaffold.state_dict`); each
datacenter keeps its own c_i in its durable state store (key ``scaffold-control``), written once per round
by local rank 0, so it survives a SuperNode restart (every Flower message is a new process anyway) and a
trainer restart. A datacenter that misses a round keeps its c_i; a new one starts from c_i = 0.

Client contract, beyond the base's (:mod:`crossdc.strategies.base`):

- down: tensor group ``control`` (record :data:`~crossdc.protocol.CONTROL_KEY`) = c, the same
  names and shapes as the weights;
- local work: every one of the K = τ steps uses the corrected gradient g − c_i + c (applied after the
  gradients are complete: with W > 1 ranks, after DistributedDataParallel averaged them, on every rank);
- up: the update Δy_i = y_i − x and tensor group ``control`` = Δc_i = c_i⁺ − c_i with
  c_i⁺ = c_i − c + (x − y_i)/(K·η_l) (option II). A reply without ``control`` is rejected.

η_l is the inner optimizer's learning rate. SCAFFOLD is defined for plain SGD, where
(x − y_i)/(K·η_l) is exactly the mean corrected gradient and c_i⁺ the mean raw gradient of the K steps;
with momentum or Adam the same formula would mix in the optimizer's own scaling, so this strategy requires
``workload.optimizer = "sgd"`` and says so before a run starts. Tensors that are not trainable parameters
(buffers) get no correction and keep c_i = 0.

Server: x ← x + η_g·mean(Δy) (example-weighted mean; every datacenter runs the same τ·batch, so it is the
plain mean), c ← c + (|S|/N)·mean(Δc) (plain mean over the |S| accepted replies, N = configured
datacenters), which keeps c = (1/N)·Σ_i c_i. η_g = ``global_lr`` from the config. With
``[security] robust_aggregation`` the mean of Δy becomes the robust aggregate (:meth:`Strategy.mean_update`);
the mean of Δc stays the plain mean, so that c stays (1/N)·Σ_i c_i.

Known limit: if a datacenter's reply is lost after it stored c_i⁺ (link cut, round deadline), the server
never adds that Δc_i, and c drifts from the mean of the c_i by Δc_i/N until the next replies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from crossdc.protocol import CONTROL_KEY
from crossdc.strategies.aggregation import l2_norm, scaffold_client_control, scaffold_server_step, subtract, total_sum
from crossdc.strategies.aggregation import mean as plain_mean
from crossdc.strategies.base import Arrays, ClientUpdate, LocalContext, LocalHooks, LocalResult, Parameter, RunInfo, Strategy, StrategyError

#: state-store key of a datacenter's control variate c_i ({tensor name: float32 array})
CLIENT_CONTROL_KEY = "scaffold-control"


def zeros_like(arrays: Arrays) -> dict[str, np.ndarray]:
    return {name: np.zeros(np.shape(value), dtype=np.float32) for name, value in arrays.items()}


class Scaffold(Strategy):
    """SCAFFOLD, option II: local steps on g − c_i + c; server and datacenter control variates."""

    name = "scaffold"
    parameters = {"global_lr": Parameter(float, 1.0, "server step size η_g: x ← x + η_g·mean(Δy)", low=0.0)}
    client_groups = (CONTROL_KEY,)
    reply_groups = (CONTROL_KEY,)
    client_state_key = CLIENT_CONTROL_KEY
    #: c, the server control variate: created as zeros at the first round, replaced (never mutated) by each step
    control: dict[str, np.ndarray] | None = None

    def check_run(self, run: RunInfo) -> None:
        if run.optimizer != "sgd":
            raise StrategyError(f"strategy '{self.name}' needs workload.optimizer = \"sgd\" (its control variates are "
                                f"defined for plain SGD steps), got \"{run.optimizer}\"")
        super().check_run(run)

    # -- server half -----------------------------------------------------------------------

    def client_arrays(self, server_round: int, global_weights: Arrays) -> dict[str, dict[str, np.ndarray]]:
        if self.control is None:
            self.control = zeros_like(global_weights)
        return {CONTROL_KEY: self.control}

    def aggregate(self, server_round: int, global_weights: Arrays, updates: Sequence[ClientUpdate],
                  mean: Arrays) -> dict[str, np.ndarray]:
        if self.control is None:
            self.control = zeros_like(global_weights)
        mean_dc = plain_mean([u.group(CONTROL_KEY) for u in updates])
        weights, self.control = scaffold_server_step(global_weights, self.control, mean, mean_dc,
                                                     float(self.params["global_lr"]), len(updates), self.num_datacenters)
        return weights

    def round_metrics(self, server_round: int, updates: Sequence[ClientUpdate]) -> dict[str, Any]:
        return {
            "control_l2": l2_norm(self.control) if self.control is not None else 0.0,
            "client_state": {u.datacenter: {"loaded_round": int(u.metrics.get("control-state-round", -1)),
                                            "loaded_sum": float(u.metrics.get("control-state-sum", float("nan")))}
                             for u in updates},
        }

    def state_dict(self) -> dict[str, Any]:
        return {"control": None if self.control is None else {k: v.copy() for k, v in self.control.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        control = state.get("control")
        self.control = None if control is None else {k: np.asarray(v, np.float32).copy() for k, v in control.items()}

    # -- datacenter half ----------------------------------------------------------------------

    @staticmethod
    def _controls(global_weights: Arrays, received: Mapping[str, Arrays], state: Any) -> tuple[Arrays, Arrays]:
        if CONTROL_KEY not in received:
            raise StrategyError(f"strategy 'scaffold': the train message has no tensor group '{CONTROL_KEY}' (the server's c)")
        c = received[CONTROL_KEY]
        c_i = zeros_like(global_weights) if state is None else state
        for name, value in global_weights.items():
            for label, arrays in (("c", c), ("c_i", c_i)):
                if name not in arrays or np.shape(arrays[name]) != np.shape(value):
                    raise StrategyError(f"strategy 'scaffold': {label} does not match the weights at tensor '{name}'")
        return c, c_i

    def local_plan(self, context: LocalContext, global_weights: Arrays, received: Mapping[str, Arrays], state: Any) -> dict[str, Any]:
        c, c_i = self._controls(global_weights, received, state)
        return {"correction": {name: (np.asarray(c[name], np.float32) - np.asarray(c_i[name], np.float32))
                               for name in context.parameter_names}}

    def local_hooks(self, plan: Mapping[str, Any], global_weights: Arrays, model: torch.nn.Module) -> LocalHooks:
        device = next(model.parameters()).device
        correction = {name: torch.from_numpy(np.array(value, dtype=np.float32)).to(device) for name, value in plan["correction"].items()}

        def correct(m: torch.nn.Module) -> None:
            with torch.no_grad():
                for name, param in m.named_parameters():
                    if param.grad is not None and name in correction:
                        param.grad.add_(correction[name])

        return LocalHooks(after_backward=correct)

    def local_finish(self, context: LocalContext, global_weights: Arrays, local_weights: Arrays,
                     received: Mapping[str, Arrays], state: Any) -> LocalResult:
        c, c_i = self._controls(global_weights, received, state)
        c_new = scaffold_client_control(c_i, c, global_weights, local_weights, context.tau, context.lr, context.parameter_names)
        return LocalResult(
            extras={CONTROL_KEY: subtract(c_new, {n: np.asarray(c_i[n], np.float32) for n in c_new})},
            state=c_new,
            metrics={"control-state-round": float(context.state_round), "control-state-sum": total_sum(c_i),
                     "control-l2": l2_norm(c_new)},
        )
