"""The link between a datacenter's SuperNode and the SuperLink: a TCP relay that measures what crosses it.

Every chunk of bytes that crosses the relay is recorded in the link's ledger
(a text file, one line per chunk: direction, bytes, the wall-clock time the
chunk entered the link and the time it left). The time payloads spend in
flight is therefore measured at the link, not derived from a formula. This
relay does not shape traffic (loopback speed); delay and bandwidth limits
belong to the WAN emulator built on it.

Directions are named from the datacenter's side: ``up`` is SuperNode →
SuperLink, ``down`` is SuperLink → SuperNode.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CHUNK = 64 * 1024


@dataclass(frozen=True)
class Transfer:
    """One chunk on the link."""

    direction: str  # "up" or "down"
    size: int
    entered: float  # time.time() when the chunk entered the link
    left: float  # time.time() when it was handed to the far side


class LinkRelay:
    """Listens on `listen_port`, forwards to (target_host, target_port), writes every chunk to `ledger`."""

    def __init__(self, target_host: str, target_port: int, ledger: Path, listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.listen_host, self.port = listen_host, listen_port
        self.ledger_path = ledger
        self._ledger: IO[str] | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"link-relay-{ledger.stem}", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> "LinkRelay":
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        self._ledger = open(self.ledger_path, "a", buffering=1)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            down_writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await asyncio.gather(self._pump(down_reader, up_writer, "up"), self._pump(up_reader, down_writer, "down"))
        finally:
            for writer in (up_writer, down_writer):
                writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        try:
            while True:
                chunk = await reader.read(CHUNK)
                if not chunk:
                    break
                entered = time.time()
                writer.write(chunk)
                await writer.drain()
                self._record(Transfer(direction, len(chunk), entered, time.time()))
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass

    def _record(self, transfer: Transfer) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.write(f"{transfer.direction} {transfer.size} {transfer.entered:.6f} {transfer.left:.6f}\n")

    def close(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        with self._lock:
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None


class LedgerReader:
    """Reads a link's ledger incrementally and answers: how long were payloads in flight in a time window?"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._transfers: list[Transfer] = []

    def _read_new(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as handle:
            handle.seek(self._offset)
            data = handle.read()
        complete = data[: data.rfind("\n") + 1]  # a line still being written waits for the next read
        self._offset += len(complete.encode())
        for line in complete.splitlines():
            direction, size, entered, left = line.split()
            self._transfers.append(Transfer(direction, int(size), float(entered), float(left)))

    def window(self, start: float, end: float) -> list[Transfer]:
        """Transfers that entered the link within [start, end]; older ones are forgotten."""
        self._read_new()
        selected = [t for t in self._transfers if start <= t.entered <= end]
        self._transfers = [t for t in self._transfers if t.entered > end]
        return selected


def time_in_flight(transfers: Iterable[Transfer]) -> float:
    """Length of the union of the transfers' [entered, left] intervals: the time the link carried payload."""
    total, current_start, current_end = 0.0, None, None
    for transfer in sorted(transfers, key=lambda t: t.entered):
        if current_end is None or transfer.entered > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = transfer.entered, transfer.left
        else:
            current_end = max(current_end, transfer.left)
    if current_start is not None and current_end is not None:
        total += current_end - current_start
    return total
