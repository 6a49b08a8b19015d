"""The Inductor FX passes, on CPU: graphs holding varlen flash / efficient /
varlen_attn nodes are rewritten to ragged_compile's op and then run on CPU,
where the original nodes have no kernel. CUDA tests at the end.
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
import torch.nested._internal.sdpa as njt_sdpa
from _njt_models import SelfAttentionLayer, dense_reference, encoder, njt
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import SDPBackend
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import ragged_compile
from ragged_compile import passes
from ragged_compile.reference import dense_attention

aten = torch.ops.aten
RAGGED = torch.ops.ragged_compile.ragged_attention.default

try:
    from torch.nn.attention.varlen import varlen_attn

    VARLEN_PARAMS = inspect.signature(varlen_attn).parameters
except ImportError:  # torch < 2.10
    varlen_attn, VARLEN_PARAMS = None, {}
needs_varlen = pytest.mark.skipif(varlen_attn is None, reason="torch.nn.attention.varlen missing")


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(force_disable_caches=True), torch.no_grad():
        yield


def _layout(q_lens, k_lens=None, hq=4, hkv=4, d=8, dtype=torch.int32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_lens = k_lens or q_lens
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)  # noqa: E731
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    k = torch.randn(sum(k_lens), hkv, d, generator=gen)
    v = torch.randn(sum(k_lens), hkv, d, generator=gen)
    return q, k, v, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _run_pass(gm, caplog=None):
    passes.ragged_attention_passes()(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "ragged_compile"]


# ---------------------------------------------------------------- flash


@pytest.mark.parametrize(
    "case",
    [
        dict(id="self", q=[3, 1, 7], causal=False),
        dict(id="self-causal", q=[3, 1, 7], causal=True),
        dict(id="cross", q=[1, 1, 1], k=[4, 2, 6], causal=False),
        dict(id="cross-causal-bottom-right", q=[2, 1, 3], k=[4, 2, 6], causal=True),
        dict(id="gqa", q=[5, 2], hkv=2, causal=True, scale=0.3),
        dict(id="empty-segment", q=[0, 4, 2], k=[3, 0, 2], causal=False),
    ],
    ids=lambda c: c["id"],
)
def test_flash_varlen_rewritten_and_runs_on_cpu(case, caplog):
    q, k, v, cu_q, cu_k, mq, mk = _layout(case["q"], case.get("k"), hkv=case.get("hkv", 4))
    causal, scale = case["causal"], case.get("scale")

    def f(q, k, v, cu_q, cu_k):
        out = aten._flash_attention_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, causal, False, scale=scale)[0]
        return out * 2

    gm = make_fx(f, tracing_mode="fake")(q, k, v, cu_q, cu_k)
    assert aten._flash_attention_forward.default in _targets(gm)
    with pytest.raises(NotImplementedError):  # no CPU kernel: the original graph cannot run here
        gm(q, k, v, cu_q, cu_k)
    with caplog.at_level(logging.INFO, "ragged_compile"):
        _run_pass(gm)
    assert RAGGED in _targets(gm) and aten._flash_attention_forward.default not in _targets(gm)
    assert any("replaced" in m and "_flash_attention_forward" in m for m in _messages(caplog))
    ref = dense_attention(q, k, v, cu_q, cu_k, causal, scale or 8**-0.5).float()
    torch.testing.assert_close(gm(q, k, v, cu_q, cu_k), ref * 2, atol=1e-5, rtol=1e-5)


def test_flash_offsets_cast_is_peeled():
    """NJT SDPA casts int64 offsets to int32 for flash; our op gets the original tensor."""
    q, k, v, cu, _, m, _ = _layout([3, 5], dtype=torch.int64)

    def f(q, k, v, cu):
        cu32 = cu.to(torch.int32)
        return aten._flash_attention_forward(q, k, v, cu32, cu32, m, m, 0.0, False, False)[0]

    gm = _run_pass(make_fx(f, tracing_mode="fake")(q, k, v, cu))
    (node,) = [n for n in gm.graph.nodes if n.target is RAGGED]
    assert node.args[3].op == "placeholder" and node.args[4].op == "placeholder"
    ref = dense_attention(q, k, v, cu, cu, False, 8**-0.5).float()
    torch.testing.assert_close(gm(q, k, v, cu), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, use_lse, reason",
    [
        (dict(), True, "output 1"),
        (dict(dropout_p=0.1), False, "dropout_p=0.1"),
        (dict(window_size_left=2, window_size_right=0), False, "sliding window"),
        (dict(alibi_slopes=True), False, "alibi_slopes"),
        (dict(dense=True), False, "dense"),
    ],
    ids=["lse-used", "dropout", "window", "alibi", "dense"],
)
def test_flash_kept_when_semantics_differ(kwargs, use_lse, reason, caplog):
    q, k, v, cu_q, cu_k, mq, mk = _layout([3, 4])
    dropout = kwargs.pop("dropout_p", 0.0)
    dense = kwargs.pop("dense", False)
    alibi = kwargs.pop("alibi_slopes", False)

    def f(q, k, v, cu_q, cu_k):
        if alibi:
            kwargs["alibi_slopes"] = torch.ones(4)
        if dense:
            res = aten._flash_attention_forward(q[None], k[None], v[None], None, None, mq, mk, 0.0, False, False)
        else:
            res = aten._flash_attention_forward(q, k, v, cu_q, cu_k, mq, mk, dropout, False, False, **kwargs)
        return (res[0], res[1]) if use_lse else res[0]

    gm = make_fx(f, tracing_mode="fake")(q, k, v, cu_q, cu_k)
    with caplog.at_level(logging.INFO, "ragged_compile"):
        _run_pass(gm)
    assert aten._flash_attention_forward.default in _targets(gm) and RAGGED not in _targets(gm)
    assert any("kept" in m and reason in m for m in _messages(caplog)), _messages(caplog)


# ---------------------------------------------------------------- efficient


@pytest.mark.parametrize("mask_type", [0, 2], ids=["no-mask", "bottom-right-causal"])
def test_efficient_varlen_rewritten(mask_type):
    q, k, v, cu_q, cu_k, mq, mk = _layout([2, 1, 4], [5, 1, 3])

    def f(q, k, v, cu_q, cu_k):
        out = aten._efficient_attention_forward(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, cu_q, cu_k, mq, mk, 0.0, mask_type, False
        )[0]
        return out.squeeze(0)

    gm = _run_pass(make_fx(f, tracing_mode="fake")(q, k, v, cu_q, cu_k))
    assert RAGGED in _targets(gm) and aten._efficient_attention_forward.default not in _targets(gm)
    ref = dense_attention(q, k, v, cu_q, cu_k, mask_type == 2, 8**-0.5).float()
    torch.testing.assert_close(gm(q, k, v, cu_q, cu_k), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "mask_type, bias, lse, reason",
    [
        (1, False, False, "custom_mask_type=1"),
        (0, True, False, "bias"),
        (0, False, True, "output 1"),
    ],
    ids=["top-left-causal", "bias", "lse-used"],
)
def test_efficient_kept_when_semantics_differ(mask_type, bias, lse, reason, caplog):
    q, k, v, cu_q, cu_k, mq, mk = _layout([3, 3])

    def f(q, k, v, cu_q, cu_k):
        b = torch.zeros(1, 4, 3, 3) if bias else None
        res = aten._efficient_attention_forward(
            q[None], k[None], v[None], b, cu_q, cu_k, mq, mk, 0.0, mask_type, lse
        )
        return (res[0], res[1]) if lse else res[0]

    gm = make_fx(f, tracing_mode="fake")(q, k, v, cu_q, cu_k)
    with caplog.at_level(logging.INFO, "ragged_compile"):
        _run_pass(gm)
    assert aten._efficient_attention_forward.default in _targets(gm) and RAGGED not in _targets(gm)
    assert any("kept" in m and reason in m for m in _messages(caplog)), _messages(caplog)


# ---------------------------------------------------------------- varlen_attn


@needs_varlen
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_varlen_attn_rewritten(causal, gqa):
    if gqa and "enable_gqa" not in VARLEN_PARAMS:
        pytest.skip("this torch's varlen_attn has no GQA")
    q, k, v, cu_q, cu_k, mq, mk = _layout([4, 1, 6], [2, 5, 6], hkv=2 if gqa else 4)
    if causal:  # SDPA-style causal needs Lq == Lk to be unambiguous; varlen's is bottom-right anyway
        q, k, v, cu_q, cu_k, mq, mk = _layout([4, 1, 6], hkv=2 if gqa else 4)
    kw = dict(window_size=(-1, 0)) if causal else {}
    if gqa:
        kw["enable_gqa"] = True

    def f(q, k, v, cu_q, cu_k):
        return varlen_attn(q, k, v, cu_q, cu_k, mq, mk, **kw)

    gm = make_fx(f, tracing_mode="fake")(q, k, v, cu_q, cu_k)
    assert passes.VarlenAttnPass().target() in _targets(gm)
    with pytest.raises(Exception):  # no CPU kernel behind the op
        gm(q, k, v, cu_q, cu_k)
    _run_pass(gm)
    assert RAGGED in _targets(gm) and passes.VarlenAttnPass().target() not in _targets(gm)
    ref = dense_attention(q, k, v, cu_q, cu_k, causal, 8**-0.5).float()
    torch.testing.assert_close(gm(q, k, v, cu_q, cu_k), ref, atol=1e-5, rtol=1e-5)


@needs_varlen
def test_varlen_attn_kept_for_window_and_lse(caplog):
    from torch.nn.attention.varlen import AuxRequest

    q, k, v, cu_q, cu_k, mq, mk = _layout([4, 6])

    def f(q, k, v, cu_q, cu_k):
        a = varlen_attn(q, k, v, cu_q, cu_k, mq, mk, window_size=(2, 0))
        b, lse = varlen_attn(q, k, v, cu_q, cu_k, mq, mk, return_aux=AuxRequest(lse=True))
        return a, b, lse

    gm = make_fx(f, tracing_mode="fake")(q, k, v, cu_q, cu_k)
    with caplog.at_level(logging.INFO, "ragged_compile"):
        _run_pass(gm)
    assert _targets(gm).count(passes.VarlenAttnPass().target()) == 2
    msgs = _messages(caplog)
    assert any("kept" in m and "sliding window (2, 0)" in m for m in msgs), msgs
    assert any("kept" in m and "output 1" in m for m in msgs), msgs


@needs_varlen
def test_varlen_attn_compiled_on_cpu_through_inductor():
    q, k, v, cu_q, cu_k, mq, mk = _layout([3, 8, 1])

    def f(q, k, v, cu_q, cu_k):
        return varlen_attn(q, k, v, cu_q, cu_k, mq, mk, window_size=(-1, 0)) * 2

    out, codes = run_and_get_code(ragged_compile.compile(f, fullgraph=True), q, k, v, cu_q, cu_k)
    code = "\n".join(codes)
    assert "ragged_compile.ragged_attention" in code and "_varlen_attn" not in code
    ref = dense_attention(q, k, v, cu_q, cu_k, True, 8**-0.5).float()
    torch.testing.assert_close(out, ref * 2, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Inductor, end to end


def test_flash_compiled_on_cpu_runs_only_with_the_pass():
    q, k, v, cu_q, cu_k, mq, mk = _layout([5, 2, 3], [1, 4, 3])

    def f(q, k, v, cu_q, cu_k):
        return aten._flash_attention_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, False, False)[0] + 1

    with pytest.raises(Exception, match="_flash_attention_forward"):
        torch.compile(f, fullgraph=True)(q, k, v, cu_q, cu_k)
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=passes.ragged_attention_passes()):
        out, codes = run_and_get_code(torch.compile(f, fullgraph=True), q, k, v, cu_q, cu_k)
    code = "\n".join(codes)
    assert "ragged_compile.ragged_attention" in code and "_flash_attention_forward" not in code
    ref = dense_attention(q, k, v, cu_q, cu_k, False, 8**-0.5).float()
    torch.testing.assert_close(out, ref + 1, atol=1e-5, rtol=1e-5)


def test_njt_sdpa_forced_onto_flash_is_rewritten_by_the_pass_alone(monkeypatch, caplog):
    """Stock NJT SDPA (no handler swap) taking its CUDA flash path, traced on CPU:
    the post-grad pass alone turns the flash node into our op, and it runs."""
    monkeypatch.setattr(njt_sdpa, "_select_sdp_backend", lambda *a, **k: SDPBackend.FLASH_ATTENTION)
    torch.manual_seed(0)
    layer = SelfAttentionLayer(32, 4, causal=True).eval()
    x = njt([4, 1, 7], 32)
    compiled = torch.compile(layer, fullgraph=True)
    with caplog.at_level(logging.INFO, "ragged_compile"):
        with inductor_config.patch(post_grad_custom_post_pass=passes.ragged_attention_passes()):
            out, codes = run_and_get_code(compiled, x)
    code = "\n".join(codes)
    assert code.count("torch.ops.ragged_compile.ragged_attention.default(") == 1
    assert "_flash_attention_forward" not in code
    assert any("replaced" in m and "_flash_attention_forward" in m for m in _messages(caplog))
    monkeypatch.undo()
    torch.testing.assert_close(out.values(), dense_reference(layer, x), atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- uuid


def test_each_pass_uuid_hashes_its_own_source():
    from ragged_compile.backends import select

    kinds = (passes.FlashVarlenPass, passes.EfficientVarlenPass, passes.VarlenAttnPass)
    uuids = [cls().uuid() for cls in kinds]
    assert len(set(uuids)) == 3 and uuids == [cls().uuid() for cls in kinds]
    for cls, u in zip(kinds, uuids):
        assert u == f"{cls.__name__}:{passes._hash_source(passes, select)}"


@pytest.mark.parametrize("edited", ["passes", "select"])
def test_uuid_changes_with_source(monkeypatch, edited):
    """A pass keys Inductor's cache on the sources of its module (every pass and
    helper) and of the support rules it asks: editing either changes it."""
    from ragged_compile.backends import select

    module = {"passes": passes, "select": select}[edited]
    passes._hash_source.cache_clear()
    before = passes.FlashVarlenPass().uuid()
    assert before != passes.VarlenAttnPass().uuid()
    real = inspect.getsource
    monkeypatch.setattr(passes.inspect, "getsource", lambda obj: real(obj) + ("#edited" if obj is module else ""))
    passes._hash_source.cache_clear()
    try:
        assert passes.FlashVarlenPass().uuid() != before
    finally:
        monkeypatch.undo()
        passes._hash_source.cache_clear()
    assert passes.FlashVarlenPass().uuid() == before


def test_manager_runs_user_pass_first_and_keys_on_its_uuid():
    order = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            order.append("user")

        def uuid(self):
            return "user-v1"

    class Probe(passes.FlashVarlenPass):
        def __call__(self, graph):
            order.append("ours")

    manager = passes.ragged_attention_passes(UserPass(), extra_uuid="handler")
    manager.passes = (Probe(),)
    manager(torch.fx.Graph())
    assert order == ["user", "ours"]
    assert manager.uuid()[1:] == ("handler", ("user-v1",))
    assert passes.ragged_attention_passes(lambda g: None).uuid() is None


# ---------------------------------------------------------------- CUDA (run on a GPU machine)


def _cuda_layer(causal=False):
    torch.manual_seed(0)
    return SelfAttentionLayer(256, 4, causal=causal).to("cuda", torch.float16).eval()  # head dim 64


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_stock_njt_flash_rewritten_by_pass(causal):
    """torch.compile with only our pass: the flash node of stock NJT SDPA becomes our op."""
    layer = _cuda_layer(causal)
    x = njt([5, 17, 1, 9], 256).to("cuda", torch.float16)
    eager = layer(x)  # stock NJT SDPA (flash) eager
    with inductor_config.patch(post_grad_custom_post_pass=passes.ragged_attention_passes()):
        with torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)
    code = "\n".join(codes)
    assert "ragged_compile.ragged_attention" in code
    assert "_flash_attention_forward" not in code and "_efficient_attention_forward" not in code
    torch.testing.assert_close(out.values(), eager.values(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compile_encoder_matches_eager():
    model = encoder(256, 4).to("cuda", torch.float16)  # head dim 64
    x = njt([5, 17, 1, 9], 256).to("cuda", torch.float16)
    with ragged_compile.enable():
        eager = model(x)
    out, codes = run_and_get_code(ragged_compile.compile(model, fullgraph=True), x)
    code = "\n".join(codes)
    assert code.count("torch.ops.ragged_compile.ragged_attention.default(") == 3
    assert "_flash_attention_forward" not in code and "_efficient_attention_forward" not in code
    torch.testing.assert_close(out.values(), eager.values(), atol=2e-2, rtol=2e-2)
    ref = dense_reference(model.float(), x.float())
    torch.testing.assert_close(out.values().float(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_varlen
def test_cuda_varlen_attn_rewritten_matches_eager():
    q, k, v, cu_q, cu_k, mq, mk = (
        t.to("cuda") if isinstance(t, torch.Tensor) else t for t in _layout([7, 33, 2], d=64)
    )
    q, k, v = (t.half() for t in (q, k, v))

    def f(q, k, v, cu_q, cu_k):
        return varlen_attn(q, k, v, cu_q, cu_k, mq, mk, window_size=(-1, 0))

    eager = f(q, k, v, cu_q, cu_k)
    out, codes = run_and_get_code(ragged_compile.compile(f, fullgraph=True), q, k, v, cu_q, cu_k)
    assert "ragged_compile.ragged_attention" in "\n".join(codes)
    torch.testing.assert_close(out, eager, atol=2e-3, rtol=2e-3)
