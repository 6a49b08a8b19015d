"""The public testing API (``ragged_compile.testing``): what its strategies draw and
that its checks catch the bugs they are for."""

from __future__ import annotations

import collections
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import ragged_compile
from ragged_compile import testing

# Deterministic, so the coverage counts below are the same on every run.
COVERAGE = settings(max_examples=300, derandomize=True, database=None, deadline=None)


def _collect(strategy, check=lambda x: None) -> list:
    seen = []

    @COVERAGE
    @given(strategy)
    def run(x):
        check(x)
        seen.append(x)

    run()
    return seen


def _check_layout(layout: testing.Layout, max_segments, max_tokens) -> None:
    for name in ("q_lens", "k_lens", "cu_seqlens_q", "cu_seqlens_k"):
        t = getattr(layout, name)
        assert t.dtype == torch.int32 and t.device.type == "cpu" and t.dim() == 1, name
    assert layout.q_lens.tolist() == list(layout.q_lengths)
    assert layout.k_lens.tolist() == list(layout.k_lengths)
    assert layout.cu_seqlens_q.tolist()[1:] == torch.cumsum(layout.q_lens, 0).tolist()
    assert layout.cu_seqlens_k.tolist()[1:] == torch.cumsum(layout.k_lens, 0).tolist()
    assert layout.cu_seqlens_q[0] == 0 and layout.cu_seqlens_k[0] == 0
    assert layout.n <= max_segments
    assert layout.total_q <= max_tokens and layout.total_k <= max_tokens
    assert min(layout.q_lengths + layout.k_lengths, default=0) >= 0
    if not layout.cross:
        assert layout.q_lengths == layout.k_lengths


def test_layouts_cover_empty_one_token_cross_and_stay_in_bounds():
    seen = _collect(testing.layouts(max_segments=64, max_tokens=4096), lambda l: _check_layout(l, 64, 4096))
    count = collections.Counter()
    for layout in seen:
        lens = layout.q_lengths + layout.k_lengths
        count["empty segment"] += 0 in lens
        count["one-token segment"] += 1 in lens
        count["cross, different lengths"] += layout.cross and layout.q_lengths != layout.k_lengths
        count["self"] += not layout.cross
        count["no segment"] += layout.n == 0
        count["long segment"] += max(lens, default=0) >= 256
    for what in ("empty segment", "one-token segment", "cross, different lengths", "self", "no segment", "long segment"):
        assert count[what] >= 3, (what, count)


def test_layouts_draw_thousands_of_tiny_segments_when_bounds_allow():
    seen = _collect(testing.layouts(max_segments=4096, max_tokens=8192), lambda l: _check_layout(l, 4096, 8192))
    floods = [l for l in seen if l.n >= 1000 and max(l.q_lengths, default=0) <= 3]
    assert len(floods) >= 3, [l.n for l in seen]
    # ... and never beyond max_segments when it is small.
    assert all(l.n <= 64 for l in _collect(testing.layouts(max_segments=64, max_tokens=100000)))


@pytest.mark.parametrize("bucket", [(16, 512), (8, 64, 300), (8, 300, 64), (300, 2000)])
def test_layouts_fill_a_bucket_exactly(bucket):
    S, Tq = bucket[0], bucket[1]
    Tk = bucket[-1]
    seen = _collect(testing.layouts(bucket=bucket), lambda l: _check_layout(l, S, max(Tq, Tk)))
    assert all(l.total_q <= Tq and l.total_k <= Tk for l in seen)
    full = [l for l in seen if l.n == S and l.total_q == Tq and l.total_k == Tk]
    assert len(full) >= 10, len(full)
    assert any(l.cross for l in full)
    full_self = [l for l in seen if not l.cross and l.n == S and l.total_q == min(Tq, Tk)]
    assert len(full_self) >= 5, len(full_self)
    assert any(0 in l.q_lengths for l in full + full_self), "full buckets hold empty segments too"


