"""The experiment config: parse_config / load_config and their one-line ConfigErrors."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from crossdc.experiment.config import (
    LIMITS,
    ConfigError,
    ExperimentConfig,
    LinkFault,
    MeshLink,
    SecuritySection,
    TauSchedule,
    inner_steps_planned,
    load_config,
    parse_config,
)
from crossdc.experiment.links import LINK_PROFILES, LinkSpec

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))

MINIMAL_TOML = """\
[run]
rounds = 3

[workload]
dataset = "synthetic"
model = "linear"

[strategy]
name = "fedavg"

[[datacenters]]
name = "us-east"
"""


def minimal() -> dict[str, Any]:
    return {
        "run": {"rounds": 3},
        "workload": {"dataset": "synthetic", "model": "linear"},
        "strategy": {"name": "fedavg"},
        "datacenters": [{"name": "us-east"}, {"name": "eu-west"}],
    }


def with_changes(path: str, value: Any, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of the minimal config with `path` ("a.b", "datacenters.0.x") set to `value` (or deleted if DELETE)."""
    doc = copy.deepcopy(doc if doc is not None else minimal())
    parts = path.split(".")
    target: Any = doc
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
    last = parts[-1]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return doc


DELETE = object()


def config_error(doc: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


# -- valid configs --------------------------------------------------------------------


def test_minimal_config_parses_with_documented_defaults() -> None:
    config = parse_config(minimal())
    assert isinstance(config, ExperimentConfig)
    assert config.run.rounds == 3
    assert config.run.seed == 0 and config.run.eval_every == 1 and config.run.min_replies == 0
    assert config.run.name == "crossdc-run" and config.run.keep_best
    assert config.workload.dataset == "synthetic" and config.workload.model == "linear"
    assert config.workload.partition == {"kind": "iid"}
    assert config.workload.batch_size == 32 and config.workload.optimizer == "adamw" and config.workload.lr == 1e-3
    assert config.strategy.name == "fedavg"
    assert config.strategy.tau == TauSchedule(start=1, end=1, warmup_rounds=0, kind="linear")
    assert config.strategy.params == {}
    assert config.datacenter_names == ["us-east", "eu-west"]
    assert all(dc.workers == 1 and dc.speed == 1.0 and dc.link is None for dc in config.datacenters)


def test_minimal_toml_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL_TOML)
    config = load_config(path)
    assert config.datacenter_names == ["us-east"]
    assert load_config(str(path)) == config


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_parse(path: Path) -> None:
    config = load_config(path)
    assert config.run.rounds >= 1 and len(config.datacenters) >= 1


def test_bundled_demo_config_parses() -> None:
    config = load_config(REPO / "crossdc" / "orchestration" / "demo.toml")
    assert len(config.datacenters) == 4


def test_synthetic_example_values() -> None:
    config = load_config(REPO / "examples" / "synthetic-2dc.toml")
    assert config.run.name == "synthetic-2dc" and config.run.rounds == 3
    assert config.workload.partition == {"kind": "dirichlet", "alpha": 0.5}
    assert config.workload.lr == 0.01 and config.workload.batch_size == 32
    assert config.strategy.tau == TauSchedule(start=2, end=8, warmup_rounds=2, kind="linear")
    assert config.datacenter_names == ["us-east", "eu-west"]


def test_full_valid_config_with_neutral_not_yet_sections() -> None:
    doc = minimal()
    doc["run"].update(name="x", seed=4, eval_every=2, min_replies=1, round_timeout_s=60)
    doc["workload"].update(model="mlp", model_args={"hidden": 8}, partition={"kind": "dirichlet", "alpha": 0.3},
                           batch_size=8, optimizer="sgd", lr=1)
    doc["strategy"].update(tau={"start": 1, "end": 50, "warmup_rounds": 5, "kind": "geometric"}, params={})
    doc["datacenters"][0].update(workers=1, speed=1.0, region="North America")
    doc["compression"] = {"codecs": [], "downlink_codecs": []}
    doc["checkpoint"] = {"every_rounds": 0, "dir": "checkpoints/", "keep": 3}
    doc["security"] = {"robust_aggregation": "none", "norm_rejection_factor": 0}
    config = parse_config(doc)
    assert config.run.round_timeout_s == 60.0 and isinstance(config.run.round_timeout_s, float)
    assert config.workload.lr == 1.0 and isinstance(config.workload.lr, float)
    assert config.workload.model_args == {"hidden": 8}
    assert config.strategy.tau == TauSchedule(1, 50, 5, "geometric")
    assert config.datacenters[0].region == "North America"


