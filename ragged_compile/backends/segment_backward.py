"""The exact attention backward of chosen segments, written in place: the repair
step of flash-attn-4's isolation by recompute (fa4_backward.py), which runs the
fast kernel on the layout as it is and computes again only the segments whose
gradients came out non-finite.

:func:`recompute` takes a flag per segment on the device. On CUDA (with triton)
two Triton kernels launch one program per (row block, head), the row blocks of
every segment laid out on the device (a table bounded on the host by
``cdiv(T, block) + n``, so no sync, and a grid that grows with the tokens, not
with segment slots x the longest segment), and a program whose segment is not
flagged returns after reading its flag: where nothing is flagged (finite data,
the common case) the step costs two near-empty launches.
A flagged segment is computed from its own rows only (every load is bounded by
the segment's length), the probabilities from the forward's LSE, the row term
``D = rowsum(dO * O)`` from the forward's output, as FlashAttention's backward
does. The kernels favour being simple over being fast: they run where a segment
holds a NaN or an Inf, or sits beside one. Elsewhere (the CPU, used by the tests
of the isolation contract) the flagged segments are read on the host and
computed by the reference backward.
"""

from __future__ import annotations

import torch

from . import on_device

__all__ = ["recompute"]


def recompute(flags, grad_out, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, max_lens, grads) -> None:
    """Overwrite the rows of flagged segments in ``grads = (dq, dk, dv)`` with their
    exact gradients.

    flags: ``[n]`` bool/int on the device, one per segment; q, out, grad_out, dq:
    contiguous ``[Tq, Hq, D]``; k, v, dk, dv: contiguous ``[Tk, Hkv, D]``; lse: fp32
    ``[Hq, Tq]``, natural log, ``+inf`` for rows that see no key; cu_q, cu_k: int32
    ``[n + 1]``; max_lens: the longest q and k segment (host ints, the grid)."""
    if _kernels_run(q.device):
        _launch(flags, grad_out, q, k, v, out, lse, cu_q, cu_k, causal, scale, max_lens, grads)
    else:
        _on_host(flags, grad_out, q, k, v, cu_q, cu_k, causal, scale, grads)


def _kernels_run(device: torch.device) -> bool:
    # a seam: CPU tests run the kernels under Triton's interpreter
    return device.type == "cuda" and _triton() is not None


def _on_host(flags, grad_out, q, k, v, cu_q, cu_k, causal, scale, grads) -> None:
    from ..reference import reference_attention_backward

    dq, dk, dv = grads
    for i in flags.nonzero().flatten().tolist():
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        cq = torch.tensor([0, q1 - q0], dtype=torch.int32, device=q.device)
        ck = torch.tensor([0, k1 - k0], dtype=torch.int32, device=q.device)
        got = reference_attention_backward(grad_out[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], cq, ck, causal, scale)
        for g, x, (a, b) in zip((dq, dk, dv), got, ((q0, q1), (k0, k1), (k0, k1))):
            g[a:b] = x.to(g.dtype)


def _blocks(d: int, triton) -> tuple[int, int, int]:
    """(rows per block, head-dim block, warps) for head dim ``d``: small tiles, as
    the accumulators of a 256-wide head live in registers too."""
    bd = max(16, triton.next_power_of_2(d))
    return (64, bd, 4) if bd <= 64 else (32, bd, 4) if bd <= 128 else (16, bd, 4)


