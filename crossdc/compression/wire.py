"""The compressed wire format: encoded tensors ↔ one self-describing byte string.

Layout of a payload (every byte of it is what crosses the WAN and is counted):

    b"CDC2" | uint32 little-endian header length | header (compact JSON, zlib-compressed) | sections

(``b"CDC1"`` is the same with the header's JSON uncompressed: still read, no longer written. On a small model the
per-tensor names and sizes are a large share of a sparse payload; zlib cuts them 3–4×.)

The header lists, per tensor: name ``n``, shape ``s``, kind ``k`` (``dense``, ``sparse``, ``lowrank``),
for sparse tensors the position encoding ``i`` (varint or bitmap), the number of kept values ``c``
and the index bytes ``ib``, for low-rank tensors the matrix view ``m`` and rank ``r``, and the value
arrays ``a`` (each: encoding ``e``, element count ``n``, scale block ``b``). Sections follow in header
order: a sparse tensor's position bytes, then for every value array its codes and, for the scaled
encodings, its float32 scales (one per block). Decoding checks that the sizes add up to the payload's
length exactly, so a truncated or padded payload is refused, and refuses scales that are negative or
not finite, int4 codes outside [−7, 7] and a non-zero padding nibble (a NaN e4m3 code decodes to NaN,
which the pipeline's decoder refuses with every other NaN).

The value encodings (:data:`VALUE_KINDS`, one definition each: what the codes are, how many bytes n of
them take, whether scales follow):

- ``f32``: plain float32, 4 bytes per value;
- ``q8`` / ``q16``: int8 / int16 codes (little-endian) times a scale per block;
- ``f8``: float8 e4m3 codes (1 sign, 4 exponent, 3 mantissa bits; finite up to ±448, no infinities)
  times a scale per block, 1 byte per value;
- ``q4``: int4 codes in [−7, 7] times a scale per block, two per byte: value 2i in the low nibble of
  byte i, value 2i + 1 in its high nibble, each as 4-bit two's complement; an odd count leaves the last
  high nibble 0. n values take ⌈n/2⌉ bytes.
- ``q2``: 2-bit codes, the odd levels −3, −1, 1, 3 times a scale per block, four per byte: value 4i + j in bits
  2j, 2j + 1 of byte i as (code + 3) / 2; the unused bits after the last value are 0. n values take ⌈n/4⌉ bytes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

MAGIC = b"CDC2"
#: the first version of the format: the same layout with an uncompressed header (read, never written)
MAGIC_PLAIN_HEADER = b"CDC1"
#: the largest header a payload may unpack to (a forged one must not inflate without bound)
MAX_HEADER_BYTES = 64 << 20
DENSE, SPARSE, LOWRANK = "dense", "sparse", "lowrank"
F32, Q8, Q16, F8, Q4, Q2 = "f32", "q8", "q16", "f8", "q4", "q2"
#: bytes of one float32 scale
SCALE_BYTES = 4
#: the largest magnitude an int4 code takes (the codes are symmetric: −8 is never written)
INT4_MAX = 7


class CodecError(ValueError):
    """A payload or an update the codecs cannot handle: truncated, corrupted, wrong names or shapes, NaN/Inf."""


@dataclass
class Values:
    """One vector of floats as sent: plain float32, or integer codes times a float32 scale per block."""

    encoding: str
    codes: torch.Tensor  # float32 for f32; the codes in memory otherwise (VALUE_KINDS[encoding].dtype; q4: int8, unpacked)
    scales: torch.Tensor | None = None  # float32, one per block (the scaled encodings)
    block: int = 0  # elements per scale block; 0 = one block for the whole vector

    @property
    def count(self) -> int:
        return int(self.codes.numel())

    def decode(self) -> torch.Tensor:
        """The float32 vector these values stand for."""
        if self.encoding == F32:
            return self.codes.to(torch.float32)
        assert self.scales is not None
        codes = self.codes.to(torch.float32)
        if self.block == 0:
            return codes * self.scales[0]
        return (codes.view(-1) * torch.repeat_interleave(self.scales, self.block)[: codes.numel()]).view(-1)


def plain(values: torch.Tensor) -> Values:
    """Values sent as float32."""
    return Values(F32, values.reshape(-1).to(torch.float32))


@dataclass
class EncodedTensor:
    """One tensor as the codecs left it: dense values, kept positions + values, or low-rank factors."""

    name: str
    shape: tuple[int, ...]
    kind: str
    parts: list[Values]
    positions: torch.Tensor | None = None  # sparse: sorted int64 positions in the flattened tensor
    matrix: tuple[int, int] | None = None  # lowrank: (rows, cols) of the matrix view; parts = [P (rows×r), Q (cols×r)]
    extra: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


def reconstruct(encoded: EncodedTensor) -> torch.Tensor:
    """The dense float32 tensor an encoded tensor stands for."""
    if encoded.kind == DENSE:
        return encoded.parts[0].decode().view(encoded.shape)
    if encoded.kind == SPARSE:
        assert encoded.positions is not None
        out = torch.zeros(encoded.numel, dtype=torch.float32, device=encoded.parts[0].codes.device)
        out[encoded.positions] = encoded.parts[0].decode()
        return out.view(encoded.shape)
    if encoded.kind == LOWRANK:
        assert encoded.matrix is not None
        rows, cols = encoded.matrix
        p = encoded.parts[0].decode().view(rows, -1)
        q = encoded.parts[1].decode().view(cols, -1)
        return (p @ q.T).view(encoded.shape)
    raise CodecError(f"unknown tensor kind {encoded.kind!r}")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _scale_blocks(count: int, block: int) -> int:
    return 1 if block == 0 else (count + block - 1) // block


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes in [−8, 7] → uint8 bytes, two per byte (low nibble first, 4-bit two's complement);
    an odd count leaves the last high nibble 0. ⌈n/2⌉ bytes for n codes."""
    nibbles = codes.reshape(-1).to(torch.int16) & 0xF
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    pairs = nibbles.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack_nibbles(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles` for codes in [−7, 7]: `count` int8 codes; CodecError when `data` is not
    ⌈count/2⌉ bytes, the padding nibble is not 0, or a code is −8."""
    if data.numel() != (count + 1) // 2:
        raise CodecError(f"{data.numel()} bytes of int4 codes for {count} values ({(count + 1) // 2} expected)")
    as_int = data.reshape(-1).to(torch.int16)
    nibbles = torch.stack([as_int & 0xF, as_int >> 4], dim=1).view(-1)
    if count % 2 and int(nibbles[-1]) != 0:
        raise CodecError("int4 codes: the padding nibble after an odd count is not 0")
    nibbles = nibbles[:count]
    if bool((nibbles == 0x8).any()):
        raise CodecError(f"int4 code −8 outside the symmetric range [−{INT4_MAX}, {INT4_MAX}]")
    return torch.where(nibbles > 7, nibbles - 16, nibbles).to(torch.int8)


#: the largest magnitude a 2-bit code takes (the levels are −3, −1, 1, 3: symmetric, and no zero)
INT2_MAX = 3


def pack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes in {−3, −1, 1, 3} → uint8 bytes, four per byte (value 4i + j in bits 2j..2j+1 of byte i, stored as
    (code + 3) / 2); the unused bits after the last value are 0. ⌈n/4⌉ bytes for n codes."""
    crumbs = ((codes.reshape(-1).to(torch.int16) + INT2_MAX) // 2) & 0x3
    crumbs = torch.cat([crumbs, crumbs.new_zeros((-crumbs.numel()) % 4)]).view(-1, 4)
    return (crumbs[:, 0] | (crumbs[:, 1] << 2) | (crumbs[:, 2] << 4) | (crumbs[:, 3] << 6)).to(torch.uint8)


def unpack_crumbs(data: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_crumbs`: `count` int8 codes in {−3, −1, 1, 3}; CodecError when `data` is not
    ⌈count/4⌉ bytes or the unused bits after the last value are not 0."""
    if data.numel() != (count + 3) // 4:
        raise CodecError(f"{data.numel()} bytes of 2-bit codes for {count} values ({(count + 3) // 4} expected)")
    as_int = data.reshape(-1).to(torch.int16)
    crumbs = torch.stack([(as_int >> shift) & 0x3 for shift in (0, 2, 4, 6)], dim=1).view(-1)
    if bool(crumbs[count:].any()):
        raise CodecError("2-bit codes: the unused bits after the last value are not 0")
    return (crumbs[:count] * 2 - INT2_MAX).to(torch.int8)


@dataclass(frozen=True)
class ValueKind:
    """One value encoding on the wire: the codes' dtype in memory, the bits each code takes on the wire, whether
    float32 scales (one per block) follow the codes, and how codes become bytes and back."""

    name: str
    dtype: torch.dtype
    bits: int
    scaled: bool
    pack: Callable[[torch.Tensor], torch.Tensor] = _as_bytes
    #: (bytes, count) → codes; None: the bytes are the codes, viewed as `dtype`
    unpack: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    @property
    def bytes_per_value(self) -> float:
        """Bytes one value's code takes (0.5 for q4), scales aside."""
        return self.bits / 8

    def code_bytes(self, count: int) -> int:
        """Bytes of `count` codes on the wire (whole bytes: ⌈count · bits / 8⌉)."""
        return (count * self.bits + 7) // 8

    def section_bytes(self, count: int, block: int) -> int:
        """Bytes a value array of `count` values with scale block `block` takes on the wire: codes plus scales."""
        return self.code_bytes(count) + (SCALE_BYTES * _scale_blocks(count, block) if self.scaled else 0)

    def from_wire(self, data: torch.Tensor, count: int) -> torch.Tensor:
        """The codes in memory from their :meth:`code_bytes` bytes (uint8); CodecError if they are malformed."""
        return data.view(self.dtype) if self.unpack is None else self.unpack(data, count)


#: every value encoding, by the name the header gives it
VALUE_KINDS: dict[str, ValueKind] = {kind.name: kind for kind in (
    ValueKind(F32, torch.float32, 32, scaled=False),
    ValueKind(Q8, torch.int8, 8, scaled=True),
    ValueKind(Q16, torch.int16, 16, scaled=True),
    ValueKind(F8, torch.float8_e4m3fn, 8, scaled=True),
    ValueKind(Q4, torch.int8, 4, scaled=True, pack=pack_nibbles, unpack=unpack_nibbles),
    ValueKind(Q2, torch.int8, 2, scaled=True, pack=pack_crumbs, unpack=unpack_crumbs),
)}


def serialize(tensors: list[EncodedTensor], index_bytes: dict[str, tuple[str, torch.Tensor]]) -> np.ndarray:
    """One payload (uint8 numpy array, on the host) for `tensors`; `index_bytes[name]` = a sparse tensor's
    (position encoding, its bytes). Sections are joined on the tensors' device, then copied once."""
    header: list[dict] = []
    sections: list[torch.Tensor] = []
    for t in tensors:
        entry: dict = {"n": t.name, "s": list(t.shape), "k": t.kind, "a": []}
        if t.kind == SPARSE:
            kind, data = index_bytes[t.name]
            entry.update(i=kind, c=int(t.parts[0].count), ib=int(data.numel()))
            sections.append(data)
        if t.kind == LOWRANK:
            assert t.matrix is not None
            entry.update(m=list(t.matrix))
        for part in t.parts:
            value_kind = VALUE_KINDS[part.encoding]
            entry["a"].append({"e": part.encoding, "n": part.count, "b": part.block})
            sections.append(value_kind.pack(part.codes))
            if value_kind.scaled:
                assert part.scales is not None
                sections.append(_as_bytes(part.scales.to(torch.float32)))
        header.append(entry)
    head = zlib.compress(json.dumps({"v": 1, "t": header}, separators=(",", ":")).encode(), 9)
    body = torch.cat([s.to(sections[0].device) for s in sections]) if sections else torch.zeros(0, dtype=torch.uint8)
    pinned = body.is_cuda
    host = torch.empty(body.numel(), dtype=torch.uint8, pin_memory=pinned)
    host.copy_(body)
    return np.concatenate([np.frombuffer(MAGIC + struct.pack("<I", len(head)) + head, dtype=np.uint8), host.numpy()])


def _take(blob: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, what: str) -> tuple[torch.Tensor, int]:
    if nbytes < 0 or offset + nbytes > blob.numel():
        raise CodecError(f"payload truncated in {what}")
    return blob[offset : offset + nbytes].clone().view(dtype), offset + nbytes


def parse(payload: np.ndarray | bytes) -> tuple[list[EncodedTensor], dict[str, tuple[str, torch.Tensor]]]:
    """Inverse of :func:`serialize`: the encoded tensors and their position bytes; CodecError if malformed."""
    raw = bytes(payload) if not isinstance(payload, np.ndarray) else payload.astype(np.uint8, copy=False).tobytes()
    if len(raw) < 8 or raw[:4] not in (MAGIC, MAGIC_PLAIN_HEADER):
        raise CodecError("not a crossdc compressed payload (bad magic)")
    (head_len,) = struct.unpack("<I", raw[4:8])
    if 8 + head_len > len(raw):
        raise CodecError("payload truncated in its header")
    try:
        head = raw[8 : 8 + head_len]
        if raw[:4] == MAGIC:
            inflate = zlib.decompressobj()
            head = inflate.decompress(head, MAX_HEADER_BYTES)
            assert inflate.eof and not inflate.unconsumed_tail and not inflate.unused_data
        header = json.loads(head)
        entries = header["t"]
        assert header["v"] == 1 and isinstance(entries, list)
    except Exception as err:
        raise CodecError(f"unreadable payload header ({type(err).__name__})") from None
    blob = torch.frombuffer(bytearray(raw[8 + head_len :]), dtype=torch.uint8) if len(raw) > 8 + head_len \
        else torch.zeros(0, dtype=torch.uint8)
    tensors: list[EncodedTensor] = []
    index_bytes: dict[str, tuple[str, torch.Tensor]] = {}
    offset = 0
    try:
        for entry in entries:
            name, shape, kind = str(entry["n"]), tuple(int(d) for d in entry["s"]), str(entry["k"])
            if any(d < 0 for d in shape):
                raise CodecError(f"negative dimension in tensor '{name}'")
            encoded = EncodedTensor(name, shape, kind, [])
            if kind == SPARSE:
                data, offset = _take(blob, offset, int(entry["ib"]), torch.uint8, f"positions of '{name}'")
                index_bytes[name] = (str(entry["i"]), data)
            elif kind == LOWRANK:
                encoded.matrix = (int(entry["m"][0]), int(entry["m"][1]))
            elif kind != DENSE:
                raise CodecError(f"unknown tensor kind {kind!r} for '{name}'")
            for part in entry["a"]:
                encoding, count, block = str(part["e"]), int(part["n"]), int(part["b"])
                if count < 0 or block < 0:
                    raise CodecError(f"negative size in tensor '{name}'")
                value_kind = VALUE_KINDS.get(encoding)
                if value_kind is None:
                    raise CodecError(f"unknown value encoding {encoding!r} for '{name}'")
                data, offset = _take(blob, offset, value_kind.code_bytes(count), torch.uint8, f"codes of '{name}'")
                codes = value_kind.from_wire(data, count)
                if not value_kind.scaled:
                    encoded.parts.append(Values(encoding, codes))
                    continue
                scales, offset = _take(blob, offset, SCALE_BYTES * _scale_blocks(count, block), torch.float32,
                                       f"scales of '{name}'")
                if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
                    raise CodecError(f"scales of '{name}' are not all finite and non-negative")
                encoded.parts.append(Values(encoding, codes, scales, block))
            tensors.append(encoded)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        if isinstance(err, CodecError):
            raise
        raise CodecError(f"malformed payload header entry ({type(err).__name__}: {err})") from None
    if offset != blob.numel():
        raise CodecError(f"payload has {blob.numel() - offset} bytes past its last section")
    return tensors, index_bytes
