"""The WAN benchmark: crossdc side by side with single-datacenter training, synchronous data parallel and plain Flower.

Setting: Shakespeare char-transformer (2 layers, d_model 64, 4 heads, context 64; 117k parameters), 4 datacenters
with the natural non-IID partition (whole plays), batch 32 per datacenter, inner AdamW lr 3e-3 (SCAFFOLD: inner SGD,
which its control variates need), every datacenter on the `transoceanic` link profile (100 Mbps, 150 ms RTT).
Budget: the same number of gradient computations for every method — STEPS local steps of batch 32 per datacenter
(800 in the full size: 16 rounds at τ = 50, 800 rounds at τ = 1), i.e. 4 × 800 batches in all.

Methods and how each row is obtained (the table's "time" column says which):
- single-datacenter baselines (crossdc.orchestration.baselines, run here): `all-workers` (one datacenter with the 4
  datacenters' workers: global batch 128, STEPS steps) and `sequential` (one worker, batch 32, 4 × STEPS steps).
  Their compute-only time is measured; all-workers' is its measured time divided by 4 (4 workers in parallel,
  intra-datacenter all-reduce taken as free).
- synchronous data parallel across datacenters (τ = 1, fp32 gradients averaged every step over the WAN): its time
  and bytes are *measured*: `crossdc run --baseline sync-dp` (torch DistributedDataParallel on gloo, each
  datacenter a rank in its own network namespace, every datacenter pair joined by a transoceanic link of the
  packet-level emulator) runs a stretch of a few rounds of a few steps (Size.sync_dp_*); the per-step time, WAN time and bytes of its steps
  after the first round (connections and TCP windows warm) are extrapolated to the budget's steps — a measured
  stretch extrapolated per step, not the whole budget (800 steps of ≈ 1 s would take the benchmark's whole
  time again). Its training curve is the all-workers baseline's (averaging 4 datacenters' batch-32 gradients is one
  step on their 128 examples; the baseline draws its 128 from the pooled data instead of 32 per datacenter). The
  cost model's figure (crossdc.wan.cost_model.ring_allreduce_time, the textbook ring) is kept beside it.
- Flower's own FedAvg (flwr.serverapp.strategy.FedAvg, unchanged) with a plain ClientApp at τ = 50
  (crossdc.testing.flower_baseline), run in Flower's simulation engine; each of its messages carries one Array per
  model tensor, which the time model counts (more objects, more round trips in Flower's protocol).
- crossdc: FedAvg with a τ warm-up, DiLoCo (outer Nesterov, lr 0.7, momentum 0.5), DiLoCo + int8, DiLoCo + top-k 1 %
  (sparsity warm-up) + int8, SCAFFOLD, and FedAvg at τ = 1 with DGC's pipeline (top-k with error feedback and
  warm-up, int8; down: the union of the 4 datacenters' top-k, i.e. top-k at 4 × their fraction in every round of
  the warm-up, + int8 — a downlink that lags the union at τ = 1 keeps the datacenters stepping on stale
  coordinates: loss 2.61 instead of 2.47 after 300 rounds with a plain top-k 4 % downlink). Driven in-process
  (crossdc.testing.inprocess: the real trainers, codecs, update gate and strategies; Flower's transport left
  out); bytes are the serialised messages, counted both ways.
  Tuned on this budget's validation loss, once (full size, DiLoCo alone): outer (lr, momentum) (0.7, 0.9), the
  paper's, ends at 2.184; (1.0, 0.5) at 1.996; (0.7, 0.5) at 1.909, used here — 16 outer steps are too few for a
  0.9 momentum to build up. SCAFFOLD's inner SGD: lr 1.0 diverges (NaN, refused by the update gate), 0.3 is used.

Time on the emulated link ("cost model" in the table): per round, each datacenter's measured compute plus its link
time from the cost model validated against the link relay (benchmarks/wan_validation.py: within 6 % on three
profiles): transfer of the bytes it actually sent and received plus Flower 1.42's round trips for those messages;
the round lasts as long as the slowest datacenter, plus the platform's measured time outside training (codecs,
state, aggregation, or Flower's own time for its row). Not counted: Flower's idle polling (up to 3 s per round in
a deployment), TCP slow start, evaluation.

Rows train two at a time (`--jobs`, one process each, one torch thread each: the two cores of this machine), so
each measured compute time is that of one core beside one other busy core.

Projection column: each row's comm/comp ratio at the mission's scale (a 1B-parameter model, 2 s a step), from the
cost model with the row's τ and measured compression ratios on the same link — a projection, not a measurement.

Usage: make bench-wan, or python benchmarks/wan_benchmark.py [--size full|tiny] [--jobs 2] [--out benchmarks/results]
Writes wan_benchmark.json, wan_benchmark.md and wan_benchmark.html (plotly: validation loss vs bytes and vs time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from results_file import write_results

from crossdc.experiment.config import parse_config
from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.orchestration.baselines import run_baseline
from crossdc.strategies.schedule import tau_for_round
from crossdc.testing.flower_baseline import run_flower_fedavg
from crossdc.testing.inprocess import InProcessFederation
from crossdc.wan.cost_model import (
    CROSSDC_RECORDS_PER_MESSAGE,
    StarPlan,
    link_message_pair_time,
    ring_allreduce_time,
    star_round,
    sync_dp_step,
    uniform_datacenters,
)

RESULTS = Path(__file__).resolve().parent / "results"
DATACENTERS = ("us-east", "eu-west", "ap-south", "sa-east")
PROFILE = "transoceanic"
BATCH = 32
ADAMW_LR = 3e-3
SGD_LR = 0.3
DILOCO = {"outer_lr": 0.7, "outer_momentum": 0.5}
#: the mission's scale, for the projection column: a 1B-parameter model whose step takes 2 s
PROJECTED_PARAMS = 1_000_000_000
PROJECTED_STEP_S = 2.0
#: Flower's FedAvg message: the config (down) or metrics (up) record beside the arrays record
FLOWER_RECORDS_PER_MESSAGE = 2


@dataclass(frozen=True)
class Size:
    """How long the benchmark runs: local steps per datacenter, τ, warm-ups, how often to evaluate."""

    steps: int
    tau: int
    tau_warmup_start: int
    tau_warmup_rounds: int
    topk_warmup_rounds: int
    dgc_warmup_rounds: int
    eval_every_steps: int
    #: the sync-dp row's measured stretch: rounds of sync_dp_tau steps (the first is warm-up, left out)
    sync_dp_rounds: int = 4
    sync_dp_tau: int = 5


SIZES = {
    "full": Size(steps=800, tau=50, tau_warmup_start=10, tau_warmup_rounds=4, topk_warmup_rounds=4,
                 dgc_warmup_rounds=100, eval_every_steps=50),
    "tiny": Size(steps=4, tau=2, tau_warmup_start=2, tau_warmup_rounds=0, topk_warmup_rounds=1,
                 dgc_warmup_rounds=1, eval_every_steps=2, sync_dp_rounds=2, sync_dp_tau=2),
}


@dataclass(frozen=True)
class Method:
    """One row of the table: how it trains and what crosses the WAN."""

    key: str
    label: str
    engine: str  # "crossdc" (in-process), "flower" (Flower's simulation engine)
    strategy: str = "fedavg"
    params: dict[str, Any] = field(default_factory=dict)
    tau: str = "fixed"  # "fixed" (Size.tau), "warmup" (Size.tau_warmup_start → Size.tau), "one" (τ = 1)
    codecs: tuple[str, ...] = ()
    downlink_codecs: tuple[str, ...] = ()
    optimizer: str = "adamw"


def methods(size: Size) -> list[Method]:
    """The federated rows, in table order."""
    topk = f"topk:0.01:warmup={size.topk_warmup_rounds}"
    return [
        Method("flower-fedavg", f"Flower FedAvg (unchanged, plain client), τ = {size.tau}", "flower"),
        Method("fedavg-warmup", f"crossdc FedAvg, τ warm-up {size.tau_warmup_start} → {size.tau}", "crossdc", tau="warmup"),
        Method("diloco", f"crossdc DiLoCo, τ = {size.tau}", "crossdc", "diloco", DILOCO),
        Method("diloco-int8", f"crossdc DiLoCo + int8 (up and down), τ = {size.tau}", "crossdc", "diloco", DILOCO,
               codecs=("int8",), downlink_codecs=("int8",)),
        Method("diloco-topk-int8", f"crossdc DiLoCo + top-k 1 % (warm-up {size.topk_warmup_rounds}) + int8 up, int8 down, "
               f"τ = {size.tau}", "crossdc", "diloco", DILOCO, codecs=(topk, "int8"), downlink_codecs=("int8",)),
        Method("scaffold", f"crossdc SCAFFOLD (inner SGD lr {SGD_LR:g}), τ = {size.tau}", "crossdc", "scaffold", optimizer="sgd"),
        Method("fedavg-dgc", f"crossdc FedAvg τ = 1 + DGC (top-k 1 % warm-up {size.dgc_warmup_rounds} + int8 up; "
               "top-k 4 × that + int8 down)", "crossdc", tau="one",
               codecs=(f"topk:0.01:warmup={size.dgc_warmup_rounds}", "int8"),
               downlink_codecs=(f"topk:0.04:warmup={size.dgc_warmup_rounds}:warmup_start=1.0", "int8")),
    ]


def tau_spec(method: Method, size: Size) -> int | dict[str, int]:
    if method.tau == "one":
        return 1
    if method.tau == "warmup":
        return {"start": size.tau_warmup_start, "end": size.tau, "warmup_rounds": size.tau_warmup_rounds}
    return size.tau


def rounds_for_budget(tau: int | dict[str, int], steps: int) -> int:
    """The number of rounds whose τ add up to exactly `steps` local steps (ValueError if none does)."""
    schedule = tau if isinstance(tau, dict) else {"start": tau, "end": tau, "warmup_rounds": 0}
    done, rounds = 0, 0
    while done < steps:
        rounds += 1
        done += tau_for_round(rounds, schedule["start"], schedule["end"], schedule["warmup_rounds"])
    if done != steps:
        raise ValueError(f"τ schedule {schedule} cannot spend exactly {steps} steps (round {rounds} ends at {done})")
    return rounds


def experiment(method: Method, size: Size, rounds: int, inner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The experiment config (crossdc's config document) of a federated row; `inner`: more [workload] keys (the inner
    optimizer's betas, grad_clip, schedule...)."""
    return {
        "run": {"name": f"wan-{method.key}", "rounds": rounds, "seed": 0},
        "workload": {"dataset": "shakespeare", "model": "char-transformer",
                     "model_args": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64},
                     "partition": {"kind": "natural"}, "batch_size": BATCH, "optimizer": method.optimizer,
                     "lr": SGD_LR if method.optimizer == "sgd" else ADAMW_LR, **(inner or {})},
        "strategy": {"name": method.strategy, "tau": tau_spec(method, size), "params": dict(method.params)},
        "compression": {"codecs": list(method.codecs), "downlink_codecs": list(method.downlink_codecs)},
        "datacenters": [{"name": name} for name in DATACENTERS],
    }