def _block_table(cu: torch.Tensor, total: int, block: int) -> torch.Tensor:
    """int32 ``[bound, 2]``: the (segment, block within it) of each row block of one
    side, on the device without a sync. ``bound = cdiv(total, block) + n`` (each
    segment ends at most one partial block) is the host's grid, so it grows with the
    tokens, not with segment slots x the longest segment; the spare entries name
    segment ``n``, which is never flagged."""
    n = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    counts = (lens + (block - 1)) // block
    bound = -(-total // block) + n
    counts = torch.cat([counts, (bound - counts.sum()).view(1)])  # sums to bound exactly
    seg = torch.repeat_interleave(torch.arange(n + 1, device=cu.device, dtype=torch.int32), counts,
                                  output_size=bound)
    first = (counts.cumsum(0) - counts).to(torch.int32)
    idx = torch.arange(bound, device=cu.device, dtype=torch.int32) - first[seg.long()]
    return torch.stack([seg, idx], 1).contiguous()


def _with_spare_segment(flags, q, cu_q, cu_k):
    """What both recompute launches start from: the block shape for q's head dim, and
    flags and offsets with a segment n appended (the block tables' spare blocks):
    never flagged, no rows."""
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the recompute kernels take float16/bfloat16 on CUDA (tl.dot of float32 is TF32), got {q.dtype}")
    flags = torch.cat([flags.to(torch.int32), flags.new_zeros(1, dtype=torch.int32)])
    cu_q, cu_k = (torch.cat([c, c[-1:]]).to(torch.int32).contiguous() for c in (cu_q, cu_k))
    return _blocks(q.shape[-1], triton), flags, cu_q, cu_k


def _launch(flags, grad_out, q, k, v, out, lse, cu_q, cu_k, causal, scale, max_lens, grads) -> None:
    _, dk_dv, dq_rows = _triton()
    dq, dk, dv = grads
    same = cu_k is cu_q  # self-attention: one block table
    n = cu_q.numel() - 1
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    if n == 0 or tq == 0 or tk == 0 or max_lens[0] == 0 or max_lens[1] == 0:
        return  # no segment has both queries and keys: the gradients are zeros already
    (block, bd, warps), flags, cu_q, cu_k = _with_spare_segment(flags, q, cu_q, cu_k)
    table_q = _block_table(cu_q[:-1], tq, block)
    table_k = table_q if same else _block_table(cu_k[:-1], tk, block)
    common = (flags, cu_q, cu_k, float(scale), tq, hq, hkv, hq // hkv, d)
    with on_device(q):
        dk_dv[(table_k.shape[0], hkv)](
            q, k, v, out, grad_out, lse.contiguous(), dk, dv, table_k, *common,
            CAUSAL=causal, BM=block, BN=block, BD=bd, num_warps=warps,
        )
        dq_rows[(table_q.shape[0], hq)](
            q, k, v, out, grad_out, lse.contiguous(), dq, table_q, *common,
            CAUSAL=causal, BM=block, BN=block, BD=bd, num_warps=warps,
        )


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def _triton():
    return None if triton is None else (triton, _dk_dv_rows, _dq_rows)


if triton is not None:
    # Module level, so the kernels find their helpers by name; Triton's interpreter
    # (TRITON_INTERPRET=1) applies when set before this module is imported.

    @triton.jit
    def _table_entry(TABLE, B: tl.constexpr):
        # (segment, first row of the block within it, head) of this program
        at = tl.program_id(0).to(tl.int64) * 2
        return tl.load(TABLE + at), tl.load(TABLE + at + 1).to(tl.int64) * B, tl.program_id(1)

    @triton.jit
    def _segment(FLAGS, CU_Q, CU_K, seg):
        q0 = tl.load(CU_Q + seg).to(tl.int64)
        k0 = tl.load(CU_K + seg).to(tl.int64)
        lq = tl.load(CU_Q + seg + 1).to(tl.int64) - q0
        lk = tl.load(CU_K + seg + 1).to(tl.int64) - k0
        return tl.load(FLAGS + seg) != 0, q0, lq, k0, lk

    @triton.jit
    def _block(X, start, r, n, rd, heads, h, d):
        # rows start + r (r < n) of head h of a [T, heads, d] tensor, zero elsewhere
        mask = (r[:, None] < n) & (rd[None, :] < d)
        return tl.load(X + (start + r)[:, None] * (heads * d) + h * d + rd[None, :], mask=mask, other=0.0)

    @triton.jit
    def _store(X, value, start, r, n, rd, heads, h, d):
        mask = (r[:, None] < n) & (rd[None, :] < d)
        tl.store(X + (start + r)[:, None] * (heads * d) + h * d + rd[None, :], value.to(X.dtype.element_ty), mask=mask)

    @triton.jit
    def _query_rows(Q, O, DO, LSE, q0, rm, lq, rd, tq, hq, h, d):
        # a q block's rows, its output gradient, D = rowsum(dO * O) and its LSE
        q = _block(Q, q0, rm, lq, rd, hq, h, d)
        do = _block(DO, q0, rm, lq, rd, hq, h, d)
        delta = tl.sum(do.to(tl.float32) * _block(O, q0, rm, lq, rd, hq, h, d).to(tl.float32), 1)
        lse = tl.load(LSE + h.to(tl.int64) * tq + q0 + rm, mask=rm < lq, other=float("inf"))
        return q, do, delta, lse

    @triton.jit
    def _valid(rm, rn, lq, lk, CAUSAL: tl.constexpr):
        # the (query row, key) pairs of a tile inside the segment, at or below the
        # bottom-right-aligned diagonal when causal
        valid = (rm[:, None] < lq) & (rn[None, :] < lk)
        if CAUSAL:
            valid = valid & (rn[None, :] <= rm[:, None] + (lk - lq))
        return valid

    @triton.jit
    def _tile(q, k, v, do, delta, lse, rm, rn, lq, lk, scale, CAUSAL: tl.constexpr):
        # P and dS of one (q block, k block) tile: P zero outside the segment, above
        # the bottom-right-aligned diagonal when causal, and where lse = +inf (no key)
        s = tl.dot(q, tl.trans(k)) * scale
        p = tl.where(_valid(rm, rn, lq, lk, CAUSAL), tl.exp(s - lse[:, None]), 0.0)
        return p, p * (tl.dot(do, tl.trans(v)) - delta[:, None])

    @triton.jit
    def _dk_dv_rows(
        Q, K, V, O, DO, LSE, DK, DV, TABLE, FLAGS, CU_Q, CU_K, scale, tq, hq, hkv, group, d,
        CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):
        # program (k block of a segment, kv head): dk, dv of its rows over the group's
        # query heads and every q block of the segment
        seg, n0, hk = _table_entry(TABLE, BN)
        flagged, q0, lq, k0, lk = _segment(FLAGS, CU_Q, CU_K, seg)
        if flagged & (n0 < lk):
            rn = n0 + tl.arange(0, BN)
            rd = tl.arange(0, BD)
            k = _block(K, k0, rn, lk, rd, hkv, hk, d)
            v = _block(V, k0, rn, lk, rd, hkv, hk, d)
            dk = tl.zeros([BN, BD], dtype=tl.float32)
            dv = tl.zeros([BN, BD], dtype=tl.float32)
            for g in range(0, group):
                h = hk * group + g
                for m0 in range(0, lq, BM):
                    rm = m0 + tl.arange(0, BM)
                    q, do, delta, lse = _query_rows(Q, O, DO, LSE, q0, rm, lq, rd, tq, hq, h, d)
                    p, ds = _tile(q, k, v, do, delta, lse, rm, rn, lq, lk, scale, CAUSAL)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            _store(DK, dk * scale, k0, rn, lk, rd, hkv, hk, d)
            _store(DV, dv, k0, rn, lk, rd, hkv, hk, d)

    @triton.jit
    def _dq_rows(
        Q, K, V, O, DO, LSE, DQ, TABLE, FLAGS, CU_Q, CU_K, scale, tq, hq, hkv, group, d,
        CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):
        # program (q block of a segment, query head): dq of its rows over the segment's keys
        seg, m0, h = _table_entry(TABLE, BM)
        flagged, q0, lq, k0, lk = _segment(FLAGS, CU_Q, CU_K, seg)
        if flagged & (m0 < lq):
            hk = h // group
            rm = m0 + tl.arange(0, BM)
            rd = tl.arange(0, BD)
            q, do, delta, lse = _query_rows(Q, O, DO, LSE, q0, rm, lq, rd, tq, hq, h, d)
            dq = tl.zeros([BM, BD], dtype=tl.float32)
            for n0 in range(0, lk, BN):
                rn = n0 + tl.arange(0, BN)
                k = _block(K, k0, rn, lk, rd, hkv, hk, d)
                p, ds = _tile(q, k, _block(V, k0, rn, lk, rd, hkv, hk, d), do, delta, lse, rm, rn, lq, lk, scale, CAUSAL)
                dq += tl.dot(ds.to(k.dtype), k)
            _store(DQ, dq * scale, q0, rm, lq, rd, hq, h, d)
