"""Compile FlashInfer kernels ahead of a GPU run, several at once.

    python bench/warm_kernels.py fa2:128:bf16 fa3:128:bf16 fa2:64:fp16 ...
    python bench/warm_kernels.py fa2:64:bf16:softcap fa2:64:bf16:softcap+window ...

FlashInfer JIT-compiles one module per (backend, head dim, dtype, variant: a
left window, a soft-cap) on first use
(~72 s for fa3, ~22 s for fa2 on an H200 host), one after another, and caches
it. Here each module compiles in its own process, so a run that needs four pays
about one.
"""

from __future__ import annotations

import subprocess
import sys
import time

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

CHILD = """
import sys, torch
from ragged_compile.backends import flashinfer as fi
backend, d, dt, variant = sys.argv[1], int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4]
ws = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')
w = fi.make_wrapper(ws, backend)
cu = torch.tensor([0, 3, 10], dtype=torch.int32)
q = torch.randn(10, 4, d, device='cuda', dtype=dt)
k = torch.randn(10, 2, d, device='cuda', dtype=dt)
fi.plan(w, cu, cu, 4, 2, d, dt, True, d ** -0.5, window_left=3 if 'window' in variant else -1,
        softcap=30.0 if 'softcap' in variant else 0.0)
fi.run(w, q, k, k)
torch.cuda.synchronize()
"""


def main(specs: list[str]) -> int:
    t0 = time.perf_counter()
    procs = []
    for spec in specs:
        backend, d, dt, variant = (spec.split(":") + ["bf16", ""])[:4]
        procs.append((spec, subprocess.Popen([sys.executable, "-c", CHILD, backend, d, DTYPES[dt], variant])))
    bad = 0
    for spec, p in procs:
        rc = p.wait()
        bad += rc != 0
        print(f"warm {spec}: exit {rc} at {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
