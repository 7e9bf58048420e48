"""A standing federation: SuperLink and datacenters started on their own (`crossdc node start`), runs submitted to it
(`crossdc run --superlink`), over TLS through the Fleet API front; the CLI can detach and follow again."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CROSSDC, read_run
from crossdc.platform.fleet_front import start_front
from crossdc.platform.processes import ProcessGroup, flower_env, free_port, kill_processes_with_env, wait_for_port
from crossdc.platform.tls import make_certificates

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "synthetic-2dc.toml"
MARKER = "CROSSDC_TEST_STANDING_FEDERATION"


@pytest.mark.deployment
@pytest.mark.timeout(600)
def test_run_on_a_standing_federation_over_tls_detach_and_follow(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    env = {**flower_env(tmp_path / "superlink-home"), MARKER: str(tmp_path)}
    processes = ProcessGroup()
    private, public = free_port(), free_port()
    front = None
    db_url = f"sqlite:///{tmp_path / 'federation.db'}"
    try:
        superlink = processes.start("superlink", [str(Path(sys.executable).with_name("flower-superlink")), "--insecure",
                                                  "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
                                                  "--port", str(private)], tmp_path / "superlink.log", env=env)
        wait_for_port("127.0.0.1", private, 60, alive=superlink)
        front = start_front(f"http://127.0.0.1:{private}", "127.0.0.1", public, certs.server_cert, certs.server_key)
        for name in ("us-east", "eu-west"):
            processes.start(f"node-{name}", [CROSSDC, "node", "start", "--superlink", f"127.0.0.1:{public}", "--datacenter", name,
                                            "--state-dir", str(tmp_path / name), "--root-certificates", str(certs.ca_cert)],
                            tmp_path / f"node-{name}.log", env=env)
        submitted = subprocess.run([CROSSDC, "run", str(CONFIG), "--superlink", f"127.0.0.1:{private}", "--db", db_url,
                                    "--detach", "--runs-dir", str(tmp_path / "runs")],
                                   capture_output=True, text=True, timeout=180, env=env)
        assert submitted.returncode == 0, submitted.stderr[-3000:]
        run_id = submitted.stdout.strip().splitlines()[-1]
        assert "crossdc runs follow" in submitted.stderr
        # the command is gone, the run goes on: follow it to its end from the run log alone
        followed = subprocess.run([CROSSDC, "runs", "follow", run_id, "--db", db_url], capture_output=True, text=True,
                                  timeout=400, env=env)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in tmp_path.glob("node-*.log")}
        assert followed.returncode == 0, (followed.stderr[-3000:], logs)
        summary = json.loads(followed.stdout.strip().splitlines()[-1])
        assert summary["run_id"] == run_id and summary["rounds"] == 3
        logged = read_run(db_url, run_id)
        assert logged["run"]["status"] == "finished"
        assert len(logged["dc_rounds"]) == 6 and all(r["status"] == "ok" for r in logged["dc_rounds"])
        # every datacenter trained in its own node's state folder, and only Fleet API calls crossed the front
        for name in ("us-east", "eu-west"):
            assert (tmp_path / name / "runs" / run_id / "run.json").exists()
        assert front.stats.refused == {} and any(path.endswith("push-messages") for path, _ in front.stats.forwarded)
    finally:
        if front is not None:
            front.stop()
        processes.stop_all()
        kill_processes_with_env(MARKER, str(tmp_path))
