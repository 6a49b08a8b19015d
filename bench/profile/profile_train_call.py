"""Where the host time of one training call goes: ``rc.ragged_attention`` forward
and backward (``torch.autograd.grad``) on a batch small enough that the host
decides the time (32 segments of 9..33 tokens, 12 heads of 64, bf16), inside a
runtime step with the layout planned, for each backward ``auto`` may pick.
Host microseconds per call (synced at the end only) and cProfile's top functions
by own time and by cumulative time.

    python bench/profile/profile_train_call.py --out bench/results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from env import environment  # noqa: E402

import ragged_compile as rc  # noqa: E402
from ragged_compile.runtime import Runtime  # noqa: E402


def profile(backward: str, dev, reps: int) -> dict:
    os.environ["RAGGED_COMPILE_BACKWARD"] = backward
    lens = [9, 17, 33, 12] * 8
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(sum(lens), 12, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(q.shape, device=dev, dtype=q.dtype)
    rt = Runtime(dev)

    def call():
        out = rc.ragged_attention(q, k, v, cu, cu)
        torch.autograd.grad(out, (q, k, v), g)

    row = {}
    with rt.step():
        for _ in range(20):
            call()
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        row["host_us_per_call"] = (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize(dev)
        row["forward"] = rt.last_backend
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(reps):
            call()
        pr.disable()
        torch.cuda.synchronize(dev)
    for key, order in (("by_own_time", "tottime"), ("by_cumulative_time", "cumtime")):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(order).print_stats(30)
        row[key] = s.getvalue()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=300)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device: the CPU path has no separate backward kernels to profile")
    dev = torch.device("cuda")
    res = {"environment": environment(), "calls": {}}
    for backward in ("auto", "fa2", "fa4"):
        try:
            res["calls"][backward] = profile(backward, dev, a.reps)
        except Exception as e:  # noqa: BLE001 - fa4 where flash-attn-4 is missing: record, go on
            res["calls"][backward] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_train_call.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({b: r.get("host_us_per_call", r.get("error")) for b, r in res["calls"].items()}))


if __name__ == "__main__":
    main()
