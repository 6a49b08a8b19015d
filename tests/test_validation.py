"""Bad input raises ValueError/TypeError whose message names the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ragged_compile import ragged_attention

OP = torch.ops.ragged_compile.ragged_attention.default


def good():
    """A valid cross-attention call: 3 segments, q 9 tokens x 4 heads, k/v 11 x 2, D 16."""
    g = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(9, 4, 16, generator=g),
        k=torch.randn(11, 2, 16, generator=g),
        v=torch.randn(11, 2, 16, generator=g),
        cu_seqlens_q=torch.tensor([0, 3, 4, 9], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 5, 11], dtype=torch.int32),
    )


def _nested_q(a):
    return torch.nested.nested_tensor(
        [torch.randn(3, 4, 16), torch.randn(1, 4, 16), torch.randn(5, 4, 16)], layout=torch.jagged
    )


# (id, change to the good arguments, exception type, regex the message must match)
BAD = [
    ("cu_q-2d", dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"][None]), ValueError,
     r"cu_seqlens_q must be 1-D"),
    ("cu_k-0d", dict(cu_seqlens_k=lambda a: torch.tensor(0, dtype=torch.int32)), ValueError,
     r"cu_seqlens_k must be 1-D"),
    ("cu_q-float", dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"].float()), TypeError,
     r"cu_seqlens_q must have dtype int32 or int64"),
    ("cu_k-int16", dict(cu_seqlens_k=lambda a: a["cu_seqlens_k"].short()), TypeError,
     r"cu_seqlens_k must have dtype int32 or int64"),
    ("cu_q-list", dict(cu_seqlens_q=lambda a: [0, 3, 4, 9]), TypeError,
     r"cu_seqlens_q must be a torch.Tensor"),
    ("cu_q-empty", dict(cu_seqlens_q=lambda a: torch.zeros(0, dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must hold at least one offset"),
    ("cu_q-first-not-0", dict(cu_seqlens_q=lambda a: torch.tensor([1, 3, 4, 9])), ValueError,
     r"cu_seqlens_q\[0\] must be 0"),
    ("cu_k-first-not-0", dict(cu_seqlens_k=lambda a: torch.tensor([2, 5, 5, 11])), ValueError,
     r"cu_seqlens_k\[0\] must be 0"),
    ("cu_q-decreasing", dict(cu_seqlens_q=lambda a: torch.tensor([0, 5, 4, 9])), ValueError,
     r"cu_seqlens_q must be non-decreasing.*cu_seqlens_q\[2\]=4 < cu_seqlens_q\[1\]=5"),
    ("cu_k-decreasing", dict(cu_seqlens_k=lambda a: torch.tensor([0, 6, 5, 11])), ValueError,
     r"cu_seqlens_k must be non-decreasing"),
    ("cu_q-last-not-Tq", dict(cu_seqlens_q=lambda a: torch.tensor([0, 3, 4, 8])), ValueError,
     r"cu_seqlens_q\[-1\] is 8 but q holds 9 tokens"),
    ("cu_q-last-too-big", dict(cu_seqlens_q=lambda a: torch.tensor([0, 3, 4, 10])), ValueError,
     r"cu_seqlens_q\[-1\] is 10 but q holds 9 tokens"),
    ("cu_k-last-not-Tk", dict(cu_seqlens_k=lambda a: torch.tensor([0, 5, 5, 10])), ValueError,
     r"cu_seqlens_k\[-1\] is 10 but k/v holds 11 tokens"),
    ("segment-count-mismatch", dict(cu_seqlens_k=lambda a: torch.tensor([0, 5, 11])), ValueError,
     r"cu_seqlens_q has 3 segments but cu_seqlens_k has 2"),
    ("hq-not-multiple-of-hkv",
     dict(k=lambda a: torch.randn(11, 3, 16), v=lambda a: torch.randn(11, 3, 16)), ValueError,
     r"q heads \(4\) must be a positive multiple of k/v heads \(3\)"),
    ("k-dtype", dict(k=lambda a: a["k"].double()), TypeError,
     r"q, k and v must share one dtype.*k=torch.float64"),
    ("v-dtype", dict(v=lambda a: a["v"].half()), TypeError,
     r"q, k and v must share one dtype.*v=torch.float16"),
    ("q-integer", dict(q=lambda a: a["q"].int()), TypeError,
     r"q must be a floating-point tensor"),
    ("cu_q-device", dict(cu_seqlens_q=lambda a: a["cu_seqlens_q"].to("meta")), ValueError,
     r"cu_seqlens_q is on meta but q is on cpu"),
    ("cu_k-device", dict(cu_seqlens_k=lambda a: a["cu_seqlens_k"].to("meta")), ValueError,
     r"cu_seqlens_k is on meta but q is on cpu"),
    ("k-device", dict(k=lambda a: a["k"].to("meta")), ValueError,
     r"q, k and v must be on one device.*k=meta"),
    ("head-dim-k", dict(k=lambda a: a["k"][..., :8]), ValueError,
     r"q, k and v must share head_dim, got q=16, k=8, v=16"),
    ("head-dim-v", dict(v=lambda a: torch.randn(11, 2, 32)), ValueError,
     r"q, k and v must share head_dim, got q=16, k=16, v=32"),
    ("kv-token-mismatch", dict(v=lambda a: a["v"][:10]), ValueError,
     r"k and v must have the same \[tokens, heads\]"),
    ("kv-head-mismatch", dict(v=lambda a: a["v"][:, :1]), ValueError,
     r"k and v must have the same \[tokens, heads\]"),
    ("q-2d", dict(q=lambda a: a["q"][:, 0]), ValueError,
     r"q must be packed as \[tokens, heads, head_dim\], got shape \(9, 16\)"),
    ("k-4d", dict(k=lambda a: a["k"][None]), ValueError,
     r"k must be packed as \[tokens, heads, head_dim\]"),
    ("q-nested", dict(q=_nested_q), TypeError, r"q is a nested tensor"),
    ("q-not-tensor", dict(q=lambda a: a["q"].tolist()), TypeError, r"q must be a torch.Tensor"),
    ("scale-nan", dict(scale=math.nan), ValueError, r"scale must be finite, got nan"),
    ("scale-inf", dict(scale=math.inf), ValueError, r"scale must be finite, got inf"),
    ("scale-neg-inf", dict(scale=-math.inf), ValueError, r"scale must be finite"),
    ("scale-str", dict(scale="0.1"), TypeError, r"scale must be a float or None"),
    ("scale-bool", dict(scale=True), TypeError, r"scale must be a float or None"),
    ("scale-tensor", dict(scale=torch.tensor(0.1)), TypeError, r"scale must be a float or None"),
    ("causal-int", dict(causal=1), TypeError, r"causal must be a bool"),
    ("causal-str", dict(causal="yes"), TypeError, r"causal must be a bool"),
    ("causal-none", dict(causal=None), TypeError, r"causal must be a bool"),
    ("max_seqlen_q-too-small", dict(max_seqlen_q=4), ValueError,
     r"cu_seqlens_q has 5 tokens, more than max_seqlen_q=4"),
    ("max_seqlen_k-too-small", dict(max_seqlen_k=5), ValueError,
     r"cu_seqlens_k has 6 tokens, more than max_seqlen_k=5"),
    ("max_seqlen_q-str", dict(max_seqlen_q="5"), TypeError, r"max_seqlen_q must be an int"),
    ("max_seqlen_k-float", dict(max_seqlen_k=6.0), TypeError, r"max_seqlen_k must be an int"),
]


@pytest.mark.parametrize("change,exc,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(change, exc, pattern):
    args = good()
    ragged_attention(**args)  # the unchanged call is fine
    for key, value in change.items():
        args[key] = value(args) if callable(value) else value
    with pytest.raises(exc, match=pattern):
        ragged_attention(**args)


def test_self_layout_max_seqlen_names_q():
    a = good()
    with pytest.raises(ValueError, match=r"more than max_seqlen_q=4"):
        ragged_attention(a["q"], a["q"], a["q"], a["cu_seqlens_q"], max_seqlen_q=4)


def test_accepted_number_types():
    a = good()
    base = ragged_attention(**a, scale=0.3, max_seqlen_q=5, max_seqlen_k=6)
    # numpy scalars are numbers: accepted and equal to the Python ones.
    same = ragged_attention(**a, scale=np.float64(0.3), max_seqlen_q=np.int64(5), max_seqlen_k=6)
    assert torch.equal(base, same)
    close = ragged_attention(**a, scale=np.float32(0.3))
    torch.testing.assert_close(base, close)
    ints = ragged_attention(**a, scale=1)
    torch.testing.assert_close(ints, ragged_attention(**a, scale=1.0), rtol=0, atol=0)


# Value errors are also raised by the custom op itself (the CPU kernel reads the
# offsets), so calls that skip the public wrapper, and compiled graphs, are checked.
RAW_BAD = [
    ("cu_q-first-not-0", "cu_seqlens_q", torch.tensor([1, 3, 4, 9]), r"cu_seqlens_q\[0\] must be 0"),
    ("cu_k-decreasing", "cu_seqlens_k", torch.tensor([0, 6, 5, 11]), r"cu_seqlens_k must be non-decreasing"),
    ("cu_q-last", "cu_seqlens_q", torch.tensor([0, 3, 4, 8]), r"cu_seqlens_q\[-1\] is 8"),
    ("cu_k-last", "cu_seqlens_k", torch.tensor([0, 5, 5, 12]), r"cu_seqlens_k\[-1\] is 12"),
]


@pytest.mark.parametrize("key,value,pattern", [b[1:] for b in RAW_BAD], ids=[b[0] for b in RAW_BAD])
def test_bad_offsets_raw_op(key, value, pattern):
    a = good()
    a[key] = value
    with pytest.raises(ValueError, match=pattern):
        OP(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], False, 0.25)


@pytest.mark.parametrize("key,value,pattern", [b[1:] for b in RAW_BAD], ids=[b[0] for b in RAW_BAD])
def test_bad_offsets_under_compile(key, value, pattern):
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: ragged_attention(**kw) * 2, backend="eager", fullgraph=True)
    a = good()
    compiled(**a)  # compiles with good offsets
    a[key] = value
    with pytest.raises(ValueError, match=pattern):
        compiled(**a)
    torch._dynamo.reset()


def test_metadata_error_under_compile_keeps_message():
    torch._dynamo.reset()
    a = good()
    a["k"] = torch.randn(11, 3, 16)
    a["v"] = torch.randn(11, 3, 16)
    pattern = r"q heads \(4\) must be a positive multiple of k/v heads \(3\)"
    # Without fullgraph Dynamo falls back to eager: the original exception.
    with pytest.raises(ValueError, match=pattern):
        torch.compile(lambda **kw: ragged_attention(**kw), backend="eager")(**a)
    torch._dynamo.reset()
    # With fullgraph Dynamo wraps it, but the message is still in the error.
    with pytest.raises(Exception, match=pattern):
        torch.compile(lambda **kw: ragged_attention(**kw), backend="eager", fullgraph=True)(**a)
    torch._dynamo.reset()
