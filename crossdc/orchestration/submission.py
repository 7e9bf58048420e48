"""Runs submitted to a standing federation by crossdc's service (``crossdc serve --superlink``), and stopped there.

Promises:

* :meth:`StandingFederation.check` validates an experiment config's TOML text exactly as ``crossdc run --superlink``
  does (the same parser, the same build of its strategy and workload, the same refusals of what a standing
  federation cannot run, then :meth:`StandingFederation.admit`), raising one of :data:`CONFIG_ERRORS` with the same
  one-line message; nothing is recorded;
* :meth:`StandingFederation.admit` is what a standing federation adds to a valid config: its ``checkpoint.dir``
  confined to the service's checkpoint roots (:func:`confine_checkpoint_dir`: a relative path is taken under the
  first root, and the config carries the absolute folder or URL from then on), and every configured datacenter
  enrolled and active (:func:`refuse_unenrolled`), else :class:`SubmissionRefused` naming the path or every such
  datacenter; ``checkpoint.dir`` is the only path a config carries;
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

import copy
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy import Connection

from crossdc.db.queries import enrolled_identities, enrolled_identities_at, get_run_at, parse_flower_run_ids
from crossdc.deployment.superlink_control import SuperLinkControl
from crossdc.experiment.builders import check_config
from crossdc.experiment.config import ConfigError, ExperimentConfig, parse_config_text
from crossdc.orchestration.local_run import LocalRunOptions, LocalRunResult, RunFailed, record_run_end, refuse_unsupported, run_local
from crossdc.strategies.base import StrategyError
from crossdc.workloads.errors import WorkloadError


class SubmissionRefused(ValueError):
    """A valid config this standing federation will not run as it is: a checkpoint path outside the service's roots,
    or a datacenter that is not enrolled and active. The message is one line naming the path or the datacenters."""


#: what :meth:`StandingFederation.check` raises for a config the user must fix (one line each)
CONFIG_ERRORS: tuple[type[Exception], ...] = (ConfigError, StrategyError, WorkloadError, RunFailed, SubmissionRefused)
#: the event a stop through the service records
STOP_EVENT = "run-stopped"


class StopRefused(RuntimeError):
    """The run cannot be stopped (not running, not known to Flower yet); the message says why."""


#: the state of a datacenter the run log knows but nobody enrolled (a name a run saw), and of one it does not know
NOT_ENROLLED, UNKNOWN = "not enrolled", "unknown"
#: the state a datacenter must be in for a run to name it
ACTIVE = "active"

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
#: URL schemes that name this machine's files (fsspec's local file system)
_LOCAL_SCHEMES = frozenset({"file", "local"})


def resolve_checkpoint_roots(given: Sequence[str], default: Path) -> tuple[str, ...]:
    """The checkpoint roots of a service from its ``--checkpoint-root`` options, in order: a local folder as an
    absolute path with symlinks resolved, an fsspec URL (``s3://bucket/prefix``) as it is, without a trailing ``/``;
    ``default`` (resolved) when none is given. ValueError, one line, for a root that is empty, a ``file://`` URL
    that is not absolute, or a URL without a bucket or with ``?``, ``#``, ``::`` or an empty, ``.`` or ``..``
    segment."""
    roots = []
    for root in given or [str(default)]:
        if not root.strip() or "\x00" in root:
            raise ValueError(f"--checkpoint-root {root!r}: give a folder or a URL like s3://bucket/prefix")
        match = _URL.match(root)
        if match is None or match.group(1).lower() in _LOCAL_SCHEMES:
            local = match.group(2) if match is not None else root
            if match is not None and not local.startswith("/"):
                raise ValueError(f"--checkpoint-root {root!r}: give a folder, or file:///absolute/path")
            roots.append(str(Path(local).expanduser().resolve()))
            continue
        segments = _url_segments(match.group(2).rstrip("/"))
        if segments is None or not segments:
            raise ValueError(f"--checkpoint-root {root!r}: a URL root needs a bucket and no '?', '#', '::', '..', "
                             "'.' or empty segment, like s3://bucket/prefix")
        roots.append(f"{match.group(1).lower()}://{'/'.join(segments)}")
    return tuple(roots)


def _url_segments(path: str) -> list[str] | None:
    """The '/'-separated segments of a URL's path part (its bucket first), or None when one is empty, ``.`` or
    ``..``, or the text holds ``?``, ``#``, ``::``, a backslash or NUL (what could name another place than it seems)."""
    if any(bad in path for bad in ("?", "#", "::", "\\", "\x00")):
        return None
    segments = path.split("/") if path else []
    if any(segment in ("", ".", "..") for segment in segments):
        return None
    return segments


def confine_checkpoint_dir(directory: str, roots: Sequence[str]) -> str:
    """The absolute folder or URL a submitted config's ``checkpoint.dir`` names, inside one of `roots` (from
    :func:`resolve_checkpoint_roots`; the first takes a relative path). SubmissionRefused, one line naming the key, its value
    and the roots, for a path with a ``..``, one that leaves every local root (symlinks followed), or a URL whose
    scheme, bucket and prefix no root has (a ``file://`` URL is a local path)."""
    shown = ", ".join(roots)

    def refused(why: str) -> SubmissionRefused:
        return SubmissionRefused(f"'checkpoint.dir' = {directory!r} {why}; this service's checkpoint roots: {shown} "
                                 "(a relative path goes under the first)")

    if "\x00" in directory:
        raise refused("is not a path")
    match = _URL.match(directory)
    if match is None and "://" in directory:
        raise refused("is neither a path nor a URL")
    if match is not None and match.group(1).lower() not in _LOCAL_SCHEMES:
        segments = _url_segments(match.group(2).rstrip("/"))
        if segments is None:
            raise refused("has a '..', '.', empty segment, '?', '#' or '::'")
        for root in roots:
            root_match = _URL.match(root)
            if root_match is None or root_match.group(1) != match.group(1).lower():
                continue
            root_segments = root_match.group(2).split("/")
            if segments[:len(root_segments)] == root_segments:
                return f"{root_match.group(1)}://{'/'.join(segments)}"
        raise refused("is outside every checkpoint root of this service")
    local = match.group(2) if match is not None else directory
    if match is not None and not local.startswith("/"):
        raise refused("is not a file:///absolute/path")
    if ".." in PurePosixPath(local).parts:
        raise refused("may not contain '..'")
    if not PurePosixPath(local).is_absolute():
        first = _URL.match(roots[0]) if roots else None
        if first is not None:  # the first root is a URL: the relative path goes under it
            segments = _url_segments(local.rstrip("/"))
            if segments is None:
                raise refused("has a '.', empty segment, '?', '#' or '::'")
            return "/".join([roots[0], *segments])
        if not roots:
            raise refused("has no root to be relative to")
        local = str(Path(roots[0]) / local)
    resolved = Path(local).resolve()
    for root in roots:
        if _URL.match(root) is None and resolved.is_relative_to(Path(root).resolve()):
            return str(resolved)
    raise refused("is outside every checkpoint root of this service")


def with_checkpoint_dir(config: ExperimentConfig, directory: str) -> ExperimentConfig:
    """`config` with ``checkpoint.dir`` = `directory`, in its typed section and, when it has a [checkpoint] table, in
    the TOML it keeps for the run log (`raw`)."""
    raw = copy.deepcopy(config.raw)
    if isinstance(raw.get("checkpoint"), dict):
        raw["checkpoint"]["dir"] = directory
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, dir=directory), raw=raw)


