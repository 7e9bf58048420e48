"""Streaming DiLoCo against DiLoCo on the demo's setting: loss, bytes and time of P fragments, overlap τ_o, eager
updates and low-bit outer gradients; and the trainers' idle time measured on Flower's Deployment Engine.

Part "grid" (in-process, crossdc.testing.inprocess: every datacenter a real LocalTrainer and StreamingReplica, the
server the real RoundSession behind the update gate, the codecs the real pipeline; deterministic, so its losses are
what a deployed run gives, weight for weight — tests/test_streaming_runs.py checks that): the demo's workload
(Shakespeare, natural partition, 4 datacenters, the 2-layer character transformer, batch 32, inner AdamW lr 3e-3),
H = τ = 48 inner steps a round (the demo's 50, made a multiple of 4), 10 rounds (480 inner steps per datacenter),
outer Nesterov lr 0.7, momentum 0.9, α = 0.5. Rows: DiLoCo (the reference), the demo's FedAvg (τ 10 → 50, for
context), Streaming DiLoCo for P ∈ {1, 2, 4} × τ_o ∈ {0, 1, H/P} × eager off/on in fp32, P = 1 at τ_o = H/2 and
3H/4 (overlaps long enough to hide an exchange cycle of several seconds), eager at τ_o = 1 with half the outer
learning rate (0.35), and fp8 / int4 outer gradients at τ_o = 1. Per row: the
final validation loss and its gap to DiLoCo's, the bytes each datacenter sends per round, the peak bytes of one
sync (the largest reply of one exchange) against DiLoCo's whole update (goal: ≤ 1.25/P of it), and the time a
round takes on the demo's links, from the cost model (crossdc.wan.cost_model.streaming_exchange_idle) fed with two
measured figures: the time of an inner step and the exchange cycle, both in the demo's setting (below).

Part "deployment" (real runs on Flower's Deployment Engine, crossdc.orchestration.local_run.run_local: every
datacenter in its network namespace behind the emulated link): (a) the issue's end-to-end setting — two datacenters
behind `transoceanic` links (150 ms RTT), a synthetic MLP slowed with `speed` so that a round of H = 100 steps
computes about 10 s — overlapped (P = 2, τ_o = H/P, α = 0.5) and not (P = 2, τ_o = 0, α = 0); (b) the demo's
setting without overlap (P = 1, τ_o = 0, α = 0: DiLoCo's schedule, 3 rounds); and (c) the demo's own experiment as
`crossdc demo` runs it, when it streams. Per run: the exposed comm/comp Σ idle_s / Σ compute_s after round 1 (goal ≤
0.10 in (a), ≤ 0.05 in the demo), the trainers' utilisation, and the federation's wall time from its first message
to its last round against the slowest datacenter's summed compute_s (goal ≤ 1.15× in (a), ≤ 1.05× in the demo);
process start-up (trainers, Flower) is reported apart. A run without overlap waits a whole exchange cycle per
exchange: the median wait of (b) is the cycle the grid's times use.

Part "depth" (in-process, one round each): the peak bytes of one sync against the whole update for P ∈ {1, 2, 4}
on the same transformer with 2, 4 and 8 layers. Fragments are whole layers (the paper's rule), so on the demo's
2-layer model the largest layer bounds the peak; deeper models show where the 1.25/P goal holds.

Usage: python benchmarks/streaming_grid.py [--parts grid,deployment,depth] [--jobs 2] [--quick]
       [--out benchmarks/results/streaming_grid.json]
A part left out of --parts keeps its rows from the results file already at --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from results_file import write_results

DATACENTERS = ("us-east", "eu-west", "ap-south", "sa-east")
#: inner steps a round: the demo's τ, rounded to a multiple of 4 so that every P divides it
H = 48
ROUNDS = 10
GRID_ENGINE = ("in-process round driving (crossdc.testing.inprocess): real LocalTrainer + StreamingReplica per "
               "datacenter, real RoundSession behind the update gate, real codec pipeline; no Flower transport")
DEPLOYMENT_ENGINE = ("real runs on Flower's Deployment Engine (crossdc.orchestration.local_run.run_local): SuperLink, "
                     "a SuperNode and a persistent trainer per datacenter, each datacenter in its network namespace "
                     "behind the emulated link")


def demo_workload() -> dict[str, Any]:
    return {"dataset": "shakespeare", "model": "char-transformer",
            "model_args": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64},
            "partition": {"kind": "natural"}, "batch_size": 32, "optimizer": "adamw", "lr": 3e-3}


def grid_config(label: str, strategy: str, tau: Any, params: dict[str, Any], codecs: tuple[str, ...] = (),
                rounds: int = ROUNDS) -> dict[str, Any]:
    doc: dict[str, Any] = {"run": {"name": label, "rounds": rounds, "seed": 0}, "workload": demo_workload(),
                           "strategy": {"name": strategy, "tau": tau, "params": params},
                           "datacenters": [{"name": dc} for dc in DATACENTERS]}
    if codecs:
        doc["compression"] = {"codecs": list(codecs)}
    return doc


def grid_rows(quick: bool) -> list[dict[str, Any]]:
    """The grid's experiments: label, config, what the row shows."""
    rounds = 2 if quick else ROUNDS
    rows = [{"label": "diloco", "doc": grid_config("diloco", "diloco", H, {}, rounds=rounds),
             "strategy": "diloco", "fragments": 1, "overlap": 0, "eager": False, "codec": "fp32"},
            {"label": "fedavg-demo", "doc": grid_config("fedavg-demo", "fedavg",
                                                        {"start": 10, "end": 50, "warmup_rounds": 4, "kind": "linear"},
                                                        {}, rounds=rounds),
             "strategy": "fedavg (τ 10 → 50)", "fragments": 1, "overlap": 0, "eager": False, "codec": "fp32"}]
    for fragments in (1, 2, 4):
        spacing = H // fragments
        for overlap in sorted({0, 1, spacing}):
            for eager in (False, True):
                params = {"fragments": fragments, "overlap": overlap, "alpha": 0.5, "eager": eager}
                label = f"streaming-P{fragments}-o{overlap}-{'eager' if eager else 'plain'}"
                rows.append({"label": label, "doc": grid_config(label, "streaming-diloco", H, params, rounds=rounds),
                             "strategy": "streaming-diloco", "fragments": fragments, "overlap": overlap, "eager": eager,
                             "codec": "fp32"})
        # eager at half the outer learning rate: whether a smaller outer step keeps the eager merges stable
        params = {"fragments": fragments, "overlap": 1, "alpha": 0.5, "eager": True, "outer_lr": 0.35}
        label = f"streaming-P{fragments}-o1-eager-lr0.35"
        rows.append({"label": label, "doc": grid_config(label, "streaming-diloco", H, params, rounds=rounds),
                     "strategy": "streaming-diloco", "fragments": fragments, "overlap": 1, "eager": True,
                     "codec": "fp32", "outer_lr": 0.35})
        if fragments == 1:
            for overlap in (H // 2, 3 * H // 4):
                params = {"fragments": 1, "overlap": overlap, "alpha": 0.5, "eager": False}
                label = f"streaming-P1-o{overlap}-plain"
                rows.append({"label": label, "doc": grid_config(label, "streaming-diloco", H, params, rounds=rounds),
                             "strategy": "streaming-diloco", "fragments": 1, "overlap": overlap, "eager": False,
                             "codec": "fp32"})
        for codec in ("fp8", "int4"):
            params = {"fragments": fragments, "overlap": 1, "alpha": 0.5, "eager": False}
            label = f"streaming-P{fragments}-o1-plain-{codec}"
            rows.append({"label": label, "doc": grid_config(label, "streaming-diloco", H, params, (codec,), rounds),
                         "strategy": "streaming-diloco", "fragments": fragments, "overlap": 1, "eager": False,
                         "codec": codec})
    if quick:
        rows = [r for r in rows if r["fragments"] in (1, 2) and r["overlap"] <= 1]
    return rows


def run_grid_row(row: dict[str, Any]) -> dict[str, Any]:
    """One in-process experiment to its end: loss, bytes, compute per step."""
    import torch

    from crossdc.experiment.config import parse_config
    from crossdc.testing.inprocess import InProcessFederation

    torch.set_num_threads(1)
    started = time.perf_counter()
    config = parse_config(row["doc"])
    with tempfile.TemporaryDirectory() as tmp:
        fed = InProcessFederation.from_config(config, tmp, run_id=row["label"])
        bytes_up, bytes_down, peaks, compute, steps = [], [], [], [], 0
        for _ in range(config.run.rounds):
            result = fed.run_round()
            if result.rejected:
                raise RuntimeError(f"{row['label']}: rejected updates {result.rejected}")
            bytes_up.append(statistics.mean(result.bytes_up.values()))
            bytes_down.append(statistics.mean(result.bytes_down.values()) if result.bytes_down else 0.0)
            peaks.append(max(result.exchange_peak_bytes.values()) if result.exchange_peak_bytes
                         else max(result.bytes_up.values()))
            compute.append(statistics.mean(result.compute_s.values()))
            steps += result.tau
        loss, accuracy = fed.evaluate()
    return {**{k: v for k, v in row.items() if k != "doc"}, "params": row["doc"]["strategy"]["params"],
            "val_loss": loss, "val_accuracy": accuracy, "rounds": config.run.rounds, "inner_steps": steps,
            "bytes_up_per_round": statistics.mean(bytes_up), "bytes_down_per_round": statistics.mean(bytes_down),
            "peak_bytes_per_sync": max(peaks), "step_s": sum(compute) / steps, "wall_s": time.perf_counter() - started}


def part_grid(jobs: int, quick: bool, cache: Path | None) -> list[dict[str, Any]]:
    """Every row of the grid, `jobs` at a time; with `cache`, each finished row is kept there (one JSON file per
    row and setting) and a rerun takes it from there."""
    rows = grid_rows(quick)
    cached: dict[str, dict[str, Any]] = {}
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for row in rows:
            path = cache / f"{row['label']}-H{H}-r{row['doc']['run']['rounds']}.json"
            if path.exists():
                cached[row["label"]] = json.loads(path.read_text())
    done = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(run_grid_row, [r for r in rows if r["label"] not in cached]):
            if cache is not None:
                (cache / f"{result['label']}-H{H}-r{result['rounds']}.json").write_text(json.dumps(result))
            cached[result["label"]] = result
            print(f"  grid {result['label']:<34} val loss {result['val_loss']:.4f}  up {result['bytes_up_per_round'] / 1e3:7.1f} kB"
                  f"/round  peak {result['peak_bytes_per_sync'] / 1e3:7.1f} kB  ({result['wall_s']:.0f}s)", flush=True)
    done = [cached[r["label"]] for r in rows]
    reference = next(r for r in done if r["label"] == "diloco")
    for r in done:
        r["gap_to_diloco_rel"] = (r["val_loss"] - reference["val_loss"]) / reference["val_loss"]
        r["peak_vs_diloco"] = r["peak_bytes_per_sync"] / reference["peak_bytes_per_sync"]
        r["peak_goal"] = 1.25 / r["fragments"] if r["strategy"] == "streaming-diloco" else None
        fp32 = next((x for x in done if x["fragments"] == r["fragments"] and x["overlap"] == r["overlap"]
                     and x["eager"] == r["eager"] and x["codec"] == "fp32" and x["strategy"] == r["strategy"]
                     and not x.get("outer_lr")), None)
        r["gap_to_fp32_rel"] = ((r["val_loss"] - fp32["val_loss"]) / fp32["val_loss"]
                                if fp32 is not None and r["codec"] != "fp32" else None)
    return done


#: model depths of part "depth": the demo's 2 layers, and deeper stacks of the same width
DEPTHS = (2, 4, 8)


def depth_rows() -> list[dict[str, Any]]:
    """Part "depth": one round of Streaming DiLoCo (τ_o = 1) for P ∈ {1, 2, 4} on the demo's transformer at each of
    DEPTHS layers; the fragments are whole layers, so the peak of one sync falls with P only as far as the largest
    layer allows."""
    rows = []
    for layers in DEPTHS:
        for fragments in (1, 2, 4):
            label = f"depth-L{layers}-P{fragments}"
            doc = grid_config(label, "streaming-diloco", H, {"fragments": fragments, "overlap": 1, "alpha": 0.5},
                              rounds=1)
            doc["workload"]["model_args"]["layers"] = layers
            rows.append({"label": label, "doc": doc, "strategy": "streaming-diloco", "fragments": fragments,
                         "overlap": 1, "eager": False, "codec": "fp32", "layers": layers})
    return rows


def part_depth(jobs: int) -> list[dict[str, Any]]:
    """Peak bytes of one sync against P = 1's (DiLoCo's whole update) at each depth."""
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(run_grid_row, depth_rows()))
    for r in done:
        whole = next(x for x in done if x["layers"] == r["layers"] and x["fragments"] == 1)
        r["peak_vs_diloco"] = r["peak_bytes_per_sync"] / whole["peak_bytes_per_sync"]
        r["peak_goal"] = 1.25 / r["fragments"]
        print(f"  depth {r['label']:<16} peak {r['peak_bytes_per_sync'] / 1e3:8.1f} kB = {r['peak_vs_diloco']:.3f} of the "
              f"whole update (goal ≤ {r['peak_goal']:.3f})", flush=True)
    return done


