"""Top-k sparsification with DGC's refinements (Lin et al., 2018, "Deep Gradient Compression").

Keeps the k largest-magnitude entries of each tensor (k = ⌈fraction · numel⌉), or of the whole update
(``scope=global``). With error feedback (on by default) everything not sent stays in the datacenter's
residual and is added to the next round's update, so what is eventually sent equals what was produced.

Options, all off by default:

- ``momentum=m``: momentum correction — the codec keeps a velocity u ← m·u + update and accumulates u
  (not the raw update) into the residual; momentum-factor masking then zeroes u where values were sent.
- ``clip=c``: local clipping — an update whose L2 norm exceeds c is scaled down to norm c before it
  is accumulated.
- ``warmup=R``: sparsity warm-up — the kept fraction starts at ``warmup_start`` (25 %) in round 1 and falls
  geometrically to ``fraction`` at round R + 1 (DGC's 75 % → 93.75 % → … → 99.9 % sparsity). On the downlink
  of a τ = 1 run, ``warmup_start`` = N × the uplink's start and ``fraction`` = N × the uplink's fraction keep
  up with the union of N datacenters' sparse updates in every round, so the datacenters never train from a
  lagging model (one that lags at τ = 1 keeps them stepping on stale coordinates, and trains worse).

The codec sees one update per round: with τ = 1 local step that is DGC's per-step form exactly; with
τ > 1 the round's update plays the role of the gradient.

``threshold``: ``exact`` uses ``torch.topk``; ``sampled`` estimates the k-th magnitude from a random
sample (DGC's trick) and keeps what lies above it, refined to exactly k when the estimate keeps too
many; ``auto`` samples for tensors above 2²⁰ elements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from crossdc.compression.base import StructureCodec, TensorState
from crossdc.compression.wire import SPARSE, EncodedTensor, plain
from crossdc.parameters import Parameter

SAMPLE_ABOVE = 1 << 20
SAMPLE_SIZE = 1 << 16
WARMUP_START_FRACTION = 0.25


def warmup_fraction(server_round: int, target: float, warmup_rounds: int, start: float = WARMUP_START_FRACTION) -> float:
    """Kept fraction in `server_round` (1-based): `start` at round 1, geometric to `target` at warmup_rounds + 1."""
    if warmup_rounds <= 0 or target >= start or server_round > warmup_rounds:
        return target
    progress = (server_round - 1) / warmup_rounds
    return start * (target / start) ** progress


def kept_count(numel: int, fraction: float) -> int:
    """k for a tensor of `numel` elements: ⌈fraction · numel⌉, at least 1."""
    return max(1, min(numel, math.ceil(fraction * numel)))


def sampled_threshold(magnitudes: torch.Tensor, fraction: float, generator: torch.Generator | None) -> torch.Tensor:
    """An estimate of the magnitude above which `fraction` of the entries lie, from a random sample."""
    sample = magnitudes[torch.randint(magnitudes.numel(), (SAMPLE_SIZE,), device=magnitudes.device, generator=generator)]
    return torch.topk(sample, kept_count(SAMPLE_SIZE, fraction), sorted=False).values.min()


def top_positions(magnitudes: torch.Tensor, k: int, threshold: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted positions of (about, for ``sampled``: at most 1.25 ×) the k largest `magnitudes` (a flat tensor)."""
    numel = magnitudes.numel()
    if k >= numel:
        return torch.arange(numel, device=magnitudes.device)
    if threshold == "sampled" or (threshold == "auto" and numel > SAMPLE_ABOVE):
        cut = sampled_threshold(magnitudes, k / numel, generator)
        candidates = torch.nonzero(magnitudes >= cut).flatten()
        if candidates.numel() >= k // 2 and candidates.numel() > 0:
            if candidates.numel() > 1.25 * k:  # the estimate kept too many: exact top-k among the candidates
                candidates = candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
            return torch.sort(candidates).values
    return torch.sort(torch.topk(magnitudes, k, sorted=False).indices).values


def accumulate_velocity(update: torch.Tensor, state: TensorState, momentum: float) -> torch.Tensor:
    """The tensor's velocity u ← momentum · u + update, kept in `state` (u = update in its first round)."""
    velocity = state.get("velocity")
    velocity = update.clone() if velocity is None else velocity.mul_(momentum).add_(update)
    state["velocity"] = velocity
    return velocity


