"""Short sliding windows, the kernel alone: window_forward.py's Triton forward
against PyTorch's FlashAttention-2 with the same window (what windowed calls ran
before), side by side in one process, CUDA-event time per call.

Rows: ModernBERT-base's local layers (12 heads of 64, window 64 + 64) on 64
sequences of 1..1,024 tokens packed (~32k tokens, the padded-batch bench's
layout), wider two-sided windows (128 + 128, 256 + 256), causal left windows
(255, 511), head dims 128 and 96, and GQA. Each row checks both kernels against
each other (max |diff|) and reports the effective throughput (the window's own
query-key pairs, 4 flops each per head dim). ``--sweep``: the Triton kernel's
tile configurations per head dim on the ModernBERT layout, to choose
``window_forward._config``. ``--layouts``: the ModernBERT window and a causal left
window of 256 over every layout class (floods of short segments, ViT-sized,
mixed, long), written to ``window-layouts.{json,md}``.

    python bench/bench_window.py --out bench/results [--sweep] [--layouts] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from env import environment  # noqa: E402
from timing import mean_ms  # noqa: E402

from ragged_compile.backends import flash_backward, window_forward  # noqa: E402

# (name, heads q, heads kv, head dim, causal, window)
ROWS = [
    ("modernbert_local", 12, 12, 64, False, (64, 64)),
    ("two_sided_257", 12, 12, 64, False, (128, 128)),
    ("two_sided_513", 12, 12, 64, False, (256, 256)),
    ("causal_left_256", 12, 12, 64, True, (255, -1)),
    ("causal_left_512", 12, 12, 64, True, (511, -1)),
    ("d128_local", 16, 16, 128, False, (64, 64)),
    ("d128_gqa_left_512", 32, 8, 128, True, (511, -1)),
    ("d96_local", 12, 12, 96, False, (64, 64)),
]
SWEEP = [(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


# layout classes, ~32-40k tokens each: (segments, shortest, longest)
LAYOUTS = {"short": (2048, 8, 32), "vit": (36, 1024, 1024), "mixed": (64, 1, 1024), "long": (4, 8192, 8192)}


def _layout(smoke: bool, name: str = "mixed"):
    g = torch.Generator().manual_seed(0)
    n, lo, hi = (4, 1, 64) if smoke else LAYOUTS[name]
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    return np.concatenate([[0], np.cumsum(lens.numpy())]).astype(np.int32)


def _pairs(cu, causal, window) -> int:
    """Query-key pairs inside the window (self-attention), per head."""
    left, right = window
    total = 0
    for n in np.diff(cu):
        i = np.arange(n)
        lo = np.maximum(i - left, 0) if left >= 0 else np.zeros_like(i)
        hi = i if causal else (np.minimum(i + right, n - 1) if right >= 0 else np.full_like(i, n - 1))
        total += int((hi - lo + 1).sum())
    return total


def _case(cu_np, hq, hkv, d, dev, dtype):
    t = int(cu_np[-1])
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(t, hq, d, device=dev, dtype=dtype, generator=g)
    k = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g)
    v = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g)
    cu = torch.from_numpy(cu_np).to(dev)
    return q, k, v, cu


def row(name, hq, hkv, d, causal, window, cu_np, dev, dtype, reps):
    q, k, v, cu = _case(cu_np, hq, hkv, d, dev, dtype)
    table = torch.from_numpy(window_forward.tiles(cu_np)).to(dev)
    lens = np.diff(cu_np)
    max_len = int(lens.max())
    scale = d**-0.5
    fns = {
        "window": lambda: window_forward.forward(q, k, v, cu, cu, table, causal, scale, window),
        "fa2": lambda: flash_backward.forward(q, k, v, cu, cu, max_len, max_len, causal, scale, window),
    }
    outs = {key: fn() for key, fn in fns.items()}
    res = {"row": name, "hq": hq, "hkv": hkv, "head_dim": d, "causal": causal, "window": list(window),
           "tokens": int(cu_np[-1]), "segments": int(lens.shape[0]),
           "max_diff_out": (outs["window"][0].float() - outs["fa2"][0].float()).abs().max().item(),
           "max_diff_lse": (outs["window"][1] - outs["fa2"][1]).abs().max().item()}
    flops = 4 * _pairs(cu_np, causal, window) * hq * d
    for key, fn in fns.items():
        ms = mean_ms(fn, dev, reps)[0]
        res[f"{key}_ms"] = ms
        res[f"{key}_tflops_effective"] = flops / ms / 1e9
    res["window_over_fa2_speed"] = res["fa2_ms"] / res["window_ms"]
    return res


def sweep(cu_np, dev, dtype, reps) -> list[dict]:
    """The Triton kernel's tile configurations on the ModernBERT layout, per head dim
    (BLOCK_M 64 and 128)."""
    out = []
    real_config, real_block = window_forward._config, window_forward.BLOCK_M
    try:
        for d, hq in ((64, 12), (128, 16)):
            for bm in (64, 128):
                window_forward.BLOCK_M = bm
                q, k, v, cu = _case(cu_np, hq, hq, d, dev, dtype)
                table = torch.from_numpy(window_forward.tiles(cu_np)).to(dev)
                ref = flash_backward.forward(q, k, v, cu, cu, int(np.diff(cu_np).max()), int(np.diff(cu_np).max()),
                                             False, d**-0.5, (64, 64))[0]
                for bn, warps, stages in SWEEP:
                    if bm * bn * d > 128 * 128 * 128:
                        continue
                    window_forward._config = lambda _d, c=(d, bn, warps, stages): c
                    entry = {"head_dim": d, "bm": bm, "bn": bn, "warps": warps, "stages": stages}
                    try:
                        got = window_forward.forward(q, k, v, cu, cu, table, False, d**-0.5, (64, 64))[0]
                        entry["max_diff"] = (got.float() - ref.float()).abs().max().item()
                        entry["ms"] = mean_ms(
                            lambda: window_forward.forward(q, k, v, cu, cu, table, False, d**-0.5, (64, 64)), dev, reps,
                        )[0]
                    except Exception as e:  # noqa: BLE001 - a config that fails to compile is recorded
                        entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    out.append(entry)
                    print(json.dumps(entry), flush=True)
    finally:
        window_forward._config, window_forward.BLOCK_M = real_config, real_block
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--layouts", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.layouts:
        rows = []
        for name in LAYOUTS:
            for spec in (ROWS[0], ROWS[3]):
                try:
                    r = {"layout": name, **row(*spec, _layout(a.smoke, name), dev, dtype, a.reps)}
                except Exception as e:  # noqa: BLE001 - a failing row is recorded, the others run
                    r = {"layout": name, "row": spec[0], "error": f"{type(e).__name__}: {str(e)[:300]}"}
                rows.append(r)
                print(json.dumps(r), flush=True)
        _write(out / "window-layouts", {"environment": environment(), "dtype": str(dtype), "rows": rows})
        return
    cu_np = _layout(a.smoke)
    res = {"environment": environment(), "dtype": str(dtype), "rows": []}
    if a.sweep:
        res["sweep"] = sweep(cu_np, dev, dtype, a.reps)
    for spec in ROWS:
        try:
            r = row(*spec, cu_np, dev, dtype, a.reps)
        except Exception as e:  # noqa: BLE001 - a failing row is recorded, the others run
            r = {"row": spec[0], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
    _write(out / "window", res)


def _write(stem: pathlib.Path, res: dict) -> None:
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Short sliding windows: window_forward.py against FlashAttention-2 (kernel alone)", "",
             f"Environment: `{json.dumps(res['environment'])}`", "",
             "| layout | row | heads | d | causal | window | segments | tokens | FA2 ms | ours ms | ours / FA2 | "
             "ours TFLOP/s (window's work) | max diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        where = r.get("layout", "mixed")
        if "error" in r:
            lines.append(f"| {where} | {r['row']} | error: {r['error'][:100]} | | | | | | | | | | |")
            continue
        lines.append(f"| {where} | {r['row']} | {r['hq']}/{r['hkv']} | {r['head_dim']} | {r['causal']} | "
                     f"{tuple(r['window'])} | {r['segments']} | {r['tokens']} | {r['fa2_ms']:.3f} | {r['window_ms']:.3f} | "
                     f"{r['window_over_fa2_speed']:.2f}x | {r['window_tflops_effective']:.0f} | {r['max_diff_out']:.1e} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
