"""SDPA over nested jagged tensors (NJT) on ragged_compile's op, and :func:`enable`.

Hook level: ``F.scaled_dot_product_attention`` on NJTs reaches
``NestedTensor.__torch_function__`` -> ``torch.nested._internal.ops.jagged_torch_function``,
which looks up ``jagged_scaled_dot_product_attention`` as a module global on every
call. :func:`enable` swaps that global for :func:`_ragged_sdpa`. It is the one
level that sees NJT SDPA eagerly and under ``torch.compile`` on every device.
Dynamo records NJT SDPA as a single graph node and calls the handler to
propagate fake NJTs; AOTAutograd calls it again while tracing, so our op (not
flash or math) is what lands in the aten graph Inductor compiles. Anything
later is too late on CPU: the stock handler picks MATH, whose
``_nested_tensor_from_tensor_list`` has no fake kernel, so compiling fails before
Inductor runs. A ``TorchFunctionMode`` instead makes Dynamo trace every NJT
method through the mode, which breaks on NJT's own ``super()`` calls.

Calls the op cannot represent go to the handler that was installed before us,
so stock behaviour (including stock errors) is kept for them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import weakref
from collections.abc import Iterator

import torch
import torch.nested._internal.ops as _njt_ops
from torch import Tensor
from torch._inductor import config as _inductor_config
from torch.nested._internal.nested_tensor import (
    NestedTensor,
    nested_view_from_values_offsets_lengths,
)

from . import ops as _ops  # noqa: F401  (registers torch.ops.ragged_compile.ragged_attention)
from .ops import unsupported_reason
from .passes import RaggedAttentionPasses, ragged_attention_passes
from .train_ops import attention, training_unsupported_reason

__all__ = ["enable", "is_enabled"]

log = logging.getLogger("ragged_compile")

# The handler checks it too, for anyone who kept a reference to the handler.
_ENABLED = False
# The handler we replaced; every call we do not take goes there.
_previous = _njt_ops.jagged_scaled_dot_product_attention


def is_enabled() -> bool:
    """Whether NJT SDPA currently runs on ragged_compile's op."""
    return _ENABLED


@contextlib.contextmanager
def enable() -> Iterator[None]:
    """Run NJT ``F.scaled_dot_product_attention`` and varlen attention on our op.

    Inside the context, eager or compiled:

    * SDPA over NJTs in the ``[B, H, j, D]`` layout (``.transpose(1, 2)`` of the
      jagged ``[B, j, H, D]``) calls ``ragged_compile::ragged_attention`` on the
      packed values and the NJT offsets as they are: self- and cross-attention,
      ``is_causal`` (where it means what SDPA means) and ``enable_gqa``.
    * Inductor's post-grad passes rewrite varlen flash / efficient attention
      and ``varlen_attn`` nodes (see :mod:`ragged_compile.passes`).

    Everything else keeps stock behaviour. On exit the NJT SDPA handler, the
    Inductor pass slot and our flag are restored exactly (process-wide, not
    thread-safe, like any config patch). Like a config patch, it acts when code
    is traced: Dynamo does not guard on it, so a function compiled inside keeps
    the rewrite when called outside (same results, our op) and one compiled
    before keeps stock code until it recompiles. :func:`ragged_compile.compile`
    enters this context around every call, so it never mixes the two.
    """
    global _ENABLED, _previous
    saved = (_ENABLED, _previous, _njt_ops.jagged_scaled_dot_product_attention)
    user_pass = _inductor_config.post_grad_custom_post_pass
    ours = user_pass
    if not isinstance(ours, RaggedAttentionPasses):
        ours = ragged_attention_passes(user_pass, extra_uuid=_handler_uuid())
    if saved[2] is not _ragged_sdpa:
        _previous = saved[2]
    # Plain set/restore, as inductor_config.patch() does, at a fraction of its
    # cost: compile() enters this context on every call.
    _inductor_config.post_grad_custom_post_pass = ours
    _njt_ops.jagged_scaled_dot_product_attention = _ragged_sdpa
    _ENABLED = True
    try:
        yield
    finally:
        _ENABLED, _previous, _njt_ops.jagged_scaled_dot_product_attention = saved
        _inductor_config.post_grad_custom_post_pass = user_pass


@functools.lru_cache(1)
def _handler_uuid() -> str:
    # AOTAutograd's cache key holds the Dynamo graph (one NJT SDPA node), not
    # what this handler traced it into; our pass uuid carries that instead.
    from .passes import _hash_source

    return _hash_source(sys.modules[__name__])


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
        seen = _seen
    else:
        seen = set()
    if msg not in seen:
        seen.add(msg)
        log.log(level, "ragged_compile: %s", msg)
    return True


_seen: set[str] = set()  # eager warnings: once per process
_seen_per_compile: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stock_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> str | None:
    """Why this SDPA call must stay stock, or None. Metadata only: safe under Dynamo."""
    if not all(isinstance(t, NestedTensor) for t in (query, key, value)):
        return "q, k and v are not all nested jagged tensors"
    if attn_mask is not None:
        return "attn_mask is given (NJT SDPA supports no mask)"
    if dropout_p > 0.0:
        return f"dropout_p={dropout_p} (our op has no dropout)"
    if (
        query.device.type != "cpu"
        and torch.is_grad_enabled()
        and (query.requires_grad or key.requires_grad or value.requires_grad)
    ):
        # On CUDA the op trains with fused kernels (train_ops.py) where they take
        # the call; elsewhere stock NJT SDPA has a fused backward and ours would be
        # the reference kernel. On CPU stock has no causal, no GQA and no compile,
        # so training there runs on our op.
        why = training_unsupported_reason(query.device, query.dtype, query.size(-1))
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
        return f"q has {hq} heads and k/v {hk} without a valid enable_gqa"
    return None


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
    reason = None if _ENABLED else "ragged_compile is not enabled"
    if reason is None:
        reason = _stock_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        # Users who expect our op here (missing transpose, grad mode) get a warning.
        warn = "transpose" in reason or "require grad" in reason
        _note(logging.WARNING if warn else logging.DEBUG, f"stock NJT SDPA: {reason}")
        return _previous(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    # [B, H, j, D] -> [B, j, H, D], whose values are the packed [T, H, D] tensor.
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    cu_q, cu_k = q._offsets, k._offsets
    if v._offsets is not cu_k:
        torch.ops.ragged_compile.check_same_segments(cu_k, v._offsets, _KV_MISMATCH)
    if is_causal and cu_k is not cu_q:
        torch.ops.ragged_compile.check_same_segments(cu_q, cu_k, _CAUSAL_MISMATCH)
    head_dim = q.size(-1)
    scale = float(scale) if scale is not None else head_dim**-0.5
    _note(
        logging.DEBUG,
        f"NJT SDPA -> ragged_attention (causal={bool(is_causal)}, heads "
        f"{query.size(1)}/{key.size(1)}, {'self' if cu_q is cu_k else 'cross'}-attention)",
    )
    out = attention(q.values(), k.values(), v.values(), cu_q, cu_k, bool(is_causal), scale)
    out = nested_view_from_values_offsets_lengths(
        out, cu_q, None, min_seqlen=q._maybe_min_seqlen, max_seqlen=q._maybe_max_seqlen
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
def _(cu_a, cu_b, message):
    return None


# It returns nothing: without this, dead-code elimination would drop the check.
torch.fx.node.has_side_effect(torch.ops.ragged_compile.check_same_segments.default)