class TopK(StructureCodec):
    """Top-k sparsification with error feedback and DGC's momentum correction, clipping and warm-up."""

    name = "topk"
    positional = "fraction"
    error_feedback = True
    parameters = {
        "fraction": Parameter(float, 0.01, "fraction of each tensor's entries sent (0, 1]", low=1e-9, high=1.0),
        "scope": Parameter(str, "tensor", "k per tensor, or one threshold for the whole update", choices=("tensor", "global")),
        "ef": Parameter(bool, True, "keep what is not sent in a residual added to the next update"),
        "momentum": Parameter(float, 0.0, "DGC momentum correction factor (0 = off)", low=0.0, high=0.999),
        "clip": Parameter(float, 0.0, "clip each tensor's update to this L2 norm before accumulating (0 = off)", low=0.0),
        "warmup": Parameter(int, 0, "rounds of sparsity warm-up from `warmup_start` kept to `fraction`", low=0),
        "warmup_start": Parameter(float, WARMUP_START_FRACTION, "fraction kept in the warm-up's first round", low=1e-9,
                                  high=1.0),
        "threshold": Parameter(str, "auto", "how the k-th magnitude is found", choices=("auto", "exact", "sampled")),
    }

    #: with ``scope=global``: this round's magnitude threshold over all tensors (set by begin_round)
    _global_cut: torch.Tensor | None = None

    def fraction(self, server_round: int) -> float:
        """The kept fraction in this round (after warm-up)."""
        return warmup_fraction(server_round, self.params["fraction"], self.params["warmup"], self.params["warmup_start"])

    def prepare(self, name: str, update: torch.Tensor, state: TensorState) -> torch.Tensor:
        clip = self.params["clip"]
        if clip > 0:
            norm = float(torch.linalg.vector_norm(update))
            if norm > clip:
                update = update * (clip / norm)
        momentum = self.params["momentum"]
        return accumulate_velocity(update, state, momentum) if momentum > 0 else update

    def begin_round(self, accumulated: Mapping[str, torch.Tensor], server_round: int) -> None:
        """With ``scope=global``: one magnitude threshold over all tensors of the round."""
        self._global_cut = None
        if self.params["scope"] == "global" and accumulated:
            magnitudes = torch.cat([t.reshape(-1).abs() for t in accumulated.values()])
            k = kept_count(magnitudes.numel(), self.fraction(server_round))
            positions = top_positions(magnitudes, k, self.params["threshold"], self.generator)
            self._global_cut = magnitudes[positions].min()

    def compress(self, name: str, tensor: torch.Tensor, state: TensorState, server_round: int) -> EncodedTensor:
        flat = tensor.reshape(-1)
        magnitudes = flat.abs()
        if self._global_cut is not None:
            positions = torch.nonzero(magnitudes >= self._global_cut).flatten()
        else:
            k = kept_count(flat.numel(), self.fraction(server_round))
            positions = top_positions(magnitudes, k, self.params["threshold"], self.generator)
        return EncodedTensor(name, tuple(tensor.shape), SPARSE, [plain(flat[positions])], positions=positions)

    def after_send(self, name: str, encoded: EncodedTensor, state: TensorState) -> None:
        velocity = state.get("velocity")
        if velocity is not None:  # momentum-factor masking: no momentum keeps pushing values already sent
            if encoded.positions is None:  # sent densely: every value went
                velocity.zero_()
            else:
                velocity.view(-1)[encoded.positions] = 0.0


def chunk_top_positions(magnitudes: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Sorted positions of the k largest `magnitudes` (a flat tensor) in every run of `chunk` consecutive entries; a
    last, shorter run keeps ⌈k · its length / chunk⌉ (all of them when k ≥ chunk)."""
    numel = magnitudes.numel()
    if k >= chunk:
        return torch.arange(numel, device=magnitudes.device)
    whole = numel // chunk
    pieces = []
    if whole:
        rows = magnitudes[: whole * chunk].view(whole, chunk)
        starts = torch.arange(whole, device=magnitudes.device)[:, None] * chunk
        pieces.append((torch.topk(rows, k, dim=1, sorted=False).indices + starts).reshape(-1))
    tail = numel - whole * chunk
    if tail:
        kept = min(tail, math.ceil(k * tail / chunk))
        pieces.append(torch.topk(magnitudes[whole * chunk :], kept, sorted=False).indices + whole * chunk)
    return torch.sort(torch.cat(pieces)).values


class ChunkTopK(StructureCodec):
    """Chunked top-k (SparseLoCo, Sarfi et al., 2025): the k largest magnitudes of every chunk of each tensor, with an
    error-feedback residual that may decay.

    Each tensor, flattened, is cut into chunks of ``chunk`` entries, and each chunk sends its ``k`` largest (density
    k / chunk; 64 / 4096 = 1.6 % by default), so every part of the tensor is heard from in every round and, with
    ``int2`` at ``block`` = k, each chunk's values share one scale. The residual follows e ← decay · e + update before
    each round's selection (``decay`` β < 1 is SparseLoCo's error feedback that stands in for DiLoCo's outer momentum;
    1 is plain error feedback), and e ← e − what was sent after it, the values' rounding included. With ``nesterov``
    μ > 0 the update is first given a Nesterov momentum kept in the datacenter (u ← μ·u + update; update + μ·u
    enters the residual): DiLoCo's outer momentum moved before the selection, so that everything sent carries it
    once and the server needs none of its own.
    """

    name = "chunk-topk"
    positional = "k"
    error_feedback = True
    parameters = {
        "k": Parameter(int, 64, "entries sent per chunk", low=1),
        "chunk": Parameter(int, 4096, "entries per chunk", low=1),
        "ef": Parameter(bool, True, "keep what is not sent in a residual added to the next update"),
        "decay": Parameter(float, 1.0, "β: the residual is multiplied by β before the next update is added "
                           "(SparseLoCo: 0.95)", low=0.0, high=1.0),
        "nesterov": Parameter(float, 0.0, "μ of a Nesterov momentum the datacenter keeps on its updates: what enters "
                              "the residual is update + μ·u, u ← μ·u + update (0 = off)", low=0.0, high=0.999),
    }

    def residual_decay(self) -> float:
        return float(self.params["decay"])

    def prepare(self, name: str, update: torch.Tensor, state: TensorState) -> torch.Tensor:
        momentum = self.params["nesterov"]
        if momentum <= 0:
            return update
        return update + momentum * accumulate_velocity(update, state, momentum)

    def compress(self, name: str, tensor: torch.Tensor, state: TensorState, server_round: int) -> EncodedTensor:
        flat = tensor.reshape(-1)
        positions = chunk_top_positions(flat.abs(), self.params["k"], self.params["chunk"])
        return EncodedTensor(name, tuple(tensor.shape), SPARSE, [plain(flat[positions])], positions=positions)
