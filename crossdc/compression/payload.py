"""What crosses the WAN: record names in Flower messages, conversions, and exact byte counts.

Numpy only (no torch): the short-lived ClientApp imports this.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

#: record holding tensors: the global weights (down) or the update (up)
ARRAYS_KEY = "arrays"
#: config record of a server → datacenter message
CONFIG_KEY = "config"
#: metrics record of a datacenter's reply
METRICS_KEY = "metrics"


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Wrap named numpy arrays, keeping their order."""
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in arrays.items()})


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Unwrap an ArrayRecord into named numpy arrays (order kept)."""
    return {name: array.numpy() for name, array in record.items()}


def payload_bytes(content: RecordDict) -> int:
    """Exact size in bytes of a message's content as Flower serialises it (protobuf)."""
    return recorddict_to_proto(content).ByteSize()


def raw_fp32_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Size of the same tensors sent densely as fp32 (the uncompressed reference)."""
    return int(sum(int(np.size(a)) * 4 for a in arrays.values()))
