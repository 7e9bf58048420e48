"""The maths of gossip on small exact cases: topologies, doubly stochastic mixing, consensus rates, CHOCO."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from crossdc.compression.pipeline import CodecPipeline
from crossdc.strategies.mixing import (
    MixingError,
    available_row,
    check_doubly_stochastic,
    choco_mix,
    consensus_distances,
    contraction,
    count_sketch,
    exponential_period,
    mix,
    mixing_matrix,
    random_groups,
    round_graph,
    sketched_distances,
)


def replicas(n: int, seed: int = 0, size: int = 6) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(size,)).astype(np.float32), "b": rng.normal(size=(2, 2)).astype(np.float32)}
            for _ in range(n)]


def mix_all(states: list[dict[str, np.ndarray]], weights: np.ndarray) -> list[dict[str, np.ndarray]]:
    n = len(states)
    return [mix(dict(enumerate(states)), available_row(weights, i, range(n))) for i in range(n)]


def test_ring_metropolis_weights_are_a_third_each() -> None:
    weights = mixing_matrix(round_graph("ring", 4, 1))
    expected = np.array([[1, 1, 0, 1], [1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1]]) / 3
    assert np.allclose(weights, expected)


def test_exponential_graph_cycles_through_powers_of_two() -> None:
    assert exponential_period(8) == 3 and exponential_period(5) == 3 and exponential_period(2) == 1
    hops = [round_graph("exponential", 8, r).senders_to(0) for r in (1, 2, 3, 4)]
    assert hops == [[7], [6], [4], [7]]  # 0 hears from 0 − 1, 0 − 2, 0 − 4, then 0 − 1 again
    for r in (1, 2, 3):
        weights = mixing_matrix(round_graph("exponential", 8, r))
        check_doubly_stochastic(weights)
        assert sorted(np.unique(weights)) == [0.0, 0.5]


def test_random_pairs_are_a_matching_the_same_for_everyone_with_a_triple_when_odd() -> None:
    for n in (2, 4, 6):
        groups = random_groups(n, 3, seed=7)
        assert sorted(itertools.chain(*groups)) == list(range(n)) and all(len(g) == 2 for g in groups)
        assert groups == random_groups(n, 3, seed=7)
    groups = random_groups(5, 3, seed=7)
    assert sorted(len(g) for g in groups) == [2, 3] and sorted(itertools.chain(*groups)) == list(range(5))
    assert len({random_groups(6, r, seed=7) for r in range(1, 20)}) > 1  # pairs change from round to round
    weights = mixing_matrix(round_graph("random-pairs", 5, 3, seed=7))
    triple = next(g for g in groups if len(g) == 3)
    assert all(weights[i, j] == pytest.approx(1 / 3) for i in triple for j in triple)


def test_nearest_keeps_the_lowest_rtt_tree() -> None:
    # 0 and 1 in one region (10 ms), 2 and 3 in another (12 ms), the regions 150 ms apart, 1–2 the shortest crossing
    rtt = {(0, 1): 10.0, (2, 3): 12.0, (0, 2): 160.0, (0, 3): 170.0, (1, 2): 150.0, (1, 3): 155.0}
    graph = round_graph("nearest", 4, 1, rtt_ms=rtt)
    assert {(i, j) for i, j in graph.edges if i < j} == {(0, 1), (2, 3), (1, 2)}
    assert graph == round_graph("nearest", 4, 9, rtt_ms=rtt)  # fixed
    check_doubly_stochastic(mixing_matrix(graph))


@pytest.mark.parametrize(("topology", "n", "match"), [
    ("ring", 2, "a ring needs at least 3"), ("random-pairs", 1, "at least 2 datacenters"),
    ("star", 4, "unknown topology 'star'"), ("nearest", 3, "needs the round-trip times")])
def test_a_topology_invalid_for_the_run_is_refused(topology: str, n: int, match: str) -> None:
    with pytest.raises(MixingError, match=match):
        round_graph(topology, n, 1)


def test_a_mixing_that_is_not_doubly_stochastic_is_refused() -> None:
    with pytest.raises(MixingError, match="not doubly stochastic: datacenter 0 would give weight -0.2 to itself"):
        mixing_matrix(round_graph("ring", 5, 1), mixing=0.6)
    assert np.allclose(np.diag(mixing_matrix(round_graph("ring", 5, 1), mixing=0.5)), 0.0)
    with pytest.raises(MixingError, match="column 0 sums to 1.5"):
        check_doubly_stochastic(np.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]]))
    with pytest.raises(MixingError, match="within \\[0, 1\\]"):
        mixing_matrix(round_graph("ring", 4, 1), mixing=-0.1)


@pytest.mark.parametrize("topology", ["ring", "exponential", "random-pairs"])
def test_doubly_stochastic_mixing_keeps_the_average_exactly(topology: str) -> None:
    states = replicas(5)
    before = consensus_distances(states)[2]
    for r in range(1, 8):
        states = mix_all(states, mixing_matrix(round_graph(topology, 5, r, seed=3)))
    after = consensus_distances(states)[2]
    for name in before:
        assert np.allclose(after[name], before[name], atol=1e-6)


def test_consensus_shrinks_at_the_rate_of_the_spectral_gap() -> None:
    """On a ring of 6 with training off, the distance to the mean shrinks by the second eigenvalue every round."""
    n = 6
    weights = mixing_matrix(round_graph("ring", n, 1))
    rate = contraction(weights)
    assert rate == pytest.approx((1 + 2 * np.cos(2 * np.pi / n)) / 3)  # the ring's second eigenvalue, 2/3
    # start from the slowest mode: x_i = cos(2πi/N) (its mean is 0) — the ratio is exactly the rate every round
    states = [{"x": np.array([np.cos(2 * np.pi * i / n)], np.float64)} for i in range(n)]
    distances = [consensus_distances(states)[1]]
    for _ in range(10):
        states = [{"x": sum(weights[i, j] * states[j]["x"] for j in range(n))} for i in range(n)]
        distances.append(consensus_distances(states)[1])
    ratios = np.array(distances[1:]) / np.array(distances[:-1])
    assert np.allclose(ratios, rate, rtol=1e-5)
    # from any start: never slower than the bound, and geometric in the long run
    states = replicas(n, seed=1)
    start = float(np.sqrt(sum(d ** 2 for d in consensus_distances(states)[0])))
    for k in range(1, 30):
        states = mix_all(states, weights)
        now = float(np.sqrt(sum(d ** 2 for d in consensus_distances(states)[0])))
        assert now <= start * rate ** k * (1 + 1e-4) + 1e-6


def test_a_missing_neighbour_keeps_its_weight_with_the_receiver_and_cut_links_keep_the_average() -> None:
    weights = mixing_matrix(round_graph("ring", 4, 1))
    assert available_row(weights, 0, [1]) == pytest.approx({0: 2 / 3, 1: 1 / 3})
    # the link 0–3 is cut both ways: neither mixes the other; the average is still kept
    states = replicas(4)
    before = consensus_distances(states)[2]
    arrived = {0: [1], 1: [0, 2], 2: [1, 3], 3: [2]}
    mixed = [mix(dict(enumerate(states)), available_row(weights, i, arrived[i])) for i in range(4)]
    after = consensus_distances(mixed)[2]
    assert all(np.allclose(after[n], before[n], atol=1e-6) for n in before)


def test_choco_with_top_k_reaches_exact_consensus_and_keeps_the_average() -> None:
    """CHOCO-Gossip with top-10 % compression of x − x̂ (no residual: the public copy is the error feedback)."""
    n, size = 4, 50
    rng = np.random.default_rng(0)
    states = [{"w": rng.normal(size=(size,)).astype(np.float32)} for _ in range(n)]
    start_mean = consensus_distances(states)[2]["w"].astype(np.float64)
    weights = mixing_matrix(round_graph("ring", n, 1))
    public = {i: {"w": np.zeros(size, np.float32)} for i in range(n)}  # every datacenter holds the same copies
    pipelines = [CodecPipeline(["topk:0.1"], seed=i, error_feedback=False) for i in range(n)]
    first = consensus_distances(states)[1]
    for step in range(1, 400):
        for i in range(n):  # each sends Q(x_i − x̂_i); every holder of x̂_i adds what was sent
            encoded = pipelines[i].encode({"w": states[i]["w"] - public[i]["w"]}, step)
            public[i] = {"w": public[i]["w"] + encoded.sent["w"].numpy()}
        states = [choco_mix(states[i], public, available_row(weights, i, range(n)), i, step_size=0.2)
                  for i in range(n)]
    _, distance, average = consensus_distances(states)
    assert distance < 1e-4 * first
    assert np.allclose(average["w"], start_mean, atol=1e-4)


def test_the_count_sketch_is_linear_and_estimates_consensus_distances() -> None:
    states = replicas(4, seed=3, size=20_000)
    sketches = [count_sketch(s, seed=11) for s in states]
    assert np.allclose(count_sketch({n: states[0][n] - states[1][n] for n in states[0]}, seed=11),
                       sketches[0] - sketches[1], atol=1e-4)  # float32 differences, float64 sketches
    exact, exact_mean, _ = consensus_distances(states)
    estimated, estimated_mean = sketched_distances(sketches)
    assert np.allclose(estimated, exact, rtol=0.15)  # within ~3 standard deviations of √(2/1024) ≈ 4.4 %
    assert estimated_mean == pytest.approx(exact_mean, rel=0.1)
