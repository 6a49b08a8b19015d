"""The flash-attn-4 backward wrapper (backends/fa4_backward.py) on CPU, against a
float64 model of the kernel's contract that reproduces its one hazard: tiles
that read rows past a segment's end (so a NaN there reaches the segment's
gradients). The kernel itself runs in tests/test_train_cuda.py and the gradient
fuzz on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from ragged_compile import ops, reference
from ragged_compile.backends import select
from ragged_compile.backends import fa4_backward, segment_backward, tile_pad
from ragged_compile.reference import reference_attention, reference_attention_backward

TILES = (5, 7)  # odd tiles, so padded and unpadded layouts differ everywhere


def fa4_contract(q, k, v, out, dout, lse, *, softmax_scale, causal, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """FA4's varlen backward as it computes: a segment's q tiles read whole
    tiles of q/out/dout from its start (rows past ``seqused`` included, masked
    only through an LSE of +inf), its k tiles whole tiles of k/v (masked scores,
    but dq = dS @ K still multiplies those rows by zero)."""
    for t in (q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        assert t.is_contiguous()
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and lse.dtype == torch.float32
    assert lse.shape == (q.shape[1], q.shape[0]) and q.dtype == k.dtype == out.dtype == dout.dtype
    assert q.shape[-1] in (64, 96, 128, 256) or q.shape[-1] <= 16, "head dim FA4 computes wrongly"
    tm, tn = TILES
    f = torch.float64
    # Rows outside every segment are never written (FA4 allocates with empty_like).
    dq, dk, dv = (torch.full(t.shape, math.nan, dtype=f) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.numel() - 1):
        sq, sk = int(cu_seqlens_q[i]), int(cu_seqlens_k[i])
        lq, lk = int(seqused_q[i]), int(seqused_k[i])
        dq[sq : sq + lq] = 0
        dk[sk : sk + lk] = 0
        dv[sk : sk + lk] = 0
        if lq == 0 or lk == 0:
            continue
        rq, rk = -(-lq // tm) * tm, -(-lk // tn) * tn
        # past the tensor's last row a tile reads zeros (TMA's out-of-bounds fill)
        Q, O, dO = (_rows(t, sq, rq).to(f) for t in (q, out, dout))
        K, V = (_rows(t, sk, rk).to(f).repeat_interleave(group, 1) for t in (k, v))
        L = _rows(lse.t(), sq, rq).t().to(f).clone()
        L[:, lq:] = math.inf
        S = torch.einsum("qhd,khd->hqk", Q, K) * softmax_scale
        keep = torch.ones(rq, rk, dtype=torch.bool)
        keep[:, lk:] = False
        if causal:
            keep &= torch.arange(rk)[None, :] <= torch.arange(rq)[:, None] + (lk - lq)
        S = torch.where(keep, S, -math.inf)
        P = torch.exp(S - L[..., None])
        dP = torch.einsum("qhd,khd->hqk", dO, V)
        D = (dO * O).sum(-1).t()[..., None]
        dS = P * (dP - D) * softmax_scale
        gq = torch.einsum("hqk,khd->qhd", dS, K)
        gk = torch.einsum("hqk,qhd->khd", dS, Q)
        gv = torch.einsum("hqk,qhd->khd", P, dO)
        dq[sq : sq + lq] = gq[:lq]
        dk[sk : sk + lk] += gk[:lk].unflatten(1, (-1, group)).sum(2)
        dv[sk : sk + lk] += gv[:lk].unflatten(1, (-1, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _rows(t, start, n):
    got = t[start : start + n]
    return torch.cat([got, got.new_zeros((n - got.shape[0], *got.shape[1:]))]) if got.shape[0] < n else got


@pytest.fixture
def fa4(monkeypatch):
    monkeypatch.setattr(fa4_backward, "_kernel", fa4_contract)
    monkeypatch.setattr(fa4_backward, "_tiles", lambda d, causal: TILES)


def _case(lq, lk, hq=4, hkv=2, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    go = torch.randn(q.shape, generator=g, dtype=dtype)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    return q, k, v, go, cq, ck


def _grads(q, k, v, go, cq, ck, causal, scale):
    out = reference_attention(q, k, v, cq, ck, causal, scale)
    lse = reference.reference_lse(q, k, cq, ck, causal, scale)
    return fa4_backward.backward(go, q, k, v, out, lse, cq, ck, causal, scale)


LAYOUTS = [
    ([3, 0, 1, 5, 12], [2, 4, 0, 6, 11]),  # empty q and k segments, Lq > Lk and Lq < Lk
    ([4, 1, 7, 1], [4, 1, 7, 1]),  # self, one-token segments
    ([5, 10], [0, 0]),  # all-empty k
    ([10, 14], [10, 14]),  # multiples of both tiles
]


@pytest.mark.parametrize("lq,lk", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_gradients_match_the_exact_reference(fa4, lq, lk, causal, hq, hkv):
    q, k, v, go, cq, ck = _case(lq, lk, hq, hkv)
    got = _grads(q, k, v, go, cq, ck, causal, 0.3)
    want = reference_attention_backward(go, q, k, v, cq, ck, causal, 0.3)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")  # the LSE is fp32


def test_head_dims_fa4_gets_wrong_are_padded_with_the_true_scale(fa4):
    assert [fa4_backward.fa4_head_dim(d) for d in (32, 64, 72, 80, 96, 100, 128, 160, 256)] == [
        64, 64, 96, 96, 96, 128, 128, 256, 256,
    ]
    q, k, v, go, cq, ck = _case([6, 3], [4, 9], 2, 2, d=72)
    scale = 72**-0.5
    got = _grads(q, k, v, go, cq, ck, True, scale)
    want = reference_attention_backward(go, q, k, v, cq, ck, True, scale)
    for a, b in zip(got, want):
        assert a.shape[-1] == 72
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _poisoned(tensors, cq, ck, where, poison, seg):
    """(q, k, v, grad_out) with segment ``seg``'s rows of one of them set to ``poison``."""
    i = ("q", "k", "v", "grad_out").index(where)
    cu = cq if where in ("q", "grad_out") else ck
    t = tensors[i].clone()
    t[int(cu[seg]) : int(cu[seg + 1])] = poison
    return tensors[:i] + (t,) + tensors[i + 1 :]


