"""``digits`` and ``mnist1d``: small offline image/signal classification workloads.

- ``digits``: scikit-learn's ``load_digits`` (1797 8x8 images, 64 features
  scaled to [0, 1], 10 classes). Validation: a fixed stratified 20% split
  (``SPLIT_SEED``, independent of the run seed): 1437 train / 360 validation.
- ``mnist1d``: MNIST-1D (40-sample signals, 10 classes) generated offline by
  the ``mnist1d`` package with its default arguments (5000 samples, data seed
  42, the package's own 80/20 split): 4000 train / 1000 validation. Nothing is
  downloaded and no pickle is written.

Both load once per process.
"""

from __future__ import annotations

import functools
import random
from typing import ClassVar

import numpy as np
from torch import nn

from crossdc.workloads.classification import ArraySplit, ClassificationWorkload, make_split
from crossdc.workloads.models import MLP, Conv1dNet

__all__ = ["DigitsWorkload", "Mnist1dWorkload", "load_digits_split", "load_mnist1d_split", "SPLIT_SEED"]

#: Seed of the fixed digits train/validation split.
SPLIT_SEED = 0
#: Fraction of digits held out for validation.
VALIDATION_FRACTION = 0.2

_MLP_DEFAULTS = {"hidden": 128, "layers": 2}


@functools.lru_cache(maxsize=1)
def load_digits_split() -> ArraySplit:
    """scikit-learn digits, pixels / 16 in [0, 1], fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    inputs, labels = load_digits(return_X_y=True)
    train_x, val_x, train_y, val_y = train_test_split(
        inputs / 16.0, labels, test_size=VALIDATION_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    return make_split(train_x, train_y, val_x, val_y)


@functools.lru_cache(maxsize=1)
def load_mnist1d_split() -> ArraySplit:
    """MNIST-1D regenerated in memory with the package's default arguments.

    ``mnist1d.data.make_dataset`` reseeds Python's and numpy's global
    generators; their states are saved and restored around the call so
    building this workload does not disturb the caller's randomness.
    """
    from mnist1d.data import get_dataset_args, make_dataset

    py_state = random.getstate()
    np_state = np.random.get_state()
    try:
        data = make_dataset(get_dataset_args())
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return make_split(data["x"], data["y"], data["x_test"], data["y_test"])


class DigitsWorkload(ClassificationWorkload):
    """8x8 digits; model ``mlp`` (model_args ``hidden`` default 128, ``layers`` hidden layers default 2)."""

    name: ClassVar[str] = "digits"
    models: ClassVar[tuple[str, ...]] = ("mlp",)
    default_model: ClassVar[str] = "mlp"
    model_defaults: ClassVar[dict[str, dict[str, int]]] = {"mlp": _MLP_DEFAULTS}
    num_classes: ClassVar[int] = 10

    @classmethod
    def load_split(cls) -> ArraySplit:
        return load_digits_split()

    def make_model(self) -> nn.Module:
        return MLP(self.num_features, self.num_classes, self.model_args["hidden"], self.model_args["layers"])


class Mnist1dWorkload(ClassificationWorkload):
    """MNIST-1D; models ``mlp`` (``hidden`` 128, ``layers`` 2) and ``cnn1d`` (``channels`` default 32)."""

    name: ClassVar[str] = "mnist1d"
    models: ClassVar[tuple[str, ...]] = ("mlp", "cnn1d")
    default_model: ClassVar[str] = "mlp"
    model_defaults: ClassVar[dict[str, dict[str, int]]] = {"mlp": _MLP_DEFAULTS, "cnn1d": {"channels": 32}}
    num_classes: ClassVar[int] = 10

    @classmethod
    def load_split(cls) -> ArraySplit:
        return load_mnist1d_split()

    def make_model(self) -> nn.Module:
        if self.spec.model == "cnn1d":
            return Conv1dNet(self.num_features, self.num_classes, self.model_args["channels"])
        return MLP(self.num_features, self.num_classes, self.model_args["hidden"], self.model_args["layers"])
