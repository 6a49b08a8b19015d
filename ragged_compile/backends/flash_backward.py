"""PyTorch's FlashAttention-2 varlen kernels: its backward
(`aten._flash_attention_backward`) is the CUDA backward of every training call
FlashAttention-4 does not take, and its forward (`aten._flash_attention_forward`)
runs sliding windows, which FlashInfer's ragged kernels bound on the left only,
and plain calls on layouts too small for a FlashInfer plan to pay
(``select.cuda_backend``: ``"varlen"``). They ship in every CUDA wheel of torch
(SM80+).

Contract of the aten kernel (torch 2.11 and 2.13, read from
``torch/nn/attention/varlen.py`` and ``aten/src/ATen/native/transformers/cuda/attention_backward.cu``,
and probed on the H200):

* ``logsumexp`` is fp32 ``[Hq, Tq]``, natural log, softmax scale included;
  rows that see no key must hold ``+inf`` (their probabilities are then 0).
  FlashInfer's forward gives ``[Tq, Hq]`` in base 2 with ``-inf`` for those
  rows: :func:`lse_from_flashinfer` converts.
* Offsets int32 and contiguous; GQA native (query head ``h`` uses k/v head
  ``h // (Hq // Hkv)``, dk/dv come back with ``Hkv`` heads); causal is
  bottom-right aligned for ``Lq != Lk``, as ours, on the original offsets.
* Head dims must be multiples of 8 up to 256: inputs are zero-padded to the
  next multiple of 8 (zero columns change no score and no output), with the
  true dim's scale.
* ``max_k == 0`` fails with "CUDA error: invalid argument" and ``n == 0`` is
  rejected: both (and ``max_q == 0``) have all-zero gradients, given here.
* Windows ``window_size_left/right`` (-1 unbounded) bound query row ``i`` to keys
  ``[i' - left, i' + right]`` with ``i' = i + Lk - Lq``, ours exactly; ``is_causal``
  caps ``right`` at 0. A row that sees no key gets output 0 and LSE ``+inf``
  from the forward, which is what the backward takes.
* But a side left unbounded while the other is bounded becomes ``max_seqlen_k``
  (flash-attn's ``set_params_fprop``; a bound ``>= max_seqlen_k`` first becomes
  -1): too short for rows with ``i' < 0`` when ``Lq > max_k`` (cross-attention
  with a left window: the first rows saw no key on the H200). Windowed calls pass
  ``max(max_q, max_k)`` as ``max_seqlen_k``, which the kernels use for that
  bound only (their loops run to each segment's own length).
"""

from __future__ import annotations

import functools
import math

import torch

from . import pad_head_dim

__all__ = [
    "unsupported_reason", "fa2_head_dim", "lse_from_flashinfer", "forward", "forward_dropout", "backward",
    "with_sinks", "sinks_grad", "forward_unpadded",
]

MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16)
_LN2 = math.log(2.0)


@functools.cache
def _flash_built() -> bool:
    try:
        return bool(torch.backends.cuda.is_flash_attention_available())
    except Exception:  # a CPU build, or an older torch without the query
        return False


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the fused backward cannot take this call (the reference backward will), or None."""
    if device.type != "cuda":
        return f"the fused backward is CUDA-only, got {device.type}"
    if dtype not in DTYPES:
        return f"the fused backward takes float16/bfloat16, got {dtype} (train in bfloat16)"
    if head_dim > MAX_HEAD_DIM:
        return f"the fused backward takes head_dim <= {MAX_HEAD_DIM}, got {head_dim}"
    if not _flash_built():
        return "this torch build has no FlashAttention kernels"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if major < 8:
        return f"FlashAttention-2 needs SM80 or newer, this GPU is SM{major}{minor}"
    return None


def fa2_head_dim(d: int) -> int:
    """The head dim the kernel computes ``d`` at: the next multiple of 8."""
    return -(-d // 8) * 8


def lse_from_flashinfer(lse: torch.Tensor, *, natural_hn: bool = False) -> torch.Tensor:
    """FlashInfer's LSE -> aten's ``[Hq, Tq]`` natural-log LSE. ``natural_hn``: it
    is already ``[Hq, Tq]`` in natural log (FlashInfer's ``lse_layout="HN",
    lse_base="ln"``); else ``[Tq, Hq]`` base 2.

    Keyless rows: FlashInfer's ``-inf`` becomes ``+inf``, which makes their
    probabilities ``exp(s - lse) = 0`` in the backward (``-inf`` would make
    ``exp(-inf + inf)`` NaN for the masked scores of a causal blind row). NaN
    (from a NaN in that segment) stays NaN.
    """
    if not natural_hn:
        lse = (lse.float() * _LN2).t().contiguous()
    return lse.nan_to_num_(nan=math.nan, posinf=math.inf, neginf=math.inf)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    window: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``ragged_attention(q, k, v, cu_q, cu_k, causal, scale,
    window_size=window)``; ``lse`` in the backward's layout (``[Hq, Tq]`` fp32,
    natural log, ``+inf`` for keyless rows). ``max_q``/``max_k``: host ints."""
    return _forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, 0.0)[:2]


