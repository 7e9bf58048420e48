"""Why crossdc's DiLoCo trailed FedAvg on one user's char-transformer setting: the partition, the inner settings and
the outer momentum tried one at a time.

The setting a user tried (and reported): Shakespeare, the char-transformer with 3 layers, d_model 128, 4 heads,
seq_len 64 (about 624k parameters), 4 datacenters, batch 32, inner AdamW lr 1e-3 (crossdc's defaults: betas
(0.9, 0.999), weight decay 0.01, no clipping), 400 inner steps per datacenter; FedAvg and DiLoCo (outer lr 0.7,
Nesterov momentum 0.9) at τ = 50 and τ = 10. Row sets (``--rows``):
- ``partition``: those rows on the ``natural`` partition (whole plays per datacenter) and on ``iid``;
- ``settings``: the field's inner settings (β2 0.95, clipping at 1.0, warm-up then cosine decay) together and in
  parts, and FedAvg at τ = 10;
- ``outer step``: DiLoCo τ = 10 with momentum 0.5, and with momentum 0.9 over an inner lr divided by the 7× the
  momentum's outer step settles at.
- ``momentum warm-up``: DiLoCo (0.7, 0.9) at τ = 50 and 10 with its outer momentum warmed up over the first half of
  the rounds.
crossdc's FedAvg and DiLoCo give a plain torch loop's weights round by round (tests/test_reference_loops.py), so these
runs use crossdc's in-process driver (crossdc.testing.InProcessFederation, the deployed code paths minus the
transport). One seed (0).

Reported per row: the validation loss after 50, 150 and 400 inner steps per datacenter, the spread of the
datacenters' updates (the mean cosine between one datacenter's update and the average of the others' in the first
round) and each datacenter's own model's validation loss after round 1, before the average.

Usage: python benchmarks/diloco_symptom.py [--rows partition settings "outer step" "momentum warm-up"] [--jobs 2]
       [--out benchmarks/results/diloco_symptom.json]   (rows not run are kept from --out)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from results_file import merge_rows, write_results

from crossdc.experiment.config import parse_config
from crossdc.strategies.aggregation import cosine
from crossdc.testing.inprocess import InProcessFederation

INNER_STEPS = 400
CHECKPOINTS = (50, 150, 400)
PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9}
#: inner settings: crossdc's defaults, and the field's (β2 0.95, clipping at 1.0, warm-up then cosine decay)
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "field": {"betas": [0.9, 0.95], "grad_clip": 1.0,
              "schedule": {"kind": "cosine", "warmup_steps": 40, "min_lr": 1e-4}},
    "cosine only": {"schedule": {"kind": "cosine", "warmup_steps": 40, "min_lr": 1e-4}},
    "beta2 0.95 + clip only": {"betas": [0.9, 0.95], "grad_clip": 1.0},
    # DiLoCo's outer Nesterov step settles at outer_lr / (1 − μ) = 7 times the mean update: the same lr divided by 7
    "inner lr / 7": {"lr": 1e-3 / 7},
}
#: (partition, strategy, τ, strategy params, inner settings) of each row, by the question it answers
ROW_SETS: dict[str, list[tuple[str, str, int, dict[str, Any], str]]] = {
    # does the partition explain the order? (it does not: the iid rows keep it)
    "partition": [(partition, strategy, tau, params, "defaults") for partition in ("natural", "iid")
                  for strategy, tau, params in (("fedavg", 50, {}), ("diloco", 50, PAPER), ("diloco", 10, PAPER))],
    # do the inner settings the field trains with explain it?
    "settings": [("natural", "fedavg", 50, {}, "field"), ("natural", "diloco", 50, PAPER, "field"),
                 ("natural", "diloco", 10, PAPER, "field"), ("natural", "diloco", 10, PAPER, "cosine only"),
                 ("natural", "diloco", 10, PAPER, "beta2 0.95 + clip only"),
                 ("natural", "fedavg", 10, {}, "defaults")],
    # is it the outer step's size? a smaller momentum, or the inner lr scaled down by what the momentum multiplies
    "outer step": [("natural", "diloco", 10, {"outer_lr": 0.7, "outer_momentum": 0.5}, "defaults"),
                   ("natural", "diloco", 10, PAPER, "inner lr / 7")],
    # the paper's pair with its momentum warmed up over the first half of the rounds (the WAN benchmark's recipe)
    "momentum warm-up": [("natural", "diloco", tau, {**PAPER, "outer_momentum_warmup_rounds": INNER_STEPS // tau // 2},
                          "defaults") for tau in (50, 10)],
}


def config(strategy: str, tau: int, params: dict[str, Any], partition: str, settings: str) -> dict[str, Any]:
    return {
        "run": {"name": f"symptom-{strategy}-{tau}-{partition}", "rounds": INNER_STEPS // tau, "seed": 0},
        "workload": {"dataset": "shakespeare", "model": "char-transformer",
                     "model_args": {"layers": 3, "d_model": 128, "heads": 4, "seq_len": 64},
                     "partition": {"kind": partition}, "batch_size": 32, "optimizer": "adamw", "lr": 1e-3,
                     **SETTINGS[settings]},
        "strategy": {"name": strategy, "tau": tau, "params": params},
        "datacenters": [{"name": f"dc-{i}"} for i in range(1, 5)],
    }


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["partition"], row["strategy"], row["tau"], json.dumps(row["params"], sort_keys=True),
            row.get("settings", "defaults"))


def run_row(row: tuple[str, str, int, dict[str, Any], str]) -> dict[str, Any]:
    import torch

    from crossdc.workloads import evaluate

    torch.set_num_threads(1)
    partition, strategy, tau, params, settings = row
    started = time.perf_counter()
    local_after_first: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        federation = InProcessFederation.from_config(parse_config(config(strategy, tau, params, partition, settings)),
                                                     tmp)
        curve: dict[int, float] = {}
        first_round_cosine = None
        for server_round in range(1, INNER_STEPS // tau + 1):
            result = federation.run_round()
            if server_round == 1:  # each datacenter's own model before the average, and how far apart they pull
                local_after_first = {dc: float(evaluate(federation.session.workload, trainer.model)[0])
                                     for dc, trainer in federation.trainers.items()}
                deltas = {u.datacenter: u.delta for u in result.updates}
                cosines = []
                for name, delta in deltas.items():
                    others = [d for n, d in deltas.items() if n != name]
                    mean_others = {k: np.mean([d[k] for d in others], axis=0) for k in delta}
                    cosines.append(cosine(delta, mean_others))
                first_round_cosine = float(np.mean(cosines))
            steps = server_round * tau
            if steps in CHECKPOINTS:
                curve[steps] = float(federation.evaluate()[0])
    return {"strategy": strategy, "tau": tau, "params": params, "partition": partition, "settings": settings,
            "inner": SETTINGS[settings], "val_loss": curve, "final_val_loss": curve[INNER_STEPS],
            "first_round_update_cosine": first_round_cosine, "local_val_loss_after_round_1": local_after_first,
            "wall_s": time.perf_counter() - started}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["Shakespeare char-transformer (3 layers, d_model 128, 4 heads, seq_len 64), 4 datacenters, batch 32, inner "
             f"AdamW lr 1e-3, {INNER_STEPS} inner steps per datacenter; validation loss after 50 / 150 / 400 steps",
             "", "| partition | inner settings | row | after 50 | after 150 | after 400 | update cosine, round 1 |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        outer = f"({r['params'].get('outer_lr', 0.7):g}, {r['params'].get('outer_momentum', 0.9):g})"
        warmup = r["params"].get("outer_momentum_warmup_rounds")
        name = (f"{'FedAvg' if r['strategy'] == 'fedavg' else f'DiLoCo {outer}'} τ = {r['tau']}"
                + (f", momentum warm-up {warmup} rounds" if warmup else ""))
        v = {int(k): loss for k, loss in r["val_loss"].items()}
        lines.append(f"| {r['partition']} | {r.get('settings', 'defaults')} | {name} | {v.get(50, float('nan')):.3f} | "
                     f"{v[150]:.3f} | {v[400]:.3f} | {r['first_round_update_cosine']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("CROSSDC_BENCH_JOBS", "2")))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "diloco_symptom.json"))
    parser.add_argument("--rows", choices=sorted(ROW_SETS), nargs="+", default=sorted(ROW_SETS),
                        help="which sets of rows to run (the others are kept from --out)")
    args = parser.parse_args()
    started = time.perf_counter()
    work = [row for name in args.rows for row in ROW_SETS[name]]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        fresh = list(pool.map(run_row, work))
    rows = merge_rows(args.out, fresh, row_key)
    table = markdown(rows)
    write_results(args.out, {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "engine": "crossdc.testing."
                             "InProcessFederation (the deployed code paths minus the transport)", "rows": rows,
                             "wall_s": time.perf_counter() - started, "table_markdown": table}, table)


if __name__ == "__main__":
    main()
