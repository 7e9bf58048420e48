"""The update's trip up the WAN: encoded at the datacenter, decoded at the server, the same way everywhere.

- :func:`encode_update` (datacenter, local rank 0): the round's update through the run's codec pipeline,
  whose state (error-feedback residuals, DGC velocity, PowerSGD's Q) is read from and written back to the
  datacenter's durable state store every round, tagged with the round, so a restarted trainer or SuperNode
  continues exactly;
- :func:`decode_update` (server): the update a reply carries, dense float32 by name, compressed or not;
  a reply in the other form than the run's config says, or one the codecs cannot decode (truncated,
  corrupted, wrong names or shapes, NaN/Inf), raises :class:`~crossdc.compression.wire.CodecError`.

A strategy's extra tensor groups (SCAFFOLD's control variates) travel uncompressed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import RecordDict

from crossdc import protocol as proto
from crossdc.compression.pipeline import CodecPipeline, decode_payload
from crossdc.compression.wire import CodecError
from crossdc.protocol import ARRAYS_KEY, COMPRESSED_KEY, PayloadError, compressed_payload, decode_tensors

#: the state-store key of a datacenter's codec state
CODEC_STATE_KEY = "codec-state"


def encode_update(delta: Mapping[str, np.ndarray], codecs: Sequence[str], server_round: int, seed: int,
                  store: Any) -> tuple[np.ndarray, dict[str, float]]:
    """The payload for this round's update, and metrics (``energy-kept``, ``codec-s``, ``payload-bytes``)."""
    started = time.perf_counter()
    pipeline = CodecPipeline(codecs, seed=seed)
    saved = store.load(CODEC_STATE_KEY)
    if saved is not None:
        pipeline.load_state_dict(saved[0])
    encoded = pipeline.encode(delta, server_round)
    store.save(CODEC_STATE_KEY, pipeline.state_dict(), server_round)
    return encoded.payload, {proto.ENERGY_KEPT: encoded.energy_kept, proto.CODEC_S: time.perf_counter() - started,
                             proto.PAYLOAD_BYTES: float(encoded.nbytes)}


def decode_update(content: RecordDict, reference: Mapping[str, np.ndarray], compressed: bool) -> dict[str, np.ndarray]:
    """The update of a reply as float32 arrays named and shaped like `reference` (see the module docstring)."""
    has_compressed = COMPRESSED_KEY in content.array_records
    has_dense = ARRAYS_KEY in content.array_records
    if compressed and not has_compressed:
        raise CodecError("the run compresses updates, but this reply carries none" + (" (it sent a dense one)" if has_dense else ""))
    if not compressed:
        if has_compressed:
            raise CodecError("the run sends dense updates, but this reply carries a compressed one")
        return decode_tensors(content)
    try:
        payload = compressed_payload(content)
    except PayloadError as err:
        raise CodecError(str(err)) from None
    return decode_arrays(payload, reference)


def decode_arrays(payload: np.ndarray | bytes, reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A payload decoded to float32 arrays named and shaped like `reference`; CodecError if it cannot be."""
    shapes = {name: tuple(np.shape(array)) for name, array in reference.items()}
    return {name: tensor.numpy() for name, tensor in decode_payload(payload, shapes).items()}
