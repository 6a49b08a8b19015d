"""The ragged attention op family: the public function, its custom ops, their fake
kernels, device kernels and autograd.

===============================================  ===================================
op                                               what it is
===============================================  ===================================
``ragged_attention(q, k, v, cu_q, cu_k,          the inference op: no LSE; its
causal, scale, *V) -> out``                      backward is ``ragged_attention_backward``
``ragged_attention_backward(grad_out, q, k, v,   exact gradients without a saved LSE:
cu_q, cu_k, causal, scale, *V) -> (dq, dk, dv,   the CPU kernel's, or the reference's
dsinks)``
``ragged_attention_lse(q, k, v, cu_q, cu_k,      the training forward: also the LSE (fp32
causal, scale, *V) -> (out, lse, max_lens)``     ``[Hq, Tq]``, natural log, ``+inf`` for
                                                 rows that see no key: aten's layout) and
                                                 ``max_lens``, a CPU int64 ``[max_q, max_k,
                                                 pairs]`` from the host layout, so the
                                                 backward needs no device-to-host sync
``ragged_attention_lse_backward(grad_out, q, k,  the fused backward: flash-attn-4 or
v, out, lse, cu_q, cu_k, max_lens, causal,       FlashAttention-2 on CUDA, the CPU
scale, *V) -> (dq, dk, dv, dsinks)``             kernel's on CPU (reusing the LSE)
===============================================  ===================================

``*V`` are the variants, last and with defaults (a call without them is plain
attention): ``window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
sinks: Tensor? = None`` (see :func:`ragged_attention`). ``dsinks`` is ``[Hq]`` in
the sinks' dtype, or an empty tensor for a call without sinks. With sinks the
LSE includes them. Which kernel runs a variant is ``select.forward_kernel``'s
answer (on CUDA: FlashAttention-2 for windows, FlashInfer for softcap and sinks).

:func:`attention` routes a call to the pair or the inference op, and the
kernels below ask ``backends/select.py`` which kernel runs; this module only
validates and dispatches. It mirrors ``torch/nn/attention/varlen.py``: a public
function with argument checks, custom ops with fake kernels, a backward op with
a fake kernel, ``register_autograd``.
"""

from __future__ import annotations

import warnings

import torch

from .backends import cpu as cpu_kernel
from .backends import fa4_backward, flash_backward, segment_backward, select
from .reference import (
    reference_attention, reference_attention_backward, reference_dropout_attention, reference_dropout_backward,
    reference_lse,
)
from .runtime import get_runtime
from .steps import fast_attention, repeated_training_call, run_repeated_training
from .validation import (
    check_cu_seqlens_values, check_dropout, check_inputs, check_meta, check_values, check_variants,
    check_variants_meta, debug_checks,
)

