"""SDPA over nested jagged tensors (NJT) on ragged_compile's op, and :func:`enable`.

Hook level: ``F.scaled_dot_product_attention`` on NJTs reaches
``NestedTensor.__torch_function__`` -> ``torch.nested._internal.ops.jagged_torch_function``,
which looks up ``jagged_scaled_dot_product_attention`` as a module global on every
call. On first use we replace that global, once and for good, with
:func:`_ragged_sdpa`. It is the one level that sees NJT SDPA eagerly and under
``torch.compile`` on every device. Dynamo records NJT SDPA as a single graph node
and calls the handler to propagate fake NJTs; AOTAutograd calls it again while
tracing, so our op (not flash or math) is what lands in the aten graph Inductor
compiles. Anything later is too late on CPU: the stock handler picks MATH, whose
``_nested_tensor_from_tensor_list`` has no fake kernel, so compiling fails before
Inductor runs. A ``TorchFunctionMode`` instead makes Dynamo trace every NJT
method through the mode, which breaks on NJT's own ``super()`` calls.

Who gets our op is decided per call, never by swapping globals, so threads and
plain ``torch.compile`` next to ours each get what they asked for:

* while Dynamo compiles (on this thread), by the backend it compiles for: only
  :func:`ragged_compile.compile`'s backend gets our op. Dynamo keys its cache on
  the backend, so code compiled for ours is never run by a plain
  ``torch.compile`` and the other way round;
* otherwise (eager) by a context variable that :func:`enable` sets, per thread
  and per ``contextvars`` context.

Everything else goes to the handler that was installed before us, called
exactly as without ragged_compile (including stock errors).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Iterator

import torch
import torch._dynamo.symbolic_convert as _dynamo_tx
import torch.nested._internal.ops as _njt_ops
import torch.nn.functional as F
from torch import Tensor
from torch.nested._internal.nested_tensor import (
    NestedTensor,
    nested_view_from_values_offsets_lengths,
)
from torch.utils.weak import WeakTensorKeyDictionary

from . import ops as _ops  # noqa: F401  (registers torch.ops.ragged_compile.ragged_attention)
from .backends.select import dropout_kernel, training_reason, unsupported_reason
from .logs import log, warn_once
from .ops import attention, autocast_inputs

__all__ = ["enable", "is_enabled"]


# Eager calls in this context run on our op (set by enable()).
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("ragged_compile_enabled", default=False)
# The handler we replaced; every call we do not take goes there.
_stock = _njt_ops.jagged_scaled_dot_product_attention
_install_lock = threading.Lock()


def is_enabled() -> bool:
    """Whether eager NJT SDPA in this thread / context runs on ragged_compile's op."""
    return _ENABLED.get()


def install() -> None:
    """Put :func:`_ragged_sdpa` in NJT's handler slot, once (idempotent, thread-safe).

    Outside :func:`enable` and :func:`ragged_compile.compile` it calls the
    handler it replaced with the same arguments, so nothing changes for anyone
    else. Should other code replace the slot later, the next use installs us
    again in front of it.
    """
    global _stock
    if _njt_ops.jagged_scaled_dot_product_attention is _ragged_sdpa:
        return
    with _install_lock:
        current = _njt_ops.jagged_scaled_dot_product_attention
        if current is not _ragged_sdpa:
            _stock = current
            _njt_ops.jagged_scaled_dot_product_attention = _ragged_sdpa


