"""Training on the GPU: the op's forward with its log-sum-exp, and a fused backward.

``ragged_compile::ragged_attention`` (ops.py) is the inference op: FlashInfer
forward, no LSE, and the reference kernel as its backward. When a CUDA call
needs gradients, :func:`attention` routes it to the pair of ops defined here:

* ``ragged_compile::ragged_attention_lse(q, k, v, cu_q, cu_k, causal, scale)
  -> (out, lse, max_lens)``: FlashInfer's forward, which also returns the LSE
  (fp32 ``[Hq, Tq]``, natural log, ``+inf`` for rows that see no key: the
  layout of ``aten._flash_attention_forward``), and ``max_lens``, a CPU int64
  tensor ``[max_q, max_k]`` read from the runtime's host layout, so that the
  backward needs no device-to-host sync.
* ``ragged_compile::ragged_attention_lse_backward(...) -> (dq, dk, dv)``:
  PyTorch's FlashAttention-2 varlen backward (backends/flash_backward.py) on
  CUDA, the reference kernel's exact gradients elsewhere.

On CPU the pair runs the fused CPU kernel (backends/cpu.py), whose backward
then reuses the forward's LSE; float64 and devices without a kernel of their
own run the reference kernel with an exact LSE.
This mirrors ``torch/nn/attention/varlen.py`` (forward op returning auxiliary
outputs, a backward custom op with a fake kernel, ``register_autograd``).
"""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

from .backends import cpu as cpu_kernel
from .backends import fa4_backward, flash_backward
from .reference import reference_attention, reference_attention_backward
from .runtime import get_runtime
from .validation import check_inputs, check_meta, check_values

__all__ = ["attention", "training_unsupported_reason", "reference_lse"]

log = logging.getLogger("ragged_compile")

# The kernels look plans and host layouts up at every call (see ops.py).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch._dynamo.assume_constant_result
def _reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    from .backends import flashinfer as fi

    if not fi.supports(dtype, head_dim):
        return f"FlashInfer takes fp16/bf16 with head_dim <= 256 (and must be importable), got {dtype}, head_dim {head_dim}"
    return flash_backward.unsupported_reason(device, dtype, head_dim)


def training_unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim) -> str | None:
    """Why a grad-requiring CUDA call cannot train on FlashInfer + FlashAttention-2, or None."""
    if device.type != "cuda":
        return "training kernels are CUDA-only"
    if not isinstance(head_dim, int):
        return "head dim is symbolic"
    return _reason(device, dtype, head_dim)


_warned: set[str] = set()


@torch._dynamo.assume_constant_result
def _warn_once(reason: str) -> bool:
    if reason not in _warned:
        _warned.add(reason)
        log.warning(
            "ragged_compile: a CUDA call needs gradients but %s: it runs the (slow, exact) "
            "reference kernel instead", reason,
        )
    return True


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float) -> torch.Tensor:
    """The op a call should run: the LSE pair when the call needs gradients
    and a kernel of its own takes it, else ``ragged_attention``.

    * CUDA: FlashInfer's forward with its LSE and FlashAttention-2's backward.
    * CPU: the fused CPU kernel (backends/cpu.py) saves its LSE, so the
      backward does not redo the forward (a quarter of forward+backward on
      long segments).

    Inference (no grad mode, or nothing requires grad) never pays for the LSE.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if q.device.type == "cuda":
            reason = training_unsupported_reason(q.device, q.dtype, q.shape[-1])
            if reason is None:
                return _with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
            _warn_once(reason)
        elif cpu_kernel.takes(q):
            return _with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return torch.ops.ragged_compile.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)


def _with_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    out, _, _ = torch.ops.ragged_compile.ragged_attention_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return out


def reference_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float) -> torch.Tensor:
    """Exact LSE of the scaled scores, ``[Hq, Tq]`` fp32, natural log, ``+inf`` for
    rows that see no key (aten's convention). Host offsets; one segment at a time."""
    Tq, Hq, _ = q.shape
    group = Hq // k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((Hq, Tq), math.inf, dtype=acc, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if lq == 0 or lk == 0:
            continue
        qs = q[cq[i] : cq[i + 1]].to(acc)
        ks = k[ck[i] : ck[i + 1]].to(acc).repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            rows = torch.arange(lq, device=q.device)[:, None]
            cols = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(cols > rows + (lk - lq), -math.inf)
        seg = torch.logsumexp(s, dim=-1)
        lse[:, cq[i] : cq[i + 1]] = seg.masked_fill(seg == -math.inf, math.inf)
    return lse.float()


@torch.library.custom_op("ragged_compile::ragged_attention_lse", mutates_args=(), tags=_TAGS)
def _attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # CPU: the fused CPU kernel; devices without a kernel of their own, float64
    # and RAGGED_COMPILE_REFERENCE=1: the reference kernel and an exact LSE.
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    lens_q, lens_k = check_values(q, k, cu_seqlens_q, cu_seqlens_k)
    max_lens = torch.tensor([int(x.max()) if x.numel() else 0 for x in (lens_q, lens_k)], dtype=torch.int64)
    if cpu_kernel.takes(q):
        out, lse = cpu_kernel.cpu_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, return_lse=True)
        lse = lse.t().contiguous()  # [Tq, Hq] -> the backward's [Hq, Tq]
    else:
        out = reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        lse = reference_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, scale)
    return out, lse, max_lens


