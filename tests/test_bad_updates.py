"""A datacenter that sends a NaN or wrongly shaped update is rejected, recorded, and never touches the model.

Runs the real ServerApp and the real ClientApp under Flower's simulation engine;
one datacenter's replies are corrupted on their way out of its ClientApp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message
from flwr.clientapp import ClientApp

from crossdc.clients import client_app as real
from crossdc.compression.payload import decode_tensors, encode_tensors
from conftest import client_app_altering_replies, read_run
from crossdc.platform.config import load_config
from crossdc.platform.local_run import LocalRunOptions, run_local

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
