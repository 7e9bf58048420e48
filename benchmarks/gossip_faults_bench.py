"""Decentralized gossip through faults, end to end: a datacenter cut off, and the coordinator killed for a minute.

Every row runs on Flower's Deployment Engine (`crossdc run`'s local deployment): each datacenter's SuperNode,
trainer and gossip exchanges in its own network namespace, every packet through the emulated transoceanic links
(no `[[links]]`: two datacenters' exchanges cross the coordinator's site on both their links). The workload is the
WAN benchmark's (benchmarks/wan_benchmark.py: Shakespeare char-transformer, 4 datacenters, natural partition,
batch 32, AdamW 3e-3, τ = 50, 16 rounds), with gossip's best row of benchmarks/gossip_bench.py: random pairs, outer
Nesterov 0.7, 0.5.

Rows:
- *uncut*: nothing goes wrong;
- *cut*: us-east's link is cut once round 5 is logged, for 30 % of the uncut run's training time (its exchanges
  fail their probe; it trains alone; the others mix without it);
- *coordinator away*: the ServerApp is SIGKILLed once round 4 is logged and submitted again 60 s later.

Per row and datacenter, from the run log: utilisation (compute seconds over compute + idle seconds, summed over the
rounds it reported) and step rate (inner steps over compute + idle seconds); per row, the final validation loss of
the replicas' average. The goals (of the gossip issue): with the cut, every other datacenter's utilisation ≥ 95 % of
its uncut value and the loss within 2 % of the uncut run's; with the coordinator away, every datacenter's step rate
within 5 % of its uncut value.

Usage: python benchmarks/gossip_faults_bench.py [--quick] [--out benchmarks/results/gossip_faults.json]
(needs the namespace emulator: root, or the capabilities of docs/wan.md)
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

from results_file import write_results
from wan_benchmark import DATACENTERS, DILOCO, PROFILE, SIZES, Method, experiment, rounds_for_budget

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_datacenter_rounds
from crossdc.experiment.config import parse_config
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRun, LocalRunOptions

ENGINE = ("Flower's Deployment Engine, each datacenter in its own network namespace behind an emulated transoceanic "
          "link; gossip exchanges over gloo pairs through those links")
METHOD = Method("gossip-pairs-nesterov", "gossip, random pairs, outer Nesterov 0.7, 0.5", "crossdc", "gossip",
                {"topology": "random-pairs", **DILOCO, "nesterov": True, "exchange_timeout_s": 30})
CUT_DATACENTER, CUT_AFTER_ROUND, CUT_FRACTION = "us-east", 5, 0.3
KILL_AFTER_ROUND, COORDINATOR_AWAY_S = 4, 60.0


def config_doc(quick: bool, cut_s: float | None = None) -> dict[str, Any]:
    """The row's experiment: the WAN benchmark's workload under gossip, behind transoceanic links; with `cut_s`,
    CUT_DATACENTER's link cut for that long once CUT_AFTER_ROUND is logged."""
    size = SIZES["tiny" if quick else "medium"]
    doc = experiment(METHOD, size, rounds_for_budget(size.tau, size.steps))
    doc["run"].update(eval_every=doc["run"]["rounds"], round_timeout_s=600)
    doc["datacenters"] = [{"name": name, "link": PROFILE} for name in DATACENTERS]
    if cut_s is not None:
        doc["link_faults"] = [{"datacenter": CUT_DATACENTER, "after_round": CUT_AFTER_ROUND, "kind": "cut",
                               "cut_s": round(cut_s, 1)}]
    return doc


class CoordinatorAway(LocalRun):
    """A local run whose ServerApp is killed once KILL_AFTER_ROUND is logged, and stays away COORDINATOR_AWAY_S."""

    killed: list[int] | None = None

    def inject_faults(self, rounds_logged: int) -> None:
        super().inject_faults(rounds_logged)
        if rounds_logged >= KILL_AFTER_ROUND and self.killed is None:
            self.killed = self.kill_coordinator(COORDINATOR_AWAY_S)


