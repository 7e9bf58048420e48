"""The model architectures of the built-in workloads (torch ``nn.Module``s).

Every model maps a batch of inputs to logits: classifiers ``(B, features) ->
(B, classes)``, the character LM ``(B, T) int64 -> (B, T, vocab)``.
Initialisation draws only from torch's global generator, so a model is
reproducible given ``torch.manual_seed`` set by the caller.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SoftmaxRegression", "MLP", "Conv1dNet", "CharTransformer"]


class SoftmaxRegression(nn.Module):
    """One linear layer: ``(B, in_features) -> (B, classes)`` logits."""

    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)


class MLP(nn.Module):
    """``layers`` hidden layers of width ``hidden`` (Linear + ReLU), then a linear output layer."""

    def __init__(self, in_features: int, classes: int, hidden: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = in_features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        blocks.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*blocks)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs.flatten(1))


class Conv1dNet(nn.Module):
    """Small 1-D CNN for ``(B, length)`` signals: three conv layers (kernel 5, stride 2, ReLU), then linear.

    The layout of the MNIST-1D paper's baseline CNN, with ``channels`` filters per layer.
    """

    def __init__(self, length: int, classes: int, channels: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, channels, kernel_size=5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv1d(channels, channels, kernel_size=5, stride=2, padding=2),
            nn.ReLU(),
        )
        out_length = length
        for _ in range(3):
            out_length = (out_length + 2 * 2 - 5) // 2 + 1
        self.head = nn.Linear(channels * out_length, classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(inputs.unsqueeze(1)).flatten(1))


class CharTransformer(nn.Module):
    """Causal decoder-only transformer over characters.

    Token embedding + learned positions, ``layers`` pre-norm
    ``nn.TransformerEncoderLayer`` blocks (``heads`` heads, feed-forward
    ``4 * d_model``, GELU, dropout 0) under a causal mask, a final LayerNorm and
    a linear head to ``vocab_size`` logits. Position ``t``'s logits depend only
    on tokens ``0..t``. Inputs may be shorter than ``seq_len``, not longer.

    Weights are drawn N(0, 0.02) (GPT-2 style, biases zero) so the initial
    loss is close to ``ln(vocab_size)``.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, heads: int, layers: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                heads,
                dim_feedforward=4 * d_model,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        # Not persistent: it is derived from seq_len, so it stays out of state_dict
        # (and out of every parameter exchange) but follows the model across devices.
        self.register_buffer(
            "causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"expected (batch, time) token ids, got shape {tuple(tokens.shape)}")
        length = tokens.shape[1]
        if length > self.seq_len:
            raise ValueError(f"sequence of {length} tokens is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(length, device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        mask = self.causal_mask[:length, :length]
        for block in self.blocks:
            hidden = block(hidden, src_mask=mask, is_causal=True)
        return self.head(self.final_norm(hidden))
