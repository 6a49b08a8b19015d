"""Plan reuse outside ``Runtime.step``: eager code plans once per forward, never
with a stale plan.

The cache logic (object identity through a weak reference, plus the in-place
version) runs on CPU tensors here; the CUDA tests count plans and syncs of
eager NJT models under ``enable()`` and check every output.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import threading

import _fake_flashinfer
import pytest
import torch

import ragged_compile as rc
from ragged_compile.steps import IMPLICIT_LAYOUTS, OffsetsCache


def _cu(lens, device="cpu"):
    return torch.tensor([0] + list(lens), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


# -- OffsetsCache (CPU) ---------------------------------------------------------------


def test_cache_hits_only_the_same_unmodified_tensors():
    c = OffsetsCache(4)
    a, b = _cu([10, 20, 30]), _cu([30, 20, 10])  # equal totals, other layout
    assert c.put((a, a), "a")
    assert c.get((a, a)) == "a"
    assert c.get((b, b)) is None
    assert c.get((a, b)) is None
    assert c.get((a.clone(), a)) is None  # equal values, another tensor: not assumed
    a[1] = 11  # in-place edit
    assert c.get((a, a)) is None
    c.put((a, a), "a2")
    a[1:2].add_(1)  # through a view: same version counter
    assert c.get((a, a)) is None


def test_cache_never_mistakes_a_freed_tensor_for_new_offsets():
    c = OffsetsCache(4)
    old = _cu([10, 20, 30])
    c.put((old,), "old")
    ptr = old.data_ptr()
    new = _cu([30, 20, 10])
    # Give the entry the new tensor's id, as CPython may once `old` is freed.
    c._entries[(id(new),)] = c._entries.pop((id(old),))
    del old
    gc.collect()
    assert c.get((new,)) is None
    # Memory reuse: same address, same version 0, other values.
    for _ in range(20):
        again = _cu([1, 2, 57])
        if again.data_ptr() == ptr:
            break
    assert c.get((again,)) is None
    assert len(c) == 0  # dead entries are pruned


def test_cache_skips_inference_tensors_and_drops_the_least_recently_used():
    c = OffsetsCache(2)
    with torch.inference_mode():
        t = _cu([3, 4])
    assert not c.put((t,), "x") and c.get((t,)) is None
    a, b, d = _cu([1]), _cu([2]), _cu([3])
    c.put((a,), "a"), c.put((b,), "b")
    assert c.get((a,)) == "a"  # a is now the most recent
    c.put((d,), "d")
    assert c.get((b,)) is None and c.get((a,)) == "a" and c.get((d,)) == "d"


# -- the implicit step's choices (CPU tensors, no planning) -------------------------------


def test_implicit_step_reads_each_offsets_tensor_once_and_renews_when_stale():
    rt = rc.Runtime("cpu")
    cu = _cu([3, 7])
    step = rt._step_for(cu, cu)
    lay = step.layout_for(cu, cu, 10, 10)
    for _ in range(7):  # the other layers of the forward
        assert rt._step_for(cu, cu) is step
        assert step.layout_for(cu, cu, 10, 10) is lay
    assert rt.stats["syncs"] == 1 and lay.cu_q.tolist() == [0, 3, 10]

    other = _cu([7, 3])  # equal totals, other layout, while cu is alive
    assert rt._step_for(other, other) is step
    assert step.layout_for(other, other, 10, 10).cu_q.tolist() == [0, 7, 10]

    cu[1] = 5  # edited in place: read again
    s = rt._step_for(cu, cu)
    assert s.layout_for(cu, cu, 10, 10).cu_q.tolist() == [0, 5, 10]
    assert rt.stats["syncs"] == 3

    del cu, other, s
    gc.collect()
    fresh = _cu([1, 9])
    renewed = rt._step_for(fresh, fresh)  # nothing of the old step is usable
    assert renewed is not step
    assert renewed.layout_for(fresh, fresh, 10, 10).cu_q.tolist() == [0, 1, 10]


def test_implicit_step_is_renewed_after_its_layout_budget():
    rt = rc.Runtime("cpu")
    alive = [_cu([i + 1, 9 - i]) for i in range(IMPLICIT_LAYOUTS + 1)]
    first = rt._step_for(alive[0], alive[0])
    for cu in alive[:IMPLICIT_LAYOUTS]:
        step = rt._step_for(cu, cu)
        assert step is first
        step.layout_for(cu, cu, 10, 10)
    last = rt._step_for(alive[-1], alive[-1])
    assert last is not first  # holding old offsets alive never grows a step without bound


def test_cross_layout_reads_q_offsets_once():
    rt = rc.Runtime("cpu")
    cq, ck = _cu([1, 2]), _cu([5, 0])
    step = rt._step_for(cq, cq)
    step.layout_for(cq, cq, 3, 3)
    step.layout_for(cq, ck, 3, 5)
    step.layout_for(ck, ck, 5, 5)
    assert rt.stats["syncs"] == 2


def test_threads_get_their_own_implicit_step_and_explicit_steps_win():
    rt = rc.Runtime("cpu")
    cu = _cu([2, 2])
    seen = {}

    def run(name):
        seen[name] = rt._step_for(cu, cu)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in seen.values()}) == 3
    with rt.step([2, 2]) as explicit:
        assert rt._step_for(cu, cu) is explicit
    with rc.Runtime("cpu").step():  # another runtime's step is not ours
        assert rt._step_for(cu, cu) is not explicit


# -- CUDA: plans and syncs per eager forward -------------------------------------------------

cuda = pytest.mark.cuda


def _encoder(layers=8, E=256, heads=4):
    from _njt_models import SelfAttentionLayer

    torch.manual_seed(0)
    return torch.nn.Sequential(*[SelfAttentionLayer(E, heads) for _ in range(layers)]).to("cuda", torch.bfloat16).eval()


def _njt(lens, E=256, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    parts = [torch.randn(n, E, device="cuda", generator=g).to(torch.bfloat16) for n in lens]
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def _check_per_segment(model, x, out):
    """Each segment against a float32 copy of the model run densely on it alone.
    bf16 against float32 differs by ~0.03 after 2 layers and ~0.07 after 8 (CPU);
    another layout's plan ([40, 24] for [10, 54]) is off by ~0.5 after 2."""
    tol = 0.1 if len(model) <= 2 else 0.25
    ref = copy.deepcopy(model).float()
    for seg, got in zip(x.unbind(), out.unbind()):
        want = ref(seg.unsqueeze(0).float())[0]  # dense, stock SDPA
        assert torch.isfinite(got).all()
        assert (got.float() - want).abs().max().item() < tol