# ----------------------------------------------------------------------------- engines


class RowFailed(RuntimeError):
    """A row's training broke down (a datacenter's update refused, NaN): the rounds it completed are kept."""

    def __init__(self, reason: str, rounds: list[dict[str, Any]]) -> None:
        super().__init__(reason)
        self.rounds = rounds


def drive_crossdc(doc: dict[str, Any], root: Path, eval_every_steps: int) -> list[dict[str, Any]]:
    """Every round in-process; per round: τ, per-datacenter compute and bytes, the platform's time; loss at eval points.
    RowFailed (with the completed rounds) when a round cannot complete or a datacenter's update is refused."""
    fed = InProcessFederation.from_config(parse_config(doc), root)
    rows: list[dict[str, Any]] = []
    steps = 0
    for server_round in range(1, doc["run"]["rounds"] + 1):
        started = time.perf_counter()
        try:
            result = fed.run_round()
        except Exception as err:  # noqa: BLE001 - any breakdown ends this row, not the benchmark
            raise RowFailed(f"round {server_round}: {type(err).__name__}: {err}", rows) from err
        wall = time.perf_counter() - started
        if result.rejected:
            reasons = "; ".join(f"{dc}: {why}" for dc, why in sorted(result.rejected.items()))
            raise RowFailed(f"round {server_round}: updates refused by the update gate ({reasons})", rows)
        compute = [result.compute_s[dc] for dc in fed.datacenters]
        row: dict[str, Any] = {"round": server_round, "tau": result.tau, "compute_s": compute,
                               "bytes_up": [result.bytes_up[dc] for dc in fed.datacenters],
                               "bytes_down": [result.bytes_down[dc] for dc in fed.datacenters],
                               "round_wall_s": wall, "overhead_s": max(0.0, wall - sum(compute))}
        crossed = steps // eval_every_steps < (steps + result.tau) // eval_every_steps
        steps += result.tau
        if crossed or server_round == doc["run"]["rounds"]:
            row["val_loss"], row["val_accuracy"] = fed.evaluate()
        rows.append(row)
    return rows


