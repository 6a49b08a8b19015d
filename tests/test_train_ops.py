"""The training ops (the LSE pair of ops.py) and the fused-backward wrapper, on CPU.

The CUDA kernels themselves run in tests/test_train_cuda.py. Here: schemas, fake
kernels and autograd through ``opcheck``; the exact LSE; and the wrapper around
``aten._flash_attention_backward`` (padding, LSE conversion, special cases)
against a float64 reference of that kernel's contract.
"""

from __future__ import annotations

import math

import pytest
import torch

from ragged_compile.backends import flash_backward, select
from ragged_compile.reference import dense_attention, dense_gradients, dense_lse, reference_lse


def _inputs(lq, lk, hq=4, hkv=2, d=8, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=dtype, requires_grad=grad)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype, requires_grad=grad)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype, requires_grad=grad)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    return q, k, v, cq, ck


LAYOUTS = [
    ([3, 0, 1, 5], [2, 4, 0, 6]),  # empty q and k segments, Lq > Lk and Lq < Lk
    ([4, 1, 7], [4, 1, 7]),  # self, one-token segment
    ([5], [0]),  # all-empty k
]


@pytest.mark.parametrize("lq,lk", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_forward_with_lse(lq, lk, causal):
    q, k, v, cq, ck = _inputs(lq, lk)
    torch.library.opcheck(torch.ops.ragged_compile.ragged_attention_lse.default, (q, k, v, cq, ck, causal, 0.3))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_backward_op(causal):
    q, k, v, cq, ck = _inputs([3, 0, 4], [2, 5, 1], grad=False)
    out, lse, max_lens = torch.ops.ragged_compile.ragged_attention_lse(q, k, v, cq, ck, causal, 0.3)
    g = torch.randn(q.shape)
    torch.library.opcheck(
        torch.ops.ragged_compile.ragged_attention_lse_backward.default,
        (g, q, k, v, out, lse, cq, ck, max_lens, causal, 0.3),
    )


def test_max_lens_are_host_values():
    q, k, v, cq, ck = _inputs([3, 0, 9, 1], [2, 5, 1, 0], grad=False)
    _, _, max_lens = torch.ops.ragged_compile.ragged_attention_lse(q, k, v, cq, ck, False, 0.3)
    # the longest q and k segments, and the query-key pairs per head (which pick the CUDA backward)
    assert max_lens.device.type == "cpu" and max_lens.tolist() == [9, 5, 3 * 2 + 9 * 1]


@pytest.mark.parametrize("causal", [False, True])
def test_lse_is_the_softmax_normaliser(causal):
    """exp(s - lse) sums to 1 over the keys a row sees; keyless rows hold +inf."""
    lq, lk = [3, 0, 4, 2], [2, 5, 0, 6]
    q, k, v, cq, ck = _inputs(lq, lk, dtype=torch.float64, grad=False)
    scale = 0.37
    lse = reference_lse(q, k, cq, ck, causal, scale)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    for i in range(len(lq)):
        Lq, Lk = lq[i], lk[i]
        qs, ks = q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]].repeat_interleave(2, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        for r in range(Lq):
            seen = Lk if not causal else max(0, min(Lk, r + Lk - Lq + 1))
            row = lse[:, cq[i] + r].double()
            if seen == 0:
                assert torch.isinf(row).all() and (row > 0).all()
            else:
                total = torch.exp(s[:, r, :seen] - row[:, None]).sum(-1)
                torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_float64_dense_autograd(causal):
    lq, lk = [4, 0, 1, 7], [4, 3, 0, 9]
    q, k, v, cq, ck = _inputs(lq, lk, dtype=torch.float32)
    w = torch.randn(q.shape)
    out, _, _ = torch.ops.ragged_compile.ragged_attention_lse(q, k, v, cq, ck, causal, 0.3)
    (out * w).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    _, *want = dense_gradients(w, q, k, v, cq, ck, causal, 0.3)
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-4)


# -- the wrapper around aten._flash_attention_backward -------------------------


