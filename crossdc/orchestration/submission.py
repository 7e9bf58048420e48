"""Runs submitted to a standing federation by crossdc's service (``crossdc serve --superlink``), and stopped there.

Promises:

* :meth:`StandingFederation.check` validates an experiment config's TOML text exactly as ``crossdc run --superlink``
  does (the same parser, the same build of its strategy and workload, the same refusals of what a standing
  federation cannot run), raising one of :data:`CONFIG_ERRORS` with the same one-line message; nothing is recorded;
* :meth:`StandingFederation.submit` starts the run the way ``crossdc run --superlink … --detach`` does: a run row,
  a run folder under ``runs_root``, the Flower app submitted to the SuperLink, the Flower run id recorded at once;
  it returns without following the run (its ServerApp logs it);
* :meth:`StandingFederation.unfinished_status` says whether the SuperLink still runs a run (``crossdc resume`` of a
  run on a standing federation refuses one it still runs);
* :meth:`StandingFederation.stop` stops a running run: Flower's Control API stops the Flower run (the SuperLink
  refuses its ServerApp's next call; the SuperNodes stay for the next run) and the run log records the run as
  ``interrupted``, with who stopped it, before any later verdict of its ServerApp (the first final status wins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossdc.db.queries import get_run_at, parse_flower_run_ids
from crossdc.deployment.superlink_control import SuperLinkControl
from crossdc.experiment.builders import check_config
from crossdc.experiment.config import ConfigError, ExperimentConfig, parse_config_text
from crossdc.orchestration.local_run import LocalRunOptions, LocalRunResult, RunFailed, record_run_end, refuse_unsupported, run_local
from crossdc.strategies.base import StrategyError
from crossdc.workloads.errors import WorkloadError

#: what :meth:`StandingFederation.check` raises for a config the user must fix (one line each)
CONFIG_ERRORS: tuple[type[Exception], ...] = (ConfigError, StrategyError, WorkloadError, RunFailed)
#: the event a stop through the service records
STOP_EVENT = "run-stopped"


class StopRefused(RuntimeError):
    """The run cannot be stopped (not running, not known to Flower yet); the message says why."""


@dataclass(frozen=True)
class StandingFederation:
    """A standing federation's SuperLink as the service submits to it: its private Control API ``superlink``
    (HOST:PORT, TLS verified against `superlink_ca`, plain HTTP without), and where run folders go."""

    superlink: str
    superlink_ca: Path | None
    runs_root: Path

    def check(self, text: str) -> ExperimentConfig:
        """The config in `text`, validated as ``crossdc run --superlink`` validates a config file."""
        config = check_config(parse_config_text(text))
        refuse_unsupported(config, standing=True)
        return config

    def submit(self, config: ExperimentConfig, db_url: str) -> LocalRunResult:
        """Submit `config` (after :meth:`check`) and return at once; its summary has ``run_id`` and ``flower_run_id``.
        RunFailed (the run recorded as failed) if Flower refused it."""
        return run_local(config, LocalRunOptions(db_url=db_url, superlink=self.superlink, superlink_ca=self.superlink_ca,
                                                 detach=True, runs_root=self.runs_root))

    def control(self) -> SuperLinkControl:
        return SuperLinkControl(self.superlink, self.superlink_ca, insecure=self.superlink_ca is None)

    def unfinished_status(self, run: Mapping[str, Any]) -> str | None:
        """Flower's status of the newest Flower run of `run` (a ``runs`` row) while it has not finished (``pending``,
        ``starting``, ``running``), else None (finished, or never submitted). ControlError if the SuperLink does not
        answer."""
        flower_runs = parse_flower_run_ids(run.get("flower_run_ids"))
        if not flower_runs:
            return None
        control = self.control()
        try:
            status, _ = control.run_status(flower_runs[-1])
        finally:
            control.close()
        return None if status.startswith("finished") else status

    def stop(self, db_url: str, run_id: str, by: str) -> int:
        """Stop the running run `run_id` on behalf of `by` (a token's name); returns the Flower run id stopped.
        StopRefused if it is not running or Flower has no run of it yet; ControlError if the SuperLink did not stop
        it (nothing is recorded then)."""
        run = get_run_at(db_url, run_id)
        if run is None:
            raise LookupError(f"run '{run_id}' not found")
        if run["status"] != "running":
            raise StopRefused(f"run '{run_id}' is {run['status']}; only a running run can be stopped")
        flower_runs = parse_flower_run_ids(run.get("flower_run_ids"))
        if not flower_runs:
            raise StopRefused(f"run '{run_id}' was not submitted to a SuperLink (it has no Flower run id)")
        control = self.control()
        try:
            control.stop_run(flower_runs[-1])
        finally:
            control.close()
        record_run_end(db_url, run_id, "interrupted", f"stopped through the API by '{by}'", event=STOP_EVENT,
                       detail={"by": by, "flower_run_id": flower_runs[-1]})
        return flower_runs[-1]
