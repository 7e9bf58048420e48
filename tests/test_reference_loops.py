"""crossdc's FedAvg and DiLoCo against a plain torch loop written from the algorithms' definitions.

The reference below shares nothing with crossdc's training code but the workload's data, shards and initial model:
its own data order (a torch.Generator seeded as crossdc documents a datacenter's seed, one randperm per epoch), its
own AdamW per datacenter (torch's, kept across rounds), its own loss (cross-entropy), its own
server step (the plain mean of the datacenters' models for FedAvg; for DiLoCo ``torch.optim.SGD(nesterov=True)``
stepped on the outer gradient x − mean(yᵢ)). crossdc runs through :class:`crossdc.testing.InProcessFederation`, the
same code paths as a deployed run minus the transport. After every round the global weights must agree within
float32 rounding (the two sum the datacenters' models in different orders).

The model is an MLP on MNIST-1D with a non-IID (Dirichlet) partition. Not a transformer: its attention's key bias
has no gradient at all (softmax ignores a shift shared by every key), so AdamW turns float rounding noise there
into full learning-rate steps, and two correct implementations that round differently drift apart in that one
tensor while computing the same function.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from crossdc.experiment.builders import build_workload, initial_model, initial_weights
from crossdc.experiment.config import parse_config
from crossdc.testing.inprocess import InProcessFederation
from crossdc.workloads import model_weights

DATACENTERS = ("us-east", "eu-west", "ap-south")
ROUNDS = 4
TAU = 6
BATCH = 8
LR = 3e-3
SEED = 3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
#: float32 rounding, grown by AdamW where a gradient is tiny (measured here: FedAvg 1e-7, DiLoCo 7e-6 after 4 rounds,
#: whose outer step rounds differently in torch; a round moves the weights by 1.5e-2 to 4.6e-2)
RTOL, ATOL = 1e-4, 5e-5


def config_doc(strategy: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": {"name": f"reference-{strategy}", "rounds": ROUNDS, "seed": SEED},
        "workload": {"dataset": "mnist1d", "model": "mlp", "partition": {"kind": "dirichlet", "alpha": 0.5},
                     "batch_size": BATCH, "optimizer": "adamw", "lr": LR},
        "strategy": {"name": strategy, "tau": TAU, "params": params},
        "datacenters": [{"name": name} for name in DATACENTERS],
    }


class ReferenceDatacenter:
    """One datacenter of the plain loop: its model, its AdamW (torch's defaults but crossdc's documented weight
    decay 0.01), and its data order: a permutation per epoch from a generator seeded run_seed·1000 + 1 + index."""

    def __init__(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, index: int) -> None:
        self.model = model
        self.inputs, self.targets = inputs, targets
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.01)
        self.generator = torch.Generator().manual_seed(SEED * 1000 + 1 + index)
        self.order = torch.randperm(len(inputs), generator=self.generator)
        self.position = 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + BATCH > len(self.inputs):
            self.order, self.position = torch.randperm(len(self.inputs), generator=self.generator), 0
        index = self.order[self.position:self.position + BATCH]
        self.position += BATCH
        return self.inputs[index], self.targets[index]

    def train(self, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """τ AdamW steps from the global `start`; the model it ends with."""
        self.model.load_state_dict(start)
        self.model.train()
        for _ in range(TAU):
            inputs, targets = self.batch()
            self.optimizer.zero_grad()
            logits = self.model(inputs)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
            self.optimizer.step()
        return {name: value.detach().clone() for name, value in self.model.state_dict().items()}


def reference_rounds(strategy: str) -> list[dict[str, np.ndarray]]:
    """The global weights after each round of the plain loop."""
    config = parse_config(config_doc(strategy, {}))
    workload = build_workload(config)
    server = initial_model(config, workload)
    datacenters = [ReferenceDatacenter(copy.deepcopy(server), *workload.shard(name).tensors, index)
                   for index, name in enumerate(DATACENTERS)]
    outer = torch.optim.SGD(server.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    history = []
    for _ in range(ROUNDS):
        start = {name: value.detach().clone() for name, value in server.state_dict().items()}
        ends = [dc.train(start) for dc in datacenters]
        # FedAvg's mean as crossdc defines it: x + Σᵢ nᵢ(yᵢ − x) / Σᵢ nᵢ (float64 sums, nᵢ = the τ·B examples each saw)
        mean = {name: (start[name] + (sum((end[name] - start[name]).double() * (TAU * BATCH) for end in ends)
                                      / (TAU * BATCH * len(ends))).float()) for name in start}
        if strategy == "fedavg":
            server.load_state_dict(mean)
        else:
            outer.zero_grad()
            for name, parameter in server.named_parameters():
                parameter.grad = start[name] - mean[name]  # the outer gradient: x − mean yᵢ
            outer.step()
        history.append({name: value.detach().numpy().copy() for name, value in server.state_dict().items()})
    return history


@pytest.mark.parametrize(("strategy", "params"), [
    ("fedavg", {}),
    ("diloco", {"outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM}),
])
def test_crossdc_gives_the_plain_loops_weights_round_by_round(strategy: str, params: dict[str, Any], tmp_path: Path) -> None:
    expected = reference_rounds(strategy)
    federation = InProcessFederation.from_config(parse_config(config_doc(strategy, params)), tmp_path)
    for server_round, reference in enumerate(expected, start=1):
        result = federation.run_round()
        assert not result.rejected and len(result.updates) == len(DATACENTERS)
        got = federation.weights
        assert set(got) == set(reference)
        for name, value in reference.items():
            np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{strategy}, round {server_round}, {name}")
    # the tolerance tells the strategies apart: the rounds moved the model far more than it, and the other
    # strategy's reference (the same data and inner steps, another server step) is far outside it
    first = expected[0]
    assert max(float(np.abs(expected[-1][n] - first[n]).max()) for n in first) > 200 * ATOL
    other = reference_rounds("diloco" if strategy == "fedavg" else "fedavg")[-1]
    assert max(float(np.abs(expected[-1][n] - other[n]).max()) for n in other) > 100 * ATOL


def test_the_initial_weights_leave_the_callers_random_state_alone() -> None:
    """A trainer checks the initial weights mid-run (the downlink's round-1 digest): that must not reseed the random
    draws its training goes on with, and the weights are the initial model's."""
    config = parse_config(config_doc("fedavg", {}))
    workload = build_workload(config)
    torch.manual_seed(1234)
    expected_next = torch.rand(4)
    torch.manual_seed(1234)
    weights = initial_weights(config, workload)
    torch.testing.assert_close(torch.rand(4), expected_next)
    built = model_weights(initial_model(config, workload))
    assert list(weights) == list(built) and all(np.array_equal(weights[k], built[k]) for k in built)
