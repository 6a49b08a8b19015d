"""flash-attn-4's training forward (backends/fa4_forward.py) and its isolation by
recompute (backends/segment_forward.py) on CPU, against a float64 model of the
kernel's contract that reproduces its one hazard: key tiles that read rows past
a segment's end (masked scores, so exact-zero probabilities, but P @ V still
multiplies those v rows: a NaN there reaches the segment's output). The kernel
itself runs in tests/test_train_cuda.py and the gradient fuzz on the GPU.
"""

from __future__ import annotations

import math
import pytest
import torch

from ragged_compile.backends import fa4_backward, fa4_forward, segment_forward, select
from _triton_interpreter import run_checks
from ragged_compile.reference import reference_attention, reference_lse

TILE_N = 5  # an odd key tile, so tiles end inside segments nearly everywhere


def fa4_fwd_contract(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     return_lse):
    """FA4's varlen forward as it computes: a segment's key tiles are whole tiles of
    k/v from its start (rows past its end included, zeros past the tensor's end),
    their scores masked to -inf, so P is exactly 0 there and P @ V multiplies those
    rows by zero. Rows that see no key: output 0 (times the key tile before the
    segment's first key, which such a query tile still runs), LSE -inf."""
    for t in (q, k, v, cu_seqlens_q, cu_seqlens_k):
        assert t.is_contiguous()
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and return_lse
    lens_q, lens_k = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]), (cu_seqlens_k[1:] - cu_seqlens_k[:-1])
    assert max_seqlen_q == int(lens_q.max()) and max_seqlen_k == int(lens_k.max())
    f = torch.float64
    group = q.shape[1] // k.shape[1]
    out = torch.full(q.shape, math.nan, dtype=f)  # rows outside every segment stay unwritten
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)
    for i in range(cu_seqlens_q.numel() - 1):
        sq, sk, lq, lk = int(cu_seqlens_q[i]), int(cu_seqlens_k[i]), int(lens_q[i]), int(lens_k[i])
        if lq == 0:
            continue
        rk = max(-(-lk // TILE_N) * TILE_N, TILE_N)
        Q = q[sq : sq + lq].to(f)
        K, V = (_rows(t, sk, rk).to(f).repeat_interleave(group, 1) for t in (k, v))
        S = torch.einsum("qhd,khd->hqk", Q, K) * softmax_scale
        keep = torch.zeros(lq, rk, dtype=torch.bool)
        keep[:, :lk] = True
        if causal:
            keep &= torch.arange(rk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        S = torch.where(keep, S, -math.inf)
        m = S.amax(-1, keepdim=True)
        seen = m > -math.inf
        P = torch.exp(S - torch.where(seen, m, 0.0))
        l = P.sum(-1, keepdim=True)
        o = torch.einsum("hqk,khd->qhd", P / torch.where(seen, l, 1.0), V)
        # a query tile with no key runs the tile before the segment's keys: 0 * those rows
        before = _rows(v, max(sk - TILE_N, 0), min(sk, TILE_N)).to(f).repeat_interleave(group, 1)
        nothing = torch.einsum("k,khd->hd", torch.zeros(before.shape[0], dtype=f), before)
        out[sq : sq + lq] = torch.where(seen.permute(1, 0, 2), o, nothing[None])
        lse[:, sq : sq + lq] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), -math.inf)[..., 0].float()
    return out.to(q.dtype), lse, None, None, None


def _rows(t, start, n):
    got = t[start : start + n]
    return torch.cat([got, got.new_zeros((n - got.shape[0], *got.shape[1:]))]) if got.shape[0] < n else got


@pytest.fixture
def fa4(monkeypatch):
    """The contract model in place of the kernel; the segments each recompute was given."""
    flags = []
    real = segment_forward.recompute

    def spy(redo, *args, **kw):
        flags.append(redo.clone())
        return real(redo, *args, **kw)

    monkeypatch.setattr(fa4_forward, "_kernel", fa4_fwd_contract)
    monkeypatch.setattr(segment_forward, "recompute", spy)
    return flags


def _case(lq, lk, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    return q, k, v, cq, ck


def _forward(q, k, v, cq, ck, causal, scale=0.3, keyless_rows=True):
    lens = (int((cq[1:] - cq[:-1]).max()), int((ck[1:] - ck[:-1]).max()))
    return fa4_forward.forward(q, k, v, cq, ck, causal, scale, lens, keyless_rows)


LAYOUTS = [
    ([3, 0, 1, 5, 12], [2, 4, 0, 6, 11]),  # empty q and k segments, Lq > Lk and Lq < Lk
    ([4, 1, 7, 1], [4, 1, 7, 1]),  # self, one-token segments
    ([10, 15], [10, 15]),  # multiples of the tile
]


@pytest.mark.parametrize("lq,lk", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_output_and_lse_match_the_reference(fa4, lq, lk, causal, hq, hkv):
    q, k, v, cq, ck = _case(lq, lk, hq, hkv)
    out, lse = _forward(q, k, v, cq, ck, causal)
    torch.testing.assert_close(out, reference_attention(q, k, v, cq, ck, causal, 0.3), rtol=1e-6, atol=1e-7)
    want = reference_lse(q, k, cq, ck, causal, 0.3).float()
    # rows that see no key: +inf, the backward's convention (the kernel gives -inf)
    assert torch.equal(torch.isinf(lse), torch.isinf(want)) and bool((lse[torch.isinf(lse)] > 0).all())
    torch.testing.assert_close(lse[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-5, atol=1e-5)
    (flags,) = fa4  # finite data: only segments with rows that see no key are redone
    keyless = [a > 0 and (b == 0 or (causal and a > b)) for a, b in zip(lq, lk)]
    assert flags.tolist() == keyless


def _poisoned(q, k, v, cq, ck, where, poison, seg):
    i = "qkv".index(where)
    cu = cq if where == "q" else ck
    t = (q, k, v)[i].clone()
    t[int(cu[seg]) : int(cu[seg + 1])] = poison
    return tuple(t if j == i else x for j, x in enumerate((q, k, v)))


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seg", [0, 1, 3])
def test_a_non_finite_segment_keeps_to_itself(fa4, where, poison, causal, seg):
    lq, lk = [6, 4, 9, 3], [8, 3, 5, 6]
    q, k, v, cq, ck = _case(lq, lk)
    want = reference_attention(q, k, v, cq, ck, causal, 0.3)
    want_lse = reference_lse(q, k, cq, ck, causal, 0.3).float()
    fa4.clear()
    out, lse = _forward(*_poisoned(q, k, v, cq, ck, where, poison, seg), cq, ck, causal)
    for i in range(len(lq)):
        if i == seg:
            continue
        rows = slice(int(cq[i]), int(cq[i + 1]))
        assert torch.isfinite(out[rows]).all(), f"segment {i} reached by a {poison} in segment {seg}'s {where}"
        torch.testing.assert_close(out[rows], want[rows], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lse[:, rows], want_lse[:, rows], rtol=1e-5, atol=1e-5)
    (flags,) = fa4
    redone = set(flags.nonzero().flatten().tolist())
    # at most the poisoned segment, the one whose tile reads it, and those with keyless rows
    keyless = {i for i, (a, b) in enumerate(zip(lq, lk)) if a > 0 and (b == 0 or (causal and a > b))}
    assert redone <= {seg - 1, seg} | keyless


@pytest.mark.parametrize("seg", range(5))
@pytest.mark.parametrize("causal", [False, True])
def test_each_segment_of_a_cross_layout_with_empty_segments_is_isolated(fa4, seg, causal):
    lq, lk = LAYOUTS[0]
    q, k, v, cq, ck = _case(lq, lk, 8, 1)
    want = reference_attention(q, k, v, cq, ck, causal, 0.3)
    out, _ = _forward(*_poisoned(q, k, v, cq, ck, "v", math.nan, seg), cq, ck, causal)
    for i in range(len(lq)):
        if i != seg:
            rows = slice(int(cq[i]), int(cq[i + 1]))
            torch.testing.assert_close(out[rows], want[rows], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lq,lk,causal", [
    ([10, 12], [8, 3], True),  # segment 1's first 9 rows see no key
    ([4, 5], [6, 0], False),  # segment 1 has no key at all
    ([4, 5], [6, 0], True),
])
def test_rows_that_see_no_key_do_not_read_the_segment_before(fa4, lq, lk, causal):
    q, k, v, cq, ck = _case(lq, lk)
    want = reference_attention(q, k, v, cq, ck, causal, 0.3)
    fa4.clear()
    out, lse = _forward(*_poisoned(q, k, v, cq, ck, "v", math.nan, 0), cq, ck, causal)
    torch.testing.assert_close(out[lq[0]:], want[lq[0]:], rtol=1e-6, atol=1e-7)
    want_lse = reference_lse(q, k, cq, ck, causal, 0.3).float()[:, lq[0]:]
    assert torch.equal(lse[:, lq[0]:].isinf(), want_lse.isinf())
    (flags,) = fa4
    assert bool(flags[1])


def _nan_stays_nan(device, dtype, tol):
    """The recompute decides which rows see a key from the layout, not from the sum of
    their probabilities: a NaN key makes exactly the rows that see it NaN, as the
    reference does (no row turns into a keyless zero)."""
    q, k, v, cq, ck = (t.to(device) for t in _case([7, 5], [7, 5], d=16))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k[2] = math.nan
    want = reference_attention(q.double(), k.double(), v.double(), cq, ck, True, 0.3)
    out = torch.full_like(q, 7.0)
    lse = torch.full((q.shape[1], q.shape[0]), -7.0, dtype=torch.float32, device=device)
    segment_forward.recompute(torch.tensor([True, True], device=device), q, k, v, cq, ck, True, 0.3, (7, 5), out, lse)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and bool(torch.isnan(out[2:7]).all())
    fin = torch.isfinite(want)
    assert (out[fin].double() - want[fin]).abs().max().item() <= tol


def test_a_nan_in_a_recomputed_segment_stays_nan():
    _nan_stays_nan("cpu", torch.float64, 1e-9)


def test_without_the_recompute_the_contract_model_leaks(fa4, monkeypatch):
    """The isolation tests above can fail: with nothing flagged, the model leaks."""
    monkeypatch.setattr(fa4_forward, "_contaminated", lambda out, cu: torch.zeros(cu.numel() - 1, dtype=torch.bool))
    q, k, v, cq, ck = _case([6, 4], [8, 3])
    v = v.clone()
    v[8:] = math.nan
    out, _ = _forward(q, k, v, cq, ck, False)
    assert not torch.isfinite(out[:6]).all()


def test_without_flagging_keyless_rows_the_contract_model_leaks(fa4, monkeypatch):
    monkeypatch.setattr(fa4_forward, "_reads_before", lambda cq, ck, causal: torch.zeros(cq.numel() - 1, dtype=torch.bool))
    q, k, v, cq, ck = _case([10, 12], [8, 3])
    v = v.clone()
    v[:8] = math.nan
    out, _ = _forward(q, k, v, cq, ck, True)
    assert not torch.isfinite(out[10:19]).all() and torch.isfinite(out[19:]).all()


# -- the recompute kernel ----------------------------------------------------------------

# (q lengths, k lengths, hq, hkv, head dim, causal): empty and one-token segments, Lq > Lk
# and Lq < Lk (bottom-right causal, keyless rows), GQA, head dims that fill no power of two
# and the widest, segments longer than one block
CASES = [
    ([5, 0, 1, 33], [0, 7, 1, 20], 8, 1, 72, True),
    ([5, 0, 1, 33], [0, 7, 1, 20], 8, 1, 72, False),
    ([70, 3], [9, 100], 4, 2, 64, True),
    ([17, 1, 0, 130], [17, 1, 0, 130], 2, 2, 96, False),
    ([40, 3], [40, 3], 2, 1, 256, True),
    ([20, 9], [31, 4], 2, 2, 128, True),
]


def _check(lq, lk, hq, hkv, d, causal, dtype, flags, device, tol):
    """Recompute the flagged segments of an output preset to 7 and an LSE preset to
    -7, and compare: flagged rows against the reference, every other row untouched.
    The inputs of unflagged segments are NaN, so a read past a flagged segment shows."""
    g = torch.Generator().manual_seed(len(lq) * 31 + d)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    q = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(sum(lk), hkv, d, generator=g).to(dtype) for _ in range(2))
    scale = d**-0.5
    want = reference_attention(q.double(), k.double(), v.double(), cq, ck, causal, scale)
    want_lse = reference_lse(q.double(), k.double(), cq, ck, causal, scale)
    q, k, v = (t.clone() for t in (q, k, v))
    for i, flagged in enumerate(flags):
        if not flagged:
            for t, cu in ((q, cq), (k, ck), (v, ck)):
                t[int(cu[i]) : int(cu[i + 1])] = float("nan")
    q, k, v, cq_d, ck_d = (t.to(device) for t in (q, k, v, cq, ck))
    out = torch.full(q.shape, 7.0, dtype=dtype, device=device)
    lse = torch.full((hq, q.shape[0]), -7.0, dtype=torch.float32, device=device)
    segment_forward.recompute(torch.tensor(flags, device=device), q, k, v, cq_d, ck_d, causal, scale,
                              (max(lq), max(lk)), out, lse)
    out, lse = out.cpu(), lse.cpu()
    for i in range(len(lq)):
        rows = slice(int(cq[i]), int(cq[i + 1]))
        if flags[i]:
            assert bool(torch.isfinite(out[rows]).all()), f"segment {i}'s output reached by a neighbour's NaN"
            err = (out[rows].double() - want[rows]).abs().max().item() if out[rows].numel() else 0.0
            assert err <= tol, f"out of segment {i}: {err:.3g} ({lq}, {lk}, {hq}/{hkv}, d={d}, {dtype})"
            w = want_lse[:, rows]
            assert torch.equal(torch.isinf(lse[:, rows]), torch.isinf(w)), f"keyless rows of segment {i}"
            fin = torch.isfinite(w)
            if fin.any():
                assert (lse[:, rows][fin].double() - w[fin].double()).abs().max().item() <= tol
        else:
            assert bool((out[rows] == 7).all()) and bool((lse[:, rows] == -7).all()), f"unflagged segment {i} written"


def test_the_host_path_recomputes_only_the_flagged_segments():
    for lq, lk, hq, hkv, d, causal in CASES[:3]:
        _check(lq, lk, hq, hkv, d, causal, torch.float64, [i % 2 == 0 for i in range(len(lq))], "cpu", 1e-9)


_CHILD = """
import torch
from test_fa4_forward import CASES, _check, _nan_stays_nan
for lq, lk, hq, hkv, d, causal in CASES:
    for flags in ([True] * len(lq), [i % 2 == 1 for i in range(len(lq))]):
        _check(lq, lk, hq, hkv, d, causal, torch.float16, flags, "cpu", 2e-2)
_nan_stays_nan("cpu", torch.float16, 2e-2)
print("checked", len(CASES))
"""


def test_the_triton_kernel_matches_the_reference_under_tritons_interpreter():
    run_checks(_CHILD, f"checked {len(CASES)}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}/{c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}")
def test_cuda_the_triton_kernel_matches_the_reference(case, dtype):
    lq, lk, hq, hkv, d, causal = case
    _check(lq, lk, hq, hkv, d, causal, dtype, [True] * len(lq), "cuda", 3e-2)
    _check(lq, lk, hq, hkv, d, causal, dtype, [i % 2 == 1 for i in range(len(lq))], "cuda", 3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_nan_in_a_recomputed_segment_stays_nan():
    _nan_stays_nan("cuda", torch.bfloat16, 3e-2)


# -- the choice --------------------------------------------------------------------------


def test_the_training_forward_choice(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    tokens = 34043

    def choice(requested, device, work, hq=16, hkv=16, causal=False):
        # ``work`` key pairs per query row (halved when causal)
        pairs = int(work * tokens * (2 if causal else 1))
        return select.training_forward(requested, device, torch.bfloat16, 128, hq, hkv, pairs, causal,
                                       (16, tokens, tokens))

    monkeypatch.setattr(fa4_forward, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(fa4_backward, "unsupported_reason", lambda *a: None)
    monkeypatch.delenv("RAGGED_COMPILE_BACKWARD", raising=False)
    # forced: wherever it runs, whatever the work
    assert choice("fa4", cuda, 0.0) == "fa4"
    assert choice("fa4", cpu, 1e6) is None
    for other in ("fa2", "fa3", "varlen"):
        assert choice(other, cuda, 1e6) is None
    # auto: only where the forward pays and the backward is FA4's too
    monkeypatch.setattr(select, "fa4_forward_pays", lambda d, work: work >= 1000)
    assert choice("auto", cuda, 2000.0) == "fa4"
    assert choice("auto", cuda, 2000.0, causal=True) == "fa4"
    assert choice("auto", cuda, 1500.0, causal=True) == "fa4"  # 3,000 pairs a row, halved
    assert choice("auto", cuda, 500.0) is None
    # GQA leaves the forward's work per row as it is
    assert choice("auto", cuda, 500.0, hq=32, hkv=4) is None
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa2")
    assert choice("auto", cuda, 2000.0) is None
    monkeypatch.setattr(fa4_forward, "unsupported_reason", lambda *a: "not here")
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "auto")
    assert choice("fa4", cuda, 0.0) is None
    assert choice("auto", cuda, 2000.0) is None


def test_unsupported_reasons_name_the_limit(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert "head dims 64, 96, 128, 256" in fa4_forward.unsupported_reason(cuda, torch.bfloat16, 80)
    monkeypatch.setattr(fa4_backward, "installed", lambda: False)
    assert "not installed" in fa4_forward.unsupported_reason(cuda, torch.bfloat16, 128)


# -- the kernel on the H200 ----------------------------------------------------------------


def _cuda_fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda", torch.cuda.current_device())
    reason = fa4_forward.unsupported_reason(dev, torch.bfloat16, 128)
    if reason is not None:
        pytest.skip(reason)
    return dev


def _cuda_case(lq, lk, hq, hkv, d, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, device=dev).to(dtype)
    k, v = (torch.randn(sum(lk), hkv, d, generator=g, device=dev).to(dtype) for _ in range(2))
    cq = torch.tensor([0] + lq, device=dev).cumsum(0).int()
    ck = torch.tensor([0] + lk, device=dev).cumsum(0).int()
    return q, k, v, cq, ck


def _assert_close_segments(out, lse, want, want_lse, cq, skip=()):
    for i in range(cq.numel() - 1):
        if i in skip:
            continue
        rows = slice(int(cq[i]), int(cq[i + 1]))
        o, w = out[rows].double(), want[rows]
        assert bool(torch.isfinite(o).all()), f"segment {i} not finite"
        err = (o - w).abs().max().item() if o.numel() else 0.0
        assert err <= 2e-2 * max(w.abs().max().item() if w.numel() else 1.0, 1.0), f"segment {i}: {err:.3g}"
        wl, gl = want_lse[:, rows], lse[:, rows]
        assert torch.equal(torch.isinf(gl), torch.isinf(wl)), f"keyless rows of segment {i}"
        fin = torch.isfinite(wl)
        if fin.any():
            assert (gl[fin].double() - wl[fin].double()).abs().max().item() <= 2e-2, f"lse of segment {i}"


# segment lengths around SM90's forward tiles (64..192 rows), empty and one-token segments,
# Lq != Lk (causal: bottom-right, keyless rows)
CUDA_LAYOUTS = [
    ([1, 64, 65, 0, 127, 128, 129, 176, 177, 200, 300, 3], None),
    ([5, 0, 1, 33, 250, 70], [0, 7, 1, 20, 300, 9]),
]


@pytest.mark.cuda
@pytest.mark.parametrize("layout", CUDA_LAYOUTS, ids=["self", "cross"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,d,dtype", [
    (4, 4, 64, torch.bfloat16), (8, 1, 128, torch.bfloat16), (4, 2, 96, torch.float16), (2, 2, 256, torch.bfloat16),
    (16, 16, 128, torch.float16),
], ids=lambda x: str(x).replace("torch.", ""))
def test_cuda_fa4_forward_matches_float64(layout, causal, hq, hkv, d, dtype):
    dev = _cuda_fa4()
    lq, lk = layout[0], layout[1] or layout[0]
    q, k, v, cq, ck = _cuda_case(lq, lk, hq, hkv, d, dtype, dev)
    scale = d**-0.5
    out, lse = fa4_forward.forward(q, k, v, cq, ck, causal, scale, (max(lq), max(lk)))
    assert out.dtype == dtype and lse.shape == (hq, sum(lq)) and lse.dtype == torch.float32
    want = reference_attention(q.double(), k.double(), v.double(), cq, ck, causal, scale)
    want_lse = reference_lse(q.double(), k.double(), cq, ck, causal, scale)
    _assert_close_segments(out, lse, want, want_lse, cq.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_rows_without_keys_are_written(causal):
    """The kernel writes every row of a segment, those that see no key too (output 0,
    LSE -inf): into memory filled with NaN, nothing stays unwritten."""
    dev = _cuda_fa4()
    lq, lk = [5, 3, 40, 2], [0, 1, 30, 0]
    q, k, v, cq, ck = _cuda_case(lq, lk, 4, 4, 128, torch.bfloat16, dev)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, sum(lq)), float("nan"), device=dev)
    fa4_forward._kernel(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=40, max_seqlen_k=30,
                        softmax_scale=0.1, causal=causal, return_lse=True, out=out, lse=lse)
    assert bool(torch.isfinite(out).all())
    want_lse = reference_lse(q.double(), k.double(), cq, ck, causal, 0.1)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and bool((lse[torch.isinf(lse)] < 0).all())
    assert bool((out[:5] == 0).all()) and bool((out[-2:] == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 128), (2, 2, 256)])
def test_cuda_a_non_finite_segment_keeps_to_itself(where, poison, causal, hq, hkv, d):
    """NaN or Inf in each segment in turn (lengths around every SM90 forward tile):
    every other segment's output and LSE stay the float64 reference's."""
    dev = _cuda_fa4()
    lq = CUDA_LAYOUTS[0][0]
    q, k, v, cq, ck = _cuda_case(lq, lq, hq, hkv, d, torch.bfloat16, dev)
    scale = d**-0.5
    want = reference_attention(q.double(), k.double(), v.double(), cq, ck, causal, scale)
    want_lse = reference_lse(q.double(), k.double(), cq, ck, causal, scale)
    host = cq.cpu()
    for seg in range(len(lq)):
        if lq[seg] == 0:
            continue
        x = {"q": q, "k": k, "v": v}
        x[where] = x[where].clone()
        x[where][int(host[seg]) : int(host[seg + 1])] = poison
        out, lse = fa4_forward.forward(x["q"], x["k"], x["v"], cq, ck, causal, scale, (max(lq), max(lq)))
        _assert_close_segments(out, lse, want, want_lse, host, skip=(seg,))


@pytest.mark.cuda
@pytest.mark.parametrize("lq,lk,causal", [([10, 300], [200, 20], True), ([64, 200], [300, 0], False)])
def test_cuda_rows_that_see_no_key_do_not_read_the_segment_before(lq, lk, causal):
    """Whole query tiles that see no key (causal Lq - Lk past a tile; Lk == 0) run the
    key tile before the segment: a NaN there stays out of the segment."""
    dev = _cuda_fa4()
    q, k, v, cq, ck = _cuda_case(lq, lk, 4, 4, 128, torch.bfloat16, dev)
    want = reference_attention(q.double(), k.double(), v.double(), cq, ck, causal, 0.1)
    want_lse = reference_lse(q.double(), k.double(), cq, ck, causal, 0.1)
    v = v.clone()
    v[: lk[0]] = math.nan
    out, lse = fa4_forward.forward(q, k, v, cq, ck, causal, 0.1, (max(lq), max(lk)))
    _assert_close_segments(out, lse, want, want_lse, cq.cpu(), skip=(0,))


@pytest.mark.parametrize("lq,lk", LAYOUTS)
def test_the_host_layout_says_which_layouts_have_keyless_rows(fa4, lq, lk):
    """The runtime passes the host layout's answer: where it says no row is keyless,
    looking on the device is skipped, and nothing else is flagged."""
    from ragged_compile.steps import HostLayout

    cq, ck = (torch.tensor([0] + x).cumsum(0).int() for x in (lq, lk))
    layout = HostLayout(cq, ck)
    for causal in (False, True):
        want = bool(fa4_forward._reads_before(cq, ck, causal).any())
        assert layout.keyless_rows[causal] == want
        q, k, v, _, _ = _case(lq, lk)
        fa4.clear()
        out, _ = _forward(q, k, v, cq, ck, causal, keyless_rows=layout.keyless_rows[causal])
        torch.testing.assert_close(out, reference_attention(q, k, v, cq, ck, causal, 0.3), rtol=1e-6, atol=1e-7)
        (flags,) = fa4
        assert bool(flags.any()) == want
