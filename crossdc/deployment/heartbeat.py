"""crossdc's own liveness heartbeat: each datacenter's trainer tells the coordinator it is alive, over UDP.

Flower's node heartbeat (1.42) is fixed at 30 s with a patience of 2: a dead SuperNode is noticed a minute or more
later, and a round waits for it until its deadline. This heartbeat is crossdc's, at the cadence the run asks for
(``run.heartbeat_timeout_s``), on the WAN like any other traffic (a datacenter's datagrams cross its emulated link).

Promises:

* a beat is one UDP datagram naming the run, the datacenter and a sequence number, signed (HMAC-SHA256) with the
  run's key (a local run) or its node's own key (a standing federation, below); :func:`decode_beat` answers None for
  anything else (a datagram of another run, forged, truncated, oversized or random, or signed with a key other than
  the one of the datacenter it names), never raises;
* :class:`HeartbeatSender` sends a beat every ``interval_s`` from a daemon thread until stopped; a send that fails
  (the link is cut, the coordinator is gone) is retried at the next beat; with ``retarget`` it asks before every beat
  where to send it and with which key (a standing federation's node: each attempt at a run offers its own);
* :func:`liveness_changes` is the one rule (pure): a datacenter not heard from for more than ``timeout_s`` since
  its last beat (or since monitoring began, if it never beat) is *down*; one heard from again is *up*; only changes
  are reported;
* :class:`HeartbeatMonitor` receives beats on its socket and applies the rule every ``check_s``, calling
  ``on_change(datacenter, up, silent_s)`` once per change (``datacenter-down`` / ``datacenter-up`` events, in the
  federation); :meth:`HeartbeatMonitor.down` is the set down now, :meth:`HeartbeatMonitor.down_since` adds those
  that went down since a moment (a message sent them then may be lost), :meth:`HeartbeatMonitor.came_up_since`
  those back since a moment. Its socket is bound when it is made (:attr:`HeartbeatMonitor.port` is known at once,
  to offer it), judging begins at :meth:`HeartbeatMonitor.start`: a datacenter is given `timeout_s` from then.
* :class:`HeartbeatOffer` is what a coordinator on a standing federation offers the datacenters in its hello: the
  UDP port its monitor listens on (on every interface; a datacenter sends to the SuperLink's host as it reaches it)
  and the key of the node the hello goes to, :func:`node_key` of a secret made for this attempt at the run (which
  never leaves the coordinator) and that node's id: a node's key tells nothing of another's. Its :class:`NodeKeys`
  verify a beat naming a datacenter only with the key of the node that datacenter is bound to (:meth:`NodeKeys.bind`:
  where discovery placed it, moved when it rejoins under a new node), none before: a node, even one whose claim was
  refused, cannot beat for a datacenter it is not;
* a monitor asked for port 0 takes the first free port of :data:`HEARTBEAT_PORTS_ENV` when that is set (the ports a
  firewall opens or a container publishes, e.g. ``9200-9209``), else one the system chooses; an unusable range or
  no free port in it is an ``OSError`` saying which (the run then goes on without a heartbeat).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("crossdc.heartbeat")

#: the largest datagram a monitor reads (a beat is about 150 bytes)
MAX_BEAT_BYTES = 1024
_DIGEST = 32
#: how many beats a monitor expects per timeout (the sender's interval is timeout / BEATS_PER_TIMEOUT)
BEATS_PER_TIMEOUT = 6
#: the UDP ports ("PORT" or "FIRST-LAST") a monitor asked for port 0 takes its port from (a standing federation's
#: coordinator does); unset: any free port
HEARTBEAT_PORTS_ENV = "CROSSDC_HEARTBEAT_PORTS"


def heartbeat_ports(spec: str) -> range:
    """The ports of `spec`, ``PORT`` or ``FIRST-LAST`` (1-65535); ValueError saying why for anything else."""
    first, _, last = spec.strip().partition("-")
    try:
        ports = range(int(first), int(last or first) + 1)
    except ValueError:
        raise ValueError(f"{HEARTBEAT_PORTS_ENV}={spec!r}: expected PORT or FIRST-LAST") from None
    if not ports or ports[0] < 1 or ports[-1] > 65535:
        raise ValueError(f"{HEARTBEAT_PORTS_ENV}={spec!r}: expected ports from 1 to 65535, the first not above the last")
    return ports


def bind_udp(host: str, port: int) -> socket.socket:
    """A UDP socket bound to (`host`, `port`); for port 0 the first free one of :data:`HEARTBEAT_PORTS_ENV` when it
    is set. OSError (one line) if none can be bound."""
    spec = os.environ.get(HEARTBEAT_PORTS_ENV, "").strip() if port == 0 else ""
    try:
        candidates = heartbeat_ports(spec) if spec else range(port, port + 1)
    except ValueError as err:
        raise OSError(str(err)) from None
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    last: OSError | None = None
    for candidate in candidates:
        try:
            sock.bind((host, candidate))
            return sock
        except OSError as err:
            last = err
    sock.close()
    raise OSError(f"no free UDP port in {HEARTBEAT_PORTS_ENV}={spec} on {host}: {last}" if spec else str(last))


@dataclass(frozen=True)
class Beat:
    run_id: str
    datacenter: str
    seq: int


def encode_beat(beat: Beat, key: bytes) -> bytes:
    """The datagram of `beat`: its JSON, then its HMAC-SHA256 under `key`."""
    body = json.dumps({"run": beat.run_id, "dc": beat.datacenter, "seq": beat.seq}, separators=(",", ":")).encode()
    return body + hmac.new(key, body, hashlib.sha256).digest()


#: which key verifies a beat naming a datacenter (None: none, the beat is refused)
KeyOf = Callable[[str], bytes | None]


def decode_beat(data: bytes, key: bytes | KeyOf, run_id: str) -> Beat | None:
    """The beat in `data` if it is one of run `run_id` signed with `key`: one key for every datacenter, or
    ``key(datacenter)``, the key of the datacenter the beat names (None: it has none); None otherwise (never raises
    on any `data`)."""
    if not isinstance(data, bytes | bytearray) or not _DIGEST < len(data) <= MAX_BEAT_BYTES:
        return None
    body, digest = bytes(data[:-_DIGEST]), bytes(data[-_DIGEST:])
    try:  # read before it is verified (the name says which key verifies it): anything may be there
        fields = json.loads(body)
        beat = Beat(str(fields["run"]), str(fields["dc"]), int(fields["seq"]))
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError):
        return None
    signer = key if isinstance(key, bytes) else key(beat.datacenter)
    if signer is None or not hmac.compare_digest(digest, hmac.new(signer, body, hashlib.sha256).digest()):
        return None
    return beat if beat.run_id == run_id else None


def liveness_changes(last_heard: Mapping[str, float], down: Iterable[str], now: float,
                     timeout_s: float) -> dict[str, bool]:
    """Datacenter → True (now up) / False (now down) for each whose state changes at `now`: down once more than
    `timeout_s` passed since `last_heard` (its last beat, or when monitoring began), up again once it is heard within
    `timeout_s`. Datacenters whose state stays are left out."""
    was_down = set(down)
    changes: dict[str, bool] = {}
    for name, heard in last_heard.items():
        is_down = now - heard > timeout_s
        if is_down != (name in was_down):
            changes[name] = not is_down
    return changes


#: a heartbeat's destination and key: ((host, port), key)
Target = tuple[tuple[str, int], bytes]


#: what a node's heartbeat key is derived under, before its node id (see node_key)
NODE_KEY_LABEL = b"crossdc-heartbeat:"


def node_key(secret: bytes, node_id: int) -> bytes:
    """The heartbeat key of the SuperNode `node_id` in the attempt at a run whose secret is `secret`:
    HMAC-SHA256(secret, ``crossdc-heartbeat:`` + the node id in decimal)."""
    return hmac.new(secret, NODE_KEY_LABEL + str(int(node_id)).encode(), hashlib.sha256).digest()


class NodeKeys:
    """One attempt's heartbeat keys on a standing federation: every node's own (:func:`node_key` of the attempt's
    `secret`), and which node each datacenter is bound to; :meth:`key_of` a datacenter is the key of its node, None
    while it is bound to none. Bound from the loop while the monitor's thread reads."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._nodes: dict[str, int] = {}
        self._lock = threading.Lock()

    def for_node(self, node_id: int) -> bytes:
        """The key of the node `node_id` (what the hello to that node offers)."""
        return node_key(self._secret, node_id)

    def bind(self, datacenter: str, node_id: int) -> None:
        """From now on, only the key of the node `node_id` verifies a beat naming `datacenter`."""
        with self._lock:
            self._nodes[datacenter] = node_id

    def key_of(self, datacenter: str) -> bytes | None:
        """The key that verifies a beat naming `datacenter`: its node's; None while it is bound to none."""
        with self._lock:
            node = self._nodes.get(datacenter)
        return None if node is None else self.for_node(node)


