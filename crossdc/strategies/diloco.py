"""DiLoCo (Douillard et al., 2023): inner AdamW for τ steps, outer SGD with Nesterov momentum on the server.

Client contract: exactly the base's (:mod:`crossdc.strategies.base`). The inner optimizer is the workload's,
and must be AdamW (``workload.optimizer = "adamw"``, checked before a run starts); its moments stay with the
datacenter across rounds, in its trainer and its durable state store (the trainer saves them every round
and a restarted trainer resumes from them).

Server: the outer gradient is the averaged pseudo-gradient g = x − mean_i y_i = −mean Δy (example-weighted,
like FedAvg's mean; the robust aggregate with ``[security] robust_aggregation``, see Strategy.mean_update); the
outer optimizer is SGD with Nesterov momentum, exactly torch.optim.SGD(lr=outer_lr,
momentum=outer_momentum, nesterov=True) semantics (:func:`crossdc.strategies.aggregation.nesterov_sgd_step`):
b ← μ·b + g (b ← g at the first step), x ← x − lr·(g + μ·b). Its momentum buffer lives on the server and is
checkpointable (:meth:`DiLoCo.state_dict` / :meth:`DiLoCo.load_state_dict`). With outer_lr = 1 and
outer_momentum = 0 it is exactly FedAvg. Defaults follow the paper: outer lr 0.7, momentum 0.9.

The outer learning rate may follow a schedule over the run's rounds (``outer_schedule`` constant | cosine | linear,
``outer_warmup_rounds``, ``outer_min_lr``; :func:`crossdc.lr_schedule.lr_at` counted in outer steps, 0-based, over
run.rounds): few outer steps with a large momentum are where a warm-up helps. The default is the constant outer_lr.
The momentum may warm up too (``outer_momentum_warmup_rounds`` N: μ·(s + 1)/N at 0-based outer step s < N, then μ;
the same count as the learning rate's, torch.optim.SGD's semantics with its param group's momentum set before each
step), so that the first rounds' pseudo-gradients, taken far from where the run ends, weigh less in the buffer.

Like torchft's LocalSGD → DiLoCo, the only method this overrides is the server's step (`aggregate`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from crossdc.lr_schedule import SCHEDULE_KINDS, lr_at, warmed_up
from crossdc.strategies.aggregation import l2_norm, negate, nesterov_sgd_step
from crossdc.strategies.base import Arrays, ClientUpdate, Parameter, RunInfo, Strategy, StrategyError


class DiLoCo(Strategy):
    """Inner AdamW for τ steps per datacenter; outer SGD with Nesterov momentum on the averaged pseudo-gradient."""

    name = "diloco"
    parameters = {
        "outer_lr": Parameter(float, 0.7, "outer (server) learning rate", low=0.0),
        "outer_momentum": Parameter(float, 0.9, "outer Nesterov momentum μ (0 = plain outer SGD)", low=0.0, high=0.999),
        "outer_schedule": Parameter(str, "constant", "the outer learning rate's decay over the run's rounds",
                                    choices=SCHEDULE_KINDS),
        "outer_warmup_rounds": Parameter(int, 0, "outer steps over which the outer learning rate rises linearly to "
                                         "outer_lr", low=0),
        "outer_min_lr": Parameter(float, 0.0, "the outer learning rate a decaying schedule ends at", low=0.0),
        "outer_momentum_warmup_rounds": Parameter(int, 0, "outer steps over which the outer momentum rises linearly "
                                                  "to outer_momentum", low=0),
    }

    #: server state, replaced (never mutated) by each outer step: the outer momentum b, steps taken, last step's norm
    momentum_buffer: dict[str, np.ndarray] | None = None
    outer_steps = 0
    last_step_l2 = 0.0
    last_outer_lr = 0.0

    def check_run(self, run: RunInfo) -> None:
        if run.optimizer != "adamw":
            raise StrategyError(f"strategy '{self.name}' needs workload.optimizer = \"adamw\" (its inner optimizer), "
                                f"got \"{run.optimizer}\"")
        if float(self.params["outer_min_lr"]) > float(self.params["outer_lr"]):
            raise StrategyError(f"strategy '{self.name}': outer_min_lr ({self.params['outer_min_lr']:g}) is above "
                                f"outer_lr ({self.params['outer_lr']:g})")
        self.check_within_run(run, "outer_warmup_rounds", "outer_momentum_warmup_rounds")
        super().check_run(run)

    def outer_lr(self) -> float:
        """The learning rate of the next outer step (the outer schedule at :meth:`schedule_position`)."""
        step, horizon = self.schedule_position()
        return lr_at(step, float(self.params["outer_lr"]), horizon, str(self.params["outer_schedule"]),
                     int(self.params["outer_warmup_rounds"]), float(self.params["outer_min_lr"]))

    def momentum(self) -> float:
        """The outer Nesterov momentum μ of the next outer step (``outer_momentum``, warmed up over
        ``outer_momentum_warmup_rounds`` at :meth:`schedule_position`)."""
        return warmed_up(float(self.params["outer_momentum"]), self.schedule_position()[0],
                         int(self.params["outer_momentum_warmup_rounds"]))

    def schedule_position(self) -> tuple[int, int]:
        """(the next outer step's place in the outer schedule, 0-based; the run's outer steps): one step a round."""
        return self.outer_steps, self.run.rounds if self.run is not None else 0

    def aggregate(self, server_round: int, global_weights: Arrays, updates: Sequence[ClientUpdate],
                  mean: Arrays) -> dict[str, np.ndarray]:
        return self.outer_step(global_weights, mean)

    def outer_step(self, global_weights: Arrays, mean: Arrays) -> dict[str, np.ndarray]:
        """One outer Nesterov step of the tensors in `global_weights` (all of the model's, or one fragment's) on
        the pseudo-gradient −`mean`; each tensor's momentum is its own (a tensor stepped for the first time starts
        from none), so fragments stepped at different times each keep theirs."""
        pseudo_gradient = negate(mean)
        buffer = self.momentum_buffer or {}
        names = list(global_weights)
        previous = {n: buffer[n] for n in names} if all(n in buffer for n in names) else None
        self.last_outer_lr, momentum = self.outer_lr(), self.momentum()
        weights, stepped = nesterov_sgd_step(global_weights, pseudo_gradient, previous, self.last_outer_lr, momentum)
        if momentum > 0.0:  # without momentum the buffer is never read: neither kept nor checkpointed
            self.momentum_buffer = {**buffer, **stepped}
        self.outer_steps += 1
        self.last_step_l2 = l2_norm({n: weights[n].astype(np.float64) - global_weights[n] for n in weights})
        return weights

    def round_metrics(self, server_round: int, updates: Sequence[ClientUpdate]) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "outer_step_l2": self.last_step_l2, "outer_lr": self.last_outer_lr,
                "momentum_l2": l2_norm(self.momentum_buffer) if self.momentum_buffer is not None else 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps,
                "momentum_buffer": None if self.momentum_buffer is None else {k: v.copy() for k, v in self.momentum_buffer.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.outer_steps = int(state.get("outer_steps", 0))
        buffer = state.get("momentum_buffer")
        self.momentum_buffer = None if buffer is None else {k: np.asarray(v, np.float32).copy() for k, v in buffer.items()}
