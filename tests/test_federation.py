"""End-to-end runs on real Flower: the Deployment Engine (SuperLink + 2 SuperNodes) and the simulation engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import COMM_SOURCE, client_app_altering_replies, interruptible, processes_mentioning, read_run

from crossdc.clients import client_app as real
from crossdc.db.engine import make_engine
from crossdc.db.queries import get_run, list_rounds, parse_flower_run_ids
from crossdc.experiment.config import load_config, with_rounds
from crossdc.experiment.processes import ensure_port_free, free_port, is_running, processes_with_env
from crossdc.orchestration.local_run import RUN_MARKER_ENV, LocalRunOptions, run_local

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "synthetic-2dc.toml"


@pytest.fixture(scope="module")
def deployment_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One shared 2-datacenter, 2-round run on the Deployment Engine."""
    tmp = tmp_path_factory.mktemp("deployment")
    db_url = f"sqlite:///{tmp / 'runs.db'}"
    config = with_rounds(load_config(CONFIG), 2)
    port = free_port()
    result = run_local(config, LocalRunOptions(db_url=db_url, engine="deployment", superlink_port=port, runs_root=tmp / "runs"))
    data = {"result": result, "port": port, **read_run(db_url, result.run_id)}
    return data


@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_deployment_run_logs_every_round_to_sql(deployment_run: dict) -> None:
    run, rounds, dc_rounds = deployment_run["run"], deployment_run["rounds"], deployment_run["dc_rounds"]
    assert run["status"] == "finished" and run["finished_at"] is not None
    assert run["strategy"] == "fedavg" and run["baseline"] == "none"
    assert len(parse_flower_run_ids(run["flower_run_ids"])) == 1
    assert [r["round"] for r in rounds] == [1, 2]
    # tau = { start = 2, end = 8, warmup_rounds = 2 } linear: 2, then 2 + 6/2 = 5
    assert [r["tau"] for r in rounds] == [2, 5]
    assert all(r["val_loss"] > 0 and 0 <= r["val_accuracy"] <= 1 for r in rounds)
    assert len(dc_rounds) == 4
    assert {r["datacenter"] for r in dc_rounds} == {"us-east", "eu-west"}
    for row in dc_rounds:
        assert row["status"] == "ok", row
        assert row["bytes_up"] > row["bytes_up_raw"] > 0  # framing on top of the fp32 payload
        assert row["bytes_down"] > 0
        assert row["compute_s"] > 0 and row["overhead_s"] >= 0
        assert row["comm_source"] == COMM_SOURCE and 0 < row["comm_s"] < row["round_s"]
        assert row["round_s"] == pytest.approx(row["compute_s"] + row["comm_s"] + row["overhead_s"], rel=1e-6)
        # no overlap: the trainer waits for everything that is not its compute
        assert row["idle_s"] == pytest.approx(row["round_s"] - row["compute_s"], rel=1e-6)
        assert row["drift_l2"] > 0 and -1 <= row["update_cosine"] <= 1
        assert row["num_examples"] == row_tau(rounds, row["round"]) * 32
    for r in rounds:
        ups = [d["bytes_up"] for d in dc_rounds if d["round"] == r["round"]]
        assert r["bytes_up"] == sum(ups)
    result = run["result"]
    assert result["rounds"] == 2 and result["val_loss"] == pytest.approx(rounds[-1]["val_loss"])
    kinds = [e["kind"] for e in deployment_run["events"]]
    assert "federation-ready" in kinds and "trainer-restarted" not in kinds


def row_tau(rounds: list[dict], server_round: int) -> int:
    return next(r["tau"] for r in rounds if r["round"] == server_round)


@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_the_same_trainer_process_serves_every_round(deployment_run: dict) -> None:
    result = deployment_run["result"]
    groups = result.summary["worker_pids"]  # the worker groups that served each datacenter, a new one per change
    for datacenter, pids in result.worker_pids.items():
        assert groups[datacenter] == [pids]


