"""``ragged_compile.compile``: ``torch.compile`` with the ragged rewrite in force.

Two pieces, one per moment:

* **Compile time**: a Dynamo backend of our own, :class:`RaggedBackend`, wraps
  the backend the user chose (``"inductor"`` with its ``mode``/``options``,
  ``"aot_eager"``, a callable). Dynamo keys every cache entry on the backend
  object, so code compiled here is never run by a plain ``torch.compile`` of the
  same function or module class, nor the other way round, in any mode. The NJT
  SDPA handler (see :mod:`ragged_compile.njt`) gives our op to graphs traced for
  this backend only, and Inductor's varlen passes run only inside it
  (:func:`ragged_compile.passes.installed`). One backend object per
  ``(backend, mode, options, dynamic)``, so compiles with equal settings share
  our cache entries as ``torch.compile``'s do.
* **Call time**: every call of the returned object goes through :func:`_run`,
  which runs in plain Python *outside* the compiled region (it wraps Dynamo's
  entry point, it is not traced) and sees the call's arguments. It marks the
  layout of every nested jagged tensor argument dynamic
  (:func:`_dynamic_layouts`), enters :func:`ragged_compile.enable` for the parts
  that run eagerly (graph breaks), and enters :func:`_call_context`, the
  per-call seam for a device runtime.

Nothing process-wide is swapped per call: threads calling compiled and eager
models at once each get what they asked for.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nested._internal.nested_tensor import NestedTensor
from torch.utils import _pytree as pytree

from . import passes
from .njt import _handler_uuid, enable, install

__all__ = ["compile", "RaggedBackend"]



def compile(model: Callable | None = None, **torch_compile_kwargs: Any) -> Any:
    """``torch.compile(model, **torch_compile_kwargs)`` with the ragged rewrite in force.

    Returns what ``torch.compile`` returns for the same arguments (an
    ``OptimizedModule`` for a module, a function for a function, a decorator
    when ``model`` is None). SDPA over nested jagged tensors and varlen attention
    run on ``ragged_compile::ragged_attention`` (see :func:`ragged_compile.enable`);
    everything else compiles as ``torch.compile`` would, with the same
    ``backend``, ``mode`` and ``options``.

    Compiled code is never shared with plain ``torch.compile``: a model of the
    same class compiled both ways runs stock attention through one and ours
    through the other, in either order.

    Unless ``dynamic=False``, nested jagged tensor arguments are marked dynamic
    so that new layouts (batch size, lengths, totals, max length) reuse the
    compiled graph instead of recompiling or specialising.

    The rewrite lives in a wrapper around the returned object's entry point,
    which a module's ``copy.deepcopy``, pickle or ``torch.save`` copy keeps.
    """
    if model is None:
        return lambda m: compile(m, **torch_compile_kwargs)
    kwargs = dict(torch_compile_kwargs)
    backend = kwargs.pop("backend", None)
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    name = kwargs.pop("name", None)
    dynamic = kwargs.get("dynamic")
    dynamo_options = None
    if options:
        # torch.compile takes these two out of options before the backend sees them.
        options = dict(options)
        dynamo_options = {k: options.pop(k) for k in ("guard_filter_fn",) if k in options} or None
    ours = _backend(backend, mode, options, dynamic, name)
    install()
    compiled = torch.compile(model, backend=ours, options=dynamo_options, **kwargs)
    mark = None if dynamic is False else True
    if isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule):
        # forward is Dynamo's wrapped entry, built by the module's dynamo_ctx;
        # nn.Module.__call__ (hooks included) runs outside it, as does our
        # wrapper around it. Our context builds it wrapped, here and in every
        # copy: deepcopy and pickle rebuild OptimizedModule(module, dynamo_ctx).
        compiled.dynamo_ctx = _RaggedContext(compiled.dynamo_ctx, mark)
        compiled._initialize()
        return compiled
    return functools.wraps(compiled)(_wrap(compiled, {"unbacked": mark}))


class RaggedBackend:
    """Dynamo backend: the user's backend, compiled with the ragged rewrite.

    ``inner`` is what ``torch.compile`` would have used for the same arguments
    (``_TorchCompileInductorWrapper`` for ``"inductor"`` with mode and options
    applied, ``_TorchCompileWrapper`` for anything else). Equal inners make
    equal backends, so Dynamo reuses our entries across compiles with equal
    settings; no plain backend ever equals ours.
    """

    _ragged_compile_backend = True  # what the NJT SDPA handler looks for

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.compiler_name = f"ragged_compile[{getattr(inner, 'compiler_name', 'custom')}]"
        self.__name__ = self.compiler_name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        _quiet_njt_cache_keys()
        with passes.installed(_handler_uuid()), passes.in_our_compile():
            return self.inner(gm, example_inputs, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RaggedBackend) and self.inner == other.inner

    def __hash__(self) -> int:
        return hash(RaggedBackend)

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def get_compiler_config(self) -> Any:
        getter = getattr(self.inner, "get_compiler_config", None)
        return getter() if getter is not None else None


_backends: list[RaggedBackend] = []
_backends_lock = threading.Lock()


def _backend(backend: Any, mode: str | None, options: dict | None, dynamic: bool | None, name: Any) -> RaggedBackend:
    """Our backend for these settings, built as ``torch.compile`` builds its own."""
    if mode is not None and options is not None:
        raise RuntimeError(
            "Either mode or options can be specified, but both can't be specified at the same time."
        )
    if mode is None and options is None:
        mode = "default"
    if backend is None:
        try:
            from torch._dynamo.backends.registry import get_default_backend

            backend = get_default_backend()
        except ImportError:  # torch releases without a configurable default
            backend = "inductor"
    options = dict(options) if options else options
    use_aoti = bool(options.pop("use_aoti", False)) if options else False
    if backend == "inductor":
        cls = torch._TorchCompileAOTInductorWrapper if use_aoti else torch._TorchCompileInductorWrapper
        extra = {"name": name} if name is not None else {}
        inner = cls(mode, options, dynamic, **extra)
        slot = inner.config.get("post_grad_custom_post_pass")
        if slot is not None and not isinstance(slot, passes.RaggedAttentionPasses):
            # A pass given in options replaces the config slot during the compile: run ours after it.
            inner.config["post_grad_custom_post_pass"] = passes.RaggedAttentionPasses(
                slot, _handler_uuid(), gated=True
            )
    else:
        inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
    with _backends_lock:
        for existing in _backends:
            if existing.inner == inner:
                return existing
        ours = RaggedBackend(inner)
        _backends.append(ours)
        return ours


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
    from .runtime import get_runtime
    from .steps import current_step

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


def _wrap(call: Callable, state: dict) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return _run(call, state, args, kwargs)

    return run


class _RaggedContext:
    """The ``dynamo_ctx`` of a module compiled by :func:`compile`: Dynamo's own
    context, whose entry point it wraps in :func:`_run`.

    ``OptimizedModule`` builds ``forward`` as ``dynamo_ctx(module.__call__)`` when
    it is made and when a copy is (``copy.deepcopy``, pickle and ``torch.save``
    rebuild it from the module and this context), so every copy gets the
    wrapper, hence the dynamic marks, and the state learned so far (whether
    min/max lengths can stay unbacked). Everything else is Dynamo's context's.
    """

    def __init__(self, inner: Any, mark: bool | None) -> None:
        self.inner = inner
        self.state = {"unbacked": mark}

    def __call__(self, fn: Callable) -> Callable:
        return _wrap(self.inner(fn), self.state)

    def __getattr__(self, name: str) -> Any:
        # Only for what this object lacks; never while unpickling (no inner yet).
        if name.startswith("__") or name in ("inner", "state"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def _run(call: Callable, state: dict, args: tuple, kwargs: dict) -> Any:
    njts = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, NestedTensor)]
    with enable(), _call_context(args, kwargs):
        try:
            return _call_marked(call, state, njts, args, kwargs)
        except Exception as e:
            _surface_notes(e)
            raise


def _call_marked(call: Callable, state: dict, njts: list, args: tuple, kwargs: dict) -> Any:
    unbacked = state["unbacked"]
    if unbacked is None or not njts:  # dynamic=False: no marks
        return call(*args, **kwargs)
    try:
        with _dynamic_layouts(njts, unbacked=unbacked):
            return call(*args, **kwargs)
    except Exception as e:
        if not (unbacked and _unbacked_failure(e)):
            raise
        first = e
    # A data-dependent failure: our unbacked min/max lengths, or the model's own
    # (a user error, stock code reading sizes)? Only a call that then compiles
    # with them backed says it was ours.
    try:
        with _dynamic_layouts(njts, unbacked=False):
            out = call(*args, **kwargs)
    except Exception:
        retry_failed = True
    else:
        retry_failed = False
    if retry_failed:
        # Not our marks: the call's own error, and the model keeps its settings.
        # Raised out here so that its chain stays as it was.
        raise first
    # Some code needs the unmarked sizes' values (a guard on a data-dependent
    # size): keep them backed from now on, as plain torch.compile does.
    state["unbacked"] = False
    from .njt import _note

    _note(
        logging.WARNING,
        "this model cannot keep NJT min/max lengths symbolic without hints, so layouts "
        "whose min or max segment length is 1 compile their own graph",
    )
    return out


_UNBACKED_ERRORS = ("GuardOnDataDependentSymNode", "PendingUnbackedSymbolNotFound", "DataDependent")


def _unbacked_failure(e: BaseException | None) -> bool:
    """Whether a failure is data-dependent (a guard or a size needing an unbacked value).

    Only a candidate: :func:`_call_marked` retries with backed sizes to learn
    whether our marks caused it.
    """
    seen = 0
    while e is not None and seen < 16:
        if any(name in type(e).__name__ for name in _UNBACKED_ERRORS) or "unbacked" in str(e)[:2000]:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _surface_notes(e: BaseException) -> None:
    """Put ragged_compile's notes from deeper in the chain on ``e`` itself.

    The NJT SDPA handler notes why a call was left to stock NJT SDPA on the
    exception stock raised (see :mod:`ragged_compile.njt`); Dynamo wraps that
    one (``Unsupported``, ``UserError``) and prints the wrapper, note-less.
    """
    have = set(getattr(e, "__notes__", ()))
    inner, seen = e.__cause__ or e.__context__, 0
    while inner is not None and seen < 16:
        for note in getattr(inner, "__notes__", ()):
            if isinstance(note, str) and note.startswith("ragged_compile:") and note not in have:
                e.add_note(note)
                have.add(note)
        inner, seen = inner.__cause__ or inner.__context__, seen + 1


@contextlib.contextmanager
def _dynamic_layouts(njts: list[NestedTensor], unbacked: bool):
    """Keep every layout on one graph, marking only the sizes a layout sets.

    * The ragged length is a nested int, symbolic for NJTs anyway.
    * The batch size is not: Dynamo reads it from ``offsets.size(0)``, and the
      first new batch size would recompile (automatic dynamic). So the batch dim
      and the offsets' length are marked dynamic up front.
    * A min/max segment length of one (the NJT's cached
      ``_min/_max_seqlen_tensor``) hits Dynamo's 0/1 specialisation: one more
      graph each. They are marked *unbacked* (no 0/1 guard; nothing else sees
      them).
    * The token total (``values.size(0)``) stays *backed*, so a batch of one
      token and an empty batch compile one more graph each, once. Every activation's shape derives from it,
      and an unbacked total cost the 8-layer d=2048 training step 5% of its time
      and 5.2 GiB of peak memory on the H200 (``bench/profile/profile_train.py``:
      229.7 ms and 22.4 GiB over resident, against 217.9 ms and 17.2 GiB
      backed): Inductor's pointwise and layer-norm kernels got slower and its
      backward reused fewer buffers.

    Only these tensors are marked, never a process-wide setting (dense side
    inputs keep torch.compile's semantics), and the marks come off after the
    call, so the user's tensors carry nothing into a plain ``torch.compile``.

    Measured on torch 2.13 CPU, a 3-layer encoder over 28 layouts (batches of 1
    to 7 segments of 1-12 tokens, totals of 1 and all-ones layouts included):
    4 graphs with the dynamic marks alone, 2 with unbacked min/max lengths (the
    second for the one-token total), 1 with the total unbacked too.
    """
    added: list[tuple[torch.Tensor, str, int]] = []

    def mark(t: torch.Tensor, attr: str, how: Callable) -> None:
        if 0 in getattr(t, attr, ()):
            return
        how(t, 0)
        added.append((t, attr, 0))

    for nt in njts:
        mark(nt, "_dynamo_weak_dynamic_indices", torch._dynamo.maybe_mark_dynamic)
        mark(nt._offsets, "_dynamo_weak_dynamic_indices", torch._dynamo.maybe_mark_dynamic)
        if not unbacked:
            continue
        for key in ("min_seqlen", "max_seqlen"):
            t = nt._metadata_cache.get(key)
            if isinstance(t, torch.Tensor):
                mark(t, "_dynamo_unbacked_indices", torch._dynamo.decorators.mark_unbacked)
    try:
        yield
    finally:
        for t, attr, index in added:
            # A new set, not discard(): Dynamo's guards keep the set they compiled with.
            setattr(t, attr, getattr(t, attr) - {index})


class _NJTCacheKeyFilter(logging.Filter):
    """Drops Inductor's "Failed to pickle cache key" record for NJT inputs, in our compiles.

    On this torch, Inductor's cache cannot key a graph with nested jagged tensor
    inputs (``NestedTensor`` has no ``_stable_hash_for_caching``, and the default
    hash pickles symbolic sizes): it logs a multi-line traceback and compiles
    without the cache, every compile. Only that record is dropped, only while
    our backend compiles, and only when the traceback shows a NestedTensor
    being hashed; we say once, at INFO, that such compiles are not cached.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not passes._IN_OUR_COMPILE.get() or record.msg != "Failed to pickle cache key":
            return True
        exc = record.exc_info[1] if record.exc_info else None
        tb = exc.__traceback__ if exc is not None else None
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "_reduce_tensor_subclass" and isinstance(
                frame.f_locals.get("tensor"), NestedTensor
            ):
                from .njt import _note

                _note(
                    logging.INFO,
                    "Inductor's cache cannot key nested jagged tensor inputs on this torch "
                    "(NestedTensor has no _stable_hash_for_caching): this graph is compiled uncached",
                )
                return False
            tb = tb.tb_next
        return True


_cache_key_filter = _NJTCacheKeyFilter()


def _quiet_njt_cache_keys() -> None:
    logger = logging.getLogger("torch._inductor.codecache")
    if _cache_key_filter not in logger.filters:
        logger.addFilter(_cache_key_filter)  # stays: it acts only inside our compiles
