"""Backward of the op: exact gradients from the reference kernel."""

from __future__ import annotations

import pytest
import torch

import ragged_compile as rc
from ragged_compile.reference import dense_gradients


def _inputs(lq, lk, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype, requires_grad=True)
    cq = torch.tensor([0] + lq).cumsum(0)
    ck = torch.tensor([0] + lk).cumsum(0)
    return q, k, v, cq, ck


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    q, k, v, cq, ck = _inputs([3, 0, 1, 5], [2, 4, 0, 6])
    fn = lambda q, k, v: rc.ragged_attention(q, k, v, cq, ck, causal=causal)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_dense_autograd(causal):
    q, k, v, cq, ck = _inputs([4, 1, 7], [4, 3, 7], dtype=torch.float32)
    w = torch.randn(q.shape)
    (rc.ragged_attention(q, k, v, cq, ck, causal=causal) * w).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    _, *want = dense_gradients(w, q, k, v, cq, ck, causal, 8**-0.5, dtype=torch.float32)
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_backward_under_compile():
    q, k, v, cq, ck = _inputs([5, 2, 9], [5, 2, 9], dtype=torch.float32)
    fn = torch.compile(lambda q, k, v: rc.ragged_attention(q, k, v, cq, ck, causal=True).square().sum(), fullgraph=True)
    fn(q, k, v).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    rc.ragged_attention(q, k, v, cq, ck, causal=True).square().sum().backward()
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)


def test_opcheck_backward_op():
    q, k, v, cq, ck = _inputs([3, 0, 4], [2, 5, 1], dtype=torch.float32)
    torch.library.opcheck(torch.ops.ragged_compile.ragged_attention.default, (q, k, v, cq, ck, True, 0.3))
    g = torch.randn(q.shape)
    torch.library.opcheck(
        torch.ops.ragged_compile.ragged_attention_backward.default,
        (g, q.detach(), k.detach(), v.detach(), cq, ck, True, 0.3),
    )
