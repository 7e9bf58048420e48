"""The low-bit values codecs on small exact cases: int4 (two codes per byte) and fp8 (float8 e4m3).

Error bounds, the exact wire bytes (nibble packing, section sizes for odd and even lengths and blocks), zeros and
all-equal tensors, malformed payloads, composition with top-k, PowerSGD, error feedback and the downlink, and the
listing of `crossdc codecs list --json`.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli_errors import cli  # tests/ is on sys.path

from crossdc.compression.base import build_codec
from crossdc.compression.downlink import DownlinkSender
from crossdc.compression.pipeline import CodecPipeline, decode_payload
from crossdc.compression.quantize import FP8_E4M3_MAX, fp8_quantize, int4_quantize
from crossdc.compression.uplink import decode_arrays
from crossdc.compression.wire import F8, Q4, VALUE_KINDS, CodecError, EncodedTensor, Values, pack_nibbles, serialize, unpack_nibbles

#: e4m3: 3 mantissa bits (half a step: 2⁻⁴ of the value), smallest normal 2⁻⁶, subnormal step 2⁻⁹
E4M3_RELATIVE_ERROR = 2.0 ** -4
E4M3_SMALLEST_NORMAL = 2.0 ** -6
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10


def _per_value_scales(values: Values) -> torch.Tensor:
    """The scale each value was written against."""
    assert values.scales is not None
    if values.block == 0:
        return values.scales[0].expand(values.count)
    return torch.repeat_interleave(values.scales, values.block)[: values.count]


def _sections(payload: np.ndarray) -> bytes:
    """A payload's bytes after its magic, length and header: the sections."""
    (head_len,) = struct.unpack("<I", payload[4:8].tobytes())
    return payload[8 + head_len :].tobytes()


def _dense_payload(values: Values, name: str = "x") -> np.ndarray:
    return serialize([EncodedTensor(name, (values.count,), "dense", [values])], {})