@pytest.mark.parametrize("where", ["q", "k", "v", "grad_out"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_in_one_segment_stays_there(fa4, where, poison):
    lq, lk = [6, 4, 9, 3], [8, 3, 5, 6]
    q, k, v, go, cq, ck = _case(lq, lk)
    clean = _grads(q, k, v, go, cq, ck, False, 0.3)
    seg = 1
    got = _grads(*_poisoned((q, k, v, go), cq, ck, where, poison, seg), cq, ck, False, 0.3)
    for g, c, cu in zip(got, clean, (cq, ck, ck)):
        for i in range(len(lq)):
            if i == seg:
                continue
            rows = slice(int(cu[i]), int(cu[i + 1]))
            assert torch.equal(g[rows], c[rows]), f"segment {i} changed by a {poison} in segment {seg}'s {where}"


def test_the_contract_model_leaks_without_the_padding(fa4, monkeypatch):
    """The isolation test above can fail: unpadded, the model of the kernel leaks."""

    def unpadded(cu, total, tile):
        cu = cu.to(torch.int32)
        return tile_pad.Layout(cu, cu[1:] - cu[:-1], torch.arange(total), total + tile)

    monkeypatch.setattr(fa4_backward, "_padded_layout", unpadded)
    q, k, v, go, cq, ck = _case([6, 4], [8, 3])
    q = q.clone()
    q[6:] = math.nan
    dq, dk, dv = _grads(q, k, v, go, cq, ck, False, 0.3)
    assert not torch.isfinite(dk[:8]).all() or not torch.isfinite(dv[:8]).all()


def test_backward_kernel_choice(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa2")
    assert select.backward_kernel(cpu, torch.bfloat16, 128) == "fa2"
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    assert select.backward_kernel(cpu, torch.bfloat16, 128) == "fa2"
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa4")
    with pytest.raises(RuntimeError, match="RAGGED_COMPILE_BACKWARD=fa4, but flash-attn-4 is CUDA-only"):
        select.backward_kernel(cpu, torch.bfloat16, 128)
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)
    assert select.backward_kernel(cpu, torch.bfloat16, 128) == "fa4"
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="not bitwise deterministic"):
            select.backward_kernel(cpu, torch.bfloat16, 128)
        monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
        assert select.backward_kernel(cpu, torch.bfloat16, 128) == "fa2"
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa5")
    with pytest.raises(ValueError, match="must be one of"):
        select.backward_kernel(cpu, torch.bfloat16, 128)


def test_unsupported_reasons_name_the_limit(monkeypatch):
    monkeypatch.setattr(fa4_backward, "installed", lambda: True)
    cuda = torch.device("cuda", 0)
    assert "float16/bfloat16" in fa4_backward.unsupported_reason(cuda, torch.float32, 128)
    assert "head_dim <= 256" in fa4_backward.unsupported_reason(cuda, torch.bfloat16, 320)
    monkeypatch.setattr(fa4_backward, "installed", lambda: False)
    assert fa4_backward.unsupported_reason(cuda, torch.bfloat16, 128) == "flash-attn-4 is not installed"


def test_auto_takes_fa4_only_where_the_work_per_row_repays_isolation(monkeypatch):
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "fused")  # isolation by the padded layout
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)
    cuda = torch.device("cuda", 0)
    # 250 segments of ~130 tokens (a short flood) against 16 of ~2,100 (mixed), 16 heads of 128
    short = select.backward_work(16, 16, 33109, 33109, 250 * 167 * 132, False)
    mixed = select.backward_work(16, 16, 34043, 34043, 34043 * 2900, False)
    assert select.backward_kernel(cuda, torch.bfloat16, 128, short, slots=(250, 33109, 33109)) == "fa2"
    assert select.backward_kernel(cuda, torch.bfloat16, 128, mixed, slots=(16, 34043, 34043)) == "fa4"
    # causal halves the work; GQA weighs it up; smaller head dims need more of it
    assert select.backward_work(16, 16, 100, 100, 10_000, True) == 50.0
    assert select.backward_work(32, 8, 100, 100, 10_000, False) == 160.0
    assert select.fa4_backward_pays(128, 941) and not select.fa4_backward_pays(64, 941)
    assert not select.fa4_backward_pays(128, 471)  # ViT, causal: FA2 (see select._FA4_MIN_WORK)
    assert select.fa4_backward_pays(72, 1e4)  # computed at 96
    assert not select.fa4_backward_pays(320, 1e9)  # past the head dims it takes
    assert select.backward_work(16, 16, 0, 0, 0, False) == 0.0
    # a cross-attention over many more keys than queries copies its keys too: 16 segments
    # of 77 queries on 4096 keys is little work per copied row
    cross = select.backward_work(16, 16, 16 * 77, 16 * 4096, 16 * 77 * 4096, False)
    assert cross < 200 and not select.fa4_backward_pays(128, cross)
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa4")  # asked for: used anyway
    assert select.backward_kernel(cuda, torch.bfloat16, 128, short) == "fa4"
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    assert select.backward_kernel(cuda, torch.bfloat16, 128) == "fa4"  # no layout given: the faster kernel