def run_row(key: str, doc: dict[str, Any], root: Path) -> dict[str, Any]:
    """Run one row to its end; what the run log says of it."""
    started = time.perf_counter()
    db_url = f"sqlite:///{root / f'{key}.db'}"
    options = LocalRunOptions(db_url=db_url, engine="deployment", superlink_port=free_port(), runs_root=root / key)
    run = (CoordinatorAway if key == "coordinator-away" else LocalRun)(parse_config(doc), options)
    result = run.execute()
    engine = make_engine(db_url)
    try:
        rows = list_datacenter_rounds(engine, result.run_id)
    finally:
        engine.dispose()
    per_dc = {}
    for name in DATACENTERS:
        mine = [r for r in rows if r["datacenter"] == name and r["status"] == "ok"]
        compute = sum(r["compute_s"] for r in mine)
        busy = compute + sum(r["idle_s"] for r in mine)
        steps = sum(r["num_examples"] for r in mine) // doc["workload"]["batch_size"]
        per_dc[name] = {"rounds": len(mine), "compute_s": compute, "idle_s": busy - compute,
                        "utilisation": compute / busy, "steps_per_s": steps / busy}
    training_s = statistics.median(d["compute_s"] + d["idle_s"] for d in per_dc.values())
    return {"key": key, "val_loss": result.summary["val_loss"], "replica_val_loss": result.summary.get("replica_val_loss"),
            "datacenters": per_dc, "training_s": training_s, "link_faults": doc.get("link_faults", []),
            "coordinator_killed": getattr(run, "killed", None), "wall_s": time.perf_counter() - started}


def goals(done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, each with the figures it compares."""
    uncut, cut, away = done["uncut"], done["cut"], done["coordinator-away"]
    others = [n for n in DATACENTERS if n != CUT_DATACENTER]
    utilisation = {n: cut["datacenters"][n]["utilisation"] / uncut["datacenters"][n]["utilisation"] for n in others}
    rate = {n: away["datacenters"][n]["steps_per_s"] / uncut["datacenters"][n]["steps_per_s"] for n in DATACENTERS}
    loss_gap = (cut["val_loss"] - uncut["val_loss"]) / uncut["val_loss"]
    return {"cut_utilisation_vs_uncut": utilisation, "cut_utilisation_met": min(utilisation.values()) >= 0.95,
            "cut_loss_gap": loss_gap, "cut_loss_met": loss_gap <= 0.02,
            "away_step_rate_vs_uncut": rate, "away_step_rate_met": all(abs(v - 1) <= 0.05 for v in rate.values())}


def markdown(done: dict[str, dict[str, Any]], met: dict[str, Any]) -> str:
    lines = ["| row | val loss | " + " | ".join(f"{n} utilisation, steps/s" for n in DATACENTERS) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in DATACENTERS) + " |"]
    for key, row in done.items():
        cells = [f"{100 * row['datacenters'][n]['utilisation']:.1f} %, {row['datacenters'][n]['steps_per_s']:.2f}"
                 for n in DATACENTERS]
        lines.append(f"| {key} | {row['val_loss']:.4f} | " + " | ".join(cells) + " |")
    lines += ["", f"cut: the others' utilisation vs uncut {min(met['cut_utilisation_vs_uncut'].values()):.3f} at worst "
              f"(goal ≥ 0.95: {'met' if met['cut_utilisation_met'] else 'missed'}); loss {100 * met['cut_loss_gap']:+.2f} % "
              f"(goal ≤ 2 %: {'met' if met['cut_loss_met'] else 'missed'})",
              "coordinator away: step rate vs uncut " + ", ".join(f"{n} {v:.3f}" for n, v in met['away_step_rate_vs_uncut'].items())
              + f" (goal within 5 %: {'met' if met['away_step_rate_met'] else 'missed'})"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny budget (a smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gossip_faults.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    done: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gossip-faults-") as tmp:
        root = Path(tmp)
        for key in ("uncut", "cut", "coordinator-away"):
            cut_s = CUT_FRACTION * done["uncut"]["training_s"] if key == "cut" else None
            done[key] = run_row(key, config_doc(args.quick, cut_s), root)
            print(f"  {key:<18} val loss {done[key]['val_loss']:.4f}  ({done[key]['wall_s']:.0f}s)", flush=True)
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(done, indent=1))  # a row lost is minutes
    met = goals(done)
    table = markdown(done, met)
    write_results(args.out, {"engine": ENGINE, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                             "quick": args.quick, "date": time.strftime("%Y-%m-%d"), "rows": done, "goals": met,
                             "wall_s": time.perf_counter() - started, "table_markdown": table}, table)
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
