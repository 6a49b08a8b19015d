"""Property tests of ``ragged_attention`` (CPU kernel) against a float64 oracle.

Run with ``HYPOTHESIS_PROFILE=ci`` (bounded, derandomized), ``dev`` (default)
or ``long`` (soak); see the root ``conftest.py``.
"""

from __future__ import annotations

import math

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import ragged_compile
from ragged_compile.reference import reference_attention
from ragged_compile.testing import (
    AttentionCase,
    Layout,
    assert_matches_reference,
    attention_cases,
    head_configs,
    scaled_examples,
    tiny_segment_lengths,
)

# (rtol, atol at unit logit scale). The CPU kernel accumulates in float32
# (float64 for float64 inputs) and rounds once to the output dtype, so
#   * float32/float64: error comes from the logits, which grows with their size;
#     atol is multiplied by (1 + scale * sqrt(D)) -- the typical logit magnitude
#     for standard-normal q and k -- and is ~1e-5 at the default scale.
#   * bfloat16/float16: one final rounding, at most half an ulp = 2**-8 / 2**-11
#     of the value; rtol is twice that, atol covers float32 accumulation.
TOLERANCES = {
    torch.float64: (1e-12, 1e-13),
    torch.float32: (1e-5, 4e-6),
    torch.bfloat16: (2**-7, 1e-5),
    torch.float16: (2**-10, 1e-5),
}


def tolerance(case: AttentionCase) -> tuple[float, float]:
    rtol, atol = TOLERANCES[case.dtype]
    return rtol, atol * (1 + case.effective_scale * math.sqrt(case.head_dim))


def assert_matches(out: torch.Tensor, kwargs: dict, case: AttentionCase) -> None:
    rtol, atol = tolerance(case)
    assert_matches_reference(out, rtol=rtol, atol=atol, **kwargs)


def _case(q_lens, kv_lens=None, hq=4, hkv=2, d=16, dtype=torch.float32, causal=False, **kw):
    cross = kv_lens is not None
    layout = Layout(q_lens, kv_lens if cross else q_lens, cross)
    kw.setdefault("scale", None)
    kw.setdefault("seed", 1)
    return AttentionCase(layout, hq, hkv, d, dtype, causal, **kw)


# Hand-picked cases every profile runs, whatever the random draws cover.
EXAMPLES = [
    _case([3, 0, 1, 5], [0, 4, 1, 7], causal=True),  # empty on either side, Lq < Lk, Lq > Lk
    _case([9, 1, 0], [2, 1, 0], causal=True, d=72, dtype=torch.bfloat16),  # rows seeing no key
    _case([5, 1, 7], hq=8, hkv=1, d=80, dtype=torch.float16, causal=True),  # MQA, padded dim
    _case([6, 2], hq=8, hkv=2, d=96, fused_qkv=True, index_dtype=torch.int64),  # GQA 4:1, views
    _case([1] * 300 + [0] * 20, hq=2, hkv=1, d=8, causal=True),  # many one-token segments
    _case([0, 0, 0]),  # all empty
    _case([]),  # n = 0
    _case([17, 33], hq=2, hkv=2, d=256, dtype=torch.float64, scale=0.02),
]


def _record(case: AttentionCase) -> None:
    """Coverage events (shown by ``--hypothesis-show-statistics``)."""
    event(f"dtype {str(case.dtype).removeprefix('torch.')}")
    event("cross" if case.layout.cross else "self")
    event("causal" if case.causal else "not causal")
    event(f"GQA ratio {case.hq // case.hkv}")
    event(f"head_dim {case.head_dim}")
    longest = max(case.q_lengths + case.k_lengths, default=0)
    event("n = 0" if case.n == 0 else f"n <= {1 << max(0, case.n - 1).bit_length()}")
    event(f"longest segment <= {1 << max(0, longest - 1).bit_length()}")


def _with_examples(test):
    for case in EXAMPLES:
        test = example(case=case)(test)
    return test