def _check_fa2_inputs(q, cu_q, cu_k, max_q, max_k, dropout_p):
    assert q.shape[-1] % 8 == 0 and q.shape[-1] <= 256, q.shape
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert cu_q.numel() > 1 and max_q > 0 and max_k > 0, "the kernel rejects n == 0 and fails on max_k == 0"
    assert dropout_p == 0.0
    cq, ck = cu_q.tolist(), cu_k.tolist()
    # max_k may exceed the longest k segment: windowed calls widen the kernel's
    # stand-in for an unbounded side with it (_fa2_window)
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k >= max(b - a for a, b in zip(ck, ck[1:]))


def _fa2_window(left, right, is_causal, max_k):
    """The window flash-attn's varlen kernels apply (flash_api.cpp: ``mha_varlen_fwd``
    / ``mha_varlen_bwd`` and ``set_params_fprop``): causal caps the right at 0,
    a bound ``>= max_seqlen_k`` is unbounded, and an unbounded side next to a
    bounded one becomes ``max_seqlen_k``."""
    left, right = (-1 if left is None else left), (-1 if right is None else right)
    if is_causal:
        right = 0
    left, right = (-1 if left >= max_k else left), (-1 if right >= max_k else right)
    if is_causal and left < 0:
        return (-1, -1)  # plain causal: the caller's causal flag says it
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return left, right


def _fa2_contract(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal,
                  rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    """What the aten kernel computes, in float64, from the LSE it is given (it
    does not recompute it), after checking the inputs it insists on."""
    _check_fa2_inputs(q, cu_q, cu_k, max_q, max_k, dropout_p)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert rng_state.dtype == torch.uint64
    window = _fa2_window(window_size_left, window_size_right, is_causal, max_k)
    _, dq, dk, dv = dense_gradients(grad_out, q, k, v, cu_q, cu_k, is_causal, scale, out=out, lse=lse,
                                    window_size=window)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fa2_forward_contract(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
                          scale=None, window_size_left=None, window_size_right=None):
    """The aten forward's contract: output in q's dtype, LSE ``[Hq, Tq]`` fp32 natural
    log with ``+inf`` for rows that see no key (flash-attn's normaliser)."""
    _check_fa2_inputs(q, cu_q, cu_k, max_q, max_k, dropout_p)
    assert not return_debug_mask
    window = _fa2_window(window_size_left, window_size_right, is_causal, max_k)
    out = dense_attention(q, k, v, cu_q, cu_k, is_causal, scale, window_size=window).to(q.dtype)
    lse = dense_lse(q, k, cu_q, cu_k, is_causal, scale, torch.float32, window_size=window)
    unused = torch.empty(0)
    return out, lse, torch.zeros(2, dtype=torch.uint64), unused, unused


@pytest.mark.parametrize("d", [8, 20, 72, 96])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [([3, 0, 1, 5], [2, 4, 0, 6]), ([6, 2], [6, 2])])
def test_flash_backward_wrapper_matches_dense_autograd(monkeypatch, d, causal, lq, lk):
    """Padding to a multiple of 8, the FlashInfer LSE conversion (keyless rows
    included) and the offsets handed over give dense float64 autograd's gradients."""
    monkeypatch.setattr(flash_backward, "_kernel", _fa2_contract)
    q, k, v, cq, ck = _inputs(lq, lk, d=d, dtype=torch.float64)
    cq, ck = cq.long(), ck.long()  # NJT offsets are int64: the wrapper converts
    scale = d**-0.5
    g = torch.randn(q.shape, dtype=torch.float64)
    out, *want = dense_gradients(g, q, k, v, cq, ck, causal, scale)
    # FlashInfer's LSE: [Tq, Hq], base 2, -inf for keyless rows.
    lse_ln = reference_lse(q.detach(), k.detach(), cq, ck, causal, scale)
    fi_lse = (lse_ln / math.log(2.0)).t().contiguous()
    fi_lse[torch.isinf(fi_lse)] = -math.inf
    lse = flash_backward.lse_from_flashinfer(fi_lse)
    torch.testing.assert_close(lse, lse_ln)
    max_q, max_k = max(lq), max(lk)
    got = flash_backward.backward(
        g, q.detach(), k.detach(), v.detach(), out.detach(), lse, cq, ck, max_q, max_k, causal, scale
    )
    for a, t, w in zip(got, (q, k, v), want):
        assert a.shape == t.shape
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [16, 72, 80])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(2, -1), (3, 1), (0, 0), (-1, 2), (40, 40)])
@pytest.mark.parametrize("lq,lk", [([3, 0, 1, 9], [2, 4, 0, 6]), ([7, 2, 11], [7, 2, 11])])
def test_fa2_windowed_forward_and_backward_match_dense_autograd(monkeypatch, d, causal, window, lq, lk):
    """Windows through FlashAttention-2, forward (its LSE included: keyless rows
    +inf) and backward fed that LSE, padded head dims, against float64 autograd."""
    monkeypatch.setattr(flash_backward, "_kernel", _fa2_contract)
    monkeypatch.setattr(flash_backward, "_forward_kernel", _fa2_forward_contract)
    q, k, v, cq, ck = _inputs(lq, lk, d=d, dtype=torch.float64)
    cq, ck = cq.long(), ck.long()
    scale = d**-0.5
    g = torch.randn(q.shape, dtype=torch.float64)
    want_out, *want = dense_gradients(g, q, k, v, cq, ck, causal, scale, window_size=window)
    out, lse = flash_backward.forward(q.detach(), k.detach(), v.detach(), cq, ck, max(lq), max(lk), causal, scale, window)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, reference_lse(q.detach(), k.detach(), cq, ck, causal, scale, window_size=window))
    got = flash_backward.backward(g, q.detach(), k.detach(), v.detach(), out, lse, cq, ck, max(lq), max(lk), causal,
                                  scale, window)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1)), (False, (2, 2))])
