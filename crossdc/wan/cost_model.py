"""A cost model for training across datacenters over a WAN (`crossdc plan`).

Pure functions, no I/O and no torch: given a model size, the datacenters and
their links, the local step time and the strategy (τ local steps per round,
compression), predict where a round's time goes, in the vocabulary of
docs/glossary.md: `compute_s`, `comm_s`, the comm/comp
ratio `comm_s / compute_s` (alert above 0.1) and utilisation.

Two regimes are modelled, and the overlap of a streaming run (3.).

1. **Synchronous data parallel across datacenters** (the baseline crossdc is
   built to beat): fp32 gradients of S = 4·P bytes are averaged every step by
   a ring all-reduce whose hops are WAN links (bandwidth B, round trip RTT):

       t_allreduce = 2(N−1)/N · S/B  +  2(N−1) · RTT/2

   The bandwidth term is the ring's optimum (each datacenter sends and
   receives 2(N−1)/N · S bytes). The latency term counts the 2(N−1)
   sequential steps of reduce-scatter + all-gather; each step is one chunk
   sent to the ring neighbour, which can start the next step as soon as the
   chunk has *arrived*, so each step pays the one-way delay RTT/2, not a full
   round trip (no acknowledgement is waited for at the algorithm level).
   Communication is assumed not to overlap compute: step = t_step + t_allreduce.

2. **crossdc's star** (what crossdc runs): a coordinator (Flower SuperLink +
   ServerApp) and N datacenters, datacenter i on its own link (B_i, RTT_i) to
   the coordinator. Per round each datacenter downloads the global model
   (bytes_down = 4·P / compression_down), trains τ local steps, and uploads
   its update (bytes_up = 4·P / compression_up):

       compute_i = τ · t_step / speed_i
       comm_i    = 3 · (RTT_i + r) + O(objects_down) + O(objects_up)
       round     = max_i (compute_i + comm_i + overhead_s) + coordinator_s

   as Flower 1.42's SuperNode moves a message (read in its source): 3 fixed
   exchanges per message (PullMessages, ConfirmMessageReceived, PushMessages),
   then the message's objects, two requests in flight, each connection taking
   the next object as soon as its previous one is answered; a small object
   costs a round trip, a chunk (≤ 5 MiB of the arrays) a round trip plus its
   bytes/B_i, and the objects of one direction take at least RTT_i + bytes/B_i
   (`flower_objects_time`); every request also costs r (`request_s`, default
   0), the time the two ends spend on it besides the link. `round_trips` reports k, the sequential exchanges
   were the two connections in lock-step (`flower_round_trips`). With an
   explicit k (`round_trips_per_round`) the plain form is used instead:

       comm_i    = bytes_down/B_i + bytes_up/B_i + k · (RTT_i + r)

   With a coordinator bandwidth cap C (`coordinator_bandwidth_mbps`), the N
   downloads share the coordinator's egress and the N uploads its ingress
   (full duplex, each direction on its own), so a transfer takes
   max(bytes/B_i, N·bytes/C): it cannot end before all N payloads have crossed
   the coordinator's link (exact for identical datacenters uploading at once).

3. **Streaming DiLoCo's overlap** (`streaming_exchange_idle`): a round of H
   inner steps holds P exchanges, one every H/P steps; each exchange takes one
   cycle c (its reply up, the next message down: `link_message_pair_time` for
   the links). A datacenter merges exchange k's result τ_o steps after sending
   it (eager on: the result of the fragment's previous exchange, H + τ_o steps
   after that one was sent), and the deployed loop has one exchange per
   datacenter in flight, so at most one exchange completes per cycle. In
   steady state a datacenter then waits, per exchange,

       idle = max(0, c − min(covered, H/P) · t_step),
       covered = τ_o (eager off), H + τ_o (eager on)

   DiLoCo is P = 1, τ_o = 0, eager off: idle = c, the round's whole exchange.

What is not modelled: TCP's window growth on a new connection and slow start
after an idle phase (a few RTTs on a connection's first large transfers),
window limits (throughput ≤ window/RTT), packet loss,
(de)serialisation, Flower's 3 s idle polling and ClientApp start-up (those
belong in `overhead_s`, which defaults to 0), compute/communication
overlap in regimes 1 and 2, and in 3 the first round's transient (eager's
first merges need no server result) and datacenters of different speeds.

Units: bandwidth in Mbps (10^6 bit/s), RTT in ms, sizes in bytes, times in s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from crossdc.experiment.links import LINK_PROFILES, LinkSpec

BYTES_PER_FP32 = 4
DEFAULT_TARGET_RATIO = 0.1

# --- Flower 1.42's SuperNode protocol, as read in its source (see flower_round_trips) ---
#: flwr/common/constant.py:162 FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE: an Array is sent as chunks of at most 5 MiB.
FLOWER_CHUNK_BYTES = 5 * 1024 * 1024
#: flwr/supercore/constant.py:39-44 FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES / _PULLS: two objects in flight.
FLOWER_OBJECT_CONCURRENCY = 2
#: PullMessages + ConfirmMessageReceived + PushMessages, once per message.
FLOWER_FIXED_EXCHANGES_PER_MESSAGE = 3
#: GetRun + GetFab, only for the first message of a run (crossdc's discovery query, not a training round).
FLOWER_FIRST_MESSAGE_EXCHANGES = 2
#: crossdc's TRAIN message holds {arrays, layout, config}, its reply {arrays, layout, metrics}: three
#: records each, all tensors packed in one Array (crossdc/protocol.py), so T = 1.
CROSSDC_RECORDS_PER_MESSAGE = 3


class CostModelError(ValueError):
    """An input the cost model cannot use (non-positive size, unknown link profile, ...)."""


# ----------------------------------------------------------------------------- links


def resolve_link(link: str | LinkSpec | None = None, bandwidth_mbps: float | None = None,
                 rtt_ms: float | None = None) -> LinkSpec:
    """A `LinkSpec` from a profile name (or spec), explicit numbers, or a profile with numbers overriding it.

    `resolve_link("continental")` is 1000 Mbps / 40 ms; `resolve_link(bandwidth_mbps=100, rtt_ms=150)`
    is a custom link; `resolve_link("continental", rtt_ms=80)` changes the profile's RTT only.
    """
    if isinstance(link, str):
        if link not in LINK_PROFILES:
            raise CostModelError(f"unknown link profile '{link}'; known: {', '.join(LINK_PROFILES)}")
        base: LinkSpec | None = LINK_PROFILES[link]
    else:
        base = link
    if base is None:
        if bandwidth_mbps is None or rtt_ms is None:
            raise CostModelError("give a link profile, or both bandwidth (Mbps) and RTT (ms)")
        base = LinkSpec("custom", float(bandwidth_mbps), float(rtt_ms))
    elif bandwidth_mbps is not None or rtt_ms is not None:
        base = replace(base, name=f"{base.name} (modified)",
                       bandwidth_mbps=float(base.bandwidth_mbps if bandwidth_mbps is None else bandwidth_mbps),
                       rtt_ms=float(base.rtt_ms if rtt_ms is None else rtt_ms))
    _positive("link bandwidth (Mbps)", base.bandwidth_mbps)
    _non_negative("link RTT (ms)", base.rtt_ms)
    return base


def transfer_time(nbytes: float, bandwidth_mbps: float) -> float:
    """Seconds to serialise `nbytes` onto a link: nbytes · 8 / (bandwidth_mbps · 10^6). No latency."""
    _non_negative("bytes", nbytes)
    _positive("bandwidth (Mbps)", bandwidth_mbps)
    return nbytes * 8.0 / (bandwidth_mbps * 1e6)


# ----------------------------------------------------------------------------- sync data parallel


def ring_allreduce_time(nbytes: float, datacenters: int, bandwidth_mbps: float, rtt_ms: float) -> float:
    """Seconds for a ring all-reduce of `nbytes` over N datacenters joined by WAN hops.

        t = 2(N−1)/N · S/B + 2(N−1) · RTT/2

    S = nbytes, B = bandwidth in bytes/s. The latency term is 2(N−1) sequential ring steps, each
    paying the one-way delay RTT/2 (a step ends when its chunk has arrived at the neighbour).
    N = 1 needs no communication (0 s).
    """
    _non_negative("bytes", nbytes)
    _positive_int("datacenters", datacenters)
    _positive("bandwidth (Mbps)", bandwidth_mbps)
    _non_negative("RTT (ms)", rtt_ms)
    n = datacenters
    bandwidth_term = 2.0 * (n - 1) / n * transfer_time(nbytes, bandwidth_mbps)
    latency_term = 2.0 * (n - 1) * (rtt_ms / 1000.0) / 2.0
    return bandwidth_term + latency_term


#: gloo/allreduce.h (pytorch/gloo) kMaxSegmentSize: the ring moves a buffer in segments of at most 1 MiB
GLOO_MAX_SEGMENT_BYTES = 1024 * 1024
#: gloo/allreduce.cc ring(): at most two segments in flight per phase
GLOO_SEGMENTS_IN_FLIGHT = 2


def gloo_ring_allreduce_time(nbytes: float, ranks: int, bandwidth_mbps: float, rtt_ms: float,
                             max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> float:
    """Seconds for gloo's ring all-reduce (torch.distributed's CPU all-reduce, what DistributedDataParallel runs on
    gloo) of `nbytes` over `ranks` ranks, each hop of the ring a WAN link (B, RTT), as gloo schedules it.

    Read in gloo's source (allreduce.cc ``ring``, transport/tcp/pair.cc), nothing fitted:
    - the buffer is cut into M = roundup(max(⌈S/1 MiB⌉, 2N), N) segments; reduce-scatter and then all-gather each
      move M − M/N segments to the ring neighbour, in order, at most two in flight: segment i is posted when
      segment i−2 has been received;
    - a send waits for the receiver's "ready to receive" notice (the tcp transport's rendezvous): posted at the
      same moment on both sides, a segment leaves one one-way delay after the notice was sent (or when the hop is
      free), occupies the hop s/B, and arrives one one-way delay later. The notice travels on the pair's one TCP
      connection, so it waits behind a segment that connection is sending at that moment;
    - every rank runs the same schedule (the ring is symmetric), so one rank's timeline is the all-reduce's.
    TCP's own dynamics (slow start, windows) are not modelled. N = 1 needs no communication (0 s).
    """
    _non_negative("bytes", nbytes)
    _positive_int("ranks", ranks)
    _positive("bandwidth (Mbps)", bandwidth_mbps)
    _non_negative("RTT (ms)", rtt_ms)
    if ranks == 1:
        return 0.0
    segments = max(math.ceil(nbytes / max_segment_bytes), 2 * ranks)
    segments = math.ceil(segments / ranks) * ranks
    transfers = segments - segments // ranks
    segment_s = transfer_time(nbytes / segments, bandwidth_mbps)
    one_way = rtt_ms / 2000.0

    def phase(start: float) -> float:
        hop_free, arrived, sending = start, list[float](), list[tuple[float, float]]()
        for i in range(transfers):
            posted = start if i < GLOO_SEGMENTS_IN_FLIGHT else arrived[i - GLOO_SEGMENTS_IN_FLIGHT]
            # the notice goes out on the same connection as the data: behind a segment the hop is sending then
            notice_sent = next((end for begin, end in sending if begin <= posted < end), posted)
            leaves = max(notice_sent + one_way, hop_free)
            hop_free = leaves + segment_s
            sending.append((leaves, hop_free))
            arrived.append(hop_free + one_way)
        return max(arrived)

    return phase(phase(0.0))


@dataclass(frozen=True)
class SyncDPEstimate:
    """One step of synchronous data parallel across datacenters (ring all-reduce of fp32 gradients).

    `step_s = compute_s + comm_s` (no overlap); `utilisation = compute_s / step_s`.
    `bytes_sent_per_datacenter` = 2(N−1)/N · gradient_bytes, sent (and as much received) per step.
    """

    datacenters: int
    params: float
    gradient_bytes: float
    bytes_sent_per_datacenter: float
    bandwidth_s: float
    latency_s: float
    comm_s: float
    compute_s: float
    step_s: float
    comm_comp_ratio: float
    utilisation: float


def sync_dp_step(params: float, datacenters: int, link: str | LinkSpec, step_time_s: float,
                 bytes_per_param: float = BYTES_PER_FP32) -> SyncDPEstimate:
    """Predict one synchronous data-parallel step across datacenters (see `ring_allreduce_time`).

    gradient_bytes S = bytes_per_param · params (fp32: 4·P); comm_s = ring all-reduce of S;
    compute_s = step_time_s; comm_comp_ratio = comm_s / compute_s.
    """
    _positive("params", params)
    _positive_int("datacenters", datacenters)
    _positive("step time (s)", step_time_s)
    _positive("bytes per parameter", bytes_per_param)
    spec = resolve_link(link)
    n = datacenters
    size = bytes_per_param * params
    bandwidth_s = 2.0 * (n - 1) / n * transfer_time(size, spec.bandwidth_mbps)
    latency_s = 2.0 * (n - 1) * spec.rtt_ms / 1000.0 / 2.0
    comm = bandwidth_s + latency_s
    return SyncDPEstimate(
        datacenters=n, params=float(params), gradient_bytes=size,
        bytes_sent_per_datacenter=2.0 * (n - 1) / n * size,
        bandwidth_s=bandwidth_s, latency_s=latency_s, comm_s=comm, compute_s=step_time_s,
        step_s=step_time_s + comm, comm_comp_ratio=comm / step_time_s,
        utilisation=step_time_s / (step_time_s + comm),
    )


# ----------------------------------------------------------------------------- Flower's protocol


def flower_objects_per_message(payload_bytes: float, tensors: int = 1,
                               records: int = CROSSDC_RECORDS_PER_MESSAGE,
                               chunk_bytes: int = FLOWER_CHUNK_BYTES) -> int:
    """Objects Flower 1.42 moves one by one for a message carrying `payload_bytes` of arrays.

        objects = 1 (Message) + 1 (RecordDict) + records + T (Arrays) + T · ⌈payload / (T · chunk)⌉

    A Message's child is its RecordDict, whose children are its records; an ArrayRecord's
    children are its Arrays; an Array's children are its chunks of ≤ 5 MiB (flwr/app/message/
    message.py:378, recorddict.py:296, arrayrecord.py:373, array.py:262-283). The payload is
    taken as T tensors of equal size; T = 1 gives the fewest objects (a lower bound).
    Identical chunks are sent once (Flower deduplicates by content hash): not modelled.
    """
    _non_negative("payload bytes", payload_bytes)
    _positive_int("tensors", tensors)
    _positive_int("chunk bytes", chunk_bytes)
    per_tensor = payload_bytes / tensors
    chunks_per_tensor = max(1, math.ceil(per_tensor / chunk_bytes)) if per_tensor > 0 else 0
    return 2 + records + tensors + tensors * chunks_per_tensor


def flower_round_trips(bytes_down: float, bytes_up: float, tensors: int = 1, *,
                       records: int = CROSSDC_RECORDS_PER_MESSAGE,
                       first_message: bool = False,
                       concurrency: int = FLOWER_OBJECT_CONCURRENCY,
                       chunk_bytes: int = FLOWER_CHUNK_BYTES) -> int:
    """Sequential request/response exchanges a Flower 1.42 SuperNode makes on its link for one message.

        k = 3 + ⌈objects_down / c⌉ + ⌈objects_up / c⌉  (+ 2 for the first message of a run)

    Counted in flwr/supernode/start_client_internal.py (the SuperNode loop) and
    flwr/supernode/fleet_http_connection.py (one HTTP POST per call):
      - PullMessages that brings the message (start_client_internal.py:309, fleet_http_connection.py:146);
      - GetRun + GetFab, only while the run is unknown to the node (:335-340): crossdc's discovery
        query pays them, training rounds do not (`first_message`);
      - one PullObject per object of the message (:408-418 → inflatable_utils.py pull_objects),
        c = min(2, cores) in flight (supercore/constant.py:42, inflatable_utils.py:96-100, 283);
      - ConfirmMessageReceived (:423);
      - PushMessages of the reply (:518), which answers with the objects the SuperLink lacks;
      - one PushObject per object of the reply (:522-531 → push_object_contents_from_iterable), c in flight.
    The idle polls before the message arrives (a PullMessages every 3 s, :263) are waiting, i.e.
    overhead, not communication; heartbeats run on their own thread every 30 s, off the critical path.
    `tensors` and `records` describe each message (crossdc's: one packed Array, three records; Flower's
    FedAvg: one Array per model tensor, two records). Counting ⌈n/c⌉ RTTs for n objects assumes the c requests advance in
    lock-step, which makes
    comm = transfer + k·RTT an upper estimate when a chunk's transfer is long compared with the RTT.
    """
    _positive_int("concurrency", concurrency)
    down = flower_objects_per_message(bytes_down, tensors, records, chunk_bytes)
    up = flower_objects_per_message(bytes_up, tensors, records, chunk_bytes)
    k = FLOWER_FIXED_EXCHANGES_PER_MESSAGE + math.ceil(down / concurrency) + math.ceil(up / concurrency)
    return k + (FLOWER_FIRST_MESSAGE_EXCHANGES if first_message else 0)


def flower_message_objects(payload_bytes: float, tensors: int = 1,
                           records: int = CROSSDC_RECORDS_PER_MESSAGE,
                           chunk_bytes: int = FLOWER_CHUNK_BYTES) -> list[float]:
    """Bytes of data in each object Flower 1.42 moves for a message, in the order it moves them: the arrays' chunks
    first (T · ⌈payload / (T · chunk)⌉ equal chunks), then the Message, RecordDict, record and Array objects, whose
    few hundred bytes of metadata count as 0 (flower_objects_per_message counts the same objects)."""
    count = flower_objects_per_message(payload_bytes, tensors, records, chunk_bytes)
    chunks = count - (2 + records + tensors)
    return [payload_bytes / chunks] * chunks + [0.0] * (count - chunks) if chunks else [0.0] * count


def flower_objects_time(objects: list[float], rtt_s: float, seconds_per_byte: float,
                        concurrency: int = FLOWER_OBJECT_CONCURRENCY, request_s: float = 0.0) -> float:
    """Seconds to move a message's objects, `concurrency` requests in flight, each connection taking the next object
    as soon as its previous one is answered (flwr/supercore/inflatable_utils.py: a thread pool of that size):

        time = max(makespan of that schedule with one object = RTT + request_s + bytes · seconds_per_byte,
                   RTT + request_s + Σ bytes · seconds_per_byte)

    The second term: the link carries the data no faster than its bandwidth, however many requests are in flight.
    `request_s`: the time the two ends spend on one request besides the link (answering it, sending the next).
    No objects: 0 s."""
    _positive_int("concurrency", concurrency)
    _non_negative("RTT (s)", rtt_s)
    _non_negative("request time (s)", request_s)
    _non_negative("seconds per byte", seconds_per_byte)
    if not objects:
        return 0.0
    lanes = [0.0] * min(concurrency, len(objects))
    for size in objects:
        lane = min(range(len(lanes)), key=lanes.__getitem__)
        lanes[lane] += rtt_s + request_s + size * seconds_per_byte
    return max(max(lanes), rtt_s + request_s + sum(objects) * seconds_per_byte)


def flower_message_pair_time(bytes_down: float, bytes_up: float, rtt_s: float, transfer_down_s: float,
                             transfer_up_s: float, tensors: int = 1,
                             records: int = CROSSDC_RECORDS_PER_MESSAGE, request_s: float = 0.0) -> float:
    """Seconds a datacenter's link spends on one round's message pair (Flower 1.42, see the module docstring):

        3 · (RTT + request_s) + flower_objects_time(objects down) + flower_objects_time(objects up)

    where each direction's data takes `transfer_*_s` in all (its bytes over the link's bandwidth, or its share of a
    coordinator cap), and `request_s` is what the two ends spend on each request besides the link."""
    down = flower_message_objects(bytes_down, tensors, records)
    up = flower_message_objects(bytes_up, tensors, records)
    return (FLOWER_FIXED_EXCHANGES_PER_MESSAGE * (rtt_s + request_s)
            + flower_objects_time(down, rtt_s, transfer_down_s / bytes_down if bytes_down else 0.0, request_s=request_s)
            + flower_objects_time(up, rtt_s, transfer_up_s / bytes_up if bytes_up else 0.0, request_s=request_s))


def link_message_pair_time(bytes_down: float, bytes_up: float, link: str | LinkSpec, tensors: int = 1,
                           records: int = CROSSDC_RECORDS_PER_MESSAGE, request_s: float = 0.0) -> float:
    """Seconds one datacenter's `link` (a profile name or spec) spends on a message pair of these payloads:
    `flower_message_pair_time` with each direction's transfer at the link's bandwidth."""
    spec = resolve_link(link)
    return flower_message_pair_time(bytes_down, bytes_up, spec.rtt_ms / 1000.0,
                                    transfer_time(bytes_down, spec.bandwidth_mbps),
                                    transfer_time(bytes_up, spec.bandwidth_mbps), tensors, records, request_s)


# ----------------------------------------------------------------------------- streaming overlap


def streaming_exchange_idle(cycle_s: float, step_time_s: float, steps_per_round: int, fragments: int = 1,
                            overlap: int = 0, eager: bool = False) -> float:
    """Seconds a datacenter of a streaming run waits per exchange, in steady state (regime 3 of the module docstring):

        idle = max(0, cycle_s − min(covered, H/P) · t_step),  covered = τ_o (eager off), H + τ_o (eager on)

    `cycle_s` is one exchange's cycle (reply up, next message down, the wait for the others), `steps_per_round`
    H, `fragments` P, `overlap` τ_o ≤ H/P. The compute that can hide a cycle is the τ_o steps between a send and
    its merge, or with eager the H + τ_o steps until the merge that needs it; but one exchange completes per cycle
    and the trainers start one every H/P steps, so no more than H/P steps' compute hides each cycle. DiLoCo
    (P = 1, τ_o = 0, eager off) waits the whole cycle."""
    _non_negative("cycle (s)", cycle_s)
    _non_negative("step time (s)", step_time_s)
    _positive_int("inner steps per round", steps_per_round)
    _positive_int("fragments", fragments)
    _non_negative_int("overlap", overlap)
    if steps_per_round % fragments:
        raise CostModelError(f"the inner steps per round ({steps_per_round}) must be a multiple of the fragments "
                             f"({fragments})")
    spacing = steps_per_round // fragments
    if overlap > spacing:
        raise CostModelError(f"overlap {overlap} must be within [0, H/P = {spacing}]")
    covered = overlap + (steps_per_round if eager else 0)
    return max(0.0, cycle_s - min(covered, spacing) * step_time_s)


# ----------------------------------------------------------------------------- crossdc's star


@dataclass(frozen=True)
class Datacenter:
    """One datacenter of the star: its link to the coordinator and its relative compute speed."""

    name: str
    link: LinkSpec
    speed: float = 1.0


def uniform_datacenters(count: int, link: str | LinkSpec, speed: float = 1.0) -> tuple[Datacenter, ...]:
    """`count` identical datacenters `dc0`, `dc1`, ... on the same kind of link."""
    _positive_int("datacenters", count)
    spec = resolve_link(link)
    return tuple(Datacenter(f"dc{i}", spec, speed) for i in range(count))


@dataclass(frozen=True)
class StarPlan:
    """The inputs of one crossdc round (star topology). See the module docstring for the formulas.

    params: model parameters P; the payloads are bytes_per_param · P / compression each way.
    compression_up / compression_down: bytes_raw / bytes_sent on the uplink (update) and the
    downlink (global model or its delta); 1 = dense fp32.
    round_trips_per_round: k; None = `flower_round_trips` for these payloads.
    tensors: number of (equal-size) tensors in a payload, only used to derive k.
    coordinator_bandwidth_mbps: the coordinator's own link, shared by the N transfers of each
    direction; None = not a bottleneck.
    coordinator_s: aggregation/evaluation time on the coordinator per round.
    overhead_s: per-datacenter time outside compute and link (Flower polling, process start).
    request_s: what the SuperLink and the SuperNode spend on each protocol request besides the link (answering it,
    sending the next); 0 = the links alone. `benchmarks/wan_validation.py` measures it on a metro link.
    """

    params: float
    datacenters: tuple[Datacenter, ...]
    step_time_s: float
    tau: int
    compression_up: float = 1.0
    compression_down: float = 1.0
    bytes_per_param: float = BYTES_PER_FP32
    round_trips_per_round: int | None = None
    tensors: int = 1
    coordinator_bandwidth_mbps: float | None = None
    coordinator_s: float = 0.0
    overhead_s: float = 0.0
    request_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("params", self.params)
        if not self.datacenters:
            raise CostModelError("at least one datacenter is needed")
        object.__setattr__(self, "datacenters", tuple(self.datacenters))
        for dc in self.datacenters:
            _positive(f"speed of datacenter '{dc.name}'", dc.speed)
            _positive(f"bandwidth of datacenter '{dc.name}' (Mbps)", dc.link.bandwidth_mbps)
            _non_negative(f"RTT of datacenter '{dc.name}' (ms)", dc.link.rtt_ms)
        _positive("step time (s)", self.step_time_s)
        _positive_int("tau", self.tau)
        _positive("compression ratio (uplink)", self.compression_up)
        _positive("compression ratio (downlink)", self.compression_down)
        _non_negative("request time (s)", self.request_s)
        _positive("bytes per parameter", self.bytes_per_param)
        if self.round_trips_per_round is not None:
            _non_negative_int("round trips per round", self.round_trips_per_round)
        _positive_int("tensors", self.tensors)
        if self.coordinator_bandwidth_mbps is not None:
            _positive("coordinator bandwidth (Mbps)", self.coordinator_bandwidth_mbps)
        _non_negative("coordinator time (s)", self.coordinator_s)
        _non_negative("overhead (s)", self.overhead_s)

    @property
    def raw_bytes(self) -> float:
        """The fp32 (uncompressed) size of one payload: bytes_per_param · P."""
        return self.bytes_per_param * self.params

    @property
    def bytes_up(self) -> float:
        return self.raw_bytes / self.compression_up

    @property
    def bytes_down(self) -> float:
        return self.raw_bytes / self.compression_down

    @property
    def round_trips(self) -> int:
        """k: the explicit `round_trips_per_round`, else Flower 1.42's count for these payloads."""
        if self.round_trips_per_round is not None:
            return self.round_trips_per_round
        return flower_round_trips(self.bytes_down, self.bytes_up, self.tensors)


