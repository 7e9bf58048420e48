"""The WAN benchmark: crossdc side by side with single-datacenter training, synchronous data parallel and plain Flower.

Setting: Shakespeare char-transformer (2 layers, d_model 64, 4 heads, context 64; 117k parameters), 4 datacenters
with the natural non-IID partition (whole plays), batch 32 per datacenter, inner AdamW with the same recipe for every
row (gradient clipping at 1.0, warm-up over 5 % of the steps, cosine decay to a tenth of the learning rate), every
datacenter on the `transoceanic` link profile (100 Mbps, 150 ms RTT; every datacenter pair too, for gossip and
synchronous data parallel). Budget: the same number of gradient computations for every method — STEPS local steps
of batch 32 per datacenter (2,000 in the full size: 40 rounds at τ = 50, 2,000 rounds at τ = 1), 4 × STEPS batches in
all (the asynchronous row: 4 × STEPS / τ updates of τ steps, whoever computes them). Two DiLoCo rows ("-short")
synchronise every Size.short_tau steps instead (200 rounds at τ = 10), for 5× the rounds of the τ = 50 rows.

Tuned settings: benchmarks/wan_tuning.py sweeps each family's key hyper-parameter on this budget (three settings
each) and writes wan_tuning[-size].json; this benchmark reads the chosen settings (the JSON's `tuning` says which,
or that none were found and the defaults ran).

How each row runs (the table's "how run" column):
- **deployed**: `crossdc run` on Flower's Deployment Engine, each datacenter's SuperNode and trainer in its own
  network namespace behind the packet-level emulator's links (Size.deployed lists these rows, at most 6): times,
  bytes, compute, idle from the run log (the delay line's ledger and the trainers' own clocks), start-up left out.
  All four trainers share this machine's two cores, so their compute is about twice an in-process row's.
- **in-process**: crossdc's real trainers, codecs, update gate and strategies in one process
  (crossdc.testing.inprocess), Flower's transport left out; bytes are the serialised messages both ways, and the
  time is each datacenter's measured compute plus its link time from the cost model (Flower 1.42's message pairs
  over the link), the round lasting as long as the slowest datacenter, plus the platform's own time. A calibration
  row (DiLoCo) runs both ways; the JSON's `calibration` says by how much the two differ.
- **simulation**: an asynchronous row not deployed at this size runs in Flower's simulation engine (`crossdc run
  --engine simulation`); its time is the run log's.
- **Flower** (deployed too): Flower's own FedAvg (flwr.serverapp.strategy.FedAvg, unchanged) with a plain ClientApp
  (crossdc.testing.flower_baseline), submitted with `flwr run` to Flower's Deployment Engine: Flower's own
  `flower-supernode` in each datacenter's namespace behind the same emulated links. It writes no run log: its rounds
  come from its ServerApp (per-round wall clock, the clients' compute and message sizes), its link seconds from the
  delay line's ledger, read as crossdc's run log reads it.
- **baselines**: `all-workers` (one datacenter with the 4 datacenters' workers: batch 128, STEPS steps; compute
  time = measured / 4, the intra-datacenter all-reduce taken as free) and `sequential` (one worker, batch 32,
  4 × STEPS steps), in-process.
- **sync-dp**: synchronous data parallel measured: `crossdc run --baseline sync-dp` (DDP on gloo, each datacenter a
  rank in its namespace, every pair on a transoceanic link) runs a stretch of Size.sync_dp_rounds rounds of
  Size.sync_dp_tau steps; the per-step WAN time and bytes of the rounds after the first are extrapolated to the
  budget's steps (a measured stretch extrapolated per step, not the whole budget). Its training curve is the
  all-workers baseline's (4 datacenters' batch-32 gradients averaged are one step on their 128 examples).

Seeds: the two best crossdc rows and the all-workers baseline run Size.seeds seeds (median and range in the table);
the other rows one seed (0). The extra seeds of a deployed synchronous row run in-process (the same weights as
deployed, as the calibration shows): they give the loss's spread, not times.

Columns beyond loss and bytes: trainer utilisation (compute / (compute + idle), the least over datacenters), exposed
comm/comp (idle / compute over all datacenters), peak bytes per sync (the largest message one datacenter sent in
one synchronisation), time to the all-workers baseline's final loss. The `goals` list in the JSON holds the four
goals (loss_gap, bytes_ratio, wall_over_compute, beats_flower), each for the row that does best on it, and
`pareto_front` the rows no other federated row beats on loss, bytes and time together.

Usage: make bench-wan, or python benchmarks/wan_benchmark.py [--size full|medium|tiny] [--jobs 2] [--out DIR]
[--report-only: remake the report from the last run's wan_benchmark-raw[-size].json, running nothing]
[--rerun ROW ...: measure these rows (or add new ones) in place of the last run's, keep the others; the report says
so]
Writes wan_benchmark[-size].json, .md and .html (plotly: validation loss vs bytes and vs time, the Pareto front).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from results_file import write_results

from crossdc.experiment.config import parse_config
from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.orchestration.baselines import run_baseline
from crossdc.strategies.registry import strategy_class
from crossdc.strategies.schedule import tau_for_round
from crossdc.testing.flower_baseline import FlowerBaselineError, run_flower_fedavg
from crossdc.testing.inprocess import InProcessFederation
from crossdc.wan.cost_model import (
    CROSSDC_RECORDS_PER_MESSAGE,
    StarPlan,
    link_message_pair_time,
    ring_allreduce_time,
    star_round,
    sync_dp_step,
    uniform_datacenters,
)

RESULTS = Path(__file__).resolve().parent / "results"
DATACENTERS = ("us-east", "eu-west", "ap-south", "sa-east")
PROFILE = "transoceanic"
BATCH = 32
ADAMW_LR = 3e-3
SGD_LR = 0.3
#: DiLoCo's outer step before tuning (the one the medium-size benchmarks used)
DILOCO = {"outer_lr": 0.7, "outer_momentum": 0.5}
#: SparseLoCo before tuning: chunked top-k k of every 4096 values, outer learning rate
SPARSELOCO = {"chunk_k": 64, "outer_lr": 1.0, "decay": 0.95}
#: the SparseLoCo settings that configure its uplink codec (the rest are the strategy's parameters)
SPARSELOCO_CODEC_KEYS = ("chunk_k", "decay", "nesterov")
#: the asynchronous row: this datacenter computes 4× slower than the others
SLOW_DATACENTER = "sa-east"
SLOW_SPEED = 0.25
#: the mission's scale, for the projection column: a 1B-parameter model whose step takes 2 s
PROJECTED_PARAMS = 1_000_000_000
PROJECTED_STEP_S = 2.0
#: rows without WAN traffic or not crossdc's: what the crossdc rows are compared with
REFERENCE_KEYS = ("all-workers", "sequential", "sync-dp", "flower-fedavg")
#: the thresholds of the JSON's goals
GOAL_THRESHOLDS = {"loss_gap": 0.01, "bytes_ratio": 1000.0, "wall_over_compute": 1.05, "beats_flower": 1.0}
#: the rows run on the Deployment Engine at the full size: Flower's FedAvg (deployed at every size), the best of each
#: family and the asynchronous row (6 in all)
DEPLOYED_FULL = ("flower-fedavg", "diloco", "streaming-diloco-int4", "sparseloco", "gossip", "fedbuff-slow")


@dataclass(frozen=True)
class Size:
    """How long the benchmark runs: local steps per datacenter, τ, warm-ups, evaluation, what is deployed, seeds."""

    steps: int
    tau: int
    tau_warmup_start: int
    tau_warmup_rounds: int
    dgc_warmup_rounds: int
    eval_every_steps: int
    #: the sync-dp row's measured stretch: rounds of sync_dp_tau steps (the first is warm-up, left out)
    sync_dp_rounds: int = 4
    sync_dp_tau: int = 5
    #: rows run on the Deployment Engine over the namespace emulator (the others in-process)
    deployed: tuple[str, ...] = DEPLOYED_FULL
    #: seeds of the two best crossdc rows and of the all-workers baseline (the other rows: seed 0)
    seeds: int = 3
    #: deployed rows and the sync-dp stretch run alone (they time the WAN); False: beside the others (a smoke test)
    deployed_alone: bool = True
    #: the τ of the rows that synchronise more often than Size.tau (the DiLoCo rows "-short")
    short_tau: int = 10


SIZES = {
    "full": Size(steps=2000, tau=50, tau_warmup_start=10, tau_warmup_rounds=4, dgc_warmup_rounds=100,
                 eval_every_steps=200),
    #: the budget of the WAN benchmark until 2026-12-04 (16 rounds at τ = 50), kept by the benchmarks that studied it
    "medium": Size(steps=800, tau=50, tau_warmup_start=10, tau_warmup_rounds=4, dgc_warmup_rounds=100,
                   eval_every_steps=50),
    "tiny": Size(steps=2, tau=2, tau_warmup_start=2, tau_warmup_rounds=0, dgc_warmup_rounds=1, eval_every_steps=2,
                 sync_dp_rounds=2, sync_dp_tau=2, deployed=("diloco",), seeds=2, deployed_alone=False, short_tau=1),
}


@dataclass(frozen=True)
class Method:
    """One row of the table: how it trains and what crosses the WAN."""

    key: str
    label: str
    engine: str  # "crossdc" (deployed or in-process, as the size says), "flower" (plain Flower, always deployed)
    strategy: str = "fedavg"
    params: dict[str, Any] = field(default_factory=dict)
    #: "fixed" (Size.tau), "warmup" (Size.tau_warmup_start → Size.tau), "one" (τ = 1), "short" (Size.short_tau)
    tau: str = "fixed"
    codecs: tuple[str, ...] = ()
    downlink_codecs: tuple[str, ...] = ()
    optimizer: str = "adamw"
    #: the inner learning rate
    lr: float = ADAMW_LR
    #: datacenter → compute speed (1/speed times as long a step) for the datacenters not at full speed
    speeds: dict[str, float] = field(default_factory=dict)
    #: the rounds that spend the budget, when they are not those of the τ schedule (the asynchronous row's versions)
    rounds: int | None = None

    @property
    def loop(self) -> str:
        """The loop the strategy declares (sync, async, streaming, gossip)."""
        return strategy_class(self.strategy).loop

    @property
    def asynchronous(self) -> bool:
        """The strategy runs the asynchronous loop (not in-process: deployed, or in the simulation engine)."""
        return self.loop == "async"


def inner_recipe(lr: float, size: Size) -> dict[str, Any]:
    """The [workload] keys every row trains with: the learning rate, clipping at 1.0, a warm-up over 5 % of the
    budget's steps, then a cosine decay to a tenth of the learning rate."""
    return {"lr": lr, "grad_clip": 1.0,
            "schedule": {"kind": "cosine", "warmup_steps": size.steps // 20, "min_lr": lr / 10}}


def tuning_path(size_name: str, out: Path = RESULTS) -> Path:
    """Where benchmarks/wan_tuning.py writes the settings it chose for size `size_name`."""
    return out / ("wan_tuning.json" if size_name == "full" else f"wan_tuning-{size_name}.json")


def read_tuning(size_name: str) -> tuple[dict[str, dict[str, Any]], str]:
    """The tuned settings for this size (family → setting) and where they come from."""
    path = tuning_path(size_name)
    if not path.exists():
        return {}, f"defaults: no tuning results at {path.relative_to(RESULTS.parent.parent)}"
    data = json.loads(path.read_text())
    return data["chosen"], f"{path.relative_to(RESULTS.parent.parent)} ({data.get('date', 'undated')})"


def momentum_warmup_rounds(size: Size, tau: int) -> int:
    """The rounds over which a DiLoCo-family row's outer momentum rises to its value: half of a τ = `tau` run's."""
    return size.steps // tau // 2


def method_catalogue(size: Size, tuned: dict[str, dict[str, Any]] | None = None) -> dict[str, Method]:
    """Every federated row, in table order, with the tuned settings (family → setting, see wan_tuning.py) applied."""
    tuned = tuned or {}
    fedavg_lr = float(tuned.get("fedavg", {}).get("lr", ADAMW_LR))
    # every DiLoCo-family row warms its outer momentum up over the first half of its rounds (the tuning sweeps the
    # pair with it); measured at τ = 50: the paper's (0.7, 0.9) 1.719 without, 1.614 over 10 of 40, 1.586 over 20
    outer = {**DILOCO, "outer_momentum_warmup_rounds": momentum_warmup_rounds(size, size.tau), **tuned.get("diloco", {})}
    # the same outer step at τ = Size.short_tau, warmed up over half of its (more) rounds; measured on the tau probe
    # (benchmarks/wan_tau_probe.py, seed 0): 1.540 at τ = 10, 1.561 at τ = 25, 1.586 at τ = 50
    outer_short = {**outer, "outer_momentum_warmup_rounds": momentum_warmup_rounds(size, size.short_tau)}
    sparse = {**SPARSELOCO, **tuned.get("sparseloco", {})}
    outer_text = f"outer Nesterov ({outer['outer_lr']:g}, {outer['outer_momentum']:g})"
    streaming = {"fragments": 2, "overlap": max(1, size.tau // 2), "alpha": 0.5, **outer}
    nesterov = float(sparse.get("nesterov", 0.0))  # the chunked top-k's own Nesterov momentum (0: none)
    sparse_codecs = (f"chunk-topk:{int(sparse['chunk_k'])}:decay={float(sparse['decay']):g}"
                     + (f":nesterov={nesterov:g}" if nesterov else ""), "int2")
    # down: the mean of 4 datacenters' selections has at most 4 k entries per chunk; 4-bit values (the reference's
    # error feedback carries what the rounding leaves to the next round)
    sparse_down = (f"chunk-topk:{4 * int(sparse['chunk_k'])}", "int4")
    updates = len(DATACENTERS) * size.steps // size.tau  # the asynchronous row's budget: τ-step updates in all
    catalogue = [
        Method("flower-fedavg", f"Flower FedAvg (unchanged, plain client), τ = {size.tau}", "flower", lr=fedavg_lr),
        Method("fedavg-warmup", f"crossdc FedAvg, τ warm-up {size.tau_warmup_start} → {size.tau}", "crossdc",
               tau="warmup", lr=fedavg_lr),
        Method("diloco", f"crossdc DiLoCo ({outer_text}), τ = {size.tau}", "crossdc", "diloco", outer),
        Method("diloco-int8", f"crossdc DiLoCo + int8 (up and down), τ = {size.tau}", "crossdc", "diloco", outer,
               codecs=("int8",), downlink_codecs=("int8",)),
        Method("diloco-short", f"crossdc DiLoCo ({outer_text}), τ = {size.short_tau}", "crossdc", "diloco", outer_short,
               tau="short"),
        Method("diloco-int8-short", f"crossdc DiLoCo + int8 (up and down), τ = {size.short_tau}", "crossdc", "diloco",
               outer_short, tau="short", codecs=("int8",), downlink_codecs=("int8",)),
        Method("streaming-diloco", f"crossdc Streaming DiLoCo (P = 2, τ_o = {streaming['overlap']}, α = 0.5), fp32, "
               f"H = {size.tau}", "crossdc", "streaming-diloco", streaming),
        Method("streaming-diloco-int4", f"crossdc Streaming DiLoCo as above, 4-bit outer gradients, H = {size.tau}",
               "crossdc", "streaming-diloco", streaming, codecs=("int4",)),
        Method("sparseloco", f"crossdc SparseLoCo (chunk top-k {int(sparse['chunk_k'])}/4096 + 2-bit up, "
               f"{4 * int(sparse['chunk_k'])}/4096 + 4-bit down, outer lr {sparse['outer_lr']:g}), τ = {size.tau}",
               "crossdc", "sparseloco", {k: v for k, v in sparse.items() if k not in SPARSELOCO_CODEC_KEYS}, codecs=sparse_codecs,
               downlink_codecs=sparse_down),
        Method("gossip", f"crossdc gossip (random pairs, {outer_text}), τ = {size.tau}", "crossdc", "gossip",
               {"topology": "random-pairs", "nesterov": True, **outer}),
        Method("fedbuff-slow", f"crossdc FedBuff (K = 4, staleness ≤ 4), {SLOW_DATACENTER} 4× slower, τ = {size.tau}",
               "crossdc", "fedbuff", {"max_staleness": 4}, lr=fedavg_lr, speeds={SLOW_DATACENTER: SLOW_SPEED},
               rounds=max(1, updates // len(DATACENTERS))),
        Method("fedavg-dgc", f"crossdc FedAvg τ = 1 + DGC (top-k 1 % warm-up {size.dgc_warmup_rounds} + int8 up; "
               "top-k 4 × that + int8 down)", "crossdc", tau="one", lr=fedavg_lr,
               codecs=(f"topk:0.01:warmup={size.dgc_warmup_rounds}", "int8"),
               downlink_codecs=(f"topk:0.04:warmup={size.dgc_warmup_rounds}:warmup_start=1.0", "int8")),
    ]
    return {m.key: m for m in catalogue}


def methods(size: Size, tuned: dict[str, dict[str, Any]] | None = None) -> list[Method]:
    """The federated rows, in table order."""
    return list(method_catalogue(size, tuned).values())


def tau_spec(method: Method, size: Size) -> int | dict[str, int]:
    if method.tau == "one":
        return 1
    if method.tau == "warmup":
        return {"start": size.tau_warmup_start, "end": size.tau, "warmup_rounds": size.tau_warmup_rounds}
    if method.tau == "short":
        return size.short_tau
    return size.tau


def rounds_for_budget(tau: int | dict[str, int], steps: int) -> int:
    """The number of rounds whose τ add up to exactly `steps` local steps (ValueError if none does)."""
    schedule = tau if isinstance(tau, dict) else {"start": tau, "end": tau, "warmup_rounds": 0}
    done, rounds = 0, 0
    while done < steps:
        rounds += 1
        done += tau_for_round(rounds, schedule["start"], schedule["end"], schedule["warmup_rounds"])
    if done != steps:
        raise ValueError(f"τ schedule {schedule} cannot spend exactly {steps} steps (round {rounds} ends at {done})")
    return rounds


def method_rounds(method: Method, size: Size) -> int:
    """The rounds (the asynchronous row: versions) that spend the budget."""
    return method.rounds if method.rounds is not None else rounds_for_budget(tau_spec(method, size), size.steps)


def experiment(method: Method, size: Size, rounds: int, inner: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    """The experiment config (crossdc's config document) of a federated row; `inner`: more [workload] keys (the inner
    optimizer's learning rate, betas, grad_clip, schedule...)."""
    return {
        "run": {"name": f"wan-{method.key}", "rounds": rounds, "seed": seed},
        "workload": {"dataset": "shakespeare", "model": "char-transformer",
                     "model_args": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64},
                     "partition": {"kind": "natural"}, "batch_size": BATCH, "optimizer": method.optimizer,
                     "lr": SGD_LR if method.optimizer == "sgd" else method.lr, **(inner or {})},
        "strategy": {"name": method.strategy, "tau": tau_spec(method, size), "params": dict(method.params)},
        "compression": {"codecs": list(method.codecs), "downlink_codecs": list(method.downlink_codecs)},
        "datacenters": [{"name": name, **({"speed": method.speeds[name]} if name in method.speeds else {})}
                        for name in DATACENTERS],
    }


def budget_experiment(method: Method, size: Size, seed: int = 0) -> dict[str, Any]:
    """A row's training config: the rounds that spend the budget and the inner recipe at the row's learning rate."""
    return experiment(method, size, method_rounds(method, size), inner_recipe(method.lr, size), seed)


def row_experiment(method: Method, size: Size, seed: int = 0) -> dict[str, Any]:
    """A row's whole config: :func:`budget_experiment`, evaluation every Size.eval_every_steps local steps (a run's
    rounds), and the emulated links a local run puts its datacenters behind (each datacenter's own, and every pair
    for the modes that connect datacenters)."""
    doc = budget_experiment(method, size, seed)
    if method.asynchronous:
        per_version = size.tau  # a version: K = 4 updates, one datacenter's τ steps each, i.e. τ per datacenter
    else:
        per_version = max(1, size.steps // doc["run"]["rounds"])
    doc["run"].update(eval_every=max(1, size.eval_every_steps // per_version), round_timeout_s=900)
    for datacenter in doc["datacenters"]:
        datacenter["link"] = PROFILE
    if method.strategy == "gossip":
        doc["links"] = [{"between": [a, b], "profile": PROFILE}
                        for i, a in enumerate(DATACENTERS) for b in DATACENTERS[i + 1:]]
    return doc


# ----------------------------------------------------------------------------- engines


class RowFailed(RuntimeError):
    """A row's training broke down (a datacenter's update refused, NaN): the rounds it completed are kept."""

    def __init__(self, reason: str, rounds: list[dict[str, Any]]) -> None:
        super().__init__(reason)
        self.rounds = rounds


def drive_crossdc(doc: dict[str, Any], root: Path, eval_every_steps: int) -> list[dict[str, Any]]:
    """Every round in-process; per round: τ, per-datacenter compute and bytes, the platform's time; loss at eval points.
    RowFailed (with the completed rounds) when a round cannot complete or a datacenter's update is refused."""
    fed = InProcessFederation.from_config(parse_config(doc), root)
    gossip = fed.strategy.loop == "gossip"
    rows: list[dict[str, Any]] = []
    steps = 0
    for server_round in range(1, doc["run"]["rounds"] + 1):
        started = time.perf_counter()
        try:
            result = fed.run_round()
        except Exception as err:  # noqa: BLE001 - any breakdown ends this row, not the benchmark
            raise RowFailed(f"round {server_round}: {type(err).__name__}: {err}", rows) from err
        wall = time.perf_counter() - started
        if result.rejected:
            reasons = "; ".join(f"{dc}: {why}" for dc, why in sorted(result.rejected.items()))
            raise RowFailed(f"round {server_round}: updates refused by the update gate ({reasons})", rows)
        compute = [result.compute_s.get(dc, 0.0) for dc in fed.datacenters]
        peak = max([*result.exchange_peak_bytes.values(), *result.link_bytes.values()]
                   or [max(result.bytes_up.values(), default=0)])
        row: dict[str, Any] = {"round": server_round, "tau": result.tau, "compute_s": compute,
                               "bytes_up": [result.bytes_up.get(dc, 0) for dc in fed.datacenters],
                               # gossip: a message between datacenters crosses the WAN once (counted as sent)
                               "bytes_down": [0 if gossip else result.bytes_down.get(dc, 0) for dc in fed.datacenters],
                               "peak_sync_bytes": peak, "round_wall_s": wall, "overhead_s": max(0.0, wall - sum(compute))}
        crossed = steps // eval_every_steps < (steps + result.tau) // eval_every_steps
        steps += result.tau
        if crossed or server_round == doc["run"]["rounds"]:
            row["val_loss"], row["val_accuracy"] = fed.evaluate()
        rows.append(row)
    return rows


def drive_local_run(doc: dict[str, Any], root: Path, engine: str, asynchronous: bool = False) -> list[dict[str, Any]]:
    """`crossdc run` of `doc` on `engine` ("deployment": the datacenters in namespaces behind the emulated links;
    "simulation"), read back from its run log: per round (an asynchronous run: per version) τ, each datacenter's
    compute, idle and link seconds and bytes both ways (gossip: its datacenter-to-datacenter links' too), the largest
    message one datacenter sent in one synchronisation, the round's wall time, and the loss where evaluated.
    RowFailed when the run does not end well. An asynchronous run logs the updates applied at version v (its round
    v + 1, since versions count from 0) as datacenter rows of round v."""
    from crossdc.db.engine import make_engine
    from crossdc.db.queries import (
        list_async_updates,
        list_datacenter_rounds,
        list_fragment_exchanges,
        list_link_rounds,
        list_rounds,
    )
    from crossdc.experiment.processes import free_port
    from crossdc.orchestration.local_run import LocalRunOptions, RunFailed, run_local

    root.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{root / 'run.db'}"
    try:
        result = run_local(parse_config(doc), LocalRunOptions(db_url=db_url, engine=engine, superlink_port=free_port(),
                                                              runs_root=root / "runs"))
    except RunFailed as err:
        raise RowFailed(f"{engine} run failed: {err}", []) from err
    except Exception as err:  # noqa: BLE001 - a run that cannot even start ends this row, not the benchmark
        raise RowFailed(f"{engine} run could not run: {type(err).__name__}: {err}", []) from err
    database = make_engine(db_url)
    try:
        rounds = list_rounds(database, result.run_id)
        dc_rounds = list_datacenter_rounds(database, result.run_id)
        exchanges = list_fragment_exchanges(database, result.run_id)
        links = list_link_rounds(database, result.run_id)
        updates = list_async_updates(database, result.run_id)
    finally:
        database.dispose()
    rows = []
    offset = 1 if asynchronous else 0
    gossip = doc["strategy"]["name"] == "gossip"
    for r in rounds:
        mine = {dc: [d for d in dc_rounds if d["round"] == r["round"] - offset and d["datacenter"] == dc]
                for dc in DATACENTERS}
        # a gossip run's datacenter rows hold the bytes of its links (sent, and received from the others): a message
        # between two datacenters crosses the WAN once, so only what was sent counts (the star's two directions are
        # different messages)
        sent = {dc: sum(d["bytes_up"] or 0 for d in mine[dc]) for dc in DATACENTERS}
        received = {dc: 0 if gossip else sum(d["bytes_down"] or 0 for d in mine[dc]) for dc in DATACENTERS}
        # one synchronisation's messages: a streaming run's fragment exchanges, a gossip run's link messages, an
        # asynchronous run's updates, else each datacenter's reply of the round
        messages = ([x["bytes_up"] for x in exchanges if x["round"] == r["round"]]
                    or [u["bytes_up"] for u in updates if u["applied_version"] == r["round"] - offset]
                    or [x["bytes"] for x in links if x["round"] == r["round"]]
                    or [d["bytes_up"] or 0 for d in dc_rounds if d["round"] == r["round"] - offset])
        steps = [sum(d["num_examples"] or 0 for d in mine[dc]) // int(doc["workload"]["batch_size"]) for dc in DATACENTERS]
        rows.append({"round": r["round"], "tau": statistics.mean(steps) if asynchronous else r["tau"],
                     "compute_s": [sum(d["compute_s"] or 0.0 for d in mine[dc]) for dc in DATACENTERS],
                     "idle_s": [sum(d["idle_s"] or 0.0 for d in mine[dc]) for dc in DATACENTERS],
                     # the delay line's seconds in flight on the coordinator's link, and a gossip run's exchanges
                     "comm_s": [sum(d["comm_s"] or 0.0 for d in mine[dc])
                                + sum(x["in_flight_s"] or 0.0 for x in links if x["round"] == r["round"] and x["src"] == dc)
                                for dc in DATACENTERS],
                     "bytes_up": [sent[dc] for dc in DATACENTERS], "bytes_down": [received[dc] for dc in DATACENTERS],
                     "steps_each": steps,
                     "peak_sync_bytes": max(messages, default=0), "round_wall_s": float(r["wall_s"] or 0.0),
                     "eval_s": float(r["eval_s"] or 0.0),
                     **({"val_loss": r["val_loss"], "val_accuracy": r["val_accuracy"]} if r["val_loss"] is not None else {})})
    if not rows or "val_loss" not in rows[-1]:
        raise RowFailed(f"{engine} run {result.run_id} ended without its last round evaluated", rows)
    return rows


def run_single_datacenter(size: Size, kind: str, root: Path, inner: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    """Baseline `kind` (all-workers or sequential), evaluated every `eval_every_steps` per-datacenter steps; `inner` as
    for :func:`experiment`."""
    from crossdc.db.engine import upgrade

    db_url = f"sqlite:///{root / f'baseline-{kind}-{seed}.db'}"
    upgrade(db_url)
    rounds = size.steps // size.eval_every_steps
    config = parse_config(experiment(Method("baseline", "", "crossdc"), replace(size, tau=size.eval_every_steps), rounds,
                                     inner, seed))
    history: list[dict[str, Any]] = []
    summary = run_baseline(config, kind, db_url, f"wan-baseline-{kind}-{seed}",
                           progress=lambda h: history.__setitem__(slice(None), h))
    return {"summary": summary, "history": [dict(h) for h in history]}


# ----------------------------------------------------------------------------- time and bytes


def timeline(rounds: list[dict[str, Any]], link: LinkSpec, tensors: int) -> dict[str, Any]:
    """Emulated wall time of an in-process run, round by round (see the module docstring), and its totals. A
    datacenter idles for the rest of each round after its own compute."""
    n = len(rounds[0]["compute_s"]) if rounds else len(DATACENTERS)
    wall = comm = overhead = 0.0
    compute_each, idle_each = [0.0] * n, [0.0] * n
    for row in rounds:
        links = [link_message_pair_time(d, u, link, tensors, CROSSDC_RECORDS_PER_MESSAGE)  # each datacenter's pair
                 for d, u in zip(row["bytes_down"], row["bytes_up"], strict=False)]
        busy = [compute + on_link for compute, on_link in zip(row["compute_s"], links, strict=False)]
        slowest = max(range(len(busy)), key=busy.__getitem__)
        round_wall = busy[slowest] + row["overhead_s"]
        wall += round_wall
        comm += links[slowest]
        overhead += row["overhead_s"]
        for i, compute in enumerate(row["compute_s"]):
            compute_each[i] += compute
            idle_each[i] += round_wall - compute
        row["modelled_wall_s"] = round_wall
    return {**totals(rounds, compute_each, idle_each, wall, overhead, [r["modelled_wall_s"] for r in rounds]), "comm_s": comm}


def measured_timeline(rounds: list[dict[str, Any]], asynchronous: bool = False) -> dict[str, Any]:
    """The totals of a run read from its run log (deployed or simulated): wall time = the rounds' wall time without
    evaluation; comm_s = the delay line's seconds in flight, summed over datacenters. An asynchronous run's
    compute-only time is its steps at the datacenters' summed step rates (each computing without a pause), not the
    slowest datacenter's compute (which, always busy, is about the whole run)."""
    n = len(rounds[0]["compute_s"])
    compute_each = [sum(r["compute_s"][i] for r in rounds) for i in range(n)]
    idle_each = [sum(r["idle_s"][i] for r in rounds) for i in range(n)]
    walls = [max(0.0, r["round_wall_s"] - r["eval_s"]) for r in rounds]
    overhead = sum(max(0.0, w - max(c + i for c, i in zip(r["compute_s"], r["idle_s"], strict=True)))
                   for w, r in zip(walls, rounds, strict=True))
    out = totals(rounds, compute_each, idle_each, sum(walls), overhead, walls)
    out["comm_s"] = sum(sum(r["comm_s"]) for r in rounds) / n
    if asynchronous:
        steps_each = [sum(r["steps_each"][i] for r in rounds) for i in range(n)]
        rate = sum(s / c for s, c in zip(steps_each, compute_each, strict=True) if c > 0)
        out["compute_s"] = sum(steps_each) / rate if rate > 0 else 0.0
    return out


def totals(rounds: list[dict[str, Any]], compute_each: list[float], idle_each: list[float], wall: float, overhead: float,
           round_walls: list[float]) -> dict[str, Any]:
    """A federated row's totals: wall and compute-only time (the slowest datacenter's compute), bytes, utilisation,
    exposed comm/comp, the peak message of a sync, and the curve (steps per datacenter, bytes, seconds, loss)."""
    curve, steps, total_bytes, elapsed = [], 0.0, 0, 0.0
    for row, round_wall in zip(rounds, round_walls, strict=True):
        total_bytes += sum(row["bytes_down"]) + sum(row["bytes_up"])
        steps += row["tau"]
        elapsed += round_wall
        if row.get("val_loss") is not None:
            curve.append({"steps": steps, "bytes": total_bytes, "wall_s": elapsed, "val_loss": row["val_loss"],
                          "val_accuracy": row["val_accuracy"]})
    return {"wall_s": wall, "compute_s": max(compute_each), "overhead_s": overhead, "bytes": total_bytes,
            "rounds": len(rounds), "steps": round(steps), "curve": curve,
            "utilisation": [c / (c + i) if c + i > 0 else None for c, i in zip(compute_each, idle_each, strict=True)],
            "exposed_comm_comp": sum(idle_each) / sum(compute_each) if sum(compute_each) > 0 else None,
            "peak_sync_bytes": max((r.get("peak_sync_bytes", 0) for r in rounds), default=0)}


def baseline_row(kind: str, data: dict[str, Any], n: int) -> dict[str, Any]:
    """A single-datacenter row: measured training time (all-workers: over n workers in parallel), no WAN."""
    share = n if kind == "all-workers" else 1
    elapsed, curve, steps = 0.0, [], 0
    for h in data["history"]:
        elapsed += (h["wall_s"] - (h.get("eval_s") or 0.0)) / share
        steps += h["tau"] // (1 if kind == "all-workers" else n)
        if h.get("val_loss") is not None:
            curve.append({"steps": steps, "bytes": 0, "wall_s": elapsed, "val_loss": h["val_loss"], "val_accuracy": h["val_accuracy"]})
    return {"wall_s": elapsed, "compute_s": elapsed, "comm_s": 0.0, "overhead_s": 0.0, "bytes": 0, "steps": steps, "curve": curve,
            "utilisation": [1.0], "exposed_comm_comp": 0.0, "peak_sync_bytes": 0}


def measure_sync_dp(size: Size, link: LinkSpec, root: Path) -> dict[str, Any]:
    """A stretch of `crossdc run --baseline sync-dp` in the benchmark's setting, each datacenter pair on `link`:
    per step (medians over the rounds after the first) its wall time, its WAN time (comm_s, from the delay line,
    the mean over datacenters) and compute, and the bytes all datacenters sent."""
    from crossdc.db.engine import make_engine, upgrade
    from crossdc.db.queries import list_datacenter_rounds, list_rounds

    doc = experiment(Method("sync-dp", "", "fedavg"), size, size.sync_dp_rounds)  # a stretch: its time, not its loss
    doc["strategy"]["tau"] = size.sync_dp_tau
    doc["datacenters"] = [{"name": name, "link": PROFILE} for name in DATACENTERS]
    doc["links"] = [{"between": [a, b], "profile": PROFILE} for i, a in enumerate(DATACENTERS) for b in DATACENTERS[i + 1:]]
    root.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{root / 'sync-dp.db'}"
    upgrade(db_url)
    summary = run_baseline(parse_config(doc), "sync-dp", db_url, "sync-dp-stretch", runs_root=root / "runs")
    engine = make_engine(db_url)
    try:
        rounds = [r for r in list_rounds(engine, summary["run_id"]) if r["round"] > 1]
        dc_rounds = [r for r in list_datacenter_rounds(engine, summary["run_id"]) if r["round"] > 1]
    finally:
        engine.dispose()
    per_step = statistics.median((r["wall_s"] - (r["eval_s"] or 0.0)) / r["tau"] for r in rounds)
    comm = statistics.median(statistics.mean(d["comm_s"] for d in dc_rounds if d["round"] == r["round"]) / r["tau"] for r in rounds)
    compute = statistics.median(max(d["compute_s"] for d in dc_rounds if d["round"] == r["round"]) / r["tau"] for r in rounds)
    sent = statistics.median(r["bytes_up"] / r["tau"] for r in rounds)
    return {"steps_measured": size.sync_dp_tau * (size.sync_dp_rounds - 1), "per_step_s": per_step, "per_step_comm_s": comm,
            "per_step_compute_s": compute, "per_step_bytes": sent, "run_summary": summary}


def sync_dp_row(all_workers: dict[str, Any], params: int, n: int, link: LinkSpec, measured: dict[str, Any]) -> dict[str, Any]:
    """Synchronous data parallel across the WAN: all-workers' training and compute, the measured stretch's WAN time and
    bytes per step (its steps' time less their compute) added to every step; the cost model's figure beside it."""
    gradient_bytes = 4 * params
    per_step_comm = measured["per_step_s"] - measured["per_step_compute_s"]
    per_step_bytes = measured["per_step_bytes"]
    curve = [{**p, "bytes": p["steps"] * per_step_bytes, "wall_s": p["wall_s"] + p["steps"] * per_step_comm} for p in all_workers["curve"]]
    steps = all_workers["steps"]
    compute = all_workers["compute_s"]
    idle = steps * per_step_comm
    return {"wall_s": compute + idle, "compute_s": compute, "comm_s": idle, "overhead_s": 0.0,
            "bytes": steps * per_step_bytes, "steps": steps, "curve": curve, "per_step_comm_s": per_step_comm,
            "utilisation": [compute / (compute + idle)] if compute + idle > 0 else [None],
            "exposed_comm_comp": idle / compute if compute else None, "peak_sync_bytes": per_step_bytes / n,
            "measured_stretch": measured,
            "cost_model_per_step_comm_s": ring_allreduce_time(gradient_bytes, n, link.bandwidth_mbps, link.rtt_ms),
            "cost_model_per_step_bytes": 2 * (n - 1) * gradient_bytes}


def time_to_loss(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds at the first evaluation whose validation loss is at or below `target` (None: never)."""
    return next((p["wall_s"] for p in curve if p["val_loss"] <= target), None)


# ----------------------------------------------------------------------------- report


#: the columns that describe a completed run (None for a row that failed)
FINAL_COLUMNS = ("val_loss", "val_accuracy", "gap_all-workers", "gap_sequential", "bytes_ratio_vs_sync", "comm_comp_ratio",
                 "wall_over_compute", "overhead_share", "min_utilisation")


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Fill the comparison columns: gaps to the baselines, bytes ratio, comm/comp, overhead share, least utilisation,
    time to the all-workers baseline's final loss. A row run over several seeds keeps its median final loss."""
    by_key = {r["key"]: r for r in rows}
    sync = by_key["sync-dp"]
    for r in rows:
        if r.get("failed"):
            continue
        r["val_loss"] = statistics.median(r["seed_losses"]) if r.get("seed_losses") else r["curve"][-1]["val_loss"]
    target = by_key["all-workers"]["val_loss"]
    for r in rows:
        r["time_to_all_workers_loss_s"] = time_to_loss(r["curve"], target)
        if r.get("failed"):  # no final model: no end-of-run columns, only how far it got
            r.update({column: None for column in FINAL_COLUMNS})
            continue
        loss = r["val_loss"]
        r["val_accuracy"] = r["curve"][-1]["val_accuracy"]
        for kind in ("all-workers", "sequential"):
            ref = by_key[kind]["val_loss"]
            r[f"gap_{kind}"] = (loss - ref) / ref
        r["bytes_ratio_vs_sync"] = (sync["bytes"] / r["bytes"]) if r["bytes"] else None
        r["comm_comp_ratio"] = r["comm_s"] / r["compute_s"] if r["compute_s"] else None
        r["wall_over_compute"] = r["wall_s"] / r["compute_s"] if r["compute_s"] else None
        r["overhead_share"] = r["overhead_s"] / r["wall_s"] if r["wall_s"] else None
        known = [u for u in r.get("utilisation", []) if u is not None]
        r["min_utilisation"] = min(known) if known else None


def project(rows: list[dict[str, Any]], params: int, n: int, link: LinkSpec) -> None:
    """Each synchronous star row's comm/comp ratio at the mission's scale (PROJECTED_PARAMS, PROJECTED_STEP_S a step),
    from the cost model: same τ (mean over the run), same measured compression ratios each way (fp32 size of the
    messages over the bytes sent), same link; Flower's per-object round trips left at crossdc's packing (one Array).
    The overlapping, decentralised and asynchronous rows are not projected (None)."""
    raw = 4 * params
    for r in rows:
        if r["key"] in ("all-workers", "sequential") or r.get("failed") or r.get("loop", "sync") != "sync":
            r["projected_comm_comp_ratio"] = None
        elif r["key"] == "sync-dp":
            r["projected_comm_comp_ratio"] = sync_dp_step(PROJECTED_PARAMS, n, link, PROJECTED_STEP_S).comm_comp_ratio
        else:
            per_round = r["per_round"]
            messages = sum(len(row["bytes_up"]) for row in per_round)
            up = raw * messages / sum(sum(row["bytes_up"]) for row in per_round)
            down = raw * messages / sum(sum(row["bytes_down"]) for row in per_round)
            tau = max(1, round(r["steps"] / len(per_round)))
            plan = StarPlan(params=PROJECTED_PARAMS, datacenters=uniform_datacenters(n, link), step_time_s=PROJECTED_STEP_S,
                            tau=tau, compression_up=up, compression_down=down)
            r.update(compression_up=up, compression_down=down, projected_comm_comp_ratio=star_round(plan).comm_comp_ratio)


def crossdc_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The completed crossdc rows the goals judge (not the references, not a calibration's second run)."""
    return [r for r in rows if r["key"] not in REFERENCE_KEYS and not r.get("failed") and not r.get("calibration")]


def goal_list(rows: list[dict[str, Any]], size: Size) -> list[dict[str, Any]]:
    """The four goals, each for the crossdc row that does best on it: {"name", "row", "figure", "threshold", "met"}.

    loss_gap: the lowest (L − L_all-workers) / L_all-workers (met at ≤ 0.01); bytes_ratio: the largest synchronous
    data parallel's WAN bytes / the row's (≥ 1000); wall_over_compute: the least wall time / compute-only time
    (≤ 1.05); beats_flower: 1 if a row at Flower's τ has both a lower loss and fewer bytes than Flower's FedAvg (the
    best such row by loss), else 0 (≥ 1)."""
    candidates = crossdc_rows(rows)
    flower = next((r for r in rows if r["key"] == "flower-fedavg" and not r.get("failed")), None)

    def goal(name: str, row: dict[str, Any] | None, figure: float | None, met: bool) -> dict[str, Any]:
        return {"name": name, "row": row["key"] if row else None, "figure": figure, "threshold": GOAL_THRESHOLDS[name],
                "met": bool(met)}

    out = []
    best = min(candidates, key=lambda r: r["gap_all-workers"], default=None)
    figure = best["gap_all-workers"] if best else None
    out.append(goal("loss_gap", best, figure, figure is not None and figure <= GOAL_THRESHOLDS["loss_gap"]))
    frugal = max((r for r in candidates if r["bytes_ratio_vs_sync"]), key=lambda r: r["bytes_ratio_vs_sync"], default=None)
    figure = frugal["bytes_ratio_vs_sync"] if frugal else None
    out.append(goal("bytes_ratio", frugal, figure, figure is not None and figure >= GOAL_THRESHOLDS["bytes_ratio"]))
    fast = min((r for r in candidates if r["wall_over_compute"]), key=lambda r: r["wall_over_compute"], default=None)
    figure = fast["wall_over_compute"] if fast else None
    out.append(goal("wall_over_compute", fast, figure, figure is not None and figure <= GOAL_THRESHOLDS["wall_over_compute"]))
    equal_tau = [r for r in candidates if all(row["tau"] == size.tau for row in r["per_round"])]
    beating = [r for r in equal_tau if flower is not None and r["val_loss"] < flower["val_loss"]
               and r["bytes"] < flower["bytes"]]
    winner = min(beating, key=lambda r: r["val_loss"], default=None)
    out.append(goal("beats_flower", winner, 1.0 if winner else 0.0, winner is not None))
    return out


def pareto_front(rows: list[dict[str, Any]]) -> list[str]:
    """The federated rows (crossdc's, Flower's and synchronous data parallel) that no other such row matches or beats
    on validation loss, WAN bytes and wall time together while beating it on one."""
    pool = [r for r in rows if r["key"] not in ("all-workers", "sequential") and not r.get("failed")
            and not r.get("calibration")]

    def dominates(a: dict[str, Any], b: dict[str, Any]) -> bool:
        keys = ("val_loss", "bytes", "wall_s")
        return all(a[k] <= b[k] for k in keys) and any(a[k] < b[k] for k in keys)

    return [r["key"] for r in pool if not any(dominates(o, r) for o in pool if o is not r)]


def seed_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The rows a multi-seed run repeats: the all-workers baseline and the two crossdc rows with the lowest loss."""
    best = sorted(crossdc_rows(rows), key=lambda r: r["curve"][-1]["val_loss"])[:2]
    return ["all-workers", *(r["key"] for r in best)]


def repeated_after_rerun(done: list[dict[str, Any]], repeated: list[str], keys: list[str]) -> list[str]:
    """The rows repeated over seeds once the rows `keys` were measured again (`done`: every row's seed-0 run): the
    last run's, and any of `keys` that is now one of the two best crossdc rows."""
    return [*repeated, *(k for k in seed_rows(done) if k in keys and k not in repeated)]


def seed_spread(losses: list[float]) -> dict[str, Any]:
    """Median and range of a row's final losses over its seeds."""
    return {"median": statistics.median(losses), "min": min(losses), "max": max(losses), "seeds": len(losses)}


def _num(value: float | None, fmt: str, none: str = "—") -> str:
    return none if value is None else format(value, fmt)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _goal_line(goal: dict[str, Any]) -> str:
    verdict = "**met**" if goal["met"] else "**not met**"
    figure = _num(goal["figure"], ".4g")
    return f"- `{goal['name']}`: {verdict} — row {goal['row'] or 'none'}, figure {figure}, threshold {goal['threshold']:g}"


def markdown(rows: list[dict[str, Any]], size_name: str, size: Size, link: LinkSpec, goals: list[dict[str, Any]],
             front: list[str], tuning: str, remeasured: list[dict[str, Any]] | None = None) -> str:
    # the figures between "val loss" and "how run", each "—" in a row that failed
    figures = ["gap all-workers", "gap sequential", "WAN bytes", "bytes vs sync", "peak bytes / sync", "time",
               "compute-only", "time / compute", "utilisation (least)", "exposed comm/comp", "comm/comp",
               "overhead share", "time to all-workers' loss"]
    lines = [f"Shakespeare char-transformer, 4 datacenters (natural partition), {link.describe()}, "
             f"{size.steps} local steps of batch {BATCH} per datacenter for every method ({size_name} size); "
             f"tuned settings: {tuning}.",
             "",
             "| " + " | ".join(["method", "val loss", *figures, "how run",
                                "comm/comp at 1B params, 2 s/step (projected)"]) + " |",
             "| --- | ---: |" + " ---: |" * len(figures) + " --- | ---: |"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['label']} | failed after {r['steps']} of {size.steps} steps (below) |"
                         + " — |" * len(figures) + f" {r['time_from']} | — |")
            continue
        loss = f"{r['val_loss']:.3f}"
        if r.get("seed_losses") and len(r["seed_losses"]) > 1:
            loss += f" ({min(r['seed_losses']):.3f}–{max(r['seed_losses']):.3f}, {len(r['seed_losses'])} seeds)"
        time_to = r["time_to_all_workers_loss_s"]
        lines.append(
            f"| {r['label']}{' ◆' if r['key'] in front else ''} | {loss} | {100 * r['gap_all-workers']:+.1f} % | "
            f"{100 * r['gap_sequential']:+.1f} % | {_bytes(r['bytes']) if r['bytes'] else '0'} | "
            f"{_num(r['bytes_ratio_vs_sync'], '.0f')}{'×' if r['bytes_ratio_vs_sync'] else ''} | "
            f"{_bytes(r['peak_sync_bytes']) if r['peak_sync_bytes'] else '0'} | "
            f"{r['wall_s']:.0f} s | {r['compute_s']:.0f} s | {_num(r['wall_over_compute'], '.2f')} | "
            f"{_num(r['min_utilisation'] and 100 * r['min_utilisation'], '.1f')} % | {_num(r['exposed_comm_comp'], '.3f')} | "
            f"{_num(r['comm_comp_ratio'], '.2f')} | {_num(r['overhead_share'] and 100 * r['overhead_share'], '.1f')} % | "
            f"{_num(time_to, '.0f', 'not reached')}{' s' if time_to is not None else ''} | {r['time_from']} | "
            f"{_num(r['projected_comm_comp_ratio'], '.2f')} |")
    failures = [f"- {r['key']} failed: {r['failed']}" for r in rows if r.get("failed")]
    if failures:
        failures = ["", "Rows that did not complete (left out of the goals):", *failures]
    for m in remeasured or []:
        again = [k for k in m["rows"] if k not in m.get("added", [])]
        if again:
            failures += ["", f"Rows measured again on {m['date']} (`--rerun`): {', '.join(again)}."]
        if m.get("added"):
            failures += ["", f"Rows added on {m['date']} (`--rerun`): {', '.join(m['added'])}."]
    return "\n".join(lines + failures + ["", "◆: on the Pareto front (loss, bytes, time) of the federated rows.", "",
                                         "Goals (each for the row that does best on it):",
                                         *(_goal_line(g) for g in goals)])


def chart(rows: list[dict[str, Any]], front: list[str], path: Path, title: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=2, subplot_titles=("validation loss vs bytes on the "
                                                           "WAN", "validation loss vs time on the (emulated) link"))
    for r in rows:
        points = r["curve"]
        name = r["label"] + (" (failed)" if r.get("failed") else "")
        if r["bytes"]:
            figure.add_trace(go.Scatter(x=[p["bytes"] for p in points], y=[p["val_loss"] for p in points], mode="lines+markers",
                                        name=name, legendgroup=r["key"]), row=1, col=1)
        figure.add_trace(go.Scatter(x=[p["wall_s"] for p in points], y=[p["val_loss"] for p in points], mode="lines+markers",
                                    name=name, legendgroup=r["key"], showlegend=not r["bytes"],
                                    line={"dash": "dot"} if not r["bytes"] else None), row=1, col=2)
    on_front = sorted((r for r in rows if r["key"] in front), key=lambda r: r["bytes"])
    for col, axis in ((1, "bytes"), (2, "wall_s")):
        figure.add_trace(go.Scatter(x=[r[axis] for r in on_front], y=[r["val_loss"] for r in on_front], mode="markers+text",
                                    text=[r["key"] for r in on_front], textposition="top center",
                                    marker={"symbol": "diamond", "size": 13, "color": "black"},
                                    name="Pareto front (loss, bytes, time)", legendgroup="pareto", showlegend=col == 1),
                         row=1, col=col)
    figure.update_xaxes(type="log", title_text="bytes (cumulative, both directions, all datacenters)", row=1, col=1)
    figure.update_xaxes(type="log", title_text="seconds", row=1, col=2)
    figure.update_yaxes(title_text="validation loss")
    figure.update_layout(title=title, height=650)
    figure.write_html(path, include_plotlyjs=True)


# ----------------------------------------------------------------------------- main


def how_run(method: Method, size: Size) -> str:
    """The engine a row runs on at `size`: deployed (plain Flower always), in-process or simulation."""
    if method.engine == "flower" or method.key in size.deployed:
        return "deployed"
    return "simulation" if method.asynchronous else "in-process"


TIME_FROM = {
    "deployed": "deployed: Deployment Engine over the namespace emulator; run log",
    "in-process": "in-process: cost model for the link, measured compute and platform time",
    "simulation": "Flower's simulation engine; run log (no emulated link)",
    "flower": "deployed: plain Flower on the Deployment Engine over the namespace emulator; its ServerApp and the ledger",
    "calibration": "in-process (calibration of the deployed row)",
}


def task(key: str, size_name: str, root: str, threads: int, seed: int = 0, engine: str | None = None) -> dict[str, Any]:
    """One row's training in a worker process: a baseline's history, or a federated row's per-round record; `engine`
    forces "in-process" (the calibration's second run). A row that breaks in a way its engine does not catch is
    returned failed, with nothing measured, so the other rows are kept."""
    try:
        return _task(key, size_name, root, threads, seed, engine)
    except Exception as err:  # noqa: BLE001 - one row's breakdown must not cost the benchmark its other rows
        print(f"  {key:<24} seed {seed}  BROKE: {type(err).__name__}: {err}", flush=True)
        return {"key": key, "label": key, "time_from": "—", "how_run": engine or "—", "seed": seed, "per_round": [],
                "failed": f"{type(err).__name__}: {err}",
                **totals([], [0.0], [0.0], 0.0, 0.0, []), "comm_s": 0.0}


def _task(key: str, size_name: str, root: str, threads: int, seed: int, engine: str | None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    size, n, link = SIZES[size_name], len(DATACENTERS), LINK_PROFILES[PROFILE]
    tuned, _ = read_tuning(size_name)
    started = time.perf_counter()
    where = Path(root) / f"{key}-{engine or 'own'}-{seed}"
    if key in ("all-workers", "sequential"):
        label = (f"one datacenter, all {n} datacenters' workers (batch {n * BATCH})" if key == "all-workers"
                 else f"one datacenter, one worker, {n}× the steps")
        lr = float(tuned.get(key, {}).get("lr", ADAMW_LR))
        where.mkdir(parents=True, exist_ok=True)
        row = {"key": key, "label": f"{label}, lr {lr:g}", "time_from": "measured (in-process)", "seed": seed,
               **baseline_row(key, run_single_datacenter(size, key, where, inner_recipe(lr, size), seed), n)}
    else:
        method = method_catalogue(size, tuned)[key]
        mode = engine or how_run(method, size)
        failed: str | None = None
        doc = row_experiment(method, size, seed)
        loop = method.loop
        if method.engine == "flower":
            try:
                per_round = run_flower_fedavg(parse_config(doc), size.tau, doc["run"]["rounds"], where)
            except FlowerBaselineError as err:
                raise RowFailed(str(err), []) from err
            for r in per_round:
                r.update(peak_sync_bytes=max(r["bytes_up"]), steps_each=[r["tau"]] * n, eval_s=0.0)
            measured = measured_timeline(per_round)
        elif mode in ("deployed", "simulation"):
            if mode == "simulation":  # no emulated links there: the run log's time is compute and Flower's own
                for datacenter in doc["datacenters"]:
                    datacenter.pop("link", None)
                doc.pop("links", None)
            try:
                per_round = drive_local_run(doc, where, "deployment" if mode == "deployed" else "simulation",
                                            method.asynchronous)
            except RowFailed as err:
                per_round, failed = err.rounds, str(err)
            measured = (measured_timeline(per_round, method.asynchronous) if per_round
                        else totals([], [0.0], [0.0], 0.0, 0.0, []))
        else:
            try:
                per_round = drive_crossdc(doc, where, size.eval_every_steps)
            except RowFailed as err:
                per_round, failed = err.rounds, str(err)
            measured = timeline(per_round, link, 1)  # one packed Array per tensor group
        calibration = engine == "in-process" and how_run(method, size) == "deployed" and seed == 0
        row = {"key": f"{key}-inprocess" if calibration else key,
               "label": method.label + (" [in-process calibration]" if calibration else ""),
               "time_from": TIME_FROM["calibration" if calibration else "flower" if method.engine == "flower" else mode],
               "how_run": mode, "loop": loop,
               "calibration": calibration, "seed": seed, "config": doc, "per_round": per_round, "failed": failed, **measured}
    row["benchmark_wall_s"] = time.perf_counter() - started
    outcome = (f"FAILED after {row['steps']} steps: {row['failed']}" if row.get("failed") else
               f"val loss {row['curve'][-1]['val_loss']:.4f}  bytes {row['bytes']:>13,d}  time {row['wall_s']:.0f}s")
    print(f"  {row['key']:<24} seed {seed}  {outcome}  ({row['benchmark_wall_s']:.0f}s to run)", flush=True)
    return row


def calibration_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row run both ways: deployed against in-process (loss, bytes, wall time, wall over compute)."""
    by_key = {r["key"]: r for r in rows}
    out = []
    for r in rows:
        if not r.get("calibration") or r.get("failed"):
            continue
        deployed = by_key.get(r["key"].removesuffix("-inprocess"))
        if deployed is None or deployed.get("failed"):
            continue
        d_loss, i_loss = deployed["curve"][-1]["val_loss"], r["curve"][-1]["val_loss"]
        out.append({"row": deployed["key"], "val_loss_deployed": d_loss, "val_loss_inprocess": i_loss,
                    "val_loss_difference": (d_loss - i_loss) / i_loss,
                    "bytes_deployed": deployed["bytes"], "bytes_inprocess": r["bytes"],
                    "wall_s_deployed": deployed["wall_s"], "wall_s_inprocess_model": r["wall_s"],
                    "compute_s_deployed": deployed["compute_s"], "compute_s_inprocess": r["compute_s"],
                    "wall_over_compute_deployed": deployed["wall_s"] / deployed["compute_s"],
                    "wall_over_compute_inprocess": r["wall_s"] / r["compute_s"]})
    return out


def run_pool(work: list[tuple[str, int, str | None]], size_name: str, root: str, jobs: int, threads: int) -> list[dict[str, Any]]:
    """Run every (key, seed, engine) of `work`: the in-process and simulated ones `jobs` at a time, then each deployed
    run alone (four datacenters' trainers use every core, and it times the WAN)."""
    size = SIZES[size_name]
    catalogue = method_catalogue(size)

    def alone(item: tuple[str, int, str | None]) -> bool:
        key, _, engine = item
        return (size.deployed_alone and engine is None and key in catalogue
                and how_run(catalogue[key], size) == "deployed")

    pooled = [item for item in work if not alone(item)]
    done: list[dict[str, Any]] = []
    if jobs <= 1:
        done += [task(key, size_name, root, threads, seed, engine) for key, seed, engine in pooled]
    else:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(task, key, size_name, root, threads, seed, engine) for key, seed, engine in pooled]
            done += [future.result() for future in futures]
    for key, seed, engine in (item for item in work if alone(item)):
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            done.append(pool.submit(task, key, size_name, root, threads, seed, engine).result())
    return done


def seed_work(keys: list[str], size: Size, catalogue: dict[str, Method]) -> list[tuple[str, int, str | None]]:
    """The runs of the seeds after the first for the rows `keys`. They measure the final loss only: a deployed
    synchronous row's run in-process, which trains the same weights (the calibration row shows it), so the seeds cost
    no extra deployments."""
    return [(k, s, None if k not in catalogue or catalogue[k].asynchronous else "in-process")
            for s in range(1, size.seeds) for k in keys]


def raw_path(size_name: str, out: Path) -> Path:
    """Where a run keeps what it measured before the report is made (the report can be remade from it)."""
    return out / ("wan_benchmark-raw.json" if size_name == "full" else f"wan_benchmark-raw-{size_name}.json")


def run(size_name: str, out: Path, only: list[str] | None = None, jobs: int = 2, threads: int = 1) -> dict[str, Any]:
    """Run every row of size `size_name`; write wan_benchmark[-size].json / .md / .html under `out` (and, first, what
    was measured, to wan_benchmark-raw[-size].json); return the result."""
    size = SIZES[size_name]
    link = LINK_PROFILES[PROFILE]
    tuned, tuning = read_tuning(size_name)
    catalogue = method_catalogue(size, tuned)
    started = time.perf_counter()
    federated = [key for key in catalogue if not only or key in only]
    # longest first, so that the pool ends together: the deployed rows (where they share the pool), then the baselines
    # and τ = 1 (the most rounds)
    deployed = [k for k in federated if how_run(catalogue[k], size) == "deployed"]
    rest = sorted((k for k in federated if k not in deployed),
                  key=lambda k: (how_run(catalogue[k], size) != "simulation", k != "fedavg-dgc"))
    work: list[tuple[str, int, str | None]] = [(k, 0, None) for k in [*deployed, "sequential", "all-workers", *rest]]
    work += [(k, 0, "in-process") for k in federated  # the calibration: crossdc's first deployed row, run in-process too
             if catalogue[k].engine == "crossdc" and how_run(catalogue[k], size) == "deployed"][:1]
    with tempfile.TemporaryDirectory() as tmp:
        if size.deployed_alone:
            measured_sync = measure_sync_dp(size, link, Path(tmp) / "sync-dp")  # alone: it times the WAN, not the cores
            done = run_pool(work, size_name, tmp, jobs, threads)
        else:  # beside the rows, as the size's deployed rows are (a smoke test's timings mean nothing)
            with ThreadPoolExecutor(max_workers=1) as aside:
                pending = aside.submit(measure_sync_dp, size, link, Path(tmp) / "sync-dp")
                done = run_pool(work, size_name, tmp, jobs, threads)
                measured_sync = pending.result()
        repeated = seed_rows(done) if size.seeds > 1 else []
        extra = run_pool(seed_work(repeated, size, catalogue), size_name, tmp, jobs, threads)
    measured_sync.pop("run_summary", None)
    raw = {"size": size_name, "federated": federated, "tuned": tuned, "tuning": tuning, "jobs": jobs, "threads": threads,
           "sync_dp": measured_sync, "done": done, "repeated": repeated, "extra": extra,
           "measure_wall_s": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    raw_path(size_name, out).write_text(json.dumps(raw))
    return report(raw, out)


def rerun(size_name: str, out: Path, keys: list[str], jobs: int = 2, threads: int = 1) -> dict[str, Any]:
    """Measure the rows `keys` again (seed 0, and their other seeds where the last run repeated them), put them in
    place of the last run's in wan_benchmark-raw[-size].json, and remake the report. Every other row, the sync-dp
    stretch, the calibration and the rows repeated over seeds stay as the last run measured them; the raw file's
    `remeasured` (and the report) lists which rows were measured again, when, and why the harness allows it: a row
    changed (its codecs, how it runs, its tuned settings) or is new, without the others changing. A row measured
    again that is now one of the two best crossdc rows runs its seeds too (and stays repeated). A row with an
    in-process calibration run is calibrated again; the tuned settings recorded are the tuning file's as it is now."""
    path = raw_path(size_name, out)
    if not path.exists():
        raise SystemExit(f"--rerun needs the last run's {path}: run the whole benchmark first")
    raw = json.loads(path.read_text())
    size = SIZES[size_name]
    catalogue = method_catalogue(size, read_tuning(size_name)[0])
    unknown = [k for k in keys if k not in catalogue and k not in ("all-workers", "sequential")]
    if unknown or not keys:
        raise SystemExit(f"--rerun takes row keys among {', '.join(['all-workers', 'sequential', *catalogue])}; got {keys or 'none'}")
    started = time.perf_counter()
    # a row measured again whose calibration (its in-process run) the last run holds is calibrated again too
    calibrated = [r["key"].removesuffix("-inprocess") for r in raw["done"] if r.get("calibration")]
    work: list[tuple[str, int, str | None]] = [(k, 0, None) for k in keys]
    work += [(k, 0, "in-process") for k in keys if k in calibrated]
    with tempfile.TemporaryDirectory() as tmp:
        done = run_pool(work, size_name, tmp, jobs, threads)
        raw["done"] = [r for r in raw["done"] if r["key"].removesuffix("-inprocess") not in keys] + done
        raw["repeated"] = repeated_after_rerun(raw["done"], raw["repeated"], keys)
        extra = run_pool(seed_work([k for k in keys if k in raw["repeated"]], size, catalogue), size_name, tmp, jobs, threads)
    raw["tuned"], raw["tuning"] = read_tuning(size_name)
    raw["extra"] = [r for r in raw["extra"] if r["key"] not in keys] + extra
    added = [k for k in keys if k in catalogue and k not in raw["federated"]]
    raw["federated"] = [k for k in catalogue if k in raw["federated"] or k in keys]
    raw.setdefault("remeasured", []).append({"rows": keys, "added": added, "date": time.strftime("%Y-%m-%d"),
                                             "wall_s": time.perf_counter() - started})
    path.write_text(json.dumps(raw))
    return report(raw, out)


def report(raw: dict[str, Any], out: Path) -> dict[str, Any]:
    """The table, goals, Pareto front, chart and results file from what a run measured (`raw`, see :func:`run`)."""
    size_name = raw["size"]
    size = SIZES[size_name]
    link = LINK_PROFILES[PROFILE]
    n = len(DATACENTERS)
    done, extra, federated = raw["done"], raw["extra"], raw["federated"]
    by_key = {r["key"]: r for r in done}
    for key in raw["repeated"]:
        runs = [by_key[key], *(r for r in extra if r["key"] == key)]
        by_key[key]["seed_losses"] = [r["curve"][-1]["val_loss"] for r in runs if not r.get("failed")]
        by_key[key]["seed_spread"] = seed_spread(by_key[key]["seed_losses"])
    params = sum(int(p.numel()) for p in build_model_for(size).parameters())
    sync = {"key": "sync-dp", "label": "synchronous data parallel across datacenters (τ = 1, fp32, DDP on gloo)",
            "time_from": "measured: sync-dp baseline over the emulated WAN (a stretch, per step); training = all-workers",
            "how_run": "deployed (stretch)", "loop": "sync-dp",
            **sync_dp_row(by_key["all-workers"], params, n, link, raw["sync_dp"])}
    if "seed_losses" in by_key["all-workers"]:  # its training curve is the all-workers baseline's
        sync["seed_losses"] = by_key["all-workers"]["seed_losses"]
    calibrations = [r for r in done if r.get("calibration")]
    rows = [by_key["all-workers"], by_key["sequential"], sync, *(by_key[k] for k in federated), *calibrations]
    finish_rows(rows)
    project(rows, params, n, link)
    goals = goal_list(rows, size)
    front = pareto_front(rows)
    table = markdown(rows, size_name, size, link, goals, front, raw["tuning"], raw.get("remeasured", []))
    suffix = "" if size_name == "full" else f"-{size_name}"
    out.mkdir(parents=True, exist_ok=True)
    result = {"setting": {"size": size_name, **asdict(size), "datacenters": list(DATACENTERS), "link": asdict(link),
                          "batch_size": BATCH, "inner_recipe": inner_recipe(ADAMW_LR, size), "params": params,
                          "jobs": raw["jobs"], "torch_threads": raw["threads"], "tuning": raw["tuning"],
                          "tuned": raw["tuned"]},
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d"), "rows": rows, "goals": goals, "pareto_front": front,
              "calibration": calibration_of(rows), "wall_s": raw["measure_wall_s"],
              "remeasured": raw.get("remeasured", []), "table_markdown": table}
    (out / f"wan_benchmark{suffix}.md").write_text(table + "\n")
    chart(rows, front, out / f"wan_benchmark{suffix}.html", f"crossdc vs synchronous and Flower on a {link.describe()} link")
    write_results(out / f"wan_benchmark{suffix}.json", result, table)
    return result


def build_model_for(size: Size) -> torch.nn.Module:
    from crossdc.experiment.builders import build_workload, initial_model

    config = parse_config(experiment(Method("model", "", "crossdc"), size, rounds_for_budget(size.tau, size.steps)))
    return initial_model(config, build_workload(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", nargs="*", help="federated rows to run (keys); default: all")
    parser.add_argument("--jobs", type=int, default=2, help="in-process rows trained at once, one process each (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per row (default 1)")
    parser.add_argument("--sync-dp-only", action="store_true",
                        help="only the sync-dp row's measured stretch, against the cost model's figure "
                             "(writes wan_benchmark_sync_dp[-size].json)")
    parser.add_argument("--rerun", nargs="+", metavar="ROW",
                        help="measure only these rows again, in place of the last run's (wan_benchmark-raw[-size].json), "
                             "and remake the report")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: remake the report from the last run's wan_benchmark-raw[-size].json")
    args = parser.parse_args()
    if args.sync_dp_only:
        sync_dp_only(args.size, args.out)
    elif args.rerun:
        rerun(args.size, args.out, args.rerun, args.jobs, args.threads)
    elif args.report_only:
        report(json.loads(raw_path(args.size, args.out).read_text()), args.out)
    else:
        run(args.size, args.out, args.only, args.jobs, args.threads)


def sync_dp_only(size_name: str, out: Path) -> dict[str, Any]:
    """The sync-dp row's measured stretch alone, beside the cost model's per-step figures (textbook ring and gloo)."""
    from crossdc.wan.cost_model import gloo_ring_allreduce_time

    size = SIZES[size_name]
    link = LINK_PROFILES[PROFILE]
    n = len(DATACENTERS)
    params = sum(int(p.numel()) for p in build_model_for(size).parameters())
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_sync_dp(size, link, Path(tmp))
    measured.pop("run_summary", None)
    gradient_bytes = 4 * params
    result = {"setting": {"size": size_name, "params": params, "datacenters": list(DATACENTERS), "link": asdict(link)},
              "measured": measured, "measured_comm_per_step_s": measured["per_step_s"] - measured["per_step_compute_s"],
              "cost_model_ring_per_step_s": ring_allreduce_time(gradient_bytes, n, link.bandwidth_mbps, link.rtt_ms),
              "cost_model_gloo_per_step_s": gloo_ring_allreduce_time(gradient_bytes, n, link.bandwidth_mbps, link.rtt_ms),
              "cost_model_bytes_per_step": 2 * (n - 1) * gradient_bytes}
    suffix = "" if size_name == "full" else f"-{size_name}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"wan_benchmark_sync_dp{suffix}.json").write_text(json.dumps(result, indent=1))
    print(f"{'sync DP per step (' + str(n) + ' datacenters, ' + link.describe() + ')':<70}{'s':>8}{'MB sent':>10}")
    print(f"{'measured: wall':<70}{measured['per_step_s']:>8.3f}{measured['per_step_bytes'] / 1e6:>10.2f}")
    print(f"{'measured: WAN (wall − compute)':<70}{result['measured_comm_per_step_s']:>8.3f}")
    print(f"{'measured: comm_s (delay line, mean over datacenters)':<70}{measured['per_step_comm_s']:>8.3f}")
    print(f"{'cost model: textbook ring (the benchmark used it until now)':<70}{result['cost_model_ring_per_step_s']:>8.3f}"
          f"{result['cost_model_bytes_per_step'] / 1e6:>10.2f}")
    print(f"{'cost model: gloo ring':<70}{result['cost_model_gloo_per_step_s']:>8.3f}")
    return result


if __name__ == "__main__":
    main()
