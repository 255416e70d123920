"""A tiny decoder-only (GPT-style) transformer over bytes.

The architecture follows Radford et al., "Language Models are Unsupervised Multitask Learners"
(2019): learned token and position embeddings, pre-norm blocks of causal self-attention and a
GELU MLP, a final layer norm and an output head tied to the token embedding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`CharLM`.

    Attributes:
        vocab_size: number of token ids (256: one per byte value).
        context: sequence length in tokens the position embedding covers.
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block; must divide ``d_model``.
        dropout: dropout probability used in training mode (drawn from torch's global generator,
            so its masks are reproducible from the seeded RNG state).
    """

    vocab_size: int = 256
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.1


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=2)
        # (batch, length, width) -> (batch, heads, length, width / heads)
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.ln_mlp(x))
        return out


class CharLM(nn.Module):
    """Byte-level language model: ``forward(tokens)`` returns next-byte logits.

    Args:
        config: the model shape.

    ``forward`` takes ``tokens`` of shape ``(batch, length)`` (int64, ``length <= context``) and
    returns logits of shape ``(batch, length, vocab_size)``; position ``t`` predicts token
    ``t + 1``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads:
            raise ValueError(
                f"d_model {config.d_model} is not divisible by n_heads {config.n_heads}"
            )
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.Sequential(*(_Block(config) for _ in range(config.n_layers)))
        self.ln_out = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying (Press & Wolf, 2017)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        logits: torch.Tensor = self.head(self.ln_out(self.blocks(x)))
        return logits


def _init_weights(module: nn.Module) -> None:
    # GPT-2's N(0, 0.02) weights and zero biases (without its residual-projection scaling):
    # PyTorch's N(0, 1) embedding default, tied to the output head, starts the loss far above
    # ln(256).
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def next_byte_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of predicting each byte of ``windows`` from the ones before.

    Args:
        model: a :class:`CharLM`, possibly wrapped (e.g. in DistributedDataParallel).
        windows: int64 tensor of shape ``(batch, context + 1)``; inputs are ``[:, :-1]`` and
            targets ``[:, 1:]``.

    Returns:
        A scalar tensor.
    """
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def parameter_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Return the sha256 (hex) of a state dict's names, dtypes, shapes and raw bytes, by name.

    Two models have the same digest only if their parameters are bitwise equal.
    """
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()
