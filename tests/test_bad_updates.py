"""A datacenter that sends a bad update is rejected, recorded, and never touches the model.

Bad means: NaN, a wrong shape, a payload over the size limit, or an update whose norm is an outlier
(``security.norm_rejection_factor``). Also: a run with ``robust_aggregation = "median"`` learns.
Runs the real ServerApp and the real ClientApp under Flower's simulation engine;
one datacenter's replies are corrupted on their way out of its ClientApp.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import client_app_altering_replies, read_run
from flwr.app import Message
from flwr.clientapp import ClientApp

from crossdc.clients import client_app as real
from crossdc.experiment.config import ExperimentConfig, load_config, parse_config
from crossdc.orchestration.local_run import LocalRunOptions, run_local
from crossdc.protocol import decode_tensors, encode_tensors
from crossdc.testing.inprocess import InProcessFederation

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "synthetic-2dc.toml"
BAD_DATACENTER = "eu-west"


def corrupting_client_app(corrupt: str) -> ClientApp:
    """The real ClientApp, except that BAD_DATACENTER's updates are corrupted (`nan` or `shape`)."""

    def alter(datacenter: str, reply: Message) -> None:
        if datacenter != BAD_DATACENTER:
            return
        delta = {name: value.copy() for name, value in decode_tensors(reply.content).items()}
        name = next(iter(delta))
        if corrupt == "nan":
            delta[name] = np.full_like(delta[name], np.nan)
        else:
            delta[name] = np.zeros(delta[name].shape + (2,), dtype=np.float32)
        for key, record in encode_tensors(delta).items():
            reply.content[key] = record

    return client_app_altering_replies(alter)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("corrupt, reason", [("nan", "NaN"), ("shape", "shape")])
def test_bad_update_is_rejected_and_the_run_goes_on(corrupt: str, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real, "app", corrupting_client_app(corrupt))
    db_url = f"sqlite:///{tmp_path / 'bad.db'}"
    result = run_local(load_config(CONFIG), LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    logged = read_run(db_url, result.run_id)
    run, rounds, dc_rounds, events = logged["run"], logged["rounds"], logged["dc_rounds"], logged["events"]
    assert run["status"] == "finished" and len(rounds) == 3
    bad = [r for r in dc_rounds if r["datacenter"] == BAD_DATACENTER]
    good = [r for r in dc_rounds if r["datacenter"] != BAD_DATACENTER]
    assert all(r["status"] == "rejected" and reason in r["reason"] for r in bad)
    assert all(r["status"] == "ok" for r in good)
    assert sum(e["kind"] == "rejected" and e["datacenter"] == BAD_DATACENTER for e in events) == 3
    # the global model only ever saw the good datacenter's updates: finite, and learning
    assert all(np.isfinite(r["val_loss"]) for r in rounds)
    assert rounds[-1]["val_loss"] < rounds[0]["val_loss"]
    final = np.load(result.run_dir / "final-weights.npz")
    assert all(np.all(np.isfinite(final[name])) for name in final.files)
    # bytes are only counted for what was accepted in the raw column
    assert all(r["bytes_up_raw"] == 0 for r in bad) and all(r["bytes_up"] > 0 for r in bad)


PADDING_DATACENTER = "ap-south"


def three_datacenters(**security: Any) -> ExperimentConfig:
    """The synthetic example with a third datacenter (PADDING_DATACENTER), 2 rounds, and the given [security] keys."""
    doc = tomllib.loads(CONFIG.read_text())
    doc["run"]["rounds"] = 2
    doc["datacenters"].append({"name": PADDING_DATACENTER})
    doc["security"] = security
    return parse_config(doc)


def inflating_and_padding_client_app() -> ClientApp:
    """The real ClientApp, except that BAD_DATACENTER's updates are 1000× larger, and PADDING_DATACENTER's replies
    carry 2 MB of padding besides its real update (over the default size limit of this tiny model)."""

    def alter(datacenter: str, reply: Message) -> None:
        if datacenter == BAD_DATACENTER:
            records = encode_tensors({name: value * np.float32(1000) for name, value in decode_tensors(reply.content).items()})
        elif datacenter == PADDING_DATACENTER:
            records = encode_tensors({"padding": np.zeros(500_000, np.float32)}, "padding")
        else:
            return
        for key, record in records.items():
            reply.content[key] = record

    return client_app_altering_replies(alter)


@pytest.mark.timeout(300)
def test_outlier_norm_and_oversized_updates_are_rejected_and_only_the_honest_ones_are_aggregated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real, "app", inflating_and_padding_client_app())
    config = three_datacenters(norm_rejection_factor=10)
    db_url = f"sqlite:///{tmp_path / 'gate.db'}"
    result = run_local(config, LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished" and len(logged["rounds"]) == 2
    reasons = {BAD_DATACENTER: "exceeds 10 × ", PADDING_DATACENTER: "exceeds the limit of"}
    for row in logged["dc_rounds"]:
        if row["datacenter"] in reasons:
            assert row["status"] == "rejected" and reasons[row["datacenter"]] in row["reason"], row
            assert row["bytes_up_raw"] == 0
        else:
            assert row["status"] == "ok", row
    norm_rows = [r for r in logged["dc_rounds"] if r["datacenter"] == BAD_DATACENTER]
    assert len(norm_rows) == 2 and all("update norm" in r["reason"] and "median norm of the round's other accepted "
                                       "updates" in r["reason"] for r in norm_rows)
    events = sorted((e["datacenter"], e["round"]) for e in logged["events"] if e["kind"] == "rejected")
    assert events == sorted((dc, r) for dc in reasons for r in (1, 2))
    # the padded reply is refused before the norm check, so the outlier is judged against the one honest update
    # (leave-one-out: the honest one stays). The global model is exactly the aggregate of the honest updates,
    # round after round: the same experiment driven in-process (the same trainer code and seeds) with only the
    # honest datacenter taking part
    honest = [dc for dc in config.datacenter_names if dc not in reasons]
    reference = InProcessFederation.from_config(config, tmp_path / "reference")
    for _ in range(config.run.rounds):
        assert not reference.run_round(participants=honest).rejected
    final = np.load(result.run_dir / "final-weights.npz")
    assert sorted(final.files) == sorted(reference.weights)
    for name, value in reference.weights.items():
        np.testing.assert_array_equal(final[name], value, err_msg=name)


@pytest.mark.timeout(300)
def test_a_run_with_median_aggregation_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real, "app", client_app_altering_replies(lambda datacenter, reply: None))
    db_url = f"sqlite:///{tmp_path / 'median.db'}"
    result = run_local(three_datacenters(robust_aggregation="median"),
                       LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished"
    assert len(logged["dc_rounds"]) == 6 and all(r["status"] == "ok" for r in logged["dc_rounds"])
    rounds = logged["rounds"]
    assert len(rounds) == 2 and rounds[-1]["val_loss"] < rounds[0]["val_loss"]
