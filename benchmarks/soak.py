"""Chaos soak: a local federation trained under a seeded stream of faults, then checked for what was lost or doubled.

Each size runs a synchronous strategy (FedAvg, checkpoints every 2 rounds) and an asynchronous one (FedBuff, K = 2,
checkpoints every 2 versions) on the synthetic workload, datacenters behind the namespace emulator (three in the full
size, two in the short one; us-east with a worker group of 2 ranks), crossdc's heartbeat at 5 s; both strategies
side by side, each beside a fault-free run of the same config. Faults come at rounds drawn from a seeded generator,
at least three rounds apart, of these kinds:

- ``kill-supernode``: SIGKILL of a datacenter's SuperNode (and the ClientApp it may run), restarted 5 s later;
- ``kill-trainer``: SIGKILL of its SuperNode and trainer (with its worker group), restarted 5 s later (the trainer
  restores its state from its store);
- ``kill-worker``: SIGKILL of rank 1 of us-east's worker group (the trainer starts a fresh group);
- ``kill-coordinator``: SIGKILL of the ServerApp; the run then fails over to ``crossdc resume``'s path (a new attempt
  from the newest checkpoint: :class:`crossdc.orchestration.local_run.LocalRun` with ``resume``), fresh processes;
- ``cut`` (8 s) and ``reset`` of a datacenter's link (the delay line drops its packets, resets its connections);
- ``postgres-restart`` (full size, the run log on PostgreSQL): the database restarted under the run;
- ``nan-update`` and ``corrupt-update``: the datacenter's trainer spoils its next update (a NaN in it, or a tensor of
  the wrong shape: crossdc.clients.fault_injection; the runs start with fault injection on), which crosses the WAN
  like any other; the coordinator's update gate must refuse it and the run go on without it.

What is checked and recorded in ``benchmarks/results/soak.json`` (per strategy): every fault with the second it
came, its target and its outcome as the run log shows it; ``rounds_lost`` / ``rounds_duplicated`` (each round or
version 1..R must be logged exactly once); for the asynchronous run ``updates_lost`` / ``updates_duplicated`` (update
sequence numbers 1..n without gaps or repeats; every version made by exactly K applied updates); ``leftovers``
(processes of the run, the SuperLink's port still listening, the run's network namespaces) after it ended; the final
validation loss against a fault-free run of the same config: it may end at most ``loss_tolerance_rel`` (20 %) above
it (a fault that costs a datacenter a round changes the model, and an asynchronous run's order of arrivals differs
from run to run anyway; lower is never a failure).

    python benchmarks/soak.py --size short   # about 2 minutes on 2 cores (the suite runs it: tests/test_soak.py)
    python benchmarks/soak.py --size full    # writes benchmarks/results/soak.json; about 23 minutes on 2 cores
    python benchmarks/soak.py --size full --only async   # one strategy, the other's row kept
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import merge_rows, write_results  # noqa: E402

from crossdc.clients.channel import TrainerUnavailable, call_trainer  # noqa: E402
from crossdc.db.engine import make_engine  # noqa: E402
from crossdc.db.queries import get_run, list_async_updates, list_datacenter_rounds, list_events, list_rounds  # noqa: E402
from crossdc.experiment.config import ExperimentConfig, parse_config  # noqa: E402
from crossdc.experiment.processes import free_port, processes_with_env  # noqa: E402
from crossdc.orchestration.local_run import RUN_MARKER_ENV, LocalRun, LocalRunOptions, RunFailed  # noqa: E402
from crossdc.protocol import INJECT_FAULT_OP  # noqa: E402

log = logging.getLogger("crossdc.soak")
RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
DATACENTERS = ("us-east", "eu-west", "ap-south")
#: seconds a killed datacenter stays away, and a cut lasts
AWAY_S = 5.0
CUT_S = 8.0
#: how much higher (relative) the final validation loss may end than the fault-free run's: a fault costs a datacenter
#: a round or two, and an asynchronous run's order of arrivals (hence its model) differs from run to run anyway
LOSS_TOLERANCE_REL = 0.20
#: the soak's fault kinds that make a datacenter's trainer spoil its next update, and how (fault_injection.POISON_KINDS)
SPOILED_UPDATES = {"nan-update": "nan", "corrupt-update": "corrupt"}
#: what the update gate's refusal of each says
SPOILED_REASONS = {"nan-update": "NaN", "corrupt-update": "shape"}
#: a coordinator killed this soon after a spoiled update was asked for may never have seen the spoiled reply
SPOILED_JUDGED_WITHIN_S = 30.0
#: at most this many coordinator kills per run (each costs a resume: fresh processes, tens of seconds)
MAX_COORDINATOR_KILLS = 5

SIZES: dict[str, dict[str, Any]] = {
    # rounds per strategy, faults per strategy, fault kinds, PostgreSQL
    "short": {"sync_rounds": 12, "async_versions": 16, "faults": 2, "postgres": False, "datacenters": 2,
              "kinds": ("kill-trainer", "kill-coordinator", "cut", "kill-supernode", "reset", "kill-worker",
                        "nan-update", "corrupt-update"),
              "required": ("kill-coordinator", "nan-update")},
    "full": {"sync_rounds": 300, "async_versions": 400, "faults": 52, "postgres": True, "datacenters": 3,
             "kinds": ("kill-supernode", "kill-trainer", "kill-worker", "kill-coordinator", "cut", "reset",
                       "postgres-restart", "nan-update", "corrupt-update")},
}


def experiment(kind: str, rounds: int, checkpoint_dir: Path, seed: int, datacenters: int = 3) -> ExperimentConfig:
    """The soak's experiment: `kind` sync (FedAvg) or async (FedBuff, K = 2), on the first `datacenters` of
    DATACENTERS (us-east with 2 worker ranks). The data are split iid: with label skew, an asynchronous run's
    model after a fault depends on which datacenter carried the versions while another was away (one short run
    ended 30 % above its fault-free twin after eu-west made 12 updates alone while us-east's worker group
    restarted), and the loss check would measure the skew, not what the faults lost."""
    strategy = ({"name": "fedavg", "tau": 20} if kind == "sync"
                else {"name": "fedbuff", "tau": 20, "params": {"buffer_size": 2, "max_staleness": 8}})
    return parse_config({
        "run": {"name": f"soak-{kind}", "rounds": rounds, "seed": seed, "eval_every": 4, "min_replies": 1,
                "round_timeout_s": 30.0, "heartbeat_timeout_s": 5.0},
        "workload": {"dataset": "synthetic", "model": "linear", "partition": {"kind": "iid"},
                     "batch_size": 32, "optimizer": "adamw", "lr": 0.005},
        "strategy": strategy,
        "datacenters": [{"name": name, **({"workers": 2} if name == "us-east" else {})} for name in DATACENTERS[:datacenters]],
        "checkpoint": {"every_rounds": 2, "keep": 3, "dir": str(checkpoint_dir)},
    })


@dataclass
class Fault:
    kind: str
    after_round: int
    target: str
    at_s: float | None = None  # seconds since the soak of this strategy began, once injected
    round_at: int | None = None  # rounds logged when it was injected
    outcome: str = "not injected (the run ended first)"

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "at_s": None if self.at_s is None else round(self.at_s, 1), "target": self.target,
                "after_round": self.round_at, "outcome": self.outcome}


def schedule(rng: random.Random, kinds: tuple[str, ...], count: int, rounds: int,
             datacenters: tuple[str, ...] = DATACENTERS, required: tuple[str, ...] = ()) -> list[Fault]:
    """`count` faults at distinct rounds from 2 to rounds − 3, at least 3 apart, kinds and targets drawn by `rng`
    (the `required` kinds, then each other kind at least once while count allows, in a drawn order; at most
    MAX_COORDINATOR_KILLS coordinator kills)."""
    slots = list(range(2, max(3, rounds - 2), 3))
    chosen = sorted(rng.sample(slots, min(count, len(slots))))
    others = [kind for kind in kinds if kind not in required]
    rng.shuffle(others)
    pool = list(required) + others
    pool = rng.sample(pool[:count], len(pool[:count])) + pool[count:]
    faults, coordinator_kills = [], 0
    for i, after in enumerate(chosen):
        kind = pool[i] if i < len(pool) else rng.choice(kinds)
        if kind == "kill-coordinator":
            coordinator_kills += 1
            if coordinator_kills > MAX_COORDINATOR_KILLS:
                kind = "kill-supernode"
        target = {"kill-worker": "us-east", "kill-coordinator": "coordinator",
                  "postgres-restart": "postgresql"}.get(kind) or rng.choice(datacenters)
        faults.append(Fault(kind, after, target))
    return faults


class SoakRun(LocalRun):
    """A local run that injects the soak's faults as its rounds are logged (:meth:`inject_faults` runs in the
    orchestrator's follow loop)."""

    def __init__(self, config: ExperimentConfig, options: LocalRunOptions, faults: list[Fault], started: float,
                 postgres: PostgresControl | None) -> None:
        super().__init__(config, options)
        self.faults, self.started, self.postgres = faults, started, postgres
        self.restart_due: dict[str, float] = {}

    def inject_faults(self, rounds_logged: int) -> None:
        super().inject_faults(rounds_logged)
        now = time.monotonic()
        for name, due in list(self.restart_due.items()):
            if now >= due:
                del self.restart_due[name]
                self.restart_datacenter(name)
        for fault in self.faults:
            if fault.at_s is None and rounds_logged >= fault.after_round and not self.restart_due:
                self._inject(fault, rounds_logged)
                return  # one fault per look: the next waits for the run to move on

    def _inject(self, fault: Fault, rounds_logged: int) -> None:
        fault.at_s, fault.round_at, fault.outcome = time.monotonic() - self.started, rounds_logged, "injected"
        log.warning("soak: %s on %s after round %d", fault.kind, fault.target, rounds_logged)
        if fault.kind in ("kill-supernode", "kill-trainer"):
            self.kill_datacenter(fault.target, trainer=fault.kind == "kill-trainer")
            self.restart_due[fault.target] = time.monotonic() + AWAY_S
        elif fault.kind == "kill-worker":
            try:
                pids = call_trainer(self.run_dir.trainer_socket(fault.target), self.run_dir.authkey(), {"op": "ping"},
                                    connect_timeout_s=2.0)["worker_pids"]
            except TrainerUnavailable:
                pids = []
            if len(pids) > 1:
                with contextlib.suppress(OSError):
                    os.kill(int(pids[1]), signal.SIGKILL)
            else:
                fault.outcome = "not injected (no worker rank to kill)"
        elif fault.kind == "kill-coordinator":
            self.kill_coordinator()
        elif fault.kind in ("cut", "reset"):
            assert self.network is not None
            if fault.kind == "cut":
                self.network.cut(CUT_S, datacenter=fault.target)
            else:
                self.network.reset(datacenter=fault.target)
        elif fault.kind == "postgres-restart":
            assert self.postgres is not None
            self.postgres.restart()
        elif fault.kind in SPOILED_UPDATES:
            try:
                answer = call_trainer(self.run_dir.trainer_socket(fault.target), self.run_dir.authkey(),
                                      {"op": INJECT_FAULT_OP, "fault": SPOILED_UPDATES[fault.kind]}, connect_timeout_s=2.0)
            except TrainerUnavailable as err:
                answer = {"ok": False, "error": str(err)}
            if not answer.get("ok"):
                fault.outcome = f"not injected ({answer.get('error')})"