def test_tau_forms() -> None:
    assert parse_config(with_changes("strategy.tau", 4)).strategy.tau == TauSchedule(4, 4, 0)
    assert parse_config(with_changes("strategy.tau", {"start": 3})).strategy.tau == TauSchedule(3, 3, 0)
    assert parse_config(with_changes("strategy.tau", {"start": 1, "end": 9, "warmup_rounds": 2})).strategy.tau == TauSchedule(1, 9, 2)


def test_json_round_trip() -> None:
    config = parse_config(minimal())
    again = parse_config(json.loads(config.to_json()))  # what run.json hands the ServerApp and trainers
    assert again == config
    assert again.raw == minimal()


# -- errors: structure and keys ---------------------------------------------------------


def test_not_a_table() -> None:
    assert "TOML document" in config_error(["run"])


def test_missing_run_section() -> None:
    assert "missing section [run]" in config_error(with_changes("run", DELETE))


@pytest.mark.parametrize("section", ["workload", "strategy"])
def test_missing_required_sections(section: str) -> None:
    assert f"missing section [{section}]" in config_error(with_changes(section, DELETE))


def test_missing_run_rounds() -> None:
    assert "'run.rounds'" in config_error(with_changes("run.rounds", DELETE))


@pytest.mark.parametrize(("path", "key"), [("workload.dataset", "workload.dataset"),
                                           ("strategy.name", "strategy.name"), ("datacenters.0.name", "datacenters[0].name")])
def test_missing_required_keys(path: str, key: str) -> None:
    message = config_error(with_changes(path, DELETE))
    assert f"missing key '{key}'" in message


def test_unknown_top_level_key() -> None:
    message = config_error(with_changes("experiment", {"x": 1}))
    assert "unknown key 'experiment'" in message


def test_run_as_value_not_table() -> None:
    assert "[run] must be a table" in config_error(with_changes("run", 3))


def test_misspelt_workload_key_suggests_the_right_one() -> None:
    message = config_error(with_changes("workload.batchsize", 16))
    assert "'workload.batchsize'" in message
    assert "did you mean 'batch_size'" in message


@pytest.mark.parametrize(
    ("path", "value", "named", "suggestion"),
    [
        ("run.round", 3, "run.round", "rounds"),
        ("strategy.parms", {}, "strategy.parms", "params"),
        ("strategy.tau", {"start": 1, "warmup": 2}, "strategy.tau.warmup", "warmup_rounds"),
        ("workload.partition", {"kind": "dirichlet", "alfa": 0.3}, "workload.partition.alfa", "alpha"),
        ("datacenters.1.worker", 1, "datacenters[1].worker", "workers"),
        ("compression", {"codec": []}, "compression.codec", "codecs"),
        ("security", {"robust_aggregaton": "none"}, "security.robust_aggregaton", "robust_aggregation"),
    ],
)
def test_misspelt_keys_everywhere(path: str, value: Any, named: str, suggestion: str) -> None:
    message = config_error(with_changes(path, value))
    assert f"'{named}'" in message
    assert f"did you mean '{suggestion}'" in message


# -- errors: values ----------------------------------------------------------------------


@pytest.mark.parametrize("tau", [0, -2])
def test_tau_int_not_positive(tau: int) -> None:
    message = config_error(with_changes("strategy.tau", tau))
    assert "'strategy.tau'" in message and "> 0" in message


@pytest.mark.parametrize(
    ("tau", "key"),
    [
        ({"start": 0, "end": 5}, "strategy.tau.start"),
        ({"start": -1}, "strategy.tau.start"),
        ({"start": 1, "end": 0}, "strategy.tau.end"),
        ({"start": 1, "end": 5, "warmup_rounds": -1}, "strategy.tau.warmup_rounds"),
    ],
)
def test_tau_table_not_positive(tau: dict[str, int], key: str) -> None:
    message = config_error(with_changes("strategy.tau", tau))
    assert f"'{key}'" in message


@pytest.mark.parametrize("tau", [1.5, "5", True, [1, 2]])
def test_tau_wrong_type(tau: Any) -> None:
    assert "'strategy.tau'" in config_error(with_changes("strategy.tau", tau))


def test_tau_table_missing_start_and_bad_kind() -> None:
    assert "missing key 'strategy.tau.start'" in config_error(with_changes("strategy.tau", {"end": 5}))
    assert "'strategy.tau.kind'" in config_error(with_changes("strategy.tau", {"start": 1, "end": 5, "warmup_rounds": 2, "kind": "cubic"}))


@pytest.mark.parametrize("datacenters", [DELETE, []])
def test_zero_datacenters(datacenters: Any) -> None:
    message = config_error(with_changes("datacenters", datacenters))
    assert "no datacenters" in message


