"""The front door as new users try it: ``ragged_compile.compile`` next to plain
``torch.compile`` (same class, either order), threads, inputs plain
``torch.compile`` takes, training with dropout, errors that say what to do.

Which implementation ran is counted, not inferred: every CPU call of our op runs
the reference kernel, which a spy counts per thread.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nested._internal.ops as njt_ops
import torch.nn.functional as F
from _njt_models import SelfAttentionLayer, dense_reference, encoder, njt
from torch import nn
from torch._inductor import config as inductor_config

import ragged_compile
from ragged_compile import compiler, logs, njt as rc_njt, passes

E, H = 32, 4
counters = torch._dynamo.utils.counters
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


class MHA(nn.Module):
    """q = k = v from one projection: contiguous heads, so stock NJT SDPA runs eagerly on CPU.

    Plain ``torch.compile`` graph-breaks around stock NJT SDPA on CPU and runs it
    eagerly, so both front doors produce results here.
    """

    def __init__(self, causal: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(E, E)
        self.causal = causal

    def forward(self, x):
        q = self.proj(x).unflatten(-1, [H, E // H]).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=self.causal)
        return out.transpose(1, 2).flatten(-2)


def _mha_fn(x, w):
    q = (x * w).unflatten(-1, [H, E // H]).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(-2)


def _stock(model, x):
    with torch.no_grad():
        return model(x)


# ---------------------------------------------------------------- 1: never shared with plain torch.compile


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [None, False])
def test_rc_then_plain_same_class_each_runs_its_own(ours, backend, dynamic):
    x = njt([3, 5, 2], E)
    with torch.no_grad():
        ours_model = ragged_compile.compile(MHA(), backend=backend, dynamic=dynamic, fullgraph=True)
        ours.n = 0
        out = ours_model(x)
        assert ours.n == 1
        plain = torch.compile(MHA(), backend=backend, dynamic=dynamic)
        for lens in ([3, 5, 2], [4, 4], [2, 6, 1, 3]):
            x = njt(lens, E)
            ours.n = 0
            torch.testing.assert_close(plain(x).values(), _stock(MHA(), x).values())
            assert ours.n == 0, f"plain torch.compile ran our op for {lens}"
            ours.n = 0
            ours_model(x)
            assert ours.n == 1, f"ragged_compile.compile did not run our op for {lens}"
    torch.testing.assert_close(out.values(), dense_reference(MHA(), njt([3, 5, 2], E)), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [None, False])
def test_plain_then_rc_same_class_runs_ours_and_keeps_fullgraph(ours, dynamic):
    """Plain torch.compile caches graph-broken stock code first; ours must not reuse it."""
    with torch.no_grad():
        plain = torch.compile(MHA(), backend="aot_eager", dynamic=dynamic)
        x = njt([3, 5, 2], E)
        ours.n = 0
        plain(x)
        assert ours.n == 0 and counters["graph_break"]  # stock: a graph break around SDPA
        counters.clear()
        rc_model = ragged_compile.compile(MHA(), backend="aot_eager", dynamic=dynamic, fullgraph=True)
        for lens in ([3, 5, 2], [4, 4]):
            ours.n = 0
            x = njt(lens, E)
            torch.testing.assert_close(rc_model(x).values(), dense_reference(MHA(), x), atol=2e-5, rtol=1e-4)
            assert ours.n == 1
        assert not counters["graph_break"]
        ours.n = 0
        plain(njt([4, 4], E))
        assert ours.n == 0


def test_functions_are_kept_apart_too(ours):
    w = torch.randn(E)
    x = njt([2, 7], E)
    with torch.no_grad():
        ragged_compile.compile(_mha_fn, backend="aot_eager")(x, w)
        assert ours.n == 1
        ours.n = 0
        torch.compile(_mha_fn, backend="aot_eager")(x, w)
        assert ours.n == 0


def test_backend_honours_mode_and_options_and_is_reused():
    # What torch.compile would have passed to Inductor for the same arguments.
    want = torch._TorchCompileInductorWrapper("max-autotune-no-cudagraphs", None, None)
    got = compiler._backend("inductor", "max-autotune-no-cudagraphs", None, None, None)
    assert got.inner == want and got.inner.config.get("max_autotune") is True
    assert got is compiler._backend("inductor", "max-autotune-no-cudagraphs", None, None, None)
    opts = compiler._backend("inductor", None, {"max_autotune": True, "epilogue_fusion": False}, None, None)
    assert opts.inner.config == {"max_autotune": True, "epilogue_fusion": False} and opts != got
    assert got != want and want != got  # never equal to a plain backend
    with pytest.raises(RuntimeError, match="Either mode or options"):
        ragged_compile.compile(MHA(), mode="max-autotune", options={"max_autotune": True})


def test_same_settings_share_our_compiled_code(ours):
    with torch.no_grad():
        for _ in range(2):
            m = ragged_compile.compile(MHA(), backend="aot_eager", fullgraph=True)
            m(njt([3, 4], E))
    assert counters["stats"]["unique_graphs"] == 1


def test_plain_compile_inside_enable_keeps_stock_graphs(ours, caplog, monkeypatch):
    """enable() is eager-only: what plain torch.compile traces inside it is stock
    (warned), so its cached code runs the same outside. On CPU stock NJT SDPA
    cannot be traced, so the call graph-breaks and runs eagerly, inside enable()
    on our op like any eager code."""
    monkeypatch.setattr(logs, "_seen", set())
    x = njt([3, 5, 2], E)
    with torch.no_grad(), caplog.at_level(logging.WARNING, "ragged_compile"):
        plain = torch.compile(MHA(), backend="aot_eager")
        with ragged_compile.enable():
            inside = plain(x)
        assert ours.n == 1 and counters["graph_break"]  # the eager part, not a graph
        graphs = counters["stats"]["unique_graphs"]
        ours.n = 0
        outside = plain(x)
        assert ours.n == 0 and counters["stats"]["unique_graphs"] == graphs
    torch.testing.assert_close(outside.values(), _stock(MHA(), x).values())
    torch.testing.assert_close(inside.values(), outside.values(), atol=2e-5, rtol=1e-4)
    assert any("enable() acts on eager code only" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- 2: threads


def test_threads_each_get_what_they_asked_for(ours):
    """Plain eager, enable() blocks, an rc-compiled model and a plain-compiled one,
    all at once from a pool; overlapping enable() blocks run causal (which stock on
    CPU rejects) while others leave theirs."""
    causal = MHA(causal=True)
    plain_model = MHA()
    with torch.no_grad():
        rc_model = ragged_compile.compile(MHA(), backend="aot_eager", fullgraph=True)
        plain_compiled = torch.compile(MHA(), backend="aot_eager")
        warm = njt([3, 4], E)
        rc_model(warm), plain_compiled(warm)
    inputs = [njt(lens, E) for lens in ([3, 5, 2], [4, 4], [1, 6, 2, 3], [7, 1])]
    stock = [_stock(plain_model, x).values() for x in inputs]
    refs = [dense_reference(MHA(), x) for x in inputs]
    causal_refs = [dense_reference(causal, x) for x in inputs]
    barrier = threading.Barrier(3)

    def task(kind: str, i: int):
        ours.n = 0
        x = inputs[i % len(inputs)]
        with torch.no_grad():
            if kind == "eager":
                out, want, n = plain_model(x).values(), stock[i % 4], 0
            elif kind == "plain_compiled":
                out, want, n = plain_compiled(x).values(), stock[i % 4], 0
            elif kind == "rc":
                out, want, n = rc_model(x).values(), refs[i % 4], 1
            else:  # overlapping enable() blocks
                with ragged_compile.enable():
                    if i in (0, 3, 5):  # the first three enable() blocks overlap
                        barrier.wait(timeout=30)
                    out = causal(x).values()
                    out2 = plain_model(x).values()
                want, n = causal_refs[i % 4], 2
                torch.testing.assert_close(out2, refs[i % 4], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        return kind, ours.n, n

    kinds = ["enable", "eager", "rc", "enable", "plain_compiled", "enable"] + ["eager", "rc", "plain_compiled", "enable"] * 4
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(task, kinds, range(len(kinds))))
    for kind, got, want in results:
        assert got == want, f"{kind}: our op ran {got} times, expected {want}"
    # The process is left as found: nothing enabled here, stock eager, empty pass slot.
    assert not rc_njt.is_enabled()
    assert inductor_config.post_grad_custom_post_pass is None
    ours.n = 0
    with torch.no_grad():
        plain_model(inputs[0])
    assert ours.n == 0
    with pytest.raises(RuntimeError):  # stock CPU NJT SDPA has no causal
        causal(inputs[0])


def test_handler_is_installed_once_and_calls_stock_outside(ours):
    with ragged_compile.enable():
        pass
    assert njt_ops.jagged_scaled_dot_product_attention is rc_njt._ragged_sdpa
    assert rc_njt._stock.__module__ == "torch.nested._internal.sdpa"
    x = njt([3, 4], E)
    with torch.no_grad():
        torch.testing.assert_close(MHA()(x).values(), _stock(MHA(), x).values())
    assert ours.n == 0


def _flash_fn(q, k, v, cu_q, cu_k):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 5, 5, 0.0, False, False)[0] + 1


def test_inductor_passes_rewrite_only_our_compiles():
    """While our passes sit in Inductor's (process-wide) slot, a plain torch.compile
    is not rewritten: on CPU its flash node still fails to compile."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with passes.installed("test"):
        slot = inductor_config.post_grad_custom_post_pass
        assert isinstance(slot, passes.RaggedAttentionPasses) and slot.gated
        assert slot.uuid()[0] == "ragged_compile: off"  # a plain compile keys as with no pass
        with pytest.raises(Exception, match="_flash_attention_forward"):
            torch.compile(_flash_fn, fullgraph=True)(q, k, v, cu, cu)
    assert inductor_config.post_grad_custom_post_pass is None
    torch._dynamo.reset()
    out = ragged_compile.compile(_flash_fn, fullgraph=True)(q, k, v, cu, cu)
    ref = ragged_compile.reference_attention(q, k, v, cu, cu, False, 8**-0.5)
    torch.testing.assert_close(out, ref + 1, atol=1e-5, rtol=1e-5)
    assert inductor_config.post_grad_custom_post_pass is None


