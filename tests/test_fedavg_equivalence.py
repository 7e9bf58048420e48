"""FedAvg with τ = 1 and plain SGD is one synchronous SGD step on the example-weighted mean gradient.

Built from the real pieces: a synthetic workload, one LocalTrainer per
datacenter started from the same global weights, FedAvgTau.aggregate on the
deltas. The reference is computed independently: one model at the global
weights, the gradient of the mean loss on the very mini-batches the
datacenters drew (re-drawn with BatchStream and the trainers' seeds), one step
w − lr·g. Also here: the LocalTrainer / BatchStream / weights / state-store
promises the equivalence relies on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from crossdc.clients.local_training import BatchStream, LocalTrainer
from crossdc.clients.state_store import DatacenterStateStore, StateStoreError
from crossdc.strategies.base import ClientUpdate
from crossdc.strategies.fedavg import FedAvgTau
from crossdc.workloads import Workload, WorkloadSpec, load_model_weights, load_workload, model_weights

LR = 0.1
DCS = ["a", "b"]
DC_SEEDS = {"a": 11, "b": 12}
ATOL = 1e-6

pytestmark = pytest.mark.timeout(120)


def make_workload(model: str = "mlp", seed: int = 0) -> Workload:
    spec = WorkloadSpec(dataset="synthetic", model=model, partition={"kind": "iid"}, batch_size=16, optimizer="sgd", lr=LR)
    return load_workload(spec, DCS, seed)


def initial_weights(workload: Workload, seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    return model_weights(workload.make_model())


def make_trainers(workload: Workload, batch_sizes: dict[str, int], optimizer: str = "sgd") -> dict[str, LocalTrainer]:
    return {dc: LocalTrainer(workload, workload.shard(dc), batch_sizes[dc], optimizer, LR, DC_SEEDS[dc]) for dc in DCS}


def fedavg_round(strategy: FedAvgTau, trainers: dict[str, LocalTrainer], weights: dict[str, np.ndarray], tau: int,
                 server_round: int = 1) -> dict[str, np.ndarray]:
    """One FedAvg round as the federation runs it: load global weights, τ local steps, delta, aggregate."""
    updates = []
    for dc, trainer in trainers.items():
        trainer.set_weights(weights)
        result = trainer.train_steps(tau)
        local = trainer.get_weights()
        delta = {name: local[name] - weights[name] for name in weights}
        updates.append(ClientUpdate(dc, delta, num_examples=result.num_examples))
    return strategy.aggregate(server_round, weights, updates, strategy.mean_update(updates))


def sgd_step_on(workload: Workload, weights: dict[str, np.ndarray],
                batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, np.ndarray]:
    """w − lr · ∇ (mean loss over the union of `batches`), computed with its own model and no optimizer."""
    model = workload.make_model()
    load_model_weights(model, weights)
    inputs = torch.cat([b[0] for b in batches])
    targets = torch.cat([b[1] for b in batches])
    loss = workload.loss(model(inputs), targets)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    grad_of = {name: g.detach().numpy().astype(np.float64) for name, g in zip(params, grads, strict=False)}
    assert set(grad_of) == set(weights), "the model has buffers; extend the reference"
    return {name: (weights[name].astype(np.float64) - LR * grad_of[name]).astype(np.float32) for name in weights}


def per_dc_gradient_step(workload: Workload, weights: dict[str, np.ndarray],
                         batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, np.ndarray]:
    return sgd_step_on(workload, weights, [batch])


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b)
    return max(float(np.max(np.abs(a[n].astype(np.float64) - b[n].astype(np.float64)))) for n in a)


def assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float = ATOL) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=atol, err_msg=name)


# -- the key check ------------------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "linear"])
def test_fedavg_tau1_equal_shards_is_one_synchronous_sgd_step(model: str) -> None:
    workload = make_workload(model)
    assert len(workload.shard("a")) == len(workload.shard("b"))
    w0 = initial_weights(workload)
    batch = 16
    trainers = make_trainers(workload, {"a": batch, "b": batch})
    streams = {dc: BatchStream(workload.shard(dc), batch, DC_SEEDS[dc]) for dc in DCS}

    federated = dict(w0)
    synchronous = dict(w0)
    moved = 0.0
    for server_round in range(1, 4):  # several rounds: each one is one synchronous step
        federated = fedavg_round(FedAvgTau(), trainers, federated, tau=1, server_round=server_round)
        batches = [streams[dc].next() for dc in DCS]
        assert all(len(b[0]) == batch for b in batches)
        reference = sgd_step_on(workload, synchronous, batches)
        # the same step written as the average of the two per-datacenter gradients
        a_step = per_dc_gradient_step(workload, synchronous, batches[0])
        b_step = per_dc_gradient_step(workload, synchronous, batches[1])
        averaged = {n: ((a_step[n].astype(np.float64) + b_step[n]) / 2).astype(np.float32) for n in w0}
        assert_close(averaged, reference)
        assert_close(federated, reference)
        moved = max(moved, max_abs_diff(reference, synchronous))
        synchronous = reference
    assert moved > 1e-3  # the step is not trivially zero, so the check has teeth


def test_fedavg_tau1_unequal_batches_weights_by_examples() -> None:
    workload = make_workload("mlp")
    w0 = initial_weights(workload)
    sizes = {"a": 8, "b": 24}  # examples 1 : 3
    trainers = make_trainers(workload, sizes)
    updates, single_steps = [], {}
    for dc, trainer in trainers.items():
        trainer.set_weights(w0)
        result = trainer.train_steps(1)
        assert result.num_examples == sizes[dc]
        local = trainer.get_weights()
        single_steps[dc] = local
        updates.append(ClientUpdate(dc, {n: local[n] - w0[n] for n in w0}, num_examples=result.num_examples))
    fedavg = FedAvgTau()
    federated = fedavg.aggregate(1, w0, updates, fedavg.mean_update(updates))

    # independent: each datacenter's single SGD step from w0 on its own batch ...
    batches = {dc: BatchStream(workload.shard(dc), sizes[dc], DC_SEEDS[dc]).next() for dc in DCS}
    steps = {dc: per_dc_gradient_step(workload, w0, batches[dc]) for dc in DCS}
    for dc in DCS:
        assert_close(single_steps[dc], steps[dc])
    # ... their 1:3 weighted mean ...
    weighted = {n: ((1 * steps["a"][n].astype(np.float64) + 3 * steps["b"][n]) / 4).astype(np.float32) for n in w0}
    assert_close(federated, weighted)
    # ... which is one SGD step on the union of the 32 examples (mean loss over all of them)
    assert_close(federated, sgd_step_on(workload, w0, [batches["a"], batches["b"]]))
    # and the weighting matters: the plain 1:1 mean is measurably different
    unweighted = {n: ((steps["a"][n].astype(np.float64) + steps["b"][n]) / 2).astype(np.float32) for n in w0}
    assert max_abs_diff(federated, unweighted) > 1e-3


def test_fedavg_tau2_differs_from_two_synchronous_steps() -> None:
    workload = make_workload("mlp")
    w0 = initial_weights(workload)
    batch = 16
    trainers = make_trainers(workload, {"a": batch, "b": batch})
    federated = fedavg_round(FedAvgTau(tau=2), trainers, w0, tau=2)

    streams = {dc: BatchStream(workload.shard(dc), batch, DC_SEEDS[dc]) for dc in DCS}
    synchronous = dict(w0)
    for _ in range(2):
        synchronous = sgd_step_on(workload, synchronous, [streams[dc].next() for dc in DCS])

    # the FedAvg result is still the mean of the two local two-step trajectories, computed independently
    local_runs = {}
    for dc in DCS:
        stream = BatchStream(workload.shard(dc), batch, DC_SEEDS[dc])
        w = dict(w0)
        for _ in range(2):
            w = per_dc_gradient_step(workload, w, stream.next())
        local_runs[dc] = w
    mean_local = {n: ((local_runs["a"][n].astype(np.float64) + local_runs["b"][n]) / 2).astype(np.float32) for n in w0}
    assert_close(federated, mean_local)
    # but not two synchronous steps: the second local gradient is taken at a different point
    assert max_abs_diff(federated, synchronous) > 1e-4


# -- the pieces the equivalence relies on ---------------------------------------------


def test_batch_stream_is_deterministic_and_covers_an_epoch() -> None:
    workload = make_workload("linear")
    shard = workload.shard("a")
    s1, s2 = BatchStream(shard, 100, 5), BatchStream(shard, 100, 5)
    seen = []
    for _ in range(len(shard) // 100):
        x1, y1 = s1.next()
        x2, y2 = s2.next()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        seen.append(x1)
    # one epoch: every example exactly once
    epoch = torch.cat(seen)
    assert len(epoch) == len(shard)
    assert len({tuple(row.tolist()) for row in epoch}) == len({tuple(row.tolist()) for row in shard.tensors[0]})
    other = BatchStream(shard, 100, 6).next()[0]
    assert not torch.equal(other, BatchStream(shard, 100, 5).next()[0])


def test_batch_stream_batch_larger_than_dataset_and_state_round_trip() -> None:
    workload = make_workload("linear")
    shard = workload.shard("a")
    big = BatchStream(shard, 10 * len(shard), 0)
    assert len(big.next()[0]) == len(shard)
    s = BatchStream(shard, 64, 3)
    s.next()
    state = s.state_dict()
    expected = [s.next()[0] for _ in range(20)]  # crosses an epoch boundary
    t = BatchStream(shard, 64, 99)
    t.load_state_dict(state)
    for e in expected:
        assert torch.equal(t.next()[0], e)


def test_train_steps_split_equals_one_call() -> None:
    workload = make_workload("mlp")
    w0 = initial_weights(workload)
    one = LocalTrainer(workload, workload.shard("a"), 16, "adamw", 1e-2, 7)
    split = LocalTrainer(workload, workload.shard("a"), 16, "adamw", 1e-2, 7)
    one.set_weights(w0)
    split.set_weights(w0)
    r = one.train_steps(5)
    r1, r2 = split.train_steps(2), split.train_steps(3)
    assert r.steps == 5 and r.num_examples == 80
    assert r1.num_examples + r2.num_examples == 80
    assert_close(one.get_weights(), split.get_weights(), atol=1e-6)
    with pytest.raises(ValueError, match="steps must be ≥ 1"):
        one.train_steps(0)


def test_model_weights_round_trip_and_mismatch_errors() -> None:
    workload = make_workload("linear")
    torch.manual_seed(1)
    model = workload.make_model()
    weights = model_weights(model)
    assert all(v.dtype == np.float32 for v in weights.values())
    weights["linear.weight"][0, 0] = 123.0  # a copy: the model is not touched
    assert float(model.linear.weight.detach()[0, 0]) != 123.0
    load_model_weights(model, weights)
    assert float(model.linear.weight.detach()[0, 0]) == 123.0
    with pytest.raises(ValueError, match="missing"):
        load_model_weights(model, {"linear.weight": weights["linear.weight"]})
    with pytest.raises(ValueError, match="has shape"):
        load_model_weights(model, {**weights, "linear.bias": np.zeros(99, np.float32)})


def test_state_store_round_trip(tmp_path: Path) -> None:
    store = DatacenterStateStore(tmp_path, "run-1", "us-east")
    assert store.load("c_i") is None
    store.save("c_i", {"w": torch.ones(3)}, round=4)
    value, rnd = store.load("c_i")
    assert rnd == 4 and torch.equal(value["w"], torch.ones(3))
    # a new store object (another process, after a restart) sees the same state
    again = DatacenterStateStore(tmp_path, "run-1", "us-east")
    assert again.keys() == ["c_i"]
    store.save("c_i", 7, round=5)
    assert again.load("c_i") == (7, 5)
    assert not list((tmp_path / "run-1" / "us-east").glob("*.tmp"))
    assert DatacenterStateStore(tmp_path, "run-1", "eu-west").load("c_i") is None
    store.delete("c_i")
    assert store.load("c_i") is None and store.keys() == []


def test_state_store_rejects_bad_names_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(StateStoreError, match="invalid run id"):
        DatacenterStateStore(tmp_path, "../x", "a")
    with pytest.raises(StateStoreError, match="invalid datacenter"):
        DatacenterStateStore(tmp_path, "r", "a/b")
    store = DatacenterStateStore(tmp_path, "r", "a")
    for key in ("a b", "./../escape", ".hidden", ""):
        with pytest.raises(StateStoreError, match="invalid state key"):
            store.save(key, 1, round=1)
        with pytest.raises(StateStoreError, match="invalid state key"):
            store.load(key)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing written, inside or outside the store
    (store.directory / "broken.pt").write_bytes(b"not a torch file")
    with pytest.raises(StateStoreError, match="unreadable"):
        store.load("broken")


def test_state_store_save_rejects_a_traversing_key_with_state_store_error(tmp_path: Path) -> None:
    store = DatacenterStateStore(tmp_path, "r", "a")
    with pytest.raises(StateStoreError, match="invalid state key"):
        store.save("../evil", 1, round=1)
