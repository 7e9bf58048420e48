"""The pipeline loop on Flower's Grid: the coordinator drives a model split across the datacenters, round by round.

Promises:

- each round, one message to every stage (the ``[[datacenters]]`` in config order) asks for the round's τ optimizer
  steps; the stages run them together (crossdc.clients.pipeline_stage), the activations and their gradients going
  from datacenter to datacenter, never through the coordinator;
- with ``replicas`` > 1 (crossdc.strategies.pipeline), each replica's stages run their own pipeline; every stage
  returns its weights each round, the coordinator takes the replicas' DiLoCo outer step on the assembled models and
  sends each stage its blocks of the new global model with the next round's message (a ``replicas-synced`` event
  each round; each datacenter's bytes up and down include these weights);
- the round is logged once every stage has replied: per stage a ``datacenter_rounds`` row (compute, idle = wall −
  compute, the bytes it sent and received across its boundaries, the last stage's training loss, the examples the
  first stage fed) and a ``pipeline_stages`` row (compute, wall, bubble, bytes forward and backward), its
  micro-batches' forward and backward spans in ``timeline_spans``, and a ``rounds`` row;
- the bytes of a boundary come from the link ledger when the two stages' datacenters have a link of their own in
  the namespace emulator (``[[links]]``, bytes_source ``delay-line``), else from what the stages counted
  (``stage``);
- on the rounds ``run.eval_every`` names, the checkpointed rounds and the last, every stage also returns its
  weights: the coordinator assembles the model, evaluates it on the shared validation set, checkpoints it (each
  stage keeps its own optimizer state and data position in its state store), and at the end saves it as the run's
  final weights;
- a stage that fails or does not reply within ``run.round_timeout_s`` fails the run with an error naming it and
  its reason (a dead stage makes the others' step fail within the strategy's ``stage_timeout_s``, and once one
  stage has failed the coordinator waits only that long, plus 10 s, for the others' replies); a run that
  checkpoints is then resumed by ``crossdc resume RUN_ID`` from its newest checkpoint: every stage goes back to its
  state of that round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from crossdc import protocol
from crossdc.db.records import DatacenterRoundRecord, PipelineStageRecord, TimelineSpanRecord
from crossdc.db.runlog import RunLog
from crossdc.experiment.config import ExperimentConfig
from crossdc.experiment.rundir import SETTINGS_LINK_EMULATOR, RunDir
from crossdc.federation.grid_io import FederationError, Reply, collect_replies, rediscover
from crossdc.federation.server_checkpoint import SETTINGS_ATTEMPT, SETTINGS_RESUME, ServerCheckpointer
from crossdc.federation.session import RoundSession
from crossdc.federation.sync_loop import watched_session
from crossdc.protocol import CONFIG_KEY, PayloadError, decode_pipeline_reply, raw_fp32_bytes
from crossdc.strategies.base import Strategy, StrategyError
from crossdc.strategies.pipeline import Pipeline, stage_blocks
from crossdc.wan.ledger import LedgerReader, Transfer
from crossdc.wan.topology import mesh_ledger
from crossdc.workloads.stages import model_blocks, split_model, stage_tensors

log = logging.getLogger("crossdc.federation")

BYTES_FROM_LEDGER, BYTES_FROM_STAGE = "delay-line", "stage"


def _ready_detail(config: ExperimentConfig) -> Any:
    """What the run's start event says about the split (and a refusal of what a pipeline cannot run)."""

    def detail(strategy: Strategy) -> dict[str, Any]:
        if not isinstance(strategy, Pipeline):
            raise StrategyError(f"strategy '{strategy.name}' declares the pipeline loop but is no Pipeline")
        crowded = [dc.name for dc in config.datacenters if dc.workers != 1]
        if crowded:
            raise StrategyError(f"a pipeline stage runs on one worker: {', '.join(crowded)} have more (data parallel "
                                "inside a stage is not built yet)")
        replicas = strategy.replicas(config.datacenter_names)
        return {"stages": replicas[0] if len(replicas) == 1 else replicas, "replicas": len(replicas),
                "schedule": strategy.params["schedule"],
                "microbatches": strategy.params["microbatches"], "activation_codec": strategy.params["activation_codec"],
                "partition": "ignored: the first stage reads the whole training set"}

    return detail


