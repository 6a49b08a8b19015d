#!/usr/bin/env python
"""Ragged attention, side by side: ragged_compile against FlashInfer, torch
varlen_attn, NJT SDPA, FlexAttention and padded SDPA, per op and end to end.

    python bench/bench_attention.py                 # everything -> bench/results/
    python bench/bench_attention.py --only ops      # per-op table only
    python bench/bench_attention.py --only e2e      # 8-layer encoder only
    python bench/bench_attention.py --smoke --out /tmp/smoke   # tiny sizes, CPU ok

Writes attention.json (every number, the environment and every error string),
attention.md (tables) and attention.png (ms per implementation, one panel per
layout). Every measurement runs in its own try/except: a failure is recorded and
the run goes on. Outputs are rewritten after every measurement, so a run cut
short (time limit, crash) still leaves what it measured. With --only, the other
section of an existing attention.json in --out is kept. See bench/README.md for
what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import inspect
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ragged_compile is imported defensively: if it fails to import on the GPU
# machine's torch, the baselines are still measured and every row of ours says why.
try:
    import ragged_compile as rc

    RC_IMPORT_ERROR = None
except Exception as _e:  # noqa: BLE001
    rc = None
    RC_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"
try:
    from ragged_compile.reference import dense_attention, reference_attention
except Exception:  # noqa: BLE001 - the oracle only needs torch: load the file itself
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_rc_reference", os.path.join(ROOT, "ragged_compile", "reference.py")
    )
    _ref = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_ref)
    dense_attention, reference_attention = _ref.dense_attention, _ref.reference_attention

try:
    from env import environment  # bench/env.py
except Exception as _e:  # noqa: BLE001

    def environment(_err=repr(_e)) -> dict:
        return {"torch": torch.__version__, "env_py": f"unavailable: {_err}"}


DTYPE = torch.bfloat16
TOL = 2e-2  # max abs diff vs the float32 reference that still counts as correct (bf16)
E2E_REL_TOL = 5e-2  # e2e: max abs diff / max abs value vs ours_packed_eager
T_START = time.perf_counter()


# --------------------------------------------------------------------------- utils
def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def err_str(e: BaseException, limit: int = 700) -> str:
    s = f"{type(e).__name__}: {e}".strip()
    return s if len(s) <= limit else s[:limit] + " ...[truncated]"


def tb_tail(limit: int = 1500) -> str:
    s = traceback.format_exc()
    return s[-limit:]


def need_rc(attr: str | None = None):
    """ragged_compile (or one of its attributes), or an error that says why not."""
    if rc is None:
        raise RuntimeError(f"ragged_compile failed to import: {RC_IMPORT_ERROR}")
    if attr is not None and not hasattr(rc, attr):
        raise Skip(f"not available: ragged_compile.{attr} does not exist in this checkout")
    return rc if attr is None else getattr(rc, attr)


class Skip(Exception):
    """Not measured here, with the reason (status "skipped")."""

    status = "skipped"


class Unsupported(Skip):
    """The implementation cannot express this case (status "unsupported")."""

    status = "unsupported"


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - T_START)

    def check(self, need: float = 15.0) -> None:
        if self.left() < need:
            raise Skip(f"time budget exhausted ({self.seconds:.0f} s, --time-budget-s)")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def has_kwarg(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def raise_recompile_limits() -> None:
    cfg = torch._dynamo.config
    for name, val in (
        ("recompile_limit", 64),
        ("cache_size_limit", 64),
        ("accumulated_recompile_limit", 1024),
        ("accumulated_cache_size_limit", 1024),
    ):
        if hasattr(cfg, name):
            with contextlib.suppress(Exception):
                setattr(cfg, name, max(int(getattr(cfg, name)), val))


def median(xs):
    return float(statistics.median(xs)) if xs else None


def sanitize(o):
    """JSON-safe copy: non-finite floats become strings, unknown objects repr."""
    if isinstance(o, dict):
        return {str(k): sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize(v) for v in o]
    if isinstance(o, bool) or o is None or isinstance(o, (int, str)):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else str(o)
    if isinstance(o, torch.dtype):
        return str(o)
    try:
        return float(o)
    except Exception:  # noqa: BLE001
        return repr(o)


def all_runtime_stats(extra=()) -> Counter:
    """Sum of stats over every ragged_compile runtime we know of."""
    total: Counter = Counter()
    seen = set()
    rts = list(extra)
    with contextlib.suppress(Exception):
        rts += list(rc.runtime._runtimes.values())
    for rt in rts:
        if id(rt) in seen:
            continue
        seen.add(id(rt))
        with contextlib.suppress(Exception):
            total.update(rt.stats)
    return total


def stats_delta(after: Counter, before: Counter) -> dict:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)}


def auto_backend(dev: torch.device, n: int, total_k: int) -> str:
    """What ragged_compile's backend="auto" picks for a layout (its own rule if importable)."""
    try:
        from ragged_compile.backends.flashinfer import choose_backend

        return choose_backend("auto", dev, n, total_k)
    except Exception:  # noqa: BLE001 - same rule as of this writing
        sm90 = torch.cuda.get_device_capability(dev) == (9, 0)
        return "fa3" if sm90 and total_k / max(n, 1) >= 256 else "fa2"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float().to(a.device)).abs().max().item())


# --------------------------------------------------------------------------- timing
def time_fn(fn, dev: torch.device, *, warmup: int, min_reps: int, max_reps: int, target_s: float) -> dict:
    """Median time per call. CUDA: events around each of back-to-back calls (GPU
    time as the stream sees it, including host gaps if the host is the bottleneck)
    plus a wall-clock average over the same number of calls."""
    for _ in range(warmup):
        fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(min_reps, target_s / est)))
    if dev.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(dev)
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        wall = (time.perf_counter() - t0) / reps * 1e3
        method = "cuda_events_back_to_back"
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        wall = sum(times) / len(times)
        method = "perf_counter"
    return {
        "ms": median(times),
        "ms_min": times[0],
        "ms_p10": times[len(times) // 10],
        "ms_p90": times[(len(times) * 9) // 10],
        "wall_ms": wall,
        "reps": reps,
        "timing": method,
    }


def host_ms(fn, dev, reps: int, between=None) -> float:
    """Median host wall time of fn() (synced before, not after, unless between)."""
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
        if between is not None:
            between()
    return median(ts)


# --------------------------------------------------------------------------- layouts
LAYOUT_SPECS = [
    # name, kind, hq, hkv, d, causal
    ("mixed16", "mixed", 16, 16, 128, False),
    ("mixed16_causal", "mixed", 16, 16, 128, True),
    ("short250", "short", 16, 16, 128, False),
    ("long4x8192", "long", 16, 16, 128, False),
    ("gqa32_8", "mixed", 32, 8, 128, False),
    ("mixed16_d64", "mixed", 16, 16, 64, False),
    ("mixed16_d72", "mixed", 16, 16, 72, False),
]


@functools.cache
def lengths_for(kind: str, smoke: bool) -> tuple[int, ...]:
    if kind == "mixed":
        n, lo, hi, want = (4, 8, 64, (100, 220)) if smoke else (16, 64, 4096, (33000, 36000))
        for seed in range(10_000):
            g = torch.Generator().manual_seed(1000 + seed)
            lens = torch.randint(lo, hi + 1, (n,), generator=g)
            lens[0], lens[1] = lo, hi  # both ends of the range ride along
            lens = lens[torch.randperm(n, generator=g)]
            if want[0] <= int(lens.sum()) <= want[1]:
                return tuple(int(x) for x in lens)
        raise RuntimeError("no seed gave a mixed layout in range")
    if kind == "short":
        n, lo, hi = (12, 2, 16) if smoke else (250, 16, 256)
        g = torch.Generator().manual_seed(2)
        return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=g))
    if kind == "long":
        return (96, 96) if smoke else (8192,) * 4
    raise ValueError(kind)


