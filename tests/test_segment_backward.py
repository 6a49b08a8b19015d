"""The exact backward of flagged segments (backends/segment_backward.py): the
repair step of flash-attn-4's isolation by recompute. Its Triton kernels against
the reference backward, under Triton's interpreter on the CPU (in a child
process: the interpreter applies to Triton's own library functions only when
set before Triton is imported) and compiled on CUDA; the host path on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from ragged_compile.backends import segment_backward
from _triton_interpreter import run_checks
from ragged_compile.reference import reference_attention, reference_attention_backward, reference_lse

# (q lengths, k lengths, hq, hkv, head dim, causal): empty and one-token segments,
# Lq > Lk and Lq < Lk (bottom-right causal), GQA 8/1 and 2/1, head dims that fill
# no power of two (72, 96) and the widest (256), segments longer than one block
CASES = [
    ([5, 0, 1, 33], [0, 7, 1, 20], 8, 1, 72, True),
    ([5, 0, 1, 33], [0, 7, 1, 20], 8, 1, 72, False),
    ([70, 3], [9, 100], 4, 2, 64, True),
    ([17, 1, 0, 130], [17, 1, 0, 130], 2, 2, 96, False),
    ([40, 3], [40, 3], 2, 1, 256, True),
    ([20, 9], [31, 4], 2, 2, 128, True),
]


def _check(lq, lk, hq, hkv, d, causal, dtype, flags, device, tol):
    """Recompute the flagged segments of gradients preset to 7 and compare: flagged
    rows against the reference, every other row untouched. The inputs of unflagged
    segments are NaN, so a read past a flagged segment's rows shows."""
    g = torch.Generator().manual_seed(len(lq) * 31 + d)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    q, go = (torch.randn(sum(lq), hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lk), hkv, d, generator=g) for _ in range(2))
    q, k, v, go = (t.to(dtype) for t in (q, k, v, go))
    scale = d**-0.5
    out = reference_attention(q, k, v, cq, ck, causal, scale).to(dtype)
    lse = reference_lse(q, k, cq, ck, causal, scale).float()
    want = reference_attention_backward(go.double(), q.double(), k.double(), v.double(), cq, ck, causal, scale)
    q, k, v, go, out, lse = (t.clone() for t in (q, k, v, go, out, lse))
    for i, flagged in enumerate(flags):
        if not flagged:
            for t, cu in ((q, cq), (go, cq), (out, cq), (k, ck), (v, ck)):
                t[int(cu[i]) : int(cu[i + 1])] = float("nan")
            lse[:, int(cq[i]) : int(cq[i + 1])] = float("nan")
    dev = [t.to(device) for t in (q, k, v, go, out, lse, cq, ck)]
    grads = [torch.full_like(t, 7.0) for t in dev[:3]]
    flags = torch.tensor(flags, device=device)
    segment_backward.recompute(flags, dev[3], *dev[:3], dev[4], dev[5], dev[6], dev[7], causal, scale,
                               (max(lq), max(lk)), grads)
    for name, a, b, cu in zip("qkv", grads, want, (cq, ck, ck)):
        a = a.cpu()
        for i in range(len(lq)):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            if flags[i]:
                assert bool(torch.isfinite(a[rows]).all()), f"d{name} of segment {i} reached by a neighbour's NaN"
                err = (a[rows].double() - b[rows]).abs().max().item() if a[rows].numel() else 0.0
                scale_ = max(b[rows].abs().max().item(), 1.0) if b[rows].numel() else 1.0
                assert err <= tol * scale_, f"d{name} of segment {i}: {err:.3g} ({lq}, {lk}, {hq}/{hkv}, d={d}, {dtype})"
            else:
                assert bool((a[rows] == 7).all()), f"d{name} of unflagged segment {i} was written"


def test_the_host_path_recomputes_only_the_flagged_segments():
    for lq, lk, hq, hkv, d, causal in CASES[:3]:
        flags = [i % 2 == 0 for i in range(len(lq))]
        _check(lq, lk, hq, hkv, d, causal, torch.float64, flags, "cpu", 1e-9)


_CHILD = """
import torch
from test_segment_backward import CASES, _check
for lq, lk, hq, hkv, d, causal in CASES:
    for flags in ([True] * len(lq), [i % 2 == 1 for i in range(len(lq))]):
        _check(lq, lk, hq, hkv, d, causal, torch.float32, flags, "cpu", 1e-4)
    _check(lq, lk, hq, hkv, d, causal, torch.float16, [True] * len(lq), "cpu", 2e-2)
print("checked", len(CASES))
"""


def test_the_triton_kernels_match_the_reference_under_tritons_interpreter():
    run_checks(_CHILD, f"checked {len(CASES)}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}/{c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}")
def test_cuda_the_triton_kernels_match_the_reference(case, dtype):
    lq, lk, hq, hkv, d, causal = case
    _check(lq, lk, hq, hkv, d, causal, dtype, [True] * len(lq), "cuda", 3e-2)
    _check(lq, lk, hq, hkv, d, causal, dtype, [i % 2 == 1 for i in range(len(lq))], "cuda", 3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_nothing_flagged_writes_nothing_across_many_slots():
    """A compiled packed batch keeps a slot per token: thousands of programs that
    each read a flag and return."""
    lens = [1] * 3000 + [500]
    _check(lens, lens, 4, 4, 128, True, torch.bfloat16, [False] * len(lens), "cuda", 0.0)