class PostgresControl:
    """A database for the soak on this machine's PostgreSQL, and restarts of that server (``pg_ctlcluster``)."""

    def __init__(self) -> None:
        versions = sorted(p.name for p in Path("/etc/postgresql").iterdir()) if Path("/etc/postgresql").is_dir() else []
        if not versions:
            raise RuntimeError("no PostgreSQL cluster here (/etc/postgresql is empty)")
        self.version = versions[-1]
        self.database = f"soak_{os.getpid()}"
        subprocess.run(["psql", "-U", "postgres", "-h", "127.0.0.1", "-c", f"CREATE DATABASE {self.database}"],
                       check=True, capture_output=True)
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.database}"

    def restart(self) -> None:
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.version, "main", "restart"], check=True,
                       capture_output=True, timeout=120)

    def drop(self) -> None:
        subprocess.run(["psql", "-U", "postgres", "-h", "127.0.0.1", "-c", f"DROP DATABASE IF EXISTS {self.database} WITH (FORCE)"],
                       capture_output=True)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def run_with_faults(config: ExperimentConfig, db_url: str, runs: Path, faults: list[Fault],
                    postgres: PostgresControl | None) -> tuple[str, float, list[int], str | None]:
    """Run `config` to its end under `faults`, resuming after every coordinator kill; (run id, seconds, the SuperLink
    ports it used, None or why the run failed: a failure is recorded, the run log checked all the same)."""
    started = time.monotonic()
    run_id: str | None = None
    ports: list[int] = []
    attempts = 0
    while True:
        attempts += 1
        port = free_port()
        ports.append(port)
        options = LocalRunOptions(db_url=db_url, superlink_port=port, runs_root=runs, run_id=run_id, resume=run_id is not None,
                                  fault_injection=True)
        run = SoakRun(config, options, faults, started, postgres)
        run_id = run.run_id
        try:
            run.execute()
            break
        except RunFailed as err:
            pending_kill = any(f.kind == "kill-coordinator" and f.at_s is not None and "resumed" not in f.outcome
                               for f in faults)
            if not pending_kill or attempts > MAX_COORDINATOR_KILLS + 1:
                log.error("soak: run %s failed: %s", run_id, err)
                return run_id, time.monotonic() - started, ports, str(err)
            for fault in faults:
                if fault.kind == "kill-coordinator" and fault.at_s is not None and "resumed" not in fault.outcome:
                    fault.outcome = f"resumed (the run failed: {str(err)[:80]})"
    return run_id, time.monotonic() - started, ports, None


