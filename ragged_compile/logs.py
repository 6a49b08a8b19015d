"""The ``ragged_compile`` logger and its one warn-once helper.

Fallbacks (a call that runs a slower kernel, or stock PyTorch, and why) are
logged once per process at WARNING on the ``ragged_compile`` logger; user
errors raise. ``warnings.warn`` is kept for nothing but deprecations.
"""

from __future__ import annotations

import logging
import threading

import torch

__all__ = ["log", "warn_once"]

log = logging.getLogger("ragged_compile")

_seen: set[str] = set()
_lock = threading.Lock()


# Traced by Dynamo as a constant: a fallback decided inside a compiled region
# logs while it is traced, without a graph break.
@torch._dynamo.assume_constant_result
def warn_once(msg: str) -> bool:
    """Log ``msg`` at WARNING the first time this process sees it; True if it was logged."""
    with _lock:
        if msg in _seen:
            return False
        _seen.add(msg)
    log.warning("ragged_compile: %s", msg)
    return True