# The float64 oracle is a Python loop over segments (1-3 ms each on CPU): floods
# of tiny segments are the job of the last test, with fewer examples.
@_with_examples
@given(case=attention_cases(max_tiny_segments=0))
def test_matches_float64_reference(case: AttentionCase):
    _record(case)
    x = case.tensors()
    out = ragged_compile.ragged_attention(**case.call_kwargs(x))
    assert out.shape == x.q.shape and out.dtype == case.dtype and out.device == x.q.device
    assert bool(torch.isfinite(out).all()), f"non-finite output for {case!r}"
    blind = case.no_key_rows()
    assert bool((out[blind] == 0).all()), "rows that see no key must be exactly zero"
    assert_matches(out, case.call_kwargs(x), case)


def _segment_masks(lengths, i):
    mask = torch.zeros(sum(lengths), dtype=torch.bool)
    start = sum(lengths[:i])
    mask[start : start + lengths[i]] = True
    return mask


@settings(max_examples=scaled_examples(0.5, minimum=10))
@given(
    case=attention_cases(min_segments=2, max_tiny_segments=0),
    data=st.data(),
    fill=st.sampled_from(["random", "nan", "inf", "huge"]),
)
def test_segment_output_depends_only_on_its_own_inputs(case: AttentionCase, data, fill):
    i = data.draw(st.integers(0, case.n - 1), label="segment")
    x = case.tensors()
    out = ragged_compile.ragged_attention(**case.call_kwargs(x))

    mine_q = _segment_masks(case.q_lengths, i)
    mine_k = _segment_masks(case.k_lengths, i)
    g = torch.Generator().manual_seed(case.seed + 1)

    def perturb(t, mine):
        t = t.clone()
        if fill == "random":
            noise = 3 * torch.randn(t.shape, generator=g).to(t.dtype)
        else:
            value = {"nan": math.nan, "inf": math.inf, "huge": 1e4}[fill]
            noise = torch.full(t.shape, value, dtype=t.dtype)
        t[~mine] = noise[~mine]
        return t

    x2 = x._replace(q=perturb(x.q, mine_q), k=perturb(x.k, mine_k), v=perturb(x.v, mine_k))
    out2 = ragged_compile.ragged_attention(**case.call_kwargs(x2))
    assert torch.equal(out[mine_q], out2[mine_q]), (
        f"segment {i} changed when only other segments' q/k/v changed ({fill}) for {case!r}"
    )

    # The same segment alone, as a batch of one, agrees up to rounding.
    if case.q_lengths[i]:
        alone = ragged_compile.ragged_attention(
            x.q[mine_q],
            x.k[mine_k],
            x.v[mine_k],
            torch.tensor([0, case.q_lengths[i]], dtype=case.index_dtype),
            torch.tensor([0, case.k_lengths[i]], dtype=case.index_dtype),
            causal=case.causal,
            scale=case.scale,
        )
        rtol, atol = tolerance(case)
        torch.testing.assert_close(
            alone.double(), out[mine_q].double(), rtol=rtol, atol=2 * atol, msg=repr(case)
        )


@st.composite
def tiny_cases(draw):
    q_lens = draw(tiny_segment_lengths(1000, 4096))
    cross = draw(st.booleans())
    kv_lens = draw(tiny_segment_lengths(len(q_lens), len(q_lens))) if cross else q_lens
    hq, hkv = draw(head_configs(max_kv_heads=2, max_q_heads=4))
    return AttentionCase(
        Layout(q_lens, kv_lens, cross),
        hq,
        hkv,
        draw(st.sampled_from((8, 16, 32))),
        draw(st.sampled_from((torch.float32, torch.float64))),
        draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        seed=draw(st.integers(0, 2**31 - 1)),
        index_dtype=draw(st.sampled_from((torch.int32, torch.int64))),
    )


@settings(max_examples=scaled_examples(0.02, minimum=4))
@given(case=tiny_cases())
def test_reference_and_op_match_dense_on_thousands_of_tiny_segments(case: AttentionCase):
    x = case.tensors()
    out = reference_attention(
        x.q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, case.causal, case.effective_scale
    )
    assert bool((out[case.no_key_rows()] == 0).all())
    assert_matches(out, case.call_kwargs(x), case)
    # ... and so does the public op on the same layout.
    op_out = ragged_compile.ragged_attention(**case.call_kwargs(x))
    assert_matches(op_out, case.call_kwargs(x), case)
