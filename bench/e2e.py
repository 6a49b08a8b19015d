"""End to end: an 8-layer encoder forward (packed and NJT forms, ours and stock)
on the mixed16 layout, every variant on the same weights and input."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import (
    CPU_EXPECTED_FAILURES,
    DTYPE,
    E2E_REL_TOL,
    Budget,
    Skip,
    Unsupported,
    all_runtime_stats,
    auto_backend,
    err_str,
    has_kwarg,
    log,
    max_diff,
    need_rc,
    rc,
    stats_delta,
    tb_tail,
)
from layouts import lengths_for
from report import _one_line, section_meta
from timing import kernel_times, median, sync

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

        # The kernel ours ran in ours_packed_eager (first in the plan), else auto's rule.
        backend = getattr(rt, "last_backend", None)
        if backend not in ("fa2", "fa3"):
            backend = auto_backend(dev, n, T, hq=heads, hkv=heads, head_dim=d // heads, causal=False)
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
                        rec.update(profile_kernels(fwd, 3 if not smoke else 1))
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

