"""The op's CPU kernel (backends/cpu.py) against the reference kernel and float64.

Forward and gradients on every layout class the plan distinguishes: views of
back-to-back segments, one call per segment, gathered tiny segments (with and
without key masks), causal self (``is_causal``), causal cross (bottom-right
masks, chunked by rows), rows and keys that see nothing.
"""

from __future__ import annotations

import math
import resource

import pytest
import torch

import ragged_compile.backends.cpu as cpu
from ragged_compile import ragged_attention
from ragged_compile.reference import dense_gradients, reference_attention, reference_attention_backward
from ragged_compile.testing import cu_seqlens, no_key_rows

LAYOUTS = {
    "mixed": ([5, 0, 17, 1, 9, 3], None),
    "empty-and-one": ([0, 1, 0, 1, 2, 0], None),
    "uniform-views": ([12, 12, 12, 12], None),  # one call on views, the kernel's output returned
    "tiny-many": ([1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 1, 1, 4] * 3, None),  # gathered, padded, masked
    "long-and-tiny": ([70, 1, 2, 33, 2, 70], None),
    "equal-total-a": ([10, 10, 10], None),
    "equal-total-b": ([1, 28, 1], None),
    "cross": ([3, 0, 5, 1, 7, 2], [6, 2, 0, 4, 3, 9]),
    "cross-more-q": ([9, 4, 12, 2], [3, 4, 1, 11]),
    "cross-empty-k": ([4, 3, 5], [0, 0, 0]),
    "cross-empty-q": ([0, 0, 2], [5, 3, 2]),
    "cross-decode": ([1, 2, 1, 1], [40, 17, 1, 9]),
}
HEADS = [(4, 4), (8, 2)]


def _inputs(q_lens, kv_lens, hq, hkv, d, dtype, seed=0):
    kv_lens = q_lens if kv_lens is None else kv_lens
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype)
    return q, k, v, cu_seqlens(q_lens), cu_seqlens(kv_lens)


def _close(got, want, rtol, atol, what):
    err = (got.double() - want).abs()
    bound = atol + rtol * want.abs()
    assert bool((err <= bound).all()), f"{what}: max err {err.max().item():.3g}"


TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 2e-3), torch.float16: (2**-10, 5e-4)}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
def test_matches_float64_and_reference(name, causal, heads):
    q_lens, kv_lens = LAYOUTS[name]
    q, k, v, cq, ck = _inputs(q_lens, kv_lens, *heads, 32, torch.float32)
    scale = 0.3
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    want, *want_grads = dense_gradients(go, q, k, v, cq, ck, causal, scale)

    out = cpu.cpu_attention(q, k, v, cq, ck, causal, scale)
    _close(out, want, 1e-5, 1e-5, "out vs float64")
    torch.testing.assert_close(out, reference_attention(q, k, v, cq, ck, causal, scale), rtol=1e-5, atol=1e-5)
    blind = no_key_rows(q_lens, kv_lens or q_lens, causal)
    assert bool((out[blind] == 0).all()), "rows that see no key must be exactly zero"

    grads = cpu.cpu_attention_backward(go, q, k, v, cq, ck, causal, scale)
    ref_grads = reference_attention_backward(go, q, k, v, cq, ck, causal, scale)
    for name_, g, w, r in zip("qkv", grads, want_grads, ref_grads):
        _close(g, w, 1e-4, 1e-5, f"d{name_} vs float64")
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert bool((grads[0][blind] == 0).all())

    # The saved-forward route gives the same gradients as recomputing.
    o2, lse = cpu.cpu_attention(q, k, v, cq, ck, causal, scale, return_lse=True)
    assert torch.equal(o2, out)
    assert bool(torch.isinf(lse[blind]).all()) and bool(torch.isfinite(lse[~blind]).all())
    saved = cpu.cpu_attention_backward(go, q, k, v, cq, ck, causal, scale, out=o2, lse=lse)
    for g, s in zip(grads, saved):
        torch.testing.assert_close(s, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [72, 80, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_and_odd_head_dims(dtype, d, causal):
    q_lens, kv_lens = [7, 0, 30, 1, 3, 3], [9, 2, 30, 0, 3, 1]
    q, k, v, cq, ck = _inputs(q_lens, kv_lens, 4, 1, d, dtype)  # MQA
    scale = d**-0.5
    go = torch.randn(q.shape).to(dtype)
    want, *want_grads = dense_gradients(go, q, k, v, cq, ck, causal, scale)
    out = ragged_attention(q, k, v, cq, ck, causal=causal)
    assert out.dtype == dtype
    rtol, atol = TOL[dtype]
    _close(out, want, rtol, atol, "out")  # float32 inside: one rounding at the end
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    ragged_attention(*leaves, cq, ck, causal=causal).backward(go)
    for x, w in zip(leaves, want_grads):
        assert x.grad.dtype == dtype
        _close(x.grad, w, 4 * rtol, 4 * atol * (1 + w.abs().max().item()), "grad")


def test_fused_qkv_and_expanded_grad():
    """Non-contiguous q/k/v (slices of one projection) and a broadcast grad_out."""
    lens = [6, 1, 13, 2]
    cu = cu_seqlens(lens)
    qkv = torch.randn(sum(lens), 8 + 2 * 2, 16)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    out = ragged_attention(q, k, v, cu, causal=True)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu, cu, True, 0.25), rtol=1e-5, atol=1e-6)
    go = torch.ones(16).expand(q.shape)  # strides (0, 0, 1)
    grads = cpu.cpu_attention_backward(go, q, k, v, cu, cu, True, 0.25)
    for g, r in zip(grads, reference_attention_backward(go, q, k, v, cu, cu, True, 0.25)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_causal_mask_chunked_by_rows(monkeypatch):
    """Causal pieces with fewer queries than keys hold a mask of at most _BUDGET elements."""
    monkeypatch.setattr(cpu, "_BUDGET", 64)
    q_lens, kv_lens = [20, 3, 40], [50, 9, 41]
    q, k, v, cq, ck = _inputs(q_lens, kv_lens, 4, 2, 16, torch.float32)
    p = cpu.plan(cq, ck, True, 4, 2, 16)
    masks = [c.mask for c in p.calls if c.mask is not None]
    assert masks and max(m.numel() for m in masks) <= 64 and p.shared_keys
    go = torch.randn(q.shape)
    want, *want_grads = dense_gradients(go, q, k, v, cq, ck, True, 0.25)
    _close(cpu.cpu_attention(q, k, v, cq, ck, True, 0.25), want, 1e-5, 1e-5, "out")
    for g, w in zip(cpu.cpu_attention_backward(go, q, k, v, cq, ck, True, 0.25), want_grads):
        _close(g, w, 1e-4, 1e-5, "grad")


def test_plan_shapes():
    """Long segments run as views, one call each or one per back-to-back run; tiny ones gathered."""
    cu = cu_seqlens([64, 64, 64, 1, 1, 2, 3, 100])
    calls = cpu.plan(cu, cu, False, 8, 8, 64).calls
    by_shape = {(c.Pq, c.B): c for c in calls}
    assert by_shape[(64, 3)].q.start == 0  # three back-to-back 64s: one view call
    assert by_shape[(100, 1)].q.start == 199
    tiny = [c for c in calls if c.Pq <= 3]
    assert len(tiny) == 1 and tiny[0].B == 4 and tiny[0].mask is not None and tiny[0].q.start is None


def test_opcheck_with_cpu_kernels():
    q, k, v, cq, ck = _inputs([3, 0, 4, 1, 1], [2, 5, 1, 0, 3], 4, 2, 16, torch.float32)
    for causal in (False, True):
        torch.library.opcheck(torch.ops.ragged_compile.ragged_attention.default, (q, k, v, cq, ck, causal, 0.3))
        qg = q.detach().requires_grad_()
        torch.library.opcheck(
            torch.ops.ragged_compile.ragged_attention.default, (qg, k.requires_grad_(), v, cq, ck, causal, 0.3)
        )
        torch.library.opcheck(
            torch.ops.ragged_compile.ragged_attention_backward.default,
            (torch.randn(q.shape), q, k.detach(), v, cq, ck, causal, 0.3),
        )


def test_reference_reachable(monkeypatch):
    """RAGGED_COMPILE_REFERENCE=1 makes the op run the exact reference kernel."""
    q, k, v, cq, ck = _inputs([5, 9, 2], None, 4, 4, 16, torch.float32)
    monkeypatch.setenv("RAGGED_COMPILE_REFERENCE", "1")
    calls = []
    monkeypatch.setattr(cpu, "_flash", lambda *a, **kw: calls.append(1))
    out = ragged_attention(q, k, v, cq)
    assert not calls and torch.equal(out, reference_attention(q, k, v, cq, cq, False, 0.25))


def test_isolation_reproducer_from_issue():
    """cu = [0, 3, 8, 14], NaN in q[0], loss on out[3:]: no NaN in other segments' gradients."""
    for run in (cpu.cpu_attention_backward, reference_attention_backward):
        cu = torch.tensor([0, 3, 8, 14])
        q, k, v = (torch.randn(14, 2, 8) for _ in range(3))
        go = torch.randn(14, 2, 8)
        go[:3] = 0
        clean = run(go, q, k, v, cu, cu, False, 0.3)
        for which in range(3):
            x = [q.clone(), k.clone(), v.clone()]
            x[which][0] = float("nan")
            dirty = run(go, *x, cu, cu, False, 0.3)
            for c, d in zip(clean, dirty):
                assert torch.equal(c[3:], d[3:]), (run.__name__, "qkv"[which])


def test_memory_bounded_by_a_chunk():
    """Peak memory of a long causal segment grows linearly, not as Lq x Lk."""
    lens = [6000]
    q, k, v, cq, ck = _inputs(lens, None, 1, 1, 16, torch.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cpu.cpu_attention_backward(torch.randn(q.shape), q, k, v, cq, ck, True, 0.25)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    # 6000 x 6000 float32 scores would be 137 MiB; inputs and gradients are < 3 MiB.
    assert grown_kib < 48 * 1024, f"peak RSS grew {grown_kib / 1024:.0f} MiB"
    assert math.isfinite(grown_kib)
