"""End to end: an 8-layer encoder forward (packed and NJT forms, ours and stock)
on the mixed16 layout, every variant on the same weights and input."""

from __future__ import annotations

import contextlib
import time

import torch

from harness import (
    DTYPE,
    E2E_REL_TOL,
    Budget,
    Skip,
    all_runtime_stats,
    auto_backend,
    err_str,
    log,
    max_diff,
    need_rc,
    rc,
    recorded,
    stats_delta,
)
from layouts import cu_seqlens, lengths_for
from model import Encoder, values
from report import _one_line, section_meta
from timing import call_ms, kernel_times, median, sync
from variants import flashinfer_wrapper, varlen_kwargs


def profile_kernels(fwd, n: int) -> dict:
    """GPU kernel time per forward (timing.kernel_times), under this file's JSON names."""
    k = kernel_times(fwd, steps=n, top=8)
    return {
        "gpu_kernel_ms": k["total_ms"],
        "gpu_kernels_per_forward": k["kernels_per_step"],
        "top_kernels": [{"kernel": name, "ms_per_forward": ms} for name, ms in k["top"]],
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
        w = Encoder(d, heads, layers).to(dev, DTYPE).eval()  # every variant runs these weights
        cu_host = cu_seqlens(lens)
        cu = cu_host.to(dev)
        g = torch.Generator(device=dev).manual_seed(7)
        x = torch.randn(T, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        def make_njt():  # fresh per variant: ragged_compile.compile marks its inputs dynamic
            return torch.nested.nested_tensor_from_jagged(x, cu.long(), min_seqlen=Lmin, max_seqlen=Lmax)

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

    # -- variant builders: each returns (fwd callable -> [T, d], uses_runtime)
    def v_ours_packed(compiled):
        need_rc()
        m = torch.compile(w, fullgraph=True) if compiled else w

        def fwd():
            with rt.step(lens):
                return m(x, cu)

        return fwd, True

    def v_flashinfer_by_hand():
        if dev.type != "cuda":
            raise Skip("CUDA only")
        # The kernel ours ran in ours_packed_eager (first in the plan), else auto's rule.
        backend = getattr(rt, "last_backend", None)
        if backend not in ("fa2", "fa3"):
            backend = auto_backend(dev, n, T, hq=heads, hkv=heads, head_dim=d // heads, causal=False)
        wr, kw = flashinfer_wrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), backend, False, scale)
        m = w.with_attention(lambda q, k, v, cu: wr.run(q, k, v))
        base["flashinfer_backend"] = backend

        def fwd():
            wr.plan(cu_host, cu_host, heads, heads, d // heads, **kw)  # once per forward
            return m(x, cu)

        return fwd, False

    def v_varlen_compiled():
        varlen_attn, kw, _ = varlen_kwargs(False, False, scale, d // heads)

        def attn(q, k, v, cu):
            r = varlen_attn(q, k, v, cu, cu, Lmax, Lmax, **kw)
            return r[0] if isinstance(r, tuple) else r

        m = torch.compile(w.with_attention(attn), fullgraph=True)
        return (lambda: m(x, cu)), False

    def v_njt(make_model, uses_rt=False):
        m, xn = make_model(), make_njt()
        return (lambda: values(m(xn))), uses_rt

    def v_enable_eager():
        need_rc("enable")
        xn = make_njt()

        def fwd():
            with rc.enable():
                return values(w(xn))

        return fwd, True

    plan = [
        ("ours_packed_eager", lambda: v_ours_packed(False)),  # baseline for output agreement
        ("ragged_compile_compile", lambda: v_njt(lambda: need_rc("compile")(w, fullgraph=True), True)),
        ("njt_sdpa_compiled", lambda: v_njt(lambda: torch.compile(w, fullgraph=True))),
        ("varlen_compiled", v_varlen_compiled),
        ("ours_packed_compiled", lambda: v_ours_packed(True)),
        ("flashinfer_by_hand_eager", v_flashinfer_by_hand),
        ("njt_sdpa_eager", lambda: v_njt(lambda: w)),
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
        with recorded(rec, name, dev):
            budget.check(30)
            # Dynamo keys compiled code by code object (Encoder.forward is shared by
            # every variant) and does not guard on ragged_compile.enable: start clean.
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
                ts = call_ms(fwd, dev, reps)
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
                        rec.update(profile_kernels(fwd, 3 if not smoke else 1))
                    except Exception as e:  # noqa: BLE001
                        rec["profile_error"] = err_str(e)
                else:
                    rec["profile_skipped"] = "no CUDA: GPU kernel time not measured"
                rec["status"] = "ok"
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