def useful_pairs(lq: int, lk: int, causal: bool) -> int:
    """(query, key) pairs actually attended; causal aligned bottom-right."""
    if not causal:
        return lq * lk
    off = lk - lq
    return sum(min(lk, max(0, i + off + 1)) for i in range(lq))


class Case:
    """One layout's tensors and metadata, on the device."""

    def __init__(self, name, kind, hq, hkv, d, causal, dev, smoke, seed):
        self.name, self.kind, self.causal, self.dev = name, kind, causal, dev
        if smoke:
            hq, hkv = (4, 2) if hq != hkv else (2, 2)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.lens = list(lengths_for(kind, smoke))
        self.n = len(self.lens)
        self.total = sum(self.lens)
        self.max_len, self.min_len = max(self.lens), min(self.lens)
        self.scale = d**-0.5
        cu = torch.zeros(self.n + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(self.lens, dtype=torch.int64), 0)
        self.cu_host = cu
        self.cu = cu.to(dev)  # int32 offsets on the device
        self.cu64 = self.cu.long()
        g = torch.Generator(device=dev).manual_seed(seed)
        self.q = torch.randn(self.total, hq, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        self.k = torch.randn(self.total, hkv, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        self.v = torch.randn(self.total, hkv, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        self.pairs = sum(useful_pairs(L, L, causal) for L in self.lens)
        self.flops = 4 * self.pairs * hq * d
        self.ref: torch.Tensor | None = None
        self.ours: torch.Tensor | None = None

    def describe(self) -> dict:
        return {
            "segments": self.n,
            "tokens": self.total,
            "min_len": self.min_len,
            "max_len": self.max_len,
            "hq": self.hq,
            "hkv": self.hkv,
            "head_dim": self.d,
            "causal": self.causal,
            "dtype": str(DTYPE),
            "attended_pairs": self.pairs,
            "useful_flops": self.flops,
            "lengths": self.lens,
        }


class Prepared:
    def __init__(self, fn, to_out=lambda r: r, extra=None, stats=None, note=None):
        self.fn, self.to_out, self.extra, self.stats = fn, to_out, extra or {}, stats
        self.note = note


# --------------------------------------------------------------------------- shared state
class Shared:
    """Objects kept across layouts: runtimes, FlashInfer workspace, compiled fns."""

    def __init__(self, dev):
        self.dev = dev
        self._runtimes = {}
        self._workspace = None
        self._compiled = {}

    def runtime(self, backend: str):
        need_rc()
        if backend not in self._runtimes:
            if self.dev.type == "cuda":
                self._runtimes[backend] = rc.Runtime(self.dev, backend=backend)
            else:
                self._runtimes[backend] = rc.Runtime(self.dev)
        return self._runtimes[backend]

    def workspace(self):
        if self._workspace is None:
            self._workspace = torch.empty(256 << 20, dtype=torch.uint8, device=self.dev)
        return self._workspace

    def compiled(self, key, make):
        if key not in self._compiled:
            self._compiled[key] = make()
        return self._compiled[key]


# --------------------------------------------------------------------------- per-op implementations
def _ours_fn(c: Case):
    need_rc()
    return lambda: rc.ragged_attention(c.q, c.k, c.v, c.cu, causal=c.causal, scale=c.scale)


def _plan_cost(rt, c: Case, f, reps: int = 7) -> dict:
    """plan_ms = median(enter a fresh step + first call, synced) - median(a call, synced)."""
    dev = c.dev

    def fresh():
        with rt.step(c.lens):
            f()
            sync(dev)

    firsts = [host_ms(fresh, dev, 1) for _ in range(reps)]
    first = median(firsts)
    with rt.step(c.lens):
        f()
        sync(dev)

        def steady():
            f()
            sync(dev)

        plain = host_ms(steady, dev, reps)
    return {
        "plan_ms": first - plain,
        "plan_ms_min": min(firsts) - plain,
        "fresh_step_first_call_ms": first,
        "steady_call_synced_ms": plain,
    }


def impl_ours(c: Case, sh: Shared, stack, backend="auto", compiled=False) -> Prepared:
    if backend != "auto" and c.dev.type != "cuda":
        raise Skip("CUDA only: forcing a FlashInfer backend needs a GPU (CPU runs the reference kernel)")
    rt = sh.runtime(backend)
    if compiled:
        causal, scale = c.causal, c.scale

        def attn(q, k, v, cu):
            return rc.ragged_attention(q, k, v, cu, causal=causal, scale=scale)

        cf = torch.compile(attn, fullgraph=True, dynamic=False)
        f = lambda: cf(c.q, c.k, c.v, c.cu)  # noqa: E731
    else:
        f = _ours_fn(c)
    with rt.step(c.lens):  # first call: FlashInfer JIT / torch.compile
        f()
        sync(c.dev)
    extra = {}
    try:
        extra.update(_plan_cost(rt, c, f))
        if c.dev.type != "cuda":
            extra["plan_ms_note"] = "CPU: the reference kernel never plans; plan_ms is noise here"
    except Exception as e:  # noqa: BLE001
        extra["plan_ms_error"] = err_str(e)
    stack.enter_context(rt.step(c.lens))  # the step stays open while timing: one plan, then hot path
    f()
    sync(c.dev)
    extra["backend_used"] = getattr(rt, "last_backend", None)
    if extra["backend_used"] is None and c.dev.type == "cuda":
        extra["backend_used"] = backend if backend != "auto" else auto_backend(c.dev, c.n, c.total)
    extra["runtime_backend"] = backend
    return Prepared(f, extra=extra, stats=lambda: Counter(rt.stats))


def _fi_direct(c: Case, sh: Shared, backend: str):
    """A FlashInfer ragged wrapper for this case: (run callable, plan callable, note)."""
    if c.dev.type != "cuda":
        raise Skip("CUDA only")
    if backend == "fa3" and torch.cuda.get_device_capability(c.dev) != (9, 0):
        raise Unsupported("fa3 needs SM90")
    import flashinfer

    dp = next((x for x in (64, 128, 256) if x >= c.d), None)
    if dp is None:
        raise Unsupported(f"head_dim {c.d} > 256")
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(sh.workspace(), kv_layout="NHD", backend=backend)
    kw = dict(causal=c.causal, sm_scale=c.scale, q_data_type=DTYPE, kv_data_type=DTYPE)
    if has_kwarg(w.plan, "o_data_type"):
        kw["o_data_type"] = DTYPE

    def plan():
        w.plan(c.cu_host, c.cu_host, c.hq, c.hkv, dp, **kw)

    q, k, v = c.q, c.k, c.v
    note = None
    if dp != c.d:
        # FlashInfer fa2 is silently wrong for head dims like 72 and fa3 lacks them
        # (NOTES / flashinfer issue 4299): zero-pad by hand, true scale, slice back.
        note = f"head_dim {c.d} zero-padded to {dp} inside the timed call (as ours does)"
        pad = (0, dp - c.d)
        f = lambda: w.run(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad))[..., : c.d]  # noqa: E731
    else:
        f = lambda: w.run(q, k, v)  # noqa: E731
    return f, plan, note


def impl_flashinfer(c: Case, sh: Shared, stack, backend: str) -> Prepared:
    f, plan, note = _fi_direct(c, sh, backend)
    plan()
    sync(c.dev)
    extra = {"plan_ms": host_ms(plan, c.dev, 5, between=lambda: sync(c.dev))}
    plan()
    sync(c.dev)
    return Prepared(f, extra=extra, note=note)


def paired_vs_flashinfer(c: Case, sh: Shared, backend: str, rounds: int = 6, reps: int = 30) -> dict:
    """ours_eager and FlashInfer (the backend ours picked) timed in alternating blocks,
    so clock / thermal drift between rows cannot pass for overhead."""
    f_fi, plan, _ = _fi_direct(c, sh, backend)
    rt = sh.runtime("auto")
    f_ours = _ours_fn(c)
    ours, fi = [], []
    plan()
    with rt.step(c.lens):
        f_ours()
        f_fi()
        sync(c.dev)
        for r in range(rounds):
            order = ((f_ours, ours), (f_fi, fi)) if r % 2 == 0 else ((f_fi, fi), (f_ours, ours))
            for fn, acc in order:
                acc.append(time_fn(fn, c.dev, warmup=2, min_reps=reps, max_reps=reps, target_s=0)["ms"])
    o, g = median(ours), median(fi)
    return {
        "backend": backend,
        "ours_ms": o,
        "flashinfer_ms": g,
        "ratio": o / g,
        "ours_blocks_ms": ours,
        "flashinfer_blocks_ms": fi,
    }


def impl_varlen(c: Case, sh: Shared, stack) -> Prepared:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"torch.nn.attention.varlen.varlen_attn not in torch {torch.__version__}: {err_str(e)}")
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "scale" in params:
        kw["scale"] = c.scale
    elif abs(c.scale - c.d**-0.5) > 1e-12:
        raise Unsupported("varlen_attn has no scale argument")
    if c.causal:
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise Unsupported("varlen_attn has neither is_causal nor window_size")
    if c.hq != c.hkv:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            raise Unsupported(f"no GQA: varlen_attn of torch {torch.__version__} has no enable_gqa")
    q, k, v, cu, m = c.q, c.k, c.v, c.cu, c.max_len
    f = lambda: varlen_attn(q, k, v, cu, cu, m, m, **kw)  # noqa: E731
    return Prepared(f, to_out=lambda r: r[0] if isinstance(r, tuple) else r, extra={"kwargs": sorted(kw)})


def _njt(c: Case, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    kw = {}
    if has_kwarg(torch.nested.nested_tensor_from_jagged, "min_seqlen"):
        kw = {"min_seqlen": c.min_len, "max_seqlen": c.max_len}
    return torch.nested.nested_tensor_from_jagged(x, offsets, **kw)


def impl_njt(c: Case, sh: Shared, stack, compiled=False) -> Prepared:
    off = c.cu64
    qn, kn, vn = (_njt(c, x, off) for x in (c.q, c.k, c.v))  # [B, j, H, D], one nested int
    kw = {"is_causal": c.causal, "scale": c.scale}
    if c.hq != c.hkv:
        kw["enable_gqa"] = True  # NJT SDPA is expected to reject this: recorded as an error

    def attn(qn, kn, vn):
        o = F.scaled_dot_product_attention(qn.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2), **kw)
        return o.transpose(1, 2)

    fn = torch.compile(attn, fullgraph=True) if compiled else attn
    f = lambda: fn(qn, kn, vn)  # noqa: E731
    return Prepared(f, to_out=lambda r: r.values(), note="NJTs [B, j, H, D] built outside the timed call")


def impl_flex(c: Case, sh: Shared, stack) -> Prepared:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"flex_attention unavailable: {err_str(e)}")
    dev = c.dev
    doc = torch.repeat_interleave(
        torch.arange(c.n, device=dev, dtype=torch.int32), torch.tensor(c.lens, device=dev)
    )
    if c.causal:

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

    T = c.total

    def make_mask():
        return create_block_mask(mask_mod, None, None, T, T, device=dev)

    bm = make_mask()
    sync(dev)
    extra = {"block_mask_ms": host_ms(lambda: (make_mask(), sync(dev)), dev, 3)}
    q4 = c.q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, T, D]
    k4 = c.k.transpose(0, 1).unsqueeze(0).contiguous()
    v4 = c.v.transpose(0, 1).unsqueeze(0).contiguous()
    kw = {"block_mask": bm, "scale": c.scale}
    if c.hq != c.hkv:
        kw["enable_gqa"] = True
    cflex = sh.compiled("flex", lambda: torch.compile(flex_attention, dynamic=False))
    f = lambda: cflex(q4, k4, v4, **kw)  # noqa: E731
    return Prepared(
        f,
        to_out=lambda r: (r[0] if isinstance(r, tuple) else r)[0].transpose(0, 1),
        extra=extra,
        note="packed [1, H, T, D] with a document mask, compiled flex_attention; block mask built outside the timed call",
    )


