"""Validate the cost model (`crossdc plan`) against the packet-level WAN emulator, and measure the emulator's ceiling.

Three parts (``--parts``), nothing in the model fitted to any of them (its round-trip counts come from reading
Flower's and gloo's code, so every profile is held out):

- ``flower``: for each link profile, a small real federation (2 datacenters, the Shakespeare char-transformer,
  Flower's Deployment Engine, each datacenter in its own network namespace behind the delay line): the measured
  per-datacenter communication time of a round (comm_s, from the delay line's ledger) against the cost model's
  prediction for the same payload, tensor count and link (``star_round``), from the links alone and with the time
  the two ends spend on a request (``request_s``) measured beforehand on a metro link (2 ms, where the link itself
  costs almost nothing), so the validated profiles stay held out; rounds 1–2 (TCP's window growth on Flower's two
  new connections, not modelled) are reported apart from the later rounds the model is judged on; plus the byte
  cross-check (bytes that crossed the link for the round's messages against the payload crossdc counts: HTTP +
  Flower framing + IP/TCP).
- ``gloo``: for each profile, gloo all-reduces (torch.distributed, what DistributedDataParallel runs) between two
  datacenters' namespaces over a datacenter-to-datacenter link of that profile, several sizes: the measured time
  per all-reduce (back to back, the steady state of synchronous data parallel) against
  ``gloo_ring_allreduce_time`` (and the textbook ring's ``ring_allreduce_time``, for reference); ``--gloo-runs``
  probes per profile, each on a fresh network, with the packets the hops' queues dropped in each.
- ``ceiling``: one bulk TCP stream through an unshaped datacenter → datacenter path (two hops of the delay line) at
  MTU 65,000 and 1,500: the throughput the delay line sustains and the share of a core it uses.

    python benchmarks/wan_validation.py [--parts flower gloo ceiling] [--profiles continental transoceanic constrained]

Writes benchmarks/results/wan_validation.json (with, per part, the host it ran on: kernel, date and the TCP settings
the namespaces inherit) and prints the tables (medians). Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from crossdc.db.engine import make_engine
from crossdc.db.queries import list_datacenter_rounds
from crossdc.experiment.builders import build_workload, initial_model
from crossdc.experiment.config import parse_config
from crossdc.experiment.links import LINK_PROFILES
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRunOptions, run_local
from crossdc.wan.cost_model import (
    StarPlan,
    gloo_ring_allreduce_time,
    ring_allreduce_time,
    star_round,
    uniform_datacenters,
)
from crossdc.wan.ledger import PAYLOAD_PATHS, LedgerReader
from crossdc.wan.network import EmulatedNetwork

HERE = Path(__file__).resolve().parent


def experiment(profile: str, rounds: int) -> dict[str, Any]:
    return {
        "run": {"name": f"wan-validation-{profile}", "rounds": rounds, "seed": 0, "eval_every": rounds, "round_timeout_s": 600},
        "workload": {"dataset": "shakespeare", "model": "char-transformer", "partition": {"kind": "natural"},
                     "batch_size": 16, "optimizer": "adamw", "lr": 3e-3},
        "strategy": {"name": "fedavg", "tau": 2},
        "datacenters": [{"name": "dc-a", "link": profile}, {"name": "dc-b", "link": profile}],
    }


#: rounds whose transfers open Flower's connections (the SuperNode's pool of two): reported apart from the rest
WARM_UP_ROUNDS = 2


def _federation(profile: str, rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]], Path, int]:
    """One small real federation over `profile`: its config, its accepted rows, its run folder and its parameters."""
    config = parse_config(experiment(profile, rounds))
    params = sum(p.numel() for p in initial_model(config, build_workload(config)).state_dict().values())
    tmp = Path(tempfile.mkdtemp(prefix=f"crossdc-wan-{profile}-"))
    db_url = f"sqlite:///{tmp / 'wan.db'}"
    result = run_local(config, LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=tmp / "runs"))
    engine = make_engine(db_url)
    try:
        measured = [r for r in list_datacenter_rounds(engine, result.run_id) if r["status"] == "ok"]
    finally:
        engine.dispose()
    return experiment(profile, rounds), measured, result.run_dir, params


def request_times(ledger: Path) -> dict[str, float]:
    """What the two ends spend on each of Flower's message requests besides the link, read off a ledger: the server's
    time (the request's last data delivered → its response's first data sent) and the client's (a response's last
    data delivered → the next request on that connection sent, when it follows within 0.5 s, i.e. in one phase)."""
    transfers = [t for t in LedgerReader(ledger).window(0.0, float("inf")) if t.path in PAYLOAD_PATHS and t.data]
    by_exchange: dict[str, list[Any]] = {}
    for transfer in transfers:
        by_exchange.setdefault(transfer.exchange, []).append(transfer)
    server, client = [], []
    for exchange, packets in by_exchange.items():
        ups = [t for t in packets if t.direction == "up"]
        downs = [t for t in packets if t.direction == "down"]
        if not ups or not downs:
            continue
        server.append(min(t.entered for t in downs) - max(t.left for t in ups))
        connection, number = exchange.split(".")
        following = by_exchange.get(f"{connection}.{int(number) + 1}")
        if following:
            gap = min(t.entered for t in following if t.direction == "up") - max(t.left for t in downs) \
                if any(t.direction == "up" for t in following) else None
            if gap is not None and 0 <= gap < 0.5:
                client.append(gap)
    return {"server_s": statistics.median(server), "client_s": statistics.median(client) if client else 0.0,
            "exchanges": len(server)}


def flower_rows(profiles: list[str], rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Flower's message pairs: measured comm_s of real rounds against star_round's prediction, from the links alone and
    with the request time measured on a metro link (where the link itself costs almost nothing)."""
    _, _, metro_dir, _ = _federation("metro", rounds)
    per_ledger = [request_times(path) for path in sorted((metro_dir / "logs" / "links").glob("*.ledger"))]
    calibration = {"profile": "metro", "server_s": statistics.median(r["server_s"] for r in per_ledger),
                   "client_s": statistics.median(r["client_s"] for r in per_ledger),
                   "exchanges": sum(r["exchanges"] for r in per_ledger)}
    calibration["request_s"] = calibration["server_s"] + calibration["client_s"]
    print(f"metro: a request costs the two ends {1000 * calibration['request_s']:.1f} ms besides the link "
          f"(server {1000 * calibration['server_s']:.1f} ms, client {1000 * calibration['client_s']:.1f} ms)", flush=True)
    rows = []
    for profile in profiles:
        _, measured, run_dir, params = _federation(profile, rounds)
        # crossdc packs every tensor of a message into one Array (compression/payload.py): T = 1 on the wire
        plan = StarPlan(params=params, datacenters=uniform_datacenters(2, LINK_PROFILES[profile]), step_time_s=0.05,
                        tau=2, tensors=1)
        links_only = star_round(plan).datacenters[0]
        predicted = star_round(replace(plan, request_s=calibration["request_s"])).datacenters[0]
        # Flower's SuperNode keeps a pool of FLOWER_OBJECT_CONCURRENCY connections; the model's first crossing of each
        # pays TCP's window growth, which the cost model leaves out: rounds 1–2 are reported on their own, and the
        # later rounds (every connection warm, the steady state the model describes) are what it is judged on
        comm = [float(r["comm_s"]) for r in measured if r["round"] > WARM_UP_ROUNDS]
        first = [float(r["comm_s"]) for r in measured if r["round"] <= WARM_UP_ROUNDS]
        framing_up = [r["link_bytes_up"] / r["bytes_up"] - 1 for r in measured]
        framing_down = [r["link_bytes_down"] / r["bytes_down"] - 1 for r in measured]
        row = {
            "profile": profile, "bandwidth_mbps": LINK_PROFILES[profile].bandwidth_mbps, "rtt_ms": LINK_PROFILES[profile].rtt_ms,
            "params": params, "round_trips_predicted": predicted.round_trips,
            "comm_s_predicted": predicted.comm_s, "comm_s_predicted_links_only": links_only.comm_s,
            "comm_s_measured_median": statistics.median(comm),
            "comm_s_measured_min": min(comm), "comm_s_measured_max": max(comm), "samples": len(comm),
            "error_rel": statistics.median(comm) / predicted.comm_s - 1,
            "error_rel_links_only": statistics.median(comm) / links_only.comm_s - 1,
            "comm_s_first_rounds_median": statistics.median(first), "first_rounds": WARM_UP_ROUNDS,
            "error_rel_first_rounds": statistics.median(first) / predicted.comm_s - 1,
            "request_s_here": statistics.median(here["server_s"] + here["client_s"] for here in (
                request_times(path) for path in sorted((run_dir / "logs" / "links").glob("*.ledger")))),
            "bytes_up_median": statistics.median(r["bytes_up"] for r in measured),
            "framing_overhead_up": statistics.median(framing_up), "framing_overhead_down": statistics.median(framing_down),
            "run_id": run_dir.name,
        }
        rows.append(row)
        print(f"{profile}: predicted {row['comm_s_predicted']:.2f}s ({row['comm_s_predicted_links_only']:.2f}s from the links "
              f"alone), measured median {row['comm_s_measured_median']:.2f}s", flush=True)
    return calibration, rows


