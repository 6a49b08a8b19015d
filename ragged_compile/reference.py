"""Reference kernel: exact per-segment attention, float32 accumulation, any device.

The oracle every other kernel is tested against, and the CPU kernel of the op.

Cost: ``O(sum_i Lq_i * Lk_i * Hq * D)`` multiply-adds, at most 4x that after
padding, plus one Python iteration per *group* of segments rather than per
segment. Segments are grouped by (next power of two of Lq, next power of two
of Lk) and each group is padded to its longest member and computed as one
batched masked attention, so thousands of tiny segments cost a handful of
batched matmuls. Groups are split into chunks of at most ``_BUDGET``
score elements, so one long segment never allocates an ``Lq x Lk`` matrix
larger than that. It reads the offsets on the host (a device sync on GPU):
it is a reference, not a hot path.
"""

from __future__ import annotations

import torch

__all__ = ["reference_attention", "dense_attention"]

_BUDGET = 1 << 25  # score elements per chunk (128 MiB of float32)


def _next_pow2(x: torch.Tensor) -> torch.Tensor:
    # 1 -> 1, 2 -> 2, 3 -> 4, 5 -> 8 ...; x >= 1
    return torch.pow(2, torch.ceil(torch.log2(x.double()))).long()


def _attend(qg, kg, vg, allowed, scale, acc):
    """qg [G,R,Hq,D], kg/vg [G,K,Hkv,D], allowed [G,R,K] -> [G,R,Hq,D] in acc dtype."""
    G, R, Hq, D = qg.shape
    Hkv = kg.shape[2]
    grp = Hq // Hkv
    # [G, Hkv, grp, R, D] so GQA needs no copy of k/v per query head.
    qh = qg.to(acc).reshape(G, R, Hkv, grp, D).permute(0, 2, 3, 1, 4)
    kh = kg.to(acc).permute(0, 2, 1, 3).unsqueeze(2)  # [G, Hkv, 1, K, D]
    vh = vg.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [G, Hkv, grp, R, K]
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see no key
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, vh) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return o.permute(0, 3, 1, 2, 4).reshape(G, R, Hq, D)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Ragged attention, exact up to float32 rounding (float64 for float64 inputs).

    Same contract as :func:`ragged_compile.ragged_attention`; arguments are
    assumed valid. Causal masks are aligned bottom-right: query row ``i`` of a
    segment with ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``.
    A row that sees no key is zero.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    Tq, Hq, D = q.shape
    out = torch.zeros(Tq, Hq, D, dtype=q.dtype, device=dev)
    cuq = cu_seqlens_q.to("cpu", torch.int64)
    cuk = cu_seqlens_k.to("cpu", torch.int64)
    lq, lk = cuq[1:] - cuq[:-1], cuk[1:] - cuk[:-1]
    active = torch.nonzero((lq > 0) & (lk > 0)).flatten()
    if active.numel() == 0:
        return out
    key = _next_pow2(lq[active]) * (1 << 32) + _next_pow2(lk[active])
    cuq_d, cuk_d = cuq.to(dev), cuk.to(dev)
    lq_d, lk_d = lq.to(dev), lk.to(dev)
    for group_key in torch.unique(key).tolist():
        idx = active[key == group_key]
        Pq, Pk = int(lq[idx].max()), int(lk[idx].max())
        rows = max(1, _BUDGET // (Hq * Pk))
        row_chunk = min(Pq, rows)
        seg_chunk = max(1, rows // Pq) if rows >= Pq else 1
        idx_d = idx.to(dev)
        kr = torch.arange(Pk, device=dev)
        for s0 in range(0, idx.numel(), seg_chunk):
            ids = idx_d[s0 : s0 + seg_chunk]
            seg_lq, seg_lk = lq_d[ids][:, None], lk_d[ids][:, None]
            kvalid = kr[None, :] < seg_lk  # [G, Pk]
            kpos = torch.where(kvalid, cuk_d[ids][:, None] + kr[None, :], 0)
            kg, vg = k[kpos], v[kpos]
            for r0 in range(0, Pq, row_chunk):
                r = torch.arange(r0, min(r0 + row_chunk, Pq), device=dev)
                qvalid = r[None, :] < seg_lq  # [G, R]
                qpos = torch.where(qvalid, cuq_d[ids][:, None] + r[None, :], 0)
                allowed = kvalid[:, None, :].expand(-1, r.numel(), -1)
                if causal:
                    limit = r[None, :, None] + (seg_lk - seg_lq)[:, :, None]  # [G, R, 1]
                    allowed = allowed & (kr[None, None, :] <= limit)
                o = _attend(q[qpos], kg, vg, allowed, scale, acc)
                out[qpos[qvalid]] = o[qvalid].to(q.dtype)
    return out


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Slow, obviously-correct oracle: one dense softmax per segment, in ``dtype``.

    A Python loop over segments; tests use it to check :func:`reference_attention`
    and the fast kernels on small layouts. Returns ``dtype``.
    """
    Tq, Hq, D = q.shape
    grp = Hq // k.shape[1]
    out = torch.zeros(Tq, Hq, D, dtype=dtype)
    cuq = cu_seqlens_q.tolist()
    cuk = cu_seqlens_k.tolist()
    for i in range(len(cuq) - 1):
        qs = q[cuq[i] : cuq[i + 1]].to("cpu", dtype)
        ks = k[cuk[i] : cuk[i + 1]].to("cpu", dtype).repeat_interleave(grp, dim=1)
        vs = v[cuk[i] : cuk[i + 1]].to("cpu", dtype).repeat_interleave(grp, dim=1)
        Lq, Lk = qs.shape[0], ks.shape[0]
        if Lq == 0 or Lk == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            qi = torch.arange(Lq)[:, None]
            kj = torch.arange(Lk)[None, :]
            s = s.masked_fill(kj > qi + (Lk - Lq), float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)  # rows with every key masked
        out[cuq[i] : cuq[i + 1]] = torch.einsum("hqk,khd->qhd", p, vs)
    return out
