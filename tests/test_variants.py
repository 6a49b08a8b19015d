"""Variants of the op: sliding windows, logit soft-capping, attention sinks.

Every kernel against the float64 oracle (which is itself checked against the
definition, element by element), forward and gradients (sinks too); the
kernel each call runs (select.py); the checks; opcheck; torch.compile and
torch.export; head-sharded sinks; on CUDA (marked) the reference kernel.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import ragged_compile as rc
from ragged_compile import logs, testing
from ragged_compile.backends import cpu as cpu_kernel
from ragged_compile.backends import segment_backward, select
from ragged_compile.reference import (
    dense_attention, dense_gradients, dense_lse, reference_attention, reference_attention_backward, sees_key,
)

OPS = torch.ops.ragged_compile
WINDOWS = [(2, -1), (-1, 2), (3, 3), (1, 0), (0, 0), (0, -1), (-1, 0), (100, 100), (5, 1)]
LAYOUTS = {
    "self": ([5, 9, 1, 17], None),
    "cross": ([2, 6, 9, 3], [7, 1, 4, 12]),
    "empty-and-one": ([0, 3, 1, 0, 1], [2, 0, 1, 0, 6]),
}


def cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def make(q_lens, kv_lens=None, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0, grad=False):
    kv_lens = q_lens if kv_lens is None else kv_lens
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype)
    v = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype)
    sinks = (2 * torch.randn(hq, generator=g)).to(dtype)
    if grad:
        for t in (q, k, v, sinks):
            t.requires_grad_()
    return q, k, v, cu(q_lens), cu(kv_lens), sinks


@pytest.fixture(autouse=True)
def _fresh_warnings():
    logs._seen.clear()


def _brute(q, k, v, lq, lk, causal, scale, window, softcap, sinks):
    """The definition, one element at a time (float64): row i of a segment sees key
    j iff i' - left <= j <= i' + right (i' = i + Lk - Lq; causal: right 0)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    grp = q.shape[1] // k.shape[1]
    left, right = window
    q0 = k0 = 0
    for Lq, Lk in zip(lq, lk):
        for i in range(Lq):
            ip = i + Lk - Lq
            for h in range(q.shape[1]):
                logits, vals = [], []
                for j in range(Lk):
                    if (causal and j > ip) or (right >= 0 and j > ip + right) or (left >= 0 and j < ip - left):
                        continue
                    s = float(q[q0 + i, h].double() @ k[k0 + j, h // grp].double()) * scale
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s)
                    vals.append(v[k0 + j, h // grp].double())
                if not logits:
                    continue
                extra = [float(sinks[h])] if sinks is not None else []
                m = max(logits + extra)
                w = [math.exp(s - m) for s in logits]
                denom = sum(w) + sum(math.exp(s - m) for s in extra)
                out[q0 + i, h] = sum(wi / denom * vi for wi, vi in zip(w, vals))
        q0 += Lq
        k0 += Lk
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,softcap,with_sinks", [
    ((2, 1), 0.0, False), ((0, -1), 0.0, False), ((-1, 1), 0.0, True), ((1, 1), 1.5, True),
    ((-1, -1), 2.0, False), ((-1, -1), 0.0, True), ((3, 0), 0.0, False),
])
def test_oracle_is_the_definition(causal, window, softcap, with_sinks):
    lq, lk = [3, 5, 1, 0, 2], [4, 2, 1, 3, 0]
    q, k, v, cq, ck, sinks = make(lq, lk, hq=4, hkv=2, d=4, dtype=torch.float64)
    sinks = sinks if with_sinks else None
    want = _brute(q, k, v, lq, lk, causal, 0.7, window, softcap, sinks)
    got = dense_attention(q, k, v, cq, ck, causal, 0.7, window_size=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    blind = ~sees_key(cq.long(), ck.long(), q.shape[0], causal, window)
    assert bool((want[blind] == 0).all()) and bool((want[~blind] != 0).any(-1).all())


def _check(q, k, v, cq, ck, causal, window, softcap, sinks, tol=2e-5):
    """The op (forward and gradients, through autograd) against the oracle."""
    scale = q.shape[-1] ** -0.5
    out = rc.ragged_attention(q, k, v, cq, ck, causal=causal, window_size=window, softcap=softcap, sinks=sinks)
    kw = dict(window_size=window, softcap=softcap, sinks=sinks)
    ref = dense_attention(q.detach(), k.detach(), v.detach(), cq, ck, causal, scale,
                          **{**kw, "sinks": None if sinks is None else sinks.detach()})
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    blind = ~sees_key(cq.long(), ck.long(), q.shape[0], causal, window)
    assert bool((out[blind] == 0).all())
    leaves = [t for t in (q, k, v, sinks) if t is not None and t.requires_grad]
    if not leaves:
        return
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    got = torch.autograd.grad(out, leaves, go, allow_unused=True)
    want = dense_gradients(go, q, k, v, cq, ck, causal, scale, **kw)[1:]
    for name, g, w in zip("q k v sinks".split(), got, want):
        g = torch.zeros_like(w) if g is None else g
        torch.testing.assert_close(g.double(), w, rtol=10 * tol, atol=10 * tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_windows_match_the_oracle(layout, causal, window):
    q, k, v, cq, ck, _ = make(*LAYOUTS[layout], grad=True)
    _check(q, k, v, cq, ck, causal, window, 0.0, None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.5, 5.0, 50.0])
def test_softcap_matches_the_oracle(layout, causal, softcap):
    q, k, v, cq, ck, _ = make(*LAYOUTS[layout], grad=True)
    _check(q, k, v, cq, ck, causal, (-1, -1), softcap, None)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink_scale", [1.0, 10.0])
def test_sinks_match_the_oracle_and_get_gradients(layout, causal, sink_scale):
    q, k, v, cq, ck, sinks = make(*LAYOUTS[layout], grad=True)
    sinks = (sinks.detach() * sink_scale).requires_grad_()
    _check(q, k, v, cq, ck, causal, (-1, -1), 0.0, sinks)


@pytest.mark.parametrize("d", [72, 80])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1)])
def test_all_variants_together_gqa_head_dims(d, hq, hkv):
    q, k, v, cq, ck, sinks = make([7, 1, 0, 33], [9, 2, 3, 33], hq=hq, hkv=hkv, d=d, grad=True)
    for causal in (False, True):
        _check(q, k, v, cq, ck, causal, (4, 2), 3.0, sinks)
        _check(q, k, v, cq, ck, causal, (6, -1), 0.0, sinks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_variant_dtypes(dtype):
    q, k, v, cq, ck, sinks = make([6, 0, 9], [4, 3, 9], dtype=dtype)
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float64: 1e-10}[dtype]
    for window, softcap, s in (((2, 1), 0.0, None), ((-1, -1), 4.0, None), ((1, -1), 0.0, sinks), ((3, 3), 2.0, sinks)):
        out = rc.ragged_attention(q, k, v, cq, ck, window_size=window, softcap=softcap, sinks=s)
        assert out.dtype == dtype
        ref = dense_attention(q, k, v, cq, ck, False, 16**-0.5, window_size=window, softcap=softcap, sinks=s)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_window_wider_than_every_segment_is_plain_attention():
    q, k, v, cq, ck, _ = make([5, 9, 1], [3, 9, 4])
    for causal in (False, True):
        plain = rc.ragged_attention(q, k, v, cq, ck, causal=causal)
        wide = rc.ragged_attention(q, k, v, cq, ck, causal=causal, window_size=(50, 50))
        torch.testing.assert_close(wide, plain, rtol=1e-6, atol=1e-6)


