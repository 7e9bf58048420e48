"""A link's ledger: what crossed it, one line per chunk (the relay) or packet (the delay line), and the questions
the round asks of it: which transfers carried the round's messages, how long the link carried them, how many
bytes went each way.

A ledger line is ``direction size entered left exchange path data``: ``up`` (datacenter → coordinator) or ``down``,
bytes, the wall-clock times the bytes entered the link and were handed to the far side, the HTTP exchange
("<connection>.<request>") and its request path, ``-`` where unknown, and the bytes of data the packet carries
for its connection (TCP payload: 0 for a bare acknowledgement; a line without it is read as all data). :func:`ledger_line` writes one,
:class:`LedgerReader` reads them back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Transfer:
    """One chunk on the link, and the HTTP exchange (request path) it belongs to, if any."""

    direction: str  # "up" or "down"
    size: int
    entered: float  # time.time() when the chunk entered the link
    left: float  # time.time() when it was handed to the far side
    exchange: str = "-"  # "<connection>.<request>" (an HTTP/1.1 request and its response), "-" if unknown
    path: str = "-"  # the request's path, e.g. /v1/fleet/pull-object
    data: int | None = None  # bytes of TCP payload (0: a bare acknowledgement or FIN); None: all of `size` is data


class ExchangeTracker:
    """Follows HTTP/1.1 request lines on one connection, so every chunk can name the exchange it belongs to.

    Flower 1.42's Fleet API is HTTP/1.1 (httpx): a request line starts the client's chunk that opens
    the next exchange; the server's answer belongs to the latest request.
    """

    _METHODS = (b"POST ", b"GET ", b"PUT ", b"DELETE ", b"PATCH ", b"HEAD ")

    def __init__(self, connection: int) -> None:
        self.connection = connection
        self.count = 0
        self.path = "-"

    def on_up(self, chunk: bytes) -> None:
        if chunk.startswith(self._METHODS):
            line = chunk.split(b"\r\n", 1)[0].split(b" ")
            self.count += 1
            self.path = line[1].decode("latin-1") if len(line) > 1 else "-"

    @property
    def exchange(self) -> str:
        return f"{self.connection}.{self.count}" if self.count else "-"


def pace(arrival: float, size: int, link_free_at: float, last_delivery: float, bandwidth_bps: float,
         one_way_s: float, jitter_s: float = 0.0) -> tuple[float, float]:
    """(time the link is free again, delivery time) of a chunk of `size` bytes arriving at `arrival`."""
    start = max(arrival, link_free_at)
    free_at = start + size * 8.0 / bandwidth_bps
    return free_at, max(free_at + one_way_s + jitter_s, last_delivery)


class LedgerReader:
    """Reads a link's ledger incrementally and answers: what crossed the link in a time window?"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._transfers: list[Transfer] = []

    def _read_new(self) -> None:
        lines, self._offset = read_new_lines(self.path, self._offset)
        for line in lines:
            direction, size, entered, left, exchange, path, *data = line.split()
            self._transfers.append(Transfer(direction, int(size), float(entered), float(left), exchange, path,
                                            int(data[0]) if data else None))

    def window(self, start: float, end: float) -> list[Transfer]:
        """Transfers that entered the link within [start, end]; older ones are forgotten."""
        self._read_new()
        selected = [t for t in self._transfers if start <= t.entered <= end]
        self._transfers = [t for t in self._transfers if t.entered > end]
        return selected


def read_new_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines of `path` after byte `offset` (a line still being written waits for the next read), and the
    offset after them; none if the file does not exist yet."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read()
    complete = data[: data.rfind(b"\n") + 1]
    return complete.decode().splitlines(), offset + len(complete)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_start is not None and current_end is not None:
        total += current_end - current_start
    return total


def time_in_flight(transfers: Iterable[Transfer]) -> float:
    """Length of the union of the transfers' [entered, left] intervals: the time the link carried payload."""
    return union_length((t.entered, t.left) for t in transfers)


#: Fleet API requests that move a message's content (objects) or its acknowledgement
PAYLOAD_PATHS = ("/v1/fleet/pull-object", "/v1/fleet/push-object", "/v1/fleet/push-messages",
                  "/v1/fleet/confirm-message-received", "/v1/fleet/get-run", "/v1/fleet/get-fab")
_POLL_PATH = "/v1/fleet/pull-messages"


def payload_transfers(transfers: list[Transfer]) -> list[Transfer]:
    """The transfers that carried the round's messages: the poll that delivered the message (the last
    pull-messages exchange before the first pull-object), then every exchange that moved objects or
    acknowledged them. Idle polls and heartbeats are left out; non-HTTP traffic is kept whole."""
    if not any(t.path != "-" for t in transfers):
        return list(transfers)
    ordered = sorted(transfers, key=lambda t: t.entered)
    first_object = next((t.entered for t in ordered if t.path == "/v1/fleet/pull-object"), None)
    delivering = None
    if first_object is not None:
        polls = [t for t in ordered if t.path == _POLL_PATH and t.entered <= first_object]
        delivering = polls[-1].exchange if polls else None
    kept = [t for t in ordered if t.path in PAYLOAD_PATHS or (delivering is not None and t.exchange == delivering)]
    return within_exchanges(kept)


def within_exchanges(transfers: list[Transfer]) -> list[Transfer]:
    """`transfers` less what each HTTP exchange's connection sent after the exchange was over: an exchange ends when
    its last packet that carries data (request or response bytes) is delivered; the bare packets that follow on
    its connection (the last acknowledgement, keep-alives, the closing handshake) wait on nobody. Transfers of no
    known exchange, and those whose data is unknown, are kept."""
    last_data: dict[str, float] = {}
    for t in transfers:
        if t.exchange != "-" and (t.data is None or t.data > 0):
            last_data[t.exchange] = max(last_data.get(t.exchange, t.left), t.left)
    return [t for t in transfers if t.exchange == "-" or t.data is None or t.data > 0
            or (t.exchange in last_data and t.entered <= last_data[t.exchange])]


def bytes_by_direction(transfers: Iterable[Transfer]) -> dict[str, int]:
    """Bytes that crossed the link in each direction ("up", "down")."""
    totals = {"up": 0, "down": 0}
    for transfer in transfers:
        totals[transfer.direction] += transfer.size
    return totals


def ledger_line(transfer: Transfer) -> str:
    """The ledger's line for `transfer` (newline included)."""
    data = "" if transfer.data is None else f" {transfer.data}"
    return (f"{transfer.direction} {transfer.size} {transfer.entered:.6f} {transfer.left:.6f} "
            f"{transfer.exchange} {transfer.path}{data}\n")


def bytes_of_datacenter(transfers: Iterable[Transfer], datacenter: str) -> dict[str, int]:
    """Bytes that left (``up``) and reached (``down``) `datacenter` in `transfers` taken from its star ledger (directions
    ``up``/``down``) and its mesh ledgers (directions ``<from>><to>``)."""
    totals = {"up": 0, "down": 0}
    for transfer in transfers:
        if transfer.direction in totals:
            totals[transfer.direction] += transfer.size
        else:
            source = transfer.direction.split(">", 1)[0]
            totals["up" if source == datacenter else "down"] += transfer.size
    return totals