def predicted_round_s(row: dict[str, Any], cycle_s: float, step_s: float) -> tuple[float, float]:
    """(seconds of a round, of which idle) on the demo's links by the cost model, for a measured exchange cycle and
    inner step: a synchronous strategy waits one cycle a round; a streaming one P exchanges' idle."""
    from crossdc.wan.cost_model import streaming_exchange_idle

    if row["strategy"] != "streaming-diloco":
        return H * step_s + cycle_s, cycle_s
    idle = row["fragments"] * streaming_exchange_idle(cycle_s, step_s, H, row["fragments"], row["overlap"], row["eager"])
    return H * step_s + idle, idle


# ------------------------------------------------------------------------------------------------- deployment


def e2e_config(label: str, params: str, speed: float, rounds: int) -> dict[str, Any]:
    import tomllib

    datacenters = "".join(f'\n[[datacenters]]\nname = "{dc}"\nlink = "transoceanic"\nspeed = {speed:g}\n'
                          for dc in ("us-east", "eu-west"))
    text = (f'[run]\nname = "{label}"\nrounds = {rounds}\nseed = 0\nround_timeout_s = 300\n\n'
            '[workload]\ndataset = "synthetic"\nmodel = "mlp"\npartition = { kind = "iid" }\nbatch_size = 16\n'
            'optimizer = "adamw"\nlr = 0.01\n\n'
            f'[strategy]\nname = "streaming-diloco"\ntau = 100\nparams = {params}\n{datacenters}')
    return tomllib.loads(text)


