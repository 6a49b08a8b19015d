"""Where a small batch's host time goes, call by call and forward by forward.

* ``op``: microseconds per call (eager, planned layout, a batch small enough that
  the host decides the time) of each layer of our path, from the allocation and
  FlashInfer's kernel launch up to the public function, beside dense SDPA.
* ``forward``: padded BERT-base forwards (``"sdpa"``, ours, the batch packed by
  hand): wall ms back to back; the host's time to issue one forward while the
  GPU sleeps 200 ms (a forward that waits for the GPU anywhere takes ~200 ms
  here, and Python's profiler of that forward names the call that waited);
  syncs PyTorch sees (its sync debug mode); CUDA runtime calls per forward.

    python bench/profile/profile_host.py --out bench/results
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
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_host import _bert, _packed, _padded_batch, per_call_us  # noqa: E402
from env import environment  # noqa: E402
from profile_hf import _hand_packed, _runtime_calls  # noqa: E402
from timing import time_fn  # noqa: E402

import ragged_compile as rc  # noqa: E402
from ragged_compile import ops  # noqa: E402
from ragged_compile.backends import flashinfer as fi  # noqa: E402


def _dlpack_env() -> dict:
    out = {}
    try:
        import tvm_ffi

        out["tvm_ffi"] = getattr(tvm_ffi, "__version__", "?")
    except Exception as err:  # noqa: BLE001
        out["tvm_ffi"] = repr(err)
    for name in ("__c_dlpack_exchange_api__", "__dlpack_c_exchange_api__"):
        out[name] = hasattr(torch.Tensor, name)
    try:
        import torch_c_dlpack_ext  # noqa: F401  (only whether it imports)

        out["torch_c_dlpack_ext"] = True
    except Exception as err:  # noqa: BLE001
        out["torch_c_dlpack_ext"] = repr(err)
    return out


def op_rows(dev, dtype, reps) -> dict:
    lens = [9 + (i * 7) % 25 for i in range(32)]
    heads, d = 12, 64
    q, k, v, cu = _packed(lens, heads, heads, d, dtype, dev)
    scale = d ** -0.5
    rt = rc.Runtime(dev)
    rows = {}
    with torch.no_grad(), rt.step(lens) as step:
        rc.ragged_attention(q, k, v, cu)  # plans
        slot = next(iter(step.plans.values()))[0]
        w = slot.wrapper
        fns = {
            "torch_empty": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
            "torch_empty_like": lambda: torch.empty_like(q),
            "wrapper_run": lambda: w.run(q, k, v),
            "wrapper_run_no_pdl": lambda: w.run(q, k, v, enable_pdl=False),
            "fi_run_replayed": lambda: fi.run(w, q, k, v),
            "step_attention": lambda: step.attention(q, k, v, cu, cu, False, scale),
            "runtime_attention": lambda: rt.attention(q, k, v, cu, cu, False, scale),
            "ops_attention": lambda: ops.attention(q, k, v, cu, cu, False, scale, checked=True),
            "ragged_attention": lambda: rc.ragged_attention(q, k, v, cu),
            "dispatcher": lambda: torch.ops.ragged_compile.ragged_attention(q, k, v, cu, cu, False, scale),
        }
        b, s = len(lens), max(lens)
        qd = torch.randn(b, heads, s, d, device=dev, dtype=dtype)
        fns["sdpa_dense"] = lambda: F.scaled_dot_product_attention(qd, qd, qd)
        for name, fn in fns.items():
            rows[name] = round(per_call_us(fn, dev, reps), 2)
        rows["profile"] = _cprofile(fns["ragged_attention"], dev, 10 * 200, 30)
    return rows


def _cprofile(fn, dev, calls, lines, callers=()) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(dev)
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf).sort_stats("tottime")
    st.print_stats(lines)
    for c in callers:
        st.print_callers(c)
    return buf.getvalue()


def _issue_while_gpu_sleeps(fn, dev, sleep_ms=200.0):
    """Host ms to issue ``fn()`` while the GPU sleeps ``sleep_ms``, and Python's
    profile of that call: a call that waits for the GPU takes about ``sleep_ms``."""
    fn()
    torch.cuda.synchronize(dev)
    cycles = int(sleep_ms * 2e6)  # ~2 GHz SM clocks
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(cycles)
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    torch.cuda.synchronize(dev)
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(12)
    return round(host, 3), buf.getvalue()


def _sync_stacks(fn, dev, keep=4) -> dict:
    fn()
    torch.cuda.synchronize(dev)
    import traceback

    stacks = []
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        orig = warnings.showwarning
        torch.cuda.set_sync_debug_mode(1)
        try:

            def hook(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message) and len(stacks) < keep:
                    stacks.append("".join(traceback.format_stack(limit=14)[:-2]))
                return orig(message, category, filename, lineno, file, line)

            warnings.showwarning = hook
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = orig
    n = sum("synchroniz" in str(w.message) for w in log)
    return {"count": n, "messages": sorted({str(w.message)[:160] for w in log})[:4], "stacks": stacks}


def _host_split(fn, dev, names, reps=30) -> dict:
    """Host us per forward (the GPU idle at each start, so no wait is counted) in the
    attention function of each name in ``names`` (its first call of the forward, the
    others together) and in its mask function, and the whole forward's."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    acc = {"forward": 0.0, "attention_first": 0.0, "attention_rest": 0.0, "mask": 0.0}
    calls = [0]
    saved = {}

    def timed_attention(inner):
        def f(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            acc["attention_first" if calls[0] == 0 else "attention_rest"] += time.perf_counter() - t
            calls[0] += 1
            return out
        return f

    def timed_mask(inner):
        def f(*a, **k):
            t = time.perf_counter()
            out = inner(*a, **k)
            acc["mask"] += time.perf_counter() - t
            return out
        return f

    for name in names:
        saved[name] = (ALL_ATTENTION_FUNCTIONS._global_mapping[name], ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name])
        ALL_ATTENTION_FUNCTIONS._global_mapping[name] = timed_attention(saved[name][0])
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name] = timed_mask(saved[name][1])
    try:
        fn()
        for key in acc:
            acc[key] = 0.0
        for _ in range(reps):
            torch.cuda.synchronize(dev)
            calls[0] = 0
            t = time.perf_counter()
            fn()
            acc["forward"] += time.perf_counter() - t
        torch.cuda.synchronize(dev)
    finally:
        for name, (att, mask) in saved.items():
            ALL_ATTENTION_FUNCTIONS._global_mapping[name] = att
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name] = mask
    return {k: round(v / reps * 1e6, 1) for k, v in acc.items()}


