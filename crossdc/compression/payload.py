"""What crosses the WAN: the tensor wire format inside Flower messages, and exact byte counts.

Wire format: all tensors of a message travel as ONE flat float32 Array (record ``arrays``, entry
``flat``) plus a small layout record (``layout``: tensor names and shapes, in order). Flower 1.42
makes one request per object it transfers (each record, each Array, each 5 MiB chunk), so one
Array instead of one per tensor saves a WAN round trip per pair of tensors in each direction
(for the demo's transformer: 67 → 9 round trips per round).

Numpy only (no torch): the short-lived ClientApp imports this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

#: record holding tensors: the global weights (down) or the update (up)
ARRAYS_KEY = "arrays"
#: names and shapes of the tensors packed in ARRAYS_KEY
LAYOUT_KEY = "layout"
#: config record of a server → datacenter message
CONFIG_KEY = "config"
#: a strategy's control variates, as a second tensor group (SCAFFOLD: the server's c down, a datacenter's Δc_i up)
CONTROL_KEY = "control"
#: metrics record of a datacenter's reply
METRICS_KEY = "metrics"
#: record holding a codec pipeline's payload (the update, compressed) instead of ARRAYS_KEY
COMPRESSED_KEY = "compressed"
FLAT = "flat"
PAYLOAD = "payload"
#: config keys and record of a train message whose global model comes through `downlink_codecs`
#: (crossdc.compression.downlink): "full" or "delta", the reference version a delta applies to, the version after it
DOWNLINK = "downlink"
DOWNLINK_BASE = "downlink-base"
DOWNLINK_VERSION = "downlink-version"
DOWNLINK_KEY = "downlink"
#: Flower Array serialisation type of a codec payload: the bytes as they are
PAYLOAD_STYPE = "crossdc.payload"


class PayloadError(ValueError):
    """A message's tensors cannot be decoded (missing records, or a layout that does not match the data)."""


def layout_key(group: str) -> str:
    """The layout record of tensor group `group`: LAYOUT_KEY for the main group ARRAYS_KEY, else ``<group>-layout``."""
    return LAYOUT_KEY if group == ARRAYS_KEY else f"{group}-layout"


def encode_tensors(arrays: Mapping[str, np.ndarray], group: str = ARRAYS_KEY) -> dict[str, ArrayRecord | ConfigRecord]:
    """The records carrying `arrays` (float32) as tensor group `group`: {group: one flat Array, layout_key(group): names
    and shapes}. The main group (weights down, the update up) is ARRAYS_KEY; a strategy's extra tensors travel as
    further groups under named constants (e.g. CONTROL_KEY), in the same message."""
    names = list(arrays)
    flat = np.concatenate([np.asarray(arrays[n], dtype=np.float32).ravel() for n in names]) if names else np.zeros(0, np.float32)
    layout = json.dumps([[n, list(np.shape(arrays[n]))] for n in names])
    return {group: ArrayRecord({FLAT: Array(flat)}), layout_key(group): ConfigRecord({"tensors": layout})}


def has_tensors(content: RecordDict, group: str) -> bool:
    """Whether the message carries tensor group `group` (both its records)."""
    return group in content and layout_key(group) in content


def decode_tensors(content: RecordDict, group: str = ARRAYS_KEY) -> dict[str, np.ndarray]:
    """The named tensors of group `group` of a message encoded by :func:`encode_tensors`; PayloadError if the message
    does not carry that group or it does not decode (a missing group fails here, never as an empty dict)."""
    try:
        flat = content[group][FLAT].numpy()
        layout = json.loads(str(content[layout_key(group)]["tensors"]))
    except (KeyError, TypeError, ValueError) as err:
        what = "no tensors" if group == ARRAYS_KEY else f"no tensor group '{group}'"
        raise PayloadError(f"{what} in the message ({type(err).__name__}: {err})") from None
    if flat.ndim != 1:
        raise PayloadError(f"the packed tensors must be one flat array, got shape {flat.shape}")
    result: dict[str, np.ndarray] = {}
    offset = 0
    for entry in layout:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(isinstance(d, int) and d >= 0 for d in entry[1])):
            raise PayloadError(f"malformed layout entry {entry!r}")
        name, shape = entry
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if offset + size > flat.size:
            raise PayloadError(f"layout needs more values than the {flat.size} sent (at tensor '{name}')")
        result[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    if offset != flat.size:
        raise PayloadError(f"layout covers {offset} values but {flat.size} were sent")
    return result


def encode_compressed(payload: np.ndarray, key: str = COMPRESSED_KEY) -> dict[str, ArrayRecord]:
    """The record carrying a codec pipeline's payload (see crossdc.compression.wire) as raw bytes: about 40 bytes
    of Flower framing instead of the ~170 of a numpy array (whose .npy header would travel too)."""
    data = np.ascontiguousarray(payload, dtype=np.uint8).tobytes()
    return {key: ArrayRecord({PAYLOAD: Array(dtype="uint8", shape=(len(data),), stype=PAYLOAD_STYPE, data=data)})}


def compressed_payload(content: RecordDict, key: str = COMPRESSED_KEY) -> np.ndarray:
    """The payload bytes of a message built by :func:`encode_compressed`; PayloadError if it has none."""
    try:
        array = content[key][PAYLOAD]
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"no compressed update in the message ({type(err).__name__}: {err})") from None
    if array.stype != PAYLOAD_STYPE or array.dtype != "uint8" or list(array.shape) != [len(array.data)]:
        raise PayloadError(f"the compressed update must be raw bytes, got {array.stype} {array.dtype} {array.shape}")
    return np.frombuffer(array.data, dtype=np.uint8)


def payload_bytes(content: RecordDict) -> int:
    """Exact size in bytes of a message's content as Flower serialises it (protobuf)."""
    return recorddict_to_proto(content).ByteSize()


def raw_fp32_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """Size of the same tensors sent densely as fp32 (the uncompressed reference)."""
    return int(sum(int(np.size(a)) * 4 for a in arrays.values()))
