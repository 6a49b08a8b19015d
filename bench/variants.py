"""The implementations the per-op benchmark compares (the rows of its table):
ours (eager, forced fa2/fa3, compiled), FlashInfer run directly, varlen_attn,
NJT SDPA, FlexAttention with a document mask and padded SDPA. Each builder
returns a :class:`Prepared` callable on a :class:`layouts.Case`."""

from __future__ import annotations

import inspect
from collections import Counter

import torch
import torch.nn.functional as F

from harness import DTYPE, Skip, Unsupported, auto_backend, err_str, has_kwarg, need_rc, rc
from layouts import Case
from timing import host_ms, interleaved, median, sync, time_fn

class Prepared:
    def __init__(self, fn, to_out=lambda r: r, extra=None, stats=None, note=None):
        self.fn, self.to_out, self.extra, self.stats = fn, to_out, extra or {}, stats
        self.note = note


class Shared:
    """Objects kept across layouts: runtimes, FlashInfer workspace, compiled fns."""

    def __init__(self, dev):
        self.dev = dev
        self._runtimes = {}
        self._workspaces = {}
        self._compiled = {}

    def runtime(self, backend: str):
        need_rc()
        if backend not in self._runtimes:
            if self.dev.type == "cuda":
                self._runtimes[backend] = rc.Runtime(self.dev, backend=backend)
            else:
                self._runtimes[backend] = rc.Runtime(self.dev)
        return self._runtimes[backend]

    def workspace(self, key: str):
        """One FlashInfer workspace per key: wrappers alive at once (the paired
        blocks) must not share one, or a plan would clobber another's."""
        if key not in self._workspaces:
            self._workspaces[key] = torch.empty(256 << 20, dtype=torch.uint8, device=self.dev)
        return self._workspaces[key]

    def compiled(self, key, make):
        if key not in self._compiled:
            self._compiled[key] = make()
        return self._compiled[key]


# --------------------------------------------------------------------------- per-op implementations
def _ours_fn(c: Case):
    need_rc()
    return lambda: rc.ragged_attention(c.q, c.k, c.v, c.cu, causal=c.causal, scale=c.scale)


def _plan_cost(rt, c: Case, f, reps: int = 7) -> dict:
    """plan_ms = median(enter a fresh step + first call, synced) - median(a call, synced)."""
    dev = c.dev

    def fresh():
        with rt.step(c.lens):
            f()
            sync(dev)

    firsts = [host_ms(fresh, dev, 1) for _ in range(reps)]
    first = median(firsts)
    with rt.step(c.lens):
        f()
        sync(dev)

        def steady():
            f()
            sync(dev)

        plain = host_ms(steady, dev, reps)
    return {
        "plan_ms": first - plain,
        "plan_ms_min": min(firsts) - plain,
        "fresh_step_first_call_ms": first,
        "steady_call_synced_ms": plain,
    }


def impl_ours(c: Case, sh: Shared, stack, backend="auto", compiled=False) -> Prepared:
    if backend != "auto" and c.dev.type != "cuda":
        raise Skip("CUDA only: forcing a FlashInfer backend needs a GPU (CPU runs the reference kernel)")
    rt = sh.runtime(backend)
    if compiled:
        causal, scale = c.causal, c.scale

        def attn(q, k, v, cu):
            return rc.ragged_attention(q, k, v, cu, causal=causal, scale=scale)

        cf = torch.compile(attn, fullgraph=True, dynamic=False)
        f = lambda: cf(c.q, c.k, c.v, c.cu)  # noqa: E731
    else:
        f = _ours_fn(c)
    with rt.step(c.lens):  # first call: FlashInfer JIT / torch.compile
        f()
        sync(c.dev)
    extra = {}
    try:
        extra.update(_plan_cost(rt, c, f))
        if c.dev.type != "cuda":
            extra["plan_ms_note"] = "CPU: the reference kernel never plans; plan_ms is noise here"
    except Exception as e:  # noqa: BLE001
        extra["plan_ms_error"] = err_str(e)
    stack.enter_context(rt.step(c.lens))  # the step stays open while timing: one plan, then hot path
    f()
    sync(c.dev)
    extra["backend_used"] = getattr(rt, "last_backend", None)
    if extra["backend_used"] is None and c.dev.type == "cuda":
        extra["backend_used"] = backend if backend != "auto" else auto_backend(
            c.dev, c.n, c.total, hq=c.hq, hkv=c.hkv, head_dim=c.d, causal=c.causal
        )
    extra["runtime_backend"] = backend
    return Prepared(f, extra=extra, stats=lambda: Counter(rt.stats))


def flashinfer_wrapper(workspace, backend: str, causal: bool, scale: float):
    """FlashInfer's ragged prefill wrapper, run directly, and its plan's keyword arguments."""
    import flashinfer

    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend)
    kw = dict(causal=causal, sm_scale=scale, q_data_type=DTYPE, kv_data_type=DTYPE)
    if has_kwarg(w.plan, "o_data_type"):
        kw["o_data_type"] = DTYPE
    return w, kw


