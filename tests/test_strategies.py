"""FedProx, SCAFFOLD, DiLoCo and the strategy registry.

- the pure maths (aggregation.py) on small exact cases, and torch's Nesterov SGD as the reference;
- each strategy's server step through `aggregate` on hand-computed cases;
- the contract's failure modes: a reply without SCAFFOLD's `control` group is rejected by the gate;
- on least-squares problems with a known optimum, driven round by round with the real datacenter code
  (LocalTrainer + run_local_round, the persistent trainer's own round) and the strategies' aggregation:
  FedAvg with τ > 1 stays measurably away from the optimum, SCAFFOLD reaches it, FedProx moves towards it
  as μ grows, and μ = 0 / (outer lr 1, momentum 0) are exactly FedAvg;
- registration by decorator for strategies and workloads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord, RecordDict
from torch import nn
from torch.utils.data import TensorDataset

from crossdc.experiment.builders import build_strategy
from crossdc.experiment.config import parse_config
from crossdc.federation.grid_io import Reply
from crossdc.federation.update_gate import GateRules, judge_reply
from crossdc.protocol import CONTROL_KEY, METRICS_KEY, encode_tensors
from crossdc.strategies.aggregation import mean, nesterov_sgd_step, scaffold_client_control, scaffold_server_step
from crossdc.strategies.base import LOOPS, ClientUpdate, Parameter, RunInfo, Strategy, StrategyError
from crossdc.strategies.diloco import DiLoCo
from crossdc.strategies.fedavg import FedAvgTau
from crossdc.strategies.fedprox import FedProx, proximal_term
from crossdc.strategies.registry import available_strategies, describe_strategies, register_strategy, strategy_class, unregister_strategy
from crossdc.strategies.scaffold import Scaffold
from crossdc.strategies.schedule import TauSchedule
from crossdc.testing.inprocess import InProcessFederation
from crossdc.workloads import Workload, WorkloadSpec, load_workload
from crossdc.workloads.registry import register_workload, unregister_workload

pytestmark = pytest.mark.timeout(300)


def built(cls: type[Strategy], params: dict | None = None, datacenters: int = 4, optimizer: str = "sgd", lr: float = 0.1) -> Strategy:
    return cls(params=params, run=RunInfo(tuple(f"dc-{i}" for i in range(datacenters)), optimizer, lr))


def aggregate(strategy: Strategy, server_round: int, weights: dict, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
    """The server step as the round loop takes it: the mean update computed once, handed to aggregate."""
    return strategy.aggregate(server_round, weights, updates, strategy.mean_update(updates))


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# -- pure functions, exact small cases ---------------------------------------------------------------


def test_mean_is_unweighted() -> None:
    out = mean([{"w": arr(1, 2)}, {"w": arr(3, 6)}, {"w": arr(5, 1)}])
    np.testing.assert_array_equal(out["w"], arr(3, 3))


def test_scaffold_client_control_option_ii() -> None:
    # c_i⁺ = c_i − c + (x − y)/(K·η): 1 − 0.5 + (3 − 1)/(2·0.5) = 2.5; a buffer keeps 0
    out = scaffold_client_control({"w": arr(1), "buf": arr(7)}, {"w": arr(0.5), "buf": arr(7)},
                                  {"w": arr(3), "buf": arr(2)}, {"w": arr(1), "buf": arr(9)}, steps=2, lr=0.5,
                                  trainable={"w"})
    np.testing.assert_array_equal(out["w"], arr(2.5))
    np.testing.assert_array_equal(out["buf"], arr(0))
    with pytest.raises(ValueError):
        scaffold_client_control({"w": arr(1)}, {"w": arr(1)}, {"w": arr(1)}, {"w": arr(1)}, steps=0, lr=0.5)


def test_scaffold_client_control_with_sgd_is_the_mean_raw_gradient() -> None:
    # K SGD steps on g_k − c_i + c from x: y = x − η Σ (g_k − c_i + c)  ⇒  c_i⁺ = mean_k g_k
    rng = np.random.default_rng(0)
    x, c, c_i = (rng.normal(size=5).astype(np.float32) for _ in range(3))
    grads = rng.normal(size=(4, 5)).astype(np.float32)
    lr, y = 0.1, x.astype(np.float64)
    for g in grads:
        y = y - lr * (g - c_i + c)
    out = scaffold_client_control({"w": c_i}, {"w": c}, {"w": x}, {"w": y.astype(np.float32)}, steps=4, lr=lr)
    np.testing.assert_allclose(out["w"], grads.astype(np.float64).mean(axis=0), atol=2e-5)


def test_scaffold_server_step() -> None:
    # x ← x + η_g·mean Δy = 1 + 0.5·2 = 2;  c ← c + |S|/N·mean Δc = 0 + (1/4)·4 = 1
    x, c = scaffold_server_step({"w": arr(1)}, {"w": arr(0)}, {"w": arr(2)}, {"w": arr(4)}, 0.5, participants=1, datacenters=4)
    np.testing.assert_array_equal(x["w"], arr(2))
    np.testing.assert_array_equal(c["w"], arr(1))
    with pytest.raises(ValueError):
        scaffold_server_step({"w": arr(1)}, {"w": arr(0)}, {"w": arr(2)}, {"w": arr(4)}, 1.0, participants=5, datacenters=4)


def test_nesterov_two_steps_by_hand() -> None:
    # lr 0.1, μ 0.9.  step 1, g = 1:   b = 1,                 d = 1 + 0.9·1 = 1.9,      p = 1 − 0.19 = 0.81
    #                 step 2, g = 0.5: b = 0.9·1 + 0.5 = 1.4, d = 0.5 + 0.9·1.4 = 1.76, p = 0.81 − 0.176 = 0.634
    p, b = nesterov_sgd_step({"w": arr(1)}, {"w": arr(1)}, None, lr=0.1, momentum=0.9)
    assert b["w"][0] == pytest.approx(1.0) and p["w"][0] == pytest.approx(0.81, abs=1e-7)
    p, b = nesterov_sgd_step(p, {"w": arr(0.5)}, b, lr=0.1, momentum=0.9)
    assert b["w"][0] == pytest.approx(1.4, abs=1e-7) and p["w"][0] == pytest.approx(0.634, abs=1e-7)
    # without Nesterov: d = b
    p, _ = nesterov_sgd_step({"w": arr(1)}, {"w": arr(1)}, {"w": arr(2)}, lr=0.1, momentum=0.5, nesterov=False)
    assert p["w"][0] == pytest.approx(1 - 0.1 * (0.5 * 2 + 1), abs=1e-7)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_nesterov_matches_torch_sgd(momentum: float) -> None:
    rng = np.random.default_rng(1)
    p0 = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    tensors = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in p0.items()}
    opt = torch.optim.SGD(list(tensors.values()), lr=0.7, momentum=momentum, nesterov=momentum > 0)
    params, buf = p0, None
    for _ in range(5):
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in p0.items()}
        for k, t in tensors.items():
            t.grad = torch.tensor(grads[k])
        opt.step()
        params, buf = nesterov_sgd_step(params, grads, buf, lr=0.7, momentum=momentum)
        for k, t in tensors.items():
            np.testing.assert_allclose(params[k], t.detach().numpy(), rtol=1e-6, atol=1e-6)


# -- the strategies' server step on hand-computed cases ------------------------------------------------


def updates_of(*pairs: tuple[float, int], control: list[float] | None = None) -> list[ClientUpdate]:
    return [ClientUpdate(f"dc-{i}", {"w": arr(d)}, n, {}, {} if control is None else {CONTROL_KEY: {"w": arr(control[i])}})
            for i, (d, n) in enumerate(pairs)]


def test_diloco_two_outer_steps_by_hand() -> None:
    s = built(DiLoCo, {"outer_lr": 0.7, "outer_momentum": 0.9}, optimizer="adamw")
    # mean Δy weighted 1:3 of −1 and −3 = −2.5  ⇒  g = 2.5; b = 2.5; d = 2.5 + 0.9·2.5 = 4.75; x = 1 − 0.7·4.75 = −2.325
    x = aggregate(s, 1, {"w": arr(1)}, updates_of((-1, 1), (-3, 3)))
    assert x["w"][0] == pytest.approx(-2.325, abs=1e-6)
    saved = json.loads(json.dumps({k: {n: a.tolist() for n, a in v.items()} if isinstance(v, dict) else v
                                   for k, v in s.state_dict().items()}))
    # g = −1; b = 0.9·2.5 − 1 = 1.25; d = −1 + 0.9·1.25 = 0.125; x = −2.325 − 0.7·0.125 = −2.4125
    x2 = aggregate(s, 2, x, updates_of((1, 1), (1, 1)))
    assert x2["w"][0] == pytest.approx(-2.4125, abs=1e-6)
    # the outer optimizer's state is checkpointable: a fresh strategy restored from it takes the same step
    restored = built(DiLoCo, {"outer_lr": 0.7, "outer_momentum": 0.9}, optimizer="adamw")
    restored.load_state_dict({"outer_steps": saved["outer_steps"],
                              "momentum_buffer": {n: np.array(v, np.float32) for n, v in saved["momentum_buffer"].items()}})
    np.testing.assert_array_equal(aggregate(restored, 2, x, updates_of((1, 1), (1, 1)))["w"], x2["w"])
    assert restored.round_metrics(2, [])["outer_steps"] == 2


def test_diloco_outer_lr_1_momentum_0_is_fedavg_exactly() -> None:
    rng = np.random.default_rng(2)
    diloco = built(DiLoCo, {"outer_lr": 1.0, "outer_momentum": 0.0}, optimizer="adamw")
    fedavg = FedAvgTau()
    x_d = x_f = {"w": rng.normal(size=(4, 3)).astype(np.float32)}
    for r in range(1, 6):
        updates = [ClientUpdate(f"dc-{i}", {"w": rng.normal(size=(4, 3)).astype(np.float32)}, int(rng.integers(1, 9))) for i in range(3)]
        x_d, x_f = aggregate(diloco, r, x_d, updates), aggregate(fedavg, r, x_f, updates)
        np.testing.assert_array_equal(x_d["w"], x_f["w"])


def test_scaffold_aggregate_and_state() -> None:
    s = built(Scaffold, {"global_lr": 0.5}, datacenters=4)
    x0 = {"w": arr(1)}
    assert s.client_arrays(1, x0)[CONTROL_KEY]["w"][0] == 0  # c starts at 0
    # 2 of N = 4 replied: x = 1 + 0.5·mean(2, 4) = 2.5; c = 0 + (2/4)·mean(1, 3) = 1
    x = aggregate(s, 1, x0, updates_of((2, 10), (4, 10), control=[1, 3]))
    assert x["w"][0] == pytest.approx(2.5) and s.control["w"][0] == pytest.approx(1.0)
    np.testing.assert_array_equal(s.client_arrays(2, x)[CONTROL_KEY]["w"], arr(1))
    state = s.state_dict()
    fresh = built(Scaffold, datacenters=4)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(fresh.control["w"], arr(1))
    with pytest.raises(StrategyError, match="no tensor group 'control'"):
        aggregate(s, 2, x, updates_of((2, 10)))


def test_a_reply_without_the_control_group_is_rejected_by_the_gate() -> None:
    weights = {"w": np.zeros((2, 2), np.float32)}
    metrics = MetricRecord({"num-examples": 4, "compute-s": 0.0, "train-loss": 1.0})

    def judged(content: RecordDict) -> Any:
        reply = Reply(SimpleNamespace(has_error=lambda: False, content=content), received_at=1.0)  # type: ignore[arg-type]
        return judge_reply(reply, "us-east", weights, tau=1, pushed_at=0.0, timeout_reason="",
                           rules=GateRules(batch_size=4, reply_groups=(CONTROL_KEY,))).record

    without = judged(RecordDict({**encode_tensors(weights), METRICS_KEY: metrics}))
    assert without.status == "rejected" and "no tensor group 'control'" in without.reason
    bad = judged(RecordDict({**encode_tensors(weights), **encode_tensors({"w": np.full((2, 2), np.nan, np.float32)}, CONTROL_KEY),
                             METRICS_KEY: metrics}))
    assert bad.status == "rejected" and "tensor group 'control'" in bad.reason and "NaN" in bad.reason
    good = judged(RecordDict({**encode_tensors(weights), **encode_tensors(weights, CONTROL_KEY), METRICS_KEY: metrics}))
    assert good.status == "ok"


def test_proximal_term_value_and_gradient() -> None:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, -1.0]]))
    anchor = {"weight": torch.tensor([[1.0, 1.0]])}
    term = proximal_term(model, anchor, mu=0.5)
    assert float(term.detach()) == pytest.approx(0.25 * (4 + 4))  # (μ/2)·‖(2, −2)‖²
    term.backward()
    np.testing.assert_allclose(model.weight.grad.numpy(), [[1.0, -1.0]])  # μ·(w − w_g)


def test_construction_checks_the_inner_optimizer() -> None:
    with pytest.raises(StrategyError, match="strategy 'scaffold' needs workload.optimizer = \"sgd\""):
        built(Scaffold, optimizer="adamw")
    with pytest.raises(StrategyError, match="strategy 'diloco' needs workload.optimizer = \"adamw\""):
        built(DiLoCo, optimizer="sgd")
    with pytest.raises(StrategyError, match="strategy 'fedprox' parameter 'mu' must be ≥ 0"):
        FedProx(params={"mu": -1})
    with pytest.raises(StrategyError, match="strategy 'diloco' parameter 'outer_lr' must be float, got str"):
        DiLoCo(params={"outer_lr": "fast"})
    with pytest.raises(StrategyError, match="strategy 'scaffold' was built without a run"):
        _ = Scaffold().num_datacenters


def test_construction_is_by_keyword_and_complete() -> None:
    with pytest.raises(TypeError):
        FedAvgTau(1, 1, 0)  # type: ignore[misc]
    s = FedProx(tau=TauSchedule(1, 8, 3), params={"mu": 0.5}, run=RunInfo(("a", "b"), "sgd", 0.1),
                robust_aggregation="trimmed_mean", trim_fraction=0.1)
    assert (s.params, s.num_datacenters, s.robust_aggregation, s.trim_fraction) == ({"mu": 0.5}, 2, "trimmed_mean", 0.1)
    assert [s.tau(r) for r in range(1, 5)] == [1, 3, 6, 8]
    assert FedAvgTau().tau(7) == 1 and FedAvgTau(tau=5).tau(1) == 5 == FedAvgTau(tau=TauSchedule(5, 5)).tau(3)
    assert FedAvgTau.loop == "sync" and FedProx.loop == "sync" and Scaffold.loop == "sync" and DiLoCo.loop == "sync"


def test_setup_is_the_one_hook_for_state() -> None:
    class Counting(Strategy):
        name = "counting"

        def setup(self) -> None:
            self.seen: list[int] = [len(self.run.datacenters) if self.run else 0]

    assert Counting(run=RunInfo(("a", "b", "c"), "sgd", 0.1)).seen == [3] and Counting().seen == [0]


@pytest.mark.parametrize("attribute, group", [("reply_groups", "arrays"), ("reply_groups", "metrics"),
                                              ("client_groups", "config"), ("client_groups", "layout"),
                                              ("reply_groups", "compressed"), ("client_groups", "downlink"),
                                              ("reply_groups", "metrics-layout"), ("client_groups", "control-layout")])
def test_a_tensor_group_may_not_take_a_reserved_record_name(attribute: str, group: str) -> None:
    groups = ("control", group) if group == "control-layout" else (group,)
    with pytest.raises(StrategyError, match=f"strategy class Clash: tensor group '{group}' is a record name the protocol reserves"):
        type("Clash", (Strategy,), {"name": "clash", attribute: groups})
    type("Fine", (Strategy,), {"name": "fine", attribute: ("momentum",)})  # any other name is fine


def test_an_unknown_loop_is_refused_at_class_definition() -> None:
    assert LOOPS == ("sync", "async", "streaming", "gossip", "pipeline")
    with pytest.raises(StrategyError, match="strategy class Ring: unknown loop 'ring-allreduce'; known: sync, async, "
                                            "streaming, gossip, pipeline"):
        type("Ring", (Strategy,), {"name": "ring", "loop": "ring-allreduce"})


# -- a least-squares problem with a known optimum, on the real datacenter code ------------------------

FEATURES = 4
POINTS = 16  # per datacenter: one full batch
LSQ_DATACENTERS = ["dc-a", "dc-b", "dc-c"]


class LeastSquares(Workload):
    """Datacenter i holds (A_i, b_i) with its own linear target; loss ½·mean (a·w − b)². Global optimum known."""

    models: ClassVar[tuple[str, ...]] = ("linear",)
    partitions: ClassVar[tuple[str, ...]] = ("natural",)

    def __init__(self, spec: WorkloadSpec, datacenters: list[str], seed: int) -> None:
        super().__init__(spec, datacenters, seed)
        rng = np.random.default_rng(7)
        self.data: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for i, dc in enumerate(self.datacenters):
            scale = np.array([1.0, 0.6, 1.4, 0.8]) * (1 + 0.5 * i)  # different curvature per datacenter
            a = (rng.normal(size=(POINTS, FEATURES)) * scale).astype(np.float32)
            target = rng.normal(size=FEATURES) * 3  # different optimum per datacenter
            self.data[dc] = (a, (a @ target + 0.1 * rng.normal(size=POINTS)).astype(np.float32))

    def shard(self, datacenter: str) -> TensorDataset:
        a, b = self.data[datacenter]
        return TensorDataset(torch.from_numpy(a), torch.from_numpy(b))

    def validation(self) -> TensorDataset:
        return self.all_training()

    def all_training(self) -> TensorDataset:
        return TensorDataset(*(torch.cat([self.shard(dc).tensors[k] for dc in self.datacenters]) for k in (0, 1)))

    def make_model(self) -> nn.Module:
        return nn.Linear(FEATURES, 1, bias=False)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return 0.5 * torch.mean((logits.squeeze(-1) - targets) ** 2)

    def optimum(self) -> np.ndarray:
        """argmin_w Σ_i ½·mean_i (a·w − b)² (equal weights: every datacenter sees the same examples per round)."""
        h = sum(a.T.astype(np.float64) @ a / len(a) for a, _ in self.data.values())
        g = sum(a.T.astype(np.float64) @ b / len(a) for a, b in self.data.values())
        return np.linalg.solve(h, g)


@pytest.fixture
def lsq_workload() -> Iterator[Workload]:
    register_workload("lsq-test")(LeastSquares)
    try:
        spec = WorkloadSpec(dataset="lsq-test", model="linear", partition={"kind": "natural"}, batch_size=POINTS, optimizer="sgd", lr=0.05)
        yield load_workload(spec, LSQ_DATACENTERS, 0)
    finally:
        unregister_workload("lsq-test")


def drive(workload: Workload, cls: type[Strategy], tau: int, rounds: int, root: Path, params: dict | None = None,
          optimizer: str = "sgd", lr: float = 0.05) -> InProcessFederation:
    strategy = cls(tau=tau, params=params, run=RunInfo(tuple(LSQ_DATACENTERS), optimizer, lr))
    weights = {"weight": np.zeros((1, FEATURES), np.float32)}
    fed = InProcessFederation.from_parts(workload, strategy, LSQ_DATACENTERS, POINTS, optimizer, lr,
                              {dc: 10 + i for i, dc in enumerate(LSQ_DATACENTERS)}, root, weights)
    for _ in range(rounds):
        result = fed.run_round()
        assert not result.rejected, result.rejected
    return fed


def distance(fed: InProcessFederation, optimum: np.ndarray) -> float:
    return float(np.linalg.norm(fed.weights["weight"].ravel().astype(np.float64) - optimum))


def test_scaffold_reaches_the_optimum_where_fedavg_does_not(lsq_workload: LeastSquares, tmp_path: Path) -> None:
    optimum = lsq_workload.optimum()
    tau, rounds = 10, 150
    fedavg = distance(drive(lsq_workload, FedAvgTau, tau, rounds, tmp_path / "fedavg"), optimum)
    scaffold_fed = drive(lsq_workload, Scaffold, tau, rounds, tmp_path / "scaffold")
    scaffold = distance(scaffold_fed, optimum)
    assert np.linalg.norm(optimum) > 1.0
    assert scaffold < 1e-4, scaffold
    assert fedavg > 0.05, fedavg  # FedAvg's fixed point is biased: measurably away, not slowly converging
    assert fedavg > 1000 * scaffold
    # FedAvg has converged to its fixed point (it is a bias, not slowness): 50 more rounds change nothing
    more = distance(drive(lsq_workload, FedAvgTau, tau, rounds + 50, tmp_path / "fedavg-more"), optimum)
    assert more == pytest.approx(fedavg, rel=1e-3)
    # the server's c is the mean of the datacenters' stored c_i (every datacenter replied every round)
    stored = [scaffold_fed.stores[dc].load("scaffold-control") for dc in LSQ_DATACENTERS]
    assert all(s is not None and s[1] == rounds for s in stored)
    np.testing.assert_allclose(scaffold_fed.strategy.control["weight"], mean([s[0] for s in stored])["weight"], atol=1e-5)


def test_fedprox_moves_the_fixed_point_towards_the_optimum(lsq_workload: LeastSquares, tmp_path: Path) -> None:
    optimum = lsq_workload.optimum()
    tau = 10
    fedavg = drive(lsq_workload, FedAvgTau, tau, 150, tmp_path / "fedavg")
    distances = {}
    for mu, rounds in ((0.0, 150), (1.0, 150), (4.0, 150), (16.0, 400)):  # a larger μ takes smaller steps: more rounds
        fed = drive(lsq_workload, FedProx, tau, rounds, tmp_path / f"mu-{mu}", {"mu": mu})
        distances[mu] = distance(fed, optimum)
        if mu == 0.0:  # μ = 0 is exactly FedAvg
            np.testing.assert_array_equal(fed.weights["weight"], fedavg.weights["weight"])
    assert distances[0.0] > distances[1.0] > distances[4.0] > distances[16.0], distances
    assert distances[16.0] < 0.4 * distances[0.0], distances
    # these are fixed points, not snapshots of a slow descent: 50 more rounds at μ = 4 change nothing
    longer = distance(drive(lsq_workload, FedProx, tau, 200, tmp_path / "mu-4-longer", {"mu": 4.0}), optimum)
    assert longer == pytest.approx(distances[4.0], rel=1e-3)


def test_diloco_momentum_0_lr_1_is_fedavg_on_the_real_client_code(lsq_workload: LeastSquares, tmp_path: Path) -> None:
    fedavg = drive(lsq_workload, FedAvgTau, 5, 4, tmp_path / "fedavg", optimizer="adamw")
    diloco = drive(lsq_workload, DiLoCo, 5, 4, tmp_path / "diloco", {"outer_lr": 1.0, "outer_momentum": 0.0}, optimizer="adamw")
    np.testing.assert_array_equal(diloco.weights["weight"], fedavg.weights["weight"])
    # the inner AdamW's moments carry over between rounds in each datacenter's state store
    state, stored_round = diloco.stores["dc-a"].load("local-trainer")
    assert stored_round == 4 and state["optimizer"]["state"][0]["step"] == 20


def test_a_datacenter_that_misses_a_round_keeps_its_control_variate(lsq_workload: LeastSquares, tmp_path: Path) -> None:
    fed = drive(lsq_workload, Scaffold, 3, 2, tmp_path)
    before = fed.stores["dc-c"].load("scaffold-control")
    result = fed.run_round(participants=["dc-a", "dc-b"])
    assert [u.datacenter for u in result.updates] == ["dc-a", "dc-b"]
    after = fed.stores["dc-c"].load("scaffold-control")
    assert after is not None and before is not None and after[1] == before[1] == 2
    np.testing.assert_array_equal(after[0]["weight"], before[0]["weight"])
    assert fed.stores["dc-a"].load("scaffold-control")[1] == 3
    # and the next time it trains, it starts from that c_i (it reports the round its c_i came from)
    metrics = {u.datacenter: u.metrics for u in fed.run_round().updates}
    assert metrics["dc-c"]["control-state-round"] == 2 and metrics["dc-a"]["control-state-round"] == 3


# -- registration -----------------------------------------------------------------------------------


def test_builtins_are_found_through_entry_points() -> None:
    strategies = available_strategies()
    assert {"fedavg": FedAvgTau, "fedprox": FedProx, "scaffold": Scaffold, "diloco": DiLoCo}.items() <= strategies.items()
    rows = {row["name"]: row for row in describe_strategies()}
    assert rows["scaffold"]["source"] == "built-in" and rows["scaffold"]["parameters"]["global_lr"]["type"] == "float"
    assert rows["diloco"]["parameters"]["outer_lr"]["default"] == 0.7


def test_decorator_registers_a_strategy_for_this_process() -> None:
    @register_strategy("half-step")
    class HalfStep(Strategy):
        """FedAvg with half the mean update."""

        parameters = {"factor": Parameter(float, 0.5, "fraction of the mean update", low=0.0, high=1.0)}

        def aggregate(self, server_round, global_weights, updates, mean):  # type: ignore[no-untyped-def]
            return {n: global_weights[n] + self.params["factor"] * mean[n] for n in global_weights}

    try:
        assert strategy_class("half-step") is HalfStep and HalfStep.name == "half-step"
        row = next(r for r in describe_strategies() if r["name"] == "half-step")
        assert row["source"] == "plug-in" and row["summary"] == "FedAvg with half the mean update."
        config = parse_config({"run": {"rounds": 1}, "workload": {"dataset": "synthetic", "model": "linear"},
                               "strategy": {"name": "half-step", "params": {"factor": 0.25}}, "datacenters": [{"name": "a"}]})
        assert build_strategy(config).params == {"factor": 0.25}
        with pytest.raises(StrategyError, match="strategy 'half-step' parameter 'factor' must be ≤ 1"):
            HalfStep(params={"factor": 2})
        with pytest.raises(StrategyError, match="strategy name 'fedavg' is already registered"):
            register_strategy("fedavg")(HalfStep)
    finally:
        unregister_strategy("half-step")
    with pytest.raises(StrategyError, match="unknown strategy 'half-step'"):
        strategy_class("half-step")
