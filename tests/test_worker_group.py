"""A datacenter's worker group: W local ranks with DistributedDataParallel (gloo on this CPU machine)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TrainerService, processes_mentioning  # tests/ is on sys.path

from crossdc.clients.channel import TrainerFailed
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.processes import is_running
from crossdc.experiment.rundir import RunDir
from crossdc.workloads import model_weights


def experiment(optimizer: str, workers: int, strategy: str = "fedavg", params: dict | None = None) -> dict:
    return {
        "run": {"name": "group", "rounds": 3, "seed": 3},
        "workload": {"dataset": "synthetic", "model": "mlp", "partition": {"kind": "iid"}, "batch_size": 32,
                     "optimizer": optimizer, "lr": 0.05},
        "strategy": {"name": strategy, "tau": 4, "params": params or {}},
        "datacenters": [{"name": "dc-a", "workers": workers}],
    }


def initial_weights(doc: dict) -> dict[str, np.ndarray]:
    config = parse_config(doc)
    return model_weights(initial_model(config, build_workload(config)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_ranks_equal_one_process_on_the_same_global_batch(optimizer: str, tmp_path: Path) -> None:
    weights = initial_weights(experiment(optimizer, 1))
    deltas = {}
    for workers in (1, 2):
        service = TrainerService(tmp_path / f"w{workers}", experiment(optimizer, workers))
        try:
            ping = service.call({"op": "ping"})
            assert len(ping["worker_pids"]) == workers
            answers = [service.call({"op": "train", "run_id": "group-test", "round": r, "tau": 4, "weights": weights}) for r in (1, 2)]
            # the group lives across rounds
            assert answers[0]["metrics"]["worker-pids"] == answers[1]["metrics"]["worker-pids"] == ping["worker_pids"]
            assert answers[1]["metrics"]["num-examples"] == 4 * 32
            deltas[workers] = answers[1]["delta"]
        finally:
            service.close()
        assert all(not is_running(pid) for pid in ping["worker_pids"])
    for name in deltas[1]:
        np.testing.assert_allclose(deltas[2][name], deltas[1][name], atol=2e-6, rtol=1e-4)
    assert any(np.abs(d).max() > 1e-3 for d in deltas[1].values())  # it trained


@pytest.mark.timeout(300)
def test_two_ranks_with_diloco_and_codecs_keep_the_datacenter_state_right(tmp_path: Path) -> None:
    """DiLoCo's inner AdamW with an error-feedback codec pipeline (top-k + int8) and a compressed downlink on 2 ranks:
    rank 0 alone encodes and keeps the codec residuals and the downlink reference in the state store, and the
    decoded updates equal one process's to the codecs' resolution."""
    from flwr.app import ConfigRecord, RecordDict

    from crossdc.clients.state_store import DatacenterStateStore
    from crossdc.compression.downlink import DownlinkSender
    from crossdc.compression.uplink import CODEC_STATE_KEY, decode_arrays
    from crossdc.protocol import CONFIG_KEY, global_model

    doc = {**experiment("adamw", 1, "diloco"), "compression": {"codecs": ["topk:0.25", "int8"], "downlink_codecs": ["int8"]}}
    weights = initial_weights(doc)
    decoded: dict[int, list[dict]] = {}
    for workers in (1, 2):
        root = tmp_path / f"w{workers}"
        doc["datacenters"][0]["workers"] = workers
        service = TrainerService(root, doc)
        sender = DownlinkSender(["int8"])
        decoded[workers] = []
        try:
            for server_round in (1, 2, 3):
                sender.prepare({k: v + 0.01 * server_round for k, v in weights.items()}, server_round)
                records, cfg = sender.message_for("dc-a")
                request = global_model(RecordDict({**records, CONFIG_KEY: ConfigRecord(cfg)}))
                answer = service.call({"op": "train", "run_id": "group-test", "round": server_round, "tau": 4, **request})
                assert "payload" in answer and "delta" not in answer
                decoded[workers].append(decode_arrays(answer["payload"], weights))
                sender.acknowledge("dc-a")
            assert [k for k in request["downlink"] if k == "payload"] == ["payload"]  # rounds 2 and 3 were deltas
        finally:
            service.close()
        store = DatacenterStateStore(RunDir(root).state_root, "group-test", "dc-a")
        assert store.keys() == sorted(["local-trainer", CODEC_STATE_KEY, "downlink-reference"])
        assert store.load(CODEC_STATE_KEY)[1] == 3
    for one, two in zip(decoded[1], decoded[2], strict=False):
        for name in one:
            scale = float(np.abs(one[name]).max()) / 127 + 1e-7
            assert np.abs(two[name] - one[name]).max() <= 2 * scale + 1e-5, name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, params", [("fedprox", {"mu": 0.5}), ("scaffold", {})])
def test_two_ranks_equal_one_process_with_the_strategys_local_hooks(strategy: str, params: dict, tmp_path: Path) -> None:
    """FedProx's proximal term and SCAFFOLD's correction g − c_i + c on 2 DDP ranks give the same update (and the same
    Δc_i) as one process; SCAFFOLD's c_i is written once per round, by rank 0, and read back the next round."""
    from crossdc.clients.state_store import DatacenterStateStore
    from crossdc.protocol import CONTROL_KEY

    weights = initial_weights(experiment("sgd", 1, strategy, params))
    rng = np.random.default_rng(5)
    control = {name: (0.05 * rng.normal(size=w.shape)).astype(np.float32) for name, w in weights.items()}  # the server's c
    received = {CONTROL_KEY: control} if strategy == "scaffold" else {}
    answers: dict[int, list[dict]] = {}
    for workers in (1, 2):
        root = tmp_path / f"w{workers}"
        service = TrainerService(root, experiment("sgd", workers, strategy, params))
        try:
            assert len(service.call({"op": "ping"})["worker_pids"]) == workers
            answers[workers] = [service.call({"op": "train", "run_id": "group-test", "round": r, "tau": 4, "weights": weights,
                                              "received": received}) for r in (1, 2)]
        finally:
            service.close()
        store = DatacenterStateStore(RunDir(root).state_root, "group-test", "dc-a")
        if strategy == "scaffold":
            c_i, stored_round = store.load("scaffold-control")
            assert stored_round == 2 and store.keys() == ["local-trainer", "scaffold-control"]
            deltas_c = [a["extras"][CONTROL_KEY] for a in answers[workers]]
            for name in c_i:  # c_i starts at 0: after two rounds it is the sum of the two Δc_i sent
                np.testing.assert_allclose(c_i[name], deltas_c[0][name] + deltas_c[1][name], atol=1e-6)
            assert answers[workers][1]["metrics"]["control-state-round"] == 2 - 1  # round 2 started from round 1's c_i
        else:
            assert store.keys() == ["local-trainer"] and answers[workers][0]["extras"] == {}
    one, two = answers[1][1], answers[2][1]
    for name in one["delta"]:
        np.testing.assert_allclose(two["delta"][name], one["delta"][name], atol=2e-6, rtol=1e-4)
    for group in one["extras"]:
        for name in one["extras"][group]:
            np.testing.assert_allclose(two["extras"][group][name], one["extras"][group][name], atol=2e-5, rtol=1e-4)
    assert two["metrics"]["train-loss"] == pytest.approx(one["metrics"]["train-loss"], rel=1e-5)
    # the hooks matter: the same round with FedAvg gives a measurably different update
    service = TrainerService(tmp_path / "plain", experiment("sgd", 1))
    try:
        plain = [service.call({"op": "train", "run_id": "group-test", "round": r, "tau": 4, "weights": weights}) for r in (1, 2)][1]
    finally:
        service.close()
    assert max(float(np.abs(plain["delta"][n] - one["delta"][n]).max()) for n in one["delta"]) > 1e-4