@pytest.mark.parametrize("datacenters", [{"name": "a"}, ["a", "b"]])
def test_datacenters_not_an_array_of_tables(datacenters: Any) -> None:
    assert "'datacenters' must be an array of tables" in config_error(with_changes("datacenters", datacenters))


def test_duplicate_datacenter_names() -> None:
    message = config_error(with_changes("datacenters", [{"name": "us-east"}, {"name": "eu-west"}, {"name": "us-east"}]))
    assert "'us-east'" in message and "twice" in message


@pytest.mark.parametrize("name", ["US-East", "us east", "us_east", "-us", "", "a" * 64, "ü"])
def test_bad_datacenter_name(name: str) -> None:
    message = config_error(with_changes("datacenters.0.name", name))
    assert repr(name) in message and "datacenter name" in message


def test_datacenter_name_wrong_type() -> None:
    assert "'datacenters[0].name' must be a string" in config_error(with_changes("datacenters.0.name", 5))


@pytest.mark.parametrize(
    ("path", "value", "key", "kind"),
    [
        ("run.rounds", "ten", "run.rounds", "an integer"),
        ("run.rounds", 10.0, "run.rounds", "an integer"),
        ("run.rounds", True, "run.rounds", "an integer"),
        ("run.seed", "0", "run.seed", "an integer"),
        ("run.name", 5, "run.name", "a string"),
        ("workload.lr", True, "workload.lr", "a number"),
        ("workload.lr", "0.1", "workload.lr", "a number"),
        ("workload.batch_size", 3.5, "workload.batch_size", "an integer"),
        ("workload.dataset", 1, "workload.dataset", "a string"),
        ("workload.partition", "iid", "workload.partition", "a table"),
        ("workload.model_args", [], "workload.model_args", "a table"),
        ("strategy.params", "mu=1", "strategy.params", "a table"),
        ("datacenters.0.workers", "2", "datacenters[0].workers", "an integer"),
        ("datacenters.0.speed", False, "datacenters[0].speed", "a number"),
    ],
)
def test_wrong_types(path: str, value: Any, key: str, kind: str) -> None:
    message = config_error(with_changes(path, value))
    assert f"'{key}' must be {kind}" in message


@pytest.mark.parametrize(
    ("path", "value", "key"),
    [
        ("run.rounds", 0, "run.rounds"),
        ("run.rounds", -1, "run.rounds"),
        ("run.eval_every", 0, "run.eval_every"),
        ("run.keep_best", "yes", "run.keep_best"),
        ("run.min_replies", -1, "run.min_replies"),
        ("run.round_timeout_s", 0, "run.round_timeout_s"),
        ("workload.batch_size", 0, "workload.batch_size"),
        ("workload.lr", 0, "workload.lr"),
        ("workload.lr", -0.1, "workload.lr"),
        ("datacenters.0.workers", 0, "datacenters[0].workers"),
    ],
)
def test_out_of_range_values(path: str, value: Any, key: str) -> None:
    message = config_error(with_changes(path, value))
    assert f"'{key}'" in message


def test_partition_without_kind() -> None:
    assert "missing key 'workload.partition.kind'" in config_error(with_changes("workload.partition", {"alpha": 0.3}))


def test_min_replies_more_than_datacenters_is_rejected() -> None:
    message = config_error(with_changes("run.min_replies", 3))  # 2 datacenters
    assert "run.min_replies" in message


# -- limits: what a config may ask for ---------------------------------------------------------------


def test_a_trillion_rounds_is_refused_at_once() -> None:
    """Once summed τ over every round (10^8 rounds: 51 s; 10^12: a thread SIGTERM could not stop): now refused before
    anything is computed, naming the key and the limit."""
    assert config_error(with_changes("run.rounds", 10**12)) == (
        "'run.rounds' must be ≤ 1000000 (the most a config may ask for), got 1000000000000")


