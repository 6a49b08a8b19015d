"""Training benchmark (CUDA): attention forward+backward and an encoder training step.

    python bench/bench_train.py --out bench/results [--only attn|e2e] [--smoke]

Side by side in one process, bf16:

* ``attn``: attention forward+backward (``torch.autograd.grad`` of a fixed output
  gradient) on the mixed (16 x 64..4096), mixed causal, long (4 x 8192) and GQA
  32/8 layouts, 16 (32) heads of 128. ``ours``: ``ragged_attention`` inside a
  runtime step whose plan is made (the per-layer cost in a model, where one plan
  serves every layer); ``ours_plan``: a fresh step per call (plan included);
  ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (FA2 forward and
  backward), GQA with k/v expanded where it has no ``enable_gqa``; ``njt_sdpa``:
  stock NJT SDPA (no GQA).
* ``e2e``: an 8-layer pre-norm encoder (d=2048, 16 heads) training step on the
  mixed layout: forward, backward, AdamW. ``ours``: NJT model through
  ``ragged_compile.compile``; ``njt_sdpa_compiled``: the same NJT model through
  ``torch.compile``; ``varlen_compiled``: the packed model with ``varlen_attn``
  through ``torch.compile``. Peak memory per step (``max_memory_allocated``).

Writes ``train.json`` and ``train.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ragged_compile as rc  # noqa: E402
from env import environment  # noqa: E402
from ragged_compile.runtime import Runtime  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16


def lengths(kind: str, smoke: bool) -> list[int]:
    if kind == "mixed":
        if smoke:
            return [8, 64, 33, 17]
        for seed in range(10_000):  # as bench_attention.py: 16 segments of 64..4096, 33-36k tokens
            g = torch.Generator().manual_seed(1000 + seed)
            lens = torch.randint(64, 4097, (16,), generator=g)
            lens[0], lens[1] = 64, 4096
            lens = lens[torch.randperm(16, generator=g)]
            if 33000 <= int(lens.sum()) <= 36000:
                return [int(x) for x in lens]
    if kind == "long":
        return [96, 96] if smoke else [8192] * 4
    raise ValueError(kind)


def time_ms(fn, reps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return {"ms": ts[len(ts) // 2], "ms_min": ts[0], "ms_p90": ts[(len(ts) * 9) // 10], "reps": reps}


def _cu(lens):
    return torch.tensor([0] + lens).cumsum(0).to(DEV, torch.int32)


def _varlen_kwargs(causal: bool, gqa: bool):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if causal else {}
    if "is_causal" in params and causal:
        kw = {"is_causal": True}
    expand = gqa and "enable_gqa" not in params
    if gqa and not expand:
        kw["enable_gqa"] = True
    return varlen_attn, kw, expand


# -------------------------------------------------------------------------- attention
ATTN_CASES = [  # name, kind, hq, hkv, causal
    ("mixed16", "mixed", 16, 16, False),
    ("mixed16_causal", "mixed", 16, 16, True),
    ("long4x8192", "long", 16, 16, False),
    ("gqa32_8", "mixed", 32, 8, False),
]


def bench_attention(args) -> dict:
    res = {}
    for name, kind, hq, hkv, causal in ATTN_CASES:
        lens = lengths(kind, args.smoke)
        T, D = sum(lens), 128
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(T, hq, D, device=DEV, generator=g).to(DT).requires_grad_()
        k = torch.randn(T, hkv, D, device=DEV, generator=g).to(DT).requires_grad_()
        v = torch.randn(T, hkv, D, device=DEV, generator=g).to(DT).requires_grad_()
        go = torch.randn(T, hq, D, device=DEV, generator=g).to(DT)
        cu, m = _cu(lens), max(lens)
        rt = Runtime()
        row = {"lengths": lens, "tokens": T, "hq": hq, "hkv": hkv, "causal": causal}

        def ours():
            out = rc.ragged_attention(q, k, v, cu, causal=causal)
            return torch.autograd.grad(out, (q, k, v), go)

        def run(label, fn, check=None):
            try:
                r = time_ms(fn, args.reps)
                if check is not None:
                    r["max_abs_diff_vs_ours"] = check
                row[label] = r
            except Exception as e:  # noqa: BLE001 - record, keep going
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}

        with rt.step():
            ours()  # plan once: the per-layer cost in a model
            run("ours", ours)
            ref = ours()
        with rt.step(), _backward("fa2"):
            ours()
            run("ours_fa2", ours)
        run("ours_plan", lambda: _fresh_step(rt, ours))
        run("ours_fwd", lambda: _no_grad_step(rt, q, k, v, cu, causal))

        varlen_attn, kw, expand = _varlen_kwargs(causal, hq != hkv)
        grp = hq // hkv

        def varlen():
            kk, vv = (k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)) if expand else (k, v)
            out = varlen_attn(q, kk, vv, cu, cu, m, m, **kw)
            return torch.autograd.grad(out, (q, k, v), go)

        try:
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(varlen(), ref))
        except Exception:  # noqa: BLE001
            diff = None
        run("varlen_attn", varlen, diff)
        if expand:
            row["varlen_attn"]["note"] = "no enable_gqa in this torch: k/v expanded (timed)"
        if hq == hkv:
            off = cu.long()

            def njt():
                nts = [torch.nested.nested_tensor_from_jagged(x, off, min_seqlen=min(lens), max_seqlen=m) for x in (q, k, v)]
                out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in nts), is_causal=causal)
                return torch.autograd.grad(out.transpose(1, 2).values(), (q, k, v), go)

            run("njt_sdpa", njt)
        for label in ("ours", "ours_fa2", "ours_plan"):
            if "ms" in row.get(label, {}) and "ms" in row.get("varlen_attn", {}):
                row[f"speedup_{label}_vs_varlen"] = row["varlen_attn"]["ms"] / row[label]["ms"]
        res[name] = row
        print(name, json.dumps({k: (v if not isinstance(v, dict) else v.get("ms", v)) for k, v in row.items() if k != "lengths"}), flush=True)
        del q, k, v, go
        torch.cuda.empty_cache()
    return res


@contextlib.contextmanager
def _backward(kernel: str):
    """Force the op's CUDA backward (train_ops.backward_kernel reads this per call)."""
    old = os.environ.get("RAGGED_COMPILE_BACKWARD")
    os.environ["RAGGED_COMPILE_BACKWARD"] = kernel
    try:
        yield
    finally:
        if old is None:
            del os.environ["RAGGED_COMPILE_BACKWARD"]
        else:
            os.environ["RAGGED_COMPILE_BACKWARD"] = old