@pytest.mark.parametrize("lq,lk", [([3, 0, 1, 9], [2, 4, 0, 6]), ([7, 2, 11], [7, 2, 11])])
def test_sinks_from_a_fused_forward_and_fa2_backward_are_exact(monkeypatch, causal, window, lq, lk):
    """Sinks on CUDA: a fused forward's output and LSE rescaled (with_sinks), and
    FlashAttention-2's backward handed them, give the sinks' attention's exact
    output, LSE and dq/dk/dv; sinks_grad gives d(sinks). Keyless rows included."""
    monkeypatch.setattr(flash_backward, "_kernel", _fa2_contract)
    monkeypatch.setattr(flash_backward, "_forward_kernel", _fa2_forward_contract)
    q, k, v, cq, ck = _inputs(lq, lk, d=16, dtype=torch.float64)
    sinks = 1.5 * torch.randn(q.shape[1], dtype=torch.float64)
    scale = 0.3
    g = torch.randn(q.shape, dtype=torch.float64)
    want_out, *want = dense_gradients(g, q, k, v, cq, ck, causal, scale, window_size=window, sinks=sinks)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = flash_backward.forward(qd, kd, vd, cq, ck, max(lq), max(lk), causal, scale, window)
    out, lse = flash_backward.with_sinks(out, lse, sinks)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, reference_lse(qd, kd, cq, ck, causal, scale, window_size=window, sinks=sinks))
    got = flash_backward.backward(g, qd, kd, vd, out, lse, cq, ck, max(lq), max(lk), causal, scale, window)
    got = (*got, flash_backward.sinks_grad(g, out, lse, sinks))
    assert len(want) == 4
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)


