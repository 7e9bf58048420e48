"""A datacenter's streaming replica, training continuously in its own thread while exchanges travel.

Promises: once started, the worker meets every send and merge of the run's schedule in order, training in between
without waiting for anyone; at a send it files the fragment's answer (the update, through the run's codecs, and
its metrics) for the message that asks for that exchange; at a merge it takes the server's result the merge needs,
waiting for it only if it has not arrived (that wait is the datacenter's idle time, reported with the next send).
:meth:`StreamingWorker.exchange` is what one message does: hand over the result it carries, then wait for the
answer of the exchange it asks for. A failure in the thread is reported to every later call, never swallowed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from crossdc import protocol as proto
from crossdc.clients.streaming_replica import SentUpdate, StreamingReplica

Arrays = Mapping[str, np.ndarray]


class StreamingFailed(RuntimeError):
    """The replica's thread stopped on an error (its message in one line)."""


class StreamingWorker:
    """Runs `replica` through exchanges 1..`last_exchange` (see the module docstring); `encode(sent)` turns a sent
    update into the answer a reply carries (``{"delta"|"payload", "metrics"}``)."""

    def __init__(self, replica: StreamingReplica, last_exchange: int,
                 encode: Callable[[SentUpdate], dict[str, Any]]) -> None:
        self.replica, self.last_exchange, self.encode = replica, last_exchange, encode
        self._condition = threading.Condition()
        self._results: dict[int, Arrays | None] = {}  # the server's result of an exchange, by exchange
        self._answers: dict[int, dict[str, Any]] = {}  # a send's answer, by exchange
        self._error: str | None = None
        self._idle_s = 0.0  # waited since the previous send
        self._thread = threading.Thread(target=self._run, name="streaming-replica", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self.replica.plan.schedule.events(self.last_exchange):
                sent = self.replica.meet(event, self._wait_for_result)
                if sent is not None:
                    answer = self.encode(sent)
                    answer["metrics"].update({proto.IDLE_S: self._idle_s, proto.SENT_STEP: event.step})
                    self._idle_s = 0.0
                    with self._condition:
                        self._answers[event.exchange] = answer
                        self._condition.notify_all()
        except Exception as err:  # every later call is told, in one line
            with self._condition:
                self._error = f"{type(err).__name__}: {err}".splitlines()[0]
                self._condition.notify_all()

    def _wait_for_result(self, exchange: int) -> Arrays | None:
        started = time.perf_counter()
        with self._condition:
            while exchange not in self._results:
                self._condition.wait()
            result = self._results.pop(exchange)
        self._idle_s += time.perf_counter() - started
        return result

    def exchange(self, exchange: int, update_of: int | None, update: Arrays | None, timeout_s: float) -> dict[str, Any]:
        """One message: file the server's result of exchange `update_of` (if it carries one), then wait up to
        `timeout_s` for the answer of exchange `exchange`. StreamingFailed if the thread failed, TimeoutError if
        the answer did not come in time (the answer stays filed for a retry of the same exchange)."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            if update_of is not None:
                self._results[update_of] = update
                self._condition.notify_all()
            for stale in [k for k in self._answers if k < exchange]:  # their messages gave up: never asked again
                del self._answers[stale]
            while exchange not in self._answers:
                if self._error is not None:
                    raise StreamingFailed(self._error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"exchange {exchange}: no update within {timeout_s:g}s")
                self._condition.wait(left)
            return self._answers.pop(exchange)

    @property
    def error(self) -> str | None:
        """Why the thread stopped, if it failed."""
        return self._error
