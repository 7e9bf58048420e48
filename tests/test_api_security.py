"""The API's write side over real HTTP, against a real authenticating SuperLink: tokens and roles (and their
expiry), enrollment, suspension, re-activation and revocation, the audit log (refusals of callers without a live
token aggregated), locked reads, the dashboard's login sessions, and tokens that never leak."""

from __future__ import annotations

import getpass
import json
import logging
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import CROSSDC, authenticating_superlink
from sqlalchemy import insert, select

from crossdc.clients.enroll import EnrollmentError, enroll, node_key
from crossdc.dashboard.app import create_app
from crossdc.dashboard.auth import parse_login_form, safe_next
from crossdc.dashboard.queries import LINK_PATHS
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.models import API_TOKENS, DATACENTERS
from crossdc.db.queries import utcnow
from crossdc.db.runlog import RunLog
from crossdc.db.security import (
    OVERFLOW,
    TokenError,
    audit_entries,
    check_session,
    check_token,
    create_token,
    generate_token,
    hash_token,
    open_session,
    parse_duration,
    record_audit,
    record_refusal,
    refusal_key,
    revoke_token,
    role_allows,
    token_problem,
    window_start,
)
from crossdc.deployment.background_server import BackgroundServer, start_background, uvicorn_config
from crossdc.deployment.superlink_control import PublicKeyError, SuperLinkControl, check_public_key
from crossdc.experiment.config import LIMITS
from crossdc.experiment.processes import free_port
from crossdc.orchestration.submission import StandingFederation

#: a generous timeout: the suite runs its tests side by side on a small machine, and a request may wait its turn
HTTP = httpx.Client(timeout=60.0)


@dataclass
class Service:
    url: str
    locked_url: str
    db_url: str
    tokens: dict[str, str]  # role (and "revoked", "expired") → token
    control: SuperLinkControl
    tmp: Path
    certs: Any  # the certificates of the SuperLink, for 127.0.0.1 (crossdc.deployment.tls)

    def headers(self, who: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}

    def audit(self) -> list[dict[str, Any]]:
        with make_engine(self.db_url).connect() as conn:
            return audit_entries(conn, limit=10_000)

    def log_in(self, token: str, next_path: str = "/") -> httpx.Response:
        """The dashboard's login form posted to the locked service (redirects not followed; the cookie is not kept)."""
        return httpx.post(f"{self.locked_url}/login", data={"token": token, "next": next_path}, timeout=60)


def session_of(login: httpx.Response, **headers: str) -> dict[str, str]:
    """Request headers that send the session cookie `login` set (and `headers`)."""
    return {"Cookie": f"crossdc_session={login.cookies['crossdc_session']}", **headers}


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
    tokens["expired"] = create_token(engine, "expired-admin", "admin", expires_in=timedelta(minutes=30),
                                     now=utcnow() - timedelta(hours=1))
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
            yield Service(servers[0].url, servers[1].url, db_url, tokens, control, tmp, certs)
        finally:
            for server in servers:
                server.stop()
            control.close()


def _enrollment(name: str, key_dir: Path, **facts: Any) -> dict[str, Any]:
    return {"name": name, "gpus": 8, "region": "test", "public_key": node_key(key_dir).public_key_pem, **facts}


def _enrolled(service: Service, *names: str) -> None:
    """Each of `names` enrolled (its key registered at the SuperLink) and active, as a run may name only those."""
    for name in names:
        answer = HTTP.post(f"{service.url}/api/datacenters", json=_enrollment(name, service.tmp / "keys" / name),
                           headers=service.headers("enrollment"))
        assert answer.status_code == 201 or "already enrolled (status active)" in answer.text, answer.text


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"


# ------------------------------------------------------------------ pure pieces


def test_tokens_are_random_and_stored_as_their_hash() -> None:
    first, second = generate_token(), generate_token()
    assert first != second and first.startswith("cdx_") and len(first) > 40
    assert hash_token(first) == hash_token(first) != hash_token(second) and len(hash_token(first)) == 64
    assert role_allows("admin", "enrollment") and role_allows("enrollment", "enrollment")
    assert not role_allows("enrollment", "admin") and not role_allows("read", "enrollment") and not role_allows("enrollment", "read")


