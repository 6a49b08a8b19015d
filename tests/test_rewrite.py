"""NJT SDPA -> ragged_compile's op: ragged_compile.enable() and ragged_compile.compile().

Models are written as users write them (tests/_njt_models.py) and checked
against a per-sample dense run of the same module.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nested._internal.ops as njt_ops
import torch.nn.functional as F
from _njt_models import (
    CrossAttentionBlock,
    SelfAttentionLayer,
    TutorialStyleMHA,
    dense_reference,
    encoder,
    njt,
)
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import ragged_compile
from ragged_compile import compiler, logs, njt as rc_njt

E, H = 32, 4
ATOL = 2e-5
# Generated-code names of every stock attention path that must be gone.
STOCK_ATTENTION = (
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_scaled_dot_product",  # _scaled_dot_product_attention_math / _flash_attention / ...
    "_nested_tensor_from_tensor_list",
    "_cudnn_attention_forward",
)
RAGGED_CALL = "torch.ops.ragged_compile.ragged_attention.default("


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(force_disable_caches=True), torch.no_grad():
        yield


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    values = out.values() if out.is_nested else out
    torch.testing.assert_close(values, ref, atol=ATOL, rtol=1e-4)


def _assert_only_ragged(code: str, expected_calls: int) -> None:
    assert code.count(RAGGED_CALL) == expected_calls, code
    for name in STOCK_ATTENTION:
        assert name not in code, f"{name} left in the compiled graph"


# ---------------------------------------------------------------- eager


@pytest.mark.parametrize(
    "layer",
    [
        pytest.param(lambda: SelfAttentionLayer(E, H), id="self"),
        pytest.param(lambda: SelfAttentionLayer(E, H, causal=True), id="causal"),
        pytest.param(lambda: SelfAttentionLayer(E, H, kv_heads=2), id="gqa"),
        pytest.param(lambda: SelfAttentionLayer(E, H, kv_heads=1, causal=True), id="mqa-causal"),
    ],
)
def test_eager_enable_matches_dense(layer):
    torch.manual_seed(0)
    model = layer().eval()
    x = njt([5, 1, 9, 3], E)
    with ragged_compile.enable():
        out = model(x)
    _close(out, dense_reference(model, x))


def test_eager_stock_fails_where_enable_works():
    """Stock NJT SDPA on CPU rejects causal and GQA; enable() runs them."""
    torch.manual_seed(0)
    x = njt([4, 2], E)
    for model in (SelfAttentionLayer(E, H, causal=True), SelfAttentionLayer(E, H, kv_heads=2)):
        with pytest.raises(RuntimeError):
            model(x)
        with ragged_compile.enable():
            _close(model(x), dense_reference(model, x))


def test_eager_cross_attention_one_query_per_sample():
    torch.manual_seed(0)
    block = CrossAttentionBlock(E, H).eval()
    x, memory = njt([1, 1, 1, 1], E), njt([6, 1, 3, 11], E)
    with ragged_compile.enable():
        out = block(x, memory)
    _close(out, dense_reference(block, x, memory))


def test_eager_uses_our_op_and_passes_offsets_as_they_are(monkeypatch):
    seen = []
    real = torch.ops.ragged_compile.ragged_attention

    def spy(q, k, v, cu_q, cu_k, causal, scale):
        seen.append((cu_q, cu_k, causal, scale))
        return real(q, k, v, cu_q, cu_k, causal, scale)

    monkeypatch.setattr(torch.ops.ragged_compile, "ragged_attention", spy)
    model = encoder(E, H)
    x = njt([3, 4, 5], E)
    with ragged_compile.enable():
        model(x)
    assert [s[2] for s in seen] == [False, True, False]
    for cu_q, cu_k, _, scale in seen:
        assert cu_q is x.offsets() and cu_k is x.offsets()  # same tensor object, no cast
        assert scale == pytest.approx((E // H) ** -0.5)


# ---------------------------------------------------------------- compiled


def test_compiled_encoder_matches_dense_one_graph_only_our_op():
    model = encoder(E, H)
    compiled = ragged_compile.compile(model, fullgraph=True)
    x = njt([5, 3, 9], E)
    out, codes = run_and_get_code(compiled, x)
    _close(out, dense_reference(model, x))
    code = "\n".join(codes)
    _assert_only_ragged(code, expected_calls=3)
    assert "check_same_segments" not in code  # q, k, v share x's offsets: nothing to check
    for lengths in ([2, 7, 1, 4], [8, 8], [1, 2, 3, 4, 5, 6]):
        x = njt(lengths, E)
        _close(compiled(x), dense_reference(model, x))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compiled_cross_attention_matches_dense(caplog):
    torch.manual_seed(0)
    block = CrossAttentionBlock(E, H).eval()
    compiled = ragged_compile.compile(block, fullgraph=True)
    x, memory = njt([1, 1, 1], E), njt([4, 9, 2], E)
    with caplog.at_level(logging.INFO, "ragged_compile"):
        out, codes = run_and_get_code(compiled, x, memory)
    logged = [m for m in (r.getMessage() for r in caplog.records) if "-> ragged_attention" in m]
    assert len(logged) == 1 and "cross-attention" in logged[0] and "[compile 0/0]" in logged[0]
    _close(out, dense_reference(block, x, memory))
    _assert_only_ragged("\n".join(codes), expected_calls=1)
    for q_lens, kv_lens in (([1, 1, 1, 1], [3, 1, 8, 2]), ([3, 5], [7, 1]), ([2, 2, 6], [5, 5, 1])):
        x, memory = njt(q_lens, E), njt(kv_lens, E)
        _close(compiled(x, memory), dense_reference(block, x, memory))
    assert not torch._dynamo.utils.counters["graph_break"]


def test_tutorial_style_mha_separate_qkv_causal():
    """q, k, v built as three nested tensors (three offsets tensors), is_causal=True."""
    torch.manual_seed(0)
    mha = TutorialStyleMHA(E, E, E, E, H).eval()
    lengths = [3, 12, 1, 6]
    q, k, v = (njt(lengths, E, seed=s) for s in (1, 2, 3))
    with ragged_compile.enable():
        eager = mha(q, k, v)
    ref = dense_reference(mha, q, k, v)
    _close(eager, ref)
    compiled = ragged_compile.compile(mha, fullgraph=True)
    out, codes = run_and_get_code(compiled, q, k, v)
    _close(out, ref)
    code = "\n".join(codes)
    _assert_only_ragged(code, expected_calls=1)
    assert "check_same_segments" in code  # lengths are compared at run time, not assumed


def test_causal_with_different_lengths_raises_clear_error():
    """SDPA's causal mask is top-left, ours bottom-right: refuse rather than differ."""
    torch.manual_seed(0)
    mha = TutorialStyleMHA(E, E, E, E, H).eval()
    q = njt([3, 4], E, seed=1)
    k, v = njt([4, 4], E, seed=2), njt([4, 4], E, seed=3)
    with ragged_compile.enable(), pytest.raises(ValueError, match="top-left"):
        mha(q, k, v)
    compiled = ragged_compile.compile(mha, fullgraph=True)
    compiled(njt([2, 5], E, seed=1), njt([2, 5], E, seed=2), njt([2, 5], E, seed=3))
    with pytest.raises(ValueError, match="top-left"):
        compiled(q, k, v)


