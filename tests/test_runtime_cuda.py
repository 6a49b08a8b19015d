"""The FlashInfer kernel through the runtime, against the float32 reference (CUDA only)."""

from __future__ import annotations


import pytest
import torch

import ragged_compile as rc
from ragged_compile.backends import flashinfer as fi
from ragged_compile.reference import reference_attention, sees_key

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cu(lens, device="cuda"):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return cu.to(device)


def _case(lq, lk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(sum(lk), hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(sum(lk), hkv, d, device="cuda", generator=g).to(dtype)
    return q, k, v, _cu(lq), _cu(lk)


def _check(out, q, k, v, cu_q, cu_k, causal, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref = reference_attention(q.float(), k.float(), v.float(), cu_q, cu_k, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    assert err < 2e-2, err


LAYOUTS = {
    "mixed": ([64, 1, 0, 300, 17, 1024], None),
    "one_token": ([1] * 40, None),
    "empty_kv": ([5, 7, 9], [0, 12, 0]),
    "cross_short_q": ([1, 1, 1, 1], [77, 0, 300, 5]),
    "q_longer": ([40, 9, 100], [10, 9, 3]),
    "full_long": ([2048, 2048], None),
    # Found by the CUDA fuzzer: fa2 got causal rows wrong when Lq > Lk past a tile.
    "q_overhang": ([128, 200, 5, 3], [64, 10, 5, 0]),
}


@pytest.mark.parametrize("backend", ["fa2", "fa3", "varlen"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,d", [((8, 8), 64), ((8, 2), 128), ((4, 1), 72), ((6, 3), 80), ((4, 4), 96)])
def test_matches_reference(backend, layout, causal, heads, d):
    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs SM90")
    lq, lk = LAYOUTS[layout]
    lk = lq if lk is None else lk
    q, k, v, cu_q, cu_k = _case(lq, lk, *heads, d)
    runtime = rc.Runtime(backend=backend)
    with runtime.step():
        out = runtime.attention(q, k, v, cu_q, cu_k, causal, d**-0.5)
    _check(out, q, k, v, cu_q, cu_k, causal)
    kernel = "varlen" if backend == "varlen" else "flashinfer"
    assert runtime.stats[kernel] == 1 and runtime.stats["reference"] == 0
    assert runtime.stats["plans"] == (kernel == "flashinfer") and runtime.last_backend == backend


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("split_kv", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,d,dtype", [((8, 2), 128, torch.bfloat16), ((4, 4), 64, torch.bfloat16),
                                           ((4, 2), 256, torch.float16)])
def test_flashinfer_writes_zero_for_rows_that_see_no_key(backend, graph, split_kv, causal, heads, d, dtype):
    """The runtime and graph mode leave keyless rows (empty k/v segments, causal
    Lq > Lk, graph mode's padding segment) to FlashInfer: they must come back
    exactly zero even where the output memory held NaN."""
    if backend == "fa3" and (torch.cuda.get_device_capability() != (9, 0) or d == 256):
        pytest.skip("fa3 needs SM90 (and its d=256 kernel is not worth a JIT here)")
    lq = [5, 7, 9, 300, 1, 40]
    lk = [0, 12, 0, 200, 3000, 0]  # the last: graph mode's padding segment
    q, k, v, cu_q, cu_k = _case(lq, lk, *heads, d, dtype)
    n = len(lq)
    entries = 2 * n + 1 if causal else n + 1
    bufs = {}
    if graph:
        bufs = dict(qo_indptr_buf=torch.zeros(entries, dtype=torch.int32, device="cuda"),
                    kv_indptr_buf=torch.zeros(entries, dtype=torch.int32, device="cuda"))
    w = fi.make_wrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), backend, **bufs)
    fi.plan(w, cu_q.cpu(), cu_k.cpu(), *heads, d, dtype, causal, d**-0.5, split_kv=split_kv)
    out = torch.full((sum(lq), heads[0], d), float("nan"), dtype=dtype, device="cuda")
    w.run(q, k, v, out=out)
    blind = ~sees_key(cu_q.cpu(), cu_k.cpu(), sum(lq), causal).cuda()
    assert int(blind.sum()) >= 54
    assert out[blind].eq(0).all()
    _check(out, q, k, v, cu_q, cu_k, causal)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lse", [False, True])
def test_replayed_runs_equal_flashinfers_run_bit_for_bit(backend, graph, causal, lse):
    """fi.run / fi.run_with_lse replay the kernel call of the plan's first run: every
    later call of that plan, on other tensors, equals wrapper.run exactly, and a new
    plan is recorded anew."""
    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs SM90")
    heads, d, dtype = (8, 2), 128, torch.bfloat16
    layouts = [([5, 7, 300, 1, 40], [12, 7, 200, 3000, 0]), ([64, 64, 3, 9, 100], [64, 64, 3, 0, 100])]
    bufs = {}
    if graph:  # a graph-mode wrapper has a fixed number of segments
        entries = 11 if causal else 6
        bufs = dict(qo_indptr_buf=torch.zeros(entries, dtype=torch.int32, device="cuda"),
                    kv_indptr_buf=torch.zeros(entries, dtype=torch.int32, device="cuda"))
    w = fi.make_wrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), backend, **bufs)
    for lq, lk in layouts:
        fi.plan(w, _cu(lq, "cpu"), _cu(lk, "cpu"), *heads, d, dtype, causal, d**-0.5, causal_split=graph or None)
        for seed in range(3):
            q, k, v, cu_q, cu_k = _case(lq, lk, *heads, d, dtype, seed=seed)
            got = fi.run_with_lse(w, q, k, v) if lse else (fi.run(w, q, k, v),)
            want = w.run(q, k, v, return_lse=True) if lse else (w.run(q, k, v),)
            for g_, w_ in zip(got, want):
                torch.testing.assert_close(g_, w_, rtol=0, atol=0)
            if seed == 0:
                _check(got[0], q, k, v, cu_q, cu_k, causal)
        assert getattr(w, fi._REPLAY) is not None, "the call was not recorded for replay"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_public_function_on_cuda(dtype):
    q, k, v, cu_q, cu_k = _case([3, 0, 50, 1], [9, 4, 0, 1], 8, 4, 64, dtype)
    for causal in (False, True):
        out = rc.ragged_attention(q, k, v, cu_q, cu_k, causal=causal, scale=0.2)
        _check(out, q, k, v, cu_q, cu_k, causal, 0.2)


def test_one_plan_per_layout_per_step_and_no_sync_with_host_lengths():
    lens = [100, 3, 0, 250, 1]
    q, k, v, cu, _ = _case(lens, lens, 8, 8, 64)
    runtime = rc.Runtime(backend="fa2")  # FlashInfer: what plans
    with runtime.step(lens):
        outs = [runtime.attention(q, k, v, cu, cu, False, 0.125) for _ in range(24)]
    assert runtime.stats["plans"] == 1
    assert runtime.stats["syncs"] == 0
    for out in outs[:2]:
        _check(out, q, k, v, cu, cu, False, 0.125)


def test_one_sync_per_layout_from_device_offsets():
    lens = [100, 3, 0, 250, 1]
    q, k, v, cu, _ = _case(lens, lens, 8, 8, 64)
    runtime = rc.Runtime(backend="fa2")  # FlashInfer: what plans
    with runtime.step():
        for _ in range(24):
            runtime.attention(q, k, v, cu, cu, True, 0.125)
    assert runtime.stats["plans"] == 1
    assert runtime.stats["syncs"] == 1


def test_equal_totals_different_layouts_never_reuse_a_plan():
    runtime = rc.Runtime(backend="fa2")  # FlashInfer: what plans
    for lens in ([10, 20, 30], [30, 20, 10], [59, 0, 1], [1, 58, 1]):
        q, k, v, cu, _ = _case(lens, lens, 4, 4, 64, seed=sum(l * i for i, l in enumerate(lens)))
        with runtime.step():
            out = runtime.attention(q, k, v, cu, cu, True, 0.125)
        _check(out, q, k, v, cu, cu, True, 0.125)
    # Same offsets tensor memory reused across steps with new contents:
    cu = _cu([10, 20, 30])
    q, k, v, _, _ = _case([10, 20, 30], [10, 20, 30], 4, 4, 64)
    with runtime.step():
        a = runtime.attention(q, k, v, cu, cu, True, 0.125)
    cu.copy_(_cu([30, 20, 10]))
    with runtime.step():
        b = runtime.attention(q, k, v, cu, cu, True, 0.125)
    _check(b, q, k, v, cu, cu, True, 0.125)
    assert not torch.equal(a, b)


def test_step_lengths_that_do_not_match_are_caught_in_debug_mode():
    lens = [10, 20, 30]
    q, k, v, cu, _ = _case(lens, lens, 4, 4, 64)
    runtime = rc.Runtime()
    rc.set_debug_checks(True)
    try:
        with pytest.raises(ValueError, match="step"):
            with runtime.step([30, 20, 10]):
                runtime.attention(q, k, v, cu, cu, False, 0.125)
    finally:
        rc.set_debug_checks(False)


def test_cross_layout_declared_in_step_needs_no_sync():
    lq, lk = [1, 1, 2], [30, 0, 40]
    q, k, v, cu_q, cu_k = _case(lq, lk, 8, 2, 128)
    runtime = rc.Runtime(backend="fa2")  # FlashInfer: what plans
    with runtime.step(lq, lk):
        out = runtime.attention(q, k, v, cu_q, cu_k, False, 128**-0.5)
        selfq = runtime.attention(q, q[:, :2], q[:, :2], cu_q, cu_q, False, 128**-0.5)
    assert runtime.stats["syncs"] == 0 and runtime.stats["plans"] == 2
    _check(out, q, k, v, cu_q, cu_k, False)
    _check(selfq, q, q[:, :2], q[:, :2], cu_q, cu_q, False)


def test_float32_and_huge_head_dim_run_the_reference_with_a_warning(caplog):
    from ragged_compile import logs

    logs._seen.clear()
    q, k, v, cu, _ = _case([5, 6], [5, 6], 2, 2, 64, torch.float32)
    runtime = rc.Runtime()
    with caplog.at_level("WARNING", logger="ragged_compile"):
        out = runtime.attention(q, k, v, cu, cu, False, 0.125)
    assert "float16/bfloat16" in caplog.text and "reference kernel" in caplog.text
    _check(out, q, k, v, cu, cu, False, 0.125)
    q, k, v, cu, _ = _case([5, 6], [5, 6], 2, 2, 320)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ragged_compile"):
        runtime.attention(q, k, v, cu, cu, False, 0.125)
    assert "head_dim <= 256" in caplog.text
    assert runtime.stats["reference"] == 2


def test_compiled_function_plans_once_per_step(monkeypatch):
    lens = [100, 3, 0, 250, 1]
    q, k, v, cu, _ = _case(lens, lens, 8, 8, 64)

    def layers(q, k, v, cu):
        x = q
        for _ in range(6):
            x = rc.ragged_attention(x, k, v, cu) + q
        return x

    compiled = torch.compile(layers, fullgraph=True)
    from ragged_compile.runtime import get_runtime

    rt = get_runtime(q.device)
    monkeypatch.setattr(rt, "backend", "fa2")  # FlashInfer: what plans
    compiled(q, k, v, cu)  # compile
    before = dict(rt.stats)
    with rt.step(lens):
        out = compiled(q, k, v, cu)
    assert rt.stats["plans"] - before.get("plans", 0) == 1
    assert rt.stats["syncs"] - before.get("syncs", 0) == 0
    with rt.step(lens):
        eager = layers(q, k, v, cu)
    torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)


