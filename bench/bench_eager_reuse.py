"""Eager ``enable()`` without ``Runtime.step``: plans and time per forward (CUDA).

Eager code under ``rc.enable()`` gets the runtime's implicit per-thread step,
so the model's layers share one plan (and one offsets read) per forward. This
runs one 8-layer NJT encoder (model.py's, d=1024, 16 heads, MLP x2) over ~250
segments of 16-256 tokens three ways, side by side in one process:

* ``eager``: ``with rc.enable(): model(x)``  (the implicit step)
* ``eager+step``: the same inside ``runtime.step()``  (the explicit step)
* ``compiled``: ``rc.compile(model)(x)``

and records, per way, the median forward time (CUDA events, after warm-up) and
plans / syncs per forward. Writes ``bench/results/eager_reuse.json``.

    python bench/bench_eager_reuse.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch

import ragged_compile as rc
from env import environment
from model import Encoder
from ragged_compile.runtime import get_runtime


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--segments", type=int, default=250)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "eager_reuse.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA; nothing to measure here")
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = Encoder(args.dim, args.heads, args.layers, mlp=2).to(dev, torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):  # new layouts each forward, as a server sees them
        lens = torch.randint(16, 257, (args.segments,), generator=gen).tolist()
        parts = [torch.randn(n, args.dim, generator=gen).to(dev, torch.bfloat16) for n in lens]
        batches.append(torch.nested.nested_tensor(parts, layout=torch.jagged))
    rt = get_runtime(dev)
    compiled = rc.compile(model, fullgraph=True)

    def eager(x):
        with rc.enable():
            return model(x)

    def eager_step(x):
        with rc.enable(), rt.step():
            return model(x)

    ways = {"eager": eager, "eager+step": eager_step, "compiled": compiled}
    rows = {}
    with torch.no_grad():
        for name, fn in ways.items():
            for x in batches:  # warm-up (compiles)
                fn(x)
            torch.cuda.synchronize()
            times, plans, syncs = [], [], []
            for i in range(args.reps):
                b = batches[i % len(batches)]
                # Fresh offsets every forward, as new requests bring: no plan
                # carried over from an earlier forward of the same batch.
                x = torch.nested.nested_tensor_from_jagged(b.values(), b.offsets().clone())
                before = dict(rt.stats)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(x)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
                plans.append(rt.stats["plans"] - before.get("plans", 0))
                syncs.append(rt.stats["syncs"] - before.get("syncs", 0))
            rows[name] = {
                "median_ms": statistics.median(times),
                "plans_per_forward": statistics.mean(plans),
                "syncs_per_forward": statistics.mean(syncs),
            }
            print(name, rows[name], flush=True)
    out = {
        "environment": environment(),
        "config": vars(args) | {"dtype": "bfloat16", "model": "model.Encoder(mlp=2)",
                                "tokens_per_batch": [int(b.values().shape[0]) for b in batches]},
        "results": rows,
    }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
