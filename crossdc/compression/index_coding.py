"""Compact encodings of the positions a sparse tensor keeps (pure torch, CPU or GPU, no Python loops).

Two encodings, and the cheaper one is chosen per tensor:

- ``varint``: the sorted positions as gaps (first position, then ``p[i] − p[i−1] − 1``), each gap
  as an unsigned LEB128 varint (7 bits per byte, high bit = "more bytes follow");
- ``bitmap``: one bit per element of the tensor, little-endian within each byte.

Both are exact and round-trip for any sorted, unique set of positions in ``[0, numel)``.
"""

from __future__ import annotations

import torch

VARINT = "varint"
BITMAP = "bitmap"
_MAX_VARINT_BYTES = 9  # enough for any non-negative int64 (9 × 7 = 63 bits)
#: the least value that needs 2, 3, ... 9 bytes
_VARINT_THRESHOLDS = torch.tensor([1 << (7 * group) for group in range(1, _MAX_VARINT_BYTES)], dtype=torch.int64)


class IndexCodingError(ValueError):
    """Encoded positions that cannot be decoded (truncated, corrupted, or out of range)."""


def _varint_lengths(values: torch.Tensor) -> torch.Tensor:
    """Bytes each non-negative value needs as a varint (1 for 0..127, 2 for 128..16383, ...)."""
    thresholds = _VARINT_THRESHOLDS.to(values.device)
    return (1 + torch.bucketize(values, thresholds, right=True)).to(values.dtype)


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    gaps = positions.clone()
    if positions.numel() > 1:
        gaps[1:] = positions[1:] - positions[:-1] - 1
    return gaps


def varint_size(positions: torch.Tensor) -> int:
    """Bytes :func:`encode_varint` would produce for these sorted positions."""
    return int(_varint_lengths(_gaps(positions.to(torch.int64))).sum()) if positions.numel() else 0


def bitmap_size(numel: int) -> int:
    """Bytes of a bitmap over `numel` elements."""
    return (numel + 7) // 8


def encode_varint(positions: torch.Tensor) -> torch.Tensor:
    """Sorted unique int64 positions → uint8 bytes of their gaps as LEB128 varints."""
    if positions.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=positions.device)
    gaps = _gaps(positions.to(torch.int64))
    lengths = _varint_lengths(gaps)
    width = int(lengths.max())
    shifts = 7 * torch.arange(width, device=gaps.device, dtype=torch.int64)
    groups = (gaps[:, None] >> shifts) & 0x7F
    column = torch.arange(width, device=gaps.device)
    more = column[None, :] < (lengths[:, None] - 1)
    present = column[None, :] < lengths[:, None]
    return (groups | (more.to(torch.int64) << 7))[present].to(torch.uint8)


def decode_varint(data: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The `count` sorted positions encoded by :func:`encode_varint`; IndexCodingError if `data` is not that."""
    if count == 0:
        if data.numel():
            raise IndexCodingError(f"{data.numel()} index bytes for 0 positions")
        return torch.zeros(0, dtype=torch.int64, device=data.device)
    data = data.to(torch.int64)
    ends = (data & 0x80) == 0
    if data.numel() == 0 or not bool(ends[-1]):
        raise IndexCodingError("truncated index varints")
    value_id = torch.cumsum(ends.to(torch.int64), 0) - ends.to(torch.int64)
    if int(value_id[-1]) + 1 != count:
        raise IndexCodingError(f"index bytes hold {int(value_id[-1]) + 1} positions, {count} expected")
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=data.device), torch.nonzero(ends).flatten()[:-1] + 1])
    offset = torch.arange(data.numel(), device=data.device) - starts[value_id]
    if int(offset.max()) >= 9:  # gaps past 2^63 are not positions of any tensor
        raise IndexCodingError("index varint too long")
    gaps = torch.zeros(count, dtype=torch.int64, device=data.device)
    gaps.index_add_(0, value_id, (data & 0x7F) << (7 * offset))
    positions = torch.cumsum(gaps + 1, 0) - 1
    if int(positions[-1]) >= numel:
        raise IndexCodingError(f"position {int(positions[-1])} outside a tensor of {numel} elements")
    return positions


def encode_bitmap(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """Positions → uint8 bitmap of ``ceil(numel / 8)`` bytes."""
    bits = torch.zeros(bitmap_size(numel) * 8, dtype=torch.uint8, device=positions.device)
    bits[positions.to(torch.int64)] = 1
    weights = (1 << torch.arange(8, device=positions.device, dtype=torch.int64)).to(torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.int64).to(torch.uint8)


def decode_bitmap(data: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The sorted positions of the set bits; IndexCodingError if their number is not `count`."""
    if data.numel() != bitmap_size(numel):
        raise IndexCodingError(f"bitmap of {data.numel()} bytes for {numel} elements ({bitmap_size(numel)} expected)")
    shifts = torch.arange(8, device=data.device, dtype=torch.int64)
    bits = ((data.to(torch.int64)[:, None] >> shifts) & 1).flatten()
    if numel < bits.numel() and bool(bits[numel:].any()):
        raise IndexCodingError("bitmap has bits set past the tensor's end")
    positions = torch.nonzero(bits[:numel]).flatten()
    if positions.numel() != count:
        raise IndexCodingError(f"bitmap holds {positions.numel()} positions, {count} expected")
    return positions


def encode_positions(positions: torch.Tensor, numel: int) -> tuple[str, torch.Tensor]:
    """The cheaper of the two encodings: (its name, its bytes)."""
    if varint_size(positions) <= bitmap_size(numel):
        return VARINT, encode_varint(positions)
    return BITMAP, encode_bitmap(positions, numel)


def decode_positions(kind: str, data: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`encode_positions`."""
    if kind == VARINT:
        return decode_varint(data, count, numel)
    if kind == BITMAP:
        return decode_bitmap(data, count, numel)
    raise IndexCodingError(f"unknown index encoding {kind!r}")
