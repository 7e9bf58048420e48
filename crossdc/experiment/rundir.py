"""The folder of one local run: where its config, trainers' sockets, state and logs live.

Pure paths (no torch, no flwr), shared by the orchestrator, the ServerApp, the
ClientApp and the trainers so they agree on one layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the run's settings key saying how its WAN is emulated: "delay-line" (namespaces, packet level) or "relay"
SETTINGS_LINK_EMULATOR = "link_emulator"
#: the run's settings key giving, for a gossip run, each datacenter's [host, port] of its gossip rendezvous store
#: (its own address: in a namespace, the datacenter's emulated address)
SETTINGS_GOSSIP_ADDRESSES = "gossip_addresses"
#: the run's settings key giving, for a pipeline run, where its stages' group meets (``master``: [host, port] of the
#: first stage's rendezvous) and each datacenter's network interface toward the others (``interfaces``: name or
#: null for gloo's default)
SETTINGS_PIPELINE_GROUP = "pipeline_group"
#: the run's settings key giving where the coordinator receives the datacenters' heartbeats: [host, port] (UDP)
SETTINGS_HEARTBEAT = "heartbeat"
#: the run's settings key giving the heartbeat's key (hex) where it is not the run's own key (a standing
#: federation's node: the coordinator's hello offers one per attempt)
SETTINGS_HEARTBEAT_KEY = "heartbeat_key"
#: the run's settings keys of a run on a standing federation: its SuperLink's private Control API address
#: (HOST:PORT) and the CA of its certificate (null: plain HTTP); absent for a run this machine hosts itself
SETTINGS_SUPERLINK = "superlink"
SETTINGS_SUPERLINK_CA = "superlink_ca"
#: the run's settings key saying its trainers accept injected faults (chaos tests: crossdc.clients.fault_injection)
SETTINGS_FAULT_INJECTION = "fault_injection"

# sun_path holds 108 bytes including the terminating NUL
_MAX_UNIX_PATH = 100


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def settings_file(self) -> Path:
        """JSON with run id, database URL and the experiment config (read by the ServerApp and trainers)."""
        return self.path / "run.json"

    @property
    def state_root(self) -> Path:
        return self.path / "state"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def flwr_home(self) -> Path:
        return self.path / "flwr-home"

    @property
    def app_dir(self) -> Path:
        return self.path / "flower-app"

    @property
    def authkey_file(self) -> Path:
        return self.path / "trainers" / "authkey"

    def trainer_socket(self, datacenter: str) -> Path:
        """The trainer's Unix socket; under a short folder in /tmp when the run folder's path is too long for one."""
        path = self.path / "trainers" / f"{datacenter}.sock"
        if len(str(path)) < _MAX_UNIX_PATH:
            return path
        return self.short_socket_dir / f"{datacenter}.sock"

    @property
    def short_socket_dir(self) -> Path:
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"crossdc-{digest}"

    def link_ledger(self, datacenter: str) -> Path:
        """The ledger of the link between this datacenter's SuperNode and the SuperLink (see link_relay)."""
        return self.logs / "links" / f"{datacenter}.ledger"

    @property
    def final_weights(self) -> Path:
        return self.path / "final-weights.npz"

    @property
    def best_weights(self) -> Path:
        """The evaluated global model with the lowest validation loss so far (``run.keep_best``)."""
        return self.path / "best-weights.npz"

    def create(self, settings: dict[str, Any]) -> None:
        """Make the folders, write the settings and a fresh trainer auth key (mode 0600)."""
        for folder in (self.path, self.state_root, self.logs, self.path / "trainers"):
            folder.mkdir(parents=True, exist_ok=True)
        self.short_socket_dir.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.settings_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the database URL
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(settings, indent=1, sort_keys=True))
        fd = os.open(self.authkey_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(32))

    def remove_sockets(self) -> None:
        """Remove the trainers' socket files (and the short socket folder) once nothing listens on them."""
        for folder in (self.path / "trainers", self.short_socket_dir):
            for sock in folder.glob("*.sock"):
                sock.unlink(missing_ok=True)
        try:
            self.short_socket_dir.rmdir()
        except OSError:
            pass

    def settings(self) -> dict[str, Any]:
        return json.loads(self.settings_file.read_text())

    def update_settings(self, changes: dict[str, Any]) -> None:
        """Add or replace settings (the file replaced at once, mode 0600, so a reader never sees half of it)."""
        settings = {**self.settings(), **changes}
        fd, temporary = tempfile.mkstemp(dir=self.path, prefix=".run.json.")
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(settings, indent=1, sort_keys=True))
        os.replace(temporary, self.settings_file)

    def authkey(self) -> bytes:
        return self.authkey_file.read_bytes()
