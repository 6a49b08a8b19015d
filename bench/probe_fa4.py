#!/usr/bin/env python
"""Probe the flash-attn-4 (CuTe DSL) varlen BACKWARD on SM90 as a replacement for
aten's FlashAttention-2 varlen backward (``aten._flash_attention_backward``).

Usage (GPU):   python bench/probe_fa4.py --out DIR [--fa4-path SITE] [--budget-s 450]
Usage (CPU):   python bench/probe_fa4.py --selftest-cpu   (checks the float64 reference,
               a fake FA-style backward fed with the aten LSE, and the comparison helpers)

Writes DIR/probe_fa4.json after every case (so a kill keeps what finished). Every
case catches its own exceptions; after ``--budget-s`` seconds no new case starts.

FA4 facts this probe relies on (flash_attn/cute/interface.py of flash-attn-4 4.0.0b36):
* ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=, cu_seqlens_q=,
  cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=, deterministic=)`` -> (dq, dk, dv);
  varlen lse is fp32 ``[Hq, total_q]``, natural log with the scale folded in (the same
  as aten's); the preprocess maps lse -> lse*log2(e), and -inf -> 0 (a keyless row's
  scores are all masked, so P = 0 either way); +inf gives P = 0 as well.
* ``_flash_attn_fwd(...)`` returns (out, lse, p, row_max, o_lo); its lse is -inf for
  rows that see no key (aten's FA2 writes +inf there).
* Persistent kernel cache: FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 and
  FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=... are read at import time, so they are set here
  before flash_attn.cute is imported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types

import torch

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
CANON_HDIMS = (64, 96, 128, 192, 256)  # the SM90 backward's tile classes (<=64, <=96, <=128, <=192, else)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------


class Layout:
    """Segments as (len_q, len_k) pairs; offsets int32 on ``dev``."""

    def __init__(self, name, pairs, dev="cpu"):
        self.name = name
        self.pairs = [(int(a), int(b)) for a, b in pairs]
        self.lens_q = [a for a, _ in self.pairs]
        self.lens_k = [b for _, b in self.pairs]
        self.n = len(self.pairs)
        self.total_q = sum(self.lens_q)
        self.total_k = sum(self.lens_k)
        self.max_q = max(self.lens_q) if self.pairs else 0
        self.max_k = max(self.lens_k) if self.pairs else 0
        self.off_q = [0]
        self.off_k = [0]
        for a, b in self.pairs:
            self.off_q.append(self.off_q[-1] + a)
            self.off_k.append(self.off_k[-1] + b)
        self.cu_q = torch.tensor(self.off_q, dtype=torch.int32, device=dev)
        self.cu_k = torch.tensor(self.off_k, dtype=torch.int32, device=dev)

    def describe(self):
        short = self.pairs if self.n <= 24 else self.pairs[:12] + [("...", self.n - 12)]
        return {
            "name": self.name, "n": self.n, "total_q": self.total_q, "total_k": self.total_k,
            "max_q": self.max_q, "max_k": self.max_k, "pairs": [list(p) for p in short],
        }


def mixed16_lengths():
    for seed in range(10_000):
        g = torch.Generator().manual_seed(1000 + seed)
        lens = torch.randint(64, 4097, (16,), generator=g)
        lens[0], lens[1] = 64, 4096
        lens = lens[torch.randperm(16, generator=g)]
        if 33000 <= int(lens.sum()) <= 36000:
            return [int(x) for x in lens], seed
    raise RuntimeError("no seed gave a mixed16 layout in range")


def short250_lengths():  # as bench/layouts.py
    g = torch.Generator().manual_seed(2)
    return [int(x) for x in torch.randint(16, 257, (250,), generator=g)]


def self_pairs(lens):
    return [(x, x) for x in lens]


SMALL = {
    # lengths chosen so that max_q and max_k exceed every bwd tile (FA4 compiles a separate
    # kernel when max_seqlen fits one tile, see `single_q_block` in interface.py)
    "self": self_pairs([300, 129, 1, 64, 517, 77]),
    "cross_empty": [(200, 333), (333, 200), (0, 50), (70, 0), (1, 300), (300, 1), (0, 0),
                    (150, 150), (65, 64)],
    "onetok_mix": self_pairs([1] * 12 + [200] + [1] * 5),
    "onetok_pure": self_pairs([1] * 16),
    "allempty_k": [(5, 0), (7, 0), (0, 0)],
    "nan4": self_pairs([300, 200, 257, 129]),
}


def many_pairs(n=300, seed=5):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 65, (n,), generator=g).tolist()
    lens[n // 2] = 200  # keep max above one tile
    return self_pairs(lens)


def useful_pairs(lq, lk, causal):
    if not causal:
        return lq * lk
    off = lk - lq
    return sum(min(lk, max(0, i + off + 1)) for i in range(lq))


def layout_flops(L, hq, d, causal):
    pairs = sum(useful_pairs(a, b, causal) for a, b in L.pairs)
    return {"fwd": 4.0 * pairs * d * hq, "bwd": 10.0 * pairs * d * hq}


# ----------------------------------------------------------------------------------------
# Inputs, float64 reference, fake FA backward, comparisons
# ----------------------------------------------------------------------------------------


def make_inputs(L, hq, hkv, d, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(t, h):
        return torch.randn(t, h, d, generator=g, device=dev, dtype=torch.float32).to(dtype)

    return rnd(L.total_q, hq), rnd(L.total_k, hkv), rnd(L.total_k, hkv), rnd(L.total_q, hq)


class Ref:
    pass


def dense_reference(q, k, v, dout, L, causal, scale):
    """float64 autograd of per-segment softmax attention.

    GQA: query head h reads k/v head h // (Hq // Hkv) (repeat_interleave). Causal is
    bottom-right aligned: key j visible to query i iff j <= i + (Lk - Lq). Rows that see
    no key give zero output and zero gradients; their LSE is +inf (aten's convention).
    """
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    qd = q.detach().double().requires_grad_(True)
    kd = k.detach().double().requires_grad_(True)
    vd = v.detach().double().requires_grad_(True)
    outs, lses = [], []
    for b, (lq, lk) in enumerate(L.pairs):
        if lq == 0:
            continue
        q0 = L.off_q[b]
        if lk == 0:
            outs.append(torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64, device=q.device))
            lses.append(torch.full((hq, lq), math.inf, dtype=torch.float64, device=q.device))
            continue
        k0 = L.off_k[b]
        qb = qd[q0:q0 + lq].transpose(0, 1)  # [Hq, Lq, d]
        kb = kd[k0:k0 + lk].transpose(0, 1).repeat_interleave(grp, 0)
        vb = vd[k0:k0 + lk].transpose(0, 1).repeat_interleave(grp, 0)
        s = (qb @ kb.transpose(-1, -2)) * scale
        if causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(~(j <= i + (lk - lq)), -math.inf)
        m = s.detach().amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        den = e.sum(-1, keepdim=True)
        p = e / torch.where(den > 0, den, torch.ones_like(den))
        outs.append((p @ vb).transpose(0, 1))
        with torch.no_grad():
            dd = den.detach()
            lses.append(torch.where(dd > 0, m + torch.log(dd.clamp_min(1e-300)),
                                    torch.full_like(dd, math.inf)).squeeze(-1))
    r = Ref()
    if outs:
        out = torch.cat(outs, 0)
        r.lse = torch.cat(lses, 1)
    else:
        out = torch.zeros(0, hq, v.shape[-1], dtype=torch.float64, device=q.device)
        r.lse = torch.zeros(hq, 0, dtype=torch.float64, device=q.device)
    assert out.shape[0] == L.total_q
    r.out = out.detach()
    if out.requires_grad:
        gq, gk, gv = torch.autograd.grad((out * dout.double()).sum(), (qd, kd, vd), allow_unused=True)
    else:
        gq = gk = gv = None
    r.dq = gq if gq is not None else torch.zeros_like(qd)
    r.dk = gk if gk is not None else torch.zeros_like(kd)
    r.dv = gv if gv is not None else torch.zeros_like(vd)
    r.dq, r.dk, r.dv = r.dq.detach(), r.dk.detach(), r.dv.detach()
    r.keyless_rows = int((r.lse == math.inf).sum())
    return r


def fake_flash_bwd(q, k, v, out, dout, lse, L, causal, scale):
    """FA-style backward from (out, lse) in float64 with FA4's LSE handling
    (flash_bwd_preprocess.py: lse_log2 = lse*log2e, -inf -> 0; P = exp2(S*scale*log2e - lse_log2)).
    Only for the CPU self-test: it validates the LSE conventions this probe assumes."""
    hq, hkv = q.shape[1], k.shape[1]
    grp = hq // hkv
    qd, kd, vd, od, dod = (t.double() for t in (q, k, v, out, dout))
    lse2 = lse.double() * LOG2E
    lse2 = torch.where(lse.double() == -math.inf, torch.zeros_like(lse2), lse2)
    dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
    for b, (lq, lk) in enumerate(L.pairs):
        if lq == 0 or lk == 0:
            continue
        q0, k0 = L.off_q[b], L.off_k[b]
        qb = qd[q0:q0 + lq].transpose(0, 1)
        kb = kd[k0:k0 + lk].transpose(0, 1).repeat_interleave(grp, 0)
        vb = vd[k0:k0 + lk].transpose(0, 1).repeat_interleave(grp, 0)
        ob = od[q0:q0 + lq].transpose(0, 1)
        dob = dod[q0:q0 + lq].transpose(0, 1)
        s = qb @ kb.transpose(-1, -2)
        if causal:
            i = torch.arange(lq)[:, None]
            j = torch.arange(lk)[None, :]
            s = s.masked_fill(~(j <= i + (lk - lq)), -math.inf)
        p = torch.exp2(s * (scale * LOG2E) - lse2[:, q0:q0 + lq, None])
        dsum = (dob * ob).sum(-1, keepdim=True)
        dp = dob @ vb.transpose(-1, -2)
        ds = p * (dp - dsum)
        dq[q0:q0 + lq] = (ds @ kb * scale).transpose(0, 1)
        dkb = (ds.transpose(-1, -2) @ qb * scale).view(hkv, grp, lk, -1).sum(1)
        dvb = (p.transpose(-1, -2) @ dob).view(hkv, grp, lk, -1).sum(1)
        dk[k0:k0 + lk] = dkb.transpose(0, 1)
        dv[k0:k0 + lk] = dvb.transpose(0, 1)
    return dq, dk, dv


def err_stats(x, ref):
    """max |x - ref| / max |ref| (plus the parts), counting non-finite entries of x."""
    x = x.detach().double()
    ref = ref.detach().double().to(x.device)
    if x.shape != ref.shape:
        return {"error": f"shape {tuple(x.shape)} != ref {tuple(ref.shape)}"}
    if x.numel() == 0:
        return {"rel": 0.0, "max_abs": 0.0, "ref_max": 0.0, "nonfinite": 0, "numel": 0}
    nonfinite = int((~torch.isfinite(x)).sum())
    diff = (x - ref).abs()
    fin = torch.isfinite(diff)
    max_abs = float(diff[fin].max()) if bool(fin.any()) else 0.0
    ref_max = float(ref.abs().max())
    rel = max_abs / ref_max if ref_max > 0 else max_abs
    if nonfinite:
        rel = math.inf
    return {"rel": rel, "max_abs": max_abs, "ref_max": ref_max, "nonfinite": nonfinite}


def grad_stats(grads, ref):
    d = {name: err_stats(g, getattr(ref, name)) for name, g in zip(("dq", "dk", "dv"), grads)}
    d["worst_rel"] = max((v.get("rel", math.inf) for v in d.values()), default=math.inf)
    return d


def lse_stats(lse, ref_lse):
    """Finite entries compared; the keyless-row convention reported separately."""
    lse = lse.detach().double()
    ref_lse = ref_lse.to(lse.device)
    if lse.shape != ref_lse.shape:
        return {"error": f"shape {tuple(lse.shape)} != ref {tuple(ref_lse.shape)}"}
    keyless = ref_lse == math.inf
    fin = ~keyless
    res = {"shape": list(lse.shape), "dtype": str(lse.dtype), "keyless_rows": int(keyless.sum())}
    if bool(fin.any()):
        res["max_abs_finite_rows"] = float((lse[fin] - ref_lse[fin]).abs().max())
    if bool(keyless.any()):
        vals = lse[keyless]
        res["keyless_values"] = sorted({str(float(x)) for x in vals.unique()[:8].tolist()})
    return res


def sanitize(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else str(o)
    if isinstance(o, dict):
        return {str(k): sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize(v) for v in o]
    if isinstance(o, torch.Tensor):
        return sanitize(o.tolist())
    if isinstance(o, (int, str, bool)) or o is None:
        return o
    return repr(o)


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------


def fa2_forward(q, k, v, L, causal, scale):
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, L.cu_q, L.cu_k, L.max_q, L.max_k, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse


_RNG = {}


def fa2_backward(dout, q, k, v, out, lse, L, causal, scale):
    dev = q.device
    if dev not in _RNG:
        _RNG[dev] = (torch.zeros(2, dtype=torch.uint64, device=dev), torch.empty(0, device=dev))
    rng, unused = _RNG[dev]
    return torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, L.cu_q, L.cu_k, L.max_q, L.max_k, 0.0, causal, rng, unused,
        scale=scale,
    )


def _pad(x, dp):
    return torch.nn.functional.pad(x, (0, dp - x.shape[-1])) if x.shape[-1] != dp else x


class Ctx:
    fa4 = None
    dev = None
    args = None
    compile_times = {}


def fa4_backward(dout, q, k, v, out, lse, L, causal, scale, pad_to=None, deterministic=False):
    fa4 = Ctx.fa4
    d = q.shape[-1]
    if pad_to is not None and pad_to != d:
        q, k, v, out, dout = (_pad(t, pad_to) for t in (q, k, v, out, dout))
    dq, dk, dv = fa4._flash_attn_bwd(
        q, k, v, out, dout, lse,
        softmax_scale=scale, causal=causal,
        cu_seqlens_q=L.cu_q, cu_seqlens_k=L.cu_k,
        max_seqlen_q=L.max_q, max_seqlen_k=L.max_k,
        deterministic=deterministic,
    )[:3]
    if dq.shape[-1] != d:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
    return dq, dk, dv


def fa4_forward(q, k, v, L, causal, scale):
    res = Ctx.fa4._flash_attn_fwd(
        q, k, v, cu_seqlens_q=L.cu_q, cu_seqlens_k=L.cu_k,
        max_seqlen_q=L.max_q, max_seqlen_k=L.max_k,
        softmax_scale=scale, causal=causal, return_lse=True,
    )
    return res[0], res[1]


def n_compiled():
    fa4 = Ctx.fa4
    if fa4 is None:
        return {}
    out = {}
    for name in ("_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert",
                 "_flash_attn_fwd", "_compute_tile_cumsum"):
        c = getattr(getattr(fa4, name, None), "compile_cache", None)
        if c is not None and hasattr(c, "cache"):
            out[name] = len(c.cache)
    return out


def compiles_delta(before):
    after = n_compiled()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def sync():
    torch.cuda.synchronize()


def first_call(fn):
    """Run fn once, synchronized; wall seconds and new FA4 compiles (first call = JIT)."""
    before = n_compiled()
    sync()
    t = time.perf_counter()
    r = fn()
    sync()
    return r, {"first_call_s": time.perf_counter() - t, "new_compiles": compiles_delta(before)}


def time_fn(fn, warmup=None, iters=None):
    warmup = Ctx.args.warmup if warmup is None else warmup
    iters = Ctx.args.iters if iters is None else iters
    _, info = first_call(fn)
    for _ in range(warmup):
        fn()
    sync()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    host = []
    for s, e in ev:
        t = time.perf_counter()
        s.record()
        fn()
        e.record()
        host.append(time.perf_counter() - t)
    sync()
    ms = sorted(s.elapsed_time(e) for s, e in ev)
    # back-to-back wall time (host overhead included when it exceeds GPU time)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    wall = (time.perf_counter() - t) / iters * 1e3
    info.update({
        "median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1],
        "wall_ms_per_call": wall, "host_submit_ms_median": statistics.median(host) * 1e3,
        "iters": iters,
    })
    return info


def peak_extra_mb(fn):
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    sync()
    peak = torch.cuda.max_memory_allocated()
    del r
    return (peak - base) / 2**20


def guarded(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - every failure is a result here
        return {"error": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-3000:]}


# ----------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------


def case_correctness(name, pairs, hq, hkv, d, dtype, causal, seed=0, pad_to=None,
                     do_fa2=True, fa4_fwd=False):
    dev = Ctx.dev
    L = Layout(name, pairs, dev)
    q, k, v, dout = make_inputs(L, hq, hkv, d, dtype, dev, seed)
    scale = d ** -0.5
    res = {"layout": L.describe(), "hq": hq, "hkv": hkv, "d": d, "dtype": str(dtype),
           "causal": causal, "metric": "max|x-ref| / max|ref| per tensor (ref: float64 autograd)"}
    if L.total_k == 0 or L.max_k == 0:
        # aten FA2 fails on max_k == 0 (CUDA invalid argument); nothing is seen by anyone.
        out = torch.zeros_like(q)
        lse = torch.full((hq, L.total_q), math.inf, dtype=torch.float32, device=dev)
        res["fwd_note"] = "max_k == 0: out = 0, lse = +inf built by hand (aten fwd rejects it)"
        do_fa2 = False
    else:
        out, lse = fa2_forward(q, k, v, L, causal, scale)
    ref = dense_reference(q, k, v, dout, L, causal, scale)
    res["ref_keyless_rows"] = ref.keyless_rows
    res["fa2_fwd_out"] = err_stats(out, ref.out)
    res["fa2_fwd_lse"] = lse_stats(lse, ref.lse)
    if do_fa2:
        res["fa2_bwd"] = guarded(lambda: grad_stats(fa2_backward(dout, q, k, v, out, lse, L, causal, scale), ref))

    def run_fa4(lse_in, pad=None):
        def go():
            g, info = first_call(lambda: fa4_backward(dout, q, k, v, out, lse_in, L, causal, scale, pad_to=pad))
            st = grad_stats(g, ref)
            st.update(info)
            return st
        return guarded(go)

    res["fa4_bwd"] = run_fa4(lse)
    if ref.keyless_rows:
        # FA4's own forward writes -inf for keyless rows; check it takes that too.
        res["fa4_bwd_lse_neginf"] = run_fa4(lse.masked_fill(lse == math.inf, -math.inf))
    if pad_to is not None and pad_to != d:
        res[f"fa4_bwd_padded_to_{pad_to}"] = run_fa4(lse, pad_to)
    if fa4_fwd:
        def fwd_check():
            (o4, l4), info = first_call(lambda: fa4_forward(q, k, v, L, causal, scale))
            r = {"out": err_stats(o4, ref.out), "lse_vs_ref": lse_stats(l4, ref.lse),
                 "lse_shape": list(l4.shape), "lse_dtype": str(l4.dtype), **info}
            fin = torch.isfinite(lse) & torch.isfinite(l4)
            if bool(fin.any()):
                r["lse_vs_aten_max_abs"] = float((l4[fin] - lse[fin]).abs().max())
            g = fa4_backward(dout, q, k, v, o4, l4, L, causal, scale)
            r["bwd_from_fa4_fwd"] = grad_stats(g, ref)
            return r
        res["fa4_fwd"] = guarded(fwd_check)
    fa2w = res.get("fa2_bwd", {}).get("worst_rel")
    fa4w = res["fa4_bwd"].get("worst_rel") if isinstance(res["fa4_bwd"], dict) else None
    res["summary"] = {"fa2_worst_rel": fa2w, "fa4_worst_rel": fa4w}
    return res


def case_nan_isolation(which, causal):
    dev = Ctx.dev
    L = Layout("nan4", SMALL["nan4"], dev)
    hq = hkv = 4
    d, dtype = 128, torch.bfloat16
    scale = d ** -0.5
    q, k, v, dout = make_inputs(L, hq, hkv, d, dtype, dev, seed=7)
    bad = 1
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    if "q" in which:
        qn[L.off_q[bad]:L.off_q[bad + 1]] = float("nan")
    if "k" in which:
        kn[L.off_k[bad]:L.off_k[bad + 1]] = float("nan")
    if "v" in which:
        vn[L.off_k[bad]:L.off_k[bad + 1]] = float("nan")
    out_c, lse_c = fa2_forward(q, k, v, L, causal, scale)
    out_n, lse_n = fa2_forward(qn, kn, vn, L, causal, scale)
    res = {"layout": L.describe(), "nan_segment": bad, "nan_in": which, "causal": causal}

    def seg_report(gc, gn):
        rep = []
        for b in range(L.n):
            rq = slice(L.off_q[b], L.off_q[b + 1])
            rk = slice(L.off_k[b], L.off_k[b + 1])
            row = {"segment": b}
            for nm, c, n_, rs in (("dq", gc[0], gn[0], rq), ("dk", gc[1], gn[1], rk), ("dv", gc[2], gn[2], rk)):
                a, bb = c[rs].double(), n_[rs].double()
                fin = bool(torch.isfinite(bb).all())
                row[nm] = {"finite": fin,
                           "rel_diff_vs_clean": (float((a - bb).abs().max() / a.abs().max().clamp_min(1e-30))
                                                 if fin and a.numel() else None)}
            rep.append(row)
        others = [r for r in rep if r["segment"] != bad]
        ok = all(r[t]["finite"] and (r[t]["rel_diff_vs_clean"] or 0.0) < 2e-2 for r in others for t in ("dq", "dk", "dv"))
        return {"segments": rep, "other_segments_isolated": ok}

    fwd_other_ok = True
    for b in range(L.n):
        if b == bad:
            continue
        rs = slice(L.off_q[b], L.off_q[b + 1])
        fwd_other_ok &= bool(torch.equal(out_c[rs], out_n[rs]))
    res["fa2_fwd_other_segments_identical"] = fwd_other_ok
    res["fa2_bwd"] = guarded(lambda: seg_report(
        fa2_backward(dout, q, k, v, out_c, lse_c, L, causal, scale),
        fa2_backward(dout, qn, kn, vn, out_n, lse_n, L, causal, scale)))
    res["fa4_bwd"] = guarded(lambda: seg_report(
        fa4_backward(dout, q, k, v, out_c, lse_c, L, causal, scale),
        fa4_backward(dout, qn, kn, vn, out_n, lse_n, L, causal, scale)))
    return res


def case_timing(name, lens, hq, hkv, d, dtype, causal, fa4_fwd=False, fa2=True):
    dev = Ctx.dev
    L = Layout(name, self_pairs(lens), dev)
    q, k, v, dout = make_inputs(L, hq, hkv, d, dtype, dev, seed=11)
    scale = d ** -0.5
    out, lse = fa2_forward(q, k, v, L, causal, scale)
    fl = layout_flops(L, hq, d, causal)
    res = {"layout": L.describe(), "hq": hq, "hkv": hkv, "d": d, "dtype": str(dtype), "causal": causal}

    def tf(key, fn, flops=None):
        r = guarded(lambda: time_fn(fn))
        if flops and "median_ms" in r:
            r["tflops"] = flops / (r["median_ms"] * 1e-3) / 1e12
        res[key] = r
        log(f"   {name} {key}: {r.get('median_ms', r.get('error', '?'))}")

    # FA4 first: its first-call time is the JIT compile of this config.
    tf("fa4_bwd", lambda: fa4_backward(dout, q, k, v, out, lse, L, causal, scale), fl["bwd"])
    if fa2:
        tf("fa2_bwd", lambda: fa2_backward(dout, q, k, v, out, lse, L, causal, scale), fl["bwd"])
        tf("fa2_fwd", lambda: fa2_forward(q, k, v, L, causal, scale), fl["fwd"])

        def f2():
            o, l_ = fa2_forward(q, k, v, L, causal, scale)
            return fa2_backward(dout, q, k, v, o, l_, L, causal, scale)
        tf("fa2_fwd_bwd", f2, fl["fwd"] + fl["bwd"])
    if fa4_fwd:
        tf("fa4_fwd", lambda: fa4_forward(q, k, v, L, causal, scale), fl["fwd"])

        def f4():
            o, l_ = fa4_forward(q, k, v, L, causal, scale)
            return fa4_backward(dout, q, k, v, o, l_, L, causal, scale)
        tf("fa4_fwd_bwd", f4, fl["fwd"] + fl["bwd"])
    try:
        a = res["fa2_bwd"]["median_ms"]
        b = res["fa4_bwd"]["median_ms"]
        res["bwd_speedup_fa4_over_fa2"] = a / b
    except (KeyError, TypeError):
        pass

    def agree():
        g4 = fa4_backward(dout, q, k, v, out, lse, L, causal, scale)
        g2 = fa2_backward(dout, q, k, v, out, lse, L, causal, scale)
        r = {nm: err_stats(a, b) for nm, a, b in zip(("dq", "dk", "dv"), g4, g2)}
        r["note"] = "FA4 vs FA2 (no float64 ref on timing layouts)"
        r["peak_extra_mb_fa4_bwd"] = peak_extra_mb(lambda: fa4_backward(dout, q, k, v, out, lse, L, causal, scale))
        r["peak_extra_mb_fa2_bwd"] = peak_extra_mb(lambda: fa2_backward(dout, q, k, v, out, lse, L, causal, scale))
        return r
    if fa2:
        res["fa4_vs_fa2"] = guarded(agree)
    res["flops"] = fl
    return res


def case_deterministic():
    dev = Ctx.dev
    lens, _ = mixed16_lengths()
    L = Layout("mixed16", self_pairs(lens), dev)
    hq = hkv = 16
    d, dtype, causal = 128, torch.bfloat16, False
    scale = d ** -0.5
    q, k, v, dout = make_inputs(L, hq, hkv, d, dtype, dev, seed=11)
    out, lse = fa2_forward(q, k, v, L, causal, scale)
    res = {"layout": L.describe()}
    res["time_deterministic"] = guarded(lambda: time_fn(
        lambda: fa4_backward(dout, q, k, v, out, lse, L, causal, scale, deterministic=True)))

    def rep(det):
        a = fa4_backward(dout, q, k, v, out, lse, L, causal, scale, deterministic=det)
        b = fa4_backward(dout, q, k, v, out, lse, L, causal, scale, deterministic=det)
        return {nm: bool(torch.equal(x, y)) for nm, x, y in zip(("dq", "dk", "dv"), a, b)}
    res["bitwise_repeat_deterministic"] = guarded(lambda: rep(True))
    res["bitwise_repeat_default"] = guarded(lambda: rep(False))
    return res


def case_cudagraph():
    dev = Ctx.dev
    L = Layout("self", SMALL["self"], dev)
    hq = hkv = 4
    d, dtype, causal = 128, torch.bfloat16, False
    scale = d ** -0.5
    q, k, v, dout = make_inputs(L, hq, hkv, d, dtype, dev, seed=3)
    out, lse = fa2_forward(q, k, v, L, causal, scale)
    ref = dense_reference(q, k, v, dout, L, causal, scale)
    eager = fa4_backward(dout, q, k, v, out, lse, L, causal, scale)
    res = {"eager": grad_stats(eager, ref)}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fa4_backward(dout, q, k, v, out, lse, L, causal, scale)
    torch.cuda.current_stream().wait_stream(s)
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = fa4_backward(dout, q, k, v, out, lse, L, causal, scale)
    g.replay()
    sync()
    res["replay"] = grad_stats(static, ref)
    # new data in the same buffers: the replay must follow it
    q2, k2, v2, dout2 = make_inputs(L, hq, hkv, d, dtype, dev, seed=4)
    for dst, src in ((q, q2), (k, k2), (v, v2), (dout, dout2)):
        dst.copy_(src)
    o2, l2 = fa2_forward(q, k, v, L, causal, scale)
    out.copy_(o2)
    lse.copy_(l2)
    g.replay()
    sync()
    res["replay_new_data"] = grad_stats(static, dense_reference(q, k, v, dout, L, causal, scale))
    res["captured_ok"] = True
    return res


def cache_dir_listing(path):
    if not path or not os.path.isdir(path):
        return None
    files, size = 0, 0
    by_sub = {}
    for root, _, fs in os.walk(path):
        for f in fs:
            if f.endswith(".o"):
                p = os.path.join(root, f)
                files += 1
                sz = os.path.getsize(p)
                size += sz
                sub = os.path.basename(root)
                by_sub[sub] = by_sub.get(sub, 0) + 1
    return {"dir": path, "objects": files, "mb": size / 2**20, "by_kind": by_sub}


def child_cache_check(args):
    """Run in a fresh process: first FA4 bwd call for the main config (self layout,
    bf16 d128 non-causal) should load from the persistent cache, not compile."""
    t = time.perf_counter()
    info = {}
    setup_fa4(args, info)
    Ctx.dev = torch.device("cuda")
    torch.cuda.init()
    info["import_s"] = time.perf_counter() - t
    L = Layout("self", SMALL["self"], Ctx.dev)
    q, k, v, dout = make_inputs(L, 4, 4, 128, torch.bfloat16, Ctx.dev, seed=0)
    out, lse = fa2_forward(q, k, v, L, False, 128 ** -0.5)
    _, a = first_call(lambda: fa4_backward(dout, q, k, v, out, lse, L, False, 128 ** -0.5))
    _, b = first_call(lambda: fa4_backward(dout, q, k, v, out, lse, L, False, 128 ** -0.5))
    info["first_call_s"] = a["first_call_s"]
    info["first_call_new_compiles"] = a["new_compiles"]
    info["second_call_s"] = b["first_call_s"]
    print("CHILD_JSON " + json.dumps(sanitize(info)), flush=True)


def case_cache_crossprocess(remaining_s):
    args = Ctx.args
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") != "1":
        return {"skipped": "persistent cache disabled (--no-persist)"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child-cache-check", "--out", args.out]
    if args.fa4_path:
        cmd += ["--fa4-path", args.fa4_path]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, min(240, remaining_s)),
                       env=dict(os.environ))
    res = {"wall_s": time.perf_counter() - t, "rc": p.returncode,
           "cache": cache_dir_listing(os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"))}
    for line in p.stdout.splitlines():
        if line.startswith("CHILD_JSON "):
            res["child"] = json.loads(line[len("CHILD_JSON "):])
    if "child" not in res:
        res["stdout_tail"] = p.stdout[-2000:]
        res["stderr_tail"] = p.stderr[-3000:]
    res["parent_compile_first_calls"] = Ctx.compile_times
    return res


# ----------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------


def setup_fa4(args, info):
    """Import flash_attn.cute.interface, working around a PYTHONPATH'd wheel unpack:
    * the nvidia_cutlass_dsl_packages.pth line (sys.path += nvidia_cutlass_dsl/dsl_packages)
      only runs for site dirs, not PYTHONPATH entries;
    * flash_attn/cute/testing.py imports einops at module level (only for test helpers)."""
    if args.fa4_path:
        for p in reversed(args.fa4_path.split(os.pathsep)):
            if p and p not in sys.path:
                sys.path.insert(0, p)
    if not args.no_persist:
        cache = args.cache_dir or os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR") or os.path.join(
            "/tmp", f"fa4_probe_cache_{int(time.time())}")
        os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
        os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = cache
        info["persistent_cache_dir"] = cache
    try:
        import cutlass  # noqa: F401
    except ImportError:
        import importlib.util
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
        if spec is not None and spec.submodule_search_locations:
            dsl = os.path.join(list(spec.submodule_search_locations)[0], "dsl_packages")
            sys.path.insert(0, dsl)
            info["added_dsl_packages_to_path"] = dsl
    import importlib.util
    deps = {}
    for mod in ("cutlass", "cutlass.cute", "tvm_ffi", "quack", "triton", "cuda.bindings", "einops",
                "torch_c_dlpack_ext", "flash_attn"):
        try:
            spec = importlib.util.find_spec(mod)
            deps[mod] = None if spec is None else (spec.origin or "namespace:" + ",".join(spec.submodule_search_locations or []))
        except Exception as e:  # noqa: BLE001
            deps[mod] = f"error {type(e).__name__}: {e}"
    info["dep_specs"] = deps
    if deps.get("cutlass", "") and str(deps["cutlass"]).startswith("namespace:"):
        info["dep_warning"] = ("cutlass resolves to a namespace package (no __init__.py): the pure-Python "
                               "wheel nvidia-cutlass-dsl-libs-core==4.8.1 is missing")
    try:
        import einops  # noqa: F401
    except ImportError:
        stub = types.ModuleType("einops")

        def _nope(*a, **k):
            raise RuntimeError("einops stub (not installed)")
        stub.rearrange = stub.repeat = stub.reduce = _nope
        sys.modules["einops"] = stub
        info["einops_stubbed"] = True
    t = time.perf_counter()
    import flash_attn.cute.interface as fa4
    info["fa4_import_s"] = time.perf_counter() - t
    info["fa4_interface_file"] = fa4.__file__
    Ctx.fa4 = fa4
    return fa4


def versions(info):
    import importlib.metadata as md
    info["python"] = sys.version.split()[0]
    info["platform"] = platform.platform()
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["torch_has_dlpack_c_exchange_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                 "nvidia-cutlass-dsl-libs-core", "quack-kernels", "apache-tvm-ffi",
                 "cuda-bindings", "torch-c-dlpack-ext", "einops", "triton", "flashinfer-python"):
        try:
            info[f"pkg:{dist}"] = md.version(dist)
        except Exception:  # noqa: BLE001
            info[f"pkg:{dist}"] = None
    try:
        import cutlass
        info["cutlass.__version__"] = getattr(cutlass, "__version__", None)
    except Exception as e:  # noqa: BLE001
        info["cutlass_import_error"] = repr(e)
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = list(torch.cuda.get_device_capability(0))
        info["sm_count"] = p.multi_processor_count
        info["gpu_mem_gb"] = p.total_memory / 2**30
        info["flash_sdp_available"] = bool(torch.backends.cuda.is_flash_attention_available())
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        pass


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------


def build_cases():
    bf16, fp16 = torch.bfloat16, torch.float16
    lens16, seed16 = mixed16_lengths()
    mixed = self_pairs(lens16)
    C = []

    def corr(name, pairs, hq, hkv, d, dtype, causal, **kw):
        C.append((name, lambda: case_correctness(name, pairs, hq, hkv, d, dtype, causal, **kw)))

    def timing(name, lens, hq, hkv, d, dtype, causal, **kw):
        C.append((name, lambda: case_timing(name, lens, hq, hkv, d, dtype, causal, **kw)))

    # 1. the main case (compiles bf16 d128 non-causal) and its correctness
    timing("time_mixed16_bf16_d128_nc", lens16, 16, 16, 128, bf16, False)
    corr("corr_mixed16_bf16_d128_nc", mixed, 16, 16, 128, bf16, False)
    # 2. same kernel config, edge layouts (no new compile expected)
    corr("corr_self_nc", SMALL["self"], 4, 4, 128, bf16, False)
    corr("corr_cross_empty_nc", SMALL["cross_empty"], 4, 4, 128, bf16, False)
    corr("corr_onetok_mix_nc", SMALL["onetok_mix"], 4, 4, 128, bf16, False)
    corr("corr_allempty_k_nc", SMALL["allempty_k"], 4, 4, 128, bf16, False)
    C.append(("nan_isolation_q_nc", lambda: case_nan_isolation("q", False)))
    C.append(("nan_isolation_kv_nc", lambda: case_nan_isolation("kv", False)))
    # 3. causal (one more compile)
    timing("time_mixed16_bf16_d128_causal", lens16, 16, 16, 128, bf16, True)
    corr("corr_mixed16_bf16_d128_causal", mixed, 16, 16, 128, bf16, True)
    corr("corr_self_causal", SMALL["self"], 4, 4, 128, bf16, True)
    corr("corr_cross_empty_causal", SMALL["cross_empty"], 4, 4, 128, bf16, True)
    corr("corr_onetok_mix_causal", SMALL["onetok_mix"], 4, 4, 128, bf16, True)
    C.append(("nan_isolation_q_causal", lambda: case_nan_isolation("q", True)))
    # 4. more timing on compiled configs
    timing("time_long4x8192_nc", [8192] * 4, 16, 16, 128, bf16, False)
    timing("time_long4x8192_causal", [8192] * 4, 16, 16, 128, bf16, True)
    timing("time_short250_nc", short250_lengths(), 16, 16, 128, bf16, False)
    # 5. GQA (ratio 4 and 2 compile separately)
    timing("time_mixed16_gqa32_8_nc", lens16, 32, 8, 128, bf16, False)
    corr("corr_gqa16_4_self_nc", SMALL["self"], 16, 4, 128, bf16, False)
    corr("corr_gqa32_8_cross_nc", SMALL["cross_empty"], 32, 8, 128, bf16, False)
    corr("corr_gqa2_1_self_nc", SMALL["self"], 2, 1, 128, bf16, False)
    # 6. FA4 forward: timing on mixed16 and the LSE cross-check
    timing("time_fa4_fwd_mixed16_nc", lens16, 16, 16, 128, bf16, False, fa4_fwd=True, fa2=False)
    corr("corr_fa4_fwd_cross_empty_nc", SMALL["cross_empty"], 4, 4, 128, bf16, False, fa4_fwd=True)
    corr("corr_fa4_fwd_cross_empty_causal", SMALL["cross_empty"], 4, 4, 128, bf16, True, fa4_fwd=True)
    # 7. fp16
    corr("corr_fp16_self_nc", SMALL["self"], 4, 4, 128, fp16, False)
    corr("corr_fp16_cross_empty_nc", SMALL["cross_empty"], 4, 4, 128, fp16, False)
    # 8. head dims (72/80 also zero-padded to 96, 96's kernel)
    for d in (64, 96, 256, 72, 80):
        pad = None if d in CANON_HDIMS else next(x for x in CANON_HDIMS if x >= d)
        corr(f"corr_d{d}_cross_empty_nc", SMALL["cross_empty"], 4, 4, d, bf16, False, pad_to=pad)
    # 9. CUDA graphs, determinism, persistent cache in a second process
    C.append(("cudagraph_capture", case_cudagraph))
    C.append(("deterministic", case_deterministic))
    C.append(("cache_crossprocess", None))  # filled in main (needs the remaining budget)
    # 10. lower priority: more configs
    corr("corr_gqa16_4_cross_causal", SMALL["cross_empty"], 16, 4, 128, bf16, True)
    corr("corr_d64_causal", SMALL["cross_empty"], 4, 4, 64, bf16, True)
    corr("corr_d256_causal", SMALL["cross_empty"], 4, 4, 256, bf16, True)
    corr("corr_onetok_pure_nc", SMALL["onetok_pure"], 4, 4, 128, bf16, False)
    corr("corr_many300_nc", many_pairs(), 4, 4, 128, bf16, False)
    timing("time_mixed16_gqa32_8_causal", lens16, 32, 8, 128, bf16, True)
    return C, {"mixed16_lens": lens16, "mixed16_seed": seed16}


def selftest_cpu():
    """CPU float64 checks of the reference, the LSE convention and the helpers."""
    torch.manual_seed(0)
    ok = True
    cases = [("self", SMALL["self"][:4], 2, 2), ("cross_empty", SMALL["cross_empty"], 4, 2),
             ("onetok_mix", SMALL["onetok_mix"][:5], 4, 1), ("allempty_k", SMALL["allempty_k"], 2, 2)]
    for name, pairs, hq, hkv in cases:
        pairs = [(min(a, 40), min(b, 40)) if (a, b) != (0, 0) else (a, b) for a, b in pairs]
        L = Layout(name, pairs)
        for causal in (False, True):
            d = 16
            q, k, v, dout = make_inputs(L, hq, hkv, d, torch.float64, "cpu", seed=1)
            scale = d ** -0.5
            ref = dense_reference(q, k, v, dout, L, causal, scale)
            # (a) the reference against an independent per-head loop with SDPA where every row sees a key
            worst = 0.0
            for b, (lq, lk) in enumerate(L.pairs):
                if lq == 0 or lk == 0:
                    continue
                i = torch.arange(lq)[:, None]
                j = torch.arange(lk)[None, :]
                mask = (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool)
                rows = mask.any(-1)
                for h in range(hq):
                    kh = h // (hq // hkv)
                    qq = q[L.off_q[b]:L.off_q[b] + lq, h].clone().requires_grad_(True)
                    kk = k[L.off_k[b]:L.off_k[b] + lk, kh].clone().requires_grad_(True)
                    vv = v[L.off_k[b]:L.off_k[b] + lk, kh].clone().requires_grad_(True)
                    o = torch.nn.functional.scaled_dot_product_attention(
                        qq[rows][None], kk[None], vv[None], attn_mask=mask[rows][None], scale=scale)[0]
                    go = dout[L.off_q[b]:L.off_q[b] + lq, h][rows]
                    gq, gk, gv = torch.autograd.grad((o * go).sum(), (qq, kk, vv))
                    ro = ref.out[L.off_q[b]:L.off_q[b] + lq, h]
                    worst = max(worst, float((ro[rows] - o.detach()).abs().max()),
                                float(ro[~rows].abs().max()) if bool((~rows).any()) else 0.0,
                                float((ref.dq[L.off_q[b]:L.off_q[b] + lq, h] - gq).abs().max()))
                    # per-kv-head grads get summed over the group in the reference: check dv for group of 1
                    if hq == hkv:
                        worst = max(worst, float((ref.dk[L.off_k[b]:L.off_k[b] + lk, kh] - gk).abs().max()),
                                    float((ref.dv[L.off_k[b]:L.off_k[b] + lk, kh] - gv).abs().max()))
            # (b) an FA-style backward fed the reference LSE, as +inf (aten) and -inf (FA4 fwd)
            g_pos = fake_flash_bwd(q, k, v, ref.out, dout, ref.lse, L, causal, scale)
            neg = ref.lse.masked_fill(ref.lse == math.inf, -math.inf)
            g_neg = fake_flash_bwd(q, k, v, ref.out, dout, neg, L, causal, scale)
            sp, sn = grad_stats(g_pos, ref), grad_stats(g_neg, ref)
            # (c) a base-2 LSE (FlashInfer layout [Tq, Hq]) converted to FA4's
            fi = (ref.lse / LN2).t().masked_fill((ref.lse == math.inf).t(), -math.inf)
            conv = (fi * LN2).t().contiguous()
            sc = grad_stats(fake_flash_bwd(q, k, v, ref.out, dout, conv, L, causal, scale), ref)
            good = worst < 1e-10 and sp["worst_rel"] < 1e-10 and sn["worst_rel"] < 1e-10 and sc["worst_rel"] < 1e-10
            ok &= good
            print(f"selftest {name:12s} causal={causal!s:5s} keyless={ref.keyless_rows:3d} "
                  f"sdpa_vs_ref={worst:.2e} fake_bwd(+inf)={sp['worst_rel']:.2e} "
                  f"fake_bwd(-inf)={sn['worst_rel']:.2e} fake_bwd(flashinfer->fa4)={sc['worst_rel']:.2e} "
                  f"{'OK' if good else 'FAIL'}", flush=True)
    # (d) the helpers on a perturbed copy
    x = torch.randn(5, 3)
    s = err_stats(x + 1e-3, x)
    assert abs(s["max_abs"] - 1e-3) < 1e-6, s
    y = x.clone()
    y[0, 0] = float("nan")
    assert err_stats(y, x)["rel"] == math.inf
    json.dumps(sanitize({"a": math.inf, "b": [float("nan"), 1.0], "t": torch.ones(2)}), allow_nan=False)
    lens, seed = mixed16_lengths()
    print(f"mixed16 seed={seed} total={sum(lens)} lens={lens}", flush=True)
    fl = layout_flops(Layout("m", self_pairs(lens)), 16, 128, False)
    print(f"mixed16 bwd TFLOP per call: {fl['bwd'] / 1e12:.3f}", flush=True)
    print("SELFTEST", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for probe_fa4.json")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no new case after this many seconds")
    ap.add_argument("--fa4-path", default=os.environ.get("FA4_PATH"),
                    help="dir(s) with the unpacked flash-attn-4 wheels (prepended to sys.path)")
    ap.add_argument("--cache-dir", default=None, help="FA4 persistent kernel cache dir (default: fresh /tmp dir)")
    ap.add_argument("--no-persist", action="store_true", help="in-memory FA4 kernel cache only")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only matching cases")
    ap.add_argument("--skip", default=None, help="comma-separated substrings: skip matching cases")
    ap.add_argument("--selftest-cpu", action="store_true")
    ap.add_argument("--child-cache-check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    Ctx.args = args
    if args.selftest_cpu:
        return selftest_cpu()
    if args.child_cache_check:
        child_cache_check(args)
        return 0
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "probe_fa4.json")
    results = {"env": {}, "cases": {}, "order": [], "skipped_budget": [], "skipped_filter": []}

    def dump():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(sanitize(results), f, indent=1, allow_nan=False)
        os.replace(tmp, path)

    env = results["env"]
    if not torch.cuda.is_available():
        env["error"] = "no CUDA device"
        dump()
        log("no CUDA device")
        return 1
    Ctx.dev = torch.device("cuda")
    try:
        setup_fa4(args, env)
    except Exception as e:  # noqa: BLE001 - FA2 numbers are still worth having
        env["fa4_import_error"] = f"{type(e).__name__}: {e}"
        env["fa4_import_traceback"] = traceback.format_exc()[-4000:]
        log(f"FA4 import failed: {e}")
    versions(env)
    env["budget_s"] = args.budget_s
    env["iters"], env["warmup"] = args.iters, args.warmup
    try:
        env["fa4_arch"] = Ctx.fa4._get_device_arch() if Ctx.fa4 else None
    except Exception as e:  # noqa: BLE001
        env["fa4_arch"] = repr(e)
    cases, meta = build_cases()
    env.update(meta)
    dump()
    log(f"env: torch {env.get('torch')} gpu {env.get('gpu')} fa4 {env.get('pkg:flash-attn-4')}")
    only = [s for s in (args.only or "").split(",") if s]
    skip = [s for s in (args.skip or "").split(",") if s]
    for name, fn in cases:
        if (only and not any(s in name for s in only)) or any(s in name for s in skip):
            results["skipped_filter"].append(name)
            continue
        elapsed = time.perf_counter() - T0
        if elapsed > args.budget_s:
            results["skipped_budget"].append(name)
            continue
        if name == "cache_crossprocess":
            fn = (lambda rem=args.budget_s - elapsed + 60: case_cache_crossprocess(rem))
        log(f"start {name}")
        t = time.perf_counter()
        r = guarded(fn)
        r["wall_s"] = time.perf_counter() - t
        # record first-call (JIT) times that compiled something, per case
        for key, sub in list(r.items()):
            if isinstance(sub, dict) and sub.get("new_compiles"):
                Ctx.compile_times[f"{name}/{key}"] = {"s": sub.get("first_call_s"), "new": sub["new_compiles"]}
        results["cases"][name] = r
        results["order"].append(name)
        results["compile_first_calls"] = Ctx.compile_times
        try:
            sync()
        except Exception as e:  # noqa: BLE001 - a sticky CUDA error poisons the rest
            r["cuda_error_after"] = repr(e)
            results["cuda_poisoned_after"] = name
            dump()
            log(f"CUDA context broken after {name}: {e}; stopping")
            break
        summ = r.get("summary") or {k: r[k].get("median_ms") for k in ("fa4_bwd", "fa2_bwd") if isinstance(r.get(k), dict)}
        log(f"done  {name} in {r['wall_s']:.1f}s: {summ if summ else ('ERROR ' + r['error'][:200] if 'error' in r else 'ok')}")
        dump()
    results["total_s"] = time.perf_counter() - T0
    results["fa4_cache"] = cache_dir_listing(os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"))
    dump()
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
