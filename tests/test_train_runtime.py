"""The runtime's training path on CPU, with FlashInfer replaced by a recorder.

What is checked is bookkeeping the GPU cannot show cheaply: the LSE the backward
gets (layout, base, keyless rows), the host max lengths, and that a call outside
any step on offsets a finished training step identified (an activation-checkpoint
recompute, on autograd's thread) reuses that step's plan with no sync, while new
steps never re-plan a wrapper such a step still holds.
"""

from __future__ import annotations

import math
import threading

import _fake_flashinfer
import pytest
import torch

from ragged_compile import runtime as rt_mod
from ragged_compile.reference import reference_lse
from ragged_compile.reference import reference_attention


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return _fake_flashinfer.install(monkeypatch)


def _inputs(lq, lk, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g)
    k = torch.randn(sum(lk), hkv, d, generator=g)
    v = torch.randn(sum(lk), hkv, d, generator=g)
    cq = torch.tensor([0] + lq).cumsum(0).int()
    ck = torch.tensor([0] + lk).cumsum(0).int()
    return q, k, v, cq, ck


def test_lse_and_max_lengths_for_the_backward(fake_flashinfer):
    rt = rt_mod.Runtime("cpu", workspace_bytes=16)
    q, k, v, cq, ck = _inputs([5, 0, 3, 1], [2, 4, 0, 6])
    with rt.step():
        out, lse, max_lens = rt.attention_with_lse(q, k, v, cq, ck, True, 0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, cq, ck, True, 0.3))
    want = reference_lse(q, k, cq, ck, True, 0.3)
    assert lse.shape == (4, 9) and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want)) and bool((lse[torch.isinf(lse)] > 0).all())
    torch.testing.assert_close(lse[~torch.isinf(lse)], want[~torch.isinf(want)])
    assert max_lens == (5, 6, 5 * 2 + 3 * 0 + 0 * 4 + 1 * 6)  # the pairs pick the backward's kernel


@pytest.mark.parametrize("lq,lk", [([3, 2], [0, 0]), ([0, 0], [4, 1])])
def test_nothing_to_attend_plans_nothing(fake_flashinfer, lq, lk):
    rt = rt_mod.Runtime("cpu", workspace_bytes=16)
    q, k, v, cq, ck = _inputs(lq, lk)
    with rt.step():
        out, lse, max_lens = rt.attention_with_lse(q, k, v, cq, ck, False, 0.3)
    assert not out.any() and out.shape == q.shape
    assert lse.shape == (4, sum(lq)) and bool((lse == math.inf).all())
    assert max_lens == (max(lq), max(lk), sum(a * b for a, b in zip(lq, lk))) and rt.stats["plans"] == 0


def test_recompute_after_the_step_reuses_its_plan_without_sync(fake_flashinfer):
    rt = rt_mod.Runtime("cpu", workspace_bytes=16)
    q, k, v, cq, ck = _inputs([7, 3, 9], [7, 3, 9])
    with rt.step():
        first = rt.attention_with_lse(q, k, v, cq, cq, True, 0.25)
        rt.attention_with_lse(q, k, v, cq, cq, True, 0.25)  # a second layer: same plan
    assert rt.stats["plans"] == 1 and rt.stats["syncs"] == 1
    got = []
    # autograd runs the backward (and checkpoint recomputes) on its own thread
    t = threading.Thread(target=lambda: got.append(rt.attention_with_lse(q, k, v, cq, cq, True, 0.25)))
    t.start()
    t.join()
    assert rt.stats["plans"] == 1 and rt.stats["syncs"] == 1
    for a, b in zip(got[0][:2], first[:2]):
        assert torch.equal(a, b)


def test_new_steps_never_replan_a_retained_wrapper(fake_flashinfer):
    rt = rt_mod.Runtime("cpu", workspace_bytes=16)
    q, k, v, cq, _ = _inputs([7, 3, 9], [7, 3, 9])
    q2, k2, v2, cq2, _ = _inputs([2, 17], [2, 17], seed=1)
    with rt.step():
        first = rt.attention_with_lse(q, k, v, cq, cq, False, 0.25)
    with rt.step():  # the next training step: another layout, another wrapper
        rt.attention_with_lse(q2, k2, v2, cq2, cq2, False, 0.25)
    assert len(fake_flashinfer) == 2 and rt.stats["plans"] == 2
    # the first step's recompute still finds its own plan, not the second's
    again = rt.attention_with_lse(q, k, v, cq, cq, False, 0.25)
    assert torch.equal(again[0], first[0]) and rt.stats["plans"] == 2


def test_out_of_wrappers_retained_steps_give_theirs_up(fake_flashinfer):
    rt = rt_mod.Runtime("cpu", workspace_bytes=16)
    cases = [_inputs([3 + i, 2], [3 + i, 2], seed=i) for i in range(rt_mod._WRAPPERS_PER_CONFIG + 2)]
    for q, k, v, cq, _ in cases:
        with rt.step():
            for j in range(3):  # three layouts per step: wrappers run out quickly
                n = q.shape[0] - j
                cu = torch.tensor([0, n], dtype=torch.int32)
                rt.attention_with_lse(q[:n], k[:n], v[:n], cu, cu, False, 0.25)
    assert len(fake_flashinfer) <= rt_mod._WRAPPERS_PER_CONFIG
    # a call outside any step on unknown offsets still works (its own step)
    q, k, v, cq, _ = _inputs([4, 4], [4, 4], seed=99)
    out, _, _ = rt.attention_with_lse(q, k, v, cq, cq, False, 0.25)
    torch.testing.assert_close(out, reference_attention(q, k, v, cq, cq, False, 0.25))