@pytest.mark.timeout(300)
def test_a_streaming_replica_on_two_ranks_equals_one_process(tmp_path: Path) -> None:
    """Streaming DiLoCo in a datacenter of 2 DDP ranks: the replica's inner steps, merges and a resumed replica's
    state reach both ranks, so every fragment update sent equals one process's on the same global batch."""
    params = {"fragments": 2, "overlap": 1, "alpha": 0.5}
    weights = initial_weights(experiment("adamw", 1, "streaming-diloco", params))
    answers: dict[int, list[dict]] = {}
    for workers in (1, 2):
        service = TrainerService(tmp_path / f"w{workers}", experiment("adamw", workers, "streaming-diloco", params))
        try:
            assert len(service.call({"op": "ping"})["worker_pids"]) == workers
            answers[workers], results = [], {}
            for exchange in (1, 2, 3, 4):  # two rounds of τ = 4 steps, a fragment sent every 2 steps
                answer = service.call({"op": "stream", "run_id": "group-test", "exchange": exchange, "tau": 4,
                                       "weights": weights if exchange == 1 else None, "results": results})
                answers[workers].append(answer)
                # the server's result of this exchange (new global values of its fragment), carried by the next message
                results = {exchange: {n: (weights[n] + 0.25 * v).astype(np.float32) for n, v in answer["delta"].items()}}
        finally:
            service.close()
    for one, two in zip(answers[1], answers[2], strict=True):
        assert set(one["delta"]) == set(two["delta"]) and two["metrics"]["workers"] == 2
        for name in one["delta"]:
            np.testing.assert_allclose(two["delta"][name], one["delta"][name], atol=2e-6, rtol=1e-4)
        assert two["metrics"]["num-examples"] == one["metrics"]["num-examples"] == 2 * 32
    assert [a["metrics"]["sent-step"] for a in answers[2]] == [2, 4, 6, 8]
    # the merges took the server's values: exchange 3 sends fragment 0 again, against the merged reference
    assert max(float(np.abs(d).max()) for d in answers[1][2]["delta"].values()) > 1e-4


