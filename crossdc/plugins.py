"""One registry mechanism for every kind of plug-in: strategies, codecs, workloads.

A :class:`PluginRegistry` finds classes two ways, and promises the same answer in every process that can see them:

- **entry points** of its group (``crossdc.strategies``, ``crossdc.codecs``, ``crossdc.workloads``): how built-ins
  and installed packages register; what every process of a run (server, trainers, worker ranks) sees;
- the :meth:`PluginRegistry.register` **decorator**: code in this process only (notebooks, tests).

A name registered twice by different classes is an error naming it; a plug-in that fails to import, or is not
a subclass of the registry's base, either raises (``broken="raise"``) or is left out with a warning naming it
(``broken="warn"``, so one broken plug-in cannot hide the others).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar, cast

T = TypeVar("T", bound=type)

_ENTRY_POINTS: dict[tuple[str, tuple[str, ...]], tuple[EntryPoint, ...]] = {}


def group_entry_points(group: str) -> tuple[EntryPoint, ...]:
    """The entry points of `group`, read once per process and ``sys.path`` (reading them scans every installed
    distribution: tens of milliseconds, which a codec pipeline built every round would pay each time)."""
    key = (group, tuple(sys.path))
    if key not in _ENTRY_POINTS:
        _ENTRY_POINTS[key] = tuple(entry_points(group=group))
    return _ENTRY_POINTS[key]


class PluginRegistry(Generic[T]):
    """Plug-ins of one kind (`kind`: "strategy", "codec", ...) subclassing `base`, found in entry-point `group`."""

    def __init__(self, group: str, base: type, kind: str, error: type[Exception], broken: str = "raise") -> None:
        self.group, self.base, self.kind, self.error, self.broken = group, base, kind, error, broken
        self._decorated: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: register a subclass of the base under `name` for this process (sets ``cls.name``)."""

        def decorate(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise self.error(f"registering {self.kind} '{name}' needs a {self.base.__name__} subclass, got {cls!r}")
            taken = {ep.name for ep in group_entry_points(self.group)}
            if (name in taken or name in self._decorated) and self._decorated.get(name) is not cls:
                raise self.error(f"{self.kind} name '{name}' is already registered")
            setattr(cls, "name", name)  # noqa: B010 (T is any class; its name is the registry's)
            self._decorated[name] = cls
            return cls

        return decorate

    def unregister(self, name: str) -> None:
        """Forget a class registered with the decorator (tests)."""
        self._decorated.pop(name, None)

    def sources(self) -> dict[str, str]:
        """Name → where it comes from: ``module:Class`` of its entry point, or ``decorator:module.Class``."""
        found = {ep.name: ep.value for ep in group_entry_points(self.group)}
        found.update({name: f"decorator:{cls.__module__}.{cls.__qualname__}" for name, cls in self._decorated.items()})
        return found

    def _broken(self, message: str, cause: Exception | None = None) -> None:
        if self.broken == "warn":
            warnings.warn(message, stacklevel=3)
            return
        raise self.error(message) from cause

    def load(self) -> dict[str, T]:
        """Name → class of every registered plug-in, sorted by name."""
        found: dict[str, T] = {}
        origin: dict[str, str] = {}
        for ep in group_entry_points(self.group):
            if ep.name in found:
                if origin[ep.name] != ep.value:  # not just the same distribution seen twice on sys.path
                    self._broken(f"{self.kind} '{ep.name}' is registered twice: {origin[ep.name]} and {ep.value}")
                continue
            try:
                cls = ep.load()
            except Exception as err:  # a plug-in's import error must name the plug-in
                self._broken(f"{self.kind} plug-in '{ep.name}' ({ep.value}) failed to load: {err}", err)
                continue
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                self._broken(f"{self.kind} plug-in '{ep.name}' ({ep.value}) is not a crossdc {self.base.__name__} subclass")
                continue
            found[ep.name], origin[ep.name] = cast(T, cls), ep.value
        found.update(self._decorated)
        return dict(sorted(found.items()))