def test_layout_checks_its_arguments():
    with pytest.raises(ValueError, match="same number of segments"):
        testing.Layout((1, 2), (1,), cross=True)
    with pytest.raises(ValueError, match="cross=True"):
        testing.Layout((1, 2), (2, 1), cross=False)
    with pytest.raises(ValueError, match="bucket"):
        find(testing.layouts(bucket=(4,)), lambda _: True)


# --------------------------------------------------------------------------- every bound, every draw

_OMIT = object()  # an argument left out (for max_tokens, None means "no bound")
_LAYOUT_ARGS = {
    "max_segments": st.one_of(st.integers(0, 40), st.integers(250, 420)),
    "max_tokens": st.one_of(st.none(), st.integers(0, 400)),
    "min_segments": st.integers(0, 6),
    "max_len": st.integers(0, 60),
    "max_k_tokens": st.one_of(st.none(), st.integers(0, 400)),
    "max_scores": st.integers(0, 3000),
    "max_tiny_segments": st.sampled_from((0, 100, 256, 300, 500)),
    "cross": st.one_of(st.none(), st.booleans()),
    "bucket": st.one_of(st.tuples(st.integers(0, 24), st.integers(0, 400)), st.tuples(*[st.integers(0, 400)] * 3)),
}
_BOUNDS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def _some_arguments(draw, table):
    kw = {}
    for name, values in table.items():
        value = draw(st.one_of(st.just(_OMIT), values), label=name)
        if value is not _OMIT:
            kw[name] = value
    return kw


def _layout_bounds(kw):
    """The bounds layouts(**kw) documents: (S, Tq, Tk, largest flood), None for no bound."""
    S, Tq = kw.get("max_segments", 64), kw.get("max_tokens", 4096)
    Tk = kw.get("max_k_tokens") if kw.get("max_k_tokens") is not None else kw.get("max_tokens", None)
    if "bucket" in kw:
        b = kw["bucket"]
        S = min(b[0], S) if "max_segments" in kw else b[0]
        Tq = min(b[1], Tq) if "max_tokens" in kw and Tq is not None else b[1]
        Tk = b[-1] if Tk is None else min(b[-1], Tk)
    elif "max_k_tokens" not in kw or kw["max_k_tokens"] is None:
        Tk = Tq
    tiny = kw.get("max_tiny_segments")
    if tiny is None:
        tiny = S if S >= 256 else 0
    if "bucket" in kw:
        tiny = min(tiny, S)
    return S, Tq, Tk, tiny


def _rejects_contradiction(make, kw, S) -> bool:
    """``min_segments`` above the segment bound ``S``: ``make(**kw)`` raises naming it."""
    if kw.get("min_segments", 0) <= S:
        return False
    with pytest.raises(ValueError, match="min_segments"):
        make(**kw)
    return True


def _assert_count(lens, n, kw, S, tiny):
    """``min_segments <= n <= S``, or a flood (the one documented excess) of at most ``tiny``."""
    assert n >= kw.get("min_segments", 0), (lens, kw)
    if tiny >= 256 and tiny > S and n > S:
        assert n <= tiny and max(lens) <= 3, (lens, kw)
    else:
        assert n <= S, (lens, kw)


def _assert_within(layout, kw):
    S, Tq, Tk, tiny = _layout_bounds(kw)
    lens = layout.q_lengths + layout.k_lengths
    _assert_count(lens, layout.n, kw, S, tiny)
    if not layout.cross:
        Tq = Tk = min((t for t in (Tq, Tk) if t is not None), default=None)
    assert Tq is None or layout.total_q <= Tq, (layout, kw)
    assert Tk is None or layout.total_k <= Tk, (layout, kw)
    if "max_len" in kw:
        assert max(lens, default=0) <= kw["max_len"], (layout, kw)
    if "max_scores" in kw:
        assert layout.score_elements <= kw["max_scores"], (layout, kw)
    if kw.get("cross") is not None:
        assert layout.cross == kw["cross"], (layout, kw)