__all__ = ["ragged_attention", "attention", "autocast_inputs"]


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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
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
        window_size: ``(left, right)``, a sliding window in the same bottom-right
            coordinates: row ``i`` sees key ``j`` when ``i' - left <= j <= i' + right``
            with ``i' = i + Lk - Lq``; ``-1`` is unbounded, ``causal=True`` caps
            ``right`` at 0. transformers' ``sliding_window=W`` is ``(W - 1, 0)``
            causal, ``(W - 1, W - 1)`` bidirectional (ModernBERT passes ``W`` =
            half its ``local_attention`` + 1).
        softcap: ``> 0`` soft-caps the scaled scores to ``softcap * tanh(s / softcap)``
            before the softmax (Gemma2's ``attn_logit_softcapping``); 0 is off.
        sinks: ``[Hq]`` per-head logits that join every row's softmax denominator
            and add no value (gpt-oss' ``sinks``); differentiable. A row that sees
            no key is still zero.

        dropout_p: attention dropout, as SDPA's ``dropout_p``: each probability is
            zeroed with probability ``dropout_p`` and the kept ones scaled by
            ``1 / (1 - dropout_p)``, whenever it is > 0 (pass 0 outside
            training). Each segment's mask is independent of the others. On CUDA
            PyTorch's FlashAttention-2 draws it from CUDA's generator (fp16/bf16,
            head dim <= 256, SM80+), elsewhere the reference kernel from the CPU
            generator's seed; ``torch.manual_seed`` reproduces either. Not with a
            window, softcap or sinks.

    Returns:
        ``[Tq, Hq, D]`` in q's dtype. A query row that sees no key (empty k/v
        segment, or above the causal diagonal when ``Lq > Lk``) is zero, never
        NaN. Zero-length segments are valid on either side; ``n = 0`` returns
        an empty result.

    Inputs of any strides are accepted; kernels that need a contiguous last
    dimension copy. GQA/MQA: query head ``h`` uses k/v head ``h // (Hq // Hkv)``
    (as ``enable_gqa=True`` in SDPA). Backward: on CUDA (fp16/bf16, head_dim
    <= 256, SM80+) a grad-requiring call runs a fused forward with its LSE
    (FlashInfer's, or on small layouts PyTorch's FlashAttention-2's, which needs
    no plan) and a fused backward (flash-attn-4 on SM90 where installed, else PyTorch's
    FlashAttention-2); on CPU the fused CPU kernel's; elsewhere exact gradients
    from the reference kernel (on CUDA with a warning, once). Which kernel runs
    a call is decided in ``backends/select.py``. Variants: windows and sinks run
    the fused CPU kernel, softcap the reference on CPU; on CUDA windows run
    PyTorch's FlashAttention-2 forward and backward, softcap FlashInfer's forward
    and its LSE (gradients: segment_backward.py's Triton backward), sinks
    rescale a fused forward and train on FlashAttention-2's backward; softcap
    with sinks runs the reference kernel, said once at WARNING.

    Offsets are checked (``cu[0] == 0``, non-decreasing, ``cu[-1] == T``) on
    host copies: always for CPU tensors, at plan time on CUDA, and on every call
    under ``RAGGED_COMPILE_DEBUG=1``, since reading device offsets costs a sync.
    """
    if (
        not torch.compiler.is_compiling() and type(q) is _Tensor and q.is_cuda and sinks is None
        and max_seqlen_q is None and max_seqlen_k is None and (causal is False or causal is True)
        and (scale is None or type(scale) is float) and type(window_size) is tuple and window_size == (-1, -1)
        and type(softcap) is float and softcap == 0.0 and type(dropout_p) is float and dropout_p == 0.0
        and not torch.is_autocast_enabled("cuda") and not debug_checks() and _undispatched(q, k, v)
    ):
        # The layers of a forward after its first: see steps.fast_attention and
        # steps.repeated_training_call. Every check the first call passed holds.
        cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        call_scale = q.shape[-1] ** -0.5 if scale is None else scale
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            hit = repeated_training_call(q, k, v, cu_seqlens_q, cu_k, causal, call_scale)
            if hit is not None:
                return _repeated_training(hit, q, k, v, cu_seqlens_q, cu_k, causal, call_scale)
        else:
            out = fast_attention(q, k, v, cu_seqlens_q, cu_k, causal, call_scale)
            if out is not None:
                return out
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
        if max_seqlen_k is None:
            max_seqlen_k = max_seqlen_q
    q, k, v = autocast_inputs(q, k, v)
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    if type(causal).__module__ == "numpy" and type(causal).__name__ == "bool":
        causal = bool(causal)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__module__}.{type(causal).__name__}")
    if scale is None:
        head_dim = q.shape[-1]
        if torch.jit.is_tracing():  # a traced size is a 0-d tensor; the trace keeps this head dim's scale
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                head_dim = int(head_dim)
        scale = head_dim ** -0.5
    left, right, softcap = check_variants(q, window_size, softcap, sinks)
    if causal:
        right = -1  # causal caps right at 0 itself
    elif right == 0:
        causal, right = True, -1  # a window with right = 0 is causal (the fast kernels' flag)
    if max_seqlen_q is not None or max_seqlen_k is not None:
        if not torch.compiler.is_compiling() and (cu_seqlens_q.device.type == "cpu" or debug_checks()):
            check_cu_seqlens_values(cu_seqlens_q, q.shape[0], "cu_seqlens_q", max_seqlen_q)
            check_cu_seqlens_values(cu_seqlens_k, k.shape[0], "cu_seqlens_k", max_seqlen_k)
    if dropout_p != 0.0:
        dropout_p = check_dropout(dropout_p, (left, right) != (-1, -1) or bool(softcap) or sinks is not None)
    if not torch._C._are_functorch_transforms_active():  # a constant to Dynamo
        # Autograd and AOTAutograd differentiate the op (or the LSE pair) through
        # its registered autograd.
        return attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, float(scale), checked=True,
            window_size=(left, right), softcap=softcap, sinks=sinks, dropout_p=dropout_p,
        )
    if dropout_p:
        raise RuntimeError(
            "ragged_attention with dropout_p > 0 under a torch.func transform is not supported (its random "
            "mask is drawn inside the kernel); call it outside the transform, or with dropout_p=0"
        )
    if torch.compiler.is_compiling() and _differentiating_transform():
        raise RuntimeError(_NO_COMPILED_FUNC_GRAD)
    # Under a torch.func transform (grad, vjp, jacrev, vmap): the Function
    # torch.library makes for register_autograd has no setup_context, which
    # functorch needs.
    return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, float(scale), left, right, softcap, sinks)


# TorchScript cannot compile the function above (keyword-only arguments, Python
# checks); torch.jit.script raises this instead of a parser error about line 46.
setattr(
    ragged_attention,
    "__script_unsupported",
    "ragged_compile.ragged_attention cannot be compiled by TorchScript (keyword-only "
    "arguments and Python-side argument checks). In scripted code call the op with every "
    "argument given: torch.ops.ragged_compile.ragged_attention(q, k, v, cu_seqlens_q, "
    "cu_seqlens_k, causal, scale) (then window_left, window_right, softcap, sinks), with cu_seqlens_k = cu_seqlens_q for self-attention and "
    "scale = head_dim ** -0.5 by default; or use torch.compile / ragged_compile.compile "
    "instead of torch.jit.script",
)


def attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, *, checked: bool = False,
    window_size=(-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
) -> torch.Tensor:
    """The op a call runs: the LSE pair when it needs gradients and a kernel of its
    own trains it (``select.trains_with_lse``), else the inference op.

    Inference (no grad mode, or nothing requires grad) never pays for the LSE.
    An eager CUDA call that nothing could intercept (no torch.compile trace, no
    dispatch or function mode, no profiler, plain tensors) runs the same kernels
    without the dispatcher, whose custom-op and autograd layers cost more host
    time than the kernel launch on small batches. ``checked``: the caller ran
    ``check_inputs`` (and ``check_variants``). Callers cast for autocast first
    (:func:`autocast_inputs`), as the checks need the cast dtypes. Variant calls
    (``window_size``, ``softcap``, ``sinks``) always go through the dispatcher;
    dropout (its own pair, which draws the mask and hands the backward its state)
    too, except where such an eager call runs FlashAttention-2 (see
    :func:`_eager_dropout`).
    """
    if dropout_p:
        if not checked:
            check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
            has_variant = sinks is not None or bool(softcap) or tuple(window_size) != (-1, -1)
            dropout_p = check_dropout(dropout_p, has_variant)
        if q.is_cuda and _undispatched(q, k, v):
            out = _eager_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, float(dropout_p))
            if out is not None:
                return out
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, float(dropout_p))
        return torch.ops.ragged_compile.ragged_attention_dropout(*args)[0]
    if sinks is not None or softcap or window_size[0] >= 0 or window_size[1] >= 0:
        return _variant_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, checked, window_size, softcap, sinks)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    direct = q.is_cuda and _undispatched(q, k, v)
    if direct and not checked:
        check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    if grad:
        if select.trains_with_lse(q.device, q.dtype, q.shape[-1]):
            if direct:
                return _EagerTraining.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
            out, _, _ = torch.ops.ragged_compile.ragged_attention_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
            return out
    elif direct:
        return get_runtime(q.device).attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return torch.ops.ragged_compile.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)


def _variant_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, checked, window_size, softcap, sinks):
    if not checked:
        check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
        window_size = check_variants(q, window_size, softcap, sinks)[:2]
    left, right = window_size
    variant = select.variant(causal, window_size, softcap, sinks)
    needs = (q, k, v) if sinks is None else (q, k, v, sinks)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in needs)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, left, right, float(softcap), sinks)
    if grad and select.trains_with_lse(q.device, q.dtype, q.shape[-1], variant):
        return torch.ops.ragged_compile.ragged_attention_lse(*args)[0]
    return torch.ops.ragged_compile.ragged_attention(*args)


def _variants(window_left, window_right, softcap, sinks) -> dict:
    """The reference's and the CPU kernel's keywords for an op's variant arguments."""
    return dict(window_size=(window_left, window_right), softcap=softcap, sinks=sinks)


def _with_dsinks(grads, q) -> tuple:
    """(dq, dk, dv) from a kernel, plus dsinks (empty for a call without sinks)."""
    return tuple(grads) if len(grads) == 4 else tuple(grads) + (q.new_empty(0),)


def _dsinks_fake(q, sinks):
    return q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)


_Tensor = torch.Tensor


def autocast_inputs(q, k, v):
    """Under ``torch.autocast`` for q's device, q, k and v in its dtype, as SDPA (a
    lower-precision op of autocast's) takes them; otherwise unchanged. Plain or
    nested tensors."""
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))
    return q, k, v


