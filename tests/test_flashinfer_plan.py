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


# -- replaying run()'s kernel call ----------------------------------------------------------


class _Module:
    """A JIT module: ``ragged_run`` writes into ``o`` (and ``lse``) what the planned
    "kernel" computes, from the plan's own state, so a replay with stale arguments shows."""

    def __init__(self):
        self.calls = 0

    def ragged_run(self, ws, plan_info, q, k, v, o, lse, scale, pdl):
        self.calls += 1
        o.copy_((q * plan_info[0] + k - v) * scale)
        if lse is not None:
            lse.copy_(q.sum(-1) * plan_info[0])


class _Wrapper:
    """FlashInfer's wrapper in miniature: ``plan`` makes a new plan-info object, ``run``
    checks, allocates and builds the module's argument list in its own order."""

    def __init__(self, convert_lse=False):
        self._cached_module, self._ws, self.runs, self.convert_lse = _Module(), torch.zeros(1), 0, convert_lse
        self._plan_info = None

    def plan(self, factor, scale):
        self._plan_info, self._scale = [factor], scale

    def run(self, q, k, v, return_lse=False, enable_pdl=False):
        self.runs += 1
        out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if return_lse else None
        self._cached_module.ragged_run(self._ws, self._plan_info, q, k, v, out, lse, self._scale, enable_pdl)
        if return_lse:
            return out, (lse * 1.0 if self.convert_lse else lse)
        return out


def _qkv(seed, t=7, h=2, d=64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, d, generator=g) for _ in range(3))


def _expected(q, k, v, factor, scale):
    return (q * factor + k - v) * scale, q.sum(-1) * factor


def test_runs_of_one_plan_after_the_first_replay_its_kernel_call(monkeypatch):
    monkeypatch.setattr(fi, "_pdl", lambda index: False)
    w = _Wrapper()
    w.plan(2.0, 0.5)
    for seed in range(4):
        q, k, v = _qkv(seed)
        torch.testing.assert_close(fi.run(w, q, k, v), _expected(q, k, v, 2.0, 0.5)[0], rtol=0, atol=0)
    assert (w.runs, w._cached_module.calls) == (1, 4)
    w.plan(3.0, 0.25)  # a new plan: recorded again, never the old arguments
    q, k, v = _qkv(9)
    torch.testing.assert_close(fi.run(w, q, k, v), _expected(q, k, v, 3.0, 0.25)[0], rtol=0, atol=0)
    torch.testing.assert_close(fi.run(w, *_qkv(10)), _expected(*_qkv(10), 3.0, 0.25)[0], rtol=0, atol=0)
    assert w.runs == 2
    # the recorded list keeps none of the call's tensors alive
    assert all(not (isinstance(a, torch.Tensor) and a.shape == q.shape) for a in getattr(w, fi._REPLAY).args)


def test_lse_runs_replay_apart_from_plain_ones_and_return_what_the_kernel_wrote(monkeypatch):
    monkeypatch.setattr(fi, "_pdl", lambda index: False)
    w = _Wrapper()
    w.plan(2.0, 0.5)
    for seed in range(3):
        q, k, v = _qkv(seed)
        out, lse = fi.run_with_lse(w, q, k, v)
        want_out, want_lse = _expected(q, k, v, 2.0, 0.5)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    fi.run(w, *_qkv(5))  # switching to a plain run records that one
    assert w.runs == 2 and w._cached_module.calls == 4


def test_calls_it_cannot_replay_exactly_keep_running_run(monkeypatch):
    monkeypatch.setattr(fi, "_pdl", lambda index: False)
    w = _Wrapper(convert_lse=True)  # run hands back an lse it made itself
    w.plan(2.0, 0.5)
    for seed in range(3):
        q, k, v = _qkv(seed)
        torch.testing.assert_close(fi.run_with_lse(w, q, k, v)[1], _expected(q, k, v, 2.0, 0.5)[1], rtol=0, atol=0)
    assert w.runs == 3
    w2 = _Wrapper()
    w2.plan(2.0, 0.5)
    q, _, v = _qkv(0)
    for _ in range(3):  # q is k: its slot would be ambiguous
        torch.testing.assert_close(fi.run(w2, q, q, v), _expected(q, q, v, 2.0, 0.5)[0], rtol=0, atol=0)
    assert w2.runs == 3


def test_a_kernel_call_with_keywords_is_run_not_replayed(monkeypatch):
    monkeypatch.setattr(fi, "_pdl", lambda index: False)

    class KeywordWrapper(_Wrapper):
        def run(self, q, k, v, return_lse=False, enable_pdl=False):
            self.runs += 1
            out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
            self._cached_module.ragged_run(self._ws, self._plan_info, q, k, v, out, None, self._scale, pdl=enable_pdl)
            return out

    w = KeywordWrapper()
    w.plan(2.0, 0.5)
    for seed in range(3):
        q, k, v = _qkv(seed)
        torch.testing.assert_close(fi.run(w, q, k, v), _expected(q, k, v, 2.0, 0.5)[0], rtol=0, atol=0)
    assert w.runs == 3


def test_replay_runs_only_the_recorded_call_of_the_current_plan(monkeypatch):
    """``fi.replay`` (the direct path of a forward's later layers): the recorded kernel
    call of the plan in force, for a call that needs nothing adapted; None before a
    recording, after a re-plan, for an LSE recording, a padded head dim or a
    non-contiguous q, where ``run`` must do it."""
    monkeypatch.setattr(fi, "_pdl", lambda index: False)
    w = _Wrapper()
    w.plan(2.0, 0.5)
    q, k, v = _qkv(0)
    assert fi.replay(w, q, k, v) is None  # nothing recorded yet
    fi.run(w, q, k, v)
    for seed in range(1, 4):
        q, k, v = _qkv(seed)
        torch.testing.assert_close(fi.replay(w, q, k, v), _expected(q, k, v, 2.0, 0.5)[0], rtol=0, atol=0)
    assert (w.runs, w._cached_module.calls) == (1, 4)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    assert fi.replay(w, qt, k, v) is None
    assert fi.replay(w, q[..., :32], k[..., :32], v[..., :32]) is None  # another head dim than recorded
    assert fi.replay(w, q.double(), k.double(), v.double()) is None
    w.plan(3.0, 0.25)
    assert fi.replay(w, q, k, v) is None  # re-planned: the recording is stale
    fi.run_with_lse(w, q, k, v)
    assert fi.replay(w, q, k, v) is None  # an LSE recording
    # ... which replays for a call that wants the LSE (a training forward's later layers)
    for seed in range(4, 6):
        q, k, v = _qkv(seed)
        out, lse = fi.replay(w, q, k, v, lse=True)
        want_out, want_lse = _expected(q, k, v, 3.0, 0.25)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert fi.replay(w, qt, k, v, lse=True) is None
    fi.run(w, q, k, v)  # recorded without the LSE again
    assert fi.replay(w, q, k, v, lse=True) is None


def test_a_broken_flashinfer_install_reads_as_missing_under_compile(tmp_path, monkeypatch):
    """An import of flashinfer that raises (a CUDA mismatch underneath it) means
    "not available", also when the first check runs while torch.compile traces
    (where a raising import would be an internal compiler error)."""
    import sys

    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("raise RuntimeError('a broken CUDA install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    fi._importable.cache_clear()
    try:
        @torch.compile(fullgraph=True, backend="eager")
        def f(x):
            return x + (1 if fi.available() else 2)

        assert f(torch.zeros(1)).item() == 2
    finally:
        fi._importable.cache_clear()
