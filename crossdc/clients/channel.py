"""The local channel between the short-lived ClientApp and the datacenter's persistent trainer.

A Unix socket with an authentication key (multiprocessing.connection): only a
process that can read the run's key file can hand work to the trainer.
Numpy only on this side, so a ClientApp never imports torch.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

#: accept() errors that mean the listening socket itself is gone (not one client's failed handshake)
_LISTENER_GONE = {errno.EBADF, errno.EINVAL, errno.ENOTSOCK}


class TrainerUnavailable(RuntimeError):
    """The datacenter's trainer did not answer on its socket."""


class TrainerFailed(RuntimeError):
    """The trainer answered with an error for this request."""


def call_trainer(socket_path: str | Path, authkey: bytes, request: dict[str, Any], connect_timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request, wait for its answer; raise TrainerUnavailable / TrainerFailed."""
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            connection = Client(str(socket_path), family="AF_UNIX", authkey=authkey)
            break
        except (FileNotFoundError, ConnectionRefusedError) as err:
            if time.monotonic() >= deadline:
                raise TrainerUnavailable(f"no trainer listening on {socket_path}: {err}") from err
            time.sleep(0.1)
    with connection:
        connection.send(request)
        try:
            answer = connection.recv()
        except EOFError as err:
            raise TrainerUnavailable(f"trainer on {socket_path} closed the connection mid-request") from err
    if not answer.get("ok"):
        raise TrainerFailed(str(answer.get("error", "unknown trainer error")))
    return answer


def serve_requests(listener: Listener, handle: Callable[[dict[str, Any]], dict[str, Any]], log: logging.Logger) -> None:
    """Answer one request per connection with ``handle(request)`` until the listener is closed.

    A client that fails authentication or goes away is logged and the service goes on; an exception from `handle`
    becomes ``{"ok": False, "error": "one line"}`` for that client (and a logged traceback)."""
    while True:
        try:
            connection = listener.accept()
        except Exception as err:
            # Listener.close() (the service stopping) leaves no socket to accept on; any other failure is one client's
            # handshake (a wrong key, a malformed or oversized frame, a client that hung up: AuthenticationError, EOFError,
            # OSError "bad message length", BrokenPipeError...): that client is refused and the service goes on
            if listener._listener is None or (isinstance(err, OSError) and err.errno in _LISTENER_GONE):
                return
            log.warning("rejected a connection: %s", err)
            continue
        with connection:
            try:
                answer = handle(connection.recv())
            except Exception as err:
                log.exception("request failed")
                answer = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0]}
            try:
                connection.send(answer)
            except OSError as err:
                log.warning("could not answer (client gone): %s", err)