GLOO_SIZES = (4096, 1024 * 1024, 8 * 1024 * 1024)
PROBE = HERE / "allreduce_probe.py"


def gloo_probe(link: Any, repeats: int) -> tuple[dict[str, Any], int, int]:
    """One probe on a fresh emulated network: (per size, the probe's seconds per all-reduce), and the packets the
    link's tail-drop queues refused and carried over the whole probe (warm-ups and every size)."""
    with tempfile.TemporaryDirectory() as tmp, EmulatedNetwork([("dc-a", None), ("dc-b", None)], [("dc-a", "dc-b", link)],
                                                               Path(tmp)) as net:
        master = f"{net.address('dc-a')}:29500"
        sizes = ",".join(str(size) for size in GLOO_SIZES)
        ranks = [subprocess.Popen([sys.executable, str(PROBE), str(rank), master, sizes, str(repeats)],
                                  env={"GLOO_SOCKET_IFNAME": net.device(dc), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                                  preexec_fn=net.preexec(dc), stdout=subprocess.PIPE, text=True)
                 for rank, dc in enumerate(("dc-a", "dc-b"))]
        output = ranks[0].communicate(timeout=1800)[0]
        ranks[1].wait(timeout=60)
        hops = net.stats()["hops"]
    return (json.loads(output.strip().splitlines()[-1]), sum(hop["dropped_queue"] for hop in hops.values()),
            sum(hop["packets"] for hop in hops.values()))


def gloo_rows(profiles: list[str], repeats: int, runs: int) -> list[dict[str, Any]]:
    """gloo all-reduces between two namespaces over a mesh link of each profile, against the gloo ring model: `runs`
    probes per profile, each on a fresh emulated network (TCP's losses at the hop's queue vary from one to the next);
    the row's measurement is the median of the probes' medians, its min and max over every timed loop."""
    rows = []
    for profile in profiles:
        link = LINK_PROFILES[profile]
        probes = [gloo_probe(link, repeats) for _ in range(runs)]
        for size in GLOO_SIZES:
            samples = [measured[str(size)] for measured, _, _ in probes]
            median = statistics.median(sample["median_s"] for sample in samples)
            predicted = gloo_ring_allreduce_time(size, 2, link.bandwidth_mbps, link.rtt_ms)
            rows.append({"profile": profile, "bandwidth_mbps": link.bandwidth_mbps, "rtt_ms": link.rtt_ms, "bytes": size,
                         "measured_s_median": median, "measured_s_min": min(sample["min_s"] for sample in samples),
                         "measured_s_max": max(sample["max_s"] for sample in samples),
                         "run_medians_s": [sample["median_s"] for sample in samples],
                         "predicted_s": predicted, "error_rel": median / predicted - 1,
                         "run_errors_rel": [sample["median_s"] / predicted - 1 for sample in samples],
                         "textbook_ring_s": ring_allreduce_time(size, 2, link.bandwidth_mbps, link.rtt_ms),
                         "run_queue_drops": [drops for _, drops, _ in probes], "run_packets": [packets for _, _, packets in probes]})
            runs = ", ".join(f"{sample['median_s']:.3f}" for sample in samples)
            print(f"gloo {profile} {size} B: predicted {predicted:.3f}s, measured {median:.3f}s (runs: {runs})", flush=True)
    return rows


BULK_RECEIVER = """
import socket, sys, time
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], 7000)); server.listen()
print("listening", flush=True)
connection, _ = server.accept(); received, first = 0, None
while True:
    data = connection.recv(1 << 20)
    if not data:
        break
    first = first or time.perf_counter()
    received += len(data)
print(received * 8 / (time.perf_counter() - first) / 1e6, flush=True)
"""
BULK_SENDER = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 7000)); data = b"x" * (1 << 20)
for _ in range(int(sys.argv[2])):
    connection.sendall(data)
