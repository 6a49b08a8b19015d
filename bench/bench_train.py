"""Training benchmark: attention forward+backward and an encoder training step.

    python bench/bench_train.py --out bench/results [--only attn|e2e] [--smoke]

Side by side in one process, bf16 (CUDA; ``--smoke`` runs tiny sizes anywhere,
the CPU included, where the CUDA-only rows record their error):

* ``attn``: attention forward+backward (``torch.autograd.grad`` of a fixed output
  gradient) on the mixed16, long4x8192, gqa32_8, short250 and vit42 layouts of
  layouts.py (causal where named so). ``ours``: ``ragged_attention`` inside a runtime step whose plan is
  made (the per-layer cost in a model, where one plan serves every layer), with
  the backward ``auto`` picks (flash-attn-4's where it is installed);
  ``ours_fa2``: the same with ``RAGGED_COMPILE_BACKWARD=fa2``; ``ours_plan``: a
  fresh step per call (plan included); ``ours_fwd``: the inference forward alone, in
  a fresh step per call (plan included);
  ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (FA2 forward and
  backward), GQA with k/v expanded where it has no ``enable_gqa``; ``njt_sdpa``:
  stock NJT SDPA (no GQA). ``--smoke`` also checks ours' gradients against the
  float64 oracle (``ragged_compile.reference.dense_gradients``).
* ``e2e``: the 8-layer encoder of model.py (d=2048, 16 heads) training step on
  mixed16: forward, backward, AdamW. ``ours`` / ``ours_fa2``: the NJT model
  through ``ragged_compile.compile``; ``njt_sdpa_compiled``: the same NJT model
  through ``torch.compile``; ``varlen_compiled``: the packed model with
  ``varlen_attn`` through ``torch.compile``. Peak memory per step
  (``max_memory_allocated``, CUDA).

Writes ``train.json`` and ``train.md`` (``train-attn.*`` / ``train-e2e.*`` with
``--only``) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import time
import traceback
from unittest import mock
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import ragged_compile as rc
from env import environment
from harness import DTYPE
from layouts import LAYOUT_SPECS, Case, cu_seqlens, lengths_for
from model import Encoder, values
from ragged_compile.backends import select
from ragged_compile.reference import dense_gradients
from ragged_compile.runtime import Runtime
from ragged_compile.steps import PlannedStep, activate
from timing import sync, time_fn
from variants import varlen_kwargs

HERE = os.path.dirname(os.path.abspath(__file__))
ATTN_LAYOUTS = ("mixed16", "mixed16_causal", "long4x8192", "gqa32_8", "short250", "short250_causal", "vit42",
                "vit42_causal")
# the backward sweep: each layout class, causal and not, over head shapes; FA2's and
# FA4's backward timed on the same forward (the rule in backends/select.py is fitted on it)
SWEEP_KINDS = ("short", "vit", "mid", "mixed", "long")
SWEEP_HEADS = ((16, 16, 128), (32, 8, 128), (16, 16, 64), (16, 16, 80), (8, 8, 256))


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``name`` set to ``value`` inside (unchanged for None): our knobs are read per call."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def fa4_pad(mode: str | None):
    """Force how flash-attn-4's isolation layout is written (RAGGED_COMPILE_FA4_PAD)."""
    return _env("RAGGED_COMPILE_FA4_PAD", mode)


def backward(kernel: str | None):
    """Force the op's CUDA backward (RAGGED_COMPILE_BACKWARD)."""
    return _env("RAGGED_COMPILE_BACKWARD", kernel)


def timed(fn, dev, reps: int, warmup: int) -> dict:
    t = time_fn(fn, dev, warmup=warmup, min_reps=reps)
    return {k: t[k] for k in ("ms", "ms_min", "ms_p90", "reps")}


