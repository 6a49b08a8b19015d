"""Fixtures shared by tests/: a fresh Dynamo per test, and which implementation ran, counted.

On CPU every call of our op runs the fused CPU kernel (or, float64, the
reference), so counting those calls per thread says whether our op ran.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch._inductor import config as inductor_config


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset, its counters cleared, Inductor's caches off: every compile
    counted (modules opt in with ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with inductor_config.patch(force_disable_caches=True):
        yield


class _Counter(threading.local):
    n = 0


@pytest.fixture
def ours(monkeypatch):
    """Calls of our op's CPU kernels on this thread (``ours.n``): the fused CPU kernel
    (inference op and, with grad, the LSE pair of ops.py) and the reference."""
    from ragged_compile import ops as rc_ops
    from ragged_compile.backends import cpu as cpu_kernel

    count = _Counter()

    def spying(real):
        def spy(*args, **kwargs):
            count.n += 1
            return real(*args, **kwargs)

        return spy

    monkeypatch.setattr(rc_ops, "reference_attention", spying(rc_ops.reference_attention))
    monkeypatch.setattr(cpu_kernel, "cpu_attention", spying(cpu_kernel.cpu_attention))
    return count
