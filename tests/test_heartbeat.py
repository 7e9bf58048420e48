"""crossdc's heartbeat: the liveness rule on exact cases, the signed datagram and its refusals, a sender and a monitor
over real UDP on loopback; and a deployment run whose datacenter is killed mid-run: marked down long before the round
deadline, the round closed without waiting for it, marked up again when it returns."""

from __future__ import annotations

import hashlib
import hmac
import random
import socket
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from conftest import read_run

from crossdc.deployment.heartbeat import (
    Beat,
    HeartbeatMonitor,
    HeartbeatSender,
    NodeKeys,
    decode_beat,
    encode_beat,
    liveness_changes,
    node_key,
)
from crossdc.experiment.config import ConfigError, parse_config
from crossdc.experiment.processes import free_port
from crossdc.orchestration.local_run import LocalRun, LocalRunOptions

KEY = b"k" * 32


def test_liveness_rule_on_exact_cases() -> None:
    heard = {"a": 10.0, "b": 4.0, "c": 9.0}
    assert liveness_changes(heard, set(), now=12.0, timeout_s=5.0) == {"b": False}  # 8 s silent: down
    assert liveness_changes(heard, {"b"}, now=12.0, timeout_s=5.0) == {}  # already down: no change reported
    assert liveness_changes(heard, {"b", "c"}, now=12.0, timeout_s=5.0) == {"c": True}  # heard 3 s ago: up again
    assert liveness_changes(heard, set(), now=14.0, timeout_s=5.0) == {"b": False}  # exactly 5 s silent: still up
    assert liveness_changes({}, {"gone"}, now=1.0, timeout_s=1.0) == {}


def test_beats_are_signed_and_anything_else_is_refused() -> None:
    beat = Beat("run-1", "us-east", 7)
    data = encode_beat(beat, KEY)
    assert decode_beat(data, KEY, "run-1") == beat
    assert decode_beat(data, KEY, "run-2") is None  # another run's
    assert decode_beat(data, b"x" * 32, "run-1") is None  # another key
    assert decode_beat(data[:-1], KEY, "run-1") is None and decode_beat(data[:10], KEY, "run-1") is None  # truncated
    forged = data.replace(b"us-east", b"eu-west")
    assert decode_beat(forged, KEY, "run-1") is None
    assert decode_beat(b"\0" * 5000, KEY, "run-1") is None  # oversized
    rng = random.Random(0)
    assert all(decode_beat(rng.randbytes(rng.randint(0, 300)), KEY, "run-1") is None for _ in range(500))
    # signed but not a beat: refused, not raised
    for body in (b"[]", b'{"run": "run-1"}', b'{"run": "run-1", "dc": "x", "seq": "seven"}', b"\xff\xfe"):
        assert decode_beat(body + hmac.new(KEY, body, hashlib.sha256).digest(), KEY, "run-1") is None


def test_a_nodes_key_is_derived_from_the_attempts_secret_and_its_node_id() -> None:
    secret = b"s" * 32
    assert node_key(secret, 7) == hmac.new(secret, b"crossdc-heartbeat:7", hashlib.sha256).digest()
    assert node_key(secret, 2**64 - 1) == hmac.new(secret, b"crossdc-heartbeat:18446744073709551615", hashlib.sha256).digest()
    assert len(node_key(secret, 7)) == 32 and node_key(secret, 7) != secret
    assert len({node_key(secret, 7), node_key(secret, 70), node_key(secret, 8), node_key(b"t" * 32, 7)}) == 4
    assert NodeKeys(secret).for_node(7) == node_key(secret, 7)


