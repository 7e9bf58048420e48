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
  needs one;
* while a service with a SuperLink serves, it reconciles at start and every :data:`RECONCILE_INTERVAL_S`
  (:func:`reconcile`): an active datacenter whose node the SuperLink does not know at all (a SuperLink whose state was
  lost: started again without its ``--database``, or with a new one) has its key registered again, its new
  ``node_id`` recorded and a ``reconcile`` row audited; its SuperNode, refused under its old node id, comes back
  under the new one when it starts again. A node the SuperLink knows, whatever its status, is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import Connection, Engine, exc, insert, select, update

from crossdc.dashboard import queries
from crossdc.dashboard.api import DatacenterInfo, ErrorBody, _503
from crossdc.dashboard.auth import Admin, Enroller, audit, client_address, refuse
from crossdc.db.models import DATACENTERS
from crossdc.db.security import TokenIdentity, audit_entries, record_audit
from crossdc.deployment.superlink_control import ControlError, PublicKeyError, SuperLinkControl, check_public_key

log = logging.getLogger("crossdc.enrollment")

#: how often a serving API service checks that the SuperLink knows every active datacenter's node (see reconcile)
RECONCILE_INTERVAL_S = 10.0
#: the audit log's action for a key registered again by reconciliation
RECONCILE_ACTION = "reconcile"


def reconcile(engine: Engine, control: SuperLinkControl) -> list[dict[str, Any]]:
    """Register again at the SuperLink the key of every active datacenter whose node it does not know at all (its state
    was lost), record the node id Flower gave it and audit it (``reconcile``, with the old and new node ids); returns
    what was re-registered (name, old and new node id). A row changed meanwhile (suspended, revoked, enrolled again)
    keeps its change and the new registration is undone. A key the SuperLink refuses is logged and tried again next
    time. ControlError if the SuperLink does not answer the list of its nodes."""
    with engine.connect() as conn:  # the rows first: a datacenter enrolled after this is not in them
        rows = conn.execute(select(DATACENTERS.c.name, DATACENTERS.c.public_key, DATACENTERS.c.node_id).where(
            DATACENTERS.c.status == "active", DATACENTERS.c.public_key.is_not(None))).all()
    if not rows:
        return []
    known = control.nodes()  # every node it has, unregistered ones included: those were cut off on purpose
    done = []
    for name, public_key, old_node_id in rows:
        if old_node_id is not None and old_node_id.isdigit() and int(old_node_id) in known:
            continue
        try:
            node_id = control.register(public_key, name)
        except ControlError as err:
            log.warning("reconcile: the SuperLink does not know datacenter %s's node %s and refused its key: %s",
                        name, old_node_id, err)
            continue
        same_node = (DATACENTERS.c.node_id == old_node_id if old_node_id is not None else DATACENTERS.c.node_id.is_(None))
        with engine.begin() as conn:
            changed = conn.execute(update(DATACENTERS).where(
                DATACENTERS.c.name == name, DATACENTERS.c.status == "active", DATACENTERS.c.public_key == public_key,
                same_node).values(node_id=str(node_id))).rowcount
            if changed == 1:
                record_audit(conn, RECONCILE_ACTION, "ok", actor=None, target=name, detail={
                    "node_id": str(node_id), "old_node_id": old_node_id,
                    "reason": "the SuperLink did not know the node: its key was registered again"})
        if changed != 1:
            with contextlib.suppress(ControlError):
                control.unregister(node_id)
            continue
        log.warning("reconcile: datacenter %s was unknown to the SuperLink; its key is registered again as node %s "
                    "(was %s)", name, node_id, old_node_id)
        done.append({"name": name, "old_node_id": old_node_id, "node_id": str(node_id)})
    return done


class Reconciler:
    """Runs :func:`reconcile` at once and then every `interval_s` from a daemon thread until stopped; a SuperLink
    or database that does not answer is logged and tried again at the next turn."""

    def __init__(self, engine: Engine, control: SuperLinkControl, interval_s: float = RECONCILE_INTERVAL_S) -> None:
        self.engine, self.control, self.interval_s = engine, control, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crossdc-reconcile", daemon=True)

    def start(self) -> Reconciler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reconcile(self.engine, self.control)
            except (ControlError, exc.SQLAlchemyError) as err:
                log.info("reconcile: not this time: %s", str(err).splitlines()[0] if str(err) else type(err).__name__)
            except Exception:  # never let one bad turn end reconciliation
                log.exception("reconcile failed")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@contextlib.asynccontextmanager
async def _reconcile_while_serving(app: FastAPI) -> AsyncIterator[None]:
    """The router's lifespan: a :class:`Reconciler` runs while a service with a SuperLink serves (every
    ``app.state.reconcile_interval_s`` if set, else :data:`RECONCILE_INTERVAL_S`)."""
    control: SuperLinkControl | None = getattr(app.state, "superlink_control", None)
    interval_s = float(getattr(app.state, "reconcile_interval_s", RECONCILE_INTERVAL_S))
    reconciler = Reconciler(app.state.engine, control, interval_s).start() if control is not None else None
    try:
        yield
    finally:
        if reconciler is not None:
            reconciler.stop()


router = APIRouter(tags=["datacenters"], lifespan=_reconcile_while_serving)

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
    count: int = Field(description="How many acts the row stands for: 1, or the refusals of callers without a live "
                                   "token from one client, for one route and reason, in one window.")
    last_at: datetime | None = Field(description="The last of an aggregated row's refusals (null on other rows).")


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