def impl_padded(c: Case, sh: Shared, stack) -> Prepared:
    dev, B, L = c.dev, c.n, c.max_len
    lens = torch.tensor(c.lens, device=dev)
    b_idx = torch.repeat_interleave(torch.arange(B, device=dev), lens)
    pos = torch.arange(c.total, device=dev) - torch.repeat_interleave(c.cu64[:-1], lens)

    def pad(x):
        p = x.new_zeros(B, L, x.shape[1], x.shape[2])
        p[b_idx, pos] = x
        return p.transpose(1, 2).contiguous()  # [B, H, L, D]

    qp, kp, vp = pad(c.q), pad(c.k), pad(c.v)
    mask = (torch.arange(L, device=dev)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L] keys
    if c.causal:
        mask = mask & torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None]
    kw = {"attn_mask": mask, "scale": c.scale}
    if c.hq != c.hkv:
        kw["enable_gqa"] = True
    f = lambda: F.scaled_dot_product_attention(qp, kp, vp, **kw)  # noqa: E731
    return Prepared(
        f,
        to_out=lambda r: r.transpose(1, 2)[b_idx, pos],
        note=f"pre-padded [B={B}, H, Lmax={L}, D] + boolean mask; padding/unpadding not timed",
    )


IMPLS = [
    ("ours_eager", lambda c, sh, st: impl_ours(c, sh, st, "auto")),
    ("ours_fa2", lambda c, sh, st: impl_ours(c, sh, st, "fa2")),
    ("ours_fa3", lambda c, sh, st: impl_ours(c, sh, st, "fa3")),
    ("ours_compiled", lambda c, sh, st: impl_ours(c, sh, st, "auto", compiled=True)),
    ("flashinfer_fa3", lambda c, sh, st: impl_flashinfer(c, sh, st, "fa3")),
    ("flashinfer_fa2", lambda c, sh, st: impl_flashinfer(c, sh, st, "fa2")),
    ("varlen_attn", impl_varlen),
    ("njt_sdpa_eager", lambda c, sh, st: impl_njt(c, sh, st, False)),
    ("njt_sdpa_compiled", lambda c, sh, st: impl_njt(c, sh, st, True)),
    ("flex_doc_mask", impl_flex),
    ("padded_sdpa", impl_padded),
]
IMPL_NAMES = [n for n, _ in IMPLS]
# Known not to run on CPU (NOTES): tried anyway in --smoke to exercise the plumbing.
CPU_EXPECTED_FAILURES = {
    "varlen_attn": "CUDA only: varlen_attn has no CPU kernel",
    "njt_sdpa_compiled": "NJT SDPA cannot be compiled on CPU (MATH path, no fake kernel)",
    "varlen_compiled": "CUDA only: varlen_attn has no CPU kernel",
}