def _delta(rt, before, key):
    return rt.stats[key] - before.get(key, 0)


@cuda
def test_eager_enable_plans_and_syncs_once_per_forward_of_an_8_layer_encoder():
    from ragged_compile.runtime import get_runtime

    model = _encoder()
    rt = get_runtime(torch.device("cuda"))
    with torch.no_grad(), rc.enable():
        # Equal totals with different layouts, a one-token segment, a repeat.
        for i, lens in enumerate(([100, 3, 250, 1], [1, 250, 3, 100], [177, 177], [100, 3, 250, 1])):
            x = _njt(lens, seed=i)
            before = dict(rt.stats)
            out = model(x)
            assert _delta(rt, before, "plans") == 1, lens
            assert _delta(rt, before, "syncs") == 1, lens
            assert _delta(rt, before, "flashinfer") == 8
            _check_per_segment(model, x, out)


@cuda
def test_eager_reuse_sees_in_place_edits_and_reallocated_offsets():
    from ragged_compile.runtime import get_runtime

    model = _encoder(layers=2)
    rt = get_runtime(torch.device("cuda"))
    with torch.no_grad(), rc.enable():
        x = _njt([40, 24])
        model(x)
        # Same values, offsets edited in place to another layout of equal total.
        x._offsets.copy_(_cu([10, 54], "cuda").to(x._offsets.dtype))
        before = dict(rt.stats)
        out = model(x)
        assert _delta(rt, before, "plans") == 1
        ref = torch.nested.nested_tensor_from_jagged(x.values(), x._offsets)
        assert [s.shape[0] for s in ref.unbind()] == [10, 54]
        _check_per_segment(model, ref, out)
        # Freed offsets, new ones likely at the same address: never the old plan.
        for i, lens in enumerate(([30, 34], [34, 30], [1, 63], [63, 1])):
            del x, out
            x = _njt(lens, seed=10 + i)
            out = model(x)
            _check_per_segment(model, x, out)