def forward_rows(dev, dtype, shapes) -> list[dict]:
    from ragged_compile import hf

    name = hf.register()
    sdpa = _bert(dev, dtype, 12, 768, 12, "sdpa")
    ours = _bert(dev, dtype, 12, 768, 12, name)
    ours.load_state_dict(sdpa.state_dict())
    out = []
    for b, s in shapes:
        ids, mask, lens = _padded_batch(b, s, dev)
        packed = _hand_packed(ids, mask)
        fns = {
            "sdpa": lambda: sdpa(input_ids=ids, attention_mask=mask).last_hidden_state,
            "ours": lambda: ours(input_ids=ids, attention_mask=mask).last_hidden_state,
            "hand_packed": lambda: ours(**packed).last_hidden_state,
        }
        row = {"batch": b, "length": s}
        with torch.no_grad():
            for key, fn in fns.items():
                try:
                    t = time_fn(fn, dev, warmup=3, min_reps=20)
                    host, prof = _issue_while_gpu_sleeps(fn, dev)
                    row[key] = {
                        "wall_ms": round(t["wall_ms"], 3), "event_ms": round(t["ms"], 3),
                        "host_us": _host_split(fn, dev, ("sdpa", name)),
                        "issue_ms_gpu_asleep": host, "issue_profile": prof,
                        "syncs": _sync_stacks(fn, dev), "runtime_calls": _runtime_calls(fn),
                    }
                except Exception as err:  # noqa: BLE001
                    row[key] = {"error": repr(err)[:400]}
                print(key, b, s, {k: v for k, v in row[key].items() if k not in ("issue_profile", "runtime_calls", "syncs")},
                      flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--only", default="op,forward")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_host.py measures CUDA calls: no CUDA device here")
        return
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    res = {"environment": environment(), "dlpack": _dlpack_env()}
    print(json.dumps(res["dlpack"]), flush=True)
    only = set(a.only.split(","))
    if "op" in only:
        res["op"] = op_rows(dev, dtype, 2000)
        print(json.dumps({k: v for k, v in res["op"].items() if k != "profile"}), flush=True)
    if "forward" in only:
        res["forward"] = forward_rows(dev, dtype, [(64, 48), (64, 128), (16, 512), (256, 128)])
    path = pathlib.Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "profile_host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
