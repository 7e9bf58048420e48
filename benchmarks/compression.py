"""Compression on Shakespeare, 4 datacenters: validation loss vs cumulative upload bytes, per codec pipeline.

For FedAvg and DiLoCo (inner AdamW, equal τ and rounds for all), each uplink pipeline — none, int8,
top-k 1 % with error feedback, top-k 1 % + int8, top-k 1 % + int8 with DGC's sparsity warm-up, PowerSGD
rank 4 — trains the same model from the same start. Reported per run: final validation loss, its gap to
the uncompressed run of the same strategy, total upload bytes (the real encoded payloads, framing
included), the compression ratio against the uncompressed run, and the median share of the update's
energy each round's payload carried (‖sent‖² / ‖update + residual‖²).

Engine: in-process round driving (crossdc.testing.inprocess): each datacenter is the real LocalTrainer and
state store driven by run_local_round, which encodes the update with the run's CodecPipeline (its residuals in
the state store), and the server decodes the real payload bytes before the update gate and the strategy's
aggregate. Flower's transport is left out; a Flower message adds ~70 bytes of framing per reply, also left out.

Usage: python benchmarks/compression.py [--rounds 15] [--tau 20] [--quick]
Writes benchmarks/results/compression.json, compression.md and compression.html (loss vs bytes), prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from crossdc.experiment.config import parse_config
from crossdc.testing.inprocess import InProcessFederation

RESULTS = Path(__file__).parent / "results"
PIPELINES: dict[str, list[str]] = {
    "none": [],
    "int8": ["int8"],
    "topk 1% + EF": ["topk:0.01"],
    "topk 1% + int8": ["topk:0.01", "int8"],
    "topk 1% + int8, warm-up 5": ["topk:0.01:warmup=5", "int8"],
    "powersgd r4": ["powersgd:rank=4"],
}
STRATEGIES = {"fedavg": {}, "diloco": {}}


def config(strategy: str, codecs: list[str], tau: int, rounds: int) -> dict[str, Any]:
    return {
        "run": {"name": f"compression-{strategy}", "rounds": rounds, "seed": 0},
        "workload": {"dataset": "shakespeare", "model": "char-transformer",
                     "model_args": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64},
                     "partition": {"kind": "natural"}, "batch_size": 32, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": strategy, "tau": tau, "params": STRATEGIES[strategy]},
        "datacenters": [{"name": n} for n in ("us-east", "eu-west", "ap-south", "sa-east")],
        "compression": {"codecs": codecs},
    }


def drive(doc: dict[str, Any], root: Path) -> dict[str, Any]:
    """Run every round; the loss after each, the cumulative upload bytes, the energy kept."""
    fed = InProcessFederation.from_config(parse_config(doc), root)
    cumulative, curve, energy = 0, [], []
    started = time.perf_counter()
    for _ in range(doc["run"]["rounds"]):
        result = fed.run_round()
        if result.rejected:
            raise RuntimeError(f"rejected updates: {result.rejected}")
        cumulative += sum(result.bytes_up.values())
        energy += [float(u.metrics["energy-kept"]) for u in result.updates if "energy-kept" in u.metrics]
        loss, accuracy = fed.evaluate()
        curve.append({"round": result.server_round, "bytes_up": cumulative, "val_loss": loss, "val_accuracy": accuracy})
    raw = sum(4 * a.size for a in fed.weights.values()) * len(fed.datacenters) * doc["run"]["rounds"]
    return {"curve": curve, "bytes_up": cumulative, "raw_fp32_bytes": raw, "val_loss": curve[-1]["val_loss"],
            "val_accuracy": curve[-1]["val_accuracy"], "energy_kept_median": statistics.median(energy) if energy else 1.0,
            "wall_s": time.perf_counter() - started}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| strategy | uplink codecs | val loss | vs uncompressed | upload bytes | ratio | energy kept (median) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['pipeline']} | {r['val_loss']:.3f} | {100 * r['loss_gap']:+.1f} % | "
                     f"{r['bytes_up'] / 1e6:.2f} MB | {r['ratio']:.0f}× | {100 * r['energy_kept_median']:.1f} % |")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import plotly.graph_objects as go

    figure = go.Figure()
    for r in rows:
        figure.add_trace(go.Scatter(x=[p["bytes_up"] for p in r["curve"]], y=[p["val_loss"] for p in r["curve"]],
                                    mode="lines+markers", name=f"{r['strategy']}: {r['pipeline']}"))
    figure.update_layout(title="Shakespeare, 4 datacenters: validation loss vs cumulative upload bytes",
                         xaxis={"title": "upload bytes (cumulative)", "type": "log"}, yaxis={"title": "validation loss"})
    figure.write_html(path, include_plotlyjs=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tau", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 rounds of τ 2 (the harness test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds, tau = (2, 2) if args.quick else (args.rounds, args.tau)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in STRATEGIES:
            for label, codecs in PIPELINES.items():
                result = drive(config(strategy, codecs, tau, rounds), Path(tmp) / f"{strategy}-{len(rows)}")
                rows.append({"strategy": strategy, "pipeline": label, "codecs": codecs, **result})
                print(f"{strategy:7s} {label:28s} loss {result['val_loss']:.3f} bytes {result['bytes_up']:>12,d} "
                      f"({result['wall_s']:.0f}s)", flush=True)
    for r in rows:
        reference = next(x for x in rows if x["strategy"] == r["strategy"] and not x["codecs"])
        r["loss_gap"] = (r["val_loss"] - reference["val_loss"]) / reference["val_loss"]
        r["ratio"] = reference["bytes_up"] / r["bytes_up"]
    table = markdown(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (args.out / f"compression{suffix}.json").write_text(json.dumps({
        "setting": {"rounds": rounds, "tau": tau, "datacenters": 4, "dataset": "shakespeare natural", "model": "char-transformer d64 l2"},
        "engine": "in-process round driving (real trainer, codecs and server decode; no Flower transport)",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "rows": rows}, indent=1))
    (args.out / f"compression{suffix}.md").write_text(table + "\n")
    chart(rows, args.out / f"compression{suffix}.html")
    print(table)


if __name__ == "__main__":
    main()
