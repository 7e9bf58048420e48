"""The folder of one local run: where its config, trainers' sockets, state and logs live.

Pure paths (no torch, no flwr), shared by the orchestrator, the ServerApp, the
ClientApp and the trainers so they agree on one layout.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
        return self.path / "trainers" / f"{datacenter}.sock"

    @property
    def final_weights(self) -> Path:
        return self.path / "final-weights.npz"

    def create(self, settings: dict[str, Any]) -> None:
        """Make the folders, write the settings and a fresh trainer auth key (mode 0600)."""
        for folder in (self.path, self.state_root, self.logs, self.path / "trainers"):
            folder.mkdir(parents=True, exist_ok=True)
        self.settings_file.write_text(json.dumps(settings, indent=1, sort_keys=True))
        fd = os.open(self.authkey_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(32))

    def settings(self) -> dict[str, Any]:
        return json.loads(self.settings_file.read_text())

    def authkey(self) -> bytes:
        return self.authkey_file.read_bytes()
