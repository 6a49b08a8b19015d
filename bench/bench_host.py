"""Host cost per call, and the small-batch encoders it decides: ours against stock,
side by side in one process.

Rows (``--only`` picks sections):

* ``op``: microseconds per attention call, eager, back to back, on a batch small
  enough that the host decides the time: ``rc.ragged_attention`` inside a runtime
  step with the layout planned (inference and forward+backward; the kernel
  ``auto`` picks, and each CUDA forward forced: FlashInfer's fa2, which plans,
  and PyTorch's FlashAttention-2, which does not), the same call
  through the dispatcher (``torch.ops.ragged_compile.ragged_attention``), dense
  ``F.scaled_dot_product_attention`` on the padded batch, ``varlen_attn`` where
  torch has it, FlashInfer's ``wrapper.run`` alone and the same plan through our
  backend's ``run`` (which replays the kernel call ``wrapper.run`` makes).
* ``njt``: NJT SDPA under ``rc.enable()`` against stock NJT SDPA, per call.
* ``hf``: BERT-base (12 layers, 768 hidden, 12 heads) and BERT-large (24, 1024,
  16) encoders, random weights, bf16, padded batches of random lengths L/2..L
  (~75% real tokens) and, for unpadding, 1..L (~50%):
  ``"sdpa"`` against ``hf.register()`` (with the kernel ``auto`` picked, and
  with FlashInfer forced) and against ``hf.unpad`` (the whole model packed),
  forward ms and device-to-host syncs per forward.
* ``train``: training steps (forward, backward, AdamW; attention dropout 0) of
  BERT-base 64 x 256 and BERT-large 32 x 512, ~50% padding: ``"sdpa"`` (cuDNN's
  fused attention on Hopper) against ours, padded and unpadded, ms and syncs per
  step, in rotating rounds, with fused AdamW (transformers' ``Trainer`` default)
  and foreach AdamW (``torch.optim``'s).
* ``train_compiled`` (not in the default ``--only``): the BERT-large and
  BERT-base steps of ``train`` with both models compiled (``torch.compile``):
  ``"sdpa"`` padded against ours unpadded, fused AdamW, each also with
  ``mode="reduce-overhead"``; the unpadded step also given the mask on the CPU.
* ``graphs`` (not in the default ``--only``): CUDA graphs through ``hf.graphed``.
  BERT-base forward ms at 64 x 48, 64 x 128 and 16 x 512 (lengths L/2..L, each
  shape its own bucket) against ``"sdpa"`` eager, the graphed call given the
  mask on the device (one read per call) and on the CPU (as a tokenizer gives
  it: no read); and sentence-transformers ``encode()`` of 4096 sentences of
  lognormal length (mean ~45 tokens, batch 64) on BERT-base with and without
  graphs (buckets every 32 tokens). No pretrained vocabulary offline: the
  tokenizer is a ``BertTokenizerFast`` over a synthetic 30k-word vocabulary, the
  sentences its words (one token each), so tokenization is WordPiece's real
  cost on text of that length, not on natural text.

``--smoke`` runs tiny sizes on whatever device there is (CPU included), to check
the plumbing. Writes ``host.json`` (every number, the environment) and
``host.md`` to ``--out``.
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import pathlib
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from env import environment  # noqa: E402
from harness import model_cli  # noqa: E402
from timing import interleaved, kernel_times, mean_ms, median, sync as _sync, time_fn  # noqa: E402

import ragged_compile as rc  # noqa: E402
from ragged_compile.runtime import get_runtime  # noqa: E402


def per_call_us(fn, dev, reps: int) -> float:
    """Host wall microseconds per call of ``fn()`` back to back, synced at the end only:
    the host's cost per call wherever it, not the GPU, is the bottleneck."""
    for _ in range(max(3, reps // 10)):
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / reps * 1e6


class SyncCount:
    """Device-to-host syncs inside the block (CUDA's sync debug mode, counted):
    ``n``, and ``sources``, a Counter of where each came from (the innermost
    frames of this repository, transformers or the benchmark)."""

    def __init__(self, dev):
        self.dev, self.n, self.sources = dev, 0, collections.Counter()

    def _seen(self, message, *args, **kwargs):
        if "called a synchronizing" not in str(message):
            return
        self.n += 1
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(part in f.filename for part in ("ragged_compile", "transformers", "bench"))]
        self.sources[" < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])] += 1

    def __enter__(self):
        if self.dev.type == "cuda":
            self._w = warnings.catch_warnings()
            self._w.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._seen
            torch.cuda.set_sync_debug_mode(1)
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self._w.__exit__(*exc)
        return False


# -- op ----------------------------------------------------------------------------------


def _packed(lens, hq, hkv, d, dtype, dev, grad=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dev, dtype).requires_grad_(grad) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + list(lens), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
    return q, k, v, cu


def op_rows(dev, dtype, lens, heads, d, reps) -> dict:
    hq = hkv = heads
    q, k, v, cu = _packed(lens, hq, hkv, d, dtype, dev)
    rows = {}
    rt = rc.Runtime(dev) if dev.type == "cuda" else None
    with torch.no_grad():
        if rt is not None:
            # "ours": the default runtime's choice for this layout ("varlen" here: see
            # select.cuda_backend); then each CUDA forward forced, through the same path
            for backend in ("auto", "fa2", "varlen"):
                rt.backend = backend
                with rt.step(lens):
                    name = "ours" if backend == "auto" else f"ours_{backend}"
                    rows[name] = per_call_us(lambda: rc.ragged_attention(q, k, v, cu), dev, reps)
                    if backend == "auto":
                        rows["ours_kernel"] = rt.last_backend
                        rows["ours_dispatcher"] = per_call_us(
                            lambda: torch.ops.ragged_compile.ragged_attention(q, k, v, cu, cu, False, d**-0.5), dev, reps
                        )
            rt.backend = "auto"
            rows["plans"] = rt.stats["plans"]
        else:
            rows["ours"] = per_call_us(lambda: rc.ragged_attention(q, k, v, cu), dev, reps)
        b, s = len(lens), max(lens)
        qd = torch.randn(b, hq, s, d, device=dev, dtype=dtype)
        rows["sdpa_dense"] = per_call_us(lambda: F.scaled_dot_product_attention(qd, qd, qd), dev, reps)
        try:  # a submodule torch.nn.attention does not import itself
            varlen = importlib.import_module("torch.nn.attention.varlen").varlen_attn
        except (ImportError, AttributeError):
            varlen = None
        if varlen is not None and dev.type == "cuda":
            m = max(lens)
            rows["varlen_attn"] = per_call_us(lambda: varlen(q, k, v, cu, cu, m, m), dev, reps)
        if rt is not None:
            from ragged_compile.backends import flashinfer as fi

            w = fi.make_wrapper(rt.workspace(), "fa2")
            fi.plan(w, cu.cpu(), cu.cpu(), hq, hkv, d, dtype, False, d**-0.5)
            rows["flashinfer_run"] = per_call_us(lambda: w.run(q, k, v), dev, reps)
            # the same plan through our backend, which replays run()'s kernel call
            rows["flashinfer_replayed"] = per_call_us(lambda: fi.run(w, q, k, v), dev, reps)
    if rt is not None:
        qg, kg, vg, _ = _packed(lens, hq, hkv, d, dtype, dev, grad=True)
        go = torch.randn_like(qg)

        def train():
            out = rc.ragged_attention(qg, kg, vg, cu)
            torch.autograd.backward(out, go)

        for backend in ("auto", "fa2"):
            rt.backend = backend
            with rt.step(lens):
                rows["ours_fwd_bwd" if backend == "auto" else f"ours_{backend}_fwd_bwd"] = per_call_us(train, dev, reps // 2)
        rt.backend = "auto"
        # the floor of a training call on these kernels: aten's FlashAttention-2 forward
        # under autograd, whose own backward node runs FlashAttention-2's backward
        m = max(lens)
        rows["aten_fa2_fwd_bwd"] = per_call_us(
            lambda: torch.autograd.backward(
                torch.ops.aten._flash_attention_forward(qg, kg, vg, cu, cu, m, m, 0.0, False, False, scale=d**-0.5)[0],
                go,
            ),
            dev, reps // 2,
        )
        qgd = qd.clone().requires_grad_(True)
        god = torch.randn_like(qgd)
        rows["sdpa_dense_fwd_bwd"] = per_call_us(
            lambda: torch.autograd.backward(F.scaled_dot_product_attention(qgd, qgd, qgd), god), dev, reps // 2
        )
        if varlen is not None:
            m = max(lens)
            rows["varlen_attn_fwd_bwd"] = per_call_us(
                lambda: torch.autograd.backward(varlen(qg, kg, vg, cu, cu, m, m), go), dev, reps // 2
            )
    return rows


def profile_rows(dev, dtype, lens, heads, d, steps=20) -> dict:
    """torch.profiler tables (self CPU time per op) of the inference call and of the
    forward+backward call: where the host time of one call goes."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, cu = _packed(lens, heads, heads, d, dtype, dev)
    qg, kg, vg, _ = _packed(lens, heads, heads, d, dtype, dev, grad=True)
    go = torch.randn_like(qg)
    rt = rc.Runtime(dev)
    tables = {}
    for name, fn in {
        "inference": lambda: rc.ragged_attention(q, k, v, cu),
        "fwd_bwd": lambda: torch.autograd.backward(rc.ragged_attention(qg, kg, vg, cu), go),
    }.items():
        with rt.step(lens):
            grad = torch.enable_grad() if name == "fwd_bwd" else torch.no_grad()
            with grad:
                for _ in range(5):
                    fn()
                _sync(dev)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        fn()
                    _sync(dev)
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(f"== profile {name} ({steps} calls)\n{tables[name]}", flush=True)
        # torch.profiler sends calls through the dispatcher (so it can see them): the
        # eager path itself, function by function, is Python's profiler's to show.
        import cProfile
        import io
        import pstats

        with rt.step(lens):
            grad = torch.enable_grad() if name == "fwd_bwd" else torch.no_grad()
            with grad:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(10 * steps):
                    fn()
                _sync(dev)
                pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
        tables[name + "_python"] = buf.getvalue()
        print(f"== python profile {name} ({10 * steps} calls)\n{buf.getvalue()}", flush=True)
    return tables


def njt_rows(dev, dtype, lens, heads, d, reps) -> dict:
    xs = [torch.randn(n, heads * d, device=dev, dtype=dtype) for n in lens]
    x = torch.nested.nested_tensor(xs, layout=torch.jagged)

    def call():
        h = x.unflatten(-1, (heads, d)).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h)

    rows = {}
    with torch.no_grad():
        if dev.type == "cuda":
            rows["stock_njt_sdpa"] = per_call_us(call, dev, reps)
        with rc.enable():
            rows["ours_enable"] = per_call_us(call, dev, reps)
    return rows


# -- transformers --------------------------------------------------------------------------


def _bert(dev, dtype, layers, hidden, heads, attn):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * hidden, attention_probs_dropout_prob=0.0, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = BertModel(cfg, add_pooling_layer=False).to(dev, dtype)
    model.set_attn_implementation(attn)
    return model.eval()


def _padded_batch(b, s, dev, seed=0, low=0.5):
    """Right-padded ids and mask of ``b`` rows, lengths uniform in ``low * s .. s``
    (``low=0.5``: ~75% real tokens; ``low=0``: ~50%)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, int(s * low)), s + 1, (b,), generator=g)
    ids = torch.randint(1000, 30000, (b, s), generator=g)
    mask = (torch.arange(s)[None, :] < lens[:, None]).long()
    return ids.to(dev), mask.to(dev), lens


def hf_rows(dev, dtype, shapes, layers, hidden, heads, target_s, label="bert-base", low=0.5) -> list[dict]:
    """Forward ms per padded batch: ``"sdpa"``, ours (``register()``) and ours with
    the whole model unpadded (``hf.unpad``), same weights."""
    from ragged_compile import hf

    name = hf.register()
    rows = []
    models = {"sdpa": _bert(dev, dtype, layers, hidden, heads, "sdpa")}
    models["ours"] = _bert(dev, dtype, layers, hidden, heads, name)
    models["ours"].load_state_dict(models["sdpa"].state_dict())
    models["unpad"] = hf.unpad(_bert(dev, dtype, layers, hidden, heads, name))
    models["unpad"].load_state_dict(models["sdpa"].state_dict())
    rt = get_runtime(dev) if dev.type == "cuda" else None
    for b, s in shapes:
        ids, mask, lens = _padded_batch(b, s, dev, low=low)
        row = {"model": label, "batch": b, "length": s, "real_tokens": int(lens.sum()), "padded_tokens": b * s}
        valid = mask.bool()
        outs, fwds = {}, {}
        with torch.no_grad():
            runs = [(impl, model, mask) for impl, model in models.items()]
            if dev.type == "cuda":  # the mask as the tokenizer gives it: no read waits for the GPU
                runs.append(("unpad_host", models["unpad"], mask.cpu()))
            for impl, model, given in runs:
                fwds[impl] = fwd = lambda m=model, g=given: m(input_ids=ids, attention_mask=g).last_hidden_state  # noqa: E731
                outs[impl] = fwd()
                with SyncCount(dev) as sc:
                    fwd()
                row[impl] = {"syncs_per_forward": sc.n}
                if rt is not None and impl != "sdpa":
                    row[impl]["kernel"] = _kernel_of(rt, fwd)
            if rt is not None:
                # ours on the ragged path (no SDPA for small batches: select.padded_kernel),
                # with auto's kernel and with FlashInfer forced (a plan per forward)
                for impl, backend in (("ours_ragged", "auto"), ("ours_flashinfer", "fa2")):
                    fwds[impl] = fwd = lambda m=models["ours"], be=backend: _on_backend(rt, be, m, ids, mask)
                    row[impl] = {"kernel": _kernel_of(rt, fwd)}
            # in rotating rounds, so drift (clocks, a neighbour's load) hits all alike
            for impl, times in _rounds(fwds, dev, target_s).items():
                row[impl].update(ms=median([t[0] for t in times]), wall_ms=median([t[1] for t in times]))
        row["max_diff_valid"] = max(
            (outs[i].float() - outs["sdpa"].float())[valid].abs().max().item() for i in outs if i != "sdpa"
        )
        row["ours_over_sdpa_speed"] = row["sdpa"]["wall_ms"] / row["ours"]["wall_ms"]
        row["unpad_over_sdpa_speed"] = row["sdpa"]["wall_ms"] / row["unpad"]["wall_ms"]
        for impl in ("ours_ragged", "ours_flashinfer", "unpad_host"):
            if impl in row:
                row[f"{impl}_over_sdpa_speed"] = row["sdpa"]["wall_ms"] / row[impl]["wall_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _on_backend(rt, backend, model, ids, mask):
    """A forward of ``model`` on the ragged path (never SDPA for a small padded
    batch), with the runtime's CUDA forward forced to ``backend``."""
    from ragged_compile.backends import select

    before, rt.backend = rt.backend, backend
    dense, select._DENSE_MAX_FLOPS = select._DENSE_MAX_FLOPS, 0
    try:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        rt.backend, select._DENSE_MAX_FLOPS = before, dense


def _kernel_of(rt, fwd) -> str:
    """What a forward's attention ran: the runtime's last kernel, or ``"sdpa"`` where
    no op call reached the runtime (a small padded batch: select.padded_kernel)."""
    before = sum(rt.stats[k] for k in ("varlen", "flashinfer", "fa2", "reference"))
    fwd()
    ran = sum(rt.stats[k] for k in ("varlen", "flashinfer", "fa2", "reference")) - before
    return rt.last_backend if ran else "sdpa"


def _rounds(fns: dict, dev, target_s: float, rounds: int = 5) -> dict:
    """(CUDA-event ms, wall ms) per call of each of ``fns``, measured in ``rounds``
    rotating rounds of back-to-back calls (:func:`timing.interleaved`)."""
    for fn in fns.values():
        fn()
    _sync(dev)
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    _sync(dev)
    per = (time.perf_counter() - t0) / len(fns)
    reps = max(5, int(target_s / rounds / max(per, 1e-4)))
    if dev.type == "cuda":
        return interleaved(fns, rounds, lambda fn: mean_ms(fn, dev, reps))

    def host(fn):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        ms = (time.perf_counter() - t) / reps * 1e3
        return ms, ms

    return interleaved(fns, rounds, host)


def train_step(model, opt, ids, mask, model_mask=None):
    """One training step of an encoder on a padded batch (forward, a loss over valid
    positions, backward, ``opt``), as a closure to time. ``model_mask``: the mask the
    model gets, where not ``mask`` (its host copy)."""
    given = mask if model_mask is None else model_mask

    def step():
        out = model(input_ids=ids, attention_mask=given).last_hidden_state
        (out.float() * mask[..., None]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def train_rows(dev, dtype, configs, target_s) -> list[dict]:
    """Training steps of padded BERT encoders, ``"sdpa"`` / ours / ours unpadded (the
    same weights), timed in rotating rounds, with each AdamW: ``fused`` (what
    transformers' ``Trainer`` and sentence-transformers' trainer default to on torch
    >= 2.8: ``optim="adamw_torch_fused"``) and ``foreach`` (``torch.optim.AdamW``'s
    default). A host-bound step feels the optimizer's launches."""
    from ragged_compile import hf

    name = hf.register()
    rows = []
    for label, layers, hidden, heads, b, s in configs:
        ids, mask, lens = _padded_batch(b, s, dev, seed=1, low=0.0)
        for optim in ("fused", "foreach"):
            row = {"model": label, "batch": b, "length": s, "real_tokens": int(lens.sum()), "optim": optim}
            steps = {}
            for key in ("sdpa", "ours", "unpad") + (("unpad_host",) if dev.type == "cuda" else ()):
                model = _bert(dev, dtype, layers, hidden, heads, "sdpa" if key == "sdpa" else name).train()
                if key.startswith("unpad"):
                    hf.unpad(model)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **{optim: True})
                step = train_step(model, opt, ids, mask, mask.cpu() if key.endswith("_host") else None)
                for _ in range(3):
                    step()
                with SyncCount(dev) as sc:
                    step()
                row[key] = {"syncs_per_step": sc.n}
                steps[key] = step
            for key, times in _rounds(steps, dev, target_s).items():
                row[key].update(ms=median([t[0] for t in times]), wall_ms=median([t[1] for t in times]))
            for key in steps:
                row[f"{key}_over_sdpa_speed"] = row["sdpa"]["wall_ms"] / row[key]["wall_ms"]
            del steps, step, model, opt
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def compiled_train_rows(dev, dtype, configs, target_s,
                        keys=("sdpa", "sdpa_ro", "unpad", "unpad_ro", "unpad_ro_host")) -> list[dict]:
    """The training steps of :func:`train_rows` with the model compiled, fused AdamW:
    ``"sdpa"`` padded against ours unpadded, each with ``torch.compile(model)``
    (``sdpa``, ``unpad``) and with ``mode="reduce-overhead"`` (``sdpa_ro``,
    ``unpad_ro``: Inductor's CUDA graphs, partitioned around our op, which runs
    between them). Unpadding's mask read is a graph break before the compiled
    model; ``unpad_host`` / ``unpad_ro_host`` hand the model the mask on the CPU
    (the loss keeps the GPU's), so that read waits for no queued GPU work. A step
    whose kernels take less time than the host needs to launch them (a compiled
    step still launches several hundred kernels and extern calls) is host-bound;
    the graphs take that host work away."""
    from ragged_compile import hf

    name = hf.register()
    rows = []
    for label, layers, hidden, heads, b, s in configs:
        ids, mask, lens = _padded_batch(b, s, dev, seed=1, low=0.0)
        row = {"model": label, "batch": b, "length": s, "real_tokens": int(lens.sum()), "optim": "fused"}
        steps = {}
        for key in ("sdpa",) + tuple(k for k in keys if k != "sdpa"):  # speeds are against "sdpa"
            if ("_ro" in key or key.endswith("_host")) and dev.type != "cuda":
                continue
            model = _bert(dev, dtype, layers, hidden, heads, "sdpa" if key.startswith("sdpa") else name).train()
            if key.startswith("unpad"):
                hf.unpad(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
            compiled = torch.compile(model, mode="reduce-overhead" if "_ro" in key else None)

            step = train_step(compiled, opt, ids, mask, mask.cpu() if key.endswith("_host") else None)
            t0 = time.perf_counter()
            step()
            _sync(dev)
            row[key] = {"first_step_s": round(time.perf_counter() - t0, 1)}
            for _ in range(2):
                step()
            with SyncCount(dev) as sc:
                step()
            row[key]["syncs_per_step"] = sc.n
            if dev.type == "cuda":  # a step whose wall time exceeds its kernels' is host-bound
                row[key]["kernels_ms"] = kernel_times(step, steps=3, top=0)["total_ms"]
            steps[key] = step
        for key, times in _rounds(steps, dev, target_s).items():
            row[key].update(ms=median([t[0] for t in times]), wall_ms=median([t[1] for t in times]))
        for key in steps:
            row[f"{key}_over_sdpa_speed"] = row["sdpa"]["wall_ms"] / row[key]["wall_ms"]
        if "unpad_ro" in steps and "sdpa_ro" in steps:
            row["unpad_ro_over_sdpa_ro_speed"] = row["sdpa_ro"]["wall_ms"] / row["unpad_ro"]["wall_ms"]
        del steps, step, model, opt, compiled
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- CUDA graphs (hf.graphed) --------------------------------------------------------------


def graphs_rows(dev, dtype, shapes, layers, hidden, heads, target_s) -> list[dict]:
    """Forward ms per padded batch: ``"sdpa"`` eager against ``hf.graphed`` (bucket =
    the shape), the mask on the device and on the CPU, same weights."""
    from ragged_compile import hf

    sdpa = _bert(dev, dtype, layers, hidden, heads, "sdpa")
    model = _bert(dev, dtype, layers, hidden, heads, "sdpa")
    model.load_state_dict(sdpa.state_dict())
    g = hf.graphed(model, shapes)
    rows = []
    for b, s in shapes:
        ids, mask, lens = _padded_batch(b, s, dev)
        on_cpu = dict(input_ids=ids.cpu(), attention_mask=mask.cpu())
        row = {"model": "bert-base", "batch": b, "length": s, "real_tokens": int(lens.sum()), "padded_tokens": b * s}
        fns = {
            "sdpa": lambda: sdpa(input_ids=ids, attention_mask=mask).last_hidden_state,
            "graphed": lambda: g(input_ids=ids, attention_mask=mask).last_hidden_state,
            "graphed_cpu_inputs": lambda: g(**on_cpu).last_hidden_state,
        }
        with torch.no_grad():
            outs = {k: f() for k, f in fns.items()}
            for k, f in fns.items():
                r = time_fn(f, dev, warmup=3, min_reps=10, target_s=target_s)
                row[k] = {"ms": r["ms"], "wall_ms": r["wall_ms"]}
        valid = mask.bool()
        row["max_diff_valid"] = max(
            (outs[k].float() - outs["sdpa"].float())[valid].abs().max().item() for k in ("graphed", "graphed_cpu_inputs")
        )
        row["graphed_over_sdpa_speed"] = row["sdpa"]["wall_ms"] / row["graphed"]["wall_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append({"stats": dict(g.stats)})
    return rows


def _sentences(n, vocab_words, seed=0):
    """``n`` sentences of synthetic vocabulary words, lognormal lengths (mean ~45
    tokens with [CLS] and [SEP], at most 510 words)."""
    import math

    g = torch.Generator().manual_seed(seed)
    sigma = 0.6
    lens = torch.exp(math.log(43) - sigma**2 / 2 + sigma * torch.randn(n, generator=g)).round().clamp(1, 510).long()
    return [" ".join(f"w{j}" for j in torch.randint(0, vocab_words, (int(k),), generator=g).tolist()) for k in lens]


def st_encode_rows(dev, dtype, n, batch, layers, hidden, heads) -> dict:
    """``SentenceTransformer.encode()`` wall seconds of ``n`` sentences: plain
    (``"sdpa"``) against ``hf.graphed`` on the same weights (one line), the graphed
    model's first encode (its captures) apart."""
    import tempfile

    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from ragged_compile import hf

    words = 30000
    texts = _sentences(n, words)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "model"
        vocab = pathlib.Path(tmp) / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(words)]))
        tok = BertTokenizerFast(vocab_file=str(vocab), model_max_length=512)
        cfg = BertConfig(vocab_size=words + 5, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, max_position_embeddings=512, attention_probs_dropout_prob=0.0)
        torch.manual_seed(0)
        BertModel(cfg).save_pretrained(path)
        tok.save_pretrained(path)

        def load(attn="sdpa"):
            t = Transformer(str(path), model_kwargs={"attn_implementation": attn, "dtype": dtype})
            return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode="mean")],
                                          device=str(dev))

        plain, ours, graphed = load(), load(hf.register()), load()
    graphed[0].auto_model.forward = hf.graphed(graphed[0].auto_model, [(batch, length) for length in range(32, 513, 32)])

    def encode(m):
        t0 = time.perf_counter()
        out = m.encode(texts, batch_size=batch, convert_to_tensor=True)
        _sync(dev)
        return out, time.perf_counter() - t0

    row = {"sentences": n, "batch": batch, "mean_tokens": sum(len(t.split()) + 2 for t in texts) / n}
    _, row["graphed_first_s"] = encode(graphed)  # captures its buckets
    encode(plain)
    encode(ours)
    models = {"sdpa": plain, "ours": ours, "graphed": graphed}
    runs = {name: [] for name in models}
    for r in range(3):  # rotating rounds
        for name in list(models)[r:] + list(models)[:r]:
            runs[name].append(encode(models[name]))
    for name in models:
        row[f"{name}_s"] = min(t for _, t in runs[name])
    for name in ("ours", "graphed"):
        row[f"{name}_max_diff"] = (runs[name][0][0].float() - runs["sdpa"][0][0].float()).abs().max().item()
        row[f"{name}_over_sdpa_speed"] = row["sdpa_s"] / row[f"{name}_s"]
    row["stats"] = dict(graphed[0].auto_model.forward.stats)
    print(json.dumps(row), flush=True)
    return row


