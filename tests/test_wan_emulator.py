"""The namespace emulator (crossdc.wan.network) on real namespaces, TUN devices and the delay line: the paces it
promises (RTT, bandwidth, loss), its faults (cut, reset), the datacenter-to-datacenter mesh, and that it leaves
nothing behind, even when its owner is SIGKILLed.

Every run here keeps its state under tmp_path and takes a slot from SLOT_BASE up (the slots below hold placeholders
owned by this process): slots are counted per state folder while the names they stand for (cdc<slot>-<i>,
10.201.<slot>.0/24) are machine-wide, so starting at slot 0 would collide with a real run of the suite."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crossdc.experiment.links import LINK_PROFILES, LinkSpec
from crossdc.experiment.processes import enter_network_namespace, is_running
from crossdc.wan.ledger import LedgerReader
from crossdc.wan.network import EmulatedNetwork, owner_state, sweep

pytestmark = pytest.mark.usefixtures("namespaces")  # skipped without namespaces, failed under CI (conftest)

from conftest import processes_mentioning  # noqa: E402

TRANSOCEANIC = LINK_PROFILES["transoceanic"]
METRO = LINK_PROFILES["metro"]
SLOT_BASE = 200


# ------------------------------------------------------------------ helpers
@pytest.fixture
def state_root(tmp_path: Path) -> Path:
    root = tmp_path / "wan"
    root.mkdir()
    mine = {**owner_state(os.getpid()), "network": "0.0.0.0/32", "namespaces": []}
    for slot in range(SLOT_BASE):
        (root / f"slot-{slot}.json").write_text(json.dumps(mine))
    return root


@contextlib.contextmanager
def emulated(tmp_path: Path, state_root: Path, star, mesh=(), **kwargs) -> Iterator[EmulatedNetwork]:
    net = EmulatedNetwork(star, list(mesh), tmp_path / "ledgers", state_root=state_root,
                          log_path=tmp_path / "delay-line.log", **kwargs).start()
    try:
        yield net
    finally:
        net.close()


def socket_in(net: EmulatedNetwork, datacenter: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket of the datacenter's namespace, made by a thread that enters it (a socket keeps its namespace)."""
    made: dict[str, object] = {}

    def make() -> None:
        try:
            enter_network_namespace(str(net.namespace_path(datacenter)))  # this thread only
            made["socket"] = socket.socket(socket.AF_INET, kind)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            made["error"] = err

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]  # type: ignore[misc]
    return made["socket"]  # type: ignore[return-value]


def abort(sock: socket.socket) -> None:
    """Close with a reset: nothing of the connection lingers in the kernel (no FIN to retransmit after the run)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class TcpServer:
    """Accepts on `listener`; "echo" sends every byte back, "sink" counts them ((time, total) per read).
    close() resets what is still open, before the network goes (a root-namespace socket outlives the run)."""

    def __init__(self, listener: socket.socket, mode: str = "echo") -> None:
        self.listener, self.mode = listener, mode
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.port = listener.getsockname()[1]
        self.marks: list[tuple[float, int]] = []
        self.done = threading.Event()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            self.threads.append(thread)
            thread.start()
        self.listener.close()

    def _serve(self, connection: socket.socket) -> None:
        connection.settimeout(0.1)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = 0
        while not self.stopping.is_set():
            try:
                data = connection.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if self.mode == "echo":
                try:
                    connection.sendall(data)
                except OSError:
                    break
            else:
                total += len(data)
                self.marks.append((time.monotonic(), total))
        abort(connection)
        self.done.set()

    def close(self) -> None:
        self.stopping.set()
        for thread in list(self.threads):
            thread.join(5)


def listen_on(address: str, sock: socket.socket | None = None, mode: str = "echo") -> TcpServer:
    sock = sock or socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    return TcpServer(sock, mode)


def run_in(net: EmulatedNetwork, datacenter: str, code: str, *args: object, timeout: float = 30) -> str:
    """Run Python `code` in the datacenter's namespace; its standard output."""
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], preexec_fn=net.preexec(datacenter),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


