"""Activation codecs for pipeline-stage boundaries: what crosses the WAN between stage i and stage i+1, forward
(the activation) and backward (its gradient), compressed in both directions.

A pipeline runtime sends a stage's output tensor as it is and sends back a gradient of exactly the received
tensor's shape and dtype. So each codec is a pair of differentiable modules that keep a float32 tensor on the wire
whose *bytes* are the compressed form: `EncodeBoundary` ends stage i (activation -> wire tensor), `DecodeBoundary`
starts stage i+1 (wire tensor -> activation). Backward, the decode module turns the true gradient into a wire-shaped
gradient (itself compressed) and the encode module turns that back into a gradient of the activation.

Codecs (`ACTIVATION_CODECS`), for an activation of shape (*lead, features):

- ``none``: the activation itself, float32. Exact.
- ``int8``: each row (the last dimension) as int8 codes with one float32 scale, scale = max |row| / 127,
  code = round(x / scale) in [-127, 127]; the codes (padded to a multiple of 4 bytes) and the scale are bit-cast
  into a float32 wire tensor of shape (*lead, ceil(features / 4) + 1). Every value decodes within scale / 2 of
  what was sent; a zero row decodes to zeros. The gradient crosses back in the same form, so the activation
  receives the int8 round trip of its true gradient (the forward rounding is treated as the identity: a
  straight-through estimate). NaN or Inf, forward or backward, raises `ActivationCodecError`.
- ``subspace``: the activation projected onto a fixed orthonormal basis U (features x rank) made from a seed,
  identical on both stages: x @ U is sent (float32, shape (*lead, rank)) and decoded as (x @ U) @ Uᵀ. Exact for x in
  the span of U, lossy otherwise (nothing constrains the model to that span). Both maps are linear, so the gradient
  is exact for them: g @ U crosses back and the activation receives g @ U @ Uᵀ. The wire is features / rank times
  smaller than float32.

Wire tensors are only ever viewed, reshaped and copied, never computed on: bit-cast int8 bytes can be NaN or
denormal patterns. `wire_features` and `wire_bytes` give the exact wire size; `int8_pack`, `int8_unpack` and
`subspace_basis` are the pure functions underneath.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

#: the activation codecs, by name
ACTIVATION_CODECS = ("none", "int8", "subspace")

#: the largest int8 code (the codes are symmetric: -128 is never written)
INT8_MAX = 127
#: bytes per float32 value on the wire
FLOAT32_BYTES = 4


class ActivationCodecError(ValueError):
    """An activation codec that does not exist or is misconfigured, a wire tensor of the wrong shape, or non-finite
    values that int8 cannot scale."""


def _where(boundary: str | None) -> str:
    """' at stage boundary <boundary>' when one is named, else nothing (for error messages)."""
    return f" at stage boundary {boundary}" if boundary else ""


def _check_codec(codec: str) -> None:
    if codec not in ACTIVATION_CODECS:
        raise ActivationCodecError(f"unknown activation codec {codec!r}; choose one of {', '.join(ACTIVATION_CODECS)}")


def _check_features(features: int) -> None:
    if isinstance(features, bool) or not isinstance(features, int) or features < 1:
        raise ActivationCodecError(f"features must be a positive integer, got {features!r}")


def subspace_rank(features: int, rank: int | None = None) -> int:
    """The subspace codec's rank: `rank`, or features // 8 (at least 1) when None; between 1 and `features`."""
    _check_features(features)
    if rank is None:
        return max(1, features // 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= features:
        raise ActivationCodecError(f"subspace rank must be an integer between 1 and {features} (the features), got {rank!r}")
    return rank


def _int8_row_words(features: int) -> int:
    """float32 words that one row's int8 codes take on the wire (the codes padded to a multiple of 4 bytes)."""
    return -(-features // FLOAT32_BYTES)


def wire_features(codec: str, features: int, rank: int | None = None) -> int:
    """The wire tensor's last dimension for an activation with `features` in its last dimension."""
    _check_codec(codec)
    _check_features(features)
    if codec != "subspace" and rank is not None:
        raise ActivationCodecError(f"rank is a parameter of the subspace codec only, not of {codec!r}")
    if codec == "int8":
        return _int8_row_words(features) + 1
    if codec == "subspace":
        return subspace_rank(features, rank)
    return features


def wire_bytes(codec: str, shape: Sequence[int], rank: int | None = None) -> int:
    """Bytes that one activation of float shape `shape` (or its gradient, the same size) takes on the wire."""
    if len(shape) == 0 or any(isinstance(size, bool) or not isinstance(size, int) or size < 0 for size in shape):
        raise ActivationCodecError(f"an activation shape needs at least one dimension, none negative; got {tuple(shape)}")
    rows = math.prod(shape[:-1])
    return rows * wire_features(codec, shape[-1], rank) * FLOAT32_BYTES


def _int8_pack(x: Tensor, what: str, boundary: str | None) -> Tensor:
    """`int8_pack`, naming `what` (activations, gradient) and the boundary in its error message."""
    if x.dim() == 0:
        raise ActivationCodecError(f"int8 needs a tensor with a features dimension, got a scalar{_where(boundary)}")
    features = x.shape[-1]
    _check_features(features)
    rows = x.detach().reshape(-1, features).to(torch.float32)
    if not rows.is_meta and not bool(torch.isfinite(rows).all()):  # meta tensors (shape inference) hold no values
        raise ActivationCodecError(f"int8 cannot scale non-finite {what}{_where(boundary)}: the tensor holds NaN or Inf")
    scales = rows.abs().amax(dim=1) / INT8_MAX
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(rows / divisors[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    code_bytes = _int8_row_words(features) * FLOAT32_BYTES
    packed = torch.zeros(rows.shape[0], code_bytes + FLOAT32_BYTES, dtype=torch.uint8, device=rows.device)
    packed[:, :features] = codes.view(torch.uint8)
    packed[:, code_bytes:] = scales.reshape(-1, 1).view(torch.uint8)
    return packed.view(torch.float32).reshape(*x.shape[:-1], code_bytes // FLOAT32_BYTES + 1)


def int8_pack(x: Tensor, *, boundary: str | None = None) -> Tensor:
    """The int8 wire form of `x` (*lead, features): a float32 tensor (*lead, ceil(features / 4) + 1) whose bytes are
    each row's int8 codes (zero-padded to a multiple of 4 bytes) followed by the row's float32 scale. Not
    differentiable. Raises `ActivationCodecError` when `x` holds NaN or Inf (`boundary` names the stage boundary in
    the message)."""
    return _int8_pack(x, "activations", boundary)


def int8_unpack(wire: Tensor, features: int, *, boundary: str | None = None) -> Tensor:
    """The float32 values (*lead, features) of an int8 wire tensor made by `int8_pack`: each within scale / 2 of
    what was packed, where scale = max |row| / 127. Not differentiable."""
    expected = wire_features("int8", features)
    if wire.dtype != torch.float32 or wire.dim() == 0 or wire.shape[-1] != expected:
        raise ActivationCodecError(
            f"an int8 wire tensor for {features} features must be float32 with last dimension {expected}, "
            f"got {wire.dtype} of shape {tuple(wire.shape)}{_where(boundary)}"
        )
    code_bytes = (expected - 1) * FLOAT32_BYTES
    packed = wire.detach().reshape(-1, expected).contiguous().view(torch.uint8)
    codes = packed[:, :features].view(torch.int8).to(torch.float32)
    scales = packed[:, code_bytes:].contiguous().view(torch.float32)
    return (codes * scales).reshape(*wire.shape[:-1], features)


def subspace_basis(features: int, rank: int, seed: int) -> Tensor:
    """A float32 (features, rank) matrix with orthonormal columns, the same for the same (features, rank, seed) on
    every machine: the Q of a QR factorisation of a seeded Gaussian matrix (computed in float64, signs fixed so that
    R has a positive diagonal)."""
    rank = subspace_rank(features, rank)
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(features, rank, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian, mode="reduced")
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(torch.float32)


class _Int8Encode(torch.autograd.Function):
    """activation -> int8 wire; backward: int8 wire gradient -> activation gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, boundary: str | None) -> Tensor:
        ctx.features = x.shape[-1]
        ctx.dtype = x.dtype
        ctx.boundary = boundary
        return _int8_pack(x, "activations", boundary)

    @staticmethod
    def backward(ctx: Any, wire_grad: Tensor) -> tuple[Tensor, None]:
        return int8_unpack(wire_grad, ctx.features, boundary=ctx.boundary).to(ctx.dtype), None


class _Int8Decode(torch.autograd.Function):
    """int8 wire -> activation; backward: activation gradient -> int8 wire gradient."""

    @staticmethod
    def forward(ctx: Any, wire: Tensor, features: int, boundary: str | None) -> Tensor:
        ctx.boundary = boundary
        return int8_unpack(wire, features, boundary=boundary)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _int8_pack(grad, "gradient", ctx.boundary), None, None


class _Boundary(nn.Module):
    """What the encode and decode modules share: the codec, its features and rank, the subspace basis."""

    def __init__(self, codec: str, features: int | None, *, seed: int, rank: int | None, boundary: str | None) -> None:
        super().__init__()
        _check_codec(codec)
        if features is not None:
            _check_features(features)
        if codec == "subspace":
            if features is None:
                raise ActivationCodecError(f"the subspace codec needs the number of features{_where(boundary)}")
            rank = subspace_rank(features, rank)
            self.register_buffer("basis", subspace_basis(features, rank, seed), persistent=False)
        elif rank is not None:
            raise ActivationCodecError(f"rank is a parameter of the subspace codec only, not of {codec!r}")
        self.codec = codec
        self.features = features
        self.rank = rank
        self.seed = seed
        self.boundary = boundary

    def _check_last_dim(self, tensor: Tensor, expected: int, what: str) -> None:
        if tensor.dim() == 0 or tensor.shape[-1] != expected:
            raise ActivationCodecError(
                f"{self.codec} {what} must have last dimension {expected}, got shape {tuple(tensor.shape)}{_where(self.boundary)}"
            )

    def extra_repr(self) -> str:
        parts = [repr(self.codec), f"features={self.features}"]
        if self.codec == "subspace":
            parts += [f"rank={self.rank}", f"seed={self.seed}"]
        if self.boundary:
            parts.append(f"boundary={self.boundary!r}")
        return ", ".join(parts)


class EncodeBoundary(_Boundary):
    """The end of the sending stage: activation (*lead, features) -> float32 wire tensor (*lead, wire_features).
    Backward it turns the wire tensor's gradient into the activation's gradient. `features` may be left out for
    "none" and "int8" (then it is taken from the activation); "subspace" needs it."""

    def __init__(
        self, codec: str, features: int | None = None, *, seed: int = 0, rank: int | None = None, boundary: str | None = None
    ) -> None:
        super().__init__(codec, features, seed=seed, rank=rank, boundary=boundary)

    def forward(self, x: Tensor) -> Tensor:
        if self.features is not None:
            self._check_last_dim(x, self.features, "activations")
        if self.codec == "int8":
            return _Int8Encode.apply(x, self.boundary)
        if self.codec == "subspace":
            return x.to(torch.float32) @ self.basis
        return x


class DecodeBoundary(_Boundary):
    """The start of the receiving stage: float32 wire tensor (*lead, wire_features) -> float32 activation
    (*lead, features). Backward it turns the activation's gradient into the wire tensor's gradient, the form that
    crosses the WAN back."""

    def __init__(self, codec: str, features: int, *, seed: int = 0, rank: int | None = None, boundary: str | None = None) -> None:
        super().__init__(codec, features, seed=seed, rank=rank, boundary=boundary)
        self.decoded_features = features

    def forward(self, wire: Tensor) -> Tensor:
        features = self.decoded_features
        self._check_last_dim(wire, wire_features(self.codec, features, self.rank), "wire tensor")
        if wire.dtype != torch.float32 and self.codec != "none":
            raise ActivationCodecError(f"{self.codec} wire tensor must be float32, got {wire.dtype}{_where(self.boundary)}")
        if self.codec == "int8":
            return _Int8Decode.apply(wire, features, self.boundary)
        if self.codec == "subspace":
            return wire @ self.basis.T
        return wire


def boundary_modules(
    codec: str, features: int, *, seed: int, rank: int | None = None, boundary: str | None = None
) -> tuple[nn.Module, nn.Module]:
    """(the module that ends the sending stage, the module that starts the receiving stage) for an activation with
    `features` in its last dimension. "none" gives two identities. `seed` fixes the subspace basis (both stages
    must use the same); `rank` is the subspace's (default features // 8, at least 1); `boundary` (e.g. "stage 0 -> 1")
    names the boundary in error messages."""
    _check_codec(codec)
    _check_features(features)
    if codec == "none":
        if rank is not None:
            raise ActivationCodecError("rank is a parameter of the subspace codec only, not of 'none'")
        return nn.Identity(), nn.Identity()
    encode = EncodeBoundary(codec, features, seed=seed, rank=rank, boundary=boundary)
    decode = DecodeBoundary(codec, features, seed=seed, rank=rank, boundary=boundary)
    return encode, decode
