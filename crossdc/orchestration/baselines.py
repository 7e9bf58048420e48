"""Single-datacenter baselines: the bar a federation is measured against ("within 1%").

- ``all-workers``: one datacenter holding all the data and all the workers:
  synchronous data parallel with global batch = Σ datacenter batches, and as
  many steps as one datacenter's local steps summed over the rounds. The data
  is pooled (batches drawn uniformly from the union of the shards, as one
  datacenter holding everything would); one process computing the mean
  gradient of the global batch is mathematically that synchronous
  data-parallel step.
- ``sequential``: the same total number of gradient computations in one
  sequence at the per-datacenter batch size: N × Σ τ steps (N datacenters).

Both start from the federation's initial weights, use its inner optimizer and
learning rate, and are evaluated on the same validation set at the end of
every "round" (the step count the federation has done by that round), so the
curves line up round by round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crossdc.clients.local_training import LocalTrainer
from crossdc.db.runlog import RunLog
from crossdc.experiment.builders import build_strategy, build_workload, initial_model
from crossdc.experiment.config import ExperimentConfig
from crossdc.workloads import evaluate, model_weights

#: the baselines one process trains here; "sync-dp" (crossdc.orchestration.sync_dp) runs across the emulated WAN
LOCAL_BASELINES = ("all-workers", "sequential")
BASELINE_KINDS = (*LOCAL_BASELINES, "sync-dp")


def baseline_plan(config: ExperimentConfig, kind: str) -> tuple[int, list[int]]:
    """(batch size, optimizer steps per round) of baseline `kind` for this experiment."""
    if kind not in LOCAL_BASELINES:
        raise ValueError(f"unknown baseline '{kind}'; known: {', '.join(LOCAL_BASELINES)}")
    strategy = build_strategy(config)
    n = len(config.datacenters)
    taus = [strategy.tau(r) for r in range(1, config.run.rounds + 1)]
    batch = config.workload.batch_size
    if kind == "all-workers":
        return n * batch, taus
    return batch, [n * tau for tau in taus]


def run_baseline(config: ExperimentConfig, kind: str, db_url: str, run_id: str,
                 progress: Callable[[list[dict[str, Any]]], None] | None = None, runs_root: Path = Path("runs")) -> dict[str, Any]:
    """Train baseline `kind`, log it as run `run_id` (runs.baseline = kind); return its summary. "sync-dp" runs its
    ranks in the datacenters' namespaces (its folder under `runs_root`)."""
    if kind == "sync-dp":
        from crossdc.orchestration.sync_dp import run_sync_dp

        return run_sync_dp(config, db_url, run_id, runs_root=runs_root, progress=progress)
    batch, steps_per_round = baseline_plan(config, kind)
    workload = build_workload(config)
    model = initial_model(config, workload)
    trainer = LocalTrainer(workload, workload.all_training(), batch, config.workload.optimizer, config.workload.lr, config.run.seed,
                           options=config.workload.options, horizon_steps=sum(steps_per_round))
    trainer.set_weights(model_weights(model))
    history: list[dict[str, Any]] = []
    with RunLog(db_url) as runlog:
        runlog.start_run(run_id=run_id, name=f"{config.run.name} [{kind} baseline]", strategy=config.strategy.name,
                         config=config.raw, rounds_planned=config.run.rounds, baseline=kind)
        started = time.perf_counter()
        val_loss = val_accuracy = float("nan")
        try:
            for server_round, steps in enumerate(steps_per_round, start=1):
                round_started = time.perf_counter()
                trainer.train_steps(steps)
                eval_s = None
                if server_round % config.run.eval_every == 0 or server_round == config.run.rounds:
                    eval_started = time.perf_counter()
                    val_loss, val_accuracy = evaluate(workload, trainer.model)
                    eval_s = time.perf_counter() - eval_started
                row = dict(round=server_round, tau=steps, val_loss=val_loss if eval_s is not None else None,
                           val_accuracy=val_accuracy if eval_s is not None else None,
                           bytes_up=0, bytes_down=0, bytes_up_raw=0, wall_s=time.perf_counter() - round_started, eval_s=eval_s)
                runlog.log_round(run_id=run_id, **row)
                history.append(row)
                if progress:
                    progress(history)
            summary = {"run_id": run_id, "baseline": kind, "rounds": config.run.rounds, "batch_size": batch,
                       "steps": sum(steps_per_round), "val_loss": val_loss, "val_accuracy": val_accuracy,
                       "bytes_up_total": 0, "bytes_down_total": 0, "wall_s": time.perf_counter() - started}
            runlog.finish_run(run_id=run_id, status="finished", result=summary)
        except BaseException as err:
            status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            runlog.finish_run(run_id=run_id, status=status, error=f"{type(err).__name__}: {err}".splitlines()[0])
            raise
        runlog.flush(timeout=60)
    return summary


def gap_to(baseline: dict[str, Any], run: dict[str, Any]) -> dict[str, float]:
    """The run's gap to a baseline: relative validation-loss gap (L − L_ref)/L_ref and accuracy difference in points."""
    reference = float(baseline["val_loss"])
    return {
        "val_loss_gap_rel": (float(run["val_loss"]) - reference) / reference,
        "val_accuracy_gap_points": 100.0 * (float(run["val_accuracy"]) - float(baseline["val_accuracy"])),
    }


def matching_baselines(db_url: str, config: ExperimentConfig) -> dict[str, dict[str, Any]]:
    """The latest finished baseline of each kind logged for exactly this experiment config (by kind)."""
    from crossdc.db.engine import make_engine
    from crossdc.db.queries import list_runs

    engine = make_engine(db_url)
    try:
        runs = list_runs(engine)
    finally:
        engine.dispose()
    found: dict[str, dict[str, Any]] = {}
    for run in sorted(runs, key=lambda r: r["started_at"]):
        if run["baseline"] in BASELINE_KINDS and run["status"] == "finished" and run["config"] == config.raw and run.get("result"):
            found[run["baseline"]] = run["result"]
    return found