BULK = r"""
import socket, sys
host, port, megabytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=30)
chunk = b"x" * (1 << 20)
for _ in range(megabytes):
    s.sendall(chunk)
s.shutdown(socket.SHUT_WR)
try:
    s.recv(1)  # the server resets the connection once it has read everything
except ConnectionResetError:
    pass
"""

UDP = r"""
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(count):
    s.sendto(i.to_bytes(4, "big") + b"u" * 296, (host, port))
    if i % 50 == 49:
        time.sleep(0.005)  # a paced sender: the TUN device's own queue must not overflow
"""


def pinger(net: EmulatedNetwork, datacenter: str, host: str, port: int) -> socket.socket:
    """A TCP connection (TCP_NODELAY) from the datacenter's namespace to an echo server."""
    sock = socket_in(net, datacenter)
    sock.settimeout(10)
    sock.connect((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(2):  # warm up
        ping_ms(sock, 1)
    return sock


def ping_ms(sock: socket.socket, count: int) -> list[float]:
    """`count` one-byte ping-pongs; their round-trip times in milliseconds."""
    rtts = []
    for _ in range(count):
        start = time.perf_counter()
        sock.sendall(b"p")
        assert sock.recv(16) == b"p"
        rtts.append((time.perf_counter() - start) * 1000)
    return rtts


def ping_once(sock: socket.socket) -> None:
    sock.sendall(b"hello")
    assert sock.recv(16) == b"hello"


def blocked_recv(sock: socket.socket) -> tuple[threading.Thread, dict[str, object]]:
    """A thread blocked in sock.recv; the outcome dict gets the error (or the data) and when it came."""
    outcome: dict[str, object] = {}

    def wait() -> None:
        sock.settimeout(10)
        try:
            outcome["data"] = sock.recv(16)
        except OSError as err:
            outcome["error"] = err
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.2)
    return thread, outcome


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def blackhole_routes() -> list[str]:
    out = subprocess.run(["ip", "route", "show", "type", "blackhole"], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def root_devices() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line}


def net_namespaces_in_use() -> dict[int, str]:
    """`lsns -t net`: the network namespaces that have processes (inode → its first process)."""
    out = subprocess.run(["lsns", "-t", "net", "-n", "-r", "-o", "NS,PID"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[0]): line.split()[1] for line in out.splitlines() if line.strip()}


def leftovers(slot: int, namespaces: list[str], network: str, spec_path: Path) -> list[str]:
    """What of a run is still on the machine (empty when nothing)."""
    found = [f"namespace {name}" for name in sorted(netns_names() & set(namespaces))]
    found += [f"route {route}" for route in blackhole_routes() if route.split()[1] == network]
    found += [f"device {name}" for name in root_devices() if name == f"cdc{slot}" or name.startswith(f"cdc{slot}d")]
    found += [f"process {p}" for p in processes_mentioning("crossdc.wan.delay_line", str(spec_path))]
    return found


def _run_facts(net: EmulatedNetwork) -> tuple[int, list[str], str, Path]:
    assert net.slot is not None
    assert net.process is not None
    return (net.slot, [net.namespace(name) for name in net.names], net.network, Path(net.process.args[-1]))


# ------------------------------------------------------------------ paces
def rtt_over_baseline_ms(path: socket.socket, baseline: socket.socket, rounds: int = 5, count: int = 20) -> tuple[float, float]:
    """(median RTT over `path`, median RTT over `baseline`, a path of zero emulated delay), pinged in alternation so
    both see the same load. The baseline is this machine's own cost of a path (the TUN devices, the delay line, the
    Python ends): about 0.15 ms, not part of the emulated link."""
    measured: list[float] = []
    base: list[float] = []
    for _ in range(rounds):
        measured += ping_ms(path, count)
        base += ping_ms(baseline, count)
    return statistics.median(measured), statistics.median(base)


ZERO = LinkSpec("zero", bandwidth_mbps=10_000.0, rtt_ms=0.0)


@pytest.mark.serial
def test_ping_pong_finds_the_links_round_trip_time(tmp_path: Path, state_root: Path) -> None:
    with emulated(tmp_path, state_root, [("far", TRANSOCEANIC), ("near", METRO), ("base", None)]) as net:
        server = listen_on(net.coordinator_address)
        clients = [pinger(net, dc, net.coordinator_address, server.port) for dc in ("far", "near", "base")]
        far = ping_ms(clients[0], 10)
        near, base = rtt_over_baseline_ms(clients[1], clients[2])
        for client in clients:
            client.close()
        server.close()
    print(f"transoceanic RTT median {statistics.median(far):.1f} ms ({min(far):.1f}–{max(far):.1f}); "
          f"metro RTT median {near:.3f} ms, unshaped {base:.3f} ms: metro adds {near - base:.3f} ms")
    assert statistics.median(far) == pytest.approx(150.0, rel=0.25)
    # metro's 2 ms is measured over the machine's own cost of the path (see rtt_over_baseline_ms)
    assert near - base == pytest.approx(2.0, rel=0.25)


def _steady_mbps(marks: list[tuple[float, int]]) -> float:
    """The rate over the last two thirds of the bytes (slow start is in the first third)."""
    end, total = marks[-1]
    since, already = next(mark for mark in marks if mark[1] >= total / 3)
    return (total - already) * 8 / (end - since) / 1e6


@pytest.mark.serial
@pytest.mark.parametrize(("profile", "megabytes"), [("transoceanic", 24), ("constrained", 5)])
def test_a_bulk_stream_gets_the_links_bandwidth(tmp_path: Path, state_root: Path, profile: str, megabytes: int) -> None:
    link = LINK_PROFILES[profile]
    with emulated(tmp_path, state_root, [("a", link)]) as net:
        server = listen_on(net.coordinator_address, mode="sink")
        started = time.monotonic()
        run_in(net, "a", BULK, net.coordinator_address, server.port, megabytes, timeout=60)
        assert server.done.wait(10)
        took = time.monotonic() - started
        server.close()
        up = net.stats()["hops"]["a:up"]
    assert server.marks[-1][1] == megabytes << 20
    mbps = _steady_mbps(server.marks)
    print(f"{profile}: {megabytes} MB in {took:.1f} s, steady {mbps:.1f} Mbps; a:up {up}")
    assert mbps == pytest.approx(link.bandwidth_mbps, rel=0.25)


def test_a_lossy_link_drops_its_fraction_of_datagrams(tmp_path: Path, state_root: Path) -> None:
    lossy = LinkSpec("lossy", bandwidth_mbps=1000.0, rtt_ms=0.2, loss=0.1)
    count = 2000
    with emulated(tmp_path, state_root, [("a", lossy)], mtu=1500) as net:
        receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        receiver.bind((net.coordinator_address, 0))
        run_in(net, "a", UDP, net.coordinator_address, receiver.getsockname()[1], count)
        got = set()
        while select.select([receiver], [], [], 0.5)[0]:
            got.add(int.from_bytes(receiver.recv(2048)[:4], "big"))
        receiver.close()
        up = net.stats()["hops"]["a:up"]
    fraction = len(got) / count
    print(f"received {len(got)}/{count} = {fraction:.3f}; a:up {up}")
    assert fraction == pytest.approx(0.9, abs=0.03)  # σ = √(0.9·0.1/2000) ≈ 0.0067
    assert up["dropped_loss"] == count - len(got)
    assert up["packets"] == len(got) and up["dropped_queue"] == 0 and up["dropped_cut"] == 0


# ------------------------------------------------------------------ faults
FAST = LinkSpec("fast", bandwidth_mbps=1000.0, rtt_ms=2.0)


def test_a_cut_resets_open_connections_and_blocks_new_ones_until_it_ends(tmp_path: Path, state_root: Path) -> None:
    with emulated(tmp_path, state_root, [("a", FAST), ("b", FAST)]) as net:
        server = listen_on(net.coordinator_address)
        inside = listen_on(net.address("a"), socket_in(net, "a"))  # for connections the other way
        client = socket_in(net, "a")
        client.connect((net.coordinator_address, server.port))
        ping_once(client)
        bystander = socket_in(net, "b")  # another datacenter's connection is not affected
        bystander.connect((net.coordinator_address, server.port))
        thread, outcome = blocked_recv(client)

        cut_at = time.monotonic()
        net.cut(2.0, datacenter="a")
        cut_took = time.monotonic() - cut_at
        thread.join(5)
        detected = outcome["at"] - cut_at  # type: ignore[operator]
        assert isinstance(outcome.get("error"), ConnectionResetError | ConnectionAbortedError), outcome
        assert detected < 1.5
        with pytest.raises(OSError):
            client.send(b"after the cut")
        client.close()
        ping_once(bystander)

        # during the cut: new connections, either way, get no answer
        tried_at = time.monotonic() - cut_at
        fresh = socket_in(net, "a")
        fresh.settimeout(0.4)
        with pytest.raises(TimeoutError):
            fresh.connect((net.coordinator_address, server.port))
        fresh.close()
        with socket.socket() as other_way:
            other_way.settimeout(0.4)
            with pytest.raises(TimeoutError):
                other_way.connect((net.address("a"), inside.port))
        assert time.monotonic() - cut_at < 2.0, "the checks during the cut ran after its end: the machine is too busy"
        dropped = net.stats()["hops"]["a:up"]["dropped_cut"]
        assert dropped >= 1

        # after the cut (and the reset that ends it): new connections work both ways
        time.sleep(max(0.0, cut_at + 2.0 + 1.0 - time.monotonic()))
        again = socket_in(net, "a")
        again.settimeout(5)
        again.connect((net.coordinator_address, server.port))
        ping_once(again)
        with socket.create_connection((net.address("a"), inside.port), timeout=5) as other_way:
            ping_once(other_way)
        time.sleep(0.3)
        ping_once(again)  # still open
        again.close()
        bystander.close()
        server.close()
        inside.close()
    print(f"cut() took {cut_took * 1000:.0f} ms; the blocked recv failed after {detected * 1000:.0f} ms "
          f"({type(outcome['error']).__name__}); connect attempts during the cut began {tried_at * 1000:.0f} ms in; "
          f"a:up dropped {dropped} packets in the cut")


def test_a_reset_resets_open_connections_and_new_ones_work_at_once(tmp_path: Path, state_root: Path) -> None:
    with emulated(tmp_path, state_root, [("a", FAST)]) as net:
        server = listen_on(net.coordinator_address)
        client = socket_in(net, "a")
        client.connect((net.coordinator_address, server.port))
        ping_once(client)
        thread, outcome = blocked_recv(client)
        reset_at = time.monotonic()
        net.reset(datacenter="a")
        thread.join(5)
        detected = outcome["at"] - reset_at  # type: ignore[operator]
        assert isinstance(outcome.get("error"), ConnectionResetError | ConnectionAbortedError), outcome
        assert detected < 1.5
        client.close()
        fresh = socket_in(net, "a")
        fresh.settimeout(2)
        fresh.connect((net.coordinator_address, server.port))
        ping_once(fresh)
        fresh.close()
        server.close()
        hops = net.stats()["hops"]
    assert hops["a:up"]["dropped_cut"] == hops["a:down"]["dropped_cut"] == 0
    print(f"reset detected after {detected * 1000:.0f} ms ({type(outcome['error']).__name__})")


# ------------------------------------------------------------------ the mesh
@pytest.mark.serial
def test_datacenters_reach_each_other_through_the_coordinator_or_their_mesh_link(tmp_path: Path, state_root: Path) -> None:
    # a–b: no mesh entry, so a:up then b:down (75 + 75 ms each way); a–c: a metro mesh link; a–d: a mesh link of
    # zero delay, the baseline of a–c (see rtt_over_baseline_ms)
    star = [("a", TRANSOCEANIC), ("b", TRANSOCEANIC), ("c", TRANSOCEANIC), ("d", TRANSOCEANIC)]
    with emulated(tmp_path, state_root, star, [("a", "c", METRO), ("d", "a", ZERO)]) as net:
        at = {dc: listen_on(net.address(dc), socket_in(net, dc)) for dc in ("b", "c", "d")}
        clients = {dc: pinger(net, "a", net.address(dc), at[dc].port) for dc in ("b", "c", "d")}
        via_coordinator = ping_ms(clients["b"], 6)
        direct, base = rtt_over_baseline_ms(clients["c"], clients["d"])
        for dc in at:
            clients[dc].close()
            at[dc].close()
        hops = net.stats()["hops"]
    print(f"a→b via the coordinator: median {statistics.median(via_coordinator):.1f} ms; "
          f"a→c over the metro mesh link: median {direct:.3f} ms, a→d over a zero-delay one {base:.3f} ms: "
          f"metro adds {direct - base:.3f} ms")
    assert statistics.median(via_coordinator) == pytest.approx(300.0, rel=0.25)
    assert direct - base == pytest.approx(2.0, rel=0.25)
    assert hops["a>c"]["packets"] > 0 and hops["c>a"]["packets"] > 0 and hops["a>d"]["packets"] > 0
    for dc in ("c", "d"):  # the mesh traffic never touched their star links
        assert hops[f"{dc}:up"]["packets"] == hops[f"{dc}:down"]["packets"] == 0
    assert hops["a:up"]["packets"] > 0 and hops["b:down"]["packets"] > 0 and hops["b:up"]["packets"] > 0
    ledgers = tmp_path / "ledgers"
    assert {t.direction for t in LedgerReader(ledgers / "a--c.ledger").window(0, 1e12)} == {"a>c", "c>a"}
    assert {t.direction for t in LedgerReader(ledgers / "a--d.ledger").window(0, 1e12)} == {"a>d", "d>a"}
    assert {t.direction for t in LedgerReader(ledgers / "b.ledger").window(0, 1e12)} == {"up", "down"}


# ------------------------------------------------------------------ nothing left behind
def test_close_leaves_nothing_behind(tmp_path: Path, state_root: Path) -> None:
    net = EmulatedNetwork([("a", FAST), ("b", None)], [("a", "b", METRO)], tmp_path / "ledgers", state_root=state_root).start()
    try:
        slot, namespaces, network, spec_path = _run_facts(net)
        assert slot == SLOT_BASE
        assert set(namespaces) <= netns_names() and any(r.split()[1] == network for r in blackhole_routes())
        assert f"cdc{slot}" in root_devices() and processes_mentioning("crossdc.wan.delay_line", str(spec_path))
        sleeper = subprocess.Popen(["sleep", "600"], preexec_fn=net.preexec("a"))
        inode = os.stat(net.namespace_path("a")).st_ino
        assert net_namespaces_in_use().get(inode) == str(sleeper.pid)
    finally:
        net.close()
    assert sleeper.wait(5) == -signal.SIGKILL  # close() ended the process left in the namespace
    assert leftovers(slot, namespaces, network, spec_path) == []
    assert inode not in net_namespaces_in_use()
    assert not (state_root / f"slot-{slot}.json").exists() and not spec_path.exists()
    net.close()  # twice is harmless


CHILD = r"""
import json, subprocess, sys, time
from pathlib import Path
from crossdc.experiment.links import LINK_PROFILES
from crossdc.experiment.processes import enter_network_namespace
from crossdc.wan.network import EmulatedNetwork
net = EmulatedNetwork([("x", LINK_PROFILES["metro"]), ("y", None)], [], Path(sys.argv[2]), state_root=Path(sys.argv[1])).start()
path = str(net.namespace_path("x"))
# a process that outlives its starter (as a daemon would), and one that dies with it (net.preexec)
orphan = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: enter_network_namespace(path), start_new_session=True)
follower = subprocess.Popen(["sleep", "601"], preexec_fn=net.preexec("y"))
print(json.dumps({"slot": net.slot, "namespaces": [net.namespace(n) for n in net.names], "network": net.network,
                  "orphan": orphan.pid, "follower": follower.pid, "spec": net.process.args[-1]}), flush=True)
time.sleep(600)
"""


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_the_next_start_sweeps_what_a_killed_run_left_and_only_that(tmp_path: Path, state_root: Path) -> None:
    with emulated(tmp_path, state_root, [("a", FAST)]) as live:
        live_slot, live_namespaces, live_network, _ = _run_facts(live)
        with open(tmp_path / "child.log", "w") as child_log:
            child = subprocess.Popen([sys.executable, "-c", CHILD, str(state_root), str(tmp_path / "dead-ledgers")],
                                     stdout=subprocess.PIPE, stderr=child_log, text=True)
        try:
            ready = select.select([child.stdout], [], [], 30)[0]
            line = child.stdout.readline() if ready else ""  # type: ignore[union-attr]
            assert line, f"the child did not start its network: {(tmp_path / 'child.log').read_text()[-2000:]}"
            dead = json.loads(line)
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
            child.stdout.close()  # type: ignore[union-attr]
        slot, namespaces, network = dead["slot"], dead["namespaces"], dead["network"]
        spec_path = Path(dead["spec"])
        assert slot == live_slot + 1
        inode = os.stat(f"/run/netns/{namespaces[0]}").st_ino

        # what the killed run left: its namespaces, its route, the orphan, its slot file (its delay line and devices
        # went with it: they die with their parent)
        assert _wait_until(lambda: not processes_mentioning("crossdc.wan.delay_line", str(spec_path)), 10)
        assert _wait_until(lambda: not is_running(dead["follower"]), 10)
        # the kernel unregisters a dead process's TUN devices after its exit, seconds later on a loaded machine
        assert _wait_until(lambda: not [d for d in root_devices() if d == f"cdc{slot}" or d.startswith(f"cdc{slot}d")], 30)
        assert set(namespaces) <= netns_names() and any(r.split()[1] == network for r in blackhole_routes())
        assert is_running(dead["orphan"]) and net_namespaces_in_use().get(inode) == str(dead["orphan"])
        assert (state_root / f"slot-{slot}.json").exists()

        assert sweep(state_root) == [f"slot-{slot}.json"]

        assert leftovers(slot, namespaces, network, spec_path) == []
        assert not set(namespaces) & netns_names(), subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert _wait_until(lambda: not is_running(dead["orphan"]), 5)
        assert inode not in net_namespaces_in_use(), subprocess.run(["lsns", "-t", "net"], capture_output=True, text=True).stdout
        assert not (state_root / f"slot-{slot}.json").exists() and not spec_path.exists()

        # the live run is untouched, and still carries traffic
        assert set(live_namespaces) <= netns_names()
        assert any(r.split()[1] == live_network for r in blackhole_routes())
        assert (state_root / f"slot-{live_slot}.json").exists() and len(list(state_root.glob("slot-*.json"))) == SLOT_BASE + 1
        server = listen_on(live.coordinator_address)
        client = socket_in(live, "a")
        client.settimeout(5)
        client.connect((live.coordinator_address, server.port))
        ping_once(client)
        client.close()
        server.close()
        # a start sweeps too, and nothing is left to sweep; the freed slot is taken again
        (tmp_path / "next").mkdir()
        with emulated(tmp_path / "next", state_root, [("z", None)]) as following:
            assert following.slot == slot
        assert sweep(state_root) == []
