"""A datacenter's gossip replica, training and exchanging round after round in its own thread, with no coordinator.

Promises: once started, the agent runs every remaining gossip round of the run — τ inner steps, this round's
exchanges with its neighbours over the datacenter-to-datacenter transport (one thread per neighbour, each bounded by
the strategy's ``exchange_timeout_s``), the mix and the outer step — without asking anyone; the coordinator only
observes. After each round it files a **report** (compute and idle seconds, training loss, examples, per
neighbour the bytes each way, the seconds in flight and why nothing came when nothing did, and a CountSketch of its
outer weights right after the mix, :func:`crossdc.strategies.mixing.count_sketch`, from which the coordinator
estimates the replicas' distances to their average) and, on the rounds `observe(round)` names, a **snapshot** of
those weights; `save(round, state)`
(if given) keeps the replica's state with the reports not yet acknowledged, so a restarted trainer goes on from there;
`publish(round, weights)` (if given) offers the replica after each round to datacenters that rejoin. An agent given
`rejoin` (a restarted datacenter's) first asks it for a newer replica — (round, weights, whose) from a neighbour, or
None — and, if one comes, adopts it (:meth:`GossipReplica.adopt`) and goes on from the round after it; its next
report says so (``rejoined``: the round it had, the round it took, from whom), and the rounds in between have no
report from it. A round in which no exchange worked (every neighbour of the round cut off or gone) still takes as
long as the recent rounds that met when none of its neighbours could be reached at all (their median idle time, at
most the exchange timeout): the replica keeps
training, in step with the others, so that when its links return its neighbours are at its round (a replica that
ran ahead would wait for them and mix with nobody meanwhile).
:meth:`GossipAgent.reports` hands over what the coordinator has not acknowledged and forgets what it has: a coordinator
away for a while catches up on everything when it comes back. A failure in the thread is reported to every later
call, never swallowed.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crossdc.clients.gossip_replica import GossipMessage, GossipReplica
from crossdc.clients.gossip_transport import Exchanged
from crossdc.strategies.mixing import count_sketch

Arrays = Mapping[str, np.ndarray]
#: exchange(round, peers, message_for(peer, holds), held_of(peer)) → what each peer exchange gave
Exchange = Callable[[int, list[int], Callable[[int, int], GossipMessage | None], Callable[[int], int]], dict[int, Exchanged]]


#: how many of the last rounds that met set the pace of a round that met nobody
PACE_WINDOW = 5


class GossipFailed(RuntimeError):
    """The agent's thread stopped on an error (its message in one line)."""


@dataclass
class RoundReport:
    """What one datacenter did in one gossip round (see the module docstring); `links` by neighbour index."""

    server_round: int
    compute_s: float
    idle_s: float
    train_loss: float
    num_examples: int
    links: dict[int, dict[str, Any]] = field(default_factory=dict)
    sketch: list[float] = field(default_factory=list)
    rejoined: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.server_round, "compute_s": self.compute_s, "idle_s": self.idle_s,
                "train_loss": self.train_loss, "num_examples": self.num_examples,
                "links": {str(k): v for k, v in self.links.items()}, "sketch": list(self.sketch),
                "rejoined": self.rejoined}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundReport:
        return cls(int(data["round"]), float(data["compute_s"]), float(data["idle_s"]), float(data["train_loss"]),
                   int(data["num_examples"]), {int(k): dict(v) for k, v in data["links"].items()},
                   [float(x) for x in data.get("sketch", [])], data.get("rejoined"))