def _fresh_step(rt, fn):
    with rt.step():
        return fn()


def _no_grad_step(rt, q, k, v, cu, causal):
    with torch.no_grad(), rt.step():
        return rc.ragged_attention(q, k, v, cu, causal=causal)


# -------------------------------------------------------------------------- end to end
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Encoder(nn.Module):
    """Pre-norm encoder; NJT input [B, j, d] (SDPA) or packed [T, d] with an attention fn."""

    def __init__(self, d: int, heads: int, layers: int, attention=None):
        super().__init__()
        self.heads, self.head_dim, self.attention = heads, d // heads, attention
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        H, Dh = self.heads, self.head_dim
        for b in self.blocks:
            h = b.ln1(x)
            if self.attention is None:
                q, k, v = (p(h).unflatten(-1, [H, Dh]).transpose(1, 2) for p in (b.q, b.k, b.v))
                a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)
            else:
                q, k, v = (p(h).unflatten(-1, (H, Dh)) for p in (b.q, b.k, b.v))
                a = self.attention(q, k, v).flatten(-2)
            x = x + b.o(a)
            x = x + b.fc2(F.gelu(b.fc1(b.ln2(x))))
        return x


def bench_e2e(args) -> dict:
    lens = lengths("mixed", args.smoke)
    d, heads, layers = (256, 4, 2) if args.smoke else (2048, 16, 8)
    T = sum(lens)
    cu = _cu(lens)
    m = max(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, d, device=DEV, generator=g).to(DT)
    target = torch.randn(T, d, device=DEV, generator=g).to(DT)
    x_njt = torch.nested.nested_tensor_from_jagged(x, cu.long(), min_seqlen=min(lens), max_seqlen=m)
    torch.manual_seed(0)
    base = Encoder(d, heads, layers).to(DEV, DT)
    varlen_attn, kw, _ = _varlen_kwargs(False, False)

    def packed_attention(q, k, v):
        return varlen_attn(q, k, v, cu, cu, m, m, **kw)

    impls = {
        "ours": lambda mdl: (rc.compile(mdl), x_njt, lambda out: out.values()),
        "ours_fa2": lambda mdl: (rc.compile(mdl), x_njt, lambda out: out.values()),
        "njt_sdpa_compiled": lambda mdl: (torch.compile(mdl), x_njt, lambda out: out.values()),
        "varlen_compiled": lambda mdl: (torch.compile(_with_attention(mdl, packed_attention)), x, lambda out: out),
    }
    res = {"lengths": lens, "tokens": T, "d": d, "heads": heads, "layers": layers}
    for name, make in impls.items():
        if args.only_impl and name not in args.only_impl:
            continue
        try:
            ctx = _backward("fa2") if name == "ours_fa2" else contextlib.nullcontext()
            ctx.__enter__()
            mdl = copy.deepcopy(base)
            fn, inp, values = make(mdl)
            opt = torch.optim.AdamW(mdl.parameters(), lr=1e-5)

            def step():
                return train_step(opt, fn, inp, values, target)

            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
            r = time_ms(step, args.e2e_reps, warmup=2)
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            r["peak_over_resident_gib"] = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
            r["first_step_s"] = first
            r["tokens_per_s"] = T / (r["ms"] / 1e3)
            res[name] = r
            del mdl, opt, fn
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:600]}", "trace": traceback.format_exc()[-1500:]}
        finally:
            ctx.__exit__(None, None, None)
        torch.cuda.empty_cache()
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "trace"}), flush=True)
    for other in ("njt_sdpa_compiled", "varlen_compiled"):
        if "ms" in res.get("ours", {}) and "ms" in res.get(other, {}):
            res[f"speedup_vs_{other}"] = res[other]["ms"] / res["ours"]["ms"]
            res[f"peak_mem_ratio_vs_{other}"] = res["ours"]["peak_mem_gib"] / res[other]["peak_mem_gib"]
    return res


