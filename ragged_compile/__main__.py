"""`python -m ragged_compile`: the product in two parts, on the best device here.

1. The op: pack a random variable-length batch, run `ragged_attention`, check it
   against a float64 per-segment reference.
2. The rewrite: a small pre-norm encoder written on nested jagged tensors, as the
   PyTorch tutorials write it, run eagerly on stock NJT SDPA and through
   `ragged_compile.compile(fullgraph=True)` over several layouts; outputs
   compared, compile time, graphs and speed printed.
"""

from __future__ import annotations

import argparse
import time

import torch

from .ops import ragged_attention
from .reference import dense_attention


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _time(fn, device, reps):
    fn()  # warm-up (and JIT on GPU)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / reps * 1e3


def _sdpa_loop(q, k, v, cu, causal):
    """Stock PyTorch's way on CPU: one SDPA call per segment, for comparison."""
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        x = [t[a:b].transpose(0, 1) for t in (q, k, v)]
        outs.append(torch.nn.functional.scaled_dot_product_attention(*x, is_causal=causal, enable_gqa=True))
    return torch.cat([o.transpose(0, 1) for o in outs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ragged_compile", description=__doc__)
    p.add_argument("--segments", type=int, default=24)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-encoder", action="store_true", help="only the op demo")
    args = p.parse_args(argv)

    device = _device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(0, args.max_len + 1, (args.segments,), generator=g)
    lens[: min(2, args.segments)] = torch.tensor([1, 0])[: min(2, args.segments)]  # edge cases ride along
    cu = torch.zeros(args.segments + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    total = int(cu[-1])
    q = torch.randn(total, args.heads, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(total, args.kv_heads, args.head_dim, generator=g).to(device, dtype)
    v = torch.randn(total, args.kv_heads, args.head_dim, generator=g).to(device, dtype)
    cu = cu.to(device)

    if device.type == "cuda":
        from .runtime import get_runtime

        # The hot path: a step planned once from host lengths, then only runs.
        runtime = get_runtime(device)
        with runtime.step(lens.tolist()):
            out, ms = _time(lambda: ragged_attention(q, k, v, cu, causal=args.causal), device, reps=10)
    else:
        out, ms = _time(lambda: ragged_attention(q, k, v, cu, causal=args.causal), device, reps=3)
        _, loop_ms = _time(lambda: _sdpa_loop(q, k, v, cu.tolist(), args.causal), device, reps=3)
    ref = dense_attention(q, k, v, cu.cpu(), cu.cpu(), args.causal, args.head_dim**-0.5)
    err = (out.cpu().double() - ref).abs().max().item() if total else 0.0
    if device.type == "cuda":
        backend = {"varlen": "PyTorch's FlashAttention-2 (varlen, no plan)"}.get(
            runtime.last_backend, f"flashinfer {runtime.last_backend}")
    else:
        backend = "fused CPU attention over groups of segments (backends/cpu.py)"
    print(f"device     {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})")
    print(f"backend    {backend}")
    print(f"segments   {args.segments} (lengths {int(lens.min())}..{int(lens.max())})")
    print(f"tokens     {total}  heads {args.heads}/{args.kv_heads}  head_dim {args.head_dim}  {dtype}")
    print(f"causal     {args.causal}")
    print(f"max error  {err:.3e} vs float64 per-segment dense attention")
    if device.type == "cuda":
        print(f"time       {ms:.2f} ms per call")
    else:
        print(f"time       {ms:.2f} ms per call (stock: a loop of SDPA per segment, {loop_ms:.2f} ms)")
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    if not err <= tol:
        print(f"FAILED: error above {tol}")
        return 1
    if args.skip_encoder:
        return 0
    return encoder_demo(device, dtype, args.seed)


class _Layer(torch.nn.Module):
    """Pre-norm encoder layer on a [B, j, E] nested jagged tensor, tutorial style."""

    def __init__(self, E, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(E), torch.nn.LayerNorm(E)
        self.q, self.k, self.v = (torch.nn.Linear(E, E) for _ in range(3))
        self.out = torch.nn.Linear(E, E)
        self.ff = torch.nn.Sequential(torch.nn.Linear(E, 4 * E), torch.nn.GELU(), torch.nn.Linear(4 * E, E))

    def forward(self, x):
        h = self.norm1(x)
        q, k, v = (p(h).unflatten(-1, [self.heads, -1]).transpose(1, 2) for p in (self.q, self.k, self.v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attn.transpose(1, 2).flatten(-2))
        return x + self.ff(self.norm2(x))


def encoder_demo(device, dtype, seed) -> int:
    import warnings

    import torch._dynamo

    # ragged_compile.compile drops Inductor's "Failed to pickle cache key" traceback
    # for NJT inputs itself; torch's one-line subclass-hash warning remains.
    warnings.filterwarnings("ignore", message="NestedTensor does not implement")
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")  # stock MATH path

    from . import compile as rc_compile

    E, heads, layers = (1024, 16, 4) if device.type == "cuda" else (256, 4, 2)
    max_len, batches = (2048, 6) if device.type == "cuda" else (256, 6)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[_Layer(E, heads) for _ in range(layers)]).to(device, dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)

    def batch():
        lens = torch.randint(1, max_len + 1, (int(torch.randint(2, 17, (), generator=g)),), generator=g)
        parts = [torch.randn(int(n), E, generator=g).to(device, dtype) for n in lens]
        return torch.nested.nested_tensor(parts, layout=torch.jagged), lens

    def timed(fn, x):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) * 1e3

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = rc_compile(model, fullgraph=True)
    print(f"\nencoder    {layers} layers, d_model {E}, {heads} heads, {dtype}, NJT input, {batches} layouts")
    worst, t_stock, t_ours = 0.0, [], []
    with torch.no_grad():
        x, _ = batch()
        _, compile_ms = timed(compiled, x)
        for i in range(batches):
            x, lens = batch()
            stock, ms_stock = timed(model, x)
            ours, ms_ours = timed(compiled, x)
            # Relative to the activations' scale: bf16 residual streams grow with depth.
            ref = stock.values().float()
            err = ((ours.values().float() - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            t_stock.append(ms_stock)
            t_ours.append(ms_ours)
            print(f"  batch {i}: {len(lens)} segments, {int(lens.sum())} tokens, "
                  f"stock NJT SDPA eager {ms_stock:.1f} ms, ragged_compile.compile {ms_ours:.1f} ms, rel diff {err:.2e}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"compile    {compile_ms / 1e3:.1f} s (first call), {graphs} graph(s) for {batches + 1} layouts")
    print(f"speed      stock NJT SDPA eager {sorted(t_stock)[len(t_stock) // 2]:.1f} ms, "
          f"ragged_compile.compile {sorted(t_ours)[len(t_ours) // 2]:.1f} ms (median per forward)")
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    print(f"agreement  max diff {worst:.2e} relative to max |activation| (tolerance {tol})")
    if not worst <= tol:
        print("FAILED: compiled encoder differs from stock")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
