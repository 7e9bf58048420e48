"""Times gloo all-reduces between two datacenters' namespaces over the emulated WAN (used by wan_validation.py).

Run by the benchmark as one process per rank, inside the rank's datacenter namespace:

    python benchmarks/allreduce_probe.py RANK MASTER_HOST:PORT SIZE_BYTES[,SIZE_BYTES...] REPEATS

Rank 0 prints one JSON line: for every size, the seconds per all-reduce of a float32 tensor of that many bytes,
each the mean of REPEATS back-to-back all-reduces (the steady state of synchronous data parallel with no compute),
measured REPEATS times after a warm-up (the median is what the benchmark quotes).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank, master, sizes_text, repeats_text = sys.argv[1:5]
    sizes = [int(size) for size in sizes_text.split(",")]
    repeats = int(repeats_text)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=int(rank), world_size=2)
    results = {}
    for size in sizes:
        tensor = torch.ones(max(1, size // 4), dtype=torch.float32)
        dist.all_reduce(tensor)  # warm-up: connections open, TCP windows grown
        dist.all_reduce(tensor)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(repeats):
                dist.all_reduce(tensor)
            samples.append((time.perf_counter() - started) / repeats)
        results[str(size)] = {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples)}
    dist.barrier()
    dist.destroy_process_group()
    if rank == "0":
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
