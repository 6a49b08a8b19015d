"""CUDA gradient fuzz: training forward + backward (flash-attn-4 when installed, else
FlashAttention-2; RAGGED_COMPILE_BACKWARD picks one) vs float64 autograd.

    RAGGED_FUZZ_GRAD_EXAMPLES=1000 python -m pytest -q -s fuzz/test_fuzz_grad_cuda.py

Each example draws a layout (self or cross, empty and one-token segments, all-empty
k, causal with Lq != Lk), GQA 1/2/4/8, head dims 32..256 (72/80/96 padded), bf16
or fp16, and compares out with a dense float64 per-segment reference and dq, dk,
dv with float64 gradients given the forward's rounded output (see check), on
the GPU, on the *same* rounded inputs. Checked per tensor (norm-wise,
tight) and per token row (loose, so one wrong segment cannot hide among long ones).
Skipped without a CUDA device.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

import ragged_compile
from ragged_compile.backends import select
from ragged_compile.reference import dense_attention, dense_gradients
from ragged_compile.testing import AttentionCase, Layout, attention_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_EXAMPLES = int(os.environ.get("RAGGED_FUZZ_GRAD_EXAMPLES", "200"))
HEAD_DIMS = (32, 64, 72, 80, 96, 128, 256)
# (norm-wise relative, per-row relative) tolerances against float64.
TOLERANCES = {torch.bfloat16: (2e-2, 1e-1), torch.float16: (5e-3, 3e-2)}


def _case(q_lens, kv_lens=None, hq=4, hkv=1, d=72, dtype=torch.bfloat16, causal=True, **kw):
    cross = kv_lens is not None
    layout = Layout(tuple(q_lens), tuple(kv_lens if cross else q_lens), cross)
    return AttentionCase(layout, hq, hkv, d, dtype, causal, kw.pop("scale", None), kw.pop("seed", 7), **kw)


EXAMPLES = [
    _case([5, 0, 1, 33], [0, 7, 1, 20], hq=8, hkv=1, d=72),  # GQA 8, empty q and k, Lq > Lk
    _case([1, 1, 200, 0], [64, 0, 300, 5], hq=4, hkv=2, d=80, dtype=torch.float16),
    _case([17, 1, 0, 130], hq=8, hkv=8, d=96, causal=False, fused_qkv=True),
    _case([3, 9], [0, 0], hq=4, hkv=1, d=64),  # all-empty k
    _case([0, 0], [5, 2], hq=2, hkv=1, d=32),  # all-empty q
    _case([40, 3], [9, 100], hq=16, hkv=2, d=256, index_dtype=torch.int64, scale=0.05),
    _case([1] * 300, hq=8, hkv=1, d=128, dtype=torch.float16),
]


def _check(name, got, want, dtype, case, tolerances=None):
    assert got.shape == want.shape and got.dtype == dtype, (name, got.shape, want.shape)
    assert bool(torch.isfinite(got).all()), f"{name} not finite for {case!r}"
    if want.numel() == 0:
        return
    norm_tol, row_tol = tolerances or TOLERANCES[dtype]
    got, ref = got.detach().double().cpu(), want.detach().double().cpu()
    err = got - ref
    # Exact zeros happen (one-token causal segments: dq = 0): a floor of 1e-3 rms.
    ref_norm = max(ref.norm().item(), 1e-3 * ref.numel() ** 0.5)
    rel = err.norm().item() / ref_norm
    assert rel < norm_tol, f"{name}: relative error {rel:.3g} >= {norm_tol} for {case!r}"
    row_err = err.flatten(1).norm(dim=1)
    row_ref = ref.flatten(1).norm(dim=1)
    floor = ref_norm / max(1, ref.shape[0]) ** 0.5  # the rms row norm
    bad = row_err > row_tol * torch.maximum(row_ref, torch.full_like(row_ref, floor))
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} token rows off (first {bad.nonzero()[0].item()}) for {case!r}"
    )


def _fuzzed(max_examples: int, **bounds):
    """Hypothesis over half-precision cases of every head dim, within ``bounds``."""
    cases = attention_cases(dtypes=(torch.bfloat16, torch.float16), head_dims=HEAD_DIMS, max_elements=1 << 20,
                            max_score_elements=1 << 26, **bounds)
    health = [HealthCheck.too_slow, HealthCheck.data_too_large]
    return lambda fn: settings(max_examples=max_examples, deadline=None, suppress_health_check=health)(
        given(case=cases)(fn)
    )


@pytest.mark.parametrize("forward", ["fa2", "fa3", "varlen", "fa4"])
def test_gradients_match_float64_autograd(forward, monkeypatch):
    """Each training forward the default runtime may pick (FlashInfer's, whose LSE
    is converted; FlashAttention-2's or flash-attn-4's, whose LSE the backward takes
    as it is), forced for every example (flash-attn-4's where it takes the head dim)."""
    from ragged_compile.backends import fa4_forward
    from ragged_compile.runtime import get_runtime

    if forward == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs SM90")
    device = torch.device("cuda", torch.cuda.current_device())
    if forward == "fa4" and fa4_forward.unsupported_reason(device, torch.bfloat16, 128) is not None:
        pytest.skip(fa4_forward.unsupported_reason(device, torch.bfloat16, 128))
    rt = get_runtime(device)
    monkeypatch.setattr(rt, "backend", forward)
    kernel = {"varlen": "varlen", "fa4": "fa4"}.get(forward, "flashinfer")
    before = rt.stats[kernel]
    ran = collections.Counter()

    @_fuzzed(MAX_EXAMPLES, max_segments=48, max_len=512, max_tiny_segments=256)
    def check(case: AttentionCase):
        x = case.tensors(device="cuda")
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        kwargs = case.call_kwargs(x)
        kwargs.update(q=q, k=k, v=v)
        out = ragged_compile.ragged_attention(**kwargs)
        g = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(case.seed), device="cuda")
        out.backward(g.to(out.dtype))
        torch.cuda.synchronize()

        # float64 on the GPU (fast there), on the *same* rounded inputs. The
        # gradients take D_i = sum_d dO_id O_id from the forward's *rounded*
        # output: where a row's softmax is nearly one-hot (large scores, short
        # segments) D cancels against dP_ij, and with O rounded to bf16 that
        # cancellation is what any FlashAttention backward computes, stock
        # PyTorch's included. This isolates what the backward kernel itself gets
        # right; the output is checked against exact float64 first.
        args = (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, case.causal, case.effective_scale)
        ref = dense_attention(*args, device=x.q.device)
        _check("out", out.detach(), ref, case.dtype, case)
        _, *want = dense_gradients(g.to(out.dtype), *args, out=out.detach(), device=x.q.device)
        for name, a, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
            _check(name, a, b, case.dtype, case)
        ran["examples"] += 1
        total_q, total_k = case.layout.total_q, case.layout.total_k
        pairs = sum(a * b for a, b in zip(case.q_lengths, case.k_lengths))
        work = select.backward_work(case.hq, case.hkv, total_q, total_k, pairs, case.causal)
        slots = (len(case.q_lengths), total_q, total_k)
        ran["backward_" + select.backward_kernel(q.device, q.dtype, q.shape[-1], work, (), slots)] += 1
        ran["forward_" + str(rt.last_backend)] += 1
        ran[str(case.dtype)] += 1
        ran[f"d{case.head_dim}"] += 1
        ran[f"gqa{case.hq // case.hkv}"] += 1
        ran["cross" if case.layout.cross else "self"] += 1
        ran["causal"] += case.causal
        ran["empty_segment"] += 0 in case.q_lengths or 0 in case.k_lengths
        ran["all_k_empty"] += case.layout.total_k == 0
        ran["causal_lq_gt_lk"] += case.causal and any(a > b for a, b in zip(case.q_lengths, case.k_lengths))
        if ran["examples"] % 100 == 0:  # progress that survives a time limit
            print(f"\n{ran['examples']} examples passed so far ({dict(ran)})", flush=True)

    for c in EXAMPLES:
        check = example(case=c)(check)
    check()
    print(f"\nCUDA gradient fuzz: ran {ran['examples']} examples ({dict(ran)})")
    assert ran["examples"] >= min(MAX_EXAMPLES, len(EXAMPLES))
    # the forced forward ran (layouts it cannot take, and those without work, do not;
    # flash-attn-4's takes 4 of the 7 head dims)
    assert rt.stats[kernel] - before >= ran["examples"] // (3 if forward == "fa4" else 2)


