"""The API's write side over real HTTP, against a real authenticating SuperLink: tokens and roles, enrollment,
suspension, re-activation and revocation, the audit log, locked reads, and tokens that never leak."""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import CROSSDC, authenticating_superlink
from sqlalchemy import select

from crossdc.clients.enroll import EnrollmentError, enroll, node_key
from crossdc.dashboard.app import create_app
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.models import API_TOKENS
from crossdc.db.runlog import RunLog
from crossdc.db.security import TokenError, audit_entries, create_token, generate_token, hash_token, revoke_token, role_allows
from crossdc.deployment.background_server import BackgroundServer, start_background, uvicorn_config
from crossdc.deployment.superlink_control import PublicKeyError, SuperLinkControl, check_public_key
from crossdc.experiment.processes import free_port
from crossdc.orchestration.submission import StandingFederation

#: a generous timeout: the suite runs its tests side by side on a small machine, and a request may wait its turn
HTTP = httpx.Client(timeout=60.0)


@dataclass
class Service:
    url: str
    locked_url: str
    db_url: str
    tokens: dict[str, str]  # role (and "revoked") → token
    control: SuperLinkControl
    tmp: Path

    def headers(self, who: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}

    def audit(self) -> list[dict[str, Any]]:
        with make_engine(self.db_url).connect() as conn:
            return audit_entries(conn, limit=10_000)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("security")
    db_url = f"sqlite:///{tmp / 'crossdc.db'}"
    upgrade(db_url)
    with RunLog(db_url) as log:
        log.start_run(run_id="run-1", name="one", strategy="fedavg", config={}, rounds_planned=1)
        log.touch_datacenter(name="seen-by-a-run")
    engine = make_engine(db_url)
    tokens = {role: create_token(engine, f"{role}-token", role) for role in ("admin", "enrollment", "read")}
    tokens["revoked"] = create_token(engine, "old-admin", "admin")
    revoke_token(engine, "old-admin")
    servers: list[BackgroundServer] = []
    with authenticating_superlink(tmp) as (address, certs):
        control = SuperLinkControl(address, certs.ca_cert)
        try:
            # the open service submits runs to a SuperLink that is not there; the locked one submits none
            nowhere = StandingFederation(f"127.0.0.1:{free_port()}", None, tmp / "runs")
            for lock in (False, True):
                app = create_app(db_url, lock_reads=lock, superlink_control=control,
                                 standing_federation=None if lock else nowhere)
                servers.append(start_background(uvicorn_config(app, "127.0.0.1", free_port()), "api"))
            yield Service(servers[0].url, servers[1].url, db_url, tokens, control, tmp)
        finally:
            for server in servers:
                server.stop()
            control.close()


def _enrollment(name: str, key_dir: Path, **facts: Any) -> dict[str, Any]:
    return {"name": name, "gpus": 8, "region": "test", "public_key": node_key(key_dir).public_key_pem, **facts}


# ------------------------------------------------------------------ pure pieces


def test_tokens_are_random_and_stored_as_their_hash() -> None:
    first, second = generate_token(), generate_token()
    assert first != second and first.startswith("cdx_") and len(first) > 40
    assert hash_token(first) == hash_token(first) != hash_token(second) and len(hash_token(first)) == 64
    assert role_allows("admin", "enrollment") and role_allows("enrollment", "enrollment")
    assert not role_allows("enrollment", "admin") and not role_allows("read", "enrollment") and not role_allows("enrollment", "read")


def test_public_keys_are_checked() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    good = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    assert check_public_key(good) == good
    edwards = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    for bad in ("", "not a key", edwards, good.replace("A", "B", 3)):
        with pytest.raises(PublicKeyError):
            check_public_key(bad)


