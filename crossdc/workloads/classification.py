"""Shared base for the small in-memory classification workloads (synthetic, digits, mnist1d).

Data are fixed float32 feature vectors with int64 labels; the train/validation
split is fixed by the dataset (independent of the run seed). Partitions:
``iid`` (shuffled, sizes within one) and ``dirichlet`` (label skew, each
datacenter at least ``DEFAULT_MIN_SIZE`` items).
"""

from __future__ import annotations

import abc
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from crossdc.workloads.base import TensorWorkload
from crossdc.workloads.partition import dirichlet_partition, iid_partition

__all__ = ["ArraySplit", "ClassificationWorkload", "make_split"]


class ArraySplit(NamedTuple):
    """A dataset's fixed train/validation split as numpy arrays (treat as read-only; loaders cache them)."""

    train_inputs: np.ndarray  # float32, (n_train, features)
    train_labels: np.ndarray  # int64, (n_train,)
    val_inputs: np.ndarray  # float32, (n_val, features)
    val_labels: np.ndarray  # int64, (n_val,)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def make_split(train_x: np.ndarray, train_y: np.ndarray, val_x: np.ndarray, val_y: np.ndarray) -> ArraySplit:
    """An ArraySplit with canonical dtypes (float32 inputs, int64 labels) and read-only arrays."""
    return ArraySplit(
        _readonly(np.ascontiguousarray(train_x, dtype=np.float32)),
        _readonly(np.ascontiguousarray(train_y, dtype=np.int64)),
        _readonly(np.ascontiguousarray(val_x, dtype=np.float32)),
        _readonly(np.ascontiguousarray(val_y, dtype=np.int64)),
    )


class ClassificationWorkload(TensorWorkload):
    """A classification workload over a fixed ArraySplit; subclasses say how to load it and build models."""

    partitions: ClassVar[tuple[str, ...]] = ("iid", "dirichlet")
    num_classes: ClassVar[int]

    @classmethod
    @abc.abstractmethod
    def load_split(cls) -> ArraySplit:
        """The dataset's fixed split (cached per process by the implementation)."""

    @property
    def num_features(self) -> int:
        """Length of one input vector."""
        return int(self.load_split().train_inputs.shape[1])

    def _training_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        split = self.load_split()
        return torch.tensor(split.train_inputs), torch.tensor(split.train_labels)

    def _validation_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        split = self.load_split()
        return torch.tensor(split.val_inputs), torch.tensor(split.val_labels)

    def _partition(self, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
        labels = self.load_split().train_labels
        if self.partition_kind == "dirichlet":
            assert self.alpha is not None
            return dirichlet_partition(labels, n_parts, self.alpha, rng)
        return iid_partition(len(labels), n_parts, rng)
