"""The message protocol between crossdc's coordinator and its datacenters: one definition of every key.

This module is the bottom layer of crossdc (torch-free; the short-lived ClientApp imports it). It owns:

- the **record names** of a Flower message (tensor groups, the config record, the metrics record);
- the **config keys** the coordinator puts in a message (run, round, τ, attempt, downlink, global version);
- the **metric keys** a datacenter's reply carries;
- the **trainer request** the ClientApp hands the datacenter's persistent trainer (:class:`TrainRequest`);
- the tensor **wire format** and exact byte counts (below).

No other module of crossdc spells one of these keys as a bare string.

Wire format: all tensors of a message travel as ONE flat float32 Array (record ``arrays``, entry
``flat``) plus a small layout record (``layout``: tensor names and shapes, in order). Flower 1.42
makes one request per object it transfers (each record, each Array, each 5 MiB chunk), so one
Array instead of one per tensor saves a WAN round trip per pair of tensors in each direction
(for the demo's transformer: 67 → 9 round trips per round).

Numpy only (no torch): the short-lived ClientApp imports this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

#: record holding tensors: the global weights (down) or the update (up)
ARRAYS_KEY = "arrays"
#: names and shapes of the tensors packed in ARRAYS_KEY
LAYOUT_KEY = "layout"
#: config record of a server → datacenter message
CONFIG_KEY = "config"
#: a strategy's control variates, as a second tensor group (SCAFFOLD: the server's c down, a datacenter's Δc_i up)
CONTROL_KEY = "control"
#: metrics record of a datacenter's reply
METRICS_KEY = "metrics"
#: record holding a codec pipeline's payload (the update, compressed) instead of ARRAYS_KEY
COMPRESSED_KEY = "compressed"
FLAT = "flat"
PAYLOAD = "payload"
#: config keys and record of a train message whose global model comes through `downlink_codecs`
#: (crossdc.compression.downlink): "full", "delta" or "initial", the reference version a delta applies to, the version
#: after it, and ("initial") the digest of the run's initial weights that the datacenter builds itself
DOWNLINK = "downlink"
DOWNLINK_BASE = "downlink-base"
DOWNLINK_VERSION = "downlink-version"
DOWNLINK_DIGEST = "downlink-digest"
DOWNLINK_KEY = "downlink"
#: the record names the protocol itself uses: no strategy tensor group may take one (nor a name that is some
#: group's layout record, ``<group>-layout``, see :func:`layout_key`)
#: record of a streaming message: the server's results of earlier exchanges (each the fragment's new global values,
#: or with eager updates its mean update), a tensor named ``<exchange>/<tensor>``
FRAGMENT_UPDATE_KEY = "fragment-update"
#: the name a streaming exchange's compressed result carries its payload under, in place of its tensors
RESULT_PAYLOAD = "#payload"
RESERVED_RECORDS = frozenset({ARRAYS_KEY, LAYOUT_KEY, CONFIG_KEY, METRICS_KEY, COMPRESSED_KEY, DOWNLINK_KEY,
                              FRAGMENT_UPDATE_KEY})
#: Flower Array serialisation type of a codec payload: the bytes as they are
PAYLOAD_STYPE = "crossdc.payload"

# ---------------------------------------------------------------- config keys (coordinator → datacenter)
#: the hello query: the configured datacenters' names, comma-separated
HELLO_DATACENTERS = "datacenters"
#: the hello query of a run on a standing federation with a heartbeat: the coordinator's heartbeat UDP port and the
#: key of the node the hello is sent to (hex; derived from the attempt's secret and the node id, so a node can sign
#: beats only for the datacenter bound to it: crossdc.deployment.heartbeat.NodeKeys)
HELLO_HEARTBEAT_PORT = "heartbeat-port"
HELLO_HEARTBEAT_KEY = "heartbeat-key"
#: crossdc's run id, its run folder (also the Flower App's run-config key), and the experiment config (JSON)
RUN_ID = "crossdc-run-id"
RUN_DIR = "crossdc-run-dir"
RUN_CONFIG = "crossdc-config"
#: the datacenter a message is for (and, in a hello reply, the datacenter a node is)
DATACENTER = "datacenter"
#: the task's number: the round (synchronous loops), or the datacenter's own task count (asynchronous loop)
ROUND = "round"
#: local steps to run
TAU = "tau"
#: which attempt at the run this message belongs to (1, then +1 per `crossdc resume`), and the round of the
#: server's oldest retained checkpoint (present only when the run checkpoints)
ATTEMPT = "crossdc-attempt"
CHECKPOINT_ROUND = "crossdc-checkpoint-round"
#: in a resumed run (attempt > 1): the round of the checkpoint it continues from
RESUME_ROUND = "crossdc-resume-round"
#: asynchronous loop: the global version the task's weights are
GLOBAL_VERSION = "global-version"

# ---------------------------------------------------------------- node config of a SuperNode
#: a production SuperNode (`crossdc node start`): the node service's socket and auth key file
NODE_SERVICE = "node-service"
NODE_AUTHKEY_FILE = "node-authkey-file"
#: a local run's SuperNode may name its trainer's socket and auth key file
NODE_TRAINER = "trainer"
NODE_TRAINER_AUTHKEY_FILE = "trainer-authkey-file"
#: Flower's simulation engine names a node by its partition
NODE_PARTITION_ID = "partition-id"

# ---------------------------------------------------------------- metric keys (datacenter → coordinator)
#: examples trained on in the round (the aggregation weight)
NUM_EXAMPLES = "num-examples"
#: mean training loss over the round's local steps
TRAIN_LOSS = "train-loss"
#: seconds of local training (the τ steps), measured by the trainer
COMPUTE_S = "compute-s"
#: seconds spent writing the datacenter's durable state after training
STATE_SAVE_S = "state-save-s"
#: the trainer process, the size of its worker group, and the group's pids (rank 0 first)
TRAINER_PID = "trainer-pid"
WORKERS = "workers"
WORKER_PIDS = "worker-pids"
#: seconds the ClientApp spent on the message (the trainer's work included)
CLIENTAPP_S = "clientapp-s"
#: codec pipeline: seconds encoding, fraction of the update's energy kept, payload size
CODEC_S = "codec-s"
ENERGY_KEPT = "energy-kept"
PAYLOAD_BYTES = "payload-bytes"
#: a streaming exchange: seconds the trainer waited for an update since its previous send, and the inner step after
#: which the update was taken
IDLE_S = "idle-s"
SENT_STEP = "sent-step"
#: a streaming exchange, on the datacenter's wall clock (seconds since the epoch): when the update was sent; flat
#: [start, end, ...] of the trainer's compute and of its waits since its previous send; flat [exchange, at, ...] of
#: the server results that reached it since then
SENT_AT = "sent-at"
SPANS_COMPUTE = "spans-compute"
SPANS_WAIT = "spans-wait"
RESULTS_RECEIVED = "results-received"

# ---------------------------------------------------------------- streaming exchanges (coordinator → datacenter)
#: config entry of a streaming message: the exchange it asks for (its round and fragment follow from the schedule)
EXCHANGE = "crossdc-exchange"
#: config entry: the exchanges whose server results the message carries (in record FRAGMENT_UPDATE_KEY): the
#: previous exchange's; the first message of a resumed attempt, every one the datacenter still needs
RESULTS_OF = "crossdc-results-of"

# ---------------------------------------------------------------- gossip (coordinator → datacenter: control only)
#: config entry of a gossip run's message: what it asks (GOSSIP_START, GOSSIP_REPORT or GOSSIP_FINAL)
GOSSIP = "crossdc-gossip"
GOSSIP_START, GOSSIP_REPORT, GOSSIP_FINAL = "start", "report", "final"
GOSSIP_ACTIONS = (GOSSIP_START, GOSSIP_REPORT, GOSSIP_FINAL)
#: config entry: the last round of this datacenter the coordinator has logged (the trainer forgets up to it)
GOSSIP_ACKNOWLEDGED = "crossdc-gossip-acknowledged"
GOSSIP_RECEIVED = "crossdc-gossip-received"
#: config entry: how long the trainer may wait for a new round before it answers a report
GOSSIP_WAIT_S = "crossdc-gossip-wait-s"
#: reply config entries: the rounds' reports (JSON list of {round, compute_s, idle_s, train_loss, num_examples,
#: links}), whether the replica's last round is done, and the rounds whose snapshots the reply carries
GOSSIP_REPORTS = "gossip-reports"
GOSSIP_FINISHED = "gossip-finished"
GOSSIP_SNAPSHOTS = "gossip-snapshots"


# ---------------------------------------------------------------- pipeline (coordinator → stage: control only)
#: config entry of a pipeline run's message: the round whose τ optimizer steps it asks the stage for (the
#: activations and their gradients travel between the stages directly, never through the coordinator)
PIPELINE = "crossdc-pipeline"
#: config entry: whether the reply carries the stage's weights after the steps (rounds evaluated or checkpointed)
PIPELINE_WEIGHTS = "crossdc-pipeline-weights"
#: a pipeline reply's report (JSON): the round's compute, wall time, bytes each way, loss, micro-batch spans
PIPELINE_REPORT = "pipeline-report"


def snapshot_key(server_round: int) -> str:
    """The tensor group of a gossip reply carrying the replica's outer weights after round `server_round`."""
    return f"snapshot-{server_round}"


