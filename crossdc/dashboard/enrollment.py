"""The API's write side: datacenters enroll, operators suspend and revoke them, and read the audit log.

Promises, for every route here:

* a bearer token of the right role is needed (enrollment: ``POST /api/datacenters``; admin: everything else),
  see :mod:`crossdc.dashboard.auth`;
* the SuperLink and SQL never disagree for long: a datacenter is recorded ``active`` with a ``node_id`` only after
  the SuperLink registered its key, and is recorded ``suspended``/``revoked`` only after the SuperLink unregistered
  it (from then on its SuperNode is refused); when the SuperLink fails, nothing is changed and the answer is 502;
* every act, done, refused or failed, is one row of the audit log;
* a suspended datacenter comes back by enrolling again with a new key (Flower never registers an unregistered key
  again); a revoked one never comes back under its name;
* a service started without a SuperLink (``crossdc serve`` without ``--superlink-control``) answers 503 to what
  needs one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Connection, exc, insert, select, update

from crossdc.dashboard import queries
from crossdc.dashboard.api import DatacenterInfo, ErrorBody, _503
from crossdc.dashboard.auth import Admin, Enroller, audit, client_address, refuse
from crossdc.db.models import DATACENTERS
from crossdc.db.security import TokenIdentity, audit_entries, record_audit
from crossdc.deployment.superlink_control import ControlError, PublicKeyError, SuperLinkControl, check_public_key

router = APIRouter(tags=["datacenters"])

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
DatacenterName = Annotated[str, Path(pattern=NAME_PATTERN, description="The datacenter's name.")]

_AUTH = {401: {"model": ErrorBody, "description": "No token, or an unknown or revoked one."},
         403: {"model": ErrorBody, "description": "The token's role may not do this."}}
_404 = {404: {"model": ErrorBody, "description": "No such datacenter."}}
_409 = {409: {"model": ErrorBody, "description": "The datacenter's status does not allow this."}}
_502 = {502: {"model": ErrorBody, "description": "The SuperLink did not do it; nothing was changed."}}


class EnrollmentRequest(BaseModel):
    """What a datacenter says about itself when it enrolls (`crossdc enroll` sends it)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, description="The datacenter's name, as experiment configs use it.")
    region: str | None = Field(None, max_length=128)
    gpus: int = Field(ge=0, le=1_000_000, description="GPUs the datacenter trains with.")
    public_key: str = Field(max_length=8192, description="PEM EC public key (P-256/384/521) of the datacenter's SuperNode.")
    link_bandwidth_mbps: float | None = Field(None, gt=0, le=1e7, allow_inf_nan=False)
    link_rtt_ms: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)

    @field_validator("public_key")
    @classmethod
    def _usable_key(cls, value: str) -> str:
        try:
            return check_public_key(value)
        except PublicKeyError as err:
            raise ValueError(str(err)) from None


class AuditEntry(BaseModel):
    id: int
    at: datetime
    action: str
    outcome: str = Field(description="ok, refused or failed.")
    actor: str | None = Field(description="The name of the token that acted (never the token).")
    target: str | None
    client: str | None
    detail: Any | None


def _control(request: Request) -> SuperLinkControl:
    control: SuperLinkControl | None = getattr(request.app.state, "superlink_control", None)
    if control is None:
        raise HTTPException(status_code=503, detail="this service is not connected to a SuperLink "
                                                    "(start it with `crossdc serve --superlink-control HOST:PORT`)")
    return control


def _row(conn: Connection, name: str) -> dict[str, Any] | None:
    row = conn.execute(select(DATACENTERS).where(DATACENTERS.c.name == name)).mappings().first()
    return dict(row) if row is not None else None


def _info(request: Request, name: str) -> dict[str, Any]:
    with request.app.state.engine.connect() as conn:
        return next(d for d in queries.datacenters(conn, now=queries.utcnow()) if d["name"] == name)


@router.post("/api/datacenters", status_code=201, response_model=DatacenterInfo,
             responses={**_AUTH, **_409, **_502, **_503,
                        400: {"model": ErrorBody, "description": "The body is not JSON."}})
