"""The cost model (`crossdc plan`) on small cases computed by hand in each test."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import replace

import pytest
from conftest import CROSSDC  # noqa: E402

from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.wan.cost_model import (
    FLOWER_CHUNK_BYTES,
    CostModelError,
    Datacenter,
    StarPlan,
    compression_for_ratio,
    flower_message_objects,
    flower_message_pair_time,
    flower_objects_per_message,
    flower_objects_time,
    flower_round_trips,
    gloo_ring_allreduce_time,
    link_message_pair_time,
    resolve_link,
    ring_allreduce_time,
    star_round,
    streaming_exchange_idle,
    sync_dp_step,
    tau_for_ratio,
    transfer_time,
    uniform_datacenters,
)

LINK_100M_100MS = LinkSpec("test", bandwidth_mbps=100.0, rtt_ms=100.0)




# ----------------------------------------------------------------------------- sync data parallel


def test_ring_allreduce_by_hand() -> None:
    # N = 4, P = 1e6 fp32 -> S = 4e6 bytes; B = 100 Mbps = 12.5e6 bytes/s; RTT = 100 ms.
    # bandwidth: 2(N-1)/N * S/B = 1.5 * 0.32 s = 0.48 s; latency: 2(N-1) * RTT/2 = 6 * 0.05 s = 0.30 s
    assert ring_allreduce_time(4e6, 4, 100.0, 100.0) == pytest.approx(0.78, rel=1e-12)
    assert ring_allreduce_time(4e6, 1, 100.0, 100.0) == 0.0  # one datacenter: nothing to exchange

    step = sync_dp_step(1e6, 4, LINK_100M_100MS, step_time_s=0.5)
    assert step.gradient_bytes == 4e6
    assert step.bytes_sent_per_datacenter == pytest.approx(6e6)  # 2 * 3/4 * 4e6
    assert step.bandwidth_s == pytest.approx(0.48)
    assert step.latency_s == pytest.approx(0.30)
    assert step.comm_s == pytest.approx(0.78)
    assert step.comm_comp_ratio == pytest.approx(0.78 / 0.5)
    assert step.utilisation == pytest.approx(0.5 / 1.28)


# ----------------------------------------------------------------------------- crossdc's star


def two_datacenter_plan(**overrides: object) -> StarPlan:
    near = Datacenter("near", LinkSpec("near", bandwidth_mbps=1000.0, rtt_ms=10.0))
    far = Datacenter("far", LinkSpec("far", bandwidth_mbps=100.0, rtt_ms=200.0))
    fields: dict[str, object] = dict(params=1e6, datacenters=(near, far), step_time_s=0.5, tau=10,
                                     round_trips_per_round=5, coordinator_s=0.5)
    fields.update(overrides)
    return StarPlan(**fields)  # type: ignore[arg-type]


def test_star_round_two_links_by_hand() -> None:
    # payload 4e6 bytes each way; compute 10 * 0.5 s = 5 s for both.
    # near: 2 * 4e6*8/1e9 = 0.064 s + 5 * 0.010 s = 0.114 s
    # far:  2 * 4e6*8/1e8 = 0.640 s + 5 * 0.200 s = 1.640 s   <- the slow link sets the round
    est = star_round(two_datacenter_plan())
    near, far = est.datacenters
    assert near.comm_s == pytest.approx(0.114)
    assert far.comm_s == pytest.approx(1.64)
    assert far.transfer_down_s == pytest.approx(0.32) and far.transfer_up_s == pytest.approx(0.32)
    assert far.latency_s == pytest.approx(1.0)
    assert est.round_s == pytest.approx(5 + 1.64 + 0.5)
    assert est.critical_datacenter == "far"
    assert est.compute_s == pytest.approx(5.0)
    assert est.comm_s == pytest.approx(1.64)
    assert est.comm_comp_ratio == pytest.approx(1.64 / 5)
    assert est.utilisation == pytest.approx(5 / 7.14)
    assert est.bytes_up == est.bytes_down == est.bytes_up_raw == 4e6

    # a slow datacenter on the fast link: compute 0.5*10/0.25 = 20 s, busy 20.114 s, now it sets the round
    slow_near = Datacenter("near", LinkSpec("near", 1000.0, 10.0), speed=0.25)
    est = star_round(two_datacenter_plan(datacenters=(slow_near, two_datacenter_plan().datacenters[1])))
    assert est.critical_datacenter == "near"
    assert est.round_s == pytest.approx(20.114 + 0.5)
    assert est.comm_comp_ratio == pytest.approx(1.64 / 5)  # the worst ratio is still the far one's
    assert est.utilisation == pytest.approx((20 + 5) / 2 / 20.614)


def test_compression_scales_only_the_transfer_terms() -> None:
    base = star_round(two_datacenter_plan())
    both = star_round(two_datacenter_plan(compression_up=4.0, compression_down=4.0))
    up_only = star_round(two_datacenter_plan(compression_up=4.0))
    for b, c, u in zip(base.datacenters, both.datacenters, up_only.datacenters, strict=False):
        assert c.transfer_down_s == pytest.approx(b.transfer_down_s / 4)
        assert c.transfer_up_s == pytest.approx(b.transfer_up_s / 4)
        assert c.latency_s == b.latency_s and c.compute_s == b.compute_s
        assert u.transfer_up_s == pytest.approx(b.transfer_up_s / 4)
        assert u.transfer_down_s == b.transfer_down_s
    assert both.bytes_up == both.bytes_down == 1e6
    assert both.bytes_up_raw == 4e6
    # far: 0.16 s of transfer + 1 s of latency
    assert both.comm_s == pytest.approx(0.16 + 1.0)


def test_coordinator_bandwidth_is_shared_by_the_datacenters() -> None:
    # two datacenters on 1 Gbps links, a 1 Gbps coordinator: each direction takes 2 * 4e6*8/1e9 = 0.064 s
    link = LinkSpec("x", 1000.0, 0.0)
    plan = StarPlan(params=1e6, datacenters=uniform_datacenters(2, link), step_time_s=1.0, tau=1,
                    round_trips_per_round=0, coordinator_bandwidth_mbps=1000.0)
    est = star_round(plan)
    assert est.datacenters[0].transfer_up_s == pytest.approx(0.064)
    assert est.datacenters[0].transfer_down_s == pytest.approx(0.064)
    assert star_round(replace(plan, coordinator_bandwidth_mbps=None)).comm_s == pytest.approx(0.064)


def test_flower_round_trips_counted_from_the_protocol() -> None:
    ten_mib = 2 * FLOWER_CHUNK_BYTES
    # Message + RecordDict + 3 records (arrays, layout, config/metrics) + 1 Array + 2 chunks
    assert flower_objects_per_message(ten_mib) == 8
    # 4 tensors of 2.5 MiB: 4 Arrays + 4 chunks
    assert flower_objects_per_message(ten_mib, tensors=4) == 13
    assert flower_objects_per_message(ten_mib + 1) == 9  # a third chunk
    # PullMessages + ConfirmMessageReceived + PushMessages, then ceil(8/2) pulls and ceil(7/2) pushes
    assert flower_round_trips(ten_mib, 1.0) == 3 + 4 + 4
    assert flower_round_trips(ten_mib, 1.0, first_message=True) == 3 + 4 + 4 + 2  # + GetRun, GetFab
    # the derived default k follows the payloads, and compression lowers it
    plan = two_datacenter_plan(round_trips_per_round=None, params=ten_mib / 4)
    assert star_round(plan).round_trips == 3 + 4 + 4  # 8 objects each way
    assert star_round(replace(plan, compression_up=2.0, compression_down=2.0)).round_trips == 3 + 4 + 4  # 7 each way


def test_flower_objects_move_two_at_a_time_each_connection_taking_the_next() -> None:
    # a 467 KB payload: one chunk (first), then Message, RecordDict, 3 records, the Array
    assert flower_message_objects(467_000.0) == [467_000.0] + [0.0] * 6
    ten_mib = 2 * FLOWER_CHUNK_BYTES
    assert flower_message_objects(ten_mib) == [FLOWER_CHUNK_BYTES] * 2 + [0.0] * 6
    assert len(flower_message_objects(ten_mib, tensors=4)) == flower_objects_per_message(ten_mib, tensors=4)
    # transoceanic (RTT 0.15 s, 0.0375 s of data): A takes the chunk (0.1875), B two small ones (0.30), then
    # A 0.3375, B 0.45, A 0.4875, B 0.60
    assert flower_objects_time([467_000.0] + [0.0] * 6, 0.15, 0.0375 / 467_000) == pytest.approx(0.60)
    # constrained (RTT 0.3 s, 0.374 s of data): the chunk's lane ends last, at 0.674 + 2 * 0.3
    assert flower_objects_time([467_000.0] + [0.0] * 6, 0.3, 0.374 / 467_000) == pytest.approx(1.274)
    # the data cannot cross faster than the link: two 5 MiB chunks at 1 s each take 2 s + RTT, not 1 s + RTT
    assert flower_objects_time([1.0, 1.0], 0.1, 1.0) == pytest.approx(2.1)
    assert flower_objects_time([], 0.1, 1.0) == 0.0
    assert flower_objects_time([0.0] * 3, 0.1, 1.0, concurrency=1) == pytest.approx(0.3)
    with pytest.raises(CostModelError):
        flower_objects_time([0.0], 0.1, 1.0, concurrency=0)
    # the round: PullMessages, ConfirmMessageReceived and PushMessages, then the objects each way
    plan = StarPlan(params=467_000 / 4, datacenters=uniform_datacenters(2, "transoceanic"), step_time_s=0.05, tau=2)
    estimate = star_round(plan).datacenters[0]
    data = transfer_time(467_000, 100.0)
    assert estimate.comm_s == pytest.approx(3 * 0.15 + 2 * flower_objects_time([467_000.0] + [0.0] * 6, 0.15, data / 467_000))
    assert estimate.latency_s == pytest.approx(estimate.comm_s - 2 * data) and estimate.round_trips == 11
    # an explicit k keeps the plain formula
    explicit = star_round(replace(plan, round_trips_per_round=11)).datacenters[0]
    assert explicit.comm_s == pytest.approx(2 * data + 11 * 0.15)
    # what the two ends spend on a request comes on top of every request's round trip
    assert flower_objects_time([0.0] * 3, 0.1, 1.0, concurrency=1, request_s=0.05) == pytest.approx(0.45)
    slow = star_round(replace(plan, request_s=0.02)).datacenters[0]
    assert slow.comm_s == pytest.approx(3 * 0.17 + 2 * flower_objects_time([467_000.0] + [0.0] * 6, 0.15, data / 467_000,
                                                                          request_s=0.02))
    assert star_round(replace(plan, request_s=0.02, round_trips_per_round=11)).comm_s == pytest.approx(2 * data + 11 * 0.17)
    with pytest.raises(CostModelError, match="request time"):
        replace(plan, request_s=-1.0)


# ----------------------------------------------------------------------------- what it takes


def one_link_plan(**overrides: object) -> StarPlan:
    # P = 1e6 on 100 Mbps / 100 ms with k = 4: comm = 2 * 0.32 s + 4 * 0.1 s = 1.04 s; step 0.3 s
    fields: dict[str, object] = dict(params=1e6, datacenters=uniform_datacenters(3, LINK_100M_100MS),
                                     step_time_s=0.3, tau=1, round_trips_per_round=4)
    fields.update(overrides)
    return StarPlan(**fields)  # type: ignore[arg-type]


def test_tau_for_ratio_is_the_smallest() -> None:
    plan = one_link_plan()
    assert star_round(plan).comm_s == pytest.approx(1.04)
    # comm / (tau * 0.3) <= 0.1  <=>  tau >= 1.04 / 0.03 = 34.67  ->  35
    tau = tau_for_ratio(plan, 0.1)
    assert tau == 35
    assert star_round(replace(plan, tau=35)).comm_comp_ratio <= 0.1
    assert star_round(replace(plan, tau=34)).comm_comp_ratio > 0.1
    # a datacenter twice as fast computes τ steps in half the time, so it needs twice the τ: 1.04/0.015 = 69.3 -> 70
    fast = Datacenter("fast", LINK_100M_100MS, speed=2.0)
    assert tau_for_ratio(replace(plan, datacenters=(*plan.datacenters, fast)), 0.1) == 70
    assert tau_for_ratio(plan, 100.0) == 1


def test_compression_for_ratio_is_the_smallest() -> None:
    # tau 30: compute 9 s, budget 0.9 s; latency 0.4 s; transfers 0.32 + 0.32 s at c = 1
    plan = one_link_plan(tau=30)
    c = compression_for_ratio(plan, 0.1, "both")  # 0.64 / (0.9 - 0.4) = 1.28
    assert c == pytest.approx(1.28, rel=1e-12)
    assert star_round(replace(plan, compression_up=c, compression_down=c)).comm_comp_ratio <= 0.1
    less = c * (1 - 1e-9)
    assert star_round(replace(plan, compression_up=less, compression_down=less)).comm_comp_ratio > 0.1

    c_up = compression_for_ratio(plan, 0.1, "up")  # 0.32 / (0.9 - 0.4 - 0.32) = 1.777...
    assert c_up == pytest.approx(0.32 / 0.18, rel=1e-12)
    assert star_round(replace(plan, compression_up=c_up)).comm_comp_ratio <= 0.1
    assert star_round(replace(plan, compression_up=c_up * (1 - 1e-9))).comm_comp_ratio > 0.1

    assert compression_for_ratio(plan, 0.5) == 1.0  # met without compression
    assert compression_for_ratio(one_link_plan(tau=10), 0.1, "both") is None  # 0.3 s budget < 0.4 s latency
    assert compression_for_ratio(one_link_plan(tau=20), 0.1, "up") is None  # downlink + latency = 0.72 s > 0.6 s


def test_compression_for_ratio_with_flower_round_trips() -> None:
    # 1e9 parameters, 8 datacenters, continental, tau 50 * 2 s: the derived k shrinks as c grows
    plan = StarPlan(params=1e9, datacenters=uniform_datacenters(8, "continental"), step_time_s=2.0, tau=50)
    c = compression_for_ratio(plan, 0.1)
    assert c is not None and 5 < c < 20
    assert star_round(replace(plan, compression_up=c, compression_down=c)).comm_comp_ratio <= 0.1
    less = c * (1 - 1e-6)
    assert star_round(replace(plan, compression_up=less, compression_down=less)).comm_comp_ratio > 0.1


# ----------------------------------------------------------------------------- links and inputs


def test_link_profiles_and_explicit_numbers() -> None:
    assert resolve_link("transoceanic") == LINK_PROFILES["transoceanic"]
    assert (resolve_link("continental").bandwidth_mbps, resolve_link("continental").rtt_ms) == (1000.0, 40.0)
    custom = resolve_link(bandwidth_mbps=50, rtt_ms=70)
    assert (custom.bandwidth_mbps, custom.rtt_ms) == (50.0, 70.0)
    slower = resolve_link("metro", rtt_ms=20)
    assert (slower.bandwidth_mbps, slower.rtt_ms) == (10_000.0, 20.0)
    with pytest.raises(CostModelError, match="unknown link profile 'mars'; known: metro, continental, transoceanic, constrained"):
        resolve_link("mars")
    with pytest.raises(CostModelError):
        resolve_link(bandwidth_mbps=100)
    assert transfer_time(1.25e6, 10.0) == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [dict(params=-1.0), dict(params=0.0), dict(tau=0), dict(step_time_s=math.nan),
                                 dict(compression_up=0.0), dict(datacenters=()), dict(round_trips_per_round=-1)])
def test_bad_inputs_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(CostModelError):
        one_link_plan(**bad)


# ----------------------------------------------------------------------------- the command


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CROSSDC, "plan", *args], capture_output=True, text=True, timeout=60)


def test_cli_plan_json() -> None:
    result = run_plan("--params", "1e6", "--datacenters", "4", "--bandwidth-mbps", "100", "--rtt-ms", "100",
                      "--step-time", "0.5", "--tau", "20", "--round-trips", "5", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["sync_dp"]["comm_s"] == pytest.approx(0.78)
    assert out["sync_dp"]["compute_s"] == 0.5
    crossdc = out["crossdc"]
    # 2 * 0.32 s + 5 * 0.1 s = 1.14 s of comm against 20 * 0.5 = 10 s of compute
    assert crossdc["comm_s"] == pytest.approx(1.14)
    assert crossdc["compute_s"] == pytest.approx(10.0)
    assert crossdc["round_s"] == pytest.approx(11.14)
    assert crossdc["comm_comp_ratio"] == pytest.approx(0.114)
    assert crossdc["utilisation"] == pytest.approx(10 / 11.14)
    assert crossdc["bytes_up"] == crossdc["bytes_down"] == 4e6
    assert out["tau_for_target"] == 23  # 1.14 / (0.5 * 0.1) = 22.8
    assert out["compression_for_target"] == pytest.approx(1.28)  # 0.64 / (1.0 - 0.5)
    assert set(out) >= {"inputs", "sync_dp", "crossdc", "tau_for_target", "compression_for_target"}


def test_cli_plan_table() -> None:
    result = run_plan("--params", "1e9", "--datacenters", "8", "--link", "continental", "--step-time", "2", "--tau", "50")
    assert result.returncode == 0, result.stderr
    assert "sync data parallel" in result.stdout and "tau for comm/comp <= 0.1" in result.stdout


@pytest.mark.parametrize("args", [
    ("--params", "-5", "--datacenters", "8", "--link", "continental", "--step-time", "2", "--tau", "50"),
    ("--params", "1e9", "--datacenters", "8", "--link", "mars", "--step-time", "2", "--tau", "50"),
    ("--params", "1e9", "--datacenters", "8", "--step-time", "2", "--tau", "50"),
])
def test_cli_plan_bad_input_is_one_line(args: tuple[str, ...]) -> None:
    result = run_plan(*args, "--json")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("crossdc: error:"), result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    if "mars" in args:
        assert "metro, continental, transoceanic, constrained" in lines[0]


def test_gloo_ring_all_reduce_pays_two_round_trips_for_a_small_buffer() -> None:
    # 2 ranks: 4 segments, 2 per phase, both posted at once; each waits for the receiver's notice (one-way),
    # then crosses (one-way): one RTT per phase, two phases
    tiny = gloo_ring_allreduce_time(4, 2, 100.0, 150.0)
    assert tiny == pytest.approx(2 * 0.150, abs=1e-5)
    assert gloo_ring_allreduce_time(10**6, 1, 100.0, 150.0) == 0.0


def test_gloo_ring_all_reduce_notice_waits_behind_the_segment_being_sent() -> None:
    # 8 MiB over 2 ranks at 100 Mbps / 150 ms: 8 segments of 1 MiB (0.08389 s each), 4 per phase, two in flight;
    # by hand: segments leave at 0.075, 0.159, 0.318, 0.477 (the 3rd and 4th notices wait behind the segment on the
    # wire) and the last arrives at 0.636 s; two phases
    segment = 1024 * 1024 * 8 / 100e6
    d = 0.075
    leaves = [d, d + segment]
    arrived = [leaves[0] + segment + d, leaves[1] + segment + d]
    notice = leaves[1] + segment  # seg 1 still on the wire when seg 2 is posted
    leaves.append(max(notice + d, leaves[1] + segment))
    arrived.append(leaves[2] + segment + d)
    notice = leaves[2] + segment  # seg 2 on the wire when seg 3 is posted
    leaves.append(max(notice + d, leaves[2] + segment))
    arrived.append(leaves[3] + segment + d)
    assert gloo_ring_allreduce_time(8 * 1024 * 1024, 2, 100.0, 150.0) == pytest.approx(2 * max(arrived), rel=1e-9)
    # and it is never faster than the textbook ring
    for size in (4096, 1 << 20, 8 << 20):
        assert gloo_ring_allreduce_time(size, 4, 100.0, 150.0) >= ring_allreduce_time(size, 4, 100.0, 150.0)


# ----------------------------------------------------------------------------- streaming overlap


def test_streaming_idle_per_exchange_by_hand() -> None:
    # a cycle of 2 s, 0.1 s a step, H = 24 inner steps a round
    assert streaming_exchange_idle(2.0, 0.1, 24) == pytest.approx(2.0)  # DiLoCo: the whole cycle is exposed
    assert streaming_exchange_idle(2.0, 0.1, 24, fragments=4, overlap=0) == pytest.approx(2.0)
    assert streaming_exchange_idle(2.0, 0.1, 24, fragments=4, overlap=2) == pytest.approx(2.0 - 0.2)
    assert streaming_exchange_idle(2.0, 0.1, 24, fragments=4, overlap=6) == pytest.approx(2.0 - 0.6)  # τ_o = H/P
    assert streaming_exchange_idle(2.0, 0.1, 24, fragments=1, overlap=24) == pytest.approx(0.0)  # 2.4 s hides 2 s
    # eager: the merge waits H + τ_o steps, but one exchange a cycle caps the hidden compute at H/P steps
    assert streaming_exchange_idle(2.0, 0.1, 24, fragments=4, overlap=2, eager=True) == pytest.approx(2.0 - 0.6)
    assert streaming_exchange_idle(2.0, 0.1, 24, fragments=1, overlap=0, eager=True) == pytest.approx(0.0)
    assert streaming_exchange_idle(3.0, 0.1, 24, fragments=1, overlap=0, eager=True) == pytest.approx(0.6)
    assert streaming_exchange_idle(0.5, 0.1, 24, fragments=4, overlap=6) == 0.0  # compute covers the cycle
    with pytest.raises(CostModelError, match="multiple of the fragments"):
        streaming_exchange_idle(1.0, 0.1, 10, fragments=4)
    with pytest.raises(CostModelError, match=r"within \[0, H/P = 6\]"):
        streaming_exchange_idle(1.0, 0.1, 24, fragments=4, overlap=7)
    with pytest.raises(CostModelError, match="cycle"):
        streaming_exchange_idle(-1.0, 0.1, 24)


def test_link_message_pair_time_is_the_pair_at_the_links_bandwidth() -> None:
    link = LinkSpec("test", bandwidth_mbps=8.0, rtt_ms=100.0)  # 1 MB/s, 0.1 s a round trip
    # each way the chunk on one connection (RTT + its bytes), the 6 small objects on the other: 3 RTTs + 1.1 + 0.6
    assert link_message_pair_time(1_000_000, 500_000, link) == pytest.approx(0.3 + 1.1 + 0.6)
    assert link_message_pair_time(1_000_000, 500_000, link) == flower_message_pair_time(1_000_000, 500_000, 0.1, 1.0, 0.5)
    assert link_message_pair_time(0, 0, "transoceanic") == pytest.approx(9 * 0.15)  # 3 fixed + 3 + 3 object RTTs

