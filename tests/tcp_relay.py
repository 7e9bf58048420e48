"""A TCP relay for tests: put it between a client and a server, then cut and restore the link.

    relay = TcpRelay("127.0.0.1", 5432).start()
    url = f"postgresql://postgres@127.0.0.1:{relay.port}/db"
    relay.cut()        # listener closed (connects are refused) and open connections reset
    relay.restore()    # listens again on the same port
    relay.close()

Runs an asyncio loop in a daemon thread; every method is synchronous and thread-safe.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Any


class TcpRelay:
    def __init__(self, target_host: str, target_port: int, *, listen_host: str = "127.0.0.1", port: int = 0):
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.port = port
        self.connections_accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-relay", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # ------------------------------------------------------------ control

    def start(self) -> TcpRelay:
        self._thread.start()
        self._call(self._listen())
        return self

    @property
    def up(self) -> bool:
        return self._server is not None

    def cut(self) -> None:
        """Stop listening (new connections are refused) and reset every open connection."""
        self._call(self._cut())

    def restore(self) -> None:
        """Listen again on the same port."""
        if self._server is None:
            self._call(self._listen())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._cut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> TcpRelay:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------- internals

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.listen_host, self.port))
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._handle, sock=sock)

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()
        await asyncio.sleep(0)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self._server is None:
            _reset(client_w)
            return
        self.connections_accepted += 1
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            _reset(client_w)
            return
        self._writers.update((client_w, server_w))
        try:
            await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))
        finally:
            for w in (client_w, server_w):
                self._writers.discard(w)
                _reset(w)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close abruptly (RST, like a dropped link), not with a polite FIN."""
    transport = writer.transport
    if transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