def test_fuzz_style_many_layouts_equal_totals():
    torch.manual_seed(0)
    runtime = rc.Runtime()
    for i in range(50):
        n = int(torch.randint(1, 40, ()))
        cuts = torch.sort(torch.randint(0, 512, (n - 1,))).values.tolist()
        lens = [b - a for a, b in zip([0] + cuts, cuts + [512])]
        q, k, v, cu, _ = _case(lens, lens, 4, 2, 96, seed=i)
        with runtime.step(lens):
            out = runtime.attention(q, k, v, cu, cu, bool(i % 2), 96**-0.5)
        _check(out, q, k, v, cu, cu, bool(i % 2), 96**-0.5)


@pytest.mark.parametrize("backend", ["fa2", "auto"])
def test_ragged_compile_plans_once_and_reads_offsets_once_per_forward(backend, monkeypatch):
    """FlashInfer plans once per forward; ``auto`` runs these small layouts on
    FlashAttention-2, which plans nothing: both read the offsets once."""
    import torch.nn.functional as F

    class Attn(torch.nn.Module):
        def __init__(self, d=256, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(d, 3 * d)

        def forward(self, x):  # x: NJT [B, j, d]
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            q, k, v = (t.unflatten(-1, [self.heads, -1]).transpose(1, 2) for t in (q, k, v))
            return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)

    model = torch.nn.Sequential(*[Attn() for _ in range(4)]).to("cuda", torch.bfloat16)
    compiled = rc.compile(model, fullgraph=True)
    rt = rc.runtime.get_runtime(torch.device("cuda", torch.cuda.current_device()))
    monkeypatch.setattr(rt, "backend", backend)
    kernel = "flashinfer" if backend == "fa2" else "varlen"

    def njt(lens, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        parts = [torch.randn(n, 256, device="cuda", generator=g).to(torch.bfloat16) for n in lens]
        return torch.nested.nested_tensor(parts, layout=torch.jagged)

    with torch.no_grad():
        compiled(njt([5, 17, 3], 0))
        for i, lens in enumerate(([40, 1, 300, 7], [100, 100, 148, 100], [1, 1])):
            x = njt(lens, i + 1)
            before = dict(rt.stats)
            out = compiled(x)
            assert rt.stats["plans"] - before.get("plans", 0) == (kernel == "flashinfer")
            assert rt.stats["syncs"] - before.get("syncs", 0) == 1
            assert rt.stats[kernel] - before.get(kernel, 0) == 4
            for seg, got in zip(x.unbind(), out.unbind()):  # dense per-segment reference
                y = seg.float()
                for layer in model:
                    w = layer.qkv.weight.float(); b = layer.qkv.bias.float()
                    q, k, v = (y @ w.T + b).chunk(3, dim=-1)
                    q, k, v = (t.unflatten(-1, [4, -1]).transpose(0, 1) for t in (q, k, v))
                    y = y + F.scaled_dot_product_attention(q, k, v).transpose(0, 1).flatten(-2)
                assert (got.float() - y).abs().max().item() < 0.25


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("implicit", [False, True])
def test_later_layers_run_the_first_layers_plan_directly_and_match(monkeypatch, backend, implicit):
    """The layers of an eager forward after its first take ``steps.fast_attention``
    (the first layer's resolved plan, FlashInfer's recorded kernel call); each one's
    output matches the reference, an in-place edit of the offsets re-plans, and a
    head dim FlashInfer pads (72) or a non-contiguous q keeps the full path."""
    import contextlib

    from ragged_compile import steps

    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs SM90")
    lens = [64, 1, 0, 300, 17, 100]
    rt = rc.Runtime(backend=backend)
    hits = []

    def spy(*a):
        out = steps.fast_attention(*a)
        hits.append(out is not None)
        return out

    monkeypatch.setattr(rc.ops, "fast_attention", spy)
    if implicit:  # the calls run in the default runtime's implicit step
        monkeypatch.setitem(rc.runtime._runtimes, torch.device("cuda", torch.cuda.current_device()), rt)
    with torch.no_grad(), (contextlib.nullcontext() if implicit else rt.step()):
        for d, causal in ((64, False), (64, True), (128, False), (72, False)):
            cu = _cu(lens)  # a new offsets tensor per (head dim, causality): its first call plans
            for layer in range(4):
                q, k, v, _, _ = _case(lens, lens, 8, 2, d, seed=layer)
                out = rc.ragged_attention(q, k, v, cu, causal=causal)
                _check(out, q, k, v, cu, cu, causal)
        # an in-place edit: the next call re-plans, and the layer after it is fast again
        cu[1:].copy_(_cu([1, 64, 300, 0, 100, 17])[1:])
        for layer in range(2):
            q, k, v, _, _ = _case(lens, lens, 8, 2, 64, seed=9 + layer)
            _check(rc.ragged_attention(q, k, v, cu), q, k, v, cu, cu, False)
        q, k, v, _, _ = _case(lens, lens, 8, 2, 64, seed=11)
        qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not contiguous
        _check(rc.ragged_attention(qt, k, v, cu), q, k, v, cu, cu, False)
    # 4 layers x 3 FlashInfer head dims: 3 fast each; 72 pads (never fast); the edit's second call
    assert sum(hits) == 3 * 3 + 1, hits
    assert hits[-1] is False  # the non-contiguous q
