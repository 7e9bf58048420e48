"""An ASGI app served by uvicorn in a background thread of this process (the demo's dashboard, the Fleet API front, tests)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn


@dataclass
class BackgroundServer:
    """A running server; `url` is where it answers."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to finish its requests and stop; wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)


def start_background(config: uvicorn.Config, name: str, ready_timeout_s: float = 15.0) -> BackgroundServer:
    """Start serving `config` in a daemon thread; returns once it accepts connections (RuntimeError if it cannot)."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"{name} did not start on {config.host}:{config.port}")
        time.sleep(0.05)
    scheme = "https" if config.ssl_certfile else "http"
    return BackgroundServer(server, thread, f"{scheme}://{config.host}:{config.port}")


def uvicorn_config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """Quiet uvicorn settings for a crossdc service (no access log, warnings only)."""
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, **kwargs)