def leftovers_of(run_dir: Path, ports: list[int]) -> dict[str, list[Any]]:
    """What a finished run left: processes carrying its marker, SuperLink ports still listening."""
    return {"processes": processes_with_env(RUN_MARKER_ENV, str(run_dir.resolve())),
            "ports": [p for p in ports if _listening(p)]}


def _ok_rounds_after(rows: list[dict[str, Any]], datacenter: str, after: int) -> list[int]:
    """The rounds after `after` at which `datacenter`'s row is ok, in order."""
    return sorted(r["round"] for r in rows if r["datacenter"] == datacenter and r["round"] > after and r["status"] == "ok")


def _outcome(fault: Fault, rows: list[dict[str, Any]], events: list[dict[str, Any]],
             killed_before_judged: int | None = None, resumed_attempt: int | None = None) -> str:
    """What the run log says became of a fault: the affected datacenter's next ok round, or the resume.
    `killed_before_judged`: for a spoiled update, the round after which the coordinator was killed within a few
    seconds of it (its spoiled reply may have gone to the dead attempt), if that happened. `resumed_attempt`: for a
    coordinator kill, the attempt that resumed after it."""
    if fault.at_s is None or fault.outcome.startswith("not injected"):
        return fault.outcome
    after = fault.round_at or 0
    if fault.kind == "kill-coordinator":
        # the attempt this kill started (the n-th kill, attempt n + 1): its checkpoint may be newer than the rounds
        # counted when the kill came (an asynchronous coordinator checkpoints a version before it is logged)
        resumed = [e for e in events if e["kind"] == "resumed" and (e["detail"] or {}).get("attempt") == resumed_attempt]
        if resumed_attempt is not None and resumed:
            detail = resumed[-1]["detail"] or {}
            return f"resumed from the checkpoint of round {resumed[-1]['round']} (attempt {detail.get('attempt')})"
        return "not resumed"
    if fault.kind == "postgres-restart":
        later = sorted({r["round"] for r in rows if r["round"] > after})
        return f"run log written on: {len(later)} later rounds" if later else "no round logged after it"
    target = fault.target
    if fault.kind in SPOILED_UPDATES:
        refused = [e for e in events if e["kind"] == "rejected" and e["datacenter"] == target and (e["round"] or 0) >= after
                   and SPOILED_REASONS[fault.kind] in str(e["detail"])]
        if refused and killed_before_judged is not None and refused[0]["round"] > killed_before_judged:
            refused = []  # a later fault's refusal (the coordinator killed meanwhile; see below)
        if not refused and killed_before_judged is not None:
            return (f"not judged: the coordinator was killed after round {killed_before_judged} before the spoiled "
                    f"reply came; the resumed run redid the round from its checkpoint")
        if not refused:
            return f"{target}'s spoiled update was never refused"
        later_ok = _ok_rounds_after(rows, target, refused[0]["round"])
        again = f"; {target} ok again at round {later_ok[0]}" if later_ok else f"; {target} not ok again before the end"
        return f"refused by the update gate at round {refused[0]['round']} ({refused[0]['detail']}){again}"
    back = _ok_rounds_after(rows, target, after)
    missed = sum(1 for r in rows if r["datacenter"] == target and r["round"] > after and r["status"] != "ok"
                 and (not back or r["round"] < back[0]))
    if not back:
        tried = [r for r in rows if r["datacenter"] == target and r["round"] > after]
        if tried:
            return f"{target} never ok again ({len(tried)} rounds failed after it)"
        last = max((r["round"] for r in rows), default=after)
        return f"{target} not heard from again before the run ended ({last - after} rounds after it)"
    return f"{target} ok again at round {back[0]} ({missed} round{'s' if missed != 1 else ''} missed)"


