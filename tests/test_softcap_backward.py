"""The Triton backward over every segment (backends/segment_backward.backward):
soft-capped scores, windows on either side, causal and cross layouts, against the
float64 reference backward, under Triton's interpreter on the CPU (in a child
process) and compiled on CUDA, with the layouts that break kernels: empty and
one-token segments, cross segments whose first rows see no key, windows wider
than a segment or zero wide, GQA, head dims that fill no power of two and the
widest, and a NaN that must stay in its own segment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _triton_interpreter import run_checks
from ragged_compile.backends import segment_backward
from ragged_compile.reference import dense_gradients, reference_attention, reference_lse

# (lens_q, lens_k, hq, hkv, d, causal, window, softcap)
CASES = [
    ([70, 1, 0, 33], None, 4, 2, 64, True, (-1, -1), 50.0),  # Gemma2's global layers
    ([70, 1, 0, 33], None, 4, 2, 72, True, (15, -1), 50.0),  # its sliding layers, shorter
    ([5, 40, 33, 0], [50, 3, 0, 7], 4, 1, 32, False, (-1, -1), 5.0),  # cross: rows that see no key
    ([5, 40, 33, 0], [50, 3, 0, 7], 4, 1, 32, True, (8, -1), 5.0),
    ([90, 17], None, 2, 2, 96, False, (100, 2), 2.0),  # wider than the segment on the left
    ([1, 1, 65, 40], None, 2, 1, 80, False, (0, 0), 1.0),  # a row sees itself only
    ([40, 3], [40, 3], 2, 1, 256, True, (-1, -1), 30.0),
    ([66, 20], None, 3, 3, 128, False, (9, 20), 0.0),  # a window alone
]


def _offsets(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


def _inputs(case, dtype, seed=0):
    lens_q, lens_k, hq, hkv, d, causal, window, softcap = case
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    # scores well past the cap, so the cap bends them
    q, go = (torch.randn(int(cu_q[-1]), hq, d, generator=g) * 2 for _ in range(2))
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, generator=g) * 2 for _ in range(2))
    return [t.to(dtype) for t in (q, k, v, go)], cu_q, cu_k, causal, d**-0.5, window, softcap


def _forward(q, k, cu_q, cu_k, v, causal, scale, window, softcap, dtype):
    kw = dict(window_size=window, softcap=softcap)
    out = reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, causal, scale, **kw).to(dtype)
    return out, reference_lse(q.double(), k.double(), cu_q, cu_k, causal, scale, **kw).float()


def _check(case, dtype, device, tol, nan_segment=None):
    (q, k, v, go), cu_q, cu_k, causal, scale, window, softcap = _inputs(case, dtype)
    out, lse = _forward(q, k, cu_q, cu_k, v, causal, scale, window, softcap, dtype)
    # the flash backward of this forward in float64, D from the rounded output as the
    # kernel takes it (with bf16 outputs D cancels against dP: any flash backward's error)
    want = dense_gradients(go, q, k, v, cu_q, cu_k, causal, scale, out=out, window_size=window, softcap=softcap)[1:]
    if nan_segment is not None:  # its q rows: its own gradients turn NaN, nobody else's
        q = q.clone()
        q[int(cu_q[nan_segment]) + min(1, int(cu_q[nan_segment + 1] - cu_q[nan_segment]) - 1)] = float("nan")
    dev = [t.to(device) for t in (go, q, k, v, out, lse, cu_q, cu_k)]
    got = segment_backward.backward(*dev, causal, scale, window, softcap)
    for name, a, b, cu in zip("qkv", got, want, (cu_q, cu_k, cu_k)):
        a = a.cpu()
        assert a.dtype == dtype and a.shape == b.shape
        for i in range(len(cu) - 1):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            if a[rows].numel() == 0:
                continue
            if i == nan_segment:
                continue
            assert bool(torch.isfinite(a[rows]).all()), f"d{name} of segment {i} is not finite ({case})"
            err = (a[rows].double() - b[rows]).abs().max().item()
            assert err <= tol * max(b[rows].abs().max().item(), 1.0), f"d{name} of segment {i}: {err:.3g} ({case}, {dtype})"


def test_bounds():
    assert segment_backward._bounds(True, (-1, -1)) == (segment_backward._FAR, 0)
    assert segment_backward._bounds(True, (7, 3)) == (7, 0)  # causal caps the right at 0
    assert segment_backward._bounds(False, (-1, 4)) == (segment_backward._FAR, 4)


def test_unsupported_reason():
    assert "CUDA-only" in segment_backward.unsupported_reason(torch.device("cpu"), torch.bfloat16, 64)
    if segment_backward.triton is not None:
        cuda = torch.device("cuda")
        assert "float16/bfloat16" in segment_backward.unsupported_reason(cuda, torch.float32, 64)
        assert "256" in segment_backward.unsupported_reason(cuda, torch.bfloat16, 320)
        assert segment_backward.unsupported_reason(cuda, torch.bfloat16, 256) is None


_CHILD = """
import torch
from test_softcap_backward import CASES, _check
for case in CASES:
    _check(case, torch.float32, "cpu", 1e-4)
    _check(case, torch.float32, "cpu", 1e-4, nan_segment=0)
