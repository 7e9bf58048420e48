"""A datacenter's own dataset and model as a crossdc workload: scikit-learn's two moons, a small MLP.

1000 training and 200 validation points (fixed, independent of the run seed); partitions ``iid`` and
``dirichlet`` (label skew) come from crossdc's ClassificationWorkload; model ``mlp`` with model_args
``hidden`` (default 32) and ``layers`` (default 2).
"""

from __future__ import annotations

import functools
from typing import ClassVar

from sklearn.datasets import make_moons
from torch import nn

from crossdc.workloads.classification import ArraySplit, ClassificationWorkload, make_split
from crossdc.workloads.models import MLP


@functools.lru_cache(maxsize=1)
def load_moons() -> ArraySplit:
    x, y = make_moons(n_samples=1200, noise=0.2, random_state=0)
    return make_split(x[:1000], y[:1000], x[1000:], y[1000:])


class MoonsWorkload(ClassificationWorkload):
    """Two interleaved half-moons in 2-D (binary classification)."""

    name: ClassVar[str] = "moons"
    models: ClassVar[tuple[str, ...]] = ("mlp",)
    model_defaults: ClassVar[dict[str, dict[str, int]]] = {"mlp": {"hidden": 32, "layers": 2}}
    num_classes: ClassVar[int] = 2

    @classmethod
    def load_split(cls) -> ArraySplit:
        return load_moons()

    def make_model(self) -> nn.Module:
        return MLP(2, 2, hidden=self.model_args["hidden"], layers=self.model_args["layers"])
