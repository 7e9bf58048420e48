"""Injected faults (crossdc.clients.fault_injection): a trainer asked to spoil its next update sends one NaN or
wrongly shaped update that the update gate refuses, and only that one; a run without fault injection refuses to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import TrainerService  # tests/ is on sys.path

from crossdc.clients.channel import TrainerFailed
from crossdc.clients.fault_injection import poison_answer
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.rundir import SETTINGS_FAULT_INJECTION
from crossdc.federation.update_gate import rejection_reason
from crossdc.workloads import model_weights

WEIGHTS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, dtype=np.float32)}


def test_nan_spoils_one_value_and_leaves_the_answer_passed_in_alone() -> None:
    answer = {"delta": {k: v.copy() for k, v in WEIGHTS.items()}, "metrics": {"n": 1}}
    spoiled = poison_answer(answer, "nan")
    assert np.isnan(spoiled["delta"]["w"][0, 0]) and np.isfinite(spoiled["delta"]["w"].reshape(-1)[1:]).all()
    assert np.array_equal(spoiled["delta"]["b"], WEIGHTS["b"]) and spoiled["metrics"] == {"n": 1}
    assert np.array_equal(answer["delta"]["w"], WEIGHTS["w"])  # the original is untouched
    assert rejection_reason(spoiled["delta"], WEIGHTS) == "tensor 'w' contains NaN or Inf"


def test_corrupt_breaks_the_shape_and_the_gate_says_so() -> None:
    spoiled = poison_answer({"delta": dict(WEIGHTS)}, "corrupt")
    assert spoiled["delta"]["w"].shape == (5,)
    assert "shape" in (rejection_reason(spoiled["delta"], WEIGHTS) or "")


def test_a_codec_payload_is_truncated_and_unknown_kinds_are_refused() -> None:
    payload = np.arange(10, dtype=np.uint8)
    assert poison_answer({"payload": payload}, "nan")["payload"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="unknown injected fault 'zero'"):
        poison_answer({"delta": dict(WEIGHTS)}, "zero")


DOC = {
    "run": {"name": "inject", "rounds": 3, "seed": 3},
    "workload": {"dataset": "synthetic", "model": "linear", "partition": {"kind": "iid"}, "batch_size": 16,
                 "optimizer": "sgd", "lr": 0.05},
    "strategy": {"name": "fedavg", "tau": 2},
    "datacenters": [{"name": "dc-a"}],
}


def _train(service: TrainerService, server_round: int, weights: dict[str, np.ndarray]) -> dict:
    return service.call({"op": "train", "run_id": "group-test", "round": server_round, "tau": 2, "weights": weights})


@pytest.mark.timeout(300)
def test_the_trainer_spoils_exactly_its_next_reply_only_when_the_run_allows_it(tmp_path: Path) -> None:
    config = parse_config(DOC)
    weights = model_weights(initial_model(config, build_workload(config)))
    refusing = TrainerService(tmp_path / "off", DOC)
    try:
        with pytest.raises(TrainerFailed, match="fault injection is off"):
            refusing.call({"op": "inject-fault", "fault": "nan"})
    finally:
        refusing.close()
    service = TrainerService(tmp_path / "on", DOC, **{SETTINGS_FAULT_INJECTION: True})
    try:
        with pytest.raises(TrainerFailed, match="unknown injected fault"):
            service.call({"op": "inject-fault", "fault": "zero"})
        assert service.call({"op": "inject-fault", "fault": "nan"}) == {"ok": True}
        spoiled = _train(service, 1, weights)
        assert rejection_reason(spoiled["delta"], weights) is not None
        clean = _train(service, 2, weights)  # the next one is sound: only the reply was spoiled
        assert rejection_reason(clean["delta"], weights) is None
    finally:
        service.close()
