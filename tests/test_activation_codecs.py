"""Activation codecs at pipeline-stage boundaries: int8 round trips within scale / 2, the packed wire layout and its
bytes, gradients that cross back compressed (also through a detached "wire hop", as a pipeline runtime does it), the
subspace codec's exactness on its span, errors, and a small split MLP that trains as well with int8 in between."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from crossdc.compression.activations import (
    ACTIVATION_CODECS,
    ActivationCodecError,
    DecodeBoundary,
    EncodeBoundary,
    boundary_modules,
    int8_pack,
    int8_unpack,
    subspace_basis,
    wire_bytes,
    wire_features,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """The tensors here are tiny: a second intra-op thread only adds seconds of contention on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    return int8_unpack(int8_pack(x), x.shape[-1])


def _half_scale(x: torch.Tensor) -> torch.Tensor:
    """The stated int8 error bound per element, scale / 2 with scale = max |row| / 127 (plus float32 rounding)."""
    return x.abs().amax(dim=-1, keepdim=True) / 127 / 2 * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("shape", [(5, 13), (3, 7, 29), (2, 3, 5, 1)])
def test_int8_round_trip_is_within_half_a_scale(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    wire = int8_pack(x)
    features = shape[-1]
    assert wire.dtype == torch.float32
    assert wire.shape == (*shape[:-1], (features + 3) // 4 + 1)
    decoded = int8_unpack(wire, features)
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    assert bool(((decoded - x).abs() <= _half_scale(x)).all())
    # the largest magnitude of each row is sent exactly (code ±127)
    rows, decoded_rows = x.reshape(-1, features), decoded.reshape(-1, features)
    largest = rows.abs().argmax(dim=1, keepdim=True)
    assert torch.allclose(decoded_rows.gather(1, largest), rows.gather(1, largest), rtol=1e-6, atol=0)


def test_zero_rows_have_scale_zero_and_decode_to_zeros() -> None:
    x = torch.randn(4, 10)
    x[1] = 0
    wire = int8_pack(x)
    scales = wire[:, -1:].contiguous().view(torch.uint8).view(torch.float32)  # bytes only, no arithmetic
    assert scales[1].item() == 0.0
    decoded = int8_unpack(wire, 10)
    assert torch.equal(decoded[1], torch.zeros(10))
    assert bool(((decoded - x).abs() <= _half_scale(x)).all())


def test_wire_sizes() -> None:
    shape = (8, 64, 128)
    dense = 8 * 64 * 128 * 4
    assert wire_bytes("none", shape) == dense
    assert wire_features("int8", 128) == 33
    assert wire_bytes("int8", shape) == 8 * 64 * (128 + 4)  # 1 byte a value + a 4-byte scale a row
    assert wire_bytes("int8", shape) / dense == pytest.approx(0.2578125)
    assert wire_features("int8", 13) == 5  # 13 codes padded to 16 bytes, then the scale
    assert wire_bytes("subspace", shape, rank=16) == 8 * 64 * 16 * 4
    assert wire_features("subspace", 128) == 16 and wire_features("subspace", 5) == 1  # features // 8, at least 1
    encode, _ = boundary_modules("int8", 128, seed=0)
    assert encode(torch.randn(shape)).numel() * 4 == wire_bytes("int8", shape)


@pytest.mark.parametrize("shape", [(6, 13), (2, 5, 29)])
def test_int8_gradient_is_the_int8_round_trip_of_the_true_gradient(shape: tuple[int, ...]) -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator).requires_grad_()
    w = torch.randn(shape, generator=generator)
    encode, decode = boundary_modules("int8", shape[-1], seed=0)
    y = decode(encode(x))
    assert torch.equal(y, _int8_round_trip(x.detach()))
    (y * w).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert torch.equal(x.grad, _int8_round_trip(w))
    assert bool(((x.grad - w).abs() <= _half_scale(w)).all())


def _expected_grad(codec: str, w: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
    if codec == "int8":
        return _int8_round_trip(w)
    if codec == "subspace":
        assert basis is not None
        return w @ basis @ basis.T
    return w


@pytest.mark.parametrize("codec", ACTIVATION_CODECS)
def test_gradients_cross_a_wire_hop(codec: str) -> None:
    """Stage i sends its output, stage i+1 receives a fresh leaf, runs backward and sends the leaf's .grad back."""
    generator = torch.Generator().manual_seed(2)
    features = 21
    x = torch.randn(3, 4, features, generator=generator).requires_grad_()
    w = torch.randn(3, 4, features, generator=generator)
    encode, decode = boundary_modules(codec, features, seed=5, rank=6 if codec == "subspace" else None)
    sent = encode(x)  # stage i
    wire = sent.detach().clone().requires_grad_()  # what stage i+1 receives
    (decode(wire) * w).sum().backward()
    assert wire.grad is not None
    assert wire.grad.shape == sent.shape and wire.grad.dtype == torch.float32
    sent.backward(wire.grad)  # stage i, with the gradient that came back
    assert x.grad is not None
    basis = getattr(encode, "basis", None)
    assert torch.allclose(x.grad, _expected_grad(codec, w, basis), rtol=1e-5, atol=1e-6)
    if codec == "int8":
        assert torch.equal(x.grad, _int8_round_trip(w))


def test_bit_cast_nan_patterns_survive_the_wire() -> None:
    """Codes (0, 0, -64, 127) are a quiet NaN as float32 and (0, 0, -96, 127) a signalling one: both must come
    through forward and backward untouched."""
    row = torch.tensor([[0.0, 0.0, -64.0, 127.0, 0.0, 0.0, -96.0, 127.0, 5.0]])
    wire = int8_pack(row)
    assert bool(torch.isnan(wire[0, :2]).all())
    assert torch.equal(int8_unpack(wire.clone(), 9), row)
    x = row.clone().requires_grad_()
    encode, decode = boundary_modules("int8", 9, seed=0)
    sent = encode(x)
    hop = sent.detach().clone().requires_grad_()
    (decode(hop) * row).sum().backward()
    assert hop.grad is not None and bool(torch.isnan(hop.grad[0, :2]).all())
    sent.backward(hop.grad.clone())
    assert torch.equal(x.grad, row)


def test_subspace_is_exact_on_its_span_and_its_gradient_is_projected() -> None:
    features, rank = 40, 8
    encode, decode = boundary_modules("subspace", features, seed=3, rank=rank)
    basis = subspace_basis(features, rank, seed=3)
    assert torch.equal(encode.basis, basis) and torch.equal(decode.basis, basis)
    assert torch.allclose(basis.T @ basis, torch.eye(rank), atol=1e-6)
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 6, rank, generator=generator) @ basis.T).requires_grad_()
    sent = encode(x)
    assert sent.shape == (5, 6, rank)
    y = decode(sent)
    assert torch.allclose(y, x, atol=1e-5)
    w = torch.randn(5, 6, features, generator=generator)
    (y * w).sum().backward()
    assert torch.allclose(x.grad, w @ basis @ basis.T, atol=1e-5)
    # off the span it is lossy: the part orthogonal to U is dropped
    off = torch.randn(5, features, generator=generator)
    assert not torch.allclose(decode(encode(off)), off, atol=1e-2)


