"""Tests of the ragged attention op: opcheck, exact layouts, SDPA, torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import ragged_compile.reference as reference_mod
from ragged_compile import ragged_attention
from ragged_compile.reference import dense_attention, reference_attention, sees_key

OP = torch.ops.ragged_compile.ragged_attention.default

# (rtol, atol) against the float64 oracle, for the CPU kernel (float32
# accumulation, one rounding to the output dtype) at the default scale.
TOL = {
    torch.float64: (1e-12, 1e-13),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-7, 1e-5),
    torch.float16: (2**-10, 1e-5),
}


def cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def make(q_lens, kv_lens=None, hq=4, hkv=2, d=16, dtype=torch.float32, index=torch.int32,
         seed=0, fused=False):
    """Random q/k/v and offsets. ``fused``: q/k/v are slices of one qkv tensor."""
    kv_lens = q_lens if kv_lens is None else kv_lens
    g = torch.Generator().manual_seed(seed)
    if fused:
        assert list(kv_lens) == list(q_lens)
        qkv = torch.randn(sum(q_lens), hq + 2 * hkv, d, generator=g).to(dtype)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    else:
        q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
        k = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype)
        v = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype)
    return q, k, v, cu(q_lens, index), cu(kv_lens, index)


def check_against_dense(out, q, k, v, cu_q, cu_k, causal, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = dense_attention(q, k, v, cu_q, cu_k, causal, scale)
    rtol, atol = TOL[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- opcheck

OPCHECK_CASES = {
    "self": dict(q_lens=[3, 5, 1]),
    "cross": dict(q_lens=[2, 6], kv_lens=[7, 1]),
    "gqa": dict(q_lens=[4, 4], hq=8, hkv=2),
    "mqa-cross": dict(q_lens=[1, 3], kv_lens=[5, 2], hq=4, hkv=1),
    "empty-segments": dict(q_lens=[0, 3, 0, 2], kv_lens=[2, 0, 0, 4]),
    "n0": dict(q_lens=[]),
    "int64-d72": dict(q_lens=[3, 2], d=72, index=torch.int64),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck(name, causal):
    q, k, v, cu_q, cu_k = make(**OPCHECK_CASES[name])
    torch.library.opcheck(OP, (q, k, v, cu_q, cu_k, causal, 0.3))


# --------------------------------------------------------------------------- exact layouts

LAYOUTS = [
    pytest.param(dict(q_lens=[5, 3, 8]), id="self"),
    pytest.param(dict(q_lens=[3, 0, 4, 0], kv_lens=[0, 2, 5, 0]), id="empty-both-sides"),
    pytest.param(dict(q_lens=[0, 0, 0]), id="all-empty"),
    pytest.param(dict(q_lens=[1, 1, 1, 1]), id="one-token-self"),
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[1, 5, 0]), id="one-token-cross"),
    pytest.param(dict(q_lens=[7, 5], kv_lens=[3, 5]), id="lq-gt-lk"),
    pytest.param(dict(q_lens=[2, 3], kv_lens=[9, 3]), id="lq-lt-lk"),
    pytest.param(dict(q_lens=[4, 9], d=72), id="d72"),
    pytest.param(dict(q_lens=[6, 2], kv_lens=[3, 8], d=80), id="d80-cross"),
    pytest.param(dict(q_lens=[5, 7], d=96, hq=2, hkv=1), id="d96"),
    pytest.param(dict(q_lens=[6, 3], hq=8, hkv=2), id="gqa-4to1"),
    pytest.param(dict(q_lens=[4, 5], kv_lens=[6, 1], hq=8, hkv=1), id="mqa"),
    pytest.param(dict(q_lens=[3, 6], index=torch.int64), id="int64"),
    pytest.param(dict(q_lens=[3, 6], index=torch.int32), id="int32"),
    pytest.param(dict(q_lens=[5, 0, 6], fused=True, hq=8, hkv=2), id="fused-qkv-views"),
    pytest.param(dict(q_lens=[5, 4], dtype=torch.bfloat16, d=80), id="bf16"),
    pytest.param(dict(q_lens=[5, 4], kv_lens=[2, 9], dtype=torch.float16), id="fp16"),
    pytest.param(dict(q_lens=[5, 4], kv_lens=[2, 9], dtype=torch.float64), id="fp64"),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_dense(layout, causal):
    q, k, v, cu_q, cu_k = make(**layout)
    cross = "kv_lens" in layout
    out = ragged_attention(q, k, v, cu_q, cu_k if cross else None, causal=causal)
    check_against_dense(out, q, k, v, cu_q, cu_k, causal)
    assert bool(torch.isfinite(out).all())


def test_explicit_scale_matches_dense():
    q, k, v, cu_q, cu_k = make([4, 6], [7, 2], d=32)
    out = ragged_attention(q, k, v, cu_q, cu_k, causal=True, scale=0.05)
    check_against_dense(out, q, k, v, cu_q, cu_k, True, scale=0.05)
    default = ragged_attention(q, k, v, cu_q, cu_k, causal=True)
    assert not torch.allclose(out, default)  # the scale is really used


def test_transposed_head_major_inputs():
    # q/k/v as transposes of [H, T, D] tensors: strides (D, T*D, 1).
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 9, 16, generator=g).transpose(0, 1)
    k = torch.randn(2, 11, 16, generator=g).transpose(0, 1)
    v = torch.randn(2, 11, 16, generator=g).transpose(0, 1)
    cu_q, cu_k = cu([4, 5]), cu([8, 3])
    out = ragged_attention(q, k, v, cu_q, cu_k, causal=True)
    check_against_dense(out, q, k, v, cu_q, cu_k, True)
    same = ragged_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, causal=True)
    torch.testing.assert_close(out, same, rtol=0, atol=0)


def test_rows_that_see_no_key_are_zero():
    # segment 0: 5 queries over 2 keys, causal -> rows 0..2 see nothing;
    # segment 1: 3 queries over 0 keys -> all zero.
    q, k, v, cu_q, cu_k = make([5, 3], [2, 0])
    out = ragged_attention(q, k, v, cu_q, cu_k, causal=True)
    assert bool((out[0:3] == 0).all()) and bool((out[5:8] == 0).all())
    assert bool((out[3:5] != 0).all())
    assert not bool(out.isnan().any())
    # Row 3 sees key 0 only: its output is v[0] (per GQA head mapping).
    torch.testing.assert_close(out[3], v[0].repeat_interleave(2, dim=0))
    out_nc = ragged_attention(q, k, v, cu_q, cu_k, causal=False)
    assert bool((out_nc[0:5] != 0).all()) and bool((out_nc[5:8] == 0).all())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "q_lens,kv_lens", [([5, 3, 0, 4], [2, 0, 3, 4]), ([1, 7, 2], [7, 1, 0]), ([6], [6])]
)
def test_sees_key_marks_exactly_the_zero_rows(q_lens, kv_lens, causal):
    q, k, v, cu_q, cu_k = make(q_lens, kv_lens)
    out = reference_attention(q, k, v, cu_q, cu_k, causal, 0.25)
    rows = sum(q_lens) + 3  # rows past the layout see nothing
    sees = sees_key(cu_q, cu_k, rows, causal)
    assert not sees[sum(q_lens) :].any()
    assert sees[: sum(q_lens)].tolist() == out.ne(0).flatten(1).any(1).tolist()


def test_gqa_head_mapping():
    # Query head h uses k/v head h // (Hq // Hkv): same as repeating k/v heads.
    q, k, v, cu_q, cu_k = make([3, 6], [5, 4], hq=8, hkv=2)
    out = ragged_attention(q, k, v, cu_q, cu_k, causal=True)
    full = ragged_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), cu_q, cu_k, causal=True
    )
    torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
    # ... and not the interleaved mapping h % Hkv.
    wrong = ragged_attention(q, k.repeat(1, 4, 1), v.repeat(1, 4, 1), cu_q, cu_k, causal=True)
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_cu_seqlens_k_none_means_self_and_index_dtypes_agree():
    q, k, v, cu32, _ = make([4, 0, 7])
    a = ragged_attention(q, k, v, cu32, causal=True)
    b = ragged_attention(q, k, v, cu32, cu32, causal=True)
    c = ragged_attention(q, k, v, cu32.long(), cu32.long(), causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_correct_max_seqlen_does_not_change_result():
    q, k, v, cu_q, cu_k = make([4, 7], [9, 2])
    a = ragged_attention(q, k, v, cu_q, cu_k, causal=True)
    b = ragged_attention(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=7, max_seqlen_k=9)
    c = ragged_attention(q, k, v, cu_q, cu_k, causal=True, max_seqlen_q=100, max_seqlen_k=100)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_inputs_not_modified_and_output_fresh():
    q, k, v, cu_q, cu_k = make([3, 4], [5, 2])
    saved = [t.clone() for t in (q, k, v, cu_q, cu_k)]
    out = ragged_attention(q, k, v, cu_q, cu_k)
    for a, b in zip(saved, (q, k, v, cu_q, cu_k)):
        assert torch.equal(a, b)
    assert out.data_ptr() not in {t.data_ptr() for t in (q, k, v)}


@pytest.mark.parametrize("budget", [1, 64, 1000])
def test_reference_chunking_matches_dense(monkeypatch, budget):
    # A tiny score budget forces the row- and segment-chunked paths.
    monkeypatch.setattr(reference_mod, "_BUDGET", budget)
    q, k, v, cu_q, cu_k = make([9, 3, 0, 12, 5, 1, 6], [4, 3, 2, 12, 8, 0, 6], hq=4, hkv=1)
    for causal in (False, True):
        out = reference_attention(q, k, v, cu_q, cu_k, causal, 0.25)
        check_against_dense(out, q, k, v, cu_q, cu_k, causal, scale=0.25)


def test_nonfinite_values_do_not_leak_across_segments():
    # Segments 0 and 1 fall in one padded group (lengths 4 and 3); the padding of
    # segment 1 used to gather token 0 of v (segment 0), so a NaN there leaked.
    q, k, v, cu_q, cu_k = make([4, 3])
    clean = ragged_attention(q, k, v, cu_q, cu_k)
    for t in (q, k, v):
        for bad in (math.nan, math.inf):
            saved = t[0].clone()
            t[0] = bad
            out = ragged_attention(q, k, v, cu_q, cu_k)
            t[0] = saved
            assert torch.equal(out[4:], clean[4:]), f"{bad} in segment 0 reached segment 1"


# --------------------------------------------------------------------------- n = 0, dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_n0_returns_empty(dtype, index):
    q = torch.randn(0, 4, 16).to(dtype)
    k = torch.randn(0, 2, 16).to(dtype)
    out = ragged_attention(q, k, k.clone(), torch.zeros(1, dtype=index), causal=True)
    assert out.shape == (0, 4, 16) and out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_dtype_preserved(dtype):
    q, k, v, cu_q, cu_k = make([3, 5], [2, 6], dtype=dtype)
    out = ragged_attention(q, k, v, cu_q, cu_k, causal=True)
    assert out.dtype == dtype and out.shape == q.shape
    check_against_dense(out, q, k, v, cu_q, cu_k, True)


# --------------------------------------------------------------------------- SDPA


@pytest.mark.parametrize(
    "lengths,hq,hkv,d",
    [([5, 1, 9, 16], 4, 4, 16), ([7, 3], 8, 2, 72), ([12, 2], 4, 1, 64)],
)
def test_causal_square_segments_match_sdpa(lengths, hq, hkv, d):
    q, k, v, cu_q, _ = make(lengths, hq=hq, hkv=hkv, d=d)
    out = ragged_attention(q, k, v, cu_q, causal=True)
    offs = cu_q.tolist()
    for i in range(len(lengths)):
        s, e = offs[i], offs[i + 1]
        ref = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None],
            k[s:e].transpose(0, 1)[None],
            v[s:e].transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=hq != hkv,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[s:e], ref, rtol=1e-5, atol=1e-5)


def test_noncausal_cross_segments_match_sdpa():
    q, k, v, cu_q, cu_k = make([3, 8], [10, 2], hq=4, hkv=2)
    out = ragged_attention(q, k, v, cu_q, cu_k, scale=0.2)
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for i in range(2):
        ref = F.scaled_dot_product_attention(
            q[oq[i] : oq[i + 1]].transpose(0, 1)[None],
            k[ok[i] : ok[i + 1]].transpose(0, 1)[None],
            v[ok[i] : ok[i + 1]].transpose(0, 1)[None],
            scale=0.2,
            enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[oq[i] : oq[i + 1]], ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- torch.compile


class CountingBackend:
    """Dynamo backend that records every FX graph and runs it eagerly."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def op_nodes(self, graph_index=-1):
        return [
            n
            for n in self.graphs[graph_index].graph.nodes
            if n.op == "call_function"
            and n.target in (torch.ops.ragged_compile.ragged_attention, OP)
        ]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(q, k, v, cu_q, cu_k):
    # Some work around the op so the graph is more than the op.
    o = ragged_attention(q * 2.0, k, v, cu_q, cu_k, causal=True, scale=0.125)
    return o.sum(-1) + 1