def test_a_beat_naming_a_datacenter_is_verified_only_with_the_key_of_its_node() -> None:
    """A standing federation: us-east is bound to node 11, eu-west to node 22; node 33 (refused at discovery) got
    a hello, so it holds its own key, and it cannot beat for either; eu-west moves to node 44 on rejoin."""
    keys = NodeKeys(b"s" * 32)

    def beat(datacenter: str, node: int) -> Beat | None:
        return decode_beat(encode_beat(Beat("run-1", datacenter, 1), node_key(b"s" * 32, node)), keys.key_of, "run-1")

    assert keys.key_of("us-east") is None and beat("us-east", 11) is None  # bound to no node yet: refused
    keys.bind("us-east", 11)
    keys.bind("eu-west", 22)
    assert keys.key_of("us-east") == node_key(b"s" * 32, 11)
    assert beat("us-east", 11) == Beat("run-1", "us-east", 1) and beat("eu-west", 22) == Beat("run-1", "eu-west", 1)
    assert beat("us-east", 22) is None and beat("eu-west", 11) is None  # one datacenter's node beating for the other
    assert beat("us-east", 33) is None and beat("eu-west", 33) is None  # a node not bound to it
    assert beat("ap-south", 33) is None  # nobody is bound to ap-south
    keys.bind("eu-west", 44)  # rejoined under a new node: only that node's key from now on
    assert beat("eu-west", 44) == Beat("run-1", "eu-west", 1) and beat("eu-west", 22) is None
    assert beat("us-east", 11) == Beat("run-1", "us-east", 1)
    # another run's, truncated or altered: refused as under one key
    data = encode_beat(Beat("run-1", "us-east", 7), node_key(b"s" * 32, 11))
    assert decode_beat(data, keys.key_of, "run-2") is None and decode_beat(data[:-1], keys.key_of, "run-1") is None
    assert decode_beat(data.replace(b"us-east", b"eu-west"), keys.key_of, "run-1") is None
    digest = b"d" * 32  # bodies read before any key is looked at: malformed ones are refused, never raised
    for body in (b"[" * 490 + b"]" * 490, b'{"run": "run-1", "dc": "us-east", "seq": 1e400}', b'{"run": 1, "dc": [], "seq": NaN}',
                 b'"us-east"', b"\xff\xfe", b'{"run": "run-1", "dc": "us-east", "seq": 1}'):
        assert decode_beat(body + digest, keys.key_of, "run-1") is None
    rng = random.Random(1)
    assert all(decode_beat(rng.randbytes(rng.randint(0, 300)), keys.key_of, "run-1") is None for _ in range(500))


@pytest.mark.timeout(60)
def test_a_monitor_hears_a_datacenter_only_from_the_node_it_is_bound_to() -> None:
    """A node not bound to us-east beating for it does not keep it up; us-east's own node does; after a move to a
    new node, the old node's beats no longer count and the new one's do."""
    secret = b"s" * 32
    keys = NodeKeys(secret)
    keys.bind("us-east", 11)
    monitor = HeartbeatMonitor("127.0.0.1", 0, "run-1", keys.key_of, ["us-east"], timeout_s=0.5,
                               on_change=lambda *_: None).start()
    address = ("127.0.0.1", monitor.port)
    senders = [HeartbeatSender(address, "run-1", "us-east", node_key(secret, 33), 0.05).start()]  # an impostor
    try:
        assert _wait_for(lambda: monitor.down() == {"us-east"} and monitor.refused >= 3)
        assert monitor.beats["us-east"] == 0
        senders.append(HeartbeatSender(address, "run-1", "us-east", node_key(secret, 11), 0.05).start())
        assert _wait_for(lambda: monitor.down() == set())
        keys.bind("us-east", 44)  # rejoined under node 44: node 11's beats (and the impostor's) are refused
        assert _wait_for(lambda: monitor.down() == {"us-east"})
        heard = monitor.beats["us-east"]
        senders.append(HeartbeatSender(address, "run-1", "us-east", node_key(secret, 44), 0.05).start())
        assert _wait_for(lambda: monitor.down() == set() and monitor.beats["us-east"] > heard)
    finally:
        for sender in senders:
            sender.stop()
        monitor.stop()


