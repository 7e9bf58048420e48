"""The gossip strategy in-process: its parameters, its reduction to DiLoCo, CHOCO exchanges, cut links and resync."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from crossdc.clients.gossip_replica import DELTA, FULL
from crossdc.strategies.base import RunInfo, StrategyError
from crossdc.strategies.diloco import DiLoCo
from crossdc.strategies.gossip import Gossip
from crossdc.strategies.mixing import consensus_distances
from crossdc.strategies.schedule import TauSchedule
from crossdc.testing.inprocess import InProcessFederation
from crossdc.workloads import WorkloadSpec, load_workload, model_weights

LR = 0.01


def run_info(datacenters: list[str], codecs: tuple[str, ...] = (), rtt_ms: dict[tuple[str, str], float] | None = None,
             optimizer: str = "adamw") -> RunInfo:
    return RunInfo(tuple(datacenters), optimizer, LR, seed=5, rtt_ms=rtt_ms or {}, codecs=codecs)


def federation(strategy: Gossip | DiLoCo, datacenters: list[str], root: Path, codecs: tuple[str, ...] = ()) -> InProcessFederation:
    spec = WorkloadSpec(dataset="synthetic", model="mlp", partition={"kind": "iid"}, batch_size=16, optimizer="adamw", lr=LR)
    workload = load_workload(spec, datacenters, 0)
    torch.manual_seed(0)
    weights = model_weights(workload.make_model())
    seeds = {dc: 11 + i for i, dc in enumerate(datacenters)}
    return InProcessFederation.from_parts(workload, strategy, datacenters, 16, "adamw", LR, seeds, root, weights,
                                          codecs=codecs)


def test_parameters_and_topologies_are_checked_in_one_line() -> None:
    four = ["a", "b", "c", "d"]
    Gossip(tau=4, run=run_info(four))  # the defaults: random pairs, NoLoCo's outer step
    with pytest.raises(StrategyError, match="a ring needs at least 3 datacenters"):
        Gossip(tau=4, params={"topology": "ring"}, run=run_info(["a", "b"]))
    with pytest.raises(StrategyError, match="not doubly stochastic: datacenter 0 would give weight -0.2 to itself"):
        Gossip(tau=4, params={"topology": "ring", "mixing": 0.6}, run=run_info(four))
    with pytest.raises(StrategyError, match="would give weight -0.2 to itself"):  # the triple of 5 random pairs
        Gossip(tau=4, params={"mixing": 0.6}, run=run_info(["a", "b", "c", "d", "e"]))
    with pytest.raises(StrategyError, match="compressed exchanges .* need a fixed topology"):
        Gossip(tau=4, params={"topology": "random-pairs"}, run=run_info(four, codecs=("topk:0.1",)))
    with pytest.raises(StrategyError, match="needs the round-trip times"):
        Gossip(tau=4, params={"topology": "nearest"}, run=run_info(four))
    with pytest.raises(StrategyError, match="must be one of ring, exponential, random-pairs, nearest"):
        Gossip(tau=4, params={"topology": "star"}, run=run_info(four))
    with pytest.raises(StrategyError, match="constant tau"):
        Gossip(tau=TauSchedule(2, 8, 3), run=run_info(four))
    rtts = {(a, b): 10.0 * (i + j + 1) for i, a in enumerate(four) for j, b in enumerate(four) if i < j}
    assert Gossip(tau=4, params={"topology": "nearest"}, run=run_info(four, rtt_ms=rtts)).round_graph(1).size == 4


def test_two_datacenters_with_diloco_outer_settings_are_diloco(tmp_path: Path) -> None:
    """With two datacenters the only pair is everyone: each replica's mix is the mean of both, its pseudo-gradient
    DiLoCo's, and with DiLoCo's outer step (Nesterov, lr 0.7, momentum 0.9) both replicas are DiLoCo's model."""
    dcs = ["a", "b"]
    diloco = federation(DiLoCo(tau=5, run=run_info(dcs)), dcs, tmp_path / "diloco")
    gossip = federation(Gossip(tau=5, params={"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
                               run=run_info(dcs)), dcs, tmp_path / "gossip")
    for _ in range(4):
        diloco.run_round()
        result = gossip.run_round()
        assert result.link_bytes.keys() == {("a", "b"), ("b", "a")}
        for weights in gossip.replica_weights().values():
            for name, value in diloco.weights.items():
                np.testing.assert_allclose(weights[name], value, rtol=0, atol=2e-6)
        assert result.mean_consensus_distance is not None and result.mean_consensus_distance < 1e-5


def test_plain_gossip_keeps_the_replicas_average_and_logs_consensus(tmp_path: Path) -> None:
    """outer lr 1, momentum 0: each replica becomes its mix, so the replicas' average is the average of the trained
    replicas (doubly stochastic mixing) — checked against the trained replicas themselves."""
    dcs = ["a", "b", "c", "d"]
    fed = federation(Gossip(tau=3, params={"topology": "ring", "outer_lr": 1.0, "outer_momentum": 0.0},
                            run=run_info(dcs)), dcs, tmp_path)
    for _ in range(3):
        assert fed.gossip_replicas is None or all(r.inner is None for r in fed.gossip_replicas.values())
        result = fed.run_round()
        assert set(result.consensus_distance) == set(dcs) and result.mean_consensus_distance is not None
        assert len(result.link_bytes) == 8  # a ring of 4: two neighbours each, both ways
    # one more round by hand, to compare the average before and after the mix
    assert fed.gossip_replicas is not None
    trained = [fed.gossip_replicas[dc].train(3) and fed.gossip_replicas[dc].inner for dc in dcs]
    before = consensus_distances(trained)[2]  # type: ignore[arg-type]
    messages = {dc: [fed.gossip_replicas[o].message_for() for o in dcs if o != dc] for dc in dcs}  # all sent, then mixed
    for dc, replica in fed.gossip_replicas.items():
        replica.mix_in(messages[dc])
    after = consensus_distances([fed.gossip_replicas[dc].outer for dc in dcs])[2]
    for name in before:
        np.testing.assert_allclose(after[name], before[name], atol=2e-6)


def test_choco_exchanges_cost_less_and_a_cut_link_is_resynced_in_full(tmp_path: Path) -> None:
    dcs = ["a", "b", "c"]
    codecs = ("topk:0.1",)
    fed = federation(Gossip(tau=3, params={"topology": "ring"}, run=run_info(dcs, codecs=codecs)), dcs, tmp_path, codecs)
    dense = federation(Gossip(tau=3, params={"topology": "ring"}, run=run_info(dcs)), dcs, tmp_path / "dense")
    first, dense_first = fed.run_round(), dense.run_round()
    assert first.link_bytes[("a", "b")] < 0.4 * dense_first.link_bytes[("a", "b")]
    cut = fed.run_round(cut=[("a", "b")])
    assert ("a", "b") not in cut.link_bytes and ("b", "a") not in cut.link_bytes
    assert cut.missing == {"a": {"b": "no message"}, "b": {"a": "no message"}}
    assert fed.gossip_replicas is not None
    a, b = fed.gossip_replicas["a"], fed.gossip_replicas["b"]
    assert b.held_version(0) == 1 and a.versions[0] == 2  # b missed a's round-2 delta
    for replica in fed.gossip_replicas.values():
        replica.train(3)
    assert a.message_for(b.held_version(0)).kind == FULL  # b's copy of a is too old for a delta: a sends it whole
    assert a.message_for(fed.gossip_replicas["c"].held_version(0)).kind == DELTA
    messages = {dc: [fed.gossip_replicas[o].message_for(fed.gossip_replicas[dc].held_version(dcs.index(o)))
                     for o in dcs if o != dc] for dc in dcs}
    for dc, replica in fed.gossip_replicas.items():
        index = dcs.index(dc)
        replica.mix_in(messages[dc])
        assert all(replica.held_version(j) == 3 for j in range(3) if j != index)
    # every datacenter holds the same public copies again
    for j in range(3):
        copies = [fed.gossip_replicas[dc].public_copy(j) for dc in dcs]
        for name in copies[0]:
            assert all(np.array_equal(c[name], copies[0][name]) for c in copies)


def test_a_replica_saved_between_rounds_goes_on_exactly(tmp_path: Path) -> None:
    dcs = ["a", "b", "c"]
    codecs = ("topk:0.2", "int8")

    def make(root: Path) -> InProcessFederation:
        return federation(Gossip(tau=3, params={"topology": "ring"}, run=run_info(dcs, codecs=codecs)), dcs, root, codecs)

    whole, resumed = make(tmp_path / "whole"), make(tmp_path / "resumed")
    for _ in range(2):
        whole.run_round()
        resumed.run_round()
    assert resumed.gossip_replicas is not None
    saved = {dc: replica.state_dict() for dc, replica in resumed.gossip_replicas.items()}
    other = make(tmp_path / "other")
    other.run_round()  # builds replicas (and moves them on), then every one is replaced by the saved state
    assert other.gossip_replicas is not None
    for dc, replica in other.gossip_replicas.items():
        replica.load_state_dict(saved[dc])
    other.server_round = resumed.server_round
    for _ in range(2):
        whole.run_round()
        other.run_round()
    for dc in dcs:
        for name, value in whole.replica_weights()[dc].items():
            assert np.array_equal(other.replica_weights()[dc][name], value), (dc, name)
