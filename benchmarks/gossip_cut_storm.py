"""Gossip exchanges through a storm of link cuts: how long a cut makes a round, and whether it costs anyone else.

Three datacenters (a, b, c), each in its own network namespace, on a mesh of continental links (1 Gbps, 40 ms
round trip) through crossdc's packet-level emulator. Each runs its own process: rounds of exchanges with both
neighbours over crossdc's gossip transport (crossdc.clients.gossip_transport: probe, meeting on the lower index's
store, gloo pair; a 200 kB message each way), one second of idle "compute" between rounds, an exchange timeout of
60 s. Once every datacenter has started, the link a–b is cut (every packet dropped, its TCP connections reset as the
cut starts and ends) for 3 s, `--cuts` times, 4 to 12 s apart (random, seeded). Nothing else fails.

Per row (one seed, with or without the handshake bound): rounds, the failed exchanges of the cut pair, the *stray*
failures (exchanges between other pairs: a cut should cost only its own link; round 1 is left out, where the
datacenters' stores start at once and a probe may come first), and each datacenter's round time (median, 95th
percentile, max: the time a cut holds a round, which is also how long the cut pair's other neighbour waits). With
`--no-handshake-bound` the meeting's handshake gets the whole exchange timeout, as before the bound.

Usage: python benchmarks/gossip_cut_storm.py [--seeds 2 3] [--rounds 60] [--cuts 12] [--no-handshake-bound]
       [--out benchmarks/results/gossip_cut_storm.json]
(needs the namespace emulator: root, or the capabilities of docs/wan.md)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from results_file import merge_rows, write_results

from crossdc.clients import gossip_transport
from crossdc.clients.gossip_replica import FULL, GossipMessage
from crossdc.clients.gossip_transport import GossipTransport, exchange_all
from crossdc.experiment.links import LINK_PROFILES
from crossdc.wan.network import EmulatedNetwork

NAMES = ("a", "b", "c")
CUT_PAIR = ("a", "b")
CUT_S = 3.0
TIMEOUT_S = 60.0
MESSAGE_BYTES = 200_000
COMPUTE_S = 1.0
PORT = 29_400
#: the cuts start once the datacenters have run this long (their stores are up, their rounds going)
SETTLE_S = 15.0


def constant(value: Any) -> Callable[..., Any]:
    """A function of any arguments that returns `value`."""
    return lambda *_: value


def peer(index: int, addresses: dict[int, tuple[str, int]], rounds: int, out: Path, bounded: bool) -> None:
    """One datacenter: `rounds` rounds of exchanges with every other, one line per exchange to `out`."""
    if not bounded:
        gossip_transport.HANDSHAKE_MIN_S = TIMEOUT_S  # handshake_timeout is then the exchange timeout
    transport = GossipTransport(index, addresses, TIMEOUT_S)
    peers = [p for p in addresses if p != index]
    payload = np.zeros(MESSAGE_BYTES, np.uint8)
    with out.open("w") as lines:
        for server_round in range(1, rounds + 1):
            started = time.time()
            message = GossipMessage(index, server_round, FULL, server_round, None, payload)
            outcomes = exchange_all(transport, server_round, peers, constant(message), constant(server_round - 1))
            for other, outcome in outcomes.items():
                lines.write(json.dumps({"round": server_round, "me": index, "peer": other, "start": started,
                                        "end": time.time(), "error": outcome.error}) + "\n")
            lines.flush()
            time.sleep(COMPUTE_S)
    transport.close()


def storm(seed: int, rounds: int, cuts: int, bounded: bool, folder: Path) -> dict[str, Any]:
    """One run (see the module docstring); the row of its figures."""
    rng = random.Random(seed)
    link = LINK_PROFILES["continental"]
    mesh = [(NAMES[i], NAMES[j], link) for i in range(3) for j in range(i + 1, 3)]
    started = time.time()
    cut_times = []
    with EmulatedNetwork([(name, link) for name in NAMES], mesh, folder / "ledgers", state_root=folder / "wan",
                         log_path=folder / "delay-line.log") as net:
        addresses = {i: (net.address(name), PORT + i) for i, name in enumerate(NAMES)}
        processes = []
        for i, name in enumerate(NAMES):
            command = [sys.executable, __file__, "--peer", str(i), json.dumps(addresses), str(rounds),
                       str(folder / f"peer-{i}.jsonl"), "1" if bounded else "0"]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": net.device(name)}
            processes.append(subprocess.Popen(command, preexec_fn=net.preexec(name), env=env,
                                              stderr=(folder / f"peer-{i}.log").open("w")))
        time.sleep(SETTLE_S)
        for _ in range(cuts):
            time.sleep(rng.uniform(4.0, 12.0))
            cut_times.append(time.time())
            net.cut(CUT_S, between=CUT_PAIR)
        for process in processes:
            if process.wait(timeout=rounds * 4 * TIMEOUT_S) != 0:
                raise RuntimeError(f"a datacenter's process failed: see {folder}")
    lines = [json.loads(line) for i in range(3) for line in (folder / f"peer-{i}.jsonl").read_text().splitlines()]
    cut_pair = {NAMES.index(CUT_PAIR[0]), NAMES.index(CUT_PAIR[1])}
    stray = [r for r in lines if r["error"] and {r["me"], r["peer"]} != cut_pair and r["round"] > 1]
    round_s = sorted({(r["me"], r["round"]): r["end"] - r["start"] for r in lines}.values())
    return {"seed": seed, "handshake_bound": bounded, "rounds": rounds, "cuts": len(cut_times),
            "cut_pair_failures": sum(1 for r in lines if r["error"] and {r["me"], r["peer"]} == cut_pair),
            "stray_failures": len(stray), "stray": [[r["round"], r["me"], r["peer"], r["error"]] for r in stray],
            "round_s_median": statistics.median(round_s), "round_s_p95": round_s[int(0.95 * (len(round_s) - 1))],
            "round_s_max": round_s[-1], "rounds_over_20s": sum(1 for s in round_s if s > 20.0),
            "slow_exchanges": [[r["round"], r["me"], r["peer"], round(r["start"] - started, 1),
                                round(r["end"] - r["start"], 1), r["error"]] for r in lines if r["end"] - r["start"] > 20.0],
            "cut_times_s": [round(t - started, 1) for t in cut_times],
            "wall_s": time.time() - started}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| handshake bound | seed | cuts | cut pair's failed exchanges | stray failures | round s median | p95 | max "
           "| rounds > 20 s | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (not r["handshake_bound"], r["seed"])):
        out.append(f"| {'yes' if r['handshake_bound'] else 'no'} | {r['seed']} | {r['cuts']} | {r['cut_pair_failures']} "
                   f"| {r['stray_failures']} | {r['round_s_median']:.1f} | {r['round_s_p95']:.1f} "
                   f"| {r['round_s_max']:.1f} | {r['rounds_over_20s']} | {r['wall_s']:.0f} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        index, addresses, rounds, out, bounded = sys.argv[2:7]
        peer(int(index), {int(k): (host, port) for k, (host, port) in json.loads(addresses).items()}, int(rounds),
             Path(out), bounded == "1")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--cuts", type=int, default=12)
    parser.add_argument("--no-handshake-bound", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/gossip_cut_storm.json")
    args = parser.parse_args()
    started = time.time()
    fresh = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="cut-storm-") as folder:
            fresh.append(storm(seed, args.rounds, args.cuts, not args.no_handshake_bound, Path(folder)))
    rows = merge_rows(args.out, fresh, key=lambda r: (r["seed"], r["handshake_bound"], r["rounds"], r["cuts"]))
    result: dict[str, Any] = {"benchmark": "gossip_cut_storm", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "cpus": os.cpu_count(), "wall_s": time.time() - started, "rows": rows, "table": table(rows)}
    write_results(args.out, result, result["table"])


if __name__ == "__main__":
    main()