@pytest.mark.timeout(60)
def test_a_monitor_marks_a_silent_sender_down_and_up_again() -> None:
    changes: list[tuple[str, bool, float, float]] = []
    port = free_port()
    monitor = HeartbeatMonitor("127.0.0.1", port, "run-1", KEY, ["us-east", "eu-west"], timeout_s=0.6,
                               on_change=lambda name, up, silent: changes.append((name, up, silent, time.monotonic())))
    monitor.start()
    senders = {name: HeartbeatSender(("127.0.0.1", port), "run-1", name, KEY, 0.1).start() for name in ("us-east", "eu-west")}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as noise:  # garbage and another run's beats
            for payload in (b"", b"hello", encode_beat(Beat("run-2", "us-east", 1), KEY),
                            encode_beat(Beat("run-1", "stranger", 1), KEY), b"\0" * 2000):
                noise.sendto(payload, ("127.0.0.1", port))
        time.sleep(1.5)
        assert changes == [] and monitor.down() == set()
        senders["eu-west"].stop()
        stopped = time.monotonic()
        deadline = stopped + 10
        while "eu-west" not in monitor.down() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert monitor.down() == {"eu-west"}
        name, up, silent, at = changes[0]
        assert (name, up) == ("eu-west", False) and silent > 0.6 and at - stopped < 2 * 0.6 + 1.0
        senders["eu-west"] = HeartbeatSender(("127.0.0.1", port), "run-1", "eu-west", KEY, 0.1).start()
        deadline = time.monotonic() + 10
        while monitor.down() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert monitor.down() == set() and [(c[0], c[1]) for c in changes] == [("eu-west", False), ("eu-west", True)]
        assert monitor.refused >= 4 and monitor.beats["us-east"] > 5
    finally:
        for sender in senders.values():
            sender.stop()
        monitor.stop()


