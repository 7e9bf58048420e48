"""Plain Flower, as a Flower user runs it today: the comparison every crossdc benchmark owes its users.

`run_flower_fedavg` runs Flower's own `flwr.serverapp.strategy.FedAvg`, unchanged, under Flower's simulation
engine, with `client_app` below: a plain ClientApp written the way Flower's examples write one. Per round a
client receives the global model as an `ArrayRecord` of named tensors, builds a fresh optimizer (its state
does not survive the round, as in Flower's examples), trains exactly τ steps on its datacenter's shard and
returns the weights with `num-examples`. No codecs, no persistent trainer, no crossdc protocol.

What is shared with crossdc, so that only the federation differs: the workload (data, partition, model),
the inner optimizer, learning rate and batch size, and the initial weights (`crossdc.experiment.builders`).
Bytes are counted exactly as crossdc counts its own: the serialised size of each message's content
(`crossdc.protocol.payload_bytes`), both ways, per datacenter and round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from crossdc import protocol as proto
from crossdc.clients.local_training import LocalTrainer
from crossdc.experiment.builders import build_workload, datacenter_seed, initial_model
from crossdc.experiment.config import ExperimentConfig, parse_config
from crossdc.protocol import payload_bytes
from crossdc.workloads import Workload, evaluate, load_model_weights, model_weights

#: train-config keys the server sends (besides FedAvg's own "server-round")
EXPERIMENT_KEY = "crossdc-experiment"
TAU_KEY = "tau"
THREADS_KEY = "torch-threads"


class FlowerBaselineError(RuntimeError):
    """Flower's run did not produce the rounds it was asked for."""


@lru_cache(maxsize=2)
def _experiment(document: str) -> tuple[ExperimentConfig, Workload]:
    config = parse_config(json.loads(document))
    return config, build_workload(config)


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def _array_record(weights: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in weights.items()})


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """τ steps from the received model on this node's datacenter shard, a fresh optimizer, the weights back."""
    cfg = msg.content["config"]
    config, workload = _experiment(str(cfg[EXPERIMENT_KEY]))
    datacenter = config.datacenter_names[int(context.node_config["partition-id"])]
    server_round, tau = int(cfg["server-round"]), int(cfg[TAU_KEY])
    torch.set_num_threads(int(cfg[THREADS_KEY]))
    w = config.workload
    # a fresh data order each round, distinct per datacenter (a user's shuffling DataLoader)
    trainer = LocalTrainer(workload, workload.shard(datacenter), w.batch_size, w.optimizer, w.lr,
                           datacenter_seed(config, datacenter) * 1000 + server_round, options=w.options,
                           horizon_steps=tau * config.run.rounds)
    trainer.inner_steps = tau * (server_round - 1)  # where the run's learning-rate schedule stands (τ is fixed here)
    trainer.set_weights(_arrays(msg.content["arrays"]))
    result = trainer.train_steps(tau)
    reply = RecordDict({"arrays": _array_record(trainer.get_weights())})
    reply["metrics"] = MetricRecord({proto.NUM_EXAMPLES: int(result.num_examples), proto.COMPUTE_S: float(result.compute_s),
                                     proto.TRAIN_LOSS: float(result.mean_loss), "bytes-down": payload_bytes(msg.content),
                                     "bytes-up": payload_bytes(reply)})
    return Message(content=reply, reply_to=msg)


def _per_datacenter(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Keep each client's figures (sums and maxima) instead of FedAvg's weighted mean of them."""
    metrics = [next(iter(r.metric_records.values())) for r in records]
    return MetricRecord({proto.NUM_EXAMPLES: sum(int(m[proto.NUM_EXAMPLES]) for m in metrics),
                         "compute-s-each": [float(m[proto.COMPUTE_S]) for m in metrics],
                         "bytes-down-each": [int(m["bytes-down"]) for m in metrics],
                         "bytes-up-each": [int(m["bytes-up"]) for m in metrics],
                         proto.TRAIN_LOSS: float(np.mean([float(m[proto.TRAIN_LOSS]) for m in metrics]))})


def run_flower_fedavg(config: ExperimentConfig, tau: int, rounds: int,
                      progress: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run Flower's FedAvg for `rounds` rounds of `tau` local steps; one row per round.

    Each row: round, tau, val_loss and val_accuracy of the global model after the round (Flower's
    centralised `evaluate_fn`, on crossdc's validation set), compute_s / bytes_down / bytes_up per
    datacenter (lists in the order the replies were aggregated), round_wall_s (the round in the simulation,
    clients one after another, evaluation excluded) and overhead_s (that minus the clients' compute: Flower's
    own time, including its engine's polling).
    """
    from flwr.simulation import run_simulation

    config_json = json.dumps(config.raw)
    _, workload = _experiment(config_json)
    n = len(config.datacenter_names)
    model = initial_model(config, workload)
    initial = model_weights(model)
    evals: dict[int, tuple[float, float, float, float]] = {}

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        started = time.perf_counter()
        load_model_weights(model, _arrays(arrays))
        loss, accuracy = evaluate(workload, model)
        evals[server_round] = (loss, accuracy, started, time.perf_counter())
        return MetricRecord({"val-loss": loss, "val-accuracy": accuracy})

    outcome: dict[str, Any] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n,
                          train_metrics_aggr_fn=_per_datacenter)
        outcome["result"] = strategy.start(grid, _array_record(initial), num_rounds=rounds,
                                           train_config=ConfigRecord({EXPERIMENT_KEY: config_json, TAU_KEY: tau,
                                                                         THREADS_KEY: torch.get_num_threads()}),
                                           evaluate_fn=central)

    # one client at a time (one actor): a round's wall time is then Σ compute + Flower's own time, as in the
    # in-process engine crossdc's rows are measured with
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 1, "include_dashboard": False}})
    result = outcome.get("result")
    if result is None or len(result.train_metrics_clientapp) != rounds:
        raise FlowerBaselineError(f"Flower's FedAvg ended with {0 if result is None else len(result.train_metrics_clientapp)} "
                                  f"of {rounds} rounds; see Flower's log above")
    rows = []
    for server_round in range(1, rounds + 1):
        m = result.train_metrics_clientapp[server_round]
        loss, accuracy, eval_started, _ = evals[server_round]
        round_s = eval_started - evals[server_round - 1][3]  # from the previous evaluation's end to this one's start
        compute = [float(c) for c in m["compute-s-each"]]
        rows.append({"round": server_round, "tau": tau, "val_loss": loss, "val_accuracy": accuracy,
                     "compute_s": compute, "bytes_down": [int(b) for b in m["bytes-down-each"]],
                     "bytes_up": [int(b) for b in m["bytes-up-each"]], "round_wall_s": round_s,
                     "overhead_s": max(0.0, round_s - sum(compute))})
        if progress:
            progress(rows[-1])
    return rows
