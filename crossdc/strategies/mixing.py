"""The maths of gossip, as pure functions: who mixes with whom in a gossip round, with which weights, and how far the
replicas are from agreeing.

The N datacenters are numbered 0…N−1 in the run's config order; gossip rounds r are numbered from 1. A round's
**mixing matrix** W (N × N) says what each replica becomes: x_i ← Σ_j W[i, j]·x_j. Row i lists what datacenter i
receives (from every j ≠ i with W[i, j] > 0); column j what datacenter j sends (to every i ≠ j with W[i, j] > 0).
Every matrix built here is **doubly stochastic** (entries ≥ 0, every row and every column summing to 1): rows
summing to 1 make each new replica a weighted average, columns summing to 1 keep the average of the replicas
exactly (Σ_i x_i is invariant), so gossip moves the replicas towards their mean without moving the mean.

Topologies (:func:`round_graph`):

- ``ring``: i ↔ i ± 1 (mod N), undirected; N ≥ 3 (two datacenters make a single pair, use ``random-pairs``).
- ``exponential`` (Stochastic Gradient Push's time-varying exponential graph): in round r, datacenter i sends to
  i + 2^k and receives from i − 2^k (mod N), k = (r − 1) mod ⌈log₂ N⌉; directed, one peer each way per round, so
  every replica hears from every other within ⌈log₂ N⌉ rounds. N ≥ 2.
- ``random-pairs`` (NoLoCo's): each round a random perfect matching, drawn from the run's seed and the round
  number, so every datacenter draws the same pairs without asking anyone. With an odd N the last three datacenters
  of the round's shuffled order form a triple (all three mix together): nobody sits out. N ≥ 2.
- ``nearest``: from the round-trip times between datacenters, the tree of lowest-RTT links — links taken in order of
  RTT (ties by name) and kept when they join two groups not yet connected, until all are connected (every
  datacenter keeps at least its own nearest peer). Undirected, fixed. N ≥ 2.

Weights (:func:`mixing_matrix`): ``mixing`` = 0 (the default) chooses them: Metropolis–Hastings weights on an
undirected graph (w_ij = 1 / (1 + max(deg_i, deg_j)), the rest stays with i: doubly stochastic on any graph), 1/2 on
a directed exchange or a pair, 1/3 in a triple. ``mixing`` = m > 0 gives every neighbour the weight m and leaves
1 − deg_i·m with i; a choice that leaves a negative self-weight is not doubly stochastic and is refused
(:class:`MixingError`).

A neighbour whose state did not arrive (a cut link, a dead peer) is left out of that round's mix, its weight kept
by the receiver (:func:`available_row`): a mix uses a neighbour's whole state or none of it. When both ends of a
link miss each other's state (a cut link drops both directions) the matrix stays doubly stochastic.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Arrays = Mapping[str, np.ndarray]

TOPOLOGIES: tuple[str, ...] = ("ring", "exponential", "random-pairs", "nearest")
#: topologies whose neighbours never change: the only ones where compressed exchanges (CHOCO public copies) work
FIXED_TOPOLOGIES: frozenset[str] = frozenset({"ring", "nearest"})
#: the tolerance of the doubly stochastic check
TOLERANCE = 1e-9


class MixingError(ValueError):
    """A topology or mixing that cannot be built for this run (with the reason, in one line)."""


@dataclass(frozen=True)
class RoundGraph:
    """One gossip round's graph: `edges` (i, j) means j's state reaches i; `directed` False lists both directions."""

    size: int
    edges: frozenset[tuple[int, int]]
    directed: bool
    #: groups that mix all together with equal weights (random pairs: pairs and a triple); None for other graphs
    groups: tuple[tuple[int, ...], ...] | None = None

    def senders_to(self, receiver: int) -> list[int]:
        """The datacenters whose state `receiver` mixes in this round, in index order."""
        return sorted(j for i, j in self.edges if i == receiver)

    def receivers_of(self, sender: int) -> list[int]:
        """The datacenters that mix `sender`'s state in this round, in index order."""
        return sorted(i for i, j in self.edges if j == sender)