connection.close()
"""


def ceiling_rows(megabytes: int = 400) -> list[dict[str, Any]]:
    """The delay line's throughput and CPU share for one TCP stream through two unshaped hops, at two MTUs."""
    rows = []
    for mtu, size in ((65_000, megabytes), (1_500, max(20, megabytes // 16))):
        with tempfile.TemporaryDirectory() as tmp, EmulatedNetwork([("dc-a", None), ("dc-b", None)], [], Path(tmp), mtu=mtu) as net:
            receiver = subprocess.Popen([sys.executable, "-c", BULK_RECEIVER, net.address("dc-b")], preexec_fn=net.preexec("dc-b"),
                                        stdout=subprocess.PIPE, text=True)
            assert receiver.stdout is not None
            receiver.stdout.readline()
            cpu_before, started = net.stats()["cpu_s"], time.perf_counter()
            subprocess.run([sys.executable, "-c", BULK_SENDER, net.address("dc-b"), str(size)], preexec_fn=net.preexec("dc-a"),
                           check=True, timeout=600)
            mbps = float(receiver.communicate(timeout=60)[0].strip())
            cpu_share = (net.stats()["cpu_s"] - cpu_before) / (time.perf_counter() - started)
        rows.append({"mtu": mtu, "megabytes": size, "throughput_mbps": mbps, "delay_line_cpu_share": cpu_share})
        print(f"ceiling at MTU {mtu}: {mbps:.0f} Mbps, delay line {100 * cpu_share:.0f}% of a core", flush=True)
    return rows


HOST_SETTINGS = ("net.ipv4.tcp_congestion_control", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.wmem_max",
                 "net.ipv4.tcp_slow_start_after_idle")


def host_facts() -> dict[str, Any]:
    """The machine's kernel and the TCP settings every namespace inherits: TCP's windows and losses (not the
    emulator) decide the cases the model leaves out, and these differ between machines."""
    facts: dict[str, Any] = {"kernel": os.uname().release, "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    for name in HOST_SETTINGS:
        path = Path("/proc/sys") / name.replace(".", "/")
        facts[name] = " ".join(path.read_text().split()) if path.exists() else None
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["ceiling", "gloo", "flower"], choices=["ceiling", "gloo", "flower"])
    parser.add_argument("--profiles", nargs="+", default=["continental", "transoceanic", "constrained"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="gloo: timed loops per size, each of this many all-reduces")
    parser.add_argument("--gloo-runs", type=int, default=3, help="gloo: probes per profile, each on a fresh network")
    parser.add_argument("--out", default=str(HERE / "results" / "wan_validation.json"))
    args = parser.parse_args()
    out = Path(args.out)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}  # the parts not run now are kept
    result.update({"note": "nothing fitted: every profile is held out", "machine_cores": os.cpu_count()})
    result.setdefault("host", {})
    if "ceiling" in args.parts:
        result["ceiling"] = ceiling_rows()
        result["host"]["ceiling"] = host_facts()
    if "gloo" in args.parts:
        result["gloo"] = gloo_rows(args.profiles, args.repeats, args.gloo_runs)
        result["host"]["gloo"] = host_facts()
    if "flower" in args.parts:
        result["request_calibration"], result["rows"] = flower_rows(args.profiles, args.rounds)
        result["host"]["flower"] = host_facts()
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(f"written to {args.out}")


def print_tables(result: dict[str, Any]) -> None:
    for c in result.get("ceiling", []):
        print(f"ceiling  MTU {c['mtu']:>6}: {c['throughput_mbps']:8.0f} Mbps, delay line {100 * c['delay_line_cpu_share']:.0f}% of a core")
    if result.get("gloo"):
        print(f"\n{'gloo all-reduce':<16}{'bytes':>10}{'predicted s':>13}{'measured s (min–max)':>24}{'error':>8}{'textbook ring s':>17}")
        for g in result["gloo"]:
            span = f"{g['measured_s_median']:.3f} ({g['measured_s_min']:.3f}–{g['measured_s_max']:.3f})"
            runs = ", ".join(f"{100 * error:+.0f}%" for error in g.get("run_errors_rel", []))
            print(f"{g['profile']:<16}{g['bytes']:>10}{g['predicted_s']:>13.3f}{span:>24}{100 * g['error_rel']:>7.0f}%"
                  f"{g['textbook_ring_s']:>17.3f}   runs: {runs}  queue drops: {g.get('run_queue_drops')}")
    rows = result.get("rows", [])
    if not rows:
        return
    calibration = result.get("request_calibration")
    if calibration:
        print(f"\nrequest time (metro calibration): {1000 * calibration['request_s']:.1f} ms "
              f"(server {1000 * calibration['server_s']:.1f}, client {1000 * calibration['client_s']:.1f})")
    print(f"\n{'profile':<14}{'link':>18}{'links only s':>14}{'model s':>9}{'measured s (min–max)':>24}{'error':>8}"
          f"{'links only':>12}{'rounds 1–2':>12}{'framing up/down':>18}")
    for r in rows:
        link = f"{r['bandwidth_mbps']:g} Mbps/{r['rtt_ms']:g} ms"
        span = f"{r['comm_s_measured_median']:.2f} ({r['comm_s_measured_min']:.2f}–{r['comm_s_measured_max']:.2f})"
        print(f"{r['profile']:<14}{link:>18}{r.get('comm_s_predicted_links_only', float('nan')):>14.2f}"
              f"{r['comm_s_predicted']:>9.2f}{span:>24}{100 * r['error_rel']:>7.0f}%"
              f"{100 * r.get('error_rel_links_only', float('nan')):>11.0f}%{100 * r.get('error_rel_first_rounds', float('nan')):>11.0f}%"
              f"{100 * r['framing_overhead_up']:>8.1f}%/{100 * r['framing_overhead_down']:.1f}%")

if __name__ == "__main__":
    main()