def test_fa2_forward_without_keys_or_queries_calls_no_kernel(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("the kernel rejects n == 0 and fails on max_q/max_k == 0")

    monkeypatch.setattr(flash_backward, "_forward_kernel", boom)
    for lq, lk in (([], []), ([3, 2], [0, 0]), ([0, 0], [4, 1])):
        q, k, v, cq, ck = _inputs(lq, lk, grad=False)
        out, lse = flash_backward.forward(q, k, v, cq, ck, max(lq, default=0), max(lk, default=0), False, 0.3, (2, 2))
        assert out.shape == q.shape and not out.any()
        assert lse.shape == (q.shape[1], q.shape[0]) and bool((lse == float("inf")).all())


@pytest.mark.parametrize("lq,lk", [([], []), ([3, 2], [0, 0]), ([0, 0], [4, 1])])
def test_flash_backward_zero_gradients_without_calling_the_kernel(monkeypatch, lq, lk):
    def boom(*a, **kw):
        raise AssertionError("the kernel rejects n == 0 and fails on max_q/max_k == 0")

    monkeypatch.setattr(flash_backward, "_kernel", boom)
    q, k, v, cq, ck = _inputs(lq, lk, grad=False)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf)
    got = flash_backward.backward(
        torch.randn(q.shape), q, k, v, torch.zeros_like(q), lse, cq, ck,
        max(lq, default=0), max(lk, default=0), True, 0.3,
    )
    for a, t in zip(got, (q, k, v)):
        assert a.shape == t.shape and not a.any()


def test_unsupported_reasons_name_the_limit():
    cpu = torch.device("cpu")
    assert "CUDA" in flash_backward.unsupported_reason(cpu, torch.bfloat16, 64)
    cuda = torch.device("cuda", 0)
    assert "float32" in flash_backward.unsupported_reason(cuda, torch.float32, 64)
    assert "256" in flash_backward.unsupported_reason(cuda, torch.bfloat16, 320)
    assert "symbolic" in select.training_reason(cuda, torch.bfloat16, object())


def _targets(fn, *args):
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(*args)
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_cpu_calls_with_grad_save_the_lse_and_inference_never_does():
    """A CPU call that needs gradients runs the LSE pair on the fused CPU kernel
    (its backward reuses the forward's LSE); float64 (the reference's dtype) and
    calls without grad keep the inference op, whose graph holds no LSE op."""
    import ragged_compile as rc

    q, k, v, cq, ck = _inputs([3, 2], [3, 2])
    call = lambda q, k, v: rc.ragged_attention(q, k, v, cq, ck)  # noqa: E731
    assert "ragged_compile.ragged_attention_lse.default" in _targets(call, q, k, v)
    with torch.no_grad():
        no_grad = _targets(call, q, k, v)
    assert "ragged_compile.ragged_attention.default" in no_grad
    assert not any("lse" in t for t in no_grad)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    f64 = _targets(call, q64, k64, v64)
    assert "ragged_compile.ragged_attention.default" in f64 and not any("lse" in t for t in f64)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_lse_pair_gradients_match_the_inference_op(causal):
    import ragged_compile as rc

    lq, lk = [5, 0, 17, 1, 30], ([5, 3, 17, 1, 30] if causal else [2, 3, 40, 0, 9])
    q, k, v, cq, ck = _inputs(lq, lk)
    out = rc.ragged_attention(q, k, v, cq, ck, causal=causal)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), go)
    ref_out = torch.ops.ragged_compile.ragged_attention(q, k, v, cq, ck, causal, q.shape[-1] ** -0.5)
    want = torch.autograd.grad(ref_out, (q, k, v), go)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- the varlen passes on training graphs --------------------------------------


def _flash_forward_graph(used_outputs, hq=4, hkv=2, d=64):
    """A post-grad forward graph holding aten._flash_attention_forward on fake CUDA
    tensors, returning the outputs a training graph saves for the stock backward."""
    import operator

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = torch.fx.Graph()
    with mode:
        vals = {
            "q": torch.empty(10, hq, d, device="cuda", dtype=torch.bfloat16),
            "k": torch.empty(10, hkv, d, device="cuda", dtype=torch.bfloat16),
            "v": torch.empty(10, hkv, d, device="cuda", dtype=torch.bfloat16),
            "cu": torch.empty(3, device="cuda", dtype=torch.int32),
        }
    nodes = {}
    for name, val in vals.items():
        nodes[name] = g.placeholder(name)
        nodes[name].meta["val"] = val
    args = (nodes["q"], nodes["k"], nodes["v"], nodes["cu"], nodes["cu"], 8, 8, 0.0, True, False)
    fa = g.call_function(torch.ops.aten._flash_attention_forward.default, args, {"scale": 0.3})
    with mode:
        fa.meta["val"] = torch.ops.aten._flash_attention_forward(
            vals["q"], vals["k"], vals["v"], vals["cu"], vals["cu"], 8, 8, 0.0, True, False, scale=0.3
        )
    outs = []
    for i in used_outputs:
        item = g.call_function(operator.getitem, (fa, i))
        item.meta["val"] = fa.meta["val"][i]
        outs.append(item)
    g.output(tuple(outs))
    return g


