"""FlashInfer fa2 against fa3 over layout classes: the data behind ``backend="auto"``.

    python bench/sweep_backends.py --out DIR [--quick]

For each layout class (segment count and length range, causal or not, heads,
head dim) both kernels run through our own backend module (head-dim padding and
the causal split included, exactly what the op runs), interleaved in blocks so
clock drift hits both alike. Records the median kernel time per call, the host
time of one plan, and the layout's features, to DIR/sweep_backends.json.
``choose_backend`` in ragged_compile/backends/flashinfer.py is fitted on it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from env import environment  # noqa: E402

from ragged_compile.backends import flashinfer as fi  # noqa: E402

# name, segments, min len, max len
SHAPES = [
    ("tiny2000x1-32", 2000, 1, 32),
    ("tiny1000x8-64", 1000, 8, 64),
    ("short250x16-256", 250, 16, 256),
    ("short500x32-96", 500, 32, 96),
    ("mid120x128-512", 120, 128, 512),
    ("mid50x256-1024", 50, 256, 1024),
    ("mixed16x64-4096", 16, 64, 4096),
    ("mixed32x16-2048", 32, 16, 2048),
    ("long8x2048-6144", 8, 2048, 6144),
    ("long4x8192", 4, 8192, 8192),
    ("single1x32768", 1, 32768, 32768),
]
HEADS = [(16, 16, 128), (32, 8, 128), (8, 1, 128), (16, 16, 64), (32, 32, 64)]


def lengths(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g)


def time_blocks(fns, blocks=4, reps=20):
    """Median over interleaved blocks of per-call CUDA time, one list per fn."""
    out = [[] for _ in fns]
    for _ in range(blocks):
        for i, f in enumerate(fns):
            f()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                f()
            e.record()
            torch.cuda.synchronize()
            out[i].append(s.elapsed_time(e) / reps)
    return [statistics.median(x) for x in out]


def plan_ms(wrapper, cu, hq, hkv, d, dtype, causal, scale, reps=5):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fi.plan(wrapper, cu, cu, hq, hkv, d, dtype, causal, scale)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget-s", type=float, default=330.0)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    wrappers = {b: fi.make_wrapper(ws, b) for b in ("fa2", "fa3")}
    rows = []
    heads = HEADS[:2] if args.quick else HEADS
    for hq, hkv, d in heads:
        for name, n, lo, hi in SHAPES:
            lens = lengths(n, lo, hi, seed=sum(map(ord, name)))
            cu = torch.zeros(n + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(lens, 0)
            T = int(cu[-1])
            q = torch.randn(T, hq, d, device=dev, dtype=dtype)
            k = torch.randn(T, hkv, d, device=dev, dtype=dtype)
            v = torch.randn(T, hkv, d, device=dev, dtype=dtype)
            for causal in (False, True):
                if time.perf_counter() - t_start > args.budget_s:
                    break
                scale = d**-0.5
                rec = {
                    "layout": name, "n": n, "total": T, "mean": T / n,
                    "max": int(lens.max()), "hq": hq, "hkv": hkv, "d": d, "causal": causal,
                }
                try:
                    fns, outs = [], {}
                    for b, w in wrappers.items():
                        rec[f"plan_{b}_ms"] = plan_ms(w, cu, hq, hkv, d, dtype, causal, scale)
                        outs[b] = fi.run(w, q, k, v)
                    diff = (outs["fa2"].float() - outs["fa3"].float()).abs().max().item()
                    rec["fa2_vs_fa3_maxdiff"] = diff
                    for b, w in wrappers.items():
                        # the wrappers hold their last plan: re-plan is not needed per run
                        fns.append(lambda w=w: fi.run(w, q, k, v))
                    t2, t3 = time_blocks(fns)
                    rec.update(fa2_ms=t2, fa3_ms=t3, fa3_over_fa2=t3 / t2)
                except Exception as e:  # noqa: BLE001 - record and go on
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(rec)
                print(json.dumps(rec), flush=True)
            del q, k, v
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_backends.json").write_text(
        json.dumps({"environment": environment(), "dtype": "bfloat16", "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
