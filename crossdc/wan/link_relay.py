"""The WAN link between a datacenter's SuperNode and the SuperLink: a user-space TCP relay that emulates
the link's latency and bandwidth, injects faults on demand, and measures what crosses it.

Emulation (per direction, shared by every connection of the link, as on a real link):
- **bandwidth**: the link sends one chunk at a time; a chunk of s bytes occupies it for
  s·8 / bandwidth seconds (a pacing model: start = max(arrival, link free), free = start + s·8/bw);
- **latency**: each chunk is delivered RTT/2 (+ a uniform jitter in [0, jitter]) after it has been
  sent, never before an earlier chunk (FIFO);
- **buffering**: at most about two bandwidth-delay products are queued; beyond that the relay stops
  reading, and TCP's flow control pushes back on the sender, as a real bottleneck would.
Faults: :meth:`LinkRelay.cut` closes the link for N seconds (new connections are refused, open ones
are reset); :meth:`LinkRelay.reset_connections` resets the open connections only.

Measurement: every chunk is written to the link's ledger (one line: direction, bytes, the wall-clock
time it entered the relay and the time it was handed to the far side), so the time payloads spend
in flight is measured at the link, not derived from a formula. Directions are named from the
datacenter's side: ``up`` is SuperNode → SuperLink, ``down`` is SuperLink → SuperNode.

Without a :class:`~crossdc.experiment.links.LinkSpec` the relay forwards at loopback speed and only measures.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import IO, Any

from crossdc.experiment.links import LinkSpec
from crossdc.wan.ledger import ExchangeTracker, Transfer, ledger_line, pace

CHUNK = 64 * 1024
SHAPED_CHUNK = 16 * 1024  # smaller chunks pace a slow link more smoothly
MIN_QUEUE_CHUNKS = 8


class LinkRelay:
    """Listens on `listen_port`, forwards to (target_host, target_port) through the emulated `link`, writes every chunk to `ledger`."""

    def __init__(self, target_host: str, target_port: int, ledger: Path, link: LinkSpec | None = None,
                 listen_host: str = "127.0.0.1", listen_port: int = 0, seed: int = 0) -> None:
        self.target = (target_host, target_port)
        self.listen_host, self.port = listen_host, listen_port
        self.link = link
        self.ledger_path = ledger
        self._ledger: IO[str] | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"link-relay-{ledger.stem}", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._link_free_at = {"up": 0.0, "down": 0.0}
        self._last_delivery = {"up": 0.0, "down": 0.0}
        self._random = random.Random(seed)
        self._cut_until = 0.0
        self._connections = 0
        self._restore: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> LinkRelay:
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        self._ledger = open(self.ledger_path, "a", buffering=1)
        self._thread.start()
        self._call(self._listen())
        return self

    @property
    def is_cut(self) -> bool:
        return time.time() < self._cut_until

    def cut(self, seconds: float) -> None:
        """Cut the link for `seconds`: refuse new connections and reset the open ones; it comes back by itself."""
        self._cut_until = time.time() + seconds
        self._call(self._cut(seconds))

    def reset_connections(self) -> None:
        """Reset every open connection (the peers see a connection reset); new connections are accepted."""
        self._call(self._abort_all())

    def close(self) -> None:
        async def shutdown() -> None:
            if self._restore is not None:
                self._restore.cancel()
            if self._server is not None:
                self._server.close()
            await self._abort_all()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        if self._thread.is_alive():
            self._call(shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        with self._lock:
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None

    def _call(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` on the relay's loop and wait for it."""
        asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    # ---------------------------------------------------------------- internals
    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _cut(self, seconds: float) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        await self._abort_all()
        if self._restore is not None:
            self._restore.cancel()
        self._restore = self._loop.call_later(seconds, lambda: asyncio.ensure_future(self._listen()))

    async def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            down_writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            down_writer.transport.abort()
            return
        self._writers.update((down_writer, up_writer))
        self._connections += 1
        tracker = ExchangeTracker(self._connections)
        try:
            await asyncio.gather(self._pump(down_reader, up_writer, "up", tracker), self._pump(up_reader, down_writer, "down", tracker),
                                 return_exceptions=True)
        finally:
            for writer in (up_writer, down_writer):
                self._writers.discard(writer)
                if self.is_cut:
                    writer.transport.abort()
                else:
                    writer.close()

    def _queue_size(self) -> int:
        if self.link is None:
            return MIN_QUEUE_CHUNKS
        bdp = self.link.bandwidth_mbps * 1e6 / 8 * max(self.link.rtt_ms, 1.0) / 1000
        return max(MIN_QUEUE_CHUNKS, int(2 * bdp / SHAPED_CHUNK))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str, tracker: ExchangeTracker) -> None:
        queue: asyncio.Queue[tuple[bytes, float, float, str, str] | None] = asyncio.Queue(self._queue_size())
        chunk_size = CHUNK if self.link is None else SHAPED_CHUNK

        async def receive() -> None:
            try:
                while True:
                    chunk = await reader.read(chunk_size)
                    if not chunk:
                        break
                    arrived = time.time()
                    if direction == "up":
                        tracker.on_up(chunk)
                    deliver = arrived
                    if self.link is not None:
                        jitter = self._random.uniform(0.0, self.link.jitter_ms / 1000.0) if self.link.jitter_ms else 0.0
                        self._link_free_at[direction], deliver = pace(
                            arrived, len(chunk), self._link_free_at[direction], self._last_delivery[direction],
                            self.link.bandwidth_mbps * 1e6, self.link.rtt_ms / 2000.0, jitter)
                        self._last_delivery[direction] = deliver
                    await queue.put((chunk, arrived, deliver, tracker.exchange, tracker.path))
            finally:
                await queue.put(None)

        async def send() -> None:
            while (item := await queue.get()) is not None:
                chunk, arrived, deliver, exchange, path = item
                wait = deliver - time.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
                self._record(Transfer(direction, len(chunk), arrived, time.time(), exchange, path))
            try:
                writer.write_eof()
            except (OSError, RuntimeError):
                pass

        try:
            await asyncio.gather(receive(), send())
        except (ConnectionError, OSError):
            writer.transport.abort()

    def _record(self, transfer: Transfer) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.write(ledger_line(transfer))