def _coordinator_killed_soon_after(fault: Fault, faults: list[Fault]) -> int | None:
    """The round after which the coordinator was killed within SPOILED_JUDGED_WITHIN_S after `fault` (a spoiled
    update) was injected, if it was: the round at the kill, else None."""
    if fault.kind not in SPOILED_UPDATES or fault.at_s is None:
        return None
    kills = [f for f in faults if f.kind == "kill-coordinator" and f.at_s is not None
             and 0 <= f.at_s - fault.at_s <= SPOILED_JUDGED_WITHIN_S]
    return kills[0].round_at if kills else None


def check(db_url: str, run_id: str, config: ExperimentConfig, faults: list[Fault]) -> dict[str, Any]:
    """Rounds and updates lost or doubled, and each fault's outcome, from the run log."""
    engine = make_engine(db_url)
    try:
        run = get_run(engine, run_id)
        rounds = list_rounds(engine, run_id)
        rows = list_datacenter_rounds(engine, run_id)
        events = list_events(engine, run_id)
        updates = list_async_updates(engine, run_id)
    finally:
        engine.dispose()
    expected = set(range(1, config.run.rounds + 1))
    logged = Counter(r["round"] for r in rounds)
    kills = sorted((f for f in faults if f.kind == "kill-coordinator" and f.at_s is not None), key=lambda f: f.at_s or 0)
    for fault in faults:
        attempt = next((n + 2 for n, kill in enumerate(kills) if kill is fault), None)
        fault.outcome = _outcome(fault, rows, events, _coordinator_killed_soon_after(fault, faults), attempt)
    result: dict[str, Any] = {
        "status": run["status"] if run else "missing",
        "rounds_lost": len(expected - set(logged)),
        "rounds_duplicated": sum(n - 1 for n in logged.values() if n > 1),
        "datacenter_rows_duplicated": sum(n - 1 for n in Counter((r["round"], r["datacenter"]) for r in rows).values() if n > 1),
        "val_loss": next((r["val_loss"] for r in reversed(rounds) if r["val_loss"] is not None), None),
        "faults": [f.record() for f in faults],
        "resumes": sum(e["kind"] == "resumed" for e in events),
        "datacenter_down_events": sum(e["kind"] == "datacenter-down" for e in events),
    }
    if updates or config.strategy.name in ("fedbuff", "fedasync"):
        # every reply has a sequence number; an applied or discarded update has a row, an unusable reply (failed,
        # timed out: never an update) none. Lost: a number neither in a row nor among the unusable; or a version
        # made by fewer than K applied updates. Doubled: a number twice, or a version made by more than K.
        seqs = [u["seq"] for u in updates]
        unusable = int(((run or {}).get("result") or {}).get("updates", {}).get("unusable", 0))
        applied = Counter(u["applied_version"] for u in updates if u["status"] == "applied")
        k = 2
        gaps = len(set(range(1, max(seqs, default=0) + 1)) - set(seqs))
        result["unusable_replies"] = unusable
        result["updates_lost"] = (max(0, gaps - unusable)
                                  + sum(max(0, k - applied.get(v, 0)) for v in range(config.run.rounds)))
        result["updates_duplicated"] = (len(seqs) - len(set(seqs))
                                        + sum(max(0, n - k) for n in applied.values()))
    return result


