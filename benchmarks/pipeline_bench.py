"""The pipeline split end to end: measured step time against the planner, the bubble, and the activation codecs.

Every row is a real `crossdc run` on Flower's Deployment Engine (crossdc.orchestration.local_run.LocalRun): each
datacenter (one pipeline stage) in its own network namespace, the activations and their gradients crossing the
emulated `[[links]]` link between consecutive stages (gloo over torch.distributed.pipelining). The workload: the
character transformer on Shakespeare (d_model 128, 4 heads, 6 blocks, seq_len 64: 3 + 3 blocks on 2 stages, 2 + 2 + 2
on 3, so the stages are even, as the textbook bubble assumes), batch 32, AdamW 3e-3, 4 micro-batches of 8 sequences;
the stages compute about 0.4 s a step in all (a micro-batch's forward about 16 ms and its backward about 30 ms on a
2-stage split), so the stages' compute is well above the WAN's per-micro-batch costs on the fast links and
comparable to them on the slow ones.

Rows (S stages, one link between every two consecutive stages, each schedule gpipe and 1f1b):
- *free-S*: 10000 Mbps / 1 ms RTT (latency hidden; traffic still stage to stage, not through the coordinator);
- *1g20*: 2 stages, 1 Gbps / 20 ms; *100m150*: 2 stages, 100 Mbps / 150 ms; *50m100x3*: 3 stages, 50 Mbps / 100 ms;
- *free-2 int8* and *free-2 subspace*: the 1f1b free-2 row with the activation codecs.

What is read back from SQL per row (rounds after the first; the first pays the group's forming and warm-up):
- the **measured step**: per round the least of the stages' pipeline_stages wall_s / steps, median over rounds (the
  stages get a round's message at different times, and those that start earlier wait for the others inside their
  first step: the stage that started last waited least); beside it, the step period from the spans (stage 0's
  first op of a step to that of the next, a round's first step left out), median over steps;
- each stage's compute per step (compute_s / steps) and per micro-batch forward and backward (timeline_spans),
  the bytes a micro-batch's activation takes on the wire (bytes_forward / (steps · M), the link ledger's count);
- the **bubble**: pipeline_stages.bubble_fraction (1 − compute_s / wall_s of the stage), mean over stages, median
  over rounds; beside it the bubble inside the schedule's window (per step: the stages' idle time between the
  step's first op and its last, from the spans: the optimizer step and the step's set-up left out);
- what a crossing costs: an op that waited on its neighbour starts this long after the neighbour's op ended
  (median; the link's delay plus gloo's handshake and the wake-up), from the spans;
- the validation loss of the last round (rounds.val_loss; every row trains the same steps from the same seed).

The planner's prediction (crossdc.wan.pipeline_plan.pipeline_step, fed with measured figures; its default
transport "gloo" models what the runtime does: crossdc's PrepostedSchedule posts every receive of a step when the
step starts, and gloo sends a message's data once the receiver's notice has crossed the link, so a micro-batch that
crosses a boundary costs a one-way delay and its time on the wire, the step's first ones whatever is left of the
notice's trip):
- *planner (free-link calibration)*, the goal's column: the stages' compute per step and the backward/forward
  ratio are the free-S row's of the same schedule (the row with latency hidden), and ``optimizer_s`` is what that
  row's step measured beyond the simulated schedule (the optimizer step, the data, torch's bookkeeping): a
  prediction of the WAN rows from a run without WAN delay plus the links' bandwidth and RTT. On the free rows it is
  exact by construction (they are the calibration), so they are not scored;
- *planner (same-run compute)*: the same with the row's own compute (compute_s per micro-batch of the row's run),
  which takes the CPU contention of that row out of the comparison;
- *torch's schedules*: the planner with ``transport="torch"`` (torch's own ScheduleGPipe / Schedule1F1B, which the
  runtime ran until 2026-12-05: each receive posted just before its op, so a crossing costs a round trip; 1F1B
  holds sends back until the stage's next receive), free-link calibration: what posting the receives ahead saves;
- *streaming*: the planner with ``transport="streaming"`` (an ideal engine: a send leaves as soon as its op ends,
  no notice to wait for), free-link calibration.

Goals: (a) the WAN rows' measured step within 20 % of the planner's prediction (free-link calibration), on the
three link profiles (a profile is met when both schedules' rows are); beside it, which schedule the planner and
the other transports say is faster, against the one measured faster; (b) on the free rows, the measured bubble
within 10 % (relative) of (S − 1)/(M + S − 1); (c) int8 activations' validation loss within 1 % of none's at equal
steps; and the subspace codec's compression (bytes on the wire, none / subspace) and loss cost.

This machine has 2 cores and other jobs (test suites) run on it at the same time: S stages share 2 cores (3 stages
cannot all compute at once), so a micro-batch's compute is slower while the pipeline is full than in its fill and
drain, which shrinks the measured bubble and stretches the steady state; the load average before and after each
row is recorded.

Usage: python benchmarks/pipeline_bench.py [--quick] [--keep] [--out benchmarks/results/pipeline.json]
(needs the namespace emulator: root, or the capabilities of docs/wan.md). --quick: a tiny model, 3 rows, 2 rounds
(about 2 minutes, a smoke test). Writes the JSON and a markdown table (same name, .md). --reanalyse runs nothing:
it recomputes the predictions, goals and table from the rows in --out, measured again from the databases of a kept
run with --runs DIR (the folder --keep printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results_file import write_results

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_pipeline_stages, list_rounds, list_timeline_spans
from crossdc.experiment.config import parse_config
from crossdc.experiment.links import LinkSpec
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRun, LocalRunOptions
from crossdc.strategies.pipeline import bubble_fraction
from crossdc.wan.pipeline_plan import DEFAULT_TRANSPORT, PipelinePlan, pipeline_step

ENGINE = ("Flower's Deployment Engine (crossdc.orchestration.local_run.LocalRun), each datacenter (one stage) in its "
          "own network namespace; activations and gradients over gloo (torch.distributed.pipelining) through the "
          "emulated [[links]] link between consecutive stages")
DATACENTERS = ("us-east", "eu-west", "ap-south")
MICROBATCHES = 4
FREE_LINK = (10_000.0, 1.0)  # Mbps, RTT ms: latency hidden, traffic still stage to stage


@dataclass(frozen=True)
class Size:
    model_args: dict[str, int]
    batch_size: int
    tau: int
    rounds: int


SIZES = {
    "full": Size({"d_model": 128, "heads": 4, "layers": 6, "seq_len": 64}, 32, 6, 4),
    "quick": Size({"d_model": 32, "heads": 2, "layers": 2, "seq_len": 32}, 16, 3, 2),
}


@dataclass(frozen=True)
class Row:
    key: str
    stages: int
    bandwidth_mbps: float
    rtt_ms: float
    schedule: str
    codec: str = "none"

    @property
    def free(self) -> bool:
        return (self.bandwidth_mbps, self.rtt_ms) == FREE_LINK

    @property
    def link(self) -> str:
        return f"{self.bandwidth_mbps:g} Mbps / {self.rtt_ms:g} ms"

    @property
    def calibration(self) -> str:
        """The key of the free-link row of the same stages and schedule (no codec)."""
        return f"free-{self.stages}-{self.schedule}"


def rows_for(quick: bool) -> list[Row]:
    if quick:
        return [Row("free-2-1f1b", 2, *FREE_LINK, "1f1b"), Row("100m150-1f1b", 2, 100, 150, "1f1b"),
                Row("free-2-1f1b-int8", 2, *FREE_LINK, "1f1b", "int8")]
    rows = []
    for schedule in ("gpipe", "1f1b"):
        rows += [Row(f"free-2-{schedule}", 2, *FREE_LINK, schedule), Row(f"free-3-{schedule}", 3, *FREE_LINK, schedule),
                 Row(f"1g20-{schedule}", 2, 1000, 20, schedule), Row(f"100m150-{schedule}", 2, 100, 150, schedule),
                 Row(f"50m100x3-{schedule}", 3, 50, 100, schedule)]
    rows += [Row("free-2-1f1b-int8", 2, *FREE_LINK, "1f1b", "int8"),
             Row("free-2-1f1b-subspace", 2, *FREE_LINK, "1f1b", "subspace")]
    return rows


def config_doc(row: Row, size: Size) -> dict[str, Any]:
    names = DATACENTERS[: row.stages]
    return {
        "run": {"name": f"pipeline-bench-{row.key}", "rounds": size.rounds, "seed": 0, "eval_every": size.rounds,
                "round_timeout_s": 300},
        "workload": {"dataset": "shakespeare", "model": "char-transformer", "model_args": dict(size.model_args),
                     "batch_size": size.batch_size, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": "pipeline", "tau": size.tau,
                     "params": {"microbatches": MICROBATCHES, "schedule": row.schedule, "activation_codec": row.codec,
                                "stage_timeout_s": 60}},
        "datacenters": [{"name": name} for name in names],
        "links": [{"between": [a, b], "bandwidth_mbps": row.bandwidth_mbps, "rtt_ms": row.rtt_ms}
                  for a, b in zip(names, names[1:], strict=False)],
    }


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def measure(stage_rows: list[dict[str, Any]], spans: list[dict[str, Any]], rounds: list[dict[str, Any]],
            stages: int) -> dict[str, Any]:
    """What a row's SQL rows say, over the rounds after the first (see the module docstring)."""
    last_round = max(r["round"] for r in stage_rows)
    kept = [r for r in stage_rows if r["round"] > 1] or stage_rows  # a 1-round run keeps its only round
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in kept:
        by_round[r["round"]].append(r)
    # the stages get the round's message at different times and the earlier ones wait in their first step for the
    # later: the stage that started last (the least wall_s) waited least
    step_s = _median([min(r["wall_s"] / r["steps"] for r in rs) for rs in by_round.values()])
    compute_per_step = [_median([r["compute_s"] / r["steps"] for r in kept if r["stage"] == s]) for s in range(stages)]
    bubble = _median([statistics.fmean(r["bubble_fraction"] for r in rs) for rs in by_round.values()])
    act_bytes = [_median([r["bytes_forward"] / (r["steps"] * r["microbatches"]) for r in kept if r["stage"] == s])
                 for s in range(stages - 1)]
    grad_bytes = [_median([r["bytes_backward"] / (r["steps"] * r["microbatches"]) for r in kept if r["stage"] == s])
                  for s in range(1, stages)]
    names = sorted({r["datacenter"] for r in stage_rows}, key=lambda n: next(r["stage"] for r in stage_rows
                                                                              if r["datacenter"] == n))
    kept_rounds = set(by_round)
    my_spans = [s for s in spans if s["round"] in kept_rounds]
    op_s: dict[tuple[int, str], list[float]] = defaultdict(list)
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for span in my_spans:
        stage = names.index(span["datacenter"])
        op_s[(stage, span["kind"])].append(span["end_s"] - span["start_s"])
        by_step[span["step"]].append(span)
    forward = [_median(op_s[(s, "forward")]) for s in range(stages)]
    backward = [_median(op_s[(s, "backward")]) for s in range(stages)]
    # what a crossing costs: an op that waited on its neighbour (its forward input or its backward's gradient)
    # starts this long after the neighbour's op ended (the link's delay, gloo's handshake, the wake-up)
    ends = {(names.index(sp["datacenter"]), sp["kind"], sp["step"], sp["microbatch"]): sp["end_s"] for sp in my_spans}
    crossings = []
    for step_spans in by_step.values():
        previous_end: dict[int, float] = {}
        for span in sorted(step_spans, key=lambda sp: sp["start_s"]):
            stage = names.index(span["datacenter"])
            neighbour = stage - 1 if span["kind"] == "forward" else stage + 1
            dependency = ends.get((neighbour, span["kind"], span["step"], span["microbatch"]))
            if 0 <= neighbour < stages and dependency is not None and dependency >= previous_end.get(stage, -1e18):
                crossings.append(span["start_s"] - dependency)
            previous_end[stage] = span["end_s"]
    window_bubbles = []
    for step_spans in by_step.values():
        window = max(s["end_s"] for s in step_spans) - min(s["start_s"] for s in step_spans)
        busy = sum(s["end_s"] - s["start_s"] for s in step_spans)
        if window > 0:
            window_bubbles.append(1.0 - busy / (stages * window))
    first_ops: dict[tuple[int, int], float] = {}  # (round, step) → stage 0's first op start
    for span in my_spans:
        if span["datacenter"] == names[0]:
            key = (span["round"], span["step"])
            first_ops[key] = min(first_ops.get(key, span["start_s"]), span["start_s"])
    # steady state: a round's first step is left out (it holds the wait for the stages that started later)
    round_first = {rnd: min(st for r, st in first_ops if r == rnd) for rnd, _ in first_ops}
    periods = [first_ops[(rnd, st + 1)] - first_ops[(rnd, st)] for rnd, st in first_ops
               if (rnd, st + 1) in first_ops and st != round_first[rnd]]
    val = [r["val_loss"] for r in rounds if r["round"] == last_round and r["val_loss"] is not None]
    return {
        "rounds_used": sorted(kept_rounds), "steps_per_round": kept[0]["steps"],
        "step_s": step_s, "step_period_s_from_spans": _median(periods),
        "stage_compute_per_step_s": compute_per_step, "forward_per_microbatch_s": forward,
        "backward_per_microbatch_s": backward,
        "backward_ratio": sum(backward) / sum(forward) if sum(forward) > 0 else float("nan"),
        "bubble_fraction": bubble, "bubble_fraction_in_schedule_window": _median(window_bubbles),
        "crossing_s": _median(crossings),
        "activation_bytes_per_microbatch": act_bytes, "gradient_bytes_per_microbatch": grad_bytes,
        "bytes_source": sorted({r["bytes_source"] for r in stage_rows}),
        "val_loss": val[0] if val else None,
        "per_round": [{"round": rnd, "stages": [{k: r[k] for k in ("stage", "steps", "compute_s", "wall_s",
                                                                     "bubble_fraction", "bytes_forward",
                                                                     "bytes_backward", "train_loss")} for r in rs]}
                      for rnd, rs in sorted(by_round.items())],
    }


