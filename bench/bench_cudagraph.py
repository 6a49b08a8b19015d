"""CUDA-graph mode vs eager: host time per step, wall time, captures, overlap.

    python bench/bench_cudagraph.py [--out bench/results] [--smoke]

Per layout (~250 segments of 16-256 tokens; 16 segments of 64-4096) and model
(one attention layer; the 8-layer pre-norm encoder, d=2048, 16 heads, MLP x4,
bf16), plus a launch-bound case (the encoder at d=512 over ~250 segments of
16-64 tokens), side by side in one process:

* eager: ``with runtime.step(lens): model(x, cu)`` (eager and torch.compile'd);
* graphed: ``runtime.graphed(model, buckets)(x, cu_host)``.

Steps run back to back, a new layout each step (same bucket, different
layouts); eager and graphed alternate in blocks so clock drift hits both, and
each figure is the median over blocks. For each: wall ms per step, host ms per
step (time until the call returns, no sync), GPU ms per step (CUDA events
around the step; "queued": one step issued behind a sleep kernel, so only GPU
work counts), captures, plans, waits. ``overlap`` is the share of host work
hidden behind GPU work: (host + gpu - wall) / host, clipped to [0, 1].
Writes bench/results/cudagraph.json and cudagraph.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import time
import traceback

import torch

import ragged_compile as rc
from env import environment
from layouts import cu_seqlens, random_lengths
from model import Encoder
from timing import gpu_queued_ms, time_steps


def measure(call, layouts, device, d, dtype):
    """Back-to-back steps over `layouts`; returns wall/host/gpu ms per step."""
    xs = [torch.randn(sum(lens), d, device=device, dtype=dtype) for lens in layouts]
    steps = [functools.partial(call, x, cu_seqlens(lens), lens) for x, lens in zip(xs, layouts)]
    return time_steps(steps)


def gpu_only(call, layouts, device, d, dtype, reps=9):
    """GPU time of one step when the host is not the bottleneck."""
    x = torch.randn(sum(layouts[0]), d, device=device, dtype=dtype)
    return gpu_queued_ms(functools.partial(call, x, cu_seqlens(layouts[0]), layouts[0]), reps)


BLOCKS = 4  # eager and graphed alternate in blocks of steps, so clock drift hits both


def _median_rows(rows):
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def run_case(name, model, layouts, bucket, d, dtype, compiled):
    device = torch.device("cuda")
    rt = rc.Runtime()
    m = torch.compile(model, fullgraph=True) if compiled else model
    row = {"case": name, "compiled": compiled, "segments": len(layouts[0]),
           "tokens": sum(layouts[0]), "bucket": list(bucket), "steps": len(layouts)}

    def eager(x, cu, lens):
        with rt.step(lens):
            return m(x, cu.to(device, non_blocking=True))

    g = rt.graphed(m, [bucket])

    def graphed(x, cu, lens):
        return g(x, cu)

    calls = {"eager": eager, "graphed": graphed}
    per = max(1, len(layouts) // BLOCKS)
    with torch.no_grad():
        for call in calls.values():  # warm: compile (two shapes: the dynamic recompile), capture
            for lens in layouts[:2]:
                call(torch.randn(sum(lens), d, device=device, dtype=dtype), cu_seqlens(lens), lens)
        rt_before, g_before = dict(rt.stats), dict(g.stats)
        blocks = {k: [] for k in calls}
        for i in range(0, per * BLOCKS, per):
            for k, call in calls.items():
                blocks[k].append(measure(call, layouts[i : i + per], device, d, dtype))
        steps = per * BLOCKS
        d_rt = {k: rt.stats[k] - rt_before.get(k, 0) for k in ("plans", "syncs")}
        d_g = {k: g.stats[k] - g_before.get(k, 0) for k in ("replays", "plans", "waits", "syncs", "eager")}
        for k, call in calls.items():
            row[k] = _median_rows(blocks[k])
            row[k]["gpu_ms_queued"] = gpu_only(call, layouts, device, d, dtype)
        row["eager"]["plans_per_step"] = round((d_rt["plans"] - d_g["plans"]) / steps, 2)
        row["eager"]["syncs_per_step"] = round(d_rt["syncs"] / steps, 2)
        row["graphed"].update(d_g)
        row["graphed"]["captures"] = g.stats["captures"]
        row["graphed"]["plans_per_step"] = round(d_g["plans"] / max(d_g["replays"], 1), 2)
        x = torch.randn(sum(layouts[-1]), d, device=device, dtype=dtype)
        cu = cu_seqlens(layouts[-1])
        err = (g(x, cu).float() - eager(x, cu, layouts[-1]).float()).abs().max().item()
        row["max_diff_graphed_vs_eager"] = err
    for mode in calls:
        r = row[mode]
        r["overlap"] = round(min(1.0, max(0.0, (r["host_ms"] + r["gpu_ms_queued"] - r["wall_ms"]) / max(r["host_ms"], 1e-9))), 3)
        r["wall_minus_gpu_queued_ms"] = round(r["wall_ms"] - r["gpu_ms_queued"], 3)
    row["graphed_vs_eager_wall"] = round(row["graphed"]["wall_ms"] / row["eager"]["wall_ms"], 3)
    print(json.dumps(row), flush=True)
    return row


def encoder(d=2048, heads=16, layers=8):
    """The graph-mode benchmark's model: model.py's encoder with one q/k/v projection."""
    return Encoder(d, heads, layers, fused_qkv=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA; nothing to measure here")
        return 0
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    steps = 20 if args.smoke else args.steps
    short = [random_lengths(250, 16, 256, gen, total=34000) for _ in range(steps)]
    mixed = [random_lengths(16, 64, 4096, gen, total=34000) for _ in range(steps)]
    tiny = [random_lengths(250, 16, 64, gen) for _ in range(steps)]
    rows = []
    cases = [
        ("attention_1layer_short250", functools.partial(encoder, layers=1), short, (256, 34000), 2048),
        ("encoder8_short250", encoder, short, (256, 34000), 2048),
        ("encoder8_mixed16", encoder, mixed, (16, 34000), 2048),
        # Launch-bound: a small encoder over ~250 short segments, where host work is most of a step.
        ("encoder8_d512_short250", functools.partial(encoder, 512, 8), tiny, (256, 11264), 512),
    ]
    if args.smoke:
        cases = [("smoke", functools.partial(encoder, 256, 4, 2), [lens[:8] for lens in short], (8, 34000), 256)]
    for name, make, layouts, bucket, d in cases:
        for compiled in (False, True):
            try:
                model = make().to("cuda", dtype).eval()
                rows.append(run_case(name, model, layouts, bucket, d, dtype, compiled))
            except Exception as e:  # noqa: BLE001 - record and go on
                traceback.print_exc()
                rows.append({"case": name, "compiled": compiled, "error": repr(e)})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    (out / "cudagraph.json").write_text(json.dumps(result, indent=1))
    lines = [
        "| case | compiled | mode | wall ms/step | host ms/step | GPU ms/step (queued) | wall - GPU | overlap | captures | plans/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['compiled']} | error: {r['error'][:80]} |")
            continue
        for mode in ("eager", "graphed"):
            m = r[mode]
            plans = m["plans_per_step"]
            lines.append(
                f"| {r['case']} | {r['compiled']} | {mode} | {m['wall_ms']} | {m['host_ms']} | "
                f"{m['gpu_ms_queued']} | {m['wall_minus_gpu_queued_ms']} | {m['overlap']} | "
                f"{m.get('captures', '-')} | {plans} |"
            )
    (out / "cudagraph.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