@_BOUNDS
@given(kw=_some_arguments(_LAYOUT_ARGS), data=st.data())
def test_layouts_keep_every_bound_they_are_given(kw, data):
    if _rejects_contradiction(testing.layouts, kw, _layout_bounds(kw)[0]):
        return
    strategy = testing.layouts(**kw)
    for i in range(4):
        _assert_within(data.draw(strategy, label=f"layout {i}"), kw)


@pytest.mark.parametrize(
    "kw,bound",
    [
        (dict(max_segments=0), dict(n=0)),
        (dict(bucket=(0, 0)), dict(n=0, total_q=0)),
        (dict(bucket=(4, 16), max_tokens=8), dict(total_q=8, total_k=8)),
        (dict(bucket=(4, 16), max_segments=2), dict(n=2)),
        (dict(bucket=(3, 40, 90), max_k_tokens=50, cross=True), dict(total_k=50)),
    ],
)
def test_layouts_honour_bounds_beside_a_bucket(kw, bound):
    """The tighter of a bucket and an explicit bound holds, and full draws fill it."""
    seen = _collect(testing.layouts(**kw))
    for name, limit in bound.items():
        assert all(getattr(l, name) <= limit for l in seen), (name, max(getattr(l, name) for l in seen))
        assert any(getattr(l, name) == limit for l in seen), name


def test_full_buckets_keep_an_explicit_max_len():
    seen = _collect(testing.layouts(bucket=(4, 64), max_len=10, cross=False))
    assert all(max(l.q_lengths, default=0) <= 10 for l in seen)
    assert any(l.n == 4 and l.total_q == 40 for l in seen), "a full draw fills S * max_len"
    # without max_len, a full bucket still holds exactly its tokens
    assert any(l.n == 2 and l.total_q == 3000 for l in _collect(testing.layouts(bucket=(2, 3000))))


@_BOUNDS
@given(
    kw=_some_arguments({k: _LAYOUT_ARGS[k] for k in ("max_segments", "max_len", "min_segments", "max_tiny_segments")}
                       | {"max_tokens": _LAYOUT_ARGS["max_tokens"], "n": st.integers(0, 30)}),
    data=st.data(),
)
def test_segment_lengths_keep_their_bounds(kw, data):
    S = kw.get("max_segments", 64)
    if _rejects_contradiction(testing.segment_lengths, kw, S):
        return
    tiny = kw.get("max_tiny_segments", S if S >= 256 else 0)
    for _ in range(4):
        lens = data.draw(testing.segment_lengths(**kw))
        if "n" in kw:
            assert len(lens) == kw["n"]
        else:
            _assert_count(lens, len(lens), kw, S, tiny)
        assert max(lens, default=0) <= kw.get("max_len", 256)
        assert kw.get("max_tokens") is None or sum(lens) <= kw["max_tokens"]


@_BOUNDS
@given(lo=st.integers(0, 300), extra=st.integers(0, 300), max_len=st.integers(0, 5), data=st.data())
def test_tiny_segment_lengths_keep_their_bounds(lo, extra, max_len, data):
    lens = data.draw(testing.tiny_segment_lengths(lo, lo + extra, max_len))
    assert lo <= len(lens) <= lo + extra and max(lens, default=0) <= max_len


_CASE_ARGS = {
    "dtypes": st.lists(st.sampled_from(testing.DTYPES), min_size=1, max_size=4, unique=True).map(tuple),
    "head_dims": st.lists(st.integers(1, 300), min_size=1, max_size=3).map(tuple),
    "gqa_ratios": st.lists(st.sampled_from((1, 2, 3, 4, 8, 16, 64)), min_size=1, max_size=3).map(tuple),
    "index_dtypes": st.sampled_from(((torch.int32,), (torch.int64,), testing.INDEX_DTYPES)),
    "causal": st.one_of(st.none(), st.booleans()),
    "cross": st.one_of(st.none(), st.booleans()),
    "fused_qkv": st.booleans(),
    "max_segments": st.integers(0, 20),
    "min_segments": st.integers(0, 3),
    "max_len": st.integers(0, 40),
    "max_elements": st.integers(1, 1 << 14),
    "max_score_elements": st.integers(1, 1 << 16),
    "max_tiny_segments": st.sampled_from((0, 256, 400)),
}