class GossipAgent:
    """Runs `replica` from its round to `rounds` (see the module docstring), exchanging through `exchange`."""

    def __init__(self, replica: GossipReplica, rounds: int, exchange: Exchange, *,
                 observe: Callable[[int], bool] = lambda server_round: True,
                 save: Callable[[int, dict[str, Any]], None] | None = None,
                 pending: list[RoundReport] | None = None, snapshots: dict[int, dict[str, np.ndarray]] | None = None,
                 publish: Callable[[int, Arrays], None] | None = None,
                 rejoin: Callable[[int], tuple[int, Arrays, str] | None] | None = None) -> None:
        self.replica, self.rounds, self._exchange, self.observe, self.save = replica, rounds, exchange, observe, save
        self.publish, self.rejoin = publish, rejoin
        #: the CountSketch's seed: the run's, the same on every datacenter
        self.sketch_seed = replica.strategy.run.seed if replica.strategy.run is not None else 0
        self._condition = threading.Condition()
        self._reports: list[RoundReport] = list(pending or [])
        self._snapshots: dict[int, dict[str, np.ndarray]] = dict(snapshots or {})
        self._error: str | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="gossip-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        replica = self.replica
        strategy = replica.strategy
        tau = strategy.tau(1)
        met_idle: deque[float] = deque(maxlen=PACE_WINDOW)  # the idle seconds of the last rounds that met someone
        try:
            rejoined = self._rejoin()
            for server_round in range(replica.server_round + 1, self.rounds + 1):
                if self._cancelled:
                    return
                steps = replica.train(tau)
                graph = strategy.round_graph(server_round)
                receivers = set(graph.receivers_of(replica.index))
                peers = sorted(receivers | set(graph.senders_to(replica.index)))
                waited_from = time.perf_counter()

                def message_for(peer: int, holds: int, receivers: set[int] = receivers) -> GossipMessage | None:
                    return replica.message_for(holds) if peer in receivers else None

                exchanged = self._exchange(server_round, peers, message_for, replica.held_version)
                if any(e.message is not None for e in exchanged.values()):
                    met_idle.append(time.perf_counter() - waited_from)
                elif met_idle and exchanged and all(e.unreachable for e in exchanged.values()):
                    # cut off from this round's every neighbour: keep in step with the rounds that met
                    timeout_s = float(strategy.params["exchange_timeout_s"])
                    self._pause(waited_from + min(statistics.median(met_idle), timeout_s))
                idle_s = time.perf_counter() - waited_from
                mixed = replica.mix_in([e.message for e in exchanged.values() if e.message is not None])
                report = RoundReport(server_round, steps.compute_s, idle_s, steps.mean_loss, steps.num_examples, {
                    peer: {"bytes_sent": e.bytes_sent, "bytes_received": e.bytes_received,
                           "in_flight_s": e.in_flight_s, "used": peer in mixed.used,
                           "error": e.error or mixed.missing.get(peer)}
                    for peer, e in exchanged.items()}, [float(f"{x:.6g}") for x in count_sketch(replica.outer, self.sketch_seed)],
                    rejoined)
                rejoined = None
                if self.publish is not None:
                    self.publish(server_round, replica.outer)
                with self._condition:
                    self._reports.append(report)
                    if self.observe(server_round):
                        self._snapshots[server_round] = {n: v.copy() for n, v in replica.outer.items()}
                    if self.save is not None:
                        self.save(server_round, self._saved_state())
                    self._condition.notify_all()
        except Exception as err:  # noqa: BLE001 - reported to every later call
            with self._condition:
                self._error = f"{type(err).__name__}: {err}".splitlines()[0]
                self._condition.notify_all()

    def _pause(self, until: float) -> None:
        """Wait until `until` (perf_counter), or until the agent is cancelled."""
        while not self._cancelled and time.perf_counter() < until:
            time.sleep(min(0.2, max(0.0, until - time.perf_counter())))

    def _rejoin(self) -> dict[str, Any] | None:
        """Adopt a neighbour's newer replica if `rejoin` finds one (see the module docstring); what was done."""
        if self.rejoin is None:
            return None
        had = self.replica.server_round
        found = self.rejoin(had)
        if found is None or found[0] <= had:
            return None
        server_round, weights, source = found
        self.replica.adopt(min(server_round, self.rounds), weights)
        return {"from_round": had, "at_round": self.replica.server_round, "source": source}

    def _saved_state(self) -> dict[str, Any]:
        return {"replica": self.replica.state_dict(), "reports": [r.to_dict() for r in self._reports],
                "snapshots": dict(self._snapshots)}

    def reports(self, acknowledged: int, wait_s: float, received: int | None = None,
                ) -> tuple[list[RoundReport], dict[int, dict[str, np.ndarray]], bool]:
        """(reports of rounds after `received`, snapshots of those rounds, whether the run's last round is done):
        waits up to `wait_s` for a round after `received` (default: `acknowledged`) if none is filed yet; forgets
        everything up to `acknowledged` (the coordinator has it in its run log). GossipFailed if the thread stopped on
        an error."""
        received = max(acknowledged, acknowledged if received is None else received)
        deadline = time.monotonic() + wait_s
        with self._condition:
            self._reports = [r for r in self._reports if r.server_round > acknowledged]
            self._snapshots = {r: s for r, s in self._snapshots.items() if r > acknowledged}
            while (not any(r.server_round > received for r in self._reports) and self._error is None
                   and self._thread.is_alive()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._condition.wait(left)
            if self._error is not None:
                raise GossipFailed(self._error)
            return ([r for r in self._reports if r.server_round > received],
                    {r: s for r, s in self._snapshots.items() if r > received}, not self._thread.is_alive())

    def final(self, timeout_s: float) -> dict[str, np.ndarray]:
        """The replica's outer weights after the run's last round (waiting up to `timeout_s` for it)."""
        self._thread.join(timeout_s)
        if self._error is not None:
            raise GossipFailed(self._error)
        if self._thread.is_alive():
            raise TimeoutError(f"the replica is at round {self.replica.server_round} of {self.rounds}")
        return {n: v.copy() for n, v in self.replica.outer.items()}

    def cancel(self, timeout_s: float) -> None:
        """Stop after the current round (a new attempt replaces this one)."""
        self._cancelled = True
        self._thread.join(timeout_s)
