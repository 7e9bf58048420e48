"""The persistent local trainer of one datacenter.

Started once per run (by `crossdc run` for a local federation), it keeps the
model, the inner optimizer and the data order in memory and answers the
short-lived ClientApps over a local authenticated socket, so no round pays
process start-up or a torch import. After every round it writes its state
(inner optimizer moments, data position) to the durable state store; a
restarted trainer resumes from it. With `workers` W > 1 in the datacenter's
config it is rank 0 of a W-process data-parallel group (DistributedDataParallel);
only rank 0 talks to the ClientApp.

Protocol (one request per connection, pickled dicts):
- ``{"op": "ping"}`` → ``{"ok": True, "pid", "worker_pids", "datacenter", "run_id", "group_start_s"}``
- ``{"op": "train", "run_id", "round", "tau", "weights": {name: ndarray}, "received": {group: {name: ndarray}}}`` →
  ``{"ok": True, "delta": {name: ndarray}, "extras": {group: {name: ndarray}}, "metrics": {...}}`` where delta is
  w_local − w_global after exactly `tau` steps with the run's strategy's local hooks, `received` the message's
  extra tensor groups (e.g. SCAFFOLD's ``control``) and `extras` the strategy's tensor groups for the reply
  (see :mod:`crossdc.clients.local_round` and :mod:`crossdc.strategies.base`).
- ``{"op": "inject-fault", "fault": "nan" | "corrupt"}`` → ``{"ok": True}``: the next train reply's update is
  spoiled (chaos tests; only in a run started with fault injection, see :mod:`crossdc.clients.fault_injection`).
- any failure → ``{"ok": False, "error": "one line"}``; the trainer keeps serving.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from multiprocessing.connection import Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from crossdc import protocol as proto
from crossdc.clients.channel import serve_requests
from crossdc.clients.fault_injection import POISON_KINDS, poison_answer
from crossdc.clients.gossip_agent import GossipAgent, GossipFailed, RoundReport
from crossdc.clients.gossip_replica import GossipReplica, dense_payload
from crossdc.clients.gossip_transport import GossipTransport, exchange_all
from crossdc.clients.local_round import run_local_round
from crossdc.clients.local_training import LocalTrainer
from crossdc.clients.state_store import StateStoreError
from crossdc.clients.streaming_replica import SentUpdate, StreamingReplica, sent_answer
from crossdc.clients.streaming_worker import StreamingFailed, StreamingWorker
from crossdc.clients.worker import GROUP_TIMEOUT, GroupTrainer, backend, build_rank, use_device
from crossdc.compression.downlink import DownlinkOutOfSync, receive
from crossdc.compression.uplink import decode_arrays
from crossdc.compression.wire import CodecError
from crossdc.deployment.heartbeat import BEATS_PER_TIMEOUT, HeartbeatSender, Target
from crossdc.experiment.builders import datacenter_seed, initial_model, initial_weights
from crossdc.experiment.config import ExperimentConfig, inner_steps_planned, parse_config
from crossdc.experiment.processes import die_with_parent, die_with_run_root
from crossdc.experiment.rundir import (
    SETTINGS_FAULT_INJECTION,
    SETTINGS_GOSSIP_ADDRESSES,
    SETTINGS_HEARTBEAT,
    SETTINGS_HEARTBEAT_KEY,
    SETTINGS_PIPELINE_GROUP,
    RunDir,
)
from crossdc.protocol import GossipRequest, PipelineRequest, ProtocolError, StreamRequest, TrainRequest
from crossdc.strategies.base import Strategy, StrategyError
from crossdc.strategies.gossip import Gossip
from crossdc.strategies.pipeline import Pipeline, stage_blocks
from crossdc.strategies.streaming_diloco import StreamingDiLoCo
from crossdc.workloads.stages import model_blocks

if TYPE_CHECKING:  # a pipeline stage imports torch.distributed.pipelining (~2 s): only a stage's trainer does
    from crossdc.clients.pipeline_stage import StageRunner

log = logging.getLogger("crossdc.trainer")

RequestT = TypeVar("RequestT", TrainRequest, StreamRequest, GossipRequest, PipelineRequest)

class DatacenterTrainer:
    """Handles requests for one datacenter of one run, as rank 0 of its worker group.

    With `workers` W > 1 it starts W − 1 worker processes (crossdc.clients.worker), joins them in a
    torch.distributed group (gloo; GPU placement with NCCL is not built yet) and broadcasts each round's command; the
    group lives across rounds. If a rank fails, the round fails cleanly (an error for the ClientApp,
    so the server records that datacenter's failure), every rank of the group is stopped, and a new
    group is started from the state store for the next round.
    """

    def __init__(self, run_dir: RunDir, datacenter: str) -> None:
        settings = run_dir.settings()
        config = parse_config(settings["config"])
        if datacenter not in config.datacenter_names:
            raise ValueError(f"datacenter '{datacenter}' is not in the run's config ({', '.join(config.datacenter_names)})")
        self.run_dir, self.run_id, self.datacenter, self.config = run_dir, settings["run_id"], datacenter, config
        #: a streaming run's replica, training in its own thread from the run's first message on
        self.streaming: StreamingWorker | None = None
        #: a gossip run's agent, training and exchanging in its own thread from the run's start message on
        self.gossip: GossipAgent | None = None
        #: a pipeline run's stage, and the last round it trained
        self.stage: StageRunner | None = None
        self.stage_round = 0
        #: an injected fault for the next train reply (crossdc.clients.fault_injection), or None
        self.poison_next: str | None = None
        self.world = next(dc.workers for dc in config.datacenters if dc.name == datacenter)
        self.codecs, self.codec_seed = config.compression.codecs, datacenter_seed(config, datacenter)
        self.generation = 0
        self.workers: list[subprocess.Popen[bytes]] = []
        started = time.perf_counter()
        self._start_group()
        self.group_start_s = time.perf_counter() - started
        self.attempt = self._stored_attempt()  # the newest attempt at the run served here (crossdc resume starts another)
        log.info("%s: worker group of %d started in %.2fs", datacenter, self.world, self.group_start_s)

    def _start_group(self) -> None:
        if self.world > 1:
            self.generation += 1
            rendezvous = self.run_dir.path / "trainers" / f"{self.datacenter}.group-{self.generation}"
            rendezvous.unlink(missing_ok=True)
            log_file = open(self.run_dir.logs / f"workers-{self.datacenter}.log", "ab")
            self.workers = [
                subprocess.Popen([sys.executable, "-m", "crossdc.clients.worker", "--run-dir", str(self.run_dir.path),
                                  "--datacenter", self.datacenter, "--rank", str(rank), "--world", str(self.world),
                                  "--rendezvous", str(rendezvous)],
                                 stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
                for rank in range(1, self.world)
            ]
            log_file.close()
            use_device(0, self.world)
            dist.init_process_group(backend(self.world), init_method=f"file://{rendezvous}", rank=0, world_size=self.world,
                                    timeout=GROUP_TIMEOUT)
        self.trainer, self.store, self.last_round, self.strategy = build_rank(self.run_dir, self.datacenter, 0, self.world)
        if self.last_round:
            log.info("%s: local state of round %d restored", self.datacenter, self.last_round)

    def _stop_group(self, graceful: bool) -> None:
        if self.world == 1:
            return
        if graceful:
            try:
                dist.broadcast_object_list([{"op": proto.STOP_OP}], src=0)
            except Exception:
                graceful = False
        for worker in self.workers:
            if not graceful:
                worker.kill()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(timeout=10)
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        self.workers = []

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
            self.stage = None
        if self.gossip is not None:
            self.gossip.cancel(self.config.run.round_timeout_s)
            self.gossip = None
        if self.streaming is not None:  # its thread may be handing the group a command: it stops first
            try:
                self.streaming.cancel(self.config.run.round_timeout_s)
            except StreamingFailed as err:
                log.warning("%s: %s", self.datacenter, err)
            self.streaming = None
        self._stop_group(graceful=True)

    def _rewind(self, to_round: int) -> None:
        """Make the state after `to_round` current again (the store's kept versions, every key) and, if anything
        changed, restart the worker group on it, so the ranks' optimizer and data position are those of that round."""
        changed = self.store.rewind(to_round)
        if changed:
            log.info("%s: resumed run: local state rewound to round %d (%s)", self.datacenter, to_round, changed)
            self._stop_group(graceful=True)
            self._start_group()
        self.last_round = min(self.last_round, to_round)  # rounds after it are trained again, also without state

    def _stored_attempt(self) -> int:
        """The newest attempt at the run this datacenter served (kept beside its state: a restarted trainer knows)."""
        try:
            return int((self.store.directory / ATTEMPT_FILE).read_text().strip())
        except (OSError, ValueError):
            return 0

    def _set_attempt(self, attempt: int) -> None:
        self.attempt = attempt
        (self.store.directory / ATTEMPT_FILE).write_text(str(attempt))

    def initial_weights(self) -> dict[str, np.ndarray]:
        """The run's initial weights, built from its seed as the coordinator builds them."""
        return initial_weights(self.config, self.trainer.workload)

    def worker_pids(self) -> list[int]:
        return [os.getpid(), *(w.pid for w in self.workers)]

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == proto.PING_OP:
            return {"ok": True, "pid": os.getpid(), "worker_pids": self.worker_pids(), "datacenter": self.datacenter,
                    "run_id": self.run_id, "last_round": self.last_round, "group_start_s": self.group_start_s,
                    "gossip_round": self.gossip.replica.server_round if self.gossip is not None else None,
                    "steps_taken": self.trainer.steps_taken}
        if op == proto.TRAIN_OP:
            return self._train(request)
        if op == proto.STREAM_OP:
            return self._stream(request)
        if op == proto.GOSSIP_OP:
            return self._gossip(request)
        if op == proto.PIPELINE_OP:
            return self._pipeline(request)
        if op == proto.INJECT_FAULT_OP:
            return self._inject_fault(request)
        return {"ok": False, "error": f"unknown trainer op {op!r}"}

    def _inject_fault(self, request: dict[str, Any]) -> dict[str, Any]:
        """Spoil the next train reply's update as `request["fault"]` says, if this run was started with fault
        injection on (crossdc.clients.fault_injection); a refusal otherwise."""
        if not self.run_dir.settings().get(SETTINGS_FAULT_INJECTION):
            return {"ok": False, "error": f"{self.datacenter}: fault injection is off for run {self.run_id}"}
        kind = request.get("fault")
        if kind not in POISON_KINDS:
            return {"ok": False, "error": f"unknown injected fault {kind!r}; expected one of {', '.join(POISON_KINDS)}"}
        self.poison_next = str(kind)
        log.warning("fault injection: the next update of %s will be spoiled (%s)", self.datacenter, kind)
        return {"ok": True}

    def _pipeline(self, message: dict[str, Any]) -> dict[str, Any]:
        """One round of a pipeline run at this datacenter's stage: its τ optimizer steps with the other stages, its
        state saved for the round, and what it did (crossdc.clients.pipeline_stage.StageRound) with, if asked, its
        weights. The first message of an attempt builds the stage: on the run's initial weights, on the state saved
        after the checkpointed round a resumed attempt continues from, or (a trainer restarted between rounds) on
        the state saved after the round before."""
        from crossdc.clients.pipeline_stage import StageFailed

        request, refusal = self._read(PipelineRequest, message, (Pipeline, "run a pipeline stage"))
        if refusal is not None:
            return refusal
        if request.attempt < self.attempt:
            return {"ok": False, "error": f"a message of attempt {request.attempt} at the run; attempt {self.attempt} "
                                          "is running"}
        try:
            if self.stage is None or request.attempt > self.attempt:
                self._start_stage(request)
            stage = self.stage
            assert stage is not None
            if request.round <= self.stage_round:
                return {"ok": False, "error": f"{self.datacenter}: round {request.round} is not newer than round "
                                              f"{self.stage_round}, already trained here"}
            if request.round != self.stage_round + 1:
                raise StageFailed(f"round {request.round} asked of a stage that trained round {self.stage_round}: "
                                  "resume the run")
            if request.checkpoint_round is not None:  # keep the states a resume to that checkpoint needs
                self.store.keep_from = request.checkpoint_round
            if request.global_weights is not None:  # replicas: the round begins from the global model's blocks
                stage.set_weights(request.global_weights)
            done = stage.train_steps(request.tau)
            self.store.save(PIPELINE_STATE_KEY, stage.state_dict(), request.round)
            self.stage_round = request.round
        except (StageFailed, StateStoreError, StrategyError) as err:
            return {"ok": False, "error": f"{self.datacenter}: {err}".splitlines()[0]}
        report = {"stage": stage.settings.index, "steps": done.steps, "started": done.started,
                  "compute_s": done.compute_s, "wall_s": done.wall_s, "bubble_fraction": done.bubble_fraction,
                  "bytes_forward": done.bytes_forward, "bytes_backward": done.bytes_backward,
                  "examples": done.examples, "loss": done.loss, "spans": [list(span) for span in done.spans],
                  "order": [list(entry) for entry in done.order], "steps_taken": stage.steps_taken}
        return {"ok": True, "report": report, "weights": stage.weights() if request.weights else None,
                "metrics": {proto.TRAINER_PID: os.getpid(), proto.WORKERS: self.world,
                            proto.WORKER_PIDS: self.worker_pids()}}

    def _start_stage(self, request: PipelineRequest) -> None:
        """This datacenter's stage for the attempt `request` belongs to (see :meth:`_pipeline`)."""
        from crossdc.clients.pipeline_stage import StageRunner, StageSettings

        strategy = self.strategy
        assert isinstance(strategy, Pipeline)
        if self.world > 1:
            raise StrategyError(f"a pipeline stage runs on one worker; '{self.datacenter}' has {self.world} "
                                "(data parallel inside a stage is not built yet)")
        if self.stage is not None:
            self.stage.close()
            self.stage = None
        group = self.run_dir.settings().get(SETTINGS_PIPELINE_GROUP)
        if not group:
            raise StrategyError("the run's settings say nowhere for the stages to meet (this launcher cannot run a "
                                "pipeline)")
        config = self.config
        replicas = strategy.replicas(config.datacenter_names)
        replica = next(r for r, names in enumerate(replicas) if self.datacenter in names)
        names = replicas[replica]
        master = group["masters"][replica] if "masters" in group else group["master"]
        params = strategy.params
        settings = StageSettings(
            index=names.index(self.datacenter), stages=len(names), microbatches=int(params["microbatches"]),
            schedule=str(params["schedule"]), activation_codec=str(params["activation_codec"]),
            codec_rank=int(params["codec_rank"]) or None, master=f"{master[0]}:{master[1]}",
            generation=request.attempt,
            timeout_s=float(params["stage_timeout_s"]), interface=group.get("interfaces", {}).get(self.datacenter))
        workload = self.trainer.workload
        model = initial_model(config, workload)
        w = config.workload
        stage = StageRunner(workload, model, stage_blocks(model_blocks(model), len(names), strategy.layers()), settings,
                            batch_size=w.batch_size, optimizer=w.optimizer, lr=w.lr,
                            data_seed=datacenter_seed(config, names[0]), codec_seed=config.run.seed,
                            options=w.options, horizon_steps=inner_steps_planned(config))
        if request.attempt > self.attempt and request.resume_round is not None:
            self.store.rewind(request.resume_round)
        after = request.resume_round if request.attempt > self.attempt and request.resume_round is not None \
            else request.round - 1
        stored = self.store.load(PIPELINE_STATE_KEY)
        if after > 0:
            if stored is None or stored[1] != after:
                raise StateStoreError(f"no state of this stage saved after round {after} to go on from"
                                      + (f" (the newest is of round {stored[1]})" if stored is not None else ""))
            stage.load_state_dict(stored[0])
            log.info("%s: pipeline stage %d resumed after round %d", self.datacenter, settings.index, after)
        self.stage, self.stage_round = stage, after
        self._set_attempt(request.attempt)

    def _gossip(self, message: dict[str, Any]) -> dict[str, Any]:
        """One message of a gossip run: ``start`` starts the replica's agent (a trainer restarted mid-run goes on from
        its saved state), ``report`` hands over what the coordinator has not acknowledged, ``final`` the replica's
        final weights. The agent trains and exchanges on its own between messages."""
        request, refusal = self._read(GossipRequest, message, (Gossip, "gossip"))
        if refusal is not None:
            return refusal
        strategy = self.strategy
        assert request is not None and isinstance(strategy, Gossip)
        metrics = {proto.TRAINER_PID: os.getpid(), proto.WORKERS: self.world, proto.WORKER_PIDS: self.worker_pids()}
        try:
            if self.gossip is None:
                self.gossip = self._start_gossip(strategy, resume_only=request.action != proto.GOSSIP_START)
            if request.action == proto.GOSSIP_FINAL:
                final = self.gossip.final(self.config.run.round_timeout_s)
                return {"ok": True, "final": final, "finished": True, "metrics": metrics}
            if request.action == proto.GOSSIP_START:
                return {"ok": True, "reports": [], "finished": False, "metrics": metrics}
            reports, snapshots, finished = self.gossip.reports(request.acknowledged, request.wait_s, request.received)
        except (GossipFailed, TimeoutError, StrategyError, StateStoreError) as err:
            return {"ok": False, "error": f"{self.datacenter}: {err}".splitlines()[0]}
        return {"ok": True, "reports": [r.to_dict() for r in reports], "snapshots": snapshots, "finished": finished,
                "metrics": metrics}

    def resume_gossip(self) -> None:
        """A trainer started again in the middle of a gossip run goes on at once from the replica it saved (and
        rejoins its neighbours from theirs if they are ahead), without waiting for the coordinator's next message."""
        strategy = self.strategy
        if not isinstance(strategy, Gossip) or self.gossip is not None or self.store.load(GOSSIP_STATE_KEY) is None:
            return
        try:
            self.gossip = self._start_gossip(strategy, resume_only=True)
        except (StrategyError, StateStoreError) as err:
            log.warning("%s: the gossip replica does not resume (%s); waiting for the coordinator", self.datacenter, err)

    def _start_gossip(self, strategy: Gossip, resume_only: bool) -> GossipAgent:
        """The replica's agent: on the run's initial weights, or on the state saved after the last round it did (a
        restarted trainer). `resume_only`: refuse to start from scratch (a report for a run this trainer never
        started)."""
        names = self.config.datacenter_names
        index = names.index(self.datacenter)
        addresses = self.run_dir.settings().get(SETTINGS_GOSSIP_ADDRESSES)
        if not addresses:
            raise StrategyError("the run's settings give no gossip addresses (this launcher cannot run gossip)")
        transport = GossipTransport(index, {names.index(dc): (str(host), int(port))
                                            for dc, (host, port) in addresses.items()},
                                    float(strategy.params["exchange_timeout_s"]))
        weights = self.initial_weights()  # every replica's start
        replica = GossipReplica(strategy, self._replica_trainer(), index, weights, self.codec_seed)
        stored = self.store.load(GOSSIP_STATE_KEY)
        pending: list[RoundReport] = []
        snapshots: dict[int, dict[str, Any]] = {}
        if stored is not None:
            replica.load_state_dict(stored[0]["replica"])
            pending = [RoundReport.from_dict(r) for r in stored[0]["reports"]]
            snapshots = {int(r): w for r, w in stored[0]["snapshots"].items()}
            log.info("%s: gossip replica resumed after round %d", self.datacenter, replica.server_round)
        elif resume_only:
            transport.close()
            raise StrategyError("no gossip replica here to report on (the run's start message has not come)")
        rounds, every = self.config.run.rounds, self.config.run.eval_every

        def save(server_round: int, state: dict[str, Any]) -> None:
            self.store.save(GOSSIP_STATE_KEY, state, server_round)

        def publish(server_round: int, weights: Mapping[str, np.ndarray]) -> None:
            transport.publish(server_round, dense_payload(weights))

        def rejoin(had: int) -> tuple[int, dict[str, np.ndarray], str] | None:
            """The newest replica a neighbour offers, if newer than round `had` (a trainer restarted behind them)."""
            offers = {peer: transport.offered_round(peer) for peer in sorted(set(range(len(names))) - {index})}
            for peer, offered in sorted(offers.items(), key=lambda item: -(item[1] or -1)):
                if offered is None or offered <= had:
                    break
                payload = transport.fetch_replica(peer, offered)
                if payload is not None:
                    log.info("%s: rejoining at round %d from %s's replica (had round %d)", self.datacenter, offered,
                             names[peer], had)
                    transport.end_round(offered)  # the rounds up to it are done here: nobody waits for them
                    return offered, decode_arrays(payload, replica.outer), names[peer]
            return None

        return GossipAgent(replica, rounds, functools.partial(exchange_all, transport),
                           observe=lambda r: r % every == 0 or r == rounds, save=save, pending=pending,
                           snapshots=snapshots, publish=publish, rejoin=rejoin if stored is not None else None)

    def _stream(self, message: dict[str, Any]) -> dict[str, Any]:
        """One message of a streaming run: the first starts the replica's thread on the run's initial weights (the
        first of a resumed attempt: on the replica's state saved at the checkpoint it continues from); each hands
        over the server's results it carries and waits for the update of the exchange it asks for."""
        request, refusal = self._read(StreamRequest, message, (StreamingDiLoCo, "stream"))
        if refusal is not None:
            return refusal
        strategy = self.strategy
        assert isinstance(strategy, StreamingDiLoCo)
        timeout_s = self.config.run.round_timeout_s
        if request.attempt < self.attempt:
            return {"ok": False, "error": f"a message of attempt {request.attempt} at the run; attempt {self.attempt} "
                                          "is running"}
        try:
            if request.attempt > self.attempt:  # a new attempt (a resume): the old one's replica stops here
                if self.streaming is not None:
                    self.streaming.cancel(timeout_s)
                    self.streaming = None
                if any(w.poll() is not None for w in self.workers):  # a rank died in the old attempt: a fresh group
                    self._stop_group(graceful=False)
                    self._start_group()
                    strategy = self.strategy
                    assert isinstance(strategy, StreamingDiLoCo)
                self._set_attempt(request.attempt)
            if self.streaming is None:
                self.streaming = self._start_streaming(strategy, request)
            if request.checkpoint_round is not None:  # keep the replica states a resume to that checkpoint needs
                self.store.keep_from = request.checkpoint_round * self.streaming.replica.plan.schedule.fragments
            answer = self.streaming.exchange(request.exchange, request.results, timeout_s=timeout_s)
        except (StreamingFailed, TimeoutError, StrategyError, StateStoreError) as err:
            return {"ok": False, "error": f"{self.datacenter}: {err}".splitlines()[0]}
        answer["metrics"].update({proto.TRAINER_PID: os.getpid(), proto.WORKERS: self.world,
                                  proto.WORKER_PIDS: self.worker_pids()})
        return {"ok": True, **answer}

    def _start_streaming(self, strategy: StreamingDiLoCo, request: StreamRequest) -> StreamingWorker:
        """The replica's thread for the attempt `request` belongs to: on the initial weights (the run's first
        exchange), or on the state saved after the checkpointed round a resumed attempt continues from. The
        state store's clock in a streaming run is the exchange: a round r ends with exchange r·P."""
        datacenters = len(self.config.datacenters)
        if request.resume_round is not None:
            plan = strategy.plan(self.trainer.get_weights())
            resumed_at = request.resume_round * plan.schedule.fragments
            if request.exchange != resumed_at + 1:
                raise StreamingFailed(f"the trainer restarted during attempt {request.attempt}; the run must be "
                                      f"resumed again (exchange {request.exchange} asked, the attempt began at "
                                      f"{resumed_at + 1})")
            self.store.rewind(resumed_at)
            stored = self.store.load(STREAMING_STATE_KEY)
            if stored is None or stored[1] != resumed_at:
                raise StateStoreError(f"no replica state of exchange {resumed_at} (round {request.resume_round}) kept "
                                      "to resume from")
            replica = StreamingReplica(strategy, self._replica_trainer(), plan, stored[0]["weights"], datacenters)
            replica.load_state_dict(stored[0])
            log.info("%s: streaming replica resumed after exchange %d (round %d)", self.datacenter, resumed_at,
                     request.resume_round)
        else:
            if request.weights is None or request.exchange != 1:
                raise StreamingFailed(f"exchange {request.exchange} asked of a trainer with no replica: the first "
                                      "message of a streaming run carries the initial weights (a trainer restarted "
                                      "mid-run needs the run resumed)")
            plan = strategy.plan(request.weights)
            replica = StreamingReplica(strategy, self._replica_trainer(), plan, request.weights, datacenters)
        schedule = plan.schedule

        def save_state(exchange: int) -> None:  # a round's last send: the replica as a checkpoint of it needs it
            if self.store.keep_from is not None and schedule.locate(exchange)[1] == schedule.fragments - 1:
                self.store.save(STREAMING_STATE_KEY, replica.state_dict(), exchange)

        return StreamingWorker(replica, self.config.run.rounds * schedule.fragments, self._sent_answer, save_state)

    def _replica_trainer(self) -> LocalTrainer | GroupTrainer:
        """What a streaming replica trains with: this rank's trainer, or with W > 1 ranks the group's (the others
        follow each step and each change of weights or state)."""
        if self.world == 1:
            return self.trainer
        return GroupTrainer(self.trainer, lambda command: dist.broadcast_object_list([command], src=0))

    def _sent_answer(self, sent: SentUpdate) -> dict[str, Any]:
        return sent_answer(sent, self.codecs, self.codec_seed, self.store)

    def _read(self, kind: type[RequestT], message: dict[str, Any], loop: tuple[type[Strategy], str] | None = None,
              ) -> tuple[RequestT, None] | tuple[None, dict[str, Any]]:
        """The request `message` holds, or the refusal to answer (malformed, for another run, or — with `loop` =
        (strategy class, verb) — for a run whose strategy is not of that class)."""
        try:
            request = kind.from_dict(message)
        except ProtocolError as err:
            return None, {"ok": False, "error": f"{self.datacenter}: {err}"}
        if request.run_id != self.run_id:
            return None, {"ok": False, "error": f"trainer serves run {self.run_id}, request is for run {request.run_id}"}
        if loop is not None and not isinstance(self.strategy, loop[0]):
            return None, {"ok": False, "error": f"{self.datacenter}: strategy '{self.strategy.name}' does not {loop[1]}"}
        return request, None

    def _train(self, message: dict[str, Any]) -> dict[str, Any]:
        request, refusal = self._read(TrainRequest, message)
        if refusal is not None:
            return refusal
        server_round, tau, attempt = request.round, request.tau, request.attempt
        if attempt > self.attempt:  # a resumed run: continue from the state of the checkpoint it resumed from
            if request.resume_round is not None:
                try:
                    self._rewind(request.resume_round)
                except Exception as err:  # nothing is marked done: the next message of this attempt tries again
                    return {"ok": False, "error": f"{self.datacenter}: cannot rewind to the checkpoint: {err}".splitlines()[0]}
            self._set_attempt(attempt)
        elif attempt < self.attempt:
            return {"ok": False, "error": f"a message of attempt {attempt} at the run; attempt {self.attempt} is running"}
        if server_round <= self.last_round:  # a stale message (e.g. delivered after its round closed)
            return {"ok": False, "error": f"round {server_round} is not newer than round {self.last_round}, already trained here"}
        if request.checkpoint_round is not None:  # keep the local state a rewind to the server's newest checkpoint needs
            self.store.keep_from = request.checkpoint_round
        dead = [w.pid for w in self.workers if w.poll() is not None]
        pids = self.worker_pids()
        try:
            model = request.model
            global_weights = (receive(model["downlink"], self.store, server_round, self.initial_weights) if "downlink" in model
                              else model["weights"])
        except (DownlinkOutOfSync, CodecError) as err:  # the server sends the full model next round
            return {"ok": False, "error": f"{self.datacenter}: {err}".splitlines()[0]}

        def broadcast(command: dict[str, Any]) -> None:
            dist.broadcast_object_list([command], src=0)

        try:
            if dead:
                raise RuntimeError(f"local worker(s) {dead} of the group had exited")
            answer = run_local_round(self.strategy, self.trainer, self.store, self.datacenter, server_round, tau,
                                     global_weights, request.received,
                                     broadcast if self.world > 1 else None, self.codecs, self.codec_seed)
        except StrategyError as err:  # the message breaks the strategy's contract: the group itself is fine
            return {"ok": False, "error": f"{self.datacenter}: {err}".splitlines()[0]}
        except Exception as err:  # a rank failed: this datacenter's round fails; a fresh group serves the next
            message = f"local training failed on {self.datacenter} ({type(err).__name__}: {err})".splitlines()[0]
            log.error("%s; restarting the worker group", message)
            self._stop_group(graceful=False)
            self._start_group()
            return {"ok": False, "error": message}
        self.last_round = server_round
        answer["metrics"].update({proto.TRAINER_PID: os.getpid(), proto.WORKERS: self.world, proto.WORKER_PIDS: pids})
        if self.poison_next is not None:  # an injected fault: only the reply is spoiled, the local state is sound
            answer, self.poison_next = poison_answer(answer, self.poison_next), None
        return {"ok": True, **answer}


#: a file beside the datacenter's state (not a state key: a rewind never moves it back)
ATTEMPT_FILE = "attempt"
#: the state-store key of a streaming replica's state, saved after each round's last send when the run checkpoints
STREAMING_STATE_KEY = "streaming-replica"
#: the state-store key of a pipeline stage's state (its weights, optimizer, data position), saved after every round
PIPELINE_STATE_KEY = "pipeline-stage"
#: the state-store key of a gossip replica's state, with the reports the coordinator has not acknowledged
GOSSIP_STATE_KEY = "gossip-replica"


def start_heartbeat(run_dir: RunDir, config: ExperimentConfig, run_id: str, datacenter: str) -> HeartbeatSender | None:
    """This datacenter's heartbeat to the coordinator (crossdc.deployment.heartbeat), every timeout / 6, when the run
    asks for one (``run.heartbeat_timeout_s`` > 0) and its settings say where it goes (a local run's; a standing
    federation's node records the coordinator's offer there, and a later attempt's offer is followed from the next
    beat on); else None."""
    timeout_s = config.run.heartbeat_timeout_s
    first = heartbeat_target(run_dir)
    if first is None or timeout_s <= 0:
        return None
    return HeartbeatSender(first[0], run_id, datacenter, first[1], timeout_s / BEATS_PER_TIMEOUT,
                           retarget=functools.partial(heartbeat_target, run_dir)).start()


def heartbeat_target(run_dir: RunDir) -> Target | None:
    """Where the run's settings say its heartbeat goes and its key (the settings' heartbeat key, or the run's own);
    None when they name no heartbeat."""
    settings = run_dir.settings()
    address = settings.get(SETTINGS_HEARTBEAT)
    if not address:
        return None
    key = settings.get(SETTINGS_HEARTBEAT_KEY)
    return (str(address[0]), int(address[1])), bytes.fromhex(key) if key else run_dir.authkey()


def serve(run_dir: RunDir, datacenter: str) -> None:
    """Serve requests until SIGTERM/SIGINT."""
    torch.set_num_threads(max(1, int(os.environ.get("CROSSDC_TRAINER_THREADS", "1"))))
    handler = DatacenterTrainer(run_dir, datacenter)
    handler.resume_gossip()
    socket_path = run_dir.trainer_socket(datacenter)
    socket_path.unlink(missing_ok=True)
    listener = Listener(str(socket_path), family="AF_UNIX", authkey=run_dir.authkey())
    os.chmod(socket_path, 0o600)
    beats = start_heartbeat(run_dir, handler.config, handler.run_id, datacenter)

    def stop(signum: int, frame: Any) -> None:
        listener.close()
        if beats is not None:
            beats.stop()
        handler.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("trainer of %s listening on %s (pid %d)", datacenter, socket_path, os.getpid())
    serve_requests(listener, handler.handle, log)


def main(argv: list[str] | None = None) -> None:
    die_with_run_root()  # started by `crossdc run` or by a node service: dies with the run's root either way
    parser = argparse.ArgumentParser(description="crossdc persistent local trainer of one datacenter")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--datacenter", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(RunDir(Path(args.run_dir)), args.datacenter)


if __name__ == "__main__":
    main()
