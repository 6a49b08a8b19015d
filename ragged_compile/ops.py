"""The ragged attention op: public function, custom op, fake kernel, device kernels."""

from __future__ import annotations


import torch

from .backends.cpu import cpu_attention, cpu_attention_backward
from .backends.cpu import takes as cpu_takes
from .reference import reference_attention, reference_attention_backward
from .runtime import get_runtime
from .train_ops import attention as _dispatch  # inference op, or the training pair (train_ops.py)
from .validation import SUPPORTED_DTYPES, check_cu_seqlens_values, check_inputs, check_meta, check_values, debug_checks

__all__ = ["ragged_attention", "SUPPORTED_DTYPES", "unsupported_reason"]


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim) -> str | None:
    """Why a rewrite should leave an attention call to stock PyTorch, or None.

    On CPU the op takes every supported dtype (the reference kernel is what CPU
    runs anyway). On CUDA it must reach FlashInfer: stock fp32 or head_dim > 256
    attention there is a fused kernel, and ours would be the reference kernel.
    """
    from .backends import flashinfer as fi

    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported"
    if device.type == "cuda":
        if not isinstance(head_dim, int):
            return "head dim is symbolic"
        if not fi.supports(dtype, head_dim):
            return (
                f"{dtype} with head_dim {head_dim} on CUDA would run the reference kernel "
                f"(FlashInfer takes fp16/bf16 and head_dim <= 256)"
            )
    return None


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    r"""Attention over packed variable-length segments, without padding.

    Shape legend:
        ============  ===================================================
        n             number of segments (sequences) in the batch
        Tq, Tk        packed tokens of q and of k/v (sum of segment lengths)
        Hq, Hkv       query heads and key/value heads; ``Hq % Hkv == 0``
        D             head dimension
        ============  ===================================================

    Args:
        q: ``[Tq, Hq, D]`` queries, segment after segment.
        k, v: ``[Tk, Hkv, D]`` keys and values, packed the same way.
        cu_seqlens_q: ``[n + 1]`` int32/int64 offsets into q: ``0``,
            non-decreasing, last entry ``Tq``. Segment ``i`` is
            ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``.
        cu_seqlens_k: ``[n + 1]`` offsets into k/v; ``None`` means self-attention
            over q's layout. Segment ``i`` of q attends only segment ``i`` of k/v.
        max_seqlen_q, max_seqlen_k: optional upper bounds on segment lengths,
            accepted for drop-in use where ``varlen_attn``-style calls pass them.
            They are checked when offsets are checked and never change the result.
        causal: mask aligned **bottom-right** (as FlashAttention and FlashInfer):
            query row ``i`` of a segment with ``Lq`` queries and ``Lk`` keys sees
            keys ``j <= i + Lk - Lq``. For ``Lq == Lk`` this is
            ``F.scaled_dot_product_attention(..., is_causal=True)``; for
            ``Lq != Lk`` SDPA aligns top-left, and the rewrites never hand such
            a call to this op.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``[Tq, Hq, D]`` in q's dtype. A query row that sees no key (empty k/v
        segment, or above the causal diagonal when ``Lq > Lk``) is zero, never
        NaN. Zero-length segments are valid on either side; ``n = 0`` returns
        an empty result.

    Inputs of any strides are accepted; kernels that need a contiguous last
    dimension copy. GQA/MQA: query head ``h`` uses k/v head ``h // (Hq // Hkv)``
    (as ``enable_gqa=True`` in SDPA). Backward: on CUDA (fp16/bf16, head_dim
    <= 256, SM80+) a grad-requiring call runs FlashInfer's forward with its LSE
    and PyTorch's FlashAttention-2 varlen backward (see train_ops.py); elsewhere
    exact gradients from the reference kernel in float32 (on CUDA with a
    warning, once).

    Offsets are checked (``cu[0] == 0``, non-decreasing, ``cu[-1] == T``) on
    host copies: always for CPU tensors, at plan time on CUDA, and on every call
    under ``RAGGED_COMPILE_DEBUG=1``, since reading device offsets costs a sync.
    """
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
        if max_seqlen_k is None:
            max_seqlen_k = max_seqlen_q
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    if type(causal).__module__ == "numpy" and type(causal).__name__ == "bool":
        causal = bool(causal)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__module__}.{type(causal).__name__}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if max_seqlen_q is not None or max_seqlen_k is not None:
        if not torch.compiler.is_compiling() and (cu_seqlens_q.device.type == "cpu" or debug_checks()):
            check_cu_seqlens_values(cu_seqlens_q, q.shape[0], "cu_seqlens_q", max_seqlen_q)
            check_cu_seqlens_values(cu_seqlens_k, k.shape[0], "cu_seqlens_k", max_seqlen_k)
    if torch.compiler.is_compiling() or torch._C._functorch.maybe_current_level() is None:
        # Autograd and AOTAutograd differentiate the op (or, for CUDA training,
        # the LSE pair of train_ops.py) through its registered autograd.
        return _dispatch(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, float(scale))
    # Under a torch.func transform (grad, vjp, jacrev, vmap).
    return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, float(scale))