@cuda
def test_runtime_attention_without_step_reuses_and_inference_offsets_do_not(caplog):
    lens = [100, 3, 0, 250, 1]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    rt = rc.Runtime()
    cu = _cu(lens, "cuda")
    outs = [rt.attention(q, k, v, cu, cu, True, 0.125) for _ in range(8)]
    assert rt.stats["plans"] == 1 and rt.stats["syncs"] == 1
    want = rc.reference_attention(q.float(), k.float(), v.float(), cu, cu, True, 0.125)
    assert (outs[-1].float() - want).abs().max().item() < 2e-2
    with torch.inference_mode():
        cu_inf = _cu(lens, "cuda")
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        for _ in range(3):
            rt.attention(q, k, v, cu_inf, cu_inf, True, 0.125)
    assert rt.stats["plans"] == 4  # no reuse: edits of inference tensors cannot be seen
    assert sum("inference tensors" in r.getMessage() for r in caplog.records) == 1


@cuda
def test_threads_calling_the_op_eagerly_each_get_their_layout():
    layouts = [[100, 3, 250, 1], [1, 250, 3, 100], [177, 177], [354]]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(354, 8, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    wants = {
        i: rc.reference_attention(q.float(), k.float(), v.float(), _cu(l, "cuda"), _cu(l, "cuda"), True, 0.125)
        for i, l in enumerate(layouts)
    }
    errors = []

    from ragged_compile.runtime import get_runtime

    rt = get_runtime(torch.device("cuda"))

    torch.cuda.synchronize()  # inputs ready before side streams read them

    def run(i):
        # Odd threads run on a stream of their own: wrappers there get their own workspace.
        stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
        try:
            with torch.cuda.stream(stream):
                for it in range(20):
                    cu = _cu(layouts[i], "cuda")
                    # Implicit steps, and explicit ones (as rc.compile opens), on one
                    # runtime: a wrapper is planned by one step at a time, whatever the thread.
                    with rt.step() if it % 2 else contextlib.nullcontext():
                        for _ in range(4):  # layers sharing one offsets tensor
                            out = rc.ragged_attention(q, k, v, cu, causal=True, scale=0.125)
                    err = (out.float() - wants[i]).abs().max().item()
                    if err > 2e-2:
                        errors.append((i, err))
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(layouts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(rt._workspaces) >= 3  # the default stream's and one per side stream


@cuda
def test_inference_mode_offsets_work_in_explicit_steps_and_rc_compile():
    lens = [40, 1, 23]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(64, 4, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    rt = rc.Runtime()
    with torch.inference_mode():
        cu = _cu(lens, "cuda")
        with rt.step():
            outs = [rt.attention(q, k, v, cu, cu, False, 0.125) for _ in range(4)]
    assert rt.stats["plans"] == 1 and rt.stats["syncs"] == 1
    want = rc.reference_attention(q.float(), k.float(), v.float(), cu, cu, False, 0.125)
    assert (outs[-1].float() - want).abs().max().item() < 2e-2

    model = _encoder(layers=2)
    compiled = rc.compile(model, fullgraph=True)
    with torch.inference_mode():
        x = _njt(lens)
        out = compiled(x)
    with torch.no_grad():
        _check_per_segment(model, x, out)


# -- the whole planning path on CPU, with a stand-in for FlashInfer (_fake_flashinfer.py) ---


@pytest.fixture
def fake_flashinfer(monkeypatch):
    _fake_flashinfer.install(monkeypatch)
    rt = rc.Runtime("cpu", backend="fa2", workspace_bytes=64)

    def call(q, k, v, cu_q, cu_k, causal=True, scale=0.3):
        """What Runtime.attention does on CUDA, on CPU tensors."""
        step = rt._step_for(cu_q, cu_k)
        if step is None:
            with rt.step():
                return rt._step_for(cu_q, cu_k).attention(q, k, v, cu_q, cu_k, causal, scale)
        return step.attention(q, k, v, cu_q, cu_k, causal, scale)

    return rt, call


def _qkv(total, seed=0, heads=2, d=8):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(total, heads, d, generator=g) for _ in range(3))


def _want(q, k, v, cu, causal=True, scale=0.3):
    return rc.reference_attention(q, k, v, cu, cu, causal, scale)


def test_fake_backend_one_plan_per_offsets_tensor_and_never_a_stale_one(fake_flashinfer):
    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30])
    for _ in range(8):  # the layers of one forward
        out = call(q, k, v, cu, cu)
    assert rt.stats["plans"] == 1 and rt.stats["syncs"] == 1 and rt.stats["flashinfer"] == 8
    torch.testing.assert_close(out, _want(q, k, v, cu))

    cu.copy_(_cu([30, 20, 10]))  # in place, equal totals
    torch.testing.assert_close(call(q, k, v, cu, cu), _want(q, k, v, cu))
    assert rt.stats["plans"] == 2

    for i, lens in enumerate(([1, 59, 0], [59, 1, 0], [0, 0, 60], [20, 20, 20], [1, 59, 0])):
        del cu
        cu = _cu(lens)  # the freed tensor's memory or id may come back
        for _ in range(3):
            out = call(q, k, v, cu, cu)
        torch.testing.assert_close(out, _want(q, k, v, cu))
    assert rt.stats["plans"] == 7