def test_durations_and_what_makes_a_token_unusable() -> None:
    assert [parse_duration(text) for text in ("90d", "12h", "30m", " 1m ")] == [
        timedelta(days=90), timedelta(hours=12), timedelta(minutes=30), timedelta(minutes=1)]
    for bad in ("", "0d", "12", "h", "1.5h", "-3d", "12s", "1w", "10 d", "1234567d", "1d2h"):
        with pytest.raises(TokenError, match="e.g. 90d, 12h or 30m"):
            parse_duration(bad)
    now = datetime(2026, 12, 8, 10, 0, tzinfo=UTC)
    assert token_problem(None, None, now) is None
    assert token_problem(None, now + timedelta(seconds=1), now) is None
    assert token_problem(None, now, now) == "expired"  # from its expiry on
    assert token_problem(None, (now - timedelta(minutes=1)).replace(tzinfo=None), now) == "expired"  # SQLite's naive UTC
    assert token_problem(now - timedelta(days=1), now - timedelta(minutes=1), now) == "revoked"
    assert window_start(datetime(2026, 12, 8, 10, 7, 59, tzinfo=UTC)) == datetime(2026, 12, 8, 10, 5, tzinfo=UTC)
    assert window_start(now, timedelta(hours=1)) == now
    keys = {refusal_key(now, "10.0.0.1", "GET /", None, 401, "no token"),
            refusal_key(now, "10.0.0.2", "GET /", None, 401, "no token"),
            refusal_key(now, "10.0.0.1", "GET /", "ops", 401, "expired"),
            refusal_key(now + timedelta(minutes=5), "10.0.0.1", "GET /", None, 401, "no token")}
    assert len(keys) == 4 and all(len(k) == 64 for k in keys)


def test_after_login_only_this_site_and_the_form_is_read_as_a_form() -> None:
    for given, expected in (("/runs/a?round=2", "/runs/a?round=2"), ("/", "/"), (None, "/"), ("", "/"),
                            ("runs", "/"), ("//evil.example/x", "/"), ("/\\evil.example", "/"), ("https://evil.example", "/"),
                            ("/x\r\nSet-Cookie: a=b", "/"), ("/login?next=/x", "/"), ("/logout", "/")):
        assert safe_next(given) == expected, given
    assert parse_login_form(b"token=+cdx_abc%2B+&next=%2Fruns%2Fa") == ("cdx_abc+", "/runs/a")
    assert parse_login_form(b"next=/") == ("", "/") and parse_login_form(b"") == ("", None)
    assert parse_login_form(b"&".join(b"f%d=1" % i for i in range(50))) == ("", None)


def test_refusals_share_a_row_per_window_and_acts_keep_theirs(migrated_url: str) -> None:
    """Refusals of callers without a live token: one row per client, action, token name, status and reason per
    window, counting them, at most `max_rows` rows a window (then one overflow row); an act done with a live token
    is a row of its own however many there are."""
    engine = make_engine(migrated_url)
    t0 = datetime(2026, 12, 8, 10, 0, tzinfo=UTC)
    window = timedelta(minutes=5)

    def refuse(at_s: float, client: str = "10.0.0.1", reason: str = "no token", actor: str | None = None) -> None:
        with engine.begin() as conn:
            record_refusal(conn, "POST /api/datacenters", actor=actor, client=client, status=401, reason=reason,
                           now=t0 + timedelta(seconds=at_s), window=window, max_rows=4)

    try:
        for at_s in range(0, 250, 10):  # 25 in the first window
            refuse(at_s)
        refuse(1, reason="unknown")
        refuse(2, reason="expired", actor="old-read")
        refuse(299.5)  # still the first window
        refuse(300)  # the next one
        for client in ("10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"):  # past 4 rows: the overflow row
            refuse(3, client=client)
        with engine.begin() as conn:
            for _ in range(3):
                record_audit(conn, "submit-run", "refused", actor="ops", client="10.0.0.1", detail={"status": 422})
            rows = audit_entries(conn, limit=100)
        seen = [(r["client"], r["actor"], r["detail"]["reason"], r["count"], r["at"], r["last_at"])
                for r in rows if r["action"] != "submit-run"]
        assert seen == [
            ("10.0.0.1", None, "no token", 26, t0, t0 + timedelta(seconds=299.5)),
            ("10.0.0.1", None, "unknown", 1, t0 + timedelta(seconds=1), t0 + timedelta(seconds=1)),
            ("10.0.0.1", "old-read", "expired", 1, t0 + timedelta(seconds=2), t0 + timedelta(seconds=2)),
            ("10.0.0.1", None, "no token", 1, t0 + timedelta(seconds=300), t0 + timedelta(seconds=300)),
            ("10.0.0.2", None, "no token", 1, t0 + timedelta(seconds=3), t0 + timedelta(seconds=3)),
            (OVERFLOW, None, OVERFLOW, 3, t0 + timedelta(seconds=3), t0 + timedelta(seconds=3)),
        ]
        assert all(r["outcome"] == "refused" and "window_key" not in r for r in rows)
        acts = [r for r in rows if r["action"] == "submit-run"]
        assert len(acts) == 3 and [r["count"] for r in acts] == [1, 1, 1] and {r["last_at"] for r in acts} == {None}
    finally:
        engine.dispose()


