"""The real `crossdc` command: run --json, the baselines, and the demo smoke test (`crossdc demo --quick`)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import COMM_SOURCE, CROSSDC, interruptible  # noqa: E402

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_datacenter_rounds, list_rounds, list_runs
from crossdc.experiment.processes import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "synthetic-2dc.toml"
SUMMARY_KEYS = {"run_id", "rounds", "val_loss", "val_accuracy", "bytes_up_total", "bytes_down_total", "wall_s"}


def crossdc(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run([CROSSDC, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "Traceback" not in completed.stderr
    return completed


def last_json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.timeout(400)
def test_run_json_reports_the_gap_to_both_baselines(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'cli.db'}"
    baselines = {}
    for kind in ("all-workers", "sequential"):
        summary = last_json_line(crossdc("run", str(CONFIG), "--db", db, "--json", "--baseline", kind, cwd=tmp_path).stdout)
        assert SUMMARY_KEYS <= set(summary) and summary["baseline"] == kind
        baselines[kind] = summary
    # tau 2, 5, 8 over 3 rounds; 2 datacenters at batch 32
    assert (baselines["all-workers"]["steps"], baselines["all-workers"]["batch_size"]) == (15, 64)
    assert (baselines["sequential"]["steps"], baselines["sequential"]["batch_size"]) == (30, 32)
    summary = last_json_line(crossdc("run", str(CONFIG), "--db", db, "--json", "--engine", "simulation",
                                     "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path).stdout)
    assert SUMMARY_KEYS <= set(summary) and summary["rounds"] == 3
    assert summary["bytes_up_total"] > 0 and summary["bytes_down_total"] > 0
    for kind, baseline in baselines.items():
        expected = (summary["val_loss"] - baseline["val_loss"]) / baseline["val_loss"]
        assert summary["gaps"][kind]["val_loss_gap_rel"] == pytest.approx(expected)
    engine = make_engine(db)
    try:
        runs = {r["id"]: r for r in list_runs(engine)}
        assert {r["baseline"] for r in runs.values()} == {"none", "all-workers", "sequential"}
        assert all(r["status"] == "finished" for r in runs.values())
        assert [r["tau"] for r in list_rounds(engine, baselines["sequential"]["run_id"])] == [4, 10, 16]
    finally:
        engine.dispose()


@pytest.mark.deployment
# about 2 minutes alone on a 2-core machine; beside the suite's other deployment files (3 workers on 2 cores) it took
# 373-896 s, so its limit leaves room above that (it also hands this file out first: tests/conftest.py)
@pytest.mark.timeout(1500)
def test_demo_quick_smoke(tmp_path: Path) -> None:
    """What CI runs as the smoke test of the main job: 4 datacenters, 2 rounds, both baselines, the table, and the
    dashboard it prints the URL of (kept serving after the table here, then stopped with Ctrl-C)."""
    dashboard_port = free_port()
    demo = subprocess.Popen([CROSSDC, "demo", "--quick", "--port", str(free_port()), "--dashboard-port", str(dashboard_port),
                             "--keep-serving"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            preexec_fn=interruptible)
    try:
        assert demo.stdout is not None
        run_id = demo.stdout.readline().strip()  # printed once the table is out; the dashboard still serves
        assert run_id, demo.stderr.read() if demo.stderr else ""
        base = f"http://127.0.0.1:{dashboard_port}"
        page = httpx.get(f"{base}/runs/{run_id}", timeout=30)
        assert page.status_code == 200 and "plotly" in page.text
        assert httpx.get(f"{base}/api/runs/{run_id}", timeout=30).json()["status"] == "finished"
        demo.send_signal(signal.SIGINT)
        stderr = demo.communicate(timeout=60)[1]
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    for text in ("4 datacenters", "all workers", "sequential", "gap", "communication", "trainer utilisation",
                 "the slowest datacenter's compute", f"dashboard: {base}/"):
        assert text in stderr, text
    # not a terminal: one plain line per round as it ends (rich's bars would show nothing until the end)
    lines = stderr.splitlines()
    for label in ("federation", "all-workers baseline", "sequential baseline"):
        rounds = [line for line in lines if line.startswith(f"{label} round ")]
        assert [line.split(":")[0] for line in rounds] == [f"{label} round 1/2", f"{label} round 2/2"], lines
        assert all("val_loss=" in line and line.endswith("s") for line in rounds), rounds
    assert lines.index(next(line for line in lines if line.startswith("federation round 2/2"))) < \
        lines.index(next(line for line in lines if line.startswith("gap =")))  # before the table, not with it
    engine = make_engine(f"sqlite:///{tmp_path / 'crossdc.db'}")  # the default database, in the working folder
    try:
        runs = list_runs(engine)
        assert sorted(r["baseline"] for r in runs) == ["all-workers", "none", "sequential"]
        assert all(r["status"] == "finished" for r in runs)
        dc_rounds = list_datacenter_rounds(engine, run_id)
        assert len(dc_rounds) == 8 and {r["datacenter"] for r in dc_rounds} == {"us-east", "eu-west", "ap-south", "sa-east"}
        assert all(r["status"] == "ok" and r["comm_source"] == COMM_SOURCE and r["comm_s"] > 0 for r in dc_rounds)
    finally:
        engine.dispose()


@pytest.mark.timeout(120)
def test_runs_follow_counts_rounds_against_the_rounds_planned(tmp_path: Path) -> None:
    """`crossdc runs follow` shows each round once against the run's planned rounds ("round 2/3", not "2/2"), then
    the summary; `rounds_to_report` picks what is new, in round order."""
    from crossdc.db.engine import upgrade
    from crossdc.db.runlog import RunLog
    from crossdc.orchestration.follow import rounds_to_report

    assert [r["round"] for r in rounds_to_report([{"round": 3}, {"round": 1}, {"round": 2}], 1)] == [2, 3]
    assert rounds_to_report([{"round": 1}, {"round": 2}], 2) == []
    db_url = f"sqlite:///{tmp_path / 'follow.db'}"
    upgrade(db_url)
    with RunLog(db_url) as log:
        log.start_run(run_id="followed", name="followed", strategy="fedavg", config={}, rounds_planned=3)
        for r in (1, 2, 3):
            log.log_round(run_id="followed", round=r, tau=2, val_loss=1.0 / r, val_accuracy=0.5, bytes_up=10**6,
                          bytes_down=2 * 10**6, bytes_up_raw=10**6, wall_s=1.5)
        log.finish_run(run_id="followed", status="finished", result={"run_id": "followed", "rounds": 3})
    followed = crossdc("runs", "follow", "followed", "--db", db_url, cwd=tmp_path, timeout=100)
    shown = [line.split()[1] for line in followed.stderr.splitlines() if line.strip().startswith("round ")]
    assert shown == ["1/3", "2/3", "3/3"], followed.stderr
    assert last_json_line(followed.stdout) == {"run_id": "followed", "rounds": 3}


def test_demo_progress_off_a_terminal_prints_one_line_per_round() -> None:
    """On a pipe or a log file: a line when a run starts (with a status) and one per round, even when several rounds
    are reported at once; no progress bar."""
    import io

    from rich.console import Console

    from crossdc.orchestration.demo import RoundProgress

    out = io.StringIO()
    rows = [{"round": 1, "tau": 2, "val_loss": 0.69314, "val_accuracy": 0.5123, "wall_s": 3.44},
            {"round": 2, "tau": 5, "val_loss": None, "val_accuracy": None, "wall_s": 1.26},
            {"round": 3, "tau": 8, "val_loss": 0.5, "val_accuracy": 0.75, "wall_s": None}]
    with RoundProgress(Console(file=out, width=150)) as progress:
        on_round = progress.track("federation", 3, status="starting trainers and Flower…")
        on_round(rows[:2])  # two rounds ended between two looks at the run log
        on_round(rows[:2])  # nothing new
        on_round(rows)
        progress.done("federation")
    assert out.getvalue().splitlines() == [
        "federation: starting trainers and Flower…",
        "federation round 1/3: τ=2 val_loss=0.693 val_acc=51.2% 3.4s",
        "federation round 2/3: τ=5 1.3s",
        "federation round 3/3: τ=8 val_loss=0.500 val_acc=75.0%",
    ]
