"""A small LLaMA-style decoder-only transformer over bytes.

Pre-norm blocks of RMSNorm, causal multi-head self-attention with rotary position embeddings
(Su et al., 2021) and a SwiGLU MLP (Shazeer, 2020); a final RMSNorm and an untied output head.
No dropout, as in current LLM pre-training: no random number is drawn after initialization.
The blocks are in ``layers`` so that FSDP2 can shard each one as its own unit
(:func:`examples.llm_fsdp.train.shard`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LLMConfig:
    """Shape of :class:`TinyLLM`.

    Attributes:
        vocab_size: number of token ids (256: one per byte value).
        context: the longest sequence, in tokens.
        d_model: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block; must divide ``d_model`` into even head widths.
        mlp_hidden: hidden width of each SwiGLU MLP.
    """

    vocab_size: int = 256
    context: int = 64
    d_model: int = 64
    n_layers: int = 3
    n_heads: int = 4
    mlp_hidden: int = 176


def rotary_tables(context: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """``(context, head_dim // 2, 2)``: cos and sin of each position's rotation angles."""
    inverse = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=torch.float64), inverse)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (``(batch, heads, length, head_dim)``) by the position angles."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = tables[: x.shape[-2], :, 0], tables[: x.shape[-2], :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings, no biases."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.n_heads, -1).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        q, k = apply_rotary(q, tables), apply_rotary(k, tables)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(attn.transpose(1, 2).reshape(batch, length, width))
        return out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.up = nn.Linear(config.d_model, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), tables)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class TinyLLM(nn.Module):
    """Byte-level decoder-only language model: ``forward(tokens)`` returns next-byte logits.

    ``tokens`` is int64 of shape ``(batch, length)``, ``length <= context``; the logits have
    shape ``(batch, length, vocab_size)``, position ``t`` predicting token ``t + 1``.
    Parameters start as GPT-2's: N(0, 0.02), the residual projections scaled by
    ``1 / sqrt(2 * n_layers)``, norms at one.
    """

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        if config.d_model % config.n_heads or (config.d_model // config.n_heads) % 2:
            raise ValueError(
                f"d_model {config.d_model} does not split into {config.n_heads} heads of an "
                "even width"
            )
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Not a parameter nor in the state dict: recomputed, identical, by every process.
        self.register_buffer(
            "rotary",
            rotary_tables(config.context, config.d_model // config.n_heads),
            persistent=False,
        )
        residual_std = 0.02 / (2 * config.n_layers) ** 0.5
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = (
                    residual_std if name.endswith(("attn.out.weight", "mlp.down.weight")) else 0.02
                )
                nn.init.normal_(parameter, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        tables = self.get_buffer("rotary")
        for layer in self.layers:
            x = layer(x, tables)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits
