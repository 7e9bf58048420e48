"""The maths of aggregation, as pure functions on dicts of numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Arrays = Mapping[str, np.ndarray]


def weighted_average(updates: Sequence[Arrays], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """Σ_i w_i · u_i / Σ_i w_i for every tensor name, computed in float64, returned as float32.

    All updates must have the same names and shapes; weights must be ≥ 0 with a positive sum.
    """
    if not updates:
        raise ValueError("weighted_average needs at least one update")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be ≥ 0 with a positive sum, got {list(weights)}")
    names = list(updates[0])
    result: dict[str, np.ndarray] = {}
    for name in names:
        acc = np.zeros(np.shape(updates[0][name]), dtype=np.float64)
        for update, weight in zip(updates, weights, strict=True):
            acc += (weight / total) * np.asarray(update[name], dtype=np.float64)
        result[name] = acc.astype(np.float32)
    return result


def add(base: Arrays, delta: Arrays, scale: float = 1.0) -> dict[str, np.ndarray]:
    """base + scale · delta, per tensor, keeping base's dtype."""
    return {name: (base[name] + scale * delta[name]).astype(base[name].dtype) for name in base}


def l2_norm(arrays: Arrays) -> float:
    """‖a‖₂ over all tensors together."""
    return float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays.values())))


def cosine(a: Arrays, b: Arrays) -> float:
    """cos(a, b) over all tensors flattened together; 0.0 if either is zero."""
    dot = sum(float(np.sum(np.asarray(a[n], np.float64) * np.asarray(b[n], np.float64))) for n in a)
    norms = l2_norm(a) * l2_norm(b)
    return dot / norms if norms > 0 else 0.0


def mean(arrays: Sequence[Arrays]) -> dict[str, np.ndarray]:
    """The plain (unweighted) mean Σ_i a_i / n per tensor, in float64, returned as float32."""
    return weighted_average(arrays, [1.0] * len(arrays))


def scaffold_client_control(c_i: Arrays, c: Arrays, x: Arrays, y: Arrays, steps: int, lr: float,
                            trainable: frozenset[str] | set[str] | None = None) -> dict[str, np.ndarray]:
    """SCAFFOLD option II (Karimireddy et al., 2020, eq. 4): c_i⁺ = c_i − c + (x − y) / (K · η_l).

    x: the global weights the K = `steps` local steps started from; y: the weights after them; η_l = `lr`, the
    inner optimizer's learning rate. With plain SGD on corrected gradients g − c_i + c this is the mean of the K
    raw gradients. Tensors not in `trainable` (buffers: no gradient, no correction) keep c_i⁺ = 0.
    Computed in float64, returned as float32.
    """
    if steps < 1 or not lr > 0:
        raise ValueError(f"need steps ≥ 1 and lr > 0, got steps={steps}, lr={lr}")
    result: dict[str, np.ndarray] = {}
    for name in x:
        if trainable is not None and name not in trainable:
            result[name] = np.zeros(np.shape(x[name]), dtype=np.float32)
            continue
        value = (np.asarray(c_i[name], np.float64) - np.asarray(c[name], np.float64)
                 + (np.asarray(x[name], np.float64) - np.asarray(y[name], np.float64)) / (steps * lr))
        result[name] = value.astype(np.float32)
    return result


def scaffold_server_step(x: Arrays, c: Arrays, mean_delta_y: Arrays, mean_delta_c: Arrays, global_lr: float,
                         participants: int, datacenters: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """SCAFFOLD's server update (Karimireddy et al., 2020, eq. 5): x ← x + η_g · mean(Δy), c ← c + (|S|/N) · mean(Δc).

    |S| = `participants` (datacenters whose update was accepted this round), N = `datacenters` (all configured).
    The (|S|/N) factor keeps c = (1/N) Σ_i c_i over all datacenters, the ones that missed the round included.
    """
    if not 0 < participants <= datacenters:
        raise ValueError(f"need 0 < |S| ≤ N, got |S|={participants}, N={datacenters}")
    return add(x, mean_delta_y, global_lr), add(c, mean_delta_c, participants / datacenters)


def nesterov_sgd_step(params: Arrays, grad: Arrays, buffer: Arrays | None, lr: float, momentum: float,
                      nesterov: bool = True) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One step of torch.optim.SGD(lr, momentum, nesterov, dampening=0, weight_decay=0), as a pure function.

    torch's semantics exactly: b ← g on the first step (`buffer` None), else b ← μ·b + g; the direction is
    d = g + μ·b with Nesterov, d = b without; p ← p − lr·d. Returns (new params, new buffer). Arithmetic in
    float32, in torch's order, so results match torch to rounding.
    """
    new_params: dict[str, np.ndarray] = {}
    new_buffer: dict[str, np.ndarray] = {}
    mu = np.float32(momentum)
    for name, p in params.items():
        g = np.asarray(grad[name], np.float32)
        b = g.copy() if buffer is None else np.asarray(buffer[name], np.float32) * mu + g
        d = g + mu * b if nesterov else b
        new_params[name] = (np.asarray(p, np.float32) - np.float32(lr) * d).astype(np.float32)
        new_buffer[name] = b.astype(np.float32)
    return new_params, new_buffer


def subtract(a: Arrays, b: Arrays) -> dict[str, np.ndarray]:
    """a − b per tensor, keeping a's dtype."""
    return {name: (a[name] - b[name]).astype(a[name].dtype) for name in a}


def negate(a: Arrays) -> dict[str, np.ndarray]:
    """−a per tensor."""
    return {name: (-np.asarray(v)).astype(np.asarray(v).dtype) for name, v in a.items()}


def total_sum(a: Arrays) -> float:
    """Σ of every entry of every tensor, in float64 and in name order (a cheap fingerprint of a state)."""
    return float(sum(float(np.sum(np.asarray(a[n], np.float64))) for n in sorted(a)))
