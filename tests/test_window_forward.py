"""The short-window forward (backends/window_forward.py): its tile table, where it
is chosen, and the kernel against the float64 reference (out and LSE), under
Triton's interpreter on CPU and natively on CUDA, with the layouts that break
windows: empty and one-token segments, windows wider than a segment, zero-wide
ones, cross-attention whose first rows see no key, GQA, odd head dims, and a NaN
that must stay in its own segment."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ragged_compile as rc
from _triton_interpreter import run_checks
from ragged_compile.backends import select, window_forward
from ragged_compile.reference import reference_attention, reference_lse

# (lens_q, lens_k, hq, hkv, d, causal, window)
CASES = [
    ([100, 1, 0, 64, 130], None, 2, 1, 64, False, (64, 64)),  # ModernBERT's local layers, shorter
    ([100, 1, 0, 64, 130], None, 4, 2, 72, True, (16, -1)),
    ([5, 70, 33, 0], [90, 3, 0, 7], 4, 2, 32, False, (8, 3)),  # cross: rows that see no key
    ([5, 70, 33, 0], [90, 3, 0, 7], 4, 2, 32, True, (8, 3)),
    ([200], None, 1, 1, 96, False, (0, 0)),  # a row sees itself only
    ([200, 17], None, 3, 1, 80, False, (300, 2)),  # wider than the segment on the left
    ([1, 1, 129, 64], None, 2, 2, 16, False, (2, 70)),
    ([65, 130], [1, 300], 2, 1, 128, True, (100, 0)),
]


def _offsets(lens, device):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)


def _inputs(case, dtype, device, seed=0):
    lens_q, lens_k, hq, hkv, d, causal, window = case
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _offsets(lens_q, "cpu"), _offsets(lens_k, "cpu")
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g).to(device, dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(device, dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(device, dtype)
    return q, k, v, cu_q, cu_k, causal, d**-0.5, window


def _run(q, k, v, cu_q, cu_k, causal, scale, window):
    table = torch.from_numpy(window_forward.tiles(cu_q.numpy())).to(q.device)
    return window_forward.forward(q, k, v, cu_q.to(q.device), cu_k.to(q.device), table, causal, scale, window)


def _check(case, dtype, device, tol, strided_offsets=False):
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, dtype, device)
    if strided_offsets:  # the op accepts offsets that are a strided view
        dev_q, dev_k = (torch.stack([c, c], 1).to(device)[:, 0] for c in (cu_q, cu_k))
        assert not dev_q.is_contiguous()
        table = torch.from_numpy(window_forward.tiles(cu_q.numpy())).to(device)
        out, lse = window_forward.forward(q, k, v, dev_q, dev_k, table, causal, scale, window)
    else:
        out, lse = _run(q, k, v, cu_q, cu_k, causal, scale, window)
    args = (q.cpu().double(), k.cpu().double(), v.cpu().double(), cu_q, cu_k, causal, scale)
    ref = reference_attention(*args, window_size=window)
    ref_lse = reference_lse(*args[:2], cu_q, cu_k, causal, scale, window_size=window).double()
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(lse.cpu() == math.inf, ~seen), "rows that see no key hold +inf, the others a finite LSE"
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen], atol=1e-3, rtol=1e-3)
    assert (out.cpu()[(~seen).t()] == 0).all(), "rows that see no key are zero"


def _nan_stays_in_its_segment(device, dtype, d=64):
    case = ([70, 90, 3, 66], None, 2, 1, d, False, (64, 64))
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, dtype, device)
    v[70 + 40] = math.nan  # segment 1, a row every neighbour's tile would read
    k[70 + 89] = math.nan
    out, lse = _run(q, k, v, cu_q, cu_k, causal, scale, window)
    for i, (a, b) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        finite = torch.isfinite(out[a:b]).all().item() and torch.isfinite(lse[:, a:b]).all().item()
        assert finite == (i != 1), f"segment {i}: a NaN of segment 1 must reach it only"
    # and within segment 1 it stays NaN (not zeroed as a row that saw no key): the rows
    # whose window holds v's NaN row, and the LSE of those whose window holds k's
    assert out[70 + 40].isnan().all(), "a row that sees a NaN value is NaN"
    assert lse[:, 70 + 89].isnan().all() and lse[:, 70 + 25].isnan().all(), "rows that see a NaN key: NaN LSE"
    assert torch.isfinite(lse[:, 70:70 + 25]).all(), "rows whose window misses the NaN key keep a finite LSE"


# -- the table and the choice (CPU) ------------------------------------------------------


def test_the_tile_table_covers_every_row_once():
    lens = [0, 1, 64, 65, 0, 200, 3]
    table = window_forward.tiles(_offsets(lens, "cpu").numpy())
    rows = [(int(s), r) for s, m0 in table.tolist() for r in range(m0, min(m0 + window_forward.BLOCK_M, lens[s]))]
    assert sorted(rows) == [(s, r) for s, n in enumerate(lens) for r in range(n)]
    assert all(m0 % window_forward.BLOCK_M == 0 and m0 < lens[s] for s, m0 in table.tolist())
    assert window_forward.tiles(_offsets([], "cpu").numpy()).shape == (0, 2)


def test_short_windows_run_the_window_kernel_long_ones_flashattention2(monkeypatch):
    monkeypatch.setattr(window_forward, "unsupported_reason", lambda *a: None)
    cuda = torch.device("cuda", 0)

    def kernel(causal, window):
        return select.window_kernel(cuda, torch.bfloat16, 64, causal, window)

    assert kernel(False, (64, 64)) == "window"  # ModernBERT
    assert kernel(True, (255, -1)) == "window" and kernel(True, (255, 7)) == "window"  # causal bounds the right
    assert kernel(False, (255, 256)) == "window" and kernel(False, (256, 256)) == "fa2"  # past MAX_SPAN
    assert kernel(True, (4095, -1)) == "fa2"  # Mistral's window: FlashAttention-2's tiles waste little
    assert kernel(False, (64, -1)) == "fa2" and kernel(False, (-1, 64)) == "fa2"  # a side unbounded
    assert select.window_kernel(cuda, torch.bfloat16, 128, False, (64, 64)) == "window"
    assert select.window_kernel(cuda, torch.bfloat16, 256, False, (64, 64)) == "fa2"  # not measured
    monkeypatch.undo()
    cpu = torch.device("cpu")
    assert window_forward.unsupported_reason(cpu, torch.bfloat16, 64) is not None
    assert select.window_kernel(cpu, torch.bfloat16, 64, False, (64, 64)) == "fa2"


def test_a_runtime_step_runs_the_window_kernel_from_its_layouts_tiles(monkeypatch):
    """steps.attention and attention_with_lse (training) route short windows to the
    kernel, with one tile table per layout for every layer."""
    from ragged_compile.runtime import Runtime

    calls = []

    def kernel(q, k, v, cu_q, cu_k, table, causal, scale, window):
        calls.append(table)
        out = reference_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=window)
        return out, reference_lse(q, k, cu_q, cu_k, causal, scale, window_size=window)

    monkeypatch.setattr(select, "window_kernel", lambda *a: "window")
    monkeypatch.setattr(window_forward, "forward", kernel)
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(CASES[0], torch.float32, "cpu")
    rt = Runtime(torch.device("cpu"))
    with rt.step():
        step = rt._step_for(cu_q, cu_k)
        out = step.attention(q, k, v, cu_q, cu_k, causal, scale, window)
        out2, lse, _ = step.attention_with_lse(q, k, v, cu_q, cu_k, causal, scale, window)
    assert len(calls) == 2 and calls[0] is calls[1] and rt.stats["window"] == 2
    ref = reference_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=window)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out2, ref)


def test_a_training_call_past_flashattention2s_segment_limit_fails_in_the_forward(monkeypatch):
    """The window kernel takes any number of segments, FlashAttention-2's backward at
    most 65,535: a training call says so at once, not in its backward."""
    from ragged_compile.backends import flash_backward
    from ragged_compile.runtime import Runtime

    monkeypatch.setattr(select, "window_kernel", lambda *a: "window")
    monkeypatch.setattr(window_forward, "forward", lambda *a: pytest.fail("the kernel must not run"))
    n = flash_backward.MAX_SEGMENTS + 1
    cu = torch.arange(n + 1, dtype=torch.int32)
    q = torch.randn(n, 1, 8)
    rt = Runtime(torch.device("cpu"))
    with rt.step():
        step = rt._step_for(cu, cu)
        with pytest.raises(ValueError, match="65535"):
            step.attention_with_lse(q, q, q, cu, cu, False, 1.0, (4, 4))


# -- the kernel: Triton's interpreter on CPU, natively on CUDA ---------------------------

_CHILD = """
import torch
from test_window_forward import CASES, _check, _nan_stays_in_its_segment
for case in CASES:
    _check(case, torch.float16, "cpu", 2e-2)