def read_back(db_url: str, run_id: str, stages: int) -> dict[str, Any]:
    """What SQL says of one row's run (`measure`)."""
    engine = make_engine(db_url)
    try:
        stage_rows = list_pipeline_stages(engine, run_id)
        spans = list_timeline_spans(engine, run_id)
        rounds = list_rounds(engine, run_id)
    finally:
        engine.dispose()
    return measure(stage_rows, spans, rounds, stages)


def run_row(row: Row, size: Size, root: Path) -> dict[str, Any]:
    """Run one row to its end and read back what SQL says of it; a failed run is recorded, with its logs' tails."""
    started = time.perf_counter()
    load_before = os.getloadavg()
    db_url = f"sqlite:///{root / f'{row.key}.db'}"
    options = LocalRunOptions(db_url=db_url, engine="deployment", superlink_port=free_port(), runs_root=root / row.key)
    base = {"key": row.key, "stages": row.stages, "link": row.link, "bandwidth_mbps": row.bandwidth_mbps,
            "rtt_ms": row.rtt_ms, "schedule": row.schedule, "codec": row.codec, "microbatches": MICROBATCHES,
            "load_before": load_before}
    try:
        result = LocalRun(parse_config(config_doc(row, size)), options).execute()
    except Exception as err:  # noqa: BLE001 (a failed row is reported, the others go on)
        logs = {}
        for log in sorted((root / row.key).glob("*/logs/*.log")):
            logs[str(log.relative_to(root))] = log.read_text(errors="replace")[-3000:]
        return {**base, "ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0],
                "traceback": traceback.format_exc()[-3000:], "log_tails": logs,
                "wall_s": time.perf_counter() - started, "load_after": os.getloadavg()}
    return {**base, "ok": True, "run_id": result.run_id, **read_back(db_url, result.run_id, row.stages),
            "summary_val_loss": result.summary.get("val_loss"), "wall_s": time.perf_counter() - started,
            "load_after": os.getloadavg()}