def measure(name, builder, c: Case, sh: Shared, args, budget: Budget) -> dict:
    rec: dict = {"impl": name}
    t0 = time.perf_counter()
    try:
        budget.check()
        with contextlib.ExitStack() as stack:
            prep = builder(c, sh, stack)
            rec["setup_s"] = time.perf_counter() - t0  # includes JIT / torch.compile
            rec.update(prep.extra)
            if prep.note:
                rec["note"] = prep.note
            out = prep.to_out(prep.fn())
            sync(c.dev)
            if c.ref is not None:
                rec["max_diff_vs_reference"] = max_diff(out, c.ref)
            if c.ours is not None and name != "ours_eager":
                rec["max_diff_vs_ours"] = max_diff(out, c.ours)
            if name == "ours_eager":
                c.ours = out.detach().clone()
            check = rec.get("max_diff_vs_reference", rec.get("max_diff_vs_ours"))
            rec["correct"] = None if check is None else bool(check <= TOL)
            del out
            before = prep.stats() if prep.stats else None
            rec.update(
                time_fn(
                    prep.fn,
                    c.dev,
                    warmup=args.warmup,
                    min_reps=args.reps,
                    max_reps=max(args.reps, 200),
                    target_s=args.target_s,
                )
            )
            if before is not None:
                rec["runtime_stats_during_timing"] = stats_delta(prep.stats(), before)
            rec["tflops"] = c.flops / (rec["ms"] * 1e-3) / 1e12 if rec["ms"] else None
            rec["status"] = "ok"
    except Skip as s:
        rec["status"] = s.status
        rec["reason"] = str(s)
    except Exception as e:  # noqa: BLE001
        if c.dev.type != "cuda" and name in CPU_EXPECTED_FAILURES:
            rec["status"] = "skipped"
            rec["reason"] = f"{CPU_EXPECTED_FAILURES[name]} (tried on CPU: {err_str(e, 200)})"
        else:
            rec["status"] = "error"
            rec["error"] = err_str(e)
            rec["traceback"] = tb_tail()
    finally:
        rec["wall_s"] = time.perf_counter() - t0
        try:
            sync(c.dev)
        except Exception as e:  # noqa: BLE001 - a poisoned CUDA context: say so
            rec["cuda_error_after"] = err_str(e)
    return rec