_check(CASES[2], torch.float16, "cpu", 2e-2, strided_offsets=True)
_nan_stays_in_its_segment("cpu", torch.float16)
print("checked", len(CASES))
"""


def test_the_kernel_matches_the_reference_under_tritons_interpreter():
    run_checks(_CHILD, f"checked {len(CASES)}")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[4]}-{c[2]}/{c[3]}-{'causal' if c[5] else 'full'}-{c[6]}")
def test_cuda_the_kernel_matches_the_reference(case, dtype):
    _check(case, dtype, "cuda", 3e-2)


@pytest.mark.cuda
@cuda
def test_cuda_strided_offsets():
    _check(CASES[2], torch.bfloat16, "cuda", 3e-2, strided_offsets=True)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("d", [64, 96, 128])
def test_cuda_a_nan_stays_in_its_segment(d):
    _nan_stays_in_its_segment("cuda", torch.bfloat16, d)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_the_op_trains_through_the_window_kernel(causal):
    """The op's forward runs the window kernel, and FlashAttention-2's backward takes
    its LSE: gradients equal the reference's."""
    from ragged_compile.runtime import get_runtime

    case = ([100, 1, 0, 64, 130, 7], None, 4, 2, 64, causal, (64, 64))
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, torch.bfloat16, "cuda")
    stats = get_runtime(torch.device("cuda")).stats
    before = stats["window"]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = rc.ragged_attention(*leaves, cu_q.cuda(), cu_k.cuda(), causal=causal, scale=scale, window_size=window)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert stats["window"] > before
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, cu_q, cu_k, causal, scale, window_size=window)
    ref.backward(grad.cpu().double())
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=3e-2, rtol=3e-2)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, atol=5e-2, rtol=5e-2)
    with torch.no_grad():
        before = stats["window"]
        again = rc.ragged_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), causal=causal, scale=scale, window_size=window)
    assert stats["window"] > before
    torch.testing.assert_close(again.cpu().double(), ref.detach(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_the_kernel_runs_on_its_inputs_device_not_the_current_one():
    """Triton launches on the current device: inputs on cuda:1 with cuda:0 current
    must still be computed on cuda:1."""
    case = CASES[0]
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, torch.bfloat16, "cuda:1")
    with torch.cuda.device(0):
        out, lse = _run(q, k, v, cu_q, cu_k, causal, scale, window)
    assert out.device == torch.device("cuda", 1)
    ref = reference_attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), cu_q, cu_k, causal, scale,
                              window_size=window)
    torch.testing.assert_close(out.cpu().double(), ref, atol=3e-2, rtol=3e-2)


