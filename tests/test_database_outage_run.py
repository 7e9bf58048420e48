"""A real federated run survives a PostgreSQL outage in the middle: writes are buffered and retried."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import read_run, via_relay
from sqlalchemy import Engine
from tcp_relay import TcpRelay

from crossdc.db.engine import make_engine, upgrade
from crossdc.db.queries import list_rounds, list_runs
from crossdc.experiment.config import load_config, with_rounds
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRunOptions, RunFailed, run_local

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"


def cut_after_first_round(direct: Engine, relay: TcpRelay, restore_after_s: float | None, outage: dict[str, float]) -> threading.Thread:
    """A thread that cuts the relay once the first round is in SQL (read directly), and restores it after
    `restore_after_s` (None: leaves it cut); `outage` gets its start and end times."""

    def cut() -> None:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            runs = [r["id"] for r in list_runs(direct)]
            if runs and list_rounds(direct, runs[0]):
                outage["start"] = time.monotonic()
                relay.cut()
                if restore_after_s is not None:
                    time.sleep(restore_after_s)
                    relay.restore()
                    outage["end"] = time.monotonic()
                return
            time.sleep(0.2)

    thread = threading.Thread(target=cut, daemon=True)
    thread.start()
    return thread


@pytest.mark.postgres
@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_run_survives_a_database_outage(pg_url: str, relay: TcpRelay, tmp_path: Path) -> None:
    upgrade(pg_url)
    url = via_relay(pg_url, relay)
    direct = make_engine(pg_url)
    outage: dict[str, float] = {}
    cutter = cut_after_first_round(direct, relay, restore_after_s=4.0, outage=outage)
    config = with_rounds(load_config(CONFIG), 4)
    result = run_local(config, LocalRunOptions(db_url=url, superlink_port=free_port(), runs_root=tmp_path / "runs"))
    cutter.join(timeout=10)
    direct.dispose()
    assert "end" in outage, "the outage never happened: the test would prove nothing"
    logged = read_run(pg_url, result.run_id)
    run, rounds, dc_rounds, events = logged["run"], logged["rounds"], logged["dc_rounds"], logged["events"]
    assert run["status"] == "finished"
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]  # each exactly once
    assert len(dc_rounds) == 8 and all(r["status"] == "ok" for r in dc_rounds)
    assert sum(e["kind"] == "federation-ready" for e in events) == 1


@pytest.mark.postgres
@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_outage_longer_than_the_buffer_fails_the_run_and_keeps_the_model(pg_url: str, relay: TcpRelay, tmp_path: Path) -> None:
    """Past db_max_outage_s the ServerApp stops, saves the global weights, and `crossdc run` fails instead of hanging."""
    upgrade(pg_url)
    url = via_relay(pg_url, relay)
    direct = make_engine(pg_url)

    cutter = cut_after_first_round(direct, relay, restore_after_s=None, outage={})
    # rounds enough that the outage outlasts db_max_outage_s before they run out: this workload's rounds take a few
    # hundred milliseconds, and 6 could all end within 2 s of the cut (the run then ended at its last round)
    config = with_rounds(load_config(CONFIG), 60)
    options = LocalRunOptions(db_url=url, superlink_port=free_port(), runs_root=tmp_path / "runs", db_max_outage_s=2.0)
    try:
        with pytest.raises(RunFailed, match="ServerApp ended"):
            run_local(config, options)
    finally:
        relay.restore()
        cutter.join(timeout=10)
        direct.dispose()
    run_dir = next((tmp_path / "runs").iterdir())
    saved = sorted(run_dir.glob("weights-round-*.npz"))
    assert saved, "the global weights were not saved when the run stopped"
    assert not (run_dir / "final-weights.npz").exists()
