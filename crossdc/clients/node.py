"""A datacenter's node service: the long-lived process that `crossdc node start` runs beside the SuperNode.

In production the SuperNode outlives runs, and the coordinator's disk is not the datacenter's. The
node service promises:

- it listens on a Unix socket (``<state-dir>/node.sock``, or a short path in /tmp when that is too long)
  guarded by the node's auth key (``<state-dir>/authkey``, mode 0600); only the datacenter's own
  ClientApps can reach it;
- ``{"op": "prepare", "run_id", "config"}`` (the config is optional once the run is known here: the hello of a
  run carries it, train messages do not) makes sure the run has a persistent local trainer (the
  datacenter's DDP worker group, :mod:`crossdc.clients.trainer`) and answers with its socket: the first
  request of a run starts it under ``<state-dir>/runs/<run id>/`` (settings, durable state store, logs),
  later ones find it running, and a trainer that died is started again from its state store;
- the run's config is the coordinator's, sent in every train message, and must name this datacenter;
  a different config for a run already prepared is refused (a run id means one experiment);
- a hello that offers the coordinator's heartbeat (``"heartbeat": [port, key hex]`` in the prepare request) is
  recorded in the run's settings, so the run's trainer beats to that port on the SuperLink's host (the node's
  ``--coordinator-host``) with that key; a later attempt's offer replaces an earlier one, and a running trainer
  beats to the new one from its next beat on;
- at most `max_runs` trainers stay alive; the least recently used one is stopped beyond that;
- stopping the service stops its trainers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from cachetools import LRUCache

from crossdc import protocol as proto
from crossdc.clients.channel import TrainerUnavailable, call_trainer, serve_requests
from crossdc.experiment.config import ConfigError, parse_config
from crossdc.experiment.processes import ProcessGroup, die_with_parent
from crossdc.experiment.rundir import SETTINGS_HEARTBEAT, SETTINGS_HEARTBEAT_KEY, RunDir

log = logging.getLogger("crossdc.node")

TRAINER_START_TIMEOUT_S = 300.0
_RUN_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


class NodeError(RuntimeError):
    """A request the node service cannot serve (bad run id, config for another datacenter, ...)."""


def node_socket(state_dir: Path) -> Path:
    """The node service's socket path for `state_dir` (short enough for AF_UNIX)."""
    return RunDir(state_dir).trainer_socket("node")


def node_authkey(state_dir: Path) -> bytes:
    """The node's auth key, created (mode 0600) on first use."""
    path = state_dir / "authkey"
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(32))
    return path.read_bytes()


class _Trainers(LRUCache):
    """The runs whose trainers are kept alive, least recently used first: at most ``maxsize`` of them; making room
    for another evicts the least recently used run, and evicting a run stops its trainer."""

    def __init__(self, maxsize: int, processes: ProcessGroup) -> None:
        super().__init__(maxsize=maxsize)
        self.processes = processes

    def popitem(self) -> tuple[str, float]:
        run_id, used = super().popitem()
        log.info("stopping the trainer of run %s (least recently used)", run_id)
        self.processes.kill(f"trainer-{run_id}")  # its state is in the store as of its last round
        return run_id, used