@pytest.mark.parametrize(
    ("path", "key", "limit"),
    [
        ("run.rounds", "run.rounds", LIMITS["run.rounds"]),
        ("strategy.tau", "strategy.tau", LIMITS["strategy.tau"]),
        ("strategy.tau.start", "strategy.tau.start", LIMITS["strategy.tau"]),
        ("strategy.tau.end", "strategy.tau.end", LIMITS["strategy.tau"]),
        ("strategy.tau.warmup_rounds", "strategy.tau.warmup_rounds", LIMITS["strategy.tau.warmup_rounds"]),
        ("datacenters.0.workers", "datacenters[0].workers", LIMITS["datacenters.workers"]),
        ("workload.batch_size", "workload.batch_size", LIMITS["workload.batch_size"]),
        ("workload.model_args.hidden", "workload.model_args.hidden", LIMITS["workload.model_args"]),
        ("workload.model_args.layers", "workload.model_args.layers", LIMITS["workload.model_args.layers"]),
    ],
)
def test_every_number_a_config_asks_for_is_bounded(path: str, key: str, limit: int) -> None:
    doc = with_changes("workload.model", "mlp")
    doc = with_changes("datacenters", [{"name": "us-east"}], doc)  # one datacenter: any batch size divides
    if path.startswith("strategy.tau."):
        doc = with_changes("strategy.tau", {"start": 1}, doc)
    at_limit = with_changes(path, limit, doc)
    if path == "datacenters.0.workers":
        at_limit = with_changes("workload.batch_size", limit, at_limit)
    parse_config(at_limit)  # the limit itself is allowed
    assert config_error(with_changes(path, limit + 1, doc)) == (
        f"'{key}' must be ≤ {limit} (the most a config may ask for), got {limit + 1}")


def test_datacenters_codecs_and_faults_are_bounded_in_number() -> None:
    many = [{"name": f"dc-{i}"} for i in range(LIMITS["datacenters"] + 1)]
    assert config_error(with_changes("datacenters", many)) == (
        f"at most {LIMITS['datacenters']} datacenters (the most a config may ask for), got {len(many)} [[datacenters]] tables")
    assert len(parse_config(with_changes("datacenters", many[:-1])).datacenters) == LIMITS["datacenters"]
    codecs = ["int8"] * (LIMITS["compression.codecs"] + 1)
    assert "'compression.codecs' may list at most 16 codecs" in config_error(with_changes("compression", {"codecs": codecs}))
    faults = [{"datacenter": "us-east", "after_round": 1, "cut_s": 1.0}] * (LIMITS["link_faults"] + 1)
    assert config_error(with_changes("link_faults", faults)).startswith(f"at most {LIMITS['link_faults']} link faults")


def test_inner_steps_planned_sum_tau_over_the_rounds() -> None:
    for tau in (7, {"start": 2, "end": 8, "warmup_rounds": 2}, {"start": 1, "end": 86, "warmup_rounds": 10},
                {"start": 50, "end": 3, "warmup_rounds": 6, "kind": "geometric"}):
        for rounds in (1, 5, 12):
            config = parse_config(with_changes("run.rounds", rounds, with_changes("strategy.tau", tau)))
            assert inner_steps_planned(config) == sum(config.strategy.tau.tau(r) for r in range(1, rounds + 1))


# -- documented but not built yet ----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "key"),
    [
        ("checkpoint.every_rounds", -1, "checkpoint.every_rounds"),
        ("checkpoint.keep", -2, "checkpoint.keep"),
        ("checkpoint.dir", "  ", "checkpoint.dir"),
        ("checkpoint.often", 1, "checkpoint.often"),
        ("run.deadline", {"floor_s": 30, "ceiling_s": 10}, "run.deadline.ceiling_s"),
        ("run.deadline", {"floor_s": 0}, "run.deadline.floor_s"),
        ("run.deadline", {"k_mad": -1}, "run.deadline.k_mad"),
        ("run.deadline", {"min_history": 5, "window": 4}, "run.deadline.min_history"),
        ("run.deadline", {"floor": 3}, "run.deadline.floor"),
        ("run.deadline", 30, "run.deadline"),
    ],
)
def test_checkpoint_and_deadline_errors(path: str, value: Any, key: str) -> None:
    message = config_error(with_changes(path, value))
    assert f"'{key}'" in message and "\n" not in message


def test_checkpoint_and_deadline_values() -> None:
    from crossdc.experiment.config import CheckpointSection, DeadlinePolicy

    assert parse_config(minimal()).checkpoint == CheckpointSection(0, "checkpoints/", 3)
    doc = with_changes("checkpoint", {"every_rounds": 5, "dir": "s3://bucket/ckpt", "keep": 0})
    assert parse_config(doc).checkpoint == CheckpointSection(5, "s3://bucket/ckpt", 0)
    run = parse_config(with_changes("run.deadline", {"floor_s": 5, "ceiling_s": 600, "k_mad": 3})).run
    assert run.deadline == DeadlinePolicy(5.0, 600.0, 3.0) and run.round_timeout_s == 600.0
    both = with_changes("run.deadline", {"floor_s": 5})
    both["run"]["round_timeout_s"] = 10.0
    assert "not both" in config_error(both)


# -- [security] ------------------------------------------------------------------------------


