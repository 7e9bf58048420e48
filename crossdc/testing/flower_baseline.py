"""Plain Flower, as a Flower user runs it today: the comparison every crossdc benchmark owes its users.

`run_flower_fedavg` runs Flower's own `flwr.serverapp.strategy.FedAvg`, unchanged, on Flower's Deployment Engine:
a SuperLink in the root namespace and one plain `flower-supernode` per datacenter, each in the datacenter's network
namespace behind its emulated WAN link (crossdc.wan.network), the app submitted with `flwr run`
(`flower_fedavg_app.toml` names its two components below). Flower's SuperNode is started as Flower ships it (its
3-second idle poll included), and it starts a new ClientApp process for every message, as Flower does.

`client_app` is a plain ClientApp written the way Flower's examples write one. Per round a client receives the
global model as an `ArrayRecord` of named tensors, builds a fresh optimizer (its state does not survive the round,
as in Flower's examples), trains exactly τ steps on its datacenter's shard and returns the weights with
`num-examples`. No codecs, no persistent trainer, no crossdc protocol, no run log.

What is shared with crossdc, so that only the federation differs: the workload (data, partition, model),
the inner optimizer, learning rate and batch size, and the initial weights (`crossdc.experiment.builders`).
Bytes are counted exactly as crossdc counts its own: the serialised size of each message's content
(`crossdc.protocol.payload_bytes`), both ways, per datacenter and round. The seconds each datacenter's link
carried the round's messages come from the delay line's ledger, read as crossdc's own run log reads it
(`crossdc.wan.ledger.payload_transfers`: the poll that delivered the message, the objects, their acknowledgements).
"""

from __future__ import annotations

import json
import os
import time
from functools import lru_cache
from pathlib import Path
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
from crossdc.experiment.rundir import RunDir
from crossdc.protocol import payload_bytes
from crossdc.workloads import Workload, evaluate, load_model_weights, model_weights

#: train-config keys the server sends (besides FedAvg's own "server-round")
EXPERIMENT_KEY = "crossdc-experiment"
TAU_KEY = "tau"
THREADS_KEY = "torch-threads"
#: the app's run-config keys (flower_fedavg_app.toml): the experiment (a JSON file), τ, rounds, where results go
APP_EXPERIMENT_FILE, APP_TAU, APP_ROUNDS, APP_RESULTS_FILE = "experiment-file", "tau", "rounds", "results-file"
APP_TEMPLATE = Path(__file__).with_name("flower_fedavg_app.toml")
#: the client's metric naming its datacenter (its SuperNode's partition-id), so replies are kept in config order
PARTITION_ID = "partition-id"
#: how often the driver asks the SuperLink whether Flower's run has ended
STATUS_CHECK_S = 2.0


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
    partition = int(context.node_config[PARTITION_ID])
    datacenter = config.datacenter_names[partition]
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
                                     proto.TRAIN_LOSS: float(result.mean_loss), PARTITION_ID: partition,
                                     "bytes-down": payload_bytes(msg.content), "bytes-up": payload_bytes(reply)})
    return Message(content=reply, reply_to=msg)