_check(CASES[1], torch.float16, "cpu", 2e-2)
print("checked", len(CASES))
"""


def test_the_triton_backward_matches_the_reference_under_tritons_interpreter():
    run_checks(_CHILD, f"checked {len(CASES)}")


def _ids(case):
    return f"{case[2]}/{case[3]}-d{case[4]}-{'causal' if case[5] else 'full'}-w{case[6][0]}.{case[6][1]}-cap{case[7]:g}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_cuda_the_triton_backward_matches_the_reference(case, dtype):
    _check(case, dtype, "cuda", 3e-2)
    _check(case, dtype, "cuda", 3e-2, nan_segment=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d,hq,hkv", [(64, 8, 2), (128, 4, 2), (256, 4, 4)])
def test_cuda_the_triton_backward_repeats_bit_for_bit(d, hq, hkv):
    """Two runs of the backward on one input agree exactly: no atomics, and no
    pipelined stage that races (segments long enough for many blocks a program)."""
    case = ([1500, 1, 0, 700, 300], None, hq, hkv, d, True, (-1, -1), 50.0)
    (q, k, v, go), cu_q, cu_k, causal, scale, window, softcap = _inputs(case, torch.bfloat16)
    out, lse = _forward(q, k, cu_q, cu_k, v, causal, scale, window, softcap, torch.bfloat16)
    dev = [t.cuda() for t in (go, q, k, v, out, lse, cu_q, cu_k)]
    first = segment_backward.backward(*dev, causal, scale, window, softcap)
    for _ in range(3):
        again = segment_backward.backward(*dev, causal, scale, window, softcap)
        for name, a, b in zip("qkv", again, first):
            assert torch.equal(a, b), f"d{name} differs between runs: {(a.float() - b.float()).abs().max().item():.3g}"


# -- the op on CUDA: FlashInfer's capped forward, this backward -----------------------


def _op_case(lens_q, lens_k, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g) * 2
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g) * 2
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g)
    return [t.cuda().to(torch.bfloat16).requires_grad_() for t in (q, k, v)], cu_q.cuda(), cu_k.cuda()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d,hq,hkv", [(64, 8, 2), (72, 4, 4), (80, 6, 3), (96, 4, 1), (128, 8, 8), (256, 4, 2)])
@pytest.mark.parametrize("layout", ["mixed", "cross"])
def test_cuda_softcapped_training_runs_the_triton_backward(d, hq, hkv, layout):
    """ragged_attention(softcap=...) with gradients on CUDA: FlashInfer's capped forward
    and its LSE, then this backward (counted), against float64, causal and not, with a
    left window and without: empty and one-token segments, Lq > Lk and Lq < Lk, GQA,
    head dims 72/80/96/256."""
    from ragged_compile.backends import select
    from ragged_compile.runtime import get_runtime

    import ragged_compile as rc

    if select.forward_reason(torch.device("cuda"), torch.bfloat16, d, ("softcap",)) is not None:
        pytest.skip("FlashInfer does not run here")
    lq, lk = {"mixed": ([200, 0, 1, 37, 64], [200, 0, 1, 37, 64]), "cross": ([9, 40, 0, 3, 1], [30, 12, 5, 0, 1])}[layout]
    (q, k, v), cu_q, cu_k = _op_case(lq, lk, hq, hkv, d, seed=d)
    stats = get_runtime(q.device).stats
    for causal in (False, True):
        for window in ((-1, -1), (7, -1)) if causal else ((-1, -1),):
            before = stats["triton_backward"]
            out = rc.ragged_attention(q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=3.0)
            go = torch.randn_like(out)
            got = torch.autograd.grad(out, (q, k, v), go)
            assert stats["triton_backward"] == before + 1
            args = (*(t.detach().cpu() for t in (q, k, v)), cu_q.cpu(), cu_k.cpu(), causal, d**-0.5)
            want = dense_gradients(go.cpu(), *args, window_size=window, softcap=3.0)
            torch.testing.assert_close(out.double().cpu(), want[0], rtol=2e-2, atol=2e-2)
            for g, w in zip(got, want[1:]):
                torch.testing.assert_close(g.double().cpu(), w, rtol=5e-2, atol=5e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_softcapped_gradients_stay_in_their_segment(causal):
    """A NaN or Inf in one segment's q, k or v moves no other segment's gradients,
    bit for bit (the kernels use no atomics)."""
    from ragged_compile import testing

    import ragged_compile as rc

    go = torch.randn(116, 4, 64, device="cuda", dtype=torch.bfloat16)

    def grads(x, c):
        with torch.enable_grad():  # the check calls fn under no_grad
            x = x.detach().requires_grad_()
            out = rc.ragged_attention(x[:, :4], x[:, 4:6], x[:, 6:], c, causal=causal, softcap=5.0)
            return torch.autograd.grad(out, x, go)[0]

    x = torch.randn(70 + 5 + 40 + 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    testing.check_segment_independence(grads, x, _offsets([70, 5, 40, 1]).cuda())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_softcapped_training_compiles_fullgraph():
    """torch.compile(fullgraph=True) of a soft-capped training step equals eager."""
    import ragged_compile as rc

    (q, k, v), cu_q, _ = _op_case([50, 1, 0, 90], [50, 1, 0, 90], 4, 2, 64, seed=5)

    def step(q, k, v, cu):
        out = rc.ragged_attention(q, k, v, cu, causal=True, window_size=(15, -1), softcap=20.0)
        return out.float().square().sum()

    want = torch.autograd.grad(step(q, k, v, cu_q), (q, k, v))
    got = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v, cu_q), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