def test_key_value_length_mismatch_raises():
    torch.manual_seed(0)
    mha = TutorialStyleMHA(E, E, E, E, H).eval()
    q, k, v = njt([3, 4], E, seed=1), njt([3, 4], E, seed=2), njt([4, 3], E, seed=3)
    with ragged_compile.enable(), pytest.raises(ValueError, match="key and value"):
        mha(q, k, v)


# ---------------------------------------------------------------- fall back to stock


def _sdpa_njt(lengths=(3, 5), heads=H, kv_heads=H, transpose=True, requires_grad=False, dtype=torch.float32):
    D = 8
    x = njt(list(lengths), heads * D).to(dtype)
    q = x.unflatten(-1, [heads, D])
    kv = njt(list(lengths), kv_heads * D, seed=5).to(dtype)
    kv = torch.nested.nested_tensor_from_jagged(kv.values(), x.offsets()).unflatten(-1, [kv_heads, D])
    if transpose:
        q, kv = q.transpose(1, 2), kv.transpose(1, 2)
    if requires_grad:
        q = q.detach().requires_grad_()
    return q, kv


def _stock_reasons(caplog):
    return [r.getMessage() for r in caplog.records if "stock NJT SDPA" in r.getMessage()]


def test_attn_mask_keeps_stock_error(caplog):
    q, kv = _sdpa_njt()
    with caplog.at_level(logging.DEBUG, "ragged_compile"), ragged_compile.enable():
        with pytest.raises(ValueError, match="Masks are not yet supported"):
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=torch.ones(2, 2, dtype=torch.bool))
    assert any("attn_mask" in r for r in _stock_reasons(caplog))