def _per_datacenter(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """Keep each client's figures (sums and maxima), in the config's datacenter order, instead of FedAvg's weighted
    mean of them."""
    metrics = sorted((next(iter(r.metric_records.values())) for r in records), key=lambda m: int(m[PARTITION_ID]))
    return MetricRecord({proto.NUM_EXAMPLES: sum(int(m[proto.NUM_EXAMPLES]) for m in metrics),
                         "compute-s-each": [float(m[proto.COMPUTE_S]) for m in metrics],
                         "bytes-down-each": [int(m["bytes-down"]) for m in metrics],
                         "bytes-up-each": [int(m["bytes-up"]) for m in metrics],
                         proto.TRAIN_LOSS: float(np.mean([float(m[proto.TRAIN_LOSS]) for m in metrics]))})


def fedavg_rounds(grid: Grid, config_json: str, tau: int, rounds: int) -> list[dict[str, Any]]:
    """Flower's FedAvg over every node of `grid` for `rounds` rounds of `tau` local steps; one row per round.

    Each row: round, tau, val_loss and val_accuracy of the global model after the round (Flower's centralised
    `evaluate_fn`, on crossdc's validation set), compute_s / bytes_down / bytes_up per datacenter (config order),
    started_at / ended_at (wall clock: the previous evaluation's end and this one's start) and round_wall_s (their
    difference: the round, evaluation excluded). FlowerBaselineError if Flower ends with fewer rounds."""
    config, workload = _experiment(config_json)
    n = len(config.datacenter_names)
    model = initial_model(config, workload)
    initial = model_weights(model)
    evals: dict[int, tuple[float, float, float, float]] = {}

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        started = time.time()
        load_model_weights(model, _arrays(arrays))
        loss, accuracy = evaluate(workload, model)
        evals[server_round] = (loss, accuracy, started, time.time())
        return MetricRecord({"val-loss": loss, "val-accuracy": accuracy})

    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n,
                      train_metrics_aggr_fn=_per_datacenter)
    result = strategy.start(grid, _array_record(initial), num_rounds=rounds,
                            train_config=ConfigRecord({EXPERIMENT_KEY: config_json, TAU_KEY: tau,
                                                       THREADS_KEY: torch.get_num_threads()}),
                            evaluate_fn=central)
    if len(result.train_metrics_clientapp) != rounds:
        raise FlowerBaselineError(f"Flower's FedAvg ended with {len(result.train_metrics_clientapp)} of {rounds} rounds")
    rows = []
    for server_round in range(1, rounds + 1):
        m = result.train_metrics_clientapp[server_round]
        loss, accuracy, eval_started, _ = evals[server_round]
        started = evals[server_round - 1][3]
        rows.append({"round": server_round, "tau": tau, "val_loss": loss, "val_accuracy": accuracy,
                     "compute_s": [float(c) for c in m["compute-s-each"]],
                     "bytes_down": [int(b) for b in m["bytes-down-each"]],
                     "bytes_up": [int(b) for b in m["bytes-up-each"]],
                     "started_at": started, "ended_at": eval_started, "round_wall_s": eval_started - started})
    return rows


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """The deployed baseline's ServerApp: :func:`fedavg_rounds` with the run config's settings; its rows go to the
    run config's results file (written whole, at the end)."""
    cfg = context.run_config
    rows = fedavg_rounds(grid, Path(str(cfg[APP_EXPERIMENT_FILE])).read_text(), int(cfg[APP_TAU]), int(cfg[APP_ROUNDS]))
    results = Path(str(cfg[APP_RESULTS_FILE]))
    temporary = results.with_suffix(".partial")
    temporary.write_text(json.dumps(rows))
    os.replace(temporary, results)


def link_seconds_per_round(rows: list[dict[str, Any]], run_dir: RunDir, datacenters: list[str]) -> None:
    """Add to every row of :func:`fedavg_rounds` what each datacenter's link carried for the round's messages (the
    delay line's ledger between the row's started_at and ended_at, measured as crossdc's run log measures it):
    comm_s (seconds in flight), link_bytes_up / link_bytes_down (framing included), and idle_s (the round's wall
    time less the datacenter's compute)."""
    from crossdc.federation.session import link_measurements
    from crossdc.orchestration.local_run import EMULATOR_NAMESPACES
    from crossdc.wan.ledger import LedgerReader

    readers = {name: LedgerReader(run_dir.link_ledger(name)) for name in datacenters}
    for row in rows:
        links = [link_measurements(readers[name], row["started_at"], row["ended_at"], EMULATOR_NAMESPACES)
                 for name in datacenters]
        row["comm_s"] = [link["comm_s"] for link in links]
        row["link_bytes_up"] = [link["link_bytes_up"] for link in links]
        row["link_bytes_down"] = [link["link_bytes_down"] for link in links]
        row["idle_s"] = [max(0.0, row["round_wall_s"] - c) for c in row["compute_s"]]


