"""A Triton forward for short sliding windows (ModernBERT's local layers: 64 keys
each side), whose key tiles start where the window does.

FlashAttention-2's windowed forward walks key tiles of 128 aligned to the
segment start: a 128-row query tile with a window of 64 + 64 reads three of
them, 384 keys a row for the 129 it needs. Here a query tile of ``BM`` rows
reads the ``BM + left + right`` keys its rows' windows span, from the first one
(tiles of ``BN``, not aligned): 192 a row at ``BM = 64``, ``BN = 32``.
:func:`pays` says where that wins (``select.window_kernel``); long windows
(Mistral's 4,096) stay on FlashAttention-2, whose tiles waste little there.

Contract as ``flash_backward.forward``: ``(out, lse)``, ``lse`` fp32 ``[Hq, Tq]``,
natural log, ``+inf`` for rows that see no key (their output 0), which is what
FlashAttention-2's backward takes. Causal bottom-right aligned, GQA native, any
head dim up to 256 (tiles of the next power of two, masked), windows as the
op's: row ``i`` sees keys ``[i' - left, i' + right]``, ``i' = i + Lk - Lq``.

One program per (query tile of a segment, query head), from a table of the
layout's tiles built once per layout on the host (:func:`tiles`). Every load is
bounded by its segment's rows, so segments stay independent: a NaN reaches only
its own segment's rows.
"""

from __future__ import annotations

import numpy as np
import torch

from . import on_device

__all__ = ["unsupported_reason", "pays", "tiles", "forward", "BLOCK_M"]

BLOCK_M = 64  # query rows per program (the table's unit)
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Measured on the H200 (bench/bench_window.py, bench/results/window.json): 1.8-3.0x
# FlashAttention-2 at head dim 64 for windows spanning 129-513 keys, 1.3-1.4x at
# 128, 1.07x at 96 (a tile of 128 columns). Wider windows and head dims above 128
# are not measured: they stay on FlashAttention-2.
MAX_SPAN = 512
MAX_MEASURED_HEAD_DIM = 128

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why this kernel cannot take a call, or None."""
    if device.type != "cuda":
        return f"the window kernel is CUDA-only, got {device.type}"
    if triton is None:
        return "triton is not installed"
    if dtype not in DTYPES:
        return f"the window kernel takes float16/bfloat16, got {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"the window kernel takes head_dim <= {MAX_HEAD_DIM}, got {head_dim}"
    return None


def pays(causal: bool, window: tuple[int, int], head_dim: int) -> bool:
    """Whether this kernel beats FlashAttention-2's on the call: both sides of the
    window bounded (``causal`` bounds the right at 0), spanning at most
    :data:`MAX_SPAN` keys, head dim at most :data:`MAX_MEASURED_HEAD_DIM`."""
    left, right = window
    right = 0 if causal else right
    return left >= 0 and right >= 0 and left + right + 1 <= MAX_SPAN and head_dim <= MAX_MEASURED_HEAD_DIM


def tiles(cu_q: np.ndarray) -> np.ndarray:
    """int32 ``[P, 2]``: (segment, first row) of every query tile of :data:`BLOCK_M`
    rows of a layout, from its host offsets (empty segments have none)."""
    lens = np.diff(cu_q.astype(np.int64))
    counts = -(-lens // BLOCK_M)
    seg = np.repeat(np.arange(lens.shape[0], dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    rows = (np.arange(seg.shape[0], dtype=np.int64) - first) * BLOCK_M
    return np.stack([seg, rows], 1).astype(np.int32)


def forward(q, k, v, cu_q, cu_k, table: torch.Tensor, causal: bool, scale: float, window: tuple[int, int]):
    """``(out, lse)`` of ``ragged_attention(q, k, v, cu_q, cu_k, causal, scale,
    window_size=window)``. ``table``: :func:`tiles` of the layout on q's device;
    ``cu_q``/``cu_k``: the offsets on the device. The caller checked
    :func:`unsupported_reason`."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((tq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    if tq == 0 or table.shape[0] == 0:
        return out, lse
    # the kernel's addressing: rows of H * D, offsets one after another
    q, k, v, cu_q, cu_k = (t.contiguous() for t in (q, k, v, cu_q, cu_k))
    left, right = window
    bd, bn, warps, stages = _config(d)
    with on_device(q):
        _window_fwd[(table.shape[0], hq)](
            q, k, v, out, lse, table, cu_q, cu_k, float(scale), tq, hq, hkv, hq // hkv, d, left, right,
            CAUSAL=causal, LEFT=left >= 0, RIGHT=right >= 0 and not causal, EXACT_D=bd == d,
            BM=BLOCK_M, BN=bn, BD=bd, num_warps=warps, num_stages=stages,
        )
    return out, lse


