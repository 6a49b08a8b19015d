#!/usr/bin/env python
"""Ragged attention, side by side: ragged_compile against FlashInfer, torch
varlen_attn, NJT SDPA, FlexAttention and padded SDPA, per op and end to end.

    python bench/bench_attention.py                 # everything -> bench/results/
    python bench/bench_attention.py --only ops      # per-op table only
    python bench/bench_attention.py --only e2e      # 8-layer encoder only
    python bench/bench_attention.py --smoke --out /tmp/smoke   # tiny sizes, CPU ok

Writes attention.json (every number, the environment and every error string),
and attention.md (tables). Every measurement runs in its own try/except: a failure is recorded and
the run goes on. Outputs are rewritten after every measurement, so a run cut
short (time limit, crash) still leaves what it measured. With --only, the other
section of an existing attention.json in --out is kept. See bench/README.md for
what each column means.

This file is the driver (command line, the per-op loop, writing results); the
parts live next to it: layouts.py (the layout classes), variants.py (the
implementations compared), timing.py (how everything is timed), report.py
(tables), e2e.py (the end-to-end variants), model.py (the encoder),
harness.py (errors, budget, logging).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import tempfile
import time

import torch

from e2e import run_e2e
from env import environment
from harness import (
    E2E_REL_TOL,
    HERE,
    T_START,
    TOL,
    Budget,
    auto_backend,
    dense_attention,
    err_str,
    log,
    max_diff,
    raise_recompile_limits,
    recorded,
    reference_attention,
    sanitize,
    stats_delta,
    tb_tail,
)
from layouts import LAYOUT_SPECS, Case
from report import fmt_rec, render_markdown, section_meta, summarize_layout
from timing import sync, time_fn
from variants import IMPLS, Shared, paired_vs_flashinfer


def measure(name, builder, c: Case, sh: Shared, args, budget: Budget) -> dict:
    rec: dict = {"impl": name}
    t0 = time.perf_counter()
    with recorded(rec, name, c.dev):
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
        if dev.type == "cuda" and any(n == "ours_eager" for n, _ in impls):
            try:
                budget.check()
                backend = entry["summary"].get("ours_backend") or auto_backend(
                    dev, c.n, c.total, hq=c.hq, hkv=c.hkv, head_dim=c.d, causal=c.causal
                )
                pr = paired_vs_flashinfer(c, sh, backend)
                entry["summary"]["paired_ours_vs_flashinfer"] = pr
                log(
                    f"  paired: ours {pr['ours_ms']:.3f} ms (picked {backend}), "
                    + ", ".join(f"{b} {pr[b + '_ms']:.3f} ms" for b in ("fa2", "fa3") if b + "_ms" in pr)
                    + f"; ours / best ({pr['best']}) = {pr['ratio_vs_best']:.3f}"
                )
            except Exception as e:  # noqa: BLE001
                entry["summary"]["paired_ours_vs_flashinfer"] = {"error": err_str(e)}
        del c
        with contextlib.suppress(Exception):
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        writer()



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
    p.add_argument("--time-budget-s", type=float, default=float("inf"),
                   help="stop starting new measurements after this many seconds (default: no limit)")
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

    def on_term(signum, frame):  # a timeout's SIGTERM: still write what we have
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
        writer()
        log(f"wrote {json_path}, {md_path}")
    return rc_code


if __name__ == "__main__":
    raise SystemExit(main())