def run_ops(args, dev, results, writer, budget: Budget) -> None:
    sh = Shared(dev)
    section = results.setdefault("ops", {})
    section["meta"] = section_meta(args, dev)
    layouts = section.setdefault("layouts", {})
    wanted = set(args.layouts.split(",")) if args.layouts else None
    impls = [(n, b) for n, b in IMPLS if not args.impls or n in args.impls.split(",")]
    if args.impls and "ours_eager" not in args.impls.split(","):
        log("note: ours_eager not selected; max_diff_vs_ours will be missing")
    for i, (name, kind, hq, hkv, d, causal) in enumerate(LAYOUT_SPECS):
        if wanted and name not in wanted:
            continue
        entry = {"impls": {}}
        layouts[name] = entry
        try:
            c = Case(name, kind, hq, hkv, d, causal, dev, args.smoke, seed=100 + i)
        except Exception as e:  # noqa: BLE001
            entry["error"] = err_str(e)
            log(f"{name}: could not build inputs: {err_str(e)}")
            writer()
            continue
        entry["layout"] = c.describe()
        log(f"layout {name}: {c.n} segments, {c.total} tokens, H {c.hq}/{c.hkv}, D {c.d}, causal {c.causal}")
        try:
            t0 = time.perf_counter()
            if dev.type == "cuda":
                c.ref = reference_attention(
                    c.q.float(), c.k.float(), c.v.float(), c.cu, c.cu, c.causal, c.scale
                )
            else:
                c.ref = dense_attention(c.q, c.k, c.v, c.cu_host, c.cu_host, c.causal, c.scale).float()
            sync(dev)
            entry["reference_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            entry["reference_error"] = err_str(e)
            log(f"  reference failed: {err_str(e)}")
        for iname, builder in impls:
            rec = measure(iname, builder, c, sh, args, budget)
            entry["impls"][iname] = rec
            log("  " + fmt_rec(iname, rec))
            if rec.get("cuda_error_after"):
                log("  CUDA context looks broken after this row; later rows will likely fail")
            writer()
        entry["summary"] = summarize_layout(entry["impls"])
        if dev.type == "cuda" and not args.impls:
            try:
                budget.check()
                backend = entry["summary"].get("ours_backend") or auto_backend(dev, c.n, c.total)
                pr = paired_vs_flashinfer(c, sh, backend)
                entry["summary"]["paired_ours_vs_flashinfer"] = pr
                log(f"  paired ours/flashinfer_{backend}: {pr['ours_ms']:.3f} / {pr['flashinfer_ms']:.3f} ms = {pr['ratio']:.3f}")
            except Exception as e:  # noqa: BLE001
                entry["summary"]["paired_ours_vs_flashinfer"] = {"error": err_str(e)}
        del c
        with contextlib.suppress(Exception):
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        writer()


def fmt_rec(name, rec) -> str:
    st = rec.get("status")
    if st == "ok":
        s = f"{name:18s} {rec['ms']:9.3f} ms"
        if rec.get("tflops") is not None:
            s += f"  {rec['tflops']:7.1f} TFLOP/s"
        d = rec.get("max_diff_vs_reference", rec.get("max_diff_vs_ours"))
        if d is not None:
            s += f"  maxdiff {d:.2e}"
        for k in ("plan_ms", "block_mask_ms"):
            if rec.get(k) is not None:
                s += f"  {k} {rec[k]:.3f}"
        if rec.get("correct") is False:
            s += "  WRONG"
        return s + f"  (setup {rec.get('setup_s', 0):.1f}s)"
    return f"{name:18s} {st}: {_one_line(rec.get('reason') or rec.get('error'), 400)}"


def summarize_layout(impls: dict) -> dict:
    def ms(n):
        r = impls.get(n) or {}
        return r.get("ms") if r.get("status") == "ok" else None

    s: dict = {}
    ours = ms("ours_eager")
    backend = (impls.get("ours_eager") or {}).get("backend_used")
    s["ours_backend"] = backend
    fi = {b: ms(f"flashinfer_{b}") for b in ("fa2", "fa3")}
    if ours:
        if backend in fi and fi[backend]:
            s["ours_vs_flashinfer"] = ours / fi[backend]
        best = [x for x in fi.values() if x]
        if best:
            s["ours_vs_flashinfer_best"] = ours / min(best)
        vs = {}
        for n in IMPL_NAMES:
            if n != "ours_eager" and ms(n):
                vs[n] = ms(n) / ours
        s["speedup_vs"] = vs  # other ms / ours_eager ms: > 1 means ours is faster
        if ms("varlen_attn"):
            s["speedup_vs_varlen"] = ms("varlen_attn") / ours
    oc = ms("ours_compiled")
    if oc and backend in fi and fi[backend]:
        s["ours_compiled_vs_flashinfer"] = oc / fi[backend]
    return s


# --------------------------------------------------------------------------- end to end
class Block(nn.Module):
    def __init__(self, d: int, mlp: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)


class Weights(nn.Module):
    def __init__(self, d: int, heads: int, layers: int):
        super().__init__()
        self.d, self.heads = d, heads
        self.blocks = nn.ModuleList(Block(d, 4 * d) for _ in range(layers))


class PackedEncoder(nn.Module):
    """Pre-norm encoder on packed tokens x [T, d]; attention(q, k, v) on [T, H, Dh]."""

    def __init__(self, w: Weights, attention):
        super().__init__()
        self.w, self.attention = w, attention

    def forward(self, x):
        H, Dh = self.w.heads, self.w.d // self.w.heads
        for b in self.w.blocks:
            h = b.ln1(x)
            q, k, v = (p(h).unflatten(-1, (H, Dh)) for p in (b.q, b.k, b.v))
            x = x + b.o(self.attention(q, k, v).flatten(-2))
            x = x + b.fc2(F.gelu(b.fc1(b.ln2(x))))
        return x


class NJTEncoder(nn.Module):
    """The same encoder on an NJT [B, j, d]: SDPA on [B, H, j, Dh] views."""

    def __init__(self, w: Weights):
        super().__init__()
        self.w = w

    def forward(self, x):
        H, Dh = self.w.heads, self.w.d // self.w.heads
        for b in self.w.blocks:
            h = b.ln1(x)
            q, k, v = (p(h).unflatten(-1, [H, Dh]).transpose(1, 2) for p in (b.q, b.k, b.v))
            o = F.scaled_dot_product_attention(q, k, v)
            x = x + b.o(o.transpose(1, 2).flatten(-2))
            x = x + b.fc2(F.gelu(b.fc1(b.ln2(x))))
        return x


def profile_kernels(fwd, dev, n: int) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fwd()
        sync(dev)
    total_us = 0.0
    per_name: Counter = Counter()
    count = 0
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        try:
            us = float(e.time_range.elapsed_us())
        except Exception:  # noqa: BLE001
            us = float(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0))
        total_us += us
        per_name[e.name] += us
        count += 1
    top = [{"kernel": k[:120], "ms_per_forward": v / n / 1e3} for k, v in per_name.most_common(8)]
    return {
        "gpu_kernel_ms": total_us / n / 1e3,
        "gpu_kernels_per_forward": count / n,
        "top_kernels": top,
    }