def run_single_datacenter(size: Size, kind: str, root: Path, inner: dict[str, Any] | None = None) -> dict[str, Any]:
    """Baseline `kind` (all-workers or sequential), evaluated every `eval_every_steps` per-datacenter steps; `inner` as
    for :func:`experiment`."""
    from crossdc.db.engine import upgrade

    db_url = f"sqlite:///{root / f'baseline-{kind}.db'}"
    upgrade(db_url)
    rounds = size.steps // size.eval_every_steps
    config = parse_config(experiment(Method("baseline", "", "crossdc"), replace(size, tau=size.eval_every_steps), rounds,
                                     inner))
    history: list[dict[str, Any]] = []
    summary = run_baseline(config, kind, db_url, f"wan-baseline-{kind}", progress=lambda h: history.__setitem__(slice(None), h))
    return {"summary": summary, "history": [dict(h) for h in history]}


# ----------------------------------------------------------------------------- time and bytes


def link_seconds(bytes_down: int, bytes_up: int, tensors: int, records: int, link: LinkSpec) -> float:
    """One datacenter's link time for a round: its message pair as the cost model moves it over `link`."""
    return link_message_pair_time(bytes_down, bytes_up, link, tensors, records)


def timeline(rounds: list[dict[str, Any]], link: LinkSpec, tensors: int, records: int = CROSSDC_RECORDS_PER_MESSAGE) -> dict[str, Any]:
    """Emulated wall time of a federated run, round by round (see the module docstring), and its totals."""
    wall = compute = comm = overhead = 0.0
    total_bytes = 0
    curve = []
    steps = 0
    for row in rounds:
        links = [link_seconds(d, u, tensors, records, link) for d, u in zip(row["bytes_down"], row["bytes_up"], strict=False)]
        busy = [compute + on_link for compute, on_link in zip(row["compute_s"], links, strict=False)]
        slowest = max(range(len(busy)), key=busy.__getitem__)
        wall += busy[slowest] + row["overhead_s"]
        compute += max(row["compute_s"])
        comm += links[slowest]
        overhead += row["overhead_s"]
        total_bytes += sum(row["bytes_down"]) + sum(row["bytes_up"])
        steps += row["tau"]
        if row.get("val_loss") is not None:
            curve.append({"steps": steps, "bytes": total_bytes, "wall_s": wall, "val_loss": row["val_loss"],
                          "val_accuracy": row["val_accuracy"]})
    return {"wall_s": wall, "compute_s": compute, "comm_s": comm, "overhead_s": overhead, "bytes": total_bytes,
            "rounds": len(rounds), "steps": steps, "curve": curve}