def measure_deployment(label: str, doc: dict[str, Any], root: Path) -> dict[str, Any]:
    """One deployed run: the trainers' idle and compute per round, its wall time against the slowest datacenter's
    compute, its exchanges' waits."""
    from crossdc.db.engine import make_engine
    from crossdc.db.queries import get_run, list_datacenter_rounds, list_fragment_exchanges, list_rounds
    from crossdc.experiment.config import parse_config
    from crossdc.experiment.processes import free_port
    from crossdc.orchestration.local_run import LocalRunOptions, run_local

    db_url = f"sqlite:///{root / f'{label}.db'}"
    started = time.perf_counter()
    result = run_local(parse_config(doc), LocalRunOptions(db_url=db_url, engine="deployment", superlink_port=free_port(),
                                                          runs_root=root / label))
    total_s = time.perf_counter() - started
    engine = make_engine(db_url)
    try:
        run = get_run(engine, result.run_id)
        rounds = list_rounds(engine, result.run_id)
        dc_rounds = list_datacenter_rounds(engine, result.run_id)
        exchanges = list_fragment_exchanges(engine, result.run_id)
    finally:
        engine.dispose()
    federation_s = sum(r["wall_s"] for r in rounds)
    compute = {dc: sum(r["compute_s"] for r in dc_rounds if r["datacenter"] == dc) for dc in {r["datacenter"] for r in dc_rounds}}
    later = [r for r in dc_rounds if r["round"] > 1]
    idle_later, compute_later = sum(r["idle_s"] for r in later), sum(r["compute_s"] for r in later)
    idle_all = sum(r["idle_s"] for r in dc_rounds)
    waits = [e["idle_s"] for e in exchanges if e["exchange"] > 1 and e["idle_s"] is not None]
    return {"label": label, "run_id": result.run_id, "status": run["status"], "rounds": len(rounds),
            "final_val_loss": rounds[-1]["val_loss"], "startup_s": total_s - federation_s, "federation_wall_s": federation_s,
            "slowest_compute_s": max(compute.values()), "wall_over_compute": federation_s / max(compute.values()),
            "exposed_comm_comp_after_round_1": idle_later / compute_later if compute_later else None,
            "exposed_comm_comp": idle_all / sum(compute.values()),
            "utilisation": sum(compute.values()) / (sum(compute.values()) + idle_all),
            "median_wait_per_exchange_s": statistics.median(waits) if waits else None,
            "step_s": max(compute.values()) / (len(rounds) * int(doc["strategy"]["tau"])),
            "round_wall_s": [round(r["wall_s"], 2) for r in rounds]}


