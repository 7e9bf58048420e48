"""The inner optimizer's options (clipping, schedule, β2) and SparseLoCo, on the WAN benchmark's setting and budget.

Setting and budget: the WAN benchmark's (benchmarks/wan_benchmark.py): Shakespeare char-transformer (2 layers,
d_model 64, 4 heads, 117k parameters), 4 datacenters on the natural partition, batch 32, inner AdamW lr 3e-3, 800
inner steps per datacenter (16 rounds at τ = 50). Each row is one seed (0), in-process
(crossdc.testing.InProcessFederation: the deployed trainers, codecs, update gate and strategies, Flower's transport
left out); the all-workers baseline is crossdc's (one datacenter with the 4 datacenters' workers, batch 128, 800
steps).

Inner settings, one at a time and together (the field's):
- ``defaults``: AdamW betas (0.9, 0.999), weight decay 0.01, no clipping, constant lr;
- ``clip``: gradient clipping at global norm 1.0;
- ``cosine``: 80 warm-up steps (10 %), then a cosine decay to 3e-4 (lr / 10) at the end of the run;
- ``beta2``: betas (0.9, 0.95);
- ``field``: all three.
Rows: all-workers, FedAvg τ = 50, DiLoCo at the paper's outer (0.7, 0.9) τ = 50, under each setting; DiLoCo (0.7,
0.9) with the field's settings and a 3-round outer warm-up; SparseLoCo (chunk-topk 64 of 4096, decay 0.95, int2;
outer lr 1) under the defaults, clipping and the field's settings; with clipping (the best single option for the
federated rows): DiLoCo (0.7, 0.9) with an outer warm-up of 4 rounds then a cosine to 0.07, DiLoCo (0.7, 0.5), and
FedAvg at τ = 10 (80 rounds), SparseLoCo at outer lr 2 and at 128 of every 4096 (3.1 %). Uplink bytes are the
serialised replies, summed over datacenters and rounds.

Usage: python benchmarks/inner_options.py [--jobs 2] [--only KEY ...] [--out benchmarks/results/inner_options.json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from results_file import merge_rows, write_results
from wan_benchmark import SIZES, Method, RowFailed, drive_crossdc, experiment, rounds_for_budget, run_single_datacenter

SIZE = SIZES["medium"]
PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9}
SPARSELOCO_CODECS = ("chunk-topk:64:decay=0.95", "int2")
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "clip": {"grad_clip": 1.0},
    "cosine": {"schedule": {"kind": "cosine", "warmup_steps": 80, "min_lr": 3e-4}},
    "beta2": {"betas": [0.9, 0.95]},
    "field": {"grad_clip": 1.0, "betas": [0.9, 0.95], "schedule": {"kind": "cosine", "warmup_steps": 80, "min_lr": 3e-4}},
}
METHODS = {
    "fedavg": Method("fedavg", "FedAvg τ = 50", "crossdc"),
    "diloco": Method("diloco", "DiLoCo (0.7, 0.9) τ = 50", "crossdc", "diloco", PAPER),
    "diloco-outer-warmup": Method("diloco-outer-warmup", "DiLoCo (0.7, 0.9) τ = 50, outer warm-up 3 rounds", "crossdc",
                                  "diloco", {**PAPER, "outer_warmup_rounds": 3}),
    "diloco-outer-schedule": Method("diloco-outer-schedule", "DiLoCo (0.7, 0.9) τ = 50, outer warm-up 4 rounds then "
                                    "cosine to 0.07", "crossdc", "diloco",
                                    {**PAPER, "outer_warmup_rounds": 4, "outer_schedule": "cosine", "outer_min_lr": 0.07}),
    "diloco-m05": Method("diloco-m05", "DiLoCo (0.7, 0.5) τ = 50", "crossdc", "diloco",
                         {"outer_lr": 0.7, "outer_momentum": 0.5}),
    "fedavg-tau10": Method("fedavg-tau10", "FedAvg τ = 10", "crossdc"),
    "sparseloco": Method("sparseloco", "SparseLoCo (chunk-topk 64/4096, β 0.95, int2; outer lr 1) τ = 50", "crossdc",
                         "sparseloco", {"outer_lr": 1.0}, codecs=SPARSELOCO_CODECS),
    "sparseloco-lr2": Method("sparseloco-lr2", "SparseLoCo as above, outer lr 2", "crossdc", "sparseloco",
                             {"outer_lr": 2.0}, codecs=SPARSELOCO_CODECS),
    "sparseloco-k128": Method("sparseloco-k128", "SparseLoCo, chunk-topk 128/4096 (3.1 %), outer lr 1", "crossdc",
                              "sparseloco", {"outer_lr": 1.0}, codecs=("chunk-topk:128:decay=0.95", "int2:block=128")),
}
#: (method or "all-workers", setting) of every row
ROWS: list[tuple[str, str]] = [
    *((method, setting) for method in ("all-workers", "fedavg", "diloco") for setting in SETTINGS),
    ("diloco-outer-warmup", "field"), ("sparseloco", "defaults"), ("sparseloco", "field"),
    ("diloco-outer-schedule", "clip"), ("diloco-m05", "clip"), ("fedavg-tau10", "clip"), ("sparseloco", "clip"),
    ("sparseloco-lr2", "clip"), ("sparseloco-k128", "clip"),
]
#: rows at another τ than the WAN benchmark's 50 (the same 800 inner steps per datacenter in more rounds)
TAU = {"fedavg-tau10": 10}


def row_key(method: str, setting: str) -> str:
    return f"{method}/{setting}"


def run_row(row: tuple[str, str], root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    method_key, setting = row
    inner = SETTINGS[setting]
    started = time.perf_counter()
    failed = None
    if method_key == "all-workers":
        history = run_single_datacenter(SIZE, "all-workers", Path(root), inner)["history"]
        curve = [{"steps": h["round"] * SIZE.eval_every_steps, "val_loss": h["val_loss"]} for h in history
                 if h.get("val_loss") is not None]
        label, bytes_up = "all-workers (one datacenter, batch 128)", 0
    else:
        method = METHODS[method_key]
        label = method.label
        size = replace(SIZE, tau=TAU.get(method_key, SIZE.tau))
        doc = experiment(method, size, rounds_for_budget(size.tau, size.steps), inner)
        try:
            per_round = drive_crossdc(doc, Path(root) / row_key(method_key, setting).replace("/", "-"),
                                      SIZE.eval_every_steps)
        except RowFailed as err:
            per_round, failed = err.rounds, str(err)
        steps, curve = 0, []
        for r in per_round:
            steps += r["tau"]
            if "val_loss" in r:
                curve.append({"steps": steps, "val_loss": r["val_loss"]})
        bytes_up = sum(sum(r["bytes_up"]) for r in per_round)
    result = {"key": row_key(method_key, setting), "method": method_key, "label": label, "setting": setting,
              "inner": inner, "curve": curve, "val_loss": curve[-1]["val_loss"] if curve and not failed else None,
              "bytes_up": bytes_up, "failed": failed, "wall_s": time.perf_counter() - started}
    print(f"  {result['key']:<30} val loss {result['val_loss']}  bytes up {bytes_up:,}  "
          f"({result['wall_s']:.0f}s)", flush=True)
    return result


def markdown(rows: list[dict[str, Any]]) -> str:
    by = {r["key"]: r for r in rows}

    def loss(method: str, setting: str) -> str:
        r = by.get(row_key(method, setting))
        return "—" if r is None else ("failed" if r["val_loss"] is None else f"{r['val_loss']:.3f}")

    lines = ["Validation loss after 800 inner steps per datacenter (WAN benchmark setting: Shakespeare char-transformer "
             "117k parameters, 4 datacenters natural partition, batch 32, AdamW lr 3e-3, τ = 50; one seed)", "",
             "| inner setting | all-workers (batch 128) | FedAvg τ = 50 | DiLoCo (0.7, 0.9) τ = 50 |",
             "| --- | ---: | ---: | ---: |"]
    for setting in SETTINGS:
        lines.append(f"| {setting} | {loss('all-workers', setting)} | {loss('fedavg', setting)} | "
                     f"{loss('diloco', setting)} |")
    lines += ["", "| row | inner setting | val loss | uplink bytes | fewer uplink bytes than DiLoCo fp32 (same setting) |",
              "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        if r["method"] != "all-workers":
            reference = by.get(row_key("diloco", r["setting"]))
            ratio = (f"{reference['bytes_up'] / r['bytes_up']:.3g}×" if reference and r["bytes_up"] else "—")
            lines.append(f"| {r['label']} | {r['setting']} | {loss(r['method'], r['setting'])} | {r['bytes_up']:,} | "
                         f"{ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("CROSSDC_BENCH_JOBS", "2")))
    parser.add_argument("--only", nargs="+", help="row keys (method/setting) to run; the others are kept from --out")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "inner_options.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    work = [row for row in ROWS if not args.only or row_key(*row) in args.only]
    with tempfile.TemporaryDirectory() as tmp, \
            ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        fresh = list(pool.map(run_row, work, [tmp] * len(work)))
    order = [row_key(*row) for row in ROWS]
    rows = sorted(merge_rows(args.out, fresh, lambda r: r["key"]),
                  key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))
    table = markdown(rows)
    write_results(args.out, {"machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                             "engine": "crossdc.testing.InProcessFederation; baselines: crossdc.orchestration.baselines",
                             "settings": SETTINGS, "rows": rows, "wall_s": time.perf_counter() - started,
                             "table_markdown": table}, table)


if __name__ == "__main__":
    main()