def _undispatched(q, k, v) -> bool:
    """Whether running the kernels directly is exactly what the dispatcher would do:
    eager, plain tensors, and nothing that watches or rewrites ops."""
    return (
        type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and not torch.autograd._profiler_enabled()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._is_tracing()  # a trace must record the op, which checks at every run
    )


# cudagraph_unsafe: the CUDA kernels look their plan up on the host at every call.
# A graph captured by torch.compile(mode="reduce-overhead") would freeze the plan
# of the capture-time layout and replay it for any other layout of the same
# shapes; with the tag, Inductor partitions the graph around these ops instead.
# CUDA-graph replay across layouts is the runtime's job (cudagraph.py).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


# -- the inference op ------------------------------------------------------------------


@torch.library.custom_op("ragged_compile::ragged_attention", mutates_args=(), tags=_TAGS)
def _ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # Every device but CUDA: the fused CPU kernel or the reference (select.forward_kernel).
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    check_values(q, k, cu_seqlens_q, cu_seqlens_k)
    variant = select.variant(causal, (window_left, window_right), softcap, sinks)
    if select.forward_kernel(q.device, q.dtype, q.shape[-1], variant) == "cpu":
        window = (window_left, window_right)
        return cpu_kernel.cpu_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_size=window, sinks=sinks)
    return reference_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, **_variants(window_left, window_right, softcap, sinks)
    )