@dataclass(frozen=True)
class DatacenterEstimate:
    """One datacenter's round: compute_s + comm_s + overhead_s = busy_s; utilisation = compute_s / round_s."""

    name: str
    compute_s: float
    comm_s: float
    transfer_down_s: float
    transfer_up_s: float
    latency_s: float
    round_trips: int
    overhead_s: float
    busy_s: float
    comm_comp_ratio: float
    utilisation: float


@dataclass(frozen=True)
class RoundEstimate:
    """One crossdc round (star topology).

    round_s = max_i busy_i + coordinator_s; compute_s and comm_s are the largest over datacenters;
    comm_comp_ratio = max_i comm_i / compute_i (the alert is per datacenter, so the worst one counts);
    utilisation = mean_i compute_i / round_s (the share of the federation's GPU time spent training,
    datacenters weighted equally). bytes_up / bytes_down / bytes_up_raw are per datacenter.
    """

    tau: int
    compute_s: float
    comm_s: float
    round_s: float
    comm_comp_ratio: float
    utilisation: float
    bytes_up: float
    bytes_down: float
    bytes_up_raw: float
    round_trips: int
    coordinator_s: float
    critical_datacenter: str
    datacenters: tuple[DatacenterEstimate, ...] = field(default=())


def star_round(plan: StarPlan) -> RoundEstimate:
    """Predict one crossdc round:

        compute_i = τ · t_step / speed_i
        comm_i    = 3 · RTT_i + O(objects_down, T_down) + O(objects_up, T_up)      (Flower's protocol, the default)
        comm_i    = T(bytes_down, B_i) + T(bytes_up, B_i) + k · RTT_i             (an explicit k)
        round     = max_i (compute_i + comm_i + overhead_s) + coordinator_s

    with T(bytes, B_i) = bytes/B_i, or max(bytes/B_i, N · bytes/C) under a coordinator cap C, and O the time
    Flower's two connections take to move a message's objects (`flower_objects_time`: a small object costs a round
    trip, the chunks carry the bytes). `round_trips` reports k (`flower_round_trips`) either way.
    """
    n = len(plan.datacenters)
    k = plan.round_trips
    down, up = plan.bytes_down, plan.bytes_up
    rows: list[tuple[Datacenter, float, float, float, float, float]] = []
    for dc in plan.datacenters:
        compute = plan.tau * plan.step_time_s / dc.speed
        t_down = transfer_time(down, dc.link.bandwidth_mbps)
        t_up = transfer_time(up, dc.link.bandwidth_mbps)
        if plan.coordinator_bandwidth_mbps is not None:
            t_down = max(t_down, transfer_time(n * down, plan.coordinator_bandwidth_mbps))
            t_up = max(t_up, transfer_time(n * up, plan.coordinator_bandwidth_mbps))
        rtt = dc.link.rtt_ms / 1000.0
        if plan.round_trips_per_round is None:
            latency = flower_message_pair_time(down, up, rtt, t_down, t_up, plan.tensors,
                                               request_s=plan.request_s) - t_down - t_up
        else:
            latency = k * (rtt + plan.request_s)
        rows.append((dc, compute, t_down, t_up, latency, compute + t_down + t_up + latency + plan.overhead_s))
    round_s = max(r[5] for r in rows) + plan.coordinator_s
    estimates = tuple(
        DatacenterEstimate(name=dc.name, compute_s=compute, comm_s=t_down + t_up + latency,
                           transfer_down_s=t_down, transfer_up_s=t_up, latency_s=latency, round_trips=k,
                           overhead_s=plan.overhead_s, busy_s=busy,
                           comm_comp_ratio=(t_down + t_up + latency) / compute, utilisation=compute / round_s)
        for dc, compute, t_down, t_up, latency, busy in rows
    )
    critical = max(estimates, key=lambda e: e.busy_s)
    return RoundEstimate(
        tau=plan.tau,
        compute_s=max(e.compute_s for e in estimates),
        comm_s=max(e.comm_s for e in estimates),
        round_s=round_s,
        comm_comp_ratio=max(e.comm_comp_ratio for e in estimates),
        utilisation=sum(e.compute_s for e in estimates) / n / round_s,
        bytes_up=up, bytes_down=down, bytes_up_raw=plan.raw_bytes,
        round_trips=k, coordinator_s=plan.coordinator_s,
        critical_datacenter=critical.name, datacenters=estimates,
    )