def _boundary_ledgers(config: ExperimentConfig, run_dir: RunDir, names: Sequence[str]) -> dict[int, LedgerReader]:
    """By boundary b (between stages b and b + 1 of the pipeline `names`), the ledger of the link of their own, where
    the run has one."""
    if run_dir.settings().get(SETTINGS_LINK_EMULATOR) != BYTES_FROM_LEDGER:
        return {}
    direct = {frozenset(link.between) for link in config.links}
    return {b: LedgerReader(run_dir.logs / "links" / f"{mesh_ledger(names[b], names[b + 1])}.ledger")
            for b in range(len(names) - 1) if frozenset((names[b], names[b + 1])) in direct}


def _ledger_bytes(transfers: Sequence[Transfer], sender: str, receiver: str) -> int:
    """Bytes of TCP payload `sender` sent `receiver` in `transfers` (read off their link's ledger)."""
    direction = f"{sender}>{receiver}"
    return sum(t.size if t.data is None else t.data for t in transfers if t.direction == direction)


def run_pipeline(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog) -> dict[str, Any]:
    """Run a pipeline experiment to its end on `grid` (see the module docstring); returns the run's summary. A stage
    the heartbeat marks down is not waited for (the step fails without waiting out the deadline)."""
    with watched_session(grid, run_dir, run_id, config, runlog, _ready_detail(config)) as (session, nodes):
        return _pipeline(grid, run_dir, run_id, config, runlog, session, nodes)


def _pipeline(grid: Grid, run_dir: RunDir, run_id: str, config: ExperimentConfig, runlog: RunLog, session: RoundSession,
              nodes: dict[str, int]) -> dict[str, Any]:
    strategy = session.strategy
    assert isinstance(strategy, Pipeline)
    names = config.datacenter_names
    replicas = strategy.replicas(names)
    synced = len(replicas) > 1  # replicas: every stage reports its weights and begins each round from the global's
    blocks = stage_blocks(model_blocks(session.model), len(replicas[0]), strategy.layers())
    stage_names = [list(t) for t in stage_tensors(session.model, split_model(session.model, blocks))]
    stage_of = {name: index for replica in replicas for index, name in enumerate(replica)}
    settings = run_dir.settings()
    attempt = int(settings.get(SETTINGS_ATTEMPT, 1))
    checkpointer = ServerCheckpointer.from_settings(settings, config.checkpoint.every_rounds, config.checkpoint.keep,
                                                    config.run.rounds)
    ledgers = [_boundary_ledgers(config, run_dir, replica) for replica in replicas]
    run_started, wall_started = time.perf_counter(), time.time()
    first_round = 1
    if settings.get(SETTINGS_RESUME):
        first_round = session.resume(checkpointer, attempt, nodes)[0] + 1
    seen_nodes = set(nodes.values())
    for server_round in range(first_round, config.run.rounds + 1):
        round_started = time.perf_counter()
        if server_round > first_round:
            rediscover(grid, nodes, seen_nodes, config, runlog, run_id, server_round,
                       heartbeat=session.heartbeat_offer)
        tau = strategy.tau(server_round)
        evaluated = server_round % config.run.eval_every == 0 or server_round == config.run.rounds
        checkpointed = checkpointer is not None and checkpointer.due(server_round)
        messages, sent_down = {}, {}
        for name, node in nodes.items():
            task = protocol.pipeline_config(
                server_round=server_round, tau=tau, run_id=run_id, run_dir=str(run_dir.path), datacenter=name,
                weights=synced or evaluated or checkpointed, attempt=attempt,
                checkpoint_round=checkpointer.oldest_round if checkpointer is not None else None,
                resume_round=first_round - 1 if attempt > 1 else None)
            records: dict[str, Any] = {CONFIG_KEY: ConfigRecord(task)}
            if synced and server_round > 1:  # (round 1: every replica builds the same initial model from the seed)
                down = {n: session.weights[n] for n in stage_names[stage_of[name]]}
                records.update(protocol.encode_tensors(down))
                sent_down[name] = raw_fp32_bytes(down)
            messages[name] = Message(RecordDict(records), dst_node_id=node, message_type=MessageType.TRAIN,
                                     ttl=config.run.round_timeout_s)
        sent = session.sent_now()
        ids = list(grid.push_messages(list(messages.values())))
        by_id = dict(zip(ids, messages, strict=True))
        # a stage that fails makes the others' step fail within the stage timeout: their reasons are worth a wait
        arrived = collect_replies(grid, ids, config.run.round_timeout_s,
                                  after_error_s=float(strategy.params["stage_timeout_s"]) + 10.0,
                                  given_up=session.given_up(sent, dict(zip(messages, ids, strict=True))))
        replies = {by_id[i]: reply for i, reply in arrived.items()}
        reports, weights = _read_replies(server_round, names, replies, config.run.round_timeout_s, runlog, run_id)
        sent_up = {name: raw_fp32_bytes(part) for name, part in weights.items()} if synced else {}
        records = [record for index, (replica, ledger) in enumerate(zip(replicas, ledgers, strict=True))
                   for record in _log_stages(runlog, run_id, server_round, index, replica, reports, ledger,
                                             wall_started, {n: (sent_up.get(n, 0), sent_down.get(n, 0)) for n in replica})]
        eval_s = None
        if synced:
            replica_weights = assemble_replicas(server_round, replicas, weights, stage_names, session.weights)
            session.weights = strategy.replica_step(session.weights, replica_weights)
            runlog.log_event(run_id=run_id, kind="replicas-synced", round=server_round,
                             detail={"replicas": len(replicas), **strategy.round_metrics(server_round, [])})
            eval_s = session.evaluate_if_due(server_round)
        elif weights:
            session.weights = {k: np.asarray(v, np.float32) for part in weights.values() for k, v in part.items()}
            eval_s = session.evaluate_if_due(server_round)
        # what one stage sends another, another receives
        session.log_round(server_round, tau, records, sum(int(r.bytes_down or 0) for r in records),
                          time.perf_counter() - round_started, eval_s)
        session.check_run_log(f"round-{server_round}")
        if checkpointed and checkpointer is not None:
            session.checkpoint(checkpointer, server_round, {})
    session.save_final_weights()
    return session.summary(time.perf_counter() - run_started, stages=names, blocks_per_stage=blocks,
                           replicas=[list(replica) for replica in replicas])


