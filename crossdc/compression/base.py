"""The codec interface, the spelling of codecs in a config, and the registry that finds them.

A codec is one stage of the pipeline that turns a datacenter's update into what crosses the WAN:

- a **structure** codec (top-k, PowerSGD) decides *which* numbers are sent: it maps a dense tensor to
  dense values, kept positions + values, or low-rank factors;
- a **values** codec (int8, int4, fp8, QSGD) decides *how* each sent number is written: it maps a float vector
  to low-bit codes with float32 scales.

A pipeline holds at most one of each, structure first (``["topk:0.01", "int8"]``: sparsify, then
quantise the surviving values). Spelling (as in the experiment config): ``"name[:arg][:key=value]..."``; the bare
``arg`` sets the codec's positional parameter (top-k's ``fraction``, PowerSGD's ``rank``, QSGD's
``levels``). Codecs are found through the entry-point group ``crossdc.codecs`` (built-ins register
the same way) and, for code in the same process, the :func:`register_codec` decorator.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from crossdc.compression.wire import VALUE_KINDS, CodecError, EncodedTensor, Values
from crossdc.parameters import Parameter, ParameterError, check_parameters
from crossdc.plugins import PluginRegistry

ENTRY_POINT_GROUP = "crossdc.codecs"
STRUCTURE, VALUES = "structure", "values"

#: per-tensor state a codec keeps between rounds (saved in the datacenter's state store)
TensorState = dict[str, torch.Tensor]
#: bytes of one value sent as plain float32
FLOAT32_BYTES = 4.0


class CodecConfigError(ValueError):
    """A codec spelled wrongly in a config: unknown name, bad parameter, impossible combination."""


class Codec(ABC):
    """Base of all codecs: declared parameters, checked at construction."""

    name: ClassVar[str]
    stage: ClassVar[str]
    parameters: ClassVar[dict[str, Parameter]] = {}
    #: the parameter a bare ``name:arg`` sets
    positional: ClassVar[str | None] = None
    #: whether the pipeline keeps an error-feedback residual for this codec unless told otherwise (``ef=false``)
    error_feedback: ClassVar[bool] = False

    def __init__(self, **params: Any) -> None:
        try:
            self.params = check_parameters(f"codec '{self.name}'", self.parameters, params)
        except ParameterError as err:
            raise CodecConfigError(str(err)) from None

    def spec(self) -> str:
        """This codec spelled as in a config, with every parameter."""
        return ":".join([self.name] + [f"{k}={v}" for k, v in self.params.items()])


class StructureCodec(Codec):
    """Decides which numbers of a tensor are sent.

    The pipeline calls, per round: :meth:`prepare` for each tensor, :meth:`begin_round` once with all of them,
    then :meth:`compress` and :meth:`after_send` for each; :meth:`use_generator` once, when it is built.
    """

    stage = STRUCTURE
    #: where the codec draws its randomness from (set by :meth:`use_generator`; None: torch's global generator)
    generator: torch.Generator | None = None

    def use_generator(self, generator: torch.Generator) -> None:
        """Draw every random number from `generator`: the pipeline's own, seeded and saved with its state, so a
        restarted datacenter draws the same ones. Called once by the pipeline that holds the codec; default: keep it
        as :attr:`generator`."""
        self.generator = generator

    def begin_round(self, accumulated: Mapping[str, torch.Tensor], server_round: int) -> None:
        """Called once per round with every tensor about to be compressed (after :meth:`prepare` and error feedback),
        before the first :meth:`compress`; default: nothing (top-k's ``scope=global`` picks its one threshold here)."""

    @abstractmethod
    def compress(self, name: str, tensor: torch.Tensor, state: TensorState, server_round: int) -> EncodedTensor:
        """`tensor` (float32, its real shape) as an encoded tensor whose parts are plain float32 values."""

    def after_send(self, name: str, encoded: EncodedTensor, state: TensorState) -> None:
        """Called with what was actually sent once a tensor is encoded; default: nothing."""

    def prepare(self, name: str, update: torch.Tensor, state: TensorState) -> torch.Tensor:
        """What of this round's update enters the error-feedback accumulator (default: the update itself)."""
        return update

    def residual_decay(self) -> float:
        """β: the error-feedback residual is multiplied by β before this round's update is added to it
        (default 1: nothing is forgotten)."""
        return 1.0


class ValuesCodec(Codec):
    """Decides how each sent float is written."""

    stage = VALUES
    #: the wire encoding (a key of wire.VALUE_KINDS) its values are written as; None: not declared (a plug-in's
    #: choice at each call), and the pipeline counts `value_bytes` per value
    encoding: ClassVar[str | None] = None
    #: bytes one sent value costs on the wire (scales aside; 0.5 for int4)
    value_bytes: ClassVar[float] = FLOAT32_BYTES

    def wire_encoding(self) -> str | None:
        """The wire encoding this codec writes with these parameters (default: the class's `encoding`)."""
        return self.encoding

    def wire_bytes(self, count: int) -> int:
        """Bytes `count` values cost on the wire, codes and scales, as :func:`wire.serialize` writes them: what the
        pipeline weighs sparse against dense with. Exact for a declared encoding (scale blocks of this codec's
        ``block``, 0 when it has none); ⌈count · value_bytes⌉ otherwise."""
        encoding = self.wire_encoding()
        if encoding is None:
            return math.ceil(count * self.value_bytes)
        return VALUE_KINDS[encoding].section_bytes(count, int(self.params.get("block", 0)))

    @abstractmethod
    def quantize(self, values: torch.Tensor, generator: torch.Generator | None) -> Values:
        """A flat float32 vector as codes + scales."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed ``"name[:arg][:key=value]"``."""

    name: str
    params: dict[str, Any]


def _value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_spec(text: str, positional: str | None) -> CodecSpec:
    """Parse one codec spelling; `positional` names the parameter a bare argument sets."""
    if not isinstance(text, str) or not text.strip():
        raise CodecConfigError(f"a codec must be a non-empty string like 'topk:0.01', got {text!r}")
    name, *args = [part.strip() for part in text.split(":")]
    params: dict[str, Any] = {}
    for position, arg in enumerate(args):
        if "=" in arg:
            key, _, value = arg.partition("=")
            params[key.strip()] = _value(value)
        elif position == 0 and positional is not None:
            params[positional] = _value(arg)
        else:
            raise CodecConfigError(f"codec '{text}': '{arg}' must be key=value")
    return CodecSpec(name, params)


REGISTRY: PluginRegistry[type[Codec]] = PluginRegistry(ENTRY_POINT_GROUP, Codec, "codec", CodecConfigError)


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make a codec defined in this process available by its ``name``."""
    return REGISTRY.register(cls.name)(cls)


def available_codecs() -> dict[str, type[Codec]]:
    """Name → class of every codec: entry points of ``crossdc.codecs`` and in-process registrations."""
    return REGISTRY.load()


def build_codec(text: str, codecs: dict[str, type[Codec]] | None = None) -> Codec:
    """The codec a config spells as `text`; CodecConfigError naming the codec and parameter otherwise."""
    codecs = available_codecs() if codecs is None else codecs
    name = text.split(":", 1)[0].strip() if isinstance(text, str) else text
    if name not in codecs:
        raise CodecConfigError(f"unknown codec '{name}'; known: {', '.join(sorted(codecs)) or 'none'}")
    cls = codecs[name]
    spec = parse_spec(text, cls.positional)
    return cls(**spec.params)


def describe_codecs() -> list[dict[str, Any]]:
    """One JSON-able row per registered codec (CLI and API)."""
    origin = REGISTRY.sources()
    rows = []
    for name, cls in sorted(available_codecs().items()):
        value = origin.get(name, f"{cls.__module__}:{cls.__qualname__}")
        rows.append({
            "name": name,
            "stage": cls.stage,
            "source": "built-in" if value.startswith("crossdc.") else "plug-in",
            "class": value,
            "positional": cls.positional,
            "error_feedback": cls.error_feedback,
            "parameters": {k: p.describe() for k, p in cls.parameters.items()},
            "summary": (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "",
        })
    return rows


__all__ = ["Codec", "CodecConfigError", "CodecError", "CodecSpec", "StructureCodec", "ValuesCodec", "available_codecs",
           "build_codec", "describe_codecs", "parse_spec", "register_codec"]
