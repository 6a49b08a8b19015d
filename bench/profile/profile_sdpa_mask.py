"""What SDPA costs a padded batch per call, by the form of its mask, and what a
BERT-base forward costs on "sdpa" against our small-batch route with each form.

SDPA runs cuDNN's attention on the H200; a bool mask is converted to an additive
one inside every call (two elementwise kernels, ~35 us of host time), where an
additive mask costs what no mask does. Per mask form: host and wall us per call,
and the CUDA kernels of one call; per shape: BERT-base forward wall ms in
rotating rounds, and Python profiles of one forward of each.

    python bench/profile/profile_sdpa_mask.py --out bench/results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_host import _bert, _padded_batch, _rounds  # noqa: E402
from env import environment  # noqa: E402

SHAPES = ((64, 48), (64, 128), (16, 512))


def _host_us(fn, n: int = 300) -> tuple[float, float]:
    """(host, wall) microseconds per call back to back, synced once at the end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(host, 1), round((time.perf_counter() - t) / n * 1e6, 1)


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def sdpa_rows(dev) -> dict:
    """SDPA on BERT-base-shaped q/k/v (a view of one projection, as the model has
    them) with each form of a padding mask."""
    rows = {}
    for b, s in SHAPES:
        h, d = 12, 64
        x = torch.randn(b, s, 3 * h * d, device=dev, dtype=torch.bfloat16)
        q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in x.chunk(3, -1))
        valid = torch.arange(s, device=dev)[None] < torch.randint(s // 2, s + 1, (b,), device=dev)[:, None]
        masks = {
            "stock_4d_bool": valid[:, None, None, :].expand(b, 1, s, s).contiguous(),
            "b11s_bool": valid[:, None, None, :],
            "b11s_expand_view": valid[:, None, None, :].expand(b, 1, s, s),
            "b11s_additive": torch.zeros(b, 1, 1, s, device=dev, dtype=torch.bfloat16).masked_fill(
                ~valid[:, None, None, :], float("-inf")
            ),
            "none": None,
        }
        row = {}
        for name, m in masks.items():
            fn = lambda m=m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125)  # noqa: E731
            row[name] = {"host_wall_us": _host_us(fn), "kernels": _kernels(fn)}
        rows[f"sdpa_{b}x{s}"] = row
        print(json.dumps(row), flush=True)
    return rows


def _python_profile(fn, calls: int = 20) -> str:
    """Python's profile of ``calls`` forwards, by own time (the tail of its table)."""
    pr = cProfile.Profile()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    sio = io.StringIO()
    pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(18)
    return sio.getvalue()[-4000:]


def bert_rows(dev) -> dict:
    """BERT-base forwards on ``"sdpa"`` against our small-batch route handing SDPA
    each form of the mask (``hf._dense_mask`` swapped for the run)."""
    from ragged_compile import hf

    name = hf.register()
    real = hf._dense_mask  # (mask, dtype) -> the additive [B, 1, 1, Sk] mask the route builds
    forms = {
        "b11s_additive": lambda m, dt, s: real(m, dt),
        "b11s_bool": lambda m, dt, s: real(m, dt) == 0,
        "stock_4d_bool": lambda m, dt, s: (real(m, dt) == 0).expand(m.shape[0], 1, s, m.shape[1]).contiguous(),
    }
    rows = {}
    for b, s in SHAPES:
        ids, mask, _ = _padded_batch(b, s, dev)
        sdpa = _bert(dev, torch.bfloat16, 12, 768, 12, "sdpa")
        ours = _bert(dev, torch.bfloat16, 12, 768, 12, name)
        ours.load_state_dict(sdpa.state_dict())
        fns = {"sdpa": lambda: sdpa(input_ids=ids, attention_mask=mask).last_hidden_state}

        def with_form(form, s=s):
            def forward():
                hf._dense_mask = lambda m, dt: forms[form](m, dt, s)
                try:
                    return ours(input_ids=ids, attention_mask=mask).last_hidden_state
                finally:
                    hf._dense_mask = real

            return forward

        fns.update({"ours_" + form: with_form(form) for form in forms})
        with torch.no_grad():
            times = _rounds(fns, dev, 1.0)
            row = {k: round(sorted(t[1] for t in v)[len(v) // 2], 3) for k, v in times.items()}
            row["profile_ours"] = _python_profile(fns["ours_b11s_additive"])
            row["profile_sdpa"] = _python_profile(fns["sdpa"])
        rows[f"bert_{b}x{s}"] = row
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_sdpa_mask.py measures CUDA calls: no CUDA device here")
        return
    dev = torch.device("cuda")
    res = {"environment": environment(), **sdpa_rows(dev), **bert_rows(dev)}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_sdpa_mask.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
