"""The WAN benchmark's tuning: each row family's key hyper-parameter swept on the benchmark's own budget, with the
same effort for every family (three settings each), and the chosen settings written for the benchmark to read.

Setting and budget: the WAN benchmark's (benchmarks/wan_benchmark.py, the size given with --size), every run
in-process with one torch thread, one seed (0). Every row, baselines included, trains with the same inner recipe
(:func:`wan_benchmark.inner_recipe`: gradient clipping at 1.0, a warm-up over 5 % of the steps, then a cosine decay
to a tenth of the learning rate), so that only the swept parameter differs between a family's settings.

Families and what each gets swept (chosen: the lowest final validation loss):
- all-workers (one datacenter, batch 128): the learning rate, around the batch-32 one scaled up (batch 4×);
- sequential (one worker, batch 32, 4× the steps): the learning rate;
- FedAvg (crossdc's, τ warm-up): the inner learning rate (Flower's FedAvg row, DGC and FedBuff take the chosen one);
- DiLoCo: the outer (learning rate, momentum) at the inner learning rate 3e-3, each with the benchmark's outer
  momentum warm-up over the first half of the rounds (Streaming DiLoCo and gossip, which apply the same outer
  Nesterov step, take the chosen pair and the warm-up);
- SparseLoCo: chunk density (chunked top-k k of 4096) and outer learning rate.
Tuning on the validation set the benchmark then reports is optimistic for every row alike; the benchmark's other
seeds (1, 2) are not used here.

Usage: python benchmarks/wan_tuning.py [--size full|medium|tiny] [--jobs 2] [--only FAMILY ...]
Writes benchmarks/results/wan_tuning[-size].json (rows not rerun with --only are kept).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
from results_file import merge_rows, write_results
from wan_benchmark import (
    ADAMW_LR,
    SIZES,
    RowFailed,
    budget_experiment,
    drive_crossdc,
    inner_recipe,
    method_catalogue,
    run_single_datacenter,
    tuning_path,
)

#: family → the settings swept (each a dict: "lr" for the inner learning rate, otherwise strategy params or codecs)
GRID: dict[str, list[dict[str, Any]]] = {
    "all-workers": [{"lr": 3e-3}, {"lr": 6e-3}, {"lr": 1.2e-2}],
    "sequential": [{"lr": 1.5e-3}, {"lr": 3e-3}, {"lr": 6e-3}],
    "fedavg": [{"lr": 1.5e-3}, {"lr": 3e-3}, {"lr": 6e-3}],
    "diloco": [{"outer_lr": 0.7, "outer_momentum": 0.9}, {"outer_lr": 0.7, "outer_momentum": 0.5},
               {"outer_lr": 1.0, "outer_momentum": 0.5}],
    "sparseloco": [{"chunk_k": 64, "outer_lr": 1.0}, {"chunk_k": 128, "outer_lr": 1.0}, {"chunk_k": 64, "outer_lr": 1.5}],
}
#: the benchmark row each family is tuned on
FAMILY_ROW = {"fedavg": "fedavg-warmup", "diloco": "diloco", "sparseloco": "sparseloco"}


def setting_key(family: str, setting: dict[str, Any]) -> str:
    return family + ":" + ",".join(f"{k}={v:g}" for k, v in sorted(setting.items()))


def run_setting(family: str, setting: dict[str, Any], size_name: str, root: str) -> dict[str, Any]:
    """One setting's run to the end of the budget: its final validation loss (None and the reason if it broke down)."""
    torch.set_num_threads(1)
    size = SIZES[size_name]
    started = time.perf_counter()
    failed, loss = None, None
    where = Path(root) / setting_key(family, setting)
    where.mkdir(parents=True)
    if family in ("all-workers", "sequential"):
        lr = float(setting.get("lr", ADAMW_LR))
        history = run_single_datacenter(size, family, where, inner_recipe(lr, size))["history"]
        loss = next(h["val_loss"] for h in reversed(history) if h.get("val_loss") is not None)
    else:
        method = method_catalogue(size, tuned={family: dict(setting)})[FAMILY_ROW[family]]
        doc = budget_experiment(method, size)
        try:
            rounds = drive_crossdc(doc, where, size.eval_every_steps)
            loss = rounds[-1]["val_loss"]
        except RowFailed as err:
            failed = str(err)
    row = {"key": setting_key(family, setting), "family": family, "setting": setting, "val_loss": loss, "failed": failed,
           "run_s": time.perf_counter() - started}
    print(f"  {row['key']:<48} {'FAILED: ' + failed if failed else f'val loss {loss:.4f}'}  ({row['run_s']:.0f}s)",
          flush=True)
    return row


def chosen(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per family, the setting with the lowest final validation loss among the runs that completed."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["val_loss"] is None:
            continue
        if row["family"] not in best or row["val_loss"] < best[row["family"]]["val_loss"]:
            best[row["family"]] = row
    return {family: dict(row["setting"]) for family, row in best.items()}


def markdown(rows: list[dict[str, Any]], choice: dict[str, dict[str, Any]], size_name: str) -> str:
    lines = [f"WAN benchmark tuning ({size_name} size: {SIZES[size_name].steps} inner steps per datacenter), "
             "three settings per family, final validation loss", "",
             "| family | setting | val loss | chosen |", "| --- | --- | ---: | :---: |"]
    for row in sorted(rows, key=lambda r: (list(GRID).index(r["family"]), r["key"])):
        loss = "failed" if row["val_loss"] is None else f"{row['val_loss']:.4f}"
        mark = "✓" if choice.get(row["family"]) == row["setting"] else ""
        setting = ", ".join(f"{k} {v:g}" for k, v in row["setting"].items())
        lines.append(f"| {row['family']} | {setting} | {loss} | {mark} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=sorted(GRID), help="families to (re)run; the others are kept")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: the benchmark's tuning file)")
    args = parser.parse_args()
    out = args.out or tuning_path(args.size)
    started = time.perf_counter()
    work = [(family, setting) for family, settings in GRID.items() if not args.only or family in args.only
            for setting in settings]
    # the longest runs first (sequential trains 4× the steps), so the pool ends together
    work.sort(key=lambda item: item[0] != "sequential")
    fresh: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, \
            ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_setting, family, setting, args.size, tmp) for family, setting in work]
        for future in as_completed(futures):  # written as each run ends: a later failure loses none of them
            fresh.append(future.result())
            write(out, args.size, merge_rows(out, fresh, key=lambda r: r["key"]), time.perf_counter() - started)


def write(out: Path, size_name: str, rows: list[dict[str, Any]], wall_s: float) -> None:
    choice = chosen(rows)
    table = markdown(rows, choice, size_name)
    write_results(out, {"size": size_name, "steps": SIZES[size_name].steps, "grid": GRID, "family_row": FAMILY_ROW,
                        "inner_recipe": inner_recipe(ADAMW_LR, SIZES[size_name]), "rows": rows, "chosen": choice,
                        "date": time.strftime("%Y-%m-%d"),
                        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                        "wall_s": wall_s, "table_markdown": table}, table)


if __name__ == "__main__":
    main()