# ---------------------------------------------------------------- 4: inputs torch.compile takes


def test_broadcasting_dense_side_inputs():
    def f(x, a, b):
        return _mha_fn(x, 1.0) * 2, a + b

    compiled = ragged_compile.compile(f, backend="aot_eager")
    with torch.no_grad():
        for sa, sb in (((3, 3), (3, 3)), ((4, 4), (4, 4)), ((1, 6), (6, 6)), ((5, 1), (1, 5))):
            a, b = torch.randn(sa), torch.randn(sb)
            x = njt([3, 4], E)
            out, s = compiled(x, a, b)
            torch.testing.assert_close(s, a + b)


def test_non_contiguous_njt_input():
    def g(x):
        q = x.unflatten(-1, [2, 8]).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2)

    base = torch.nested.nested_tensor([torch.randn(n, 32) for n in (3, 5)], layout=torch.jagged)
    x = base[..., :16]
    assert not x.values().is_contiguous()
    with torch.no_grad():
        out = ragged_compile.compile(g, backend="aot_eager", fullgraph=True)(x)
        with ragged_compile.enable():
            want = g(x)
    torch.testing.assert_close(out.values(), want.values())


def test_batches_of_one_share_the_graph_and_a_one_token_total_costs_one_more():
    """The token total stays backed (compiler._dynamic_layouts says why): a
    batch of one token compiles a second graph once, an empty batch a third;
    everything else, one-token segments and batches of one segment included,
    shares the first."""
    model = encoder(E, H)
    compiled = ragged_compile.compile(model, backend="aot_eager", fullgraph=True)
    graphs = []
    with torch.no_grad():
        for lens in ([5, 3, 9], [3], [1, 1, 1], [2, 1], [7, 1, 4], [1], [1], [4, 1], [0, 0], [0]):
            x = njt(lens, E)
            torch.testing.assert_close(compiled(x).values(), dense_reference(model, x), atol=2e-5, rtol=1e-4)
            # The marks come off after the call: a plain torch.compile sees the tensors as given.
            for t in (x, x._values, x._offsets, *x._metadata_cache.values()):
                assert 0 not in getattr(t, "_dynamo_unbacked_indices", ())
                assert 0 not in getattr(t, "_dynamo_weak_dynamic_indices", ())
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 1, 1, 2, 2, 2, 3, 3]