def baseline_row(kind: str, data: dict[str, Any], n: int) -> dict[str, Any]:
    """A single-datacenter row: measured training time (all-workers: over n workers in parallel), no WAN."""
    share = n if kind == "all-workers" else 1
    elapsed, curve, steps = 0.0, [], 0
    for h in data["history"]:
        elapsed += (h["wall_s"] - (h.get("eval_s") or 0.0)) / share
        steps += h["tau"] // (1 if kind == "all-workers" else n)
        if h.get("val_loss") is not None:
            curve.append({"steps": steps, "bytes": 0, "wall_s": elapsed, "val_loss": h["val_loss"], "val_accuracy": h["val_accuracy"]})
    return {"wall_s": elapsed, "compute_s": elapsed, "comm_s": 0.0, "overhead_s": 0.0, "bytes": 0, "steps": steps, "curve": curve}


def measure_sync_dp(size: Size, link: LinkSpec, root: Path) -> dict[str, Any]:
    """A stretch of `crossdc run --baseline sync-dp` in the benchmark's setting, each datacenter pair on `link`:
    per step (medians over the rounds after the first) its wall time, its WAN time (comm_s, from the delay line,
    the mean over datacenters) and compute, and the bytes all datacenters sent."""
    from crossdc.db.engine import make_engine, upgrade
    from crossdc.db.queries import list_datacenter_rounds, list_rounds

    doc = experiment(Method("sync-dp", "", "fedavg"), size, size.sync_dp_rounds)
    doc["strategy"]["tau"] = size.sync_dp_tau
    doc["datacenters"] = [{"name": name, "link": PROFILE} for name in DATACENTERS]
    doc["links"] = [{"between": [a, b], "profile": PROFILE} for i, a in enumerate(DATACENTERS) for b in DATACENTERS[i + 1:]]
    root.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{root / 'sync-dp.db'}"
    upgrade(db_url)
    summary = run_baseline(parse_config(doc), "sync-dp", db_url, "sync-dp-stretch", runs_root=root / "runs")
    engine = make_engine(db_url)
    try:
        rounds = [r for r in list_rounds(engine, summary["run_id"]) if r["round"] > 1]
        dc_rounds = [r for r in list_datacenter_rounds(engine, summary["run_id"]) if r["round"] > 1]
    finally:
        engine.dispose()
    per_step = statistics.median((r["wall_s"] - (r["eval_s"] or 0.0)) / r["tau"] for r in rounds)
    comm = statistics.median(statistics.mean(d["comm_s"] for d in dc_rounds if d["round"] == r["round"]) / r["tau"] for r in rounds)
    compute = statistics.median(max(d["compute_s"] for d in dc_rounds if d["round"] == r["round"]) / r["tau"] for r in rounds)
    sent = statistics.median(r["bytes_up"] / r["tau"] for r in rounds)
    return {"steps_measured": size.sync_dp_tau * (size.sync_dp_rounds - 1), "per_step_s": per_step, "per_step_comm_s": comm,
            "per_step_compute_s": compute, "per_step_bytes": sent, "run_summary": summary}