def run_e2e(args, dev, results, writer, budget: Budget) -> None:
    sec = results.setdefault("e2e", {})
    sec["meta"] = section_meta(args, dev)
    smoke = args.smoke
    # smoke: head dim 64, a FlashInfer kernel that exists (16 is not one)
    d, heads, layers = (128, 2, 2) if smoke else (2048, 16, 8)
    lens = list(lengths_for("mixed", smoke))
    T, n, Lmax, Lmin = sum(lens), len(lens), max(lens), min(lens)
    cfg = {
        "layout": "mixed16",
        "lengths": lens,
        "tokens": T,
        "d_model": d,
        "heads": heads,
        "head_dim": d // heads,
        "layers": layers,
        "mlp": 4 * d,
        "dtype": str(DTYPE),
        "norm": "pre-norm LayerNorm",
        "activation": "GELU",
    }
    sec["config"] = cfg
    variants = sec.setdefault("variants", {})
    log(f"e2e: {layers}-layer encoder d={d} H={heads} on {n} segments / {T} tokens")
    try:
        torch.manual_seed(0)
        w = Weights(d, heads, layers).to(dev, DTYPE).eval()
        cu_host = torch.zeros(n + 1, dtype=torch.int32)
        cu_host[1:] = torch.cumsum(torch.tensor(lens), 0)
        cu = cu_host.to(dev)
        g = torch.Generator(device=dev).manual_seed(7)
        x = torch.randn(T, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        njt_kw = {}
        if has_kwarg(torch.nested.nested_tensor_from_jagged, "min_seqlen"):
            njt_kw = {"min_seqlen": Lmin, "max_seqlen": Lmax}

        def make_njt():  # fresh per variant: ragged_compile.compile marks its inputs dynamic
            return torch.nested.nested_tensor_from_jagged(x, cu.long(), **njt_kw)

        make_njt()
    except Exception as e:  # noqa: BLE001
        sec["error"] = err_str(e)
        writer()
        return
    rt = None
    if rc is not None:
        rt = rc.runtime.get_runtime(dev) if dev.type == "cuda" else rc.Runtime(dev)
    scale = (d // heads) ** -0.5
    base: dict = {}

    def ours_attn(q, k, v):
        return rc.ragged_attention(q, k, v, cu, scale=scale)

    # -- variant builders: each returns (fwd callable -> [T, d], uses_runtime)
    def v_ours_packed_eager():
        need_rc()
        m = PackedEncoder(w, ours_attn)

        def fwd():
            with rt.step(lens):
                return m(x)

        return fwd, True

    def v_ours_packed_compiled():
        need_rc()
        m = torch.compile(PackedEncoder(w, ours_attn), fullgraph=True)

        def fwd():
            with rt.step(lens):
                return m(x)

        return fwd, True

    def v_flashinfer_by_hand():
        if dev.type != "cuda":
            raise Skip("CUDA only")
        import flashinfer

        backend = auto_backend(dev, n, T)
        wr = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=dev), kv_layout="NHD", backend=backend
        )
        kw = dict(causal=False, sm_scale=scale, q_data_type=DTYPE, kv_data_type=DTYPE)
        if has_kwarg(wr.plan, "o_data_type"):
            kw["o_data_type"] = DTYPE
        m = PackedEncoder(w, lambda q, k, v: wr.run(q, k, v))
        base["flashinfer_backend"] = backend

        def fwd():
            wr.plan(cu_host, cu_host, heads, heads, d // heads, **kw)  # once per forward
            return m(x)

        return fwd, False

    def v_varlen_compiled():
        try:
            from torch.nn.attention.varlen import varlen_attn
        except Exception as e:  # noqa: BLE001
            raise Unsupported(f"no varlen_attn in torch {torch.__version__}: {err_str(e)}")
        kw = {"scale": scale} if has_kwarg(varlen_attn, "scale") else {}

        def attn(q, k, v):
            r = varlen_attn(q, k, v, cu, cu, Lmax, Lmax, **kw)
            return r[0] if isinstance(r, tuple) else r

        m = torch.compile(PackedEncoder(w, attn), fullgraph=True)
        return (lambda: m(x)), False

    def v_njt_compiled():
        m, xn = torch.compile(NJTEncoder(w), fullgraph=True), make_njt()
        return (lambda: m(xn).values()), False

    def v_njt_eager():
        m, xn = NJTEncoder(w), make_njt()
        return (lambda: m(xn).values()), False

    def v_ragged_compile_compile():
        m, xn = need_rc("compile")(NJTEncoder(w), fullgraph=True), make_njt()
        return (lambda: m(xn).values()), True

    def v_enable_eager():
        need_rc("enable")
        m, xn = NJTEncoder(w), make_njt()
        probe = rc.enable()
        if hasattr(probe, "__enter__"):  # a context manager: entered around every forward

            def fwd():
                with rc.enable():
                    return m(xn).values()

            return fwd, True
        return (lambda: m(xn).values()), True  # a global switch (already on)

    plan = [
        ("ours_packed_eager", v_ours_packed_eager),  # baseline for output agreement
        ("ragged_compile_compile", v_ragged_compile_compile),
        ("njt_sdpa_compiled", v_njt_compiled),
        ("varlen_compiled", v_varlen_compiled),
        ("ours_packed_compiled", v_ours_packed_compiled),
        ("flashinfer_by_hand_eager", v_flashinfer_by_hand),
        ("njt_sdpa_eager", v_njt_eager),
        ("ragged_compile_enable_eager", v_enable_eager),  # last: enable() may patch NJT SDPA globally
    ]
    if args.e2e_variants:
        keep = set(args.e2e_variants.split(","))
        plan = [p for p in plan if p[0] in keep]
    reps = 3 if smoke else args.e2e_reps
    for name, build in plan:
        rec: dict = {"variant": name}
        variants[name] = rec
        t0 = time.perf_counter()
        try:
            budget.check(30)
            # Dynamo keys compiled code by code object (NJTEncoder.forward is shared by
            # two variants) and does not guard on ragged_compile.enable: start clean.
            torch._dynamo.reset()
            with torch.inference_mode(False), torch.no_grad():
                fwd, uses_rt = build()
                out = fwd()  # compile / JIT
                sync(dev)
                rec["setup_s"] = time.perf_counter() - t0
                for _ in range(1 if smoke else 2):
                    out = fwd()
                sync(dev)
                out = out.float()
                if "ref" not in base:
                    base["ref"] = out
                    base["ref_name"] = name
                else:
                    diff = max_diff(out, base["ref"])
                    rel = diff / max(float(base["ref"].abs().max()), 1e-12)
                    rec[f"max_diff_vs_{base['ref_name']}"] = diff
                    rec["rel_diff"] = rel
                    rec["agrees"] = bool(rel <= E2E_REL_TOL)
                rec["output_finite"] = bool(torch.isfinite(out).all())
                del out
                before = all_runtime_stats([rt] if rt is not None else [])
                ts = []
                for _ in range(reps):
                    sync(dev)
                    s = time.perf_counter()
                    fwd()
                    sync(dev)
                    ts.append((time.perf_counter() - s) * 1e3)
                after = all_runtime_stats([rt] if rt is not None else [])
                rec["ms_per_forward"] = median(ts)
                rec["ms_min"] = min(ts)
                rec["reps"] = reps
                dlt = stats_delta(after, before)
                # calls of ragged_compile's CUDA kernel: non-zero for a stock variant means the
                # rewrite leaked into it (the CPU kernel does not count)
                rec["ragged_op_calls_per_forward"] = (dlt.get("flashinfer", 0) + dlt.get("reference", 0)) / reps
                if uses_rt:
                    rec["plans_per_forward"] = dlt.get("plans", 0) / reps
                    rec["syncs_per_forward"] = dlt.get("syncs", 0) / reps
                    rec["runtime_stats_per_forward"] = {k: v / reps for k, v in dlt.items()}
                if name == "flashinfer_by_hand_eager":
                    rec["plans_per_forward"] = 1.0
                    rec["syncs_per_forward"] = 0.0
                    rec["flashinfer_backend"] = base.get("flashinfer_backend")
                if dev.type == "cuda":
                    try:
                        rec.update(profile_kernels(fwd, dev, 3 if not smoke else 1))
                    except Exception as e:  # noqa: BLE001
                        rec["profile_error"] = err_str(e)
                else:
                    rec["profile_skipped"] = "no CUDA: GPU kernel time not measured"
                rec["status"] = "ok"
        except Skip as s:
            rec["status"] = s.status
            rec["reason"] = str(s)
        except Exception as e:  # noqa: BLE001
            if dev.type != "cuda" and name in CPU_EXPECTED_FAILURES:
                rec["status"] = "skipped"
                rec["reason"] = f"{CPU_EXPECTED_FAILURES[name]} (tried on CPU: {err_str(e, 200)})"
            else:
                rec["status"] = "error"
                rec["error"] = err_str(e)
                rec["traceback"] = tb_tail()
        finally:
            rec["wall_s"] = time.perf_counter() - t0
            try:
                sync(dev)
            except Exception as e:  # noqa: BLE001
                rec["cuda_error_after"] = err_str(e)
        if rec["status"] == "ok":
            extra = ""
            if "plans_per_forward" in rec:
                extra = f"  plans {rec['plans_per_forward']:.2f} syncs {rec['syncs_per_forward']:.2f}"
            if "gpu_kernel_ms" in rec:
                extra += f"  gpu {rec['gpu_kernel_ms']:.2f} ms"
            if "rel_diff" in rec:
                extra += f"  rel diff {rec['rel_diff']:.2e}" + ("" if rec["agrees"] else " DISAGREES")
            log(f"  {name:28s} {rec['ms_per_forward']:9.2f} ms/fwd{extra}  (setup {rec['setup_s']:.1f}s)")
        else:
            log(f"  {name:28s} {rec['status']}: {_one_line(rec.get('reason') or rec.get('error'), 400)}")
        writer()
        with contextlib.suppress(Exception):
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if "ref_name" in base:
        sec["outputs_compared_against"] = base["ref_name"]


# --------------------------------------------------------------------------- reporting
def section_meta(args, dev) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ragged_compile": getattr(rc, "__version__", None) if rc is not None else f"import failed: {RC_IMPORT_ERROR}",
        "smoke": bool(args.smoke),
        "argv": sys.argv[1:],
    }
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except Exception as e:  # noqa: BLE001
        meta["flashinfer"] = f"unavailable: {err_str(e, 200)}"
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        meta["triton"] = None
    try:
        meta["git_commit"] = (
            subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
            .stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001
        meta["git_commit"] = None
    return meta


def _one_line(msg: str, limit: int = 300) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[:limit] + " ..."


def _cell(rec: dict | None, notes: dict) -> str:
    """A table cell; errors/skips become a numbered note shared by equal messages."""
    if not rec:
        return ""
    st = rec.get("status")
    if st == "ok":
        s = f"{rec['ms']:.3f}"
        if rec.get("tflops") is not None:
            s += f" ({rec['tflops']:.3g})"
        if rec.get("correct") is False:
            s += " **WRONG**"
        return s
    msg = _one_line(f"{rec.get('impl')}: {rec.get('reason') or rec.get('error') or ''}").replace("|", "\\|")
    num = notes.setdefault(msg, len(notes) + 1)
    return f"{st} [{num}]"


def _f(x, fmt="{:.3f}"):
    return "" if x is None else (fmt.format(x) if isinstance(x, (int, float)) else str(x))


def render_markdown(results: dict) -> str:
    L = ["# Ragged attention benchmark", ""]
    ops, e2e = results.get("ops"), results.get("e2e")
    meta = (ops or e2e or {}).get("meta", {})
    if meta:
        L.append(
            f"GPU: {meta.get('gpu') or meta.get('device')} | torch {meta.get('torch')} | "
            f"flashinfer {meta.get('flashinfer')} | triton {meta.get('triton')} | {meta.get('date')}"
            + (" | **SMOKE (tiny sizes)**" if meta.get("smoke") else "")
        )
        L.append("")
    if ops and ops.get("layouts"):
        lay = ops["layouts"]
        names = list(lay)
        notes: dict = {}
        L += ["## Per op: median ms per call (useful TFLOP/s)", ""]
        L.append("| impl | " + " | ".join(names) + " |")
        L.append("|---" * (len(names) + 1) + "|")
        for impl in IMPL_NAMES:
            if not any(impl in lay[n].get("impls", {}) for n in names):
                continue
            L.append(f"| {impl} | " + " | ".join(_cell(lay[n]["impls"].get(impl), notes) for n in names) + " |")
        L.append("")
        L += ["Layouts:", ""]
        for n in names:
            d = lay[n].get("layout", {})
            L.append(
                f"- `{n}`: {d.get('segments')} segments, {d.get('tokens')} tokens "
                f"(lengths {d.get('min_len')}..{d.get('max_len')}), H {d.get('hq')}/{d.get('hkv')}, "
                f"D {d.get('head_dim')}, causal {d.get('causal')}, {_f(d.get('useful_flops', 0) / 1e12, '{:.2f}')} useful TFLOP"
            )
        L.append("")
        L += ["## Ratios and host costs", ""]
        L.append(
            "| layout | ours backend | ours / flashinfer (same backend) | ours / best flashinfer | "
            "ours / flashinfer paired | ours_compiled / flashinfer | varlen / ours | plan ms ours | plan ms fi fa2 | "
            "plan ms fi fa3 | flex block mask ms |"
        )
        L.append("|---" * 11 + "|")
        for n in names:
            s, im = lay[n].get("summary", {}), lay[n].get("impls", {})
            L.append(
                f"| {n} | {_f(s.get('ours_backend'))} | {_f(s.get('ours_vs_flashinfer'))} | "
                f"{_f(s.get('ours_vs_flashinfer_best'))} | {_f((s.get('paired_ours_vs_flashinfer') or {}).get('ratio'))} | "
                f"{_f(s.get('ours_compiled_vs_flashinfer'))} | "
                f"{_f(s.get('speedup_vs_varlen'))} | {_f(im.get('ours_eager', {}).get('plan_ms'))} | "
                f"{_f(im.get('flashinfer_fa2', {}).get('plan_ms'))} | {_f(im.get('flashinfer_fa3', {}).get('plan_ms'))} | "
                f"{_f(im.get('flex_doc_mask', {}).get('block_mask_ms'))} |"
            )
        L.append("")
        L += ["## Correctness: max abs diff vs float32 reference (vs ours_eager)", ""]
        L.append("| impl | " + " | ".join(names) + " |")
        L.append("|---" * (len(names) + 1) + "|")
        for impl in IMPL_NAMES:
            cells = []
            for n in names:
                r = lay[n].get("impls", {}).get(impl) or {}
                a, b = r.get("max_diff_vs_reference"), r.get("max_diff_vs_ours")
                c = "" if a is None else f"{a:.1e}"
                if b is not None:
                    c += f" ({b:.1e})"
                if r.get("correct") is False:
                    c += " **WRONG**"
                cells.append(c)
            if any(cells):
                L.append(f"| {impl} | " + " | ".join(cells) + " |")
        L.append("")
        if notes:
            L += ["Notes (errors, skips, unsupported):", ""]
            L += [f"{num}. {m}" for m, num in notes.items()]
            L.append("")
    if e2e and e2e.get("variants"):
        cfg = e2e.get("config", {})
        L += [
            "## End to end: encoder forward",
            "",
            f"{cfg.get('layers')} layers, d_model {cfg.get('d_model')}, {cfg.get('heads')} heads, MLP x4 GELU, "
            f"pre-norm LayerNorm, {cfg.get('dtype')}, {cfg.get('tokens')} tokens in {len(cfg.get('lengths', []))} segments. "
            f"Outputs compared against `{e2e.get('outputs_compared_against')}`.",
            "",
            "| variant | ms / forward (wall) | GPU kernel ms / forward | plans / fwd | syncs / fwd | max diff (rel) | status |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in e2e["variants"].items():
            diff = next((v for k, v in r.items() if k.startswith("max_diff_vs_")), None)
            dcell = "" if diff is None else f"{diff:.2e} ({r.get('rel_diff', 0):.1e})" + (
                "" if r.get("agrees", True) else " **DISAGREES**"
            )
            st = r.get("status")
            if st != "ok":
                st = f"{st}: {(r.get('reason') or r.get('error') or '')[:200]}".replace("\n", " ").replace("|", "\\|")
            L.append(
                f"| {name} | {_f(r.get('ms_per_forward'), '{:.2f}')} | {_f(r.get('gpu_kernel_ms'), '{:.2f}')} | "
                f"{_f(r.get('plans_per_forward'), '{:.2f}')} | {_f(r.get('syncs_per_forward'), '{:.2f}')} | {dcell} | {st} |"
            )
        L.append("")
    return "\n".join(L) + "\n"


def render_chart(results: dict, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"skipped: matplotlib unavailable ({err_str(e, 200)})"
    panels = []
    lay = (results.get("ops") or {}).get("layouts", {})
    for n, entry in lay.items():
        bars = [(i, r["ms"]) for i, r in entry.get("impls", {}).items() if r.get("status") == "ok" and r.get("ms")]
        if bars:
            panels.append((f"{n} (ms / call)", bars))
    e2e = (results.get("e2e") or {}).get("variants", {})
    bars = [(n, r["ms_per_forward"]) for n, r in e2e.items() if r.get("status") == "ok"]
    if bars:
        panels.append(("e2e encoder (ms / forward)", bars))
    if not panels:
        return "skipped: nothing measured"
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (title, bars) in zip(axes.flat, panels):
        labels = [b[0] for b in bars]
        vals = [b[1] for b in bars]
        colors = ["tab:red" if lab.startswith(("ours", "ragged_compile")) else "tab:blue" for lab in labels]
        ax.barh(range(len(vals)), vals, color=colors)
        ax.set_yticks(range(len(vals)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        for j, val in enumerate(vals):
            ax.text(val, j, f" {val:.2f}", va="center", fontsize=7)
        ax.set_xlim(0, max(vals) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "ok"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output folder (default bench/results; a temp dir with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU")
    p.add_argument("--only", choices=["ops", "e2e"], default=None)
    p.add_argument("--layouts", default=None, help="comma list of layouts to run (default all)")
    p.add_argument("--impls", default=None, help="comma list of per-op implementations (default all)")
    p.add_argument("--e2e-variants", default=None, help="comma list of e2e variants (default all)")
    p.add_argument("--reps", type=int, default=None, help="minimum timed reps per op (default 30; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 5; smoke 1)")
    p.add_argument("--target-s", type=float, default=0.3, help="aim for this much timed work per op")
    p.add_argument("--e2e-reps", type=int, default=20)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=540.0,
        help="stop starting new measurements after this many seconds (outputs are always written)",
    )
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.smoke else 30
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 5
    if args.smoke:
        args.target_s = min(args.target_s, 0.05)
    out_dir = args.out or (tempfile.mkdtemp(prefix="bench_attention_smoke_") if args.smoke else os.path.join(HERE, "results"))
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "attention.json")
    md_path = os.path.join(out_dir, "attention.md")
    png_path = os.path.join(out_dir, "attention.png")

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    raise_recompile_limits()
    results: dict = {}
    if args.only and os.path.exists(json_path):  # keep the other section of an earlier run
        try:
            with open(json_path) as fh:
                old = json.load(fh)
            other = "e2e" if args.only == "ops" else "ops"
            if other in old:
                results[other] = old[other]
        except Exception as e:  # noqa: BLE001
            log(f"could not read earlier {json_path}: {err_str(e)}")
    results["run"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "environment": environment(),
        "tolerance_abs_vs_reference": TOL,
        "e2e_rel_tolerance": E2E_REL_TOL,
    }

    def write_json():
        tmp = json_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(sanitize(results), fh, indent=1)
        os.replace(tmp, json_path)
        with open(md_path, "w") as fh:
            fh.write(render_markdown(results))

    def writer():
        try:
            write_json()
        except Exception as e:  # noqa: BLE001
            log(f"writing results failed: {err_str(e)}")

    def on_term(signum, frame):  # the device tool's timeout: still write what we have
        raise KeyboardInterrupt(f"signal {signum}")

    with contextlib.suppress(Exception):
        signal.signal(signal.SIGTERM, on_term)

    budget = Budget(args.time_budget_s)
    log(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), torch {torch.__version__}, out {out_dir}")
    if dev.type != "cuda" and not args.smoke:
        log("no CUDA device: full sizes on CPU would take very long; consider --smoke")
    rc_code = 0
    try:
        if args.only in (None, "ops"):
            run_ops(args, dev, results, writer, budget)
        if args.only in (None, "e2e"):
            run_e2e(args, dev, results, writer, budget)
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}); writing what was measured")
        results["run"]["interrupted"] = str(e)
        rc_code = 130
    except Exception as e:  # noqa: BLE001
        log(f"unexpected failure: {err_str(e)}")
        results["run"]["fatal"] = err_str(e)
        results["run"]["fatal_traceback"] = tb_tail(4000)
        rc_code = 1
    finally:
        results["run"]["total_s"] = time.perf_counter() - T_START
        try:
            results["run"]["chart"] = render_chart(results, png_path)
        except Exception as e:  # noqa: BLE001
            results["run"]["chart"] = f"failed: {err_str(e)}"
        writer()
        log(f"chart: {results['run']['chart']}")
        log(f"wrote {json_path}, {md_path}" + (f", {png_path}" if results["run"]["chart"] == "ok" else ""))
    return rc_code


if __name__ == "__main__":
    raise SystemExit(main())