@contextlib.contextmanager
def enable() -> Iterator[None]:
    """Run eager NJT ``F.scaled_dot_product_attention`` on our op, in this context.

    Inside the context, SDPA over NJTs in the ``[B, H, j, D]`` layout
    (``.transpose(1, 2)`` of the jagged ``[B, j, H, D]``) calls
    ``ragged_compile::ragged_attention`` on the packed values and the NJT offsets
    as they are: self- and cross-attention, ``is_causal`` (where it means what
    SDPA means) and ``enable_gqa``. Everything else keeps stock behaviour.

    The switch is a ``contextvars.ContextVar``: it holds for this thread (and
    this asyncio task) only, nests, and is restored on exit whatever other
    threads do. Nothing process-wide is swapped.

    It does not reach into ``torch.compile``: code compiled by plain
    ``torch.compile`` runs stock attention whether it was traced or called
    inside this context or not (a warning says so once), because Dynamo's cache
    cannot tell the two apart and would hand code traced here to calls outside.
    What such a model runs eagerly (around graph breaks) follows this context
    like any eager code. Compile with :func:`ragged_compile.compile` for our op
    in compiled code.

    With ``dropout_p > 0`` our op's dropout (PyTorch's FlashAttention-2, on CUDA)
    serves the call where it runs; elsewhere, on CPU, dense SDPA with dropout
    over padded segments (:func:`_padded_sdpa`), else stock NJT SDPA, with a
    warning, once. Indivisible head counts
    raise an error naming ``enable_gqa`` instead of stock's matmul error.
    """
    install()
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _compiling_for() -> tuple[bool, bool]:
    """``(compiling, ours)``: is Dynamo compiling on this thread, and for our backend?

    Dynamo keeps the frame it is translating in a thread-local while it builds
    the graph and while the backend (AOTAutograd) traces it; its output graph
    holds the backend it compiles for, possibly wrapped, so the wrappers are
    unwound (:func:`_is_ours`).
    """
    tx = getattr(_dynamo_tx.tls, "current_tx", None)
    if tx is None:
        return False, False
    return True, _is_ours(getattr(getattr(tx, "output", None), "compiler_fn", None))


# Where Dynamo's backend wrappers keep the backend they wrap:
# ``_torchdynamo_orig_backend`` (convert-frame callbacks, ``WrapBackendDebug``),
# ``compiler_fn`` (``_TorchCompileWrapper``), ``backend_compile_fn`` (the
# ``DDPOptimizer`` behind a bound ``compile_fn``, reached through ``__self__``),
# ``backend`` (``WrapperBackend`` of ``verify_correctness``), ``compiler``
# (``SubmodCompiler``), ``__wrapped__`` (``functools.wraps``, the per-graph
# inductor-config override), ``func`` (``functools.partial``).
_WRAPPED_ATTRS = (
    "_torchdynamo_orig_backend", "compiler_fn", "backend_compile_fn", "backend", "compiler",
    "__wrapped__", "func", "__self__",
)
_MAX_WRAPPERS = 64  # objects visited per lookup: wrapper chains are a handful deep


def _is_ours(fn: object) -> bool:
    """Whether ``fn`` is our backend or wraps it, through any of Dynamo's wrappers.

    A bounded breadth-first walk over the attributes above and, for plain
    function wrappers that record nothing, the callables their closures hold.
    Attribute look-ups that raise count as absent: a foreign backend can never
    make a compile fail here, only keep stock attention.
    """
    queue, seen = [fn], set()
    while queue and len(seen) < _MAX_WRAPPERS:
        obj = queue.pop(0)
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            continue  # a class is not a backend, and its attributes are not wrapped ones
        try:
            if getattr(obj, "_ragged_compile_backend", False) is True:
                return True
        except Exception:
            continue
        for attr in _WRAPPED_ATTRS:
            try:
                inner = getattr(obj, attr, None)
            except Exception:
                continue
            if inner is not None and not isinstance(inner, (str, bytes, int, float, type)):
                queue.append(inner)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(inner) and not isinstance(inner, type):
                queue.append(inner)
    return False


@functools.lru_cache(1)
def _handler_uuid() -> str:
    # AOTAutograd's cache key holds the Dynamo graph (one NJT SDPA node), not
    # what this handler traced it into; our pass uuid carries that instead.
    from .backends import select
    from .passes import _hash_source

    return _hash_source(sys.modules[__name__], select)


@torch._dynamo.assume_constant_result
def _note(level: int, msg: str) -> bool:
    """Log a decision: INFO once per compile, DEBUG per eager call; warnings once.

    Dynamo records NJT SDPA as one graph node and runs the handler while it
    propagates fake tensors and again while AOTAutograd traces, hence the
    de-duplication per compile id. Should Dynamo ever inline the handler, the
    decorator runs this at trace time instead of graph-breaking on the log call.
    """
    context = torch._guards.CompileContext.try_get()
    if context is not None and context.compile_id is not None:
        msg = f"{msg} [compile {context.compile_id}]"
        level = max(level, logging.INFO)
        seen = _seen_per_compile.setdefault(context, set())
    elif level >= logging.WARNING:
        warn_once(msg)  # eager warnings: once per process
        return True
    else:
        seen = set()
    if msg not in seen:
        seen.add(msg)
        log.log(level, "ragged_compile: %s", msg)
    return True


