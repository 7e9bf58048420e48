"""Checkpoints of a run's server side: written atomically, found again, pruned.

A checkpoint is everything the coordinator needs to continue a run exactly: global weights, the
strategy's state (DiLoCo's outer momentum, SCAFFOLD's server variate), the round counter, RNG
states, anything else the caller puts in the state dict. Datacenters keep their own state (client
variates, codec residuals) in their durable state stores.

Storage is a local directory or any fsspec URL (``s3://bucket/run``, ``memory://...``), so
cross-region object storage works the same way. Each checkpoint is two objects:

- ``round-000012.ckpt``: the state, ``torch.save``-d;
- ``round-000012.json``: the commit record, written *after* the data, holding its size and SHA-256.

A checkpoint counts only if its commit record exists and the data matches it, so a checkpoint whose
writer died half-way (no record, or data cut short) is never loaded. Retention keeps the newest
``keep`` committed checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from crossdc.db.queries import utcnow

_NAME = re.compile(r"round-(\d{6,})\.json$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint."""

    round: int
    uri: str
    size: int
    sha256: str
    created_at: str


class CheckpointStore:
    """Checkpoints of one run under `url` (a directory or fsspec URL), keeping the newest `keep` (0 = all)."""

    def __init__(self, url: str, keep: int = 3) -> None:
        if keep < 0:
            raise CheckpointError(f"keep must be ≥ 0, got {keep}")
        self.url = url.rstrip("/")
        self.keep = keep
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, server_round: int, suffix: str) -> str:
        return f"{self.root}/round-{server_round:06d}.{suffix}"

    def _uri(self, path: str) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return path if protocol == "file" else f"{protocol}://{path}"

    def save(self, server_round: int, state: dict[str, Any]) -> CheckpointInfo:
        """Write the checkpoint of `server_round` (data first, then its commit record), then prune old ones."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        data_path = self._path(server_round, "ckpt")
        try:
            with self.fs.open(data_path, "wb") as out:
                out.write(data)
            info = CheckpointInfo(server_round, self._uri(data_path), len(data), hashlib.sha256(data).hexdigest(),
                                  utcnow().isoformat())
            with self.fs.open(self._path(server_round, "json"), "w") as out:
                out.write(json.dumps(info.__dict__))
        except OSError as err:
            raise CheckpointError(f"could not write checkpoint of round {server_round} to {self.url}: {err}") from err
        self.prune()
        return info

    def committed(self) -> list[CheckpointInfo]:
        """Checkpoints with a commit record, oldest first (their data is verified on load)."""
        found = []
        for path in self.fs.glob(f"{self.root}/round-*.json"):
            if not _NAME.search(path):
                continue
            try:
                with self.fs.open(path, "r") as record:
                    found.append(CheckpointInfo(**json.loads(record.read())))
            except (OSError, ValueError, TypeError):
                continue  # an unreadable commit record commits nothing
        return sorted(found, key=lambda info: info.round)

    def _read_verified(self, info: CheckpointInfo) -> bytes | None:
        path = self._path(info.round, "ckpt")
        try:
            with self.fs.open(path, "rb") as data_file:
                data = data_file.read()
        except OSError:
            return None
        if len(data) != info.size or hashlib.sha256(data).hexdigest() != info.sha256:
            return None
        return data

    def load_latest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """The newest checkpoint whose data matches its commit record, or None; damaged ones are skipped."""
        for info in reversed(self.committed()):
            data = self._read_verified(info)
            if data is not None:
                return info, torch.load(io.BytesIO(data), weights_only=False)
        return None

    def prune(self) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints (commit record first); returns the rounds removed."""
        if self.keep == 0:
            return []
        removed = []
        for info in self.committed()[: -self.keep]:
            for suffix in ("json", "ckpt"):
                path = self._path(info.round, suffix)
                if self.fs.exists(path):
                    self.fs.rm(path)
            removed.append(info.round)
        return removed