def check_topology(topology: str, size: int, rtt_ms: Mapping[tuple[int, int], float] | None = None) -> None:
    """MixingError if `topology` cannot connect `size` datacenters (or is unknown, or ``nearest`` lacks RTTs)."""
    if topology not in TOPOLOGIES:
        raise MixingError(f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
    if size < 2:
        raise MixingError(f"gossip needs at least 2 datacenters, the run has {size}")
    if topology == "ring" and size < 3:
        raise MixingError(f"a ring needs at least 3 datacenters, the run has {size} (use topology = \"random-pairs\")")
    if topology == "nearest":
        if rtt_ms is None:
            raise MixingError("topology \"nearest\" needs the round-trip times between the datacenters")
        missing = [(i, j) for i in range(size) for j in range(i + 1, size) if _rtt(rtt_ms, i, j) is None]
        if missing:
            raise MixingError(f"topology \"nearest\" has no round-trip time between datacenters {missing[0]}")


def _rtt(rtt_ms: Mapping[tuple[int, int], float], i: int, j: int) -> float | None:
    return rtt_ms.get((i, j), rtt_ms.get((j, i)))


def exponential_period(size: int) -> int:
    """⌈log₂ N⌉ (at least 1): the rounds of the exponential graph's cycle of hop lengths 1, 2, 4, …"""
    return max(1, math.ceil(math.log2(size)))


def random_groups(size: int, server_round: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """Round `server_round`'s random pairs (a triple at the end when `size` is odd), the same for every caller with
    the same seed: a shuffle of 0…N−1 by a generator seeded with (seed, round)."""
    order = list(range(size))
    random.Random(f"crossdc-gossip/{seed}/{server_round}").shuffle(order)
    pairs = [tuple(sorted(order[k:k + 2])) for k in range(0, size - 3 if size % 2 else size, 2)]
    if size % 2:
        pairs.append(tuple(sorted(order[-3:])))
    return tuple(pairs)


def nearest_tree(size: int, rtt_ms: Mapping[tuple[int, int], float]) -> frozenset[tuple[int, int]]:
    """The lowest-RTT tree over `size` datacenters (see the module docstring), as undirected edges (i < j)."""
    parent = list(range(size))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    links = sorted((float(_rtt(rtt_ms, i, j) or 0.0), i, j) for i in range(size) for j in range(i + 1, size))
    tree = set()
    for _, i, j in links:
        a, b = root(i), root(j)
        if a != b:
            parent[a] = b
            tree.add((i, j))
    return frozenset(tree)


def round_graph(topology: str, size: int, server_round: int, *, seed: int = 0,
                rtt_ms: Mapping[tuple[int, int], float] | None = None) -> RoundGraph:
    """Round `server_round`'s graph of `topology` over `size` datacenters (MixingError if it cannot be built)."""
    check_topology(topology, size, rtt_ms)
    if topology == "ring":
        edges = {(i, (i + d) % size) for i in range(size) for d in (1, -1)}
        return RoundGraph(size, frozenset(edges), directed=False)
    if topology == "exponential":
        hop = 2 ** ((server_round - 1) % exponential_period(size))
        edges = {(i, (i - hop) % size) for i in range(size)} - {(i, i) for i in range(size)}
        return RoundGraph(size, frozenset(edges), directed=True)
    if topology == "random-pairs":
        groups = random_groups(size, server_round, seed)
        edges = {(i, j) for group in groups for i in group for j in group if i != j}
        return RoundGraph(size, frozenset(edges), directed=False, groups=groups)
    assert rtt_ms is not None
    tree = nearest_tree(size, rtt_ms)
    return RoundGraph(size, frozenset(tree | {(j, i) for i, j in tree}), directed=False)


def mixing_matrix(graph: RoundGraph, mixing: float = 0.0) -> np.ndarray:
    """W of one round (see the module docstring for the weights); MixingError if it is not doubly stochastic."""
    n = graph.size
    weights = np.zeros((n, n))
    if mixing < 0 or mixing > 1:
        raise MixingError(f"mixing must be within [0, 1] (0: chosen by the topology), got {mixing}")
    degree = [len(graph.senders_to(i)) for i in range(n)]
    for i, j in graph.edges:
        if mixing > 0:
            weights[i, j] = mixing
        elif graph.groups is not None:
            weights[i, j] = 1.0 / (degree[i] + 1)  # a pair: 1/2, a triple: 1/3
        elif graph.directed:
            weights[i, j] = 0.5
        else:
            weights[i, j] = 1.0 / (1 + max(degree[i], degree[j]))
    for i in range(n):
        weights[i, i] = 1.0 - weights[i].sum()
    check_doubly_stochastic(weights, f"mixing = {mixing:g}")
    return weights


def check_doubly_stochastic(weights: np.ndarray, what: str = "the mixing matrix") -> None:
    """MixingError naming the first row or column that breaks double stochasticity (entries ≥ 0, sums 1)."""
    n = weights.shape[0]
    if weights.shape != (n, n):
        raise MixingError(f"{what}: a mixing matrix must be square, got shape {weights.shape}")
    for i in range(n):
        if weights[i].min() < -TOLERANCE:
            j = int(np.argmin(weights[i]))
            raise MixingError(f"{what} is not doubly stochastic: datacenter {i} would give weight "
                              f"{weights[i, j]:.4g} to {'itself' if i == j else f'datacenter {j}'} (negative); "
                              f"use a smaller mixing (at most 1 / the largest degree)")
        if abs(weights[i].sum() - 1) > TOLERANCE:
            raise MixingError(f"{what} is not doubly stochastic: row {i} sums to {weights[i].sum():.6g}, not 1")
        if abs(weights[:, i].sum() - 1) > TOLERANCE:
            raise MixingError(f"{what} is not doubly stochastic: column {i} sums to {weights[:, i].sum():.6g}, not 1 "
                              "(the average of the replicas would drift)")


def contraction(weights: np.ndarray) -> float:
    """‖W − 11ᵀ/N‖₂: the factor by which one mixing round at least shrinks the replicas' distance to their mean
    (‖X' − X̄‖_F ≤ contraction · ‖X − X̄‖_F); the spectral gap is 1 − contraction. For a symmetric W it is the
    second-largest |eigenvalue|, reached by the slowest mode."""
    n = weights.shape[0]
    return float(np.linalg.norm(weights - np.full((n, n), 1.0 / n), 2))


def available_row(weights: np.ndarray, receiver: int, arrived: Sequence[int]) -> dict[int, float]:
    """Datacenter `receiver`'s weights for this round when only the states of `arrived` came: the weight of every
    sender that did not arrive stays with the receiver. Keys: the receiver and the arrived senders."""
    row = {receiver: float(weights[receiver, receiver])}
    for j in range(weights.shape[0]):
        if j == receiver or weights[receiver, j] == 0:
            continue
        if j in arrived:
            row[j] = float(weights[receiver, j])
        else:
            row[receiver] += float(weights[receiver, j])
    return row


def mix(states: Mapping[int, Arrays], row: Mapping[int, float]) -> dict[str, np.ndarray]:
    """Σ_j row[j]·x_j over the states named by `row` (every one of them must be in `states`), in float64, as
    float32."""
    first = states[next(iter(row))]
    out = {}
    for name in first:
        acc = np.zeros(np.shape(first[name]), np.float64)
        for j, weight in row.items():
            acc += weight * np.asarray(states[j][name], np.float64)
        out[name] = acc.astype(np.float32)
    return out


def consensus_distances(states: Sequence[Arrays]) -> tuple[list[float], float, dict[str, np.ndarray]]:
    """(‖x_i − x̄‖ for each replica, their mean, x̄) over replicas taken at the same step; x̄ is their plain mean."""
    names = list(states[0])
    average = {n: np.mean([np.asarray(s[n], np.float64) for s in states], axis=0) for n in names}
    distances = [math.sqrt(sum(float(np.sum((np.asarray(s[n], np.float64) - average[n]) ** 2)) for n in names))
                 for s in states]
    return distances, sum(distances) / len(distances), {n: v.astype(np.float32) for n, v in average.items()}


def choco_mix(own: Arrays, public: Mapping[int, Arrays], row: Mapping[int, float], own_index: int,
              step_size: float) -> dict[str, np.ndarray]:
    """CHOCO-Gossip's step (Koloskova et al., 2019): x_i + γ·Σ_j w_ij·(x̂_j − x̂_i) over the public copies x̂ (the
    receiver's own, `public[own_index]`, and each sender's in `row`); γ = `step_size`. With exact copies (x̂ = x) and
    γ = 1 it is the plain mix Σ_j w_ij·x_j. Keeps the average of the replicas when W is doubly stochastic and every
    datacenter holds the same copies."""
    mine = public[own_index]
    out = {}
    for name, value in own.items():
        acc = np.asarray(value, np.float64).copy()
        for j, weight in row.items():
            if j != own_index:
                acc += step_size * weight * (np.asarray(public[j][name], np.float64) - np.asarray(mine[name], np.float64))
        out[name] = acc.astype(np.float32)
    return out


#: the buckets of a replica's consensus sketch (:func:`count_sketch`): ‖s_i − s̄‖ estimates ‖x_i − x̄‖ within about
#: √(2/k) ≈ 4.4 % (one standard deviation of the squared norm's relative error)
SKETCH_SIZE = 1024


def count_sketch(arrays: Arrays, seed: int, size: int = SKETCH_SIZE) -> np.ndarray:
    """A CountSketch of the tensors flattened together, in float64: every coordinate j, in name order, is added with
    a random sign σ(j) to a random bucket h(j), σ and h drawn from `seed` (the same for every datacenter of a run).
    Linear (sketch(a − b) = sketch(a) − sketch(b)), and E‖sketch(x)‖² = ‖x‖²: the replicas' distances to their
    average are estimated from sketches of `size` numbers instead of whole models."""
    rng = np.random.default_rng(seed)
    out = np.zeros(size, np.float64)
    for name in sorted(arrays):
        values = np.asarray(arrays[name], np.float64).ravel()
        buckets = rng.integers(0, size, values.size)
        signs = rng.integers(0, 2, values.size) * 2.0 - 1.0
        out += np.bincount(buckets, weights=signs * values, minlength=size)
    return out


def sketched_distances(sketches: Sequence[np.ndarray]) -> tuple[list[float], float]:
    """(each replica's estimated ‖x_i − x̄‖, their mean) from the replicas' sketches (:func:`count_sketch`, one seed)."""
    average = np.mean(np.stack(sketches), axis=0)
    distances = [float(np.linalg.norm(s - average)) for s in sketches]
    return distances, sum(distances) / len(distances)