def test_auto_keeps_fa2_where_the_isolation_layout_would_multiply_memory(monkeypatch):
    """The padded buffers are sized from the segment slots on the host: a compiled
    packed batch with a slot per token (4 documents of 8192, one slot each token)
    would pad to ~128x its rows, however much work each row has. Isolation by
    recompute pads nothing, so it takes FA4 there."""
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "fused")
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)
    cuda = torch.device("cuda", 0)
    work = select.backward_work(16, 16, 32768, 32768, 4 * 8192 * 8192, True)
    assert select.fa4_backward_pays(128, work)
    assert select.backward_kernel(cuda, torch.bfloat16, 128, work, slots=(4, 32768, 32768)) == "fa4"
    assert select.backward_kernel(cuda, torch.bfloat16, 128, work, slots=(32768, 32768, 32768)) == "fa2"
    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "redo")
    assert select.backward_kernel(cuda, torch.bfloat16, 128, work, slots=(32768, 32768, 32768)) == "fa4"
    # ... at the head dims it takes as they are; 80 is padded to 96, so it keeps the guard
    assert select.backward_kernel(cuda, torch.bfloat16, 80, work, slots=(32768, 32768, 32768)) == "fa2"
    assert fa4_backward.pads_little(16, 34043, 34043) and not fa4_backward.pads_little(300, 9000, 9000)
    assert not fa4_backward.pads_little(16, 34043, 77 * 16)  # short text k/v of a cross-attention


