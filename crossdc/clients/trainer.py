"""The persistent local trainer of one datacenter.

Started once per run (by `crossdc run` for a local federation), it keeps the
model, the inner optimizer and the data order in memory and answers the
short-lived ClientApps over a local authenticated socket, so no round pays
process start-up or a torch import. After every round it writes its state
(inner optimizer moments, data position) to the durable state store; a
restarted trainer resumes from it.

Protocol (one request per connection, pickled dicts):
- ``{"op": "ping"}`` → ``{"ok": True, "pid", "datacenter", "run_id"}``
- ``{"op": "train", "run_id", "round", "tau", "weights": {name: ndarray}}`` →
  ``{"ok": True, "delta": {name: ndarray}, "metrics": {...}}`` where delta is
  w_local − w_global after exactly `tau` steps.
- any failure → ``{"ok": False, "error": "one line"}``; the trainer keeps serving.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crossdc.clients.local_training import LocalTrainer
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.platform.config import ExperimentConfig, parse_config
from crossdc.platform.experiment import build_workload, datacenter_seed
from crossdc.platform.rundir import RunDir

log = logging.getLogger("crossdc.trainer")

TRAINER_STATE_KEY = "local-trainer"


class DatacenterTrainer:
    """Handles requests for one datacenter of one run."""

    def __init__(self, config: ExperimentConfig, run_id: str, datacenter: str, state_root: Path) -> None:
        if datacenter not in config.datacenter_names:
            raise ValueError(f"datacenter '{datacenter}' is not in the run's config ({', '.join(config.datacenter_names)})")
        self.run_id, self.datacenter = run_id, datacenter
        workload = build_workload(config)
        w = config.workload
        self.trainer = LocalTrainer(workload, workload.shard(datacenter), w.batch_size, w.optimizer, w.lr, datacenter_seed(config, datacenter))
        self.store = DatacenterStateStore(state_root, run_id, datacenter)
        self.last_round = 0
        stored = self.store.load(TRAINER_STATE_KEY)
        if stored is not None:
            state, self.last_round = stored
            self.trainer.load_state_dict(state)
            log.info("%s: resumed local state of round %d", datacenter, self.last_round)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "datacenter": self.datacenter, "run_id": self.run_id, "last_round": self.last_round}
        if op == "train":
            return self._train(request)
        return {"ok": False, "error": f"unknown trainer op {op!r}"}

    def _train(self, request: dict[str, Any]) -> dict[str, Any]:
        if request.get("run_id") != self.run_id:
            return {"ok": False, "error": f"trainer serves run {self.run_id}, request is for run {request.get('run_id')}"}
        server_round, tau = int(request["round"]), int(request["tau"])
        if server_round <= self.last_round:  # a stale message (e.g. delivered after its round closed)
            return {"ok": False, "error": f"round {server_round} is not newer than round {self.last_round}, already trained here"}
        global_weights = request["weights"]
        self.trainer.set_weights(global_weights)
        result = self.trainer.train_steps(tau)
        local = self.trainer.get_weights()
        delta = {name: local[name] - np.asarray(global_weights[name], dtype=np.float32) for name in local}
        started = time.perf_counter()
        self.store.save(TRAINER_STATE_KEY, self.trainer.state_dict(), server_round)
        self.last_round = server_round
        return {
            "ok": True,
            "delta": delta,
            "metrics": {
                "num-examples": result.num_examples,
                "train-loss": result.mean_loss,
                "compute-s": result.compute_s,
                "state-save-s": time.perf_counter() - started,
                "trainer-pid": os.getpid(),
            },
        }


def serve(run_dir: RunDir, datacenter: str) -> None:
    """Serve requests until SIGTERM/SIGINT."""
    settings = run_dir.settings()
    config = parse_config(settings["config"])
    torch.set_num_threads(max(1, int(os.environ.get("CROSSDC_TRAINER_THREADS", "1"))))
    handler = DatacenterTrainer(config, settings["run_id"], datacenter, run_dir.state_root)
    socket_path = run_dir.trainer_socket(datacenter)
    socket_path.unlink(missing_ok=True)
    listener = Listener(str(socket_path), family="AF_UNIX", authkey=run_dir.authkey())
    os.chmod(socket_path, 0o600)

    def stop(signum: int, frame: Any) -> None:
        listener.close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("trainer of %s listening on %s (pid %d)", datacenter, socket_path, os.getpid())
    while True:
        try:
            connection = listener.accept()
        except OSError:
            return
        except Exception as err:  # a failed authentication must not stop the trainer
            log.warning("rejected a connection: %s", err)
            continue
        with connection:
            try:
                request = connection.recv()
                answer = handler.handle(request)
            except Exception as err:
                log.exception("request failed")
                answer = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0]}
            try:
                connection.send(answer)
            except OSError as err:
                log.warning("could not answer (client gone): %s", err)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="crossdc persistent local trainer of one datacenter")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--datacenter", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(RunDir(Path(args.run_dir)), args.datacenter)


if __name__ == "__main__":
    main()