def measure_again(done: dict[str, dict[str, Any]], runs: Path) -> None:
    """Replace every measured row's figures with what the kept databases under `runs` say now (`--runs`)."""
    for key, row in done.items():
        db = runs / f"{key}.db"
        if not row["ok"]:
            continue
        if not db.exists():
            raise SystemExit(f"{db} is missing: --runs must be the folder of the run that measured {key}")
        row.update(read_back(f"sqlite:///{db}", row["run_id"], row["stages"]))


def plan_for(row: dict[str, Any], compute: dict[str, Any], optimizer_s: float,
             transport: str = DEFAULT_TRANSPORT) -> PipelinePlan:
    """The planner's inputs for `row`'s links and bytes, with the stage compute of `compute` (a measured row)."""
    stages = row["stages"]
    per_step = compute["stage_compute_per_step_s"]
    wire = row["activation_bytes_per_microbatch"] + row["gradient_bytes_per_microbatch"]
    link = LinkSpec(row["link"], row["bandwidth_mbps"], row["rtt_ms"])
    return PipelinePlan(stage_params=[1.0] * stages, activation_bytes=statistics.fmean(wire),
                        microbatches=row["microbatches"], step_time_s=sum(per_step), stage_compute_s=per_step,
                        backward_ratio=compute["backward_ratio"], links=[link] * (stages - 1),
                        schedule=row["schedule"], optimizer_s=max(0.0, optimizer_s), transport=transport)