def test_dropout_on_cpu_runs_padded_sdpa_with_a_warning(caplog, monkeypatch):
    """Our op's dropout kernel is CUDA's; on CPU (where stock cannot run most of
    these) the call runs dense SDPA with dropout over padded segments, and says so once."""
    calls = []
    monkeypatch.setattr(torch.ops.ragged_compile, "ragged_attention", lambda *a: calls.append(a))
    monkeypatch.setattr(logs, "_seen", set())
    q, kv = _sdpa_njt()
    with caplog.at_level(logging.DEBUG, "ragged_compile"), ragged_compile.enable():
        out = F.scaled_dot_product_attention(q, kv, kv, dropout_p=0.5)
        F.scaled_dot_product_attention(q, kv, kv, dropout_p=0.5)
    assert out.is_nested and not calls
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "ragged_compile"]
    assert len(warned) == 1 and "dropout_p=0.5" in warned[0]


def test_requires_grad_on_cpu_runs_our_op_with_exact_gradients():
    # On CPU our op trains (exact reference backward); gradients equal stock's.
    q, kv = _sdpa_njt(requires_grad=True)
    with torch.enable_grad():
        stock = F.scaled_dot_product_attention(q, kv, kv)
        (stock.values() ** 2).sum().backward()
        want = q.grad.clone()
        q.grad = None
        with ragged_compile.enable():
            ours = F.scaled_dot_product_attention(q, kv, kv)
        (ours.values() ** 2).sum().backward()
    torch.testing.assert_close(ours.values(), stock.values())
    torch.testing.assert_close(q.grad, want)