def test_subspace_basis_depends_only_on_its_seed() -> None:
    first = subspace_basis(32, 4, seed=11)
    assert first.shape == (32, 4) and first.dtype == torch.float32
    assert torch.equal(first, subspace_basis(32, 4, seed=11))
    assert not torch.allclose(first, subspace_basis(32, 4, seed=12), atol=1e-3)


def test_none_is_two_identities() -> None:
    encode, decode = boundary_modules("none", 7, seed=0)
    assert isinstance(encode, nn.Identity) and isinstance(decode, nn.Identity)
    assert wire_features("none", 7) == 7


def test_errors() -> None:
    with pytest.raises(ActivationCodecError, match="unknown activation codec 'fp4'"):
        boundary_modules("fp4", 8, seed=0)
    with pytest.raises(ActivationCodecError, match="unknown activation codec"):
        wire_bytes("zip", (2, 8))
    for rank in (0, -1, 9):
        with pytest.raises(ActivationCodecError, match="rank must be an integer between 1 and 8"):
            boundary_modules("subspace", 8, seed=0, rank=rank)
    with pytest.raises(ActivationCodecError, match="subspace codec only"):
        boundary_modules("int8", 8, seed=0, rank=2)
    _, decode = boundary_modules("int8", 10, seed=0, boundary="stage 0 -> 1")
    with pytest.raises(ActivationCodecError, match="last dimension 4, got shape .* at stage boundary stage 0 -> 1"):
        decode(torch.zeros(2, 5))
    with pytest.raises(ActivationCodecError, match="last dimension 4"):
        int8_unpack(torch.zeros(2, 3), 10)
    _, subspace_decode = boundary_modules("subspace", 16, seed=0, rank=4)
    with pytest.raises(ActivationCodecError, match="last dimension 4"):
        subspace_decode(torch.zeros(2, 16))
    encode = EncodeBoundary("int8", boundary="stage 1 -> 2")
    for bad in (float("nan"), float("inf")):
        x = torch.ones(3, 6)
        x[1, 2] = bad
        with pytest.raises(ActivationCodecError, match="non-finite activations at stage boundary stage 1 -> 2"):
            encode(x)
        with pytest.raises(ActivationCodecError, match="non-finite"):
            int8_pack(x)
    wire = torch.zeros(3, 3, requires_grad=True)
    nan_gradient = torch.full((3, 6), float("nan"))
    with pytest.raises(ActivationCodecError, match="non-finite gradient"):
        DecodeBoundary("int8", 6)(wire).backward(nan_gradient)


def _split_mlp_loss(codec: str) -> tuple[float, float]:
    """A 2-layer MLP split into two stages with `codec` between them, 30 full-batch SGD steps on a fixed random
    regression problem: (first loss, last loss)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=generator)
    targets = torch.tanh(inputs @ torch.randn(16, 1, generator=generator)) + 0.1 * torch.randn(256, 1, generator=generator)
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(16, 64), nn.Tanh()), nn.Linear(64, 1)
    encode, decode = boundary_modules(codec, 64, seed=0)
    parameters = [*first.parameters(), *second.parameters()]
    losses = []
    for _ in range(30):
        for parameter in parameters:
            parameter.grad = None
        sent = encode(first(inputs))
        wire = sent.detach().clone().requires_grad_()
        loss = nn.functional.mse_loss(second(decode(wire)), targets)
        loss.backward()
        sent.backward(wire.grad)
        with torch.no_grad():  # plain SGD (torch.optim's first use costs seconds of imports)
            for parameter in parameters:
                parameter -= 0.2 * parameter.grad
        losses.append(loss.item())
    return losses[0], losses[-1]


def test_a_split_mlp_trains_as_well_with_int8_between_its_stages() -> None:
    start, plain = _split_mlp_loss("none")
    _, compressed = _split_mlp_loss("int8")
    assert plain < 0.5 * start
    assert abs(compressed - plain) <= 0.03 * plain
