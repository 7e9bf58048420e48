"""A standing federation as an operator runs it: a SuperLink with SuperNode authentication on a private address (TLS,
as Flower requires for authentication), crossdc's Fleet API front before it, crossdc's API service that enrolls
datacenters; datacenters enroll (`crossdc enroll`) and start their nodes (`crossdc node start`); a run is submitted
(`crossdc run --superlink`), detached and followed. A SuperNode without an enrolled key is refused; a revoked one
is cut off and cannot come back; a node holding another enrolled datacenter's key cannot take part as another.

The operator's side (SuperLink, front, API service, database) runs in the root namespace; each datacenter's side
(`crossdc enroll`, `crossdc node start`) runs in its own network namespace behind crossdc's WAN emulator
(tests/namespaced.py), reaching the front and the API service on the emulator's coordinator address only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import CROSSDC, AuthenticatingSuperLink, authenticating_superlink, read_run
from namespaced import DATACENTER_ENV, crossed, emulated_datacenters, ledger_size, needs_namespaces

from crossdc.clients.enroll import enroll, node_key
from crossdc.clients.node_runner import NodeFailed, node_health
from crossdc.dashboard.app import create_app
from crossdc.dashboard.enrollment import RECONCILE_ACTION, reconcile
from crossdc.db.engine import make_engine, upgrade
from crossdc.db.queries import list_datacenters, parse_flower_run_ids
from crossdc.db.security import audit_entries, create_token, local_operator
from crossdc.deployment.background_server import start_background, uvicorn_config
from crossdc.deployment.fleet_front import start_front
from crossdc.deployment.superlink_control import ControlError, SuperLinkControl
from crossdc.deployment.tls import make_certificates
from crossdc.experiment.links import LINK_PROFILES
from crossdc.experiment.processes import ProcessGroup, flower_env, free_port, kill_processes_with_env
from crossdc.federation.identity import CLAIM_ACTION, REFUSED_EVENT
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

def _stop_federation(tmp_path: Path, processes: ProcessGroup, front: Any, service: Any, control: Any,
                     superlink: Any = None) -> None:
    """Stop what a standing-federation test started: the front and the API service, the Control API client, the
    nodes' processes, the SuperLink if given, and anything left under the test's marker."""
    for server in (front, service):
        if server is not None:
            server.stop()
    if control is not None:
        control.close()
    processes.stop_all()
    if superlink is not None:
        superlink.stop()
    kill_processes_with_env(MARKER, str(tmp_path))

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
    assert outcome["statuses"] == {"us-east": "revoked", "eu-west": "active", "ap-south": "active"}
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


def _wait_online(control: SuperLinkControl, node_id: int, online: bool = True, within_s: float = 90) -> None:
    """Until the SuperLink lists the node `node_id` online (or, not `online`, no longer online)."""
    deadline = time.monotonic() + within_s
    while (control.nodes().get(node_id) == "online") != online:
        assert time.monotonic() < deadline, f"node {node_id} did not {'come' if online else 'go'} online"
        time.sleep(0.5)


def _impostor_kept_out(logged: dict[str, Any], impostor_node: int, db_url: str) -> None:
    """The node holding ap-south's key (`impostor_node`) and claiming eu-west was refused by the run `logged`: one
    event (and an audit row, checked with the others) naming the claim and the key's name, no row of the run is its
    (the run trained on us-east's and eu-west's own nodes), and ap-south, whose key it holds, is the datacenter it
    was seen as."""
    refused = [(e["datacenter"], e["detail"]) for e in logged["events"] if e["kind"] == REFUSED_EVENT]
    assert refused == [("eu-west", {"node_id": str(impostor_node), "claimed": "'eu-west'", "key_enrolled_as": "ap-south",
                                    "reason": "it claims 'eu-west' but its key is enrolled as 'ap-south'"})], logged["events"]
    assert {r["datacenter"] for r in logged["dc_rounds"]} == set(DATACENTERS)
    engine = make_engine(db_url)
    try:
        assert {row["name"]: row["last_seen"] for row in list_datacenters(engine)}["ap-south"] is not None
    finally:
        engine.dispose()


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
        # ap-south enrolls too, and a node started with its key says it is eu-west: every run refuses it
        ap_south = enroll(service.url, enrollment_token, tmp_path / "ap-south", name="ap-south", gpus=0,
                          ca_cert=public_certs.ca_cert)
        impostor = processes.start("node-impostor", [CROSSDC, "node", "start", "--superlink", superlink, "--datacenter", "eu-west",
                                                     "--state-dir", str(tmp_path / "impostor"), "--auth-key",
                                                     str(tmp_path / "ap-south" / "node-key"), "--root-certificates",
                                                     str(public_certs.ca_cert)],
                                   tmp_path / "node-impostor.log", **datacenter("eu-west"))
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
        # followed to its end from the run log; a bad config is refused as `crossdc run` refuses it. The impostor is
        # online first, so that the run's discovery meets it
        _wait_online(control, int(ap_south["node_id"]))
        run_id = _submit_through_the_api(service.url, public_certs.ca_cert, admin_token, enrollment_token)
        followed = _cli(["runs", "follow", run_id, "--db", db_url], env, timeout=400)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in tmp_path.glob("node-*.log")}
        assert followed.returncode == 0, (followed.stderr[-3000:], logs)
        summary = json.loads(followed.stdout.strip().splitlines()[-1])
        assert summary["run_id"] == run_id and summary["rounds"] == 3
        logged = read_run(db_url, run_id)
        assert logged["run"]["status"] == "finished"
        # the nodes' trainers beat to the coordinator across the emulated WAN, each signed with its own node's key (the
        # impostor's trainer beats as eu-west under ap-south's node key: refused, never counted as eu-west's)
        heartbeats = logged["run"]["result"]["heartbeats"]
        assert all(heartbeats["beats"][name] >= 1 for name in DATACENTERS), heartbeats
        assert len(logged["dc_rounds"]) == 6 and all(r["status"] == "ok" for r in logged["dc_rounds"])
        _impostor_kept_out(logged, int(ap_south["node_id"]), db_url)
        impostor.process.terminate()  # its node stops (its SuperNode signs off), so the next runs are spared its hello
        assert _exits_within(impostor.process, 60) is not None
        _wait_online(control, int(ap_south["node_id"]), online=False)
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
        # (its checkpoint of round 2 taken, under the checkpoint root the submission confines it to)
        long_config = tmp_path / "long.toml"
        long_config.write_text(CONFIG.read_text().replace("rounds = 3", f"rounds = {LONG_ROUNDS}")
                               + f'\n[checkpoint]\nevery_rounds = 2\ndir = "{tmp_path / "checkpoints"}"\n')
        submitted = _cli(["run", str(long_config), "--superlink", f"127.0.0.1:{private}", "--superlink-ca", str(certs.ca_cert),
                          "--db", db_url, "--detach", "--runs-dir", str(tmp_path / "runs"),
                          "--checkpoint-root", str(tmp_path / "checkpoints")], env, timeout=180)
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
        assert ("revoke", "ok", "us-east") in acts and (CLAIM_ACTION, "refused", "eu-west") in acts
        assert ("submit-run", "ok", run_id) in acts and ("submit-run", "refused", "ops") in acts
        assert ("stop-run", "ok", long_run) in acts and ("stop-run", "refused", long_run) in acts
        # the command line's submission and resume of the long run, by the local operator
        by_operator = [(a["action"], a["outcome"], a["target"]) for a in audit if a["actor"] == local_operator()]
        assert ("submit-run", "ok", long_run) in by_operator and ("resume-run", "ok", long_run) in by_operator
        assert ("DELETE /api/datacenters/us-east", "refused", "enroller") in acts
        assert sum(a["outcome"] == "refused" for a in audit) >= 2
        everything = json.dumps(audit, default=str) + "".join(
            p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
        assert enrollment_token not in everything and admin_token not in everything
        return {"run_status": logged["run"]["status"], "ok_rows": sum(r["status"] == "ok" for r in logged["dc_rounds"]),
                "statuses": {name: d["status"] for name, d in listed.items()}, "eu_west_online": eu_west_online,
                "crossed": {name: crossed(net, name) for name in DATACENTERS}}
    finally:
        _stop_federation(tmp_path, processes, front, service, control)


#: how long the SuperLink stays away in the restart test (its SuperNodes retry meanwhile, at most
#: crossdc.clients.supernode.RECONNECT_MAX_WAIT_S apart)
SUPERLINK_AWAY_S = 3


@pytest.mark.deployment
@needs_namespaces
@pytest.mark.timeout(600)
def test_a_superlink_restart_loses_nobody(tmp_path: Path) -> None:
    """The SuperLink keeps its state in a database (`--database`, as compose.yaml runs it): killed while both
    datacenters' nodes run, and away for a while (the front answers 502; each SuperNode retries and the node's health
    check says the SuperLink is gone), it comes back knowing every enrolled key under its node id. The nodes
    reconnect on their own (same processes, same node ids), the API service's reconciliation finds nothing to
    register again, and the next run, submitted through the API, trains on both, their heartbeats received. (us-east
    starts with its key as PKCS#8 PEM, which `node start` converts for Flower.)"""
    env = {**flower_env(tmp_path / "superlink-home"), MARKER: str(tmp_path)}
    db_url = f"sqlite:///{tmp_path / 'federation.db'}"
    upgrade(db_url)
    processes = ProcessGroup()
    superlink = AuthenticatingSuperLink(tmp_path / "operator", database=tmp_path / "operator" / "superlink.db")
    front = service = control = None
    with emulated_datacenters(tmp_path, [(name, LINK_PROFILES["metro"]) for name in DATACENTERS], SLOT_BASE + 5) as net:
        try:
            superlink.start()
            coordinator, public, api_port = net.coordinator_address, free_port(), free_port()
            public_certs = make_certificates(tmp_path / "public-certs", [coordinator])
            front = start_front(f"https://{superlink.address}", coordinator, public, public_certs.server_cert,
                                public_certs.server_key, upstream_ca=superlink.certs.ca_cert)
            control = SuperLinkControl(superlink.address, superlink.certs.ca_cert)
            federation = StandingFederation(superlink.address, superlink.certs.ca_cert, tmp_path / "runs")
            app = create_app(db_url, superlink_control=control, standing_federation=federation)
            service = start_background(uvicorn_config(app, coordinator, api_port, ssl_certfile=str(public_certs.server_cert),
                                                      ssl_keyfile=str(public_certs.server_key)), "api")
            token = create_token(make_engine(db_url), "enroller", "enrollment")
            admin = create_token(make_engine(db_url), "ops", "admin")

            # each datacenter enrolls, told where the front is; the hint names it, and `node start` finds it there
            nodes = {}
            for name in DATACENTERS:
                where = {"env": {**env, **DATACENTER_ENV, "CROSSDC_ENROLLMENT_TOKEN": token}, "preexec": net.preexec(name)}
                enrolled = _cli(["enroll", "--server", service.url, "--front", f"{coordinator}:{public}", "--name", name,
                                 "--gpus", "0", "--state-dir", str(tmp_path / name), "--ca-cert", str(public_certs.ca_cert)],
                                where["env"], preexec=where["preexec"])
                assert enrolled.returncode == 0, enrolled.stderr
                key = ["--auth-key", str(_pkcs8_copy(tmp_path / name / "node-key"))] if name == "us-east" else []
                assert f"crossdc node start --datacenter {name} --state-dir {tmp_path / name} --superlink {coordinator}:{public} " \
                       f"--root-certificates {public_certs.ca_cert}" in enrolled.stderr, enrolled.stderr
                nodes[name] = processes.start(f"node-{name}", [CROSSDC, "node", "start", "--datacenter", name, "--state-dir",
                                                               str(tmp_path / name), *key, "--root-certificates",
                                                               str(public_certs.ca_cert)],
                                              tmp_path / f"node-{name}.log", env={**env, **DATACENTER_ENV},
                                              preexec=net.preexec(name))
            enrolled_ids = {d["name"]: int(d["node_id"]) for d in httpx.get(f"{service.url}/api/datacenters",
                                                                             verify=str(public_certs.ca_cert)).json()}
            _all_online(control, set(enrolled_ids.values()), nodes)

            # the SuperLink crashes: the front answers 502 to the SuperNodes, which retry; the nodes stay
            superlink.kill()
            time.sleep(SUPERLINK_AWAY_S)
            assert all(node.process.poll() is None for node in nodes.values()), _log_tails(tmp_path)
            assert any(status == 502 for _, status in front.stats.forwarded), front.stats.forwarded
            with pytest.raises(NodeFailed, match="last accepted the SuperNode"):
                node_health(tmp_path / "us-east", max_age_s=SUPERLINK_AWAY_S / 2)

            # it comes back with its database: every node reconnects under its enrolled node id (the SuperLink accepts
            # its SuperNode again: its pulse is newer than the restart), nothing re-registered
            superlink.start()
            back = time.time()
            _all_online(control, set(enrolled_ids.values()), nodes)
            deadline = time.monotonic() + 90
            for name in DATACENTERS:
                while True:
                    try:
                        assert f"node {name}: node service answers" in node_health(tmp_path / name, time.time() - back)
                        break
                    except NodeFailed:
                        assert nodes[name].process.poll() is None and time.monotonic() < deadline, _log_tails(tmp_path)
                        time.sleep(0.5)
            assert reconcile(make_engine(db_url), control) == []
            with make_engine(db_url).connect() as conn:
                assert not [a for a in audit_entries(conn, limit=1000) if a["action"] == RECONCILE_ACTION]
            assert {d["name"]: int(d["node_id"]) for d in httpx.get(f"{service.url}/api/datacenters",
                                                                    verify=str(public_certs.ca_cert)).json()} == enrolled_ids

            # the next run trains on both
            with httpx.Client(base_url=service.url, verify=str(public_certs.ca_cert), timeout=120) as api:
                answer = api.post("/api/runs", json={"config": CONFIG.read_text().replace("rounds = 3", "rounds = 1")},
                                  headers={"Authorization": f"Bearer {admin}"})
            assert answer.status_code == 201, answer.text
            run_id = answer.json()["run_id"]
            deadline = time.monotonic() + 240
            while (logged := read_run(db_url, run_id))["run"]["status"] == "running":
                assert time.monotonic() < deadline, _log_tails(tmp_path)
                time.sleep(1)
            assert logged["run"]["status"] == "finished", (logged["run"], _log_tails(tmp_path))
            assert sorted((r["datacenter"], r["status"]) for r in logged["dc_rounds"]) == sorted(
                (name, "ok") for name in DATACENTERS)
            heartbeats = logged["run"]["result"]["heartbeats"]
            assert all(heartbeats["beats"][name] >= 1 for name in DATACENTERS), heartbeats
        finally:
            _stop_federation(tmp_path, processes, front, service, control, superlink)


def _all_online(control: SuperLinkControl, node_ids: set[int], nodes: dict[str, Any], within_s: float = 90) -> None:
    """Wait until the SuperLink lists every one of `node_ids` online; fails at once if a node process ended."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            statuses = control.nodes()
        except ControlError:  # a SuperLink still starting
            statuses = {}
        if all(statuses.get(node_id) == "online" for node_id in node_ids):
            return
        ended = {name: node.process.returncode for name, node in nodes.items() if node.process.poll() is not None}
        assert not ended, (ended, statuses)
        assert time.monotonic() < deadline, statuses
        time.sleep(0.5)


def _pkcs8_copy(openssh_key: Path, password: bytes | None = None) -> Path:
    """The private key at `openssh_key` written again as PKCS#8 PEM (encrypted with `password` if given), beside it."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_ssh_private_key(openssh_key.read_bytes(), None)
    encryption = (serialization.BestAvailableEncryption(password) if password is not None
                  else serialization.NoEncryption())
    path = openssh_key.with_name(openssh_key.name + (".encrypted" if password else "") + ".pkcs8.pem")
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    path.chmod(0o600)
    return path


def test_node_start_gives_flower_a_key_it_reads_or_says_why_not(tmp_path: Path) -> None:
    """flower-supernode reads only OpenSSH keys (a PKCS#8 one made it exit with code 1 and no reason): `node start`
    converts an EC key in PEM to an OpenSSH copy in its state folder, and refuses anything else with one line before
    starting anything. `crossdc enroll` records the front a node reaches, which `node start` defaults to."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    from crossdc.clients.enroll import CONVERTED_KEY_FILE, front_address, supernode_auth_key

    enrolled = node_key(tmp_path / "dc").private_key
    state = tmp_path / "state"
    state.mkdir()
    assert supernode_auth_key(enrolled, state) == enrolled  # OpenSSH: as it is
    for pem in (_pkcs8_copy(enrolled), tmp_path / "sec1.pem"):
        if pem.name == "sec1.pem":
            pem.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
        converted = supernode_auth_key(pem, state)
        assert converted == state / CONVERTED_KEY_FILE and oct(converted.stat().st_mode & 0o777) == "0o600"
        original = serialization.load_pem_private_key(pem.read_bytes(), None)
        assert serialization.load_ssh_private_key(converted.read_bytes(), None).private_numbers() == original.private_numbers()  # type: ignore[union-attr]

    rsa_key = tmp_path / "rsa.pem"
    rsa_key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    (tmp_path / "garbage").write_text("not a key\n")
    ca = make_certificates(tmp_path / "certs", ["127.0.0.1"]).ca_cert
    for bad, why in ((rsa_key, "is not an elliptic-curve key on P-256, P-384 or P-521"),
                     (_pkcs8_copy(enrolled, b"secret"), "is encrypted"),
                     (tmp_path / "garbage", "is not a private key in OpenSSH or PEM format")):
        refused = _cli(["node", "start", "--superlink", "127.0.0.1:1", "--datacenter", "dc", "--state-dir",
                        str(tmp_path / "refused"), "--auth-key", str(bad), "--root-certificates", str(ca)], dict(os.environ))
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"crossdc: error: --auth-key {bad} {why}"), lines
        assert not (tmp_path / "refused" / "logs").exists()  # nothing was started

    # the front a node reaches: as given, else the service's host with the front's port
    assert front_address("https://ops.example.org:8443") == "ops.example.org:9092"
    assert front_address("https://ops.example.org:8443", "fleet.example.org") == "fleet.example.org:9092"
    assert front_address("https://ops.example.org:8443", "10.0.0.7:19092") == "10.0.0.7:19092"
    no_front = _cli(["node", "start", "--datacenter", "dc", "--state-dir", str(tmp_path / "never-enrolled"),
                     "--root-certificates", str(ca)], dict(os.environ))
    assert no_front.returncode == 2 and no_front.stderr.startswith("crossdc: error: give --superlink"), no_front.stderr


@pytest.mark.deployment
def test_a_superlink_that_lost_its_state_gets_every_active_key_again(tmp_path: Path) -> None:
    """A SuperLink started again without its state (no `--database`, or a lost one) knows no enrolled key: the API
    service's reconciliation, at start and then periodically, registers every active datacenter's key again, records
    the new node id and audits it; a suspended one stays cut off, and a second pass changes nothing."""
    from crossdc.clients.enroll import enroll as enroll_datacenter

    db_url = f"sqlite:///{tmp_path / 'federation.db'}"
    upgrade(db_url)
    superlink = AuthenticatingSuperLink(tmp_path / "operator")  # its state in memory only
    service = control = None
    try:
        superlink.start()
        control = SuperLinkControl(superlink.address, superlink.certs.ca_cert)
        app = create_app(db_url, superlink_control=control)
        app.state.reconcile_interval_s = 0.5
        service = start_background(uvicorn_config(app, "127.0.0.1", free_port()), "api")
        token = create_token(make_engine(db_url), "enroller", "enrollment")
        admin = create_token(make_engine(db_url), "ops", "admin")
        before = {name: enroll_datacenter(service.url, token, tmp_path / name, name=name, gpus=0)["node_id"]
                  for name in ("us-east", "eu-west", "ap-south")}
        assert httpx.post(f"{service.url}/api/datacenters/ap-south/suspend",
                          headers={"Authorization": f"Bearer {admin}"}).status_code == 200

        superlink.stop()
        superlink.start()  # empty: no node, no key
        deadline = time.monotonic() + 60
        while len(reconciled := _audited(db_url, "reconcile")) < 2:
            assert time.monotonic() < deadline, _audited(db_url, None)
            time.sleep(0.5)
        rows = {d["name"]: d for d in httpx.get(f"{service.url}/api/datacenters").json()}
        known = control.nodes()
        for name in ("us-east", "eu-west"):
            assert rows[name]["status"] == "active" and rows[name]["node_id"] != before[name]
            assert known[int(rows[name]["node_id"])] == "registered", known
        assert rows["ap-south"]["status"] == "suspended" and len(known) == 2
        assert sorted((a["target"], a["detail"]["old_node_id"], a["detail"]["node_id"]) for a in reconciled) == sorted(
            (name, before[name], rows[name]["node_id"]) for name in ("us-east", "eu-west"))
        assert reconcile(make_engine(db_url), control) == []
        assert len(_audited(db_url, "reconcile")) == 2
    finally:
        if service is not None:
            service.stop()
        if control is not None:
            control.close()
        superlink.stop()


def _audited(db_url: str, action: str | None) -> list[dict[str, Any]]:
    """The audit log's rows of `action` (every row: None)."""
    with make_engine(db_url).connect() as conn:
        return [a for a in audit_entries(conn, limit=1000) if action is None or a["action"] == action]
