"""Asynchronous runs end to end: the real ServerApp's asynchronous loop and the real ClientApp and trainers, under
Flower's simulation engine, on the synthetic workload (Dirichlet non-IID partition).

One FedAsync run (module fixture) serves several checks: two fast datacenters (speed 0.25) and one 5× slower
(speed 0.05), uplink top-k with error feedback, ``max_staleness = 4``. τ = 800 steps at those speeds make each
update's compute (≈ 0.45 s on the fast ones on the 2-core development machine) well above the per-update overhead
(Flower's delivery and the server's polls, ≈ 0.12 s), so the fast datacenters' pace is their own. (At speed 0.5
the compute there was only about twice the overhead, the premise's bound; a faster machine shrinks the compute
alone. The speeds only stretch the compute's wall time: the training is the same.) A second pair of runs checks that FedBuff
with K = number of datacenters, equal speeds and ``max_staleness = 0`` is synchronous FedAvg, bit for bit (with
downlink compression and a 2-worker datacenter in both).
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import read_run

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_async_updates
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import load_config, parse_config
from crossdc.orchestration.local_run import LocalRunOptions, LocalRunResult, run_local
from crossdc.workloads import evaluate, load_model_weights, model_weights

#: these tests assert paces and deadlines on the wall clock: they run alone, after the parallel part of the suite
pytestmark = pytest.mark.serial

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"
MAX_STALENESS = 4
SPEED_RATIO = 5  # fast / slow
VERSIONS = 24
EVAL_EVERY = 4

FEDASYNC_DOC: dict[str, Any] = {
    "run": {"name": "fedasync-3dc", "rounds": VERSIONS, "seed": 0, "eval_every": EVAL_EVERY},
    "workload": {"dataset": "synthetic", "model": "linear", "partition": {"kind": "dirichlet", "alpha": 0.5},
                 "batch_size": 32, "optimizer": "adamw", "lr": 0.0005},
    "strategy": {"name": "fedasync", "tau": 800, "params": {"max_staleness": MAX_STALENESS, "lr": 0.6}},
    "compression": {"codecs": ["topk:0.5"]},
    "datacenters": [{"name": "fast-a", "speed": 0.25}, {"name": "fast-b", "speed": 0.25},
                    {"name": "slow", "speed": 0.25 / SPEED_RATIO}],
}


@pytest.fixture(scope="module")
def fedasync_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fedasync")
    db_url = f"sqlite:///{tmp / 'async.db'}"
    result = run_local(parse_config(FEDASYNC_DOC), LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp / "runs"))
    logged = read_run(db_url, result.run_id)
    engine = make_engine(db_url)
    try:
        logged["updates"] = list_async_updates(engine, result.run_id)
    finally:
        engine.dispose()
    logged["result"] = result
    return logged


@pytest.mark.timeout(300)
def test_applied_staleness_never_exceeds_the_bound_and_discards_are_recorded(fedasync_run: dict[str, Any]) -> None:
    run, updates, events = fedasync_run["run"], fedasync_run["updates"], fedasync_run["events"]
    assert run["status"] == "finished"
    assert [u["seq"] for u in updates] == list(range(1, len(updates) + 1))
    applied = [u for u in updates if u["status"] == "applied"]
    discarded = [u for u in updates if u["status"] == "discarded"]
    assert len(applied) == VERSIONS  # FedAsync: one applied update per version
    assert sorted(u["applied_version"] for u in applied) == list(range(VERSIONS))
    assert all(0 <= u["staleness"] <= MAX_STALENESS for u in applied)
    assert all(u["scale"] == pytest.approx(0.6 / (1 + u["staleness"])) for u in applied)
    # the slow datacenter's updates come back ~10 versions late: discarded, each with a row and an event
    assert discarded and all(u["staleness"] > MAX_STALENESS and u["scale"] is None for u in discarded)
    assert all(u["staleness"] == u["applied_version"] - u["base_version"] for u in updates)
    discard_events = [e for e in events if e["kind"] == "discarded"]
    assert sorted((e["datacenter"], e["detail"]["staleness"]) for e in discard_events) == \
        sorted((u["datacenter"], u["staleness"]) for u in discarded)
    dc_rows = {(r["round"], r["datacenter"]): r for r in fedasync_run["dc_rounds"]}
    for u in discarded:
        row = dc_rows[(u["applied_version"], u["datacenter"])]
        assert row["status"] == "rejected" and "stale update discarded" in row["reason"] and row["staleness"] >= u["staleness"]
    # after a discard, that datacenter's next update was computed from a fresh model, not a stale one
    for u in discarded:
        later = [v for v in updates if v["datacenter"] == u["datacenter"] and v["seq"] > u["seq"]]
        assert all(v["base_version"] >= u["applied_version"] for v in later)


@pytest.mark.timeout(300)
def test_fast_datacenters_never_wait_for_the_slow_one(fedasync_run: dict[str, Any]) -> None:
    per_dc = Counter(u["datacenter"] for u in fedasync_run["updates"])
    assert per_dc["slow"] >= 1
    for fast in ("fast-a", "fast-b"):
        assert per_dc[fast] >= 0.6 * SPEED_RATIO * per_dc["slow"], per_dc
    # the premise: compute per update c well above the per-update overhead o (the pace check above needs
    # (5c + o) / (c + o) ≥ 3, i.e. c ≥ o)
    fast_rows = [r for r in fedasync_run["dc_rounds"] if r["datacenter"].startswith("fast") and r["status"] == "ok"]
    compute = np.mean([r["compute_s"] for r in fast_rows])
    overhead = np.mean([r["overhead_s"] for r in fast_rows])
    assert compute > 2 * overhead, (compute, overhead)


@pytest.mark.timeout(300)
def test_validation_loss_falls_on_non_iid_data(fedasync_run: dict[str, Any]) -> None:
    config = parse_config(FEDASYNC_DOC)
    workload = build_workload(config)
    model = initial_model(config, workload)
    initial_loss, _ = evaluate(workload, model)
    rounds = fedasync_run["rounds"]
    evaluated = [r for r in rounds if r["val_loss"] is not None]
    assert [r["round"] for r in evaluated] == list(range(EVAL_EVERY, VERSIONS + 1, EVAL_EVERY))
    assert evaluated[-1]["val_loss"] < evaluated[0]["val_loss"] < initial_loss
    final = np.load(fedasync_run["result"].run_dir / "final-weights.npz")
    assert set(final.files) == set(model_weights(model)) and all(np.all(np.isfinite(final[n])) for n in final.files)
    # the best evaluated model is kept beside the final one (run.keep_best): the version with the lowest loss
    best = min(evaluated, key=lambda r: r["val_loss"])
    summary = fedasync_run["result"].summary
    assert (summary["best_round"], summary["best_val_loss"]) == (best["round"], pytest.approx(best["val_loss"]))
    with np.load(fedasync_run["result"].run_dir / "best-weights.npz") as npz:
        load_model_weights(model, {name: npz[name] for name in npz.files})
    assert evaluate(workload, model)[0] == pytest.approx(best["val_loss"], rel=1e-6)


@pytest.mark.timeout(300)
def test_run_log_of_an_async_run(fedasync_run: dict[str, Any]) -> None:
    rounds, dc_rounds, updates = fedasync_run["rounds"], fedasync_run["dc_rounds"], fedasync_run["updates"]
    assert [r["round"] for r in rounds] == list(range(1, VERSIONS + 1))  # one row per global version
    # one datacenter row per version and datacenter that replied at it, round = the version applied at
    for u in updates:
        row = next(r for r in dc_rounds if r["round"] == u["applied_version"] and r["datacenter"] == u["datacenter"])
        assert row["staleness"] is not None and row["bytes_up"] >= u["bytes_up"] > 0
    assert all(r["status"] in ("ok", "rejected") for r in dc_rounds)  # nothing failed: task numbers out of step are fine
    assert sum(r["bytes_up"] for r in rounds) == sum(r["bytes_up"] for r in dc_rounds)
    summary = fedasync_run["result"].summary
    assert summary["updates"]["applied"] == VERSIONS and summary["updates"]["discarded"] >= 1


@pytest.mark.timeout(300)
def test_waiting_instead_of_discarding_applies_every_slow_update(tmp_path: Path) -> None:
    doc = copy.deepcopy(FEDASYNC_DOC)
    doc["strategy"]["params"]["staleness_policy"] = "wait"
    doc["run"]["rounds"] = versions = 14  # the slow datacenter's task spans ~5 versions: it replies 2-3 times
    db_url = f"sqlite:///{tmp_path / 'wait.db'}"
    result = run_local(parse_config(doc), LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    logged = read_run(db_url, result.run_id)
    engine = make_engine(db_url)
    try:
        updates = list_async_updates(engine, result.run_id)
    finally:
        engine.dispose()
    assert logged["run"]["status"] == "finished"
    # the same run as the fixture's, which discards the slow datacenter's updates: here none is discarded
    assert [u["status"] for u in updates] == ["applied"] * versions
    assert all(0 <= u["staleness"] <= MAX_STALENESS for u in updates)
    per_dc = Counter(u["datacenter"] for u in updates)
    assert per_dc["slow"] >= 2, per_dc
    # the fast datacenters were held back for the slow one, and each hold ended (with the seconds it lasted)
    events = logged["events"]
    held = [e for e in events if e["kind"] == "held"]
    released = [e for e in events if e["kind"] == "released"]
    assert held and {e["datacenter"] for e in held} <= {"fast-a", "fast-b"}
    assert all(e["detail"]["max_staleness"] == MAX_STALENESS and e["detail"]["oldest_in_flight"] is not None for e in held)
    assert released and all(e["detail"]["waited_s"] > 0 for e in released)
    assert not [e for e in events if e["kind"] == "discarded"]
    assert result.summary["updates"] == {"applied": versions, "discarded": 0, "unusable": 0}


def _final_weights(result: LocalRunResult) -> dict[str, np.ndarray]:
    with np.load(result.run_dir / "final-weights.npz") as npz:
        return {name: npz[name] for name in npz.files}


@pytest.mark.timeout(300)
def test_fedbuff_with_k_datacenters_equal_speeds_and_no_staleness_is_synchronous_fedavg(tmp_path: Path) -> None:
    base = load_config(CONFIG).raw
    results: dict[str, LocalRunResult] = {}
    for name, params in (("fedavg", {}), ("fedbuff", {"max_staleness": 0})):
        doc = copy.deepcopy(base)
        doc["strategy"].update(name=name, params=params)
        doc["compression"] = {"downlink_codecs": ["int8"]}  # the downlink reference stays in step in both loops
        for dc in doc["datacenters"]:
            dc["speed"] = 0.5  # equal speeds; pacing changes the time, never the maths (also under FedAvg)
        doc["datacenters"][1]["workers"] = 2  # a local worker group behind the asynchronous loop as well
        db_url = f"sqlite:///{tmp_path / f'{name}.db'}"
        results[name] = run_local(parse_config(doc), LocalRunOptions(db_url=db_url, engine="simulation",
                                                                     runs_root=tmp_path / name))
        logged = read_run(db_url, results[name].run_id)
        assert logged["run"]["status"] == "finished" and len(logged["rounds"]) == base["run"]["rounds"]
        assert all(r["status"] == "ok" for r in logged["dc_rounds"])
        assert [len(pids) for pids in results[name].worker_pids.values()] == [1, 2]
        if name == "fedbuff":
            engine = make_engine(db_url)
            updates = list_async_updates(engine, results[name].run_id)
            engine.dispose()
            assert all(u["staleness"] == 0 and u["status"] == "applied" for u in updates)
            assert Counter(u["applied_version"] for u in updates) == {v: 2 for v in range(base["run"]["rounds"])}
    sync, buffered = _final_weights(results["fedavg"]), _final_weights(results["fedbuff"])
    assert set(sync) == set(buffered)
    for name in sync:
        np.testing.assert_array_equal(buffered[name], sync[name])