@_attention_lse.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k)
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, lse, torch.empty(2, dtype=torch.int64, device="cpu")


@_attention_lse.register_kernel("cuda")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale):
    check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    out, lse, max_lens = get_runtime(q.device).attention_with_lse(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale
    )
    return out, lse, torch.tensor(max_lens, dtype=torch.int64)


@torch.library.custom_op("ragged_compile::ragged_attention_lse_backward", mutates_args=(), tags=_TAGS)
def _attention_lse_backward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if cpu_kernel.takes(q):
        return cpu_kernel.cpu_attention_backward(
            grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, out=out, lse=lse.t()
        )
    return reference_attention_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)


@_attention_lse_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens, causal, scale):
    torch._check(grad_out.shape == q.shape, lambda: f"grad_out {tuple(grad_out.shape)} must match q {tuple(q.shape)}")
    torch._check(
        lse.dim() == 2 and lse.shape[0] == q.shape[1] and lse.shape[1] == q.shape[0],
        lambda: f"lse must be [Hq, Tq] = {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}",
    )
    torch._check(max_lens.numel() == 2, lambda: "max_lens must hold [max_q, max_k]")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@_attention_lse_backward.register_kernel("cuda")
def _cuda_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens, causal, scale):
    layout = (cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0])
    if backward_kernel(q.device, q.dtype, q.shape[-1], layout) == "fa4":
        try:
            return fa4_backward.backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # a JIT or launch failure of the pre-release: FA2 from now on
            if os.environ.get("RAGGED_COMPILE_BACKWARD") == "fa4":
                raise
            fa4_backward.disable(f"its backward failed ({type(e).__name__}: {str(e)[:300]})")
            _warn_fa4_once(fa4_backward.unsupported_reason(q.device, q.dtype, q.shape[-1]))
    max_q, max_k = max_lens.tolist()  # a CPU tensor: no sync
    return flash_backward.backward(
        grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, causal, scale
    )


BACKWARD_KERNELS = ("auto", "fa2", "fa4")


def backward_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, layout: tuple[int, int, int] | None = None
) -> str:
    """The CUDA backward a training call runs: ``"fa4"`` (flash-attn-4, twice as
    fast on SM90, when installed) or ``"fa2"`` (PyTorch's FlashAttention-2).
    ``layout``, (segments, total q, total k): floods of short segments stay on
    FA2 (:func:`fa4_backward.pads_little`).

    ``RAGGED_COMPILE_BACKWARD=fa2|fa4`` forces one; ``fa4`` where it cannot run
    is an error that says why. Under ``torch.use_deterministic_algorithms(True)``
    it is FA2 (FA4's atomics make dq differ run to run in its last bits). If
    FA4's kernel fails once (a pre-release), FA2 from then on, with a WARNING."""
    choice = os.environ.get("RAGGED_COMPILE_BACKWARD", "auto")
    if choice not in BACKWARD_KERNELS:
        raise ValueError(f"RAGGED_COMPILE_BACKWARD must be one of {BACKWARD_KERNELS}, got {choice!r}")
    if choice == "fa2":
        return "fa2"
    if torch.are_deterministic_algorithms_enabled():
        # FA4 accumulates dq (and GQA's dk/dv) with atomics; aten's FA2 backward
        # honours the flag itself.
        if choice == "fa4":
            raise RuntimeError(
                "RAGGED_COMPILE_BACKWARD=fa4, but torch.use_deterministic_algorithms(True) is set and "
                "flash-attn-4's backward is not bitwise deterministic; unset one of them"
            )
        return "fa2"
    reason = fa4_backward.unsupported_reason(device, dtype, head_dim)
    if reason is None:
        if choice == "auto" and layout is not None and not fa4_backward.pads_little(*layout):
            return "fa2"
        return "fa4"
    if choice == "fa4":
        raise RuntimeError(f"RAGGED_COMPILE_BACKWARD=fa4, but {reason}; unset it to use FlashAttention-2's backward")
    if fa4_backward.installed():
        _warn_fa4_once(reason)
    return "fa2"


@functools.cache
def _warn_fa4_once(reason: str) -> None:
    log.warning("ragged_compile: flash-attn-4 is installed but %s: training uses FlashAttention-2's (slower) backward", reason)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale = inputs
    out, lse, max_lens = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_lens)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse, max_lens)


def _backward(ctx, grad_out, _grad_lse, _grad_max_lens):
    q, k, v, out, lse, cu_q, cu_k, max_lens = ctx.saved_tensors
    dq, dk, dv = torch.ops.ragged_compile.ragged_attention_lse_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, max_lens, ctx.causal, ctx.scale
    )
    return dq, dk, dv, None, None, None, None


_attention_lse.register_autograd(_backward, setup_context=_setup_context)
