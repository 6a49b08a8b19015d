"""Where padded encoder batches spend their time beyond attention: ModernBERT-base
forwards and BERT-large / ModernBERT training steps, ``"sdpa"`` against ours
(``register()``) and ours unpadded (``hf.unpad``), per implementation: wall ms in
rotating rounds, the GPU time of one call queued behind a sleep (the host out of
the way), the kernels' total, count and the top kernels by CUDA time, and the
host's own ops by self CPU time (torch.profiler).

A row whose wall time exceeds its queued GPU time is host-bound; the top kernels
of ours against ``"sdpa"`` say which GPU work our path adds or removes.

    python bench/profile/profile_encoders.py --out bench/results [--only modernbert,bert_large_train]

``--only bert_base_train_compiled`` (``bert_large_train_compiled``) profiles
BERT-base's (BERT-large's) step with both models compiled (``torch.compile``),
with Dynamo's graph and graph-break counts, beside the unpadded step in eager;
``st_train`` (``st_train_compiled``) the sentence-transformers fine-tuning step
of ``bench_unpad.py``. Each row counts device-to-host syncs per call and where
they come from, and the host's Python functions by own time (cProfile:
``python_top``, as (function, calls, own ms, cumulative ms) per call). On CUDA
the ModernBERT forward row adds ``unpad_host``: the unpadded model given the mask
on the CPU; ``bert_base_train_ro_host`` compiles the unpadded BERT-base step with
``mode="reduce-overhead"`` and gives it the mask on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_host import SyncCount, _bert, _padded_batch, _rounds, train_step
from env import environment
from timing import gpu_queued_ms, kernel_times, median

from ragged_compile import hf


def _modernbert(dev, dtype, attn, smoke):
    import transformers as t

    base = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 1152, "num_hidden_layers": 22,
                "local_attention": 128, "vocab_size": 50368, "max_position_embeddings": 8192}
    if smoke:
        base = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 3,
                    "local_attention": 8, "vocab_size": 128, "max_position_embeddings": 512}
    torch.manual_seed(0)
    model = t.ModernBertModel(t.ModernBertConfig(**base, pad_token_id=0)).to(dev, dtype)
    model.set_attn_implementation(attn)
    return model


def _host_ops(fn, steps=3, top=25) -> list:
    """The host's ops by self CPU time per call (torch.profiler, CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    evs = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key[:80], e.count // steps, round(e.self_cpu_time_total / steps / 1e3, 3)) for e in evs]


def _python_top(fn, steps=3, top=25) -> list:
    """The host's Python functions by own time per call (cProfile): where a step's
    host time goes between and around the kernels' launches (graph replays, our op's
    Python, the optimizer)."""
    import cProfile
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{os.path.basename(f)}:{line}({name})", round(nc / steps, 1), round(tt / steps * 1e3, 3),
             round(ct / steps * 1e3, 3)) for (f, line, name), (cc, nc, tt, ct, _) in rows]


def _syncs(fn, steps=2, top=8) -> dict:
    """Device-to-host syncs per call and where they come from (``SyncCount``), plus
    the default runtime's counters per call (plans, its own offset reads)."""
    from ragged_compile.runtime import get_runtime

    fn()
    torch.cuda.synchronize()
    rt = get_runtime(torch.device("cuda"))
    before = dict(rt.stats)
    with SyncCount(torch.device("cuda")) as sc:
        for _ in range(steps):
            fn()
    torch.cuda.synchronize()
    stats = {k: (v - before.get(k, 0)) / steps for k, v in rt.stats.items() if v != before.get(k, 0)}
    return {"per_call": sc.n / steps, "sources": [(src, n / steps) for src, n in sc.sources.most_common(top)],
            "runtime_stats_per_call": stats}


def _profile(fns: dict, dev, target_s: float) -> dict:
    res = {}
    for key, times in _rounds(fns, dev, target_s).items():
        res[key] = {"wall_ms": round(median([t[1] for t in times]), 3)}
    if dev.type == "cuda":
        for key, fn in fns.items():
            # gpu_ms: a call with a sync inside (unpadding's mask read) issues what
            # follows the sync at the host's pace, so there kernels' total_ms is the GPU time
            res[key].update(gpu_ms=gpu_queued_ms(fn, reps=5), kernels=kernel_times(fn, steps=3, top=30),
                            host_ops=_host_ops(fn), python_top=_python_top(fn), syncs=_syncs(fn))
    for key in fns:
        res[key]["speed_over_sdpa"] = round(res["sdpa"]["wall_ms"] / res[key]["wall_ms"], 3)
    return res