def test_right_zero_window_is_causal():
    q, k, v, cq, ck, _ = make([5, 9, 1], [7, 9, 4])
    a = rc.ragged_attention(q, k, v, cq, ck, window_size=(-1, 0))
    b = rc.ragged_attention(q, k, v, cq, ck, causal=True)
    assert torch.equal(a, b)  # the same call: right = 0 is causal's flag


def test_huge_and_tiny_sinks():
    q, k, v, cq, ck, _ = make([4, 6], [5, 6], hq=2, hkv=2)
    out = rc.ragged_attention(q, k, v, cq, ck, sinks=torch.tensor([80.0, -80.0]))
    plain = rc.ragged_attention(q, k, v, cq, ck)
    assert float(out[:, 0].abs().max()) < 1e-20  # the sink takes every row's mass
    torch.testing.assert_close(out[:, 1], plain[:, 1])  # a sink of -80 takes none


# -- which kernel runs ---------------------------------------------------------------


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ragged_compile":
            self.seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_select_variant_and_kernels():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select.variant(False) == () and select.variant(True, (-1, 0)) == ()
    assert select.variant(True, (3, -1)) == ("window",) and select.variant(False, (-1, 0)) == ("window",)
    assert select.variant(False, (-1, -1), 2.0, torch.zeros(2)) == ("sinks", "softcap")
    assert select.forward_kernel(cpu, torch.float32, 64, ("window", "sinks")) == "cpu"
    assert select.forward_kernel(cpu, torch.float32, 64, ("softcap",)) == "reference"
    assert "soft-cap" in select.forward_reason(cpu, torch.float32, 64, ("softcap",))
    assert select.forward_reason(cpu, torch.float32, 64, ("window",)) is None
    assert select.forward_kernel(cuda, torch.bfloat16, 64, ("sinks", "softcap")) == "reference"
    assert "not wired" in select.forward_reason(cuda, torch.bfloat16, 64, ("sinks", "softcap"))
    assert select.trains_with_lse(cpu, torch.float32, 64, ("sinks",))
    assert not select.trains_with_lse(cpu, torch.float32, 64, ("softcap",))
    assert not select.trains_with_lse(cuda, torch.bfloat16, 64, ("sinks", "softcap"))
    # rewrites and hf: variants stay on the op on CPU; on CUDA stock keeps them (ours is the reference)
    assert select.unsupported_reason(cpu, torch.float32, 64, variant=("softcap",)) is None
    why = select.unsupported_reason(cuda, torch.bfloat16, 64, variant=("sinks", "softcap"))
    assert "reference kernel on CUDA" in why and "sinks" in why
    assert not select.cuda_runs_reference(cpu, torch.float32, 64, ("window",))