def test_fake_backend_inference_offsets_plan_per_call_and_stay_right(fake_flashinfer):
    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    with torch.inference_mode():
        cu = _cu([10, 20, 30])
        for _ in range(3):
            out = call(q, k, v, cu, cu)
        cu.copy_(_cu([30, 20, 10]))
        edited = call(q, k, v, cu, cu)
    assert rt.stats["plans"] == 4
    torch.testing.assert_close(out, _want(q, k, v, _cu([10, 20, 30])))
    torch.testing.assert_close(edited, _want(q, k, v, _cu([30, 20, 10])))


def test_fake_backend_threads_never_share_a_planned_wrapper(fake_flashinfer):
    rt, call = fake_flashinfer
    layouts = [[10, 20, 30], [30, 20, 10], [1, 1, 58], [60, 0, 0]]
    q, k, v = _qkv(60)
    wants = [_want(q, k, v, _cu(l)) for l in layouts]
    barrier = threading.Barrier(len(layouts))
    errors = []

    def run(i):
        try:
            for it in range(30):
                cu = _cu(layouts[(i + it) % len(layouts)])
                barrier.wait()  # every thread plans, then every thread runs
                with rt.step() if it % 2 else contextlib.nullcontext():
                    step = rt._step_for(cu, cu)
                    step.layout_for(cu, cu, 60, 60)
                    slot = rt.plan(step, step.layout_for(cu, cu, 60, 60), 2, 2, 8, q.dtype, True, 0.3)
                    barrier.wait()
                    out = slot.wrapper.run(q, k, v)
                if not torch.equal(out, wants[(i + it) % len(layouts)]):
                    errors.append((i, it))
        except Exception as e:  # noqa: BLE001
            errors.append((i, repr(e)))
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(layouts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # Implicit steps keep their wrappers between forwards; renewed ones give them back.
    assert max(len(p) for p in rt._pool.values()) <= 2 * len(layouts) + 4


def test_fake_backend_softcap_plans_once_per_variant_and_layout(fake_flashinfer):
    """Gemma2's pattern: windowed soft-capped layers between full soft-capped ones.
    FlashInfer takes window_left and the cap at plan time, so one forward plans
    once per (layout, variant): two plans for eight layers, and each layer's
    output is its own variant's."""
    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30])
    with rt.step():
        step = rt._step_for(cu, cu)
        for layer in range(8):
            window = (3, -1) if layer % 2 else (-1, -1)
            out = step.attention(q, k, v, cu, cu, True, 0.3, window, 5.0)
            want = rc.reference_attention(q, k, v, cu, cu, True, 0.3, window_size=window, softcap=5.0)
            torch.testing.assert_close(out, want)
    assert rt.stats["plans"] == 2 and rt.stats["syncs"] == 1 and rt.stats["flashinfer"] == 8


