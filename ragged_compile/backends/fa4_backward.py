"""flash-attn-4's varlen backward (CuTe DSL, ``pip install 'ragged-compile[fa4]'``)
as the CUDA backward of the op on SM90, where it is about twice as fast as
PyTorch's FlashAttention-2 backward (bench/results/probe_fa4.json, H200).

Contract of ``flash_attn.cute.interface._flash_attn_bwd`` (4.0.0b36, read from
its source and probed on the H200 against float64 autograd):

* ``lse`` is aten's: fp32 ``[Hq, Tq]``, natural log, scale included; ``+inf``
  for rows that see no key is fine. GQA native, causal bottom-right aligned as
  ours, empty q and k segments and an all-empty k give zero gradients.
* Head dims 64, 96, 128 and 256 are correct; 72 and 80 gave a wrong dq, so
  inputs are zero-padded to the next of those (with the true dim's scale).
* **Its tiles read past a segment's end**: a q tile of segment i loads the first
  rows of segment i+1 (k tiles likewise), and masks them only through the LSE,
  so a NaN or Inf there reaches segment i's dk/dv (dq). Segments stay
  independent by recompute (the default; see "isolation by recompute" below):
  the segments whose gradients come out non-finite are computed again from
  their own rows. Head dims the kernel pads, or ``RAGGED_COMPILE_FA4_PAD=fused``
  / ``copies``: every segment is laid out padded with zero rows to a multiple of
  the kernel's tile (``cu_seqlens``: the padded starts; ``seqused``: the true
  lengths), built on the device with no sync (the padded total is bounded on
  the host by ``T + n * (tile - 1) + tile``).
"""

from __future__ import annotations

import functools
import threading

import torch

from .. import config
from . import segment_backward, tile_pad

__all__ = ["installed", "unsupported_reason", "backward", "fa4_head_dim"]

DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 96, 128, 256)  # verified on the H200; others pad up to one of these
# Isolation rests on its private tile choice (_tile_size_bwd_sm90) being the
# kernel's: only versions whose source was read and whose kernel was probed.
VERIFIED_VERSIONS = ("4.0.0b36",)
_MAX_TILE = 128  # the largest tile of either side on SM90
_disabled: str | None = None


def fa4_head_dim(d: int) -> int:
    """The head dim the kernel computes ``d`` at (inputs are zero-padded to it)."""
    return next(p for p in _HEAD_DIMS if p >= d)