def test_cuda_runs_reference_warns_once(caplog):
    cuda = torch.device("cuda")
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        assert select.cuda_runs_reference(cuda, torch.bfloat16, 64, ("sinks", "softcap"))
        assert select.cuda_runs_reference(cuda, torch.bfloat16, 64, ("sinks", "softcap"))
    msgs = [r.getMessage() for r in caplog.records if r.name == "ragged_compile"]
    assert len(msgs) == 1 and "sinks" in msgs[0] and "reference kernel" in msgs[0]


def test_cuda_windows_choose_flashattention2_where_it_runs(monkeypatch):
    """Windows alone run FlashAttention-2 forward and backward on CUDA (both sides
    bounded, which FlashInfer's ragged kernels cannot); with softcap or sinks, or
    where FA2 cannot run (no kernels in the build, float32, head dim > 256), the
    reference kernel, and the rewrites keep their stock path."""
    from ragged_compile.backends import flash_backward

    cuda = torch.device("cuda")
    def fa2_on_sm90(device, dtype, head_dim):  # as on an H200 (this build may have no FlashAttention)
        ok = dtype in flash_backward.DTYPES and head_dim <= flash_backward.MAX_HEAD_DIM
        return None if ok else "the fused backward takes float16/bfloat16 and head_dim <= 256"

    monkeypatch.setattr(flash_backward, "unsupported_reason", fa2_on_sm90)
    window = ("window",)
    assert select.forward_kernel(cuda, torch.bfloat16, 80, window) == "fa2"
    assert select.forward_reason(cuda, torch.bfloat16, 80, window) is None
    assert not select.cuda_runs_reference(cuda, torch.float16, 80, window)
    assert select.trains_with_lse(cuda, torch.bfloat16, 80, window)
    assert select.unsupported_reason(cuda, torch.bfloat16, 80, variant=window) is None
    assert select.unsupported_reason(cuda, torch.bfloat16, 80, training=True, variant=window) is None
    assert select.backward_kernel(cuda, torch.bfloat16, 80, 1e4, window) == "fa2"
    monkeypatch.setenv("RAGGED_COMPILE_BACKWARD", "fa4")  # FA4's windowed backward is not wired: FA2 still
    assert select.backward_kernel(cuda, torch.bfloat16, 80, 1e4, window) == "fa2"
    for sinks in (("sinks",), ("sinks", "window")):  # a fused forward rescaled, FA2's backward
        assert select.trains_with_lse(cuda, torch.bfloat16, 80, sinks)
        assert select.backward_kernel(cuda, torch.bfloat16, 80, 1e4, sinks) == "fa2"
    assert select.forward_kernel(cuda, torch.bfloat16, 80, ("sinks", "window")) == "fa2"
    for dtype, d, variant in ((torch.float32, 64, window), (torch.bfloat16, 320, window),
                              (torch.bfloat16, 64, ("sinks", "softcap", "window"))):
        assert select.forward_kernel(cuda, dtype, d, variant) == "reference"
        assert not select.trains_with_lse(cuda, dtype, d, variant)
        assert "reference kernel on CUDA" in select.unsupported_reason(cuda, dtype, d, variant=variant)


