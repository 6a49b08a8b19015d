"""An unmodified NJT model on ragged_compile's op with one line.

    python examples/njt_encoder.py            # CPU (reference kernel) or CUDA

The model is written as PyTorch's NJT tutorials write it: a ``[B, j, E]`` jagged
nested tensor through Linear, ``unflatten(-1, [H, D]).transpose(1, 2)``,
``F.scaled_dot_product_attention``, transpose and flatten back. Stock NJT SDPA
on CPU rejects ``is_causal=True`` and GQA and cannot be compiled;
``ragged_compile.compile`` runs it compiled, with one graph for every layout.
"""

from __future__ import annotations

import logging
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

import ragged_compile


class Block(nn.Module):
    def __init__(self, E: int, nheads: int, kv_heads: int):
        super().__init__()
        self.nheads, self.kv_heads, self.E_head = nheads, kv_heads, E // nheads
        self.norm = nn.LayerNorm(E)
        self.query_proj = nn.Linear(E, E)
        self.kv_proj = nn.Linear(E, 2 * kv_heads * self.E_head)
        self.out_proj = nn.Linear(E, E)
        self.ff = nn.Sequential(nn.LayerNorm(E), nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))

    def forward(self, x):
        h = self.norm(x)
        q = self.query_proj(h).unflatten(-1, [self.nheads, self.E_head]).transpose(1, 2)
        k, v = self.kv_proj(h).chunk(2, dim=-1)
        k = k.unflatten(-1, [self.kv_heads, self.E_head]).transpose(1, 2)
        v = v.unflatten(-1, [self.kv_heads, self.E_head]).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out_proj(a.transpose(1, 2).flatten(-2))
        return x + self.ff(x)


def batch(lengths, E, device, dtype):
    return torch.nested.nested_tensor(
        [torch.randn(n, E) for n in lengths], layout=torch.jagged, device=device, dtype=dtype
    )


def main() -> None:
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("ragged_compile").setLevel(logging.INFO)  # what the passes did
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    E, H, H_kv = 128, 8, 2
    model = nn.Sequential(*[Block(E, H, H_kv) for _ in range(2)]).to(device, dtype).eval()

    compiled = ragged_compile.compile(model, fullgraph=True)  # the one line

    rng = random.Random(0)
    with torch.no_grad():
        for step in range(10):
            lengths = [rng.randint(1, 64) for _ in range(rng.randint(2, 16))]
            x = batch(lengths, E, device, dtype)
            t = time.perf_counter()
            out = compiled(x)
            ms = (time.perf_counter() - t) * 1e3
            with ragged_compile.enable():  # eager NJT model on our op, for comparison
                ref = model(x)
            err = (out.values() - ref.values()).abs().max().item()
            print(f"step {step}: {len(lengths):2d} segments, {sum(lengths):4d} tokens, "
                  f"{ms:8.1f} ms, max |compiled - eager| = {err:.1e}")
    print("graphs compiled:", torch._dynamo.utils.counters["stats"]["unique_graphs"])


if __name__ == "__main__":
    main()
