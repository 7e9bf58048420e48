"""Quantisation of the floats that are sent: deterministic int8, int4 and fp8, and QSGD's unbiased stochastic levels.

Each writes every value as a code times a float32 scale shared by a block of values (``block`` values
per scale; 0 = one scale for the whole vector):

- ``int8``: scale = max |x| / 127 over the block, code = round(x / scale); the error of each value is
  at most scale / 2. Deterministic.
- ``int4``: the same with codes in [−7, 7] (scale = max |x| / 7), two codes per byte on the wire; the
  error of each value is at most scale / 2. Deterministic.
- ``int2``: 2-bit codes on the odd levels −3, −1, 1, 3 (scale = max |x| / 3 over the block: the levels are ±max and
  ±max / 3, and no zero, since it writes values a sparsifier chose for their size), four codes per byte on the
  wire; the error of each value is at most the scale. Deterministic. SparseLoCo's values codec.
- ``fp8``: scale = max |x| / 448 over the block, code = x / scale rounded to the nearest float8 e4m3
  (ties to even), so the block's largest magnitude maps to e4m3's largest, 448. The error of each value
  is at most 2⁻⁴ of it where |x| / scale ≥ 2⁻⁶ (e4m3's normal range: 3 mantissa bits), and at most
  2⁻¹⁰ · scale below (the subnormals' half step). Deterministic.
- ``qsgd`` (Alistarh et al., 2017) with s levels: scale = ‖x‖₂ / s over the block, code =
  sign(x) · ⌊|x| / scale + u⌋ with u ~ U[0, 1), so E[decode(encode(x))] = x (unbiased). Codes fit
  int8 for s ≤ 127, int16 above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from crossdc.compression.base import ValuesCodec
from crossdc.compression.wire import F8, INT2_MAX, INT4_MAX, Q2, Q4, Q8, Q16, VALUE_KINDS, Values
from crossdc.parameters import Parameter

#: the largest int8 code (the codes are symmetric: −128 is never written)
INT8_MAX = 127
#: the largest finite float8 e4m3 value (torch.float8_e4m3fn: no infinities)
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """`values` as rows of `block` (zero-padded), or one row when block is 0."""
    if block == 0 or block >= values.numel():
        return values.view(1, -1)
    return F.pad(values, (0, (-values.numel()) % block)).view(-1, block)


def _max_abs_scaled(values: torch.Tensor, block: int, largest: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`values` divided, block by block, by scale = max |x| / `largest` (an all-zero block: scale 0, values 0), so
    each block's largest magnitude becomes `largest`: (the scaled values, flat and zero-padded to whole blocks,
    the scales, the block as the wire records it: 0 when one scale covers everything)."""
    rows = _blocks(values.reshape(-1).to(torch.float32), block)
    scales = rows.abs().amax(dim=1) / largest
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.div(rows, safe[:, None]).view(-1), scales, block if rows.shape[0] > 1 else 0


def _rounded_codes(values: torch.Tensor, block: int, largest: int, encoding: str) -> Values:
    """Symmetric integer codes round(x / scale) in [−largest, largest] with a max-abs scale per block."""
    scaled, scales, recorded = _max_abs_scaled(values, block, float(largest))
    codes = scaled.round_().clamp_(-largest, largest).to(VALUE_KINDS[encoding].dtype)[: values.numel()]
    return Values(encoding, codes, scales, recorded)


def int8_quantize(values: torch.Tensor, block: int = 0) -> Values:
    """Deterministic symmetric int8 codes with a max-abs scale per block (error ≤ scale / 2 per value)."""
    return _rounded_codes(values, block, INT8_MAX, Q8)


def int4_quantize(values: torch.Tensor, block: int = 0) -> Values:
    """Deterministic symmetric int4 codes in [−7, 7] with a max-abs scale per block (error ≤ scale / 2 per value);
    the codes are int8 in memory and packed two per byte on the wire."""
    return _rounded_codes(values, block, INT4_MAX, Q4)


def int2_quantize(values: torch.Tensor, block: int = 0) -> Values:
    """Deterministic 2-bit codes: x / scale (scale = max |x| / 3 per block) rounded to the nearest odd level of −3, −1,
    1, 3 (error ≤ scale per value; a zero lands on ±1)."""
    scaled, scales, recorded = _max_abs_scaled(values, block, float(INT2_MAX))
    odd = (torch.floor(scaled.clamp_(-INT2_MAX, INT2_MAX) / 2) * 2 + 1).clamp_(-INT2_MAX, INT2_MAX)
    return Values(Q2, odd.to(torch.int8)[: values.numel()], scales, recorded)