@_ragged_attention.register_fake
def _ragged_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left=-1, window_right=-1,
                           softcap=0.0, sinks=None):
    check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_variants_meta(q, window_left, window_right, softcap, sinks)
    return q.new_empty(q.shape)


@_ragged_attention.register_kernel("cuda")
def _ragged_attention_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left=-1, window_right=-1,
                           softcap=0.0, sinks=None):
    # FlashInfer through the runtime: it finds the plan of this step's layout
    # without host work (steps.py), or runs the reference and says why; small
    # layouts run PyTorch's FlashAttention-2, which needs no plan
    # (select.cuda_backend). Windows:
    # FlashAttention-2 with the step's host lengths; softcap: FlashInfer, capping
    # at plan time; sinks rescale a fused forward's output by its LSE (the
    # reference where select.cuda_runs_reference says).
    if _plain(window_left, window_right, softcap, sinks):
        out = fast_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        if out is not None:
            return out
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    window = (window_left, window_right)
    variant = select.variant(causal, window, softcap, sinks)
    if select.cuda_runs_reference(q.device, q.dtype, q.shape[-1], variant, causal=causal, window=window):
        return reference_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, **_variants(window_left, window_right, softcap, sinks)
        )
    if sinks is not None:  # a fused forward's output and LSE, rescaled
        out, lse, _ = get_runtime(q.device).attention_with_lse(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, _window(variant, window), trains=False
        )
        return flash_backward.with_sinks(out, lse, sinks)[0]
    return get_runtime(q.device).attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, _window(variant, window), softcap
    )


def _plain(window_left, window_right, softcap, sinks) -> bool:
    """Whether a dispatched CUDA call may take the repeat lookup of eager calls
    (steps.fast_attention, steps.repeated_training_call): no variant, no debug
    checks. A compiled graph calls the op through the dispatcher at every layer;
    its layers after the first repeat the first's offsets and shapes, so every
    check that call passed holds."""
    return window_left == -1 and window_right == -1 and not softcap and sinks is None and not debug_checks()


def _window(variant, window: tuple[int, int]) -> tuple[int, int]:
    """The window a fast CUDA kernel takes: (-1, -1) unless the call is windowed."""
    return window if select.WINDOW in variant else (-1, -1)


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
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # One opaque op so AOTAutograd traces the backward graph without reading
    # offsets: the fused CPU kernel on CPU, the reference's exact gradients elsewhere.
    args = (grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return _exact_backward(*args, window_left, window_right, softcap, sinks)


def _exact_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, softcap,
                    sinks, out=None, lse=None):
    """(dq, dk, dv, dsinks) from the CPU kernel where it ran the forward (reusing its
    ``out`` and ``lse`` [Hq, Tq] where given), else from the reference."""
    variant = select.variant(causal, (window_left, window_right), softcap, sinks)
    if select.forward_kernel(q.device, q.dtype, q.shape[-1], variant) == "cpu":
        grads = cpu_kernel.cpu_attention_backward(
            grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, out=out,
            lse=None if lse is None else lse.t(), window_size=(window_left, window_right), sinks=sinks,
        )
    else:
        grads = reference_attention_backward(
            grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
            **_variants(window_left, window_right, softcap, sinks),
        )
    return _with_dsinks(grads, q)