# -------------------------------------------------------------------------- attention
def bench_attention(args, dev) -> dict:
    res = {}
    specs = {s[0]: s for s in LAYOUT_SPECS}
    for i, name in enumerate(ATTN_LAYOUTS):
        c = Case(*specs[name], dev=dev, smoke=args.smoke, seed=i)
        q, k, v = (t.requires_grad_() for t in (c.q, c.k, c.v))
        go = torch.randn_like(c.q)
        cu, m, lens, causal = c.cu, c.max_len, c.lens, c.causal
        rt = Runtime(dev)
        row = {"lengths": lens, "tokens": c.total, "hq": c.hq, "hkv": c.hkv, "causal": causal}

        def ours():
            out = rc.ragged_attention(q, k, v, cu, causal=causal)
            return torch.autograd.grad(out, (q, k, v), go)

        def fresh_step():
            with rt.step():
                return ours()

        def forward_only():
            with torch.no_grad(), rt.step():
                return rc.ragged_attention(q, k, v, cu, causal=causal)

        def run(label, fn, check=None):
            try:
                row[label] = timed(fn, dev, args.reps, warmup=3)
                if check is not None:
                    row[label]["max_abs_diff_vs_ours"] = check
            except Exception as e:  # noqa: BLE001 - record, keep going
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}

        with rt.step():
            for _ in range(10):  # plan once (the per-layer cost in a model); the first timed
                ours()  # column of a layout also warms the GPU's clocks, so a few more
            run("ours", ours)
            ref = ours()
        if args.smoke:  # ours' gradients against the float64 oracle
            want = dense_gradients(go, q, k, v, c.cu_host, c.cu_host, causal, c.scale)[1:]
            row["ours_grad_max_abs_diff_vs_float64"] = max(
                float((a.double().cpu() - b).abs().max()) for a, b in zip(ref, want)
            )
        for kernel in ("fa2", "fa4"):
            with rt.step(), backward(kernel):
                ours()
                run(f"ours_{kernel}", ours)
        run("ours_plan", fresh_step)
        run("ours_fwd", forward_only)

        try:
            varlen_attn, kw, expand = varlen_kwargs(causal, c.hq != c.hkv)
        except Exception as e:  # noqa: BLE001 - no varlen_attn in this torch
            row["varlen_attn"] = {"error": f"{type(e).__name__}: {e}"}
        else:
            grp = c.hq // c.hkv

            def varlen():
                kk, vv = (k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)) if expand else (k, v)
                out = varlen_attn(q, kk, vv, cu, cu, m, m, **kw)
                return torch.autograd.grad(out, (q, k, v), go)

            try:
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(varlen(), ref))
            except Exception:  # noqa: BLE001 - the timed run records the error
                diff = None
            run("varlen_attn", varlen, diff)
            if expand and "ms" in row["varlen_attn"]:
                row["varlen_attn"]["note"] = "no enable_gqa in this torch: k/v expanded (timed)"
        if c.hq == c.hkv:
            off = cu.long()

            def njt():
                nts = [torch.nested.nested_tensor_from_jagged(t, off, min_seqlen=c.min_len, max_seqlen=m) for t in (q, k, v)]
                out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in nts), is_causal=causal)
                return torch.autograd.grad(out.transpose(1, 2).values(), (q, k, v), go)

            run("njt_sdpa", njt)
        for label in ("ours", "ours_fa2", "ours_fa4", "ours_plan"):
            if "ms" in row.get(label, {}) and "ms" in row.get("varlen_attn", {}):
                row[f"speedup_{label}_vs_varlen"] = row["varlen_attn"]["ms"] / row[label]["ms"]
        res[name] = row
        print(name, json.dumps({k: (v if not isinstance(v, dict) else v.get("ms", v)) for k, v in row.items() if k != "lengths"}), flush=True)
        del c, q, k, v, go, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


