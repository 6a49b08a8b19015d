# test_segments.py -- needs only: pip install "ragged-compile[test]"
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import nn

import ragged_compile
from ragged_compile import testing


class PackedEncoder(nn.Module):
    """A packed model: x [T, E] holds n segments back to back, cu_seqlens [n + 1]."""

    def __init__(self, E=64, heads=4, leak=False):
        super().__init__()
        self.heads, self.leak = heads, leak
        self.norm = nn.LayerNorm(E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x, cu_seqlens):
        h = self.norm(x)
        q, k, v = self.qkv(h).unflatten(-1, (3, self.heads, -1)).unbind(1)
        a = ragged_compile.ragged_attention(q, k, v, cu_seqlens, causal=True)
        x = x + self.out(a.flatten(1))
        if self.leak:  # planted bug: a "sequence mean" taken over the whole packed batch
            x = x + x.mean(0)
        return x


class NJTEncoder(nn.Module):
    """The same block written on a jagged nested tensor [B, j, E] and SDPA."""

    def __init__(self, E=64, heads=4, leak=False):
        super().__init__()
        self.heads, self.leak = heads, leak
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        with ragged_compile.enable():  # NJT SDPA on ragged_compile's op (CPU and CUDA)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).flatten(-2))
        if self.leak:  # planted bug: statistics over the packed values of every sequence
            x = torch.nested.nested_tensor_from_jagged(x.values() - x.values().mean(0), x.offsets())
        return x


torch.manual_seed(0)
MODELS = {
    "packed": PackedEncoder().eval(),
    "packed_planted_leak": PackedEncoder(leak=True).eval(),  # expect these tests to fail
}
NJT_MODELS = {
    "njt": NJTEncoder().eval(),
    "njt_planted_leak": NJTEncoder(leak=True).eval(),  # expect these tests to fail
}
LAYOUTS = testing.layouts(max_segments=16, max_tokens=256)  # empty, 1-token, uniform, long ...


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=25, deadline=None)
@given(layout=LAYOUTS)
def test_packed_model_keeps_segments_apart(name, layout):
    x = torch.randn(layout.total_q, 64)
    # perturb, then NaN/Inf-poison one segment at a time: no other output may move
    testing.check_segment_independence(MODELS[name], x, layout.cu_seqlens_q)
    # the packed run equals the model run on each segment alone
    testing.check_matches_per_segment(MODELS[name], x, layout.cu_seqlens_q)


@pytest.mark.parametrize("name", NJT_MODELS)
@settings(max_examples=25, deadline=None)
@given(layout=LAYOUTS)
def test_njt_model_keeps_segments_apart(name, layout):
    x = torch.nested.nested_tensor_from_jagged(torch.randn(layout.total_q, 64), layout.cu_seqlens_q.long())
    testing.check_segment_independence(NJT_MODELS[name], x)
    testing.check_matches_per_segment(NJT_MODELS[name], x)