#: what `predict` writes (and first removes, with the keys of earlier versions of this script)
PREDICTION_KEYS = (
    "calibration_row", "overhead_per_step_s", "predicted_step_s", "predicted_error", "predicted_exposed_comm_s",
    "predicted_bubble_fraction", "predicted_same_run_step_s", "predicted_same_run_error", "streaming_step_s",
    "streaming_error", "streaming_overhead_per_step_s", "torch_step_s", "torch_error", "torch_overhead_per_step_s",
    "theoretical_bubble_fraction", "scored", "prediction_note",
    "runtime_model_step_s", "runtime_model_error", "runtime_model_overhead_per_step_s",
)
#: the planner's other transports, shown beside the runtime's ("gloo"): torch's own schedules, the ideal engine
OTHER_TRANSPORTS = ("torch", "streaming")


def predict(done: dict[str, dict[str, Any]]) -> None:
    """Add the planner's predictions to every measured row (see the module docstring)."""
    for row in done.values():
        for key in PREDICTION_KEYS:
            row.pop(key, None)
        if not row["ok"]:
            continue
        calib = done.get(f"free-{row['stages']}-{row['schedule']}")
        if calib is None or not calib["ok"]:
            row["prediction_note"] = "no free-link row of these stages and schedule to calibrate on"
            continue
        # the calibration: what the free row measured beyond the simulated schedule, per transport
        overhead = {transport: calib["step_s"] - pipeline_step(plan_for(calib, calib, 0.0, transport)).makespan_s
                    for transport in ("gloo", *OTHER_TRANSPORTS)}
        calibrated = pipeline_step(plan_for(row, calib, overhead["gloo"]))
        same_run = pipeline_step(plan_for(row, row, overhead["gloo"]))
        for transport in OTHER_TRANSPORTS:
            other = pipeline_step(plan_for(row, calib, overhead[transport], transport))
            row.update({f"{transport}_step_s": other.step_s, f"{transport}_error": row["step_s"] / other.step_s - 1.0,
                        f"{transport}_overhead_per_step_s": overhead[transport]})
        row.update(
            calibration_row=calib["key"], overhead_per_step_s=overhead["gloo"],
            predicted_step_s=calibrated.step_s, predicted_error=row["step_s"] / calibrated.step_s - 1.0,
            predicted_exposed_comm_s=calibrated.exposed_comm_s, predicted_bubble_fraction=calibrated.bubble_fraction,
            predicted_same_run_step_s=same_run.step_s,
            predicted_same_run_error=row["step_s"] / same_run.step_s - 1.0,
            theoretical_bubble_fraction=bubble_fraction(row["stages"], row["microbatches"]),
            scored=not row["key"].startswith("free-"))


