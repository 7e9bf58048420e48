"""Builds the pieces of an experiment from its config: workload, strategy, initial model."""

from __future__ import annotations

import numpy as np
import torch

from crossdc.experiment.config import ExperimentConfig
from crossdc.strategies.base import RunInfo, Strategy, StrategyError
from crossdc.strategies.registry import strategy_class
from crossdc.workloads import Workload, WorkloadSpec, load_workload, model_weights


def workload_spec(config: ExperimentConfig) -> WorkloadSpec:
    """The config's ``[workload]`` as a WorkloadSpec. A config without ``model`` gives ``model=None``: the workload
    resolves it to its default model when it is built (:meth:`crossdc.workloads.base.Workload.default_model_name`),
    in every process the same way."""
    w = config.workload
    return WorkloadSpec(dataset=w.dataset, model=w.model, model_args=dict(w.model_args), partition=dict(w.partition),
                        batch_size=w.batch_size, optimizer=w.optimizer, lr=w.lr)


def build_workload(config: ExperimentConfig) -> Workload:
    """The experiment's workload, partitioned over its datacenters (deterministic in the seed)."""
    return load_workload(workload_spec(config), config.datacenter_names, config.run.seed)


def run_info(config: ExperimentConfig) -> RunInfo:
    """What a strategy may check about the run: its datacenters, inner optimizer, seed, the round-trip times between
    its datacenters, its codecs, its batch size, its inner gradient clipping and its rounds."""
    return RunInfo(datacenters=tuple(config.datacenter_names), optimizer=config.workload.optimizer, lr=config.workload.lr,
                   seed=config.run.seed, rtt_ms=datacenter_rtts(config), codecs=tuple(config.compression.codecs),
                   batch_size=config.workload.batch_size, grad_clip=config.workload.options.grad_clip,
                   rounds=config.run.rounds)


def datacenter_rtts(config: ExperimentConfig) -> dict[tuple[str, str], float]:
    """The round-trip time (ms) between every pair of datacenters (in config order): their direct link's (`[[links]]`),
    else the sum of their links to the coordinator (a datacenter without a link counts 0)."""
    star = {dc.name: dc.link.rtt_ms if dc.link is not None else 0.0 for dc in config.datacenters}
    names = config.datacenter_names
    rtts = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            mesh = config.mesh_link(a, b)
            rtts[(a, b)] = mesh.link.rtt_ms if mesh is not None else star[a] + star[b]
    return rtts


def build_strategy(config: ExperimentConfig) -> Strategy:
    """The configured strategy, built in one step: its parameters checked, bound to the run, its mean update the one
    ``[security] robust_aggregation`` asks for (StrategyError naming the strategy and the parameter or key
    otherwise). The server and every datacenter's trainer build it the same way."""
    s = config.strategy
    strategy = strategy_class(s.name)(tau=s.tau, params=s.params, run=run_info(config),
                                      robust_aggregation=config.security.robust_aggregation,
                                      trim_fraction=config.security.trim_fraction)
    if strategy.loop == "async" and config.security.norm_rejection_factor:
        raise StrategyError(f"'security.norm_rejection_factor' (a check across a round's updates) is not implemented yet "
                            f"for the asynchronous strategy '{s.name}'")
    return strategy


def check_config(config: ExperimentConfig) -> ExperimentConfig:
    """`config` once what it names is built (its strategy with its parameters, its workload), so a bad name or
    parameter fails before anything starts (StrategyError or WorkloadError with one line); every way a run is
    started checks a config this way."""
    build_strategy(config)
    build_workload(config)
    return config


def initial_model(config: ExperimentConfig, workload: Workload) -> torch.nn.Module:
    """The global model at round 0: the same weights for every strategy given the seed."""
    torch.manual_seed(config.run.seed)
    return workload.make_model()


def initial_weights(config: ExperimentConfig, workload: Workload) -> dict[str, np.ndarray]:
    """`initial_model`'s weights, built without touching the caller's random state: a trainer that checks them in
    mid-run (the downlink's round-1 digest) draws the same dropout and data order as one that does not."""
    with torch.random.fork_rng(devices=[]):
        return model_weights(initial_model(config, workload))


def datacenter_seed(config: ExperimentConfig, datacenter: str) -> int:
    """Seed of a datacenter's data order: distinct per datacenter, fixed per run seed."""
    return config.run.seed * 1000 + 1 + config.datacenter_names.index(datacenter)


