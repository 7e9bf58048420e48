"""The global model's trip down the WAN, compressed: `[compression] downlink_codecs`.

The server and every datacenter that is in step hold the same *reference* model x̂, versioned by the round
that produced it. Promises:

- round 1 starts from the run's initial weights, which every datacenter builds itself from the run's seed (as
  the coordinator does): where the sender was given their digest (`initial_digest`) and round 1's reference is
  exactly those weights, the round-1 message carries only that **digest** ("initial", a few dozen bytes instead of
  the model); a datacenter whose own build has another digest refuses the round (DownlinkOutOfSync) and gets the
  reference in full next round;
- otherwise round 1, and any datacenter whose last acknowledged version is not the previous one (it missed a
  round, or restarted), gets the reference **in full** (dense float32), so nobody ever trains from a model it
  cannot reconstruct;
- otherwise a datacenter gets the round's **delta** x − x̂ through the downlink codec pipeline, and both sides
  add the decoded delta to x̂: everyone in step holds the same reference. The reference is the error feedback:
  what a round does not send stays in the next round's x − x̂, so the pipeline keeps no residual of its own
  (one would add the unsent part a second time each round, and it would grow geometrically);
- a datacenter applies a delta only to the reference version it was computed from; a datacenter whose stored
  reference is another version refuses the round (DownlinkOutOfSync), and gets the full reference next time;
- the server counts a datacenter in step only after an accepted reply to that round.

The datacenters train from x̂ (within the downlink codec's error of the global model x); the server applies
the aggregated update to x itself. A streaming run's results take the same scheme per fragment
(:class:`FragmentDownlink`, :func:`decode_result`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from crossdc.compression.pipeline import CodecPipeline
from crossdc.protocol import (
    DOWNLINK,
    DOWNLINK_BASE,
    DOWNLINK_DIGEST,
    DOWNLINK_KEY,
    DOWNLINK_VERSION,
    RESULT_PAYLOAD,
    encode_compressed,
    encode_tensors,
)

#: the state-store key of a datacenter's reference model
REFERENCE_KEY = "downlink-reference"

Arrays = Mapping[str, np.ndarray]


class DownlinkOutOfSync(RuntimeError):
    """A delta arrived for a reference version this datacenter does not hold, or its initial weights are not the
    coordinator's."""


