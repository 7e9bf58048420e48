"""Codec throughput: MB/s of fp32 input for encode and decode, beside one memory pass over the tensor.

For each pipeline and size (elements of one fp32 tensor), in a fresh process per size:
- ``encode``: CodecPipeline.encode (error feedback, selection, quantisation, position coding, framing);
- ``decode``: decode_payload (parsing, position decoding, reconstruction, NaN check);
- ``copy``: one read + write pass over the tensor (``torch.clone``): the memory-bandwidth bound;
- ``peak_rss_x``: the process's peak resident memory over the tensor's size (memory is bounded by a small multiple).
Medians of several repetitions. Runs on the GPU as well when one is present (``--device cuda``).

    python benchmarks/codec_throughput.py [--sizes 1e6,1e7,1e8] [--repeat 5] [--device cpu]

Writes ``benchmarks/results/codec_throughput.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PIPELINES = [["int8"], ["topk:0.01"], ["topk:0.01", "int8"], ["qsgd:16"], ["powersgd:4"]]
RESULTS = Path(__file__).parent / "results" / "codec_throughput.json"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure(size: int, repeat: int, device: str) -> list[dict]:
    """Time every pipeline on one tensor of `size` elements (run in its own process)."""
    import torch

    from crossdc.compression.pipeline import CodecPipeline, decode_payload

    torch.manual_seed(0)
    side = 1000
    shape = (size // side, side) if size % side == 0 else (size,)
    x = torch.randn(shape, device=device)
    megabytes = 4 * size / 1e6
    copies = []
    for _ in range(repeat):
        _sync(device)
        started = time.perf_counter()
        x.clone()
        _sync(device)
        copies.append(time.perf_counter() - started)
    copy_mb_s = megabytes / statistics.median(copies)
    rows = []
    for specs in PIPELINES:
        pipeline = CodecPipeline(specs)
        encode_s, decode_s = [], []
        encoded = None
        for r in range(1, repeat + 1):
            _sync(device)
            started = time.perf_counter()
            encoded = pipeline.encode({"w": x}, r)
            _sync(device)
            encode_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            decode_payload(encoded.payload, {"w": shape}, device=device)
            _sync(device)
            decode_s.append(time.perf_counter() - started)
        assert encoded is not None
        rows.append({
            "pipeline": "+".join(specs), "elements": size, "device": device,
            "encode_mb_s": megabytes / statistics.median(encode_s), "decode_mb_s": megabytes / statistics.median(decode_s),
            "encode_s_median": statistics.median(encode_s), "decode_s_median": statistics.median(decode_s),
            "copy_mb_s": copy_mb_s, "ratio": encoded.raw_bytes / encoded.nbytes,
        })
        del pipeline, encoded
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for row in rows:
        row["peak_rss_x"] = peak / (4 * size)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one size and print JSON
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.repeat, args.device)))
        return
    rows: list[dict] = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        done = subprocess.run([sys.executable, __file__, "--one", str(size), "--repeat", str(args.repeat), "--device", args.device],
                              check=True, capture_output=True, text=True)
        rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    import torch

    result = {"machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                          "device": args.device}, "repeat": args.repeat, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| pipeline | elements | encode MB/s | decode MB/s | copy MB/s (bound) | ratio | peak RSS / tensor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['pipeline']} | {row['elements']:.0e} | {row['encode_mb_s']:.0f} | {row['decode_mb_s']:.0f} | "
              f"{row['copy_mb_s']:.0f} | {row['ratio']:.0f}× | {row['peak_rss_x']:.1f} |")


if __name__ == "__main__":
    main()