def sync_dp_row(all_workers: dict[str, Any], params: int, n: int, link: LinkSpec, measured: dict[str, Any]) -> dict[str, Any]:
    """Synchronous data parallel across the WAN: all-workers' training and compute, the measured stretch's WAN time and
    bytes per step (its steps' time less their compute) added to every step; the cost model's figure beside it."""
    gradient_bytes = 4 * params
    per_step_comm = measured["per_step_s"] - measured["per_step_compute_s"]
    per_step_bytes = measured["per_step_bytes"]
    curve = [{**p, "bytes": p["steps"] * per_step_bytes, "wall_s": p["wall_s"] + p["steps"] * per_step_comm} for p in all_workers["curve"]]
    steps = all_workers["steps"]
    return {"wall_s": all_workers["compute_s"] + steps * per_step_comm, "compute_s": all_workers["compute_s"],
            "comm_s": steps * per_step_comm, "overhead_s": 0.0, "bytes": steps * per_step_bytes, "steps": steps,
            "curve": curve, "per_step_comm_s": per_step_comm, "measured_stretch": measured,
            "cost_model_per_step_comm_s": ring_allreduce_time(gradient_bytes, n, link.bandwidth_mbps, link.rtt_ms),
            "cost_model_per_step_bytes": 2 * (n - 1) * gradient_bytes}


def time_to_loss(curve: list[dict[str, Any]], target: float) -> float | None:
    """Emulated seconds at the first evaluation whose validation loss is at or below `target` (None: never)."""
    return next((p["wall_s"] for p in curve if p["val_loss"] <= target), None)


# ----------------------------------------------------------------------------- report


#: the columns that describe a completed run (None for a row that failed)
FINAL_COLUMNS = ("val_loss", "val_accuracy", "gap_all-workers", "gap_sequential", "bytes_ratio_vs_sync", "comm_comp_ratio",
                 "wall_over_compute", "overhead_share")


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Fill the comparison columns: gaps to the baselines, bytes ratio, comm/comp, overhead share, time to target."""
    by_key = {r["key"]: r for r in rows}
    sync = by_key["sync-dp"]
    target = sync["curve"][-1]["val_loss"]
    for r in rows:
        r["time_to_sync_loss_s"] = time_to_loss(r["curve"], target)
        if r.get("failed"):  # no final model: no end-of-run columns, only how far it got
            r.update({column: None for column in FINAL_COLUMNS})
            continue
        loss = r["curve"][-1]["val_loss"]
        r["val_loss"] = loss
        r["val_accuracy"] = r["curve"][-1]["val_accuracy"]
        for kind in ("all-workers", "sequential"):
            ref = by_key[kind]["curve"][-1]["val_loss"]
            r[f"gap_{kind}"] = (loss - ref) / ref
        r["bytes_ratio_vs_sync"] = (sync["bytes"] / r["bytes"]) if r["bytes"] else None
        r["comm_comp_ratio"] = r["comm_s"] / r["compute_s"] if r["compute_s"] else None
        r["wall_over_compute"] = r["wall_s"] / r["compute_s"] if r["compute_s"] else None
        r["overhead_share"] = r["overhead_s"] / r["wall_s"] if r["wall_s"] else None


def project(rows: list[dict[str, Any]], params: int, n: int, link: LinkSpec) -> None:
    """Each row's comm/comp ratio at the mission's scale (PROJECTED_PARAMS, PROJECTED_STEP_S a step), from the cost model.

    Same τ (mean over the run), same measured compression ratios each way (fp32 size of the messages over the
    bytes sent), same link; Flower's per-object round trips left at crossdc's packing (one Array).
    """
    raw = 4 * params
    for r in rows:
        if r["key"] in ("all-workers", "sequential") or r.get("failed"):
            r["projected_comm_comp_ratio"] = None
        elif r["key"] == "sync-dp":
            r["projected_comm_comp_ratio"] = sync_dp_step(PROJECTED_PARAMS, n, link, PROJECTED_STEP_S).comm_comp_ratio
        else:
            per_round = r["per_round"]
            messages = sum(len(row["bytes_up"]) for row in per_round)
            up = raw * messages / sum(sum(row["bytes_up"]) for row in per_round)
            down = raw * messages / sum(sum(row["bytes_down"]) for row in per_round)
            tau = max(1, round(r["steps"] / len(per_round)))
            plan = StarPlan(params=PROJECTED_PARAMS, datacenters=uniform_datacenters(n, link), step_time_s=PROJECTED_STEP_S,
                            tau=tau, compression_up=up, compression_down=down)
            r.update(compression_up=up, compression_down=down, projected_comm_comp_ratio=star_round(plan).comm_comp_ratio)


def goals(rows: list[dict[str, Any]], size: Size) -> list[str]:
    """The issue's four goals, each checked against the measured rows: one line per goal, met or not and by what."""
    crossdc = [r for r in rows if r["key"] not in ("all-workers", "sequential", "sync-dp", "flower-fedavg") and not r.get("failed")]
    flower = next(r for r in rows if r["key"] == "flower-fedavg")
    best = min(crossdc, key=lambda r: r["val_loss"])

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    lossy = [r for r in crossdc if r["gap_all-workers"] <= 0.01]
    frugal = [r for r in crossdc if (r["bytes_ratio_vs_sync"] or 0) >= 100]
    fast = [r for r in crossdc if (r["wall_over_compute"] or float("inf")) <= 1.1]
    equal_tau = [r for r in crossdc if all(row["tau"] == size.tau for row in r["per_round"])]
    beats_flower = [r for r in equal_tau if r["val_loss"] < flower["val_loss"] and r["bytes"] < flower["bytes"]]
    names = lambda rs: ", ".join(r["key"] for r in rs) or "none"  # noqa: E731
    return [
        f"- Within 1 % of the all-workers baseline's validation loss: {verdict(bool(lossy))} — best crossdc row "
        f"{best['key']} at {100 * best['gap_all-workers']:+.1f} %; rows within 1 %: {names(lossy)}.",
        f"- ≥ 100× fewer bytes than synchronous data parallel: {verdict(bool(frugal))} — rows: {names(frugal)} "
        f"(largest ratio {max((r['bytes_ratio_vs_sync'] or 0) for r in crossdc):.0f}×).",
        f"- Wall time within 1.1× the compute-only limit: {verdict(bool(fast))} — rows: {names(fast)} "
        f"(best {min(r['wall_over_compute'] for r in crossdc):.2f}×).",
        f"- Better than Flower's FedAvg on both loss and bytes at equal τ = {size.tau}: {verdict(bool(beats_flower))} — "
        f"rows: {names(beats_flower)} (Flower: loss {flower['val_loss']:.3f}, {_bytes(flower['bytes'])}).",
    ]


