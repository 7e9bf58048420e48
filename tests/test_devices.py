"""Device placement of local ranks and bf16 autocast in local training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crossdc.clients.devices import Placement, PlacementError, placement
from crossdc.clients.local_training import LocalTrainer
from crossdc.workloads import WorkloadSpec, load_workload


def test_one_rank_per_gpu_with_nccl_else_cpu_with_gloo() -> None:
    assert placement(0, 1, 0) == Placement("cpu", "gloo")
    assert placement(1, 2, 0) == Placement("cpu", "gloo")
    assert placement(0, 8, 8) == Placement("cuda:0", "nccl")
    assert placement(3, 4, 8) == Placement("cuda:3", "nccl")
    with pytest.raises(PlacementError, match="only 2 visible GPU"):
        placement(0, 4, 2)


def _trainer(precision: str, device: str = "cpu") -> LocalTrainer:
    spec = WorkloadSpec(dataset="shakespeare", model="char-transformer", model_args={"layers": 1, "d_model": 32, "heads": 2, "seq_len": 32},
                        partition={"kind": "natural"}, batch_size=16, optimizer="adamw", lr=3e-3)
    workload = load_workload(spec, ["a", "b"], 0)
    return LocalTrainer(workload, workload.shard("a"), 16, "adamw", 3e-3, seed=1, device=device, precision=precision)


def test_bf16_autocast_trains_close_to_fp32_and_keeps_fp32_weights() -> None:
    fp32, bf16 = _trainer("fp32"), _trainer("bf16")
    start = fp32.get_weights()
    bf16.set_weights(start)
    a, b = fp32.train_steps(20), bf16.train_steps(20)
    assert abs(a.mean_loss - b.mean_loss) / a.mean_loss < 0.05, (a.mean_loss, b.mean_loss)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    moved = {k: float(np.abs(bf16.get_weights()[k] - start[k]).max()) for k in start}
    assert max(moved.values()) > 0  # it trained
    diff = max(float(np.abs(bf16.get_weights()[k] - fp32.get_weights()[k]).max()) for k in start)
    assert diff > 0  # and bf16 really changed the arithmetic


def test_unknown_precision_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="precision"):
        _trainer("fp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
def test_gpu_rank_equals_cpu_to_float_tolerance() -> None:
    cpu, gpu = _trainer("fp32"), _trainer("fp32", device="cuda:0")
    gpu.set_weights(cpu.get_weights())
    cpu.train_steps(5), gpu.train_steps(5)
    for name, value in cpu.get_weights().items():
        assert np.allclose(value, gpu.get_weights()[name], atol=1e-4), name