def train_step(opt, fn, inp, values, target) -> torch.Tensor:
    """One step of the e2e benchmark: forward, MSE loss in fp32, backward, AdamW."""
    opt.zero_grad(set_to_none=True)
    loss = (values(fn(inp)).float() - target.float()).square().mean()
    loss.backward()
    opt.step()
    return loss


def _with_attention(mdl: Encoder, attention) -> Encoder:
    mdl.attention = attention
    return mdl


def render(results: dict) -> str:
    lines = [f"# Training benchmark ({results['env'].get('gpu')}, torch {results['env']['torch']}, "
             f"flashinfer {results['env'].get('flashinfer')}, bf16)", ""]
    if "attn" in results:
        lines += ["## Attention forward+backward (ms, median)", "",
                  "| layout | ours | ours, FA2 backward | ours (plan per call) | ours fwd only | varlen_attn | NJT SDPA | ours vs varlen |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, row in results["attn"].items():
            def c(key):
                r = row.get(key)
                if r is None:
                    return "-"
                return f"{r['ms']:.2f}" if "ms" in r else "error"
            sp = row.get("speedup_ours_vs_varlen")
            lines.append(f"| {name} ({row['tokens']} tok, {row['hq']}/{row['hkv']} heads) | {c('ours')} | {c('ours_fa2')} | {c('ours_plan')} | "
                         f"{c('ours_fwd')} | {c('varlen_attn')} | {c('njt_sdpa')} | {f'{sp:.2f}x' if sp else '-'} |")
        lines.append("")
    if "e2e" in results:
        e = results["e2e"]
        lines += [f"## {e['layers']}-layer d={e['d']} encoder training step, {e['tokens']} tokens (forward, backward, AdamW)", "",
                  "| implementation | ms/step | tokens/s | peak GiB | first step s |", "|---|---|---|---|---|"]
        for name in ("ours", "ours_fa2", "njt_sdpa_compiled", "varlen_compiled"):
            r = e.get(name, {})
            if "ms" in r:
                lines.append(f"| {name} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {r['peak_mem_gib']:.2f} | {r['first_step_s']:.1f} |")
            elif r:
                lines.append(f"| {name} | error: {r['error'][:120]} | | | |")
        for k, v in e.items():
            if k.startswith(("speedup", "peak_mem_ratio")):
                lines.append(f"\n{k}: {v:.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--only", choices=["attn", "e2e"], default=None)
    p.add_argument("--only-impl", nargs="*", default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--e2e-reps", type=int, default=10)
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    results = {"env": environment()}
    if args.only in (None, "attn"):
        results["attn"] = bench_attention(args)
    if args.only in (None, "e2e"):
        results["e2e"] = bench_e2e(args)
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.only is None else f"-{args.only}"
    with open(os.path.join(args.out, f"train{suffix}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = render(results)
    with open(os.path.join(args.out, f"train{suffix}.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
