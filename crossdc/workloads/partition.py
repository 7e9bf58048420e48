"""Partitioners: split a training set's item indices among datacenters.

Pure numpy (importing this module never imports torch). Every function returns
one ``np.ndarray`` of int64 item indices per part, each sorted ascending; the
parts are pairwise disjoint and together cover every item exactly once.
Randomness comes only from the ``numpy.random.Generator`` passed in, so a
partition is reproducible from the generator's seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crossdc.workloads.errors import WorkloadError

__all__ = [
    "DEFAULT_MIN_SIZE",
    "DEFAULT_MAX_TRIES",
    "iid_partition",
    "dirichlet_partition",
    "natural_partition",
]

#: Default least number of items a Dirichlet part must get (as in FedLab's
#: ``min_require_size``): a datacenter with a handful of items cannot fill a batch.
DEFAULT_MIN_SIZE = 10
#: Default number of Dirichlet draws tried before giving up.
DEFAULT_MAX_TRIES = 1000


def _check_n_parts(n_parts: int) -> None:
    if isinstance(n_parts, bool) or not isinstance(n_parts, (int, np.integer)) or n_parts < 1:
        raise WorkloadError(f"number of parts must be a positive integer, got {n_parts!r}")


def iid_partition(n_items: int, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(n_items)`` with ``rng`` and deal it into ``n_parts`` parts.

    Part sizes differ by at most one (the first ``n_items % n_parts`` parts get
    the extra item). Raises WorkloadError if there are fewer items than parts,
    since a part would be empty.
    """
    _check_n_parts(n_parts)
    if n_items < n_parts:
        raise WorkloadError(f"iid partition: {n_items} items cannot fill {n_parts} parts (every part needs at least one)")
    perm = rng.permutation(n_items).astype(np.int64)
    return [np.sort(part) for part in np.array_split(perm, n_parts)]


def dirichlet_partition(
    labels: Sequence[int] | np.ndarray,
    n_parts: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = DEFAULT_MIN_SIZE,
    max_tries: int = DEFAULT_MAX_TRIES,
) -> list[np.ndarray]:
    """Label-skewed split: for each class, its items go to the parts in proportions drawn from Dir(alpha).

    For every class ``c`` (in sorted order) the items of ``c`` are shuffled and
    cut at the cumulative proportions of one draw ``p ~ Dirichlet(alpha * 1)``.
    Small ``alpha`` (e.g. 0.05) gives each part few dominant classes; large
    ``alpha`` (e.g. 100) approaches an IID split. If any part ends with fewer
    than ``min_size`` items the whole draw is repeated, at most ``max_tries``
    times; then WorkloadError.
    """
    _check_n_parts(n_parts)
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise WorkloadError(f"dirichlet partition: labels must be one-dimensional, got shape {labels.shape}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.floating, np.integer)) or not np.isfinite(alpha) or alpha <= 0:
        raise WorkloadError(f"dirichlet partition: alpha must be a finite number > 0, got {alpha!r}")
    if min_size < 0 or max_tries < 1:
        raise WorkloadError(f"dirichlet partition: need min_size >= 0 and max_tries >= 1, got {min_size}, {max_tries}")
    n_items = len(labels)
    if n_items < n_parts * max(min_size, 1):
        raise WorkloadError(
            f"dirichlet partition: {n_items} items cannot give {n_parts} parts at least {max(min_size, 1)} items each"
        )
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c).astype(np.int64) for c in classes]
    concentration = np.full(n_parts, float(alpha))
    for _ in range(max_tries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
        for members in by_class:
            shuffled = rng.permutation(members)
            proportions = rng.dirichlet(concentration)
            if not np.all(np.isfinite(proportions)):  # underflow at tiny alpha: redraw
                break
            cuts = (np.cumsum(proportions)[:-1] * len(shuffled)).astype(np.int64)
            for part, piece in zip(chunks, np.split(shuffled, cuts), strict=True):
                part.append(piece)
        else:
            parts = [np.sort(np.concatenate(part)) for part in chunks]
            if min(len(p) for p in parts) >= max(min_size, 1):
                return parts
    raise WorkloadError(
        f"dirichlet partition: no draw in {max_tries} tries gave each of {n_parts} parts at least "
        f"{max(min_size, 1)} items (alpha={alpha}, {len(classes)} classes, {n_items} items); "
        "use a larger alpha or fewer datacenters"
    )


def natural_partition(group_of_item: Sequence[str] | np.ndarray, n_parts: int) -> list[np.ndarray]:
    """Assign whole groups (e.g. the plays of Shakespeare) to parts; a group is never split.

    Groups are placed largest first (ties: by group name), each into the part
    with the fewest items so far (ties: lowest part index) -- greedy
    balancing. Deterministic: no randomness, depends only on the group sizes
    and names. Raises WorkloadError when there are more parts than groups.
    """
    _check_n_parts(n_parts)
    groups = np.asarray(group_of_item)
    if groups.ndim != 1:
        raise WorkloadError(f"natural partition: group_of_item must be one-dimensional, got shape {groups.shape}")
    names, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    if n_parts > len(names):
        raise WorkloadError(
            f"natural partition: {n_parts} parts but only {len(names)} groups (each part needs a whole group)"
        )
    order = sorted(range(len(names)), key=lambda g: (-int(counts[g]), str(names[g])))
    loads = np.zeros(n_parts, dtype=np.int64)
    part_of_group = np.empty(len(names), dtype=np.int64)
    for g in order:
        j = int(np.argmin(loads))  # argmin returns the first minimum: lowest index wins ties
        part_of_group[g] = j
        loads[j] += counts[g]
    part_of_item = part_of_group[inverse.reshape(-1)]
    return [np.flatnonzero(part_of_item == j).astype(np.int64) for j in range(n_parts)]
