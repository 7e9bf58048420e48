"""The datacenter's Flower ClientApp: a thin adapter that hands each round to the persistent trainer.

Flower starts a new ClientApp process per message, so this module imports no
torch: it unwraps the message, calls the trainer over the local channel and
wraps the trainer's answer (see :mod:`crossdc.strategies.base` for the contract).

Which datacenter this node is comes from the SuperNode's node config
(``datacenter="us-east"``); under Flower's simulation, from the node's
``partition-id`` into the datacenter list the server sends.
"""

from __future__ import annotations

import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from crossdc.clients.channel import call_trainer
from crossdc.compression.payload import (ARRAYS_KEY, CONFIG_KEY, DOWNLINK, DOWNLINK_BASE, DOWNLINK_KEY, DOWNLINK_VERSION,
                                         METRICS_KEY, compressed_payload, decode_tensors, encode_compressed, encode_tensors,
                                         has_tensors)
from crossdc.platform.rundir import RunDir

#: config keys of server → datacenter messages
HELLO_DATACENTERS = "datacenters"
RUN_ID = "crossdc-run-id"
RUN_DIR = "crossdc-run-dir"
RUN_CONFIG = "crossdc-config"
#: node config of a production SuperNode (`crossdc node start`): the node service's socket and auth key file
NODE_SERVICE = "node-service"
NODE_AUTHKEY_FILE = "node-authkey-file"
ROUND = "round"
TAU = "tau"
#: which attempt at the run this message belongs to (1, then +1 per `crossdc resume`), and the round of the
#: server's oldest retained checkpoint (present only when the run checkpoints)
ATTEMPT = "crossdc-attempt"
CHECKPOINT_ROUND = "crossdc-checkpoint-round"
#: in a resumed run (attempt > 1): the round of the checkpoint it continues from
RESUME_ROUND = "crossdc-resume-round"
DATACENTER = "datacenter"

app = ClientApp()


def datacenter_name(context: Context, known: list[str]) -> str:
    """This node's datacenter: node config `datacenter`, else `partition-id` (simulation) into `known`."""
    name = context.node_config.get("datacenter")
    if name:
        return str(name)
    if "partition-id" in context.node_config:
        return known[int(context.node_config["partition-id"])]
    raise RuntimeError("this SuperNode has no 'datacenter' in its node config (--node-config 'datacenter=\"NAME\"')")


def _node_service(context: Context, request: dict) -> dict:
    """Ask this datacenter's node service (production SuperNodes only) to prepare a run's trainer."""
    key = Path(str(context.node_config[NODE_AUTHKEY_FILE])).read_bytes()
    return call_trainer(str(context.node_config[NODE_SERVICE]), key, {"op": "prepare", **request})


@app.query()
def hello(msg: Message, context: Context) -> Message:
    """Tell the server which datacenter this node is; a production node also prepares the run's trainer from the
    run id and config the hello carries."""
    config = msg.content[CONFIG_KEY]
    known = str(config.get(HELLO_DATACENTERS, "")).split(",")
    name = datacenter_name(context, known)
    if NODE_SERVICE in context.node_config and RUN_ID in config:
        _node_service(context, {"run_id": str(config[RUN_ID]), "config": str(config.get(RUN_CONFIG, ""))})
    return Message(RecordDict({CONFIG_KEY: ConfigRecord({DATACENTER: name})}), reply_to=msg)


def extra_groups(content: RecordDict) -> dict[str, dict]:
    """Every tensor group of a message besides the weights (a strategy's, e.g. SCAFFOLD's ``control``), decoded."""
    return {name: decode_tensors(content, name) for name in content.array_records
            if name not in (ARRAYS_KEY, DOWNLINK_KEY) and has_tensors(content, name)}


def global_model(content: RecordDict) -> dict:
    """The request entries that carry the round's global model: ``weights`` (dense), or with downlink compression
    ``downlink`` (the full reference or a compressed delta for the trainer to apply to its stored reference)."""
    config = content[CONFIG_KEY]
    kind = config.get(DOWNLINK)
    if kind is None:
        return {"weights": decode_tensors(content)}
    message = {"kind": str(kind), "version": int(config[DOWNLINK_VERSION])}
    if kind == "delta":
        message.update(base=int(config[DOWNLINK_BASE]), payload=compressed_payload(content, DOWNLINK_KEY))
    else:
        message["weights"] = decode_tensors(content)
    return {"downlink": message}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the round's local steps on the datacenter's trainer and return the update and the strategy's extra
    tensor groups (the contract is in crossdc.strategies.base; this adapter knows no strategy)."""
    started = time.perf_counter()
    config = msg.content[CONFIG_KEY]
    datacenter = str(config[DATACENTER])
    if NODE_SERVICE in context.node_config:  # production: the node service knows where the run's trainer is
        socket_path = _node_service(context, {"run_id": str(config[RUN_ID])})["socket"]
        authkey_file = context.node_config[NODE_AUTHKEY_FILE]
    else:  # a local run: the trainer's socket is in the run's folder (or given as node config)
        run_dir = RunDir(Path(str(config[RUN_DIR])))
        socket_path = context.node_config.get("trainer") or run_dir.trainer_socket(datacenter)
        authkey_file = context.node_config.get("trainer-authkey-file") or run_dir.authkey_file
    answer = call_trainer(
        str(socket_path),
        Path(str(authkey_file)).read_bytes(),
        {
            "op": "train",
            "run_id": str(config[RUN_ID]),
            "round": int(config[ROUND]),
            "tau": int(config[TAU]),
            "attempt": int(config.get(ATTEMPT, 1)),
            **({"checkpoint_round": int(config[CHECKPOINT_ROUND])} if CHECKPOINT_ROUND in config else {}),
            **({"resume_round": int(config[RESUME_ROUND])} if RESUME_ROUND in config else {}),
            **global_model(msg.content),
            "received": extra_groups(msg.content),
        },
    )
    metrics = dict(answer["metrics"])
    metrics["clientapp-s"] = time.perf_counter() - started
    records: dict = encode_compressed(answer["payload"]) if "payload" in answer else encode_tensors(answer["delta"])
    for group, arrays in (answer.get("extras") or {}).items():
        records.update(encode_tensors(arrays, group))
    content = RecordDict({**records, METRICS_KEY: MetricRecord(metrics)})
    return Message(content, reply_to=msg)