def soak_one(kind: str, size: str, work: Path, seed: int, postgres: PostgresControl | None,
             pool: ThreadPoolExecutor) -> dict[str, Any]:
    """One strategy's soak: the run under faults and its fault-free reference, side by side in `pool`."""
    spec = SIZES[size]
    rounds = spec["sync_rounds"] if kind == "sync" else spec["async_versions"]
    rng = random.Random(seed * 1000 + (kind == "async"))
    names = DATACENTERS[:spec["datacenters"]]
    faults = schedule(rng, spec["kinds"], spec["faults"], rounds, names, spec.get("required", ()))
    (work / kind).mkdir(parents=True, exist_ok=True)
    config = experiment(kind, rounds, work / kind / "checkpoints", seed, len(names))
    db_url = postgres.url if postgres is not None else f"sqlite:///{work / kind / 'soak.db'}"
    reference_config = experiment(kind, rounds, work / kind / "reference-checkpoints", seed, len(names))
    reference_db = f"sqlite:///{work / kind / 'reference.db'}"
    reference_job = pool.submit(run_with_faults, reference_config, reference_db, work / kind / "reference-runs", [], None)
    run_id, wall_s, ports, error = run_with_faults(config, db_url, work / kind / "runs", faults, postgres)
    reference_id, reference_s, reference_ports, reference_error = reference_job.result()
    result = check(db_url, run_id, config, faults)
    if error is not None:
        result["error"] = error
    reference = check(reference_db, reference_id, reference_config, [])
    if reference_error is not None:
        reference["error"] = reference_error
    gap = (None if result["val_loss"] is None or reference["val_loss"] is None
           else (result["val_loss"] - reference["val_loss"]) / reference["val_loss"])
    leftovers = leftovers_of(work / kind / "runs" / run_id, ports)
    reference_left = leftovers_of(work / kind / "reference-runs" / reference_id, reference_ports)
    leftovers = {key: leftovers[key] + reference_left[key] for key in leftovers}
    return {"strategy": config.strategy.name, "size": size, "seed": seed, "rounds": rounds, "wall_s": round(wall_s, 1),
            "reference_wall_s": round(reference_s, 1), **result, "reference_val_loss": reference["val_loss"],
            "reference_status": reference["status"], "reference_error": reference.get("error"),
            "loss_gap_rel": gap, "loss_tolerance_rel": LOSS_TOLERANCE_REL,
            "loss_within_tolerance": gap is not None and gap <= LOSS_TOLERANCE_REL, "leftovers": leftovers}


