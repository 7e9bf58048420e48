"""A standing federation as an operator runs it: a SuperLink with SuperNode authentication on a private address (TLS,
as Flower requires for authentication), crossdc's Fleet API front before it, crossdc's API service that enrolls
datacenters; datacenters enroll (`crossdc enroll`) and start their nodes (`crossdc node start`); a run is submitted
(`crossdc run --superlink`), detached and followed. A SuperNode without an enrolled key is refused; a revoked one
is cut off and cannot come back.

The operator's side (SuperLink, front, API service, database) runs in the root namespace; each datacenter's side
(`crossdc enroll`, `crossdc node start`) runs in its own network namespace behind crossdc's WAN emulator
(tests/namespaced.py), reaching the front and the API service on the emulator's coordinator address only."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import CROSSDC, authenticating_superlink, read_run
from namespaced import DATACENTER_ENV, crossed, emulated_datacenters, ledger_size, needs_namespaces

from crossdc.clients.enroll import node_key
from crossdc.dashboard.app import create_app
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.queries import parse_flower_run_ids
from crossdc.db.security import audit_entries
from crossdc.deployment.background_server import start_background, uvicorn_config
from crossdc.deployment.fleet_front import start_front
from crossdc.deployment.superlink_control import ControlError, SuperLinkControl
from crossdc.deployment.tls import make_certificates
from crossdc.experiment.links import LINK_PROFILES
from crossdc.experiment.processes import ProcessGroup, flower_env, free_port, kill_processes_with_env
from crossdc.orchestration.submission import StandingFederation
from crossdc.wan.network import EmulatedNetwork

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "synthetic-2dc.toml"
MARKER = "CROSSDC_TEST_STANDING_FEDERATION"
DATACENTERS = ("us-east", "eu-west")
#: the run stopped through the API and resumed
LONG_ROUNDS = 8
#: slots of this module's emulated WANs (see tests/namespaced.py)
SLOT_BASE = 160


def _cli(args: list[str], env: dict[str, str], timeout: float = 120,
         preexec: Any = None) -> subprocess.CompletedProcess[str]:
    """`crossdc ARGS`; in a datacenter's namespace with `preexec` (EmulatedNetwork.preexec)."""
    return subprocess.run([CROSSDC, *args], capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=preexec)


def _exits_within(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.deployment
@needs_namespaces
@pytest.mark.timeout(900)
def test_enrolled_datacenters_run_over_tls_and_others_are_refused(tmp_path: Path) -> None:
    env = {**flower_env(tmp_path / "superlink-home"), MARKER: str(tmp_path)}
    processes = ProcessGroup()
    db_url = f"sqlite:///{tmp_path / 'federation.db'}"
    upgrade(db_url)
    # the datacenters, each in its own namespace behind its emulated link to the operator
    with emulated_datacenters(tmp_path, [(name, LINK_PROFILES["metro"]) for name in DATACENTERS], SLOT_BASE) as net:
        # the operator: SuperLink (private, TLS, only enrolled SuperNodes), the front, the API service
        with authenticating_superlink(tmp_path / "operator") as (private_address, certs):
            outcome = _operate_and_enroll(tmp_path, env, processes, private_address, certs, db_url, net)
    # the run finished on the enrolled datacenters; the revoked one ended up revoked, the other still online
    assert outcome["run_status"] == "finished" and outcome["ok_rows"] == 6
    assert outcome["statuses"] == {"us-east": "revoked", "eu-west": "active"}
    assert outcome["eu_west_online"]
    # every datacenter's traffic (enrollment, its SuperNode's Fleet API calls) crossed its emulated link
    for name in DATACENTERS:
        assert outcome["crossed"][name]["up"] > 0 and outcome["crossed"][name]["down"] > 0, outcome["crossed"]
        assert ledger_size(net, name) > 0, name


def _log_tails(tmp_path: Path, chars: int = 2500) -> dict[str, str]:
    """The end of every log the datacenters and the coordinator wrote under `tmp_path` (SuperNodes, node services,
    trainers, ServerApps), colour codes removed: what a failure's report needs to say where a run stalled."""
    tails = {}
    for path in sorted(tmp_path.rglob("*.log")):
        text = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))
        tails[str(path.relative_to(tmp_path))] = text[-chars:]
    return tails


def _flower_status_once_ended(control: SuperLinkControl, flower_run: int, within_s: float = 60) -> str:
    """Flower's status of a run once it is no longer running (the ServerApp process ends a moment after the run log
    records the end), or its last status after `within_s`."""
    deadline = time.monotonic() + within_s
    while (status := control.run_status(flower_run)[0]) == "running" and time.monotonic() < deadline:
        time.sleep(1)
    return status


