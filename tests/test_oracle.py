"""The float64 oracle itself (reference.py's dense_*): its two gradient routes agree,
it handles GQA and layouts where nothing sees a key, and runs on any device."""

from __future__ import annotations

import pytest
import torch

from ragged_compile.reference import dense_attention, dense_gradients, dense_lse
from ragged_compile.testing import cu_seqlens

LAYOUTS = [
    ([3, 0, 1, 5, 7], [2, 4, 0, 6, 3]),  # empty q and k segments, Lq > Lk and Lq < Lk
    ([4, 1, 9], [4, 1, 9]),
    ([3, 2], [0, 0]),  # no row sees a key
    ([], []),
]


def _case(lq, lk, hq=8, hkv=2, d=16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    go = torch.randn(q.shape, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (go, q, k, v, cu_seqlens(lq), cu_seqlens(lk))]


@pytest.mark.parametrize("lq,lk", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_saved_forward_route_equals_autograd(lq, lk, causal):
    """Given the exact out and LSE, the flash-backward formulas are autograd's gradients."""
    go, q, k, v, cq, ck = _case(lq, lk)
    auto = dense_gradients(go, q, k, v, cq, ck, causal, 0.3)
    out = dense_attention(q, k, v, cq, ck, causal, 0.3)
    lse = dense_lse(q, k, cq, ck, causal, 0.3)
    for kw in (dict(out=out), dict(lse=lse), dict(out=out, lse=lse)):
        saved = dense_gradients(go, q, k, v, cq, ck, causal, 0.3, **kw)
        for name, a, b in zip(("out", "dq", "dk", "dv"), saved, auto):
            assert a.shape == b.shape and a.dtype == torch.float64, name
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name} with {list(kw)}")
    torch.testing.assert_close(auto[0], out, rtol=0, atol=0)
    if sum(lk) == 0:
        assert not any(t.any() for t in auto)


def test_the_given_output_enters_only_through_d():
    """A perturbed ``out`` changes dq and dk (through D = rowsum(dO * out)), never dv."""
    go, q, k, v, cq, ck = _case([4, 6], [5, 3])
    exact = dense_gradients(go, q, k, v, cq, ck, True, 0.3)
    rounded = exact[0].to(torch.bfloat16).double()
    got = dense_gradients(go, q, k, v, cq, ck, True, 0.3, out=rounded)
    torch.testing.assert_close(got[3], exact[3], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[1], exact[1], rtol=1e-9, atol=1e-9)


def test_device_and_dtype():
    go, q, k, v, cq, ck = _case([3, 5], [4, 2], hq=4, hkv=1)
    out = dense_attention(q.float(), k.float(), v.float(), cq, ck, False, 0.3, dtype=torch.float32, device="meta")
    assert out.device.type == "meta" and out.dtype == torch.float32
    grads = dense_gradients(go, q, k, v, cq, ck, False, 0.3, dtype=torch.float32)
    assert all(g.dtype == torch.float32 and g.device.type == "cpu" for g in grads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_equals_the_cpu():
    cpu = _case([3, 0, 7], [5, 2, 7])
    gpu = [t.cuda() for t in cpu]
    for kw in (dict(), dict(out=dense_attention(*cpu[1:], True, 0.3))):
        want = dense_gradients(*cpu, True, 0.3, **kw)
        got = dense_gradients(*gpu, True, 0.3, device="cuda", **{n: t.cuda() for n, t in kw.items()})
        for a, b in zip(got, want):
            assert a.device.type == "cuda"
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12)