def enroll_datacenter(request: Request, body: EnrollmentRequest, who: Enroller) -> dict[str, Any]:
    """Enroll a datacenter: register its SuperNode's public key with the SuperLink and record it as active."""
    action = "enroll"
    public_key = body.public_key  # checked and normalised by EnrollmentRequest
    control = _control(request)
    with request.app.state.engine.connect() as conn:
        existing = _row(conn, body.name)
    if existing is not None and existing["status"] == "revoked":
        raise refuse(request, action, who, body.name, 409,
                      f"datacenter '{body.name}' was revoked for good: enroll under another name")
    if existing is not None and existing["public_key"] is not None:
        if existing["status"] != "suspended":
            hint = ("it was revoked for good: enroll under another name" if existing["status"] == "revoked"
                    else "an admin must suspend it before it enrolls again")
            raise refuse(request, action, who, body.name, 409,
                          f"datacenter '{body.name}' is already enrolled (status {existing['status']}); {hint}")
        if existing["public_key"] == public_key:
            raise refuse(request, action, who, body.name, 409,
                          f"datacenter '{body.name}' was suspended with this key; enroll again with a new key "
                          "(`crossdc enroll --new-key`)")
    try:
        node_id = control.register(public_key, body.name)
    except ControlError as err:
        raise refuse(request, action, who, body.name, 502, str(err)) from None
    facts = {"region": body.region, "gpus": body.gpus, "public_key": public_key, "status": "active",
             "enrolled_at": queries.utcnow(), "node_id": str(node_id),
             "link_bandwidth_mbps": body.link_bandwidth_mbps, "link_rtt_ms": body.link_rtt_ms}
    try:
        with request.app.state.engine.begin() as conn:
            if existing is None:
                conn.execute(insert(DATACENTERS).values(name=body.name, **facts))
            else:  # a name a run log has seen (no key yet) or a suspended datacenter keeps its row (and last_seen)
                same_key = (DATACENTERS.c.public_key == existing["public_key"] if existing["public_key"] is not None
                            else DATACENTERS.c.public_key.is_(None))
                done = conn.execute(update(DATACENTERS).where(DATACENTERS.c.name == body.name, same_key,
                                                              DATACENTERS.c.status == existing["status"]).values(**facts))
                if done.rowcount != 1:
                    raise exc.IntegrityError("enrolled concurrently", None, ValueError(body.name))
            record_audit(conn, action, "ok", actor=who.name, target=body.name, client=client_address(request),
                         detail={"node_id": str(node_id), "region": body.region, "gpus": body.gpus})
    except exc.SQLAlchemyError as err:  # not recorded (a concurrent change, the database): undo the registration
        try:
            control.unregister(node_id)
            undone = "its registration at the SuperLink was undone"
        except ControlError as control_err:
            undone = f"its registration (node {node_id}) could not be undone: {control_err}"
        if isinstance(err, exc.IntegrityError):
            raise refuse(request, action, who, body.name, 409,
                          f"datacenter '{body.name}' was enrolled or changed concurrently; {undone}") from None
        try:
            audit(request, action, "failed", who, body.name, {"status": 503, "reason": f"database: {undone}"})
        finally:
            raise HTTPException(status_code=503, detail=f"the database did not record the enrollment; {undone}") from None
    return _info(request, body.name)


def _cut_off(request: Request, name: str, who: TokenIdentity, action: str, allowed_from: tuple[str, ...],
             new_status: str) -> dict[str, Any]:
    """Move a datacenter to `new_status` (from one of `allowed_from`), unregistering its key at the SuperLink."""
    with request.app.state.engine.connect() as conn:
        row = _row(conn, name)
    if row is None:
        raise refuse(request, action, who, name, 404, f"datacenter '{name}' not found")
    if row["status"] == new_status:
        return _info(request, name)  # asked twice: already done
    if row["status"] not in allowed_from:
        raise refuse(request, action, who, name, 409, f"datacenter '{name}' is {row['status']}; cannot {action} it")
    control = _control(request)
    node_id: str | None = row["node_id"]
    try:
        if node_id is not None:
            control.unregister(int(node_id))
    except ControlError as err:
        try:  # already unregistered (an earlier attempt whose database write failed): only the status is left to do
            gone = control.nodes().get(int(node_id), "unregistered") == "unregistered"
        except ControlError:
            gone = False
        if not gone:
            raise refuse(request, action, who, name, 502, str(err)) from None
    with request.app.state.engine.begin() as conn:
        conn.execute(update(DATACENTERS).where(DATACENTERS.c.name == name).values(status=new_status, node_id=None))
        record_audit(conn, action, "ok", actor=who.name, target=name, client=client_address(request),
                     detail={"from": row["status"], "to": new_status})
    return _info(request, name)


@router.delete("/api/datacenters/{name}", response_model=DatacenterInfo, responses={**_AUTH, **_404, **_502, **_503})
def revoke_datacenter(request: Request, name: DatacenterName, who: Admin) -> dict[str, Any]:
    """Revoke a datacenter for good: its key is unregistered at the SuperLink; its SuperNode is refused from its
    next request on. The row stays (its runs refer to it)."""
    return _cut_off(request, name, who, "revoke", ("active", "suspended"), "revoked")


@router.post("/api/datacenters/{name}/suspend", response_model=DatacenterInfo,
             responses={**_AUTH, **_404, **_409, **_502, **_503})
def suspend_datacenter(request: Request, name: DatacenterName, who: Admin) -> dict[str, Any]:
    """Suspend a datacenter: its key is unregistered at the SuperLink like a revocation, but the datacenter may
    enroll again, with a new key."""
    return _cut_off(request, name, who, "suspend", ("active",), "suspended")


@router.get("/api/audit", response_model=list[AuditEntry], responses={**_AUTH, **_503}, tags=["security"])
def audit_log(request: Request, who: Admin,
              since_id: Annotated[int | None, Query(ge=0, le=2**63 - 1, description="Only entries after this id.")] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict[str, Any]]:
    """The audit log, oldest first: enrollments, suspensions, revocations, tokens made, refused attempts."""
    with request.app.state.engine.connect() as conn:
        return audit_entries(conn, since_id=since_id, limit=limit)