def goals(done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {k: r for k, r in done.items() if r["ok"]}
    scored = {k: r for k, r in ok.items() if r.get("scored") and "predicted_error" in r}
    step = {k: r["predicted_error"] for k, r in scored.items()}
    bubble = {k: r["bubble_fraction"] / r["theoretical_bubble_fraction"] - 1.0 for k, r in ok.items()
              if r["key"].startswith("free-") and r["codec"] == "none" and "theoretical_bubble_fraction" in r}
    window = {k: r["bubble_fraction_in_schedule_window"] / r["theoretical_bubble_fraction"] - 1.0
              for k, r in ok.items() if k in bubble}
    # per link profile (the row's key without its schedule): met when both schedules' rows are within 20 %
    profiles: dict[str, dict[str, Any]] = defaultdict(dict)
    for k, r in scored.items():
        profiles[k.rsplit("-", 1)[0]][r["schedule"]] = r
    per_profile = {profile: all(abs(r["predicted_error"]) <= 0.20 for r in rs.values())
                   for profile, rs in profiles.items()}
    # which schedule is faster, measured and as each model predicts it (profiles with both schedules measured)
    ranking: dict[str, dict[str, Any]] = {}
    for profile, rs in profiles.items():
        if set(rs) == {"gpipe", "1f1b"}:
            ranking[profile] = {name: min(sorted(rs), key=lambda schedule: float(rs[schedule][field]))
                                for name, field in (("measured", "step_s"), ("planner", "predicted_step_s"),
                                                    *((t, f"{t}_step_s") for t in OTHER_TRANSPORTS))}
            steps = sorted(float(r["step_s"]) for r in rs.values())
            ranking[profile]["measured_margin"] = steps[1] / steps[0] - 1.0
    met: dict[str, Any] = {
        "step_vs_prediction": step, "step_met": bool(step) and all(abs(v) <= 0.20 for v in step.values()),
        "step_rows_within_20_percent": sorted(k for k, v in step.items() if abs(v) <= 0.20),
        "step_rows_outside_20_percent": sorted(k for k, v in step.items() if abs(v) > 0.20),
        "step_profiles_met": per_profile,
        "step_vs_same_run_prediction": {k: r["predicted_same_run_error"] for k, r in scored.items()},
        **{f"step_vs_{t}": {k: r[f"{t}_error"] for k, r in scored.items()} for t in OTHER_TRANSPORTS},
        "faster_schedule": ranking,
        "bubble_vs_theory": bubble, "bubble_met": bool(bubble) and all(abs(v) <= 0.10 for v in bubble.values()),
        "bubble_in_window_vs_theory": window,
        "bubble_planner_over_the_free_link": {k: ok[k]["predicted_bubble_fraction"] for k in bubble},
        "failed_rows": sorted(k for k, r in done.items() if not r["ok"]),
    }
    none = ok.get("free-2-1f1b")
    for codec in ("int8", "subspace"):
        row = ok.get(f"free-2-1f1b-{codec}")
        if none is None or row is None or none["val_loss"] is None or row["val_loss"] is None:
            continue
        met[f"{codec}_loss_gap"] = row["val_loss"] / none["val_loss"] - 1.0
        met[f"{codec}_compression"] = (statistics.fmean(none["activation_bytes_per_microbatch"])
                                       / statistics.fmean(row["activation_bytes_per_microbatch"]))
    if "int8_loss_gap" in met:
        met["int8_met"] = abs(met["int8_loss_gap"]) <= 0.01
    return met


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f} %"


