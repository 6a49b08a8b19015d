"""Attention backward over segments in Triton: the full backward of soft-capped
attention (no fused CUDA backward caps scores: PyTorch's FlashAttention-2 takes no
softcap), and the repair step of flash-attn-4's isolation by recompute
(fa4_backward.py), which runs the fast kernel on the layout as it is and computes
again only the segments whose gradients came out non-finite.

Two kernels, one program per (row block, head) each, from a table of every
segment's row blocks built on the device (bounded on the host by
``cdiv(T, block) + n``, so no sync, and a grid that grows with the tokens, not
with segment slots x the longest segment): ``dk, dv`` per key block over the query
blocks its keys are seen by, ``dq`` per query block over the keys it sees. Every
load is bounded by the segment's length, so a segment's gradients read nothing
of another's. Probabilities come from the forward's LSE, the row term
``D = rowsum(dO * O)`` from its output, as FlashAttention's backward does; a window
and causal bound both the mask and the blocks a program visits.

:func:`backward` computes every segment. :func:`recompute` takes a flag per
segment on the device; a program whose segment is not flagged returns after
reading its flag, so where nothing is flagged (finite data, the common case) the
step costs two near-empty launches. Elsewhere (the CPU, used by the tests of the
isolation contract) the flagged segments are read on the host and computed by the
reference backward.
"""

from __future__ import annotations

import torch

from . import on_device

__all__ = ["backward", "recompute", "unsupported_reason"]

# "unbounded" for a window side: further than any segment reaches
_FAR = 1 << 40


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why :func:`backward`'s kernels cannot take a call, or None."""
    if device.type != "cuda":
        return "the Triton backward is CUDA-only"
    if triton is None:
        return "triton is not importable"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the Triton backward takes float16/bfloat16 (tl.dot of float32 is TF32), got {dtype}"
    if head_dim > 256:
        return f"the Triton backward takes head_dim <= 256, got {head_dim}"
    return None


