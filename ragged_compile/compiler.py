"""``ragged_compile.compile``: ``torch.compile`` with the ragged rewrite in force.

Every call of the returned object goes through :func:`_run`, which runs in plain
Python *outside* the compiled region (it wraps Dynamo's entry point, it is not
traced) and sees the call's arguments:

1. it marks the layout of every nested jagged tensor argument dynamic and turns
   on size-oblivious reasoning for the call (see :func:`_dynamic_layouts`);
2. it enters :func:`ragged_compile.enable` (NJT SDPA handler, Inductor passes),
   so every trace and recompile of this object happens with the rewrite;
3. it enters :func:`_call_context`, the per-call seam for a device runtime.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config
from torch.nested._internal.nested_tensor import NestedTensor
from torch.utils import _pytree as pytree

from .njt import enable

__all__ = ["compile"]


def compile(model: Callable | None = None, **torch_compile_kwargs: Any) -> Any:
    """``torch.compile(model, **torch_compile_kwargs)`` with the ragged rewrite in force.

    Returns what ``torch.compile`` returns for the same arguments (an
    ``OptimizedModule`` for a module, a function for a function, a decorator
    when ``model`` is None). SDPA over nested jagged tensors and varlen attention
    run on ``ragged_compile::ragged_attention`` (see :func:`ragged_compile.enable`);
    everything else compiles as ``torch.compile`` would.

    Unless ``dynamic=False``, nested jagged tensor arguments are marked dynamic
    so that new layouts (batch size, lengths, totals, max length) reuse the
    compiled graph instead of recompiling or specialising.

    The rewrite lives in a wrapper around the returned object's entry point;
    ``copy.deepcopy`` or pickling rebuilds a plain ``torch.compile`` object, so
    compile the copy again.
    """
    if model is None:
        return lambda m: compile(m, **torch_compile_kwargs)
    compiled = torch.compile(model, **torch_compile_kwargs)
    mark = torch_compile_kwargs.get("dynamic") is not False
    if isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
        # forward is Dynamo's wrapped entry; nn.Module.__call__ (hooks included)
        # runs outside it, as does our wrapper around it.
        compiled.forward = _wrap(compiled.forward, mark)
        return compiled
    return functools.wraps(compiled)(_wrap(compiled, mark))


def _call_context(args: tuple, kwargs: dict) -> contextlib.AbstractContextManager:
    """Per-call seam, entered around every call outside the compiled region.

    With nested jagged tensors on CUDA it opens a runtime step for the call, so
    every layer shares one plan per layout, and starts copying their offsets to
    the host before the model runs: the first attention layer then waits for that
    copy alone (one read per layout per forward), never for a drained queue.
    """
    njts = [
        x for x in pytree.tree_leaves((args, kwargs))
        if isinstance(x, NestedTensor) and x.device.type == "cuda"
    ]
    if not njts:
        return contextlib.nullcontext()
    return _cuda_step(njts)


@contextlib.contextmanager
def _cuda_step(njts: list[NestedTensor]):
    from .runtime import current_step, get_runtime

    runtime = get_runtime(njts[0].device)
    outer = current_step()
    if outer is not None and outer.runtime is runtime:
        # Compiled blocks called inside one forward (per-block compile, as with
        # FSDP2) join the step around it: one plan per layout per forward.
        for nt in njts:
            outer.prefetch(nt._offsets)
        yield
        return
    with runtime.step() as step:
        for nt in njts:
            step.prefetch(nt._offsets)
        yield


def _wrap(call: Callable, mark: bool) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return _run(call, mark, args, kwargs)

    return run


def _run(call: Callable, mark: bool, args: tuple, kwargs: dict) -> Any:
    with contextlib.ExitStack() as stack:
        njts = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, NestedTensor)]
        if mark and njts:
            stack.enter_context(_dynamic_layouts(njts))
        stack.enter_context(enable())
        stack.enter_context(_call_context(args, kwargs))
        return call(*args, **kwargs)


@contextlib.contextmanager
def _dynamic_layouts(njts: list[NestedTensor]):
    """Keep every layout on one graph.

    * The ragged length and the total token count are symbolic for NJTs anyway.
    * The batch size is not: Dynamo reads it from ``offsets.size(0)``, and the
      first new batch size would recompile (automatic dynamic). So the batch dim
      and the offsets' length are marked dynamic up front.
    * A cached min/max seqlen of 1 (segments of one token) or a batch of 1 hits
      Dynamo's 0/1 specialisation: one more graph each. ``backed_size_oblivious``
      treats backed sizes as size-like >= 0 instead, for this call only.

    Measured on torch 2.13 CPU, a 2-layer encoder over 45 random layouts (2-7
    segments of 1-12 tokens, all-ones layouts included): 4 graphs with nothing,
    3 with the marks alone, 2 with backed_size_oblivious alone, 1 with both
    (marking the values' dim 0 instead of the batch dim still gave 2).
    """
    for nt in njts:
        torch._dynamo.maybe_mark_dynamic(nt, 0)
        torch._dynamo.maybe_mark_dynamic(nt._offsets, 0)
    fx_config = torch.fx.experimental._config
    before = fx_config.backed_size_oblivious
    fx_config.backed_size_oblivious = True  # set/restore as config.patch() does, cheaper
    try:
        yield
    finally:
        fx_config.backed_size_oblivious = before
