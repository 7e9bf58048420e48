"""A codec pipeline: what a datacenter's update becomes on the WAN, and back.

``CodecPipeline(["topk:0.01", "int8"])`` promises, per round:

- :meth:`~CodecPipeline.encode` turns an update (name → float32 tensor) into one payload (bytes) whose
  length is what crosses the WAN (all framing included), and returns what the receiver will decode;
- with error feedback (on when any codec asks for it, e.g. top-k and PowerSGD), the pipeline keeps a
  residual per tensor: the update plus the previous residual is encoded, and what was not sent becomes
  the new residual — so over any number of rounds, the sum of decoded payloads plus the final residual
  equals the sum of the updates (to float rounding); a structure codec may decay the residual instead
  (e ← β·e + update, :meth:`StructureCodec.residual_decay`; SparseLoCo's chunked top-k), and then the
  same holds with each round's update and payload weighted by β to the power of the rounds since;
- per tensor, sparse positions are sent only when that is cheaper than sending every value;
- its state (residuals, DGC velocity, PowerSGD's Q) comes out of :meth:`state_dict` for the
  datacenter's durable state store and goes back with :meth:`load_state_dict`.

:func:`decode_payload` is the receiving side: stateless, and strict — a payload that is truncated,
corrupted, names other tensors or shapes than expected, or holds NaN/Inf raises :class:`CodecError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from crossdc.compression.base import (
    Codec,
    CodecConfigError,
    StructureCodec,
    TensorState,
    ValuesCodec,
    available_codecs,
    build_codec,
)
from crossdc.compression.index_coding import IndexCodingError, bitmap_size, decode_positions, encode_positions, varint_size
from crossdc.compression.wire import (
    DENSE,
    F32,
    LOWRANK,
    SPARSE,
    VALUE_KINDS,
    CodecError,
    EncodedTensor,
    parse,
    plain,
    reconstruct,
    serialize,
)


@dataclass
class Encoded:
    """One encoded update: the payload, and what the receiver decodes from it."""

    payload: np.ndarray  # uint8, the exact bytes sent
    tensors: list[EncodedTensor]  # what the payload holds, before serialisation
    energy_kept: float  # ‖sent‖² / ‖update + residual‖²: how much of what was due this round was sent
    raw_bytes: int  # the same update as dense float32
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    @property
    def sent(self) -> dict[str, torch.Tensor]:
        """The update the receiver decodes (dense tensors; computed on demand)."""
        return {t.name: reconstruct(t) for t in self.tensors}


def _squared_norm(tensor: torch.Tensor) -> float:
    """‖tensor‖² in one pass without a float64 copy; inf if it overflows, NaN if the tensor holds NaN."""
    return float(torch.linalg.vector_norm(tensor)) ** 2


def _is_finite(tensor: torch.Tensor, squared_norm: float) -> bool:
    """Whether every value is finite (the norm tells in one pass unless it overflowed)."""
    return bool(np.isfinite(squared_norm)) or bool(torch.isfinite(tensor).all())


def _decoded_parts(encoded: EncodedTensor) -> list[torch.Tensor]:
    return [part.decode() for part in encoded.parts]


def _sent_energy(encoded: EncodedTensor, parts: list[torch.Tensor]) -> float:
    """‖what the tensor decodes to‖², from its decoded parts (never building a low-rank product)."""
    if encoded.kind == LOWRANK:
        assert encoded.matrix is not None
        p, q = (part.double().view(dim, -1) for part, dim in zip(parts, encoded.matrix, strict=True))
        return float(torch.trace((p.T @ p) @ (q.T @ q)))
    return _squared_norm(parts[0])


def _subtract_sent(accumulated: torch.Tensor, encoded: EncodedTensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """`accumulated` − what was sent, in place (it becomes the new residual)."""
    flat = accumulated.view(-1)
    if encoded.kind == SPARSE:
        assert encoded.positions is not None
        flat[encoded.positions] -= parts[0]
    elif encoded.kind == LOWRANK:
        assert encoded.matrix is not None
        rows, cols = encoded.matrix
        accumulated.view(rows, cols).sub_(parts[0].view(rows, -1) @ parts[1].view(cols, -1).T)
    elif parts[0].data_ptr() == flat.data_ptr():  # sent exactly as it is (and still referenced): nothing left over
        return torch.zeros_like(accumulated)
    else:
        flat -= parts[0]
    return accumulated


def _stage_names(stage: str) -> str:
    """The registered codecs of one stage, for an error message."""
    return ", ".join(sorted(name for name, cls in available_codecs().items() if cls.stage == stage))


def build_pipeline_codecs(specs: Sequence[str]) -> tuple[StructureCodec | None, ValuesCodec | None]:
    """The codecs a config's list spells, checked: at most one structure codec, first, and one values codec."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise CodecConfigError(f"codecs must be a list of strings like [\"topk:0.01\", \"int8\"], got {specs!r}")
    structure: StructureCodec | None = None
    values: ValuesCodec | None = None
    for text in specs:
        codec: Codec = build_codec(text)
        if isinstance(codec, StructureCodec):
            if structure is not None:
                raise CodecConfigError(f"codecs {list(specs)}: '{codec.name}' after '{structure.name}': "
                                       f"at most one structure codec ({_stage_names(codec.stage)}) per pipeline")
            if values is not None:
                raise CodecConfigError(f"codecs {list(specs)}: '{codec.name}' must come before '{values.name}' "
                                       "(choose what is sent, then how it is written)")
            structure = codec
        elif isinstance(codec, ValuesCodec):
            if values is not None:
                raise CodecConfigError(f"codecs {list(specs)}: at most one values codec ({_stage_names(codec.stage)}) "
                                       "per pipeline")
            values = codec
        else:
            raise CodecConfigError(f"codec '{codec.name}' is neither a structure nor a values codec")
    return structure, values