def modernbert_rows(dev, dtype, smoke, target_s, train=False) -> dict:
    name = hf.register()
    models = {"sdpa": _modernbert(dev, dtype, "sdpa", smoke), "ours": _modernbert(dev, dtype, name, smoke),
              "unpad": hf.unpad(_modernbert(dev, dtype, name, smoke))}
    for m in models.values():
        m.load_state_dict(models["sdpa"].state_dict())
    b, s = (4, 32) if smoke else ((16, 1024) if train else (64, 1024))
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None, :] < lens[:, None]).long().to(dev)
    ids = (torch.randint(1, models["sdpa"].config.vocab_size, (b, s), generator=g).to(dev) * mask)
    row = {"model": "modernbert-base", "train": train, "batch": b, "length": s, "real_tokens": int(lens.sum())}
    if not train:
        for m in models.values():
            m.eval()
        fns = {k: (lambda m=m: m(input_ids=ids, attention_mask=mask).last_hidden_state) for k, m in models.items()}
        if dev.type == "cuda":  # the mask as the tokenizer gives it: unpadding's read waits for nothing
            host_mask = mask.cpu()
            fns["unpad_host"] = lambda m=models["unpad"]: m(input_ids=ids, attention_mask=host_mask).last_hidden_state
        with torch.no_grad():
            row.update(_profile(fns, dev, target_s))
        return row
    fns = {}
    for k, m in models.items():
        opt = torch.optim.AdamW(m.train().parameters(), lr=1e-5, fused=dev.type == "cuda")

        fns[k] = train_step(m, opt, ids, mask)
    row.update(_profile(fns, dev, target_s))
    return row


def bert_train_row(dev, dtype, smoke, target_s, large=True, compiled=False, ro_host=False) -> dict:
    """Padded-batch training steps: BERT-large 32 x 512 (or BERT-base
    64 x 256) at half padding, fused AdamW, hidden dropout 0.1 (BertConfig's
    default), attention dropout 0; ``compiled``: each model ``torch.compile``d,
    with Dynamo's graph and graph-break counts; ``ro_host``: the unpadded one with
    ``mode="reduce-overhead"`` and given the mask on the CPU (CUDA)."""
    name = hf.register()
    layers, hidden, heads, b, s = (24, 1024, 16, 32, 512) if large else (12, 768, 12, 64, 256)
    if smoke:
        layers, hidden, heads, b, s = 2, 64, 2, 4, 32
    ids, mask, lens = _padded_batch(b, s, dev, seed=1, low=0.0)
    fns, graphs = {}, {}
    for key in ("sdpa", "unpad") + (("unpad_eager",) if compiled else ()):
        ro = ro_host and compiled and key == "unpad" and dev.type == "cuda"
        model = _bert(dev, dtype, layers, hidden, heads, "sdpa" if key == "sdpa" else name).train()
        if key != "sdpa":
            hf.unpad(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
        run = model
        if compiled and key != "unpad_eager":
            from torch._dynamo.utils import counters

            counters.clear()
            run = torch.compile(model, mode="reduce-overhead" if ro else None)

        step = train_step(run, opt, ids, mask, mask.cpu() if ro else None)
        if compiled and key != "unpad_eager":
            for _ in range(3):
                step()
            graphs[key] = {"unique_graphs": counters["stats"]["unique_graphs"],
                           "graph_breaks": sum(counters["graph_break"].values()),
                           "break_reasons": [r[:160] for r in counters["graph_break"]]}
        fns[key] = step
    row = {"model": "bert-large" if large else "bert-base", "train": True, "compiled": compiled, "ro_host": ro_host,
           "batch": b,
           "length": s, "real_tokens": int(lens.sum())}
    row.update(_profile(fns, dev, target_s))
    for key, g in graphs.items():
        row[key]["dynamo"] = g
    return row


def st_train_row(dev, dtype, smoke, target_s, compiled=False) -> dict:
    """The sentence-transformers fine-tuning step of ``bench_unpad.py``
    (``st_train``), per implementation, batch by batch in turn."""
    from bench_unpad import ST_TRAIN, ST_TRAIN_SMOKE, st_train_steps

    pairs, batches, _ = ST_TRAIN_SMOKE if smoke else ST_TRAIN
    steps = st_train_steps(dev, dtype, smoke, compiled)
    row = {"model": "bert-base sentence-transformer", "train": True, "compiled": compiled, "pairs": pairs,
           "batches": batches,
           "real_fraction": sum(float(x["attention_mask"].float().mean()) for f in steps[0][2] for x in f)
           / (2 * batches)}
    row.update(_profile({key: step for key, step, _ in steps}, dev, target_s))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--only", default="modernbert,modernbert_train,bert_large_train")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--target-s", type=float, default=4.0)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    res = {"environment": environment(), "rows": []}
    path = pathlib.Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    only = a.only.split(",")
    for kind in only:
        if kind == "modernbert":
            row = modernbert_rows(dev, dtype, a.smoke, a.target_s)
        elif kind == "modernbert_train":
            row = modernbert_rows(dev, dtype, a.smoke, a.target_s, train=True)
        elif kind == "bert_large_train":
            row = bert_train_row(dev, dtype, a.smoke, a.target_s)
        elif kind == "bert_base_train_compiled":
            row = bert_train_row(dev, dtype, a.smoke, a.target_s, large=False, compiled=True)
        elif kind == "bert_base_train_ro_host":
            row = bert_train_row(dev, dtype, a.smoke, a.target_s, large=False, compiled=True, ro_host=True)
        elif kind == "bert_large_train_compiled":
            row = bert_train_row(dev, dtype, a.smoke, a.target_s, compiled=True)
        elif kind in ("st_train", "st_train_compiled"):
            row = st_train_row(dev, dtype, a.smoke, a.target_s, compiled=kind == "st_train_compiled")
        else:
            raise SystemExit(f"--only: unknown row {kind!r}")
        res["rows"].append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {x: v[x] for x in ("wall_ms", "gpu_ms") if x in v})
                          for k, v in row.items()}), flush=True)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        (path / "profile_encoders.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
