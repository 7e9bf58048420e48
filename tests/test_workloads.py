"""Tests of crossdc.workloads: partitioners, the built-in workloads, the registry."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from crossdc.workloads import (
    DigitsWorkload,
    Mnist1dWorkload,
    ShakespeareWorkload,
    SyntheticWorkload,
    WorkloadError,
    WorkloadSpec,
    available_workloads,
    dirichlet_partition,
    evaluate,
    iid_partition,
    load_workload,
    make_optimizer,
    natural_partition,
)
from crossdc.workloads.shakespeare import VOCAB_SIZE, decode, encode, training_windows, validation_windows

DCS4 = ["us-east", "us-west", "eu", "asia"]


def spec(dataset: str = "synthetic", model: str = "mlp", **kwargs: object) -> WorkloadSpec:
    kwargs.setdefault("partition", {"kind": "iid"})
    return WorkloadSpec(dataset=dataset, model=model, **kwargs)  # type: ignore[arg-type]


def shakespeare(partition: dict, datacenters: list[str] = DCS4, seed: int = 0, **model_args: int) -> ShakespeareWorkload:
    w = load_workload(spec("shakespeare", "char-transformer", partition=partition, model_args=model_args), datacenters, seed)
    assert isinstance(w, ShakespeareWorkload)
    return w


def assert_disjoint_cover(parts: list[np.ndarray], n_items: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n_items
    assert np.array_equal(np.sort(joined), np.arange(n_items))
    for p in parts:
        assert np.all(np.diff(p) > 0)  # sorted, no repeats


# -- partitioners ---------------------------------------------------------------


def test_partition_module_does_not_import_torch() -> None:
    code = "import sys, crossdc.workloads.partition; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("n_items", "n_parts", "sizes"), [(10, 3, [4, 3, 3]), (12, 4, [3, 3, 3, 3]), (5, 5, [1] * 5)])
def test_iid_sizes_and_cover(n_items: int, n_parts: int, sizes: list[int]) -> None:
    parts = iid_partition(n_items, n_parts, np.random.default_rng(0))
    assert [len(p) for p in parts] == sizes
    assert_disjoint_cover(parts, n_items)


def test_iid_depends_on_rng_and_rejects_too_many_parts() -> None:
    a = iid_partition(100, 2, np.random.default_rng(1))
    b = iid_partition(100, 2, np.random.default_rng(1))
    c = iid_partition(100, 2, np.random.default_rng(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=False))
    assert not np.array_equal(a[0], c[0])
    with pytest.raises(WorkloadError, match="3 items cannot fill 4 parts"):
        iid_partition(3, 4, np.random.default_rng(0))


def dominant_fraction(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(labels[p]).max() / len(p) for p in parts]))


def test_dirichlet_cover_min_size_and_skew() -> None:
    labels = np.repeat(np.arange(10), 100)
    skewed = dirichlet_partition(labels, 4, 0.05, np.random.default_rng(0), min_size=20)
    even = dirichlet_partition(labels, 4, 100.0, np.random.default_rng(0), min_size=20)
    for parts in (skewed, even):
        assert_disjoint_cover(parts, len(labels))
        assert min(len(p) for p in parts) >= 20
    assert dominant_fraction(labels, skewed) > 0.5
    assert dominant_fraction(labels, even) < 0.2
    again = dirichlet_partition(labels, 4, 0.05, np.random.default_rng(0), min_size=20)
    assert all(np.array_equal(x, y) for x, y in zip(skewed, again, strict=False))


def test_dirichlet_gives_up_with_a_clear_error() -> None:
    labels = np.repeat(np.arange(2), 50)  # 2 classes, tiny alpha: 8 parts cannot all get 10 items
    with pytest.raises(WorkloadError, match="no draw in 20 tries"):
        dirichlet_partition(labels, 8, 0.001, np.random.default_rng(0), min_size=10, max_tries=20)
    with pytest.raises(WorkloadError, match="alpha must be"):
        dirichlet_partition(labels, 2, 0.0, np.random.default_rng(0))
    with pytest.raises(WorkloadError, match="cannot give 11 parts"):
        dirichlet_partition(labels, 11, 1.0, np.random.default_rng(0))


def test_natural_keeps_groups_whole_balanced_and_deterministic() -> None:
    groups = np.array(["a"] * 5 + ["b"] * 4 + ["c"] * 3 + ["d"] * 2 + ["e"] * 1)
    shuffled = np.random.default_rng(0).permutation(len(groups))
    groups = groups[shuffled]
    parts = natural_partition(groups, 2)
    assert_disjoint_cover(parts, len(groups))
    part_groups = [set(groups[p]) for p in parts]
    assert part_groups[0].isdisjoint(part_groups[1])  # no group split
    # greedy, largest first: a->0, b->1, c->1, d->0, e->0 (ties to the lower index)
    assert part_groups == [{"a", "d", "e"}, {"b", "c"}]
    assert [len(p) for p in parts] == [8, 7]
    again = natural_partition(list(groups), 2)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again, strict=False))
    with pytest.raises(WorkloadError, match="6 parts but only 5 groups"):
        natural_partition(groups, 6)


# -- shakespeare ----------------------------------------------------------------


def test_vocabulary_is_fixed() -> None:
    assert VOCAB_SIZE == 97
    ids = encode("Ab ~\né")
    assert ids.tolist() == [33, 66, 0, 94, 95, 96]
    assert decode(ids[:5]) == "Ab ~\n"


def test_shakespeare_natural_gives_each_datacenter_different_plays() -> None:
    w = shakespeare({"kind": "natural"})
    plays = [set(w.plays(dc)) for dc in DCS4]
    assert all(plays)
    for i in range(4):
        for j in range(i + 1, 4):
            assert plays[i].isdisjoint(plays[j])
    assert set().union(*plays) == set(w.play_names) and len(w.play_names) == 37
    sizes = [len(w.shard(dc)) for dc in DCS4]
    assert sum(sizes) == len(w.all_training())
    assert max(sizes) < 1.2 * min(sizes)  # greedy balancing
    x, y = w.shard("eu")[:3]
    assert x.shape == y.shape == (3, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_shakespeare_validation_is_one_fixed_set() -> None:
    reference = shakespeare({"kind": "natural"}).validation()
    assert len(reference) == 256
    for build in (
        lambda: shakespeare({"kind": "iid"}),
        lambda: shakespeare({"kind": "natural"}, datacenters=["solo"]),
        lambda: shakespeare({"kind": "iid"}, datacenters=["x", "y"], seed=7),
    ):
        validation_windows.cache_clear()  # rebuild from the texts, as a fresh process would
        training_windows.cache_clear()
        val = build().validation()
        assert all(torch.equal(a, b) for a, b in zip(reference.tensors, val.tensors, strict=False))


def test_shakespeare_iid_is_even_and_seeded() -> None:
    w = shakespeare({"kind": "iid"}, seed=3)
    sizes = [len(w.shard(dc)) for dc in DCS4]
    assert max(sizes) - min(sizes) <= 1
    assert len(w.plays("eu")) == 37  # every datacenter sees every play
    same = shakespeare({"kind": "iid"}, seed=3)
    other = shakespeare({"kind": "iid"}, seed=4)
    assert torch.equal(w.shard("eu").tensors[0], same.shard("eu").tensors[0])
    assert not torch.equal(w.shard("eu").tensors[0], other.shard("eu").tensors[0])


def test_char_transformer_shapes_causality_and_initial_loss() -> None:
    w = shakespeare({"kind": "natural"}, seq_len=32, d_model=32, heads=2, layers=1)
    torch.manual_seed(0)
    model = w.make_model()
    x, y = w.validation()[:8]
    assert x.shape == (8, 32)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (8, 32, VOCAB_SIZE)
    assert abs(w.loss(logits, y).item() - math.log(VOCAB_SIZE)) < 0.1
    changed = x.clone()
    changed[:, 20:] = 7
    with torch.no_grad():
        for mode in (True, False):
            model.train(mode)
            assert torch.allclose(model(x)[:, :20], model(changed)[:, :20], atol=1e-5)
    assert "causal_mask" not in model.state_dict()
    torch.manual_seed(0)
    twin = w.make_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=False))


def test_shakespeare_bad_specs() -> None:
    with pytest.raises(WorkloadError, match="40 datacenters but only 37 plays"):
        shakespeare({"kind": "natural"}, datacenters=[f"dc{i}" for i in range(40)])
    with pytest.raises(WorkloadError, match=r"unknown model_args key 'width'.*known: d_model, heads, layers, seq_len"):
        shakespeare({"kind": "natural"}, width=3)
    with pytest.raises(WorkloadError, match="divisible by heads"):
        shakespeare({"kind": "natural"}, d_model=30, heads=4)
    with pytest.raises(WorkloadError, match=r"unknown partition kind 'dirichlet'.*known: iid, natural"):
        shakespeare({"kind": "dirichlet", "alpha": 0.5})


# -- classification workloads ---------------------------------------------------


def test_synthetic_shards_are_deterministic_and_cover() -> None:
    s = spec(partition={"kind": "dirichlet", "alpha": 0.3})
    a = SyntheticWorkload(s, DCS4, seed=5)
    b = SyntheticWorkload(s, DCS4, seed=5)
    c = SyntheticWorkload(s, DCS4, seed=6)
    for dc in DCS4:
        assert all(torch.equal(x, y) for x, y in zip(a.shard(dc).tensors, b.shard(dc).tensors, strict=False))
    assert any(len(a.shard(dc)) != len(c.shard(dc)) for dc in DCS4)
    assert_disjoint_cover([a.shard_indices(dc) for dc in DCS4], len(a.all_training()))
    assert len(a.all_training()) == 2000 and len(a.validation()) == 400
    assert all(torch.equal(x, y) for x, y in zip(a.validation().tensors, c.validation().tensors, strict=False))
    inputs, targets = a.all_training().tensors
    idx = torch.from_numpy(a.shard_indices("eu").copy())
    assert torch.equal(a.shard("eu").tensors[0], inputs[idx])


def test_synthetic_model_trains_and_evaluate_is_bounded() -> None:
    w = SyntheticWorkload(spec(model="linear", optimizer="sgd", lr=0.5), ["only"], seed=0)
    torch.manual_seed(0)
    model = w.make_model()
    loss0, acc0 = evaluate(w, model, batch_size=64)
    assert 0.0 <= acc0 <= 1.0 and loss0 > 0
    assert model.training  # evaluate restores the mode
    x, y = w.shard("only").tensors
    opt = make_optimizer(w.spec.optimizer, model.parameters(), w.spec.lr)
    for _ in range(50):
        opt.zero_grad()
        w.loss(model(x), y).backward()
        opt.step()
    loss1, acc1 = evaluate(w, model)
    assert loss1 < loss0 and 0.6 < acc1 <= 1.0


def test_digits_and_mnist1d() -> None:
    digits = DigitsWorkload(spec("digits", partition={"kind": "dirichlet", "alpha": 1.0}), DCS4, seed=0)
    x, y = digits.validation().tensors
    assert x.shape == (360, 64) and len(digits.all_training()) == 1437
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert np.bincount(y.numpy()).min() >= 35  # stratified
    torch.manual_seed(0)
    assert digits.make_model()(x[:5]).shape == (5, 10)

    np.random.seed(123)
    before = np.random.random()
    np.random.seed(123)
    m1d = Mnist1dWorkload(spec("mnist1d", "cnn1d", model_args={"channels": 8}), DCS4, seed=0)
    assert np.random.random() == before  # global numpy RNG left alone
    vx, vy = m1d.validation().tensors
    assert vx.shape == (1000, 40) and len(m1d.all_training()) == 4000
    assert [len(m1d.shard(dc)) for dc in DCS4] == [1000] * 4
    torch.manual_seed(0)
    model = m1d.make_model()
    assert model(vx[:5]).shape == (5, 10)
    loss, acc = evaluate(m1d, model)
    assert 0.0 <= acc <= 1.0 and abs(loss - math.log(10)) < 0.5


# -- errors, registry, optimizers ------------------------------------------------


def test_registry_lists_the_builtins() -> None:
    found = available_workloads()
    assert list(found) == ["digits", "mnist1d", "shakespeare", "synthetic"]
    assert found["synthetic"] is SyntheticWorkload


@pytest.mark.parametrize(
    ("the_spec", "message"),
    [
        (spec("imagenet"), "unknown dataset 'imagenet'; known: digits, mnist1d, shakespeare, synthetic"),
        (spec(model="resnet"), "unknown model 'resnet' for dataset 'synthetic'; known: linear, mlp"),
        (spec(partition={"kind": "natural"}), "unknown partition kind 'natural' for dataset 'synthetic'; known: dirichlet, iid"),
        (spec(partition={"kind": "dirichlet"}), "needs alpha"),
        (spec(partition={"kind": "dirichlet", "alpha": 0}), "alpha must be a finite number > 0"),
        (spec(partition={"kind": "dirichlet", "alpha": -1.0}), "alpha must be a finite number > 0"),
        (spec(partition={"kind": "iid", "alpha": 1.0}), "only applies to kind 'dirichlet'"),
        (spec(partition={"kind": "iid", "beta": 1}), "unknown partition key 'beta'"),
        (spec(model="linear", model_args={"hidden": 3}), "unknown model_args key 'hidden' for model 'linear'"),
        (spec(model_args={"hidden": 0}), "must be a positive integer"),
        (spec(optimizer="lamb"), "unknown optimizer 'lamb'; known: adamw, momentum, sgd"),
        (spec(lr=0.0), "lr must be"),
    ],
)
def test_bad_specs_raise_workload_error(the_spec: WorkloadSpec, message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        load_workload(the_spec, DCS4, seed=0)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_datacenters_and_seed() -> None:
    with pytest.raises(WorkloadError, match="at least one datacenter"):
        load_workload(spec(), [], 0)
    with pytest.raises(WorkloadError, match="repeated: a"):
        load_workload(spec(), ["a", "b", "a"], 0)
    with pytest.raises(WorkloadError, match="seed must be"):
        load_workload(spec(), ["a"], -1)
    w = load_workload(spec(), ["a", "b"], 0)
    with pytest.raises(WorkloadError, match="unknown datacenter 'c'; known: a, b"):
        w.shard("c")


def test_make_optimizer() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = make_optimizer("sgd", params, 0.1)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0
    assert make_optimizer("momentum", params, 0.1).defaults["momentum"] == 0.9
    adamw = make_optimizer("adamw", params, 0.1)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["weight_decay"] == 0.01
    with pytest.raises(ValueError, match="unknown optimizer 'adam'; known: adamw, momentum, sgd"):
        make_optimizer("adam", params, 0.1)
