"""A real federated run survives a PostgreSQL outage in the middle: writes are buffered and retried."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from crossdc.db.engine import make_engine, upgrade
from crossdc.db.queries import get_run, list_datacenter_rounds, list_events, list_rounds, list_runs
from crossdc.platform.config import load_config, with_rounds
from crossdc.platform.local_run import LocalRunOptions, run_local
from crossdc.platform.processes import free_port

from conftest import via_relay
from tcp_relay import TcpRelay

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"


@pytest.mark.postgres
@pytest.mark.deployment
@pytest.mark.timeout(300)
def test_run_survives_a_database_outage(pg_url: str, relay: TcpRelay, tmp_path: Path) -> None:
    upgrade(pg_url)
    url = via_relay(pg_url, relay)
    direct = make_engine(pg_url)
    outage: dict[str, float] = {}

    def cut_after_first_round() -> None:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            runs = [r["id"] for r in list_runs(direct)]
            if runs and list_rounds(direct, runs[0]):
                outage["start"] = time.monotonic()
                relay.cut()
                time.sleep(4.0)
                relay.restore()
                outage["end"] = time.monotonic()
                return
            time.sleep(0.2)

    cutter = threading.Thread(target=cut_after_first_round, daemon=True)
    cutter.start()
    config = with_rounds(load_config(CONFIG), 4)
    result = run_local(config, LocalRunOptions(db_url=url, superlink_port=free_port(), runs_root=tmp_path / "runs"))
    cutter.join(timeout=10)
    try:
        assert "end" in outage, "the outage never happened: the test would prove nothing"
        run = get_run(direct, result.run_id)
        rounds = list_rounds(direct, result.run_id)
        dc_rounds = list_datacenter_rounds(direct, result.run_id)
        events = list_events(direct, result.run_id)
    finally:
        direct.dispose()
    assert run["status"] == "finished"
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]  # each exactly once
    assert len(dc_rounds) == 8 and all(r["status"] == "ok" for r in dc_rounds)
    assert sum(e["kind"] == "federation-ready" for e in events) == 1
