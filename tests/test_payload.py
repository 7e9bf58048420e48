"""The tensor wire format: one flat float32 Array plus a layout; exact byte counts."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from crossdc.protocol import (
    CONFIG_KEY,
    LAYOUT_KEY,
    RESULTS_OF,
    PayloadError,
    PipelineRequest,
    ProtocolError,
    StreamRequest,
    decode_tensors,
    encode_results,
    encode_tensors,
    payload_bytes,
    pipeline_config,
    raw_fp32_bytes,
    stream_config,
)


def test_round_trip_keeps_names_order_shapes_and_values() -> None:
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1.5], np.float32), "s": np.float32(2.0) * np.ones(())}
    decoded = decode_tensors(RecordDict(encode_tensors(arrays)))
    assert list(decoded) == ["b", "a", "s"]
    for name, value in arrays.items():
        assert decoded[name].shape == value.shape and decoded[name].dtype == np.float32
        np.testing.assert_array_equal(decoded[name], value)


def test_one_array_whatever_the_number_of_tensors() -> None:
    records = encode_tensors({f"t{i}": np.zeros(3, np.float32) for i in range(50)})
    assert len(list(records["arrays"].keys())) == 1


def test_bytes_are_the_payload_plus_small_framing() -> None:
    arrays = {"w": np.zeros((100, 100), np.float32), "b": np.zeros(100, np.float32)}
    size = payload_bytes(RecordDict(encode_tensors(arrays)))
    assert raw_fp32_bytes(arrays) == 40_400
    assert 40_400 < size < 40_400 + 400


@pytest.mark.parametrize("layout", ['[["w", [3]]]', '[["w", [1]]]', '[["w", [-2]]]', '[["w"]]', "not json"])
def test_a_layout_that_does_not_match_the_data_is_refused(layout: str) -> None:
    content = RecordDict(encode_tensors({"w": np.zeros(2, np.float32)}))
    content[LAYOUT_KEY] = ConfigRecord({"tensors": layout})
    with pytest.raises(PayloadError):
        decode_tensors(content)


def test_missing_records_are_refused() -> None:
    with pytest.raises(PayloadError, match="no tensors"):
        decode_tensors(RecordDict({}))


def _stream_message(results: dict, results_of: object) -> RecordDict:
    config = stream_config(exchange=6, server_round=3, tau=8, run_id="r", run_dir="", datacenter="a")
    config[RESULTS_OF] = results_of
    return RecordDict({**encode_results(results), CONFIG_KEY: ConfigRecord(config)})


def test_a_streaming_message_carries_the_results_of_several_exchanges() -> None:
    results = {3: {"w": np.arange(4, dtype=np.float32).reshape(2, 2)}, 4: {"w": np.ones(2, np.float32), "b": np.zeros(1, np.float32)}}
    request = StreamRequest.from_message(_stream_message(results, [3, 4]))
    assert sorted(request.results) == [3, 4] and sorted(request.results[4]) == ["b", "w"]
    np.testing.assert_array_equal(request.results[3]["w"], results[3]["w"])
    assert StreamRequest.from_dict(request.to_dict()).results.keys() == request.results.keys()
    with pytest.raises(ProtocolError, match="none of the exchanges"):  # a result the config does not announce
        StreamRequest.from_message(_stream_message(results, [3]))
    with pytest.raises(ProtocolError, match=r"no result tensors of exchange\(s\) \[5\]"):
        StreamRequest.from_message(_stream_message(results, [3, 4, 5]))
    with pytest.raises(ProtocolError, match="must be a list of integers"):
        StreamRequest.from_message(_stream_message(results, "3,4"))
    with pytest.raises(ProtocolError, match="no tensor group 'fragment-update'"):
        StreamRequest.from_message(_stream_message({}, [3]))
    with pytest.raises(ProtocolError, match="malformed stream request"):
        StreamRequest.from_dict({"run_id": "r", "exchange": 1, "tau": 8, "results": [1, 2]})


def test_compressed_results_travel_as_raw_bytes_beside_dense_ones() -> None:
    from crossdc.protocol import RESULT_PAYLOAD, payload_bytes, result_payload_key

    payload = np.arange(37, dtype=np.uint8)
    results = {3: {RESULT_PAYLOAD: payload}, 4: {"w": np.ones(2, np.float32)}}
    message = _stream_message(results, [3, 4])
    assert result_payload_key(3) in message and "fragment-update" in message
    request = StreamRequest.from_message(message)
    np.testing.assert_array_equal(request.results[3][RESULT_PAYLOAD], payload)
    np.testing.assert_array_equal(request.results[4]["w"], results[4]["w"])
    only_compressed = _stream_message({3: {RESULT_PAYLOAD: payload}}, [3])
    assert "fragment-update" not in only_compressed  # no empty dense group travels
    assert list(StreamRequest.from_message(only_compressed).results[3]) == [RESULT_PAYLOAD]
    assert payload_bytes(only_compressed) < payload_bytes(_stream_message({3: {"w": np.ones(37, np.float32)}}, [3]))
    both = _stream_message({3: {"w": np.ones(2, np.float32)}}, [3])
    both.array_records[result_payload_key(3)] = only_compressed.array_records[result_payload_key(3)]
    with pytest.raises(ProtocolError, match="both a compressed result and result tensors"):
        StreamRequest.from_message(both)


def test_a_pipeline_message_carries_a_replica_stage_s_global_blocks_through_to_its_trainer() -> None:
    task = pipeline_config(server_round=2, tau=3, run_id="r", run_dir="/tmp/r", datacenter="a", weights=True, attempt=1)
    blocks = {"net.0.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "net.0.bias": np.ones(2, np.float32)}
    request = PipelineRequest.from_message(RecordDict({CONFIG_KEY: ConfigRecord(task), **encode_tensors(blocks)}))
    assert request.weights and request.global_weights is not None
    again = PipelineRequest.from_dict(request.to_dict())  # over the trainer's local channel
    for name, value in blocks.items():
        np.testing.assert_array_equal(again.global_weights[name], value)
    assert PipelineRequest.from_message(RecordDict({CONFIG_KEY: ConfigRecord(task)})).global_weights is None
    spoiled = encode_tensors(blocks)
    spoiled[LAYOUT_KEY] = ConfigRecord({"tensors": '[["net.0.weight", [4, 4]]]'})
    with pytest.raises(ProtocolError, match="pipeline message"):
        PipelineRequest.from_message(RecordDict({CONFIG_KEY: ConfigRecord(task), **spoiled}))