def _markdown(res: dict) -> str:
    lines = ["# Host cost and small batches", "", f"Environment: `{json.dumps(res['environment'])}`", ""]
    if "op" in res:
        lines += ["## Microseconds per attention call (eager, host-bound batch)", "", "| path | us / call |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in res["op"].items() if isinstance(v, float)]
        if "ours_kernel" in res["op"]:
            lines += ["", f"`ours` ran `{res['op']['ours_kernel']}` (the runtime's `auto` choice for this layout)."]
        lines.append("")
    if "njt" in res:
        lines += ["## NJT SDPA, us per call", "", "| path | us / call |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in res["njt"].items()]
        lines.append("")
    if "hf" in res:
        lines += ["## BERT-style encoder forward, padded batches (lengths L/2..L, or 1..L where real tokens are ~50%)", "",
                  "| model | batch x L | real tokens | sdpa ms | ours ms (kernel) | ours ragged ms (kernel) | ours, FlashInfer forced, ms | ours unpadded ms | ours / sdpa | unpadded / sdpa | syncs / forward (sdpa, ours, unpadded) | max diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["hf"]:
            fi_ms = f"{r['ours_flashinfer']['wall_ms']:.2f}" if "ours_flashinfer" in r else ""
            rg = f"{r['ours_ragged']['wall_ms']:.2f} ({r['ours_ragged']['kernel']})" if "ours_ragged" in r else ""
            lines.append(
                f"| {r['model']} | {r['batch']} x {r['length']} | {r['real_tokens'] / r['padded_tokens']:.0%} | "
                f"{r['sdpa']['wall_ms']:.2f} | {r['ours']['wall_ms']:.2f} ({r['ours'].get('kernel', '')}) | {rg} | {fi_ms} | "
                f"{r['unpad']['wall_ms']:.2f} | {r['ours_over_sdpa_speed']:.2f}x | {r['unpad_over_sdpa_speed']:.2f}x | "
                f"{r['sdpa']['syncs_per_forward']}, {r['ours']['syncs_per_forward']}, {r['unpad']['syncs_per_forward']} | "
                f"{r['max_diff_valid']:.1e} |"
            )
        hosted = [r for r in res["hf"] if "unpad_host" in r]
        if hosted:
            lines += ["", "Unpadded, the mask given on the CPU: " + ", ".join(
                f"{r['model']} {r['batch']} x {r['length']} {r['unpad_host']['wall_ms']:.2f} ms "
                f"({r['unpad_host_over_sdpa_speed']:.2f}x, {r['unpad_host']['syncs_per_forward']} syncs)" for r in hosted)]
        lines.append("")
    if "graphs" in res:
        lines += ["## CUDA graphs (hf.graphed): BERT-base forward, padded batches (lengths L/2..L)", "",
                  "| batch x L | sdpa ms | graphed ms (mask on device) | graphed ms (inputs on CPU) | graphed / sdpa | max diff |",
                  "|---|---|---|---|---|---|"]
        for r in res["graphs"]["forward"]:
            if "stats" not in r:
                lines.append(
                    f"| {r['batch']} x {r['length']} | {r['sdpa']['wall_ms']:.2f} | {r['graphed']['wall_ms']:.2f} | "
                    f"{r['graphed_cpu_inputs']['wall_ms']:.2f} | {r['graphed_over_sdpa_speed']:.2f}x | {r['max_diff_valid']:.1e} |"
                )
        e = res["graphs"]["encode"]
        lines += ["", f"sentence-transformers encode(), {e['sentences']} sentences (mean {e['mean_tokens']:.0f} tokens), "
                  f"batch {e['batch']}: sdpa {e['sdpa_s']:.2f} s, ours eager {e['ours_s']:.2f} s "
                  f"({e['ours_over_sdpa_speed']:.2f}x), graphed {e['graphed_s']:.2f} s "
                  f"({e['graphed_over_sdpa_speed']:.2f}x; first encode with its captures {e['graphed_first_s']:.2f} s), "
                  f"max diff {e['ours_max_diff']:.1e} / {e['graphed_max_diff']:.1e}. Tokenizer: BertTokenizerFast "
                  f"over a synthetic vocabulary.", ""]
    if "train" in res:
        lines += ["## Training step (forward, backward, AdamW), padded, rotating rounds", "",
                  "| model | batch x L | AdamW | sdpa ms | ours ms | ours unpadded ms | ours / sdpa | unpadded / sdpa | syncs / step (sdpa, ours, unpadded) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res["train"]:
            lines.append(
                f"| {r['model']} | {r['batch']} x {r['length']} | {r.get('optim', 'foreach')} | {r['sdpa']['wall_ms']:.1f} | {r['ours']['wall_ms']:.1f} | "
                f"{r['unpad']['wall_ms']:.1f} | {r['ours_over_sdpa_speed']:.2f}x | {r['unpad_over_sdpa_speed']:.2f}x | "
                f"{r['sdpa']['syncs_per_step']}, {r['ours']['syncs_per_step']}, {r['unpad']['syncs_per_step']} |"
            )
        hosted = [r for r in res["train"] if "unpad_host" in r]
        if hosted:
            lines += ["", "Unpadded, the model given the mask on the CPU: " + ", ".join(
                f"{r['model']} {r['optim']} {r['unpad_host']['wall_ms']:.1f} ms ({r['unpad_host_over_sdpa_speed']:.2f}x, "
                f"{r['unpad_host']['syncs_per_step']} syncs)" for r in hosted)]
    if "train_compiled" in res:
        lines += ["", "## Training step, compiled (torch.compile, fused AdamW), padded, rotating rounds", "",
                  "`ro`: `mode=\"reduce-overhead\"` (Inductor's CUDA graphs, partitioned around our op). "
                  "Speeds against `\"sdpa\"` compiled in the default mode.", "",
                  "| model | batch x L | implementation | ms | kernels ms | speed | syncs a step | first step s |",
                  "|---|---|---|---|---|---|---|---|"]
        names = {"sdpa": "`\"sdpa\"` padded", "sdpa_ro": "`\"sdpa\"` padded, ro", "unpad": "ours unpadded",
                 "unpad_ro": "ours unpadded, ro", "unpad_host": "ours unpadded, mask on the CPU",
                 "unpad_ro_host": "ours unpadded, ro, mask on the CPU"}
        for r in res["train_compiled"]:
            for key, label in names.items():
                if key in r:
                    lines.append(
                        f"| {r['model']} | {r['batch']} x {r['length']} | {label} | {r[key]['wall_ms']:.1f} | "
                        f"{r[key].get('kernels_ms', float('nan')):.1f} | "
                        f"{r[f'{key}_over_sdpa_speed']:.2f}x | {r[key]['syncs_per_step']} | {r[key]['first_step_s']} |"
                    )
    return "\n".join(lines) + "\n"


def main() -> None:
    a, dev, dtype = model_cli(__doc__, "op,njt,hf,train")
    only = set(a.only.split(","))
    res: dict = {"environment": environment(), "device": str(dev), "dtype": str(dtype)}
    small = [9, 17, 33, 12] * (1 if a.smoke else 8)
    reps = 50 if a.smoke else 2000
    if "op" in only:
        res["op"] = op_rows(dev, dtype, small, 4 if a.smoke else 12, 64, reps)
        print(json.dumps(res["op"]), flush=True)
    if "profile" in only and dev.type == "cuda":
        res["profile"] = profile_rows(dev, dtype, small, 12, 64)
    if "njt" in only:
        res["njt"] = njt_rows(dev, dtype, small, 4 if a.smoke else 12, 64, reps)
        print(json.dumps(res["njt"]), flush=True)
    if "hf" in only:
        if a.smoke:
            res["hf"] = hf_rows(dev, dtype, [(4, 16)], 2, 64, 2, 0.05)
        else:
            # HF_ROWS=half: only unpadding's rows at ~50% padding
            res["hf"] = [] if os.environ.get("HF_ROWS") == "half" else (
                hf_rows(dev, dtype, [(64, 48), (64, 128), (16, 512), (256, 128), (64, 256), (32, 512), (64, 512)],
                        12, 768, 12, a.target_s)
                + hf_rows(dev, dtype, [(64, 512), (128, 256)], 24, 1024, 16, a.target_s, label="bert-large"))
            # unpadding's rows: ~50% padding (lengths 1..L)
            res["hf"] += hf_rows(dev, dtype, [(64, 512)], 12, 768, 12, a.target_s, low=0.0)
            res["hf"] += hf_rows(dev, dtype, [(64, 512), (128, 256)], 24, 1024, 16, a.target_s, label="bert-large", low=0.0)
    if "graphs" in only:
        if a.smoke:
            res["graphs"] = {"forward": graphs_rows(dev, dtype, [(4, 16)], 2, 64, 2, 0.05),
                             "encode": st_encode_rows(dev, dtype, 64, 16, 2, 64, 2)}
        else:
            res["graphs"] = {"forward": graphs_rows(dev, dtype, [(64, 48), (64, 128), (16, 512)], 12, 768, 12, a.target_s),
                             "encode": st_encode_rows(dev, dtype, 4096, 64, 12, 768, 12)}
    if "train" in only:
        if a.smoke:
            res["train"] = train_rows(dev, dtype, [("tiny", 2, 64, 2, 4, 16)], 0.05)
        else:
            res["train"] = train_rows(
                dev, dtype, [("bert-base", 12, 768, 12, 64, 256), ("bert-large", 24, 1024, 16, 32, 512)], a.target_s
            )
    if "train_compiled" in only:
        configs = ([("tiny", 2, 64, 2, 4, 16)] if a.smoke
                   else [("bert-large", 24, 1024, 16, 32, 512), ("bert-base", 12, 768, 12, 64, 256)])
        # each compile takes about a minute: TRAIN_COMPILED_MODELS / _KEYS pick rows and implementations
        models = os.environ.get("TRAIN_COMPILED_MODELS")
        configs = [c for c in configs if models is None or c[0] in models.split(",")]
        keys = os.environ.get("TRAIN_COMPILED_KEYS", "sdpa,sdpa_ro,unpad,unpad_ro,unpad_ro_host").split(",")
        res["train_compiled"] = compiled_train_rows(dev, dtype, configs, 0.05 if a.smoke else a.target_s, keys)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host.json").write_text(json.dumps(res, indent=1))
    (out / "host.md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
