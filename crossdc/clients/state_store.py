"""The durable per-datacenter state store.

Promises: state is keyed by (crossdc run id, datacenter name, key), lives on the
datacenter's own disk, is written atomically (a crash mid-write leaves the old
value), is tagged with the round it belongs to, and survives the process that
wrote it (a SuperNode or trainer restart, a resume).

For a coordinator that resumes from a checkpoint of round k after rounds past k were trained, the store keeps a
history: while :attr:`DatacenterStateStore.keep_from` is set (the round of the server's newest checkpoint), every
save also keeps that version, and the versions a rewind to ``keep_from`` or later could need stay;
:meth:`DatacenterStateStore.rewind` then makes the newest version at or before a round the current one again, for
every key, so the datacenter continues exactly as it was after that round.
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
        self.history = self.directory / "history"
        #: keep past versions a rewind to this round (or later) needs; None: keep no history
        self.keep_from: int | None = None

    def _history_path(self, key: str, round: int) -> Path:
        return self.history / f"{key}.r{round:06d}.pt"

    def _versions(self, key: str) -> list[tuple[int, Path]]:
        """The kept past versions of `key`, oldest first."""
        found = []
        for path in self.history.glob(f"{key}.r*.pt"):
            match = re.fullmatch(re.escape(key) + r"\.r(\d{6,})\.pt", path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _prune_history(self, key: str) -> None:
        """Drop versions older than the newest one at or before `keep_from` (no rewind can need them)."""
        if self.keep_from is None:
            return
        versions = self._versions(key)
        anchors = [i for i, (round, _) in enumerate(versions) if round <= self.keep_from]
        for _, path in versions[: anchors[-1] if anchors else 0]:
            path.unlink(missing_ok=True)

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
            if self.keep_from is not None:
                self.history.mkdir(exist_ok=True)
                kept = self._history_path(key, round)
                kept.unlink(missing_ok=True)
                os.link(tmp, kept)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._prune_history(key)

    def rewind(self, to_round: int) -> dict[str, int]:
        """Make, for every key whose current version is newer than `to_round`, the newest kept version at or before
        `to_round` the current one (a key with none is deleted). Returns key → the round it now holds (0: deleted).
        StateStoreError if a needed version was not kept (no history was asked for)."""
        changed: dict[str, int] = {}
        for key in self.keys():
            stored = self.load(key)
            if stored is None or stored[1] <= to_round:
                continue
            versions = self._versions(key)
            if not versions:
                raise StateStoreError(f"state '{key}' of {self.directory} cannot go back to round {to_round}: no past "
                                      "versions were kept (checkpoints were off when it was saved)")
            earlier = [(round, path) for round, path in versions if round <= to_round]
            if earlier:
                round, path = earlier[-1]
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
                os.close(fd)
                Path(tmp).unlink()
                os.link(path, tmp)
                os.replace(tmp, self._path(key))
                changed[key] = round
            else:  # every kept version is newer: the key did not exist yet after `to_round`
                self.delete(key)
                changed[key] = 0
            for later_round, path in self._versions(key):
                if later_round > to_round:
                    path.unlink(missing_ok=True)
        return changed

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
