"""Typed rows of the run log: one record type per table the round loops write, derived from the SQL models.

A :class:`DatacenterRoundRecord` is one datacenter's part of one round (a ``datacenter_rounds`` row without its
key: run, round, datacenter); a :class:`TimelineSpanRecord` is one span of a datacenter's timeline (a
``timeline_spans`` row without its run: round, datacenter, kind, start_s, end_s, a streaming run's fragment and
exchange, a pipeline run's microbatch and step); a :class:`PipelineStageRecord` is one stage's part of one round of a
pipeline run (a ``pipeline_stages`` row without its key: run, round). Their fields are the models' columns — written
once, in :mod:`crossdc.db.models` — and ``validated()`` checks every value against its column: the column's type
(integer, number, text), whether it may be NULL, its ``info`` bounds (``minimum``, ``maximum``), whether it must be
a finite number (``finite``) and its allowed values (``choices``). A bad value raises TypeError or ValueError naming
the column, before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Column, Float, Integer, String, Table, Text

from crossdc.db.models import DATACENTER_ROUNDS, PIPELINE_STAGES, TIMELINE_SPANS

#: the columns of ``datacenter_rounds`` that place a row rather than describe it
DATACENTER_ROUND_KEY = ("id", "run_id", "round", "datacenter")
#: the columns of ``timeline_spans`` that the run log fills in (a batch of spans belongs to one run)
TIMELINE_SPAN_KEY = ("id", "run_id")
#: the columns of ``pipeline_stages`` that place a row rather than describe it (the stage is a field: a round's rows
#: differ by it)
PIPELINE_STAGE_KEY = ("id", "run_id", "round")


def _python_type(column: Column) -> type:
    if isinstance(column.type, Integer):
        return int
    if isinstance(column.type, Float):
        return float
    if isinstance(column.type, (String, Text)):
        return str
    raise TypeError(f"column {column.name}: no record type for {column.type!r}")


def _default(column: Column) -> Any:
    return column.default.arg if column.default is not None and column.default.is_scalar else None


def _record_fields(table: Table, key: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """(name, type, field) of every non-key column: required columns first (no default, not nullable)."""
    columns = [c for c in table.columns if c.name not in set(key)]
    required = [c for c in columns if not c.nullable and _default(c) is None]
    optional = [c for c in columns if c not in required]
    fields: list[tuple[str, Any, Any]] = [(c.name, _python_type(c), dataclasses.field()) for c in required]
    fields += [(c.name, _python_type(c) | None, dataclasses.field(default=_default(c))) for c in optional]
    return fields


def check_value(column: Column, value: Any) -> Any:
    """`value` as column `column` stores it; TypeError/ValueError naming the column if it cannot be stored."""
    name = column.name
    if value is None:
        if column.nullable:
            return None
        raise TypeError(f"{name} must not be None")
    kind = _python_type(column)
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise TypeError(f"{name} must be an integer, got {value!r}")
        try:
            value = int(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be an integer, got {value!r}") from err
    elif kind is float:
        try:
            value = float(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be a number or None, got {value!r}") from err
    elif not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    elif not column.nullable and not value:
        raise ValueError(f"{name} must not be empty")
    if column.info.get("finite") and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    minimum = column.info.get("minimum")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    maximum = column.info.get("maximum")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    choices = column.info.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


class _Record:
    """What every typed run-log record offers (mixed into the generated dataclasses)."""

    __table__: Table

    def validated(self) -> dict[str, Any]:
        """The record's values checked against their columns, by column name."""
        return {f.name: check_value(self.__table__.c[f.name], getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Any:
        """A copy with `changes` (unknown names are errors)."""
        return dataclasses.replace(self, **changes)


def _record_class(name: str, table: Table, key: Iterable[str], doc: str) -> type:
    cls = dataclasses.make_dataclass(name, _record_fields(table, key), bases=(_Record,), namespace={"__doc__": doc},
                                     kw_only=True)
    cls.__table__ = table
    cls.__module__ = __name__
    return cls


#: one datacenter's part of one round (``status`` required; every other column optional, with its default)
DatacenterRoundRecord = _record_class(
    "DatacenterRoundRecord", DATACENTER_ROUNDS, DATACENTER_ROUND_KEY,
    "One datacenter's part of one round: a datacenter_rounds row without its key (fields = the model's columns).")

#: one span of a datacenter's timeline (round, datacenter, kind, start_s, end_s required; fragment, exchange,
#: microbatch, step optional)
TimelineSpanRecord = _record_class(
    "TimelineSpanRecord", TIMELINE_SPANS, TIMELINE_SPAN_KEY,
    "One span of a datacenter's timeline: a timeline_spans row without its run (fields = the model's columns).")

#: one stage's part of one round of a pipeline run (every field required but train_loss: the last stage's only)
PipelineStageRecord = _record_class(
    "PipelineStageRecord", PIPELINE_STAGES, PIPELINE_STAGE_KEY,
    "One stage's part of one round of a pipeline run: a pipeline_stages row without its key (fields = the model's "
    "columns).")

__all__ = ["DATACENTER_ROUND_KEY", "PIPELINE_STAGE_KEY", "TIMELINE_SPAN_KEY", "DatacenterRoundRecord",
           "PipelineStageRecord", "TimelineSpanRecord", "check_value"]