def _wait_for(condition: Any, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def test_a_sender_follows_its_target_and_a_bound_monitor_judges_only_once_started() -> None:
    """A node's trainer beats wherever its run's settings say now (a resumed attempt offers a new port and key); a
    monitor on port 0 says which port it got, and gives every datacenter its timeout from start(), not from bind."""
    first = HeartbeatMonitor("127.0.0.1", 0, "run-1", KEY, ["us-east"], timeout_s=0.5, on_change=lambda *_: None)
    other_key = b"o" * 32
    second = HeartbeatMonitor("127.0.0.1", 0, "run-1", other_key, ["us-east"], timeout_s=0.5, on_change=lambda *_: None)
    assert first.port > 0 and second.port > 0 and first.port != second.port
    time.sleep(0.7)  # longer than the timeout, before start: nobody is down yet
    first.start()
    second.start()
    target: list[Any] = [(("127.0.0.1", first.port), KEY)]
    sender = HeartbeatSender(("127.0.0.1", 9), "run-1", "us-east", b"unused", 0.05, retarget=lambda: target[0]).start()
    try:
        assert _wait_for(lambda: first.beats["us-east"] >= 3) and first.down() == set()
        target[0] = None  # the settings name no heartbeat for now: no beat goes anywhere
        time.sleep(0.2)
        sent = sender.sent
        time.sleep(0.3)
        assert sender.sent == sent
        target[0] = (("127.0.0.1", second.port), other_key)
        assert _wait_for(lambda: second.beats["us-east"] >= 3)
        assert _wait_for(lambda: first.down() == {"us-east"}) and second.down() == set() and second.refused == 0
    finally:
        sender.stop()
        first.stop()
        second.stop()
    HeartbeatMonitor("127.0.0.1", 0, "run-1", KEY, ["a"], timeout_s=1, on_change=lambda *_: None).stop()  # never started


def test_heartbeat_timeout_is_checked() -> None:
    base = {"run": {"rounds": 1}, "workload": {"dataset": "synthetic", "model": "linear", "batch_size": 8,
                                               "optimizer": "sgd", "lr": 0.1},
            "strategy": {"name": "fedavg", "tau": 1}, "datacenters": [{"name": "a"}]}
    assert parse_config(base).run.heartbeat_timeout_s == 30.0
    assert parse_config({**base, "run": {"rounds": 1, "heartbeat_timeout_s": 0}}).run.heartbeat_timeout_s == 0.0
    for bad, words in ((-1, "must be ≥ 0"), ("fast", "must be a number"), (float("inf"), "finite")):
        with pytest.raises(ConfigError, match=words):
            parse_config({**base, "run": {"rounds": 1, "heartbeat_timeout_s": bad}})


VICTIM = "eu-west"
TIMEOUT_S = 4.0
DEADLINE_S = 150.0
AWAY_S = 6.0
CONFIG = {
    "run": {"name": "heartbeat", "rounds": 22, "seed": 0, "min_replies": 1, "round_timeout_s": DEADLINE_S,
            "heartbeat_timeout_s": TIMEOUT_S},
    "workload": {"dataset": "synthetic", "model": "linear", "partition": {"kind": "dirichlet", "alpha": 0.3},
                 "batch_size": 32, "optimizer": "sgd", "lr": 0.05},
    "strategy": {"name": "fedavg", "tau": 50},
    "datacenters": [{"name": "us-east"}, {"name": VICTIM}],
}


class KilledAndBack(LocalRun):
    """A local run whose VICTIM datacenter (SuperNode and trainer) is SIGKILLed once round 2 is logged and started
    again AWAY_S later."""

    def __init__(self, config: Any, options: LocalRunOptions) -> None:
        super().__init__(config, options)
        self.killed_at: float | None = None
        self.back_at: float | None = None

    def inject_faults(self, rounds_logged: int) -> None:
        super().inject_faults(rounds_logged)
        if rounds_logged >= 2 and self.killed_at is None:
            self.kill_datacenter(VICTIM, trainer=True)
            self.killed_at = time.time()
        elif self.killed_at is not None and self.back_at is None and time.time() - self.killed_at > AWAY_S:
            self.restart_datacenter(VICTIM)
            self.back_at = time.time()


#: the loops the test runs under (the asynchronous loop's heartbeat is tried by the chaos soak); the streaming loop
#: does not look for a datacenter back under a new node, so there the returned datacenter stays out of the exchanges
STRATEGIES = {"fedavg": ({"name": "fedavg", "tau": 50}, 22),
              "streaming": ({"name": "streaming-diloco", "tau": 50, "params": {"fragments": 1}}, 30)}
#: what a strategy needs of the workload besides CONFIG's (DiLoCo's inner optimizer is AdamW)
WORKLOADS = {"streaming": {"optimizer": "adamw", "lr": 0.005}}


@pytest.mark.deployment
@pytest.mark.serial  # it bounds the seconds from the kill to the mark on the wall clock: alone, after the parallel part
@pytest.mark.timeout(400)
@pytest.mark.parametrize("loop", sorted(STRATEGIES))
def test_a_killed_datacenter_is_marked_down_before_the_deadline_and_up_on_return(tmp_path: Path, loop: str) -> None:
    db_url = f"sqlite:///{tmp_path / 'heartbeat.db'}"
    strategy, rounds = STRATEGIES[loop]
    config = parse_config({**CONFIG, "strategy": strategy, "run": {**CONFIG["run"], "rounds": rounds},
                           "workload": {**CONFIG["workload"], **WORKLOADS.get(loop, {})}})
    run = KilledAndBack(config, LocalRunOptions(db_url=db_url, superlink_port=free_port(), runs_root=tmp_path / "runs"))
    result = run.execute()
    assert run.killed_at is not None and run.back_at is not None, "the datacenter was never killed and restarted"
    logged = read_run(db_url, result.run_id)
    assert logged["run"]["status"] == "finished"
    events = [e for e in logged["events"] if e["datacenter"] == VICTIM and e["kind"] in ("datacenter-down", "datacenter-up")]
    downs = [e for e in events if e["kind"] == "datacenter-down"]
    ups = [e for e in events if e["kind"] == "datacenter-up"]
    assert downs and ups and downs[0]["id"] < ups[-1]["id"], events

    def at(event: dict[str, Any]) -> float:  # the run log's times are UTC (SQLite hands them back naive)
        stamp = event["at"]
        return (stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp).timestamp()

    # marked down within twice the heartbeat timeout of the kill (the round deadline is DEADLINE_S), up after the return
    first_down = next(e for e in downs if at(e) >= run.killed_at - 1)
    assert at(first_down) - run.killed_at < 2 * TIMEOUT_S, (at(first_down) - run.killed_at)
    assert any(at(e) >= run.back_at - 1 for e in ups)
    # the rounds it missed closed without it, long before their deadline; its reason says it was down
    missed = [r for r in logged["dc_rounds"] if r["datacenter"] == VICTIM and r["status"] != "ok"]
    assert missed and any("the datacenter is down" in (r["reason"] or "") for r in missed), missed
    slowest = max(r["wall_s"] for r in logged["rounds"])
    assert slowest < DEADLINE_S / 2, slowest
    if loop == "fedavg":
        victim_rows = sorted((r for r in logged["dc_rounds"] if r["datacenter"] == VICTIM), key=lambda r: r["round"])
        assert victim_rows[-1]["status"] == "ok"  # back at work by the end
