"""FlashInfer's plan/run replaced, for CPU tests of the runtime's host logic
(wrapper pool, slot ownership, steps, plan reuse, the training LSE).

A wrapper records the layout it was planned for (graph-mode wrappers too: their
static buffers are ignored); ``run`` computes the reference
output and ``run_with_lse`` also FlashInfer's LSE convention (``[Tq, Hq]``,
base 2, ``-inf`` for keyless rows) from the *planned* layout, so a stale or
shared plan shows up as a wrong result.
"""

from __future__ import annotations

import math

import torch

from ragged_compile.backends import flashinfer as fi
from ragged_compile.backends import select
from ragged_compile.reference import reference_attention, reference_lse


class Wrapper:
    def __init__(self):
        self.plans = 0
        self.layout = None

    def run(self, q, k, v):
        cu_q, cu_k, causal, scale, window_left, softcap = self.layout
        # FlashInfer's window bounds the left only (right: causal's, or none)
        return reference_attention(q, k, v, cu_q, cu_k, causal, scale, window_size=(window_left, -1), softcap=softcap)


class Event:
    def record(self):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


def install(monkeypatch) -> list[Wrapper]:
    """Patches FlashInfer's entry points; returns the wrappers made, in order."""
    wrappers = []

    def make_wrapper(workspace, backend, **kw):
        wrappers.append(Wrapper())
        return wrappers[-1]

    def plan(w, cu_q, cu_k, hq, hkv, d, dtype, causal, scale, *, window_left=-1, softcap=0.0, **kw):
        w.plans += 1
        w.layout = (cu_q.clone(), cu_k.clone(), causal, scale, window_left, softcap)

    def run_with_lse(w, q, k, v):
        cu_q, cu_k, causal, scale, window_left, softcap = w.layout
        assert window_left == -1 and not softcap, "the training forward plans no variant"
        lse = reference_lse(q, k, cu_q, cu_k, causal, scale)  # [Hq, Tq], ln, +inf
        fi_lse = (lse / math.log(2.0)).t().contiguous()
        return w.run(q, k, v), fi_lse.masked_fill(torch.isinf(fi_lse), -math.inf)

    monkeypatch.setattr(fi, "make_wrapper", make_wrapper)
    monkeypatch.setattr(fi, "plan", plan)
    monkeypatch.setattr(fi, "run", lambda w, q, k, v: w.run(q, k, v))
    monkeypatch.setattr(fi, "replay", lambda w, q, k, v, lse=False: run_with_lse(w, q, k, v) if lse else w.run(q, k, v))
    monkeypatch.setattr(fi, "run_with_lse", run_with_lse)
    monkeypatch.setattr(select, "flashinfer_backend", lambda requested, *a, **kw: "fa2")
    # graph mode's double-buffered pinned plan buffer (cudagraph.py)
    monkeypatch.setattr(fi, "staging_buffer", lambda w: torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(fi, "set_staging_buffer", lambda w, buf: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return wrappers