def test_security_defaults_and_values() -> None:
    assert parse_config(minimal()).security == SecuritySection("none", 0.2, 0.0, None)
    doc = with_changes("security", {"robust_aggregation": "trimmed_mean", "trim_fraction": 0.1,
                                    "norm_rejection_factor": 10, "max_update_mb": 5})
    security = parse_config(doc).security
    assert security == SecuritySection("trimmed_mean", 0.1, 10.0, 5.0)
    assert isinstance(security.norm_rejection_factor, float) and isinstance(security.max_update_mb, float)
    assert parse_config(with_changes("security.robust_aggregation", "median")).security.robust_aggregation == "median"
    assert parse_config(with_changes("security.trim_fraction", 0, with_changes("security.robust_aggregation", "trimmed_mean"))
                        ).security.trim_fraction == 0.0


@pytest.mark.parametrize(
    ("path", "value", "key", "expected"),
    [
        ("security.robust_aggregation", "mean", "security.robust_aggregation", "must be one of \"none\", \"median\", \"trimmed_mean\""),
        ("security.robust_aggregation", 1, "security.robust_aggregation", "must be a string"),
        ("security.norm_rejection_factor", -1, "security.norm_rejection_factor", "≥ 0"),
        ("security.norm_rejection_factor", 0.5, "security.norm_rejection_factor", "0 (off) or > 1"),
        ("security.norm_rejection_factor", 1, "security.norm_rejection_factor", "0 (off) or > 1"),
        ("security.norm_rejection_factor", "3", "security.norm_rejection_factor", "must be a number"),
        ("security.norm_rejection_factor", True, "security.norm_rejection_factor", "must be a number"),
        ("security.norm_rejection_factor", float("nan"), "security.norm_rejection_factor", "finite"),
        ("security.max_update_mb", 0, "security.max_update_mb", "> 0"),
        ("security.max_update_mb", -2, "security.max_update_mb", "> 0"),
        ("security.max_update_mb", float("inf"), "security.max_update_mb", "finite"),
        ("security.max_update_mb", "1", "security.max_update_mb", "must be a number"),
        ("security.trim_fraction", 0.1, "security.trim_fraction", "only applies with robust_aggregation = \"trimmed_mean\""),
    ],
)
def test_security_errors_name_the_key(path: str, value: Any, key: str, expected: str) -> None:
    message = config_error(with_changes(path, value))
    assert f"'{key}'" in message and expected in message, message


@pytest.mark.parametrize("fraction", [0.5, 0.7, -0.1, float("nan")])
def test_trim_fraction_out_of_range(fraction: float) -> None:
    doc = with_changes("security.trim_fraction", fraction, with_changes("security.robust_aggregation", "trimmed_mean"))
    message = config_error(doc)
    assert "'security.trim_fraction'" in message and "[0, 0.5)" in message


def test_compression_codecs_are_parsed_and_checked_before_the_run() -> None:
    doc = with_changes("compression.codecs", ["topk:0.01:warmup=3", "int8"])
    assert parse_config(doc).compression.codecs == ("topk:0.01:warmup=3", "int8")
    assert parse_config(with_changes("compression.downlink_codecs", ["int8"])).compression.downlink_codecs == ("int8",)
    assert "compression.downlink_codecs" in config_error(with_changes("compression.downlink_codecs", ["zip"]))
    for codecs, expected in ((["zip"], "unknown codec 'zip'"), (["topk:0"], "fraction"), (["topk:1.5"], "fraction"),
                             ("int8", "must be a list"), (["int8", "topk:0.1"], "must come before")):
        message = config_error(with_changes("compression.codecs", codecs))
        assert "compression.codecs" in message and expected in message, message


def test_links_by_profile_numbers_or_both() -> None:
    by_name = parse_config(with_changes("datacenters.0.link", "transoceanic")).datacenters[0].link
    assert (by_name.name, by_name.bandwidth_mbps, by_name.rtt_ms, by_name.jitter_ms) == ("transoceanic", 100.0, 150.0, 0.0)
    explicit = parse_config(with_changes("datacenters.0.link", {"bandwidth_mbps": 50, "rtt_ms": 100, "jitter_ms": 5})).datacenters[0].link
    assert (explicit.name, explicit.bandwidth_mbps, explicit.rtt_ms, explicit.jitter_ms) == ("custom", 50.0, 100.0, 5.0)
    tuned = parse_config(with_changes("datacenters.0.link", {"profile": "continental", "jitter_ms": 3})).datacenters[0].link
    assert (tuned.name, tuned.bandwidth_mbps, tuned.rtt_ms, tuned.jitter_ms) == ("continental", 1000.0, 40.0, 3.0)
    assert "jitter_ms" in config_error(with_changes("datacenters.0.link", {"bandwidth_mbps": 50, "rtt_ms": 1, "jitter_ms": -1}))
    assert "missing key 'datacenters[0].link.rtt_ms'" in config_error(with_changes("datacenters.0.link", {"bandwidth_mbps": 50}))