def weights_digest(weights: Arrays) -> str:
    """A digest of `weights` as float32 (names, shapes and values, in name order): equal digests, equal weights."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        value = np.ascontiguousarray(weights[name], dtype=np.float32)
        digest.update(f"{name}:{value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


class DownlinkSender:
    """The server side (see the module docstring). `initial_digest`: the digest of the run's initial weights as every
    datacenter builds them (None: round 1 sends the reference in full)."""

    def __init__(self, specs: Sequence[str], seed: int = 0, initial_digest: str | None = None) -> None:
        self.pipeline = CodecPipeline(specs, seed=seed, error_feedback=False)
        self.reference: dict[str, np.ndarray] = {}
        self.version = 0
        self.acknowledged: dict[str, int] = {}
        self.delta_payload: np.ndarray | None = None
        self.initial_digest = initial_digest
        #: whether round 1's reference is the run's initial weights (its message then carries only their digest)
        self.starts_at_initial = False

    def prepare(self, global_weights: Arrays, server_round: int) -> None:
        """Move the reference towards `global_weights` for this round (round 1: the weights themselves)."""
        if self.version == 0:
            self.reference = {k: np.array(v, dtype=np.float32) for k, v in global_weights.items()}
            self.delta_payload = None
            self.starts_at_initial = (self.initial_digest is not None
                                      and weights_digest(self.reference) == self.initial_digest)
        else:
            delta = {k: np.asarray(global_weights[k], dtype=np.float32) - self.reference[k] for k in self.reference}
            encoded = self.pipeline.encode(delta, server_round)
            for name, sent in encoded.sent.items():
                self.reference[name] = self.reference[name] + sent.numpy()
            self.delta_payload = encoded.payload
        self.version += 1

    def message_for(self, datacenter: str) -> tuple[dict[str, Any], dict[str, int | str]]:
        """(records, config entries) that bring `datacenter` to the current reference."""
        in_step = self.delta_payload is not None and self.acknowledged.get(datacenter) == self.version - 1
        if in_step:
            assert self.delta_payload is not None
            return dict(encode_compressed(self.delta_payload, DOWNLINK_KEY)), {
                DOWNLINK: "delta", DOWNLINK_BASE: self.version - 1, DOWNLINK_VERSION: self.version}
        if self.version == 1 and self.starts_at_initial and datacenter not in self.acknowledged:
            assert self.initial_digest is not None
            return {}, {DOWNLINK: "initial", DOWNLINK_VERSION: 1, DOWNLINK_DIGEST: self.initial_digest}
        return dict(encode_tensors(self.reference)), {DOWNLINK: "full", DOWNLINK_VERSION: self.version}

    def acknowledge(self, datacenter: str, version: int | None = None) -> None:
        """`datacenter` replied acceptably to this round: it holds the current reference (or reference `version`,
        the one it was sent, when the reference has moved on since: the asynchronous loop)."""
        self.acknowledged[datacenter] = self.version if version is None else version

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "version": self.version, "acknowledged": dict(self.acknowledged),
                "pipeline": self.pipeline.state_dict(), "starts_at_initial": self.starts_at_initial}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reference = {k: np.array(v, dtype=np.float32) for k, v in state["reference"].items()}
        self.version = int(state["version"])
        self.acknowledged = dict(state["acknowledged"])
        self.pipeline.load_state_dict(state["pipeline"])
        self.starts_at_initial = bool(state.get("starts_at_initial", False))


def receive(message: Mapping[str, Any], store: Any, server_round: int,
            initial: Callable[[], Arrays] | None = None) -> dict[str, np.ndarray]:
    """The datacenter side: the reference model this round trains from, from a full model, a delta applied to the
    stored reference, or (kind "initial") the run's initial weights as `initial` builds them, checked against the
    coordinator's digest; the new reference is stored (tagged with the round). `message`: ``kind``, ``version``,
    ``base`` (delta), ``weights`` (full), ``payload`` (delta) or ``digest`` (initial)."""
    from crossdc.compression.uplink import decode_arrays

    if message["kind"] == "full":
        reference = {k: np.array(v, dtype=np.float32) for k, v in message["weights"].items()}
    elif message["kind"] == "initial":
        if initial is None:
            raise DownlinkOutOfSync("the coordinator sent the initial weights' digest; this datacenter cannot build them")
        reference = {k: np.array(v, dtype=np.float32) for k, v in initial().items()}
        held = weights_digest(reference)
        if held != message["digest"]:
            raise DownlinkOutOfSync(f"this datacenter's initial weights (digest {held[:12]}) are not the coordinator's "
                                    f"({str(message['digest'])[:12]}): the full model comes next round")
    elif message["kind"] == "delta":
        stored = store.load(REFERENCE_KEY)
        if stored is None or int(stored[0]["version"]) != int(message["base"]):
            held = "none" if stored is None else stored[0]["version"]
            raise DownlinkOutOfSync(f"a delta for reference version {message['base']} arrived; this datacenter holds {held}")
        base = stored[0]["weights"]
        delta = decode_arrays(message["payload"], base)
        reference = {k: base[k] + delta[k] for k in base}
    else:
        raise DownlinkOutOfSync(f"unknown downlink kind {message['kind']!r}")
    store.save(REFERENCE_KEY, {"version": int(message["version"]), "weights": reference}, server_round)
    return reference


class FragmentDownlink:
    """A streaming run's results on their way down, through `[compression] downlink_codecs` (the server side).

    Promises, per exchange of fragment p:

    - eager off (a result is the fragment's new global values θ_g): the server and every datacenter hold the same
      reference x̂ of each fragment — the values the datacenters last merged, which are their pseudo-gradients'
      reference θ_ref (the run's initial weights at first). The server sends θ_g − x̂ through the pipeline (no
      residual: x̂ is the error feedback, as for the synchronous downlink) and both sides add the decoded delta to
      x̂. Every datacenter merges every result, in order, so one payload serves all of them;
    - eager on (a result is the fragment's mean update ḡ): ḡ goes through the pipeline with error feedback where
      the codecs ask for it (what one exchange does not send goes with the fragment's next);
    - :func:`decode_result` gives the datacenter what the merge uses, exactly what the server's reference became.
    """

    def __init__(self, specs: Sequence[str], initial_weights: Arrays, eager: bool, seed: int = 0) -> None:
        self.eager = eager
        self.pipeline = CodecPipeline(specs, seed=seed, error_feedback=eager)
        self.reference = {} if eager else {k: np.array(v, dtype=np.float32) for k, v in initial_weights.items()}

    def encode(self, exchange: int, result: Arrays) -> dict[str, np.ndarray]:
        """Exchange `exchange`'s result as it travels: ``{RESULT_PAYLOAD: uint8 payload}``."""
        names = list(result)
        if self.eager:
            encoded = self.pipeline.encode({n: np.asarray(result[n], np.float32) for n in names}, exchange)
        else:
            delta = {n: np.asarray(result[n], np.float32) - self.reference[n] for n in names}
            encoded = self.pipeline.encode(delta, exchange)
            for name, sent in encoded.sent.items():
                self.reference[name] = self.reference[name] + sent.numpy()
        return {RESULT_PAYLOAD: encoded.payload}

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "pipeline": self.pipeline.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reference = {k: np.array(v, dtype=np.float32) for k, v in state["reference"].items()}
        self.pipeline.load_state_dict(state["pipeline"])


def decode_result(result: Arrays, reference: Arrays, eager: bool) -> dict[str, np.ndarray]:
    """The datacenter side of :class:`FragmentDownlink`: an exchange's result as the merge uses it — a dense result as
    it came; a compressed one decoded, and with eager off added to `reference` (the fragment's values as last merged,
    which name and shape it). CodecError if the payload does not decode to the fragment."""
    from crossdc.compression.uplink import decode_arrays

    if RESULT_PAYLOAD not in result:
        return {n: np.asarray(v, np.float32) for n, v in result.items()}
    decoded = decode_arrays(result[RESULT_PAYLOAD], reference)
    if eager:
        return decoded
    return {n: np.asarray(reference[n], np.float32) + decoded[n] for n in reference}
