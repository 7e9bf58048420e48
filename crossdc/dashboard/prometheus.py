"""`/metrics`: crossdc's numbers in Prometheus' text exposition format (version 0.0.4).

Promises: :func:`render` writes families that Prometheus (and ``prometheus_client.parser``) parse: one ``# HELP``
and one ``# TYPE`` line per family, label values escaped (backslash, double quote, newline), non-finite values
as ``NaN`` / ``+Inf`` / ``-Inf``, a final newline. :func:`crossdc_families` says which numbers are reported;
label sets stay bounded: only the runs of :func:`crossdc.dashboard.queries.metrics_snapshot` (running ones and
the latest few), their datacenters, and the enrolled datacenters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from crossdc.dashboard.queries import MetricsSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass
class MetricFamily:
    """One metric: its name, ``gauge`` or ``counter`` (a counter's name ends in ``_total``), help text, samples."""

    name: str
    kind: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> None:
        self.samples.append((labels, value))


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    value = float(value)
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_label_value(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def render(families: list[MetricFamily]) -> str:
    """The families as exposition text (families without samples are left out)."""
    lines: list[str] = []
    for family in families:
        if family.kind not in ("gauge", "counter"):
            raise ValueError(f"unsupported metric type {family.kind!r}")
        if not _NAME.match(family.name) or (family.kind == "counter" and not family.name.endswith("_total")):
            raise ValueError(f"bad metric name {family.name!r}")
        if not family.samples:
            continue
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for labels, value in family.samples:
            bad = [k for k in labels if not _LABEL.match(k) or k.startswith("__")]
            if bad:
                raise ValueError(f"bad label name(s) {bad} in {family.name}")
            lines.append(f"{family.name}{_labels(labels)} {_format_value(value)}")
    return "\n".join(lines) + "\n"


def crossdc_families(snapshot: MetricsSnapshot | None) -> list[MetricFamily]:
    """crossdc's metrics from a snapshot of the run log (``None``: the database did not answer)."""
    database_up = MetricFamily("crossdc_database_up", "gauge", "1 if the run log database answered this scrape, else 0.")
    database_up.add(0 if snapshot is None else 1)
    if snapshot is None:
        return [database_up]
    window = f"the run's latest {snapshot.window_rounds} rounds"
    info = MetricFamily("crossdc_run_info", "gauge", "Runs reported here (running ones and the latest few); always 1.")
    completed = MetricFamily("crossdc_run_rounds_completed", "gauge", "Rounds the run has logged.")
    planned = MetricFamily("crossdc_run_rounds_planned", "gauge", "Rounds the run was configured for.")
    up = MetricFamily("crossdc_run_bytes_up_total", "counter", "Encoded update bytes sent by the datacenters (all rounds).")
    down = MetricFamily("crossdc_run_bytes_down_total", "counter", "Encoded model bytes sent to the datacenters (all rounds).")
    raw = MetricFamily("crossdc_run_bytes_up_raw_total", "counter", "The same updates' fp32 size (all rounds).")
    heartbeat = MetricFamily("crossdc_run_heartbeat_age_seconds", "gauge", "Seconds since the run's last heartbeat.")
    for run in snapshot.runs:
        info.add(1, run_id=run.run_id, name=run.name, strategy=run.strategy, status=run.status, baseline=run.baseline)
        completed.add(run.rounds_completed, run_id=run.run_id)
        planned.add(run.rounds_planned, run_id=run.run_id)
        up.add(run.bytes_up, run_id=run.run_id)
        down.add(run.bytes_down, run_id=run.run_id)
        raw.add(run.bytes_up_raw, run_id=run.run_id)
        if run.heartbeat_age_s is not None:
            heartbeat.add(run.heartbeat_age_s, run_id=run.run_id)
    ratio = MetricFamily("crossdc_datacenter_comm_comp_ratio", "gauge",
                         f"comm_s / compute_s of the datacenter's accepted rounds among {window} (alert above 0.1).")
    compute = MetricFamily("crossdc_datacenter_compute_seconds", "gauge", f"Sum of compute_s over accepted rounds among {window}.")
    comm = MetricFamily("crossdc_datacenter_comm_seconds", "gauge", f"Sum of comm_s over accepted rounds among {window}.")
    overhead = MetricFamily("crossdc_datacenter_overhead_seconds", "gauge", f"Sum of overhead_s over accepted rounds among {window}.")
    by_status = MetricFamily("crossdc_datacenter_rounds", "gauge", f"The datacenter's rows among {window}, by status.")
    for w in snapshot.windows:
        labels = {"run_id": w.run_id, "datacenter": w.datacenter}
        if w.comm_comp_ratio is not None:
            ratio.add(w.comm_comp_ratio, **labels)
        compute.add(w.compute_s, **labels)
        comm.add(w.comm_s, **labels)
        overhead.add(w.overhead_s, **labels)
        for status, n in w.by_status.items():
            by_status.add(n, **labels, status=status)
    seen = MetricFamily("crossdc_datacenter_last_seen_age_seconds", "gauge", "Seconds since the server last heard from the datacenter.")
    dc_info = MetricFamily("crossdc_datacenter_info", "gauge", "Enrolled datacenters; always 1.")
    for dc in snapshot.datacenters:
        dc_info.add(1, datacenter=dc["name"], region=dc["region"] or "", status=dc["status"])
        if dc["last_seen_age_s"] is not None:
            seen.add(dc["last_seen_age_s"], datacenter=dc["name"])
    return [database_up, info, completed, planned, up, down, raw, heartbeat,
            ratio, compute, comm, overhead, by_status, seen, dc_info]


__all__ = ["CONTENT_TYPE", "MetricFamily", "crossdc_families", "render"]
