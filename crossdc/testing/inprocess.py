"""The federation's rounds in one process, without Flower: for tests and benchmarks that need many rounds fast.

Same code paths as a real run, minus the transport: each datacenter is a
:class:`~crossdc.clients.local_training.LocalTrainer` with its own durable
:class:`~crossdc.clients.state_store.DatacenterStateStore`, driven by
:func:`~crossdc.clients.local_round.run_local_round` (exactly what the persistent trainer runs per round); the
server side is the strategy's ``tau`` / ``client_arrays`` / ``aggregate`` behind the update gate
(:mod:`crossdc.federation.update_gate`: the size limit, the tensor checks, then the round's norm outliers), as in
:mod:`crossdc.federation.sync_loop`.
What it leaves out: Flower messages and their (de)serialisation (the float32 tensors, or the codec payload
when the run compresses, are passed as they are, which is what the wire format carries), worker groups (W = 1), deadlines and the run log.
Bytes are still counted as a run counts them: `bytes_down` is the serialised size of the message a datacenter would be
sent (:func:`~crossdc.protocol.payload_bytes` of the same records), `bytes_up` the update as sent (codec
payload or dense float32) plus the strategy's dense reply groups (SCAFFOLD's control variate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from crossdc import protocol as proto
from crossdc.clients.local_round import run_local_round
from crossdc.clients.local_training import LocalTrainer
from crossdc.workloads import load_model_weights, model_weights
from crossdc import protocol as wire
from crossdc.protocol import global_model
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.compression.downlink import DownlinkSender, receive
from crossdc.protocol import CONFIG_KEY, encode_tensors, payload_bytes, raw_fp32_bytes
from crossdc.compression.uplink import decode_arrays
from crossdc.compression.wire import CodecError
from crossdc.experiment.config import ExperimentConfig, SecuritySection
from crossdc.experiment.builders import build_strategy, build_workload, datacenter_seed, initial_model
from crossdc.federation.update_gate import rejection_reason, size_rejection_reason, update_norm_outliers, update_size_limit
from crossdc.strategies.base import ClientUpdate, Strategy
from crossdc.workloads import Workload, evaluate


@dataclass
class RoundResult:
    """One in-process round: τ, the accepted updates, and why the others were rejected."""

    server_round: int
    tau: int
    updates: list[ClientUpdate] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    strategy_metrics: dict[str, Any] = field(default_factory=dict)
    #: bytes of each datacenter's update as sent (the codec payload, or dense float32 without codecs) and its extra groups
    bytes_up: dict[str, int] = field(default_factory=dict)
    #: bytes of the message each datacenter was sent (model or downlink payload, the strategy's groups, the config)
    bytes_down: dict[str, int] = field(default_factory=dict)
    #: seconds of local training per datacenter (the trainer's `compute-s`)
    compute_s: dict[str, float] = field(default_factory=dict)


class InProcessFederation:
    """Datacenters and server of one experiment in this process (see the module docstring)."""

    def __init__(self, workload: Workload, strategy: Strategy, datacenters: Sequence[str], batch_size: int, optimizer: str,
                 lr: float, seeds: Mapping[str, int], state_root: str | Path, initial_weights: Mapping[str, np.ndarray],
                 run_id: str = "inprocess", codecs: Sequence[str] = (), downlink_codecs: Sequence[str] = (),
                 security: SecuritySection = SecuritySection()) -> None:
        """`security` gives the size limit and the norm-outlier factor; its robust aggregation is the strategy's
        (set by build_strategy, or by the caller on a strategy built by hand)."""
        self.workload, self.strategy, self.lr = workload, strategy, lr
        self.downlink = DownlinkSender(downlink_codecs) if downlink_codecs else None
        self.codecs, self.seeds = tuple(codecs), dict(seeds)
        self.datacenters = list(datacenters)
        self.trainers = {dc: LocalTrainer(workload, workload.shard(dc), batch_size, optimizer, lr, seeds[dc]) for dc in self.datacenters}
        self.stores = {dc: DatacenterStateStore(state_root, run_id, dc) for dc in self.datacenters}
        self.weights: dict[str, np.ndarray] = {k: np.asarray(v, np.float32).copy() for k, v in initial_weights.items()}
        self.norm_rejection_factor = security.norm_rejection_factor
        self.max_bytes = update_size_limit(raw_fp32_bytes(self.weights), len(strategy.reply_groups), security.max_update_mb)
        self.server_round = 0
        self._eval_model: torch.nn.Module | None = None

    @classmethod
    def from_config(cls, config: ExperimentConfig, state_root: str | Path, run_id: str = "inprocess") -> "InProcessFederation":
        """The experiment as `crossdc run` builds it: same workload, strategy, initial weights and data-order seeds."""
        workload = build_workload(config)
        strategy = build_strategy(config)
        weights = model_weights(initial_model(config, workload))
        w = config.workload
        seeds = {dc: datacenter_seed(config, dc) for dc in config.datacenter_names}
        return cls(workload, strategy, config.datacenter_names, w.batch_size, w.optimizer, w.lr, seeds, state_root, weights, run_id,
                   config.compression.codecs, config.compression.downlink_codecs, config.security)

    def run_round(self, participants: Sequence[str] | None = None) -> RoundResult:
        """One round: every datacenter in `participants` (default: all) trains; the strategy aggregates the accepted."""
        self.server_round += 1
        tau = self.strategy.tau(self.server_round)
        sent = {group: {k: v.copy() for k, v in arrays.items()}
                for group, arrays in self.strategy.client_arrays(self.server_round, self.weights).items()}
        result = RoundResult(self.server_round, tau)
        group_records: dict[str, Any] = encode_tensors(self.weights) if self.downlink is None else {}
        for group, arrays in sent.items():
            group_records.update(encode_tensors(arrays, group))
        round_config = {wire.ROUND: self.server_round, wire.TAU: tau, **self.strategy.client_config(self.server_round)}
        if self.downlink is not None:
            self.downlink.prepare(self.weights, self.server_round)
        for dc in (self.datacenters if participants is None else participants):
            start_from = self.weights
            records: dict[str, Any] = {}
            cfg: dict[str, Any] = {}
            if self.downlink is not None:  # the reference the datacenter holds, rebuilt from what it was sent
                records, cfg = self.downlink.message_for(dc)
                start_from = receive(global_model(RecordDict({**records, CONFIG_KEY: ConfigRecord(cfg)}))["downlink"],
                                     self.stores[dc], self.server_round)
            result.bytes_down[dc] = payload_bytes(RecordDict({**records, **group_records,
                                                              CONFIG_KEY: ConfigRecord({**round_config, wire.DATACENTER: dc, **cfg})}))
            answer = run_local_round(self.strategy, self.trainers[dc], self.stores[dc], dc, self.server_round, tau, self.lr,
                                     start_from, sent, codecs=self.codecs, codec_seed=self.seeds[dc])
            extras = answer["extras"]
            result.compute_s[dc] = float(answer["metrics"][proto.COMPUTE_S])
            result.bytes_up[dc] = (int(answer["payload"].nbytes) if "payload" in answer else raw_fp32_bytes(answer["delta"])) \
                + sum(raw_fp32_bytes(extras[group]) for group in self.strategy.reply_groups if group in extras)
            too_big = size_rejection_reason(result.bytes_up[dc], self.max_bytes)
            if too_big is not None:
                result.rejected[dc] = too_big
                continue
            if "payload" in answer:
                try:
                    answer["delta"] = decode_arrays(answer["payload"], self.weights)
                except CodecError as err:
                    result.rejected[dc] = f"undecodable update: {err}"
                    continue
            reason = rejection_reason(answer["delta"], self.weights)
            for group in self.strategy.reply_groups:
                if reason is None:
                    reason = f"missing tensor group '{group}'" if group not in extras else rejection_reason(extras[group], self.weights)
            if reason is not None:
                result.rejected[dc] = reason
                continue
            result.updates.append(ClientUpdate(dc, answer["delta"], int(answer["metrics"][proto.NUM_EXAMPLES]), answer["metrics"],
                                               {g: extras[g] for g in self.strategy.reply_groups}))
        outliers = update_norm_outliers({u.datacenter: u.delta for u in result.updates}, self.norm_rejection_factor)
        result.rejected.update(outliers)
        result.updates = [u for u in result.updates if u.datacenter not in outliers]
        if self.downlink is not None:
            for update in result.updates:
                self.downlink.acknowledge(update.datacenter)
        if result.updates:
            self.weights = self.strategy.aggregate(self.server_round, self.weights, result.updates)
            result.strategy_metrics = self.strategy.round_metrics(self.server_round, result.updates)
        return result

    def evaluate(self) -> tuple[float, float]:
        """(validation loss, accuracy) of the current global weights on the workload's one validation set."""
        if self._eval_model is None:
            self._eval_model = self.workload.make_model()
        load_model_weights(self._eval_model, self.weights)
        return evaluate(self.workload, self._eval_model)