class CodecPipeline:
    """A datacenter's (or the server's downlink) codec pipeline with its per-tensor state."""

    def __init__(self, specs: Sequence[str], seed: int = 0, error_feedback: bool = True) -> None:
        """`error_feedback`: True — a residual where the codecs ask for one (each one's ``ef``); False — never, for a
        caller whose update already carries everything not yet sent (the downlink's x − x̂: a residual on top
        of it would count the unsent part again every round, and grow it geometrically)."""
        self.structure, self.values = build_pipeline_codecs(specs)
        self.specs = list(specs)
        self.error_feedback = error_feedback and any(
            bool(c.params.get("ef", c.error_feedback)) for c in (self.structure, self.values) if c)
        self.residual_decay = self.structure.residual_decay() if self.structure is not None else 1.0
        self.generator = torch.Generator().manual_seed(seed)
        if self.structure is not None:
            self.structure.use_generator(self.generator)
        self.residuals: dict[str, torch.Tensor] = {}
        self.codec_state: dict[str, TensorState] = {}

    @property
    def lossless(self) -> bool:
        return self.structure is None and self.values is None

    def _values_bytes(self, count: int) -> int:
        """Bytes `count` sent values cost on the wire, codes and scales (float32 without a values codec)."""
        return self.values.wire_bytes(count) if self.values is not None else VALUE_KINDS[F32].section_bytes(count, 0)

    def _cheaper(self, encoded: EncodedTensor, accumulated: torch.Tensor) -> EncodedTensor:
        """Dense instead of sparse when sending every value costs no more than positions + kept values."""
        if encoded.kind != SPARSE or encoded.positions is None:
            return encoded
        kept = encoded.positions.numel()
        sparse_cost = min(varint_size(encoded.positions), bitmap_size(encoded.numel)) + self._values_bytes(kept)
        if self._values_bytes(encoded.numel) <= sparse_cost:
            return EncodedTensor(encoded.name, encoded.shape, DENSE, [plain(accumulated)])
        return encoded

    def encode(self, update: Mapping[str, torch.Tensor], server_round: int) -> Encoded:
        """Encode one round's update (see the module docstring); CodecError if it holds NaN/Inf."""
        accumulated: dict[str, torch.Tensor] = {}
        due = kept = 0.0
        for name, tensor in update.items():
            tensor = torch.as_tensor(tensor).to(torch.float32)
            state = self.codec_state.setdefault(name, {})
            if self.structure is not None:
                tensor = self.structure.prepare(name, tensor, state)
            residual = self.residuals.get(name)
            if self.error_feedback:
                tensor = tensor + residual * self.residual_decay if residual is not None else tensor.clone()
            accumulated[name] = tensor
            energy = _squared_norm(tensor)
            if not _is_finite(tensor, energy):
                raise CodecError(f"tensor '{name}' of the update contains NaN or Inf")
            due += energy
        if self.structure is not None:
            self.structure.begin_round(accumulated, server_round)
        encoded_tensors: list[EncodedTensor] = []
        index_bytes: dict[str, tuple[str, torch.Tensor]] = {}
        for name, acc in accumulated.items():
            state = self.codec_state[name]
            if self.structure is not None:
                encoded = self._cheaper(self.structure.compress(name, acc, state, server_round), acc)
            else:
                encoded = EncodedTensor(name, tuple(acc.shape), DENSE, [plain(acc)])
            if self.values is not None:
                encoded.parts = [self.values.quantize(part.codes, self.generator) for part in encoded.parts]
            if encoded.kind == SPARSE:
                assert encoded.positions is not None
                index_bytes[name] = encode_positions(encoded.positions, encoded.numel)
            parts = _decoded_parts(encoded)
            kept += _sent_energy(encoded, parts)
            if self.error_feedback:
                self.residuals[name] = _subtract_sent(acc, encoded, parts)
            if self.structure is not None:
                self.structure.after_send(name, encoded, state)
            encoded_tensors.append(encoded)
        payload = serialize(encoded_tensors, index_bytes)
        raw = sum(4 * t.numel() for t in accumulated.values())
        kinds = {k: sum(1 for t in encoded_tensors if t.kind == k) for k in (DENSE, SPARSE, LOWRANK)}
        return Encoded(payload, encoded_tensors, kept / due if due > 0 else 1.0, raw, {"tensor_kinds": kinds})

    def state_dict(self) -> dict[str, Any]:
        """Residuals and codec state, for the datacenter's durable state store."""
        return {"specs": self.specs, "residuals": dict(self.residuals),
                "codec_state": {k: dict(v) for k, v in self.codec_state.items()},
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; CodecConfigError if it was written by a different pipeline."""
        if list(state["specs"]) != self.specs:
            raise CodecConfigError(f"saved codec state is for {state['specs']}, this pipeline is {self.specs}")
        self.residuals = dict(state["residuals"])
        self.codec_state = {k: dict(v) for k, v in state["codec_state"].items()}
        self.generator.set_state(state["generator"])


def decode_payload(payload: np.ndarray | bytes, expected: Mapping[str, tuple[int, ...]],
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The update a payload carries, checked against the expected tensor names and shapes.

    Raises CodecError for a truncated or corrupted payload, missing/unexpected tensors, a wrong shape,
    positions out of range, or NaN/Inf values.
    """
    tensors, index_bytes = parse(payload)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise CodecError("a tensor appears twice in the payload")
    missing = [n for n in expected if n not in names]
    unexpected = [n for n in names if n not in expected]
    if missing or unexpected:
        raise CodecError(f"payload tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    result: dict[str, torch.Tensor] = {}
    for encoded in tensors:
        if tuple(encoded.shape) != tuple(expected[encoded.name]):
            raise CodecError(f"tensor '{encoded.name}' has shape {encoded.shape}, expected {tuple(expected[encoded.name])}")
        try:
            _check_sizes(encoded)
            if encoded.kind == SPARSE:
                kind, data = index_bytes[encoded.name]
                encoded.positions = decode_positions(kind, data, encoded.parts[0].count, encoded.numel)
            value = reconstruct(encoded).to(device)
        except (IndexCodingError, RuntimeError, AssertionError) as err:
            raise CodecError(f"tensor '{encoded.name}' cannot be decoded: {err}") from None
        if not _is_finite(value, _squared_norm(value)):
            raise CodecError(f"tensor '{encoded.name}' contains NaN or Inf")
        result[encoded.name] = value
    return result


def _check_sizes(encoded: EncodedTensor) -> None:
    """The value arrays' sizes must fit the tensor's kind and shape (a forged header must not decode)."""
    counts = [p.count for p in encoded.parts]
    if encoded.kind == DENSE and counts != [encoded.numel]:
        raise CodecError(f"dense tensor '{encoded.name}' carries {counts} values for {encoded.numel} elements")
    if encoded.kind == SPARSE and (len(counts) != 1 or counts[0] > encoded.numel):
        raise CodecError(f"sparse tensor '{encoded.name}' carries {counts} values for {encoded.numel} elements")
    if encoded.kind == LOWRANK:
        assert encoded.matrix is not None
        rows, cols = encoded.matrix
        if rows * cols != encoded.numel or len(counts) != 2 or rows == 0 or cols == 0 \
                or counts[0] % rows or counts[1] % cols or counts[0] // rows != counts[1] // cols:
            raise CodecError(f"low-rank tensor '{encoded.name}' has factors {counts} that do not fit {encoded.shape}")
