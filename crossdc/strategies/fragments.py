"""The maths of streaming outer sync, as pure functions: fragments of a model, their sync schedule, the merge.

Streaming DiLoCo (Douillard et al., 2025) syncs a model not all at once but in P **fragments**, each at its own
offset within a round of H inner steps, and overlaps each fragment's exchange with the next τ_o inner steps.

- **Tensor groups.** A tensor belongs to its layer: ``blocks.3.linear1.weight`` to ``blocks.3`` (a numbered layer
  of the container ``blocks``), ``head.weight`` to ``head`` (:func:`tensor_group`).
- **Fragments** (:func:`split_fragments`). With at least P numbered layers, layer i goes to fragment i mod P
  (the paper's strided pattern: each fragment spans the depth of the model); the other groups (embeddings, final
  norm, head), largest first, each go to the fragment with the fewest bytes so far. With fewer numbered layers
  than P, every group is placed that way. A fragment left empty is an error: more fragments than tensor groups.
- **Schedule** (:class:`FragmentSchedule`). Round r (1-based) covers inner steps ((r−1)·H, r·H]. Fragment p
  (0-based) is synced at step s = (r−1)·H + t_p with t_p = (p+1)·H/P: its pseudo-gradient is taken after that
  step, and its merged update is applied after step s + τ_o. Every fragment is synced exactly once per round;
  exchange k = (r−1)·P + p + 1 is the k-th sync of the run. τ_o ≤ H/P keeps at most one exchange per fragment in
  flight (fragment p's next sync comes H steps later).
- **Merge** (:func:`mix`): after the outer step gives the fragment's new global values θ_g, the local fragment
  (as it is after the τ_o further steps) becomes (1 − α)·θ_g + α·θ_local; the next pseudo-gradient is taken
  against θ_g (as torchft does). α = 0: the global values replace the local ones.
- **Eager outer gradient** (:func:`eager_outer_gradient`, Kale et al., 2025): a datacenter whose merge cannot
  wait for this sync's average uses ḡ_prev + w·(g_own − g_own_prev) in its place: the previous sync's average
  of the fragment with the datacenter's own share of it (weight w) replaced by its fresh pseudo-gradient. Each
  datacenter then runs its own copy of the outer optimizer; every datacenter's pseudo-gradient still enters the
  outer steps exactly once with its weight (its own share one sync early, the others' one sync late).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Arrays = Mapping[str, np.ndarray]

_NUMBERED_LAYER = re.compile(r"^(?P<container>[^.]+)\.(?P<index>\d+)(\.|$)")


class FragmentError(ValueError):
    """A fragment split or schedule that cannot be built (with the reason, in one line)."""


def tensor_group(name: str) -> str:
    """The layer a tensor belongs to: ``container.N`` for a numbered layer, else the name's first component."""
    match = _NUMBERED_LAYER.match(name)
    if match:
        return f"{match['container']}.{match['index']}"
    return name.split(".", 1)[0]


def _layer_index(group: str) -> int | None:
    match = _NUMBERED_LAYER.match(group)
    return int(match["index"]) if match else None


