"""PowerSGD low-rank compression (Vogels et al., 2019).

Each tensor of two or more dimensions is viewed as a matrix M (first dimension × the rest) and sent
as two factors P (rows × r) and Q (cols × r) with M ≈ P Qᵀ, from one step of power iteration:
P = orthonormalise(M Q_prev), Q = Mᵀ P. Q is kept per tensor and warm-starts the next round, so the
approximation of a slowly changing update improves round after round. 1-D tensors (biases, norms)
and tensors for which the factors would not be smaller are sent uncompressed. Error feedback is on
by default. With r = min(rows, cols) the reconstruction is exact.
"""

from __future__ import annotations

import zlib

import torch

from crossdc.compression.base import StructureCodec, TensorState
from crossdc.compression.wire import DENSE, LOWRANK, EncodedTensor, plain
from crossdc.parameters import Parameter


def initial_q(name: str, cols: int, rank: int, device: torch.device) -> torch.Tensor:
    """A deterministic random start for Q (the same on every run for a tensor name)."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(cols, rank, generator=generator).to(device)


def power_step(matrix: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power-iteration step: P = orthonormal basis of M Q, then Q = Mᵀ P (so M ≈ P Qᵀ)."""
    p, _ = torch.linalg.qr(matrix @ q, mode="reduced")
    return p, matrix.T @ p


class PowerSGD(StructureCodec):
    """Rank-r approximation by power iteration with warm-started Q and error feedback."""

    name = "powersgd"
    positional = "rank"
    error_feedback = True
    parameters = {
        "rank": Parameter(int, 4, "rank r of the approximation", low=1),
        "ef": Parameter(bool, True, "keep what the approximation misses in a residual added to the next update"),
        "warm_start": Parameter(bool, True, "start each round's power step from the previous round's Q"),
    }

    def compress(self, name: str, tensor: torch.Tensor, state: TensorState, server_round: int) -> EncodedTensor:
        shape = tuple(tensor.shape)
        if tensor.dim() < 2:
            return EncodedTensor(name, shape, DENSE, [plain(tensor)])
        matrix = tensor.reshape(shape[0], -1).to(torch.float32)
        rows, cols = matrix.shape
        rank = min(self.params["rank"], rows, cols)
        if rank * (rows + cols) >= rows * cols:
            return EncodedTensor(name, shape, DENSE, [plain(tensor)])
        q = state.get("q") if self.params["warm_start"] else None
        if q is None or tuple(q.shape) != (cols, rank):
            q = initial_q(name, cols, rank, matrix.device)
        p, q = power_step(matrix, q)
        state["q"] = q
        return EncodedTensor(name, shape, LOWRANK, [plain(p), plain(q)], matrix=(rows, cols))
