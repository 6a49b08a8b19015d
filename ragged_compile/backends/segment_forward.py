"""The exact attention forward (output and LSE) of chosen segments, written in
place: the repair step of flash-attn-4's forward's isolation by recompute
(fa4_forward.py), which runs the fast kernel on the layout as it is and computes
again only the segments whose output came out non-finite.

:func:`recompute` takes a flag per segment on the device and launches one Triton
program per (q row block, head) over the row-block table of
segment_backward.py (bounded on the host, no sync); a program whose segment is
not flagged returns after reading its flag. A flagged segment is computed from
its own rows only (every load bounded by the segment's length), by the online
softmax of FlashAttention's forward: simple rather than fast, as it runs only
where a segment holds a NaN or an Inf, or sits beside one. Elsewhere (the CPU
tests of the isolation contract) the flagged segments are read on the host and
computed by the reference.
"""

from __future__ import annotations

import torch

from . import on_device, segment_backward

__all__ = ["recompute"]


def recompute(flags, q, k, v, cu_q, cu_k, causal: bool, scale: float, max_lens, out, lse) -> None:
    """Overwrite the rows of flagged segments in ``out`` and ``lse`` with their exact
    values.

    flags: ``[n]`` bool/int on the device, one per segment; q, out: contiguous
    ``[Tq, Hq, D]``; k, v: contiguous ``[Tk, Hkv, D]``; lse: fp32 ``[Hq, Tq]``
    contiguous, natural log, written ``+inf`` for rows that see no key; cu_q, cu_k:
    int32 ``[n + 1]``; max_lens: the longest q and k segment (host ints)."""
    if segment_backward._kernels_run(q.device):
        _launch(flags, q, k, v, cu_q, cu_k, causal, scale, max_lens, out, lse)
    else:
        _on_host(flags, q, k, v, cu_q, cu_k, causal, scale, out, lse)


def _on_host(flags, q, k, v, cu_q, cu_k, causal, scale, out, lse) -> None:
    from ..reference import reference_attention, reference_lse

    for i in flags.nonzero().flatten().tolist():
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        cq = torch.tensor([0, q1 - q0], dtype=torch.int32, device=q.device)
        ck = torch.tensor([0, k1 - k0], dtype=torch.int32, device=q.device)
        args = (q[q0:q1], k[k0:k1], v[k0:k1], cq, ck, causal, scale)
        out[q0:q1] = reference_attention(*args).to(out.dtype)
        lse[:, q0:q1] = reference_lse(*args[:2], cq, ck, causal, scale).to(lse.dtype)


def _launch(flags, q, k, v, cu_q, cu_k, causal, scale, max_lens, out, lse) -> None:
    n = cu_q.numel() - 1
    tq, hq, d = q.shape
    hkv = k.shape[1]
    if n == 0 or tq == 0 or max_lens[0] == 0:
        return
    block, bd, warps = segment_backward._blocks(d)
    flags, cu_q, cu_k = segment_backward._with_spare_segment(flags, q, cu_q, cu_k)
    table = segment_backward._block_table(cu_q[:-1], tq, block)
    with on_device(q):
        _fwd_rows[(table.shape[0], hq)](
            q, k, v, out, lse, table, flags, cu_q, cu_k, float(scale), *segment_backward._bounds(causal),
            tq, hq, hkv, hq // hkv, d, CAUSAL=causal, BM=block, BN=block, BD=bd, num_warps=warps,
        )


if segment_backward.triton is not None:
    import triton
    import triton.language as tl

    from .segment_backward import _block, _segment, _store, _table_entry, _valid

    @triton.jit
    def _fwd_rows(
        Q, K, V, O, LSE, TABLE, FLAGS, CU_Q, CU_K, scale, left, right, tq, hq, hkv, group, d,
        CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):
        # program (q block of a segment, query head): out and LSE of its rows over
        # the segment's keys, by the online softmax
        seg, m0, h = _table_entry(TABLE, BM)
        flagged, q0, lq, k0, lk = _segment(FLAGS, CU_Q, CU_K, seg, False)
        if flagged & (m0 < lq):
            hk = h // group
            rm = m0 + tl.arange(0, BM)
            rd = tl.arange(0, BD)
            q = _block(Q, q0, rm, lq, rd, hq, h, d)
            m = tl.full([BM], float("-inf"), dtype=tl.float32)
            l = tl.zeros([BM], dtype=tl.float32)
            acc = tl.zeros([BM, BD], dtype=tl.float32)
            hi = lk
            if CAUSAL:  # the keys of the block's last row (bottom-right aligned)
                hi = tl.minimum(tl.maximum(m0 + BM + lk - lq, 0), lk)
            for n0 in range(0, hi, BN):
                rn = n0 + tl.arange(0, BN)
                s = tl.dot(q, tl.trans(_block(K, k0, rn, lk, rd, hkv, hk, d))) * scale
                s = tl.where(_valid(rm, rn, lq, lk, left, right), s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                # rows that have seen no key yet keep m = -inf: shift by 0 there
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - shift)
                p = tl.exp(s - shift[:, None])
                l = l * alpha + tl.sum(p, 1)
                v = _block(V, k0, rn, lk, rd, hkv, hk, d)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            # which rows see a key, from the layout (not from l: a NaN must stay NaN)
            seen = (rm < lq) & (lk > 0)
            if CAUSAL:
                seen = seen & (rm + lk - lq >= 0)
            o = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
            _store(O, o, q0, rm, lq, rd, hq, h, d)
            lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("inf"))
            tl.store(LSE + h.to(tl.int64) * tq + q0 + rm, lse, mask=rm < lq)