_seen_per_compile: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stock_reason(query, key, value, attn_mask, is_causal, enable_gqa) -> str | None:
    """Why this SDPA call must stay stock, or None. Metadata only: safe under Dynamo.

    Dropout is decided by the caller (see :func:`_ragged_sdpa`). Head counts that
    no grouping can serve raise here, since stock's error would not say why.
    """
    if not all(isinstance(t, NestedTensor) for t in (query, key, value)):
        return "q, k and v are not all nested jagged tensors"
    if attn_mask is not None:
        return "attn_mask is given (NJT SDPA supports no mask)"
    if (
        query.device.type != "cpu"
        and torch.is_grad_enabled()
        and (query.requires_grad or key.requires_grad or value.requires_grad)
    ):
        # On CUDA the op trains with fused kernels (backends/select.py) where they take
        # the call; elsewhere stock NJT SDPA has a fused backward and ours would be
        # the reference kernel. On CPU stock has no causal, no GQA and no compile,
        # so training there runs on our op.
        why = training_reason(query.device, query.dtype, query.size(-1))
        if why is not None:
            return f"inputs require grad and {why}"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs are not 4-D [B, H, j, D]"
    if query._ragged_idx != 2 or key._ragged_idx != 2 or value._ragged_idx != 2:
        return (
            "the ragged dim is not dim 2: SDPA attends over dim -2, so without "
            ".transpose(1, 2) it attends across heads (did you forget it?)"
        )
    if query._lengths is not None or key._lengths is not None or value._lengths is not None:
        return "a nested tensor has holes (lengths), not contiguous segments"
    if not (query.dtype == key.dtype == value.dtype):
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} differ"
    if not (query.device == key.device == value.device):
        return "q, k and v are on different devices"
    if not (query.size(-1) == key.size(-1) == value.size(-1)):
        return "q, k and v head dims differ"
    reason = unsupported_reason(query.device, query.dtype, query.size(-1))
    if reason is not None:
        return reason
    hq, hk, hv = query.size(1), key.size(1), value.size(1)
    if hk != hv:
        return f"k has {hk} heads but v has {hv}"
    if hq != hk and (not enable_gqa or hq % hk != 0):
        # Stock fails here with "matmul: batch dimensions must have the same sizes".
        fix = (
            "regroup the heads so that k/v heads divide query heads"
            if enable_gqa
            else "pass enable_gqa=True for grouped-query attention"
        )
        raise RuntimeError(
            f"ragged_compile: scaled_dot_product_attention got {hq} query heads and {hk} "
            f"key/value heads with enable_gqa={bool(enable_gqa)}; {fix}"
        )
    return None


# What the latest eager forward on an offsets tensor ran (ours or stock), for
# activation-checkpoint recomputes: see _eager_decision.
_FORWARD_RAN = WeakTensorKeyDictionary()
# The autograd graph task running on this thread, -1 outside a backward pass.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _eager_decision(query) -> bool:
    """Whether an eager call runs on our op: :func:`enable`'s context, except in a
    backward, where an activation-checkpoint recompute runs what its forward ran.

    ``torch.utils.checkpoint`` (``use_reentrant`` True or False) recomputes the
    forward during ``backward()``, typically outside the ``enable()`` block the
    forward ran in, and on CUDA on autograd's own thread, whose context never
    saw it. Stock NJT SDPA there would compute other values (or, on CPU, fail),
    and non-reentrant checkpointing rejects their metadata. So every eager
    forward call records its decision under its query offsets (weakly: the entry
    goes with the tensor), and a call inside a backward pass whose offsets a
    forward recorded makes the same decision. The recompute sees the forward's
    offsets tensor itself: checkpoint saves the NJT inputs, and NJT ops pass
    offsets along. Offsets built anew inside the checkpointed function are
    unknown in the backward and follow the context, as before.
    """
    enabled = _ENABLED.get()
    offsets = getattr(query, "_offsets", None)
    if not isinstance(offsets, Tensor):
        return enabled
    if _graph_task_id() == -1:  # not in a backward: a forward
        _FORWARD_RAN[offsets] = enabled
        return enabled
    return _FORWARD_RAN.get(offsets, enabled)


