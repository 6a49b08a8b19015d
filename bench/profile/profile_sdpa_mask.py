"""What SDPA costs a padded batch per call, by the form of its mask, and what a
BERT-base forward costs on "sdpa" against our small-batch route with each form.

SDPA runs cuDNN's attention on the H200; a bool mask is converted to an additive
one inside every call (two elementwise kernels, ~35 us of host time), where an
additive mask costs what no mask does. Per mask form: host and wall us per call,
and the CUDA kernels of one call; per shape: BERT-base forward wall ms in
rotating rounds, and Python profiles of one forward of each.

    python bench/profile/profile_sdpa_mask.py bench/results
"""

import json
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from env import environment  # noqa: E402

if not torch.cuda.is_available():
    print("profile_sdpa_mask.py measures CUDA calls: no CUDA device here")
    sys.exit(0)
from torch.profiler import profile, ProfilerActivity
out = {}
dev = torch.device("cuda")
def host_us(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize(); w = (time.perf_counter() - t) / n * 1e6
    return round(h, 1), round(w, 1)
def kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    return sorted({e.name[:60] for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA})
for b, s in ((64, 48), (64, 128), (16, 512)):
    h, d = 12, 64
    x = torch.randn(b, s, 3 * h * d, device=dev, dtype=torch.bfloat16)
    q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in x.chunk(3, -1))
    lens = torch.randint(s // 2, s + 1, (b,), device=dev)
    valid = torch.arange(s, device=dev)[None] < lens[:, None]
    masks = {
        "stock_4d_bool": valid[:, None, None, :].expand(b, 1, s, s).contiguous(),
        "b11s_bool": valid[:, None, None, :],
        "b11s_expand_view": valid[:, None, None, :].expand(b, 1, s, s),
        "b11s_additive": torch.zeros(b, 1, 1, s, device=dev, dtype=torch.bfloat16).masked_fill(~valid[:, None, None, :], float("-inf")),
        "none": None,
    }
    row = {}
    for name, m in masks.items():
        fn = lambda m=m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.125)
        row[name] = {"host_wall_us": host_us(fn), "kernels": kernels(fn)}
    out[f"sdpa_{b}x{s}"] = row
    print(json.dumps(row), flush=True)
# whole BERT-base forwards: stock vs our dense route with each mask form
from bench_host import _bert, _padded_batch, _rounds
from ragged_compile import hf
name = hf.register()
real = hf._dense_mask  # (mask, dtype) -> the additive [B, 1, 1, Sk] mask the route builds
forms = {
    "b11s_additive": lambda m, dt, s: real(m, dt),
    "b11s_bool": lambda m, dt, s: real(m, dt) == 0,
    "stock_4d_bool": lambda m, dt, s: (real(m, dt) == 0).expand(m.shape[0], 1, s, m.shape[1]).contiguous(),
}
for b, s in ((64, 48), (64, 128), (16, 512)):
    ids, mask, lens = _padded_batch(b, s, dev)
    sd = _bert(dev, torch.bfloat16, 12, 768, 12, "sdpa")
    ours = _bert(dev, torch.bfloat16, 12, 768, 12, name); ours.load_state_dict(sd.state_dict())
    fns = {"sdpa": lambda: sd(input_ids=ids, attention_mask=mask).last_hidden_state}
    def mk(form):
        def f():
            hf._dense_mask = lambda m, dt: forms[form](m, dt, s)
            try:
                return ours(input_ids=ids, attention_mask=mask).last_hidden_state
            finally:
                hf._dense_mask = real
        return f
    for form in forms:
        fns["ours_" + form] = mk(form)
    with torch.no_grad():
        res = _rounds(fns, dev, 1.0)
        row = {k: round(sorted(t[1] for t in v)[len(v) // 2], 3) for k, v in res.items()}
        # host split of one forward: python profile of ours (b11s) by cumulative time
        import cProfile, pstats, io
        pr = cProfile.Profile(); f = fns["ours_b11s_additive"]
        for _ in range(3): f()
        torch.cuda.synchronize(); pr.enable()
        for _ in range(20): f()
        pr.disable(); torch.cuda.synchronize()
        sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(18)
        row["profile_ours"] = sio.getvalue()[-4000:]
        pr = cProfile.Profile(); f = fns["sdpa"]
        for _ in range(3): f()
        torch.cuda.synchronize(); pr.enable()
        for _ in range(20): f()
        pr.disable(); torch.cuda.synchronize()
        sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(18)
        row["profile_sdpa"] = sio.getvalue()[-4000:]
    out[f"bert_{b}x{s}"] = row
    print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results").mkdir(parents=True, exist_ok=True)
json.dump({"environment": environment(), **out}, open(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results") / "profile_sdpa_mask.json", "w"), indent=1)