VARIANT_EXAMPLES = int(os.environ.get("RAGGED_FUZZ_VARIANT_EXAMPLES", str(MAX_EXAMPLES)))


def test_variant_gradients_match_float64_autograd():
    """Sliding windows (left, right, both, wider than a segment, zero), soft-capping
    and sinks, alone and together, through the fused kernels (FlashAttention-2's
    windowed forward or window_forward.py's, or FlashInfer's; FlashAttention-2's
    backward, or segment_backward.py's for soft-capped scores; the sinks' rescale):
    out, dq, dk, dv and d(sinks) against float64 autograd."""
    ran = collections.Counter()

    @_fuzzed(VARIANT_EXAMPLES, max_segments=32, max_len=384, max_tiny_segments=128, window_size=True, sinks=True,
             softcap=True)
    def check(case: AttentionCase):
        x = case.tensors(device="cuda")
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        kwargs = case.call_kwargs(x)
        kwargs.update(q=q, k=k, v=v)
        sinks = kwargs.get("sinks")
        if sinks is not None:
            sinks = kwargs["sinks"] = sinks.float().requires_grad_()
        out = ragged_compile.ragged_attention(**kwargs)
        g = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(case.seed), device="cuda")
        out.backward(g.to(out.dtype))
        torch.cuda.synchronize()
        variants = {n: kwargs[n] for n in ("window_size", "softcap") if n in kwargs}
        if sinks is not None:
            variants["sinks"] = sinks.detach()
        args = (x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, case.causal, case.effective_scale)
        ref = dense_attention(*args, device=x.q.device, **variants)
        _check("out", out.detach(), ref, case.dtype, case)
        _, *want = dense_gradients(g.to(out.dtype), *args, out=out.detach(), device=x.q.device, **variants)
        got = [q.grad, k.grad, v.grad] + ([sinks.grad] if sinks is not None else [])
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
            # dsinks: float32 [Hq], a row per head, as accurate as the case's dtype allows
            rows = (a, b) if a.dim() > 1 else (a[:, None], b[:, None])
            _check(name, *rows, a.dtype, case, TOLERANCES[case.dtype])
        ran["examples"] += 1
        variant = select.variant(case.causal, tuple(case.window_size), case.softcap, sinks)
        ran["+".join(variant) or "plain"] += 1
        window = tuple(case.window_size)
        kernel = select.forward_kernel(q.device, q.dtype, q.shape[-1], variant)
        if kernel == "fa2":  # windows: FlashAttention-2's forward or window_forward.py's
            kernel = select.window_kernel(q.device, q.dtype, q.shape[-1], case.causal, window)
        if select.SOFTCAP in variant and select._variant_reason(q.device, q.dtype, q.shape[-1], variant, training=True,
                                                                causal=case.causal, window=window) is None:
            kernel += "+triton_backward"
        elif select.SOFTCAP in variant:
            kernel = "reference"
        ran["kernel_" + kernel] += 1
        ran["causal"] += case.causal
        ran["cross" if case.layout.cross else "self"] += 1
        if ran["examples"] % 100 == 0:
            print(f"\n{ran['examples']} variant examples passed so far ({dict(ran)})", flush=True)

    check()
    print(f"\nCUDA variant gradient fuzz: ran {ran['examples']} examples ({dict(ran)})")
    assert ran["examples"] >= 1
