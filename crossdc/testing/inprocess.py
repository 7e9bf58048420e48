"""The federation's rounds in one process, without Flower's transport: for tests and benchmarks that need many
rounds fast, and for plug-in authors to try a strategy without starting processes.

Same code paths as a real run, minus the transport: the server side is a
:class:`~crossdc.federation.session.RoundSession` (the same train messages, update gate, norm-outlier check and
server step as :mod:`crossdc.federation.sync_loop`); each datacenter is a
:class:`~crossdc.clients.local_training.LocalTrainer` with its own durable
:class:`~crossdc.clients.state_store.DatacenterStateStore`, which reads its train message as the ClientApp does
(:class:`crossdc.protocol.TrainRequest`) and runs :func:`~crossdc.clients.local_round.run_local_round` (exactly
what the persistent trainer runs per round); its answer is packed as the ClientApp packs it
(:func:`crossdc.protocol.reply_content`) and judged at the gate.
What it leaves out: the Flower transport and its polling, worker groups (W = 1), deadlines and the run log.
Bytes are counted as a run counts them: `bytes_down` is the serialised size of each datacenter's train message,
`bytes_up` that of its reply (:func:`~crossdc.protocol.payload_bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from crossdc import protocol
from crossdc.clients.local_round import run_local_round
from crossdc.clients.local_training import LocalTrainer
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.compression.downlink import receive
from crossdc.experiment.builders import datacenter_seed
from crossdc.experiment.config import (
    CompressionSection,
    DatacenterSection,
    ExperimentConfig,
    RunSection,
    SecuritySection,
    StrategySection,
    WorkloadSection,
)
from crossdc.federation.session import RoundSession
from crossdc.protocol import TrainRequest, payload_bytes, reply_content
from crossdc.strategies.base import ClientUpdate, Strategy
from crossdc.workloads import Workload


@dataclass
class RoundResult:
    """One in-process round: τ, the accepted updates, and why the others were rejected."""

    server_round: int
    tau: int
    updates: list[ClientUpdate] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    strategy_metrics: dict[str, Any] = field(default_factory=dict)
    #: bytes of each datacenter's reply as it would travel (serialised: the update, its extra groups, the metrics)
    bytes_up: dict[str, int] = field(default_factory=dict)
    #: bytes of the message each datacenter was sent (model or downlink payload, the strategy's groups, the config)
    bytes_down: dict[str, int] = field(default_factory=dict)
    #: seconds of local training per datacenter (the trainer's `compute-s`)
    compute_s: dict[str, float] = field(default_factory=dict)


class InProcessFederation:
    """Datacenters and server of one experiment in this process (see the module docstring).

    `workload`, `strategy` and `initial_weights` default to what `crossdc run` builds from `config`; `seeds` (each
    datacenter's data-order seed) to :func:`~crossdc.experiment.builders.datacenter_seed`."""

    def __init__(self, config: ExperimentConfig, state_root: str | Path, run_id: str = "inprocess", *,
                 workload: Workload | None = None, strategy: Strategy | None = None,
                 initial_weights: Mapping[str, np.ndarray] | None = None, seeds: Mapping[str, int] | None = None) -> None:
        self.config = config
        self.session = RoundSession(config, run_id, workload=workload, strategy=strategy, initial_weights=initial_weights)
        self.run_id = run_id
        self.datacenters = list(config.datacenter_names)
        w = config.workload
        self.seeds = dict(seeds) if seeds is not None else {dc: datacenter_seed(config, dc) for dc in self.datacenters}
        workload = self.session.workload
        self.trainers = {dc: LocalTrainer(workload, workload.shard(dc), w.batch_size, w.optimizer, w.lr, self.seeds[dc])
                         for dc in self.datacenters}
        self.stores = {dc: DatacenterStateStore(state_root, run_id, dc) for dc in self.datacenters}
        self.server_round = 0

    @classmethod
    def from_config(cls, config: ExperimentConfig, state_root: str | Path, run_id: str = "inprocess") -> InProcessFederation:
        """The experiment as `crossdc run` builds it: same workload, strategy, initial weights and data-order seeds."""
        return cls(config, state_root, run_id)

    @classmethod
    def from_parts(cls, workload: Workload, strategy: Strategy, datacenters: Sequence[str], batch_size: int,
                   optimizer: str, lr: float, seeds: Mapping[str, int], state_root: str | Path,
                   initial_weights: Mapping[str, np.ndarray], run_id: str = "inprocess", codecs: Sequence[str] = (),
                   downlink_codecs: Sequence[str] = (), security: SecuritySection = SecuritySection()) -> InProcessFederation:
        """A federation of pieces built by hand (a strategy under test, a workload of the test's own): the config
        says the rest. `security` gives the size limit and the norm-outlier factor; robust aggregation is the
        strategy's own."""
        config = ExperimentConfig(
            run=RunSection(name=run_id), strategy=StrategySection(name=strategy.name),
            workload=WorkloadSection(batch_size=batch_size, optimizer=optimizer, lr=lr),
            datacenters=tuple(DatacenterSection(name) for name in datacenters),
            compression=CompressionSection(codecs=tuple(codecs), downlink_codecs=tuple(downlink_codecs)), security=security)
        return cls(config, state_root, run_id, workload=workload, strategy=strategy, initial_weights=initial_weights,
                   seeds=seeds)

    @property
    def strategy(self) -> Strategy:
        return self.session.strategy

    @property
    def workload(self) -> Workload:
        return self.session.workload

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self.session.weights

    def run_round(self, participants: Sequence[str] | None = None) -> RoundResult:
        """One round: every datacenter in `participants` (default: all) trains; the strategy aggregates the accepted."""
        self.server_round += 1
        session, server_round = self.session, self.server_round
        tau = self.strategy.tau(server_round)
        result = RoundResult(server_round, tau)
        session.prepare_model(server_round, server_round)
        judged = {}
        for dc in (self.datacenters if participants is None else participants):
            task = protocol.train_config(server_round=server_round, tau=tau, run_id=self.run_id, run_dir="",
                                         datacenter=dc)
            content, _ = session.train_message(dc, server_round, task)
            result.bytes_down[dc] = payload_bytes(content)
            started = time.perf_counter()
            request = TrainRequest.from_message(content)  # what the ClientApp hands the trainer
            model = request.model
            start_from = (receive(model["downlink"], self.stores[dc], server_round) if "downlink" in model
                          else model["weights"])
            answer = run_local_round(self.strategy, self.trainers[dc], self.stores[dc], dc, server_round, tau,
                                     self.config.workload.lr, start_from, request.received,
                                     codecs=self.config.compression.codecs, codec_seed=self.seeds[dc])
            reply = reply_content(answer)
            result.compute_s[dc] = float(answer["metrics"][protocol.COMPUTE_S])
            judged[dc] = session.judge_content(dc, reply, tau, time.perf_counter() - started)
            result.bytes_up[dc] = int(judged[dc].record.bytes_up or 0)  # the gate measured the serialised reply
        session.reject_outliers(judged)
        for dc, outcome in judged.items():
            session.note_outcome(dc, outcome, server_round)
            if outcome.update is None:
                result.rejected[dc] = str(outcome.record.reason)
            else:
                result.updates.append(outcome.update)
        if result.updates:
            session.aggregate(server_round, result.updates)
            result.strategy_metrics = self.strategy.round_metrics(server_round, result.updates)
        return result

    def evaluate(self) -> tuple[float, float]:
        """(validation loss, accuracy) of the current global weights on the workload's one validation set."""
        loss, accuracy, _ = self.session.evaluate()
        return loss, accuracy
