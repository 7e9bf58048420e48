"""Streaming DiLoCo's maths on exact cases (fragments, schedule, merge, eager stand-in) and its in-process runs:
with one fragment, no overlap, α = 0 and eager off it is DiLoCo, weight for weight."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from crossdc.clients.streaming_replica import StreamingReplica
from crossdc.strategies.base import RunInfo, StrategyError
from crossdc.strategies.diloco import DiLoCo
from crossdc.strategies.fragments import (
    MERGE,
    SEND,
    FragmentError,
    FragmentSchedule,
    eager_outer_gradient,
    mix,
    split_fragments,
    tensor_group,
)
from crossdc.strategies.schedule import TauSchedule
from crossdc.strategies.streaming_diloco import StreamingDiLoCo
from crossdc.testing.inprocess import InProcessFederation
from crossdc.workloads import Workload, WorkloadSpec, load_workload, model_weights

DCS = ["a", "b"]
SEEDS = {"a": 11, "b": 12}
LR = 0.01

pytestmark = pytest.mark.timeout(300)

#: the tensors of the default 2-layer char-transformer, in its order, with their float32 bytes
TRANSFORMER = {
    "token_embedding.weight": 6208, "position_embedding.weight": 4096,
    **{f"blocks.{i}.{part}": n for i in range(2) for part, n in [
        ("self_attn.in_proj_weight", 12288), ("self_attn.in_proj_bias", 192), ("self_attn.out_proj.weight", 4096),
        ("self_attn.out_proj.bias", 64), ("linear1.weight", 16384), ("linear1.bias", 256), ("linear2.weight", 16384),
        ("linear2.bias", 64), ("norm1.weight", 64), ("norm1.bias", 64), ("norm2.weight", 64), ("norm2.bias", 64)]},
    "final_norm.weight": 64, "final_norm.bias": 64, "head.weight": 6208, "head.bias": 97,
}
TRANSFORMER_BYTES = {name: 4 * n for name, n in TRANSFORMER.items()}


# ---------------------------------------------------------------- fragments
def test_a_tensor_belongs_to_its_layer() -> None:
    assert tensor_group("blocks.3.linear1.weight") == "blocks.3"
    assert tensor_group("net.0.bias") == "net.0"
    assert tensor_group("head.weight") == "head"
    assert tensor_group("token_embedding.weight") == "token_embedding"


def test_two_fragments_of_the_default_model_are_strided_and_balanced() -> None:
    first, second = split_fragments(TRANSFORMER_BYTES, 2)
    assert {tensor_group(n) for n in first} >= {"blocks.0"} and {tensor_group(n) for n in second} >= {"blocks.1"}
    assert sorted(first + second) == sorted(TRANSFORMER_BYTES)  # every tensor exactly once
    total = sum(TRANSFORMER_BYTES.values())
    for fragment in (first, second):
        assert sum(TRANSFORMER_BYTES[n] for n in fragment) <= 1.25 / 2 * total
    assert list(first) == [n for n in TRANSFORMER_BYTES if n in first]  # the model's order


def test_strided_layers_and_fewer_layers_than_fragments() -> None:
    sizes = {f"layers.{i}.weight": 100 for i in range(6)} | {"embed.weight": 150, "head.weight": 140}
    fragments = split_fragments(sizes, 3)
    assert [[tensor_group(n) for n in f if n.startswith("layers")] for f in fragments] == [
        ["layers.0", "layers.3"], ["layers.1", "layers.4"], ["layers.2", "layers.5"]]
    assert [tensor_group(n) for n in fragments[0] + fragments[1] if not n.startswith("layers")] == ["embed", "head"]
    # 2 layers, 4 fragments: every group placed by bytes, largest first onto the lightest fragment
    few = split_fragments({"layers.0.w": 50, "layers.1.w": 40, "embed.w": 30, "head.w": 20}, 4)
    assert [tuple(f) for f in few] == [("layers.0.w",), ("layers.1.w",), ("embed.w",), ("head.w",)]


def test_more_fragments_than_tensor_groups_is_an_error() -> None:
    with pytest.raises(FragmentError, match="only 6 tensor groups"):
        split_fragments(TRANSFORMER_BYTES, 7)
    with pytest.raises(FragmentError, match="≥ 1"):
        split_fragments(TRANSFORMER_BYTES, 0)
    assert split_fragments(TRANSFORMER_BYTES, 1) == [tuple(TRANSFORMER_BYTES)]


# ---------------------------------------------------------------- schedule
@pytest.mark.parametrize(("steps", "fragments", "overlap"), [(12, 1, 0), (12, 3, 2), (12, 4, 3), (8, 2, 0), (8, 8, 1)])
def test_every_fragment_is_synced_exactly_once_a_round(steps: int, fragments: int, overlap: int) -> None:
    schedule = FragmentSchedule(steps, fragments, overlap)
    rounds = 3
    events = list(schedule.events(rounds * fragments))
    sends = [e for e in events if e.kind == SEND]
    for r in range(1, rounds + 1):
        in_round = [e for e in sends if (r - 1) * steps < e.step <= r * steps]
        assert sorted(e.fragment for e in in_round) == list(range(fragments))  # each fragment once per round
        assert all(e.round == r for e in in_round)
    assert [e.step for e in sends] == sorted(e.step for e in sends)
    assert sends[-1].step == rounds * steps  # the last fragment closes the round
    merges = {e.exchange: e.step for e in events if e.kind == MERGE}
    assert all(merges[e.exchange] == e.step + overlap for e in sends)
    assert [e.step for e in events] == sorted(e.step for e in events)
    # at most one exchange per fragment in flight: a fragment's merge comes before its next send
    for e in sends:
        if e.exchange + fragments <= rounds * fragments:
            assert merges[e.exchange] <= schedule.send_step(e.exchange + fragments)


def test_order_at_one_step_send_before_own_merge_after_earlier_merge() -> None:
    no_overlap = [(e.kind, e.exchange) for e in FragmentSchedule(4, 2, 0).events(2)]
    assert no_overlap == [(SEND, 1), (MERGE, 1), (SEND, 2), (MERGE, 2)]
    full = [(e.step, e.kind, e.exchange) for e in FragmentSchedule(4, 2, 2).events(3)]
    assert full == [(2, SEND, 1), (4, MERGE, 1), (4, SEND, 2), (6, MERGE, 2), (6, SEND, 3), (8, MERGE, 3)]


@pytest.mark.parametrize(("steps", "fragments", "overlap"), [(12, 1, 0), (12, 3, 2), (12, 4, 3), (8, 2, 0), (8, 8, 1)])
def test_events_after_a_send_are_the_rest_of_the_sequence(steps: int, fragments: int, overlap: int) -> None:
    schedule = FragmentSchedule(steps, fragments, overlap)
    last = 3 * fragments
    events = list(schedule.events(last))
    assert list(schedule.events_after_send(last, 0)) == events
    for k in range(1, last + 1):
        at = events.index(next(e for e in events if e.kind == SEND and e.exchange == k))
        assert list(schedule.events_after_send(last, k)) == events[at + 1:], k


def test_results_still_needed_after_a_send() -> None:
    schedule = FragmentSchedule(8, 2, 1)
    assert schedule.results_needed_after(0, eager=False) == [] == schedule.results_needed_after(0, eager=True)
    assert schedule.results_needed_after(4, eager=False) == [4]  # its own merge, τ_o steps on
    # eager: the merge of k uses the result of k − P; the merges still to come after sending 4 are those of 4, 5, 6
    assert schedule.results_needed_after(4, eager=True) == [2, 3, 4]
    assert schedule.results_needed_after(1, eager=True) == [1]


def test_schedule_errors() -> None:
    with pytest.raises(FragmentError, match="multiple of the fragments"):
        FragmentSchedule(10, 3)
    with pytest.raises(FragmentError, match=r"within \[0, H/P = 5\]"):
        FragmentSchedule(10, 2, 6)
    with pytest.raises(FragmentError, match="numbered from 1"):
        FragmentSchedule(10, 2).locate(0)


# ---------------------------------------------------------------- merge and eager
def test_mix_limits_and_midpoint() -> None:
    g, local = {"w": np.array([1.0, 2.0], np.float32)}, {"w": np.array([3.0, -2.0], np.float32)}
    assert np.array_equal(mix(g, local, 0.0)["w"], g["w"])
    assert np.array_equal(mix(g, local, 1.0)["w"], local["w"])
    assert np.array_equal(mix(g, local, 0.5)["w"], np.array([2.0, 0.0], np.float32))
    assert np.allclose(mix(g, local, 0.25)["w"], [1.5, 1.0])
    with pytest.raises(FragmentError, match="alpha"):
        mix(g, local, 1.5)


def test_eager_stand_in_by_hand_on_a_quadratic() -> None:
    """Two datacenters minimise ½(x − c_m)² with one plain gradient step a sync (x' = x − lr·(x − c_m)), so their
    updates are known in closed form. The eager stand-in of datacenter a at sync k is ḡ_{k−1} + ½(g_a,k − g_a,k−1);
    over K syncs every datacenter's update enters exactly once with weight ½ (a's own one sync early)."""
    c = {"a": np.float32(2.0), "b": np.float32(-4.0)}
    lr = np.float32(0.5)
    x = np.float32(1.0)
    own_previous = previous_mean = None
    stand_ins, means = [], []
    for _ in range(4):
        updates = {m: {"x": np.array([-lr * (x - c[m])], np.float32)} for m in c}  # Δ = x' − x
        stand_in = eager_outer_gradient(previous_mean, updates["a"], own_previous, 0.5)
        expected = (0.5 * updates["a"]["x"] if previous_mean is None
                    else previous_mean["x"] + 0.5 * (updates["a"]["x"] - own_previous["x"]))
        assert np.array_equal(stand_in["x"], expected.astype(np.float32))
        stand_ins.append(stand_in["x"])
        mean = {"x": (updates["a"]["x"] + updates["b"]["x"]) / np.float32(2)}
        means.append(mean["x"])
        own_previous, previous_mean = updates["a"], mean
        x = x + mean["x"][0]  # the server's outer step with lr 1, no momentum
    # telescoping: Σ stand-ins = Σ_{k<K} ḡ_k + ½·g_a,K
    assert np.allclose(sum(stand_ins), sum(means[:-1]) + 0.5 * own_previous["x"], atol=1e-6)
    # hand-computed first two: x0 = 1 → Δa = −0.5·(1−2) = 0.5, Δb = −0.5·(1+4) = −2.5
    assert np.allclose(stand_ins[0], [0.25]) and np.allclose(means[0], [-1.0])
    # x1 = 0 → Δa = 1.0, Δb = −2.0; stand-in = −1.0 + ½(1.0 − 0.5) = −0.75
    assert np.allclose(stand_ins[1], [-0.75])


# ---------------------------------------------------------------- the strategy
def run_info(optimizer: str = "adamw") -> RunInfo:
    return RunInfo(tuple(DCS), optimizer, LR)


def test_parameters_are_checked_in_one_line() -> None:
    StreamingDiLoCo(tau=4, run=run_info())  # the defaults fit a constant tau of 4: P = 2, overlap 1 ≤ 2
    with pytest.raises(StrategyError, match="alpha"):
        StreamingDiLoCo(tau=4, params={"alpha": 1.5}, run=run_info())
    with pytest.raises(StrategyError, match=r"overlap 3 must be within \[0, H/P = 2\]"):
        StreamingDiLoCo(tau=4, params={"overlap": 3}, run=run_info())
    with pytest.raises(StrategyError, match="constant tau"):
        StreamingDiLoCo(tau=TauSchedule(2, 8, 3), run=run_info())
    with pytest.raises(StrategyError, match="multiple of the fragments"):
        StreamingDiLoCo(tau=5, params={"fragments": 2}, run=run_info())
    with pytest.raises(StrategyError, match="adamw"):
        StreamingDiLoCo(tau=4, run=run_info("sgd"))
    with pytest.raises(StrategyError, match=r"overlap = H/P = 2 with alpha = 0 discards every inner step"):
        StreamingDiLoCo(tau=4, params={"overlap": 2, "alpha": 0.0}, run=run_info())
    StreamingDiLoCo(tau=4, params={"overlap": 2, "alpha": 0.5}, run=run_info())  # α > 0 keeps part of the steps
    with pytest.raises(StrategyError, match="only 6 tensor groups"):
        StreamingDiLoCo(tau=14, params={"fragments": 7}, run=run_info()).plan(
            {n: np.zeros(b // 4, np.float32) for n, b in TRANSFORMER_BYTES.items()})


def make_workload() -> Workload:
    spec = WorkloadSpec(dataset="synthetic", model="mlp", partition={"kind": "iid"}, batch_size=16, optimizer="adamw", lr=LR)
    return load_workload(spec, DCS, 0)


def federation(strategy: DiLoCo, root: Path, codecs: tuple[str, ...] = (), downlink: tuple[str, ...] = ()) -> InProcessFederation:
    workload = make_workload()
    torch.manual_seed(0)
    weights = model_weights(workload.make_model())
    return InProcessFederation.from_parts(workload, strategy, DCS, 16, "adamw", LR, SEEDS, root, weights, codecs=codecs,
                                          downlink_codecs=downlink)


def test_one_fragment_no_overlap_no_mixing_is_diloco_exactly(tmp_path: Path) -> None:
    tau, rounds = 6, 4
    diloco = federation(DiLoCo(tau=tau, run=run_info()), tmp_path / "diloco")
    streaming = federation(StreamingDiLoCo(tau=tau, params={"fragments": 1, "overlap": 0, "alpha": 0.0, "eager": False},
                                           run=run_info()), tmp_path / "streaming")
    for _ in range(rounds):
        expected, got = diloco.run_round(), streaming.run_round()
        assert not expected.rejected and not got.rejected
        assert [u.num_examples for u in got.updates] == [u.num_examples for u in expected.updates]
        for name in diloco.weights:
            assert np.array_equal(streaming.weights[name], diloco.weights[name]), name
    assert streaming.strategy.outer_steps == diloco.strategy.outer_steps == rounds


def test_fragments_overlap_and_eager_train_and_send_less_per_sync(tmp_path: Path) -> None:
    tau, rounds = 8, 6
    whole = federation(DiLoCo(tau=tau, run=run_info()), tmp_path / "diloco")
    initial_loss, _ = whole.evaluate()
    for _ in range(rounds):
        whole_result = whole.run_round()
    whole_bytes = max(whole_result.bytes_up.values())
    for eager in (False, True):
        fed = federation(StreamingDiLoCo(tau=tau, params={"fragments": 2, "overlap": 2, "alpha": 0.5, "eager": eager},
                                         run=run_info()), tmp_path / f"streaming-{eager}")
        for _ in range(rounds):
            result = fed.run_round()
            assert not result.rejected
            assert len(result.exchange_peak_bytes) == 2  # two exchanges a round
        loss, _ = fed.evaluate()
        assert np.isfinite(loss) and loss < initial_loss, (eager, loss, initial_loss)
        # each sync sends one fragment: less than the whole model, the two together about the whole
        assert max(result.exchange_peak_bytes.values()) < whole_bytes
        assert sum(result.exchange_peak_bytes.values()) == pytest.approx(whole_bytes, rel=0.1)
        assert fed.strategy.outer_steps == 2 * rounds


def test_with_one_datacenter_eager_updates_merge_what_the_server_computes(tmp_path: Path) -> None:
    """With N = 1 the eager stand-in ḡ_prev + (g_own − g_own_prev) is the datacenter's fresh update itself (ḡ_prev
    is its own previous one), and its copy of the outer optimizer takes the server's step: eager on and off give the
    same global and local weights, round after round, outer momentum and its warm-up included (float32 rounding
    of the stand-in aside)."""
    tau, rounds = 8, 6
    spec = WorkloadSpec(dataset="synthetic", model="mlp", partition={"kind": "iid"}, batch_size=16, optimizer="adamw",
                        lr=LR)
    runs = {}
    for eager in (False, True):
        workload = load_workload(spec, ["a"], 0)
        torch.manual_seed(0)
        weights = model_weights(workload.make_model())
        strategy = StreamingDiLoCo(tau=tau, params={"fragments": 2, "overlap": 2, "alpha": 0.5, "eager": eager,
                                                    "outer_momentum_warmup_rounds": 3},
                                   run=RunInfo(("a",), "adamw", LR))
        runs[eager] = InProcessFederation.from_parts(workload, strategy, ["a"], 16, "adamw", LR, {"a": 11},
                                                     tmp_path / f"eager-{eager}", weights)
    plain, eager_run = runs[False], runs[True]
    for _ in range(rounds):
        assert not plain.run_round().rejected and not eager_run.run_round().rejected
        assert plain.replicas is not None and eager_run.replicas is not None
        local_plain, local_eager = plain.replicas["a"].trainer.get_weights(), eager_run.replicas["a"].trainer.get_weights()
        for name in plain.weights:
            np.testing.assert_allclose(eager_run.weights[name], plain.weights[name], rtol=1e-4, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(local_eager[name], local_plain[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert eager_run.strategy.outer_steps == plain.strategy.outer_steps == 2 * rounds
    # the replica's own outer steps are its merges: the round's last exchange merges τ_o steps into the next round
    assert eager_run.replicas["a"].strategy.outer_steps == 2 * rounds - 1


def test_four_bit_outer_gradients_and_an_int8_downlink_cost_less_and_train_alike(tmp_path: Path) -> None:
    tau, rounds = 8, 6
    params = {"fragments": 2, "overlap": 1, "alpha": 0.5}
    runs = {}
    # fp32 both ways; int4 outer gradients up; and int8 results down too (deltas against the merged fragments)
    for label, codecs, downlink in (("fp32", (), ()), ("int4", ("int4:ef=true",), ()),
                                    ("int4-int8", ("int4:ef=true",), ("int8",))):
        fed = federation(StreamingDiLoCo(tau=tau, params=params, run=run_info()), tmp_path / label, codecs=codecs,
                         downlink=downlink)
        sent = 0
        for _ in range(rounds):
            result = fed.run_round()
            assert not result.rejected, result.rejected
            sent += sum(result.bytes_up.values())
        runs[label] = (fed.evaluate()[0], sent)
    (fp32_loss, fp32_bytes), (int4_loss, int4_bytes) = runs["fp32"], runs["int4"]
    assert int4_bytes < 0.2 * fp32_bytes  # 0.5 byte a value plus a scale per 64, against 4 bytes
    assert abs(int4_loss - fp32_loss) < 0.05 * fp32_loss, (int4_loss, fp32_loss)
    assert abs(runs["int4-int8"][0] - fp32_loss) < 0.05 * fp32_loss, (runs["int4-int8"][0], fp32_loss)
    assert runs["int4-int8"][0] != int4_loss  # the downlink's rounding reached the merges


def test_a_replica_saved_after_a_round_and_restored_elsewhere_goes_on_exactly(tmp_path: Path) -> None:
    """What a resume needs: the replicas' state after a round's last send (through torch.save, as the state store
    keeps it), the server's weights, outer state and the results still needed, loaded into a fresh federation
    (new trainers: the inner AdamW and the data order come from the saved state) give the uninterrupted run."""
    tau, rounds, stop_after = 8, 4, 2
    params = {"fragments": 2, "overlap": 1, "alpha": 0.5, "eager": True}
    whole = federation(StreamingDiLoCo(tau=tau, params=params, run=run_info()), tmp_path / "whole")
    for _ in range(rounds):
        whole.run_round()
    first = federation(StreamingDiLoCo(tau=tau, params=params, run=run_info()), tmp_path / "first")
    for _ in range(stop_after):
        first.run_round()
    assert first.replicas is not None
    schedule = first.replicas["a"].plan.schedule
    sent = schedule.exchange(stop_after, schedule.fragments - 1)
    buffer = io.BytesIO()
    torch.save({"replicas": {dc: r.state_dict() for dc, r in first.replicas.items()},
                "weights": first.weights, "strategy": first.strategy.state_dict(),
                "results": {k: first.exchange_results[k] for k in schedule.results_needed_after(sent, eager=True)}},
               buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    second = federation(StreamingDiLoCo(tau=tau, params=params, run=run_info()), tmp_path / "second")
    second.session.weights = saved["weights"]
    second.strategy.load_state_dict(saved["strategy"])
    plan = second.strategy.plan(second.weights)  # type: ignore[attr-defined]
    second.replicas = {}
    for dc, state in saved["replicas"].items():
        replica = StreamingReplica(copy.deepcopy(second.strategy), second.trainers[dc], plan, second.weights, len(DCS))
        replica.load_state_dict(state)
        assert replica.last_sent == sent
        second.replicas[dc] = replica
    second.exchange_results = dict(saved["results"])
    second.server_round = stop_after
    remaining = set((e.kind, e.exchange) for e in schedule.events_after_send(rounds * 2, sent))
    second.events_done = {(e.kind, e.exchange) for e in schedule.events(rounds * 2)} - remaining
    for _ in range(rounds - stop_after):
        second.run_round()
    for name in whole.weights:
        assert np.array_equal(second.weights[name], whole.weights[name]), name