def test_compiled_training_step_on_cpu_matches_eager():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 48)

    def step(x):
        q, k, v = (t.unflatten(-1, [2, 8]).transpose(1, 2) for t in layer(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (out.transpose(1, 2).values() ** 2).sum()

    x = njt([3, 7, 1], 16)
    with torch.enable_grad():  # the module's fixture runs tests under no_grad
        with ragged_compile.enable():
            step(x).backward()
        want = layer.weight.grad.clone()
        layer.weight.grad = None
        ragged_compile.compile(step, fullgraph=True)(x).backward()
    torch.testing.assert_close(layer.weight.grad, want, atol=1e-5, rtol=1e-4)


def test_missing_transpose_falls_back_with_warning(caplog, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.ops.ragged_compile, "ragged_attention", lambda *a: calls.append(a))
    monkeypatch.setattr(logs, "_seen", set())
    q, kv = _sdpa_njt(transpose=False)
    with caplog.at_level(logging.WARNING, "ragged_compile"), ragged_compile.enable():
        expected_stock = F.scaled_dot_product_attention(q, kv, kv)
    assert not calls
    assert any(r.levelno == logging.WARNING and "transpose(1, 2)" in r.getMessage() for r in caplog.records)
    # Same as stock outside the context: the fall-back changes nothing.
    _close(expected_stock, F.scaled_dot_product_attention(q, kv, kv).values())


def test_gqa_without_enable_gqa_keeps_stock_error():
    q, kv = _sdpa_njt(kv_heads=2)
    with ragged_compile.enable(), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, kv, kv)


def test_unsupported_dtype_falls_back(caplog):
    q, kv = _sdpa_njt()
    q, kv = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
    with caplog.at_level(logging.DEBUG, "ragged_compile"), ragged_compile.enable():
        with pytest.raises(Exception):
            F.scaled_dot_product_attention(q, kv, kv)
    assert any("not supported" in r for r in _stock_reasons(caplog))


# ---------------------------------------------------------------- state and API


def test_enable_is_per_context_and_swaps_nothing():
    class UserPass:  # a plain callable the user already had in the slot
        def __call__(self, graph):
            pass

    user_pass = UserPass()
    with ragged_compile.enable():
        pass
    handler = njt_ops.jagged_scaled_dot_product_attention
    assert handler is rc_njt._ragged_sdpa  # installed once, calls stock outside enable()
    with inductor_config.patch(post_grad_custom_post_pass=user_pass):
        with ragged_compile.enable():
            assert inductor_config.post_grad_custom_post_pass is user_pass  # eager-only
            assert ragged_compile.njt.is_enabled()
            with ragged_compile.enable():  # nesting
                assert ragged_compile.njt.is_enabled()
            assert ragged_compile.njt.is_enabled()
        assert not ragged_compile.njt.is_enabled()
    assert njt_ops.jagged_scaled_dot_product_attention is handler
    assert inductor_config.post_grad_custom_post_pass is None
    with pytest.raises(KeyError), ragged_compile.enable():
        raise KeyError("boom")
    assert not ragged_compile.njt.is_enabled()


def test_dense_sdpa_untouched():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, H, 7, 8) for _ in range(3))
    outside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with ragged_compile.enable():
        inside = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(inside, outside)


def test_compile_returns_what_torch_compile_returns():
    model = SelfAttentionLayer(E, H)
    compiled = ragged_compile.compile(model, backend="eager")
    assert type(compiled) is type(torch.compile(model, backend="eager"))
    assert compiled._orig_mod is model

    def fn(x):
        return x * 2

    cfn = ragged_compile.compile(fn, backend="eager")
    assert callable(cfn) and not isinstance(cfn, torch.nn.Module)
    assert cfn.__name__ == "fn" and torch.equal(cfn(torch.ones(2)), torch.full((2,), 2.0))

    @ragged_compile.compile(backend="eager", fullgraph=True)
    def decorated(x):
        return x + 1

    assert torch.equal(decorated(torch.zeros(1)), torch.ones(1))


def test_call_context_runs_each_call_outside_the_compiled_region(monkeypatch):
    seen = []

    class Recorder:
        def __init__(self, args, kwargs):
            self.entry = (len(args), sorted(kwargs), torch.compiler.is_compiling())

        def __enter__(self):
            # Inside our wrapper and outside Dynamo's frame: not traced, not compiling,
            # and the rewrite is already on.
            seen.append((*self.entry, torch.compiler.is_compiling(), rc_njt.is_enabled()))

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(compiler, "_call_context", Recorder)
    block = CrossAttentionBlock(E, H).eval()
    compiled = ragged_compile.compile(block, fullgraph=True, backend="aot_eager")
    for kv_lens in ([3, 4], [5, 1], [2, 2]):
        compiled(njt([1, 1], E), memory=njt(kv_lens, E))
    assert seen == [(1, ["memory"], False, False, True)] * 3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not rc_njt.is_enabled()  # and off again after every call