def demo_document() -> dict[str, Any]:
    """The experiment `crossdc demo` runs (the package's demo.toml), as a TOML document."""
    import tomllib

    import crossdc.orchestration

    return tomllib.loads((Path(crossdc.orchestration.__file__).parent / "demo.toml").read_text())


def part_deployment(root: Path, quick: bool) -> list[dict[str, Any]]:
    rounds = 2 if quick else 6
    demo = demo_document()
    # the demo's setting without overlap (P = 1, τ_o = 0, α = 0: DiLoCo's schedule): each exchange waits a whole cycle
    cycle = copy.deepcopy(demo)
    cycle["run"]["rounds"] = 2 if quick else 3
    cycle["strategy"] = {"name": "streaming-diloco", "tau": H, "params": {"fragments": 1, "overlap": 0, "alpha": 0.0}}
    runs = [("e2e-not-overlapped", e2e_config("e2e-not-overlapped", "{ fragments = 2, overlap = 0, alpha = 0.0 }", 0.01, rounds)),
            ("e2e-overlapped", e2e_config("e2e-overlapped", "{ fragments = 2, overlap = 50, alpha = 0.5 }", 0.01, rounds)),
            ("demo-not-overlapped", cycle)]
    if demo["strategy"]["name"] == "streaming-diloco":
        if quick:
            demo["run"]["rounds"] = 2
        runs.append(("demo", demo))
    measured = []
    for label, doc in runs:
        row = measure_deployment(label, doc, root)
        print(f"  deployment {label:<20} exposed comm/comp {row['exposed_comm_comp_after_round_1']:.3f} after round 1, "
              f"utilisation {100 * row['utilisation']:.1f} %, wall {row['federation_wall_s']:.1f}s = "
              f"{row['wall_over_compute']:.3f} × slowest compute, start-up {row['startup_s']:.1f}s", flush=True)
        measured.append(row)
    return measured


