"""Strategies on non-IID data: FedAvg vs FedProx vs SCAFFOLD (digits, Dirichlet α = 0.1), DiLoCo vs FedAvg (Shakespeare).

Engine: in-process round driving (crossdc.testing.inprocess.InProcessFederation): every datacenter is the real
LocalTrainer + state store driven by run_local_round — exactly the persistent trainer's round, with each
strategy's local hooks (FedProx's proximal term, SCAFFOLD's correction and c_i in the state store) — and the
server step is the real Strategy.aggregate behind the update gate. Flower's transport is left out (on this
2-core machine it would only add its fixed 3 s polls per round); the all-workers baseline is
crossdc.orchestration.baselines.run_baseline itself.

(a) digits, 6 datacenters, Dirichlet α = 0.1, inner SGD (SCAFFOLD is defined for SGD; the same for all),
    τ ∈ {10, 50}: rounds until the validation accuracy first reaches the target, for FedAvg, FedProx, SCAFFOLD.
(b) Shakespeare, natural partition (whole plays), 4 datacenters, inner AdamW: DiLoCo (outer Nesterov,
    lr 0.7, momentum 0.9) vs FedAvg at equal τ and rounds (so equal total steps), final validation loss and
    the gap (L − L_ref)/L_ref to the centralized all-workers baseline with the same number of steps.

Usage: python benchmarks/strategies.py [--quick] [--out benchmarks/results/strategies.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from results_file import write_results

from crossdc.experiment.config import parse_config
from crossdc.orchestration.baselines import run_baseline
from crossdc.testing.inprocess import InProcessFederation

ENGINE = ("in-process round driving (crossdc.testing.inprocess): real LocalTrainer + run_local_round per datacenter, "
          "real Strategy.aggregate behind the update gate; no Flower transport")
DIGITS_TARGET = 0.90
DIGITS_SEEDS = (0, 1, 2)


def digits_config(strategy: str, tau: int, rounds: int, params: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    return {
        "run": {"name": f"digits-{strategy}-tau{tau}-seed{seed}", "rounds": rounds, "seed": seed},
        "workload": {"dataset": "digits", "model": "mlp", "model_args": {"hidden": 64, "layers": 1},
                     "partition": {"kind": "dirichlet", "alpha": 0.1}, "batch_size": 32, "optimizer": "sgd", "lr": 0.05},
        "strategy": {"name": strategy, "tau": tau, "params": params},
        "datacenters": [{"name": f"dc-{i}"} for i in range(6)],
    }


def shakespeare_config(strategy: str, tau: int, rounds: int, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": {"name": f"shakespeare-{strategy}-tau{tau}", "rounds": rounds, "seed": 0},
        "workload": {"dataset": "shakespeare", "model": "char-transformer",
                     "model_args": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64},
                     "partition": {"kind": "natural"}, "batch_size": 32, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": strategy, "tau": tau, "params": params},
        "datacenters": [{"name": n} for n in ("us-east", "eu-west", "ap-south", "sa-east")],
    }


def drive(doc: dict[str, Any], root: Path, stop_at_accuracy: float | None = None) -> dict[str, Any]:
    """Run the experiment round by round; the validation curve, and the first round reaching the target."""
    started = time.perf_counter()
    fed = InProcessFederation.from_config(parse_config(doc), root / doc["run"]["name"])
    curve: list[tuple[float, float]] = []
    reached = None
    for server_round in range(1, doc["run"]["rounds"] + 1):
        result = fed.run_round()
        assert not result.rejected, result.rejected
        loss, accuracy = fed.evaluate()
        curve.append((loss, accuracy))
        if stop_at_accuracy is not None and reached is None and accuracy >= stop_at_accuracy:
            reached = server_round
            break
    return {"rounds_to_target": reached, "rounds_run": len(curve), "final_val_loss": curve[-1][0],
            "final_val_accuracy": curve[-1][1], "best_val_accuracy": max(a for _, a in curve),
            "curve_val_accuracy": [round(a, 4) for _, a in curve], "curve_val_loss": [round(loss, 4) for loss, _ in curve],
            "wall_s": time.perf_counter() - started}


def part_a(root: Path, quick: bool) -> list[dict[str, Any]]:
    rows = []
    budget = {10: 40 if quick else 150, 50: 15 if quick else 60}
    for seed in DIGITS_SEEDS[:1] if quick else DIGITS_SEEDS:  # the seed draws the partition and the initial model
        for tau, max_rounds in budget.items():
            for strategy, params in (("fedavg", {}), ("fedprox", {"mu": 0.1}), ("scaffold", {})):
                out = drive(digits_config(strategy, tau, max_rounds, params, seed), root, stop_at_accuracy=DIGITS_TARGET)
                rows.append({"strategy": strategy, "params": params, "tau": tau, "seed": seed, "max_rounds": max_rounds, **out})
                print(f"  (a) seed {seed} {strategy:<9} τ={tau:<3} rounds to {DIGITS_TARGET:.0%}: "
                      f"{out['rounds_to_target'] or f'> {max_rounds}'}  (best {out['best_val_accuracy']:.3f}, "
                      f"{out['wall_s']:.0f}s)", flush=True)
    return rows


def part_b(root: Path, quick: bool, db_url: str) -> list[dict[str, Any]]:
    from crossdc.db.engine import upgrade

    upgrade(db_url)
    rows = []
    settings = [(20, 4)] if quick else [(20, 15), (50, 6)]
    baselines: dict[int, dict[str, Any]] = {}  # by total steps: the same baseline serves every τ × rounds of that total
    for tau, rounds in settings:
        if tau * rounds not in baselines:
            config = parse_config(shakespeare_config("fedavg", tau, rounds, {}))
            started = time.perf_counter()
            baselines[tau * rounds] = run_baseline(config, "all-workers", db_url, f"baseline-tau{tau}")
            print(f"  (b) all-workers baseline, {baselines[tau * rounds]['steps']} steps × batch "
                  f"{baselines[tau * rounds]['batch_size']}: val loss {baselines[tau * rounds]['val_loss']:.4f} "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
        base = baselines[tau * rounds]
        for strategy, params in (("fedavg", {}), ("diloco", {"outer_lr": 0.7, "outer_momentum": 0.9})):
            out = drive(shakespeare_config(strategy, tau, rounds, params), root)
            gap = (out["final_val_loss"] - base["val_loss"]) / base["val_loss"]
            rows.append({"strategy": strategy, "params": params, "tau": tau, "rounds": rounds,
                         "steps_per_datacenter": tau * rounds, "baseline_val_loss": base["val_loss"],
                         "baseline_val_accuracy": base["val_accuracy"], "baseline_steps": base["steps"],
                         "gap_val_loss_rel": gap,
                         "gap_val_accuracy_points": 100 * (out["final_val_accuracy"] - base["val_accuracy"]), **out})
            print(f"  (b) {strategy:<7} τ={tau:<3} × {rounds} rounds: val loss {out['final_val_loss']:.4f}, "
                  f"gap {100 * gap:+.1f}% ({out['wall_s']:.0f}s)", flush=True)
    return rows


def markdown(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str:
    seeds = sorted({r["seed"] for r in a})
    lines = [f"(a) digits, 6 datacenters, Dirichlet α = 0.1, inner SGD lr 0.05, batch 32: rounds to {DIGITS_TARGET:.0%} validation "
             f"accuracy (seeds {' / '.join(map(str, seeds))}: partition and initial model)",
             "", "| strategy | τ = 10 | τ = 50 |", "| --- | --- | --- |"]
    for strategy in ("fedavg", "fedprox", "scaffold"):
        cells = []
        for tau in (10, 50):
            runs = sorted((r for r in a if r["strategy"] == strategy and r["tau"] == tau), key=lambda r: r["seed"])
            cells.append(" / ".join(str(r["rounds_to_target"]) if r["rounds_to_target"] else f"> {r['max_rounds']}" for r in runs))
        label = {"fedavg": "FedAvg", "fedprox": "FedProx (μ = 0.1)", "scaffold": "SCAFFOLD"}[strategy]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    lines += ["", "(b) Shakespeare, natural partition, 4 datacenters, inner AdamW: final validation loss, gap to all-workers",
              "", "| τ × rounds | all-workers baseline | FedAvg | DiLoCo (0.7, Nesterov 0.9) |", "| --- | --- | --- | --- |"]
    for tau in sorted({r["tau"] for r in b}):
        f = next(r for r in b if r["tau"] == tau and r["strategy"] == "fedavg")
        d = next(r for r in b if r["tau"] == tau and r["strategy"] == "diloco")
        lines.append(f"| {tau} × {f['rounds']} | {f['baseline_val_loss']:.3f} | "
                     f"{f['final_val_loss']:.3f} ({100 * f['gap_val_loss_rel']:+.1f} %) "
                     f"| {d['final_val_loss']:.3f} ({100 * d['gap_val_loss_rel']:+.1f} %) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "strategies.json"))
    parser.add_argument("--only", choices=["a", "b"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("CROSSDC_BENCH_THREADS", "1")))
    print(f"engine: {ENGINE}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = part_a(root, args.quick) if args.only in (None, "a") else []
        b = part_b(root, args.quick, f"sqlite:///{root / 'baselines.db'}") if args.only in (None, "b") else []
    table = markdown(a, b) if a and b else ""
    scaffold_vs_fedavg = {}
    for tau in (10, 50):
        for r in a:
            if r["tau"] == tau:
                scaffold_vs_fedavg.setdefault(f"tau={tau}", {}).setdefault(r["strategy"], []).append(r["rounds_to_target"])
    result = {"engine": ENGINE, "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
              "quick": args.quick, "digits_target_accuracy": DIGITS_TARGET, "digits": a, "shakespeare": b,
              "rounds_to_target": scaffold_vs_fedavg, "wall_s": time.perf_counter() - started, "table_markdown": table}
    write_results(args.out, result, table)


if __name__ == "__main__":
    main()