# -- as users call it: threads, torch.compile, autocast, checkpointing (CUDA) -----------


def _window_ran():
    from ragged_compile.runtime import get_runtime

    return get_runtime(torch.device("cuda")).stats["window"]


def _reference(q, k, v, cu_q, cu_k, causal, scale, window):
    return reference_attention(q.detach().cpu().double(), k.detach().cpu().double(), v.detach().cpu().double(),
                               cu_q.cpu(), cu_k.cpu(), causal, scale, window_size=window)


@pytest.mark.cuda
@cuda
def test_cuda_two_threads_with_their_own_layouts():
    import threading

    cases = [CASES[0], ([33, 200, 5], None, 4, 4, 64, False, (64, 64))]
    errors = []

    def work(case):
        try:
            q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, torch.bfloat16, "cuda", seed=len(case[0]))
            want = _reference(q, k, v, cu_q, cu_k, causal, scale, window)
            for _ in range(20):
                out = rc.ragged_attention(q, k, v, cu_q.cuda(), cu_k.cuda(), causal=causal, scale=scale,
                                          window_size=window)
                torch.testing.assert_close(out.cpu().double(), want, atol=3e-2, rtol=3e-2)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    before = _window_ran()
    threads = [threading.Thread(target=work, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _window_ran() - before == 40


@pytest.mark.cuda
@cuda
def test_cuda_compiled_fullgraph_and_autocast_run_the_window_kernel():
    case = ([100, 1, 0, 64, 130], None, 4, 2, 64, False, (64, 64))
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, torch.float32, "cuda")
    want = _reference(q, k, v, cu_q, cu_k, causal, scale, window)

    def fn(q, k, v, cu):
        return rc.ragged_attention(q, k, v, cu, cu, causal=causal, scale=scale, window_size=window)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    before = _window_ran()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager, graphed = fn(q, k, v, cu_q.cuda()), compiled(q, k, v, cu_q.cuda())
    assert _window_ran() - before == 2, "autocast casts fp32 q/k/v to bf16, which the window kernel takes"
    for out in (eager, graphed):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.cpu().double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@cuda
def test_cuda_checkpointed_training_equals_plain():
    from torch.utils.checkpoint import checkpoint

    case = ([100, 1, 0, 64, 130], None, 4, 2, 64, True, (63, -1))
    q, k, v, cu_q, cu_k, causal, scale, window = _inputs(case, torch.bfloat16, "cuda")
    cu = cu_q.cuda()

    def layer(q, k, v):
        return rc.ragged_attention(q, k, v, cu, cu, causal=causal, scale=scale, window_size=window)

    grads = []
    for ckpt in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = checkpoint(layer, *leaves, use_reentrant=False) if ckpt else layer(*leaves)
        out.float().pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)  # the backward accumulates dq atomically
