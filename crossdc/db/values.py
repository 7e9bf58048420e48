"""Numbers that JSON (and PostgreSQL's JSON columns) cannot carry: NaN and ±Inf, the marks of a diverged run.

The one place that says what becomes of them; the run log, the API, the pages, the figures and the CLI all use it:

* :func:`finite_or_none`: a non-finite float as ``None``, any other value unchanged (a row's cell, on its way
  to JSON);
* :func:`finite_float`: a value as a float, ``None`` when it is missing, not a number, a bool, NaN or ±Inf
  (what a chart or a formatter can plot or print);
* :func:`json_safe`: the same cleaning at any depth of dicts, lists and tuples; by default a non-finite float
  becomes ``None``, with ``non_finite=non_finite_text`` the text JSON libraries use for it (``"NaN"``,
  ``"Infinity"``, ``"-Infinity"``), which keeps what the value was.

Pure: imports nothing of crossdc.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``None`` for NaN and ±Inf floats (JSON has no such numbers); anything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def finite_float(value: Any) -> float | None:
    """``value`` as a float, or ``None`` when it is missing, not a number (bools neither), NaN or ±Inf."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def non_finite_text(value: float) -> str:
    """``"NaN"``, ``"Infinity"`` or ``"-Infinity"``: how JSON libraries spell a non-finite float."""
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


def _none(value: float) -> None:
    return None


def json_safe(obj: Any, non_finite: Callable[[float], Any] = _none) -> Any:
    """``obj`` with every NaN/±Inf float, at any depth of dicts, lists and tuples (tuples become lists), replaced
    by ``non_finite(value)`` (default ``None``); anything else unchanged. Returns new containers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else non_finite(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v, non_finite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v, non_finite) for v in obj]
    return obj


__all__ = ["finite_float", "finite_or_none", "json_safe", "non_finite_text"]
