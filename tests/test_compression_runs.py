"""Compression end to end on real Flower (simulation engine): counted bytes, a ≥ 100× smaller upload, and int8
that does not silently break training; a corrupted payload is rejected by the server's gate."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import client_app_altering_replies, read_run
from flwr.app import Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import recorddict_to_proto

from crossdc.clients import client_app as real
from crossdc.experiment.config import parse_config
from crossdc.orchestration.local_run import LocalRunOptions, run_local
from crossdc.protocol import COMPRESSED_KEY, compressed_payload, encode_compressed, payload_bytes

REPO = Path(__file__).resolve().parents[1]
BAD_DATACENTER = "eu-west"


def shakespeare_config(codecs: list[str], downlink_codecs: list[str] | None = None, strategy: str = "fedavg") -> dict:
    """2 datacenters, a ~400k-parameter char transformer, 3 rounds of FedAvg (or `strategy`) at τ = 5: the same for
    every codec list."""
    doc = tomllib.loads((REPO / "crossdc" / "orchestration" / "demo.toml").read_text())
    doc["run"].update(rounds=3, name="compression-" + ("-".join(codecs) or "none"))
    doc["workload"]["model_args"].update(d_model=128)
    doc["strategy"] = {"name": strategy, "tau": {"start": 5, "end": 5, "warmup_rounds": 0}}
    doc["datacenters"] = [{"name": "us-east"}, {"name": "eu-west"}]
    doc["compression"] = {"codecs": codecs, "downlink_codecs": downlink_codecs or []}
    return doc


def _run(tmp_path: Path, codecs: list[str], downlink_codecs: list[str] | None = None, strategy: str = "fedavg") -> dict:
    db_url = f"sqlite:///{tmp_path / 'compression.db'}"
    result = run_local(parse_config(shakespeare_config(codecs, downlink_codecs, strategy)),
                       LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    return read_run(db_url, result.run_id)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("compression")
    runs = {name: _run(tmp, codecs) for name, codecs in
            {"none": [], "int8": ["int8"], "topk+int8": ["topk:0.01", "int8"]}.items()}
    runs["downlink int8"] = _run(tmp, [], ["int8"])
    runs["sparseloco"] = _run(tmp, ["chunk-topk:64:decay=0.95", "int2"], strategy="sparseloco")
    return runs


@pytest.mark.timeout(900)
def test_topk_int8_uploads_at_least_100x_fewer_bytes(runs: dict[str, dict]) -> None:
    for name, logged in runs.items():
        assert logged["run"]["status"] == "finished", name
        assert all(r["status"] == "ok" for r in logged["dc_rounds"]), name
    dense = [r["bytes_up"] for r in runs["none"]["rounds"]]
    sparse = [r["bytes_up"] for r in runs["topk+int8"]["rounds"]]
    ratios = [d / s for d, s in zip(dense, sparse, strict=False)]
    assert min(ratios) >= 100, ratios
    # bytes_up_raw is the same update as dense fp32 in every run: the compression ratio is exact
    assert [r["bytes_up_raw"] for r in runs["topk+int8"]["rounds"]] == [r["bytes_up_raw"] for r in runs["none"]["rounds"]]
    assert all(r["bytes_up"] < r["bytes_up_raw"] / 90 for r in runs["topk+int8"]["dc_rounds"])


@pytest.mark.timeout(900)
def test_int8_final_loss_within_2_percent_of_uncompressed(runs: dict[str, dict]) -> None:
    dense_loss = runs["none"]["rounds"][-1]["val_loss"]
    int8_loss = runs["int8"]["rounds"][-1]["val_loss"]
    assert abs(int8_loss - dense_loss) / dense_loss <= 0.02, (int8_loss, dense_loss)
    assert int8_loss < runs["int8"]["rounds"][0]["val_loss"]  # and it learns
    ratio = runs["none"]["rounds"][-1]["bytes_up"] / runs["int8"]["rounds"][-1]["bytes_up"]
    assert 3.5 < ratio < 4.0, ratio


@pytest.mark.timeout(900)
def test_downlink_int8_sends_a_digest_then_deltas_and_trains_as_well(runs: dict[str, dict]) -> None:
    logged = runs["downlink int8"]
    assert logged["run"]["status"] == "finished" and all(r["status"] == "ok" for r in logged["dc_rounds"])
    dense = [r["bytes_down"] for r in runs["none"]["rounds"]]
    down = [r["bytes_down"] for r in logged["rounds"]]
    assert down[0] < dense[0] / 100  # round 1: the initial weights' digest (each trainer builds them from the seed)
    assert all(d < dense_bytes / 3.5 for d, dense_bytes in zip(down[1:], dense[1:], strict=False)), (down, dense)
    dense_loss, loss = runs["none"]["rounds"][-1]["val_loss"], logged["rounds"][-1]["val_loss"]
    assert abs(loss - dense_loss) / dense_loss <= 0.02, (loss, dense_loss)


@pytest.mark.timeout(900)
def test_sparseloco_learns_on_flower_at_over_100x_fewer_uplink_bytes(runs: dict[str, dict]) -> None:
    """SparseLoCo's chunked top-k (64 of 4096, 2-bit values) through Flower: > 100× fewer bytes than the dense
    update in every round, and it learns."""
    logged = runs["sparseloco"]
    assert logged["run"]["status"] == "finished" and all(r["status"] == "ok" for r in logged["dc_rounds"])
    ratios = [r["bytes_up_raw"] / r["bytes_up"] for r in logged["dc_rounds"]]
    assert min(ratios) > 100, ratios
    losses = [r["val_loss"] for r in logged["rounds"]]
    assert losses[-1] < losses[0] - 0.05, losses


def test_counted_bytes_are_the_serialized_message() -> None:
    payload = np.frombuffer(b"CDC1" + bytes(range(200)), dtype=np.uint8)
    content = RecordDict(encode_compressed(payload))
    assert payload_bytes(content) == len(recorddict_to_proto(content).SerializeToString())
    assert np.array_equal(compressed_payload(content), payload)
    assert payload_bytes(content) - payload.nbytes < 80  # names and type of the record: its whole framing


def corrupting_client_app(corrupt: str) -> ClientApp:
    """The real ClientApp, except that BAD_DATACENTER's compressed update is damaged on its way out."""

    def alter(datacenter: str, reply: Message) -> None:
        if datacenter != BAD_DATACENTER:
            return
        payload = compressed_payload(reply.content).copy()  # frombuffer is read-only
        if corrupt == "truncated":
            payload = payload[: len(payload) - 7]
        else:  # a header that is not JSON any more
            payload[9:30] = ord("#")
        reply.content[COMPRESSED_KEY] = encode_compressed(payload)[COMPRESSED_KEY]

    return client_app_altering_replies(alter)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("corrupt", ["truncated", "garbage"])
def test_corrupted_payload_is_rejected_and_the_run_goes_on(corrupt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real, "app", corrupting_client_app(corrupt))
    doc = tomllib.loads((REPO / "examples" / "synthetic-2dc.toml").read_text())
    doc["compression"] = {"codecs": ["topk:0.5", "int8"]}
    db_url = f"sqlite:///{tmp_path / 'bad.db'}"
    result = run_local(parse_config(doc), LocalRunOptions(db_url=db_url, engine="simulation", runs_root=tmp_path / "runs"))
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished" and len(logged["rounds"]) == 3
    bad = [r for r in logged["dc_rounds"] if r["datacenter"] == BAD_DATACENTER]
    good = [r for r in logged["dc_rounds"] if r["datacenter"] != BAD_DATACENTER]
    assert all(r["status"] == "rejected" and r["reason"].startswith("undecodable update") for r in bad), [r["reason"] for r in bad]
    assert all(r["status"] == "ok" for r in good)
    assert sum(e["kind"] == "rejected" and e["datacenter"] == BAD_DATACENTER for e in logged["events"]) == 3
    final = np.load(result.run_dir / "final-weights.npz")
    assert all(np.all(np.isfinite(final[name])) for name in final.files)
