"""The durable per-datacenter state store.

Promises: state is keyed by (crossdc run id, datacenter name, key), lives on the
datacenter's own disk, is written atomically (a crash mid-write leaves the old
value), is tagged with the round it belongs to, and survives the process that
wrote it (a SuperNode or trainer restart, a resume).
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class StateStoreError(RuntimeError):
    """A stored value is unreadable or a key is invalid."""


class DatacenterStateStore:
    """Named values (tensors, dicts of tensors, numbers) of one datacenter in one run."""

    def __init__(self, root: str | Path, run_id: str, datacenter: str) -> None:
        for label, value in (("run id", run_id), ("datacenter", datacenter)):
            if not _SAFE.match(value):
                raise StateStoreError(f"invalid {label} for the state store: {value!r}")
        self.directory = Path(root) / run_id / datacenter
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not _SAFE.match(key):
            raise StateStoreError(f"invalid state key {key!r}")
        return self.directory / f"{key}.pt"

    def save(self, key: str, value: Any, round: int) -> None:
        """Store `value` as the state `key` after round `round`, atomically."""
        target = self._path(key)
        buffer = io.BytesIO()
        torch.save({"round": round, "value": value}, buffer)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(buffer.getvalue())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, key: str) -> tuple[Any, int] | None:
        """(value, round) stored under `key`, or None if nothing was stored."""
        path = self._path(key)
        if not path.exists():
            return None
        try:
            record = torch.load(path, map_location="cpu", weights_only=False)
            return record["value"], int(record["round"])
        except Exception as err:
            raise StateStoreError(f"state '{key}' of {self.directory} is unreadable: {err}") from err

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.pt"))
