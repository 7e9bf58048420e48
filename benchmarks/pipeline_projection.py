"""Pipeline split vs synchronous data parallel vs DiLoCo, bytes per step and step time on the same links: the demo
model as measured by benchmarks/pipeline_bench.py, and 1B / 10B transformers projected with the planner
(crossdc.wan.pipeline_plan.compare, whose gloo transport was validated by that benchmark).

Run: python benchmarks/pipeline_projection.py   (seconds; reads benchmarks/results/pipeline.json)
Writes benchmarks/results/pipeline_projection.{json,md} and prints the table.

Assumptions of the projections (stated in the output): a GPT-style transformer of L layers and width d
(12·L·d² parameters), micro-batches of 8 sequences of 2048 tokens in bf16 (activation = 8·2048·d·2 bytes), one
optimizer step of the whole batch (M = 8 micro-batches) computing 6·N·tokens FLOPs on one datacenter of 64 GPUs at
400 TFLOP/s and 40 % MFU; two stages (two datacenters), τ = 100 for DiLoCo; data parallel and DiLoCo hold the whole
model in each datacenter and compute half the batch there; the pipeline runs whichever of GPipe and 1F1B the planner
finds faster on that link (GPipe holds all M micro-batches' activations, 1F1B at most S).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from crossdc.wan.cost_model import LinkSpec
from crossdc.wan.pipeline_plan import PipelinePlan, compare

RESULTS = Path(__file__).with_name("results")
LINKS = (LinkSpec("1 Gbps / 100 ms", 1000.0, 100.0), LinkSpec("10 Gbps / 50 ms", 10000.0, 50.0))
TAU = 100
GPUS, PEAK_FLOPS, MFU = 64, 400e12, 0.4
SEQUENCES, TOKENS, MICROBATCHES = 8, 2048, 8


def projected(name: str, layers: int, width: int) -> dict[str, Any]:
    """A transformer of `layers` × `width`, split in two equal stages (see the module docstring)."""
    params = 12 * layers * width**2
    tokens = SEQUENCES * TOKENS * MICROBATCHES
    return {"model": name, "params": float(params), "stage_params": [params / 2, params / 2],
            "activation_bytes": float(SEQUENCES * TOKENS * width * 2), "microbatches": MICROBATCHES,
            "step_time_s": 6 * params * tokens / (GPUS * PEAK_FLOPS * MFU), "source": "projected"}


def measured_demo() -> dict[str, Any]:
    """The benchmark's char-transformer, 2 stages, from its free-link 1F1B row (compute per step, activation bytes)."""
    rows = json.loads((RESULTS / "pipeline.json").read_text())["rows"]
    row = rows["free-2-1f1b"]
    compute = [float(s) for s in row["stage_compute_per_step_s"]]
    activation = float(row["activation_bytes_per_microbatch"][0]) if isinstance(
        row["activation_bytes_per_microbatch"], list) else float(row["activation_bytes_per_microbatch"])
    # the char-transformer of the benchmark: 6 blocks of d_model 128 (12·d² each), embeddings and head on 65 symbols
    params = 6 * 12 * 128**2 + 2 * 65 * 128 + 64 * 128
    return {"model": "demo char-transformer (measured)", "params": float(params),
            "stage_params": [params / 2, params / 2], "activation_bytes": activation,
            "microbatches": int(row["microbatches"]), "step_time_s": sum(compute), "stage_compute_s": compute,
            "source": "pipeline_bench free-2-1f1b"}


def main() -> None:
    models = [measured_demo(), projected("1B (24 × 1792)", 24, 1792), projected("10B (48 × 4096)", 48, 4096)]
    rows: list[dict[str, Any]] = []
    for model in models:
        for link in LINKS:
            plan = PipelinePlan(stage_params=model["stage_params"], activation_bytes=model["activation_bytes"],
                                microbatches=model["microbatches"], step_time_s=model["step_time_s"], links=[link],
                                schedule="1f1b", stage_compute_s=model.get("stage_compute_s"))
            result = compare(plan, tau=TAU)
            if result.other_schedule_step_s is not None and result.other_schedule_step_s < result.pipeline.step_s:
                result = compare(replace(plan, schedule=result.other_schedule), tau=TAU)  # the faster schedule
            for cost in result.costs:
                rows.append({"model": model["model"], "params": model["params"], "link": link.name,
                             "strategy": cost.name, "step_s": cost.step_s, "wan_bytes_per_step": cost.wan_bytes_per_step,
                             "exposed_comm_s": cost.exposed_comm_s, "winner": cost.name == result.winner,
                             "source": model["source"]})
            rows[-1]["verdict"] = result.verdict

    def size(n: float) -> str:
        return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"

    lines = ["| model | link | strategy | step | WAN bytes / step | exposed comm | |",
             "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['link']} | {row['strategy']} | {row['step_s']:.3g} s | "
                     f"{size(row['wan_bytes_per_step'])} | {row['exposed_comm_s']:.3g} s | "
                     f"{'fastest' if row['winner'] else ''} |")
    table = "\n".join(lines)
    header = ("Pipeline (2 stages, the faster of GPipe and 1F1B, the runtime's gloo transport) vs data parallel vs "
              "DiLoCo (τ = 100) per optimizer step, same batch and links. Demo: compute measured by "
              "benchmarks/pipeline_bench.py; 1B / 10B: projected (12·L·d² parameters; "
              f"{MICROBATCHES} micro-batches of {SEQUENCES}×{TOKENS} tokens, bf16 activations; "
              f"6·N·tokens FLOPs on {GPUS} GPUs at {PEAK_FLOPS / 1e12:g} TFLOP/s, {MFU:.0%} MFU).")
    (RESULTS / "pipeline_projection.md").write_text(header + "\n\n" + table + "\n")
    (RESULTS / "pipeline_projection.json").write_text(json.dumps({"note": header, "rows": rows}, indent=1))
    print(header)
    print(table)


if __name__ == "__main__":
    main()