@functools.cache
def _interface():
    """flash_attn.cute.interface, or the reason it cannot be used (imported once: ~6 s)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("flash-attn-4")
    except PackageNotFoundError:
        found = "unknown"
    if found not in VERIFIED_VERSIONS:
        return f"flash-attn-4 {found} is not a verified version ({', '.join(VERIFIED_VERSIONS)})"
    try:
        from flash_attn.cute import interface
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed/usable"
        return f"flash-attn-4 is not importable ({type(e).__name__}: {str(e)[:200]})"
    missing = [name for name in ("_flash_attn_bwd", "_tile_size_bwd_sm90") if not hasattr(interface, name)]
    if missing:
        return f"this flash-attn-4 lacks {', '.join(missing)} (verified with 4.0.0b36)"
    return interface


@functools.cache
def installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


def disable(reason: str) -> None:
    """Stop using FA4 in this process (its kernel failed once)."""
    global _disabled
    _disabled = reason


def disabled() -> bool:
    """Whether :func:`disable` stopped FA4 in this process."""
    return _disabled is not None


def pads_little(segments: int, total_q: int, total_k: int) -> bool:
    """Whether padding each segment slot to a tile at most doubles the rows of either
    side. The padded buffers are sized on the host from the slot count (no sync),
    so layouts with many empty slots (a compiled packed batch keeps one per token)
    or many short segments would multiply the backward's memory."""
    extra = segments * (_MAX_TILE - 1)
    return extra <= total_q and extra <= total_k


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA4's backward cannot take this call (FA2's will), or None. Imports
    flash-attn-4 only when everything else fits."""
    if device.type != "cuda":
        return "flash-attn-4 is CUDA-only"
    if not installed():
        return "flash-attn-4 is not installed"
    if _disabled is not None:
        return _disabled
    if dtype not in DTYPES:
        return f"flash-attn-4 takes float16/bfloat16, got {dtype}"
    if head_dim > _HEAD_DIMS[-1]:
        return f"flash-attn-4 takes head_dim <= {_HEAD_DIMS[-1]}, got {head_dim}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        # Only SM90's tile sizes are known here (and verified); SM100 tiles differ.
        return f"flash-attn-4's backward is used on SM90 only, this GPU is SM{major}{minor}"
    interface = _interface()
    return interface if isinstance(interface, str) else None


def _tiles(d: int, causal: bool) -> tuple[int, int]:
    cfg = _interface()._tile_size_bwd_sm90(d, d, causal, False)
    return cfg.m_block_size, cfg.n_block_size


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    causal: bool,
    scale: float,
    max_lens: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for ``out = ragged_attention(q, k, v, cu_q, cu_k, causal, scale)``;
    ``lse`` in aten's layout; ``max_lens``: the longest q and k segment (host ints),
    which :func:`redo_isolation`'s recompute needs. The caller checked
    :func:`unsupported_reason`."""
    Tq, Tk, d = q.shape[0], k.shape[0], q.shape[-1]
    if cu_q.numel() <= 1 or Tq == 0 or Tk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if max_lens is not None and redo_isolation(d):
        return _backward_redo(grad_out, q, k, v, out, lse, cu_q, cu_k, causal, scale, max_lens)
    dp = fa4_head_dim(d)
    tile_m, tile_n = _tiles(dp, causal)
    lay_q, lay_k = _padded_layout(cu_q, Tq, tile_m), _padded_layout(cu_k, Tk, tile_n)
    qp, outp, gop = tile_pad.pad_rows((q, out, grad_out.to(q.dtype)), lay_q, dp)
    kp, vp = tile_pad.pad_rows((k, v), lay_k, dp)
    dq, dk, dv = _kernel(
        qp, kp, vp, outp, gop,
        tile_pad.pad_lse(lse, lay_q),
        softmax_scale=scale,
        causal=causal,
        cu_seqlens_q=lay_q.cu,
        cu_seqlens_k=lay_k.cu,
        seqused_q=lay_q.lens,
        seqused_k=lay_k.lens,
    )
    (dq,) = tile_pad.unpad_rows((dq,), lay_q, d)
    dk, dv = tile_pad.unpad_rows((dk, dv), lay_k, d)
    return dq, dk, dv


# -- isolation by recompute -------------------------------------------------------------
# The tiles' overrun reaches a segment only through products with exact zeros (masked
# probabilities, masked scores), so finite rows of a neighbour change nothing, and a NaN
# or Inf there makes the segment's gradient rows non-finite: never a finite wrong value.
# So the kernel runs on the layout as it is, and a segment whose gradients come out
# non-finite (contaminated, or non-finite of its own) is computed again from its own
# rows only (segment_backward.py), in place. This rests on the kernel's writes stopping
# at each segment's end (per-segment bounded stores in its upstream source); the CUDA
# gradient fuzz, on finite data against float64, is what checks it on the installed
# version. Without a sync: the recompute always launches, a program per row block and
# head, and a program whose segment is not flagged only reads its flag. What it costs where
# nothing is non-finite is one read of each gradient (the check) and two near-empty
# launches, against the padded layout's copies of five inputs and three gradients.


def redo_isolation(head_dim: int) -> bool:
    """Whether isolation is by recompute here (``RAGGED_COMPILE_FA4_PAD=redo``, the
    default): a head dim FA4 computes as it is, so there is nothing to pad (other
    head dims take the padded layout, whose copies pad the head dim as well)."""
    return config.choice(config.FA4_PAD, config.FA4_PADS) == "redo" and head_dim in _HEAD_DIMS


