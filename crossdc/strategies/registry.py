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

from crossdc.plugins import PluginRegistry
from crossdc.strategies.base import Strategy, StrategyError

ENTRY_POINT_GROUP = "crossdc.strategies"
REGISTRY: PluginRegistry[type[Strategy]] = PluginRegistry(ENTRY_POINT_GROUP, Strategy, "strategy", StrategyError)


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: register a Strategy subclass under `name` for this process (sets ``cls.name``)."""
    return REGISTRY.register(name)


def unregister_strategy(name: str) -> None:
    """Forget a strategy registered with the decorator (tests)."""
    REGISTRY.unregister(name)


def strategy_sources() -> dict[str, str]:
    """Name → where it comes from: ``module:Class`` of its entry point, or ``decorator:module.Class``."""
    return REGISTRY.sources()


def available_strategies() -> dict[str, type[Strategy]]:
    """Name → class of every registered strategy (a broken or duplicate plug-in raises StrategyError naming it)."""
    return REGISTRY.load()


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
