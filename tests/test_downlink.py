"""Downlink compression: the server and the datacenters in step hold the same reference; the others get it in full."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from crossdc.clients.state_store import DatacenterStateStore
from crossdc.compression.downlink import DownlinkOutOfSync, DownlinkSender, receive, weights_digest
from crossdc.protocol import CONFIG_KEY, global_model, payload_bytes

SHAPES = {"w": (40, 30), "b": (30,)}


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _deliver(sender: DownlinkSender, datacenter: str, store: DatacenterStateStore, server_round: int,
             initial: dict[str, np.ndarray] | None = None) -> tuple[str, dict]:
    """What the ClientApp and the trainer do with the round's message for `datacenter` (whose trainer builds the
    run's initial weights as `initial`)."""
    records, cfg = sender.message_for(datacenter)
    content = RecordDict({**records, CONFIG_KEY: ConfigRecord(cfg)})
    request = global_model(content)["downlink"]
    return request["kind"], receive(request, store, server_round, None if initial is None else lambda: initial)


def test_round_one_sends_the_initial_weights_digest_and_a_datacenter_that_built_others_gets_them_in_full(
        tmp_path: Path) -> None:
    initial = _weights(0)
    sender = DownlinkSender(["int8"], initial_digest=weights_digest(initial))
    stores = {dc: DatacenterStateStore(tmp_path, "run", dc) for dc in ("a", "b")}
    sender.prepare(initial, 1)
    records, cfg = sender.message_for("a")
    assert records == {} and payload_bytes(RecordDict({CONFIG_KEY: ConfigRecord(cfg)})) < 200  # no model: its digest
    kind, reference = _deliver(sender, "a", stores["a"], 1, initial=initial)
    assert kind == "initial" and all(np.array_equal(reference[k], initial[k]) for k in SHAPES)
    sender.acknowledge("a")
    other = _weights(7)  # b's trainer built other weights (another seed, another library): it refuses round 1
    with pytest.raises(DownlinkOutOfSync, match="initial weights .* are not the coordinator's"):
        _deliver(sender, "b", stores["b"], 1, initial=other)
    with pytest.raises(DownlinkOutOfSync, match="cannot build them"):
        _deliver(sender, "b", stores["b"], 1)
    sender.prepare({k: v + 0.5 for k, v in initial.items()}, 2)
    assert _deliver(sender, "a", stores["a"], 2, initial=initial)[0] == "delta"
    kind, reference = _deliver(sender, "b", stores["b"], 2, initial=other)
    assert kind == "full" and all(np.array_equal(reference[k], sender.reference[k]) for k in SHAPES)
    # a run whose round 1 is not at the initial weights (resumed, warm-started) sends them in full
    warm = DownlinkSender(["int8"], initial_digest=weights_digest(initial))
    warm.prepare(_weights(1), 1)
    assert _deliver(warm, "a", DatacenterStateStore(tmp_path, "warm", "a"), 1, initial=initial)[0] == "full"
    assert weights_digest(initial) == weights_digest({k: initial[k].copy() for k in reversed(list(initial))})
    assert weights_digest(initial) != weights_digest({**initial, "b": initial["b"] + np.float32(1e-7)})


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


@pytest.mark.parametrize("eager", [False, True])
def test_a_streaming_runs_results_travel_compressed_and_both_sides_agree(eager: bool) -> None:
    """FragmentDownlink: with eager off the server's reference and a datacenter's merged values stay bit-identical
    over exchanges and close in on the global values (the reference is the error feedback); with eager on the mean
    updates go with error feedback, so what one exchange leaves out goes with the fragment's next."""
    from crossdc.compression.downlink import FragmentDownlink, decode_result
    from crossdc.protocol import RESULT_PAYLOAD

    rng = np.random.default_rng(2)
    initial = {"a.weight": rng.normal(size=(8, 6)).astype(np.float32), "b.bias": rng.normal(size=6).astype(np.float32)}
    sender = FragmentDownlink(["topk:0.25", "int8"], initial, eager=eager, seed=0)
    held = {n: v.copy() for n, v in initial.items()}  # the datacenter's values as last merged (θ_ref)
    sent_total = {n: np.zeros_like(v) for n, v in initial.items()}
    target = {n: v + 1.0 for n, v in initial.items()}  # the global values (eager off) the downlink closes in on
    for exchange in range(1, 9):
        result = {n: (target[n] if not eager else np.full_like(v, 0.1)) for n, v in initial.items()}
        wire = sender.encode(exchange, result)
        assert list(wire) == [RESULT_PAYLOAD] and wire[RESULT_PAYLOAD].dtype == np.uint8
        merged = decode_result(wire, held, eager)
        if eager:
            for n in merged:
                sent_total[n] += merged[n]
        else:
            held = merged
            for n in held:
                np.testing.assert_array_equal(held[n], sender.reference[n])  # the same reference on both sides
    if eager:  # 8 means of 0.1 each went down: what did not arrive is exactly the residual the next one carries
        for n, total in sent_total.items():
            np.testing.assert_allclose(total + sender.pipeline.residuals[n].numpy(), 0.8, atol=1e-5)
            assert np.abs(total - 0.8).mean() < 0.2, n
    else:
        for n in held:
            assert np.abs(held[n] - target[n]).max() < 0.05, n
    dense = {"a.weight": np.ones((8, 6), np.float32)}
    np.testing.assert_array_equal(decode_result(dense, {"a.weight": initial["a.weight"]}, eager)["a.weight"], 1.0)
    restored = FragmentDownlink(["topk:0.25", "int8"], initial, eager=eager, seed=0)
    restored.load_state_dict(sender.state_dict())
    nxt = {n: (target[n] if not eager else np.full_like(v, 0.1)) for n, v in initial.items()}
    np.testing.assert_array_equal(restored.encode(9, nxt)[RESULT_PAYLOAD], sender.encode(9, nxt)[RESULT_PAYLOAD])