def run_flower_fedavg(config: ExperimentConfig, tau: int, rounds: int, root: Path,
                      timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Run Flower's FedAvg for `rounds` rounds of `tau` local steps on the Deployment Engine over the emulated WAN
    (see the module docstring), in the folder `root` (logs, ledgers, Flower's home); the rows of
    :func:`fedavg_rounds` with the links' figures of :func:`link_seconds_per_round`. Every process it starts is
    stopped, and the namespaces removed, however it ends. FlowerBaselineError if the run does not end with its
    rounds within `timeout_s` (default: 5 minutes a round) or a process it started dies."""
    from crossdc.deployment.superlink_control import ControlError, SuperLinkControl
    from crossdc.experiment.processes import ProcessGroup, free_port, kill_processes_with_env, venv_bin
    from crossdc.orchestration.local_run import (
        RUN_MARKER_ENV,
        run_env,
        start_superlink,
        submit_flower_app,
        write_flower_app,
    )
    from crossdc.wan.network import EmulatedNetwork

    run_dir = RunDir(Path(root).resolve())
    run_dir.create({"config": config.raw})
    names = list(config.datacenter_names)
    experiment_file, results = run_dir.path / "experiment.json", run_dir.path / "rounds.json"
    experiment_file.write_text(json.dumps(config.raw))
    processes = ProcessGroup()
    network = EmulatedNetwork([(dc.name, dc.link) for dc in config.datacenters],
                              [(*link.between, link.link) for link in config.links], run_dir.logs / "links",
                              seed=config.run.seed, log_path=run_dir.logs / "delay-line.log").start()
    try:
        host, port = network.coordinator_address, free_port()
        write_flower_app(run_dir, f"{host}:{port}", template=APP_TEMPLATE)
        start_superlink(processes, run_dir, host, port)
        for index, name in enumerate(names):  # Flower's own SuperNode, in the datacenter's namespace
            processes.start(f"supernode-{name}",
                            [venv_bin("flower-supernode"), "--insecure", "--superlink", f"{host}:{port}",
                             "--node-config", f"{PARTITION_ID}={index} num-partitions={len(names)}"],
                            run_dir.logs / f"supernode-{name}.log", env=run_env(run_dir), preexec=network.preexec(name))
        flower_run_id = submit_flower_app(run_dir, {APP_EXPERIMENT_FILE: str(experiment_file), APP_TAU: tau,
                                                    APP_ROUNDS: rounds, APP_RESULTS_FILE: str(results)})
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 300.0 * (rounds + 1))
        control = SuperLinkControl(f"{host}:{port}", None, insecure=True)
        try:
            status, details = "running", ""
            while not status.startswith("finished"):
                if time.monotonic() > deadline:
                    raise FlowerBaselineError(f"Flower's run {flower_run_id} did not end in time; see {run_dir.logs}")
                for managed in processes.processes:
                    if managed.process.poll() is not None:
                        raise FlowerBaselineError(f"{managed.name} exited (code {managed.process.returncode}); "
                                                  f"see {managed.log_path}")
                time.sleep(STATUS_CHECK_S)
                try:
                    status, details = control.run_status(flower_run_id)
                except ControlError as err:
                    status, details = "unknown", str(err)
        finally:
            control.close()
        if not results.exists():
            raise FlowerBaselineError(f"Flower's run ended {status} ({details}) without its results; "
                                      f"see {run_dir.logs / 'superlink.log'}")
        rows: list[dict[str, Any]] = json.loads(results.read_text())
    finally:
        processes.stop_all()
        kill_processes_with_env(RUN_MARKER_ENV, str(run_dir.path))
        network.close()
    link_seconds_per_round(rows, run_dir, names)
    return rows
