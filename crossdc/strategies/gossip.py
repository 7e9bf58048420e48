"""Decentralized gossip: every datacenter trains its own replica and mixes it with its neighbours, with no coordinator
on the training path (NoLoCo, Kolehmainen et al., 2025, generalised to any doubly stochastic topology; CHOCO-Gossip,
Koloskova et al., 2019, for compressed exchanges).

Client contract (what every datacenter does; the topology, its mixing matrices W and the CHOCO step are
:mod:`crossdc.strategies.mixing`'s, the same pure functions on every datacenter):

- hold the replica's outer weights φ_i (the run's initial weights at first) and its own outer momentum; train τ inner
  steps a gossip round from φ_i (the inner optimizer's state and the data order carry on across rounds), reaching θ_i;
- exchange with this round's neighbours (:meth:`Gossip.round_graph`; the same graph on every datacenter, drawn from
  the run's seed and the round): send θ_i to every datacenter that mixes it and receive each sender's θ_j. Without
  codecs a message is the whole θ_j in float32. With ``[compression] codecs`` (fixed topologies only) it is CHOCO's:
  every datacenter keeps a public copy θ̂_j of itself and of each neighbour, identical everywhere; a message is the
  codecs' Q(θ_j − θ̂_j) and both ends add it to θ̂_j (so what one round leaves out goes with the next: the public
  copy is the error feedback, and no codec residual is kept), or θ̂_j in full when the receiver's copy is not the
  version the sender's delta is based on (it missed an exchange or restarted);
- mix: m_i = θ_i + γ·Σ_j w_ij·(θ̂_j − θ̂_i) with CHOCO (γ = ``consensus_step``), m_i = Σ_j w_ij·θ_j otherwise; a
  neighbour whose message did not arrive within ``exchange_timeout_s`` is left out of this round, its weight kept
  by the receiver (a whole neighbour state or none);
- outer step on the pseudo-gradient g_i = φ_i − m_i: SGD with momentum μ (``outer_momentum``, optionally warmed up
  over the first ``outer_momentum_warmup_rounds`` rounds as DiLoCo's), Nesterov if ``nesterov``, learning rate
  ``outer_lr``; then θ_i ← φ_i. With random pairs, lr α and heavy-ball momentum β this is
  NoLoCo's rule m ← β·m + α·(mean of the pair's θ − φ_i), φ ← φ + m; with ``outer_lr`` 1 and momentum 0 it is plain
  decentralized local SGD (φ_i ← m_i).

Since every W is doubly stochastic, the mean of the m_i is the mean of the θ_i, and the mean of the replicas follows
DiLoCo's outer step on the datacenters' mean pseudo-gradient (exactly, without momentum; with momentum, because the
momentum buffers are linear in the pseudo-gradients). The model a gossip run ends with is the plain average of the
replicas φ_i; each replica is kept too. Defaults are NoLoCo's: random pairs, outer lr 0.7, momentum 0.5 (heavy
ball).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from crossdc.lr_schedule import warmed_up
from crossdc.strategies.aggregation import nesterov_sgd_step
from crossdc.strategies.base import Parameter, RunInfo, Strategy, StrategyError
from crossdc.strategies.mixing import (
    FIXED_TOPOLOGIES,
    TOPOLOGIES,
    MixingError,
    RoundGraph,
    exponential_period,
    mixing_matrix,
    round_graph,
)

Arrays = Mapping[str, np.ndarray]

#: γ when ``consensus_step`` is 0 and the exchanges are compressed (CHOCO needs a step below 1; measured stable with
#: top-10 % on a ring of 4 in tests/test_gossip_mixing.py)
DEFAULT_CHOCO_STEP = 0.2


class Gossip(Strategy):
    """Every datacenter its own replica; every τ inner steps a mix with this round's neighbours and an outer step."""

    name = "gossip"
    loop = "gossip"
    parameters = {
        "topology": Parameter(str, "random-pairs", "who mixes with whom each round", choices=TOPOLOGIES),
        "mixing": Parameter(float, 0.0, "the weight of each neighbour's state (0: chosen by the topology, "
                            "Metropolis–Hastings on a graph, 1/2 in a pair)", low=0.0, high=1.0),
        "outer_lr": Parameter(float, 0.7, "the outer learning rate on the pseudo-gradient φ − mix", low=0.0),
        "outer_momentum": Parameter(float, 0.5, "the outer momentum (each datacenter keeps its own)", low=0.0,
                                    high=0.999),
        "nesterov": Parameter(bool, False, "Nesterov momentum for the outer step (NoLoCo: heavy ball)"),
        "outer_momentum_warmup_rounds": Parameter(int, 0, "gossip rounds over which the outer momentum rises linearly "
                                                  "to outer_momentum (as DiLoCo's)", low=0),
        "consensus_step": Parameter(float, 0.0, "γ of CHOCO's mix with compressed exchanges (0: 1 without codecs, "
                                    f"{DEFAULT_CHOCO_STEP} with)", low=0.0, high=1.0),
        "exchange_timeout_s": Parameter(float, 30.0, "how long a datacenter waits for a neighbour's state before it "
                                        "mixes without it", low=0.1),
    }

    def check_run(self, run: RunInfo) -> None:
        super().check_run(run)
        if self.schedule.start != self.schedule.end:
            raise StrategyError(f"strategy '{self.name}' needs a constant tau (the inner steps of every gossip round), "
                                f"got a schedule from {self.schedule.start} to {self.schedule.end}")
        self.check_within_run(run, "outer_momentum_warmup_rounds")
        topology = self.params["topology"]
        if run.codecs and topology not in FIXED_TOPOLOGIES:
            raise StrategyError(f"strategy '{self.name}': compressed exchanges ([compression] codecs) need a fixed "
                                f"topology ({', '.join(sorted(FIXED_TOPOLOGIES))}): CHOCO's public copies must meet the "
                                f"same neighbours every round, and topology \"{topology}\" changes them")
        rounds = exponential_period(len(run.datacenters)) if topology == "exponential" else 1
        try:
            for server_round in range(1, rounds + 1):  # every distinct graph of the run: each must mix correctly
                mixing_matrix(self.round_graph(server_round), float(self.params["mixing"]))
            if topology == "random-pairs" and len(run.datacenters) % 2:  # a triple appears every round
                mixing_matrix(RoundGraph(3, frozenset((i, j) for i in range(3) for j in range(3) if i != j), False,
                                         ((0, 1, 2),)), float(self.params["mixing"]))
        except MixingError as err:
            raise StrategyError(f"strategy '{self.name}': {err}") from None

    @property
    def compressed(self) -> bool:
        """Whether the exchanges go through the run's codecs (CHOCO public copies)."""
        return bool(self.run is not None and self.run.codecs)

    @property
    def consensus_step(self) -> float:
        """γ of the mix (see the module docstring)."""
        given = float(self.params["consensus_step"])
        return given if given > 0 else (DEFAULT_CHOCO_STEP if self.compressed else 1.0)

    def round_graph(self, server_round: int) -> RoundGraph:
        """Gossip round `server_round`'s graph over the run's datacenters (indices in config order)."""
        names = list(self.run.datacenters) if self.run is not None else []
        rtts = {(names.index(a), names.index(b)): rtt for (a, b), rtt in self.run.rtt_ms.items()} if self.run else {}
        return round_graph(str(self.params["topology"]), self.num_datacenters, server_round,
                           seed=self.run.seed if self.run else 0, rtt_ms=rtts or None)

    def round_weights(self, server_round: int) -> np.ndarray:
        """W of gossip round `server_round` (doubly stochastic; checked before the run started)."""
        return mixing_matrix(self.round_graph(server_round), float(self.params["mixing"]))

    def momentum(self, server_round: int) -> float:
        """The outer momentum of gossip round `server_round` (from 1): ``outer_momentum``, warmed up over
        ``outer_momentum_warmup_rounds`` (crossdc.lr_schedule.warmed_up, as DiLoCo's)."""
        return warmed_up(float(self.params["outer_momentum"]), server_round - 1,
                         int(self.params["outer_momentum_warmup_rounds"]))

    def outer_step(self, outer: Arrays, mixed: Arrays, buffer: Arrays | None,
                   server_round: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(φ', momentum') from a replica's outer weights φ, its mix m and its momentum (None before its first step)
        in gossip round `server_round`: torch.optim.SGD's step on g = φ − m (see the module docstring)."""
        gradient = {n: np.asarray(outer[n], np.float32) - np.asarray(mixed[n], np.float32) for n in outer}
        return nesterov_sgd_step(outer, gradient, buffer, float(self.params["outer_lr"]), self.momentum(server_round),
                                 nesterov=bool(self.params["nesterov"]))

    def round_metrics(self, server_round: int, updates: Any) -> dict[str, Any]:
        return {"topology": self.params["topology"]}
