"""Quantisation of the floats that are sent: deterministic int8, and QSGD's unbiased stochastic levels.

Both write each value as an integer code times a float32 scale shared by a block of values
(``block`` values per scale; 0 = one scale for the whole vector):

- ``int8``: scale = max |x| / 127 over the block, code = round(x / scale); the error of each value is
  at most scale / 2. Deterministic.
- ``qsgd`` (Alistarh et al., 2017) with s levels: scale = ‖x‖₂ / s over the block, code =
  sign(x) · ⌊|x| / scale + u⌋ with u ~ U[0, 1), so E[decode(encode(x))] = x (unbiased). Codes fit
  int8 for s ≤ 127, int16 above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from crossdc.compression.base import ValuesCodec
from crossdc.compression.wire import Q8, Q16, Values
from crossdc.parameters import Parameter


def _blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """`values` as rows of `block` (zero-padded), or one row when block is 0."""
    if block == 0 or block >= values.numel():
        return values.view(1, -1)
    return F.pad(values, (0, (-values.numel()) % block)).view(-1, block)


def int8_quantize(values: torch.Tensor, block: int = 0) -> Values:
    """Deterministic symmetric int8 codes with a max-abs scale per block."""
    rows = _blocks(values.reshape(-1).to(torch.float32), block)
    scales = rows.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.div(rows, safe[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(-1)[: values.numel()]
    return Values(Q8, codes, scales, block if rows.shape[0] > 1 else 0)


def qsgd_quantize(values: torch.Tensor, levels: int, block: int = 0, generator: torch.Generator | None = None) -> Values:
    """QSGD's unbiased stochastic rounding to `levels` levels of each block's L2 norm."""
    rows = _blocks(values.reshape(-1).to(torch.float32), block)
    scales = torch.linalg.vector_norm(rows, dim=1) / levels
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = rows.abs() / safe[:, None]
    noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=scaled.dtype)
    magnitude = torch.floor(scaled + noise).clamp_(max=levels)
    dtype = torch.int8 if levels <= 127 else torch.int16
    codes = (torch.sign(rows) * magnitude).to(dtype).view(-1)[: values.numel()]
    return Values(Q8 if levels <= 127 else Q16, codes, scales, block if rows.shape[0] > 1 else 0)


class Int8(ValuesCodec):
    """int8 quantisation with a max-abs scale per tensor or per block (deterministic)."""

    name = "int8"
    value_bytes = 1.0
    parameters = {
        "block": Parameter(int, 0, "values per scale (0 = one scale per tensor)", low=0),
        "ef": Parameter(bool, False, "keep the rounding error in a residual added to the next update"),
    }

    def quantize(self, values: torch.Tensor, generator: torch.Generator | None) -> Values:
        return int8_quantize(values, self.params["block"])


class QSGD(ValuesCodec):
    """QSGD stochastic quantisation to s levels of each block's norm (unbiased)."""

    name = "qsgd"
    positional = "levels"
    value_bytes = 1.0  # int8 codes; int16 above 127 levels (still counted as 1 byte when choosing sparse or dense)
    parameters = {
        "levels": Parameter(int, 16, "quantisation levels s", low=1, high=32767),
        "block": Parameter(int, 512, "values per norm (0 = one norm per tensor)", low=0),
        "ef": Parameter(bool, False, "keep the quantisation error in a residual added to the next update"),
    }

    def quantize(self, values: torch.Tensor, generator: torch.Generator | None) -> Values:
        return qsgd_quantize(values, self.params["levels"], self.params["block"], generator)