def _config(d: int) -> tuple[int, int, int, int]:
    """(head-dim tile, key tile, warps, stages) for head dim ``d``: the fastest of
    ``bench/bench_window.py --sweep`` on the H200 (bench/results/window.json)."""
    bd = max(16, triton.next_power_of_2(d))
    if bd <= 64:
        return bd, 32, 4, 3
    if bd <= 128:
        return bd, 64, 4, 3
    return bd, 32, 8, 2


if triton is not None:

    @triton.jit
    def _window_fwd(
        Q, K, V, O, LSE, TABLE, CU_Q, CU_K, scale, tq, hq, hkv, group, d, left, right,
        CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr, EXACT_D: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):
        at = tl.program_id(0).to(tl.int64) * 2
        seg = tl.load(TABLE + at)
        m0 = tl.load(TABLE + at + 1).to(tl.int64)
        h = tl.program_id(1)
        hk = h // group
        q0 = tl.load(CU_Q + seg).to(tl.int64)
        lq = tl.load(CU_Q + seg + 1).to(tl.int64) - q0
        k0 = tl.load(CU_K + seg).to(tl.int64)
        lk = tl.load(CU_K + seg + 1).to(tl.int64) - k0
        shift = lk - lq  # row i's diagonal key (bottom-right alignment)

        rm = m0 + tl.arange(0, BM)
        rd = tl.arange(0, BD)
        dmask = rd[None, :] < d if not EXACT_D else rd[None, :] < BD
        row_ok = rm < lq
        q = tl.load(Q + (q0 + rm)[:, None] * (hq * d) + h * d + rd[None, :], mask=row_ok[:, None] & dmask, other=0.0)

        # the keys any row of this tile sees
        last = tl.minimum(m0 + BM, lq) - 1
        lo = lk - lk
        hi = lk
        if LEFT:
            lo = tl.maximum(m0 + shift - left, 0)
        if RIGHT:
            hi = tl.minimum(last + shift + right + 1, lk)
        if CAUSAL:
            hi = tl.minimum(hi, last + shift + 1)

        # per row: the first and last key it sees (empty where first > last)
        first_k = tl.zeros([BM], dtype=tl.int64)
        last_k = tl.zeros([BM], dtype=tl.int64) + lk - 1
        if LEFT:
            first_k = tl.maximum(rm + shift - left, 0)
        if RIGHT:
            last_k = tl.minimum(rm + shift + right, lk - 1)
        if CAUSAL:
            last_k = tl.minimum(last_k, rm + shift)

        qk_scale = scale * 1.4426950408889634  # scores in base 2
        m = tl.full([BM], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        for n0 in range(lo, hi, BN):
            rn = n0 + tl.arange(0, BN)
            kmask = (rn < hi)[:, None] & dmask
            offs = (k0 + rn)[:, None] * (hkv * d) + hk * d + rd[None, :]
            kt = tl.load(K + offs, mask=kmask, other=0.0)
            s = tl.dot(q, tl.trans(kt)) * qk_scale
            seen = (rn[None, :] >= first_k[:, None]) & (rn[None, :] <= last_k[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # rows that have seen no key yet keep m = -inf: shift by 0 there
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - base)
            p = tl.math.exp2(s - base[:, None])
            l = l * alpha + tl.sum(p, 1)
            vt = tl.load(V + offs, mask=kmask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new

        # which rows see a key, from the layout (not from l: a NaN must stay NaN)
        sees = row_ok & (first_k <= last_k)
        o = tl.where(sees[:, None], acc / tl.where(sees, l, 1.0)[:, None], 0.0)
        tl.store(O + (q0 + rm)[:, None] * (hq * d) + h * d + rd[None, :], o.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & dmask)
        lse = tl.where(sees, (m + tl.math.log2(tl.where(sees, l, 1.0))) * 0.6931471805599453, float("inf"))
        tl.store(LSE + h.to(tl.int64) * tq + q0 + rm, lse, mask=row_ok)
