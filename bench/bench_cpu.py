#!/usr/bin/env python
"""CPU ragged attention: our op against the two stock ways, forward and forward+backward.

    PYTHONPATH=. python bench/bench_cpu.py --out bench/results      # ~2-3 min on 2 cores
    PYTHONPATH=. python bench/bench_cpu.py --quick --out /tmp/cpu   # a smoke run

Contenders, on the same packed inputs in one process:

* ``ours``: ``ragged_compile.ragged_attention`` (the op's CPU kernel, backends/cpu.py);
* ``loop``: ``F.scaled_dot_product_attention`` per segment on views, outputs concatenated;
* ``padded``: one SDPA call on the batch padded to its longest segment with a boolean
  mask (key padding, and the causal triangle when causal).

Forward runs under ``no_grad``; forward+backward takes ``(out * grad).sum().backward()``
of leaf q, k, v. Rounds interleave the contenders (ours, loop, padded; loop, padded,
ours; ...) and each number is the minimum over ``--rounds`` rounds of the mean of a
few calls, so a neighbour's load on a shared machine inflates all three alike. ``ratio`` is ours over
the faster stock way: below 1 is faster. Writes cpu.json and cpu.md to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

import ragged_compile as rc
from env import environment
from layouts import cu_seqlens, random_lengths
from timing import interleaved

HERE = os.path.dirname(os.path.abspath(__file__))


def layouts(quick: bool):
    g = torch.Generator().manual_seed(0)
    mixed, tiny, cross_k = (random_lengths(n, lo, hi, g) for n, lo, hi in ((24, 0, 456), (256, 1, 32), (24, 0, 456)))
    rows = []
    for causal in (False, True):
        rows.append(("mixed 24 x 0..456", mixed, mixed, causal, 8, 8, torch.float32))
        rows.append(("long 4 x 1536", [1536] * 4, [1536] * 4, causal, 8, 8, torch.float32))
        rows.append(("tiny 256 x 1..32", tiny, tiny, causal, 8, 8, torch.float32))
    rows.append(("mixed GQA 8/2", mixed, mixed, True, 8, 2, torch.float32))
    rows.append(("mixed cross (kv 0..456)", mixed, cross_k, False, 8, 8, torch.float32))
    rows.append(("mixed bf16", mixed, mixed, True, 8, 8, torch.bfloat16))
    rows.append(("tiny bf16", tiny, tiny, False, 8, 8, torch.bfloat16))
    if quick:
        rows = [(n, lq[:6], lk[:6], c, hq, hkv, dt) for n, lq, lk, c, hq, hkv, dt in rows[:3]]
    return rows


def contenders(lq, lk, causal, hq, hkv):
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    bq, bk = cq.tolist(), ck.tolist()
    gqa = hq != hkv

    def ours(q, k, v):
        return rc.ragged_attention(q, k, v, cq, ck, causal=causal)

    def loop(q, k, v):
        outs = []
        for i in range(len(lq)):
            qi = q[bq[i] : bq[i + 1]].transpose(0, 1)[None]
            if lk[i] == 0:
                outs.append(q.new_zeros(lq[i], hq, q.shape[-1]))
                continue
            ki = k[bk[i] : bk[i + 1]].transpose(0, 1)[None]
            vi = v[bk[i] : bk[i + 1]].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=gqa)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    n, Pq, Pk = len(lq), max(lq, default=0), max(lk, default=0)
    rq = torch.arange(Pq)[None, :] < torch.tensor(lq)[:, None]
    rk = torch.arange(Pk)[None, :] < torch.tensor(lk)[:, None]
    src_q = torch.nonzero(rq.flatten()).flatten()
    src_k = torch.nonzero(rk.flatten()).flatten()
    mask = rk[:, None, None, :]
    if causal:
        tri = torch.ones(Pq, Pk, dtype=torch.bool).tril()
        mask = mask & tri
    # A row that sees no key would be NaN in stock SDPA; let it see everything
    # (its output is dropped, as the loop drops it).
    mask = mask | ~mask.any(-1, keepdim=True)

    def padded(q, k, v):
        def pad(x, P, src):
            buf = x.new_zeros(n * P, *x.shape[1:])
            return buf.index_copy(0, src, x).unflatten(0, (n, P)).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            pad(q, Pq, src_q), pad(k, Pk, src_k), pad(v, Pk, src_k), attn_mask=mask, enable_gqa=gqa
        )
        return o.transpose(1, 2).flatten(0, 1).index_select(0, src_q)

    return {"ours": ours, "loop": loop, "padded": padded}


def measure(fns, make, mode, rounds, budget_s, clock):
    def run(fn):
        q, k, v, go = make()
        if mode == "fwd":
            with torch.no_grad():
                fn(q, k, v)
        else:
            for x in (q, k, v):
                x.requires_grad_(True)
            (fn(q, k, v) * go).sum().backward()

    t0 = clock()
    for fn in fns.values():  # warm-up, which also sets the calls per round
        run(fn)
    reps = max(1, min(20, int(budget_s / max(1e-6, clock() - t0))))

    def mean_ms(fn):
        t = clock()
        for _ in range(reps):
            run(fn)
        return (clock() - t) / reps * 1e3

    return {name: min(ms) for name, ms in interleaved(fns, rounds, mean_ms).items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.6, help="seconds per round of all three")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall: perf_counter; cpu: process CPU time, steadier on a shared machine "
        "(use with --threads 1, where it counts no idle spinning)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    os.makedirs(args.out, exist_ok=True)
    D = 64
    results = []
    for name, lq, lk, causal, hq, hkv, dtype in layouts(args.quick):
        g = torch.Generator().manual_seed(1)
        base = [torch.randn(sum(lq), hq, D, generator=g), torch.randn(sum(lk), hkv, D, generator=g),
                torch.randn(sum(lk), hkv, D, generator=g), torch.randn(sum(lq), hq, D, generator=g)]
        base = [x.to(dtype) for x in base]

        def make():
            return [x.detach() for x in base]

        fns = contenders(lq, lk, causal, hq, hkv)
        with torch.no_grad():  # the three agree before they race
            want = fns["loop"](*base[:3]).float()
            for other in ("ours", "padded"):
                diff = (fns[other](*base[:3]).float() - want).abs().max().item()
                assert diff < (2e-2 if dtype != torch.float32 else 1e-4), (name, other, diff)
        row = {"layout": name, "causal": causal, "heads": f"{hq}/{hkv}", "head_dim": D,
               "dtype": str(dtype).replace("torch.", ""), "tokens_q": sum(lq), "tokens_k": sum(lk),
               "segments": len(lq)}
        for mode in ("fwd", "fwd+bwd"):
            best = measure(fns, make, mode, args.rounds, args.budget, clock)
            stock = min(best["loop"], best["padded"])
            row[mode] = {k: round(v, 3) for k, v in best.items()}
            row[mode]["ratio"] = round(best["ours"] / stock, 3)
            print(f"{name:26s} causal={causal!s:5s} {mode:8s} ours {best['ours']:8.2f} ms  "
                  f"loop {best['loop']:8.2f}  padded {best['padded']:8.2f}  ratio {row[mode]['ratio']:.2f}",
                  flush=True)
        results.append(row)
    env = environment()
    env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(), clock=args.clock,
               load_average=os.getloadavg(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with open(os.path.join(args.out, "cpu.json"), "w") as f:
        json.dump({"environment": env, "rounds": args.rounds, "results": results}, f, indent=1)
    lines = [
        "# CPU ragged attention: ours vs stock (ms, min of interleaved rounds)",
        "",
        f"torch {env['torch']}, {env['threads']} thread(s), {env['cpu_capability']}, {args.clock} clock, "
        f"load average {env['load_average'][0]:.1f} at the end, {env['date']}. "
        "fp32 unless noted, head dim 64. "
        "`ratio` = ours / faster of loop and padded (below 1: ours faster). Ours is the public "
        "`ragged_attention`; with grad it saves the forward's log-sum-exp for the backward. "
        f"Produced by `PYTHONPATH=. python bench/bench_cpu.py {' '.join(argv if argv is not None else sys.argv[1:])}`.",
        "",
        "| layout | causal | heads | dtype | fwd ours | loop | padded | **ratio** "
        "| fwd+bwd ours | loop | padded | **ratio** |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, b = r["fwd"], r["fwd+bwd"]
        lines.append(
            f"| {r['layout']} | {r['causal']} | {r['heads']} | {r['dtype']} | {a['ours']:.2f} | {a['loop']:.2f} | "
            f"{a['padded']:.2f} | **{a['ratio']:.2f}** | {b['ours']:.2f} | {b['loop']:.2f} | {b['padded']:.2f} | "
            f"**{b['ratio']:.2f}** |"
        )
    with open(os.path.join(args.out, "cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
