"""What our FlashInfer plan hands the wrapper (no GPU: the wrapper is a recorder)."""

from __future__ import annotations

import torch

from ragged_compile.backends import flashinfer as fi


class _Recorder:
    def plan(self, qo, kv, *args, **kwargs):
        self.qo, self.kv, self.kwargs = qo.clone(), kv.clone(), kwargs


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _plan(lq, lk, causal, **kw):
    w = _Recorder()
    fi.plan(w, _cu(lq), _cu(lk), 4, 2, 64, torch.bfloat16, causal, 0.125, **kw)
    return w


def test_causal_self_attention_is_planned_as_is():
    w = _plan([5, 0, 9], [5, 0, 9], True)
    assert w.qo.tolist() == [0, 5, 5, 14] and w.kv.tolist() == [0, 5, 5, 14] and w.kwargs["causal"]


def test_causal_with_more_queries_than_keys_is_split():
    # fa2 got segments with Lq > Lk wrong: blind rows first (no keys), then a square block
    w = _plan([8, 3], [3, 5], True)
    assert w.qo.tolist() == [0, 5, 8, 8, 11] and w.kv.tolist() == [0, 0, 3, 3, 8]


def test_graph_mode_always_splits_and_non_causal_never_does():
    assert len(_plan([5, 9], [5, 9], True, causal_split=True).qo) == 5
    assert _plan([8, 3], [3, 5], False).qo.tolist() == [0, 8, 11]