def run_soak(size: str, seed: int = 0, work: Path | None = None, kinds: tuple[str, ...] = ("sync", "async"),
             ) -> list[dict[str, Any]]:
    """The soak of `size` for the strategies of `kinds` side by side, with their fault-free references; one result
    row each (see the module docstring). Network namespaces left over are looked for once all are done. With
    `work`, the runs' folders and the PostgreSQL database are kept (to read after a failure)."""
    postgres = PostgresControl() if SIZES[size]["postgres"] else None
    namespaces_before = _namespaces()
    try:
        # both strategies' runs under faults and their references, all four side by side
        with tempfile.TemporaryDirectory(prefix="crossdc-soak-") as scratch, ThreadPoolExecutor(max_workers=4) as pool:
            base = work or Path(scratch)
            jobs = [pool.submit(soak_one, kind, size, base, seed, postgres, pool) for kind in kinds]
            rows = [job.result() for job in jobs]
    finally:
        if postgres is not None and work is None:
            postgres.drop()
        elif postgres is not None:
            log.warning("soak: the run log is kept in %s", postgres.url)
    namespaces_left = sorted(_namespaces() - namespaces_before)
    for row in rows:
        row["leftovers"]["namespaces"] = namespaces_left
        row["leftovers_found"] = any(row["leftovers"].values())
    return rows


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| strategy | status | rounds | faults | resumes | rounds lost/dup | updates lost/dup | val loss (fault-free) "
             "| gap | leftovers | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        updates = f"{r.get('updates_lost', '-')}/{r.get('updates_duplicated', '-')}"
        lines.append(f"| {r['strategy']} | {r['status']} | {r['rounds']} | {len(r['faults'])} | {r['resumes']} | "
                     f"{r['rounds_lost']}/{r['rounds_duplicated']} | {updates} | {_loss(r['val_loss'])} "
                     f"({_loss(r['reference_val_loss'])}) | {100 * (r['loss_gap_rel'] or 0):+.1f}% | "
                     f"{'yes' if r['leftovers_found'] else 'none'} | {r['wall_s']:.0f} s |")
    for r in rows:
        lines.append("")
        lines.append(f"{r['strategy']}:" + (f" failed: {r['error']}" if r.get("error") else ""))
        lines.extend(f"- {f['kind']} on {f['target']} after round {f['after_round']} ({f['at_s']} s): {f['outcome']}"
                     for f in r["faults"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="short")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=None, help="keep the runs' folders (and the database) here")
    parser.add_argument("--only", choices=("sync", "async"), default=None, help="one strategy's soak only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.monotonic()
    rows = run_soak(args.size, args.seed, args.work, (args.only,) if args.only else ("sync", "async"))
    if args.only:  # the other strategy's row, if the results file has one of this size, stays
        kept = json.loads(args.out.read_text()) if args.out.exists() else {}
        if kept.get("size") == args.size:
            rows = merge_rows(args.out, rows, key=lambda row: row["strategy"])
    write_results(args.out, summarize(rows, args.size, time.monotonic() - started), table(rows))


def summarize(rows: list[dict[str, Any]], size: str, wall_s: float) -> dict[str, Any]:
    """The soak's results file: the totals over both strategies (every fault with its strategy) and the rows."""
    return {"benchmark": "soak", "size": size, "date": time.strftime("%Y-%m-%d"), "wall_s": wall_s,
            "faults": [{"strategy": r["strategy"], **f} for r in rows for f in r["faults"]],
            **{key: sum(int(r.get(key, 0)) for r in rows)
               for key in ("rounds_lost", "rounds_duplicated", "updates_lost", "updates_duplicated")},
            "leftovers": {kind: [item for r in rows for item in r["leftovers"][kind]] for kind in ("processes", "ports", "namespaces")},
            "loss_tolerance_rel": LOSS_TOLERANCE_REL, "rows": rows}


if __name__ == "__main__":
    main()