# Dynamo never traces into the handler (NJT SDPA is one graph node whose fake
# propagation calls it), but after a graph break in a plain torch.compile it would
# compile the handler's own frame when it runs eagerly: skip it.
@torch._dynamo.disable
def _ragged_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Drop-in for ``torch.nested._internal.sdpa.jagged_scaled_dot_product_attention``."""
    stock = functools.partial(
        _stock, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
    )
    compiling, ours = _compiling_for()
    if not compiling:
        ours = _eager_decision(query)
    elif not ours and _ENABLED.get():
        _note(
            logging.WARNING,
            "torch.compile traced NJT SDPA inside ragged_compile.enable(): compiled code keeps "
            "stock attention (enable() acts on eager code only); use ragged_compile.compile(model)",
        )
    if not ours:
        return stock()
    query, key, value = autocast_inputs(query, key, value)  # as stock SDPA under autocast
    reason = _stock_reason(query, key, value, attn_mask, is_causal, enable_gqa)
    if reason is None and dropout_p > 0.0 and dropout_kernel(query.device, query.dtype, query.size(-1)) != "fa2":
        if query.device.type == "cpu":
            _note(
                logging.WARNING,
                f"dropout_p={dropout_p}: ragged_compile's op has no dropout, so on CPU these "
                "calls run dense SDPA with dropout over padded segments (slower)",
            )
            return _padded_sdpa(query, key, value, dropout_p, is_causal, scale, enable_gqa)
        reason = (f"dropout_p={dropout_p}: ragged_compile's dropout kernel (PyTorch's FlashAttention-2: CUDA, "
                  f"float16/bfloat16, head dim <= 256, SM80+) does not take this call")
    if reason is not None:
        # Users who expect our op here (missing transpose, grad mode, dropout) get a warning.
        warn = any(w in reason for w in ("transpose", "require grad", "dropout"))
        _note(logging.WARNING if warn else logging.DEBUG, f"stock NJT SDPA: {reason}")
        if not compiling:
            return stock()
        try:
            return stock()
        except Exception as e:
            # Under Dynamo a stock failure surfaces as "... when making fake tensor
            # call" with our reason nowhere: put it first. Exception types Dynamo
            # acts on (fake-tensor ones graph-break, and the call then runs eagerly
            # as with plain torch.compile) keep their type and get it as a note.
            msg = (
                f"ragged_compile: this scaled_dot_product_attention call is left to stock "
                f"NJT SDPA because {reason}, and stock cannot trace it here: {e}"
            )
            if type(e) in (RuntimeError, ValueError, TypeError):
                raise type(e)(msg) from e
            e.add_note(msg)
            raise
    return _on_our_op(query, key, value, is_causal, scale, dropout_p)


def _check_layouts(q: NestedTensor, k: NestedTensor, v: NestedTensor, is_causal: bool) -> None:
    cu_q, cu_k = q._offsets, k._offsets
    if v._offsets is not cu_k:
        torch.ops.ragged_compile.check_same_segments(cu_k, v._offsets, _KV_MISMATCH)
        # Separately built k and v have separate symbolic totals under compile:
        # state their equality (checked above) instead of making a kernel guard on it.
        torch._check(k.values().size(0) == v.values().size(0), lambda: _KV_MISMATCH)
    if is_causal and cu_k is not cu_q:
        torch.ops.ragged_compile.check_same_segments(cu_q, cu_k, _CAUSAL_MISMATCH)


def _on_our_op(query, key, value, is_causal, scale, dropout_p: float = 0.0) -> Tensor:
    # [B, H, j, D] -> [B, j, H, D], whose values are the packed [T, H, D] tensor.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    _check_layouts(q, k, v, is_causal)
    cu_q, cu_k = q._offsets, k._offsets
    head_dim = q.size(-1)
    scale = float(scale) if scale is not None else head_dim**-0.5
    _note(
        logging.DEBUG,
        f"NJT SDPA -> ragged_attention (causal={bool(is_causal)}, heads "
        f"{query.size(1)}/{key.size(1)}, {'self' if cu_q is cu_k else 'cross'}-attention)",
    )
    out = attention(q.values(), k.values(), v.values(), cu_q, cu_k, bool(is_causal), scale, dropout_p=dropout_p)
    out = nested_view_from_values_offsets_lengths(
        out, cu_q, None, min_seqlen=q._maybe_min_seqlen, max_seqlen=q._maybe_max_seqlen
    )
    return out.transpose(1, 2)


def _padded_sdpa(query, key, value, dropout_p, is_causal, scale, enable_gqa) -> Tensor:
    """Dense SDPA with dropout over zero-padded segments: attention dropout on CPU.

    Stock NJT SDPA on CPU cannot drop out where our op runs (causal, GQA,
    non-contiguous heads, compiled), and our op has no dropout. Each segment is
    padded to the longest, padded keys are masked out and padded query rows
    dropped, so every segment sees exactly its own keys: SDPA's semantics per
    segment, dropout included, traceable with symbolic layouts. Layout checks
    are those of our op, so a model behaves the same in train and eval mode.
    """
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    _check_layouts(q, k, v, is_causal)

    def rows(nt: NestedTensor, longest):  # token t of segment b -> row b * longest + (t - offsets[b])
        cu = nt._offsets
        tokens = torch.arange(nt.values().size(0), device=cu.device)
        segment = torch.searchsorted(cu, tokens, right=True) - 1
        return segment * longest + (tokens - cu[segment])

    def padded(nt: NestedTensor):  # [B, j, H, D] -> [B, H, S, D], S its longest segment
        n = nt._maybe_max_seqlen
        if n is None:
            n = int((nt._offsets[1:] - nt._offsets[:-1]).max()) if nt.size(0) else 0
        values = nt.values()
        # index_copy / index_select, not the jagged<->padded ops: those have no derivative.
        dense = values.new_zeros((nt.size(0) * n, *values.shape[1:])).index_copy(0, rows(nt, n), values)
        return dense.unflatten(0, (nt.size(0), n)).transpose(1, 2), n

    qd, sq = padded(q)
    kd, sk = padded(k)
    vd, _ = padded(v)
    lengths_k = k._offsets[1:] - k._offsets[:-1]
    mask = torch.arange(sk, device=kd.device)[None, :] < lengths_k[:, None]  # [B, Sk]
    mask = mask[:, None, None, :]
    if is_causal:  # top-left per segment, as SDPA (equal lengths enforced above)
        mask = mask & torch.ones(sq, sk, dtype=torch.bool, device=kd.device).tril()
    out = F.scaled_dot_product_attention(
        qd, kd, vd, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    # A row that sees no key is NaN or zero depending on the SDPA backend; ours is zero.
    out = torch.where(mask.any(-1, keepdim=True), out, 0.0)
    cu_q = q._offsets
    packed = out.transpose(1, 2).flatten(0, 1).index_select(0, rows(q, sq))  # [Tq, Hq, D]
    out = nested_view_from_values_offsets_lengths(
        packed, cu_q, None,
        min_seqlen=q._maybe_min_seqlen, max_seqlen=q._maybe_max_seqlen,
    )
    return out.transpose(1, 2)


_KV_MISMATCH = "key and value nested tensors have different per-sample lengths"
_CAUSAL_MISMATCH = (
    "F.scaled_dot_product_attention(is_causal=True) got query and key nested tensors "
    "with different per-sample lengths. SDPA aligns the causal mask top-left, varlen "
    "kernels (flash, stock NJT SDPA on CUDA, ragged_compile) bottom-right; they agree "
    "only when every query segment is as long as its key segment. Use is_causal=False "
    "with an explicit mask on padded tensors, or equal lengths"
)


# It reads device offsets on the host: never capture it in a CUDA graph.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ragged_compile::check_same_segments", mutates_args=(), tags=_TAGS)
def _check_same_segments(cu_a: Tensor, cu_b: Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` unless two offset tensors are equal.

    Needed only when two NJTs carry different offsets tensors (e.g. built
    separately): their equality is a property of the values. On CUDA this reads
    both tensors (a sync); share one offsets tensor between q, k and v to avoid it.
    """
    if cu_a.shape != cu_b.shape or not torch.equal(cu_a, cu_b.to(cu_a.dtype)):
        raise ValueError(f"ragged_compile: {message}")


@_check_same_segments.register_fake
def _check_same_segments_fake(cu_a, cu_b, message):
    return None


# It returns nothing: without this, dead-code elimination would drop the check.
torch.fx.node.has_side_effect(torch.ops.ragged_compile.check_same_segments.default)
