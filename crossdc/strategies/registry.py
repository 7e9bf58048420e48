"""Finds strategies: built-ins and plug-ins through the `crossdc.strategies` entry-point group, plus the
`@register_strategy` decorator for code in the same process.

- **Entry points** (every process, the way to ship a strategy): a package declares
  ``[project.entry-points."crossdc.strategies"] myname = "mypackage.module:MyStrategy"``; crossdc's own
  built-ins are declared the same way in its pyproject. The datacenters' trainers find the class the same
  way, so a plug-in must be installed wherever the run's processes run.
- **Decorator** (this process only: notebooks, tests, in-process drivers, Flower's simulation engine
  when the trainers can import the module): ``@register_strategy("myname")`` on a Strategy subclass.

A name registered twice (two entry points, or a decorator reusing a name) is an error naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TypeVar

from crossdc.strategies.base import Strategy, StrategyError

ENTRY_POINT_GROUP = "crossdc.strategies"

_DECORATED: dict[str, type[Strategy]] = {}

S = TypeVar("S", bound=type[Strategy])


def register_strategy(name: str) -> Callable[[S], S]:
    """Class decorator: register a Strategy subclass under `name` for this process (sets ``cls.name``)."""

    def decorate(cls: S) -> S:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise StrategyError(f"@register_strategy('{name}') needs a crossdc Strategy subclass, got {cls!r}")
        taken = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if (name in taken or name in _DECORATED) and _DECORATED.get(name) is not cls:
            raise StrategyError(f"strategy name '{name}' is already registered")
        cls.name = name
        _DECORATED[name] = cls
        return cls

    return decorate


def unregister_strategy(name: str) -> None:
    """Forget a strategy registered with the decorator (tests)."""
    _DECORATED.pop(name, None)


def strategy_sources() -> dict[str, str]:
    """Name → where it comes from: ``module:Class`` of its entry point, or ``decorator:module.Class``."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    found.update({name: f"decorator:{cls.__module__}.{cls.__qualname__}" for name, cls in _DECORATED.items()})
    return found


def available_strategies() -> dict[str, type[Strategy]]:
    """Name → class of every registered strategy (a broken or duplicate plug-in raises StrategyError naming it)."""
    found: dict[str, type[Strategy]] = {}
    origin: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            if origin[ep.name] == ep.value:  # the same distribution seen twice on sys.path
                continue
            raise StrategyError(f"strategy '{ep.name}' is registered twice: {origin[ep.name]} and {ep.value}")
        try:
            cls = ep.load()
        except Exception as err:  # a plug-in's import error must name the plug-in
            raise StrategyError(f"strategy plug-in '{ep.name}' ({ep.value}) failed to load: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise StrategyError(f"strategy plug-in '{ep.name}' ({ep.value}) is not a crossdc Strategy subclass")
        found[ep.name], origin[ep.name] = cls, ep.value
    found.update(_DECORATED)
    return found


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under `name`, or StrategyError listing the known names."""
    strategies = available_strategies()
    if name not in strategies:
        raise StrategyError(f"unknown strategy '{name}'; known: {', '.join(sorted(strategies))}")
    return strategies[name]


def describe_strategies() -> list[dict[str, object]]:
    """One JSON-able row per registered strategy, by name: what `crossdc strategies list --json` and `/api/strategies` show.

    Row: ``name``, ``source`` (built-in or plug-in), ``class`` (where it comes from, see :func:`strategy_sources`),
    ``parameters`` (name → :meth:`Parameter.describe`), ``summary`` (the class docstring's first line, "" without one).
    """
    origin = strategy_sources()
    rows: list[dict[str, object]] = []
    for name, cls in sorted(available_strategies().items()):
        where = origin.get(name, f"{cls.__module__}:{cls.__qualname__}")
        doc_lines = (cls.__doc__ or "").strip().splitlines()
        rows.append({
            "name": name,
            "source": "built-in" if where.startswith("crossdc.") else "plug-in",
            "class": where,
            "parameters": {k: spec.describe() for k, spec in cls.parameters.items()},
            "summary": doc_lines[0] if doc_lines else "",
        })
    return rows