def forward_unpadded(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, lse: bool = False):
    """:func:`forward`'s output (``lse``: and its LSE) for a call whose every argument
    the kernel takes as it is (head dim a multiple of 8, unit last strides, int32
    contiguous offsets, ``max_q``/``max_k`` > 0, within :data:`MAX_SEGMENTS`): the
    later layers of a forward whose first call went through :func:`forward`
    (``steps.fast_attention``, ``steps.run_repeated_training``)."""
    got = _forward_kernel(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, window_size_left=-1, window_size_right=-1,
    )
    out = got[0] if got[0].is_contiguous() else got[0].contiguous()
    return (out, got[1]) if lse else out


def forward_dropout(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, dropout_p: float):
    """:func:`forward` with attention dropout: ``(out, lse, rng_state)``, where
    ``rng_state`` (uint64 ``[2]`` on the device: the philox seed and offset the
    kernel drew from CUDA's default generator) makes :func:`backward` drop the same
    probabilities. ``lse`` is of the undropped scores, as the backward takes it."""
    return _forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, (-1, -1), dropout_p)


def in_graph(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float, window=(-1, -1), dropout_p: float = 0.0):
    """The call as aten's FlashAttention-2 forward under autograd, for a graph that
    torch.compile captures whole (``hf.unpad(..., buckets=True)`` under
    ``mode="reduce-overhead"``): the kernel reads the offsets on the device and
    takes ``max_q``/``max_k`` (ints, symbolic under compile) for its grid only, so
    a captured replay with other offsets of the same shapes computes their
    attention; its backward is aten's, dropout drawn from CUDA's generator as SDPA's
    is (graph-safe). Same contract as :func:`forward` (``max_q``, ``max_k`` > 0:
    the caller packs at least one token)."""
    torch._check(cu_q.shape[0] - 1 <= MAX_SEGMENTS, lambda: f"cu_seqlens_q has more than {MAX_SEGMENTS} segments, "
                 f"the most PyTorch's FlashAttention-2 takes per call; split the batch")
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # of the true head dim, not the padded one
    return _kernel_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, dropout_p)[0]


