"""The coordinator's side of checkpoints and resume, for the synchronous loop (crossdc.federation.sync_loop).

Promises:

* :class:`ServerCheckpointer` saves, after every ``checkpoint.every_rounds`` rounds and after the last round,
  everything the loop needs to continue exactly (:func:`loop_state`): the round, global weights, the strategy's
  state (DiLoCo's outer momentum, SCAFFOLD's server variate), what the loop carries between rounds, and the server's
  RNG states; through :class:`crossdc.federation.checkpoints.CheckpointStore` (atomic, any fsspec URL, retention);
* a resumed run loads the newest committed checkpoint (a half-written one is skipped) and starts at the round after
  it; every datacenter is told the run's attempt number and the round of the oldest retained checkpoint, so it
  keeps the local state a rewind could need and rewinds to it when a new attempt re-runs rounds it already trained
  (crossdc.clients.state_store).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from crossdc.federation.checkpoints import CheckpointInfo, CheckpointStore

#: the run settings' keys (crossdc.experiment.rundir): where checkpoints go, and which attempt at the run this is
SETTINGS_URL = "checkpoint_url"
SETTINGS_ATTEMPT = "attempt"
SETTINGS_RESUME = "resume"
#: keys of the state dict a checkpoint holds
FORMAT_VERSION = 1


class ResumeError(RuntimeError):
    """A run cannot be resumed (no committed checkpoint, a checkpoint of another run or format)."""


def rng_state() -> dict[str, Any]:
    """The server process's random number generators (Python, NumPy, torch)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def loop_state(run_id: str, server_round: int, weights: dict[str, np.ndarray], strategy_state: dict[str, Any],
               carried: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint of the loop after `server_round`: `carried` is what the loop keeps between rounds."""
    return {"format": FORMAT_VERSION, "run_id": run_id, "round": server_round, "weights": weights,
            "strategy": strategy_state, "carried": carried, "rng": rng_state()}


@dataclass
class ServerCheckpointer:
    """Checkpoints of one run: `every` rounds (and the last one) into `store`."""

    store: CheckpointStore
    every: int
    rounds: int
    #: the oldest retained committed checkpoint's round (0: none yet): a resume may fall back as far as it (when the
    #: newer ones are damaged), so the datacenters keep the local state of that round onwards
    oldest_round: int = 0

    @classmethod
    def from_settings(cls, settings: dict[str, Any], every: int, keep: int, rounds: int) -> ServerCheckpointer | None:
        """The run's checkpointer, or None when checkpoints are off (no URL in the settings or every = 0)."""
        url = settings.get(SETTINGS_URL)
        if not url or every <= 0:
            return None
        checkpointer = cls(CheckpointStore(url, keep=keep), every, rounds)
        checkpointer._note_retained()
        return checkpointer

    def _note_retained(self) -> None:
        committed = self.store.committed()
        # keep > 0: datacenters keep state back to the oldest retained checkpoint, so a resume may fall back to any
        # of them; keep = 0 retains every checkpoint, and the datacenters then keep state back to the newest one only
        # (their history would otherwise grow without bound): a resume from an older one fails at the datacenters
        if not committed:
            self.oldest_round = 0
        else:
            self.oldest_round = (committed[0] if self.store.keep > 0 else committed[-1]).round

    def due(self, server_round: int) -> bool:
        """Whether the loop checkpoints after `server_round`."""
        return server_round % self.every == 0 or server_round == self.rounds

    def save(self, state: dict[str, Any]) -> CheckpointInfo:
        info = self.store.save(int(state["round"]), state)
        self._note_retained()
        return info

    def load_latest(self, run_id: str) -> tuple[CheckpointInfo, dict[str, Any]]:
        """The newest committed, intact checkpoint of `run_id`; ResumeError if there is none."""
        loaded = self.store.load_latest()
        if loaded is None:
            raise ResumeError(f"no committed checkpoint in {self.store.url}: nothing to resume from")
        info, state = loaded
        if state.get("format") != FORMAT_VERSION or state.get("run_id") != run_id:
            raise ResumeError(f"checkpoint {info.uri} is not a format-{FORMAT_VERSION} checkpoint of run {run_id}")
        return info, state
