"""Segments are independent: poisoning one segment moves no value of another.

A NaN or +-inf at one random position of one segment's q, k, v or grad_out,
and every other segment's output and gradients must equal the clean run's bit
for bit: on the op's CPU kernel (through autograd) and on the reference kernel,
plain and with the variants (sliding windows, softcap, sinks; the sinks' own
gradient sums over every segment, so it is not among the compared).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ragged_compile
from ragged_compile.reference import reference_attention, reference_attention_backward
from ragged_compile.testing import attention_cases, scaled_examples

_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _op(q, k, v, go, cu_q, cu_k, causal, scale, **variants):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = ragged_attention_op(*leaves, cu_q, cu_k, causal, scale, **variants)
    out.backward(go)
    return out.detach(), *[x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]


def ragged_attention_op(q, k, v, cu_q, cu_k, causal, scale, **variants):
    return ragged_compile.ragged_attention(q, k, v, cu_q, cu_k, causal=causal, scale=scale, **variants)


def _reference(q, k, v, go, cu_q, cu_k, causal, scale, **variants):
    out = reference_attention(q, k, v, cu_q, cu_k, causal, scale, **variants)
    return out, *reference_attention_backward(go, q, k, v, cu_q, cu_k, causal, scale, **variants)[:3]


KERNELS = {"op (CPU kernel)": _op, "reference": _reference}


def _bits(x):
    return x.contiguous().view(_INT[x.dtype])


def _cases(dtypes, variants=False):
    return attention_cases(
        dtypes=dtypes,
        head_dims=(8, 16, 72),
        max_segments=10,
        min_segments=2,
        max_len=40,
        max_elements=1 << 13,
        max_tiny_segments=300,
        window_size=variants,
        softcap=variants,
        sinks=variants,
    )


@settings(max_examples=scaled_examples(0.2, minimum=20))
@given(case=_cases((torch.float32, torch.bfloat16, torch.float16)), data=st.data())
def test_poison_one_segment(case, data):
    _check_isolation(case, data, KERNELS, "cpu")


@settings(max_examples=scaled_examples(0.2, minimum=20))
@given(case=_cases((torch.float32, torch.bfloat16), variants=True), data=st.data())
def test_poison_one_segment_with_variants(case, data):
    """Windows (band pieces on the CPU kernel), softcap (the reference there) and sinks."""
    _check_isolation(case, data, KERNELS, "cpu")


@pytest.mark.cuda
@settings(max_examples=scaled_examples(0.2, minimum=20))
@given(case=_cases((torch.bfloat16, torch.float16)), data=st.data())
def test_poison_one_segment_cuda(case, data):
    """The op on CUDA (FlashInfer forward, and whatever backward the op has there)."""
    _check_isolation(case, data, {"op (CUDA)": _op}, "cuda")


def _check_isolation(case, data, kernels, device):
    lq, lk = case.q_lengths, case.k_lengths
    # Which tensor, which segment, where, what.
    choices = [(t, i) for i in range(case.n) for t in ("q", "go") if lq[i]]
    choices += [(t, i) for i in range(case.n) for t in ("k", "v") if lk[i]]
    if not choices or case.n < 2:
        return
    # Token 0 of a tensor is where padding used to gather from: draw it often.
    firsts = [c for c in choices if c[1] == min(i for t, i in choices if t == c[0])]
    which, seg = data.draw(st.one_of(st.sampled_from(firsts), st.sampled_from(choices)), label="tensor, segment")
    poison = data.draw(st.sampled_from((float("nan"), float("inf"), float("-inf"))), label="value")
    q, k, v, cu_q, cu_k = case.tensors(device)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(case.seed + 1)).to(device, q.dtype)
    clean = dict(q=q, k=k, v=v, go=go)
    lens = lq if which in ("q", "go") else lk
    start = (cu_q if which in ("q", "go") else cu_k)[seg].item()
    row = start + data.draw(st.one_of(st.just(0), st.integers(0, lens[seg] - 1)), label="row")
    head = data.draw(st.integers(0, clean[which].shape[1] - 1), label="head")
    col = data.draw(st.integers(0, case.head_dim - 1), label="dim")
    dirty = {name: t.clone() for name, t in clean.items()}
    dirty[which][row, head, col] = poison

    # Rows of every other segment, on the q side and on the k/v side.
    others_q = torch.ones(q.shape[0], dtype=torch.bool, device=device)
    others_q[cu_q[seg] : cu_q[seg + 1]] = False
    others_k = torch.ones(k.shape[0], dtype=torch.bool, device=device)
    others_k[cu_k[seg] : cu_k[seg + 1]] = False
    scale = case.effective_scale
    variants = case.variants
    if case.sinks:
        variants["sinks"] = case.sink_logits(device, q.dtype)
    for name, kernel in kernels.items():
        a = kernel(clean["q"], clean["k"], clean["v"], clean["go"], cu_q, cu_k, case.causal, scale, **variants)
        b = kernel(dirty["q"], dirty["k"], dirty["v"], dirty["go"], cu_q, cu_k, case.causal, scale, **variants)
        for label, x, y, rows in zip(("out", "dq", "dk", "dv"), a, b, (others_q, others_q, others_k, others_k)):
            assert torch.equal(_bits(x[rows]), _bits(y[rows])), (
                f"{name}: {poison} in {which}[{row}, {head}, {col}] (segment {seg}) "
                f"changed {label} of another segment"
            )
            assert bool(torch.isfinite(x[rows]).all()), f"{name}: clean {label} not finite"