@_ragged_attention_backward.register_fake
def _ragged_attention_backward_fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left=-1,
                                    window_right=-1, softcap=0.0, sinks=None):
    check_variants_meta(q, window_left, window_right, softcap, sinks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks_fake(q, sinks)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, softcap, sinks = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.causal, ctx.scale, ctx.variants = causal, scale, (window_left, window_right, softcap)


def _backward(ctx, grad_out):
    q, k, v, cu_q, cu_k, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = _AttentionBackward.apply(grad_out, q, k, v, cu_q, cu_k, ctx.causal, ctx.scale, *ctx.variants, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, (None if sinks is None else dsinks)


_ragged_attention.register_autograd(_backward, setup_context=_setup_context)


# -- the training pair: forward with its LSE, fused backward ----------------------------


@torch.library.custom_op("ragged_compile::ragged_attention_lse", mutates_args=(), tags=_TAGS)
def _ragged_attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Every device but CUDA: the fused CPU kernel, or the reference and an exact LSE.
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    variant = select.variant(causal, (window_left, window_right), softcap, sinks)
    if select.forward_kernel(q.device, q.dtype, q.shape[-1], variant) == "cpu":
        max_lens = _max_lens(q, k, cu_seqlens_q, cu_seqlens_k, pairs=True)
        out, lse = cpu_kernel.cpu_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, return_lse=True,
            window_size=(window_left, window_right), sinks=sinks,
        )
        return out, lse.t().contiguous(), max_lens  # [Tq, Hq] -> the backward's [Hq, Tq]
    return _reference_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, softcap, sinks)


def _max_lens(q, k, cu_seqlens_q, cu_seqlens_k, pairs: bool = False) -> torch.Tensor:
    """CPU int64 ``[max_q, max_k]`` (and, with ``pairs``, the query-key pair count per
    head: the LSE op's third entry, which picks its CUDA backward's kernel)."""
    lens_q, lens_k = check_values(q, k, cu_seqlens_q, cu_seqlens_k)
    got = [int(x.max()) if x.numel() else 0 for x in (lens_q, lens_k)]
    if pairs:
        got.append(int((lens_q.long() * lens_k.long()).sum()))
    return torch.tensor(got, dtype=torch.int64)


def _reference_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, softcap, sinks):
    max_lens = _max_lens(q, k, cu_seqlens_q, cu_seqlens_k, pairs=True)
    kw = _variants(window_left, window_right, softcap, sinks)
    out = reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, **kw)
    return out, reference_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, scale, **kw), max_lens


@_ragged_attention_lse.register_fake
def _ragged_attention_lse_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left=-1, window_right=-1,
                               softcap=0.0, sinks=None):
    check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_variants_meta(q, window_left, window_right, softcap, sinks)
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse, torch.empty(3, dtype=torch.int64, device="cpu")


@_ragged_attention_lse.register_kernel("cuda")
def _ragged_attention_lse_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left=-1, window_right=-1,
                               softcap=0.0, sinks=None):
    if _plain(window_left, window_right, softcap, sinks):
        hit = repeated_training_call(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        got = None if hit is None else run_repeated_training(hit, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        if got is not None:
            return got[0], got[1], torch.tensor(got[2], dtype=torch.int64)
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    window = (window_left, window_right)
    variant = select.variant(causal, window, softcap, sinks)
    if select.cuda_runs_reference(q.device, q.dtype, q.shape[-1], variant, training=True, causal=causal, window=window):
        return _reference_with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right,
                                   softcap, sinks)
    out, lse, max_lens = get_runtime(q.device).attention_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, _window(variant, window), softcap=softcap
    )
    if sinks is not None:
        out, lse = flash_backward.with_sinks(out, lse, sinks)
    return out, lse, torch.tensor(max_lens, dtype=torch.int64)


@torch.library.custom_op("ragged_compile::ragged_attention_lse_backward", mutates_args=(), tags=_TAGS)
def _ragged_attention_lse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_lens: torch.Tensor,
    causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return _exact_backward(*args, window_left, window_right, softcap, sinks, out=out, lse=lse)