@dataclass
class NodeService:
    """The service state: one trainer per prepared run (see the module docstring)."""

    state_dir: Path
    datacenter: str
    max_runs: int = 2
    #: the host the coordinator's heartbeat is reached at (the SuperLink's, as this node reaches it); None: no heartbeat
    coordinator_host: str | None = None
    processes: ProcessGroup = field(default_factory=ProcessGroup)
    #: run id → when it was last used (``time.monotonic()``), least recently used first
    last_used: _Trainers = field(init=False)

    def __post_init__(self) -> None:
        self.last_used = _Trainers(self.max_runs, self.processes)

    def run_dir(self, run_id: str) -> RunDir:
        if not run_id or set(run_id) - _RUN_ID_CHARS or run_id.startswith("."):
            raise NodeError(f"bad run id {run_id!r}")
        return RunDir(self.state_dir / "runs" / run_id)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        try:
            if op == proto.PING_OP:
                return {"ok": True, "pid": os.getpid(), "datacenter": self.datacenter, "runs": sorted(self.last_used)}
            if op == proto.PREPARE_OP:
                return self.prepare(str(request.get("run_id", "")), str(request.get("config", "")), request.get("heartbeat"))
        except NodeError as err:  # the request's fault: answered, not logged as a failure of the service
            return {"ok": False, "error": str(err)}
        return {"ok": False, "error": f"unknown node op {op!r}"}

    def prepare(self, run_id: str, config_json: str, heartbeat: Any = None) -> dict[str, Any]:
        run_dir = self.run_dir(run_id)
        offer = heartbeat_offer(heartbeat) if heartbeat is not None else None
        if not config_json:
            if not run_dir.settings_file.exists():
                raise NodeError(f"run {run_id} was never announced to this node (its hello carries the config)")
            config_json = json.dumps(run_dir.settings()["config"])
        try:
            doc = json.loads(config_json)
            config = parse_config(doc)
        except (ValueError, ConfigError) as err:
            raise NodeError(f"run {run_id}: the coordinator's config is not valid here: {err}") from None
        if self.datacenter not in config.datacenter_names:
            raise NodeError(f"run {run_id} has no datacenter '{self.datacenter}' ({', '.join(config.datacenter_names)})")
        if run_dir.settings_file.exists():
            if run_dir.settings()["config"] != doc:
                raise NodeError(f"run {run_id} was prepared here with a different config")
        else:
            run_dir.create({"run_id": run_id, "config": doc, "db_url": None})
            run_dir.authkey_file.write_bytes(node_authkey(self.state_dir))
        if offer is not None and self.coordinator_host is not None:
            settings = run_dir.settings()
            target = {SETTINGS_HEARTBEAT: [self.coordinator_host, offer[0]], SETTINGS_HEARTBEAT_KEY: offer[1]}
            if any(settings.get(key) != value for key, value in target.items()):
                run_dir.update_settings(target)
        name = f"trainer-{run_id}"
        managed = self.processes.find(name)
        if managed is not None and managed.process.poll() is not None:
            log.warning("the trainer of run %s had exited (code %s); starting it again from its state store",
                        run_id, managed.process.returncode)
            self.processes.kill(name)
            managed = None
        if managed is None:
            starting = run_id not in self.last_used
            self.last_used[run_id] = time.monotonic()  # before the start: evicts (stops) the least recently used
            try:
                managed = self.processes.start(
                    name, [sys.executable, "-m", "crossdc.clients.trainer", "--run-dir", str(run_dir.path),
                           "--datacenter", self.datacenter],
                    run_dir.logs / f"trainer-{self.datacenter}.log")
                answer = self._await(run_dir, managed)
            except Exception:
                if starting:  # a run that never came up holds no place
                    self.last_used.pop(run_id, None)
                raise
        else:
            answer = self._await(run_dir, managed)
        self.last_used[run_id] = time.monotonic()
        return {"ok": True, "socket": str(run_dir.trainer_socket(self.datacenter)), "worker_pids": answer["worker_pids"]}

    def _await(self, run_dir: RunDir, managed: Any) -> dict[str, Any]:
        deadline = time.monotonic() + TRAINER_START_TIMEOUT_S
        while True:
            if managed.process.poll() is not None:
                raise NodeError(f"the trainer exited at start-up (code {managed.process.returncode}); see {managed.log_path}")
            try:
                return call_trainer(run_dir.trainer_socket(self.datacenter), run_dir.authkey(), {"op": proto.PING_OP},
                                    connect_timeout_s=1.0)
            except TrainerUnavailable:
                if time.monotonic() > deadline:
                    raise NodeError(f"the trainer did not start within {TRAINER_START_TIMEOUT_S:.0f}s") from None

    def close(self) -> None:
        self.processes.stop_all()


def heartbeat_offer(offer: Any) -> tuple[int, str]:
    """(port, key hex) of a prepare request's heartbeat offer; NodeError for anything else."""
    try:
        port, key = offer
        port, key = int(port), str(key)
        bytes.fromhex(key)
    except (TypeError, ValueError):
        raise NodeError(f"bad heartbeat offer {str(offer)[:80]!r}: expected [port, key in hex]") from None
    if not 0 < port < 65536 or not 16 <= len(key) // 2 <= 64:
        raise NodeError(f"bad heartbeat offer: port {port} or a key of {len(key) // 2} bytes")
    return port, key


def serve(state_dir: Path, datacenter: str, max_runs: int = 2, coordinator_host: str | None = None) -> None:
    """Serve requests until SIGTERM/SIGINT; trainers stop with the service."""
    service = NodeService(state_dir, datacenter, max_runs, coordinator_host)
    socket_path = node_socket(state_dir)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    socket_path.unlink(missing_ok=True)
    listener = Listener(str(socket_path), family="AF_UNIX", authkey=node_authkey(state_dir))

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    log.info("node service of %s listening on %s", datacenter, socket_path)
    try:
        serve_requests(listener, service.handle, log)
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()
        socket_path.unlink(missing_ok=True)
        service.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="crossdc node service (started by `crossdc node start`)")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--datacenter", required=True)
    parser.add_argument("--max-runs", type=int, default=2)
    parser.add_argument("--coordinator-host", default=None,
                        help="where the coordinator's heartbeat is reached (the SuperLink's host); none: no heartbeat")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    die_with_parent()
    serve(args.state_dir.resolve(), args.datacenter, args.max_runs, args.coordinator_host)


if __name__ == "__main__":
    main()