def test_backed_size_oblivious_is_never_turned_on(monkeypatch):
    seen = []
    real = compiler._run

    def spy(*args):
        seen.append(torch.fx.experimental._config.backed_size_oblivious)
        return real(*args)

    monkeypatch.setattr(compiler, "_run", spy)

    def f(x):
        seen.append(torch.fx.experimental._config.backed_size_oblivious)
        return x * 2

    with torch.no_grad():
        ragged_compile.compile(f, backend="eager")(njt([2, 3], E))
    assert seen and not any(seen)


# ---------------------------------------------------------------- 5: symbolic scale


class ScaledAttention(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, q, cu):
        return ragged_compile.ragged_attention(q, q, q, cu, scale=self.scale)


def test_float_attribute_scale_under_dynamic_true():
    torch.manual_seed(0)
    q = torch.randn(10, 4, 8)
    cu = torch.tensor([0, 3, 10])
    model = ScaledAttention(0.3)
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="aot_eager")
    for scale in (0.3, 0.5):
        model.scale = scale
        torch.testing.assert_close(
            compiled(q, cu), ragged_compile.reference_attention(q, q, q, cu, cu, False, scale)
        )
    model.scale = math.inf
    with pytest.raises(Exception, match="scale must be finite"):
        compiled(q, cu)


