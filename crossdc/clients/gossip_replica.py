"""One datacenter's side of a gossip run: its replica, what it sends its neighbours and how it mixes what they sent.

Promises (the datacenter half of :mod:`crossdc.strategies.gossip`'s contract): :meth:`GossipReplica.train` runs one
gossip round's τ inner steps from the replica's outer weights (the inner optimizer and the data order carry on);
:meth:`~GossipReplica.message_for` is what a neighbour gets, given the version of this replica's public copy that
the neighbour holds; :meth:`~GossipReplica.mix_in` mixes the messages that arrived (each whole or not at all) and
takes the outer step. Whatever carries the messages (the in-process driver, the datacenter-to-datacenter transport),
the same messages give the same weights.

A message is a :class:`GossipMessage`: ``full`` (the sender's state, or with codecs its public copy, dense
float32) or ``delta`` (with codecs: Q(θ − θ̂) of this round, to add to the public copy of version ``base``); its
``payload`` is the codec pipeline's wire format (crossdc.compression.wire), so its size is the bytes on the link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from crossdc.clients.local_training import StepsResult
from crossdc.clients.streaming_replica import ReplicaTrainer
from crossdc.compression.pipeline import CodecPipeline
from crossdc.compression.uplink import decode_arrays
from crossdc.compression.wire import CodecError
from crossdc.strategies.gossip import Gossip
from crossdc.strategies.mixing import available_row, choco_mix, mix

Arrays = Mapping[str, np.ndarray]

FULL, DELTA = "full", "delta"


@dataclass(frozen=True)
class GossipMessage:
    """What one datacenter sends a neighbour in one gossip round (see the module docstring)."""

    sender: int
    server_round: int
    kind: str
    version: int
    base: int | None
    payload: np.ndarray  # uint8, the codec pipeline's wire format

    @property
    def nbytes(self) -> int:
        """The bytes of the payload: what the link carries (the header is a few bytes more)."""
        return int(self.payload.nbytes)


@dataclass(frozen=True)
class MixResult:
    """What one mix did: the neighbours whose state it used and those it did without (and why)."""

    server_round: int
    used: tuple[int, ...]
    missing: dict[int, str]


def dense_payload(arrays: Arrays) -> np.ndarray:
    """`arrays` in the codec pipeline's wire format without codecs (dense float32, names and shapes checked on
    decoding)."""
    return CodecPipeline([]).encode({n: np.asarray(v, np.float32) for n, v in arrays.items()}, 0).payload


class GossipReplica:
    """A datacenter's replica under a gossip strategy (see the module docstring): `index` is its position in the
    run's datacenters; `weights` the run's initial weights (every replica and every public copy starts there);
    `codec_seed` seeds its codecs."""

    def __init__(self, strategy: Gossip, trainer: ReplicaTrainer, index: int, weights: Arrays, codec_seed: int = 0) -> None:
        self.strategy, self.trainer, self.index = strategy, trainer, index
        self.compressed = strategy.compressed
        self.outer: dict[str, np.ndarray] = {n: np.asarray(v, np.float32).copy() for n, v in weights.items()}
        self.momentum: dict[str, np.ndarray] | None = None
        self._initial_weights = {n: v.copy() for n, v in self.outer.items()}
        trainer.set_weights(self.outer)
        #: the rounds mixed so far
        self.server_round = 0
        #: θ after this round's inner steps (None between a mix and the next round's steps)
        self.inner: dict[str, np.ndarray] | None = None
        #: CHOCO's public copies θ̂_j (this replica's own and its neighbours'), each with the round it is at; all
        #: start at the initial weights, version 0, the same on every datacenter
        self.public: dict[int, dict[str, np.ndarray]] = {}
        self.versions: dict[int, int] = {}
        self.pipeline = CodecPipeline(strategy.run.codecs if strategy.run else (), seed=codec_seed, error_feedback=False)
        self._delta: np.ndarray | None = None
        self._delta_base: int | None = None

    def public_copy(self, datacenter: int) -> dict[str, np.ndarray]:
        """θ̂ of `datacenter` as this replica holds it (the initial weights until its first message)."""
        if datacenter not in self.public:
            self.public[datacenter] = {n: v.copy() for n, v in self._initial_weights.items()}
            self.versions[datacenter] = 0
        return self.public[datacenter]

    def held_version(self, datacenter: int) -> int:
        """The version of `datacenter`'s public copy this replica holds (0: the initial weights, and always 0 without
        codecs, where there are no public copies)."""
        if not self.compressed:
            return 0
        self.public_copy(datacenter)
        return self.versions[datacenter]

    def train(self, steps: int, **hooks: Any) -> StepsResult:
        """One gossip round's inner steps from the outer weights; then the outgoing message is prepared (with codecs:
        this round's Q(θ − θ̂), added to the replica's own public copy)."""
        if self.inner is not None:
            raise ValueError(f"round {self.server_round + 1} is trained already and not mixed yet")
        result = self.trainer.train_steps(steps, **hooks)
        self.inner = self.trainer.get_weights()
        if self.compressed:
            own = self.public_copy(self.index)
            encoded = self.pipeline.encode({n: self.inner[n] - own[n] for n in own}, self.server_round + 1)
            self._delta, self._delta_base = encoded.payload, self.versions[self.index]
            self.public[self.index] = {n: own[n] + encoded.sent[n].numpy() for n in own}
            self.versions[self.index] = self.server_round + 1
        return result

    def message_for(self, receiver_holds: int | None = None) -> GossipMessage:
        """This round's message for a neighbour holding version `receiver_holds` of this replica's public copy (a
        delta when it holds the version the delta is based on, else the copy in full)."""
        if self.inner is None:
            raise ValueError("no round trained: nothing to send")
        server_round = self.server_round + 1
        if not self.compressed:
            return GossipMessage(self.index, server_round, FULL, server_round, None, dense_payload(self.inner))
        assert self._delta is not None
        if receiver_holds == self._delta_base:
            return GossipMessage(self.index, server_round, DELTA, server_round, self._delta_base, self._delta)
        return GossipMessage(self.index, server_round, FULL, server_round, None, dense_payload(self.public[self.index]))

    def mix_in(self, messages: Sequence[GossipMessage]) -> MixResult:
        """Mix this round's arrived `messages` (each used whole or not at all) and take the outer step; the trainer
        then holds the new outer weights."""
        if self.inner is None:
            raise ValueError("mix_in before train: no inner weights to mix")
        server_round = self.server_round + 1
        weights = self.strategy.round_weights(server_round)
        expected = [j for j in range(weights.shape[0]) if j != self.index and weights[self.index, j] > 0]
        states: dict[int, Arrays] = {}
        missing: dict[int, str] = {j: "no message" for j in expected}
        for message in messages:
            if message.sender not in expected or message.server_round != server_round:
                continue  # not a neighbour this round, or another round's: ignored
            try:
                states[message.sender] = self._receive(message)
                missing.pop(message.sender)
            except (CodecError, ValueError) as err:
                missing[message.sender] = str(err).splitlines()[0]
        row = available_row(weights, self.index, list(states))
        if self.compressed:
            public = {j: self.public_copy(j) for j in row}
            mixed = choco_mix(self.inner, public, row, self.index, self.strategy.consensus_step)
        else:
            mixed = mix({self.index: self.inner, **states}, row)
        self.outer, self.momentum = self.strategy.outer_step(self.outer, mixed, self.momentum, server_round)
        self.trainer.set_weights(self.outer)
        self.inner = None
        self.server_round = server_round
        return MixResult(server_round, tuple(sorted(states)), missing)

    def _receive(self, message: GossipMessage) -> Arrays:
        """The state a message brings (its sender's θ, or with codecs its new public copy, stored here); ValueError
        for a delta on a copy this replica does not hold."""
        reference = self.outer
        if not self.compressed:
            return decode_arrays(message.payload, reference)
        held = self.held_version(message.sender)
        if message.kind == FULL:
            copy = decode_arrays(message.payload, reference)
        elif message.kind == DELTA and message.base == held:
            delta = decode_arrays(message.payload, reference)
            copy = {n: self.public[message.sender][n] + delta[n] for n in delta}
        else:
            raise ValueError(f"a delta on version {message.base} of datacenter {message.sender}'s copy arrived; "
                             f"this replica holds version {held}")
        self.public[message.sender], self.versions[message.sender] = copy, message.version
        return copy

    def adopt(self, server_round: int, weights: Arrays) -> None:
        """Rejoin at `server_round` with a neighbour's replica `weights` (its outer weights after that round's mix):
        they become this replica's outer weights; the outer momentum starts again from zero, and the inner optimizer
        and the data order carry on. Public copies keep their versions: a neighbour that holds an older one of this
        replica's copy, or sends a delta on one this replica lacks, gets or sends the copy in full."""
        if self.inner is not None:
            raise ValueError(f"round {self.server_round + 1} is trained and not mixed: nothing to adopt into")
        if server_round <= self.server_round:
            raise ValueError(f"a replica of round {server_round} is not ahead of this one (round {self.server_round})")
        if set(weights) != set(self.outer):
            raise ValueError("the neighbour's replica does not have this model's tensors")
        self.outer = {n: np.asarray(weights[n], np.float32).copy() for n in self.outer}
        self.momentum = None
        self.server_round = server_round
        self.trainer.set_weights(self.outer)

    def state_dict(self) -> dict[str, Any]:
        """Everything to go on exactly from here (between a mix and the next round's steps)."""
        return {"outer": self.outer, "momentum": self.momentum, "server_round": self.server_round,
                "trainer": self.trainer.state_dict(), "public": self.public, "versions": dict(self.versions),
                "initial": self._initial_weights, "pipeline": self.pipeline.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""
        self.outer = {n: np.asarray(v, np.float32).copy() for n, v in state["outer"].items()}
        self.momentum = state["momentum"]
        self.server_round = int(state["server_round"])
        self._initial_weights = {n: np.asarray(v, np.float32).copy() for n, v in state["initial"].items()}
        self.public = {int(j): dict(v) for j, v in state["public"].items()}
        self.versions = {int(j): int(v) for j, v in state["versions"].items()}
        self.pipeline.load_state_dict(state["pipeline"])
        self.trainer.set_weights(self.outer)
        self.trainer.load_state_dict(state["trainer"])
        self.inner = None
