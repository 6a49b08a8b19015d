"""Models written the way PyTorch's NJT tutorials teach, and their dense references.

Nothing here knows about ragged_compile: the same modules run on a jagged
``[B, j, E]`` nested tensor and on a dense ``[1, L, E]`` tensor, which is what
the per-segment dense references use.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttentionLayer(nn.Module):
    """Pre-norm encoder layer: LayerNorm, Linear, SDPA, GELU feed-forward."""

    def __init__(self, E: int, nheads: int, kv_heads: int | None = None, causal: bool = False):
        super().__init__()
        self.nheads, self.kv_heads = nheads, kv_heads or nheads
        self.E_head = E // nheads
        self.causal = causal
        self.norm1 = nn.LayerNorm(E)
        self.query_proj = nn.Linear(E, E)
        self.kv_proj = nn.Linear(E, 2 * self.kv_heads * self.E_head)
        self.out_proj = nn.Linear(E, E)
        self.norm2 = nn.LayerNorm(E)
        self.ff = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        query = self.query_proj(h).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        key, value = self.kv_proj(h).chunk(2, dim=-1)
        key = key.unflatten(-1, [self.kv_heads, self.E_head]).transpose(1, 2)
        value = value.unflatten(-1, [self.kv_heads, self.E_head]).transpose(1, 2)
        attn = F.scaled_dot_product_attention(
            query, key, value, is_causal=self.causal, enable_gqa=self.kv_heads != self.nheads
        )
        x = x + self.out_proj(attn.transpose(1, 2).flatten(-2))
        return x + self.ff(self.norm2(x))


class CrossAttentionBlock(nn.Module):
    """Decoder-style cross-attention: queries from ``x``, keys/values from ``memory``."""

    def __init__(self, E: int, nheads: int):
        super().__init__()
        self.nheads, self.E_head = nheads, E // nheads
        self.norm = nn.LayerNorm(E)
        self.query_proj = nn.Linear(E, E)
        self.key_proj = nn.Linear(E, E)
        self.value_proj = nn.Linear(E, E)
        self.out_proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        query = self.query_proj(self.norm(x)).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        key = self.key_proj(memory).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        value = self.value_proj(memory).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        attn = F.scaled_dot_product_attention(query, key, value)
        return x + self.out_proj(attn.transpose(1, 2).flatten(-2))


class TutorialStyleMHA(nn.Module):
    """Same structure and call pattern as the NJT tutorial's ``MultiHeadAttention``.

    Separate q/k/v projections of separately built q/k/v nested tensors, SDPA with
    ``dropout_p`` and ``is_causal=True``, transpose and flatten back, out projection.
    """

    def __init__(self, E_q: int, E_k: int, E_v: int, E_total: int, nheads: int, dropout_p: float = 0.0):
        super().__init__()
        self.nheads = nheads
        self.dropout_p = dropout_p
        self.query_proj = nn.Linear(E_q, E_total)
        self.key_proj = nn.Linear(E_k, E_total)
        self.value_proj = nn.Linear(E_v, E_total)
        self.out_proj = nn.Linear(E_total, E_q)
        self.E_head = E_total // nheads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        query = self.query_proj(query).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        key = self.key_proj(key).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        value = self.value_proj(value).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        attn = F.scaled_dot_product_attention(query, key, value, dropout_p=self.dropout_p, is_causal=True)
        return self.out_proj(attn.transpose(1, 2).flatten(-2))


def encoder(E: int = 32, nheads: int = 4) -> nn.Module:
    """Three layers: plain self-attention, causal self-attention, GQA (4 q heads on 2 kv heads)."""
    torch.manual_seed(0)
    layers = [
        SelfAttentionLayer(E, nheads),
        SelfAttentionLayer(E, nheads, causal=True),
        SelfAttentionLayer(E, nheads, kv_heads=nheads // 2),
    ]
    return nn.Sequential(*layers).eval()


def njt(lengths, E: int, seed: int | None = None) -> torch.Tensor:
    """A ``[B, j, E]`` jagged nested tensor, built as the tutorials build them."""
    gen = torch.Generator().manual_seed(seed if seed is not None else sum(lengths) * 7919 + len(lengths))
    return torch.nested.nested_tensor(
        [torch.randn(n, E, generator=gen) for n in lengths], layout=torch.jagged
    )


def dense_reference(model: nn.Module, *njts: torch.Tensor) -> torch.Tensor:
    """Run ``model`` one sample at a time on dense ``[1, L, E]`` tensors; packed result."""
    outs = []
    for parts in zip(*(t.unbind() for t in njts)):
        outs.append(model(*(p.unsqueeze(0) for p in parts))[0])
    return torch.cat(outs)


def random_layouts(n: int, seed: int = 0, max_len: int = 12):
    """``n`` layouts: 2-7 segments of 1..max_len tokens (all-ones layouts included)."""
    rng = random.Random(seed)
    layouts = []
    for i in range(n):
        segs = rng.randint(2, 7)
        if i % 10 == 3:
            layouts.append([1] * segs)
        else:
            layouts.append([rng.randint(1, max_len) for _ in range(segs)])
    return layouts