def test_windows_run_flashattention2_with_the_steps_host_lengths(monkeypatch, fake_flashinfer):
    """A windowed call in a step runs FlashAttention-2 with the longest segments from
    the step's host layout: no plan, no second offsets read."""
    from ragged_compile.backends import flash_backward

    rt, call = fake_flashinfer
    seen = []

    def fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale, window_size_left,
                    window_size_right):
        seen.append((max_q, max_k, window_size_left, window_size_right))
        out = rc.reference_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=(window_size_left, window_size_right))
        lse = torch.zeros(q.shape[1], q.shape[0])
        return out, lse, torch.zeros(2, dtype=torch.uint64), None, None

    monkeypatch.setattr(flash_backward, "_forward_kernel", fa2_forward)
    q, k, v = _qkv(60, d=16)
    cu = _cu([10, 20, 30])
    with rt.step():
        step = rt._step_for(cu, cu)
        for _ in range(3):
            out = step.attention(q, k, v, cu, cu, False, 0.3, (4, 2))
    assert seen == [(30, 30, 4, 2)] * 3
    assert rt.stats["plans"] == 0 and rt.stats["syncs"] == 1 and rt.stats["fa2"] == 3
    torch.testing.assert_close(out, rc.reference_attention(q, k, v, cu, cu, False, 0.3, window_size=(4, 2)))


# -- the fast path of a forward's later layers (steps.fast_attention) -----------------------


def test_fast_path_repeats_only_the_call_it_resolved(fake_flashinfer):
    """After a layer's call, the next call with the very same offsets (unmodified),
    shapes, dtype, causality and scale runs that call's plan directly; anything
    else falls back to the full path (None), which then plans what is new."""
    from ragged_compile.steps import fast_attention

    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30])
    call(q, k, v, cu, cu)
    q2, k2, v2 = _qkv(60, seed=1)
    got = fast_attention(q2, k2, v2, cu, cu, True, 0.3)
    torch.testing.assert_close(got, _want(q2, k2, v2, cu))
    assert rt.stats["flashinfer"] == 2 and rt.stats["plans"] == 1
    assert fast_attention(q, k, v, cu.clone(), cu, True, 0.3) is None  # equal values, another tensor
    assert fast_attention(q, k, v, cu, cu, False, 0.3) is None
    assert fast_attention(q, k, v, cu, cu, True, 0.5) is None
    assert fast_attention(q.double(), k.double(), v.double(), cu, cu, True, 0.3) is None
    assert fast_attention(q[:, :1], k[:, :1], v[:, :1], cu, cu, True, 0.3) is None
    assert fast_attention(q, k, v[:, :, :4], cu, cu, True, 0.3) is None  # v unlike k
    cu[1:].copy_(_cu([30, 20, 10])[1:])  # in place, equal totals
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is None
    torch.testing.assert_close(call(q, k, v, cu, cu), _want(q, k, v, cu))  # re-planned
    torch.testing.assert_close(fast_attention(q2, k2, v2, cu, cu, True, 0.3), _want(q2, k2, v2, cu))
    assert rt.stats["plans"] == 2