def _num(value: float | None, fmt: str, none: str = "—") -> str:
    return none if value is None else format(value, fmt)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def markdown(rows: list[dict[str, Any]], size_name: str, size: Size, link: LinkSpec, verdicts: list[str]) -> str:
    # the figures between "val loss" and "time from", each "—" in a row that failed
    figures = ["gap all-workers", "gap sequential", "WAN bytes", "bytes vs sync", "time", "compute-only", "time / compute",
               "comm/comp", "overhead share", "time to sync's loss"]
    lines = [f"Shakespeare char-transformer, 4 datacenters (natural partition), {link.describe()}, "
             f"{size.steps} local steps of batch {BATCH} per datacenter for every method ({size_name} size).",
             "",
             "| " + " | ".join(["method", "val loss", *figures, "time from",
                                "comm/comp at 1B params, 2 s/step (projected)"]) + " |",
             "| --- | ---: |" + " ---: |" * len(figures) + " --- | ---: |"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['label']} | failed after {r['steps']} of {size.steps} steps (below) |"
                         + " — |" * len(figures) + f" {r['time_from']} | — |")
            continue
        lines.append(
            f"| {r['label']} | {r['val_loss']:.3f} | {100 * r['gap_all-workers']:+.1f} % | {100 * r['gap_sequential']:+.1f} % | "
            f"{_bytes(r['bytes']) if r['bytes'] else '0'} | "
            f"{_num(r['bytes_ratio_vs_sync'], '.0f')}{'×' if r['bytes_ratio_vs_sync'] else ''} | "
            f"{r['wall_s']:.0f} s | {r['compute_s']:.0f} s | {_num(r['wall_over_compute'], '.2f')} | {_num(r['comm_comp_ratio'], '.2f')} | "
            f"{_num(r['overhead_share'] and 100 * r['overhead_share'], '.1f')} % | "
            f"{_num(r['time_to_sync_loss_s'], '.0f', 'not reached')}{' s' if r['time_to_sync_loss_s'] is not None else ''} | "
            f"{r['time_from']} | "
            f"{_num(r['projected_comm_comp_ratio'], '.2f')} |")
    failures = [f"- {r['key']} failed: {r['failed']}" for r in rows if r.get("failed")]
    if failures:
        failures = ["", "Rows that did not complete (left out of the goals):", *failures]
    return "\n".join(lines + failures + ["", "Goals, checked against the rows above:", *verdicts])


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=2, subplot_titles=("validation loss vs bytes on the "
                                                           "WAN", "validation loss vs time on the emulated link"))
    for r in rows:
        points = r["curve"]
        name = r["label"] + (" (failed)" if r.get("failed") else "")
        if r["bytes"]:
            figure.add_trace(go.Scatter(x=[p["bytes"] for p in points], y=[p["val_loss"] for p in points], mode="lines+markers",
                                        name=name, legendgroup=r["key"]), row=1, col=1)
        figure.add_trace(go.Scatter(x=[p["wall_s"] for p in points], y=[p["val_loss"] for p in points], mode="lines+markers",
                                    name=name, legendgroup=r["key"], showlegend=not r["bytes"],
                                    line={"dash": "dot"} if not r["bytes"] else None), row=1, col=2)
    figure.update_xaxes(type="log", title_text="bytes (cumulative, both directions, all datacenters)", row=1, col=1)
    figure.update_xaxes(type="log", title_text="seconds", row=1, col=2)
    figure.update_yaxes(title_text="validation loss")
    figure.update_layout(title=title, height=600)
    figure.write_html(path, include_plotlyjs=True)