def split_fragments(sizes: Mapping[str, int], fragments: int) -> list[tuple[str, ...]]:
    """The model's tensors (name → bytes, in the model's order) as `fragments` disjoint tuples of names that
    together hold every tensor once (see the module docstring for the rule). FragmentError for P < 1 or more
    fragments than tensor groups."""
    if fragments < 1:
        raise FragmentError(f"fragments must be ≥ 1, got {fragments}")
    groups: dict[str, list[str]] = {}
    for name in sizes:
        groups.setdefault(tensor_group(name), []).append(name)
    if fragments > len(groups):
        raise FragmentError(f"{fragments} fragments but the model has only {len(groups)} tensor groups "
                            f"({', '.join(groups)}): use at most {len(groups)}")
    group_bytes = {group: sum(sizes[n] for n in names) for group, names in groups.items()}
    layers = [g for g in groups if _layer_index(g) is not None]
    members: list[list[str]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    rest = list(groups)
    if len(layers) >= fragments:  # strided: layer i → fragment i mod P
        for position, group in enumerate(sorted(layers, key=lambda g: (g.split(".")[0], _layer_index(g)))):
            members[position % fragments].append(group)
            load[position % fragments] += group_bytes[group]
        rest = [g for g in groups if g not in layers]
    for group in sorted(rest, key=lambda g: -group_bytes[g]):  # largest first, to the lightest fragment
        lightest = min(range(fragments), key=lambda p: (load[p], p))
        members[lightest].append(group)
        load[lightest] += group_bytes[group]
    if any(not m for m in members):
        raise FragmentError(f"{fragments} fragments leave one empty: use fewer")
    chosen = [set(m) for m in members]
    return [tuple(name for name in sizes if tensor_group(name) in chosen[p]) for p in range(fragments)]


@dataclass(frozen=True)
class Event:
    """One step of a datacenter's streaming schedule: after inner step `step`, `kind` (``send``: take the
    pseudo-gradient of exchange `exchange`; ``merge``: apply that exchange's outer update) for `fragment`."""

    step: int
    kind: str
    exchange: int
    fragment: int
    round: int


SEND, MERGE = "send", "merge"


@dataclass(frozen=True)
class FragmentSchedule:
    """When each fragment is synced and merged (see the module docstring): H inner steps a round, P fragments, an
    overlap of τ_o inner steps. FragmentError for H not a multiple of P or τ_o outside [0, H/P]."""

    steps_per_round: int
    fragments: int
    overlap: int = 0

    def __post_init__(self) -> None:
        h, p = self.steps_per_round, self.fragments
        if p < 1 or h < 1:
            raise FragmentError(f"a round needs H ≥ 1 inner steps and P ≥ 1 fragments, got H={h}, P={p}")
        if h % p:
            raise FragmentError(f"the inner steps per round (tau = {h}) must be a multiple of the fragments ({p})")
        if not 0 <= self.overlap <= h // p:
            raise FragmentError(f"overlap {self.overlap} must be within [0, H/P = {h // p}] (H = {h} inner steps, "
                                f"P = {p} fragments): at most one exchange per fragment in flight")

    @property
    def spacing(self) -> int:
        """H/P: inner steps between two consecutive syncs."""
        return self.steps_per_round // self.fragments

    def offset(self, fragment: int) -> int:
        """t_p: the step within a round after which fragment p is synced."""
        return (fragment + 1) * self.spacing

    def exchange(self, server_round: int, fragment: int) -> int:
        """k: the 1-based index of fragment p's sync of round r among all syncs of the run."""
        return (server_round - 1) * self.fragments + fragment + 1

    def locate(self, exchange: int) -> tuple[int, int]:
        """(round, fragment) of exchange k."""
        if exchange < 1:
            raise FragmentError(f"exchanges are numbered from 1, got {exchange}")
        return (exchange - 1) // self.fragments + 1, (exchange - 1) % self.fragments

    def send_step(self, exchange: int) -> int:
        """s_k: the inner step after which exchange k's pseudo-gradient is taken."""
        server_round, fragment = self.locate(exchange)
        return (server_round - 1) * self.steps_per_round + self.offset(fragment)

    def merge_step(self, exchange: int) -> int:
        """s_k + τ_o: the inner step after which exchange k's outer update is merged."""
        return self.send_step(exchange) + self.overlap

    def events(self, last_exchange: int, first_exchange: int = 1) -> Iterator[Event]:
        """Every send and merge of exchanges first..last in the order a datacenter meets them: by step; at one step
        by exchange, a send before the merge of the same exchange (τ_o = 0) and after the merge of an earlier one
        (τ_o = H/P: the merged fragment's progress is not sent again)."""
        items = []
        for k in range(first_exchange, last_exchange + 1):
            server_round, fragment = self.locate(k)
            items.append(Event(self.send_step(k), SEND, k, fragment, server_round))
            items.append(Event(self.merge_step(k), MERGE, k, fragment, server_round))
        yield from sorted(items, key=_order)

    def events_after_send(self, last_exchange: int, sent: int) -> Iterator[Event]:
        """The events of exchanges up to `last_exchange` a datacenter still meets once it has sent exchange `sent`
        (0: every event), in :meth:`events`' order: where a replica restored from its state after that send goes on."""
        if sent < 1:
            yield from self.events(last_exchange)
            return
        server_round, fragment = self.locate(sent)
        position = _order(Event(self.send_step(sent), SEND, sent, fragment, server_round))
        first = max(1, sent - self.fragments)  # a merge of an earlier exchange may follow, τ_o ≤ H/P steps later
        yield from (event for event in self.events(last_exchange, first) if _order(event) > position)

    def results_needed_after(self, sent: int, eager: bool) -> list[int]:
        """The exchanges (≤ `sent`) whose server results a datacenter still needs once it has sent exchange `sent`:
        its own (eager off; merged τ_o steps later), or the P + 1 latest (eager on: a merge uses the result of the
        fragment's previous exchange)."""
        if sent < 1:
            return []
        return list(range(max(1, sent - self.fragments), sent + 1)) if eager else [sent]


def _order(event: Event) -> tuple[int, float]:
    """Where an event falls in a datacenter's sequence: by step; at one step, by exchange, a send before the merge of
    the same exchange and after the merge of an earlier one."""
    return event.step, event.exchange - 0.5 if event.kind == SEND else float(event.exchange)


def mix(global_values: Arrays, local_values: Arrays, alpha: float) -> dict[str, np.ndarray]:
    """(1 − α)·θ_g + α·θ_local per tensor, float32; α = 0 gives θ_g exactly, α = 1 θ_local exactly."""
    if not 0.0 <= alpha <= 1.0:
        raise FragmentError(f"alpha must be within [0, 1], got {alpha}")
    if alpha == 0.0:
        return {n: np.asarray(v, np.float32).copy() for n, v in global_values.items()}
    if alpha == 1.0:
        return {n: np.asarray(local_values[n], np.float32).copy() for n in global_values}
    a = np.float32(alpha)
    return {n: ((np.float32(1) - a) * np.asarray(v, np.float32) + a * np.asarray(local_values[n], np.float32)
                ).astype(np.float32) for n, v in global_values.items()}


def eager_outer_gradient(previous_mean: Arrays | None, own: Arrays, own_previous: Arrays | None,
                         weight: float) -> dict[str, np.ndarray]:
    """The eager stand-in for this sync's averaged pseudo-gradient: ḡ_prev + w·(g_own − g_own_prev), float32.
    Before a fragment's first average has arrived (`previous_mean`, `own_previous` None) it is w·g_own."""
    w = np.float32(weight)
    result = {}
    for name, value in own.items():
        g = np.asarray(value, np.float32)
        if previous_mean is None or own_previous is None:
            result[name] = (w * g).astype(np.float32)
        else:
            result[name] = (np.asarray(previous_mean[name], np.float32)
                            + w * (g - np.asarray(own_previous[name], np.float32))).astype(np.float32)
    return result


def fragment_of(arrays: Arrays, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The tensors of one fragment (a view of `arrays`, by the fragment's names)."""
    return {name: arrays[name] for name in names}