def test_flash_pass_rewrites_training_forward_to_the_lse_op():
    from ragged_compile.backends import flashinfer as fi
    from ragged_compile.passes import FlashVarlenPass

    if not fi.available():
        pytest.skip("flashinfer is not importable")
    g = _flash_forward_graph((0, 1, 2, 3))
    FlashVarlenPass()(g)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert torch.ops.aten._flash_attention_forward.default not in targets
    assert torch.ops.ragged_compile.ragged_attention_lse.default in targets
    out, lse, rng, unused = g.output_node().args[0]
    for node, i in ((out, 0), (lse, 1)):
        assert node.target.__name__ == "getitem" and node.args[1] == i
        assert node.args[0].target is torch.ops.ragged_compile.ragged_attention_lse.default
    assert lse.meta["val"].shape == (4, 10) and lse.meta["val"].dtype == torch.float32
    for node, shape in ((rng, (2,)), (unused, ())):
        assert node.target is torch.ops.ragged_compile.zero_state.default  # not aten.zeros: Inductor cannot lower uint64 zeros
        assert node.meta["val"].shape == shape and node.meta["val"].dtype == torch.uint64
    g.lint()


def test_flash_pass_keeps_inference_forward_lse_free():
    from ragged_compile.backends import flashinfer as fi
    from ragged_compile.passes import FlashVarlenPass

    if not fi.available():
        pytest.skip("flashinfer is not importable")
    g = _flash_forward_graph((0,))
    FlashVarlenPass()(g)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert torch.ops.ragged_compile.ragged_attention.default in targets
    assert torch.ops.ragged_compile.ragged_attention_lse.default not in targets


def test_flashattention2_calls_past_its_segment_limit_say_so():
    """FlashAttention-2's grid has a block row per segment (CUDA caps it at 65,535):
    beyond it a clear error, not the launch's "invalid argument"."""
    n = flash_backward.MAX_SEGMENTS + 1
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[-1] = 4
    q = torch.randn(4, 2, 64)
    for call in (lambda: flash_backward.forward(q, q, q, cu, cu, 4, 4, True, 0.125, (3, -1)),
                 lambda: flash_backward.backward(q, q, q, q, q, torch.zeros(2, 4), cu, cu, 4, 4, True, 0.125)):
        with pytest.raises(ValueError, match="at most 65535"):
            call()


def test_a_layout_past_the_segment_limit_hands_flashattention2_its_real_segments():
    from ragged_compile.steps import HostLayout

    slots = flash_backward.MAX_SEGMENTS + 10
    lens = torch.zeros(slots, dtype=torch.int64)
    lens[[0, 7, 70000 % slots, slots - 1]] = torch.tensor([3, 5, 1, 2])
    layout = HostLayout.from_lengths(lens)
    cu = layout.cu_q.clone()
    got_q, got_k = layout.fa2_offsets(torch.device("cpu"), cu, cu)
    assert got_q.tolist() == [0, 3, 8, 9, 11] and got_k.tolist() == got_q.tolist()
    small = HostLayout.from_lengths([3, 0, 5])
    c = small.cu_q.clone()
    assert layout.fa2_offsets(torch.device("cpu"), cu, cu)[0] is got_q  # once per layout
    assert small.fa2_offsets(torch.device("cpu"), c, c)[0] is c  # within the limit: the call's own