def test_create_token_command_stores_only_the_hash(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'c.db'}"
    made = subprocess.run([CROSSDC, "admin", "create-token", "--name", "ops", "--role", "admin", "--db", db_url],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("cdx_") and token not in made.stderr
    with make_engine(db_url).connect() as conn:
        stored = conn.execute(select(API_TOKENS)).mappings().one()
    assert stored["token_hash"] == hash_token(token) and token not in str(dict(stored))
    listed = subprocess.run([CROSSDC, "admin", "tokens", "--db", db_url], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "ops" in listed.stdout and token not in listed.stdout
    for args, message in ((["--name", "ops"], "exists already"), (["--name", "x", "--role", "root"], "role"),
                          (["--name", "bad name!"], "token name")):
        again = subprocess.run([CROSSDC, "admin", "create-token", *args, "--db", db_url], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and message in again.stderr and again.stderr.count("\n") == 1, again.stderr
    revoked = subprocess.run([CROSSDC, "admin", "revoke-token", "ops", "--db", db_url], capture_output=True, text=True, timeout=60)
    assert revoked.returncode == 0
    with pytest.raises(TokenError):
        revoke_token(make_engine(db_url), "ops")


# ------------------------------------------------------------------ over HTTP


WRITES = [("POST", "/api/datacenters"), ("DELETE", "/api/datacenters/seen-by-a-run"),
          ("POST", "/api/datacenters/seen-by-a-run/suspend"), ("GET", "/api/audit"), ("POST", "/api/runs"),
          ("POST", "/api/runs/run-1/stop")]


def test_every_write_endpoint_is_in_the_list_and_needs_a_token(service: Service) -> None:
    schema = HTTP.get(f"{service.url}/openapi.json").json()
    protected = {(method.upper(), path) for path, methods in schema["paths"].items() for method in methods
                 if method != "get" or path == "/api/audit"}
    assert protected == {(m, p.replace("seen-by-a-run", "{name}").replace("run-1", "{run_id}")) for m, p in WRITES}
    refused_before = sum(a["outcome"] == "refused" for a in service.audit())
    for method, path in WRITES:
        for who, status in ((None, 401), ("revoked", 401), ("read", 403)):
            answer = HTTP.request(method, service.url + path, headers=service.headers(who), json={})
            assert answer.status_code == status, (method, path, who, answer.text)
            if status == 401:
                assert answer.headers["www-authenticate"] == "Bearer"
        garbage = HTTP.request(method, service.url + path, headers={"Authorization": "Bearer " + "x" * 5000})
        assert garbage.status_code == 401
    for method, path in WRITES[1:]:  # admin only: the enrollment token may enroll, nothing else
        assert HTTP.request(method, service.url + path, headers=service.headers("enrollment")).status_code == 403
    refusals = [a for a in service.audit() if a["outcome"] == "refused"]
    assert len(refusals) - refused_before == len(WRITES) * 4 + len(WRITES) - 1
    assert {a["actor"] for a in refusals} >= {None, "read-token", "enrollment-token"}


def test_runs_submitted_and_stopped_only_where_they_can_be(service: Service) -> None:
    """POST /api/runs validates the config as `crossdc run` does (422, one line naming the key) before it tries the
    SuperLink; a SuperLink that does not answer is a 502 with the run recorded as failed; a run that is not running
    cannot be stopped (409), an unknown one is not found (404); a service without --superlink answers 503."""
    admin = service.headers("admin")
    good = (Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml").read_text()
    for text, words in ((good.replace('"fedavg"', '"fedavgx"'), "fedavgx"),
                        (good.replace("lr = 0.01", "lr = 0.01\nsurprise = 1"), "surprise"),
                        ("[run\n", "not valid TOML"),
                        (good.replace('name = "fedavg"\ntau = { start = 2, end = 8, warmup_rounds = 2 }', 'name = "gossip"\ntau = 4'),
                         "standing federation")):
        refused = HTTP.post(f"{service.url}/api/runs", json={"config": text}, headers=admin)
        assert refused.status_code == 422 and words in refused.json()["detail"], (words, refused.text)
        assert "\n" not in refused.json()["detail"]
    assert HTTP.post(f"{service.url}/api/runs", json={"config": good, "extra": 1}, headers=admin).status_code == 422
    with make_engine(service.db_url).connect() as conn:
        runs_before = conn.exec_driver_sql("select count(*) from runs").scalar_one()
    unreachable = HTTP.post(f"{service.url}/api/runs", json={"config": good}, headers=admin)
    assert unreachable.status_code == 502 and "Flower refused the run" in unreachable.json()["detail"], unreachable.text
    with make_engine(service.db_url).connect() as conn:
        statuses = [row[0] for row in conn.exec_driver_sql("select status from runs order by started_at")]
    assert len(statuses) == runs_before + 1 and statuses[-1] == "failed"
    not_running = HTTP.post(f"{service.url}/api/runs/run-1/stop", headers=admin)
    assert not_running.status_code == 409 and "no Flower run id" in not_running.json()["detail"], not_running.text
    assert HTTP.post(f"{service.url}/api/runs/nothing/stop", headers=admin).status_code == 404
    for path in ("/api/runs", "/api/runs/run-1/stop"):
        off = HTTP.post(f"{service.locked_url}{path}", json={"config": good}, headers=admin)
        assert off.status_code == 503 and "--superlink" in off.json()["detail"], off.text
    acts = [(a["action"], a["outcome"]) for a in service.audit()]
    assert acts.count(("submit-run", "refused")) >= 4 and ("submit-run", "failed") in acts and ("stop-run", "refused") in acts


def test_enroll_suspend_enroll_again_revoke(service: Service) -> None:
    enroller, admin = service.headers("enrollment"), service.headers("admin")
    body = _enrollment("dc-one", service.tmp / "dc-one", link_bandwidth_mbps=1000.0, link_rtt_ms=80.0)
    made = HTTP.post(f"{service.url}/api/datacenters", json=body, headers=enroller)
    assert made.status_code == 201, made.text
    record = made.json()
    assert record["status"] == "active" and record["gpus"] == 8 and record["link_rtt_ms"] == 80.0
    first_node = int(record["node_id"])
    assert service.control.nodes()[first_node] == "registered"
    # the same name again, with any key: refused, and nothing registered
    again = HTTP.post(f"{service.url}/api/datacenters", json=_enrollment("dc-one", service.tmp / "other"), headers=enroller)
    assert again.status_code == 409 and "already enrolled" in again.json()["detail"]
    # suspend: unregistered at the SuperLink; it may enroll again, with a new key only
    suspended = HTTP.post(f"{service.url}/api/datacenters/dc-one/suspend", headers=admin)
    assert suspended.status_code == 200 and suspended.json()["status"] == "suspended" and suspended.json()["node_id"] is None
    assert service.control.nodes()[first_node] == "unregistered"
    same_key = HTTP.post(f"{service.url}/api/datacenters", json=body, headers=enroller)
    assert same_key.status_code == 409 and "new key" in same_key.json()["detail"]
    body["public_key"] = node_key(service.tmp / "dc-one", renew=True).public_key_pem
    back = HTTP.post(f"{service.url}/api/datacenters", json=body, headers=enroller)
    assert back.status_code == 201 and back.json()["status"] == "active", back.text
    second_node = int(back.json()["node_id"])
    assert second_node != first_node and service.control.nodes()[second_node] == "registered"
    assert len(list((service.tmp / "dc-one").glob("node-key.replaced-*"))) == 1  # the old key is kept aside
    # revoke: for good
    revoked = HTTP.delete(f"{service.url}/api/datacenters/dc-one", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked"
    assert service.control.nodes()[second_node] == "unregistered"
    assert HTTP.delete(f"{service.url}/api/datacenters/dc-one", headers=admin).status_code == 200  # asked twice
    assert HTTP.post(f"{service.url}/api/datacenters/dc-one/suspend", headers=admin).status_code == 409
    body["public_key"] = node_key(service.tmp / "dc-one", renew=True).public_key_pem
    assert HTTP.post(f"{service.url}/api/datacenters", json=body, headers=enroller).status_code == 409
    assert HTTP.post(f"{service.url}/api/datacenters/nowhere/suspend", headers=admin).status_code == 404
    acts = [(a["action"], a["outcome"]) for a in service.audit() if a["target"] == "dc-one"]
    assert acts == [("enroll", "ok"), ("enroll", "refused"), ("suspend", "ok"), ("enroll", "refused"), ("enroll", "ok"),
                    ("revoke", "ok"), ("suspend", "refused"), ("enroll", "refused")]


def test_a_datacenter_a_run_already_saw_can_enroll_and_bad_enrollments_are_refused(service: Service) -> None:
    enroller = service.headers("enrollment")
    # a name only a run log had seen, revoked by an admin, never comes back
    with RunLog(service.db_url) as log:
        log.touch_datacenter(name="seen-then-revoked")
    assert HTTP.delete(f"{service.url}/api/datacenters/seen-then-revoked", headers=service.headers("admin")).status_code == 200
    back = HTTP.post(f"{service.url}/api/datacenters", json=_enrollment("seen-then-revoked", service.tmp / "str"), headers=enroller)
    assert back.status_code == 409 and "revoked" in back.json()["detail"]
    made = HTTP.post(f"{service.url}/api/datacenters", json=_enrollment("seen-by-a-run", service.tmp / "seen"), headers=enroller)
    assert made.status_code == 201 and made.json()["public_key"] is not None, made.text
    nodes_before = service.control.nodes()
    for bad in ({"public_key": "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"}, {"name": "no spaces allowed"},
                {"gpus": -1}, {"link_rtt_ms": -5.0}, {"unknown": 1}):
        answer = HTTP.post(f"{service.url}/api/datacenters", json={**_enrollment("dc-bad", service.tmp / "bad"), **bad},
                            headers=enroller)
        assert answer.status_code == 422, (bad, answer.text)
    assert service.control.nodes() == nodes_before


def test_crossdc_enroll_client(service: Service, tmp_path: Path) -> None:
    record = enroll(service.url, service.tokens["enrollment"], tmp_path / "dc-two", name="dc-two", gpus=4, region="eu")
    assert record["name"] == "dc-two" and (tmp_path / "dc-two" / "enrollment.json").exists()
    assert oct((tmp_path / "dc-two" / "node-key").stat().st_mode & 0o777) == "0o600"
    assert node_key(tmp_path / "dc-two").public_key_pem == record["public_key"]  # the key is kept, not remade
    with pytest.raises(EnrollmentError, match="401"):
        enroll(service.url, "cdx_wrong", tmp_path / "dc-three", name="dc-three", gpus=1)
    with pytest.raises(EnrollmentError, match="409"):
        enroll(service.url, service.tokens["admin"], tmp_path / "dc-two", name="dc-two", gpus=4)
    # a new key replaces the node's key only once the service enrolled it: refused here (active), the old key stays
    with pytest.raises(EnrollmentError, match="409"):
        enroll(service.url, service.tokens["enrollment"], tmp_path / "dc-two", name="dc-two", gpus=4, new_key=True)
    assert node_key(tmp_path / "dc-two").public_key_pem == record["public_key"]
    assert not list((tmp_path / "dc-two").glob("node-key.replaced-*"))


def test_locked_reads_need_a_token_of_any_role(service: Service) -> None:
    for path in ("/api/runs", "/api/runs/run-1", "/api/datacenters", "/metrics", "/"):
        assert HTTP.get(service.locked_url + path).status_code == 401, path
        assert HTTP.get(service.locked_url + path, headers=service.headers("revoked")).status_code == 401, path
        assert HTTP.get(service.locked_url + path, headers=service.headers("read")).status_code == 200, path
        assert HTTP.get(service.locked_url + path, headers=service.headers("admin")).status_code == 200, path
        assert HTTP.get(service.url + path).status_code == 200, path  # open reads by default


def test_no_read_endpoint_nor_log_ever_shows_a_token(service: Service, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for token in service.tokens.values():  # every token used at least once, right or wrong
        HTTP.post(f"{service.url}/api/datacenters", json={}, headers={"Authorization": f"Bearer {token}"})
    admin = service.headers("admin")
    seen = "".join(HTTP.get(service.url + path, headers=admin).text
                   for path in ("/api/datacenters", "/api/audit?limit=1000", "/api/runs", "/api/runs/run-1", "/metrics",
                                "/openapi.json", "/"))
    logged = caplog.text + "".join(p.read_text(errors="replace") for p in service.tmp.rglob("*.log"))
    with make_engine(service.db_url).connect() as conn:
        stored = str([dict(r) for r in conn.execute(select(API_TOKENS)).mappings()])
    for token in service.tokens.values():
        assert token not in seen and token not in logged and token not in stored
