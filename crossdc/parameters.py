"""Typed parameters of plug-ins (strategies, codecs): declared once, checked before a run starts.

A plug-in class declares ``parameters: dict[str, Parameter]``; a config's values are checked
against it with :meth:`Parameter.check`, which names the plug-in and the parameter in its error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast


class ParameterError(ValueError):
    """A plug-in parameter has the wrong type, is out of range, or is unknown."""


@dataclass(frozen=True)
class Parameter:
    """One configurable parameter.

    `kind` is the Python type a value must have (``float`` also takes an ``int``; ``bool`` is never a
    number); `low`/`high` bound numbers (inclusive) where given; `choices` lists allowed strings.
    """

    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None

    def check(self, owner: str, name: str, value: Any) -> Any:
        """`value` converted to `kind`, or ParameterError naming `owner` (e.g. "strategy 'fedprox'") and `name`."""
        where = f"{owner} parameter '{name}'"
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (self.kind is not bool and isinstance(value, bool)):
            raise ParameterError(f"{where} must be {self.kind.__name__}, got {type(value).__name__} {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ParameterError(f"{where} must be a finite number, got {value!r}")
        if self.low is not None and cast(float, value) < self.low:
            raise ParameterError(f"{where} must be ≥ {self.low:g}, got {value!r}")
        if self.high is not None and cast(float, value) > self.high:
            raise ParameterError(f"{where} must be ≤ {self.high:g}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ParameterError(f"{where} must be one of {', '.join(self.choices)}, got {value!r}")
        return value

    def describe(self) -> dict[str, Any]:
        """JSON-able description (CLI and API)."""
        return {"type": self.kind.__name__, "default": self.default, "help": self.help, "low": self.low,
                "high": self.high, "choices": list(self.choices) if self.choices else None}


def check_parameters(owner: str, declared: Mapping[str, Parameter], given: Mapping[str, Any]) -> dict[str, Any]:
    """Every declared parameter's value (given, checked; else its default); unknown names are errors."""
    unknown = sorted(set(given) - set(declared))
    if unknown:
        known = ", ".join(sorted(declared)) or "none"
        raise ParameterError(f"unknown parameter '{unknown[0]}' for {owner}; known: {known}")
    return {key: spec.check(owner, key, given[key]) if key in given else spec.default for key, spec in declared.items()}