def test_a_failing_fa4_kernel_falls_back_to_fa2_once_with_a_warning(monkeypatch, caplog):
    """A pre-release can fail to compile or launch: auto mode warns once and
    trains on FA2 from then on; a forced fa4 raises."""
    monkeypatch.setattr(fa4_backward, "_disabled", None)
    monkeypatch.setattr(fa4_backward, "installed", lambda: True)
    real_reason = fa4_backward.unsupported_reason
    monkeypatch.setattr(
        fa4_backward, "unsupported_reason",
        lambda *a: fa4_backward._disabled,  # usable until disabled
    )
    calls = []

    def broken(*a, **kw):
        calls.append("fa4")
        raise RuntimeError("DSL compile error")

    monkeypatch.setattr(fa4_backward, "backward", broken)
    monkeypatch.setattr(select, "fa4_backward_pays", lambda *a: True)
    monkeypatch.setattr(fa4_backward, "pads_little", lambda *a: True)
    monkeypatch.setattr(ops.flash_backward, "backward", lambda *a: calls.append("fa2") or ("dq", "dk", "dv"))
    q, k, v, go, cq, ck = _case([6, 4], [6, 4], dtype=torch.bfloat16)
    args = (go, q, k, v, q, torch.zeros(4, 10), cq, ck, torch.tensor([6, 6, 52]), False, 0.3)
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    with caplog.at_level("WARNING", logger="ragged_compile"):
        for _ in range(2):
            *grads, dsinks = ops._ragged_attention_lse_backward_cuda(*args)
            assert grads == ["dq", "dk", "dv"] and dsinks.numel() == 0  # no sinks: an empty dsinks
    assert calls == ["fa4", "fa2", "fa2"]
    warned = [r.getMessage() for r in caplog.records if "DSL compile error" in r.getMessage()]
    assert len(warned) == 1 and "FlashAttention-2" in warned[0]
    monkeypatch.setattr(fa4_backward, "_disabled", None)
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa4")
    with pytest.raises(RuntimeError, match="DSL compile error"):
        ops._ragged_attention_lse_backward_cuda(*args)
    assert real_reason(torch.device("cpu"), torch.bfloat16, 128) == "flash-attn-4 is CUDA-only"


