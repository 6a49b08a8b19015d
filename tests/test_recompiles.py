"""Shapes and recompiles: new layouts reuse the compiled graph and are never
specialised silently (compiled results are checked against a dense per-sample
run on every layout)."""

from __future__ import annotations

import pytest
import torch
from _njt_models import CrossAttentionBlock, TutorialStyleMHA, dense_reference, encoder, njt, random_layouts
from torch._inductor import config as inductor_config

import ragged_compile

E, H = 32, 4
counters = torch._dynamo.utils.counters


@pytest.fixture(scope="module")
def compiled_encoder():
    torch._dynamo.reset()
    counters.clear()
    model = encoder(E, H)
    with inductor_config.patch(force_disable_caches=True), torch.no_grad():
        compiled = ragged_compile.compile(model, fullgraph=True)
        compiled(njt([5, 3, 9], E))  # warm-up
        yield model, compiled


def _close(out, ref):
    torch.testing.assert_close(out.values(), ref, atol=2e-5, rtol=1e-4)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_fifty_random_layouts_compile_at_most_two_graphs(compiled_encoder):
    model, compiled = compiled_encoder
    layouts = random_layouts(50, seed=1)
    assert any(1 in lens for lens in layouts) and any(set(lens) == {1} for lens in layouts)
    assert len({len(lens) for lens in layouts}) > 3 and len({sum(lens) for lens in layouts}) > 20
    with torch.no_grad():
        for lens in layouts:
            x = njt(lens, E)
            _close(compiled(x), dense_reference(model, x))
    assert _graphs() <= 2, f"{_graphs()} graphs for 51 layouts"
    assert not counters["graph_break"]


def test_new_max_seqlen_and_total_reuse_the_graph_and_stay_correct(compiled_encoder):
    """pytorch#124205: a graph must not bake in the cached max seqlen or the total."""
    model, compiled = compiled_encoder
    with torch.no_grad():
        x = njt([4, 6, 3], E)  # max 6, total 13
        _close(compiled(x), dense_reference(model, x))
        before = (_graphs(), counters["stats"]["calls_captured"])
        x = njt([2, 31, 17, 9], E)  # max 31, total 59, another batch size
        assert x._maybe_max_seqlen == 31
        _close(compiled(x), dense_reference(model, x))
        x = njt([40, 40], E)  # max 40, total 80
        _close(compiled(x), dense_reference(model, x))
    assert (_graphs(), counters["stats"]["calls_captured"]) == before, "recompiled"


def test_cross_attention_layouts_share_one_graph():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = CrossAttentionBlock(E, H).eval()
    compiled = ragged_compile.compile(block, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for i, q_lens in enumerate(random_layouts(12, seed=2)):
            kv_lens = random_layouts(1, seed=100 + i)[0][: len(q_lens)]
            kv_lens += [3] * (len(q_lens) - len(kv_lens))
            q_lens = [1] * len(q_lens) if i % 3 == 0 else q_lens  # one query per sample
            x, memory = njt(q_lens, E), njt(kv_lens, E)
            torch.testing.assert_close(
                compiled(x, memory).values(), dense_reference(block, x, memory), atol=2e-5, rtol=1e-4
            )
    assert _graphs() <= 2


def test_separately_built_qkv_layouts_share_one_graph():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    mha = TutorialStyleMHA(E, E, E, E, H).eval()
    compiled = ragged_compile.compile(mha, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for lens in random_layouts(12, seed=3):
            q, k, v = (njt(lens, E, seed=s) for s in (1, 2, 3))
            torch.testing.assert_close(
                compiled(q, k, v).values(), dense_reference(mha, q, k, v), atol=2e-5, rtol=1e-4
            )
    assert _graphs() <= 2


def test_dynamic_false_is_respected():
    """dynamic=False asks for static shapes: we mark nothing, so layouts recompile."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = CrossAttentionBlock(E, H).eval()
    compiled = ragged_compile.compile(block, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        for q_lens, kv_lens in (([1, 2], [3, 4]), ([2, 3, 1], [5, 2, 2])):
            compiled(njt(q_lens, E), njt(kv_lens, E))
    assert _graphs() == 2