def test_training_fast_path_repeats_only_the_training_call_it_resolved(fake_flashinfer):
    """A training call (forward with its LSE) leaves its resolution for the next
    layer's (``steps.repeated_training_call``): same offsets tensors, unmodified,
    same shapes, dtype, causality and scale, else None. Replayed, it gives the
    output, the LSE in the backward's layout and the host lengths of the full path."""
    from ragged_compile.steps import fast_attention, repeated_training_call, run_repeated_training

    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30])
    with rt.step():
        step = rt._step_for(cu, cu)
        full = step.attention_with_lse(q, k, v, cu, cu, True, 0.3)
        assert full[2] == (30, 30, 10 * 10 + 20 * 20 + 30 * 30)
        assert fast_attention(q, k, v, cu, cu, True, 0.3) is None  # an inference call is not a training one
        q2, k2, v2 = _qkv(60, seed=1)
        hit = repeated_training_call(q2, k2, v2, cu, cu, True, 0.3)
        assert hit is not None
        out, lse, lens = run_repeated_training(hit, q2, k2, v2, cu, cu, True, 0.3)
        want_out, want_lse, want_lens = step.attention_with_lse(q2, k2, v2, cu, cu, True, 0.3)
        torch.testing.assert_close(out, _want(q2, k2, v2, cu))
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
        assert lens == want_lens
        assert rt.stats["plans"] == 1
        assert repeated_training_call(q, k, v, cu.clone(), cu, True, 0.3) is None
        assert repeated_training_call(q, k, v, cu, cu, False, 0.3) is None
        assert repeated_training_call(q, k, v, cu, cu, True, 0.5) is None
        assert repeated_training_call(q.double(), k.double(), v.double(), cu, cu, True, 0.3) is None
        assert repeated_training_call(q[:, :1], k[:, :1], v[:, :1], cu, cu, True, 0.3) is None
        qs, ks, vs = (torch.stack([t, t], -1).flatten(-2)[..., ::2] for t in (q, k, v))  # same shapes
        assert qs.stride(-1) == 2 and repeated_training_call(qs, ks, vs, cu, cu, True, 0.3) is None
        cu[1:].copy_(_cu([30, 20, 10])[1:])  # in place, equal totals
        assert repeated_training_call(q, k, v, cu, cu, True, 0.3) is None
    assert repeated_training_call(q2, k2, v2, cu, cu, True, 0.3) is None  # the step ended


def test_training_fast_path_on_flash_attention_2_replays_its_grid(fake_flashinfer, monkeypatch):
    """A training call whose forward is PyTorch's FlashAttention-2 leaves its grid
    (the host layout's longest segments) and what the backward choice weighs; its
    repeat runs the kernel on the call's own offsets, with or without the LSE."""
    from ragged_compile.backends import flash_backward, select
    from ragged_compile.reference import reference_lse
    from ragged_compile.steps import repeated_training_call, run_repeated_training

    rt, _ = fake_flashinfer
    seen = []

    def fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale, window_size_left,
                    window_size_right):
        seen.append((cu_q, max_q, max_k))
        out = rc.reference_attention(q, k, v, cu_q, cu_k, causal, scale)
        return out, reference_lse(q, k, cu_q, cu_k, causal, scale), torch.zeros(2, dtype=torch.uint64), None, None

    monkeypatch.setattr(flash_backward, "_forward_kernel", fa2_forward)
    monkeypatch.setattr(rt, "kernel", lambda *a, **kw: "varlen")
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30]).to(torch.int32)
    with rt.step():
        step = rt._step_for(cu, cu)
        _, want_lse, lens = step.attention_with_lse(q, k, v, cu, cu, True, 0.3)
        hit = repeated_training_call(q, k, v, cu, cu, True, 0.3)
        assert hit is not None and hit.slot is None and hit.max_lens == (30, 30)
        assert hit.work == (select.backward_work(2, 2, 60, 60, lens[2], True), (3, 60, 60))
        out, lse, got_lens = run_repeated_training(hit, q, k, v, cu, cu, True, 0.3)
        torch.testing.assert_close(out, _want(q, k, v, cu))
        torch.testing.assert_close(lse, want_lse)
        assert got_lens == lens
        torch.testing.assert_close(run_repeated_training(hit, q, k, v, cu, cu, True, 0.3, lse=False), out)
    assert len(seen) == 3 and all(c is cu and (a, b) == (30, 30) for c, a, b in seen)
    assert rt.stats["varlen"] == 3 and rt.stats["plans"] == 0