def _spread(n: int, seed: int) -> torch.Tensor:
    """`n` values of either sign whose magnitudes span 10⁻⁶ … 10² (so blocks see small and large values)."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** (torch.rand(n, generator=g) * 8 - 6)
    return torch.where(torch.rand(n, generator=g) < 0.5, -magnitudes, magnitudes)


# --- int4 -------------------------------------------------------------------------------------------

def test_int4_nibbles_are_packed_low_first_in_twos_complement() -> None:
    # -7 = 0b1001, 7 = 0b0111 → 0x79; 0, 3 → 0x30; -1 = 0b1111 and a zero padding nibble → 0x0F
    codes = torch.tensor([-7, 7, 0, 3, -1], dtype=torch.int8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x79, 0x30, 0x0F]
    assert torch.equal(unpack_nibbles(packed, 5), codes)
    assert pack_nibbles(torch.tensor([1, -2], dtype=torch.int8)).tolist() == [0xE1]


def test_int4_codes_on_the_wire_are_the_packed_nibbles_then_the_scale() -> None:
    values = int4_quantize(torch.tensor([-7.0, 7.0, 0.0, 3.0, -1.0]))
    assert values.codes.tolist() == [-7, 7, 0, 3, -1] and values.scales.tolist() == [1.0]
    assert _sections(_dense_payload(values)) == bytes([0x79, 0x30, 0x0F]) + struct.pack("<f", 1.0)


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 1001])
@pytest.mark.parametrize("block", [0, 5, 64])
def test_int4_error_within_half_a_scale(n: int, block: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    values = int4_quantize(x, block)
    scales = _per_value_scales(values)
    assert bool(((values.decode() - x).abs() <= scales / 2 * (1 + 1e-6)).all())
    assert int(values.codes.abs().max()) == 7  # each block's largest magnitude maps to ±7
    assert values.codes.dtype == torch.int8 and values.scales.numel() == (1 if block == 0 else math.ceil(n / block))


def test_fp8_codes_on_the_wire_are_e4m3_bytes_then_the_scale() -> None:
    # scale = 448 / 448 = 1: 448 = 0 1111 110 (0x7E), -1 = 1 0111 000 (0xB8), 2⁻⁹ = the smallest subnormal (0x01)
    values = fp8_quantize(torch.tensor([448.0, -1.0, 2.0 ** -9]))
    assert values.codes.dtype == torch.float8_e4m3fn
    assert _sections(_dense_payload(values)) == bytes([0x7E, 0xB8, 0x01]) + struct.pack("<f", 1.0)
    assert values.decode().tolist() == [448.0, -1.0, 2.0 ** -9]


@pytest.mark.parametrize("block", [0, 16, 100])
def test_fp8_error_within_e4m3s_relative_step_and_the_subnormal_step(block: int) -> None:
    x = _spread(1000, seed=block)
    values = fp8_quantize(x, block)
    scales = _per_value_scales(values)
    error = (values.decode() - x).abs()
    normal = x.abs() >= E4M3_SMALLEST_NORMAL * scales
    slack = 1 + 1e-6  # the float32 division by the scale and multiplication by it
    assert bool((error[normal] <= E4M3_RELATIVE_ERROR * x.abs()[normal] * slack).all())
    assert bool((error[~normal] <= E4M3_SUBNORMAL_HALF_STEP * scales[~normal] * slack).all())
    assert bool(normal.any()) and bool((~normal).any())  # both ranges were exercised
    assert float(values.codes.float().abs().max()) == FP8_E4M3_MAX


def test_fp8_rounds_to_nearest_ties_to_even_in_the_subnormals() -> None:
    # scale 1 (448 is the largest): 2⁻¹⁰ lies halfway between 0 and 2⁻⁹ → 0; 3·2⁻¹⁰ halfway between 2⁻⁹ and 2⁻⁸ → 2⁻⁸
    decoded = fp8_quantize(torch.tensor([448.0, 2.0 ** -10, 3 * 2.0 ** -10, -(2.0 ** -10)])).decode()
    assert decoded.tolist() == [448.0, 0.0, 2.0 ** -8, 0.0]


# --- both: bytes, edge cases, determinism ------------------------------------------------------------------

@pytest.mark.parametrize("codec, encoding, code_bytes", [("int4", Q4, lambda n: (n + 1) // 2), ("fp8", F8, lambda n: n)])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 65, 130])
@pytest.mark.parametrize("block", [0, 3, 64])
def test_exact_section_bytes_for_odd_and_even_lengths_and_blocks(codec: str, encoding: str, code_bytes, n: int,
                                                                 block: int) -> None:
    expected = code_bytes(n) + 4 * (1 if block == 0 else math.ceil(n / block))
    encoded = CodecPipeline([f"{codec}:block={block}"]).encode({"x": torch.randn(n)}, 1)
    assert len(_sections(encoded.payload)) == expected
    assert build_codec(f"{codec}:block={block}").wire_bytes(n) == expected == VALUE_KINDS[encoding].section_bytes(n, block)


def test_value_bytes_are_half_a_byte_for_int4_and_one_for_fp8() -> None:
    assert build_codec("int4").value_bytes == 0.5 and build_codec("fp8").value_bytes == 1.0
    assert build_codec("int4").params == {"block": 64, "ef": False}
    assert build_codec("fp8").params == {"block": 0, "ef": False}


@pytest.mark.parametrize("quantize", [int4_quantize, fp8_quantize])
def test_zeros_and_all_equal_tensors(quantize) -> None:
    zeros = quantize(torch.zeros(9), 4)
    assert zeros.scales.tolist() == [0.0, 0.0, 0.0] and zeros.decode().tolist() == [0.0] * 9
    equal = quantize(torch.full((9,), -3.5), 4)  # every value is its block's largest: the format's largest code
    assert equal.codes.float().tolist() == [-(7.0 if quantize is int4_quantize else FP8_E4M3_MAX)] * 9
    assert equal.decode().tolist() == [-3.5] * 9
    odd = quantize(torch.full((5,), 0.3), 0)
    assert torch.allclose(odd.decode(), torch.full((5,), 0.3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("specs", [["int4"], ["fp8:block=8"], ["topk:0.1", "int4"], ["powersgd:rank=2", "fp8"]])
def test_encoding_is_deterministic(specs: list[str]) -> None:
    update = {"w": torch.randn(24, 16, generator=torch.Generator().manual_seed(4))}
    first, second = CodecPipeline(specs, seed=1).encode(update, 1), CodecPipeline(specs, seed=2).encode(update, 1)
    assert np.array_equal(first.payload, second.payload)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
@pytest.mark.parametrize("specs", [["int4"], ["fp8:block=16"], ["topk:0.1", "int4"], ["powersgd:rank=2", "fp8"]])
def test_the_same_bytes_on_gpu(specs: list[str]) -> None:
    update = {"w": _spread(24 * 16, seed=9).view(24, 16), "b": torch.randn(16, generator=torch.Generator().manual_seed(1))}
    on_cpu = CodecPipeline(specs).encode(update, 1)
    on_gpu = CodecPipeline(specs).encode({n: t.cuda() for n, t in update.items()}, 1)
    assert np.array_equal(on_cpu.payload, on_gpu.payload)
    decoded = decode_payload(on_gpu.payload, {n: tuple(t.shape) for n, t in update.items()})
    assert all(torch.equal(decoded[n], on_gpu.sent[n].cpu()) for n in update)


# --- malformed payloads --------------------------------------------------------------------------------

def _int4_payload() -> tuple[np.ndarray, int]:
    """A payload of one int4 tensor of 5 values, one scale, and where its sections start."""
    payload = _dense_payload(int4_quantize(torch.tensor([-7.0, 7.0, 0.0, 3.0, -1.0])))
    return payload, len(payload) - len(_sections(payload))


def test_a_malformed_int4_payload_is_refused() -> None:
    payload, start = _int4_payload()
    assert decode_payload(payload, {"x": (5,)})["x"].tolist() == [-7.0, 7.0, 0.0, 3.0, -1.0]
    minus_eight = payload.copy()
    minus_eight[start] = 0x78  # the first code becomes 0b1000 = -8: outside the symmetric codes
    padding = payload.copy()
    padding[start + 2] = 0x1F  # the nibble after the odd fifth code is not 0
    nan_scale = payload.copy()
    nan_scale[-4:] = np.frombuffer(np.float32(np.nan).tobytes(), dtype=np.uint8)
    negative_scale = payload.copy()
    negative_scale[-4:] = np.frombuffer(np.float32(-1.0).tobytes(), dtype=np.uint8)
    short = np.delete(payload, start)  # one byte of packed codes missing
    shifted = np.insert(payload, start, 0)  # one byte too many before the codes: they are read one byte early
    long = np.append(payload, np.uint8(0))  # one byte too many after the scale
    for bad, message in [(minus_eight, "-8|−8"), (padding, "padding"), (nan_scale, "scales"), (negative_scale, "scales"),
                         (short, "truncated"), (shifted, "padding"), (long, "past its last section")]:
        with pytest.raises(CodecError, match=message):
            decode_payload(bad, {"x": (5,)})


def test_unpacking_codes_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(CodecError, match="2 bytes of int4 codes for 5 values"):
        unpack_nibbles(torch.tensor([0x79, 0x30], dtype=torch.uint8), 5)


def test_a_malformed_fp8_payload_is_refused() -> None:
    payload = _dense_payload(fp8_quantize(torch.tensor([448.0, -1.0, 0.5])))
    start = len(payload) - len(_sections(payload))
    nan_code = payload.copy()
    nan_code[start] = 0x7F  # e4m3's NaN
    inf_scale = payload.copy()
    inf_scale[-4:] = np.frombuffer(np.float32(np.inf).tobytes(), dtype=np.uint8)
    for bad, message in [(nan_code, "NaN"), (inf_scale, "scales"), (payload[:-1], "truncated")]:
        with pytest.raises(CodecError, match=message):
            decode_payload(bad, {"x": (3,)})


# --- composition ----------------------------------------------------------------------------------------

def test_topk_then_int4_quantises_the_kept_values() -> None:
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.05, 4.0, 0.0])
    encoded = CodecPipeline(["topk:0.375:ef=false", "int4"]).encode({"x": x}, 1)
    assert encoded.stats["tensor_kinds"]["sparse"] == 1
    kept = int4_quantize(torch.tensor([-5.0, 3.0, 4.0])).decode()  # scale 5/7: codes -7, 4, 6
    assert encoded.sent["x"][[1, 3, 6]].tolist() == kept.tolist()
    assert int(torch.count_nonzero(encoded.sent["x"])) == 3
    assert torch.equal(decode_payload(encoded.payload, {"x": (8,)})["x"], encoded.sent["x"])


@pytest.mark.parametrize("fraction, kind", [(0.87, "sparse"), (0.874, "dense")])
def test_sparse_or_dense_is_chosen_on_exact_int4_bytes(fraction: float, kind: str) -> None:
    # n = 1000 with int4:block=8: dense = 500 + 4·125 = 1000 bytes; sparse = 125 (bitmap) + ⌈k/2⌉ + 4·⌈k/8⌉:
    # k = 870 → 125 + 435 + 436 = 996 (sparse is cheaper), k = 874 → 125 + 437 + 440 = 1002 (dense is)
    encoded = CodecPipeline([f"topk:{fraction}", "int4:block=8"]).encode({"x": torch.randn(1000)}, 1)
    assert encoded.stats["tensor_kinds"][kind] == 1
    assert len(_sections(encoded.payload)) == (996 if kind == "sparse" else 1000)


@pytest.mark.parametrize("specs", [["int4:ef=true"], ["fp8:block=4:ef=true"], ["topk:0.1", "int4"],
                                   ["powersgd:rank=2", "fp8"], ["topk:0.2:scope=global", "fp8:ef=false"]])
def test_error_feedback_carries_the_rounding_error(specs: list[str]) -> None:
    """decode + new residual == input + old residual, every round: nothing is lost, the rounding included."""
    shapes = {"w": (12, 10), "b": (10,)}
    pipeline = CodecPipeline(specs, seed=0)
    assert pipeline.error_feedback
    for server_round in range(1, 5):
        g = torch.Generator().manual_seed(server_round)
        update = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
        old = {name: pipeline.residuals.get(name, torch.zeros(shape)).clone() for name, shape in shapes.items()}
        decoded = decode_payload(pipeline.encode(update, server_round).payload, shapes)
        for name in shapes:
            assert torch.allclose(decoded[name] + pipeline.residuals[name], update[name] + old[name], atol=1e-6), name
    if specs[-1].startswith("int4"):
        assert float(pipeline.residuals["w"].abs().max()) > 0  # the rounding error is in it


def test_without_ef_no_residual_is_kept() -> None:
    pipeline = CodecPipeline(["int4"])
    pipeline.encode({"x": torch.randn(10)}, 1)
    assert not pipeline.error_feedback and pipeline.residuals == {}


@pytest.mark.parametrize("specs", [["int4"], ["fp8"], ["topk:0.5", "int4:block=16"]])
def test_a_low_bit_downlink_closes_on_a_model_that_stops_moving(specs: list[str]) -> None:
    """The downlink's reference is its error feedback: each round sends what is still missing, so the gap to a
    fixed model shrinks round after round; the delta payload decodes to exactly what the sender added."""
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((20, 16)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)}
    sender = DownlinkSender(specs)
    sender.prepare({k: np.zeros_like(v) for k, v in weights.items()}, 1)
    gaps = []
    for server_round in range(2, 6):
        before = {k: v.copy() for k, v in sender.reference.items()}
        sender.prepare(weights, server_round)
        assert sender.delta_payload is not None
        delta = decode_arrays(sender.delta_payload, before)
        for name in weights:
            assert np.array_equal(before[name] + delta[name], sender.reference[name])
        gaps.append(max(float(np.abs(sender.reference[k] - weights[k]).max()) for k in weights))
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:], strict=False)), gaps


# --- listing --------------------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_codecs_list_json_shows_int4_and_fp8_with_their_parameters(tmp_path: Path) -> None:
    result = cli(["codecs", "list", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    by_name = {row["name"]: row for row in json.loads(result.stdout)}
    for name, block in (("int4", 64), ("fp8", 0)):
        row = by_name[name]
        assert row["stage"] == "values" and row["source"] == "built-in" and row["error_feedback"] is False
        assert row["class"] == f"crossdc.compression.quantize:{'Int4' if name == 'int4' else 'FP8'}"
        assert set(row["parameters"]) == {"block", "ef"}
        assert row["parameters"]["block"]["default"] == block and row["parameters"]["block"]["low"] == 0
        assert row["parameters"]["ef"]["type"] == "bool" and row["parameters"]["ef"]["default"] is False