@_ragged_attention_lse_backward.register_fake
def _ragged_attention_lse_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens, causal,
                                        scale, window_left=-1, window_right=-1, softcap=0.0, sinks=None):
    torch._check(grad_out.shape == q.shape, lambda: f"grad_out {tuple(grad_out.shape)} must match q {tuple(q.shape)}")
    torch._check(
        lse.dim() == 2 and lse.shape[0] == q.shape[1] and lse.shape[1] == q.shape[0],
        lambda: f"lse must be [Hq, Tq] = {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}",
    )
    torch._check(max_lens.numel() == 3, lambda: "max_lens must hold [max_q, max_k, pairs]")
    check_variants_meta(q, window_left, window_right, softcap, sinks)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks_fake(q, sinks)


@_ragged_attention_lse_backward.register_kernel("cuda")
def _ragged_attention_lse_backward_cuda(
    grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens, causal, scale, window_left=-1, window_right=-1,
    softcap=0.0, sinks=None,
):
    window = (window_left, window_right)
    variant = select.variant(causal, window, softcap, sinks)
    if select.cuda_runs_reference(q.device, q.dtype, q.shape[-1], variant, training=True, causal=causal, window=window):
        args = (grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        return _exact_backward(*args, window_left, window_right, softcap, sinks)
    lens = tuple(max_lens.tolist())  # a CPU tensor: no sync
    grads = _cuda_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, lens, causal, scale,
                           _window(variant, window), variant, softcap)
    if sinks is not None:  # out and lse are with_sinks': the sinks' own gradient from them
        grads = (*grads, flash_backward.sinks_grad(grad_out, out, lse, sinks))
    return _with_dsinks(grads, q)


def _cuda_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, lens: tuple[int, int, int], causal, scale,
                   window=(-1, -1), variant=(), softcap: float = 0.0):
    """(dq, dk, dv) on CUDA; ``lens``: (max_q, max_k, pairs) from the forward's host layout."""
    if softcap:  # no fused backward caps scores
        get_runtime(q.device).count("triton_backward")
        return segment_backward.backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                         window, softcap)
    max_q, max_k, pairs = lens
    slots = (cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0])
    work = select.backward_work(q.shape[1], k.shape[1], q.shape[0], k.shape[0], pairs, causal)
    if select.backward_kernel(q.device, q.dtype, q.shape[-1], work, variant, slots) == "fa4":
        try:
            return fa4_backward.backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                         (max_q, max_k))
        except Exception as err:  # noqa: BLE001 - select decides: re-raise, or FA2 from now on
            select.fa4_failed(err, q.device, q.dtype, q.shape[-1])
    return flash_backward.backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal, scale, window
    )