@dataclass(frozen=True)
class HeartbeatOffer:
    """A standing federation's coordinator's heartbeat, as its hello offers it to the datacenters: the port, and
    for each node its own key (:meth:`NodeKeys.for_node`)."""

    port: int
    keys: NodeKeys


class HeartbeatSender:
    """Beats of one datacenter of one run to ``address`` (host, port), every `interval_s`, from a daemon thread;
    with `retarget`, to wherever (and with whichever key) it answers before each beat (None: skip that beat)."""

    def __init__(self, address: tuple[str, int], run_id: str, datacenter: str, key: bytes, interval_s: float,
                 retarget: Callable[[], Target | None] | None = None) -> None:
        self.address, self.run_id, self.datacenter, self.key = address, run_id, datacenter, key
        self.interval_s, self.retarget = interval_s, retarget
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{datacenter}", daemon=True)

    def start(self) -> HeartbeatSender:
        self._thread.start()
        return self

    def _run(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            while not self._stop.is_set():
                if self.retarget is not None:
                    try:
                        target = self.retarget()
                    except Exception as err:  # an unreadable answer: keep the last target
                        log.debug("heartbeat of %s: keeping its target: %s", self.datacenter, err)
                    else:
                        if target is None:
                            self._stop.wait(self.interval_s)
                            continue
                        self.address, self.key = target
                try:
                    sock.sendto(encode_beat(Beat(self.run_id, self.datacenter, self.sent + 1), self.key), self.address)
                    self.sent += 1
                except OSError as err:  # no route (a cut link), the coordinator gone: try again at the next beat
                    log.debug("heartbeat of %s not sent: %s", self.datacenter, err)
                self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class HeartbeatMonitor:
    """Receives the beats of `datacenters` of run `run_id` on (`host`, `port`), verified with `key` (one key, or
    each datacenter's, see :func:`decode_beat`), and reports changes of liveness (see :func:`liveness_changes`) to
    `on_change(datacenter, up, silent_s)` from its own thread."""

    def __init__(self, host: str, port: int, run_id: str, key: bytes | KeyOf, datacenters: Iterable[str], timeout_s: float,
                 on_change: Callable[[str, bool, float], None], check_s: float | None = None) -> None:
        self.run_id, self.key, self.timeout_s, self.on_change = run_id, key, timeout_s, on_change
        self.check_s = check_s if check_s is not None else max(0.05, min(1.0, timeout_s / 10))
        self.sock = bind_udp(host, port)
        self.sock.settimeout(self.check_s)
        started = time.monotonic()
        self.last_heard: dict[str, float] = {name: started for name in datacenters}
        self.beats: dict[str, int] = dict.fromkeys(self.last_heard, 0)
        self.refused = 0
        #: (monotonic) when each datacenter last went down, and last came up again
        self.went_down_at: dict[str, float] = {}
        self.came_up_at: dict[str, float] = {}
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-monitor", daemon=True)

    @property
    def port(self) -> int:
        """The UDP port the monitor listens on (the one asked for, or the one the system chose for port 0)."""
        return int(self.sock.getsockname()[1])

    def start(self) -> HeartbeatMonitor:
        """Begin judging: every datacenter not heard from yet has `timeout_s` from now."""
        started = time.monotonic()
        with self._lock:
            self.last_heard = {name: started for name in self.last_heard}
        self._thread.start()
        return self

    def down(self) -> set[str]:
        with self._lock:
            return set(self._down)

    def down_since(self, since: float) -> set[str]:
        """The datacenters down now or gone down at any time from `since` (monotonic) on: a message sent to one of
        them then may never be answered (its node may have died and come back under a new id)."""
        with self._lock:
            return set(self._down) | {name for name, at in self.went_down_at.items() if at >= since}

    def came_up_since(self, since: float) -> set[str]:
        """The datacenters that came back up from `since` (monotonic) on and are up now."""
        with self._lock:
            return {name for name, at in self.came_up_at.items() if at >= since and name not in self._down}

    def _receive(self) -> None:
        try:
            data, _ = self.sock.recvfrom(MAX_BEAT_BYTES + 1)
        except (TimeoutError, OSError):
            return
        beat = decode_beat(data, self.key, self.run_id)
        if beat is None or beat.datacenter not in self.last_heard:
            self.refused += 1
            return
        with self._lock:
            self.last_heard[beat.datacenter] = time.monotonic()
            self.beats[beat.datacenter] += 1

    def _run(self) -> None:
        next_check = time.monotonic() + self.check_s
        while not self._stop.is_set():
            self._receive()
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + self.check_s
            with self._lock:
                changes = liveness_changes(self.last_heard, self._down, now, self.timeout_s)
                for name, up in changes.items():
                    (self._down.discard if up else self._down.add)(name)
                    (self.came_up_at if up else self.went_down_at)[name] = now
                silent = {name: now - self.last_heard[name] for name in changes}
            for name, up in changes.items():
                try:
                    self.on_change(name, up, silent[name])
                except Exception:  # reporting must not stop monitoring
                    log.exception("heartbeat: reporting %s %s failed", name, "up" if up else "down")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5)
        self.sock.close()