def _error(row: dict[str, Any], value: float) -> str:
    if row["key"] == row.get("calibration_row"):
        return "(calibration)"
    return _pct(value) + ("" if row.get("scored") else " (not scored)")


def markdown(done: dict[str, dict[str, Any]], met: dict[str, Any], meta: dict[str, Any]) -> str:
    loads = [r["load_before"][0] for r in done.values()] + [r["load_after"][0] for r in done.values()]
    lines = [f"Pipeline split, measured on {meta['machine']} ({meta['note']}; 1-minute load average "
             f"{min(loads):.1f}–{max(loads):.1f} around the rows); {meta['workload']}.", "",
             "| row | S | link | schedule | codec | measured step | planner (free-link cal.) | error | "
             "planner (same-run compute) | error | torch's schedules | error | streaming (one-way) | error | "
             "bubble measured | in window | (S−1)/(M+S−1) | crossing | act. bytes/µb | val loss |",
             "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: | ---: | ---: |"]
    for key, r in done.items():
        if not r["ok"]:
            lines.append(f"| {key} | {r['stages']} | {r['link']} | {r['schedule']} | {r['codec']} | failed: "
                         f"{r['error'][:120]} |" + " |" * 15)
            continue
        predicted = r.get("predicted_step_s")
        same = r.get("predicted_same_run_step_s")
        lines.append(
            f"| {key} | {r['stages']} | {r['link']} | {r['schedule']} | {r['codec']} | {r['step_s']:.3f} s | "
            + (f"{predicted:.3f} s | {_error(r, r['predicted_error'])} | "
               if predicted is not None else "– | – | ")
            + (f"{same:.3f} s | {_error(r, r['predicted_same_run_error'])} | " if same is not None else "– | – | ")
            + "".join(f"{r[f'{t}_step_s']:.3f} s | {_error(r, r[f'{t}_error'])} | " if f"{t}_step_s" in r
                      else "– | – | " for t in OTHER_TRANSPORTS)
            + f"{r['bubble_fraction']:.3f} | {r['bubble_fraction_in_schedule_window']:.3f} | "
            + f"{bubble_fraction(r['stages'], r['microbatches']):.3f} | "
            + (f"{1e3 * r['crossing_s']:.1f} ms | " if "crossing_s" in r else "– | ")
            + f"{statistics.fmean(r['activation_bytes_per_microbatch']) / 1e3:.1f} kB | "
            + ("–" if r["val_loss"] is None else f"{r['val_loss']:.4f}") + " |")
    step = met["step_vs_prediction"]
    profiles = met["step_profiles_met"]
    ok_rows = {k: r for k, r in done.items() if r["ok"]}
    lines += ["", "(a) measured step vs the planner (free-link calibration), WAN rows: "
              + (", ".join(f"{k} {_pct(v)}" for k, v in step.items()) or "none measured")
              + f" — goal within 20 %: {'met' if met['step_met'] else 'missed'}"
              + (f" ({sum(profiles.values())} of {len(profiles)} profiles with both schedules within it: "
                 + ", ".join(f"{p} {'met' if within else 'missed'}" for p, within in profiles.items())
                 + "; rows outside: " + (", ".join(met["step_rows_outside_20_percent"]) or "none") + ")"
                 if profiles else ""),
              "    with the row's own compute: "
              + ", ".join(f"{k} {_pct(v)}" for k, v in met["step_vs_same_run_prediction"].items())
              + "; torch's own schedules (each receive posted just before its op: a round trip per crossing): "
              + ", ".join(f"{k} {_pct(v)}" for k, v in met["step_vs_torch"].items())
              + "; the streaming transport (an ideal engine: a send leaves when its op ends): "
              + ", ".join(f"{k} {_pct(v)}" for k, v in met["step_vs_streaming"].items()),
              "    the faster schedule per profile, measured (by how much) / planner / torch's / streaming: "
              + ", ".join(f"{p} {r['measured']} ({_pct(r['measured_margin'])}) / {r['planner']} / {r['torch']} / "
                          f"{r['streaming']}" for p, r in met["faster_schedule"].items()),
              "(b) measured bubble (pipeline_stages.bubble_fraction) vs (S−1)/(M+S−1), free rows: "
              + (", ".join(f"{k} {_pct(v)}" for k, v in met["bubble_vs_theory"].items()) or "none measured")
              + f" — goal within 10 %: {'met' if met['bubble_met'] else 'missed'}; inside the schedule's window: "
              + ", ".join(f"{k} {_pct(v)}" for k, v in met["bubble_in_window_vs_theory"].items()),
              "    the planner's bubble over the free rows' 10 Gbps / 1 ms link (its handshakes included), against "
              "(S−1)/(M+S−1): " + ", ".join(f"{k} {v:.3f} ({_pct(v / ok_rows[k]['theoretical_bubble_fraction'] - 1)})"
                                            for k, v in met["bubble_planner_over_the_free_link"].items())]
    if "int8_loss_gap" in met:
        lines.append(f"(c) int8 activations: val loss {_pct(met['int8_loss_gap'])} vs none at equal steps, "
                     f"{met['int8_compression']:.2f}× fewer bytes — goal within 1 %: "
                     f"{'met' if met['int8_met'] else 'missed'}")
    if "subspace_loss_gap" in met:
        lines.append(f"    subspace: {met['subspace_compression']:.2f}× fewer bytes on the wire, val loss "
                     f"{_pct(met['subspace_loss_gap'])} vs none")
    if met["failed_rows"]:
        lines.append("failed rows: " + ", ".join(met["failed_rows"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, 3 rows, 2 rounds (a smoke test)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and databases")
    parser.add_argument("--reanalyse", action="store_true", help="run nothing: recompute the predictions, goals and "
                        "table from the measured rows already in --out")
    parser.add_argument("--runs", type=Path, default=None, help="with --reanalyse: measure the rows again from the "
                        "databases of a kept run (the folder --keep printed) before predicting")
    parser.add_argument("--out", default=None, help="the JSON file (default: benchmarks/results/pipeline.json, "
                        "pipeline_quick.json with --quick); the markdown table goes beside it (.md)")
    args = parser.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / f"pipeline{'_quick' if args.quick else ''}.json")
    size = SIZES["quick" if args.quick else "full"]
    done: dict[str, dict[str, Any]]
    if args.reanalyse:
        previous = json.loads(Path(args.out).read_text())
        done = previous["rows"]
        if args.runs is not None:
            measure_again(done, args.runs)
        predict(done)
        met = goals(done)
        meta = {k: previous[k] for k in ("machine", "note", "workload")}
        table = markdown(done, met, meta)
        reanalysed = {"date": time.strftime("%Y-%m-%d"), "measured_again_from_databases": args.runs is not None}
        write_results(args.out, {**previous, "rows": done, "goals": met, "table_markdown": table,
                                 "reanalysed": reanalysed}, table)
        Path(args.out).with_suffix(".md").write_text(table + "\n")
        return
    started = time.perf_counter()
    done = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    print(f"runs under {root}", flush=True)
    for row in rows_for(args.quick):
        done[row.key] = result = run_row(row, size, root)
        said = (f"step {result['step_s']:.3f}s bubble {result['bubble_fraction']:.3f} val {result['val_loss']}"
                if result["ok"] else f"FAILED: {result['error']}")
        print(f"  {row.key:<22} {said}  ({result['wall_s']:.0f}s, load {result['load_before'][0]:.1f})", flush=True)
        Path(args.out).with_suffix(".partial.json").write_text(json.dumps(done, indent=1))
    predict(done)
    met = goals(done)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "note": "S stages share the machine's cores; what else ran shows in the load average",
            "workload": (f"shakespeare char-transformer {size.model_args}, batch {size.batch_size}, "
                         f"{MICROBATCHES} micro-batches, τ = {size.tau} steps a round, {size.rounds} rounds, "
                         "rounds after the first measured")}
    table = markdown(done, met, meta)
    write_results(args.out, {"engine": ENGINE, **meta, "quick": args.quick, "date": time.strftime("%Y-%m-%d"),
                             "rows": done, "goals": met, "wall_s": time.perf_counter() - started,
                             "table_markdown": table}, table)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    failed = any(not r["ok"] for r in done.values())
    if args.keep or failed:
        print(f"runs kept under {root}" + (" (a row failed: see its logs there)" if failed else ""))
    else:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
