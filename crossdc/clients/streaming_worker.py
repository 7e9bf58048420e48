"""A datacenter's streaming replica, training continuously in its own thread while exchanges travel.

Promises: once started, the worker meets every send and merge of the run's schedule in order, training in between
without waiting for anyone; at a send it files the fragment's answer (the update, through the run's codecs, and
its metrics) for the message that asks for that exchange; at a merge it takes the server's result the merge needs,
waiting for it only if it has not arrived (that wait is the datacenter's idle time, reported with the next send).
:meth:`StreamingWorker.exchange` is what one message does: hand over the result it carries, then wait for the
answer of the exchange it asks for. A failure in the thread is reported to every later call, never swallowed.

Each answer also says, on the datacenter's wall clock, what the trainer did since its previous send: its spans of
compute and of waiting for a result (a wait under :data:`MIN_WAIT_SPAN_S` is no span), when it sent, and when
each server result reached it (the coordinator turns them into timeline spans).
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


#: a wait for a result shorter than this (it had arrived) is counted as compute, not as a span of its own
MIN_WAIT_SPAN_S = 1e-3


class _Cancelled(Exception):
    """The worker was told to stop (a new attempt at the run replaces it)."""


class StreamingWorker:
    """Runs `replica` through exchanges up to `last_exchange`, from where it is (see the module docstring);
    `encode(sent)` turns a sent update into the answer a reply carries (``{"delta"|"payload", "metrics"}``);
    `after_send(exchange)`, if given, runs after each send, before its answer is filed (e.g. to save the replica's
    state for a checkpoint the coordinator takes once it has that answer)."""

    def __init__(self, replica: StreamingReplica, last_exchange: int,
                 encode: Callable[[SentUpdate], dict[str, Any]],
                 after_send: Callable[[int], None] | None = None) -> None:
        self.replica, self.last_exchange, self.encode, self.after_send = replica, last_exchange, encode, after_send
        self._condition = threading.Condition()
        self._results: dict[int, Arrays | None] = {}  # the server's result of an exchange, by exchange
        self._answers: dict[int, dict[str, Any]] = {}  # a send's answer, by exchange
        self._error: str | None = None
        self._cancelled = False
        self._idle_s = 0.0  # waited since the previous send
        # since the previous send, on the wall clock: flat [start, end, ...] of compute and of waits; [exchange, at,
        # ...] of the results that reached the trainer
        self._busy_since = time.time()
        self._compute_spans: list[float] = []
        self._wait_spans: list[float] = []
        self._received: list[float] = []
        self._thread = threading.Thread(target=self._run, name="streaming-replica", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self.replica.remaining_events(self.last_exchange):
                if self._cancelled:
                    return
                sent = self.replica.meet(event, self._wait_for_result)
                if sent is not None:
                    answer = self.encode(sent)
                    if self.after_send is not None:
                        self.after_send(event.exchange)
                    now = time.time()
                    self._compute_spans += [self._busy_since, now]
                    with self._condition:
                        received, self._received = self._received, []
                    answer["metrics"].update({proto.IDLE_S: self._idle_s, proto.SENT_STEP: event.step,
                                              proto.SENT_AT: now, proto.SPANS_COMPUTE: self._compute_spans,
                                              proto.SPANS_WAIT: self._wait_spans, proto.RESULTS_RECEIVED: received})
                    self._idle_s, self._busy_since, self._compute_spans, self._wait_spans = 0.0, now, [], []
                    with self._condition:
                        self._answers[event.exchange] = answer
                        self._condition.notify_all()
        except _Cancelled:
            return
        except Exception as err:  # every later call is told, in one line
            with self._condition:
                self._error = f"{type(err).__name__}: {err}".splitlines()[0]
                self._condition.notify_all()

    def cancel(self, timeout_s: float) -> None:
        """Stop the thread at its next event (a wait for a result ends at once) and wait for it to end;
        StreamingFailed if it is still training after `timeout_s`."""
        with self._condition:
            self._cancelled = True
            self._condition.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise StreamingFailed(f"the replica's thread did not stop within {timeout_s:g}s")

    def _wait_for_result(self, exchange: int) -> Arrays | None:
        started, wall_started = time.perf_counter(), time.time()
        with self._condition:
            while exchange not in self._results:
                if self._cancelled:
                    raise _Cancelled
                self._condition.wait()
            result = self._results.pop(exchange)
        self._idle_s += time.perf_counter() - started
        wall_ended = time.time()
        if wall_ended - wall_started >= MIN_WAIT_SPAN_S:
            self._compute_spans += [self._busy_since, wall_started]
            self._wait_spans += [wall_started, wall_ended]
            self._busy_since = wall_ended
        return result

    def exchange(self, exchange: int, results: Mapping[int, Arrays | None], timeout_s: float) -> dict[str, Any]:
        """One message: file the server's results it carries (by exchange), then wait up to `timeout_s` for the
        answer of exchange `exchange`. StreamingFailed if the thread failed, TimeoutError if the answer did not come
        in time (the answer stays filed for a retry of the same exchange)."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            self._results.update(results)
            arrived = time.time()
            for k in sorted(results):
                self._received += [float(k), arrived]
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