# ----------------------------------------------------------------------------- main


def task(key: str, size_name: str, root: str, threads: int) -> dict[str, Any]:
    """One row's training, in a worker process: a baseline's history, or a federated row's per-round record."""
    torch.set_num_threads(threads)
    size, n, link = SIZES[size_name], len(DATACENTERS), LINK_PROFILES[PROFILE]
    started = time.perf_counter()
    if key in ("all-workers", "sequential"):
        label = (f"one datacenter, all {n} datacenters' workers (batch {n * BATCH})" if key == "all-workers"
                 else f"one datacenter, one worker, {n}× the steps")
        row = {"key": key, "label": label, "time_from": "measured",
               **baseline_row(key, run_single_datacenter(size, key, Path(root)), n)}
    else:
        method = next(m for m in methods(size) if m.key == key)
        failed: str | None = None
        doc = experiment(method, size, rounds_for_budget(tau_spec(method, size), size.steps))
        if method.engine == "flower":
            per_round = run_flower_fedavg(parse_config(doc), size.tau, doc["run"]["rounds"])
            measured = timeline(per_round, link, len(build_model_for(size).state_dict()), records=FLOWER_RECORDS_PER_MESSAGE)
            time_from = "cost model for the link, measured compute and Flower's own time"
        else:
            try:
                per_round = drive_crossdc(doc, Path(root) / key, size.eval_every_steps)
            except RowFailed as err:
                per_round, failed = err.rounds, str(err)
            tensors = 2 if method.strategy == "scaffold" else 1  # one packed Array per tensor group
            measured = timeline(per_round, link, tensors)
            time_from = "cost model for the link, measured compute and platform time"
        row = {"key": key, "label": method.label, "time_from": time_from, "config": doc, "per_round": per_round,
               "failed": failed, **measured}
    row["benchmark_wall_s"] = time.perf_counter() - started
    outcome = (f"FAILED after {row['steps']} steps: {row['failed']}" if row.get("failed") else
               f"val loss {row['curve'][-1]['val_loss']:.4f}  bytes {row['bytes']:>13,d}  time {row['wall_s']:.0f}s")
    print(f"  {key:<18} {outcome}  ({row['benchmark_wall_s']:.0f}s to run)", flush=True)
    return row