def test_cuda_softcap_runs_flashinfer_forward_with_a_left_window(monkeypatch):
    """Soft-capped calls run FlashInfer's forward, which caps and bounds the left
    side at plan time, and train on its LSE with segment_backward.py's Triton
    backward; a right bound (non-causal), sinks and a backward Triton cannot take
    stay on the reference, and transformers keeps its own attention there."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(select, "_cuda_forward_reason",
                        lambda dtype, d: None if dtype in (torch.float16, torch.bfloat16) and d <= 256 else "no")
    monkeypatch.setattr(segment_backward, "triton", object())  # importable, on a machine without it
    for variant in (("softcap",), ("softcap", "window")):
        assert select.forward_kernel(cuda, torch.bfloat16, 96, variant) == "flashinfer"
        assert select.trains_with_lse(cuda, torch.bfloat16, 96, variant)
        assert select.unsupported_reason(cuda, torch.bfloat16, 96, variant=variant) is None
        assert select.unsupported_reason(cuda, torch.bfloat16, 96, training=True, variant=variant) is None
        assert not select.cuda_runs_reference(cuda, torch.bfloat16, 96, variant, training=True, causal=True)
    monkeypatch.setattr(segment_backward, "triton", None)
    for variant in (("softcap",), ("softcap", "window")):
        assert not select.trains_with_lse(cuda, torch.bfloat16, 96, variant)
        assert "triton is not importable" in select.unsupported_reason(cuda, torch.bfloat16, 96, training=True,
                                                                       variant=variant)
        assert select.cuda_runs_reference(cuda, torch.bfloat16, 96, variant, training=True)
    soft_window = ("softcap", "window")
    assert not select.cuda_runs_reference(cuda, torch.bfloat16, 96, soft_window, causal=True, window=(7, -1))
    assert not select.cuda_runs_reference(cuda, torch.bfloat16, 96, soft_window, causal=False, window=(7, -1))
    assert select.cuda_runs_reference(cuda, torch.bfloat16, 96, soft_window, causal=False, window=(7, 7))
    assert select.flashinfer_window(True, (7, -1)) == 7 and select.flashinfer_window(False, (-1, -1)) == -1
    assert select.flashinfer_window(False, (7, 0)) is None
    assert select.forward_kernel(cuda, torch.float32, 96, ("softcap",)) == "reference"
    assert select.forward_kernel(cuda, torch.bfloat16, 96, ("sinks", "softcap")) == "reference"
    assert select.forward_kernel(cuda, torch.bfloat16, 96, ("sinks",)) == "flashinfer"  # rescaled by the sinks


@pytest.mark.parametrize("variant,pair", [
    (dict(window_size=(3, 1)), True), (dict(sinks=True), True), (dict(softcap=2.0), False),
])
def test_training_runs_the_pair_where_the_cpu_kernel_runs(variant, pair):
    q, k, v, cq, ck, sinks = make([5, 9], grad=True)
    if variant.get("sinks"):
        variant = dict(sinks=sinks)
    with Ops() as ops:
        rc.ragged_attention(q, k, v, cq, ck, causal=True, **variant).sum().backward()
    if pair:
        assert ops.seen == ["ragged_attention_lse", "ragged_attention_lse_backward"], ops.seen
    else:
        assert ops.seen == ["ragged_attention", "ragged_attention_backward"], ops.seen
    with torch.no_grad(), Ops() as ops:
        rc.ragged_attention(q, k, v, cq, ck, causal=True, **variant)
    assert ops.seen == ["ragged_attention"]


def test_reference_flag_runs_the_reference(monkeypatch):
    from ragged_compile import config

    q, k, v, cq, ck, sinks = make([5, 9], grad=True)
    monkeypatch.setenv(config.REFERENCE, "1")
    _check(q, k, v, cq, ck, True, (2, -1), 0.0, sinks)


def test_cpu_kernel_window_masks_stay_piece_sized():
    """A long segment with a short window: masks of chunk size, never [T, T]."""
    T = 3000
    c = cu([T])
    p = cpu_kernel.plan(c, c, True, 4, 2, 16, (31, -1))
    masks = [call.mask for call in p.calls if call.mask is not None]
    assert masks and max(m.numel() for m in masks) <= 64 * 128
    assert sum(call.B * call.Pq for call in p.calls) == T and p.covered and p.shared_keys
    q, k, v, cq, ck, sinks = make([T], hq=4, hkv=2, d=16)
    out = rc.ragged_attention(q, k, v, cq, ck, causal=True, window_size=(31, -1), sinks=sinks)
    ref = reference_attention(q, k, v, cq, ck, True, 0.25, window_size=(31, -1), sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


def test_cpu_kernel_lse_and_saved_forward_backward():
    q, k, v, cq, ck, sinks = make([7, 0, 40, 3], [5, 2, 40, 9])
    kw = dict(window_size=(5, 2), sinks=sinks)
    out, lse = cpu_kernel.cpu_attention(q, k, v, cq, ck, False, 0.25, return_lse=True, **kw)
    want = dense_lse(q, k, cq, ck, False, 0.25, **kw).t()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], want[finite], rtol=1e-5, atol=1e-5)
    go = torch.randn_like(q)
    saved = cpu_kernel.cpu_attention_backward(go, q, k, v, cq, ck, False, 0.25, out=out, lse=lse, **kw)
    again = cpu_kernel.cpu_attention_backward(go, q, k, v, cq, ck, False, 0.25, **kw)
    ref = reference_attention_backward(go, q, k, v, cq, ck, False, 0.25, **kw)
    assert len(saved) == len(again) == len(ref) == 4
    for a, b, c in zip(saved, again, ref):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-4)


# -- checks --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a 2-tuple \(left, right\)"),
    (dict(window_size=4), TypeError, r"window_size must be a 2-tuple"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size left must be >= -1"),
    (dict(window_size=(1, 1.5)), TypeError, r"window_size right must be an int"),
    (dict(window_size=(True, 0)), TypeError, r"window_size left must be an int"),
    (dict(softcap=-1.0), ValueError, r"softcap must be a finite float >= 0"),
    (dict(softcap=math.inf), ValueError, r"softcap must be a finite float >= 0"),
    (dict(softcap="50"), TypeError, r"softcap must be a float"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be \[Hq\] = \[4\].*reshape"),
    (dict(sinks=torch.zeros(4, 1)), ValueError, r"sinks must be \[Hq\] = \[4\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, r"sinks must be a floating-point tensor"),
    (dict(sinks=[0.0] * 4), TypeError, r"sinks must be a torch.Tensor"),
    (dict(sinks=torch.zeros(4, device="meta")), ValueError, r"sinks is on meta but q is on cpu.*sinks.to"),
])
def test_bad_variant_arguments_name_the_argument_and_the_fix(kwargs, err, match):
    q, k, v, cq, ck, _ = make([3, 2])
    with pytest.raises(err, match=match):
        rc.ragged_attention(q, k, v, cq, ck, **kwargs)


def test_fake_kernels_check_variants():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cq, ck, _ = make([3, 2])
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="sinks must be"):
            OPS.ragged_attention(q, k, v, cq, ck, False, 0.3, -1, -1, 0.0, torch.zeros(3))
        with pytest.raises(RuntimeError, match="window_left must be >= -1"):
            OPS.ragged_attention_lse(q, k, v, cq, ck, False, 0.3, -3, -1, 0.0, None)


# -- opcheck, compile, export ----------------------------------------------------------

OPCHECK = {
    "window-cross": ([3, 0, 5], [4, 2, 6], (2, 1), 0.0, False),
    "softcap-gqa": ([4, 4], None, (-1, -1), 2.5, False),
    "sinks": ([2, 6, 1], [3, 6, 0], (-1, -1), 0.0, True),
    "all": ([5, 1], [7, 2], (1, -1), 3.0, True),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name, causal):
    lq, lk, (left, right), softcap, with_sinks = OPCHECK[name]
    q, k, v, cq, ck, sinks = make(lq, lk, hq=4, hkv=2 if "gqa" not in name else 1, grad=True)
    sinks = sinks if with_sinks else None
    args = (q, k, v, cq, ck, causal, 0.3, left, right, softcap, sinks)
    torch.library.opcheck(OPS.ragged_attention.default, args)
    torch.library.opcheck(OPS.ragged_attention_lse.default, args)
    # the backward ops have no autograd of their own: plain inputs
    q, k, v = (t.detach() for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach()
    go = torch.randn_like(q)
    torch.library.opcheck(OPS.ragged_attention_backward.default, (go, q, k, v, cq, ck, causal, 0.3, left, right,
                                                                  softcap, sinks))
    out, lse, max_lens = OPS.ragged_attention_lse(q, k, v, cq, ck, causal, 0.3, left, right, softcap, sinks)
    torch.library.opcheck(OPS.ragged_attention_lse_backward.default, (go, q, k, v, out, lse, cq, ck, max_lens, causal,
                                                                      0.3, left, right, softcap, sinks))


def _model(q, k, v, cq, ck, sinks):
    a = rc.ragged_attention(q * 2.0, k, v, cq, ck, causal=True, window_size=(3, -1), sinks=sinks)
    b = rc.ragged_attention(q, k, v, cq, ck, window_size=(2, 2), softcap=4.0)
    return (a + b).sum(-1)


def test_compile_fullgraph_forward_and_backward():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_model, backend=backend, fullgraph=True)
    q, k, v, cq, ck, sinks = make([5, 0, 9], [3, 4, 9], grad=True)
    got = compiled(q, k, v, cq, ck, sinks)
    want = _model(q, k, v, cq, ck, sinks)
    torch.testing.assert_close(got, want)
    g1 = torch.autograd.grad(got.sum(), (q, k, v, sinks))
    g2 = torch.autograd.grad(want.sum(), (q, k, v, sinks))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    # a new layout of the same shapes: no recompile
    cq2, ck2 = cu([9, 0, 5]), cu([9, 4, 3])
    torch.testing.assert_close(compiled(q, k, v, cq2, ck2, sinks), _model(q, k, v, cq2, ck2, sinks))
    assert backend.frame_count == 1
    torch._dynamo.reset()


def test_compile_inductor_cpu():
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True)
    q, k, v, cq, ck, sinks = make([5, 0, 9], [3, 4, 9])
    torch.testing.assert_close(compiled(q, k, v, cq, ck, sinks), _model(q, k, v, cq, ck, sinks))
    torch._dynamo.reset()


def test_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.randn(4))

        def forward(self, q, k, v, cq, ck):
            return rc.ragged_attention(q, k, v, cq, ck, causal=True, window_size=(2, -1), softcap=5.0,
                                       sinks=self.sinks)

    m = M()
    q, k, v, cq, ck, _ = make([5, 0, 9], [3, 4, 9])
    ep = torch.export.export(m, (q, k, v, cq, ck))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert OPS.ragged_attention.default in targets
    torch.testing.assert_close(ep.module()(q, k, v, cq, ck), m(q, k, v, cq, ck))


def test_torch_func_grad_with_sinks():
    q, k, v, cq, ck, sinks = make([4, 6], [5, 6])

    def loss(q, sinks):
        return rc.ragged_attention(q, k, v, cq, ck, window_size=(2, 2), sinks=sinks).square().sum()

    gq, gs = torch.func.grad(loss, argnums=(0, 1))(q, sinks)
    q2, s2 = q.clone().requires_grad_(), sinks.clone().requires_grad_()
    loss(q2, s2).backward()
    torch.testing.assert_close(gq, q2.grad)
    torch.testing.assert_close(gs, s2.grad)


# -- hypothesis --------------------------------------------------------------------------


@settings(max_examples=testing.scaled_examples(0.15, minimum=25))
@given(case=testing.attention_cases(
    dtypes=(torch.float32,), head_dims=(8, 16, 72), max_segments=8, max_len=48, max_elements=1 << 13,
    max_tiny_segments=64, window_size=True, softcap=True, sinks=True,
))
def test_drawn_variant_calls_match_the_oracle(case):
    args = case.args()
    out = rc.ragged_attention(**args)
    testing.assert_matches_reference(out, **args)
    q, k, v = (args[n].detach().requires_grad_() for n in "qkv")
    leaves = [q, k, v]
    sinks = args.get("sinks")
    if sinks is not None:
        sinks = sinks.detach().requires_grad_()
        leaves.append(sinks)
    call = {**args, "q": q, "k": k, "v": v, **({"sinks": sinks} if sinks is not None else {})}
    out = rc.ragged_attention(**call)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed))
    got = torch.autograd.grad(out, leaves, go, allow_unused=True)
    kw = case.variants
    want = dense_gradients(go, q, k, v, args["cu_seqlens_q"], case.layout.cu_seqlens_k, case.causal,
                           case.effective_scale, **kw)[1:]
    for g, w in zip(got, want):
        g = torch.zeros_like(w) if g is None else g
        torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4)


def test_strategies_are_off_by_default_and_checked():
    case = testing.attention_cases(max_segments=4).example()
    assert case.window_size == (-1, -1) and case.softcap == 0.0 and not case.sinks
    assert set(case.args()) == {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "causal", "scale"}
    fixed = testing.attention_cases(max_segments=4, window_size=(3, 0), softcap=2.0, sinks=st.just(True)).example()
    args = fixed.args()
    assert args["window_size"] == (3, 0) and args["softcap"] == 2.0 and args["sinks"].shape == (fixed.hq,)
    with pytest.raises(ValueError, match="window_size"):
        testing.attention_cases(window_size=(1, -5))
    with pytest.raises(ValueError, match="softcap"):
        testing.attention_cases(softcap=-1.0)
    with pytest.raises(ValueError, match="softcaps"):
        testing.softcaps(0.0)


# -- CUDA: windows on FlashAttention-2, other variants on the reference ---------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", [
    dict(window_size=(3, -1)), dict(window_size=(2, 2)), dict(softcap=5.0), dict(sinks=True),
    dict(window_size=(4, 1), softcap=3.0, sinks=True),
])
def test_cuda_variants_equal_the_oracle(dtype, variant, caplog):
    from ragged_compile.runtime import get_runtime

    stats = get_runtime(torch.device("cuda")).stats
    before = dict(stats)
    _cuda_variant_against_the_oracle(dtype, variant, caplog)
    ran = {name: stats[name] - before.get(name, 0) for name in ("fa2", "flashinfer", "varlen", "window")}
    backward = stats["triton_backward"] - before.get("triton_backward", 0)
    if set(variant) == {"window_size"} and dtype == torch.bfloat16:
        # short windows bounded on both sides (causal bounds the right) run window_forward.py,
        # others FlashAttention-2 (the training forward too; FlashAttention-2's backward after either)
        assert ran["fa2"] + ran["window"] >= 2
        if variant["window_size"] == (2, 2):
            assert ran["window"] >= 2 and ran["fa2"] == 0
    elif set(variant) == {"softcap"} and dtype == torch.bfloat16:
        assert ran["flashinfer"] >= 2, "softcap runs FlashInfer's forward"
        assert backward == 2, "and segment_backward.py's backward"
    elif set(variant) == {"sinks"} and dtype == torch.bfloat16:
        assert ran["flashinfer"] + ran["varlen"] >= 2, "sinks rescale a fused forward"
    else:
        assert ran == {"fa2": 0, "flashinfer": 0, "varlen": 0, "window": 0} and "reference kernel" in caplog.text


@pytest.mark.cuda
@pytest.mark.parametrize("d,hq,hkv", [(64, 8, 2), (72, 4, 4), (80, 6, 3), (96, 4, 1), (128, 8, 8), (256, 2, 2)])
@pytest.mark.parametrize("window", [(0, -1), (16, -1), (5, 5), (-1, 3), (300, 300), (0, 0)])
@pytest.mark.parametrize("layout", ["mixed", "cross"])
def test_cuda_windows_match_the_oracle(d, hq, hkv, window, layout):
    """Windows on CUDA (FlashAttention-2; window_forward.py's forward for the short
    ones bounded on both sides) against float64, forward and gradients: empty and
    one-token segments, Lq > Lk and Lq < Lk, a window wider than every segment, GQA,
    head dims 72/80/96 (padded to multiples of 8), causal and not."""
    lq, lk = {"mixed": ([200, 0, 1, 37, 64], None), "cross": ([9, 40, 0, 3, 1], [30, 12, 5, 0, 1])}[layout]
    q, k, v, cq, ck, _ = make(lq, lk, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, seed=d + window[0])
    q, k, v, cq, ck = (t.cuda() for t in (q, k, v, cq, ck))
    for t in (q, k, v):
        t.requires_grad_()
    for causal in (False, True):
        out = rc.ragged_attention(q, k, v, cq, ck, causal=causal, window_size=window)
        go = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), go)
        args = (*(t.detach().cpu() for t in (q, k, v)), cq.cpu(), ck.cpu(), causal, d**-0.5)
        want = dense_gradients(go.cpu(), *args, window_size=window)
        torch.testing.assert_close(out.double().cpu(), want[0], rtol=2e-2, atol=2e-2)
        for g, w in zip(got, want[1:]):
            torch.testing.assert_close(g.double().cpu(), w, rtol=5e-2, atol=5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("window,causal", [((5, -1), True), ((3, 2), False), ((0, 7), False), ((-1, 4), False)])
def test_cuda_windowed_segments_stay_independent(window, causal):
    """A NaN or Inf in one segment's q, k or v moves no other segment's output on
    the windowed forwards (FlashAttention-2's, window_forward.py's)."""
    def fn(x, c):
        return rc.ragged_attention(x[:, :4], x[:, 4:6], x[:, 6:], c, causal=causal, window_size=window)

    x = torch.randn(70 + 5 + 40 + 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    testing.check_segment_independence(fn, x, cu([70, 5, 40, 1]).cuda())


def _cuda_variant_against_the_oracle(dtype, variant, caplog):
    q, k, v, cq, ck, sinks = make([7, 0, 33, 1], [9, 2, 33, 5], hq=8, hkv=2, d=64, dtype=dtype)
    q, k, v, cq, ck, sinks = (t.cuda() for t in (q, k, v, cq, ck, sinks))
    if variant.get("sinks"):
        variant = {**variant, "sinks": sinks.float().requires_grad_()}
    for t in (q, k, v):
        t.requires_grad_()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        for causal in (False, True):
            out = rc.ragged_attention(q, k, v, cq, ck, causal=causal, **variant)
            kw = {n: (x.detach().cpu() if isinstance(x, torch.Tensor) else x) for n, x in variant.items()}
            ref = dense_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), cq.cpu(), ck.cpu(), causal,
                                  64**-0.5, **kw)
            torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol)
            leaves = [q, k, v] + ([variant["sinks"]] if "sinks" in variant else [])
            go = torch.randn_like(out)
            got = torch.autograd.grad(out, leaves, go)
            want = dense_gradients(go.cpu(), *(t.detach().cpu() for t in (q, k, v)), cq.cpu(), ck.cpu(), causal,
                                   64**-0.5, **kw)[1:]
            for g, w in zip(got, want):
                torch.testing.assert_close(g.double().cpu(), w, rtol=5 * tol, atol=5 * tol)


@pytest.mark.parametrize("variant", [
    dict(window_size=(5, -1), causal=True), dict(window_size=(3, 2)), dict(softcap=2.0, window_size=(-1, 4)),
    dict(sinks=True, window_size=(7, 7)),
])
def test_segments_stay_independent_under_variants(variant):
    sinks = torch.randn(4)
    kw = {**variant, "sinks": sinks} if variant.get("sinks") else variant

    def fn(x, c):
        return rc.ragged_attention(x[:, :4], x[:, 4:6], x[:, 6:], c, **kw)

    x = torch.randn(70 + 5 + 40 + 1, 8, 16)
    testing.check_segment_independence(fn, x, cu([70, 5, 40, 1]))
