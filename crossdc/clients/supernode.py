"""Flower's SuperNode as crossdc starts it: flwr 1.42's own ``flower-supernode``, with shorter waits in its loop.

flwr 1.42's SuperNode (``flwr/supernode/start_client_internal.py``) handles one message at a time: it pulls a
message, waits for the ClientApp's reply, pushes it, and pulls again. Two fixed waits in that loop cost every
message time that no network and no computation needs: a pull that finds nothing sleeps **3 s** before the next
one (so a message posted to an idle node waits 1.5 s on average, up to 3 s, before it is even seen), and the
ClientApp's reply is looked for every **0.5 s**. crossdc starts its SuperNodes through :func:`main`, which runs
Flower's own entry point unchanged except for those two waits: :data:`IDLE_POLL_S` and :data:`REPLY_POLL_S`.

Promises:

- :func:`main` behaves as ``flower-supernode`` with the same arguments, except for the two waits above (every
  other sleep of the loop keeps its length);
- :func:`patch_supernode_loop` refuses, with :class:`FlowerLoopChanged`, to patch a loop that is not the one this
  was written against (the sleeps it shortens are not the ones it finds), so an upgrade of flwr fails loudly
  rather than silently bringing the 3-second poll back or shortening a wait that means something else.

An idle SuperNode then asks the SuperLink for work about every ``IDLE_POLL_S`` plus a round trip; each such pull
is a small request (a few hundred bytes each way), which the link ledger does not count as payload.
"""

from __future__ import annotations

import inspect
import re
import sys
import time
import types
from typing import Any

#: how long an idle SuperNode waits between two pulls that found nothing (flwr 1.42: 3 s)
IDLE_POLL_S = 0.2
#: how often the SuperNode looks for the ClientApp's reply, and for an object it is about to push (flwr 1.42: 0.5 s)
REPLY_POLL_S = 0.05
#: the module whose loop is patched, and the sleeps it is known to make, in source order (flwr 1.42.0)
LOOP_MODULE = "flwr.supernode.start_client_internal"
KNOWN_SLEEPS: tuple[float, ...] = (3.0, 0.5, 0.5)
#: flwr's wait → crossdc's
SHORTER_WAITS: dict[float, float] = {3.0: IDLE_POLL_S, 0.5: REPLY_POLL_S}


class FlowerLoopChanged(RuntimeError):
    """flwr's SuperNode loop is not the one crossdc's shorter waits were written for."""


def sleeps_in_source(source: str) -> tuple[float, ...]:
    """The constant arguments of every ``time.sleep(...)`` call in `source`, in order (a non-constant one: nan)."""
    found = []
    for argument in re.findall(r"\btime\.sleep\(([^()]*)\)", source):
        try:
            found.append(float(argument))
        except ValueError:
            found.append(float("nan"))
    return tuple(found)


class _ShorterWaits(types.ModuleType):
    """Stands in for the ``time`` module inside flwr's loop module: the same module, with the known waits shortened."""

    def __init__(self, waits: dict[float, float]) -> None:
        super().__init__("time")
        self._waits = waits

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(self._waits.get(seconds, seconds))


def patch_supernode_loop(module: types.ModuleType | None = None) -> None:
    """Shorten the SuperNode loop's idle and reply waits (:data:`SHORTER_WAITS`) in `module` (default: flwr's).

    Raises :class:`FlowerLoopChanged` when the module's sleeps are not :data:`KNOWN_SLEEPS` or it does not use the
    ``time`` module by that name."""
    if module is None:
        import importlib

        module = importlib.import_module(LOOP_MODULE)
    found = sleeps_in_source(inspect.getsource(module))
    if found != KNOWN_SLEEPS or getattr(module, "time", None) is not time:
        raise FlowerLoopChanged(
            f"{module.__name__} sleeps {found}, crossdc knows {KNOWN_SLEEPS}: flwr's SuperNode loop changed; review "
            "crossdc.clients.supernode before using this flwr version")
    module.time = _ShorterWaits(SHORTER_WAITS)  # type: ignore[attr-defined]


def command() -> list[str]:
    """The start of a SuperNode's command line (its arguments follow, as for ``flower-supernode``)."""
    return [sys.executable, "-m", __name__]


def main() -> None:
    """``flower-supernode`` with the shorter waits."""
    patch_supernode_loop()
    from flwr.supernode.cli import flower_supernode

    sys.argv[0] = "flower-supernode"
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
