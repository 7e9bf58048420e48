"""Who a SuperNode is on a standing federation: the datacenter its key was enrolled as, never the name it claims.

On a standing federation the SuperLink authenticates every SuperNode by its key (``--enable-supernode-auth``), and
the key's registration gave it a node id, which enrollment recorded beside the datacenter's name (``datacenters``:
``name``, ``status``, ``node_id``; see crossdc.dashboard.enrollment). A node's hello reply says which datacenter it
claims to be; the rule here says whether that claim stands.

Promises (pure, on exact cases):

* :meth:`Enrollments.holder` is the one active datacenter enrolled for a node id, or None (no such key, or, should
  the table ever disagree with itself, several names for one id);
* :func:`judge_claim` accepts a claim only when the node's key is enrolled, active, under exactly the claimed name:
  a name a node's key is not enrolled as, a suspended or revoked name, and a node whose key is not enrolled at all
  are refused, with a one-line reason (the claim, which comes from the node, shown at most 128 characters long);
* :meth:`Enrollments.nodes_of` is the node ids the given names' keys are enrolled under (what a run waits for).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: the ``datacenters.status`` of a datacenter whose key is registered at the SuperLink
ACTIVE = "active"
#: the run log's event kind, and the audit log's action, of a claim refused
REFUSED_EVENT = "identity-refused"
CLAIM_ACTION = "claim-datacenter"
#: the longest part of a node's claim that a reason shows
SHOWN_CHARS = 128


@dataclass(frozen=True)
class Enrollment:
    """One ``datacenters`` row as identity sees it: the name, its status (active, suspended, revoked) and the node id
    Flower gave its registered key (None once unregistered, or never enrolled)."""

    name: str
    status: str
    node_id: int | None


@dataclass(frozen=True)
class Refusal:
    """A claim refused: the node, the name it claimed, the active datacenter its key is enrolled as (None: none) and
    why, in one line."""

    node_id: int
    claimed: str
    holder: str | None
    reason: str


def shown(name: str) -> str:
    """A name a node claimed, quoted for a message: at most SHOWN_CHARS characters of it, escaped."""
    return repr(name[:SHOWN_CHARS]) + ("..." if len(name) > SHOWN_CHARS else "")


@dataclass(frozen=True)
class Enrollments:
    """The enrolled datacenters of a standing federation, as they stand when read."""

    entries: tuple[Enrollment, ...]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]]) -> Enrollments:
        """From ``datacenters`` rows (``name``, ``status``, ``node_id`` as the text the table stores, or None);
        ValueError naming the datacenter if a node id is not an unsigned 64-bit integer."""
        entries = []
        for row in rows:
            text = row["node_id"]
            node_id = None
            if text is not None:
                try:
                    node_id = int(text)
                except (TypeError, ValueError):
                    node_id = -1
                if not 0 <= node_id < 2**64:
                    raise ValueError(f"datacenter {shown(str(row['name']))} has node_id {text!r}, not a Flower node id")
            entries.append(Enrollment(str(row["name"]), str(row["status"]), node_id))
        return cls(tuple(entries))

    def names_of(self, node_id: int) -> list[str]:
        """The active datacenters enrolled with `node_id`, in table order (one, unless the table disagrees with
        itself)."""
        return [e.name for e in self.entries if e.status == ACTIVE and e.node_id == node_id]

    def holder(self, node_id: int) -> str | None:
        """The active datacenter whose enrolled key has `node_id`; None if there is none, or more than one."""
        names = self.names_of(node_id)
        return names[0] if len(names) == 1 else None

    def status_of(self, name: str) -> str | None:
        """The enrolled status of `name`; None if it has no row."""
        return next((e.status for e in self.entries if e.name == name), None)

    def nodes_of(self, names: Iterable[str]) -> set[int]:
        """The node ids of the active datacenters among `names` (names not enrolled, or not active, add none)."""
        wanted = set(names)
        return {e.node_id for e in self.entries if e.name in wanted and e.status == ACTIVE and e.node_id is not None}


def judge_claim(node_id: int, claimed: str, enrollments: Enrollments) -> Refusal | None:
    """None when the node `node_id` may be datacenter `claimed` (its key is enrolled, active, as that name); else
    the refusal."""
    holder = enrollments.holder(node_id)
    if holder == claimed:
        return None
    if holder is not None:
        reason = f"it claims {shown(claimed)} but its key is enrolled as {holder!r}"
    elif len(several := enrollments.names_of(node_id)) > 1:
        reason = f"it claims {shown(claimed)} but its key is enrolled under several names ({', '.join(sorted(several))})"
    elif (status := enrollments.status_of(claimed)) not in (None, ACTIVE):
        reason = f"it claims {shown(claimed)}, which is {status}, and its key is not enrolled"
    else:
        reason = f"it claims {shown(claimed)} but its key is not enrolled as any datacenter"
    return Refusal(node_id, claimed, holder, reason)
