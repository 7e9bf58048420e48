"""SparseLoCo: the 2-bit values codec and its wire format, the chunked top-k, the decaying error feedback, the
strategy's server step, and a short in-process run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crossdc.compression.pipeline import CodecPipeline, decode_payload
from crossdc.compression.quantize import int2_quantize
from crossdc.compression.topk import chunk_top_positions
from crossdc.compression.wire import Q2, VALUE_KINDS, CodecError, pack_crumbs, unpack_crumbs
from crossdc.experiment.builders import build_strategy
from crossdc.experiment.config import parse_config
from crossdc.strategies.base import ClientUpdate, StrategyError
from crossdc.testing.inprocess import InProcessFederation

# -- the 2-bit codes ----------------------------------------------------------------------------------------------


def test_two_bit_codes_pack_four_per_byte_and_back() -> None:
    codes = torch.tensor([-3, -1, 1, 3, 3, -3], dtype=torch.int8)
    packed = pack_crumbs(codes)
    # (code + 3) / 2 = 0, 1, 2, 3 | 3, 0 in bits 0-1, 2-3, ...: 0b11_10_01_00, then 0b00_00_00_11
    assert packed.tolist() == [0b11100100, 0b00000011]
    assert VALUE_KINDS[Q2].code_bytes(6) == 2 and VALUE_KINDS[Q2].section_bytes(130, 64) == 33 + 3 * 4
    assert unpack_crumbs(packed, 6).tolist() == codes.tolist()
    with pytest.raises(CodecError, match="unused bits"):
        unpack_crumbs(torch.tensor([0b11100100, 0b00010011], dtype=torch.uint8), 6)
    with pytest.raises(CodecError, match="bytes of 2-bit codes"):
        unpack_crumbs(packed, 9)


def test_int2_rounds_to_the_nearest_odd_level_of_each_blocks_scale() -> None:
    values = int2_quantize(torch.tensor([3.0, 1.2, -0.2, -3.0, 0.0, 2.1, -6.0, 0.9]), block=4)
    assert values.scales.tolist() == [1.0, 2.0]  # max |x| / 3 per block
    assert values.codes.tolist() == [3, 1, -1, -3, 1, 1, -3, 1]
    assert values.decode().tolist() == [3.0, 1.0, -1.0, -3.0, 2.0, 2.0, -6.0, 2.0]


# -- the chunked top-k --------------------------------------------------------------------------------------------


def test_chunked_topk_keeps_k_of_every_chunk_and_its_share_of_the_tail() -> None:
    magnitudes = torch.tensor([0.1, 0.9, 0.2, 0.3, 5.0, 0.0, 0.0, 4.0, 0.5, 0.6, 0.7])
    # chunks [0:4] and [4:8] keep 2 each; the tail of 3 keeps ⌈2 · 3 / 4⌉ = 2
    assert chunk_top_positions(magnitudes, 2, 4).tolist() == [1, 3, 4, 7, 9, 10]
    assert chunk_top_positions(magnitudes, 4, 4).tolist() == list(range(11))


def test_decaying_error_feedback_follows_sparselocos_recursion() -> None:
    """e ← β·e + Δ; send Q(chunk-top-k(e)); e ← e − sent. Checked against that recursion written out."""
    pipeline = CodecPipeline(["chunk-topk:2:chunk=4:decay=0.5", "int2:block=2"])
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(3, 4, generator=generator) for _ in range(3)]
    error = torch.zeros(3, 4)
    for server_round, update in enumerate(updates, start=1):
        error = 0.5 * error + update
        flat = error.reshape(-1)
        positions = chunk_top_positions(flat.abs(), 2, 4)
        sent = torch.zeros(12)
        sent[positions] = int2_quantize(flat[positions], block=2).decode()
        encoded = pipeline.encode({"w": update}, server_round)
        decoded = decode_payload(encoded.payload, {"w": (3, 4)})["w"]
        torch.testing.assert_close(decoded.reshape(-1), sent, rtol=0, atol=0)
        error = error - sent.view(3, 4)
        torch.testing.assert_close(pipeline.residuals["w"], error, rtol=1e-6, atol=1e-7)


def test_a_local_momentum_enters_the_error_feedback_in_nesterov_form_and_survives_a_restore() -> None:
    """u ← μ·u + Δ; e ← β·e + Δ + μ·u; send chunk-top-k(e); e ← e − sent. Checked against that recursion written out,
    with the pipeline rebuilt from its saved state after round 2."""
    import copy

    specs = ["chunk-topk:2:chunk=4:decay=0.5:nesterov=0.9"]
    pipeline = CodecPipeline(specs)
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(3, 4, generator=generator) for _ in range(4)]
    velocity, error = torch.zeros(3, 4), torch.zeros(3, 4)
    for server_round, update in enumerate(updates, start=1):
        if server_round == 3:
            restored = CodecPipeline(specs)
            restored.load_state_dict(copy.deepcopy(pipeline.state_dict()))
            pipeline = restored
        velocity = 0.9 * velocity + update
        error = 0.5 * error + update + 0.9 * velocity
        flat = error.reshape(-1)
        sent = torch.zeros(12)
        positions = chunk_top_positions(flat.abs(), 2, 4)
        sent[positions] = flat[positions]
        decoded = decode_payload(pipeline.encode({"w": update}, server_round).payload, {"w": (3, 4)})["w"]
        torch.testing.assert_close(decoded.reshape(-1), sent, rtol=1e-6, atol=1e-6)
        error = error - sent.view(3, 4)
    torch.testing.assert_close(pipeline.residuals["w"], error, rtol=1e-6, atol=1e-6)


def test_sparse_payload_is_over_100x_smaller_than_float32_on_a_large_tensor() -> None:
    tensor = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    encoded = CodecPipeline(["chunk-topk:64:decay=0.95", "int2"]).encode({"w": tensor}, 1)
    assert encoded.raw_bytes / encoded.nbytes > 100


# -- the strategy -------------------------------------------------------------------------------------------------


def _config(codecs: list[str], rounds: int = 3, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"run": {"rounds": rounds, "seed": 1},
            "workload": {"dataset": "synthetic", "model": "mlp", "batch_size": 16, "lr": 3e-3},
            "strategy": {"name": "sparseloco", "tau": 5, "params": params or {}},
            "compression": {"codecs": codecs},
            "datacenters": [{"name": "a"}, {"name": "b"}]}


def test_sparseloco_needs_a_chunked_topk_uplink() -> None:
    with pytest.raises(StrategyError, match="needs a chunked top-k uplink"):
        build_strategy(parse_config(_config(["topk:0.01"])))
    with pytest.raises(StrategyError, match="needs a chunked top-k uplink"):
        build_strategy(parse_config(_config([])))


def test_sparseloco_steps_on_the_mean_without_momentum() -> None:
    strategy = build_strategy(parse_config(_config(["chunk-topk:64:decay=0.95", "int2"], params={"outer_lr": 0.5})))
    weights = {"w": np.zeros(2, np.float32)}
    mean = {"w": np.array([1.0, -2.0], np.float32)}
    update = [ClientUpdate(datacenter="a", delta=mean, num_examples=1)]
    first = strategy.aggregate(1, weights, update, mean)
    second = strategy.aggregate(2, first, update, mean)
    np.testing.assert_allclose(first["w"], [0.5, -1.0])
    np.testing.assert_allclose(second["w"] - first["w"], [0.5, -1.0])  # no momentum: the same step again
    assert strategy.state_dict()["momentum_buffer"] is None


def test_sparseloco_may_add_outer_nesterov_momentum_on_the_mean() -> None:
    params = {"outer_lr": 0.5, "outer_momentum": 0.9, "outer_momentum_warmup_rounds": 2}
    strategy = build_strategy(parse_config(_config(["chunk-topk:64:decay=0.95", "int2"], params=params)))
    weights = {"w": np.zeros(2, np.float32)}
    mean = {"w": np.array([1.0, -2.0], np.float32)}
    update = [ClientUpdate(datacenter="a", delta=mean, num_examples=1)]
    first = strategy.aggregate(1, weights, update, mean)
    second = strategy.aggregate(2, first, update, mean)
    # torch SGD(nesterov) on the pseudo-gradient g = -mean: b = g, step lr (g + 0.45 b); then b = 0.9 b + g
    np.testing.assert_allclose(first["w"], 0.5 * 1.45 * np.array([1.0, -2.0]), rtol=1e-6)
    np.testing.assert_allclose(second["w"] - first["w"], 0.5 * (1 + 0.9 * 1.9) * np.array([1.0, -2.0]), rtol=1e-6)


def test_a_short_sparseloco_run_learns_and_sends_little(tmp_path: Path) -> None:
    config = parse_config(_config(["chunk-topk:8:chunk=512:decay=0.95", "int2:block=8"], rounds=4))
    federation = InProcessFederation.from_config(config, tmp_path)
    before = federation.evaluate()[0]
    results = [federation.run_round() for _ in range(4)]
    after = federation.evaluate()[0]
    assert after < before - 0.05
    raw = 4 * sum(np.asarray(v).size for v in federation.weights.values())
    sent = max(results[-1].bytes_up.values())
    assert sent < raw / 20  # 8 of 512 in 2 bits, positions and the reply's framing included
