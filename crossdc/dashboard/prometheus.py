"""`/metrics`: crossdc's numbers as Prometheus metric families, written out by ``prometheus_client``.

Promises: :class:`CrossdcCollector` turns one snapshot of the run log into ``prometheus_client`` metric families,
and :func:`exposition` writes them with :func:`prometheus_client.generate_latest` from a private
:class:`~prometheus_client.CollectorRegistry` holding only that collector (none of the client's own process or
garbage-collector families). The text is Prometheus' text exposition format (version 0.0.4,
:data:`CONTENT_TYPE`): one ``# HELP`` and one ``# TYPE`` line per family, label values escaped, non-finite
values as ``NaN`` / ``+Inf`` / ``-Inf``, no ``_created`` samples; a family without samples is left out.
:func:`crossdc_families` says which numbers are reported; label sets stay bounded: only the runs of
:func:`crossdc.dashboard.queries.metrics_snapshot` (running ones and the latest few), their datacenters, and the
enrolled datacenters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crossdc.dashboard.queries import MetricsSnapshot

#: What ``generate_latest`` writes: the text format 0.0.4 (the 1.0.0 of ``CONTENT_TYPE_LATEST`` differs only
#: for metric names outside ``[a-zA-Z_:][a-zA-Z0-9_:]*``, and crossdc has none).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def _text(*values: object) -> list[str]:
    return [str(v) for v in values]


def crossdc_families(snapshot: MetricsSnapshot | None) -> list[Metric]:
    """crossdc's metrics from a snapshot of the run log (``None``: the database did not answer)."""
    database_up = GaugeMetricFamily("crossdc_database_up", "1 if the run log database answered this scrape, else 0.",
                                    value=0 if snapshot is None else 1)
    if snapshot is None:
        return [database_up]
    window = f"the run's latest {snapshot.window_rounds} rounds"
    run = ["run_id"]
    info = GaugeMetricFamily("crossdc_run_info", "Runs reported here (running ones and the latest few); always 1.",
                             labels=["run_id", "name", "strategy", "status", "baseline"])
    completed = GaugeMetricFamily("crossdc_run_rounds_completed", "Rounds the run has logged.", labels=run)
    planned = GaugeMetricFamily("crossdc_run_rounds_planned", "Rounds the run was configured for.", labels=run)
    # counters: their samples are named ``<name>_total``
    up = CounterMetricFamily("crossdc_run_bytes_up", "Encoded update bytes sent by the datacenters (all rounds).",
                             labels=run)
    down = CounterMetricFamily("crossdc_run_bytes_down", "Encoded model bytes sent to the datacenters (all rounds).",
                               labels=run)
    raw = CounterMetricFamily("crossdc_run_bytes_up_raw", "The same updates' fp32 size (all rounds).", labels=run)
    heartbeat = GaugeMetricFamily("crossdc_run_heartbeat_age_seconds", "Seconds since the run's last heartbeat.",
                                  labels=run)
    for r in snapshot.runs:
        key = _text(r.run_id)
        info.add_metric(_text(r.run_id, r.name, r.strategy, r.status, r.baseline), 1)
        completed.add_metric(key, r.rounds_completed)
        planned.add_metric(key, r.rounds_planned)
        up.add_metric(key, r.bytes_up)
        down.add_metric(key, r.bytes_down)
        raw.add_metric(key, r.bytes_up_raw)
        if r.heartbeat_age_s is not None:
            heartbeat.add_metric(key, r.heartbeat_age_s)
    dc = ["run_id", "datacenter"]
    ratio = GaugeMetricFamily(
        "crossdc_datacenter_comm_comp_ratio",
        f"comm_s / compute_s of the datacenter's accepted rounds among {window} (alert above 0.1).", labels=dc)
    exposed = GaugeMetricFamily(
        "crossdc_datacenter_exposed_comm_comp_ratio",
        f"idle_s / compute_s of the datacenter's accepted rounds among {window} where both were measured: the WAN and "
        f"coordinator time its trainer waited for (alert above 0.1).", labels=dc)
    utilisation = GaugeMetricFamily(
        "crossdc_datacenter_trainer_utilisation",
        f"compute_s / (compute_s + idle_s) of the datacenter's accepted rounds among {window} where both were "
        f"measured: the share of its time the trainer computed.", labels=dc)
    compute = GaugeMetricFamily("crossdc_datacenter_compute_seconds",
                                f"Sum of compute_s over accepted rounds among {window}.", labels=dc)
    comm = GaugeMetricFamily("crossdc_datacenter_comm_seconds", f"Sum of comm_s over accepted rounds among {window}.",
                             labels=dc)
    overhead = GaugeMetricFamily("crossdc_datacenter_overhead_seconds",
                                 f"Sum of overhead_s over accepted rounds among {window}.", labels=dc)
    by_status = GaugeMetricFamily("crossdc_datacenter_rounds", f"The datacenter's rows among {window}, by status.",
                                  labels=[*dc, "status"])
    for w in snapshot.windows:
        labels = _text(w.run_id, w.datacenter)
        for family, value in ((ratio, w.comm_comp_ratio), (exposed, w.exposed_comm_comp_ratio),
                              (utilisation, w.trainer_utilisation)):
            if value is not None:
                family.add_metric(labels, value)
        compute.add_metric(labels, w.compute_s)
        comm.add_metric(labels, w.comm_s)
        overhead.add_metric(labels, w.overhead_s)
        for status, n in w.by_status.items():
            by_status.add_metric([*labels, str(status)], n)
    seen = GaugeMetricFamily("crossdc_datacenter_last_seen_age_seconds",
                             "Seconds since the server last heard from the datacenter.", labels=["datacenter"])
    dc_info = GaugeMetricFamily("crossdc_datacenter_info", "Enrolled datacenters; always 1.",
                                labels=["datacenter", "region", "status"])
    for d in snapshot.datacenters:
        dc_info.add_metric(_text(d["name"], d["region"] or "", d["status"]), 1)
        if d["last_seen_age_s"] is not None:
            seen.add_metric(_text(d["name"]), d["last_seen_age_s"])
    return [database_up, info, completed, planned, up, down, raw, heartbeat,
            ratio, exposed, utilisation, compute, comm, overhead, by_status, seen, dc_info]


class CrossdcCollector(Collector):
    """A ``prometheus_client`` collector of crossdc's families from one snapshot of the run log."""

    def __init__(self, snapshot: MetricsSnapshot | None) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        return _with_samples(crossdc_families(self.snapshot))

    def describe(self) -> list[Metric]:
        return []  # registering reads nothing: the families are made at collect time


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return _with_samples(self.families)

    def describe(self) -> list[Metric]:
        return []


def _with_samples(families: Iterable[Metric]) -> Iterator[Metric]:
    return (f for f in families if f.samples)


def _write(collector: Collector) -> str:
    registry = CollectorRegistry(auto_describe=False)  # private: only crossdc's families
    registry.register(collector)
    return generate_latest(registry).decode("utf-8")


def exposition(snapshot: MetricsSnapshot | None) -> str:
    """The ``/metrics`` text of a snapshot (``None``: the database did not answer)."""
    return _write(CrossdcCollector(snapshot))


def render(families: Iterable[Metric]) -> str:
    """Metric families (as :func:`crossdc_families` makes them) as exposition text; those without samples are left
    out."""
    return _write(_Families(families))


__all__ = ["CONTENT_TYPE", "CrossdcCollector", "crossdc_families", "exposition", "render"]