def assemble_replicas(server_round: int, replicas: Sequence[Sequence[str]], weights: Mapping[str, Mapping[str, Any]],
                      stage_names: Sequence[Sequence[str]], reference: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Each replica's whole model from its stages' `weights` (by datacenter); FederationError naming the stage when
    one sent other tensors than its blocks (`stage_names[stage]`), a shape other than `reference`'s, or a value that
    is not finite (a diverged replica would spoil the global model: the run stops, resumable, instead)."""
    models = []
    for replica in replicas:
        model: dict[str, np.ndarray] = {}
        for stage, name in enumerate(replica):
            part = weights.get(name)
            if part is None or set(part) != set(stage_names[stage]):
                raise FederationError(f"round {server_round}: stage {stage} ({name}) sent "
                                      f"{'no weights' if part is None else sorted(part)[:3]}, not its blocks "
                                      f"{list(stage_names[stage])[:3]}")
            for key, value in part.items():
                array = np.asarray(value, np.float32)
                if array.shape != np.shape(reference[key]):
                    raise FederationError(f"round {server_round}: stage {stage} ({name}) sent {key} of shape "
                                          f"{array.shape}, expected {np.shape(reference[key])}")
                if not np.isfinite(array).all():
                    raise FederationError(f"round {server_round}: stage {stage} ({name}) sent {key} with non-finite "
                                          "values; the replicas are not synced. A run that checkpoints goes on from "
                                          "its newest checkpoint with `crossdc resume RUN_ID`")
                model[key] = array
        models.append(model)
    return models


def _read_replies(server_round: int, names: Sequence[str], replies: Mapping[str, Reply], timeout_s: float,
                  runlog: RunLog, run_id: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, np.ndarray]]]:
    """Every stage's report (and weights, if sent); FederationError naming each stage that failed and why."""
    reports: dict[str, dict[str, Any]] = {}
    weights: dict[str, dict[str, np.ndarray]] = {}
    failures: dict[str, str] = {}
    for index, name in enumerate(names):
        reply = replies.get(name)
        if reply is None:
            failures[name] = f"no reply within {timeout_s:g}s"
        elif reply.message.has_error():
            failures[name] = str(reply.message.error.reason).splitlines()[0][:500]
        else:
            try:
                reports[name], stage_weights = decode_pipeline_reply(reply.message.content)
            except PayloadError as err:
                failures[name] = str(err)
                continue
            if stage_weights is not None:
                weights[name] = stage_weights
        if name in failures:
            runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, record=DatacenterRoundRecord(
                status="timeout" if reply is None else "failed", reason=failures[name]))
            runlog.log_event(run_id=run_id, kind="pipeline-stage-failed", round=server_round, datacenter=name,
                             detail={"stage": index, "reason": failures[name]})
    if failures:
        runlog.flush(timeout=30)
        said = "; ".join(f"stage {names.index(n)} ({n}): {why}" for n, why in failures.items())
        raise FederationError(f"round {server_round}: the pipeline step failed at {said}. A run that checkpoints goes "
                              "on from its newest checkpoint with `crossdc resume RUN_ID`")
    return reports, weights