def _backward_redo(grad_out, q, k, v, out, lse, cu_q, cu_k, causal, scale, max_lens):
    cu_q32, cu_k32 = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
    lens_q, lens_k = cu_q32[1:] - cu_q32[:-1], cu_k32[1:] - cu_k32[:-1]
    q, k, v, out = (t.contiguous() for t in (q, k, v, out))
    grad_out, lse = grad_out.to(q.dtype).contiguous(), lse.contiguous()
    dq, dk, dv = _kernel(
        q, k, v, out, grad_out, lse,
        softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q32, cu_seqlens_k=cu_k32,
        seqused_q=lens_q, seqused_k=lens_k,
    )
    # the recompute writes rows in place, as [T, H, D] contiguous (FA4 allocates them so)
    dq, dk, dv = (t.contiguous() for t in (dq, dk, dv))
    n = lens_q.numel()
    # the segment of each row (no sync: the row counts are the host's, and the offsets end
    # at them, cu[-1] == T, as the op checks); self-attention's once
    seg_q = torch.repeat_interleave(lens_q, output_size=q.shape[0])
    seg_k = seg_q if cu_k is cu_q else torch.repeat_interleave(lens_k, output_size=k.shape[0])
    redo = _non_finite_segments((dq,), seg_q, n) | _non_finite_segments((dk, dv), seg_k, n)
    segment_backward.recompute(redo, grad_out, q, k, v, out, lse, cu_q32, cu_k32, causal, scale, max_lens,
                               (dq, dk, dv))
    return dq, dk, dv


def _non_finite_segments(grads, seg: torch.Tensor, n: int) -> torch.Tensor:
    """bool ``[n]``: the segments where any of ``grads``' rows holds a NaN or Inf.
    A row's fp32 sum is non-finite if any element is (one read of each gradient; a
    sum that overflows only redoes a segment needlessly)."""
    sums = sum(g.flatten(1).sum(1, dtype=torch.float32) for g in grads)
    bad = (~torch.isfinite(sums)).to(torch.int32)
    return torch.zeros(n, dtype=torch.int32, device=seg.device).index_add_(0, seg, bad) > 0


def _padded_layout(cu: torch.Tensor, total: int, tile: int) -> tile_pad.Layout:
    # a seam: CPU tests lay segments out unpadded here to show the isolation is needed
    return _layouts.get(cu, total, tile)


class _PassLayouts:
    """The padded layouts of one backward pass: every layer of a model shares its
    offsets tensor, so the layout is built once per pass, not once per layer.

    Known by the offsets' identity and version, the row count, the tile and the
    stream, and only within the autograd graph task that built it (a new backward
    pass starts afresh, so a graph replay that rewrote the offsets, or memory
    reused by other offsets, never meets an old layout). Outside a backward pass
    nothing is kept."""

    def __init__(self):
        self._local = threading.local()

    def get(self, cu: torch.Tensor, total: int, tile: int) -> tile_pad.Layout:
        task = torch._C._current_graph_task_id()
        if task < 0 or cu.is_inference():
            return tile_pad.layout(cu, total, tile)
        stream = torch._C._cuda_getCurrentRawStream(cu.device.index) if cu.is_cuda else 0
        entries = getattr(self._local, "entries", None)
        if entries is None or self._local.task != task:
            entries = self._local.entries = {}
            self._local.task = task
        key = (id(cu), cu._version, total, tile, stream)
        hit = entries.get(key)
        if hit is not None and hit[0] is cu:
            return hit[1]
        lay = tile_pad.layout(cu, total, tile)
        entries[key] = (cu, lay)  # held until the next pass: the offsets' id stays theirs
        return lay


_layouts = _PassLayouts()


def _kernel(*args, **kwargs):
    # One seam for FA4: CPU tests put a reference of its contract (tile overrun
    # included) here.
    return _interface()._flash_attn_bwd(*args, **kwargs)