# ------------------------------------------------------------------------------------------------- report


def eager_cell(row: dict[str, Any]) -> str:
    """A streaming row's eager column: on/off, and the outer learning rate when it is not the default."""
    return ("on" if row["eager"] else "off") + (f", outer lr {row['outer_lr']}" if row.get("outer_lr") else "")


def markdown(grid: list[dict[str, Any]], deployment: list[dict[str, Any]], cycle_s: float | None,
             step_s: float | None, depth: list[dict[str, Any]] | None = None) -> str:
    lines = []
    if grid:
        measured = cycle_s is not None and step_s is not None
        lines += [f"Grid: demo workload, H = {H}, {grid[0]['rounds']} rounds, α = 0.5; round time on `transoceanic` from the "
                  "cost model with " + (f"an inner step of {step_s:.3f} s and an exchange cycle of {cycle_s:.2f} s, both "
                                        "measured in the demo's setting below" if measured else "— (not measured)"), "",
                  "| strategy | P | τ_o | eager | outer grads | val loss | gap to DiLoCo | vs fp32 | bytes up / round "
                  "| peak / DiLoCo's (goal) | round s (idle) |",
                  "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in grid:
            time_cell = "—"
            if cycle_s is not None and step_s is not None:
                total, idle = predicted_round_s(r, cycle_s, step_s)
                time_cell = f"{total:.2f} ({idle:.2f})"
            goal = f" (≤ {r['peak_goal']:.2f})" if r["peak_goal"] is not None else ""
            vs_fp32 = f"{100 * r['gap_to_fp32_rel']:+.2f} %" if r["gap_to_fp32_rel"] is not None else ""
            streaming = r["strategy"] == "streaming-diloco"
            lines.append(f"| {r['strategy']} | {r['fragments'] if streaming else ''} | {r['overlap'] if streaming else ''} | "
                         f"{eager_cell(r) if streaming else ''} | "
                         f"{r['codec']} | {r['val_loss']:.4f} | "
                         f"{100 * r['gap_to_diloco_rel']:+.2f} % | {vs_fp32} | {r['bytes_up_per_round'] / 1e3:.1f} kB | "
                         f"{r['peak_vs_diloco']:.3f}{goal} | {time_cell} |")
    if deployment:
        lines += ["", "Deployment (Flower's Deployment Engine, every datacenter in its namespace behind its emulated link):", "",
                  "| run | rounds | exposed comm/comp after round 1 | utilisation | wall from the first message | "
                  "wall / slowest compute | start-up | median wait per exchange |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for d in deployment:
            lines.append(f"| {d['label']} | {d['rounds']} | {d['exposed_comm_comp_after_round_1']:.3f} | "
                         f"{100 * d['utilisation']:.1f} % | {d['federation_wall_s']:.1f} s | {d['wall_over_compute']:.3f} | "
                         f"{d['startup_s']:.1f} s | {d['median_wait_per_exchange_s'] or 0:.2f} s |")
    if depth:
        lines += ["", "Depth (peak bytes of one sync against the whole update, the demo's transformer at d_model 64 with "
                  "more layers; fragments are whole layers):", "",
                  "| layers | whole update (kB, fp32) | P = 1 | P = 2 (goal ≤ 0.625) | P = 4 (goal ≤ 0.3125) |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for layers in sorted({r["layers"] for r in depth}):
            of = {r["fragments"]: r for r in depth if r["layers"] == layers}
            lines.append(f"| {layers} | {of[1]['peak_bytes_per_sync'] / 1e3:.1f} | " +
                         " | ".join(f"{of[p]['peak_vs_diloco']:.3f}" for p in (1, 2, 4)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="grid,deployment,depth",
                        help="which parts to run; a part not run keeps its rows from the results file at --out")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("CROSSDC_BENCH_JOBS", "2")),
                        help="in-process experiments run side by side (each on one core)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and rows (a smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "streaming_grid.json"))
    parser.add_argument("--cache", default=None, help="a folder keeping each finished grid row (a rerun skips it)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    started = time.perf_counter()
    kept = json.loads(Path(args.out).read_text()) if Path(args.out).exists() and not args.quick else {}
    grid = (part_grid(args.jobs, args.quick, Path(args.cache) if args.cache else None) if "grid" in parts
            else kept.get("grid", []))
    with tempfile.TemporaryDirectory() as tmp:
        deployment = part_deployment(Path(tmp), args.quick) if "deployment" in parts else kept.get("deployment", [])
    depth = part_depth(args.jobs) if "depth" in parts and not args.quick else kept.get("depth", [])
    waiting = next((d for d in deployment if d["label"] == "demo-not-overlapped"), None)
    cycle_s = waiting["median_wait_per_exchange_s"] if waiting is not None else None
    step_s = waiting["step_s"] if waiting is not None else None
    table = markdown(grid, deployment, cycle_s, step_s, depth)
    result = {"grid_engine": GRID_ENGINE, "deployment_engine": DEPLOYMENT_ENGINE,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "quick": args.quick,
              "date": time.strftime("%Y-%m-%d"), "steps_per_round": H, "grid": grid, "deployment": deployment,
              "depth": depth, "parts_run": sorted(parts),
              "cycle_s": cycle_s, "step_s": step_s, "wall_s": time.perf_counter() - started, "table_markdown": table}
    write_results(args.out, result, table)


if __name__ == "__main__":
    main()
