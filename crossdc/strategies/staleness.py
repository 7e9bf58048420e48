"""Staleness functions of the asynchronous strategies, as pure functions.

An update computed from global version v and applied at version t (the version of the model it is added to) has
staleness s = t − v ≥ 0, counted on the server's logical clock (versions, never wall-clock). A staleness function
maps s to the scale the update is applied with, from the strategy's base rate ``lr``:

============== ======================================= =============================================
name           scale                                   note
============== ======================================= =============================================
``inverse``    lr / (1 + s)                            the default
``hinge``      lr if s ≤ b, else lr / (1 + s − b)      FedAsync's hinge with slope 1; b = 0 is ``inverse``
``constant``   lr                                      staleness ignored (only ``max_staleness`` bounds it)
``polynomial`` lr · (1 + s)^(−a)                       a > 0; a = 0.5 is FedBuff's 1/√(1 + s)
============== ======================================= =============================================

Every function returns lr at s = 0 and never increases with s. A negative or non-integer staleness is a
ValueError (it would mean the clock ran backwards).
"""

from __future__ import annotations

import numbers

#: the names a strategy's ``staleness`` parameter accepts
STALENESS_FUNCTIONS: tuple[str, ...] = ("inverse", "hinge", "constant", "polynomial")
DEFAULT_EXPONENT = 0.5


def _staleness(s: int) -> int:
    if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
        raise ValueError(f"staleness must be an integer ≥ 0, got {s!r}")
    return int(s)


def inverse(s: int, lr: float = 1.0) -> float:
    """lr / (1 + s)."""
    return lr / (1 + _staleness(s))


def hinge(s: int, lr: float = 1.0, after: int = 0) -> float:
    """lr for s ≤ `after` (b), else lr / (1 + s − b)."""
    s = _staleness(s)
    if after < 0:
        raise ValueError(f"the hinge point must be ≥ 0, got {after!r}")
    return lr if s <= after else lr / (1 + s - after)


def constant(s: int, lr: float = 1.0) -> float:
    """lr, whatever the staleness."""
    _staleness(s)
    return lr


def polynomial(s: int, lr: float = 1.0, exponent: float = DEFAULT_EXPONENT) -> float:
    """lr · (1 + s)^(−a), a = `exponent` > 0."""
    s = _staleness(s)
    if not exponent > 0:
        raise ValueError(f"the polynomial exponent must be > 0, got {exponent!r}")
    return lr * (1 + s) ** (-exponent)


def staleness_scale(kind: str, s: int, lr: float = 1.0, exponent: float = DEFAULT_EXPONENT, hinge_after: int = 0) -> float:
    """The scale of an update with staleness `s` under the function named `kind` (see the module docstring)."""
    if kind == "inverse":
        return inverse(s, lr)
    if kind == "hinge":
        return hinge(s, lr, hinge_after)
    if kind == "constant":
        return constant(s, lr)
    if kind == "polynomial":
        return polynomial(s, lr, exponent)
    raise ValueError(f"unknown staleness function {kind!r}; known: {', '.join(STALENESS_FUNCTIONS)}")
