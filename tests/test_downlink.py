"""Downlink compression: the server and the datacenters in step hold the same reference; the others get it in full."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from crossdc.clients.state_store import DatacenterStateStore
from crossdc.compression.downlink import DownlinkOutOfSync, DownlinkSender, receive
from crossdc.protocol import CONFIG_KEY, global_model

SHAPES = {"w": (40, 30), "b": (30,)}


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _deliver(sender: DownlinkSender, datacenter: str, store: DatacenterStateStore, server_round: int) -> tuple[str, dict]:
    """What the ClientApp and the trainer do with the round's message for `datacenter`."""
    records, cfg = sender.message_for(datacenter)
    content = RecordDict({**records, CONFIG_KEY: ConfigRecord(cfg)})
    request = global_model(content)["downlink"]
    return request["kind"], receive(request, store, server_round)


def test_references_stay_identical_and_a_missed_round_gets_the_full_model(tmp_path: Path) -> None:
    sender = DownlinkSender(["topk:0.2", "int8"])
    stores = {dc: DatacenterStateStore(tmp_path, "run", dc) for dc in ("a", "b")}
    weights = _weights(0)
    kinds: dict[str, list[str]] = {"a": [], "b": []}
    for server_round in range(1, 8):
        weights = {k: v + 0.1 * _weights(server_round)[k] for k, v in weights.items()}
        sender.prepare(weights, server_round)
        for dc, store in stores.items():
            if dc == "b" and server_round == 4:
                continue  # b misses round 4: no message, no acknowledgement
            kind, reference = _deliver(sender, dc, store, server_round)
            kinds[dc].append(kind)
            for name in SHAPES:
                assert np.array_equal(reference[name], sender.reference[name]), (server_round, dc, name)
            sender.acknowledge(dc)
    assert kinds["a"] == ["full"] + ["delta"] * 6
    assert kinds["b"] == ["full", "delta", "delta", "full", "delta", "delta"]
    # error feedback keeps the reference close to the true model
    assert max(float(np.abs(sender.reference[k] - weights[k]).max()) for k in SHAPES) < 0.5


def test_a_delta_for_another_version_is_refused(tmp_path: Path) -> None:
    sender = DownlinkSender(["int8"])
    store = DatacenterStateStore(tmp_path, "run", "a")
    sender.prepare(_weights(0), 1)
    _deliver(sender, "a", store, 1)
    sender.acknowledge("a")
    sender.prepare(_weights(1), 2)
    sender.prepare(_weights(2), 3)  # a round this datacenter never saw
    sender.acknowledged["a"] = 2  # the server wrongly believes it is in step
    with pytest.raises(DownlinkOutOfSync, match="holds 1"):
        _deliver(sender, "a", store, 3)


def test_delta_messages_are_smaller(tmp_path: Path) -> None:
    from crossdc.protocol import payload_bytes

    sender = DownlinkSender(["int8"])
    sender.prepare(_weights(0), 1)
    full = payload_bytes(RecordDict(sender.message_for("a")[0]))
    sender.acknowledge("a")
    sender.prepare(_weights(1), 2)
    delta = payload_bytes(RecordDict(sender.message_for("a")[0]))
    assert delta < full / 3.5


def test_a_sparse_downlink_catches_up_without_overshooting() -> None:
    """x − x̂ already holds what earlier rounds did not send: each round sends the largest quarter of what is
    still missing, so a model that stops moving is reached exactly in 4 rounds and the gap never grows."""
    target = {"w": np.array([8.0, -7.0, 6.0, -5.0, 4.0, -3.0, 2.0, -1.0], dtype=np.float32)}
    sender = DownlinkSender(["topk:0.25"])
    sender.prepare({"w": np.zeros(8, dtype=np.float32)}, 1)
    gaps = []
    for server_round in range(2, 6):
        sender.prepare(target, server_round)
        gaps.append(float(np.abs(target["w"] - sender.reference["w"]).max()))
    assert gaps == [6.0, 4.0, 2.0, 0.0]
    assert sender.pipeline.residuals == {}