# -------------------------------------------------------------------------- backward sweep
def bench_backward_sweep(args, dev) -> list[dict]:
    """Forward+backward through the op with its backward forced to FA2 and to FA4, on
    one runtime step per row (so both share the planned forward), interleaved."""
    rows = []
    heads = SWEEP_HEADS if not args.sweep_heads else [
        tuple(int(x) for x in h.split("/")) for h in args.sweep_heads.split(",")]
    for kind in SWEEP_KINDS:
        for hq, hkv, d in heads:
            for causal in (False, True):
                c = Case(f"{kind}_{hq}_{hkv}_{d}", kind, hq, hkv, d, causal, dev=dev, smoke=args.smoke, seed=7)
                q, k, v = (t.requires_grad_() for t in (c.q, c.k, c.v))
                go = torch.randn_like(c.q)
                row = {"kind": kind, "hq": c.hq, "hkv": c.hkv, "d": d, "causal": causal, "segments": c.n,
                       "tokens": c.total, "max_len": c.max_len, "pairs": sum(n * n for n in c.lens)}
                for kernel, pad in (("fa2", None), ("fa4", "copies"), ("fa4", "fused"), ("fa4", "redo")):
                    label = kernel if pad in (None, "copies") else f"{kernel}_{pad}"
                    rt = Runtime(dev)
                    try:
                        with rt.step(), backward(kernel), fa4_pad(pad):
                            def step():
                                out = rc.ragged_attention(q, k, v, c.cu, causal=causal)
                                return torch.autograd.grad(out, (q, k, v), go)
                            step()
                            row[f"{label}_ms"] = timed(step, dev, args.reps, warmup=2)["ms"]
                    except Exception as e:  # noqa: BLE001 - record, keep going
                        row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                for label in ("fa4", "fa4_fused", "fa4_redo"):
                    if "fa2_ms" in row and f"{label}_ms" in row:
                        row[f"{label}_over_fa2"] = row[f"{label}_ms"] / row["fa2_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                del c, q, k, v, go
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# -------------------------------------------------------------------------- forward sweep
FWD_SWEEP_HEADS = ((16, 16, 128), (32, 8, 128), (16, 16, 64), (8, 8, 256))


def bench_forward_sweep(args, dev) -> list[dict]:
    """The training forward on FlashInfer's kernel (the runtime's ``auto``: its LSE
    converted) against flash-attn-4's (``backend="fa4"``: isolation by recompute
    included), alone and followed by flash-attn-4's backward; the FA4 kernel alone
    (no isolation) beside them. One runtime step per column (planned once), the
    columns interleaved over ``--rounds`` rounds."""
    from ragged_compile.backends import fa4_forward

    rows = []
    heads = FWD_SWEEP_HEADS if not args.sweep_heads else [
        tuple(int(x) for x in h.split("/")) for h in args.sweep_heads.split(",")]
    for kind in SWEEP_KINDS:
        for hq, hkv, d in heads:
            for causal in (False, True):
                c = Case(f"{kind}_{hq}_{hkv}_{d}", kind, hq, hkv, d, causal, dev=dev, smoke=args.smoke, seed=7)
                q, k, v = (t.requires_grad_() for t in (c.q, c.k, c.v))
                go = torch.randn_like(c.q)
                pairs = sum(n * n for n in c.lens)
                row = {"kind": kind, "hq": c.hq, "hkv": c.hkv, "d": d, "causal": causal, "segments": c.n,
                       "tokens": c.total, "max_len": c.max_len, "pairs": pairs,
                       "work": select.backward_work(c.hq, c.hkv, c.total, c.total, pairs, causal)}
                cu32 = c.cu.to(torch.int32)
                cols = {}
                for label, backend in (("fi", "auto"), ("fa4", "fa4")):
                    rt = Runtime(dev, backend=backend)
                    step = PlannedStep(rt, [])  # one plan per column, re-entered per call
                    # the "fi" column: auto's kernels with FA4's forward left out
                    plain = mock.patch.object(select, "training_forward", lambda *a, **kw: None) if label == "fi" \
                        else contextlib.nullcontext()

                    def fwd(step=step, plain=plain):
                        with activate(step), plain:
                            return rc.ragged_attention(q, k, v, c.cu, causal=causal)

                    def fwd_bwd(step=step, plain=plain):
                        with activate(step), plain:
                            return torch.autograd.grad(rc.ragged_attention(q, k, v, c.cu, causal=causal), (q, k, v), go)

                    cols[f"{label}_fwd"] = (rt, step, fwd)
                    cols[f"{label}_fwd_bwd"] = (rt, step, fwd_bwd)

                def kernel_only():
                    return fa4_forward._kernel(q.detach(), k.detach(), v.detach(), cu_seqlens_q=cu32,
                                               cu_seqlens_k=cu32, max_seqlen_q=c.max_len, max_seqlen_k=c.max_len,
                                               softmax_scale=c.scale, causal=causal, return_lse=True)[:2]

                cols["fa4_kernel"] = (None, None, kernel_only)
                times = {}
                try:
                    with backward("fa4"):
                        for label, (rt, _, fn) in cols.items():
                            fn()  # compile, plan
                        for label, (rt, _, fn) in cols.items():
                            if rt is not None:
                                row[f"{label}_ran"] = rt.last_backend
                        if dev.type == "cuda":  # each column ran the forward it names
                            assert row["fi_fwd_ran"] != "fa4" and row["fa4_fwd_ran"] == "fa4", row
                        ref = cols["fi_fwd"][2]().detach()
                        got = cols["fa4_fwd"][2]().detach()
                        row["fa4_max_abs_diff_vs_fi"] = float((ref.float() - got.float()).abs().max())
                        for _ in range(args.rounds):
                            for label, (_, _, fn) in cols.items():
                                times.setdefault(label, []).append(timed(fn, dev, args.reps, warmup=1)["ms"])
                except Exception as e:  # noqa: BLE001 - record, keep going
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                finally:
                    for label, (rt, step, _) in cols.items():
                        if step is not None and label.endswith("_fwd"):
                            rt._release(step)
                for label, ts in times.items():
                    row[f"{label}_ms"] = sorted(ts)[len(ts) // 2]
                if "fi_fwd_ms" in row and "fa4_fwd_ms" in row:
                    row["fa4_over_fi_fwd"] = row["fa4_fwd_ms"] / row["fi_fwd_ms"]
                    row["fa4_over_fi_fwd_bwd"] = row["fa4_fwd_bwd_ms"] / row["fi_fwd_bwd_ms"]
                    row["isolation_ms"] = row["fa4_fwd_ms"] - row["fa4_kernel_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                del c, q, k, v, go, cols
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# -------------------------------------------------------------------------- end to end
def e2e_setup(dev, smoke: bool, layout: str = "mixed") -> SimpleNamespace:
    """The training step's model (NJT form; ``varlen`` is its packed attention) and inputs,
    on one layout class of layouts.py (``mixed``, or ``vit``: patch-grid segments)."""
    lens = list(lengths_for(layout, smoke))
    d, heads, layers = (256, 4, 2) if smoke else (2048, 16, 8)
    T, m = sum(lens), max(lens)
    cu = cu_seqlens(lens, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, d, device=dev, generator=g).to(DTYPE)
    target = torch.randn(T, d, device=dev, generator=g).to(DTYPE)
    x_njt = torch.nested.nested_tensor_from_jagged(x, cu.long(), min_seqlen=min(lens), max_seqlen=m)
    torch.manual_seed(0)
    model = Encoder(d, heads, layers).to(dev, DTYPE)
    varlen_attn, kw, _ = varlen_kwargs(False, False)

    def varlen(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, m, m, **kw)

    return SimpleNamespace(lens=lens, tokens=T, d=d, heads=heads, layers=layers, cu=cu, x=x,
                           x_njt=x_njt, target=target, model=model, varlen=varlen)


def e2e_variant(name: str, mdl: Encoder, s: SimpleNamespace):
    """(compiled model, its inputs) of a training variant; ``*_fa2`` differ only in
    the backward forced around them."""
    njt, packed = (s.x_njt,), (s.x, s.cu)
    return {
        "ours": lambda: (rc.compile(mdl), njt),
        "ours_fa2": lambda: (rc.compile(mdl), njt),
        "ours_static": lambda: (rc.compile(mdl, dynamic=False), njt),
        "ours_varlen": lambda: (rc.compile(mdl.with_attention(s.varlen)), packed),
        "njt_sdpa_compiled": lambda: (torch.compile(mdl), njt),
        "varlen_compiled": lambda: (torch.compile(mdl.with_attention(s.varlen)), packed),
    }[name]()


def loss_of(fn, inp, target) -> torch.Tensor:
    """MSE loss in fp32 of the model's per-token output."""
    return (values(fn(*inp)).float() - target.float()).square().mean()


def train_step(opt, fn, inp, target) -> torch.Tensor:
    """One step of the e2e benchmark: forward, loss, backward, AdamW."""
    opt.zero_grad(set_to_none=True)
    loss = loss_of(fn, inp, target)
    loss.backward()
    opt.step()
    return loss


E2E_VARIANTS = ("ours", "ours_fa2", "njt_sdpa_compiled", "varlen_compiled")


def bench_e2e(args, dev) -> dict:
    s = e2e_setup(dev, args.smoke, args.e2e_layout)
    cuda = dev.type == "cuda"
    res = {"layout": args.e2e_layout, "lengths": s.lens, "tokens": s.tokens, "d": s.d, "heads": s.heads, "layers": s.layers}
    for name in E2E_VARIANTS:
        if args.only_impl and name not in args.only_impl:
            continue
        try:
            with backward("fa2" if name == "ours_fa2" else None):
                mdl = copy.deepcopy(s.model)
                fn, inp = e2e_variant(name, mdl, s)
                opt = torch.optim.AdamW(mdl.parameters(), lr=1e-5)

                def step():
                    return train_step(opt, fn, inp, s.target)

                t0 = time.perf_counter()
                step()
                sync(dev)
                first = time.perf_counter() - t0
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base_mem = torch.cuda.memory_allocated()
                r = timed(step, dev, args.e2e_reps, warmup=2)
                if cuda:
                    r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    r["peak_over_resident_gib"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
                r["first_step_s"] = first
                r["tokens_per_s"] = s.tokens / (r["ms"] / 1e3)
                res[name] = r
                del mdl, opt, fn
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}", "trace": traceback.format_exc()[-1500:]}
        if cuda:
            torch.cuda.empty_cache()
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "trace"}), flush=True)
    for other in ("njt_sdpa_compiled", "varlen_compiled"):
        if "ms" in res.get("ours", {}) and "ms" in res.get(other, {}):
            res[f"speedup_vs_{other}"] = res[other]["ms"] / res["ours"]["ms"]
            if "peak_mem_gib" in res["ours"]:
                res[f"peak_mem_ratio_vs_{other}"] = res["ours"]["peak_mem_gib"] / res[other]["peak_mem_gib"]
    return res