def _log_stages(runlog: RunLog, run_id: str, server_round: int, replica: int, names: Sequence[str],
                reports: Mapping[str, Mapping[str, Any]], ledgers: Mapping[int, LedgerReader],
                wall_started: float, synced: Mapping[str, tuple[int, int]]) -> list[DatacenterRoundRecord]:
    """The round's rows of every stage of pipeline `replica`, `names` (see the module docstring), each datacenter's bytes
    including what it sent up and received for the replicas' sync (`synced`: name → (up, down)); its
    datacenter-round records."""
    start, end = min(float(reports[n]["started"]) for n in names), time.time()
    forward: dict[int, tuple[int, str]] = {}  # boundary → (bytes, source)
    backward: dict[int, tuple[int, str]] = {}
    for b in range(len(names) - 1):
        sender, receiver = names[b], names[b + 1]
        if b in ledgers:
            transfers = ledgers[b].window(start, end)  # (a window is read once: the reader forgets it)
            forward[b] = (_ledger_bytes(transfers, sender, receiver), BYTES_FROM_LEDGER)
            backward[b] = (_ledger_bytes(transfers, receiver, sender), BYTES_FROM_LEDGER)
        else:
            forward[b] = (int(reports[sender]["bytes_forward"]), BYTES_FROM_STAGE)
            backward[b] = (int(reports[receiver]["bytes_backward"]), BYTES_FROM_STAGE)
    records = []
    for index, name in enumerate(names):
        report = reports[name]
        sent_forward, source_forward = forward.get(index, (0, BYTES_FROM_STAGE))
        sent_backward, source_backward = backward.get(index - 1, (0, BYTES_FROM_STAGE))
        received = (forward[index - 1][0] if index > 0 else 0) + (backward[index][0] if index in backward else 0)
        up, down = synced.get(name, (0, 0))
        compute_s, wall_s = float(report["compute_s"]), float(report["wall_s"])
        loss = report.get("loss")
        record = DatacenterRoundRecord(
            status="ok", bytes_up=sent_forward + sent_backward + up, bytes_down=received + down,
            bytes_up_raw=sent_forward + sent_backward + up, compute_s=compute_s, idle_s=max(0.0, wall_s - compute_s),
            round_s=wall_s, train_loss=float(loss) if loss is not None else None,
            num_examples=int(report["examples"]) if index == 0 else None)
        runlog.log_datacenter_round(run_id=run_id, round=server_round, datacenter=name, record=record)
        source = BYTES_FROM_LEDGER if BYTES_FROM_LEDGER in (source_forward, source_backward) else BYTES_FROM_STAGE
        runlog.log_pipeline_stage(run_id=run_id, round=server_round, record=PipelineStageRecord(
            stage=index, replica=replica, datacenter=name, steps=int(report["steps"]), microbatches=len({s[1] for s in report["spans"]}),
            compute_s=max(0.0, compute_s), wall_s=max(0.0, wall_s), bubble_fraction=min(1.0, max(0.0, float(report["bubble_fraction"]))),
            bytes_forward=sent_forward, bytes_backward=sent_backward, bytes_source=source,
            train_loss=float(loss) if loss is not None else None))
        spans = [TimelineSpanRecord(round=server_round, datacenter=name, kind=str(kind), start_s=float(s0) - wall_started,
                                    end_s=float(s1) - wall_started, microbatch=int(micro), step=int(step))
                 for kind, micro, step, s0, s1 in report["spans"] if float(s1) >= float(s0)]
        if spans:
            runlog.log_timeline_spans(run_id=run_id, spans=spans)
        records.append(record)
    return records