#: the trainer channel's operations
GOSSIP_OP = "gossip"
PIPELINE_OP = "pipeline"
STREAM_OP = "stream"
TRAIN_OP = "train"
PING_OP = "ping"
STOP_OP = "stop"
#: a chaos test's request that the trainer spoil its next update (crossdc.clients.fault_injection)
INJECT_FAULT_OP = "inject-fault"
#: rank 0's commands to the other ranks of a datacenter's worker group in a streaming run (crossdc.clients.worker):
#: run n more inner steps, take these weights, take this optimizer state and data position
STEPS_OP = "steps"
SET_WEIGHTS_OP = "set-weights"
LOAD_STATE_OP = "load-state"
PREPARE_OP = "prepare"


class ProtocolError(ValueError):
    """A request or message does not follow the protocol (a missing or malformed key)."""


@dataclass(frozen=True)
class TrainRequest:
    """What the ClientApp hands the datacenter's persistent trainer for one train message.

    `model` holds the round's global model: ``{"weights": {name: array}}`` (dense) or, with downlink codecs,
    ``{"downlink": {...}}`` (see :func:`global_model`); `received` the strategy's other tensor groups.
    """

    run_id: str
    round: int
    tau: int
    model: Mapping[str, Any]
    received: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)
    attempt: int = 1
    checkpoint_round: int | None = None
    resume_round: int | None = None

    @classmethod
    def from_message(cls, content: RecordDict) -> TrainRequest:
        """The request for a train message's content (its config keys read here, once)."""
        config = content.config_records[CONFIG_KEY]
        return cls(run_id=str(config[RUN_ID]), round=config_int(config, ROUND), tau=config_int(config, TAU),
                   model=global_model(content), received=extra_groups(content),
                   attempt=config_int(config, ATTEMPT) if ATTEMPT in config else 1,
                   checkpoint_round=config_int(config, CHECKPOINT_ROUND) if CHECKPOINT_ROUND in config else None,
                   resume_round=config_int(config, RESUME_ROUND) if RESUME_ROUND in config else None)

    def to_dict(self) -> dict[str, Any]:
        """The request as sent over the trainer's local channel: ``{"op": "train", "run_id", "round", "tau",
        "attempt", ["checkpoint_round"], ["resume_round"], "weights" | "downlink", "received"}``."""
        request: dict[str, Any] = {"op": TRAIN_OP, "run_id": self.run_id, "round": self.round, "tau": self.tau,
                                   "attempt": self.attempt, **self.model, "received": dict(self.received)}
        if self.checkpoint_round is not None:
            request["checkpoint_round"] = self.checkpoint_round
        if self.resume_round is not None:
            request["resume_round"] = self.resume_round
        return request

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> TrainRequest:
        """The request :meth:`to_dict` made; ProtocolError naming what is missing or malformed."""
        try:
            model = {key: request[key] for key in ("weights", "downlink") if key in request}
            if len(model) != 1:
                raise ProtocolError("a train request carries exactly one of 'weights' and 'downlink'")
            optional = {key: int(request[key]) for key in ("checkpoint_round", "resume_round") if key in request}
            return cls(run_id=str(request["run_id"]), round=int(request["round"]), tau=int(request["tau"]), model=model,
                       received=dict(request.get("received") or {}), attempt=int(request.get("attempt", 1)), **optional)
        except KeyError as err:
            raise ProtocolError(f"a train request needs {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ProtocolError(f"malformed train request: {err}") from None


@dataclass(frozen=True)
class StreamRequest:
    """What the ClientApp hands the persistent trainer for one message of a streaming run: the exchange k it asks
    for, the run's initial weights (the first exchange: the trainer starts training on them), and the server's
    results of earlier exchanges (`results`, by exchange) for the trainer to merge on schedule; in a resumed
    attempt, the round of the checkpoint it continues from (`resume_round`); when the run checkpoints, the round of
    the server's oldest retained checkpoint (`checkpoint_round`)."""

    run_id: str
    exchange: int
    tau: int
    weights: Mapping[str, np.ndarray] | None = None
    results: Mapping[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    attempt: int = 1
    checkpoint_round: int | None = None
    resume_round: int | None = None

    @classmethod
    def from_message(cls, content: RecordDict) -> StreamRequest:
        """The request for a streaming message's content (ProtocolError naming what is missing or malformed)."""
        config = content.config_records[CONFIG_KEY]
        try:
            weights = decode_tensors(content) if has_tensors(content, ARRAYS_KEY) else None
            results = decode_results(content, _int_list(config, RESULTS_OF))
        except PayloadError as err:
            raise ProtocolError(f"streaming message: {err}") from None
        return cls(run_id=str(config[RUN_ID]), exchange=config_int(config, EXCHANGE), tau=config_int(config, TAU),
                   weights=weights, results=results,
                   attempt=config_int(config, ATTEMPT) if ATTEMPT in config else 1,
                   checkpoint_round=config_int(config, CHECKPOINT_ROUND) if CHECKPOINT_ROUND in config else None,
                   resume_round=config_int(config, RESUME_ROUND) if RESUME_ROUND in config else None)

    def to_dict(self) -> dict[str, Any]:
        """The request as sent over the trainer's local channel (``{"op": "stream", ...}``)."""
        return {"op": STREAM_OP, "run_id": self.run_id, "exchange": self.exchange, "tau": self.tau,
                "weights": self.weights, "results": dict(self.results), "attempt": self.attempt,
                "checkpoint_round": self.checkpoint_round, "resume_round": self.resume_round}

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> StreamRequest:
        """The request :meth:`to_dict` made; ProtocolError naming what is missing or malformed."""
        try:
            optional = {key: None if request.get(key) is None else int(request[key])
                        for key in ("checkpoint_round", "resume_round")}
            return cls(run_id=str(request["run_id"]), exchange=int(request["exchange"]), tau=int(request["tau"]),
                       weights=request.get("weights"),
                       results={int(k): v for k, v in (request.get("results") or {}).items()},
                       attempt=int(request.get("attempt", 1)), **optional)
        except KeyError as err:
            raise ProtocolError(f"a stream request needs {err.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ProtocolError(f"malformed stream request: {err}") from None


def stream_config(*, exchange: int, server_round: int, tau: int, run_id: str, run_dir: str, datacenter: str,
                  results_of: Sequence[int] = (), attempt: int | None = None, checkpoint_round: int | None = None,
                  resume_round: int | None = None) -> dict[str, Any]:
    """The config entries of a streaming message (its tensors: the weights, or the results of `results_of`)."""
    cfg = train_config(server_round=server_round, tau=tau, run_id=run_id, run_dir=run_dir, datacenter=datacenter,
                       attempt=attempt, checkpoint_round=checkpoint_round, resume_round=resume_round)
    cfg[EXCHANGE] = exchange
    if results_of:
        cfg[RESULTS_OF] = [int(k) for k in results_of]
    return cfg


def result_payload_key(exchange: int) -> str:
    """The record carrying exchange `exchange`'s compressed result (raw bytes, as :func:`encode_compressed`)."""
    return f"{FRAGMENT_UPDATE_KEY}/{exchange}"


def encode_results(results: Mapping[int, Mapping[str, np.ndarray]]) -> dict[str, ArrayRecord | ConfigRecord]:
    """The records carrying the server's results of some exchanges: the dense ones as one tensor group
    (FRAGMENT_UPDATE_KEY, tensors ``<exchange>/<name>``), each compressed one (``{RESULT_PAYLOAD: bytes}``) as raw
    bytes in a record of its own (:func:`result_payload_key`); none for none."""
    records: dict[str, ArrayRecord | ConfigRecord] = {}
    dense = {f"{k}/{name}": value for k, arrays in results.items() if RESULT_PAYLOAD not in arrays
             for name, value in arrays.items()}
    if dense:
        records.update(encode_tensors(dense, FRAGMENT_UPDATE_KEY))
    for k, arrays in results.items():
        if RESULT_PAYLOAD in arrays:
            records.update(encode_compressed(arrays[RESULT_PAYLOAD], result_payload_key(k)))
    return records


def decode_results(content: RecordDict, exchanges: Sequence[int]) -> dict[int, dict[str, np.ndarray]]:
    """The results :func:`encode_results` packed, for `exchanges` (the message's RESULTS_OF); PayloadError if a
    record is missing or they do not hold exactly those exchanges."""
    if not exchanges:
        return {}
    results: dict[int, dict[str, np.ndarray]] = {k: {} for k in exchanges}
    for k in exchanges:
        if result_payload_key(k) in content:
            results[k][RESULT_PAYLOAD] = compressed_payload(content, result_payload_key(k))
    dense = decode_tensors(content, FRAGMENT_UPDATE_KEY) if has_tensors(content, FRAGMENT_UPDATE_KEY) else {}
    if not dense and any(not arrays for arrays in results.values()):
        raise PayloadError(f"no tensor group '{FRAGMENT_UPDATE_KEY}' in the message")
    for key, value in dense.items():
        exchange, _, name = key.partition("/")
        if not exchange.isdigit() or int(exchange) not in results or not name:
            raise PayloadError(f"result tensor {key!r} is of none of the exchanges {list(exchanges)}")
        if RESULT_PAYLOAD in results[int(exchange)]:
            raise PayloadError(f"exchange {exchange} has both a compressed result and result tensors")
        results[int(exchange)][name] = value
    empty = [k for k, arrays in results.items() if not arrays]
    if empty:
        raise PayloadError(f"no result tensors of exchange(s) {empty}")
    return results


def _int_list(config: ConfigRecord, key: str) -> list[int]:
    """Config entry `key` as a list of ints (empty when absent); ProtocolError when it is not one."""
    value = config.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ProtocolError(f"config entry '{key}' must be a list of integers, got {value!r}")
    return [int(v) for v in value]


def config_int(config: ConfigRecord, key: str) -> int:
    """Config entry `key` as an int; ProtocolError naming it when it is missing or not a number."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ProtocolError(f"config entry '{key}' must be a number, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ProtocolError(f"config entry '{key}' must be a number, got {value!r}") from None


def _array(content: RecordDict, record: str, key: str) -> Array:
    """Array `key` of array record `record` (KeyError/TypeError when the message has none there)."""
    value = content.array_records[record][key]
    if not isinstance(value, Array):
        raise TypeError(f"record '{record}' entry '{key}' is not an array")
    return value


def train_config(*, server_round: int, tau: int, run_id: str, run_dir: str, datacenter: str,
                 attempt: int | None = None, checkpoint_round: int | None = None, resume_round: int | None = None,
                 global_version: int | None = None) -> dict[str, Any]:
    """The config entries crossdc itself puts in a train message (a strategy's and the downlink's come on top)."""
    cfg: dict[str, Any] = {ROUND: server_round, TAU: tau, RUN_ID: run_id, RUN_DIR: run_dir, DATACENTER: datacenter}
    for key, value in ((ATTEMPT, attempt), (CHECKPOINT_ROUND, checkpoint_round), (RESUME_ROUND, resume_round),
                       (GLOBAL_VERSION, global_version)):
        if value is not None:
            cfg[key] = value
    return cfg


@dataclass(frozen=True)
class GossipRequest:
    """What the ClientApp hands the persistent trainer for one message of a gossip run: start the replica's agent
    (``start``), hand over the reports and snapshots of rounds after `received` (``report``, waiting up to `wait_s`
    for one; what the coordinator holds already is not sent again) and forget those up to `acknowledged` (they are in
    the run log), or the replica's final weights (``final``). `received` is never below `acknowledged`."""

    run_id: str
    action: str
    acknowledged: int = 0
    wait_s: float = 0.0
    attempt: int = 1
    received: int = 0

    def __post_init__(self) -> None:
        if self.received < self.acknowledged:
            object.__setattr__(self, "received", self.acknowledged)
        if self.action not in GOSSIP_ACTIONS:
            raise ProtocolError(f"unknown gossip action {self.action!r}; known: {', '.join(GOSSIP_ACTIONS)}")

    @classmethod
    def from_message(cls, content: RecordDict) -> GossipRequest:
        """The request of a gossip message's content (ProtocolError naming what is missing or malformed)."""
        config = content.config_records[CONFIG_KEY]
        try:
            return cls(run_id=str(config[RUN_ID]), action=str(config[GOSSIP]),
                       acknowledged=config_int(config, GOSSIP_ACKNOWLEDGED) if GOSSIP_ACKNOWLEDGED in config else 0,
                       wait_s=float(config.get(GOSSIP_WAIT_S, 0.0)),  # type: ignore[arg-type]
                       attempt=config_int(config, ATTEMPT) if ATTEMPT in config else 1,
                       received=config_int(config, GOSSIP_RECEIVED) if GOSSIP_RECEIVED in config else 0)
        except KeyError as err:
            raise ProtocolError(f"gossip message: missing config entry {err.args[0]!r}") from None

    def to_dict(self) -> dict[str, Any]:
        """The request as sent over the trainer's local channel (``{"op": "gossip", ...}``)."""
        return {"op": GOSSIP_OP, "run_id": self.run_id, "action": self.action, "acknowledged": self.acknowledged,
                "wait_s": self.wait_s, "attempt": self.attempt, "received": self.received}

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> GossipRequest:
        """The request :meth:`to_dict` made; ProtocolError naming what is missing or malformed."""
        try:
            return cls(run_id=str(request["run_id"]), action=str(request["action"]),
                       acknowledged=int(request.get("acknowledged", 0)), wait_s=float(request.get("wait_s", 0.0)),
                       attempt=int(request.get("attempt", 1)), received=int(request.get("received", 0)))
        except KeyError as err:
            raise ProtocolError(f"a gossip request needs {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ProtocolError(f"malformed gossip request: {err}") from None


def gossip_config(*, action: str, run_id: str, run_dir: str, datacenter: str, acknowledged: int = 0,
                  wait_s: float = 0.0, attempt: int | None = None, received: int | None = None) -> dict[str, Any]:
    """The config entries of a gossip message (`received`: as `acknowledged` if not given)."""
    cfg: dict[str, Any] = {GOSSIP: action, RUN_ID: run_id, RUN_DIR: run_dir, DATACENTER: datacenter,
                           GOSSIP_ACKNOWLEDGED: acknowledged, GOSSIP_WAIT_S: float(wait_s),
                           GOSSIP_RECEIVED: acknowledged if received is None else received}
    if attempt is not None:
        cfg[ATTEMPT] = attempt
    return cfg


def gossip_reply_content(answer: Mapping[str, Any]) -> RecordDict:
    """A gossip reply's content from the trainer's answer (``reports``: list of dicts, ``finished``, ``snapshots``:
    {round: weights}, ``final``: weights or None, ``metrics``)."""
    snapshots = {int(r): w for r, w in (answer.get("snapshots") or {}).items()}
    records: dict[str, Any] = {}
    for server_round, weights in snapshots.items():
        records.update(encode_tensors(weights, snapshot_key(server_round)))
    if answer.get("final") is not None:
        records.update(encode_tensors(answer["final"]))
    records[CONFIG_KEY] = ConfigRecord({GOSSIP_REPORTS: json.dumps(answer.get("reports") or []),
                                        GOSSIP_FINISHED: bool(answer.get("finished")),
                                        GOSSIP_SNAPSHOTS: sorted(snapshots)})
    return RecordDict({**records, METRICS_KEY: MetricRecord(dict(answer.get("metrics") or {}))})


def decode_gossip_reply(content: RecordDict) -> tuple[list[dict[str, Any]], dict[int, dict[str, np.ndarray]],
                                                      dict[str, np.ndarray] | None, bool]:
    """(reports, snapshots by round, final weights or None, finished) of a gossip reply; PayloadError if malformed."""
    try:
        config = content.config_records[CONFIG_KEY]
        reports = json.loads(str(config[GOSSIP_REPORTS]))
        rounds = [int(r) for r in config.get(GOSSIP_SNAPSHOTS, [])]  # type: ignore[union-attr]
        finished = bool(config[GOSSIP_FINISHED])
    except (KeyError, ValueError, TypeError) as err:
        raise PayloadError(f"a gossip reply without a readable {GOSSIP_REPORTS!r}: {err}") from None
    if not isinstance(reports, list):
        raise PayloadError(f"{GOSSIP_REPORTS!r} must be a JSON list")
    snapshots = {r: decode_tensors(content, snapshot_key(r)) for r in rounds}
    final = decode_tensors(content) if has_tensors(content, ARRAYS_KEY) else None
    return reports, snapshots, final, finished


@dataclass(frozen=True)
class PipelineRequest:
    """What the ClientApp hands a stage's persistent trainer for one message of a pipeline run: run the round's `tau`
    optimizer steps with the other stages and report them, with the stage's weights after them if `weights`; in a
    resumed attempt, the round of the checkpoint it continues from (`resume_round`); when the run checkpoints, the
    round of the server's oldest retained checkpoint (`checkpoint_round`); in a run of several replicas, the
    stage's blocks of the global model to begin the round from (`global_weights`, sent as the message's tensors)."""

    run_id: str
    round: int
    tau: int
    weights: bool = False
    attempt: int = 1
    checkpoint_round: int | None = None
    resume_round: int | None = None
    global_weights: dict[str, np.ndarray] | None = None

    @classmethod
    def from_message(cls, content: RecordDict) -> PipelineRequest:
        """The request of a pipeline message's content (ProtocolError naming what is missing or malformed)."""
        config = content.config_records[CONFIG_KEY]
        try:
            return cls(run_id=str(config[RUN_ID]), round=config_int(config, ROUND), tau=config_int(config, TAU),
                       weights=bool(config.get(PIPELINE_WEIGHTS, False)),
                       attempt=config_int(config, ATTEMPT) if ATTEMPT in config else 1,
                       checkpoint_round=config_int(config, CHECKPOINT_ROUND) if CHECKPOINT_ROUND in config else None,
                       resume_round=config_int(config, RESUME_ROUND) if RESUME_ROUND in config else None,
                       global_weights=decode_tensors(content) if has_tensors(content, ARRAYS_KEY) else None)
        except KeyError as err:
            raise ProtocolError(f"pipeline message: missing config entry {err.args[0]!r}") from None
        except PayloadError as err:
            raise ProtocolError(f"pipeline message: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """The request as sent over the trainer's local channel (``{"op": "pipeline", ...}``)."""
        return {"op": PIPELINE_OP, "run_id": self.run_id, "round": self.round, "tau": self.tau, "weights": self.weights,
                "attempt": self.attempt, "checkpoint_round": self.checkpoint_round, "resume_round": self.resume_round,
                "global_weights": self.global_weights}

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> PipelineRequest:
        """The request :meth:`to_dict` made; ProtocolError naming what is missing or malformed."""
        try:
            optional = {key: int(request[key]) for key in ("checkpoint_round", "resume_round")
                        if request.get(key) is not None}
            given = request.get("global_weights")
            global_weights = None if given is None else {str(k): np.asarray(v, np.float32) for k, v in dict(given).items()}
            return cls(run_id=str(request["run_id"]), round=int(request["round"]), tau=int(request["tau"]),
                       weights=bool(request.get("weights", False)), attempt=int(request.get("attempt", 1)),
                       global_weights=global_weights, **optional)
        except KeyError as err:
            raise ProtocolError(f"a pipeline request needs {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ProtocolError(f"malformed pipeline request: {err}") from None


def pipeline_config(*, server_round: int, tau: int, run_id: str, run_dir: str, datacenter: str, weights: bool,
                    attempt: int, checkpoint_round: int | None = None, resume_round: int | None = None) -> dict[str, Any]:
    """The config entries of a pipeline message."""
    cfg = train_config(server_round=server_round, tau=tau, run_id=run_id, run_dir=run_dir, datacenter=datacenter,
                       attempt=attempt, checkpoint_round=checkpoint_round, resume_round=resume_round)
    cfg.update({PIPELINE: True, PIPELINE_WEIGHTS: bool(weights)})
    return cfg


def pipeline_reply_content(answer: Mapping[str, Any]) -> RecordDict:
    """A pipeline reply's content from the stage's answer (``report``: a JSON-able dict, ``weights``: the stage's
    weights or None, ``metrics``)."""
    records: dict[str, Any] = {}
    if answer.get("weights") is not None:
        records.update(encode_tensors(answer["weights"]))
    records[CONFIG_KEY] = ConfigRecord({PIPELINE_REPORT: json.dumps(answer.get("report") or {})})
    return RecordDict({**records, METRICS_KEY: MetricRecord(dict(answer.get("metrics") or {}))})


def decode_pipeline_reply(content: RecordDict) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    """(report, the stage's weights or None) of a pipeline reply; PayloadError if malformed."""
    try:
        report = json.loads(str(content.config_records[CONFIG_KEY][PIPELINE_REPORT]))
    except (KeyError, ValueError, TypeError) as err:
        raise PayloadError(f"a pipeline reply without a readable {PIPELINE_REPORT!r}: {err}") from None
    if not isinstance(report, dict):
        raise PayloadError(f"{PIPELINE_REPORT!r} must be a JSON object")
    weights = decode_tensors(content) if has_tensors(content, ARRAYS_KEY) else None
    return report, weights


class PayloadError(ValueError):
    """A message's tensors cannot be decoded (missing records, or a layout that does not match the data)."""


def layout_key(group: str) -> str:
    """The layout record of tensor group `group`: LAYOUT_KEY for the main group ARRAYS_KEY, else ``<group>-layout``."""
    return LAYOUT_KEY if group == ARRAYS_KEY else f"{group}-layout"


def encode_tensors(arrays: Mapping[str, np.ndarray], group: str = ARRAYS_KEY) -> dict[str, ArrayRecord | ConfigRecord]:
    """The records carrying `arrays` (float32) as tensor group `group`: {group: one flat Array, layout_key(group): names
    and shapes}. The main group (weights down, the update up) is ARRAYS_KEY; a strategy's extra tensors travel as
    further groups under named constants (e.g. CONTROL_KEY), in the same message."""
    names = list(arrays)
    flat = np.concatenate([np.asarray(arrays[n], dtype=np.float32).ravel() for n in names]) if names else np.zeros(0, np.float32)
    layout = json.dumps([[n, list(np.shape(arrays[n]))] for n in names])
    return {group: ArrayRecord({FLAT: Array(flat)}), layout_key(group): ConfigRecord({"tensors": layout})}


def has_tensors(content: RecordDict, group: str) -> bool:
    """Whether the message carries tensor group `group` (both its records)."""
    return group in content and layout_key(group) in content


def decode_tensors(content: RecordDict, group: str = ARRAYS_KEY) -> dict[str, np.ndarray]:
    """The named tensors of group `group` of a message encoded by :func:`encode_tensors`; PayloadError if the message
    does not carry that group or it does not decode (a missing group fails here, never as an empty dict)."""
    try:
        flat = _array(content, group, FLAT).numpy()
        layout = json.loads(str(content.config_records[layout_key(group)]["tensors"]))
    except (KeyError, TypeError, ValueError) as err:
        what = "no tensors" if group == ARRAYS_KEY else f"no tensor group '{group}'"
        raise PayloadError(f"{what} in the message ({type(err).__name__}: {err})") from None
    if flat.ndim != 1:
        raise PayloadError(f"the packed tensors must be one flat array, got shape {flat.shape}")
    result: dict[str, np.ndarray] = {}
    offset = 0
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(isinstance(d, int) and d >= 0 for d in entry[1])):
            raise PayloadError(f"malformed layout entry {entry!r}")
        name, shape = entry
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if offset + size > flat.size:
            raise PayloadError(f"layout needs more values than the {flat.size} sent (at tensor '{name}')")
        result[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    if offset != flat.size:
        raise PayloadError(f"layout covers {offset} values but {flat.size} were sent")
    return result


def encode_compressed(payload: np.ndarray, key: str = COMPRESSED_KEY) -> dict[str, ArrayRecord]:
    """The record carrying a codec pipeline's payload (see crossdc.compression.wire) as raw bytes: about 40 bytes
    of Flower framing instead of the ~170 of a numpy array (whose .npy header would travel too)."""
    data = np.ascontiguousarray(payload, dtype=np.uint8).tobytes()
    return {key: ArrayRecord({PAYLOAD: Array(dtype="uint8", shape=(len(data),), stype=PAYLOAD_STYPE, data=data)})}


def compressed_payload(content: RecordDict, key: str = COMPRESSED_KEY) -> np.ndarray:
    """The payload bytes of a message built by :func:`encode_compressed`; PayloadError if it has none."""
    try:
        array = _array(content, key, PAYLOAD)
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"no compressed update in the message ({type(err).__name__}: {err})") from None
    if array.stype != PAYLOAD_STYPE or array.dtype != "uint8" or list(array.shape) != [len(array.data)]:
        raise PayloadError(f"the compressed update must be raw bytes, got {array.stype} {array.dtype} {array.shape}")
    return np.frombuffer(array.data, dtype=np.uint8)


def payload_bytes(content: RecordDict) -> int:
    """Exact size in bytes of a message's content as Flower serialises it (protobuf)."""
    return recorddict_to_proto(content).ByteSize()


def raw_fp32_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Size of the same tensors sent densely as fp32 (the uncompressed reference)."""
    return int(sum(int(np.size(a)) * 4 for a in arrays.values()))


def extra_groups(content: RecordDict) -> dict[str, dict[str, np.ndarray]]:
    """Every tensor group of a message besides the weights (a strategy's, e.g. SCAFFOLD's ``control``), decoded."""
    return {name: decode_tensors(content, name) for name in content.array_records
            if name not in (ARRAYS_KEY, DOWNLINK_KEY) and has_tensors(content, name)}


def global_model(content: RecordDict) -> dict[str, Any]:
    """The request entries that carry the round's global model: ``weights`` (dense), or with downlink compression
    ``downlink`` (the full reference, a compressed delta for the trainer to apply to its stored reference, or the
    digest of the run's initial weights, which the trainer builds itself)."""
    config = content.config_records[CONFIG_KEY]
    kind = config.get(DOWNLINK)
    if kind is None:
        return {"weights": decode_tensors(content)}
    message: dict[str, Any] = {"kind": str(kind), "version": config_int(config, DOWNLINK_VERSION)}
    if kind == "delta":
        message.update(base=config_int(config, DOWNLINK_BASE), payload=compressed_payload(content, DOWNLINK_KEY))
    elif kind == "initial":
        message["digest"] = str(config.get(DOWNLINK_DIGEST, ""))
    else:
        message["weights"] = decode_tensors(content)
    return {"downlink": message}


def reply_content(answer: Mapping[str, Any]) -> RecordDict:
    """A train reply's content from the trainer's answer (``payload`` or ``delta``, ``extras``, ``metrics``): the
    update (codec payload or dense), the strategy's tensor groups, the metrics record."""
    records: dict[str, Any] = encode_compressed(answer["payload"]) if "payload" in answer else encode_tensors(answer["delta"])
    for group, arrays in (answer.get("extras") or {}).items():
        records.update(encode_tensors(arrays, group))
    return RecordDict({**records, METRICS_KEY: MetricRecord(dict(answer["metrics"]))})