def test_link_faults() -> None:
    doc = minimal()
    name = doc["datacenters"][0]["name"]
    doc["link_faults"] = [{"datacenter": name, "after_round": 1, "cut_s": 5}]
    fault = parse_config(doc).link_faults[0]
    assert (fault.datacenter, fault.after_round, fault.kind, fault.cut_s) == (name, 1, "cut", 5.0)
    assert (fault.between, fault.after_s, fault.target) == (None, None, name)
    doc["link_faults"] = [{"datacenter": "nowhere", "after_round": 1, "cut_s": 5}]
    assert "'link_faults[0].datacenter'" in config_error(doc)
    doc["link_faults"] = [{"datacenter": name, "after_round": 1}]
    assert "'link_faults[0].cut_s' must be > 0" in config_error(doc)
    doc["link_faults"] = [{"datacenter": name, "after_round": 1, "kind": "flood"}]
    assert "'cut' or 'reset'" in config_error(doc)


def test_link_loss_is_parsed_and_checked() -> None:
    lossy = parse_config(with_changes("datacenters.0.link", {"profile": "continental", "loss": 0.01})).datacenters[0].link
    assert (lossy.name, lossy.bandwidth_mbps, lossy.rtt_ms, lossy.loss) == ("continental", 1000.0, 40.0, 0.01)
    assert lossy.describe() == "continental (1000 Mbps, 40 ms RTT, 1% loss)"
    assert parse_config(with_changes("datacenters.0.link", "metro")).datacenters[0].link.loss == 0.0
    assert parse_config(with_changes("datacenters.0.link", {"bandwidth_mbps": 5, "rtt_ms": 1, "loss": 0})).datacenters[0].link.loss == 0.0
    for loss in (-0.1, 1, 1.5, float("nan")):
        message = config_error(with_changes("datacenters.0.link", {"bandwidth_mbps": 50, "rtt_ms": 1, "loss": loss}))
        assert message.startswith("'datacenters[0].link.loss' must be in [0, 1)"), message
    message = config_error(with_changes("datacenters.0.link", {"profile": "metro", "loss": "1%"}))
    assert "'datacenters[0].link.loss' must be a number" in message


