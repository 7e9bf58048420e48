"""Injected faults for chaos tests: a datacenter that sends a NaN or corrupt update.

A run started with fault injection on (``LocalRunOptions(fault_injection=True)``, recorded in the run's settings
as ``fault_injection``; never by ``crossdc run``) lets whoever holds the run's key ask a datacenter's trainer, over
its local channel, to spoil its next update: ``{"op": "inject-fault", "fault": "nan" | "corrupt"}``. The trainer
trains that round as always (its own state stays sound) and only the reply it sends is spoiled, so what reaches the
coordinator is exactly what a faulty datacenter would send over the WAN: the update gate must refuse it and the run
must go on without it. A run without fault injection refuses the request.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: what an injected fault does to the next reply: ``nan``, one value of the update's first tensor becomes NaN;
#: ``corrupt``, the update's first tensor loses its last value (its shape no longer matches the model). A reply
#: whose update went through codecs (one byte payload) is truncated to half its bytes for either kind.
POISON_KINDS = ("nan", "corrupt")


def poison_answer(answer: dict[str, Any], kind: str) -> dict[str, Any]:
    """A copy of a trainer's round answer (``delta`` by name, or a codec ``payload``) whose update is spoiled as
    `kind` says (see POISON_KINDS); the answer passed in is left as it was."""
    if kind not in POISON_KINDS:
        raise ValueError(f"unknown injected fault {kind!r}; expected one of {', '.join(POISON_KINDS)}")
    spoiled = dict(answer)
    if "payload" in answer:
        payload = np.asarray(answer["payload"])
        spoiled["payload"] = payload[: payload.size // 2].copy()
        return spoiled
    delta = dict(answer["delta"])
    if not delta:
        raise ValueError("the answer carries an empty update: nothing to spoil")
    name = next(iter(delta))
    tensor = np.array(delta[name], dtype=np.float32, copy=True)
    if kind == "nan":
        tensor.reshape(-1)[0] = np.nan
    else:
        tensor = tensor.reshape(-1)[:-1].copy()
    delta[name] = tensor
    spoiled["delta"] = delta
    return spoiled