def _repeated_training(hit, q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
    """A training call that repeats an earlier one of its step (see
    steps.repeated_training_call). Where its forward is PyTorch's FlashAttention-2
    and its backward would be too, aten's forward runs under autograd, which then
    runs aten's own FlashAttention-2 backward: the kernels of
    :class:`_EagerTraining`'s backward, with no Python in it (whose host time decides
    small batches), under another autograd node that saves other tensors.

    The backward kernel is chosen here, at the forward (the full path chooses in the
    backward); a choice that raises (a forced backward that cannot run) takes the full
    path, which raises in the backward as before. Under saved-tensor hooks the node
    stays :class:`_EagerTraining`'s: non-reentrant activation checkpointing compares
    what a forward saved with what its recompute saves, and a recompute (on
    autograd's thread, outside the step) takes the full path."""
    work, slots = hit.work
    if hit.slot is None and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
        try:
            both_fa2 = select.backward_kernel(q.device, q.dtype, q.shape[-1], work, (), slots) == "fa2"
        except RuntimeError:
            both_fa2 = False
        if both_fa2:
            return run_repeated_training(hit, q, k, v, cu_q, cu_k, causal, scale, lse=False)
    return _EagerTraining.apply(q, k, v, cu_q, cu_k, causal, scale, hit)


class _EagerTraining(torch.autograd.Function):
    """The training pair without the dispatcher (see :func:`attention`): the same
    CUDA kernels, saved tensors and backward as ``ragged_attention_lse``."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, repeated=None):
        # repeated: steps.repeated_training_call's resolution of this call, or None
        got = None if repeated is None else run_repeated_training(repeated, q, k, v, cu_q, cu_k, causal, scale)
        if got is None:
            got = get_runtime(q.device).attention_with_lse(q, k, v, cu_q, cu_k, causal, scale)
        out, lse, lens = got
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.lens, ctx.causal, ctx.scale = lens, causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = _cuda_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, ctx.lens, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None, None  # calls without variants only


def _lse_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, softcap, sinks = inputs
    out, lse, max_lens = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens, sinks)
    ctx.causal, ctx.scale, ctx.variants = causal, scale, (window_left, window_right, softcap)
    ctx.mark_non_differentiable(lse, max_lens)


def _lse_backward(ctx, grad_out, _grad_lse, _grad_max_lens):
    q, k, v, out, lse, cu_q, cu_k, max_lens, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.ragged_compile.ragged_attention_lse_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, max_lens, ctx.causal, ctx.scale, *ctx.variants, sinks
    )
    return dq, dk, dv, None, None, None, None, None, None, None, (None if sinks is None else dsinks)


_ragged_attention_lse.register_autograd(_lse_backward, setup_context=_lse_setup_context)


# -- attention dropout: forward with its rng state, backward ------------------------------
# A pair of its own: the forward draws random numbers (tagged so no compiler
# dedups or recomputes it) and hands the backward the state that redraws them.

_DROPOUT_TAGS = (torch.Tag.nondeterministic_seeded, *_TAGS)


@torch.library.custom_op("ragged_compile::ragged_attention_dropout", mutates_args=(), tags=_DROPOUT_TAGS)
def _ragged_attention_dropout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Every device but CUDA: the reference, its masks from a seed of torch's CPU
    # generator (torch.manual_seed reproduces them).
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return _reference_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p)


def _eager_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p) -> torch.Tensor | None:
    """The dropout pair's CUDA kernels for an eager call nothing intercepts (see
    :func:`attention`): aten's FlashAttention-2 forward with dropout under autograd,
    whose own backward node redraws the same mask from the rng state it saved, as
    the pair's backward does, with no dispatcher or Python around either. None
    where the pair must run (the reference kernel, or nothing to attend: the
    kernel is not called there, so autograd would see no graph)."""
    if select.dropout_kernel(q.device, q.dtype, q.shape[-1]) != "fa2":
        return None
    max_q, max_k = get_runtime(q.device).max_lens(q, k, cu_seqlens_q, cu_seqlens_k)
    if not (max_q and max_k and q.shape[0] and k.shape[0]):
        return None
    return flash_backward.forward_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal, scale,
                                          dropout_p)[0]


def _reference_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p):
    max_lens = _max_lens(q, k, cu_seqlens_q, cu_seqlens_k)
    seed = int(torch.randint(0, 1 << 62, (1,)).item())
    out = reference_dropout_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p, seed)
    lse = reference_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return out, lse, max_lens, torch.tensor([seed, 0], dtype=torch.uint64, device=q.device)


@_ragged_attention_dropout.register_fake
def _ragged_attention_dropout_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p):
    check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k)
    torch._check(0.0 <= dropout_p < 1.0, lambda: f"dropout_p must be in [0, 1), got {dropout_p}")
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
    return q.new_empty(q.shape), lse, torch.empty(2, dtype=torch.int64, device="cpu"), rng_state


@_ragged_attention_dropout.register_kernel("cuda")
def _ragged_attention_dropout_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p):
    # FlashAttention-2 with dropout (FlashInfer has none), the step's host lengths.
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    if select.dropout_kernel(q.device, q.dtype, q.shape[-1]) == "reference":
        return _reference_dropout(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p)
    max_q, max_k = get_runtime(q.device).max_lens(q, k, cu_seqlens_q, cu_seqlens_k)
    out, lse, rng_state = flash_backward.forward_dropout(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal, scale, dropout_p
    )
    return out, lse, torch.tensor([max_q, max_k], dtype=torch.int64), rng_state


@torch.library.custom_op("ragged_compile::ragged_attention_dropout_backward", mutates_args=(), tags=_TAGS)
def _ragged_attention_dropout_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_lens: torch.Tensor,
    rng_state: torch.Tensor,
    causal: bool,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed = int(rng_state[0].item())
    return reference_dropout_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p, seed)


@_ragged_attention_dropout_backward.register_fake
def _ragged_attention_dropout_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens,
                                            rng_state, causal, scale, dropout_p):
    torch._check(grad_out.shape == q.shape, lambda: f"grad_out {tuple(grad_out.shape)} must match q {tuple(q.shape)}")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@_ragged_attention_dropout_backward.register_kernel("cuda")
def _ragged_attention_dropout_backward_cuda(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens,
                                            rng_state, causal, scale, dropout_p):
    if select.dropout_kernel(q.device, q.dtype, q.shape[-1]) == "reference":  # as the forward decided
        seed = int(rng_state[0].item())
        return reference_dropout_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p, seed)
    max_q, max_k = max_lens.tolist()  # a CPU tensor: no sync
    return flash_backward.backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal,
                                   scale, dropout_p=dropout_p, rng_state=rng_state)


def _dropout_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dropout_p = inputs
    out, lse, max_lens, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens, rng_state)
    ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p
    ctx.mark_non_differentiable(lse, max_lens, rng_state)


def _dropout_backward(ctx, grad_out, _grad_lse, _grad_max_lens, _grad_rng_state):
    q, k, v, out, lse, cu_q, cu_k, max_lens, rng_state = ctx.saved_tensors
    dq, dk, dv = torch.ops.ragged_compile.ragged_attention_dropout_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, max_lens, rng_state, ctx.causal, ctx.scale, ctx.dropout_p
    )
    return dq, dk, dv, None, None, None, None, None


_ragged_attention_dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)


# -- autocast -------------------------------------------------------------------------
# As SDPA: under torch.autocast the ops take q, k and v in autocast's dtype (a fixed
# dtype, as torch.library.register_autocast takes, would be wrong for the other one).
# The public function casts before its checks; these kernels serve calls of the ops
# themselves, eager or traced.

_autocast_lib = torch.library.Library("ragged_compile", "IMPL")


def _register_autocast(name: str, floating: tuple[int, ...]) -> None:
    op = getattr(torch.ops.ragged_compile, name).default
    for device_type in ("cpu", "cuda"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _excluded=keyset):
            dtype = torch.get_autocast_dtype(_device_type)
            args = tuple(
                a.to(dtype) if i in floating and a.is_floating_point() and a.device.type == _device_type else a
                for i, a in enumerate(args)
            )
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return op(*args)

        _autocast_lib.impl(name, kernel, key, with_keyset=True)


_register_autocast("ragged_attention", (0, 1, 2))
_register_autocast("ragged_attention_lse", (0, 1, 2))
_register_autocast("ragged_attention_dropout", (0, 1, 2))


# -- torch.func -----------------------------------------------------------------------

_NO_DOUBLE_BACKWARD = (
    "ragged_compile.ragged_attention has no double backward: its gradients are computed by "
    "an exact reference kernel that is not itself differentiable, so gradients of gradients "
    "(backward through a graph made with create_graph=True, torch.func.hessian, jacrev of "
    "grad) are not available. Take first-order gradients only (create_graph=False), or "
    "compute higher-order terms with a dense attention such as "
    "torch.nn.functional.scaled_dot_product_attention per segment"
)
_NO_COMPILED_FUNC_GRAD = (
    "ragged_compile.ragged_attention under torch.func.grad/vjp/jacrev inside torch.compile is not "
    "supported: there Dynamo differentiates an autograd.Function's forward and ignores its "
    "backward, and the op's forward is a fused kernel. Without "
    "fullgraph=True, torch.compile runs this frame eagerly, which is correct. Otherwise take the "
    "transform outside the compiled region (torch.func.grad(f) eagerly, or torch.compile(f) and "
    "torch.autograd.grad / .backward() on its output); torch.compile(torch.func.vmap(f)) works"
)


def _differentiating_transform() -> bool:
    """Whether any active torch.func transform differentiates (grad, vjp,
    jacrev, jvp); Dynamo evaluates this at trace time."""
    if torch._C._functorch.peek_interpreter_stack() is None:
        return False
    interpreter = torch._functorch.pyfunctorch.retrieve_current_functorch_interpreter()
    if interpreter.key() in (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp):
        return True
    if interpreter.level() <= 1:  # the outermost transform (levels count from 1)
        return False
    with interpreter.lower():  # the next transform out
        return _differentiating_transform()


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
    def forward(q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, softcap, sinks):
        return torch.ops.ragged_compile.ragged_attention(
            q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, softcap, sinks
        )

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_FORWARD_AD)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_per_element(_Attention.apply, info, in_dims, *args)


class _AttentionBackward(torch.autograd.Function):
    """The backward op; differentiating it raises what the user can do instead."""

    @staticmethod
    def forward(grad_out, q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, softcap, sinks):
        return torch.ops.ragged_compile.ragged_attention_backward(
            grad_out, q, k, v, cu_q, cu_k, causal, scale, window_left, window_right, softcap, sinks
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
    def vmap(info, in_dims, *args):
        return _vmap_per_element(_AttentionBackward.apply, info, in_dims, *args)
