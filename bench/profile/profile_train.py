"""Where the encoder training step's time and memory go, per implementation.

    python bench/profile/profile_train.py [--out DIR] [--variants ours,varlen_compiled,...]

For the 8-layer d=2048 encoder of bench_train.py on the mixed layout, each
variant runs in its own process (clean allocator and compile caches) and
reports: ms per step (forward, backward, AdamW), peak memory, the memory the
forward leaves alive for the backward, graphs and graph breaks, CUDA time per
kernel name per step (torch.profiler), and the activations the compiled
forward graph saves for the backward (from AOTAutograd's graph log). Writes
DIR/profile_train.json.

Variants: ``ours`` (``ragged_compile.compile`` on the NJT model),
``ours_backed`` (the same with backed, not unbacked, layout sizes),
``ours_static`` (``dynamic=False``), ``ours_varlen`` (``ragged_compile.compile``
on the packed ``varlen_attn`` model: our pass rewrites it), ``varlen_compiled``,
``njt_sdpa_compiled``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections import Counter

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

VARIANTS = ["ours", "ours_backed", "ours_static", "ours_varlen", "varlen_compiled", "njt_sdpa_compiled"]


def saved_activations(log_path: str) -> dict:
    """Names/shapes the first compiled forward graph returns beyond its output:
    what AOTAutograd saves for the backward (parameters excluded)."""
    shapes, ret = {}, None
    with open(log_path) as f:
        for line in f:
            for m in re.finditer(r'(\w+): "([^"]+)"', line):
                shapes.setdefault(m.group(1), m.group(2))
            s = line.split("[__aot_graphs]")[-1].strip()
            if ret is None and s.startswith("return (") and "primals" in s:
                ret = [x.strip() for x in s[len("return (") : -1].split(",")]
    if ret is None:
        return {"error": "no forward graph in the log"}
    saved = [(r, shapes.get(r, "?")) for r in ret[1:] if not r.startswith("primals")]
    by_shape = Counter(re.sub(r"\[[^\]]*\]cuda:0$|\[[^\]]*\]cpu$", "", s) for _, s in saved)
    return {"count": len(saved), "by_shape": dict(by_shape.most_common()), "names": saved[:80]}


def run_variant(name: str, args) -> dict:
    import torch
    import torch._dynamo

    import bench_train as bt
    import ragged_compile.compiler as compiler
    from ragged_compile.runtime import get_runtime
    from timing import kernel_times

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if name == "ours_backed":
        orig = compiler._dynamic_layouts
        compiler._dynamic_layouts = lambda njts, unbacked: orig(njts, unbacked=False)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mem = torch.cuda.memory_allocated if cuda else (lambda: 0)
    s = bt.e2e_setup(dev, args.smoke)
    mdl = s.model
    fn, inp = bt.e2e_variant("ours" if name == "ours_backed" else name, mdl, s)
    opt = torch.optim.AdamW(mdl.parameters(), lr=1e-5)
    rt = get_runtime(dev)

    def step():
        return bt.train_step(opt, fn, inp, s.target)

    res = {"tokens": s.tokens, "d": s.d, "layers": s.layers}
    step()
    step()
    sync()
    stats = torch._dynamo.utils.counters
    res["graphs"] = stats["stats"].get("unique_graphs", 0)
    res["graph_breaks"] = sum(stats["graph_break"].values())
    # Activations: what the forward leaves alive for the backward.
    opt.zero_grad(set_to_none=True)
    sync()
    before = mem()
    loss = bt.loss_of(fn, inp, s.target)
    sync()
    res["activations_gib"] = (mem() - before) / 2**30
    loss.backward()
    opt.step()
    del loss
    sync()
    if not cuda:  # a smoke run of the script itself
        return res
    torch.cuda.reset_peak_memory_stats()
    base = mem()
    res.update(bt.timed(step, dev, args.reps, warmup=1))
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    res["peak_over_resident_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    res["resident_gib"] = base / 2**30
    stats0 = dict(rt.stats)
    res["kernels"] = kernel_times(step, steps=2, top=args.top)
    res["runtime_per_step"] = {k: (v - stats0.get(k, 0)) / 3 for k, v in rt.stats.items()}  # 1 + 2 profiled
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda if there is one, else cpu")
    p.add_argument("--child", default=None)
    p.add_argument("--child-out", default=None)
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        try:
            res = run_variant(args.child, args)
        except Exception as e:  # noqa: BLE001 - record, keep going
            res = {"error": f"{type(e).__name__}: {str(e)[:600]}", "trace": traceback.format_exc()[-2000:]}
        with open(args.child_out, "w") as f:
            json.dump(res, f, default=str)
        return
    from env import environment

    out = {"env": environment()}
    for name in args.variants.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            log, res_path = os.path.join(tmp, "aot.log"), os.path.join(tmp, "res.json")
            env = dict(os.environ, TORCH_LOGS="aot_graphs,graph_breaks", TORCH_LOGS_OUT=log)
            cmd = [sys.executable, __file__, "--child", name, "--child-out", res_path,
                   "--reps", str(args.reps), "--top", str(args.top), "--device", args.device] + (["--smoke"] if args.smoke else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            try:
                with open(res_path) as f:
                    res = json.load(f)
            except OSError:
                res = {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
            if os.path.exists(log):
                res["saved"] = saved_activations(log)
                with open(log) as f:
                    res["graph_break_log"] = [ln.strip()[:300] for ln in f if "Graph break" in ln][:10]
        out[name] = res
        brief = {k: v for k, v in res.items() if k not in ("kernels", "saved", "trace", "stderr")}
        print(name, json.dumps(brief, default=str), flush=True)
        if "saved" in res:
            print("  saved:", json.dumps(res["saved"].get("by_shape")), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_train.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
