"""A readable reference GPT (nanoGPT-style): the model `planner run` trains for a plan.

Shapes: B batch, T tokens, C = hidden_size, H heads, D = C / H, F = ffn_hidden_size, V vocab.
Each block holds the four linears of eq. 1 (C x 3C, C x C, C x F, F x C) and two LayerNorms.
Dropout is left out: training runs must be reproducible for the parity tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

BYTE_VOCAB = 256
"""Vocabulary of byte-level tokenisation, used when the plan's model ignores embeddings (vocab 0)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int = BYTE_VOCAB
    ffn_hidden_size: int = 0
    """0 means 4 * hidden_size."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @staticmethod
    def from_model_spec(spec) -> GPTConfig:  # noqa: ANN001 - planner.specs.model.ModelSpec
        return GPTConfig(num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_heads=spec.num_heads,
                         seq_len=spec.seq_len, vocab_size=spec.vocab_size or BYTE_VOCAB,
                         ffn_hidden_size=spec.ffn_hidden_size)


class GPTOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))  # (B, T, C) -> (B, T, F) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2)
        if self.wte.weight.device.type != "meta":
            for module in self.modules():
                init_weights(module)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
        B, T = input_ids.shape
        pos = torch.arange(T, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(B * T, -1), labels.reshape(B * T))
        return GPTOutput(logits, loss)


def init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation of one module's own parameters (usable on meta-built models)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