def _submit_through_the_api(url: str, ca: Path, admin_token: str, enrollment_token: str) -> str:
    """POST /api/runs: refused without a token, with another role's, with a bad config (422 naming the key, as `crossdc
    run` words it) and with a config a standing federation cannot run; accepted with a good one. The run's id."""
    good = CONFIG.read_text()
    with httpx.Client(base_url=url, verify=str(ca), timeout=120) as api:
        assert api.post("/api/runs", json={"config": good}).status_code == 401
        assert api.post("/api/runs", json={"config": good},
                        headers={"Authorization": f"Bearer {enrollment_token}"}).status_code == 403
        admin = {"Authorization": f"Bearer {admin_token}"}
        bad = api.post("/api/runs", json={"config": good.replace("rounds = 3", "rounds = -1")}, headers=admin)
        assert bad.status_code == 422 and "run.rounds" in bad.json()["detail"], bad.text
        linked = good.replace('name = "eu-west"', 'name = "eu-west"\nlink = "metro"')
        refused = api.post("/api/runs", json={"config": linked}, headers=admin)
        assert refused.status_code == 422 and "standing federation" in refused.json()["detail"], refused.text
        answer = api.post("/api/runs", json={"config": good}, headers=admin)
        assert answer.status_code == 201, answer.text
        submitted = answer.json()
        assert submitted["strategy"] == "fedavg" and submitted["rounds"] == 3 and int(submitted["flower_run_id"]) > 0
        assert api.get(f"/api/runs/{submitted['run_id']}").status_code == 200
    return str(submitted["run_id"])


def _stop_through_the_api(url: str, ca: Path, admin_token: str, db_url: str, run_id: str) -> int:
    """Once the run has logged 3 rounds: POST /api/runs/{id}/stop refused without a token, done with the admin's; the
    run ends interrupted (its ServerApp does not overwrite that), a second stop is refused. The Flower run stopped."""
    deadline = time.monotonic() + 240
    while len(read_run(db_url, run_id)["rounds"]) < 3:
        assert time.monotonic() < deadline, "the long run logged no round"
        time.sleep(1)
    with httpx.Client(base_url=url, verify=str(ca), timeout=120) as api:
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 401
        admin = {"Authorization": f"Bearer {admin_token}"}
        assert api.post("/api/runs/no-such-run/stop", headers=admin).status_code == 404
        stopped = api.post(f"/api/runs/{run_id}/stop", headers=admin)
        assert stopped.status_code == 200 and stopped.json()["status"] == "interrupted", stopped.text
        time.sleep(10)  # the ServerApp meets the stop at its next call to the SuperLink, and ends
        again = api.post(f"/api/runs/{run_id}/stop", headers=admin)
        assert again.status_code == 409, again.text
    logged = read_run(db_url, run_id)
    assert logged["run"]["status"] == "interrupted" and "stopped through the API by 'ops'" in logged["run"]["error"]
    assert len(logged["rounds"]) < LONG_ROUNDS
    assert any(event["kind"] == "run-stopped" for event in logged["events"])
    return int(stopped.json()["flower_run_id"])


