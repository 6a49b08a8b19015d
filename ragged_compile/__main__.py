"""`python -m ragged_compile`: pack a random variable-length batch, run ragged
attention on the best available device and check it against the reference."""

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ragged_compile", description=__doc__)
    p.add_argument("--segments", type=int, default=24)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seed", type=int, default=0)
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

    out, ms = _time(lambda: ragged_attention(q, k, v, cu, causal=args.causal), device, reps=3)
    ref = dense_attention(q, k, v, cu.cpu(), cu.cpu(), args.causal, args.head_dim**-0.5)
    err = (out.cpu().double() - ref).abs().max().item() if total else 0.0
    if device.type == "cuda":
        from .runtime import get_runtime

        backend = "flashinfer " + str(get_runtime(device).last_backend)
    else:
        backend = "reference (CPU kernel)"
    print(f"device     {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})")
    print(f"backend    {backend}")
    print(f"segments   {args.segments} (lengths {int(lens.min())}..{int(lens.max())})")
    print(f"tokens     {total}  heads {args.heads}/{args.kv_heads}  head_dim {args.head_dim}  {dtype}")
    print(f"causal     {args.causal}")
    print(f"max error  {err:.3e} vs float64 per-segment dense attention")
    print(f"time       {ms:.2f} ms per call")
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    if not err <= tol:
        print(f"FAILED: error above {tol}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
