"""Validate the cost model (`crossdc plan`) against runs over the emulated WAN.

For each link profile, runs a small real federation (2 datacenters, the Shakespeare char-transformer,
Flower's Deployment Engine, every SuperNode behind crossdc's link relay) and compares the measured
per-datacenter communication time of a round (comm_s, measured at the relay) with the cost model's
prediction for the same payload, tensor count and link. Nothing in the model is fitted to these runs:
its round-trip count comes from reading Flower's protocol, so every profile here is held out.

Also reports the byte cross-check: bytes that crossed the link for the round's messages against the
payload sizes crossdc counts (the difference is HTTP + Flower object framing).

    python benchmarks/wan_validation.py [--profiles continental transoceanic constrained] [--rounds 3]

Writes benchmarks/results/wan_validation.json and prints a table (medians over datacenter-rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_datacenter_rounds
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.links import LINK_PROFILES
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRunOptions, run_local
from crossdc.wan.cost_model import StarPlan, star_round, uniform_datacenters

HERE = Path(__file__).resolve().parent


def experiment(profile: str, rounds: int) -> dict[str, Any]:
    return {
        "run": {"name": f"wan-validation-{profile}", "rounds": rounds, "seed": 0, "eval_every": rounds, "round_timeout_s": 600},
        "workload": {"dataset": "shakespeare", "model": "char-transformer", "partition": {"kind": "natural"},
                     "batch_size": 16, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": "fedavg", "tau": 2},
        "datacenters": [{"name": "dc-a", "link": profile}, {"name": "dc-b", "link": profile}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["continental", "transoceanic", "constrained"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "wan_validation.json"))
    args = parser.parse_args()
    rows = []
    for profile in args.profiles:
        config = parse_config(experiment(profile, args.rounds))
        model = initial_model(config, build_workload(config))
        params = sum(p.numel() for p in model.state_dict().values())
        tensors = len(model.state_dict())
        tmp = Path(tempfile.mkdtemp(prefix=f"crossdc-wan-{profile}-"))
        db_url = f"sqlite:///{tmp / 'wan.db'}"
        result = run_local(config, LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=tmp / "runs"))
        engine = make_engine(db_url)
        try:
            measured = [r for r in list_datacenter_rounds(engine, result.run_id) if r["status"] == "ok"]
        finally:
            engine.dispose()
        # crossdc packs every tensor of a message into one Array (compression/payload.py): T = 1 on the wire
        plan = StarPlan(params=params, datacenters=uniform_datacenters(2, LINK_PROFILES[profile]), step_time_s=0.05,
                        tau=2, tensors=1)
        predicted = star_round(plan).datacenters[0]
        comm = [float(r["comm_s"]) for r in measured]
        framing_up = [r["link_bytes_up"] / r["bytes_up"] - 1 for r in measured]
        framing_down = [r["link_bytes_down"] / r["bytes_down"] - 1 for r in measured]
        row = {
            "profile": profile, "bandwidth_mbps": LINK_PROFILES[profile].bandwidth_mbps, "rtt_ms": LINK_PROFILES[profile].rtt_ms,
            "params": params, "model_tensors": tensors, "round_trips_predicted": predicted.round_trips,
            "comm_s_predicted": predicted.comm_s, "comm_s_measured_median": statistics.median(comm),
            "comm_s_measured_min": min(comm), "comm_s_measured_max": max(comm), "samples": len(comm),
            "error_rel": statistics.median(comm) / predicted.comm_s - 1,
            "bytes_up_median": statistics.median(r["bytes_up"] for r in measured),
            "framing_overhead_up": statistics.median(framing_up), "framing_overhead_down": statistics.median(framing_down),
            "run_id": result.run_id,
        }
        rows.append(row)
        print(f"{profile}: predicted {row['comm_s_predicted']:.2f}s, measured median {row['comm_s_measured_median']:.2f}s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "note": "nothing fitted: every profile is held out"}, indent=1))
    print(f"\n{'profile':<14}{'link':>18}{'k':>5}{'predicted s':>13}{'measured s (min–max)':>24}{'error':>8}{'framing up/down':>18}")
    for r in rows:
        link = f"{r['bandwidth_mbps']:g} Mbps/{r['rtt_ms']:g} ms"
        span = f"{r['comm_s_measured_median']:.2f} ({r['comm_s_measured_min']:.2f}–{r['comm_s_measured_max']:.2f})"
        print(f"{r['profile']:<14}{link:>18}{r['round_trips_predicted']:>5}{r['comm_s_predicted']:>13.2f}{span:>24}"
              f"{100 * r['error_rel']:>7.0f}%{100 * r['framing_overhead_up']:>8.1f}%/{100 * r['framing_overhead_down']:.1f}%")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