def run(size_name: str, out: Path, only: list[str] | None = None, jobs: int = 2, threads: int = 1) -> dict[str, Any]:
    """Run every row of size `size_name`, `jobs` rows at a time (each in its own process with `threads` torch
    threads); write wan_benchmark[-size].json / .md / .html under `out`; return the result."""
    size = SIZES[size_name]
    link = LINK_PROFILES[PROFILE]
    n = len(DATACENTERS)
    started = time.perf_counter()
    federated = [m.key for m in methods(size) if not only or m.key in only]
    # longest first (τ = 1 has the most rounds, Flower starts its engine), so that the pool ends together
    keys = sorted(federated, key=lambda k: (k != "fedavg-dgc", k != "flower-fedavg")) + ["all-workers", "sequential"]
    with tempfile.TemporaryDirectory() as tmp:
        measured_sync = measure_sync_dp(size, link, Path(tmp) / "sync-dp")  # alone: it times the WAN, not the cores
        if jobs <= 1:
            done = {key: task(key, size_name, tmp, threads) for key in keys}
        else:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = {key: pool.submit(task, key, size_name, tmp, threads) for key in keys}
                done = {key: future.result() for key, future in futures.items()}
    params = sum(int(p.numel()) for p in build_model_for(size).parameters())
    sync = {"key": "sync-dp", "label": "synchronous data parallel across datacenters (τ = 1, fp32, DDP on gloo)",
            "time_from": "measured: sync-dp baseline over the emulated WAN (a stretch, per step); training = all-workers",
            **sync_dp_row(done["all-workers"], params, n, link, measured_sync)}
    rows = [done["all-workers"], done["sequential"], sync, *(done[k] for k in federated)]
    finish_rows(rows)
    project(rows, params, n, link)
    verdicts = goals(rows, size)
    table = markdown(rows, size_name, size, link, verdicts)
    suffix = "" if size_name == "full" else f"-{size_name}"
    out.mkdir(parents=True, exist_ok=True)
    result = {"setting": {"size": size_name, **asdict(size), "datacenters": list(DATACENTERS), "link": asdict(link),
                          "batch_size": BATCH, "adamw_lr": ADAMW_LR, "sgd_lr": SGD_LR, "params": params, "jobs": jobs,
                          "torch_threads": threads},
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "rows": rows, "goals": verdicts, "wall_s": time.perf_counter() - started, "table_markdown": table}
    (out / f"wan_benchmark{suffix}.md").write_text(table + "\n")
    chart(rows, out / f"wan_benchmark{suffix}.html", f"crossdc vs synchronous and Flower on a {link.describe()} link")
    write_results(out / f"wan_benchmark{suffix}.json", result, table)
    return result


def build_model_for(size: Size) -> torch.nn.Module:
    from crossdc.experiment.builders import build_workload, initial_model

    config = parse_config(experiment(Method("model", "", "crossdc"), size, rounds_for_budget(size.tau, size.steps)))
    return initial_model(config, build_workload(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", nargs="*", help="federated rows to run (keys); default: all")
    parser.add_argument("--jobs", type=int, default=2, help="rows trained at once, one process each (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per row (default 1)")
    parser.add_argument("--sync-dp-only", action="store_true",
                        help="only the sync-dp row's measured stretch, against the cost model's figure "
                             "(writes wan_benchmark_sync_dp[-size].json)")
    args = parser.parse_args()
    if args.sync_dp_only:
        sync_dp_only(args.size, args.out)
    else:
        run(args.size, args.out, args.only, args.jobs, args.threads)


def sync_dp_only(size_name: str, out: Path) -> dict[str, Any]:
    """The sync-dp row's measured stretch alone, beside the cost model's per-step figures (textbook ring and gloo)."""
    from crossdc.wan.cost_model import gloo_ring_allreduce_time

    size = SIZES[size_name]
    link = LINK_PROFILES[PROFILE]
    n = len(DATACENTERS)
    params = sum(int(p.numel()) for p in build_model_for(size).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_sync_dp(size, link, Path(tmp))
    measured.pop("run_summary", None)
    gradient_bytes = 4 * params
    result = {"setting": {"size": size_name, "params": params, "datacenters": list(DATACENTERS), "link": asdict(link)},
              "measured": measured, "measured_comm_per_step_s": measured["per_step_s"] - measured["per_step_compute_s"],
              "cost_model_ring_per_step_s": ring_allreduce_time(gradient_bytes, n, link.bandwidth_mbps, link.rtt_ms),
              "cost_model_gloo_per_step_s": gloo_ring_allreduce_time(gradient_bytes, n, link.bandwidth_mbps, link.rtt_ms),
              "cost_model_bytes_per_step": 2 * (n - 1) * gradient_bytes}
    suffix = "" if size_name == "full" else f"-{size_name}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"wan_benchmark_sync_dp{suffix}.json").write_text(json.dumps(result, indent=1))
    print(f"{'sync DP per step (' + str(n) + ' datacenters, ' + link.describe() + ')':<70}{'s':>8}{'MB sent':>10}")
    print(f"{'measured: wall':<70}{measured['per_step_s']:>8.3f}{measured['per_step_bytes'] / 1e6:>10.2f}")
    print(f"{'measured: WAN (wall − compute)':<70}{result['measured_comm_per_step_s']:>8.3f}")
    print(f"{'measured: comm_s (delay line, mean over datacenters)':<70}{measured['per_step_comm_s']:>8.3f}")
    print(f"{'cost model: textbook ring (the benchmark used it until now)':<70}{result['cost_model_ring_per_step_s']:>8.3f}"
          f"{result['cost_model_bytes_per_step'] / 1e6:>10.2f}")
    print(f"{'cost model: gloo ring':<70}{result['cost_model_gloo_per_step_s']:>8.3f}")
    return result


if __name__ == "__main__":
    main()