def _operate_and_enroll(tmp_path: Path, env: dict[str, str], processes: ProcessGroup, private_address: str, certs: Any,
                        db_url: str, net: EmulatedNetwork) -> dict[str, Any]:
    public, api_port = free_port(), free_port()
    front = service = control = None
    private = int(private_address.rpartition(":")[2])
    # what the datacenters reach (the front, the API service) listens on the coordinator's emulated address, with a
    # certificate naming it (the SuperLink's own, `certs`, names loopback only: it is reached from this machine only)
    coordinator = net.coordinator_address
    public_certs = make_certificates(tmp_path / "public-certs", [coordinator])
    superlink = f"{coordinator}:{public}"

    def datacenter(name: str) -> dict[str, Any]:
        return {"env": {**env, **DATACENTER_ENV}, "preexec": net.preexec(name)}

    try:
        front = start_front(f"https://127.0.0.1:{private}", coordinator, public, public_certs.server_cert,
                            public_certs.server_key, upstream_ca=certs.ca_cert)
        control = SuperLinkControl(f"127.0.0.1:{private}", certs.ca_cert)
        federation = StandingFederation(f"127.0.0.1:{private}", certs.ca_cert, tmp_path / "runs")
        app = create_app(db_url, superlink_control=control, standing_federation=federation)
        service = start_background(uvicorn_config(app, coordinator, api_port, ssl_certfile=str(public_certs.server_cert),
                                                  ssl_keyfile=str(public_certs.server_key)), "api")
        made = _cli(["admin", "create-token", "--name", "enroller", "--role", "enrollment", "--db", db_url], env)
        assert made.returncode == 0, made.stderr
        enrollment_token = made.stdout.strip()
        admin_token = _cli(["admin", "create-token", "--name", "ops", "--db", db_url], env).stdout.strip()

        # each datacenter enrolls with the enrollment token, then starts its node with the key enrollment made
        for name in DATACENTERS:
            enrolled = _cli(["enroll", "--server", service.url, "--name", name, "--gpus", "0", "--region", "test",
                             "--state-dir", str(tmp_path / name), "--ca-cert", str(public_certs.ca_cert)],
                            {**datacenter(name)["env"], "CROSSDC_ENROLLMENT_TOKEN": enrollment_token},
                            preexec=datacenter(name)["preexec"])
            assert enrolled.returncode == 0, enrolled.stderr
            assert oct((tmp_path / name / "node-key").stat().st_mode & 0o777) == "0o600"
        nodes = {name: processes.start(f"node-{name}", [CROSSDC, "node", "start", "--superlink", superlink,
                                                         "--datacenter", name, "--state-dir", str(tmp_path / name),
                                                         "--root-certificates", str(public_certs.ca_cert)],
                                       tmp_path / f"node-{name}.log", **datacenter(name))
                 for name in DATACENTERS}
        # a SuperNode whose key nobody enrolled is refused by the SuperLink, and its node says why
        stranger_key = node_key(tmp_path / "stranger").private_key
        stranger = processes.start("node-stranger", [CROSSDC, "node", "start", "--superlink", superlink,
                                                     "--datacenter", "us-east", "--state-dir", str(tmp_path / "stranger"),
                                                     "--auth-key", str(stranger_key), "--root-certificates",
                                                     str(public_certs.ca_cert)],
                                   tmp_path / "node-stranger.log", **datacenter("us-east"))
        assert _exits_within(stranger.process, 90) not in (None, 0)
        assert "refused this datacenter's key" in (tmp_path / "node-stranger.log").read_text()

        # the run: submitted through crossdc's API (the service submits on the SuperLink's private address, over TLS),
        # followed to its end from the run log; a bad config is refused as `crossdc run` refuses it
        run_id = _submit_through_the_api(service.url, public_certs.ca_cert, admin_token, enrollment_token)
        followed = _cli(["runs", "follow", run_id, "--db", db_url], env, timeout=400)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in tmp_path.glob("node-*.log")}
        assert followed.returncode == 0, (followed.stderr[-3000:], logs)
        summary = json.loads(followed.stdout.strip().splitlines()[-1])
        assert summary["run_id"] == run_id and summary["rounds"] == 3
        logged = read_run(db_url, run_id)
        assert logged["run"]["status"] == "finished"
        # the nodes' trainers beat to the coordinator across the emulated WAN, signed with the key its hello offered
        heartbeats = logged["run"]["result"]["heartbeats"]
        assert all(heartbeats["beats"][name] >= 1 for name in DATACENTERS) and heartbeats["refused"] == 0, heartbeats
        assert len(logged["dc_rounds"]) == 6 and all(r["status"] == "ok" for r in logged["dc_rounds"])
        # Flower's own view of the run, from its Control API (what a local run checks in place of `flwr ls`)
        flower_run = parse_flower_run_ids(logged["run"]["flower_run_ids"])[-1]
        assert _flower_status_once_ended(control, flower_run) == "finished:completed"
        with pytest.raises(ControlError, match="reading the run.s status failed|no run"):
            control.run_status(flower_run + 1)
        for name in DATACENTERS:
            assert (tmp_path / name / "runs" / run_id / "run.json").exists()
        # only Fleet API calls crossed the front
        assert front.stats.refused == {} and any(path.endswith("push-messages") for path, _ in front.stats.forwarded)

        # a longer run submitted with `crossdc run --superlink --detach`, stopped through the API after its third round
        # (its checkpoint of round 2 taken)
        long_config = tmp_path / "long.toml"
        long_config.write_text(CONFIG.read_text().replace("rounds = 3", f"rounds = {LONG_ROUNDS}")
                               + f'\n[checkpoint]\nevery_rounds = 2\ndir = "{tmp_path / "checkpoints"}"\n')
        submitted = _cli(["run", str(long_config), "--superlink", f"127.0.0.1:{private}", "--superlink-ca", str(certs.ca_cert),
                          "--db", db_url, "--detach", "--runs-dir", str(tmp_path / "runs")], env, timeout=180)
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        long_run = submitted.stdout.strip().splitlines()[-1]
        assert "crossdc runs follow" in submitted.stderr
        stopped_flower_run = _stop_through_the_api(service.url, public_certs.ca_cert, admin_token, db_url, long_run)
        assert _flower_status_once_ended(control, stopped_flower_run) == "finished:stopped"
        # `crossdc resume` restarts its coordinator against the same SuperLink and SuperNodes, from the checkpoint of
        # round 2: every round logged exactly once, the run finished. (A node once left the resumed attempt's hello
        # unanswered for 180 s, waiting on the objects of a message the stopped attempt never finished uploading;
        # crossdc's SuperNode gives up on such a message after INSTRUCTION_PULL_MAX_S. Another once answered it late:
        # a second reply to the stopped attempt's message went out in its place; the node now sends a reply it still
        # holds whenever it finds no new message.)
        resumed = _cli(["resume", long_run, "--db", db_url, "--runs-dir", str(tmp_path / "runs")], env, timeout=420)
        assert resumed.returncode == 0, (resumed.stderr[-3000:], _log_tails(tmp_path))
        logged_long = read_run(db_url, long_run)
        assert logged_long["run"]["status"] == "finished", logged_long["run"]
        assert sorted(r["round"] for r in logged_long["rounds"]) == list(range(1, LONG_ROUNDS + 1))
        assert any(event["kind"] == "resumed" for event in logged_long["events"]), logged_long["events"]

        # the operator revokes us-east: its SuperNode is cut off, and it cannot come back with the same key
        headers = {"Authorization": f"Bearer {admin_token}"}
        with httpx.Client(base_url=service.url, verify=str(public_certs.ca_cert), timeout=60) as api:
            assert api.delete("/api/datacenters/us-east").status_code == 401
            assert api.delete("/api/datacenters/us-east", headers={"Authorization": f"Bearer {enrollment_token}"}).status_code == 403
            revoked = api.delete("/api/datacenters/us-east", headers=headers)
            assert revoked.status_code == 200 and revoked.json()["status"] == "revoked", revoked.text
            listed = {d["name"]: d for d in api.get("/api/datacenters").json()}
        assert listed["us-east"]["status"] == "revoked" and listed["eu-west"]["status"] == "active"
        assert _exits_within(nodes["us-east"].process, 90) is not None, "the revoked datacenter's node kept running"
        assert nodes["eu-west"].process.poll() is None
        again = processes.start("node-us-east-again", [CROSSDC, "node", "start", "--superlink", superlink,
                                                        "--datacenter", "us-east", "--state-dir", str(tmp_path / "us-east"),
                                                        "--root-certificates", str(public_certs.ca_cert)],
                                tmp_path / "node-us-east-again.log", **datacenter("us-east"))
        assert _exits_within(again.process, 90) not in (None, 0)
        assert "refused this datacenter's key" in (tmp_path / "node-us-east-again.log").read_text()
        node_states = control.nodes()
        eu_west_online = node_states[int(listed["eu-west"]["node_id"])] == "online"
        assert eu_west_online

        # the audit log has the enrollments, the revocation and the refused attempts; no token appears anywhere
        with make_engine(db_url).connect() as conn:
            audit = audit_entries(conn, limit=1000)
        acts = [(a["action"], a["outcome"], a["target"] or a["actor"]) for a in audit]
        assert ("enroll", "ok", "us-east") in acts and ("enroll", "ok", "eu-west") in acts
        assert ("revoke", "ok", "us-east") in acts
        assert ("submit-run", "ok", run_id) in acts and ("submit-run", "refused", "ops") in acts
        assert ("stop-run", "ok", long_run) in acts and ("stop-run", "refused", long_run) in acts
        assert ("DELETE /api/datacenters/us-east", "refused", "enroller") in acts
        assert sum(a["outcome"] == "refused" for a in audit) >= 2
        everything = json.dumps(audit, default=str) + "".join(
            p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
        assert enrollment_token not in everything and admin_token not in everything
        return {"run_status": logged["run"]["status"], "ok_rows": sum(r["status"] == "ok" for r in logged["dc_rounds"]),
                "statuses": {name: d["status"] for name, d in listed.items()}, "eu_west_online": eu_west_online,
                "crossed": {name: crossed(net, name) for name in DATACENTERS}}
    finally:
        for server in (front, service):
            if server is not None:
                server.stop()
        if control is not None:
            control.close()
        processes.stop_all()
        kill_processes_with_env(MARKER, str(tmp_path))
