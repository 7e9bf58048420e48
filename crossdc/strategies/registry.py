"""Finds strategies: built-ins and plug-ins, all through the `crossdc.strategies` entry-point group."""

from __future__ import annotations

from importlib.metadata import entry_points

from crossdc.strategies.base import Strategy, StrategyError

ENTRY_POINT_GROUP = "crossdc.strategies"


def available_strategies() -> dict[str, type[Strategy]]:
    """Name → class of every registered strategy (a broken plug-in raises StrategyError naming it)."""
    found: dict[str, type[Strategy]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as err:  # a plug-in's import error must name the plug-in
            raise StrategyError(f"strategy plug-in '{ep.name}' ({ep.value}) failed to load: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise StrategyError(f"strategy plug-in '{ep.name}' ({ep.value}) is not a crossdc Strategy subclass")
        found[ep.name] = cls
    return found


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under `name`, or StrategyError listing the known names."""
    strategies = available_strategies()
    if name not in strategies:
        raise StrategyError(f"unknown strategy '{name}'; known: {', '.join(sorted(strategies))}")
    return strategies[name]