def test_a_session_lives_only_while_its_token_does(migrated_url: str) -> None:
    engine = make_engine(migrated_url)
    now = utcnow()
    try:
        forever = create_token(engine, "reader", "read")
        brief = create_token(engine, "brief", "read", expires_in=timedelta(hours=1), now=now)
        with engine.begin() as conn:
            long_session, long_ends = open_session(conn, check_token(conn, forever, now), now)
            short_session, short_ends = open_session(conn, check_token(conn, brief, now), now)
            with pytest.raises(ValueError):
                open_session(conn, check_token(conn, "cdx_nothing", now), now)
        assert long_ends == now + timedelta(hours=12) and short_ends == now + timedelta(hours=1)
        with engine.connect() as conn:
            assert check_session(conn, long_session, now).live is not None
            assert check_session(conn, long_session, now + timedelta(hours=12)).problem == "unknown"  # it ended
            assert check_session(conn, short_session, now + timedelta(minutes=59)).live is not None
            assert check_session(conn, "made-up", now).problem == "unknown"
            stored = str(conn.exec_driver_sql("select * from api_sessions").all())
        assert long_session not in stored and hash_token(long_session) in stored
        revoke_token(engine, "reader")
        with engine.connect() as conn:
            revoked = check_session(conn, long_session, now)
        assert revoked.problem == "revoked" and revoked.identity is not None and revoked.identity.name == "reader"
    finally:
        engine.dispose()


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
    brief = subprocess.run([CROSSDC, "admin", "create-token", "--name", "brief", "--role", "read", "--expires-in", "12h",
                            "--db", db_url], capture_output=True, text=True, timeout=60)
    assert brief.returncode == 0 and "expires in 12h" in brief.stderr, brief.stderr
    listed = subprocess.run([CROSSDC, "admin", "tokens", "--db", db_url], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "ops" in listed.stdout and token not in listed.stdout
    lines = dict(line.split(None, 1) for line in listed.stdout.splitlines())
    assert lines["ops"].endswith(" live") and "live, expires" in lines["brief"], listed.stdout
    with make_engine(db_url).connect() as conn:
        made = {r["target"]: r for r in audit_entries(conn) if r["action"] == "token-created"}
    assert made["ops"]["actor"] == made["brief"]["actor"] == f"cli:{getpass.getuser()}"
    assert made["ops"]["detail"]["expires_at"] is None and made["brief"]["detail"]["expires_at"] is not None
    for args, message in ((["--name", "ops"], "exists already"), (["--name", "x", "--role", "root"], "role"),
                          (["--name", "bad name!"], "token name"),
                          (["--name", "y", "--expires-in", "90 days"], "duration '90 days' must be a whole number")):
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
    refused_before = sum(a["count"] for a in service.audit() if a["outcome"] == "refused")
    for method, path in WRITES:
        for who, status in ((None, 401), ("revoked", 401), ("expired", 401), ("read", 403)):
            answer = HTTP.request(method, service.url + path, headers=service.headers(who), json={})
            assert answer.status_code == status, (method, path, who, answer.text)
            if status == 401:
                assert answer.headers["www-authenticate"] == "Bearer"
        garbage = HTTP.request(method, service.url + path, headers={"Authorization": "Bearer " + "x" * 5000})
        assert garbage.status_code == 401
    for method, path in WRITES[1:]:  # admin only: the enrollment token may enroll, nothing else
        assert HTTP.request(method, service.url + path, headers=service.headers("enrollment")).status_code == 403
    refusals = [a for a in service.audit() if a["outcome"] == "refused"]
    assert sum(a["count"] for a in refusals) - refused_before == len(WRITES) * 5 + len(WRITES) - 1
    assert {a["actor"] for a in refusals} >= {None, "read-token", "enrollment-token", "old-admin", "expired-admin"}
    reasons = {(a["actor"], a["detail"]["reason"]) for a in refusals if a["detail"]["status"] == 401}
    assert reasons >= {(None, "no token"), (None, "unknown"), ("old-admin", "revoked"), ("expired-admin", "expired")}


def test_runs_submitted_and_stopped_only_where_they_can_be(service: Service) -> None:
    """POST /api/runs validates the config as `crossdc run` does (422, one line naming the key) before it tries the
    SuperLink; a SuperLink that does not answer is a 502 with the run recorded as failed; a run that is not running
    cannot be stopped (409), an unknown one is not found (404); a service without --superlink answers 503."""
    admin = service.headers("admin")
    good = EXAMPLE.read_text()
    _enrolled(service, "us-east", "eu-west")
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


def _runs_count(service: Service) -> int:
    with make_engine(service.db_url).connect() as conn:
        return int(conn.exec_driver_sql("select count(*) from runs").scalar_one())


def _refused_submission(service: Service, text: str) -> str:
    """POST /api/runs of `text` with the admin token: refused (422) before anything is recorded but its audit row
    (`submit-run` refused, with the same reason). The one-line reason."""
    runs_before = _runs_count(service)
    answer = HTTP.post(f"{service.url}/api/runs", json={"config": text}, headers=service.headers("admin"))
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    last = service.audit()[-1]
    assert (last["action"], last["outcome"], last["detail"]["reason"]) == ("submit-run", "refused", detail)
    assert _runs_count(service) == runs_before
    return detail


def test_a_config_asking_too_much_is_refused_at_once(service: Service) -> None:
    """10^12 rounds (10^8 once took 51 s to accept; 10^12 held a service thread SIGTERM could not stop): 422 naming
    the key and the bound, as the parser words it."""
    _enrolled(service, "us-east", "eu-west")
    huge = EXAMPLE.read_text().replace("rounds = 3", f"rounds = {10**12}")
    assert _refused_submission(service, huge) == (
        "'run.rounds' must be ≤ 1000000 (the most a config may ask for), got 1000000000000")


def test_a_run_may_name_only_enrolled_active_datacenters(service: Service) -> None:
    """A run naming a revoked, a suspended, a never-enrolled or an unknown datacenter is refused at submission with
    one line naming each (it was accepted, then failed 190 s later naming none)."""
    _enrolled(service, "us-east", "eu-west", "dc-gone", "dc-resting")
    admin = service.headers("admin")
    assert HTTP.delete(f"{service.url}/api/datacenters/dc-gone", headers=admin).status_code == 200
    assert HTTP.post(f"{service.url}/api/datacenters/dc-resting/suspend", headers=admin).status_code == 200
    with RunLog(service.db_url) as log:
        log.touch_datacenter(name="dc-only-seen")  # a run log saw it; nobody enrolled it
    extra = "".join(f'\n[[datacenters]]\nname = "{name}"\n' for name in ("dc-gone", "dc-resting", "dc-only-seen", "dc-nowhere"))
    assert _refused_submission(service, EXAMPLE.read_text() + extra) == (
        "datacenters not enrolled and active at this federation: dc-gone (revoked), dc-resting (suspended), "
        "dc-only-seen (not enrolled), dc-nowhere (unknown); enroll them (`crossdc enroll`) or leave them out of "
        "[[datacenters]]")


def test_a_submitted_runs_checkpoints_stay_under_the_service_roots(service: Service) -> None:
    """checkpoint.dir outside the service's checkpoint roots (default: its runs folder) is refused, nothing written;
    one inside is admitted, and the run's stored config names the absolute folder (here the run then fails at the
    SuperLink, which is not there)."""
    _enrolled(service, "us-east", "eu-west")
    outside = service.tmp / "outside"
    good = EXAMPLE.read_text()
    for directory, why in ((str(outside), "is outside every checkpoint root"), ("../outside", "may not contain '..'"),
                           ("s3://bucket/checkpoints", "is outside every checkpoint root"),
                           (f"file://{outside}", "is outside every checkpoint root")):
        detail = _refused_submission(service, good + f'\n[checkpoint]\nevery_rounds = 1\ndir = "{directory}"\n')
        assert detail.startswith(f"'checkpoint.dir' = '{directory}' {why}"), detail
        assert str((service.tmp / "runs").resolve()) in detail
    assert not outside.exists()
    admitted = HTTP.post(f"{service.url}/api/runs", headers=service.headers("admin"),
                         json={"config": good + '\n[checkpoint]\nevery_rounds = 1\ndir = "mine/ckpt"\n'})
    assert admitted.status_code == 502 and "Flower refused the run" in admitted.text, admitted.text
    with make_engine(service.db_url).connect() as conn:
        stored = conn.exec_driver_sql("select config from runs order by started_at desc limit 1").scalar_one()
    assert json.loads(stored)["checkpoint"]["dir"] == str((service.tmp / "runs" / "mine" / "ckpt").resolve())


def test_link_totals_parse_a_runs_config_once(service: Service) -> None:
    """A run's stored config is parsed once, not on every request (a huge one once made each unauthenticated
    link-totals request take 14 s): here the largest valid schedule, asked for three times."""
    doc = {"run": {"name": "huge", "rounds": LIMITS["run.rounds"]}, "workload": {"dataset": "synthetic"},
           "strategy": {"name": "gossip", "tau": {"start": 1, "end": LIMITS["strategy.tau"], "kind": "geometric",
                                                  "warmup_rounds": LIMITS["strategy.tau.warmup_rounds"]}},
           "datacenters": [{"name": "a", "link": "metro"}, {"name": "b", "link": "continental"}]}
    run_id = "huge-config-run"
    with RunLog(service.db_url) as log:
        log.start_run(run_id=run_id, name="huge", strategy="gossip", config=doc, rounds_planned=LIMITS["run.rounds"])
        log.log_link_round(run_id=run_id, round=1, src="a", dst="b", bytes=10, in_flight_s=0.5, error=None)
    parses = LINK_PATHS.parses
    for _ in range(3):
        answer = HTTP.get(f"{service.url}/api/runs/{run_id}/link-totals")
        assert answer.status_code == 200, answer.text
        assert [(i["a"], i["b"], i["route"], i["rtt_ms"]) for i in answer.json()["items"]] == [("a", "b", "coordinator", 42.0)]
    assert LINK_PATHS.parses == parses + 1


def test_a_run_submitted_from_the_command_line_is_audited_as_the_local_operator(tmp_path: Path) -> None:
    """`crossdc run --superlink` records its submission in the audit log, acted by ``cli:<user>``: here Flower
    cannot take it (no SuperLink listens), so it is recorded failed with the reason, as the API records its own.
    (Accepted submissions and resumes: tests/test_standing_federation.py.)"""
    db_url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade(db_url)
    with make_engine(db_url).begin() as conn:  # both datacenters enrolled, as a standing federation requires
        for node_id, name in enumerate(("us-east", "eu-west"), start=1):
            conn.execute(insert(DATACENTERS).values(name=name, status="active", enrolled_at=utcnow(), node_id=str(node_id)))
    config = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"
    submitted = subprocess.run([CROSSDC, "run", str(config), "--superlink", f"127.0.0.1:{free_port()}", "--detach",
                                "--db", db_url, "--runs-dir", str(tmp_path / "runs")],
                               capture_output=True, text=True, timeout=180)
    assert submitted.returncode != 0 and submitted.stderr.startswith("crossdc: error:"), submitted.stderr
    with make_engine(db_url).connect() as conn:
        rows = [a for a in audit_entries(conn) if a["action"] == "submit-run"]
        run_ids = [r[0] for r in conn.exec_driver_sql("select id from runs")]
    assert [(a["outcome"], a["actor"], a["target"]) for a in rows] == [("failed", f"cli:{getpass.getuser()}", run_ids[0])]
    assert rows[0]["detail"]["superlink"].startswith("127.0.0.1:") and rows[0]["detail"]["reason"]


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


def test_refused_noise_is_counted_on_few_rows_and_every_act_with_a_token_keeps_its_own(service: Service) -> None:
    counts_before = {a["id"]: a["count"] for a in service.audit()}
    before = max(counts_before)
    noise = 40
    for i in range(noise):  # no token, a made-up one, on made-up ids: one route, two reasons
        headers = {"Authorization": "Bearer cdx_made-up"} if i % 2 else {}
        assert HTTP.post(f"{service.url}/api/datacenters/made-up-{i}/suspend", headers=headers).status_code == 401
    for _ in range(3):  # acts done with a live token, each refused
        assert HTTP.post(f"{service.url}/api/datacenters", json={}, headers=service.headers("read")).status_code == 403
        assert HTTP.post(f"{service.url}/api/datacenters/nowhere/suspend", headers=service.headers("admin")).status_code == 404
    after = service.audit()
    # counted on one row per reason (rows of this window may be older: an earlier test's refusals), two if a window
    # ended meanwhile
    counted = [a for a in after if a["count"] != counts_before.get(a["id"], 0)
               and a["action"] == "POST /api/datacenters/{name}/suspend"]
    assert 2 <= len(counted) <= 4 and sum(a["count"] - counts_before.get(a["id"], 0) for a in counted) == noise, counted
    assert {a["detail"]["reason"] for a in counted} == {"no token", "unknown"}
    own = [(a["action"], a["actor"], a["count"]) for a in after if a["id"] > before and a not in counted]
    assert own == [("POST /api/datacenters", "read-token", 1), ("suspend", "admin-token", 1)] * 3


def test_an_expired_token_is_refused_like_an_unknown_one(service: Service) -> None:
    expired = service.headers("expired")
    for base, method, path in ((service.url, "GET", "/api/audit"), (service.url, "POST", "/api/datacenters/x/suspend"),
                               (service.locked_url, "GET", "/api/runs"), (service.locked_url, "GET", "/metrics")):
        answer = HTTP.request(method, base + path, headers=expired)
        unknown = HTTP.request(method, base + path, headers={"Authorization": "Bearer cdx_never-made"})
        assert answer.status_code == unknown.status_code == 401, (path, answer.text)
        assert answer.json() == unknown.json() and answer.headers["www-authenticate"] == "Bearer"
    assert service.log_in(service.tokens["expired"]).status_code == 401
    expired_rows = [a for a in service.audit() if a["actor"] == "expired-admin" and a["detail"]["reason"] == "expired"]
    assert expired_rows and all(a["outcome"] == "refused" and a["detail"]["status"] == 401 for a in expired_rows)


def test_health_tells_only_up_or_down_to_a_stranger_when_reads_are_locked(service: Service) -> None:
    stranger = HTTP.get(f"{service.locked_url}/api/health")
    assert stranger.status_code == 200 and stranger.json() == {"status": "ok"}
    for headers in ({"Authorization": "Bearer cdx_made-up"}, service.headers("revoked"), service.headers("expired"),
                    service.headers("enrollment")):
        assert HTTP.get(f"{service.locked_url}/api/health", headers=headers).json() == {"status": "ok"}
    reader = HTTP.get(f"{service.locked_url}/api/health", headers=service.headers("read")).json()
    assert reader["status"] == "ok" and reader["database"]["answers"] and reader["database"]["backend"] == "sqlite"
    session = session_of(service.log_in(service.tokens["read"]))
    assert HTTP.get(f"{service.locked_url}/api/health", headers=session).json()["database"]["answers"]
    assert HTTP.get(f"{service.url}/api/health").json()["database"]["answers"]  # open reads: open health


def test_a_browser_logs_in_with_a_read_token_and_its_session_reads_only(service: Service) -> None:
    """Login → a session cookie (HttpOnly, SameSite=Strict; not Secure on plain HTTP) that reads pages and the API
    but never /metrics nor a write; a page without it redirects a browser to the login page; logout ends it."""
    html = {"Accept": "text/html"}
    bounced = HTTP.get(f"{service.locked_url}/runs/run-1?round=2", headers=html)
    assert bounced.status_code == 303 and bounced.headers["location"] == "/login?next=%2Fruns%2Frun-1%3Fround%3D2"
    form = HTTP.get(f"{service.locked_url}/login?next=/runs/run-1")
    assert form.status_code == 200 and 'name="token"' in form.text and 'value="/runs/run-1"' in form.text
    assert 'value="/"' in HTTP.get(f"{service.locked_url}/login?next=//evil.example/x").text  # never off-site
    for token, status in (("", 401), ("cdx_made-up", 401), (service.tokens["revoked"], 401),
                          (service.tokens["enrollment"], 403)):
        refused = service.log_in(token)
        assert refused.status_code == status and "set-cookie" not in refused.headers, (token[:8], refused.text)
    logged_in = service.log_in(service.tokens["read"], "/runs/run-1")
    assert logged_in.status_code == 303 and logged_in.headers["location"] == "/runs/run-1"
    cookie = logged_in.headers["set-cookie"]
    assert cookie.startswith("crossdc_session=") and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Secure" not in cookie and service.tokens["read"] not in cookie
    session = session_of(logged_in)
    for path in ("/", "/runs/run-1", "/datacenters", "/api/runs", "/api/runs/run-1"):
        assert HTTP.get(service.locked_url + path, headers={**session, **html}).status_code == 200, path
    assert "Log out" in HTTP.get(f"{service.locked_url}/", headers=session).text
    assert HTTP.get(f"{service.locked_url}/metrics", headers=session).status_code == 401  # Prometheus: bearer only
    # a cookie never authorizes a write, even an admin's session
    admin_session = session_of(service.log_in(service.tokens["admin"]))
    for method, path in WRITES:
        assert HTTP.request(method, service.url + path, headers=admin_session, json={}).status_code == 401, path
    # logout ends the session on the server, not only in this browser
    out = HTTP.post(f"{service.locked_url}/logout", headers=session)
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert HTTP.get(f"{service.locked_url}/api/runs", headers=session).status_code == 401
    acts = [(a["action"], a["actor"]) for a in service.audit() if a["outcome"] == "ok"]
    assert ("login", "read-token") in acts and ("logout", "read-token") in acts and ("login", "admin-token") in acts


def test_the_session_cookie_is_secure_over_tls(service: Service) -> None:
    app = create_app(service.db_url, lock_reads=True)
    server = start_background(uvicorn_config(app, "127.0.0.1", free_port(), ssl_certfile=str(service.certs.server_cert),
                                             ssl_keyfile=str(service.certs.server_key)), "api-tls")
    try:
        login = httpx.post(f"{server.url}/login", data={"token": service.tokens["read"]}, verify=str(service.certs.ca_cert),
                           timeout=60)
    finally:
        server.stop()
    assert server.url.startswith("https://") and login.status_code == 303
    assert "; Secure" in login.headers["set-cookie"] and "HttpOnly" in login.headers["set-cookie"]


def test_a_session_stops_working_when_its_token_is_revoked(service: Service) -> None:
    engine = make_engine(service.db_url)
    token = create_token(engine, "short-lived-reader", "read")
    session = session_of(service.log_in(token))
    assert HTTP.get(f"{service.locked_url}/api/runs", headers=session).status_code == 200
    revoke_token(engine, "short-lived-reader")
    assert HTTP.get(f"{service.locked_url}/api/runs", headers=session).status_code == 401
    again = HTTP.get(f"{service.locked_url}/", headers={**session, "Accept": "text/html"})
    assert again.status_code == 303 and again.headers["location"].startswith("/login")
    assert 'crossdc_session=""' in again.headers["set-cookie"]  # the browser forgets the dead session
    revoked = [a for a in service.audit() if a["actor"] == "short-lived-reader" and a["outcome"] == "refused"]
    assert {a["detail"]["reason"] for a in revoked} == {"revoked"}


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