def test_repeated_training_call_takes_aten_s_node_only_where_it_is_the_full_path_s_twin(monkeypatch):
    """ops._repeated_training: aten's FlashAttention-2 node for a repeat whose forward
    and backward are FlashAttention-2's; the op's autograd function where the forward
    is FlashInfer's, where the backward is another kernel, where choosing it raises
    (a forced backward that cannot run: the backward raises, as on the full path),
    and under saved-tensor hooks (non-reentrant checkpointing compares what a
    forward and its recompute save, and the recompute takes the full path)."""
    from types import SimpleNamespace

    from ragged_compile import ops
    from ragged_compile.backends import select

    ran = []
    monkeypatch.setattr(ops, "run_repeated_training", lambda *a, **kw: ran.append(("aten", kw)) or "aten")
    monkeypatch.setattr(ops._EagerTraining, "apply", lambda *a: ran.append(("function", a[-1])) or "function")
    choice = {"kernel": "fa2"}

    def backward_kernel(device, dtype, head_dim, work, variant, slots):
        assert (work, variant, slots) == (3.5, (), (2, 12, 12))
        if choice["kernel"] == "raise":
            raise RuntimeError("RAGGED_COMPILE_BACKWARD=fa4, but ...")
        return choice["kernel"]

    monkeypatch.setattr(select, "backward_kernel", backward_kernel)
    q = torch.randn(12, 2, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    fa2 = SimpleNamespace(slot=None, work=(3.5, (2, 12, 12)))

    def run(hit):
        ran.clear()
        got = ops._repeated_training(hit, q, q, q, cu, cu, False, 0.3)
        assert len(ran) == 1
        return got

    assert run(fa2) == "aten" and ran[0][1] == {"lse": False}
    assert run(SimpleNamespace(slot=object(), work=fa2.work)) == "function"
    choice["kernel"] = "fa4"
    assert run(fa2) == "function"
    choice["kernel"] = "raise"
    assert run(fa2) == "function" and ran[0][1] is fa2
    choice["kernel"] = "fa2"
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert run(fa2) == "function"
    assert run(fa2) == "aten"


def test_fast_path_ends_with_its_step_and_its_thread(fake_flashinfer):
    from ragged_compile.steps import fast_attention

    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30])
    with rt.step():
        call(q, k, v, cu, cu)
        assert fast_attention(q, k, v, cu, cu, True, 0.3) is not None
        seen = []
        t = threading.Thread(target=lambda: seen.append(fast_attention(q, k, v, cu, cu, True, 0.3)))
        t.start()
        t.join()
        assert seen == [None]  # another thread: its own steps
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is None  # the step ended: its wrappers are back
    with rt.step():
        assert fast_attention(q, k, v, cu, cu, True, 0.3) is None  # a new step plans for itself
    # the implicit step: valid while it is this thread's, and not once it is replaced
    call(q, k, v, cu, cu)
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is not None
    rt._release(rt._local.implicit)
    rt._local.implicit = None
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is None


def test_fast_path_keeps_no_offsets_alive_and_never_mistakes_new_ones(fake_flashinfer):
    from ragged_compile.steps import fast_attention

    rt, call = fake_flashinfer
    q, k, v = _qkv(60)
    cu = _cu([10, 20, 30])
    call(q, k, v, cu, cu)
    ref = __import__("weakref").ref(cu)
    step = rt._local.implicit
    old_id = id(cu)
    del cu
    gc.collect()
    assert ref() is None  # the resolution held it weakly
    for lens in ([30, 20, 10], [1, 1, 58], [10, 20, 30]):
        new = _cu(lens)
        if id(new) == old_id:  # CPython may give the new tensor the old id: still a miss
            assert fast_attention(q, k, v, new, new, True, 0.3) is None
        out = call(q, k, v, new, new)
        torch.testing.assert_close(out, _want(q, k, v, new))
        torch.testing.assert_close(fast_attention(q, k, v, new, new, True, 0.3), _want(q, k, v, new))
    assert step is not None


# -- PyTorch's FlashAttention-2 forward: no plan (select.cuda_backend "varlen") ----------


@pytest.fixture
def fake_varlen(monkeypatch, fake_flashinfer):
    """The runtime on CPU with FlashAttention-2's aten kernel replaced by the
    reference of its contract; records the grid sizes each launch got."""
    from ragged_compile.backends import flash_backward
    from ragged_compile.reference import reference_lse

    rt, call = fake_flashinfer
    rt.backend = "varlen"
    launches = []

    def fa2_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale, window_size_left,
                    window_size_right):
        assert cu_q.dtype == torch.int32 and (window_size_left, window_size_right) == (-1, -1)
        launches.append((max_q, max_k))
        out = rc.reference_attention(q, k, v, cu_q, cu_k, causal, scale)
        lse = reference_lse(q, k, cu_q, cu_k, causal, scale)  # aten's layout: [Hq, Tq], ln, +inf
        return out, lse, torch.zeros(2, dtype=torch.uint64), None, None

    monkeypatch.setattr(flash_backward, "_forward_kernel", fa2_forward)
    monkeypatch.setattr(flash_backward, "unsupported_reason", lambda device, dtype, head_dim: None)
    return rt, call, launches


