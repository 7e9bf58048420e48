"""The link relay forwards bytes unchanged and measures them; time_in_flight is the union of intervals."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from crossdc.wan.ledger import LedgerReader, Transfer, time_in_flight
from crossdc.wan.link_relay import LinkRelay


def test_time_in_flight_is_the_union_of_intervals() -> None:
    transfers = [Transfer("up", 10, 1.0, 2.0), Transfer("down", 10, 1.5, 2.5), Transfer("up", 5, 4.0, 4.25)]
    assert time_in_flight(transfers) == pytest.approx(1.5 + 0.25)
    assert time_in_flight([]) == 0.0


@pytest.mark.timeout(30)
def test_relay_forwards_and_records_every_byte(tmp_path: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    payload = bytes(range(256)) * 4096  # 1 MiB

    def echo_once() -> None:
        conn, _ = server.accept()
        with conn:
            received = b""
            while len(received) < len(payload):
                received += conn.recv(65536)
            conn.sendall(received[::-1])

    thread = threading.Thread(target=echo_once, daemon=True)
    thread.start()
    ledger = tmp_path / "links" / "dc.ledger"
    relay = LinkRelay("127.0.0.1", server.getsockname()[1], ledger).start()
    try:
        with socket.create_connection(("127.0.0.1", relay.port)) as client:
            client.sendall(payload)
            answer = b""
            while len(answer) < len(payload):
                answer += client.recv(65536)
        assert answer == payload[::-1]
        thread.join(timeout=10)
    finally:
        relay.close()
        server.close()
    transfers = LedgerReader(ledger).window(0, float("inf"))
    assert sum(t.size for t in transfers if t.direction == "up") == len(payload)
    assert sum(t.size for t in transfers if t.direction == "down") == len(payload)
    assert all(t.left >= t.entered for t in transfers)
    assert 0 < time_in_flight(transfers) < 10