def render(results: dict) -> str:
    env = results["env"]
    lines = [f"# Training benchmark ({env.get('gpu') or 'cpu'}, torch {env['torch']}, "
             f"flashinfer {env.get('flashinfer')}, bf16)", ""]
    if "attn" in results:
        lines += ["## Attention forward+backward (ms, median)", "",
                  "| layout | ours | ours, FA2 backward | ours, FA4 backward | ours (plan per call) | ours fwd only (plan per call) | varlen_attn | NJT SDPA | ours vs varlen |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, row in results["attn"].items():
            def c(key):
                r = row.get(key)
                return "-" if r is None else f"{r['ms']:.2f}" if "ms" in r else "error"

            sp = row.get("speedup_ours_vs_varlen")
            lines.append(f"| {name} ({row['tokens']} tok, {row['hq']}/{row['hkv']} heads) | {c('ours')} | {c('ours_fa2')} | {c('ours_fa4')} | {c('ours_plan')} | "
                         f"{c('ours_fwd')} | {c('varlen_attn')} | {c('njt_sdpa')} | {f'{sp:.2f}x' if sp else '-'} |")
        lines.append("")
    if "fwd_sweep" in results:
        lines += ["## Forward sweep: the training forward on FlashInfer's kernel and on flash-attn-4's (ms, median "
                  "of rotating rounds; FA4's backward after both)", "",
                  "| layout | heads q/kv x d | causal | work | FlashInfer fwd | FA4 fwd | FA4 kernel alone | FA4 / FlashInfer "
                  "fwd | FlashInfer fwd+bwd | FA4 fwd+bwd | FA4 / FlashInfer fwd+bwd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]

        def num2(x):
            return "-" if x is None else f"{x:.3f}"

        for r in results["fwd_sweep"]:
            lines.append(f"| {r['kind']} ({r['segments']} x <= {r['max_len']}) | {r['hq']}/{r['hkv']} x {r['d']} | "
                         f"{r['causal']} | {r['work']:.0f} | {num2(r.get('fi_fwd_ms'))} | {num2(r.get('fa4_fwd_ms'))} | "
                         f"{num2(r.get('fa4_kernel_ms'))} | {num2(r.get('fa4_over_fi_fwd'))} | "
                         f"{num2(r.get('fi_fwd_bwd_ms'))} | {num2(r.get('fa4_fwd_bwd_ms'))} | "
                         f"{num2(r.get('fa4_over_fi_fwd_bwd'))} |" + (f" error: {r['error'][:100]}" if "error" in r else ""))
        lines.append("")
    if "bwd_sweep" in results:
        lines += ["## Backward sweep: forward+backward ms with FA2's and FA4's backward", "",
                  "| layout | heads q/kv x d | causal | FA2 | FA4 (copies) | FA4 (fused pad) | FA4 (redo) | FA4 / FA2 | "
                  "FA4 fused / FA2 | FA4 redo / FA2 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]

        def num(x):
            return "-" if x is None else f"{x:.2f}"

        for r in results["bwd_sweep"]:
            lines.append(f"| {r['kind']} ({r['segments']} x <= {r['max_len']}) | {r['hq']}/{r['hkv']} x {r['d']} | {r['causal']} | "
                         f"{num(r.get('fa2_ms'))} | {num(r.get('fa4_ms'))} | {num(r.get('fa4_fused_ms'))} | "
                         f"{num(r.get('fa4_redo_ms'))} | {num(r.get('fa4_over_fa2'))} | {num(r.get('fa4_fused_over_fa2'))} | "
                         f"{num(r.get('fa4_redo_over_fa2'))} |")
        lines.append("")
    if "e2e" in results:
        e = results["e2e"]
        lines += [f"## {e['layers']}-layer d={e['d']} encoder training step, {e.get('layout', 'mixed')} layout, {e['tokens']} tokens (forward, backward, AdamW)", "",
                  "| implementation | ms/step | tokens/s | peak GiB | first step s |", "|---|---|---|---|---|"]
        for name in E2E_VARIANTS:
            r = e.get(name, {})
            if "ms" in r:
                peak = f"{r['peak_mem_gib']:.2f}" if "peak_mem_gib" in r else "-"
                lines.append(f"| {name} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {peak} | {r['first_step_s']:.1f} |")
            elif r:
                lines.append(f"| {name} | error: {r['error'][:120]} | | | |")
        for k, v in e.items():
            if k.startswith(("speedup", "peak_mem_ratio")):
                lines.append(f"\n{k}: {v:.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--only", choices=["attn", "e2e", "bwd-sweep", "fwd-sweep"], default=None)
    p.add_argument("--only-impl", nargs="*", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--e2e-reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="fwd-sweep: rotating rounds per row")
    p.add_argument("--e2e-layout", choices=["mixed", "vit"], default="mixed")
    p.add_argument("--sweep-heads", default="", help="the sweep's head shapes, e.g. 16/16/128,32/8/128 (default: all)")
    args = p.parse_args()
    if args.smoke:
        args.reps, args.e2e_reps = min(args.reps, 3), min(args.e2e_reps, 2)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    results = {"env": environment()}
    if args.only in (None, "attn"):
        results["attn"] = bench_attention(args, dev)
    if args.only in (None, "e2e"):
        results["e2e"] = bench_e2e(args, dev)
    if args.only == "bwd-sweep":  # not in the default run: ~100 rows
        results["bwd_sweep"] = bench_backward_sweep(args, dev)
    if args.only == "fwd-sweep":  # not in the default run: 40 rows
        results["fwd_sweep"] = bench_forward_sweep(args, dev)
    os.makedirs(args.out, exist_ok=True)
    suffix = ("" if args.only is None else f"-{args.only}") + ("" if args.e2e_layout == "mixed" else f"-{args.e2e_layout}")
    with open(os.path.join(args.out, f"train{suffix}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = render(results)
    with open(os.path.join(args.out, f"train{suffix}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