@_BOUNDS
@given(kw=_some_arguments(_CASE_ARGS), data=st.data())
def test_attention_cases_and_inputs_keep_their_arguments(kw, data):
    S = kw.get("max_segments", 64)
    if _rejects_contradiction(testing.attention_cases, kw, S):
        return
    case = data.draw(testing.attention_cases(**kw), label="case")
    layout, D = case.layout, case.head_dim
    assert case.dtype in kw.get("dtypes", testing.DTYPES)
    assert D in kw.get("head_dims", testing.HEAD_DIMS)
    assert case.hq % case.hkv == 0 and case.hq // case.hkv in kw.get("gqa_ratios", testing.GQA_RATIOS)
    assert case.index_dtype in kw.get("index_dtypes", testing.INDEX_DTYPES)
    for name, owner in (("causal", case), ("cross", layout)):
        if kw.get(name) is not None:
            assert getattr(owner, name) == kw[name]
    assert not case.fused_qkv or kw.get("fused_qkv", True)
    _assert_count(layout.q_lengths + layout.k_lengths, layout.n, kw, S, kw.get("max_tiny_segments", 4096))
    assert max(layout.q_lengths + layout.k_lengths, default=0) <= kw.get("max_len", 256)
    per_token = case.hq * D
    assert max(layout.total_q, layout.total_k) <= max(1, kw.get("max_elements", 1 << 17) // per_token)
    assert layout.score_elements <= max(1, kw.get("max_score_elements", 1 << 21) // per_token)
    # attention_inputs takes the same keywords and hands them on
    inputs = data.draw(testing.attention_inputs(**{**kw, "dtypes": kw.get("dtypes", testing.DTYPES)}), label="inputs")
    assert inputs["q"].dtype in kw.get("dtypes", testing.DTYPES)
    assert inputs["q"].shape[-1] in kw.get("head_dims", testing.HEAD_DIMS)


@pytest.mark.parametrize(
    "make,name",
    [
        (lambda: testing.layouts(max_segments=-1), "max_segments"),
        (lambda: testing.layouts(max_segments=2.5), "max_segments"),
        (lambda: testing.layouts(max_tokens="8"), "max_tokens"),
        (lambda: testing.layouts(max_len=True), "max_len"),
        (lambda: testing.layouts(max_scores=-1), "max_scores"),
        (lambda: testing.layouts(max_tiny_segments=-5), "max_tiny_segments"),
        (lambda: testing.layouts(cross="yes"), "cross"),
        (lambda: testing.layouts(bucket=(4,)), "bucket"),
        (lambda: testing.layouts(bucket=(4, -1)), "bucket"),
        (lambda: testing.layouts(bucket="ab"), "bucket"),
        (lambda: testing.layouts(min_segments=5, max_segments=2), "min_segments"),
        (lambda: testing.layouts(bucket=(2, 8), min_segments=3), "min_segments"),
        (lambda: testing.segment_lengths(-1), "max_segments"),
        (lambda: testing.segment_lengths(n=-1), "n"),
        (lambda: testing.segment_lengths(2, min_segments=3), "min_segments"),
        (lambda: testing.tiny_segment_lengths(10, 5), "min_segments"),
        (lambda: testing.attention_inputs(head_dims=(0,)), "head_dims"),
        (lambda: testing.attention_inputs(head_dims=(64.0,)), "head_dims"),
        (lambda: testing.attention_inputs(head_dims=()), "head_dims"),
        (lambda: testing.attention_inputs(dtypes=(torch.int32,)), "dtypes"),
        (lambda: testing.attention_inputs(dtypes=torch.float32), "dtypes"),
        (lambda: testing.attention_inputs(cross="yes"), "cross"),
        (lambda: testing.attention_inputs(causal=1), "causal"),
        (lambda: testing.attention_inputs(gqa_ratios=(0,)), "gqa_ratios"),
        (lambda: testing.attention_inputs(index_dtypes=(torch.int16,)), "index_dtypes"),
        (lambda: testing.attention_inputs(device="gpu0"), "device"),
        (lambda: testing.attention_cases(fused_qkv=None), "fused_qkv"),
        (lambda: testing.attention_cases(layout=[1, 2]), "layout"),
        (lambda: testing.attention_cases(max_elements=0), "max_elements"),
        (lambda: testing.attention_cases(min_segments=9, max_segments=4), "min_segments"),
        (lambda: testing.head_configs(max_kv_heads=0), "max_kv_heads"),
        (lambda: testing.head_configs(gqa_ratios=(16,), max_q_heads=8), "gqa_ratios"),
        (lambda: testing.head_dims((-8,)), "choices"),
        (lambda: testing.dtypes((torch.int64,)), "choices"),
        (lambda: testing.index_dtypes((torch.float32,)), "choices"),
        (lambda: testing.scales(0, 1), "min_value"),
        (lambda: testing.scales(2, 1), "min_value"),
    ],
)
def test_strategies_reject_bad_arguments_when_made_naming_them(make, name):
    with pytest.raises(ValueError, match=name):
        make()  # raised here, not at the first draw


def test_attention_inputs_cover_gqa_odd_head_dims_dtypes_and_match_the_op():
    count = collections.Counter()

    def check(inputs):
        q, k = inputs["q"], inputs["k"]
        assert isinstance(inputs, dict) and inputs["cu_seqlens_q"].dtype in (torch.int32, torch.int64)
        count[f"ratio {q.shape[1] // k.shape[1]}"] += 1
        count[f"D {q.shape[-1]}"] += 1
        count[str(q.dtype)] += 1
        count[f"causal {inputs['causal']}"] += 1
        count["cross"] += inputs.case.layout.cross

    @COVERAGE
    @given(testing.attention_inputs(max_elements=1 << 13))
    def run(inputs):
        check(inputs)

    run()
    for key in ("ratio 1", "ratio 2", "ratio 4", "ratio 8", "D 72", "D 80", "D 96",
                "torch.float32", "torch.bfloat16", "torch.float16", "causal True", "causal False"):
        assert count[key] >= 3, (key, count)

    no_gqa = _collect(testing.attention_inputs(gqa_ratios=(1,), causal=True, head_dims=(80,), dtypes=(torch.float64,)))
    assert all(a["q"].shape[1] == a["k"].shape[1] and a["causal"] and a["q"].shape[-1] == 80 for a in no_gqa)


@settings(max_examples=25, deadline=None)
@given(inputs=testing.attention_inputs(layout=testing.layouts(max_segments=8, max_tokens=64, cross=True)))
def test_the_op_matches_the_reference_on_drawn_inputs(inputs):
    out = ragged_compile.ragged_attention(**inputs)
    testing.assert_matches_reference(out, **inputs)


def _inputs(dtype=torch.float32, causal=True):
    layout = testing.Layout((5, 0, 3, 1), (2, 4, 0, 6), cross=True)
    case = testing.AttentionCase(layout, 4, 2, 72, dtype, causal, None, seed=3)
    return case.args()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_assert_matches_reference_fails_on_wrong_outputs(dtype):
    inputs = _inputs(dtype)
    out = ragged_compile.ragged_attention(**inputs)
    testing.assert_matches_reference(out, **inputs)  # the right answer passes

    wrong = out.clone()
    wrong[4, 0, 0] += 0.1
    with pytest.raises(AssertionError, match=r"at \(4, 0, 0\) \(segment 0\)"):
        testing.assert_matches_reference(wrong, **inputs)
    not_causal = ragged_compile.ragged_attention(**{**inputs, "causal": False})
    with pytest.raises(AssertionError, match="reference|sees no key"):
        testing.assert_matches_reference(not_causal, **inputs)
    blind = out.clone()
    blind[5:8] = 1e-3  # segment 2 has no keys: its rows must be exactly zero
    with pytest.raises(AssertionError, match=r"row 5 \(segment 2\) sees no key"):
        testing.assert_matches_reference(blind, **inputs)
    nan = out.clone()
    nan[-1, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite.*segment 3"):
        testing.assert_matches_reference(nan, **inputs)
    with pytest.raises(AssertionError, match="expected q's"):
        testing.assert_matches_reference(out.float() if dtype != torch.float32 else out.double(), **inputs)


# --------------------------------------------------------------------------- user-model checks

torch.manual_seed(0)
W1, W2 = torch.randn(16, 32) / 4, torch.randn(32, 16) / 4


def good_model(x, cu):
    """Per-token MLP, then causal attention within each segment: independent."""
    h = torch.tanh(x @ W1.to(x.dtype)) @ W2.to(x.dtype)
    q = k = v = h.unflatten(-1, (2, 8))
    return x + ragged_compile.ragged_attention(q, k, v, cu, causal=True).flatten(1)


def mean_leak(x, cu):
    return good_model(x, cu) + x.mean(0)  # a batch statistic crosses segments


def nan_leak(x, cu):
    return good_model(x, cu) + 0 * x.sum(0)  # only a NaN or Inf crosses


def dense_attention_leak(x, cu):
    """Attention over the whole packed batch: the classic packing bug."""
    h = x.unflatten(-1, (2, 8)).transpose(0, 1)
    return F.scaled_dot_product_attention(h, h, h).transpose(0, 1).flatten(1)


def no_restart(x, cu):
    """Position ids that run across the batch instead of restarting per segment."""
    pos = torch.arange(x.shape[0], dtype=x.dtype)[:, None]
    return good_model(x + torch.sin(pos / 7), cu)


CU = torch.tensor([0, 5, 5, 6, 14, 20], dtype=torch.int32)  # with an empty and a one-token segment


def test_check_segment_independence_passes_an_independent_model():
    x = torch.randn(20, 16)
    testing.check_segment_independence(good_model, x, CU)
    testing.check_segment_independence(no_restart, x, CU)  # a per-segment bug, but no leak


@pytest.mark.parametrize(
    "model,fill", [(mean_leak, "random"), (dense_attention_leak, "random"), (nan_leak, "nan")]
)
def test_check_segment_independence_names_the_segments_a_leak_connects(model, fill):
    x = torch.randn(20, 16)
    with pytest.raises(AssertionError, match=rf"changing segment 0 \({fill}\) changed the output of segment 2 .*segment 3"):
        testing.check_segment_independence(model, x, CU, segments=[0])
    with pytest.raises(AssertionError):
        testing.check_segment_independence(model, x, CU)


def test_check_segment_independence_rejects_a_nondeterministic_model():
    with pytest.raises(AssertionError, match="eval"):
        testing.check_segment_independence(lambda x, cu: F.dropout(x, 0.5), torch.randn(20, 16), CU)


def test_check_matches_per_segment():
    x = torch.randn(20, 16)
    testing.check_matches_per_segment(good_model, x, CU)
    for model in (mean_leak, no_restart, dense_attention_leak):
        with pytest.raises(AssertionError, match="differs from the segment run alone"):
            testing.check_matches_per_segment(model, x, CU)


def test_checks_take_a_jagged_njt():
    lengths = [5, 0, 1, 8, 6]
    x = torch.nested.nested_tensor([torch.randn(n, 16) for n in lengths], layout=torch.jagged)

    def njt_good(x):  # an NJT model: per-token work only
        return torch.tanh(x @ W1) @ W2

    def njt_leak(x):
        v = njt_good(x).values()
        return torch.nested.nested_tensor_from_jagged(v + v.mean(0), x.offsets())

    testing.check_segment_independence(njt_good, x)
    testing.check_matches_per_segment(njt_good, x)
    with pytest.raises(AssertionError, match="changing segment"):
        testing.check_segment_independence(njt_leak, x)
    with pytest.raises(AssertionError, match="segment run alone"):
        testing.check_matches_per_segment(njt_leak, x)


def test_checks_reject_bad_arguments_with_the_fix():
    x = torch.randn(20, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        testing.check_segment_independence(good_model, x, torch.tensor([0, 5, 19]))
    with pytest.raises(ValueError, match="one row per input token"):
        testing.check_segment_independence(lambda x, cu: x.sum(0), x, CU)


@settings(max_examples=20, deadline=None)
@given(layout=testing.layouts(max_segments=12, max_tokens=96), data=st.data())
def test_checks_over_drawn_layouts(layout, data):
    x = torch.randn(layout.total_q, 16, dtype=torch.float64)
    testing.check_segment_independence(good_model, x, layout.cu_seqlens_q, fills=("random", "nan"))
    testing.check_matches_per_segment(good_model, x, layout.cu_seqlens_q)
    if sum(1 for n in layout.q_lengths if n) >= 2:
        with pytest.raises(AssertionError):
            testing.check_segment_independence(mean_leak, x, layout.cu_seqlens_q)


def test_import_ragged_compile_does_not_import_hypothesis():
    code = "import sys, ragged_compile; assert 'hypothesis' not in sys.modules; ragged_compile.testing.layouts; assert 'hypothesis' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[1])


def test_lengths_are_tuples_and_cases_call_the_op():
    layout = find(testing.layouts(max_segments=8, max_len=16, max_tokens=50, cross=True), lambda l: l.n >= 2)
    assert isinstance(layout.q_lengths, tuple) and isinstance(layout.k_lengths, tuple)
    case = find(testing.attention_cases(max_segments=4, dtypes=(torch.float32,)), lambda c: c.layout.total_q > 0)
    assert isinstance(case.q_lengths, tuple) and isinstance(case.k_lengths, tuple)
    x = case.tensors()
    out = ragged_compile.ragged_attention(**case.call_kwargs(x))
    testing.assert_matches_reference(out, **case.call_kwargs(x))


def test_the_readme_example_passes_its_correct_models_and_catches_its_planted_leaks():
    """examples/test_fuzz_your_model.py is the README's "Fuzz your own model" test:
    on one fixed layout, its correct models pass both checks and its leaky ones fail."""
    import importlib.util

    path = pathlib.Path(__file__).parents[1] / "examples" / "test_fuzz_your_model.py"
    spec = importlib.util.spec_from_file_location("readme_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    layout = testing.Layout((3, 0, 1, 5), (3, 0, 1, 5), cross=False)
    x = torch.randn(layout.total_q, 64)
    njt = torch.nested.nested_tensor_from_jagged(x, layout.cu_seqlens_q.long())
    cases = [(m, (x, layout.cu_seqlens_q)) for m in example.MODELS.items()]
    cases += [(m, (njt,)) for m in example.NJT_MODELS.items()]
    for (name, model), args in cases:
        if "leak" in name:
            with pytest.raises(AssertionError, match="changing segment"):
                testing.check_segment_independence(model, *args)
        else:
            testing.check_segment_independence(model, *args)
            testing.check_matches_per_segment(model, *args)


def test_check_segment_independence_takes_token_ids():
    emb = torch.nn.Embedding(50, 16)
    ids = torch.randint(0, 50, (20,))
    with torch.no_grad():
        testing.check_segment_independence(lambda t, cu: good_model(emb(t), cu), ids, CU)
        testing.check_matches_per_segment(lambda t, cu: good_model(emb(t), cu), ids, CU)
        with pytest.raises(AssertionError, match=r"changing segment \d+ \(random\)"):
            testing.check_segment_independence(lambda t, cu: mean_leak(emb(t), cu), ids, CU)


@pytest.mark.cuda
@settings(max_examples=60, deadline=None)
@given(inputs=testing.attention_inputs(device="cuda", dtypes=(torch.bfloat16, torch.float16)))
def test_cuda_op_matches_the_reference_within_the_public_tolerances(inputs):
    """The dtype-aware tolerances hold for the FlashInfer kernels, not only the CPU one."""
    out = ragged_compile.ragged_attention(**inputs)
    testing.assert_matches_reference(out, **inputs)
