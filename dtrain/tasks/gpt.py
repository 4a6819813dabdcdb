"""A small GPT language model, written for readability (in the spirit of nanoGPT).

Decoder-only transformer: learned token + position embeddings, ``num_layers``
pre-LayerNorm blocks (causal self-attention, then a 4x GELU MLP, each added to the
residual stream), a final LayerNorm and a head that shares its weight with the token
embedding (weight tying, Press & Wolf 2017). Tokens are bytes (vocab 256), so any text
works without a tokenizer.

Initialisation follows GPT-2 / nanoGPT: every Linear and Embedding weight ~ N(0, 0.02),
biases 0, LayerNorm (1, 0); the two projections that write into the residual stream
(attention ``proj`` and MLP ``down``) use std 0.02 / sqrt(2 * num_layers). All draws
come from one ``torch.Generator`` seeded with ``seed``, so two processes that build the
model with the same config and seed get bit-identical weights, and the global torch
RNG is left untouched.

Sizes used by the built-in task, at ``torch.set_num_threads(1)`` on the 2-vCPU dev
machine (idle; table and loss curves in ``dtrain/tasks/builtin.py``): tiny 2L/64d
0.12 M params ~14 ms/step (8 x 32 tokens); small 2L/128d 0.44 M ~29-37 ms/step
(8 x 64); base 4L/256d 3.26 M ~680 ms/step (16 x 128).

Shape legend used in comments: B batch, T time (tokens), C embed_dim, H num_heads,
D = C // H head size, V vocab_size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Size of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (256 for bytes).
        context_len: the longest sequence the position embedding covers (tokens).
        num_layers: transformer blocks.
        num_heads: attention heads; must divide ``embed_dim``.
        embed_dim: width of the residual stream (C).
        dropout: dropout probability on attention weights and residual branches
            (0 = off; the built-in presets train on plenty of data and use 0).
    """

    vocab_size: int = 256
    context_len: int = 128
    num_layers: int = 4
    num_heads: int = 4
    embed_dim: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_len", "num_layers", "num_heads", "embed_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(f"num_heads: must divide embed_dim={self.embed_dim}, got {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim)  # C -> 3C (q, k, v side by side)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)  # C -> C, writes into the residual
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H = self.num_heads
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x [B, T, C]
        # [B, T, C] -> [B, T, H, D] -> [B, H, T, D]
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [B, H, T, D]
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.embed_dim, 4 * cfg.embed_dim)
        self.down = nn.Linear(4 * cfg.embed_dim, cfg.embed_dim)  # writes into the residual
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))  # [B, T, C]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.embed_dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.embed_dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # [B, T, C]
        x = x + self.mlp(self.ln2(x))  # [B, T, C]
        return x


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        cfg: model size.
        seed: seed of the generator all initial weights are drawn from.

    ``forward(idx)`` takes token ids ``idx`` of shape [B, T] (int64, values in
    ``[0, vocab_size)``, ``T <= context_len``) and returns next-token logits of
    shape [B, T, V] (float32). A longer ``T`` raises ``ValueError``.
    """

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        # Module constructors draw default inits from the global RNG; fork it so that
        # building a model has no side effect. Every parameter is re-drawn below.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.embed_dim)  # [V, C]
            self.pos_emb = nn.Embedding(cfg.context_len, cfg.embed_dim)  # [T_max, C]
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
            self.ln_f = nn.LayerNorm(cfg.embed_dim)
            self.head = nn.Linear(cfg.embed_dim, cfg.vocab_size, bias=False)  # C -> V
        self.head.weight = self.tok_emb.weight  # weight tying: one [V, C] matrix
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter afresh from a generator seeded with ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        # named_modules() walks in registration order, so draws happen in a fixed order.
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.head:
                    continue  # tied to tok_emb, drawn there
                std = resid_std if name.endswith(("attn.proj", "mlp.down")) else 0.02
                module.weight.normal_(0.0, std, generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02, generator=gen)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def num_params(self) -> int:
        """Number of distinct parameters (the tied embedding/head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.context_len:
            raise ValueError(f"sequence length {T} exceeds context_len={self.cfg.context_len}")
        pos = torch.arange(T, device=idx.device)  # [T]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # [B, T, C] (+ [T, C] broadcast)
        for block in self.blocks:
            x = block(x)  # [B, T, C]
        return self.head(self.ln_f(x))  # [B, T, V]
