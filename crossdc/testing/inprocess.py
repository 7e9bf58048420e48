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
A streaming strategy (``loop = "streaming"``, e.g. ``streaming-diloco``) runs with :meth:`InProcessFederation.run_round`
too: each datacenter is then a :class:`~crossdc.clients.streaming_replica.StreamingReplica`, and a round is its H
inner steps with the P fragment exchanges the schedule puts in it, met in the schedule's order (sends and merges at
their steps; an exchange's updates pass the gate against the fragment's weights, its server step is
:meth:`~crossdc.federation.session.RoundSession.aggregate_fragment`). Since a merge happens at its step whenever
its update arrives, this gives the weights a deployed streaming run gives.
A gossip strategy (``loop = "gossip"``) runs with :meth:`InProcessFederation.run_round` too: each datacenter is a
:class:`~crossdc.clients.gossip_replica.GossipReplica`; a round is every replica's τ inner steps, then the messages of
the round's graph handed from sender to receiver (each sized as the link carries it, by link), then every mix and
outer step. There is no server step: the federation's weights are the plain average of the replicas, and
:meth:`InProcessFederation.replica_weights` gives each replica.
What it leaves out: the Flower transport and its polling, worker groups (W = 1), deadlines and the run log.
Bytes are counted as a run counts them: `bytes_down` is the serialised size of each datacenter's train message,
`bytes_up` that of its reply (:func:`~crossdc.protocol.payload_bytes`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict

from crossdc import protocol
from crossdc.clients.gossip_replica import GossipReplica
from crossdc.clients.local_round import run_local_round
from crossdc.clients.local_training import LocalTrainer
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.clients.streaming_replica import SentUpdate, StreamingReplica, sent_answer
from crossdc.compression.downlink import receive
from crossdc.experiment.builders import datacenter_seed, initial_weights
from crossdc.experiment.config import (
    CompressionSection,
    DatacenterSection,
    ExperimentConfig,
    RunSection,
    SecuritySection,
    StrategySection,
    WorkloadSection,
    inner_steps_planned,
)
from crossdc.federation.session import RoundSession
from crossdc.protocol import TrainRequest, encode_results, encode_tensors, payload_bytes, reply_content
from crossdc.strategies.base import ClientUpdate, Strategy
from crossdc.strategies.fragments import SEND
from crossdc.strategies.gossip import Gossip
from crossdc.strategies.mixing import consensus_distances
from crossdc.strategies.streaming_diloco import StreamingDiLoCo
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
    #: a streaming round: the bytes of each exchange's largest reply (the peak a fragment sync sends), by exchange
    exchange_peak_bytes: dict[int, int] = field(default_factory=dict)
    #: a gossip round: the bytes each datacenter-to-datacenter link carried, by (sender, receiver)
    link_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    #: a gossip round: each replica's distance to the replicas' average ‖x_i − x̄‖ after the round, and their mean
    consensus_distance: dict[str, float] = field(default_factory=dict)
    mean_consensus_distance: float | None = None
    #: a gossip round: the neighbours each datacenter mixed without, and why
    missing: dict[str, dict[str, str]] = field(default_factory=dict)


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
        self.trainers = {dc: LocalTrainer(workload, workload.shard(dc), w.batch_size, w.optimizer, w.lr, self.seeds[dc],
                                          options=w.options, horizon_steps=inner_steps_planned(config))
                         for dc in self.datacenters}
        self.stores = {dc: DatacenterStateStore(state_root, run_id, dc) for dc in self.datacenters}
        self.server_round = 0
        #: a streaming run's replicas (built at its first round), the server's result of each exchange (what a
        #: merge needs) and the events of the schedule met so far
        self.replicas: dict[str, StreamingReplica] | None = None
        self.exchange_results: dict[int, dict[str, np.ndarray]] = {}
        self.events_done: set[tuple[str, int]] = set()
        #: a gossip run's replicas (built at its first round)
        self.gossip_replicas: dict[str, GossipReplica] | None = None

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

    def initial_weights(self, datacenter: str) -> dict[str, np.ndarray]:
        """The run's initial weights as `datacenter`'s trainer builds them from the run's seed."""
        return initial_weights(self.config, self.trainers[datacenter].workload)

    def run_round(self, participants: Sequence[str] | None = None, *,
                  cut: Sequence[tuple[str, str]] = ()) -> RoundResult:
        """One round: every datacenter in `participants` (default: all) trains; the strategy aggregates the accepted.
        A streaming strategy's round: its H inner steps and P exchanges (every datacenter takes part). A gossip
        round: every replica trains and mixes; the links between the pairs in `cut` carry nothing either way."""
        if self.strategy.loop in ("streaming", "gossip") and participants is not None:
            raise ValueError(f"a {self.strategy.loop} round has every datacenter take part (no participants list)")
        if cut and self.strategy.loop != "gossip":
            raise ValueError("only a gossip round takes cut links")
        if self.strategy.loop == "streaming":
            return self._run_streaming_round()
        if self.strategy.loop == "gossip":
            return self._run_gossip_round({frozenset(pair) for pair in cut})
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
            start_from = (receive(model["downlink"], self.stores[dc], server_round,
                                  partial(self.initial_weights, dc))
                          if "downlink" in model else model["weights"])
            answer = run_local_round(self.strategy, self.trainers[dc], self.stores[dc], dc, server_round, tau,
                                     start_from, request.received,
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

    def _run_streaming_round(self) -> RoundResult:
        strategy = self.strategy
        if not isinstance(strategy, StreamingDiLoCo):
            raise TypeError(f"strategy '{strategy.name}' declares the streaming loop but is no StreamingDiLoCo")
        plan = strategy.plan(self.weights)
        schedule = plan.schedule
        if self.replicas is None:  # each datacenter's own copy of the strategy: with eager, its own outer state
            self.replicas = {dc: StreamingReplica(copy.deepcopy(strategy), self.trainers[dc], plan, self.weights,
                                                  len(self.datacenters)) for dc in self.datacenters}
        self.server_round += 1
        server_round = self.server_round
        result = RoundResult(server_round, schedule.steps_per_round)
        round_end = server_round * schedule.steps_per_round
        last = schedule.exchange(server_round, schedule.fragments - 1)
        earliest = max(1, schedule.exchange(server_round, 0) - schedule.fragments)
        for event in schedule.events(last, earliest):
            if event.step > round_end or (event.kind, event.exchange) in self.events_done:
                continue
            self.events_done.add((event.kind, event.exchange))
            sent = {dc: replica.meet(event, self.exchange_results.__getitem__) for dc, replica in self.replicas.items()}
            if event.kind == SEND:
                updates = {dc: update for dc, update in sent.items() if update is not None}
                for dc, update in updates.items():
                    result.compute_s[dc] = result.compute_s.get(dc, 0.0) + update.compute_s
                self._streaming_exchange(event.exchange, plan.fragments[event.fragment], schedule.spacing, updates, result)
        return result

    def _streaming_exchange(self, exchange: int, names: Sequence[str], spacing: int, sent: Mapping[str, SentUpdate],
                            result: RoundResult) -> None:
        """Exchange k: every datacenter's fragment update through the gate, the server step, what the merges need.
        Each datacenter's bytes down are those of the message the deployed loop sends it with exchange k: the model at
        exchange 1, else exchange k − 1's result, with the message's config."""
        session = self.session
        server_round = self.server_round
        results_of = [exchange - 1] if exchange - 1 in self.exchange_results else []
        records = (encode_results({k: self.exchange_results[k] for k in results_of}) if exchange > 1
                   else encode_tensors(self.weights))
        for dc in self.datacenters:
            cfg = protocol.stream_config(exchange=exchange, server_round=server_round, tau=result.tau, run_id=self.run_id,
                                         run_dir="", datacenter=dc, results_of=results_of)
            result.bytes_down[dc] = result.bytes_down.get(dc, 0) + payload_bytes(
                RecordDict({**records, protocol.CONFIG_KEY: ConfigRecord(cfg)}))
        reference = {n: self.weights[n] for n in names}
        judged = {}
        for dc, update in sent.items():
            answer = sent_answer(update, self.config.compression.codecs, self.seeds[dc], self.stores[dc])
            content = reply_content({**answer, "extras": {}})
            judged[dc] = session.judge_content(dc, content, spacing, math.inf, reference=reference)
            size = int(judged[dc].record.bytes_up or 0)
            result.bytes_up[dc] = result.bytes_up.get(dc, 0) + size
            result.exchange_peak_bytes[exchange] = max(result.exchange_peak_bytes.get(exchange, 0), size)
        session.reject_outliers(judged)
        accepted = []
        for dc, outcome in judged.items():
            if outcome.update is None:
                result.rejected[dc] = str(outcome.record.reason)
            else:
                accepted.append(outcome.update)
        result.updates.extend(accepted)
        mean = session.aggregate_fragment(names, accepted)[0] if accepted else None  # none: the fragment stays
        self.exchange_results[exchange] = session.exchange_result(exchange, names, mean)

    def _run_gossip_round(self, cut: set[frozenset[str]]) -> RoundResult:
        strategy = self.strategy
        if not isinstance(strategy, Gossip):
            raise TypeError(f"strategy '{strategy.name}' declares the gossip loop but is no Gossip")
        names = self.datacenters
        if self.gossip_replicas is None:  # each datacenter's own copy of the strategy (the same maths everywhere)
            self.gossip_replicas = {dc: GossipReplica(copy.deepcopy(strategy), self.trainers[dc], i, self.weights,
                                                      self.seeds[dc]) for i, dc in enumerate(names)}
        replicas = self.gossip_replicas
        self.server_round += 1
        tau = strategy.tau(self.server_round)
        result = RoundResult(self.server_round, tau)
        for dc, replica in replicas.items():
            result.compute_s[dc] = replica.train(tau).compute_s
        graph = strategy.round_graph(self.server_round)
        inbox: dict[str, list[Any]] = {dc: [] for dc in names}
        for receiver, receiver_dc in enumerate(names):
            for sender in graph.senders_to(receiver):
                sender_dc = names[sender]
                if frozenset((sender_dc, receiver_dc)) in cut:
                    continue
                message = replicas[sender_dc].message_for(replicas[receiver_dc].held_version(sender))
                inbox[receiver_dc].append(message)
                result.link_bytes[(sender_dc, receiver_dc)] = message.nbytes
                result.bytes_up[sender_dc] = result.bytes_up.get(sender_dc, 0) + message.nbytes
                result.bytes_down[receiver_dc] = result.bytes_down.get(receiver_dc, 0) + message.nbytes
        for dc, replica in replicas.items():
            mixed = replica.mix_in(inbox[dc])
            if mixed.missing:
                result.missing[dc] = {names[j]: reason for j, reason in mixed.missing.items()}
        distances, mean_distance, average = consensus_distances([replicas[dc].outer for dc in names])
        result.consensus_distance = dict(zip(names, distances, strict=True))
        result.mean_consensus_distance = mean_distance
        self.session.weights = average
        return result

    def replica_weights(self) -> dict[str, dict[str, np.ndarray]]:
        """A gossip run's replicas (each datacenter's outer weights), by datacenter."""
        if self.gossip_replicas is None:
            raise ValueError("no gossip round has run")
        return {dc: dict(replica.outer) for dc, replica in self.gossip_replicas.items()}

    def evaluate_weights(self, weights: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(validation loss, accuracy) of `weights` on the workload's one validation set (the federation's own weights
        stay as they are)."""
        loss, accuracy, _ = self.session.evaluate(weights)
        return loss, accuracy

    def evaluate(self) -> tuple[float, float]:
        """(validation loss, accuracy) of the current global weights on the workload's one validation set."""
        loss, accuracy, _ = self.session.evaluate()
        return loss, accuracy
