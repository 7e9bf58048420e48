"""The API's run control: submit an experiment to the standing federation, and stop a run.

Promises, for every route here:

* an ``admin`` token is needed (:mod:`crossdc.dashboard.auth`): none, or an unknown one, answers 401; another role 403;
* ``POST /api/runs`` validates the config exactly as ``crossdc run --superlink`` does: a config the user must fix
  answers 422 with the same one-line message (naming the key or parameter) and records nothing but the audit row;
  so does one whose ``checkpoint.dir`` leaves the service's checkpoint roots (``crossdc serve --checkpoint-root``), or
  that names a datacenter not enrolled and active here (the line names each, with its state);
  a valid one is submitted to the SuperLink the service was started with (``crossdc serve --superlink``) and
  answers 201 with the run's id once Flower has accepted it; a SuperLink that refuses or does not answer gives 502
  (the run, if it was recorded, is recorded as failed);
* ``POST /api/runs/{id}/stop`` stops a running run at the SuperLink, then records it ``interrupted`` with the token's
  name; a run that is not running answers 409, an unknown one 404, a SuperLink that did not stop it 502 (nothing is
  recorded then);
* a service started without ``--superlink`` answers 503 to both;
* every act, done, refused or failed, is one row of the audit log (the config's name and strategy, never a token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, HTTPException, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from crossdc.dashboard.api import ErrorBody, _503
from crossdc.dashboard.auth import Admin, audit, refuse
from crossdc.db.security import TokenIdentity

if TYPE_CHECKING:
    from crossdc.orchestration.submission import StandingFederation

router = APIRouter(tags=["runs"])

#: the largest config text accepted (a config is a few kB)
MAX_CONFIG_CHARS = 1_000_000
RunId = Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="The run's id.")

_AUTH = {401: {"model": ErrorBody, "description": "No token, or an unknown or revoked one."},
         403: {"model": ErrorBody, "description": "The token's role may not do this."}}
_502 = {502: {"model": ErrorBody, "description": "The SuperLink did not do it."}}


class RunSubmission(BaseModel):
    """An experiment to run on the standing federation."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field(max_length=MAX_CONFIG_CHARS, description="The experiment config's TOML text (as `crossdc run` reads).")


class ConfigRefused(BaseModel):
    """What a 422 of ``POST /api/runs`` answers."""

    detail: str | list[dict[str, Any]]


class SubmittedRun(BaseModel):
    run_id: str = Field(description="The run's id in the run log (follow it at /api/runs/{run_id}).")
    flower_run_id: str = Field(description="The Flower run id the SuperLink gave it.")
    name: str
    strategy: str
    rounds: int


class StoppedRun(BaseModel):
    run_id: str
    status: str = Field(description="The run's status in the run log now (interrupted once stopped).")
    flower_run_id: str = Field(description="The Flower run that was stopped.")


def _federation(request: Request, action: str, who: TokenIdentity, target: str | None) -> StandingFederation:
    federation: StandingFederation | None = getattr(request.app.state, "standing_federation", None)
    if federation is None:
        raise refuse(request, action, who, target, 503, "this service submits no runs (start it with "
                                                         "`crossdc serve --superlink HOST:PORT`)")
    return federation


def _db_url(request: Request) -> str:
    return request.app.state.engine.url.render_as_string(hide_password=False)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


@router.post("/api/runs", status_code=201, response_model=SubmittedRun,
             responses={**_AUTH, **_502, **_503, 400: {"model": ErrorBody, "description": "The body is not JSON."},
                        422: {"model": ConfigRefused, "description": "The config is not one crossdc can run (the detail says "
                                                                      "why, in one line), or the body is not {\"config\": text} "
                                                                      "(the detail lists what is wrong)."}})
def submit_run(request: Request, body: RunSubmission, who: Admin) -> dict[str, Any]:
    """Submit an experiment config to the standing federation; the run goes on after the answer."""
    from crossdc.deployment.superlink_control import ControlError
    from crossdc.orchestration.submission import CONFIG_ERRORS, datacenter_states

    action = "submit-run"
    federation = _federation(request, action, who, None)
    with request.app.state.engine.connect() as conn:
        datacenters = datacenter_states(conn)
    try:
        config = federation.check(body.config, datacenters)
    except CONFIG_ERRORS as err:
        raise refuse(request, action, who, None, 422, _one_line(err)) from None
    try:
        result = federation.submit(config, _db_url(request))
    except (*CONFIG_ERRORS, ControlError, OSError) as err:
        raise refuse(request, action, who, None, 502, _one_line(err)) from None
    submitted = {"run_id": result.run_id, "flower_run_id": str(result.summary["flower_run_id"]),
                 "name": config.run.name, "strategy": config.strategy.name, "rounds": config.run.rounds}
    audit(request, action, "ok", who, result.run_id, {k: submitted[k] for k in ("flower_run_id", "name", "strategy")})
    return submitted


@router.post("/api/runs/{run_id}/stop", response_model=StoppedRun,
             responses={**_AUTH, **_502, **_503, 404: {"model": ErrorBody, "description": "No such run."},
                        409: {"model": ErrorBody, "description": "The run is not running."}})
def stop_run(request: Request, who: Admin, run_id: str = RunId) -> dict[str, Any]:
    """Stop a running run: its Flower run is stopped at the SuperLink and the run log records it interrupted."""
    from crossdc.db.queries import get_run
    from crossdc.deployment.superlink_control import ControlError
    from crossdc.orchestration.submission import StopRefused

    action = "stop-run"
    federation = _federation(request, action, who, run_id)
    try:
        flower_run_id = federation.stop(_db_url(request), run_id, who.name)
    except LookupError as err:
        raise refuse(request, action, who, run_id, 404, _one_line(err)) from None
    except StopRefused as err:
        raise refuse(request, action, who, run_id, 409, _one_line(err)) from None
    except ControlError as err:
        raise refuse(request, action, who, run_id, 502, _one_line(err)) from None
    audit(request, action, "ok", who, run_id, {"flower_run_id": flower_run_id})
    run = get_run(request.app.state.engine, run_id)
    if run is None:  # (deleted meanwhile)
        raise HTTPException(status_code=404, detail=f"run '{run_id}' not found")
    return {"run_id": run_id, "status": run["status"], "flower_run_id": str(flower_run_id)}