def test_compile_fullgraph_single_graph_holds_op(fresh_dynamo):
    backend = CountingBackend()
    compiled = torch.compile(_model, backend=backend, fullgraph=True)
    args = make([3, 0, 6], [5, 2, 6], hq=8, hkv=2, d=80)
    out = compiled(*args)
    torch.testing.assert_close(out, _model(*args), rtol=0, atol=0)
    assert len(backend.graphs) == 1
    assert len(backend.op_nodes()) == 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_layout_change_same_shapes_no_recompile(fresh_dynamo):
    backend = CountingBackend()
    compiled = torch.compile(_model, backend=backend, fullgraph=True)
    q, k, v, cu_q, cu_k = make([3, 6, 2], [5, 2, 6], hq=4, hkv=2)
    first = compiled(q, k, v, cu_q, cu_k)
    torch.testing.assert_close(first, _model(q, k, v, cu_q, cu_k), rtol=0, atol=0)
    for q_lens, kv_lens in [([6, 3, 2], [1, 6, 6]), ([0, 11, 0], [13, 0, 0]), ([1, 1, 9], [1, 1, 11])]:
        cu_q2, cu_k2 = cu(q_lens), cu(kv_lens)
        out = compiled(q, k, v, cu_q2, cu_k2)
        expected = _model(q, k, v, cu_q2, cu_k2)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        ref = dense_attention(q * 2.0, k, v, cu_q2, cu_k2, True, 0.125).sum(-1) + 1
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out, first)  # the new offsets are really used
    assert len(backend.graphs) == 1, "changing offset values must not recompile"


