"""The step the op's CUDA kernel sees: one stack per thread.

The seam between the kernel and whoever plans for it. :class:`~ragged_compile.runtime.Runtime`
pushes its steps here (``Runtime.step``), CUDA-graph mode pushes the step that
hands out graph-mode wrappers during capture (cudagraph.py). A step is any
object with a ``runtime`` attribute and an ``attention(q, k, v, cu_q, cu_k,
causal, scale)`` method. Per thread, so two threads running models under their
own steps never see each other's plans.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

__all__ = ["activate", "current_step"]

_local = threading.local()


@contextmanager
def activate(step: Any):
    """Make ``step`` the one the op's CUDA kernel sees on this thread."""
    stack = _local.__dict__.setdefault("steps", [])
    stack.append(step)
    try:
        yield step
    finally:
        stack.pop()


def current_step() -> Any | None:
    """The innermost active step on this thread, or None."""
    stack = getattr(_local, "steps", None)
    return stack[-1] if stack else None
