"""Segments laid out padded to a kernel's tile, and back: the isolation layout of
flash-attn-4's backward (fa4_backward.py), whose tiles read past a segment's end.

Every segment of a packed ``[T, H, D]`` tensor starts at a multiple of ``tile``
in the padded layout, the rows between segments zero, the head dim zero-padded
to the kernel's. :func:`layout` builds the row maps on the device without a sync
(the padded row count is bounded on the host by ``T + n * (tile - 1) + tile``);
:func:`pad_rows` writes the padded copies of several tensors of one side (q,
out and grad_out; or k and v) and :func:`unpad_rows` gathers gradients back.

It serves the head dims FA4 pads (72, 80), and every call under
``RAGGED_COMPILE_FA4_PAD=fused`` or ``copies`` (elsewhere FA4 isolates segments by
recompute, segment_backward.py). Two implementations of one contract: on CUDA
with triton installed (``fused``, and the padded calls of ``redo``), one Triton
launch per side writes every
element of the padded tensors once (rows read straight from the inputs, any
strides, padding rows and columns written as zeros); otherwise
(``RAGGED_COMPILE_FA4_PAD=copies``) PyTorch's ops zero-fill and then scatter each
tensor (two passes, a launch each). On the H200 the fused layout costs 0.74-0.81
ms a layer at ~33k tokens of 16 heads of 128 (both sides in, gradients out) in
most measured rows, near what moving those bytes once costs at the GPU's memory
bandwidth (the floor of any isolation by copying), 1.27-1.73 ms in others, against
1.45-2.14 ms for the copies (bench/results/isolation*.json). The two are tested
equal here (under Triton's interpreter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import config
from . import on_device

__all__ = ["Layout", "layout", "pad_rows", "unpad_rows", "pad_lse", "fused"]


@dataclass(frozen=True)
class Layout:
    """One side of a call in the padded layout.

    cu: int32 ``[n + 1]`` padded segment starts (the kernel's ``cu_seqlens``);
    lens: int32 ``[n]`` true lengths (its ``seqused``); dst: int64 ``[T]``, the
    padded row of each input row; rows: the padded row count (host int).
    """

    cu: torch.Tensor
    lens: torch.Tensor
    dst: torch.Tensor
    rows: int

    @functools.cached_property
    def src(self) -> torch.Tensor:
        """int64 ``[rows]``: the input row of each padded row, -1 for padding (what
        the fused gather reads; built on first use)."""
        src = torch.full((self.rows,), -1, dtype=torch.int64, device=self.dst.device)
        return src.index_copy_(0, self.dst, torch.arange(self.dst.numel(), device=self.dst.device))


def layout(cu: torch.Tensor, total: int, tile: int) -> Layout:
    """The padded layout of offsets ``cu`` over ``total`` rows, on cu's device."""
    n = cu.numel() - 1
    cu = cu.to(torch.int32)
    lens = cu[1:] - cu[:-1]
    cu_pad = F.pad(((lens + (tile - 1)) // tile * tile).cumsum(0, dtype=torch.int32), (1, 0))
    shift = (cu_pad[:-1] - cu[:-1]).to(torch.int64)
    dst = torch.arange(total, device=cu.device) + torch.repeat_interleave(shift, lens, output_size=total)
    # + tile: the last segment's tile may read up to a tile past its padded end.
    return Layout(cu_pad, lens, dst, total + n * (tile - 1) + tile)


def fused(device: torch.device) -> bool:
    """Whether :func:`pad_rows` / :func:`unpad_rows` run the Triton kernel here."""
    # "redo" isolates by recompute where it can (fa4_backward.py); elsewhere it pads as "fused"
    mode = config.choice(config.FA4_PAD, config.FA4_PADS)
    return device.type == "cuda" and mode in ("fused", "redo") and _triton() is not None


def pad_rows(tensors, lay: Layout, dim: int) -> list[torch.Tensor]:
    """``[lay.rows, H, dim]`` contiguous copies of ``[T, H, D]`` tensors (``D <= dim``)
    laid out by ``lay``, zero in padding rows and columns."""
    if fused(tensors[0].device):
        return _gather(tensors, lay.src, lay.rows, dim)
    outs = []
    for x in tensors:
        out = x.new_zeros((lay.rows, x.shape[1], dim))
        out[:, :, : x.shape[-1]].index_copy_(0, lay.dst, x)
        outs.append(out)
    return outs


def unpad_rows(tensors, lay: Layout, dim: int) -> list[torch.Tensor]:
    """The ``[T, H, dim]`` rows of padded ``[lay.rows, H, >= dim]`` tensors, contiguous."""
    if fused(tensors[0].device):
        return _gather(tensors, lay.dst, lay.dst.numel(), dim)
    return [x.index_select(0, lay.dst)[..., :dim].contiguous() for x in tensors]


def pad_lse(lse: torch.Tensor, lay: Layout) -> torch.Tensor:
    """aten's ``[H, T]`` LSE in the padded layout: ``+inf`` (no key) in padding rows."""
    out = lse.new_full((lse.shape[0], lay.rows), float("inf"))
    out.index_copy_(1, lay.dst, lse)
    return out


# -- the fused kernel ----------------------------------------------------------------------

_MAX_TENSORS = 3


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def gather_rows(
        idx_ptr,
        x0, x1, x2, s0r, s0h, s0d, s1r, s1h, s1d, s2r, s2h, s2d,
        y0, y1, y2,
        heads, d_in, d_out,
        N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One output row per program (axis 0), a block of heads per program (axis 1):
        # out[r, h, j] = x[idx[r], h, j] for j < d_in and idx[r] >= 0, else 0.
        r = tl.program_id(0).to(tl.int64)
        hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        js = tl.arange(0, BLOCK_D)[None, :]
        src = tl.load(idx_ptr + r)
        keep = (src >= 0) & (hs < heads) & (js < d_in)
        row = tl.maximum(src, 0)
        at = (r * heads + hs) * d_out + js
        inside = (hs < heads) & (js < d_out)
        v0 = tl.load(x0 + row * s0r + hs * s0h + js * s0d, mask=keep, other=0.0)
        tl.store(y0 + at, v0, mask=inside)
        if N > 1:
            v1 = tl.load(x1 + row * s1r + hs * s1h + js * s1d, mask=keep, other=0.0)
            tl.store(y1 + at, v1, mask=inside)
        if N > 2:
            v2 = tl.load(x2 + row * s2r + hs * s2h + js * s2d, mask=keep, other=0.0)
            tl.store(y2 + at, v2, mask=inside)

    return triton, gather_rows


def _gather(tensors, idx: torch.Tensor, rows: int, dim: int) -> list[torch.Tensor]:
    """``out[r] = x[idx[r], :, :dim]`` (zero where ``idx[r] < 0`` or past ``x``'s dim)
    for up to three tensors of one shape and dtype, one launch."""
    triton, kernel = _triton()
    first = tensors[0]
    if len(tensors) > _MAX_TENSORS or any(t.shape != first.shape or t.dtype != first.dtype for t in tensors):
        raise ValueError("the fused row gather takes up to three tensors of one shape and dtype")
    heads, d_in = first.shape[1], first.shape[2]
    outs = [first.new_empty((rows, heads, dim)) for _ in tensors]
    if rows == 0:
        return outs
    xs = list(tensors) + [first] * (_MAX_TENSORS - len(tensors))
    ys = outs + [outs[0]] * (_MAX_TENSORS - len(outs))
    strides = [s for t in xs for s in t.stride()]
    block_d = triton.next_power_of_2(dim)
    block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
    grid = (rows, triton.cdiv(heads, block_h))
    with on_device(first):
        kernel[grid](idx, *xs, *strides, *ys, heads, min(d_in, dim), dim,
                     N=len(tensors), BLOCK_H=block_h, BLOCK_D=block_d)
    return outs
