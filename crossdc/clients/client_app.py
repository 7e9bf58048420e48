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
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from crossdc import protocol as proto
from crossdc.clients.channel import call_trainer
from crossdc.experiment.rundir import RunDir
from crossdc.protocol import (
    CONFIG_KEY,
    GossipRequest,
    PipelineRequest,
    StreamRequest,
    TrainRequest,
    gossip_reply_content,
    pipeline_reply_content,
    reply_content,
)

app = ClientApp()


def datacenter_name(context: Context, known: list[str]) -> str:
    """This node's datacenter: node config `datacenter`, else `partition-id` (simulation) into `known`."""
    name = context.node_config.get(proto.DATACENTER)
    if name:
        return str(name)
    if proto.NODE_PARTITION_ID in context.node_config:
        return known[int(context.node_config[proto.NODE_PARTITION_ID])]
    raise RuntimeError("this SuperNode has no 'datacenter' in its node config (--node-config 'datacenter=\"NAME\"')")


def _node_service(context: Context, request: dict) -> dict:
    """Ask this datacenter's node service (production SuperNodes only) to prepare a run's trainer."""
    key = Path(str(context.node_config[proto.NODE_AUTHKEY_FILE])).read_bytes()
    return call_trainer(str(context.node_config[proto.NODE_SERVICE]), key, {"op": proto.PREPARE_OP, **request})


@app.query()
def hello(msg: Message, context: Context) -> Message:
    """Tell the server which datacenter this node is; a production node also prepares the run's trainer from the
    run id and config the hello carries, and hands it the coordinator's heartbeat offer if the hello has one."""
    config = msg.content[CONFIG_KEY]
    known = str(config.get(proto.HELLO_DATACENTERS, "")).split(",")
    name = datacenter_name(context, known)
    if proto.NODE_SERVICE in context.node_config and proto.RUN_ID in config:
        request: dict[str, Any] = {"run_id": str(config[proto.RUN_ID]), "config": str(config.get(proto.RUN_CONFIG, ""))}
        if proto.HELLO_HEARTBEAT_PORT in config:  # the coordinator's heartbeat, for the run's trainer to beat to
            request["heartbeat"] = [int(config[proto.HELLO_HEARTBEAT_PORT]), str(config.get(proto.HELLO_HEARTBEAT_KEY, ""))]
        _node_service(context, request)
    return Message(RecordDict({CONFIG_KEY: ConfigRecord({proto.DATACENTER: name})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the round's local steps on the datacenter's trainer and return the update and the strategy's extra
    tensor groups (the contract is in crossdc.strategies.base; this adapter knows no strategy). A streaming run's
    message instead hands the trainer an exchange's result and returns the update of the exchange it asks for; a
    gossip run's starts the datacenter's replica or collects its reports, snapshots and final weights; a pipeline
    run's runs the round's steps of the datacenter's stage with the other stages."""
    started = time.perf_counter()
    config = msg.content[CONFIG_KEY]
    datacenter = str(config[proto.DATACENTER])
    # a streaming run's message asks for one exchange; a gossip run's controls the replica; a pipeline run's, for one
    # round of the stage; any other, for one round's local steps
    kind: type[StreamRequest | GossipRequest | PipelineRequest | TrainRequest] = (
        StreamRequest if proto.EXCHANGE in config else GossipRequest if proto.GOSSIP in config
        else PipelineRequest if proto.PIPELINE in config else TrainRequest)
    request = kind.from_message(msg.content)
    if proto.NODE_SERVICE in context.node_config:  # production: the node service knows where the run's trainer is
        socket_path = _node_service(context, {"run_id": request.run_id})["socket"]
        authkey_file = context.node_config[proto.NODE_AUTHKEY_FILE]
    else:  # a local run: the trainer's socket is in the run's folder (or given as node config)
        run_dir = RunDir(Path(str(config[proto.RUN_DIR])))
        socket_path = context.node_config.get(proto.NODE_TRAINER) or run_dir.trainer_socket(datacenter)
        authkey_file = context.node_config.get(proto.NODE_TRAINER_AUTHKEY_FILE) or run_dir.authkey_file
    answer = call_trainer(str(socket_path), Path(str(authkey_file)).read_bytes(), request.to_dict())
    answer["metrics"] = {**answer["metrics"], proto.CLIENTAPP_S: time.perf_counter() - started}
    content = {GossipRequest: gossip_reply_content, PipelineRequest: pipeline_reply_content}.get(kind, reply_content)
    return Message(content(answer), reply_to=msg)