def enrollment_state(row: Mapping[str, Any]) -> str:
    """A ``datacenters`` row's state for a run: ``active`` (enrolled: its key registered at the SuperLink, and not
    cut off), ``suspended`` or ``revoked``, or :data:`NOT_ENROLLED` for an active name without a registered key (one
    a run log saw)."""
    status = str(row["status"])
    return NOT_ENROLLED if status == ACTIVE and row.get("node_id") is None else status


def datacenter_states(conn: Connection) -> dict[str, str]:
    """Every datacenter of the run log by name, with its :func:`enrollment_state`."""
    return {str(row["name"]): enrollment_state(row) for row in enrolled_identities(conn)}


def datacenter_states_at(db_url: str) -> dict[str, str]:
    """:func:`datacenter_states` of the database at `db_url` (its schema up to date)."""
    return {str(row["name"]): enrollment_state(row) for row in enrolled_identities_at(db_url)}


def refuse_unenrolled(names: Sequence[str], states: Mapping[str, str]) -> None:
    """SubmissionRefused, one line naming each of `names` (a config's datacenters) whose state in `states` (from
    :func:`datacenter_states`) is not ``active``, with its state (:data:`UNKNOWN` when the run log has no such name)."""
    missing = [f"{name} ({states.get(name, UNKNOWN)})" for name in names if states.get(name) != ACTIVE]
    if missing:
        raise SubmissionRefused(f"datacenters not enrolled and active at this federation: {', '.join(missing)}; "
                                "enroll them (`crossdc enroll`) or leave them out of [[datacenters]]")


@dataclass(frozen=True)
class StandingFederation:
    """A standing federation's SuperLink as the service submits to it: its private Control API ``superlink``
    (HOST:PORT, TLS verified against `superlink_ca`, plain HTTP without), where run folders go, and where submitted
    runs may keep checkpoints (`checkpoint_roots`, from :func:`resolve_checkpoint_roots`; none: under `runs_root`)."""

    superlink: str
    superlink_ca: Path | None
    runs_root: Path
    checkpoint_roots: tuple[str, ...] = ()

    @property
    def roots(self) -> tuple[str, ...]:
        """The checkpoint roots in force: the given ones, else `runs_root` (resolved)."""
        return self.checkpoint_roots or resolve_checkpoint_roots([], self.runs_root)

    def check(self, text: str, datacenters: Mapping[str, str]) -> ExperimentConfig:
        """The config in `text`, validated as ``crossdc run --superlink`` validates a config file, then admitted
        (:meth:`admit`) against `datacenters` (:func:`datacenter_states`). What a standing federation cannot run at
        all is refused before the strategy and the workload are built."""
        config = parse_config_text(text)
        refuse_unsupported(config, standing=True)
        return self.admit(check_config(config), datacenters)

    def admit(self, config: ExperimentConfig, datacenters: Mapping[str, str]) -> ExperimentConfig:
        """`config` (checked) as this federation runs it: its ``checkpoint.dir`` confined to :attr:`roots` and made
        absolute; SubmissionRefused for a path outside them or a datacenter not enrolled and active (RunFailed for
        what a standing federation cannot run)."""
        refuse_unsupported(config, standing=True)
        config = with_checkpoint_dir(config, confine_checkpoint_dir(config.checkpoint.dir, self.roots))
        refuse_unenrolled(config.datacenter_names, datacenters)
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