def three_datacenters(links: list[dict[str, Any]], faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    doc = minimal()
    doc["datacenters"].append({"name": "ap-south"})
    doc["links"] = links
    if faults is not None:
        doc["link_faults"] = faults
    return doc


def test_a_mesh_parses_by_profile_and_numbers() -> None:
    config = parse_config(three_datacenters([
        {"between": ["us-east", "eu-west"], "profile": "transoceanic"},
        {"between": ["eu-west", "ap-south"], "bandwidth_mbps": 200, "rtt_ms": 110, "jitter_ms": 2, "loss": 0.001},
        {"between": ["ap-south", "us-east"], "profile": "continental", "rtt_ms": 60},
    ]))
    assert config.links == (
        MeshLink(("us-east", "eu-west"), LINK_PROFILES["transoceanic"]),
        MeshLink(("eu-west", "ap-south"), LinkSpec("custom", 200.0, 110.0, jitter_ms=2.0, loss=0.001)),
        MeshLink(("ap-south", "us-east"), LinkSpec("custom", 1000.0, 60.0)),
    )
    assert parse_config(minimal()).links == ()


def test_mesh_link_is_order_insensitive() -> None:
    config = parse_config(three_datacenters([{"between": ["us-east", "eu-west"], "profile": "metro"}]))
    assert config.mesh_link("us-east", "eu-west") is config.links[0]
    assert config.mesh_link("eu-west", "us-east") is config.links[0]
    assert config.mesh_link("us-east", "ap-south") is None
    assert config.mesh_link("us-east", "us-east") is None


@pytest.mark.parametrize(("links", "expected"), [
    ([{"profile": "metro"}], "missing key 'links[0].between'"),
    ([{"between": "us-east", "profile": "metro"}], "'links[0].between' must be a list of two datacenter names"),
    ([{"between": ["us-east"], "profile": "metro"}], "'links[0].between' must be a list of two datacenter names"),
    ([{"between": ["us-east", "eu-west", "ap-south"], "profile": "metro"}], "'links[0].between' must be a list of two"),
    ([{"between": ["us-east", 3], "profile": "metro"}], "'links[0].between' must be a list of two datacenter names"),
    ([{"between": ["us-east", "mars"], "profile": "metro"}],
     "'links[0].between' names 'mars', not a configured datacenter (us-east, eu-west, ap-south)"),
    ([{"between": ["eu-west", "eu-west"], "profile": "metro"}], "'links[0].between' pairs datacenter 'eu-west' with itself"),
    ([{"between": ["us-east", "eu-west"], "profile": "metro"}, {"between": ["ap-south", "us-east"], "profile": "metro"},
      {"between": ["eu-west", "us-east"], "profile": "metro"}], "'links[0]' and 'links[2]' both join 'eu-west' and 'us-east'"),
    ([{"between": ["us-east", "eu-west"]}], "missing key 'links[0].bandwidth_mbps'"),
    ([{"between": ["us-east", "eu-west"], "profile": "ocean"}], "unknown link profile 'ocean' in 'links[0].profile'"),
    ([{"between": ["us-east", "eu-west"], "bandwidth_mbps": 0, "rtt_ms": 1}], "'links[0].bandwidth_mbps' must be > 0"),
    ([{"between": ["us-east", "eu-west"], "profile": "metro", "loss": 1.0}], "'links[0].loss' must be in [0, 1)"),
    ([{"between": ["us-east", "eu-west"], "profile": "metro", "loss": -0.5}], "'links[0].loss' must be in [0, 1)"),
    ([{"between": ["us-east", "eu-west"], "profile": "metro", "latency": 3}], "unknown key 'links[0].latency'"),
    ({"between": ["us-east", "eu-west"]}, "'links' must be an array of tables ([[links]])"),
])
def test_mesh_errors(links: Any, expected: str) -> None:
    message = config_error(three_datacenters(links))
    assert expected in message, message


def test_link_faults_on_a_mesh_link_and_by_time() -> None:
    links = [{"between": ["us-east", "eu-west"], "profile": "metro"}]
    config = parse_config(three_datacenters(links, [
        {"between": ["eu-west", "us-east"], "after_s": 12.5, "cut_s": 3},
        {"datacenter": "ap-south", "after_s": 0, "kind": "reset"},
        {"between": ["us-east", "eu-west"], "after_round": 2, "kind": "reset"},
    ]))
    assert config.link_faults == (
        LinkFault(between=("us-east", "eu-west"), after_s=12.5, cut_s=3.0),
        LinkFault(datacenter="ap-south", after_s=0.0, kind="reset"),
        LinkFault(between=("us-east", "eu-west"), after_round=2, kind="reset"),
    )
    assert [f.target for f in config.link_faults] == ["us-east<->eu-west", "ap-south", "us-east<->eu-west"]


@pytest.mark.parametrize(("fault", "expected"), [
    ({"after_round": 1, "cut_s": 5}, "'link_faults[0]' needs one of 'datacenter' (a datacenter's link) and 'between'"),
    ({"datacenter": "us-east", "between": ["us-east", "eu-west"], "after_round": 1, "cut_s": 5},
     "'link_faults[0]' gives both 'datacenter' (a datacenter's link) and 'between'"),
    ({"datacenter": "us-east", "cut_s": 5}, "'link_faults[0]' needs one of 'after_round' (rounds logged) and 'after_s'"),
    ({"datacenter": "us-east", "after_round": 1, "after_s": 2.0, "cut_s": 5}, "'link_faults[0]' gives both 'after_round'"),
    ({"between": ["us-east", "ap-south"], "after_round": 1, "cut_s": 5},
     "'link_faults[0].between' = ['us-east', 'ap-south'] is not a link listed in [[links]] (listed: us-east<->eu-west)"),
    ({"between": ["us-east", "mars"], "after_round": 1, "cut_s": 5}, "'link_faults[0].between' names 'mars'"),
    ({"between": ["us-east"], "after_round": 1, "cut_s": 5}, "'link_faults[0].between' must be a list of two"),
    ({"datacenter": "us-east", "after_s": -1, "cut_s": 5}, "'link_faults[0].after_s' must be ≥ 0, got -1.0"),
    ({"datacenter": "us-east", "after_s": True, "cut_s": 5}, "'link_faults[0].after_s' must be a number"),
    ({"between": ["us-east", "eu-west"], "after_s": 1}, "'link_faults[0].cut_s' must be > 0"),
])
def test_link_fault_errors(fault: dict[str, Any], expected: str) -> None:
    message = config_error(three_datacenters([{"between": ["us-east", "eu-west"], "profile": "metro"}], [fault]))
    assert expected in message, message


def test_a_fault_on_a_mesh_link_needs_links() -> None:
    doc = minimal()
    doc["link_faults"] = [{"between": ["us-east", "eu-west"], "after_round": 1, "cut_s": 5}]
    assert "is not a link listed in [[links]] (listed: none)" in config_error(doc)


def test_bad_link_is_reported_before_not_implemented() -> None:
    message = config_error(with_changes("datacenters.0.link", "interplanetary"))
    assert "unknown link profile 'interplanetary'" in message and "transoceanic" in message


# -- files -----------------------------------------------------------------------------------


def test_invalid_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[run\nrounds = 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "not valid TOML" in message and str(path) in message
    assert "\n" not in message


def test_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: {path}")):
        load_config(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)


def test_file_errors_are_the_same_as_dict_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL_TOML.replace("rounds = 3", "rounds = 3\nroudns = 4"))
    with pytest.raises(ConfigError, match=r"unknown key 'run.roudns' \(did you mean 'rounds'\?\)"):
        load_config(path)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(("key", "literal"), [("round_timeout_s", "nan"), ("lr", "nan"), ("lr", "inf")])
def test_non_finite_numbers_are_rejected(tmp_path: Path, key: str, literal: str) -> None:
    section = "[run]" if key == "round_timeout_s" else "[workload]"
    path = tmp_path / "c.toml"
    path.write_text(MINIMAL_TOML.replace(section, f"{section}\n{key} = {literal}"))
    with pytest.raises(ConfigError, match=key):
        load_config(path)


def test_workers_must_divide_the_batch() -> None:
    doc = with_changes("datacenters.0.workers", 2)
    assert parse_config(doc).datacenters[0].workers == 2
    doc = with_changes("datacenters.0.workers", 3, with_changes("workload.batch_size", 32))
    message = config_error(doc)
    assert "batch_size" in message and "divisible" in message


# -- workload.model may be left out: the workload's default model -------------------------------------------


def test_a_config_without_a_model_runs_with_the_workloads_default(tmp_path: Path) -> None:
    from crossdc.experiment.builders import build_workload
    from crossdc.testing.inprocess import InProcessFederation
    from crossdc.workloads.models import SoftmaxRegression

    doc = with_changes("workload.model", DELETE)
    doc["strategy"]["tau"] = 2
    config = parse_config(doc)
    assert config.workload.model is None
    workload = build_workload(config)
    assert workload.spec.model == "linear"  # SyntheticWorkload.default_model
    assert isinstance(workload.make_model(), SoftmaxRegression)
    fed = InProcessFederation.from_config(config, tmp_path)
    before = fed.evaluate()[0]
    result = fed.run_round()
    assert not result.rejected and len(result.updates) == 2 and result.tau == 2
    assert fed.workload.spec.model == "linear"
    assert fed.evaluate()[0] < before


@pytest.mark.parametrize(("dataset", "model"), [("synthetic", "linear"), ("digits", "mlp"), ("mnist1d", "mlp"),
                                                ("shakespeare", "char-transformer")])
def test_every_built_in_workload_has_a_default_model_it_accepts(dataset: str, model: str) -> None:
    from crossdc.workloads import available_workloads

    cls = available_workloads()[dataset]
    assert cls.default_model == model and cls.default_model_name() == model and model in cls.models


def test_the_default_model_takes_the_configs_model_args() -> None:
    from crossdc.experiment.builders import build_workload

    doc = with_changes("workload", {"dataset": "digits", "model_args": {"hidden": 16}})
    workload = build_workload(parse_config(doc))
    assert workload.spec.model == "mlp" and workload.model_args == {"hidden": 16, "layers": 2}


def test_an_unknown_model_still_gets_a_clear_error() -> None:
    from crossdc.experiment.builders import build_workload
    from crossdc.workloads import WorkloadError

    with pytest.raises(WorkloadError, match=r"^unknown model 'resnet' for dataset 'synthetic'; known: linear, mlp$"):
        build_workload(parse_config(with_changes("workload.model", "resnet")))
    assert "'workload.model' must be a string" in config_error(with_changes("workload.model", 3))


def test_a_workload_with_several_models_and_no_default_asks_for_one() -> None:
    from crossdc.workloads import WorkloadError, WorkloadSpec
    from crossdc.workloads.synthetic import SyntheticWorkload

    undecided = type("Undecided", (SyntheticWorkload,), {"name": "undecided", "default_model": None})
    with pytest.raises(WorkloadError, match=r"dataset 'undecided' has no default model: set workload.model to one of linear, mlp"):
        undecided(WorkloadSpec(dataset="undecided"), ["a"], 0)
    single = type("Single", (SyntheticWorkload,), {"name": "single", "default_model": None, "models": ("mlp",)})
    assert single(WorkloadSpec(dataset="single"), ["a"], 0).spec.model == "mlp"  # the only model is the default