def fp8_quantize(values: torch.Tensor, block: int = 0) -> Values:
    """Deterministic float8 e4m3 codes with a max-abs scale per block: x / scale rounded to the nearest e4m3 value
    (error ≤ 2⁻⁴ |x| in e4m3's normal range, ≤ 2⁻¹⁰ · scale in its subnormal range)."""
    scaled, scales, recorded = _max_abs_scaled(values, block, FP8_E4M3_MAX)
    codes = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)[: values.numel()]
    return Values(F8, codes, scales, recorded)


def qsgd_quantize(values: torch.Tensor, levels: int, block: int = 0, generator: torch.Generator | None = None) -> Values:
    """QSGD's unbiased stochastic rounding to `levels` levels of each block's L2 norm."""
    rows = _blocks(values.reshape(-1).to(torch.float32), block)
    scales = torch.linalg.vector_norm(rows, dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = rows.abs() / safe[:, None]
    noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=scaled.dtype)
    magnitude = torch.floor(scaled + noise).clamp_(max=levels)
    encoding = qsgd_encoding(levels)
    codes = (torch.sign(rows) * magnitude).to(VALUE_KINDS[encoding].dtype).view(-1)[: values.numel()]
    return Values(encoding, codes, scales, block if rows.shape[0] > 1 else 0)


def qsgd_encoding(levels: int) -> str:
    """The wire encoding of QSGD's codes with `levels` levels: int8 up to 127, int16 above."""
    return Q8 if levels <= INT8_MAX else Q16


class MaxAbsCodec(ValuesCodec):
    """Base of the deterministic codecs that write x / scale, scale = max |x| / the format's largest value per block
    (int8, int4, fp8). A subclass names its wire `encoding`, its `quantizer` and its `default_block`; its parameters
    (``block``, ``ef``) and `value_bytes` follow from them."""

    #: the pure function that writes a vector with one scale per `block` values (0: one scale in all)
    quantizer: ClassVar[Callable[[torch.Tensor, int], Values]]
    #: the default of ``block``
    default_block: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        assert cls.encoding is not None, f"{cls.__name__} must name its wire encoding"
        cls.value_bytes = VALUE_KINDS[cls.encoding].bytes_per_value
        cls.parameters = {
            "block": Parameter(int, cls.default_block, "values per scale (0 = one scale per tensor)", low=0),
            "ef": Parameter(bool, False, "keep the rounding error in a residual added to the next update"),
        }

    def quantize(self, values: torch.Tensor, generator: torch.Generator | None) -> Values:
        return type(self).quantizer(values, self.params["block"])


class Int8(MaxAbsCodec):
    """int8 quantisation with a max-abs scale per tensor or per block (deterministic)."""

    name = "int8"
    encoding = Q8
    quantizer = int8_quantize


class Int4(MaxAbsCodec):
    """int4 quantisation (codes -7..7, two per byte) with a max-abs scale per block of 64 or per tensor (deterministic)."""

    name = "int4"
    encoding = Q4
    quantizer = int4_quantize
    # 64: with only 7 levels a side, one outlier per tensor would round most values to 0; a scale per 64 values
    # keeps outliers local for 4 / 64 = 0.0625 bytes per value (0.5625 in all, 7.1x smaller than float32)
    default_block = 64


class Int2(MaxAbsCodec):
    """2-bit values (levels ±max, ±max/3 of each block, four per byte) with a max-abs scale per block of 64: with a
    chunked top-k of k = 64 per chunk (its default), one scale per chunk (SparseLoCo)."""

    name = "int2"
    encoding = Q2
    quantizer = int2_quantize
    default_block = 64


class FP8(MaxAbsCodec):
    """float8 e4m3 values with a max-abs scale per tensor or per block (deterministic; 2^-4 relative error)."""

    name = "fp8"
    encoding = F8
    quantizer = fp8_quantize


class QSGD(ValuesCodec):
    """QSGD stochastic quantisation to s levels of each block's norm (unbiased)."""

    name = "qsgd"
    positional = "levels"
    value_bytes = 1.0  # int8 codes; int16 above 127 levels (wire_encoding says which, and the pipeline counts that)
    parameters = {
        "levels": Parameter(int, 16, "quantisation levels s", low=1, high=32767),
        "block": Parameter(int, 512, "values per norm (0 = one norm per tensor)", low=0),
        "ef": Parameter(bool, False, "keep the quantisation error in a residual added to the next update"),
    }

    def wire_encoding(self) -> str:
        return qsgd_encoding(self.params["levels"])

    def quantize(self, values: torch.Tensor, generator: torch.Generator | None) -> Values:
        return qsgd_quantize(values, self.params["levels"], self.params["block"], generator)
