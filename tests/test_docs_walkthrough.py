"""The plug-in walkthrough (docs/writing-plugins.md) runs as written.

Every ```python block of the page is executed in order, in one namespace (so the code on the page is the code under
test); then what it built is checked: the workload and strategy it registered with the decorators, the rounds it
drove with crossdc.testing's in-process federation, and the claims the page makes about them (the default model,
β = 0 and η = 1 is FedAvg exactly, the run check, the reserved tensor group names).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from crossdc.experiment.config import parse_config
from crossdc.strategies.base import RunInfo, StrategyError
from crossdc.strategies.registry import strategy_class, unregister_strategy
from crossdc.testing.inprocess import InProcessFederation
from crossdc.workloads.registry import available_workloads, unregister_workload

PAGE = Path(__file__).resolve().parents[1] / "docs" / "writing-plugins.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)

pytestmark = pytest.mark.timeout(180)


def python_blocks() -> list[str]:
    return BLOCK.findall(PAGE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def walkthrough() -> Iterator[dict[str, Any]]:
    """The page's namespace after running all of its Python blocks; its plug-ins are unregistered afterwards."""
    namespace: dict[str, Any] = {"__name__": "writing_plugins"}
    try:
        for index, block in enumerate(python_blocks()):
            exec(compile(block, f"{PAGE.name}, python block {index + 1}", "exec"), namespace)  # noqa: S102
        yield namespace
    finally:
        unregister_strategy("server-momentum")
        unregister_workload("blobs")


def test_the_page_has_the_walkthrough_blocks() -> None:
    blocks = python_blocks()
    assert len(blocks) == 4
    assert "@register_workload(\"blobs\")" in blocks[0] and "@register_strategy(\"server-momentum\")" in blocks[1]
    assert "InProcessFederation.from_config" in blocks[3]


def test_the_plug_ins_are_registered_by_the_decorators(walkthrough: dict[str, Any]) -> None:
    assert strategy_class("server-momentum") is walkthrough["ServerMomentum"]
    assert available_workloads()["blobs"] is walkthrough["BlobsWorkload"]


def test_the_driven_federation_learns(walkthrough: dict[str, Any]) -> None:
    fed, rounds = walkthrough["fed"], walkthrough["rounds"]
    assert len(rounds) == 4 and all(not r.rejected and len(r.updates) == 3 for r in rounds)
    assert [r.tau for r in rounds] == [5, 5, 5, 5]
    assert walkthrough["loss"] < 0.5 * walkthrough["first_loss"]
    assert walkthrough["accuracy"] >= 0.9 > walkthrough["first_accuracy"]
    assert fed.workload.spec.model == "linear"  # the config left workload.model out: the workload's default
    assert isinstance(fed.strategy, walkthrough["ServerMomentum"]) and fed.strategy.params["momentum"] == 0.5
    assert all(r.bytes_up["dc-a"] > 0 and r.bytes_down["dc-a"] > 0 for r in rounds)
    # the server velocity is what the page's update rule says: v_r = β·v_{r−1} + mean_r, and its norm is logged
    velocity = fed.strategy.velocity
    norm = float(np.sqrt(sum(float(np.sum(v * v)) for v in velocity.values())))
    assert rounds[-1].strategy_metrics["velocity_norm"] == pytest.approx(norm)
    assert fed.strategy.state_dict()["velocity"] is velocity


def _final_weights(walkthrough: dict[str, Any], strategy: str, params: dict[str, Any], root: Path) -> dict[str, np.ndarray]:
    doc = {
        "run": {"rounds": 3, "seed": 1},
        "workload": {"dataset": "blobs", "partition": {"kind": "iid"}, "optimizer": "sgd", "lr": 0.1, "batch_size": 16},
        "strategy": {"name": strategy, "tau": 3, "params": params},
        "datacenters": [{"name": "dc-a"}, {"name": "dc-b"}],
    }
    fed = InProcessFederation.from_config(parse_config(doc), root)
    for _ in range(3):
        assert not fed.run_round().rejected
    return fed.weights


def test_no_momentum_and_unit_lr_is_fedavg_exactly(walkthrough: dict[str, Any], tmp_path: Path) -> None:
    ours = _final_weights(walkthrough, "server-momentum", {"momentum": 0.0, "server_lr": 1.0}, tmp_path / "ours")
    fedavg = _final_weights(walkthrough, "fedavg", {}, tmp_path / "fedavg")
    assert set(ours) == set(fedavg)
    for name in ours:
        np.testing.assert_array_equal(ours[name], fedavg[name])
    moved = _final_weights(walkthrough, "server-momentum", {"momentum": 0.9}, tmp_path / "momentum")
    assert any(not np.array_equal(moved[n], fedavg[n]) for n in fedavg)


def test_the_strategy_refuses_what_the_page_says(walkthrough: dict[str, Any]) -> None:
    cls = walkthrough["ServerMomentum"]
    with pytest.raises(StrategyError, match=r"strategy 'server-momentum' needs at least 2 datacenters, got 1"):
        cls(tau=1, run=RunInfo(("solo",), "sgd", 0.1))
    with pytest.raises(StrategyError, match="momentum"):
        cls(tau=1, params={"momentum": 1.5}, run=RunInfo(("a", "b"), "sgd", 0.1))
    assert "tensor group 'metrics' is a record name the protocol reserves" in walkthrough["clash_error"]