def _kernel_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, dropout_p):
    """The aten kernel's ``(out, lse, rng_state, ...)`` for q/k/v of any head dim
    (zero-padded to the next multiple of 8, ``out`` cut back)."""
    d = q.shape[-1]
    dp = fa2_head_dim(d)
    got = _forward_kernel(
        pad_head_dim(q, dp), pad_head_dim(k, dp), pad_head_dim(v, dp), cu_q, cu_k, max_q,
        _max_k_arg(max_q, max_k, window), dropout_p, causal, False, scale=scale,
        window_size_left=window[0], window_size_right=window[1],
    )
    return (got[0][..., :d] if dp != d else got[0]), *got[1:]


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, dropout_p):
    if cu_q.numel() - 1 == 0 or max_q == 0 or max_k == 0 or q.shape[0] == 0 or k.shape[0] == 0:
        lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32, device=q.device)
        return q.new_zeros(q.shape), lse, torch.zeros(2, dtype=torch.uint64, device=q.device)
    _check_segment_slots(cu_q)
    out, lse, rng_state, *_ = _kernel_call(q, k, v, cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous(),
                                           max_q, max_k, causal, scale, window, dropout_p)
    # the kernel's output takes q's strides (empty_like); the op promises a dense one
    return out.contiguous(), lse, rng_state.to(q.device)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused forward's ``(out, lse)`` with per-head sink logits in every row's
    softmax denominator: ``out * sigmoid(lse - sink)`` and ``logaddexp(lse, sink)``
    (``lse`` in the backward's layout). Handed these, the backward gives the
    sinks' attention's exact dq, dk, dv: its probabilities are ``exp(s - lse)``
    with the sink in ``lse``, and a sink adds no value. Keyless rows (``+inf``)
    stay zero with ``+inf``."""
    sink = sinks.detach().float()[:, None]
    scaled = out.float() * torch.sigmoid(lse - sink).t()[..., None]
    return scaled.to(out.dtype).contiguous(), torch.logaddexp(lse, sink)


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d(sinks)``: ``-sum_rows exp(sink - lse) * rowsum(dO * O)`` per head, from the
    output and LSE of :func:`with_sinks`."""
    rows = (grad_out.float() * out.float()).sum(-1).t()  # [Hq, Tq]
    return -(torch.exp(sinks.detach().float()[:, None] - lse) * rows).sum(-1).to(sinks.dtype)


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
    scale: float,
    window: tuple[int, int] = (-1, -1),
    dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for ``out = ragged_attention(q, k, v, cu_q, cu_k, causal, scale,
    window_size=window)``; with ``dropout_p``, of :func:`forward_dropout`'s output,
    whose ``rng_state`` it takes.

    ``lse``: aten layout ``[Hq, Tq]`` (see :func:`lse_from_flashinfer`);
    ``max_q``/``max_k``: host ints, the longest q and k segment (no sync here).
    """
    n = cu_q.numel() - 1
    if n == 0 or max_q == 0 or max_k == 0 or q.shape[0] == 0 or k.shape[0] == 0:
        # Nothing attends to anything: all gradients are zero (and the kernel
        # rejects n == 0 and fails on max_k == 0).
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _check_segment_slots(cu_q)
    d = q.shape[-1]
    dp = fa2_head_dim(d)
    dq, dk, dv = _kernel(
        pad_head_dim(grad_out.to(q.dtype), dp),
        pad_head_dim(q, dp),
        pad_head_dim(k, dp),
        pad_head_dim(v, dp),
        pad_head_dim(out, dp),
        lse.contiguous(),
        cu_q.to(torch.int32).contiguous(),
        cu_k.to(torch.int32).contiguous(),
        max_q,
        _max_k_arg(max_q, max_k, window),
        dropout_p,
        causal,
        *(_unused_state(q.device) if rng_state is None else (rng_state, _unused_state(q.device)[1])),
        scale=scale,
        window_size_left=window[0],
        window_size_right=window[1],
    )
    if dp != d:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


# FlashAttention-2 launches a grid with one block row per segment (grid.y), which
# CUDA caps at 65,535; beyond it the launch fails with "invalid argument".
MAX_SEGMENTS = 65535


def _check_segment_slots(cu_q: torch.Tensor) -> None:
    n = cu_q.numel() - 1
    if n > MAX_SEGMENTS:
        raise ValueError(
            f"cu_seqlens_q has {n} segments, but PyTorch's FlashAttention-2 kernels (windows, sinks, "
            f"dropout and training backward on CUDA) take at most {MAX_SEGMENTS} per call; drop empty "
            f"segments from the offsets or split the batch into calls of fewer segments"
        )


def _max_k_arg(max_q: int, max_k: int, window: tuple[int, int]) -> int:
    # an unbounded side of a window must reach every key of every row (module docstring)
    return max(max_q, max_k) if window != (-1, -1) else max_k


@functools.cache
def _unused_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # No dropout: the kernel reads neither its rng state nor the "unused" tensor,
    # so one pair per device serves every call (and allocates nothing per call);
    # with dropout the forward's rng state replaces the first.
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _kernel(*args, **kwargs):
    # One seam per aten kernel: CPU tests put a reference of its contract here.
    return torch.ops.aten._flash_attention_backward.default(*args, **kwargs)


def _forward_kernel(*args, **kwargs):
    return torch.ops.aten._flash_attention_forward.default(*args, **kwargs)