def backward(grad_out, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, window=(-1, -1),
             softcap: float = 0.0, config=None):
    """``(dq, dk, dv)`` of attention with soft-capped scores (``softcap`` > 0 caps
    the scaled scores to ``softcap * tanh(s / softcap)``; 0: off) and a window
    (``(left, right)``, -1 unbounded, bottom-right aligned as the op's).

    q, out, grad_out: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``; lse: fp32 ``[Hq, Tq]``,
    natural log of the capped scores' sums, ``+inf`` for rows that see no key;
    cu_q, cu_k: int ``[n + 1]`` on the device. ``config``: the two kernels' tiles
    (:func:`_config` otherwise: the sweep's)."""
    n = cu_q.numel() - 1
    tq, tk = q.shape[0], k.shape[0]
    q, k, v, grad_out, out = (t.contiguous() for t in (q, k, v, grad_out, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if n == 0 or tq == 0 or tk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = torch.empty(q.shape[1], tq, dtype=torch.float32, device=q.device)  # D, [Hq, Tq]: the dq kernel's
    (kv_rows, kv_inner, kv_warps, kv_stages), (q_rows, q_inner, q_warps, q_stages) = config or _config(q.shape[-1])
    flags = torch.ones(1, dtype=torch.int32, device=q.device)  # not read: every segment
    _launch(flags, grad_out, q, k, v, out, lse.contiguous(), delta, cu_q, cu_k, causal, scale, window, softcap,
            (dq, dk, dv), every=True, kv=(kv_rows, kv_inner, kv_warps, kv_stages),
            qs=(q_rows, q_inner, q_warps, q_stages))
    return dq, dk, dv


def _config(d: int):
    """The tiles of :func:`backward`'s two kernels by head dim: ``((key rows a
    program, query rows a step, warps, stages), (query rows a program, key rows a
    step, warps, stages))``."""
    # The fastest of bench_softcap.py --sweep on an H100 (softcap-sweep.json), one
    # stage each: pipelined (num_stages=2), the key-side loop (runtime bounds,
    # transposed register tiles) gave dK and dV that changed from run to run and
    # were wrong by 41% at head dim 128 under Triton 3.6.
    if d <= 128:
        return (64, 64, 4, 1), (64, 32, 4, 1)
    return (32, 32, 4, 1), (64, 32, 4, 1)


def recompute(flags, grad_out, q, k, v, out, lse, cu_q, cu_k, causal: bool, scale: float, max_lens, grads) -> None:
    """Overwrite the rows of flagged segments in ``grads = (dq, dk, dv)`` with their
    exact gradients.

    flags: ``[n]`` bool/int on the device, one per segment; q, out, grad_out, dq:
    contiguous ``[Tq, Hq, D]``; k, v, dk, dv: contiguous ``[Tk, Hkv, D]``; lse: fp32
    ``[Hq, Tq]``, natural log, ``+inf`` for rows that see no key; cu_q, cu_k: int32
    ``[n + 1]``; max_lens: the longest q and k segment (host ints, the grid)."""
    if _kernels_run(q.device):
        if q.shape[0] == 0 or k.shape[0] == 0 or max_lens[0] == 0 or max_lens[1] == 0:
            return  # no segment has both queries and keys: the gradients are zeros already
        block, _, warps = _blocks(q.shape[-1])
        tiles = (block, block, warps, 1)
        _launch(flags, grad_out, q, k, v, out, lse.contiguous(), lse, cu_q, cu_k, causal, scale, (-1, -1), 0.0,
                grads, every=False, kv=tiles, qs=tiles)
    else:
        _on_host(flags, grad_out, q, k, v, cu_q, cu_k, causal, scale, grads)


def _kernels_run(device: torch.device) -> bool:
    # a seam: CPU tests run the kernels under Triton's interpreter
    return device.type == "cuda" and triton is not None


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


def _blocks(d: int) -> tuple[int, int, int]:
    """The recompute's (rows per block, head-dim block, warps) for head dim ``d``:
    small tiles, as the accumulators of a 256-wide head live in registers too."""
    bd = _head_block(d)
    return (64, bd, 4) if bd <= 64 else (32, bd, 4) if bd <= 128 else (16, bd, 4)


def _head_block(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _block_table(cu: torch.Tensor, total: int, block: int) -> torch.Tensor:
    """int32 ``[bound, 2]``: the (segment, block within it) of each row block of one
    side, on the device without a sync. ``bound = cdiv(total, block) + n`` (each
    segment ends at most one partial block) is the host's grid, so it grows with the
    tokens, not with segment slots x the longest segment; the spare entries name
    segment ``n``, which has no rows and is never flagged."""
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
    """Flags and int32 offsets with a segment ``n`` appended (the block tables'
    spare blocks): never flagged, no rows."""
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the Triton kernels take float16/bfloat16 on CUDA (tl.dot of float32 is TF32), got {q.dtype}")
    flags = torch.cat([flags.to(torch.int32), flags.new_zeros(1, dtype=torch.int32)])
    cu_q, cu_k = (torch.cat([c, c[-1:]]).to(torch.int32).contiguous() for c in (cu_q, cu_k))
    return flags, cu_q, cu_k


def _bounds(causal: bool, window=(-1, -1)) -> tuple[int, int]:
    """The kernels' (left, right): how far a query row's keys reach either side of
    its bottom-right-aligned diagonal (causal is right 0; unbounded is far)."""
    left, right = window
    return (_FAR if left < 0 else left), (0 if causal else _FAR if right < 0 else right)


def _launch(flags, grad_out, q, k, v, out, lse, delta, cu_q, cu_k, causal, scale, window, softcap, grads, *,
            every: bool, kv, qs) -> None:
    """Both kernels over the segments of ``cu_q``/``cu_k`` (with a spare segment
    ``n`` appended: the block tables' spare blocks, no rows, never flagged).
    ``every``: every segment, the dq kernel (launched first) writing ``D`` into
    ``delta`` for the dk, dv kernel; else the flagged ones, each kernel taking
    ``D`` from ``out``. ``kv``/``qs``: each kernel's (rows a program, rows a step, warps,
    stages)."""
    dq, dk, dv = grads
    same = cu_k is cu_q  # self-attention: one block table where the blocks agree
    tq, hq, d = q.shape
    tk, hkv = k.shape[0], k.shape[1]
    flags, cu_q, cu_k = _with_spare_segment(flags, q, cu_q, cu_k)
    table_k = _block_table(cu_k[:-1], tk, kv[0])
    table_q = table_k if same and qs[0] == kv[0] else _block_table(cu_q[:-1], tq, qs[0])
    common = (flags, cu_q, cu_k, float(scale), float(softcap), *_bounds(causal, window), tq, hq, hkv, hq // hkv, d)
    bd = _head_block(d)
    with on_device(q):
        _dq_rows[(table_q.shape[0], hq)](
            q, k, v, out, grad_out, lse, delta, dq, table_q, *common,
            EVERY=every, CAP=bool(softcap), BM=qs[0], BN=qs[1], BD=bd, num_warps=qs[2], num_stages=qs[3],
        )
        _dk_dv_rows[(table_k.shape[0], hkv)](
            q, k, v, out, grad_out, lse, delta, dk, dv, table_k, *common,
            EVERY=every, CAP=bool(softcap), BM=kv[1], BN=kv[0], BD=bd, num_warps=kv[2], num_stages=kv[3],
        )


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


if triton is not None:
    # Module level, so the kernels find their helpers by name; Triton's interpreter
    # (TRITON_INTERPRET=1) applies when set before this module is imported.

    @triton.jit
    def _table_entry(TABLE, B: tl.constexpr):
        # (segment, first row of the block within it, head) of this program
        at = tl.program_id(0).to(tl.int64) * 2
        return tl.load(TABLE + at), tl.load(TABLE + at + 1).to(tl.int64) * B, tl.program_id(1)

    @triton.jit
    def _segment(FLAGS, CU_Q, CU_K, seg, EVERY: tl.constexpr):
        q0 = tl.load(CU_Q + seg).to(tl.int64)
        k0 = tl.load(CU_K + seg).to(tl.int64)
        lq = tl.load(CU_Q + seg + 1).to(tl.int64) - q0
        lk = tl.load(CU_K + seg + 1).to(tl.int64) - k0
        if EVERY:
            run = lk >= 0
        else:
            run = tl.load(FLAGS + seg) != 0
        return run, q0, lq, k0, lk

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
    def _query_rows(Q, O, DO, LSE, DELTA, q0, rm, lq, rd, tq, hq, h, d, FROM_O: tl.constexpr):
        # a q block's rows, its output gradient, D = rowsum(dO * O) (from O, or as the
        # dq kernel stored it) and its LSE
        q = _block(Q, q0, rm, lq, rd, hq, h, d)
        do = _block(DO, q0, rm, lq, rd, hq, h, d)
        at = h.to(tl.int64) * tq + q0 + rm
        if FROM_O:
            delta = tl.sum(do.to(tl.float32) * _block(O, q0, rm, lq, rd, hq, h, d).to(tl.float32), 1)
        else:
            delta = tl.load(DELTA + at, mask=rm < lq, other=0.0)
        lse = tl.load(LSE + at, mask=rm < lq, other=float("inf"))
        return q, do, delta, lse

    @triton.jit
    def _valid(rm, rn, lq, lk, left, right):
        # the (query row, key) pairs of a tile inside the segment and the window: the
        # key's offset from the bottom-right-aligned diagonal in [-left, right]
        rel = rn[None, :] - rm[:, None] - (lk - lq)
        return (rm[:, None] < lq) & (rn[None, :] < lk) & (rel <= right) & (rel >= -left)

    @triton.jit
    def _tile(q, k, v, do, delta, lse, rm, rn, lq, lk, scale, cap, left, right, CAP: tl.constexpr):
        # P and dS of one (q block, k block) tile: P zero outside _valid and where
        # lse = +inf (no key)
        valid = _valid(rm, rn, lq, lk, left, right)
        s = tl.dot(q, tl.trans(k)) * scale
        if CAP:
            t = 2.0 / (1.0 + tl.exp(-2.0 * s / cap)) - 1.0  # tanh(s / cap)
            s = cap * t
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        if CAP:
            ds = ds * (1.0 - t * t)
        return p, ds

    @triton.jit
    def _dk_dv_rows(
        Q, K, V, O, DO, LSE, DELTA, DK, DV, TABLE, FLAGS, CU_Q, CU_K, scale, cap, left, right, tq, hq, hkv, group, d,
        EVERY: tl.constexpr, CAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):
        # program (k block of a segment, kv head): dk, dv of its rows over the group's
        # query heads and the q blocks whose window reaches its keys
        seg, n0, hk = _table_entry(TABLE, BN)
        run, q0, lq, k0, lk = _segment(FLAGS, CU_Q, CU_K, seg, EVERY)
        if run & (n0 < lk):
            rn = n0 + tl.arange(0, BN)
            rd = tl.arange(0, BD)
            k = _block(K, k0, rn, lk, rd, hkv, hk, d)
            v = _block(V, k0, rn, lk, rd, hkv, hk, d)
            dk = tl.zeros([BN, BD], dtype=tl.float32)
            dv = tl.zeros([BN, BD], dtype=tl.float32)
            off = lk - lq
            m_lo = tl.maximum(n0 - off - right, 0)  # the first query row whose window reaches key n0
            m_hi = tl.minimum(n0 + BN - off + left, lq)  # past the last that reaches key n0 + BN - 1
            for g in range(0, group):
                h = hk * group + g
                for m0 in range((m_lo // BM) * BM, m_hi, BM):
                    rm = m0 + tl.arange(0, BM)
                    q, do, delta, lse = _query_rows(Q, O, DO, LSE, DELTA, q0, rm, lq, rd, tq, hq, h, d, not EVERY)
                    p, ds = _tile(q, k, v, do, delta, lse, rm, rn, lq, lk, scale, cap, left, right, CAP)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            _store(DK, dk * scale, k0, rn, lk, rd, hkv, hk, d)
            _store(DV, dv, k0, rn, lk, rd, hkv, hk, d)

    @triton.jit
    def _dq_rows(
        Q, K, V, O, DO, LSE, DELTA, DQ, TABLE, FLAGS, CU_Q, CU_K, scale, cap, left, right, tq, hq, hkv, group, d,
        EVERY: tl.constexpr, CAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    ):
        # program (q block of a segment, query head): dq of its rows over the keys
        # its window reaches
        seg, m0, h = _table_entry(TABLE, BM)
        run, q0, lq, k0, lk = _segment(FLAGS, CU_Q, CU_K, seg, EVERY)
        if run & (m0 < lq):
            hk = h // group
            rm = m0 + tl.arange(0, BM)
            rd = tl.arange(0, BD)
            q, do, delta, lse = _query_rows(Q, O, DO, LSE, DELTA, q0, rm, lq, rd, tq, hq, h, d, True)
            if EVERY:  # for the dk, dv kernel, launched after this one
                tl.store(DELTA + h.to(tl.int64) * tq + q0 + rm, delta, mask=rm < lq)
            dq = tl.zeros([BM, BD], dtype=tl.float32)
            off = lk - lq
            n_lo = tl.maximum(m0 + off - left, 0)  # the first key row m0's window reaches
            n_hi = tl.minimum(m0 + BM + off + right, lk)  # past the last that row m0 + BM - 1 reaches
            for n0 in range((n_lo // BN) * BN, n_hi, BN):
                rn = n0 + tl.arange(0, BN)
                k = _block(K, k0, rn, lk, rd, hkv, hk, d)
                v = _block(V, k0, rn, lk, rd, hkv, hk, d)
                p, ds = _tile(q, k, v, do, delta, lse, rm, rn, lq, lk, scale, cap, left, right, CAP)
                dq += tl.dot(ds.to(k.dtype), k)
            _store(DQ, dq * scale, q0, rm, lq, rd, hq, h, d)
