"""Soft-capped attention training, the attention alone: the op's path (FlashInfer's
capped forward with its LSE, segment_backward.py's Triton backward) against what a
model runs without it, side by side in one process, CUDA-event time per call.

Per row (a layout, heads, head dim, causal, window, softcap 50 as Gemma2's):

* ``ours``: ``ragged_attention(..., softcap=50)`` forward and backward (through the
  op's dispatcher: its planning included), and the backward kernel alone;
* ``eager``: transformers' Gemma2 eager attention on the same sequences padded
  to a batch (scores, cap, masks, float32 softmax, under autograd), forward and
  backward: what Gemma2 trains on (transformers refuses SDPA for soft-capping);
* ``reference``: the op's former path for soft-capped gradients (FlashInfer's
  forward, the reference's gradients), where the layout is small enough;
* ``fa2_nocap``: PyTorch's FlashAttention-2 forward and backward on the layout
  *without* the cap: not the same function, the speed of a fused kernel for scale.

Each row checks ours against the float32 reference (out and gradients, max |diff|
over max |ref|). ``--sweep``: the backward kernels' tiles per head dim (to choose
``segment_backward._config``). Writes ``softcap.{json,md}``.

    python bench/bench_softcap.py --out bench/results [--sweep] [--smoke]
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

import ragged_compile as rc  # noqa: E402
from ragged_compile.backends import flash_backward, segment_backward  # noqa: E402
from ragged_compile.reference import reference_attention, reference_attention_backward  # noqa: E402
from ragged_compile.runtime import get_runtime  # noqa: E402

CAP = 50.0
# (name, layout, hq, hkv, head dim, causal, window)
ROWS = [
    ("gemma2_2b_global", "mixed", 8, 4, 256, True, (-1, -1)),
    ("gemma2_2b_sliding", "long", 8, 4, 256, True, (4095, -1)),
    ("gemma2_9b_global", "mixed", 16, 8, 256, True, (-1, -1)),
    ("gemma2_27b_global", "mixed", 32, 16, 128, True, (-1, -1)),
    ("gemma2_27b_short", "short", 32, 16, 128, True, (-1, -1)),
    ("d64_encoder", "vit", 12, 12, 64, False, (-1, -1)),
]
# layout classes: (segments, shortest, longest)
LAYOUTS = {"short": (512, 32, 96), "vit": (36, 1024, 1024), "mixed": (16, 256, 4096), "long": (4, 8192, 8192)}
# (rows a program, rows a step, warps, stages); two-stage entries are kept to record
# whether pipelining stays deterministic
KV_TILES = [(64, 32, 4, 1), (64, 64, 4, 1), (32, 64, 4, 1), (32, 32, 4, 1), (64, 32, 8, 1), (128, 32, 8, 1),
            (64, 16, 4, 1), (32, 32, 8, 1), (64, 32, 4, 2), (32, 64, 4, 2)]
Q_TILES = [(64, 32, 4, 1), (64, 64, 4, 1), (32, 64, 4, 1), (32, 32, 4, 1), (64, 32, 8, 1), (128, 32, 8, 1),
           (32, 32, 8, 1), (64, 32, 4, 2), (128, 32, 8, 2)]


def _layout(name, smoke):
    g = torch.Generator().manual_seed(0)
    n, lo, hi = (3, 1, 80) if smoke else LAYOUTS[name]
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    return np.concatenate([[0], np.cumsum(lens.numpy())]).astype(np.int32)


def _case(cu_np, hq, hkv, d, dev, dtype):
    t = int(cu_np[-1])
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(t, hq, d, device=dev, dtype=dtype, generator=g) * 2  # scores past the cap
    k = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g) * 2
    v = torch.randn(t, hkv, d, device=dev, dtype=dtype, generator=g)
    go = torch.randn(t, hq, d, device=dev, dtype=dtype, generator=g)
    return q, k, v, go, torch.from_numpy(cu_np).to(dev)


def _ours(q, k, v, go, cu, causal, scale, window):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def run():
        out = rc.ragged_attention(*leaves, cu, cu, causal=causal, scale=scale, window_size=window, softcap=CAP)
        grads = torch.autograd.grad(out, leaves, go)
        return out, grads
    return run


def _eager(q, k, v, go, cu_np, causal, scale, window):
    """Gemma2's eager attention over the padded batch (transformers'
    ``eager_attention_forward`` with its softcap), forward and backward."""
    lens = np.diff(cu_np)
    b, s, hq, hkv, d = len(lens), int(lens.max()), q.shape[1], k.shape[1], q.shape[2]
    dev = q.device
    idx = torch.from_numpy(np.concatenate([i * s + np.arange(n) for i, n in enumerate(lens)])).to(dev)

    def pad(x):
        out = x.new_zeros(b * s, x.shape[1], d)
        out[idx] = x
        return out.view(b, s, x.shape[1], d).transpose(1, 2)

    qp, kp, vp, gp = (pad(t).detach() for t in (q, k, v, go))
    pos = torch.arange(s, device=dev)
    real = pos[None, :] < torch.from_numpy(lens).to(dev)[:, None]  # [b, s]
    allowed = real[:, None, None, :].expand(b, 1, s, s)
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])
    if window[0] >= 0:
        allowed = allowed & (pos[None, :] >= pos[:, None] - window[0])
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=dev).masked_fill(~allowed, torch.finfo(q.dtype).min)
    leaves = [t.requires_grad_() for t in (qp, kp, vp)]

    def run():
        qq, kk, vv = leaves
        kk = kk.repeat_interleave(hq // hkv, 1)
        vv = vv.repeat_interleave(hq // hkv, 1)
        w = torch.matmul(qq, kk.transpose(2, 3)) * scale
        w = torch.tanh(w / CAP) * CAP
        w = w + mask
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, vv)
        grads = torch.autograd.grad(out, leaves, gp)
        return out, grads
    return run


def _fa2_nocap(q, k, v, go, cu, max_len, causal, scale, window):
    def run():
        out, lse = flash_backward.forward(q, k, v, cu, cu, max_len, max_len, causal, scale, window)
        return flash_backward.backward(go, q, k, v, out, lse, cu, cu, max_len, max_len, causal, scale, window)
    return run


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def row(name, layout, hq, hkv, d, causal, window, dev, dtype, reps, smoke):
    cu_np = _layout(layout, smoke)
    q, k, v, go, cu = _case(cu_np, hq, hkv, d, dev, dtype)
    scale = d**-0.5
    max_len = int(np.diff(cu_np).max())
    res = {"row": name, "layout": layout, "segments": len(cu_np) - 1, "tokens": int(cu_np[-1]), "hq": hq, "hkv": hkv,
           "head_dim": d, "causal": causal, "window": list(window), "softcap": CAP}
    ours = _ours(q, k, v, go, cu, causal, scale, window)
    out, grads = ours()
    kw = dict(window_size=window, softcap=CAP)
    want_out = reference_attention(q, k, v, cu, cu, causal, scale, **kw)
    want = reference_attention_backward(go.float(), q.float(), k.float(), v.float(), cu, cu, causal, scale, **kw)
    res["rel_err_out"] = _rel(out, want_out)
    for n, a, b in zip("qkv", grads, want):
        res[f"rel_err_d{n}"] = _rel(a, b)
    res["runtime_stats"] = dict(get_runtime(dev).stats)  # which kernels the op ran
    # the backward alone, on the forward's out and LSE as the op saves them
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o, lse, _ = torch.ops.ragged_compile.ragged_attention_lse(*leaves, cu, cu, causal, scale, window[0], window[1], CAP)
    o, lse = o.detach(), lse.detach()
    fns = {
        "ours": ours,
        "ours_backward": lambda: segment_backward.backward(go, q, k, v, o, lse, cu, cu, causal, scale, window, CAP),
        "eager": _eager(q, k, v, go, cu_np, causal, scale, window),
        "fa2_nocap": _fa2_nocap(q, k, v, go, cu, max_len, causal, scale, window),
    }
    if int(cu_np[-1]) <= 8192:
        fns["reference"] = lambda: reference_attention_backward(go, q, k, v, cu, cu, causal, scale, **kw)
    try:  # the padded batch's scores may not fit
        eager_out = fns["eager"]()[0]
        got = torch.cat([eager_out[i, :, :n].transpose(0, 1) for i, n in enumerate(np.diff(cu_np))])
        res["eager_rel_err_out"] = _rel(got, want_out)
        del eager_out, got
    except torch.OutOfMemoryError as e:
        res["eager_error"] = f"OutOfMemoryError: {str(e)[:120]}"
        del fns["eager"]
        torch.cuda.empty_cache()
    for key, fn in fns.items():
        try:
            res[f"{key}_ms"] = mean_ms(fn, dev, reps if key != "reference" else 3)[0]
        except torch.OutOfMemoryError as e:
            res[f"{key}_error"] = f"OutOfMemoryError: {str(e)[:120]}"
            torch.cuda.empty_cache()
    for key in ("eager", "reference", "fa2_nocap"):
        if f"{key}_ms" in res and "ours_ms" in res:
            res[f"ours_over_{key}_speed"] = res[f"{key}_ms"] / res["ours_ms"]
    return res


def sweep(dev, dtype, reps, smoke) -> list[dict]:
    """Each kernel's tiles, the other's at the default, per head dim, on the mixed
    layout, causal, from the reference's output and LSE (no FlashInfer needed): the
    time, whether three runs agree bit for bit, and the error against the float32
    reference's gradients."""
    from ragged_compile.reference import reference_lse

    out = []
    cu_np = _layout("mixed", smoke)
    real = segment_backward._config
    for d, hq, hkv in ((64, 16, 8), (128, 32, 16), (256, 8, 4)):
        q, k, v, go, cu = _case(cu_np, hq, hkv, d, dev, dtype)
        scale = d**-0.5
        o = reference_attention(q, k, v, cu, cu, True, scale, softcap=CAP)
        lse = reference_lse(q, k, cu, cu, True, scale, softcap=CAP)
        want = reference_attention_backward(go.float(), q.float(), k.float(), v.float(), cu, cu, True, scale,
                                            softcap=CAP)
        base_kv, base_q = real(d)
        for which, tiles in (("kv", KV_TILES), ("q", Q_TILES)):
            for t in tiles:
                config = (t, base_q) if which == "kv" else (base_kv, t)
                entry = {"head_dim": d, "kernel": which, "tiles": list(t), "default": config == real(d)}

                def run(config=config):
                    return segment_backward.backward(go, q, k, v, o, lse, cu, cu, True, scale, (-1, -1), CAP, config)
                try:
                    runs = [run() for _ in range(3)]
                    entry["deterministic"] = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
                    entry["rel_err"] = max(_rel(a, b) for a, b in zip(runs[0], want))
                    del runs
                    entry["ms"] = mean_ms(run, dev, reps)[0]
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is recorded
                    entry["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                out.append(entry)
                print(json.dumps(entry), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # FlashInfer's backend for the forward (RAGGED_COMPILE_BACKEND; auto: the op's choice)
    res = {"environment": environment(), "dtype": str(dtype),
           "flashinfer_backend": os.environ.get("RAGGED_COMPILE_BACKEND") or "auto", "rows": []}
    if a.sweep:
        res["sweep"] = sweep(dev, dtype, a.reps, a.smoke)
        (out / "softcap-sweep.json").write_text(json.dumps(res, indent=1) + "\n")
        return
    for spec in ROWS:
        try:
            r = row(*spec, dev, dtype, a.reps, a.smoke)
        except Exception as e:  # noqa: BLE001 - a failing row is recorded, the others run
            r = {"row": spec[0], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
    _write(out / "softcap", res)


def _write(stem: pathlib.Path, res: dict) -> None:
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    fmt = lambda r, k, f="%.2f": f % r[k] if k in r else ""  # noqa: E731
    lines = ["# Soft-capped attention, forward and backward: the op against Gemma2's eager attention", "",
             f"Environment: `{json.dumps(res['environment'])}`", "",
             "| row | layout | tokens | heads | d | window | ours ms | backward alone ms | eager (padded) ms | "
             "ours / eager | reference grads ms | FA2 without cap ms | worst rel. err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:100]} |" + " |" * 11)
            continue
        err = max(v for k, v in r.items() if k.startswith("rel_err"))
        lines.append(f"| {r['row']} | {r['layout']} | {r['tokens']} | {r['hq']}/{r['hkv']} | {r['head_dim']} | "
                     f"{tuple(r['window'])} | {fmt(r, 'ours_ms')} | {fmt(r, 'ours_backward_ms')} | "
                     f"{fmt(r, 'eager_ms') or r.get('eager_error', '')[:30]} | {fmt(r, 'ours_over_eager_speed', '%.2fx')} | "
                     f"{fmt(r, 'reference_ms')} | {fmt(r, 'fa2_nocap_ms')} | {err:.1e} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