def test_varlen_forward_plans_nothing_and_reads_offsets_once(fake_varlen):
    rt, call, launches = fake_varlen
    q, k, v = _qkv(60)
    cu = _cu([10, 0, 20, 30])
    for _ in range(8):
        out = call(q, k, v, cu, cu)
    torch.testing.assert_close(out, _want(q, k, v, cu))
    assert rt.stats["plans"] == 0 and rt.stats["syncs"] == 1 and rt.stats["varlen"] == 8
    assert rt.stats["flashinfer"] == 0 and rt.last_backend == "varlen"
    assert launches == [(30, 30)] * 8  # the grid from the host layout, never a read


def test_varlen_fast_path_repeats_only_the_call_it_resolved(fake_varlen):
    from ragged_compile.steps import fast_attention

    rt, call, launches = fake_varlen
    q, k, v = _qkv(60, d=16)
    cu = _cu([10, 20, 30])
    call(q, k, v, cu, cu)
    q2, k2, v2 = _qkv(60, seed=1, d=16)
    torch.testing.assert_close(fast_attention(q2, k2, v2, cu, cu, True, 0.3), _want(q2, k2, v2, cu))
    assert rt.stats["varlen"] == 2 and len(launches) == 2
    assert fast_attention(q, k, v, cu.clone(), cu, True, 0.3) is None  # equal values, another tensor
    assert fast_attention(q, k, v, cu, cu, False, 0.3) is None
    strided = torch.randn(60, 2, 32)[..., ::2]  # the kernel takes unit last strides only
    assert fast_attention(strided, k, v, cu, cu, True, 0.3) is None
    cu[1:].copy_(_cu([30, 20, 10])[1:])  # in place, equal totals: a new layout, a new grid
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is None
    torch.testing.assert_close(call(q, k, v, cu, cu), _want(q, k, v, cu))
    assert launches[-1] == (30, 30) and rt.stats["syncs"] == 2
    # a head dim the kernel pads (not a multiple of 8) never takes the direct path
    q3, k3, v3 = _qkv(60, d=12)
    torch.testing.assert_close(call(q3, k3, v3, cu, cu), _want(q3, k3, v3, cu))
    assert fast_attention(q3, k3, v3, cu, cu, True, 0.3) is None


def test_varlen_training_forward_hands_its_lse_to_the_backward_as_it_is(fake_varlen):
    from ragged_compile.reference import reference_lse

    rt, call, launches = fake_varlen
    q, k, v = _qkv(60)
    cu = _cu([10, 0, 20, 30])
    with rt.step() as step:
        out, lse, max_lens = step.attention_with_lse(q, k, v, cu, cu, True, 0.3)
    torch.testing.assert_close(out, _want(q, k, v, cu))
    torch.testing.assert_close(lse, reference_lse(q, k, cu, cu, True, 0.3))
    assert max_lens[:2] == (30, 30) and rt.stats["plans"] == 0 and rt.stats["varlen"] == 1


def test_a_changed_backend_takes_effect_on_layouts_already_seen(fake_varlen):
    from ragged_compile.steps import fast_attention

    rt, call, launches = fake_varlen
    q, k, v = _qkv(60, d=16)
    cu = _cu([10, 20, 30])
    call(q, k, v, cu, cu)
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is not None and rt.stats["varlen"] == 2
    rt.backend = "fa2"
    assert fast_attention(q, k, v, cu, cu, True, 0.3) is None
    torch.testing.assert_close(call(q, k, v, cu, cu), _want(q, k, v, cu))
    assert rt.stats["flashinfer"] == 1 and rt.stats["plans"] == 1 and rt.stats["varlen"] == 2
    rt.backend = "varlen"
    call(q, k, v, cu, cu)
    assert rt.stats["varlen"] == 3 and rt.stats["plans"] == 1
