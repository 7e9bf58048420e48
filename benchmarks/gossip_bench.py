"""Decentralized gossip against DiLoCo on the WAN benchmark's setting: loss of the replicas' average, consensus, bytes.

Setting (benchmarks/wan_benchmark.py's): Shakespeare char-transformer (2 layers, d_model 64), 4 datacenters with the
natural non-IID partition, batch 32, inner AdamW lr 3e-3, τ = 50, 16 rounds: 800 inner steps per datacenter. Every
row runs in-process (crossdc.testing.inprocess: real trainers, real codecs; each gossip message is sized as the
link carries it, the codec pipeline's wire format), so the figures are losses and bytes, not times.

Rows: DiLoCo (the WAN benchmark's: outer Nesterov lr 0.7, momentum 0.5), and gossip with
- random pairs and NoLoCo's outer step (heavy ball, lr 0.7, momentum 0.5): the same bytes per datacenter as DiLoCo
  (one model out and one in per round), no all-reduce and no central aggregation;
- random pairs with DiLoCo's outer step (Nesterov);
- a ring (two neighbours: twice DiLoCo's bytes) and the exponential graph (one peer each way, hop 1, 2, 1, …);
- a ring with CHOCO exchanges through top-k 10 % + int8;
- random pairs with us-east's links cut for rounds 6–10 (5 of 16 rounds, 31 % of the run): it trains alone and
  mixes with nobody in those rounds, then re-enters.
Per row: the final validation loss of the replicas' average and its gap to DiLoCo's, each replica's own loss, the
replicas' mean distance to their average after the last round, and the bytes each datacenter sends and receives per
round (for DiLoCo: its update up and the model down).

Usage: python benchmarks/gossip_bench.py [--jobs 2] [--quick] [--out benchmarks/results/gossip.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from results_file import write_results
from wan_benchmark import DATACENTERS, DILOCO, SIZES, Method, experiment, rounds_for_budget

ENGINE = ("in-process round driving (crossdc.testing.inprocess): real LocalTrainer and GossipReplica per datacenter, "
          "real codec pipeline; gossip messages handed from sender to receiver and sized as the link carries them")
#: us-east's links are cut in these rounds of the cut row
CUT_ROUNDS = range(6, 11)


def rows(quick: bool) -> list[dict[str, Any]]:
    size = SIZES["tiny" if quick else "medium"]
    rounds = rounds_for_budget(size.tau, size.steps)
    pairs = {"topology": "random-pairs"}

    def row(key: str, label: str, strategy: str, params: dict[str, Any], codecs: tuple[str, ...] = (),
            cut: bool = False) -> dict[str, Any]:
        doc = experiment(Method(key, label, "crossdc", strategy, params, codecs=codecs), size, rounds)
        return {"key": key, "label": label, "doc": doc, "cut": cut}

    return [
        row("diloco", "DiLoCo (outer Nesterov 0.7, 0.5)", "diloco", DILOCO),
        row("gossip-pairs", "gossip, random pairs, NoLoCo outer (heavy ball 0.7, 0.5)", "gossip", pairs),
        row("gossip-pairs-nesterov", "gossip, random pairs, outer Nesterov 0.7, 0.5", "gossip",
            {**pairs, **DILOCO, "nesterov": True}),
        row("gossip-ring", "gossip, ring, NoLoCo outer", "gossip", {"topology": "ring"}),
        row("gossip-exponential", "gossip, exponential graph, NoLoCo outer", "gossip", {"topology": "exponential"}),
        row("gossip-ring-choco", "gossip, ring, CHOCO top-k 10 % + int8", "gossip", {"topology": "ring"},
            ("topk:0.1", "int8")),
        row("gossip-pairs-cut", f"gossip, random pairs, us-east cut in rounds {CUT_ROUNDS.start}–{CUT_ROUNDS.stop - 1}",
            "gossip", pairs, cut=True),
    ]


def run_row(row: dict[str, Any]) -> dict[str, Any]:
    import torch

    from crossdc.experiment.config import parse_config
    from crossdc.testing.inprocess import InProcessFederation

    torch.set_num_threads(1)
    started = time.perf_counter()
    config = parse_config(row["doc"])
    sent, received, distances, curve = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        fed = InProcessFederation.from_config(config, tmp, run_id=row["key"])
        gossip = fed.strategy.loop == "gossip"
        for server_round in range(1, config.run.rounds + 1):
            if gossip:
                cut = ([(DATACENTERS[0], other) for other in DATACENTERS[1:]]
                       if row["cut"] and server_round in CUT_ROUNDS else [])
                result = fed.run_round(cut=cut)
                distances.append(result.mean_consensus_distance)
            else:
                result = fed.run_round()
            if result.rejected:
                raise RuntimeError(f"{row['key']}: round {server_round} rejected {result.rejected}")
            sent.append(statistics.mean(result.bytes_up.get(dc, 0) for dc in fed.datacenters))
            received.append(statistics.mean(result.bytes_down.get(dc, 0) for dc in fed.datacenters))
            if server_round % 4 == 0 or server_round == config.run.rounds:
                curve.append({"round": server_round, "val_loss": fed.evaluate()[0]})
        loss, accuracy = fed.evaluate()
        replicas = ({dc: fed.evaluate_weights(w)[0] for dc, w in fed.replica_weights().items()} if gossip else {})
    return {"key": row["key"], "label": row["label"], "strategy": row["doc"]["strategy"],
            "codecs": row["doc"]["compression"]["codecs"], "rounds": config.run.rounds,
            "inner_steps": config.run.rounds * int(row["doc"]["strategy"]["tau"]), "val_loss": loss,
            "val_accuracy": accuracy, "replica_val_loss": replicas,
            "final_consensus_distance": distances[-1] if distances else None, "consensus_distance": distances,
            "bytes_sent_per_round": statistics.mean(sent), "bytes_received_per_round": statistics.mean(received),
            "curve": curve, "wall_s": time.perf_counter() - started}


def markdown(done: list[dict[str, Any]]) -> str:
    reference = next(r for r in done if r["key"] == "diloco")
    lines = [f"{done[0]['rounds']} rounds of τ = {done[0]['inner_steps'] // done[0]['rounds']} ({done[0]['inner_steps']} inner "
             "steps per datacenter), 4 datacenters, natural partition", "",
             "| row | val loss (average) | gap to DiLoCo | replicas' loss (min–max) | consensus distance at the end "
             "| sent / round / datacenter | received / round / datacenter |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in done:
        replicas = r["replica_val_loss"]
        spread = f"{min(replicas.values()):.4f}–{max(replicas.values()):.4f}" if replicas else ""
        distance = f"{r['final_consensus_distance']:.4f}" if r["final_consensus_distance"] is not None else ""
        lines.append(f"| {r['label']} | {r['val_loss']:.4f} | "
                     f"{100 * (r['val_loss'] - reference['val_loss']) / reference['val_loss']:+.2f} % | {spread} | "
                     f"{distance} | {r['bytes_sent_per_round'] / 1e3:.1f} kB | {r['bytes_received_per_round'] / 1e3:.1f} kB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("CROSSDC_BENCH_JOBS", "2")))
    parser.add_argument("--quick", action="store_true", help="the tiny budget (a smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gossip.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        done = []
        for result in pool.map(run_row, rows(args.quick)):
            print(f"  {result['key']:<24} val loss {result['val_loss']:.4f}  ({result['wall_s']:.0f}s)", flush=True)
            done.append(result)
    table = markdown(done)
    write_results(args.out, {"engine": ENGINE, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                             "quick": args.quick, "date": time.strftime("%Y-%m-%d"), "rows": done,
                             "wall_s": time.perf_counter() - started, "table_markdown": table}, table)


if __name__ == "__main__":
    main()