# ----------------------------------------------------------------------------- what it takes


def tau_for_ratio(plan: StarPlan, target: float = DEFAULT_TARGET_RATIO) -> int:
    """The smallest τ with comm/comp ≤ target for every datacenter, compression held fixed.

    comm_i does not depend on τ and compute_i = τ · t_step / speed_i, so

        τ = max(1, ⌈ max_i comm_i · speed_i / (t_step · target) ⌉)

    then checked against `star_round` (and moved by one where floating point rounding put it off).
    """
    _positive("target ratio", target)
    base = star_round(replace(plan, tau=1))
    need = max(dc_est.comm_s * dc.speed / (plan.step_time_s * target)
               for dc_est, dc in zip(base.datacenters, plan.datacenters, strict=True))
    tau = max(1, math.ceil(need))

    def ok(t: int) -> bool:
        return star_round(replace(plan, tau=t)).comm_comp_ratio <= target

    while not ok(tau):
        tau += 1
    while tau > 1 and ok(tau - 1):
        tau -= 1
    return tau


def compression_for_ratio(plan: StarPlan, target: float = DEFAULT_TARGET_RATIO,
                          direction: Literal["both", "up"] = "both") -> float | None:
    """The smallest compression ratio c ≥ 1 with comm/comp ≤ target for every datacenter, τ held fixed.

    direction "both": c applies to the uplink and the downlink; "up": the uplink only (the
    downlink keeps `plan.compression_down`). With k fixed, comm_i(c) = A_i/c + F_i + L_i where
    A_i is the compressed directions' transfer time at c = 1, F_i the fixed direction's and
    L_i = k · RTT_i, so

        c = max_i A_i / (target · compute_i − F_i − L_i)

    and None when some denominator is ≤ 0 (latency, or the uncompressed direction, alone breaks
    the target: no compression helps). When comm follows Flower's protocol (no explicit k), it falls
    monotonically as c grows (fewer bytes, then fewer chunks): c is bisected against `star_round`
    to a relative 1e-12.
    Returns 1.0 when the target is met without compression.
    """
    _positive("target ratio", target)
    if direction not in ("both", "up"):
        raise CostModelError(f"unknown direction '{direction}'; known: both, up")

    def at(c: float) -> StarPlan:
        if direction == "both":
            return replace(plan, compression_up=c, compression_down=c)
        return replace(plan, compression_up=c)

    def ok(c: float) -> bool:
        return star_round(at(c)).comm_comp_ratio <= target

    def closed_form(k: int) -> float | None:
        unit = star_round(replace(at(1.0), round_trips_per_round=k))  # transfer times at c = 1
        need = 0.0
        for e in unit.datacenters:
            scaled = e.transfer_up_s + (e.transfer_down_s if direction == "both" else 0.0)
            fixed = 0.0 if direction == "both" else e.transfer_down_s
            room = target * e.compute_s - fixed - e.latency_s
            if room <= 0:
                return None
            need = max(need, scaled / room)
        return need

    if ok(1.0):
        return 1.0
    if plan.round_trips_per_round is not None:
        c = closed_form(plan.round_trips_per_round)
        if c is None:
            return None
        return _settle(max(c, 1.0), ok)
    # Flower's protocol: comm only falls as c grows (fewer bytes, then fewer chunks), so bisect between a c that
    # misses the target and one that meets it; none meets it when the round trips alone break the target
    low, high = 1.0, 2.0
    while not ok(high):
        if high > 1e15:
            return None
        low, high = high, high * 2
    for _ in range(200):
        if high - low <= 1e-12 * high:
            break
        mid = (low + high) / 2
        if ok(mid):
            high = mid
        else:
            low = mid
    return high