@pytest.mark.timeout(300)
def test_a_dead_rank_fails_the_round_and_the_next_round_works(tmp_path: Path) -> None:
    doc = experiment("adamw", 2)
    weights = initial_weights(doc)
    service = TrainerService(tmp_path / "group", doc)
    try:
        first = service.call({"op": "ping"})["worker_pids"]
        os.kill(first[1], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(TrainerFailed, match="local training failed on dc-a"):
            service.call({"op": "train", "run_id": "group-test", "round": 1, "tau": 2, "weights": weights})
        answer = service.call({"op": "train", "run_id": "group-test", "round": 2, "tau": 2, "weights": weights})
        assert answer["ok"] and answer["metrics"]["worker-pids"][0] == first[0] and answer["metrics"]["worker-pids"][1] != first[1]
    finally:
        service.close()


GROUP_FEDERATION = {
    "run": {"name": "ddp-federation", "rounds": 4, "seed": 0, "min_replies": 1},
    "workload": {"dataset": "synthetic", "model": "mlp", "partition": {"kind": "iid"}, "batch_size": 32, "optimizer": "adamw", "lr": 0.01},
    "strategy": {"name": "fedavg", "tau": 3},
    "datacenters": [{"name": "us-east", "workers": 2}, {"name": "eu-west", "workers": 2}],
}


def _worker_pids_of(run_dir_root: Path, datacenter: str) -> list[int]:
    """Pids of the live non-zero ranks of `datacenter` (processes running crossdc.clients.worker for it)."""
    found = processes_mentioning("crossdc.clients.worker", f"--datacenter {datacenter} ", str(run_dir_root))
    return [int(line.split(":", 1)[0]) for line in found]


@pytest.mark.deployment
@pytest.mark.timeout(400)
def test_federation_with_two_ranks_per_datacenter_survives_a_killed_rank(tmp_path: Path) -> None:
    """Deployment Engine, 2 datacenters × 2 ranks: the groups live across rounds; a rank killed after round 1
    fails its datacenter's next round only; a fresh group serves the rounds after; nothing survives the run."""
    import threading

    from conftest import read_run

    from crossdc.db.engine import make_engine
    from crossdc.db.queries import list_rounds, list_runs
    from crossdc.experiment.processes import free_port, processes_with_env
    from crossdc.orchestration.local_run import RUN_MARKER_ENV, LocalRunOptions, run_local

    db_url = f"sqlite:///{tmp_path / 'ddp.db'}"
    runs = tmp_path / "runs"
    killed: list[int] = []

    def kill_a_rank_after_round_one() -> None:
        engine = make_engine(db_url)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    ids = [r["id"] for r in list_runs(engine)]
                    done = ids and list_rounds(engine, ids[0])
                except Exception:
                    done = False
                if done:
                    for pid in _worker_pids_of(runs, "eu-west"):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
                    return
                time.sleep(0.2)
        finally:
            engine.dispose()

    killer = threading.Thread(target=kill_a_rank_after_round_one, daemon=True)
    killer.start()
    result = run_local(parse_config(GROUP_FEDERATION), LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=runs))
    killer.join(timeout=10)
    assert killed, "no rank was killed: the test would prove nothing"
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished"
    pids = result.summary["worker_pids"]
    assert len(pids["us-east"]) == 1 and len(pids["us-east"][0]) == 2  # one group of 2 ranks served every round
    eu = sorted((r for r in logged["dc_rounds"] if r["datacenter"] == "eu-west"), key=lambda r: r["round"])
    failed = [r for r in eu if r["status"] == "failed"]
    assert len(failed) == 1 and "local training failed on eu-west" in failed[0]["reason"], [(r["round"], r["status"]) for r in eu]
    assert all(r["status"] == "ok" for r in eu if r["round"] > failed[0]["round"])
    assert any(e["kind"] == "failed" and e["datacenter"] == "eu-west" for e in logged["events"])
    everyone = [p for group in result.worker_pids.values() for p in group] + [p for g in pids["eu-west"] for p in g]
    assert [p for p in everyone if is_running(p)] == []
    assert processes_with_env(RUN_MARKER_ENV, str(result.run_dir)) == []