# ---------------------------------------------------------------- 6: attention dropout


class DropoutLayer(nn.Module):
    """Fused k/v projection (non-contiguous heads) and dropout in training, as users write it."""

    def __init__(self, p: float = 0.3, causal: bool = True, kv_heads: int = H):
        super().__init__()
        torch.manual_seed(0)
        self.p, self.causal, self.kv_heads = p, causal, kv_heads
        self.q = nn.Linear(E, E)
        self.kv = nn.Linear(E, 2 * kv_heads * (E // H))

    def forward(self, x):
        q = self.q(x).unflatten(-1, [H, E // H]).transpose(1, 2)
        k, v = (t.unflatten(-1, [self.kv_heads, E // H]).transpose(1, 2) for t in self.kv(x).chunk(2, -1))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=self.causal,
            enable_gqa=self.kv_heads != H,
        )
        return out.transpose(1, 2).flatten(-2)


def test_dropout_training_compiles_fullgraph_and_trains(caplog, monkeypatch):
    monkeypatch.setattr(logs, "_seen", set())
    layer = DropoutLayer().train()
    compiled = ragged_compile.compile(layer, fullgraph=True, backend="aot_eager")
    x = njt([3, 6, 1], E)
    with caplog.at_level(logging.WARNING, "ragged_compile"):
        out = compiled(x)
        (out.values() ** 2).sum().backward()
        with ragged_compile.enable():
            eager = layer(x)
            (eager.values() ** 2).sum().backward()
    assert layer.q.weight.grad is not None and torch.isfinite(layer.q.weight.grad).all()
    assert torch.isfinite(out.values()).all() and torch.isfinite(eager.values()).all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("dropout_p=0.3" in m for m in warnings)
    layer.eval()
    with torch.no_grad():  # eval: our op again, equal to the dense reference
        torch.testing.assert_close(compiled(x).values(), dense_reference(layer, x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("causal,kv_heads", [(False, H), (True, H), (True, 2)])
def test_padded_dropout_path_is_sdpa_per_segment(causal, kv_heads):
    """The dropout path with p=0 is exactly SDPA per segment; with p>0 it drops and rescales."""
    layer = DropoutLayer(p=0.0, causal=causal, kv_heads=kv_heads).eval()
    x = njt([4, 1, 9, 2], E)
    with torch.no_grad():
        q = layer.q(x).unflatten(-1, [H, E // H]).transpose(1, 2)
        k, v = (t.unflatten(-1, [kv_heads, E // H]).transpose(1, 2) for t in layer.kv(x).chunk(2, -1))
        got = rc_njt._padded_sdpa(q, k, v, 0.0, causal, None, kv_heads != H)
        want = [
            F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, enable_gqa=kv_heads != H)
            for qi, ki, vi in zip(q.unbind(), k.unbind(), v.unbind())
        ]
        torch.testing.assert_close(got.transpose(1, 2).values(), torch.cat([w.transpose(0, 1) for w in want]))
        torch.manual_seed(1)
        draws = torch.stack([rc_njt._padded_sdpa(q, k, v, 0.5, causal, None, kv_heads != H).values() for _ in range(300)])
    assert not torch.equal(draws[0], got.values())
    torch.testing.assert_close(draws.mean(0), got.values(), atol=0.15, rtol=0)


def test_padded_dropout_keeps_segments_independent():
    q = njt([3, 4, 2], 16).unflatten(-1, [2, 8]).transpose(1, 2)
    bad = q.transpose(1, 2).values().clone()
    bad[3:7] = float("nan")  # segment 1
    qn = torch.nested.nested_tensor_from_jagged(bad, q.transpose(1, 2).offsets()).transpose(1, 2)
    out = rc_njt._padded_sdpa(qn, qn, qn, 0.2, False, None, False).transpose(1, 2).values()
    assert torch.isnan(out[3:7]).all() and torch.isfinite(out[:3]).all() and torch.isfinite(out[7:]).all()


def test_cross_attention_with_empty_key_segment_dropout_path_gives_zeros():
    q = njt([2, 3], 16).unflatten(-1, [2, 8]).transpose(1, 2)
    k = njt([4, 0], 16).unflatten(-1, [2, 8]).transpose(1, 2)
    out = rc_njt._padded_sdpa(q, k, k, 0.0, False, None, False).transpose(1, 2).values()
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    want = F.scaled_dot_product_attention(q.unbind()[0], k.unbind()[0], k.unbind()[0])
    torch.testing.assert_close(out[:2], want.transpose(0, 1))


# ---------------------------------------------------------------- 8: errors that say what to do


@pytest.mark.parametrize("enable_gqa", [True, False])
def test_indivisible_heads_name_enable_gqa(enable_gqa):
    q = njt([3, 4], 6 * 8).unflatten(-1, [6, 8]).transpose(1, 2)
    kv = njt([3, 4], 4 * 8, seed=3)
    kv = torch.nested.nested_tensor_from_jagged(kv.values(), q.transpose(1, 2).offsets()).unflatten(-1, [4, 8])
    kv = kv.transpose(1, 2)

    def f(q, kv):
        return F.scaled_dot_product_attention(q, kv, kv, enable_gqa=enable_gqa)

    with ragged_compile.enable(), pytest.raises(RuntimeError, match="enable_gqa") as err:
        f(q, kv)
    assert "6 query heads and 4" in str(err.value)
    with pytest.raises(Exception, match="enable_gqa"):
        ragged_compile.compile(f, backend="aot_eager", fullgraph=True)(q, kv)


def test_fallback_under_compile_says_why():
    """attn_mask keeps stock; stock cannot trace on CPU: the error names our reason."""

    def f(x, mask):
        q = x.unflatten(-1, [H, E // H]).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    with pytest.raises(Exception, match="left to stock NJT SDPA because attn_mask is given"):
        ragged_compile.compile(f, backend="aot_eager", fullgraph=True)(njt([2, 3], E), torch.ones(2, 2, dtype=torch.bool))


def test_fallback_without_fullgraph_runs_eagerly_like_stock(ours):
    """Missing transpose: stock eager computes it (across heads); compiled, the call
    graph-breaks and runs eagerly rather than failing."""

    def f(x):
        q = x.unflatten(-1, [H, E // H])  # no transpose
        return F.scaled_dot_product_attention(q, q, q) * 2

    x = njt([3, 5], E)
    with torch.no_grad():
        out = ragged_compile.compile(f, backend="aot_eager")(x)
        want = f(x)
    torch.testing.assert_close(out.values(), want.values())
    assert ours.n == 0


# ---------------------------------------------------------------- 9: no cache-key tracebacks


def test_compile_logs_no_cache_key_traceback(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = encoder(E, H)
    x = njt([3, 5, 2], E)
    with inductor_config.patch(force_disable_caches=False), torch.no_grad():
        with caplog.at_level(logging.INFO):
            ragged_compile.compile(model, fullgraph=True)(x)
        ours = [r for r in caplog.records if r.name.startswith("torch")]
        assert not [r for r in ours if r.exc_info or "Failed to pickle" in r.getMessage()]
        assert any("compiled uncached" in r.getMessage() for r in caplog.records if r.name == "ragged_compile")
        caplog.clear()
        # Not ours: the same record from a plain compile is left alone.
        with caplog.at_level(logging.WARNING):
            torch.compile(lambda t: t * 2 + 1)(x)
    assert any("Failed to pickle cache key" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- CUDA (run on a GPU machine)


def _cuda_pair():
    torch.manual_seed(0)
    a = SelfAttentionLayer(256, 4).to("cuda", torch.float16).eval()  # head dim 64
    b = SelfAttentionLayer(256, 4).to("cuda", torch.float16).eval()
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plain_first_then_rc_runs_our_op():
    """Reverse direction: torch.compile(stock model) first, then
    ragged_compile.compile(model of the same class) must compile its own graph on our op."""
    from torch._inductor.utils import run_and_get_code

    stock_model, model = _cuda_pair()
    x = njt([5, 17, 1, 9], 256).to("cuda", torch.float16)
    with torch.no_grad():
        plain_out, plain_codes = run_and_get_code(torch.compile(stock_model), x)
        assert "ragged_compile" not in "\n".join(plain_codes)
        out, codes = run_and_get_code(ragged_compile.compile(model, fullgraph=True), x)
        code = "\n".join(codes)
        assert code.count("torch.ops.ragged_compile.ragged_attention.default(") == 1
        assert "_flash_attention_forward" not in code and "_efficient_attention_forward" not in code
        torch.testing.assert_close(out.values(), plain_out.values(), atol=2e-2, rtol=2e-2)
        # and the plain one still runs stock afterwards (no recompile onto ours)
        again, again_codes = run_and_get_code(torch.compile(stock_model), x)
        assert "ragged_compile" not in "\n".join(again_codes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rc_first_then_plain_runs_stock():
    from torch._inductor.utils import run_and_get_code

    model, stock_model = _cuda_pair()
    x = njt([5, 17, 1, 9], 256).to("cuda", torch.float16)
    with torch.no_grad():
        _, codes = run_and_get_code(ragged_compile.compile(model), x)
        assert "ragged_compile.ragged_attention" in "\n".join(codes)
        with ragged_compile.enable():  # enable() does not reach into plain torch.compile
            _, plain_codes = run_and_get_code(torch.compile(stock_model), x)
    plain = "\n".join(plain_codes)
    assert "ragged_compile" not in plain
    assert "_flash_attention_forward" in plain or "_efficient_attention_forward" in plain
