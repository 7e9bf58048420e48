"""Where a datacenter's local ranks run: one rank per GPU with NCCL, or the CPU with gloo.

`placement(rank, world, gpus)` promises: with at least `world` visible GPUs, rank r uses ``cuda:r`` and the
group talks NCCL; with no GPU, every rank uses the CPU and gloo; with some GPUs but fewer than `world`, a
clear error (two ranks on one GPU would halve its memory and serialise its kernels — ask for fewer workers).
`autocast(precision, device)` is the context every local step's forward pass runs in: bf16 autocast when the
config asks for ``precision = "bf16"``, plain fp32 otherwise; weights and optimizer state stay fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16")


class PlacementError(RuntimeError):
    """The datacenter's worker group does not fit its devices."""


@dataclass(frozen=True)
class Placement:
    device: str
    backend: str


def placement(rank: int, world: int, gpus: int) -> Placement:
    """The device and collective backend of local rank `rank` of `world` with `gpus` visible GPUs."""
    if gpus == 0:
        return Placement("cpu", "gloo")
    if world > gpus:
        raise PlacementError(f"{world} local workers but only {gpus} visible GPU(s): set workers ≤ {gpus}")
    return Placement(f"cuda:{rank}", "nccl")


def local_placement(rank: int, world: int) -> Placement:
    """:func:`placement` for this machine's visible GPUs."""
    return placement(rank, world, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def autocast(precision: str, device: str) -> contextlib.AbstractContextManager[None]:
    """The forward pass's precision context (bf16 autocast or nothing)."""
    if precision == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return contextlib.nullcontext()