@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_no_process_survives_the_run(deployment_run: dict) -> None:
    result = deployment_run["result"]
    assert result.child_pids, "the run should have started processes"
    assert [pid for pid in result.child_pids if is_running(pid)] == []
    assert processes_mentioning(str(result.run_dir)) == []
    # what Flower spawned detached (its SuperExec, the ServerApp, ClientApps) carries the run's marker
    assert processes_with_env(RUN_MARKER_ENV, str(result.run_dir)) == []
    ensure_port_free("127.0.0.1", deployment_run["port"])  # nothing listens on the SuperLink's port any more


@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_ctrl_c_stops_everything_and_marks_the_run_interrupted(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'runs.db'}"
    runs = tmp_path / "runs"
    # 30 rounds: the run is still going when the signal comes, however slow the machine is
    long_config = tmp_path / "long.toml"
    long_config.write_text(CONFIG.read_text().replace("rounds = 3", "rounds = 30"))
    command = [str(Path(sys.executable).with_name("crossdc")), "run", str(long_config), "--db", db_url,
               "--port", str(free_port()), "--runs-dir", str(runs)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    engine = make_engine(db_url)
    try:
        deadline = time.monotonic() + 180
        run_id = None
        while time.monotonic() < deadline and run_id is None:
            time.sleep(0.5)
            assert process.poll() is None, process.communicate()
            if runs.exists():
                folders = [p.name for p in runs.iterdir()]
                if folders and get_run(engine, folders[0]) and list_rounds(engine, folders[0]):
                    run_id = folders[0]
        assert run_id is not None, "no round finished in time"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        assert "Traceback" not in stderr
        assert get_run(engine, run_id)["status"] == "interrupted"
        assert processes_mentioning(str(runs)) == []
        assert processes_with_env(RUN_MARKER_ENV, str(runs / run_id)) == []
    finally:
        engine.dispose()
        if process.poll() is None:
            process.kill()


@pytest.mark.timeout(300)
def test_simulation_engine_runs_the_same_apps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def note_niceness(datacenter: str, reply: object) -> None:  # runs in the ClientApp's Ray actor
        (tmp_path / f"niceness-{datacenter}").write_text(str(os.nice(0)))

    monkeypatch.setattr(real, "app", client_app_altering_replies(note_niceness))
    db_url = f"sqlite:///{tmp_path / 'sim.db'}"
    config = load_config(CONFIG)
    result = run_local(config, LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    logged = read_run(db_url, result.run_id)
    run, rounds, dc_rounds = logged["run"], logged["rounds"], logged["dc_rounds"]
    assert run["status"] == "finished"
    assert [r["tau"] for r in rounds] == [2, 5, 8]
    assert len(dc_rounds) == 6 and all(r["status"] == "ok" for r in dc_rounds)
    assert all(r["comm_s"] is None for r in dc_rounds)  # no link under simulation: not measured, not invented
    assert rounds[-1]["val_loss"] < rounds[0]["val_loss"]
    assert [pid for pid in result.child_pids if is_running(pid)] == []
    # Ray's default (nice 15) starves the ClientApps on a busy host; they run at the trainers' priority
    assert {path.name: path.read_text() for path in tmp_path.glob("niceness-*")} == \
        {"niceness-us-east": str(os.nice(0)), "niceness-eu-west": str(os.nice(0))}


WAN_CONFIG = """
[run]
name = "wan-fault"
rounds = 20
seed = 0
min_replies = 1
round_timeout_s = 40

[workload]
dataset = "synthetic"
model = "linear"
partition = { kind = "iid" }
batch_size = 32
optimizer = "adamw"
lr = 0.01

[strategy]
name = "fedavg"
tau = 4

[[datacenters]]
name = "us-east"
link = "transoceanic"

[[datacenters]]
name = "eu-west"
link = "transoceanic"

[[link_faults]]
datacenter = "eu-west"
after_round = 1
cut_s = 45
"""


@pytest.fixture(scope="module")
def wan_fault_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two datacenters on emulated transoceanic links (100 Mbps, 150 ms); eu-west's link is cut for 45 s after round 1.

    The cut outlasts the round's deadline (40 s, generous so that a loaded machine still finishes every other round in
    time), so round 2 misses eu-west; it must stay shorter than Flower's 60 s offline window, or the first missed
    round is a "Node Unavailable" failure instead of a timeout. A silence that long may also outlast Flower's node
    heartbeat (about 20 s apart,
    offline after 60 s without one): the SuperLink then fails the next rounds' messages to eu-west at once, until its
    heartbeat gets through again, up to half a minute after the cut. Twenty rounds leave room for both ways back: the
    rounds that fail at once take only us-east's time (about 3 s on an idle machine), so ten could all be over before
    that heartbeat."""
    tmp = tmp_path_factory.mktemp("wan")
    (tmp / "wan.toml").write_text(WAN_CONFIG)
    db_url = f"sqlite:///{tmp / 'wan.db'}"
    result = run_local(load_config(tmp / "wan.toml"), LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=tmp / "runs"))
    return {"result": result, **read_run(db_url, result.run_id)}


@pytest.mark.deployment
@pytest.mark.timeout(600)
def test_a_150_ms_link_shows_in_comm_s(wan_fault_run: dict, deployment_run: dict) -> None:
    wan = [r for r in wan_fault_run["dc_rounds"] if r["status"] == "ok"]
    loopback = [r for r in deployment_run["dc_rounds"] if r["status"] == "ok"]
    assert wan and loopback
    # the round's message exchanges cross the link several times; each crossing costs at least RTT/2
    assert all(r["comm_source"] == COMM_SOURCE and r["comm_s"] >= 0.15 for r in wan)
    assert max(r["comm_s"] for r in loopback) < 0.5 * min(r["comm_s"] for r in wan)
    # the link's own byte counts cover the payloads (plus HTTP framing)
    assert all(r["link_bytes_up"] >= r["bytes_up"] and r["link_bytes_down"] >= r["bytes_down"] for r in wan)


@pytest.mark.deployment
@pytest.mark.timeout(600)
def test_a_cut_link_misses_rounds_and_rejoins(wan_fault_run: dict) -> None:
    assert wan_fault_run["run"]["status"] == "finished"
    events = wan_fault_run["events"]
    cut = next(e for e in events if e["kind"] == "link-cut")
    assert cut["datacenter"] == "eu-west" and cut["round"] >= 1
    eu = sorted((r for r in wan_fault_run["dc_rounds"] if r["datacenter"] == "eu-west"), key=lambda r: r["round"])
    missed = [r for r in eu if r["round"] > cut["round"] and r["status"] in ("timeout", "failed")]
    assert missed, eu
    # missed by the round's deadline, or (on a loaded machine, where the deadline can come later than Flower's own
    # heartbeat check) by Flower telling the coordinator that the node is unavailable
    if missed[0]["status"] == "timeout":
        assert any(e["kind"] == "timeout" and e["datacenter"] == "eu-west" for e in events)
    else:
        assert "Unavailable" in (missed[0]["reason"] or ""), missed[0]
    rejoined = [r for r in eu if r["round"] > missed[0]["round"] and r["status"] == "ok"]
    assert rejoined, f"eu-west never came back after the cut: {[(r['round'], r['status']) for r in eu]}"
    us = [r for r in wan_fault_run["dc_rounds"] if r["datacenter"] == "us-east"]
    assert all(r["status"] == "ok" for r in us)


@pytest.mark.deployment
@pytest.mark.timeout(600)
def test_the_datacenters_api_and_page_show_the_configured_links(wan_fault_run: dict) -> None:
    """Each datacenter's configured link reaches the `datacenters` table when the federation starts, and stays
    there through its replies and the cut (which record it seen without a link)."""
    from fastapi.testclient import TestClient

    from crossdc.dashboard.app import create_app

    db = wan_fault_run["result"].run_dir.parents[1] / "wan.db"  # the fixture's runs_root sits beside its database
    engine = make_engine(f"sqlite:///{db}")
    try:
        with TestClient(create_app(engine=engine)) as client:
            listed = client.get("/api/datacenters")
            page = client.get("/datacenters")
    finally:
        engine.dispose()
    assert listed.status_code == 200 and page.status_code == 200
    links = {dc["name"]: (dc["link_bandwidth_mbps"], dc["link_rtt_ms"]) for dc in listed.json()}
    assert links == {"us-east": (100.0, 150.0), "eu-west": (100.0, 150.0)}  # transoceanic
    for name in links:
        row = page.text.split(f'data-datacenter="{name}"', 1)[1].split("</tr>", 1)[0]
        assert "100 Mbps" in row and "150 ms" in row, row
