"""Codecs on small exact cases: index coding, error feedback, quantisation bounds, PowerSGD, bad payloads."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch

from crossdc.compression.base import CodecConfigError, build_codec, parse_spec
from crossdc.compression.index_coding import (
    BITMAP,
    VARINT,
    IndexCodingError,
    bitmap_size,
    decode_positions,
    decode_varint,
    encode_positions,
    encode_varint,
    varint_size,
)
from crossdc.compression.lowrank import power_step
from crossdc.compression.pipeline import CodecPipeline, decode_payload
from crossdc.compression.quantize import int8_quantize, qsgd_quantize
from crossdc.compression.topk import kept_count, top_positions, warmup_fraction
from crossdc.compression.wire import MAX_HEADER_BYTES, CodecError


def _update(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


SHAPES = {"layer.weight": (64, 48), "layer.bias": (48,), "conv.weight": (8, 4, 3, 3)}


# --- index coding -------------------------------------------------------------------------------

def test_varint_bytes_are_leb128_of_the_gaps() -> None:
    # positions 0, 1, 130, 20000 → gaps 0, 0, 128, 19869
    data = encode_varint(torch.tensor([0, 1, 130, 20000]))
    assert data.tolist() == [0x00, 0x00, 0x80, 0x01, 0x9D, 0x9B, 0x01]
    assert decode_varint(data, 4, 20001).tolist() == [0, 1, 130, 20000]


@pytest.mark.parametrize("density", [0.0005, 0.01, 0.2, 0.9])
def test_positions_round_trip_and_cheaper_encoding_is_chosen(density: float) -> None:
    numel = 100_003
    g = torch.Generator().manual_seed(1)
    positions = torch.sort(torch.randperm(numel, generator=g)[: max(1, int(density * numel))]).values
    kind, data = encode_positions(positions, numel)
    assert data.numel() == min(varint_size(positions), bitmap_size(numel))
    assert kind == (VARINT if varint_size(positions) <= bitmap_size(numel) else BITMAP)
    assert torch.equal(decode_positions(kind, data, positions.numel(), numel), positions)
    # at 1 % density a gap needs ~1-2 bytes: far below 4-byte int32 positions
    if density == 0.01:
        assert data.numel() < 2 * positions.numel()


def test_corrupt_positions_are_refused() -> None:
    data = encode_varint(torch.tensor([5, 300, 70000]))
    with pytest.raises(IndexCodingError, match="truncated"):
        decode_varint(data[:-1], 3, 100000)
    with pytest.raises(IndexCodingError, match="outside"):
        decode_varint(data, 3, 1000)
    with pytest.raises(IndexCodingError, match="positions"):
        decode_varint(data, 2, 100000)


# --- spelling and configuration ------------------------------------------------------------------

def test_spec_spelling() -> None:
    spec = parse_spec("topk:0.01:warmup=4:ef=false", "fraction")
    assert spec.name == "topk" and spec.params == {"fraction": 0.01, "warmup": 4, "ef": False}
    assert build_codec("qsgd:levels=8").params["levels"] == 8


@pytest.mark.parametrize("specs, message", [
    (["zip"], "unknown codec 'zip'"),
    (["topk:0"], "fraction"),
    (["topk:1.5"], "fraction"),
    (["topk:fraction=abc"], "must be float"),
    (["qsgd:levels=0"], "levels"),
    (["int8", "topk:0.01"], "must come before"),
    (["topk:0.01", "powersgd:2"], "at most one structure codec"),
    (["topk:0.01:bogus=1"], "unknown parameter 'bogus'"),
    ("topk:0.01", "must be a list"),
])
def test_bad_pipelines_fail_with_a_clear_message(specs: list[str], message: str) -> None:
    with pytest.raises(CodecConfigError, match=message):
        CodecPipeline(specs)


# --- error feedback -----------------------------------------------------------------------------

@pytest.mark.parametrize("specs", [["topk:0.02"], ["topk:0.02", "int8"], ["topk:0.05:momentum=0.9:warmup=3"],
                                   ["powersgd:2"], ["topk:0.01:scope=global", "qsgd:4"]])
def test_error_feedback_sends_everything_eventually(specs: list[str]) -> None:
    pipeline = CodecPipeline(specs, seed=3)
    produced = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    received = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    momentum = pipeline.structure.params.get("momentum", 0.0) if pipeline.structure else 0.0
    for server_round in range(1, 31):
        update = _update(server_round, SHAPES)
        encoded = pipeline.encode(update, server_round)
        decoded = decode_payload(encoded.payload, SHAPES)
        for name in SHAPES:
            assert torch.allclose(decoded[name], encoded.sent[name])
            produced[name] += update[name].double()
            received[name] += decoded[name].double()
    for name in SHAPES:
        residual = pipeline.residuals[name].double()
        if momentum == 0:
            # Σ decoded + final residual = Σ inputs
            assert torch.allclose(received[name] + residual, produced[name], atol=1e-4), name
        else:
            # with momentum correction the accumulator receives the velocity; still nothing is lost of it
            velocity = pipeline.codec_state[name]["velocity"].double()
            assert torch.isfinite(received[name]).all() and torch.isfinite(velocity).all()


def test_topk_keeps_exactly_the_largest_and_less_energy_for_dense_updates() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.05, 4.0, 0.0])
    assert top_positions(x.abs(), 3, "exact").tolist() == [1, 3, 6]
    pipeline = CodecPipeline(["topk:0.375:ef=false"])
    encoded = pipeline.encode({"x": x}, 1)
    assert encoded.sent["x"].tolist() == [0, -5.0, 0, 3.0, 0, 0, 4.0, 0]
    assert encoded.energy_kept == pytest.approx(50.0 / float((x ** 2).sum()))


def test_sampled_threshold_keeps_about_k_of_the_largest() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3_000_000, generator=g)
    k = kept_count(x.numel(), 0.01)
    positions = top_positions(x.abs(), k, "sampled", g)
    assert k // 2 <= positions.numel() <= 1.25 * k
    exact = top_positions(x.abs(), k, "exact")
    overlap = np.intersect1d(positions.numpy(), exact.numpy()).size
    assert overlap >= 0.9 * min(k, positions.numel())


def test_sparsity_warmup_schedule() -> None:
    assert warmup_fraction(1, 0.001, 4) == pytest.approx(0.25)
    assert warmup_fraction(3, 0.001, 4) == pytest.approx(0.25 * (0.001 / 0.25) ** 0.5)
    assert warmup_fraction(5, 0.001, 4) == pytest.approx(0.001)
    assert warmup_fraction(1, 0.001, 0) == 0.001
    # a downlink that keeps up with 4 datacenters' union: 4 × the uplink's fraction in every round
    for server_round in range(1, 7):
        assert warmup_fraction(server_round, 0.04, 4, start=1.0) == pytest.approx(4 * warmup_fraction(server_round, 0.01, 4))


def test_warmup_start_sets_the_first_rounds_kept_fraction() -> None:
    pipeline = CodecPipeline(["topk:0.01:warmup=2:warmup_start=0.5"])
    x = torch.arange(1.0, 101.0)
    assert int((pipeline.encode({"x": x}, 1).sent["x"] != 0).sum()) == 50
    assert int((pipeline.encode({"x": torch.zeros(100)}, 3).sent["x"] != 0).sum()) == 1


def test_momentum_factor_masking_zeroes_velocity_where_sent() -> None:
    pipeline = CodecPipeline(["topk:0.25:momentum=0.9"])
    x = torch.tensor([1.0, 0.1, 0.2, 0.3])
    encoded = pipeline.encode({"x": x}, 1)
    assert encoded.sent["x"].tolist() == [1.0, 0, 0, 0]
    velocity = pipeline.codec_state["x"]["velocity"]
    assert velocity.tolist() == pytest.approx([0.0, 0.1, 0.2, 0.3])


def test_cheaper_dense_encoding_for_a_dense_selection() -> None:
    # 990 of 1000 kept: bitmap 125 B + 990 × 4 B > 1000 × 4 B dense
    encoded = CodecPipeline(["topk:0.99"]).encode({"x": torch.randn(1000)}, 1)
    assert encoded.stats["tensor_kinds"] == {"dense": 1, "sparse": 0, "lowrank": 0}
    # 900 kept: bitmap 125 B + 900 × 4 B < 4000 B: positions pay for themselves
    encoded = CodecPipeline(["topk:0.9"]).encode({"x": torch.randn(1000)}, 1)
    assert encoded.stats["tensor_kinds"] == {"dense": 0, "sparse": 1, "lowrank": 0}


# --- quantisation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [0, 64])
def test_int8_error_within_half_a_scale(block: int) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 3
    values = int8_quantize(x, block)
    error = (values.decode() - x).abs()
    scale = torch.repeat_interleave(values.scales, block)[:1000] if block else values.scales[0].expand(1000)
    assert bool((error <= scale / 2 + 1e-6).all())
    assert values.codes.dtype == torch.int8 and values.scales.numel() == (1 if block == 0 else math.ceil(1000 / block))


def test_qsgd_is_unbiased() -> None:
    x = torch.randn(200, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    draws = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        total += qsgd_quantize(x, levels=4, block=50, generator=g).decode().double()
    mean = total / draws
    scale = float(torch.linalg.vector_norm(x.view(4, 50), dim=1).max()) / 4
    # each draw's error per element has variance ≤ scale² / 4: the mean's error is within 5 σ / √draws
    assert float((mean - x.double()).abs().max()) <= 5 * (scale / 2) / math.sqrt(draws)
    one = qsgd_quantize(x, levels=4, block=50, generator=g)
    assert int(one.codes.abs().max()) <= 4


def test_qsgd_many_levels_uses_int16_codes() -> None:
    values = qsgd_quantize(torch.randn(10), levels=1000)
    assert values.codes.dtype == torch.int16


# --- PowerSGD -----------------------------------------------------------------------------------

def test_power_step_with_full_rank_reconstructs_exactly() -> None:
    m = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p, q = power_step(m, torch.randn(4, 4, dtype=torch.float64))
    assert torch.allclose(p @ q.T, m, atol=1e-10)
    wide = m.T.contiguous()
    p, q = power_step(wide, torch.randn(6, 4, dtype=torch.float64))
    assert torch.allclose(p @ q.T, wide, atol=1e-10)


def test_powersgd_full_rank_codec_is_exact_and_warm_start_improves() -> None:
    m = torch.randn(40, 30, generator=torch.Generator().manual_seed(1))
    exact = CodecPipeline(["powersgd:rank=30"]).encode({"w": m}, 1)
    assert torch.allclose(exact.sent["w"], m, atol=1e-5)
    pipeline = CodecPipeline(["powersgd:rank=3:ef=false"])
    errors = [float(torch.linalg.norm(pipeline.encode({"w": m}, r).sent["w"] - m)) for r in range(1, 6)]
    assert errors[-1] < errors[0] * 0.95
    cold = CodecPipeline(["powersgd:rank=3:ef=false:warm_start=false"])
    cold_errors = [float(torch.linalg.norm(cold.encode({"w": m}, r).sent["w"] - m)) for r in range(1, 6)]
    assert cold_errors[-1] == pytest.approx(cold_errors[0])


def test_powersgd_sends_1d_tensors_dense() -> None:
    encoded = CodecPipeline(["powersgd:2"]).encode({"b": torch.randn(50)}, 1)
    assert encoded.stats["tensor_kinds"]["dense"] == 1 and torch.count_nonzero(encoded.sent["b"]) == 50


# --- the receiving side: strict ---------------------------------------------------------------------

def _payload(specs: list[str]) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    encoded = CodecPipeline(specs).encode(_update(0, SHAPES), 1)
    return encoded.payload, encoded.sent


@pytest.mark.parametrize("specs", [[], ["int8"], ["topk:0.1", "int8"], ["powersgd:2"]])
def test_truncated_or_padded_payloads_raise(specs: list[str]) -> None:
    payload, _ = _payload(specs)
    for bad in (payload[:-1], payload[: len(payload) // 2], payload[:10], np.concatenate([payload, payload[:3]])):
        with pytest.raises(CodecError):
            decode_payload(bad, SHAPES)


def test_wrong_names_or_shapes_raise() -> None:
    payload, _ = _payload(["topk:0.1"])
    with pytest.raises(CodecError, match="missing"):
        decode_payload(payload, {**SHAPES, "extra": (3,)})
    with pytest.raises(CodecError, match="unexpected"):
        decode_payload(payload, {k: v for k, v in SHAPES.items() if k != "layer.bias"})
    with pytest.raises(CodecError, match="shape"):
        decode_payload(payload, {**SHAPES, "layer.weight": (48, 64)})


def test_nan_in_a_payload_or_an_update_raises() -> None:
    payload, _ = _payload([])
    corrupted = payload.copy()
    corrupted[-4:] = np.frombuffer(np.float32(np.nan).tobytes(), dtype=np.uint8)  # last value of the last tensor
    with pytest.raises(CodecError, match="NaN"):
        decode_payload(corrupted, SHAPES)
    with pytest.raises(CodecError, match="NaN"):
        CodecPipeline(["int8"]).encode({"x": torch.tensor([1.0, float("inf")])}, 1)


def test_garbage_header_raises() -> None:
    payload, _ = _payload(["int8"])
    corrupted = payload.copy()
    corrupted[9:20] = ord("#")
    with pytest.raises(CodecError):
        decode_payload(corrupted, SHAPES)
    with pytest.raises(CodecError, match="magic"):
        decode_payload(b"not a payload", SHAPES)


def _with_header(payload: np.ndarray, magic: bytes, head: bytes) -> np.ndarray:
    (head_len,) = struct.unpack("<I", payload[4:8].tobytes())
    return np.frombuffer(magic + struct.pack("<I", len(head)) + head + payload[8 + head_len :].tobytes(), dtype=np.uint8)


def test_the_header_is_compressed_and_first_version_payloads_still_decode() -> None:
    payload, _ = _payload(["topk:0.1", "int8"])
    (head_len,) = struct.unpack("<I", payload[4:8].tobytes())
    plain = zlib.decompress(payload[8 : 8 + head_len].tobytes())
    assert payload[:4].tobytes() == b"CDC2" and len(plain) > head_len
    first_version = _with_header(payload, b"CDC1", plain)
    for name, tensor in decode_payload(first_version, SHAPES).items():
        torch.testing.assert_close(tensor, decode_payload(payload, SHAPES)[name], rtol=0, atol=0)
    with pytest.raises(CodecError, match="unreadable payload header"):  # trailing bytes after the compressed stream
        decode_payload(_with_header(payload, b"CDC2", zlib.compress(plain) + b"x"), SHAPES)
    with pytest.raises(CodecError, match="unreadable payload header"):  # inflates past MAX_HEADER_BYTES
        decode_payload(_with_header(payload, b"CDC2", zlib.compress(b" " * (MAX_HEADER_BYTES + 1), 9)), SHAPES)


def test_state_survives_a_restart() -> None:
    """Saving and loading the pipeline's state between rounds gives the same payloads as never stopping."""
    straight = CodecPipeline(["topk:0.05:momentum=0.5", "qsgd:8"], seed=1)
    first = CodecPipeline(["topk:0.05:momentum=0.5", "qsgd:8"], seed=1)
    for r in (1, 2):
        straight.encode(_update(r, SHAPES), r)
        first.encode(_update(r, SHAPES), r)
    restarted = CodecPipeline(["topk:0.05:momentum=0.5", "qsgd:8"], seed=99)
    restarted.load_state_dict(first.state_dict())
    a = straight.encode(_update(3, SHAPES), 3)
    b = restarted.encode(_update(3, SHAPES), 3)
    assert np.array_equal(a.payload, b.payload)
    with pytest.raises(CodecConfigError, match="saved codec state"):
        CodecPipeline(["int8"]).load_state_dict(first.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
def test_same_code_on_gpu() -> None:
    update = {n: t.cuda() for n, t in _update(0, SHAPES).items()}
    encoded = CodecPipeline(["topk:0.1", "int8"]).encode(update, 1)
    decoded = decode_payload(encoded.payload, SHAPES)
    for name in SHAPES:
        assert torch.allclose(decoded[name], encoded.sent[name].cpu())


def test_a_codec_registered_in_process_is_found_and_composes() -> None:
    from crossdc.compression.base import REGISTRY, ValuesCodec, describe_codecs, register_codec
    from crossdc.compression.wire import F32, Values
    from crossdc.parameters import Parameter

    @register_codec
    class HalfScale(ValuesCodec):
        """Sends every value at half its size (a toy: tests the registry, not compression)."""

        name = "halfscale"
        parameters = {"factor": Parameter(float, 0.5, "scale", low=0.0)}

        def quantize(self, values: torch.Tensor, generator: torch.Generator | None) -> Values:
            return Values(F32, values.reshape(-1) * self.params["factor"])

    try:
        row = next(r for r in describe_codecs() if r["name"] == "halfscale")
        assert row["source"] == "plug-in" and row["stage"] == "values" and row["parameters"]["factor"]["default"] == 0.5
        encoded = CodecPipeline(["topk:0.5", "halfscale:factor=0.25"]).encode({"x": torch.tensor([4.0, 0.0, -8.0, 1.0])}, 1)
        assert encoded.sent["x"].tolist() == [1.0, 0.0, -2.0, 0.0]
        with pytest.raises(CodecConfigError, match="already registered"):
            REGISTRY.register("topk")(HalfScale)
    finally:
        REGISTRY.unregister("halfscale")
    with pytest.raises(CodecConfigError, match="unknown codec 'halfscale'"):
        CodecPipeline(["halfscale"])
