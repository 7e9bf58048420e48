"""SCAFFOLD's datacenter control variates c_i live in the datacenter's durable state store: a datacenter whose
SuperNode and trainer are killed (SIGKILL, with the ClientApp they may be running) between rounds and started
again reads back exactly the c_i written before, and the run goes on. Deployment Engine, real processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import read_run

from crossdc.clients.channel import call_trainer
from crossdc.clients.state_store import DatacenterStateStore
from crossdc.experiment.config import parse_config
from crossdc.experiment.processes import free_port, is_running
from crossdc.orchestration.local_run import LocalRun, LocalRunOptions
from crossdc.strategies.aggregation import total_sum
from crossdc.strategies.scaffold import CLIENT_CONTROL_KEY

VICTIM = "eu-west"
CONFIG = {
    "run": {"name": "scaffold-restart", "rounds": 4, "seed": 0, "min_replies": 1, "round_timeout_s": 30.0},
    "workload": {"dataset": "synthetic", "model": "linear", "partition": {"kind": "dirichlet", "alpha": 0.3},
                 "batch_size": 32, "optimizer": "sgd", "lr": 0.05},
    "strategy": {"name": "scaffold", "tau": 4},
    "datacenters": [{"name": "us-east"}, {"name": VICTIM}],
}


class CrashAfterRoundOne(LocalRun):
    """A local run whose VICTIM datacenter crashes (its SuperNode, and its trainer if `kill_trainer`) once round 1
    is logged, then restarts."""

    def __init__(self, config: Any, options: LocalRunOptions, kill_trainer: bool) -> None:
        super().__init__(config, options)
        self.kill_trainer = kill_trainer
        self.crash: dict[str, Any] = {}

    def inject_faults(self, rounds_logged: int) -> None:
        super().inject_faults(rounds_logged)
        if rounds_logged >= 1 and not self.crash:
            killed = self.kill_datacenter(VICTIM, trainer=self.kill_trainer)
            if not self.kill_trainer:  # the trainer answers one request at a time: a ping returns once any round
                # the dead ClientApp had handed it is finished and stored
                call_trainer(self.run_dir.trainer_socket(VICTIM), self.run_dir.authkey(), {"op": "ping"})
            # nothing of the datacenter runs now: what is on disk is what was written before the crash
            store = DatacenterStateStore(self.run_dir.state_root, self.run_id, VICTIM)
            c_i, written_round = store.load(CLIENT_CONTROL_KEY)
            self.crash.update(killed=killed, written_round=written_round, written_sum=total_sum(c_i),
                              after_round=rounds_logged, trainer_pids_before=list(self.worker_pids[VICTIM]))
            self.restart_datacenter(VICTIM)


@pytest.mark.deployment
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kill_trainer", [False, True], ids=["supernode", "supernode-and-trainer"])
def test_scaffold_client_state_survives_a_datacenter_crash(kill_trainer: bool, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'restart.db'}"
    run = CrashAfterRoundOne(parse_config(CONFIG), LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=tmp_path / "runs"),
                             kill_trainer)
    result = run.execute()
    crash = run.crash
    assert crash, "the datacenter was never crashed: the test would prove nothing"
    assert not any(is_running(pid) for pid in crash["killed"])
    assert crash["written_round"] >= 1
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished"
    events = logged["events"]
    rejoined = [e for e in events if e["kind"] == "datacenter-rejoined"]
    assert len(rejoined) == 1 and rejoined[0]["datacenter"] == VICTIM
    victim_rows = sorted((r for r in logged["dc_rounds"] if r["datacenter"] == VICTIM), key=lambda r: r["round"])
    back = [r for r in victim_rows if r["round"] > crash["after_round"] and r["status"] == "ok"]
    assert back, [(r["round"], r["status"]) for r in victim_rows]
    assert victim_rows[-1]["status"] == "ok" and victim_rows[-1]["round"] == 4  # the run continued with it
    # the first round after the restart started from exactly the c_i on disk before the crash
    first_back = back[0]["round"]
    metrics = next(e for e in events if e["kind"] == "strategy-metrics" and e["round"] == first_back)["detail"]
    loaded = metrics["client_state"][VICTIM]
    assert loaded["loaded_round"] == crash["written_round"]
    assert loaded["loaded_sum"] == crash["written_sum"]  # bit for bit: same arrays, same float64 sum
    assert crash["written_sum"] != 0.0  # a real c_i, not the zeros of a fresh start
    # with the trainer killed, a new one served it (restored from the state store); else the same one did
    pids = result.summary["worker_pids"][VICTIM]
    assert pids[0] == crash["trainer_pids_before"]
    assert (pids[-1] != crash["trainer_pids_before"]) == kill_trainer
    assert any(e["kind"] == "trainer-restarted" and e["datacenter"] == VICTIM for e in events) == kill_trainer
    # the other datacenter never missed a round
    assert all(r["status"] == "ok" for r in logged["dc_rounds"] if r["datacenter"] == "us-east")
