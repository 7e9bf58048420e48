"""One datacenter's side of a streaming run: the replica that trains on and sends and merges fragments on schedule.

Promises (the datacenter half of :mod:`crossdc.strategies.streaming_diloco`'s contract): :meth:`StreamingReplica.advance`
runs the inner steps up to a step of the schedule (the inner optimizer and the data order carry on, as in one long
call); :meth:`~StreamingReplica.send` returns a fragment's update Δ = θ_local − θ_ref at that step;
:meth:`~StreamingReplica.merge` applies an exchange's outer update to the fragment as it is at the merge step.
Whatever drives it (the in-process driver step by step, the persistent trainer while its exchanges travel), the
same schedule gives the same weights: nothing depends on when an update arrived, only on the step it is merged at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from crossdc import protocol as proto
from crossdc.clients.local_training import StepsResult
from crossdc.compression.downlink import decode_result
from crossdc.compression.uplink import encode_update
from crossdc.strategies.fragments import MERGE, SEND, Event, eager_outer_gradient, fragment_of, mix
from crossdc.strategies.streaming_diloco import StreamingDiLoCo, StreamingPlan

Arrays = Mapping[str, np.ndarray]


class ReplicaTrainer(Protocol):
    """What a replica trains with: a :class:`~crossdc.clients.local_training.LocalTrainer`, or a worker group's
    (:class:`crossdc.clients.worker.GroupTrainer`)."""

    def train_steps(self, steps: int, **hooks: Any) -> StepsResult: ...
    def get_weights(self) -> dict[str, np.ndarray]: ...
    def set_weights(self, arrays: Mapping[str, np.ndarray]) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class SentUpdate:
    """A fragment's update as sent, with what the replica did since its previous send: the examples and mean loss of
    those inner steps and their compute seconds (the reply's metrics)."""

    exchange: int
    delta: dict[str, np.ndarray]
    num_examples: int
    mean_loss: float
    compute_s: float


class StreamingReplica:
    """A datacenter's model replica under a streaming schedule (see the module docstring).

    `strategy` is the datacenter's own instance of the run's strategy: with ``eager`` on, its outer optimizer
    state is this datacenter's copy. `datacenters` N gives the eager weight w = 1/N."""

    def __init__(self, strategy: StreamingDiLoCo, trainer: ReplicaTrainer, plan: StreamingPlan, weights: Arrays,
                 datacenters: int) -> None:
        self.strategy, self.trainer, self.plan = strategy, trainer, plan
        self.eager = bool(strategy.params["eager"])
        self.alpha = float(strategy.params["alpha"])
        self.weight = 1.0 / datacenters
        trainer.set_weights(weights)
        #: θ_ref: each fragment's global values as last merged (the pseudo-gradient is taken against them)
        self.reference: dict[str, np.ndarray] = {n: np.asarray(v, np.float32).copy() for n, v in weights.items()}
        #: inner steps run so far
        self.step = 0
        #: the updates sent and not yet merged, by exchange; with eager, each fragment's previous one too
        self.sent: dict[int, dict[str, np.ndarray]] = {}
        self.previous_sent: dict[int, dict[str, np.ndarray]] = {}
        #: the latest exchange sent (0: none yet)
        self.last_sent = 0
        #: since the last send: examples, steps, summed step losses, compute seconds
        self._examples = self._steps = 0
        self._loss_sum = self._compute_s = 0.0

    def state_dict(self) -> dict[str, Any]:
        """Everything the replica needs to go on exactly from where it is: the local weights, the inner optimizer
        and data position, the schedule's position, the references and updates in flight, its own outer state
        (eager). Taken between events (right after a send, for a checkpoint)."""
        return {"weights": self.trainer.get_weights(), "trainer": self.trainer.state_dict(),
                "strategy": self.strategy.state_dict(), "step": self.step, "last_sent": self.last_sent,
                "reference": {n: v.copy() for n, v in self.reference.items()},
                "sent": {k: dict(v) for k, v in self.sent.items()},
                "previous_sent": {k: dict(v) for k, v in self.previous_sent.items()},
                "since_send": (self._examples, self._steps, self._loss_sum, self._compute_s)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (the same run's plan)."""
        self.trainer.set_weights(state["weights"])
        self.trainer.load_state_dict(state["trainer"])
        self.strategy.load_state_dict(state["strategy"])
        self.step, self.last_sent = int(state["step"]), int(state["last_sent"])
        self.reference = {n: np.asarray(v, np.float32).copy() for n, v in state["reference"].items()}
        self.sent = {int(k): dict(v) for k, v in state["sent"].items()}
        self.previous_sent = {int(k): dict(v) for k, v in state["previous_sent"].items()}
        examples, steps, loss_sum, compute_s = state["since_send"]
        self._examples, self._steps, self._loss_sum, self._compute_s = int(examples), int(steps), float(loss_sum), float(compute_s)

    def remaining_events(self, last_exchange: int) -> Iterator[Event]:
        """The schedule's events up to `last_exchange` this replica has still to meet, in order."""
        return self.plan.schedule.events_after_send(last_exchange, self.last_sent)

    def advance(self, to_step: int, **hooks: Any) -> StepsResult | None:
        """Run the inner steps up to `to_step` (none if it is reached already; ValueError to go back)."""
        if to_step < self.step:
            raise ValueError(f"the replica is at step {self.step}, cannot go back to {to_step}")
        if to_step == self.step:
            return None
        result = self.trainer.train_steps(to_step - self.step, **hooks)
        self.step = to_step
        self._examples += result.num_examples
        self._steps += result.steps
        self._loss_sum += result.mean_loss * result.steps
        self._compute_s += result.compute_s
        return result

    def send(self, exchange: int) -> SentUpdate:
        """The update Δ = θ_local − θ_ref of exchange k's fragment, at the send step (ValueError elsewhere)."""
        schedule = self.plan.schedule
        if self.step != schedule.send_step(exchange):
            raise ValueError(f"exchange {exchange} is sent after step {schedule.send_step(exchange)}, the replica is at "
                             f"step {self.step}")
        _, fragment = schedule.locate(exchange)
        local = self.trainer.get_weights()
        delta = {n: (local[n] - self.reference[n]).astype(np.float32) for n in self.plan.fragments[fragment]}
        self.sent[exchange] = delta
        self.last_sent = exchange
        sent = SentUpdate(exchange, delta, self._examples, self._loss_sum / self._steps if self._steps else float("nan"),
                          self._compute_s)
        self._examples = self._steps = 0
        self._loss_sum = self._compute_s = 0.0
        return sent

    def merge(self, exchange: int, update: Arrays | None) -> None:
        """Merge exchange k's outer update at its merge step: `update` is the fragment's new global values (eager
        off), or the mean update of the fragment's previous exchange (eager on; None before its first), dense or as
        the downlink codecs sent it (crossdc.compression.downlink.FragmentDownlink)."""
        schedule = self.plan.schedule
        if self.step != schedule.merge_step(exchange):
            raise ValueError(f"exchange {exchange} is merged after step {schedule.merge_step(exchange)}, the replica is "
                             f"at step {self.step}")
        _, fragment = schedule.locate(exchange)
        names = self.plan.fragments[fragment]
        if update is not None:  # compressed on its way down: decoded against the fragment's values as last merged
            update = decode_result(update, fragment_of(self.reference, names), self.eager)
        own = self.sent.pop(exchange)
        if self.eager:
            if update is None:
                stand_in = eager_outer_gradient(None, own, None, self.weight)
            else:
                stand_in = eager_outer_gradient(update, own, self.previous_sent[fragment], self.weight)
            self.previous_sent[fragment] = own
            new_global = self.strategy.fragment_step(fragment_of(self.reference, names), stand_in)
        else:
            if update is None:
                raise ValueError(f"exchange {exchange}: the merge needs the fragment's new global values")
            new_global = {n: np.asarray(update[n], np.float32) for n in names}
        local = self.trainer.get_weights()
        local.update(mix(new_global, fragment_of(local, names), self.alpha))
        self.trainer.set_weights(local)
        self.reference.update({n: v.copy() for n, v in new_global.items()})

    def meet(self, event: Event, result_of: Callable[[int], Arrays | None]) -> SentUpdate | None:
        """Train up to the event's step, then do it: a send returns the fragment's update; a merge takes the server
        result it needs from `result_of(exchange)` (which may wait for it) and returns None."""
        self.advance(event.step)
        if event.kind == SEND:
            return self.send(event.exchange)
        if event.kind == MERGE:
            needed = self.needed_update(event.exchange)
            self.merge(event.exchange, None if needed is None else result_of(needed))
        return None

    def needed_update(self, exchange: int) -> int | None:
        """The exchange whose server result the merge of `exchange` needs: itself (eager off), the fragment's
        previous exchange (eager on; None in the first round)."""
        if not self.eager:
            return exchange
        previous = exchange - self.plan.schedule.fragments
        return previous if previous >= 1 else None


def sent_answer(sent: SentUpdate, codecs: Sequence[str], seed: int, store: Any) -> dict[str, Any]:
    """A fragment's update as a reply carries it (``{"delta"|"payload", "metrics"}``): through the run's codecs, their
    state in the datacenter's store, with the metrics of the inner steps since the previous send."""
    metrics: dict[str, Any] = {proto.NUM_EXAMPLES: sent.num_examples, proto.TRAIN_LOSS: sent.mean_loss,
                               proto.COMPUTE_S: sent.compute_s}
    if codecs:
        payload, codec_metrics = encode_update(sent.delta, codecs, sent.exchange, seed, store)
        return {"payload": payload, "metrics": {**metrics, **codec_metrics}}
    return {"delta": sent.delta, "metrics": metrics}
