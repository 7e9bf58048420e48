"""The link emulator: delay and bandwidth on a real loopback transfer, jitter ordering, faults.

Tolerances are wide for a noisy shared machine, but each check fails when shaping is off.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from crossdc.experiment.links import LinkSpec
from crossdc.wan.ledger import LedgerReader, bytes_by_direction, pace, time_in_flight
from crossdc.wan.link_relay import LinkRelay

#: these tests assert paces and deadlines on the wall clock: they run alone, after the parallel part of the suite
pytestmark = pytest.mark.serial


def test_pace_is_the_link_model() -> None:
    # 1 MB on an idle 8 Mbps link with 50 ms one way: sent for 1 s, delivered 50 ms later
    free, delivered = pace(10.0, 1_000_000, 0.0, 0.0, 8e6, 0.05)
    assert (free, delivered) == pytest.approx((11.0, 11.05))
    # the next chunk waits for the link, and never overtakes the previous delivery (FIFO under jitter)
    free2, delivered2 = pace(10.5, 1_000_000, free, delivered + 5.0, 8e6, 0.05, jitter_s=0.01)
    assert free2 == pytest.approx(12.0) and delivered2 == pytest.approx(16.05)


class Sink:
    """A TCP server that receives `expected` bytes, then answers one byte (for timing a transfer or a ping)."""

    def __init__(self, expected: int) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.expected = expected
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            got = 0
            while got < self.expected:
                data = conn.recv(1 << 16)
                if not data:
                    return
                got += len(data)
            conn.sendall(b"k")

    def close(self) -> None:
        self.server.close()


def timed_exchange(port: int, payload: bytes) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(payload)
        assert client.recv(1) == b"k"
    return time.perf_counter() - started


@pytest.mark.timeout(60)
def test_ten_megabytes_over_50_mbps_100_ms(tmp_path: Path) -> None:
    payload = b"x" * 10_000_000
    sink = Sink(len(payload))
    relay = LinkRelay("127.0.0.1", sink.port, tmp_path / "link.ledger", link=LinkSpec("test", 50.0, 100.0)).start()
    try:
        elapsed = timed_exchange(relay.port, payload)
    finally:
        relay.close()
        sink.close()
    # 80 Mbit at 50 Mbps = 1.6 s, plus a round trip; a shaping-off relay does this in milliseconds
    assert 1.6 <= elapsed < 8.0
    transfers = LedgerReader(tmp_path / "link.ledger").window(0, float("inf"))
    assert bytes_by_direction(transfers) == {"up": len(payload), "down": 1}
    assert time_in_flight(transfers) >= 1.6


@pytest.mark.timeout(60)
def test_ping_pong_takes_a_round_trip(tmp_path: Path) -> None:
    sink = Sink(1)
    relay = LinkRelay("127.0.0.1", sink.port, tmp_path / "link.ledger", link=LinkSpec("test", 1000.0, 100.0)).start()
    try:
        elapsed = timed_exchange(relay.port, b"p")
    finally:
        relay.close()
        sink.close()
    assert 0.1 <= elapsed < 2.0


@pytest.mark.timeout(60)
def test_unshaped_relay_is_fast(tmp_path: Path) -> None:
    payload = b"x" * 10_000_000
    sink = Sink(len(payload))
    relay = LinkRelay("127.0.0.1", sink.port, tmp_path / "link.ledger").start()
    try:
        elapsed = timed_exchange(relay.port, payload)
    finally:
        relay.close()
        sink.close()
    assert elapsed < 1.5


@pytest.mark.timeout(60)
def test_cut_refuses_and_resets_then_comes_back(tmp_path: Path) -> None:
    echo = socket.create_server(("127.0.0.1", 0))
    echo.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = echo.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")], daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    relay = LinkRelay("127.0.0.1", echo.getsockname()[1], tmp_path / "link.ledger").start()
    try:
        open_conn = socket.create_connection(("127.0.0.1", relay.port))
        open_conn.sendall(b"hi")
        assert open_conn.recv(2) == b"hi"
        relay.cut(1.0)
        assert relay.is_cut
        with pytest.raises(OSError):  # the open connection is reset ...
            open_conn.sendall(b"again")
            if not open_conn.recv(5):
                raise ConnectionResetError("closed")
        with pytest.raises(OSError):  # ... and new ones are refused
            socket.create_connection(("127.0.0.1", relay.port), timeout=1).recv(1)
        time.sleep(1.3)
        assert not relay.is_cut
        with socket.create_connection(("127.0.0.1", relay.port), timeout=2) as again:
            again.sendall(b"back")
            assert again.recv(4) == b"back"
    finally:
        relay.close()
        echo.close()
