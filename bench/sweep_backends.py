"""FlashInfer fa2 against fa3 over layout classes: the data behind ``backend="auto"``.

    python bench/sweep_backends.py --out DIR [--quick]

For each layout class (segment count and length range, causal or not, heads,
head dim) both kernels run through our own backend module (head-dim padding and
the causal split included, exactly what the op runs), interleaved in blocks so
clock drift hits both alike. Records the median kernel time per call, the host
time of one plan, and the layout's features, to DIR/sweep_backends.json.
``flashinfer_backend`` in ragged_compile/backends/select.py is fitted on it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

from env import environment
from layouts import cu_seqlens, random_lengths
from ragged_compile.backends import flashinfer as fi
from timing import host_ms, interleaved, mean_ms

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


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget-s", type=float, default=330.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA; nothing to measure here")
        return 0
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    wrappers = {b: fi.make_wrapper(ws, b) for b in ("fa2", "fa3")}
    rows = []
    heads = HEADS[:2] if args.quick else HEADS
    for hq, hkv, d in heads:
        for name, n, lo, hi in SHAPES:
            lens = random_lengths(n, lo, hi, sum(map(ord, name)))
            cu = cu_seqlens(lens)
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
                    "max": max(lens), "hq": hq, "hkv": hkv, "d": d, "causal": causal,
                }
                try:
                    outs = {}
                    for b, w in wrappers.items():
                        rec[f"plan_{b}_ms"] = host_ms(lambda w=w: fi.plan(w, cu, cu, hq, hkv, d, dtype, causal, scale), dev, 5)
                        outs[b] = fi.run(w, q, k, v)
                    diff = (outs["fa2"].float() - outs["fa3"].float()).abs().max().item()
                    rec["fa2_vs_fa3_maxdiff"] = diff
                    # the wrappers hold their last plan: re-plan is not needed per run
                    fns = {b: (lambda w=w: fi.run(w, q, k, v)) for b, w in wrappers.items()}
                    blocks = interleaved(fns, 4, lambda f: mean_ms(f, dev, 20)[0])
                    t2, t3 = (statistics.median(blocks[b]) for b in ("fa2", "fa3"))
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