def _settle(c: float, ok: Callable[[float], bool]) -> float:
    """Nudge a closed-form answer by a few ulps so that it meets the target exactly."""
    for _ in range(64):
        if ok(c):
            return c
        c = math.nextafter(c, math.inf)
    return c


# ----------------------------------------------------------------------------- validation


def _positive(what: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise CostModelError(f"{what} must be a positive number, got {value!r}")


def _non_negative(what: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise CostModelError(f"{what} must be a non-negative number, got {value!r}")


def _positive_int(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CostModelError(f"{what} must be a positive whole number, got {value!r}")


def _non_negative_int(what: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CostModelError(f"{what} must be a non-negative whole number, got {value!r}")


__all__ = [
    "BYTES_PER_FP32", "DEFAULT_TARGET_RATIO", "FLOWER_CHUNK_BYTES", "FLOWER_OBJECT_CONCURRENCY",
    "CostModelError", "Datacenter", "DatacenterEstimate", "RoundEstimate", "StarPlan", "SyncDPEstimate",
    "compression_for_ratio", "flower_objects_per_message", "flower_round_trips", "link_message_pair_time",
    "resolve_link", "ring_allreduce_time", "star_round", "streaming_exchange_idle", "sync_dp_step", "tau_for_ratio",
    "transfer_time",
    "uniform_datacenters",
]
