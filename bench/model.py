"""The encoder every benchmark here runs: pre-norm blocks (LayerNorm, q/k/v/o
Linear, attention, LayerNorm, GELU MLP), on packed tokens or on an NJT.

* packed ``x [T, d]``: ``attention(q, k, v, cu)`` on ``[T, H, Dh]`` (default
  ``ragged_attention(q, k, v, cu)``, so ``Runtime.graphed`` can re-plan ``cu``);
* NJT ``x [B, j, d]``: ``F.scaled_dot_product_attention`` on ``[B, H, j, Dh]``
  views, the pattern ``ragged_compile.compile`` / ``enable()`` rewrite.

``fused_qkv`` projects q, k and v with one Linear (the graph-mode benchmark's
form; packed only).
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import nn

try:
    from ragged_compile import ragged_attention
except Exception:  # noqa: BLE001 - the baselines run without it (harness.py records why)
    ragged_attention = None


def ours(q, k, v, cu):
    return ragged_attention(q, k, v, cu)


class Block(nn.Module):
    def __init__(self, d: int, mlp: int, fused_qkv: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        if fused_qkv:
            self.qkv = nn.Linear(d, 3 * d)
        else:
            self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.o = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, mlp * d), nn.Linear(mlp * d, d)


class Encoder(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, *, mlp: int = 4, fused_qkv: bool = False, attention=ours):
        super().__init__()
        self.heads, self.head_dim, self.fused_qkv, self.attention = heads, d // heads, fused_qkv, attention
        self.blocks = nn.ModuleList(Block(d, mlp, fused_qkv) for _ in range(layers))

    def with_attention(self, attention) -> Encoder:
        """This encoder, the same weights (shared), calling ``attention(q, k, v, cu)``."""
        m = copy.copy(self)
        m.attention = attention
        return m

    def forward(self, x, cu=None):
        H, Dh = self.heads, self.head_dim
        for b in self.blocks:
            h = b.ln1(x)
            if x.is_nested:
                q, k, v = (p(h).unflatten(-1, [H, Dh]).transpose(1, 2) for p in (b.q, b.k, b.v))
                a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
            else:
                if self.fused_qkv:
                    q, k, v = b.qkv(h).unflatten(-1, (3, H, Dh)).unbind(1)
                else:
                    q, k, v = (p(h).unflatten(-1, (H, Dh)) for p in (b.q, b.k, b.v))
                a = self.attention(q, k, v, cu)
            x = x + b.o(a.flatten(-2))
            x = x + b.fc2(F.gelu(b.fc1(b.ln2(x))))
        return x


def values(out):
    """The per-token rows of an encoder's output, packed or NJT."""
    return out.values() if out.is_nested else out