def test_only_verified_versions_are_used(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b99")
    reason = fa4_backward._interface.__wrapped__()
    assert isinstance(reason, str) and "4.0.0b99 is not a verified version (4.0.0b36)" in reason


def test_a_backward_pass_builds_each_padded_layout_once(fa4, monkeypatch):
    """Layers share their offsets: one layout per (offsets, tile) per backward pass,
    built again in the next pass and after an in-place edit of the offsets."""
    built = []
    real = tile_pad.layout
    monkeypatch.setattr(tile_pad, "layout", lambda cu, total, tile: built.append(tile) or real(cu, total, tile))
    q, k, v, go, cq, ck = _case([3, 0, 5], [2, 4, 6])
    out = reference_attention(q, k, v, cq, ck, False, 0.3)
    lse = reference.reference_lse(q, k, cq, ck, False, 0.3)
    want = fa4_backward.backward(go, q, k, v, out, lse, cq, ck, False, 0.3)
    assert len(built) == 2  # outside a backward pass: nothing kept
    seen = []

    class Layers(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            for _ in range(3):  # three layers on the same offsets
                seen.append(fa4_backward.backward(go, q, k, v, out, lse, cq, ck, False, 0.3))
            return g

    x = torch.ones(2, requires_grad=True)
    built.clear()
    Layers.apply(x).sum().backward()
    assert len(built) == 2 and all(torch.equal(a, b) for got in seen for a, b in zip(got, want))
    Layers.apply(x).sum().backward()  # a new pass
    assert len(built) == 4

    class Edited(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            fa4_backward.backward(go, q, k, v, out, lse, cq, ck, False, 0.3)
            cq.add_(0)  # an in-place edit: the q side's layout is built again, k's is not
            fa4_backward.backward(go, q, k, v, out, lse, cq, ck, False, 0.3)
            return g

    built.clear()
    Edited.apply(x).sum().backward()
    assert len(built) == 3


# -- isolation by recompute (RAGGED_COMPILE_FA4_PAD=redo) -----------------------------------


@pytest.fixture
def redo(fa4, monkeypatch):
    """Isolation by recompute, recording the segment flags each recompute was given
    (on the CPU it computes the flagged segments with the reference backward)."""
    flags = []
    real = segment_backward.recompute

    def spy(redo, *args, **kw):
        flags.append(redo.clone())
        return real(redo, *args, **kw)

    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "redo")
    monkeypatch.setattr(segment_backward, "recompute", spy)
    return flags


def _redo_grads(q, k, v, go, cq, ck, causal, scale):
    out = reference_attention(q, k, v, cq, ck, causal, scale)
    lse = reference.reference_lse(q, k, cq, ck, causal, scale).float()
    lens = (int((cq[1:] - cq[:-1]).max()), int((ck[1:] - ck[:-1]).max()))
    return fa4_backward.backward(go, q, k, v, out, lse, cq, ck, causal, scale, lens)


@pytest.mark.parametrize("lq,lk", LAYOUTS[:2] + LAYOUTS[3:])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_redo_gradients_match_the_exact_reference(redo, lq, lk, causal, hq, hkv):
    q, k, v, go, cq, ck = _case(lq, lk, hq, hkv, d=64)
    got = _redo_grads(q, k, v, go, cq, ck, causal, 0.3)
    want = reference_attention_backward(go, q, k, v, cq, ck, causal, 0.3)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")
    (flags,) = redo  # nothing to redo
    assert flags.shape == (len(lq),) and not flags.any()


@pytest.mark.parametrize("where", ["q", "k", "v", "grad_out"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seg", [0, 1, 3])
def test_redo_keeps_a_non_finite_segment_to_itself(redo, where, poison, causal, seg):
    lq, lk = [6, 4, 9, 3], [8, 3, 5, 6]
    q, k, v, go, cq, ck = _case(lq, lk, d=64)
    clean = _redo_grads(q, k, v, go, cq, ck, causal, 0.3)
    redo.clear()
    got = _redo_grads(*_poisoned((q, k, v, go), cq, ck, where, poison, seg), cq, ck, causal, 0.3)
    for g, c, cu in zip(got, clean, (cq, ck, ck)):
        for i in range(len(lq)):
            if i == seg:
                continue
            rows = slice(int(cu[i]), int(cu[i + 1]))
            assert torch.isfinite(g[rows]).all(), f"segment {i} reached by a {poison} in segment {seg}'s {where}"
            # a recomputed neighbour comes from the reference backward, rounded apart
            torch.testing.assert_close(g[rows], c[rows], rtol=1e-5, atol=1e-6)
    # the recompute took the segment the non-finite rows were in, and at most its neighbours
    (flags,) = redo
    redone = set(flags.nonzero().flatten().tolist())
    assert seg in redone and redone <= {seg - 1, seg, seg + 1}


@pytest.mark.parametrize("seg", range(5))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1)])
def test_redo_isolates_each_segment_of_a_cross_layout_with_empty_segments(redo, seg, hq, hkv):
    lq, lk = LAYOUTS[0]  # empty q and k segments, Lq > Lk and Lq < Lk
    q, k, v, go, cq, ck = _case(lq, lk, hq, hkv, d=64)
    want = reference_attention_backward(go, q, k, v, cq, ck, True, 0.3)
    got = _redo_grads(*_poisoned((q, k, v, go), cq, ck, "k", math.nan, seg), cq, ck, True, 0.3)
    for g, c, cu in zip(got, want, (cq, ck, ck)):
        for i in range(len(lq)):
            if i != seg:
                rows = slice(int(cu[i]), int(cu[i + 1]))
                torch.testing.assert_close(g[rows], c[rows], rtol=1e-5, atol=1e-6)


def test_without_redo_the_contract_model_leaks_on_the_natural_layout(fa4, monkeypatch):
    """The redo test above can fail: the natural layout alone leaks (the recompute off)."""
    monkeypatch.setattr(fa4_backward, "_non_finite_segments", lambda grads, seg, n: torch.zeros(n, dtype=torch.bool))
    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "redo")
    q, k, v, go, cq, ck = _case([6, 4], [8, 3], d=64)
    q = q.clone()
    q[6:] = math.nan
    dq, dk, dv = _redo_grads(q, k, v, go, cq, ck, False, 0.3)
    assert not torch.isfinite(dk[:8]).all() or not torch.isfinite(dv[:8]).all()


def test_redo_only_where_fa4_takes_the_head_dim_as_it_is(monkeypatch):
    monkeypatch.delenv("RAGGED_COMPILE_FA4_PAD", raising=False)  # the default
    assert fa4_backward.redo_isolation(128) and fa4_backward.redo_isolation(64)
    assert not fa4_backward.redo_isolation(80) and not fa4_backward.redo_isolation(72)
    monkeypatch.setenv("RAGGED_COMPILE_FA4_PAD", "fused")
    assert not fa4_backward.redo_isolation(128)
