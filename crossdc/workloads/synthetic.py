"""``synthetic``: a small Gaussian-mixture classification problem, for fast tests.

16 features, 4 balanced classes, 2000 training and 400 validation points.
Each class is a mixture of two unit-variance Gaussian clusters whose centres
are drawn once with the fixed generator seed ``GENERATOR_SEED`` (independent of
the run seed), so the data are the same in every process. The classes overlap
enough that neither model reaches 100% accuracy.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np
from torch import nn

from crossdc.workloads.classification import ArraySplit, ClassificationWorkload, make_split
from crossdc.workloads.models import MLP, SoftmaxRegression

__all__ = ["SyntheticWorkload", "GENERATOR_SEED"]

GENERATOR_SEED = 20240601
FEATURES = 16
CLASSES = 4
CLUSTERS_PER_CLASS = 2
TRAIN_PER_CLASS = 500
VAL_PER_CLASS = 100
CENTRE_SCALE = 0.75


@functools.lru_cache(maxsize=1)
def load_synthetic() -> ArraySplit:
    """The synthetic train/validation split (generated once per process)."""
    rng = np.random.default_rng(GENERATOR_SEED)
    centres = rng.normal(0.0, CENTRE_SCALE, size=(CLASSES, CLUSTERS_PER_CLASS, FEATURES))

    def sample(per_class: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.repeat(np.arange(CLASSES), per_class)
        clusters = rng.integers(0, CLUSTERS_PER_CLASS, size=labels.shape)
        inputs = centres[labels, clusters] + rng.normal(0.0, 1.0, size=(len(labels), FEATURES))
        order = rng.permutation(len(labels))
        return inputs[order], labels[order]

    train_x, train_y = sample(TRAIN_PER_CLASS)
    val_x, val_y = sample(VAL_PER_CLASS)
    return make_split(train_x, train_y, val_x, val_y)


class SyntheticWorkload(ClassificationWorkload):
    """Gaussian-mixture classification; models ``linear`` (softmax regression) and ``mlp``.

    ``mlp`` model_args: ``hidden`` (default 64) units in each of ``layers``
    (default 2) hidden layers. ``linear`` takes no model_args.
    """

    name: ClassVar[str] = "synthetic"
    models: ClassVar[tuple[str, ...]] = ("linear", "mlp")
    default_model: ClassVar[str] = "linear"
    model_defaults: ClassVar[dict[str, dict[str, int]]] = {"linear": {}, "mlp": {"hidden": 64, "layers": 2}}
    num_classes: ClassVar[int] = CLASSES

    @classmethod
    def load_split(cls) -> ArraySplit:
        return load_synthetic()

    def make_model(self) -> nn.Module:
        if self.spec.model == "linear":
            return SoftmaxRegression(FEATURES, CLASSES)
        return MLP(FEATURES, CLASSES, hidden=self.model_args["hidden"], layers=self.model_args["layers"])