def _fi_direct(c: Case, sh: Shared, backend: str):
    """A FlashInfer ragged wrapper for this case: (run callable, plan callable, note)."""
    if c.dev.type != "cuda":
        raise Skip("CUDA only")
    if backend == "fa3" and torch.cuda.get_device_capability(c.dev) != (9, 0):
        raise Unsupported("fa3 needs SM90")
    dp = next((x for x in (64, 128, 256) if x >= c.d), None)
    if dp is None:
        raise Unsupported(f"head_dim {c.d} > 256")
    w, kw = flashinfer_wrapper(sh.workspace(backend), backend, c.causal, c.scale)

    def plan():
        w.plan(c.cu_host, c.cu_host, c.hq, c.hkv, dp, **kw)

    q, k, v = c.q, c.k, c.v
    note = None
    if dp != c.d:
        # FlashInfer fa2 is silently wrong for head dims like 72 and fa3 lacks them:
        # zero-pad by hand, true scale, slice back.
        note = f"head_dim {c.d} zero-padded to {dp} inside the timed call (as ours does)"
        pad = (0, dp - c.d)
        f = lambda: w.run(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad))[..., : c.d]  # noqa: E731
    else:
        f = lambda: w.run(q, k, v)  # noqa: E731
    return f, plan, note


def impl_flashinfer(c: Case, sh: Shared, stack, backend: str) -> Prepared:
    f, plan, note = _fi_direct(c, sh, backend)
    plan()
    sync(c.dev)
    extra = {"plan_ms": host_ms(plan, c.dev, 5)}
    plan()
    sync(c.dev)
    return Prepared(f, extra=extra, note=note)


def paired_vs_flashinfer(c: Case, sh: Shared, backend: str, rounds: int = 6, reps: int = 30) -> dict:
    """ours_eager (backend "auto") and FlashInfer's fa2 and fa3 run directly, timed
    in rotating blocks so that clock / thermal drift between rows cannot pass for
    overhead or for a backend difference.

    ``ratio``: ours / FlashInfer with ``backend`` (the one ours picked);
    ``ratio_vs_fa2``, ``ratio_vs_fa3``, ``ratio_vs_best`` (the faster of the two,
    ``best``); ``within_3pct``: ``ratio_vs_best <= 1.03``, the target of ``auto``.
    A backend the GPU lacks (fa3 off SM90) is left out with the reason."""
    rt = sh.runtime("auto")
    runs = {"ours": _ours_fn(c)}
    plans, skipped = [], {}
    for b in ("fa2", "fa3"):
        try:
            f, plan, _ = _fi_direct(c, sh, b)
        except Skip as e:
            skipped[b] = str(e)
            continue
        runs[b] = f
        plans.append(plan)
    with rt.step(c.lens):
        for plan in plans:
            plan()
        for f in runs.values():
            f()
        sync(c.dev)
        blocks = interleaved(
            runs, rounds, lambda f: time_fn(f, c.dev, warmup=2, min_reps=reps, max_reps=reps, target_s=0)["ms"]
        )
    ms = {k: median(v) for k, v in blocks.items()}
    fi = {b: ms[b] for b in ("fa2", "fa3") if b in ms}
    best = min(fi, key=fi.get)
    out = {
        "backend": backend,
        "ours_ms": ms["ours"],
        "flashinfer_ms": fi.get(backend),
        "ratio": ms["ours"] / fi[backend] if backend in fi else None,
        "best": best,
        "best_ms": fi[best],
        "ratio_vs_best": ms["ours"] / fi[best],
        "within_3pct": ms["ours"] / fi[best] <= 1.03,
        "blocks_ms": blocks,
    }
    for b, v in fi.items():
        out[f"{b}_ms"] = v
        out[f"ratio_vs_{b}"] = ms["ours"] / v
    if skipped:
        out["skipped"] = skipped
    return out


