"""The WAN benchmark's rows at other τ: does more frequent synchronisation close the loss gap to one datacenter?

Setting and budget: the WAN benchmark's full size (benchmarks/wan_benchmark.py: 4 datacenters on the natural
partition, the 117k-parameter char-transformer, 2,000 inner steps of batch 32 per datacenter, the inner recipe of
every row) and its tuned settings (benchmarks/results/wan_tuning.json), with only τ changed: the rounds are those
that spend the same 2,000 steps. Every run is in-process with one torch thread and seed 0; what is read is the final
validation loss and the bytes each way (the serialised messages, as the benchmark counts them), not time.

Rows (key, τ, settings over the tuned ones):
- DiLoCo at τ = 10 and 25 with the outer (learning rate, momentum) tuned before the momentum warm-up, (1, 0.5);
- crossdc FedAvg at τ = 10 (its τ warm-up starts at 10, so τ is 10 throughout);
- SparseLoCo at the paper's density (chunked top-k 64 of 4,096, 2-bit values, outer lr 1) at τ = 10 and 25;
- DiLoCo at τ = 50 with the paper's outer (0.7, 0.9) and an outer learning-rate warm-up over its first 8 of 40
  rounds, constant after it or then a cosine to 0.07 (few outer steps from a random model are where momentum 0.9
  hurts: does a warm-up over a fifth of them rescue it?).
- the benchmark's DiLoCo recipe (the paper's pair, its momentum warmed up over half the rounds) at τ = 10 (two
  seeds, and with int8 both ways) and at τ = 25;
- SparseLoCo with that outer momentum on the mean of what the datacenters sent, at τ = 50 (the tuned density) and
  τ = 10 (the paper's); at τ = 10, SparseLoCo without the error feedback's decay, at the tuned density (with and
  without the decay), at the tuned density with a dense (fp32) downlink, at the tuned density with outer lr 2
  and 3, and at 96/4096 (100x fewer bytes up than DiLoCo fp32) with outer lr 2, and at 64/4096 with outer lr 2;
  at 96/4096 with an outer momentum (0.5 to 0.7, warmed up over half the rounds) and outer lr 1 to 2, the best of
  these on three seeds, the best without the error feedback's decay, and momentum 0.9 at the best's effective step;
- at τ = 5 (400 rounds): DiLoCo's recipe (its momentum warmed up over half the rounds) on three seeds, and SparseLoCo
  at 44 of 4,096 (about τ = 10's bytes at 96) with outer lr 1.5 and 2, with and without momentum 0.5, and at 64 of
  4,096 (139x fewer bytes up than DiLoCo at τ = 5) with lr 1.5 and momentum 0.5 on three seeds;
- DiLoCo's outer pair tuned at τ = 5 (four pairs and warm-ups); at τ = 10 over three times the budget (6,000 inner
  steps), DiLoCo's recipe and SparseLoCo's best τ = 10 setting; SparseLoCo at 96/4096 with a Nesterov momentum kept
  in each datacenter (chunk-topk's nesterov) instead of the server's; SparseLoCo's best τ = 10 setting at inner
  learning rates 4.5e-3 to 1.2e-2, and DiLoCo's recipe at 4.5e-3 and 6e-3;
- Streaming DiLoCo (fp32 and 4-bit) at H = 10, its momentum warmed up over half the rounds; with τ_o = 1, with
  τ_o = 1 and α = 0, with eager updates (outer momentum 0.9, 0.5 and 0), and with τ_o = 4 and α = 0.
The τ = 50 figures to compare with are the benchmark's and the tuning's own.

Usage: python benchmarks/wan_tau_probe.py [--only KEY@TAU ...] [--jobs 2]
Writes benchmarks/results/wan_tau_probe.json (rows not rerun with --only are kept) and prints the table; a row that
fails is reported and left out (its earlier result, if any, kept), the others are written, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from results_file import merge_rows, write_results
from wan_benchmark import RESULTS, SIZES, budget_experiment, drive_crossdc, method_catalogue, momentum_warmup_rounds, read_tuning

OUT = RESULTS / "wan_tau_probe.json"
#: SparseLoCo at the density its paper uses (1.6 %), over the tuned setting's 128
PAPER_SPARSELOCO = {"sparseloco": {"chunk_k": 64, "outer_lr": 1.0}}
PAPER_PAIR = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_momentum_warmup_rounds": 0}
PAPER_OUTER = {**PAPER_PAIR, "outer_warmup_rounds": 8}
#: DiLoCo's outer pair as tuned on 2026-12-05 before the momentum warm-up (the first τ = 10 and 25 rows ran with it)
EARLIER_PAIR = {"outer_lr": 1.0, "outer_momentum": 0.5, "outer_momentum_warmup_rounds": 0}
#: (row key, τ, settings replacing the tuned ones: family → setting, "method" → fields of the row's Method such
#: as its inner "lr", "seed" → the run's seed (0 otherwise), or "steps" → the inner steps per datacenter in place of
#: the full size's 2,000 (evaluated as often); label telling rows of one key and τ apart)
ROWS: list[tuple[str, int, dict[str, Any], str]] = [
    ("diloco", 10, {"diloco": EARLIER_PAIR}, ""),
    ("diloco", 25, {"diloco": EARLIER_PAIR}, ""),
    ("fedavg-warmup", 10, {}, ""),
    ("sparseloco", 10, PAPER_SPARSELOCO, ""),
    ("sparseloco", 25, PAPER_SPARSELOCO, ""),
    ("diloco", 50, {"diloco": PAPER_OUTER}, "paper-outer-warmup8"),
    ("diloco", 50, {"diloco": {**PAPER_OUTER, "outer_schedule": "cosine", "outer_min_lr": 0.07}},
     "paper-outer-warmup8-cosine"),
    ("diloco", 50, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 10}}, "paper-outer-momentum-warmup10"),
    ("diloco", 50, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 20}}, "paper-outer-momentum-warmup20"),
    *[("diloco", 50, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 20}, "seed": seed},
       f"paper-outer-momentum-warmup20-seed{seed}") for seed in (1, 2)],
    ("diloco", 50, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 30}}, "paper-outer-momentum-warmup30"),
    ("diloco", 50, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 40}}, "paper-outer-momentum-warmup40"),
    ("diloco", 50, {"diloco": PAPER_PAIR, "method": {"lr": 1.5e-3}}, "paper-outer-inner-lr1.5e-3"),
    # the benchmark's DiLoCo recipe (the paper's pair, momentum warmed up over half the rounds) at more frequent syncs
    *[("diloco", tau, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": warmup}},
       f"paper-outer-momentum-warmup{warmup}") for tau in (10, 25) for warmup in [momentum_warmup_rounds(SIZES["full"], tau)]],
    ("diloco", 10, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 100}, "seed": 1},
     "paper-outer-momentum-warmup100-seed1"),
    ("diloco-int8", 10, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 100}}, "paper-outer-momentum-warmup100"),
    # SparseLoCo with DiLoCo's outer momentum (warmed up over half the rounds) on the mean of the sent updates
    ("sparseloco", 50, {"sparseloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 20}}, "paper-outer-momentum-warmup20"),
    ("sparseloco", 10, {"sparseloco": {**PAPER_SPARSELOCO["sparseloco"], **PAPER_PAIR, "outer_momentum_warmup_rounds": 100}},
     "paper-outer-momentum-warmup100"),
    # SparseLoCo at τ = 10: plain error feedback (no decay) at the paper's density, and the tuned density (128/4096)
    ("sparseloco", 10, {"sparseloco": {**PAPER_SPARSELOCO["sparseloco"], "decay": 1.0}}, "no-decay"),
    ("sparseloco", 10, {}, "tuned-density"),
    ("sparseloco", 10, {"sparseloco": {"decay": 1.0}}, "tuned-density-no-decay"),
    # is it the uplink's selection or the downlink's compression? the same with the global model sent down in fp32
    ("sparseloco", 10, {"method": {"downlink_codecs": ()}}, "tuned-density-dense-downlink"),
    # a sparse update moves few weights a round: does a larger outer step make up for it? (tuning at τ = 50, density
    # 64/4096: outer lr 1.5 1.810 against 1.846 at 1)
    *[("sparseloco", 10, {"sparseloco": {"outer_lr": lr}}, f"tuned-density-outer-lr{lr:g}") for lr in (2.0, 3.0)],
    # the density that sends 100x fewer bytes up than DiLoCo fp32 (96/4096: 2.3 %), with the better outer lr
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 2.0}}, "density96-outer-lr2"),
    # lower still (64/4096: 139x fewer), and at 96/4096 a little outer momentum in place of the larger step
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 64, "outer_lr": 2.0}}, "density64-outer-lr2"),
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.0, "outer_momentum": 0.5,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-momentum0.5"),
    # momentum 0.5 helped (1.639 against lr 2's 1.657): more of it, or a larger step with it?
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.0, "outer_momentum": 0.7,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-momentum0.7"),
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.5, "outer_momentum": 0.5,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-outer-lr1.5-momentum0.5"),
    # lr 1.5 with momentum 0.5 was better still (1.618): further along both
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 2.0, "outer_momentum": 0.5,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-outer-lr2-momentum0.5"),
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.5, "outer_momentum": 0.6,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-outer-lr1.5-momentum0.6"),
    # the best of these (lr 1.5, momentum 0.5) on two more seeds: the differences above are of a seed's size
    *[("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.5, "outer_momentum": 0.5,
                                         "outer_momentum_warmup_rounds": 100}, "seed": seed},
       f"density96-outer-lr1.5-momentum0.5-seed{seed}") for seed in (1, 2)],
    # the best's effective step (lr / (1 - momentum) = 3) with the paper's momentum 0.9 (0.7 / 0.1 = 7 broke it), and
    # the best without the error feedback's decay (no decay was better at the paper's density: 1.728 against 1.745)
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 0.3, "outer_momentum": 0.9,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-outer-lr0.3-momentum0.9"),
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.5, "outer_momentum": 0.5, "decay": 1.0,
                                       "outer_momentum_warmup_rounds": 100}}, "density96-outer-lr1.5-momentum0.5-no-decay"),
    # SparseLoCo gained most from more outer steps (τ 50 → 25 → 10): at τ = 5, with about half the density (44 of
    # 4,096) to send about the same bytes up as 96/4096 at τ = 10; and DiLoCo fp32 at τ = 5 beside it
    ("sparseloco", 5, {"sparseloco": {"chunk_k": 44, "outer_lr": 1.5, "outer_momentum": 0.5,
                                      "outer_momentum_warmup_rounds": 200}}, "density44-outer-lr1.5-momentum0.5"),
    ("sparseloco", 5, {"sparseloco": {"chunk_k": 44, "outer_lr": 1.5}}, "density44-outer-lr1.5"),
    ("diloco", 5, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 200}}, "paper-outer-momentum-warmup200"),
    # at τ = 5 SparseLoCo (1.640) came within 0.7 % of DiLoCo (1.629, itself behind DiLoCo at τ = 10): a little more
    # density (64 of 4,096: still > 100x fewer bytes up than DiLoCo at τ = 5), a larger step, and DiLoCo on a second seed
    ("sparseloco", 5, {"sparseloco": {"chunk_k": 64, "outer_lr": 1.5, "outer_momentum": 0.5,
                                      "outer_momentum_warmup_rounds": 200}}, "density64-outer-lr1.5-momentum0.5"),
    ("sparseloco", 5, {"sparseloco": {"chunk_k": 44, "outer_lr": 2.0, "outer_momentum": 0.5,
                                      "outer_momentum_warmup_rounds": 200}}, "density44-outer-lr2-momentum0.5"),
    *[("diloco", 5, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 200}, "seed": seed},
       f"paper-outer-momentum-warmup200-seed{seed}") for seed in (1, 2)],
    # 64/4096 at τ = 5 ended below DiLoCo at τ = 5 (1.616 against 1.629): on two more seeds
    *[("sparseloco", 5, {"sparseloco": {"chunk_k": 64, "outer_lr": 1.5, "outer_momentum": 0.5,
                                        "outer_momentum_warmup_rounds": 200}, "seed": seed},
       f"density64-outer-lr1.5-momentum0.5-seed{seed}") for seed in (1, 2)],
    # DiLoCo's recipe at τ = 5 ended behind its τ = 10 (1.629 against 1.540), and SparseLoCo's τ = 5 settings were
    # tuned: DiLoCo's outer pair at τ = 5 tuned too, before reading SparseLoCo's win there
    ("diloco", 5, {"diloco": EARLIER_PAIR}, "outer-lr1-momentum0.5"),
    ("diloco", 5, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 100}}, "paper-outer-momentum-warmup100"),
    ("diloco", 5, {"diloco": {**PAPER_PAIR, "outer_lr": 0.5, "outer_momentum_warmup_rounds": 200}},
     "outer-lr0.5-momentum0.9-warmup200"),
    ("diloco", 5, {"diloco": {**PAPER_PAIR, "outer_momentum": 0.8, "outer_momentum_warmup_rounds": 200}},
     "outer-lr0.7-momentum0.8-warmup200"),
    # SparseLoCo cannot take DiLoCo's momentum 0.9 at the server (each coordinate arrives in bursts the momentum then
    # repeats): the momentum kept in each datacenter instead, before the selection (chunk-topk's nesterov), so that
    # what is sent carries it once; at 96 of 4,096 (100x fewer bytes up than DiLoCo fp32), no server momentum
    *[("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": lr, "nesterov": mu, "outer_momentum": 0.0}},
       f"density96-local-momentum{mu:g}-outer-lr{lr:g}") for mu, lr in ((0.9, 0.7), (0.9, 1.0), (0.8, 1.0))],
    ("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 0.7, "nesterov": 0.9, "outer_momentum": 0.0,
                                       "decay": 1.0}}, "density96-local-momentum0.9-outer-lr0.7-no-decay"),
    # the one setting SparseLoCo never had tuned for itself is the inner learning rate (3e-3, tuned on FedAvg): a sparse
    # update moving the model less a round, a larger inner step may make up for it
    *[("sparseloco", 10, {"sparseloco": {"chunk_k": 96, "outer_lr": 1.5, "outer_momentum": 0.5,
                                         "outer_momentum_warmup_rounds": 100}, "method": {"lr": lr}},
       f"density96-outer-lr1.5-momentum0.5-inner-lr{lr:g}") for lr in (4.5e-3, 6e-3, 9e-3, 1.2e-2)],
    # it did (1.613 at 4.5e-3, 1.596 at 6e-3): DiLoCo's recipe at τ = 10 with the same larger inner steps, to be fair
    *[("diloco", 10, {"diloco": {**PAPER_PAIR, "outer_momentum_warmup_rounds": 100}, "method": {"lr": lr}},
       f"paper-outer-momentum-warmup100-inner-lr{lr:g}") for lr in (4.5e-3, 6e-3)],
    # SparseLoCo wins at equal τ only where it gets many outer steps (400 at τ = 5, not 200 at τ = 10): at τ = 10 over
    # three times the budget (6,000 inner steps, 600 rounds, the inner schedule stretched with it), DiLoCo's recipe
    # beside SparseLoCo's best τ = 10 setting (96 of 4,096: 100x fewer bytes up), each momentum warmed up over half
    *[(key, 10, {key: setting, "steps": 6000}, f"{label}-budget6000") for key, setting, label in (
        ("diloco", {**PAPER_PAIR, "outer_momentum_warmup_rounds": 300}, "paper-outer-momentum-warmup300"),
        ("sparseloco", {"chunk_k": 96, "outer_lr": 1.5, "outer_momentum": 0.5, "outer_momentum_warmup_rounds": 300},
         "density96-outer-lr1.5-momentum0.5"))],
    # Streaming DiLoCo (2 fragments, each merged τ/2 steps after it is sent) at H = 10, with the τ = 10 rows' warm-up
    *[(key, 10, {"diloco": {"outer_momentum_warmup_rounds": momentum_warmup_rounds(SIZES["full"], 10)}}, "")
      for key in ("streaming-diloco", "streaming-diloco-int4")],
    # what costs it: the merge's delay (τ_o = 1 instead of 5), and then its mixing (α = 0: the new global fragment
    # replaces the local one; refused at τ_o = 5 = H/P, where it would discard every inner step)
    ("streaming-diloco", 10, {"diloco": {"outer_momentum_warmup_rounds": 100, "overlap": 1}}, "overlap1"),
    ("streaming-diloco", 10, {"diloco": {"outer_momentum_warmup_rounds": 100, "overlap": 1, "alpha": 0.0}},
     "overlap1-alpha0"),
    # eager updates (the local fragment's own pseudo-gradient stands in for the missing mean during τ_o = 5)
    ("streaming-diloco", 10, {"diloco": {"outer_momentum_warmup_rounds": 100, "eager": True}}, "eager"),
    ("streaming-diloco", 10, {"diloco": {"outer_momentum_warmup_rounds": 100, "overlap": 4, "alpha": 0.0}},
     "overlap4-alpha0"),
    # eager with a lower outer momentum: is it the stale average under momentum 0.9 that costs it?
    *[("streaming-diloco", 10, {"diloco": {"outer_momentum_warmup_rounds": 100, "eager": True, "outer_momentum": mu}},
       f"eager-momentum{mu:g}") for mu in (0.5, 0.0)],
]


def row_id(key: str, tau: int, label: str = "") -> str:
    return f"{key}@{tau}" + (f"+{label}" if label else "")


def run_row(key: str, tau: int, override: dict[str, Any], label: str) -> dict[str, Any]:
    """One row at τ `tau` over the full budget: its final validation loss, curve and bytes each way."""
    torch.set_num_threads(1)
    full = SIZES["full"]
    steps = int(override.get("steps", full.steps))
    size = dataclasses.replace(full, tau=tau, tau_warmup_start=min(full.tau_warmup_start, tau), steps=steps,
                               eval_every_steps=full.eval_every_steps * steps // full.steps)
    tuned, _ = read_tuning("full")
    for family, setting in override.items():
        if family not in ("method", "seed", "steps"):
            tuned[family] = {**tuned.get(family, {}), **setting}
    method = dataclasses.replace(method_catalogue(size, tuned)[key], **override.get("method", {}))
    seed = int(override.get("seed", 0))
    doc = budget_experiment(method, size, seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as where:
        rounds = drive_crossdc(doc, Path(where), size.eval_every_steps)
    changed = override.get("method", {})
    params = {**method.params, **({"inner_lr": method.lr} if "lr" in changed else {}),
              **({"downlink": ", ".join(method.downlink_codecs) or "fp32"} if "downlink_codecs" in changed else {})}
    row = {"row": row_id(key, tau, label), "key": key, "tau": tau, "seed": seed, "steps": steps, "params": params,
           "codecs": list(method.codecs),
           "rounds": len(rounds), "val_loss": rounds[-1]["val_loss"],
           "curve": [r["val_loss"] for r in rounds if r.get("val_loss") is not None],
           "bytes_up": sum(sum(r["bytes_up"]) for r in rounds), "bytes_down": sum(sum(r["bytes_down"]) for r in rounds),
           "run_s": time.perf_counter() - started}
    print(f"  {row['row']:<20} val loss {row['val_loss']:.4f}  up {row['bytes_up']:>12,d}  ({row['run_s']:.0f}s)", flush=True)
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| row | τ | settings | seed | rounds | val loss | bytes up | bytes down |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["key"], r["tau"], r["row"])):
        budget = [f"{r['steps']:,} steps"] if r.get("steps", SIZES["full"].steps) != SIZES["full"].steps else []
        settings = ", ".join([*(f"{k} {v:g}" if isinstance(v, int | float) else f"{k} {v}" for k, v in r["params"].items()),
                              *r["codecs"], *budget]) or "—"
        lines.append(f"| {r['key']} | {r['tau']} | {settings} | {r.get('seed', 0)} | {r['rounds']} | {r['val_loss']:.4f} | "
                     f"{r['bytes_up']:,} | {r['bytes_down']:,} |")
    return "\n".join(lines)


def gather(futures: dict[str, Future[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of the `futures` (by row id) that ran, in the futures' order, and the ids of those that raised (each
    reported on stdout with its error): one row's failure loses none of the others' results."""
    fresh, failed = [], []
    for name, future in futures.items():
        try:
            fresh.append(future.result())
        except Exception as err:
            failed.append(name)
            print(f"  {name} failed: {type(err).__name__}: {err}", flush=True)
    return fresh, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=[row_id(k, t, label) for k, t, _, label in ROWS], help="rows to (re)run")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    chosen = [r for r in ROWS if not args.only or row_id(r[0], r[1], r[3]) in args.only]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        fresh, failed = gather({row_id(key, tau, label): pool.submit(run_row, key, tau, override, label)
                                for key, tau, override, label in chosen})
    rows = merge_rows(args.out, fresh, key=lambda r: r["row"])
    table = markdown(rows)
    write_results(args.out, {"date": time.strftime("%Y-%m-%d"), "rows": rows, "table_markdown": table,
                             "wall_s": time.perf_counter() - started}, table)
    if failed:
        raise SystemExit(f"{len(failed)} row(s) failed and were not written: {', '.join(failed)}")


if __name__ == "__main__":
    main()
