"""Where graph mode's GPU time goes: kernel by kernel, eager vs graphed.

    python bench/profile/profile_cudagraph.py [--out DIR]

torch.profiler CUDA time per kernel name per step, eager (``runtime.step``) vs
graphed, for the 8-layer encoder of bench_cudagraph.py on the mixed16 and
short250 layouts. Writes DIR/profile_cudagraph.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/

import ragged_compile as rc  # noqa: E402
from bench_cudagraph import encoder  # noqa: E402
from env import environment  # noqa: E402
from layouts import cu_seqlens, random_lengths  # noqa: E402
from timing import kernel_times, time_fn  # noqa: E402


def profile_encoder(layouts, bucket):
    torch.manual_seed(0)
    model = encoder().to("cuda", torch.bfloat16).eval()
    rt = rc.Runtime()
    lens = layouts[0]
    x = torch.randn(sum(lens), 2048, device="cuda", dtype=torch.bfloat16)
    cu = cu_seqlens(lens)
    g = rt.graphed(model, [bucket])
    res = {}
    with torch.no_grad():
        def eager():
            with rt.step(lens):
                return model(x, cu.to("cuda", non_blocking=True))

        # The graph's own work, eagerly: the same padded rows, no capture.
        S, ceiling = bucket
        plens = list(lens) + [0] * (S - len(lens)) + [ceiling - sum(lens)]
        xp = torch.cat([x, x.new_zeros(ceiling - x.shape[0], x.shape[1])])
        cup = cu_seqlens(plens)

        def eager_padded():
            with rt.step(plens):
                return model(xp, cup.to("cuda", non_blocking=True))

        res["eager"] = kernel_times(eager)
        res["eager_padded"] = kernel_times(eager_padded)
        res["graphed"] = kernel_times(lambda: g(x, cu))
        res["max_diff"] = float((g(x, cu).float() - eager().float()).abs().max())
    return res


def gemm_check(rows=(33864, 34000), reps=20):
    """One Linear(2048, 6144) in bf16: eager vs replayed from a CUDA graph, per M.
    Tells whether capture itself changes cuBLAS's choice or speed."""
    lin = torch.nn.Linear(2048, 6144).to("cuda", torch.bfloat16)
    res = {}
    with torch.no_grad():
        for m in rows:
            x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                lin(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                lin(x)
            for name, fn in (("eager", lambda: lin(x)), ("graphed", graph.replay)):
                k = kernel_times(fn, steps=3)
                ms = time_fn(fn, "cuda", min_reps=reps)["mean_ms"]
                res[f"{m}_{name}"] = {"ms": round(ms, 4), "kernels": k["top"][:2]}
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA; nothing to measure here")
        return 0
    result = {"environment": environment(), "kernels": {}}
    gen = torch.Generator().manual_seed(0)
    cases = {
        "encoder8_mixed16": ([random_lengths(16, 64, 4096, gen, total=34000)], (16, 34000)),
        "encoder8_short250": ([random_lengths(250, 16, 256, gen, total=34000)], (256, 34000)),
    }
    try:
        result["gemm"] = gemm_check()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result["gemm"] = {"error": repr(e)[:300]}
    print("gemm", json.dumps(result["gemm"], indent=1), flush=True)
    for name, (layouts, bucket) in cases.items():
        try:
            result["kernels"][name] = profile_encoder(layouts, bucket)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["kernels"][name] = {"error": repr(e)[:300]}
        print(name, json.dumps(result["kernels"][name], indent=1), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_cudagraph.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