def test_compile_dynamic_shapes(fresh_dynamo):
    backend = CountingBackend()
    compiled = torch.compile(_model, backend=backend, fullgraph=True, dynamic=True)
    for q_lens, kv_lens in [([3, 6], [5, 2]), ([7, 1, 4], [2, 9, 4]), ([2, 2, 2, 9], [4, 0, 1, 3])]:
        args = make(q_lens, kv_lens)
        torch.testing.assert_close(compiled(*args), _model(*args), rtol=0, atol=0)
    assert len(backend.graphs) == 1, f"{len(backend.graphs)} graphs for dynamic shapes"
    assert len(backend.op_nodes()) == 1


def test_compile_aot_graph_holds_op(fresh_dynamo):
    from torch._dynamo.backends.common import aot_autograd

    aten_graphs = []

    def fw(gm, example_inputs):
        aten_graphs.append(gm)
        return gm.forward

    compiled = torch.compile(_model, backend=aot_autograd(fw_compiler=fw), fullgraph=True)
    args = make([4, 0, 3], [2, 5, 3], hq=4, hkv=1, fused=False)
    torch.testing.assert_close(compiled(*args), _model(*args), rtol=0, atol=0)
    assert len(aten_graphs) == 1
    targets = [n.target for n in aten_graphs[0].graph.nodes if n.op == "call_function"]
    assert OP in targets, targets


def test_compile_inductor_cpu(fresh_dynamo):
    compiled = torch.compile(_model, fullgraph=True)  # default backend: inductor
    q, k, v, cu_q, cu_k = make([5, 0, 4], [3, 6, 4], hq=4, hkv=2, d=72)
    torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k), _model(q, k, v, cu_q, cu_k))
    cu_q2, cu_k2 = cu([1, 7, 1]), cu([9, 0, 4])
    out = compiled(q, k, v, cu_q2, cu_k2)
    ref = dense_attention(q * 2.0, k, v, cu_q2, cu_k2, True, 0.125).sum(-1) + 1
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