# TorchScript cannot compile the function above (keyword-only arguments, Python
# checks); torch.jit.script raises this instead of a parser error about line 46.
setattr(
    ragged_attention,
    "__script_unsupported",
    "ragged_compile.ragged_attention cannot be compiled by TorchScript (keyword-only "
    "arguments and Python-side argument checks). In scripted code call the op with every "
    "argument given: torch.ops.ragged_compile.ragged_attention(q, k, v, cu_seqlens_q, "
    "cu_seqlens_k, causal, scale), with cu_seqlens_k = cu_seqlens_q for self-attention and "
    "scale = head_dim ** -0.5 by default; or use torch.compile / ragged_compile.compile "
    "instead of torch.jit.script",
)


# cudagraph_unsafe: the CUDA kernel looks its plan up on the host at every call.
# A graph captured by torch.compile(mode="reduce-overhead") would freeze the plan
# of the capture-time layout and replay it for any other layout of the same
# shapes; with the tag, Inductor partitions the graph around this op instead.
# CUDA-graph replay across layouts is the runtime's job (cudagraph.py).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ragged_compile::ragged_attention", mutates_args=(), tags=_TAGS)
def _ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    # CPU runs the fused-kernel path (backends/cpu.py); other devices without a
    # kernel of their own (MPS, ...), float64 and RAGGED_COMPILE_REFERENCE=1 run the reference.
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    check_values(q, k, cu_seqlens_q, cu_seqlens_k)
    if cpu_takes(q):
        return cpu_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)


@_ragged_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return q.new_empty(q.shape)


@torch.library.custom_op("ragged_compile::ragged_attention_backward", mutates_args=(), tags=_TAGS)
def _ragged_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # One opaque op so AOTAutograd traces the backward graph without reading
    # offsets: the fused CPU kernel on CPU, the reference's exact gradients elsewhere.
    if cpu_takes(q):
        return cpu_attention_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return reference_attention_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)


@_ragged_attention_backward.register_fake
def _(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad_out):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _AttentionBackward.apply(grad_out, q, k, v, cu_q, cu_k, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


_ragged_attention.register_autograd(_backward, setup_context=_setup_context)

_NO_DOUBLE_BACKWARD = (
    "ragged_compile.ragged_attention has no double backward: its gradients are computed by "
    "an exact reference kernel that is not itself differentiable, so gradients of gradients "
    "(backward through a graph made with create_graph=True, torch.func.hessian, jacrev of "
    "grad) are not available. Take first-order gradients only (create_graph=False), or "
    "compute higher-order terms with a dense attention such as "
    "torch.nn.functional.scaled_dot_product_attention per segment"
)
_NO_FORWARD_AD = (
    "ragged_compile.ragged_attention has no forward-mode AD (torch.func.jvp, jacfwd, hessian, "
    "torch.autograd.forward_ad); use reverse mode (torch.func.vjp, jacrev, grad) instead"
)


def _vmap_per_element(fn, info, in_dims, *args):
    """A vmap rule that calls ``fn`` once per batch element: every call may carry
    its own layout, and the kernels take one layout per call."""
    outs = []
    for i in range(info.batch_size):
        outs.append(fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))))
    if isinstance(outs[0], tuple):
        return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
    return torch.stack(outs), 0


class _Attention(torch.autograd.Function):
    """The op with the op's own backward, as an autograd.Function with
    setup_context and a vmap rule, which torch.func requires and the Function
    torch.library generates for register_autograd lacks (torch 2.13)."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, causal, scale):
        return torch.ops.ragged_compile.ragged_attention(q, k, v, cu_q, cu_k, causal, scale)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_FORWARD_AD)

    @staticmethod
    def vmap(info, in_dims, q, k, v, cu_q, cu_k, causal, scale):
        return _vmap_per_element(
            lambda *a: _Attention.apply(*a, causal, scale), info, in_dims[:5], q, k, v, cu_q, cu_k
        )


class _AttentionBackward(torch.autograd.Function):
    """The backward op; differentiating it raises what the user can do instead."""

    @staticmethod
    def forward(grad_out, q, k, v, cu_q, cu_k, causal, scale):
        return torch.ops.ragged_compile.ragged_attention_backward(
            grad_out, q, k, v, cu_q, cu_k, causal, scale
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_DOUBLE_BACKWARD)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_FORWARD_AD)

    @staticmethod
    def vmap(info, in_dims, grad_out, q, k, v, cu_q, cu_k, causal, scale):
        return _vmap_per_element(
            lambda *a: _AttentionBackward.apply(*a, causal, scale),
            info, in_dims[:6], grad_out, q, k, v, cu_q, cu_k,
        )


@_ragged_attention.register_kernel("cuda")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    # FlashInfer through the runtime: it finds the plan of this step's layout
    # without host work (see runtime.py), or runs the reference and says why.
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return get_runtime(q.device).attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
