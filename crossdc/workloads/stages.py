"""A model cut by blocks into consecutive pipeline stages, each a module of its own.

Promises: :func:`model_blocks` counts the blocks a model can be cut between (an MLP's hidden layers and its output
layer; a char-transformer's transformer blocks); :func:`split_model` returns one ``nn.Module`` per stage, holding
exactly the original model's parameters for its blocks (the same tensors, not copies: training the stages trains the
model), with the embeddings on the first stage and the final norm and head on the last (:func:`stage_tensors`
names them). Chaining the stages' forward
computes the model's forward exactly, so gradients are the unsplit model's. Stage i takes what stage i − 1 returns
(the first takes the model's input) and the last returns the model's output (logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from crossdc.workloads.errors import WorkloadError
from crossdc.workloads.models import MLP, CharTransformer


def model_blocks(model: nn.Module) -> int:
    """How many blocks `model` can be cut between (WorkloadError for a model that cannot be cut)."""
    if isinstance(model, MLP):
        return len(_mlp_blocks(model))
    if isinstance(model, CharTransformer):
        return len(model.blocks)
    raise WorkloadError(f"a {type(model).__name__} cannot be cut into pipeline stages (models that can: mlp, "
                        "char-transformer)")


def split_model(model: nn.Module, blocks_per_stage: Sequence[int]) -> list[nn.Module]:
    """`model` as consecutive stages of `blocks_per_stage[i]` blocks each (see the module docstring)."""
    total = model_blocks(model)
    if sum(blocks_per_stage) != total or any(count < 1 for count in blocks_per_stage):
        raise WorkloadError(f"stages of {list(blocks_per_stage)} blocks do not cut a model of {total} blocks "
                            "(each stage needs at least one, and they must add up)")
    bounds, start = [], 0
    for count in blocks_per_stage:
        bounds.append((start, start + count))
        start += count
    if isinstance(model, MLP):
        blocks = _mlp_blocks(model)
        return [MLPStage(blocks[a:b], first=a == 0) for a, b in bounds]
    assert isinstance(model, CharTransformer)
    return [TransformerStage(model, a, b) for a, b in bounds]


def stage_tensors(model: nn.Module, stages: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]]:
    """By stage, the tensors each of `stages` (modules built from `model`'s own tensors, such as :func:`split_model`'s)
    holds of `model`, under their names in `model`'s state dict; a stage's own extra tensors are left out."""
    names = {id(tensor): name for name, tensor in model.state_dict(keep_vars=True).items()}
    return [{names[id(t)]: t for t in stage.state_dict(keep_vars=True).values() if id(t) in names} for stage in stages]


def _mlp_blocks(model: MLP) -> list[nn.Sequential]:
    """An MLP's blocks: each hidden Linear with its ReLU, then the output Linear."""
    layers = list(model.net)
    blocks, current = [], []
    for layer in layers:
        current.append(layer)
        if not isinstance(layer, nn.Linear):
            blocks.append(nn.Sequential(*current))
            current = []
    if current:
        blocks.append(nn.Sequential(*current))
    return blocks


class MLPStage(nn.Module):
    """Consecutive blocks of an MLP; the first stage flattens the input as the model does."""

    def __init__(self, blocks: Sequence[nn.Module], first: bool) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.first = first

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.blocks(inputs.flatten(1) if self.first else inputs)


class TransformerStage(nn.Module):
    """Blocks [start, end) of a CharTransformer: the first stage embeds the tokens, the last adds the final norm and
    the head. Between stages passes the residual stream (batch, time, d_model)."""

    def __init__(self, model: CharTransformer, start: int, end: int) -> None:
        super().__init__()
        self.first, self.last = start == 0, end == len(model.blocks)
        self.seq_len = model.seq_len
        if self.first:
            self.token_embedding, self.position_embedding = model.token_embedding, model.position_embedding
        self.blocks = nn.ModuleList(model.blocks[start:end])
        if self.last:
            self.final_norm, self.head = model.final_norm, model.head
        self.register_buffer("causal_mask", model.causal_mask, persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(inputs.shape[1], device=inputs.device)
            hidden = self.token_embedding(inputs) + self.position_embedding(positions)
        else:
            hidden = inputs
        length = hidden.shape[1]
        mask = self.causal_mask[:length, :length]
        for block in self.blocks:
            hidden = block(hidden, src_mask=mask, is_causal=True)
        return self.head(self.final_norm(hidden)) if self.last else hidden