def varlen_kwargs(causal: bool, gqa: bool, scale: float | None = None, d: int | None = None):
    """``varlen_attn`` and its keyword arguments for this torch: causal through
    ``is_causal`` or ``window_size=(-1, 0)``, GQA through ``enable_gqa`` (else
    ``expand``: k/v must be expanded by hand), ``scale`` where it has one."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"torch.nn.attention.varlen.varlen_attn not in torch {torch.__version__}: {err_str(e)}")
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if scale is not None and "scale" in params:
        kw["scale"] = scale
    elif scale is not None and abs(scale - d**-0.5) > 1e-12:
        raise Unsupported("varlen_attn has no scale argument")
    if causal:
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise Unsupported("varlen_attn has neither is_causal nor window_size")
    expand = gqa and "enable_gqa" not in params
    if gqa and not expand:
        kw["enable_gqa"] = True
    return varlen_attn, kw, expand


def impl_varlen(c: Case, sh: Shared, stack) -> Prepared:
    varlen_attn, kw, expand = varlen_kwargs(c.causal, c.hq != c.hkv, c.scale, c.d)
    if expand:
        raise Unsupported(f"no GQA: varlen_attn of torch {torch.__version__} has no enable_gqa")
    q, k, v, cu, m = c.q, c.k, c.v, c.cu, c.max_len
    f = lambda: varlen_attn(q, k, v, cu, cu, m, m, **kw)  # noqa: E731
    return Prepared(f, to_out=lambda r: r[0] if isinstance(r, tuple) else r, extra={"kwargs": sorted(kw)})


def _njt(c: Case, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=c.min_len, max_seqlen=c.max_len)


def impl_njt(c: Case, sh: Shared, stack, compiled=False) -> Prepared:
    off = c.cu64
    qn, kn, vn = (_njt(c, x, off) for x in (c.q, c.k, c.v))  # [B, j, H, D], one nested int
    kw = {"is_causal": c.causal, "scale": c.scale}
    if c.hq != c.hkv:
        kw["enable_gqa"] = True  # NJT SDPA is expected to reject this: recorded as an error

    def attn(qn, kn, vn):
        o = F.scaled_dot_product_attention(qn.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2), **kw)
        return o.transpose(1, 2)

    fn = torch.compile(attn, fullgraph=True) if compiled else attn
    f = lambda: fn(qn, kn, vn)  # noqa: E731
    return Prepared(f, to_out=lambda r: r.values(), note="NJTs [B, j, H, D] built outside the timed call")


def impl_flex(c: Case, sh: Shared, stack) -> Prepared:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"flex_attention unavailable: {err_str(e)}")
    dev = c.dev
    doc = torch.repeat_interleave(
        torch.arange(c.n, device=dev, dtype=torch.int32), torch.tensor(c.lens, device=dev)
    )
    if c.causal:

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

    T = c.total

    def make_mask():
        return create_block_mask(mask_mod, None, None, T, T, device=dev)

    bm = make_mask()
    sync(dev)
    extra = {"block_mask_ms": host_ms(lambda: (make_mask(), sync(dev)), dev, 3)}
    q4 = c.q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, T, D]
    k4 = c.k.transpose(0, 1).unsqueeze(0).contiguous()
    v4 = c.v.transpose(0, 1).unsqueeze(0).contiguous()
    kw = {"block_mask": bm, "scale": c.scale}
    if c.hq != c.hkv:
        kw["enable_gqa"] = True
    cflex = sh.compiled("flex", lambda: torch.compile(flex_attention, dynamic=False))
    f = lambda: cflex(q4, k4, v4, **kw)  # noqa: E731
    return Prepared(
        f,
        to_out=lambda r: (r[0] if isinstance(r, tuple) else r)[0].transpose(0, 1),
        extra=extra,
        note="packed [1, H, T, D] with a document mask, compiled flex_attention; block mask built outside the timed call",
    )


def impl_padded(c: Case, sh: Shared, stack) -> Prepared:
    dev, B, L = c.dev, c.n, c.max_len
    lens = torch.tensor(c.lens, device=dev)
    b_idx = torch.repeat_interleave(torch.arange(B, device=dev), lens)
    pos = torch.arange(c.total, device=dev) - torch.repeat_interleave(c.cu64[:-1], lens)

    def pad(x):
        p = x.new_zeros(B, L, x.shape[1], x.shape[2])
        p[b_idx, pos] = x
        return p.transpose(1, 2).contiguous()  # [B, H, L, D]

    qp, kp, vp = pad(c.q), pad(c.k), pad(c.v)
    mask = (torch.arange(L, device=dev)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L] keys
    if c.causal:
        mask = mask & torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None]
    kw = {"attn_mask": mask, "scale": c.scale}
    if c.hq != c.hkv:
        kw["enable_gqa"] = True
    f = lambda: F.scaled_dot_product_attention(qp, kp, vp, **kw)  # noqa: E731
    return Prepared(
        f,
        to_out=lambda r: r.transpose(1, 2)[b_idx, pos],
        note=f"pre-padded [B={B}, H, Lmax={L}, D] + boolean mask; padding/unpadding not timed",
    )


IMPLS = [
    ("ours_eager", lambda c, sh, st: impl_ours(c, sh, st, "auto")),
    ("ours_fa2", lambda c, sh, st: impl_ours(c, sh, st, "fa2")),
    ("ours_fa3", lambda c, sh, st: impl_ours(c, sh, st, "fa3")),
    ("ours_compiled", lambda c, sh, st: impl_ours(c, sh, st, "auto", compiled=True)),
    ("flashinfer_fa3", lambda c, sh, st: impl_flashinfer(c, sh, st, "fa3")),
    ("flashinfer_fa2", lambda c, sh, st: impl_flashinfer(c, sh, st, "fa2")),
    ("varlen_attn", impl_varlen),
    ("njt_sdpa_eager", lambda c, sh, st: impl_njt(c, sh, st, False)),
    ("njt_sdpa_compiled", lambda c, sh, st: impl_njt(c, sh, st, True)),
    ("flex_doc_mask", impl_flex),
    ("padded_sdpa", impl_padded),
]
IMPL_NAMES = [n for n, _ in IMPLS]
