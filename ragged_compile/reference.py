"""Reference kernel: exact per-segment attention, float32 accumulation, any device.

The oracle every other kernel is tested against (the op's CPU kernel is
backends/cpu.py; ``RAGGED_COMPILE_REFERENCE=1`` makes the op run this one).
Segments are isolated: padding is selected to zero before any arithmetic, so a
NaN or inf in one segment changes no value of another, forward or backward.

Cost: ``O(sum_i Lq_i * Lk_i * Hq * D)`` multiply-adds, at most 4x that after
padding, plus one Python iteration per *group* of segments rather than per
segment. Segments are grouped by (next power of two of Lq, next power of two
of Lk) and each group is padded to its longest member and computed as one
batched masked attention, so thousands of tiny segments cost a handful of
batched matmuls. Groups are split into chunks of at most ``_BUDGET``
score elements, so one long segment never allocates an ``Lq x Lk`` matrix
larger than that. It reads the offsets on the host (a device sync on GPU):
it is a reference, not a hot path.

Variants (every function here takes them as keywords, default off):

* ``window_size=(left, right)``: query row ``i`` of a segment with ``Lq``
  queries and ``Lk`` keys sees key ``j`` when ``i' - left <= j <= i' + right``,
  ``i' = i + Lk - Lq`` (the bottom-right alignment causal uses); ``-1`` is
  unbounded; ``causal`` caps ``right`` at 0.
* ``softcap > 0``: scores (scale applied) become ``softcap * tanh(s / softcap)``
  before the softmax (Gemma2); 0 is off.
* ``sinks``: ``[Hq]`` per-head logits that join every row's softmax denominator
  and add no value (gpt-oss); a row that sees no key is still zero. The
  backward returns their gradient as a fourth result.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "reference_attention", "reference_attention_backward", "reference_lse",
    "reference_dropout_attention", "reference_dropout_backward", "dropout_keep",
    "dense_attention", "dense_lse", "dense_gradients", "sees_key",
]

_BUDGET = 1 << 25  # score elements per chunk (128 MiB of float32)


def _next_pow2(x: torch.Tensor) -> torch.Tensor:
    # 1 -> 1, 2 -> 2, 3 -> 4, 5 -> 8 ...; x >= 1
    return torch.pow(2, torch.ceil(torch.log2(x.double()))).long()


def _heads(qg, kg, vg, acc):
    """[G,R,Hq,D], [G,K,Hkv,D] -> [G,Hkv,grp,R,D], [G,Hkv,1,K,D]: GQA without copying k/v."""
    G, R, Hq, D = qg.shape
    Hkv = kg.shape[2]
    qh = qg.to(acc).reshape(G, R, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)
    kh = kg.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    vh = vg.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    return qh, kh, vh


def _unheads(x, G, R, Hq, D):
    return x.permute(0, 3, 1, 2, 4).reshape(G, R, Hq, D)


def _limits(causal: bool, window_size) -> tuple[int, int]:
    """(left, right) of a call, -1 unbounded, with causal's cap of right at 0."""
    left, right = (int(w) for w in window_size)
    return left, (0 if causal else right)


def _window_mask(rows, keys, shift, left: int, right: int):
    """Bool mask of keys ``keys`` each row ``rows`` sees, ``shift`` = Lk - Lq (broadcast)."""
    pos = rows + shift  # i': the row in key coordinates
    allowed = None
    if right >= 0:
        allowed = keys <= pos + right
    if left >= 0:
        low = keys >= pos - left
        allowed = low if allowed is None else allowed & low
    return allowed


def _cap(s, softcap: float):
    """Soft-capped scores, and tanh(s / softcap) for the backward (None: no cap)."""
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _probs(qh, kh, allowed, scale, softcap=0.0, sinks=None):
    """Normalised attention probabilities [G,Hkv,grp,R,K], tanh of the capped scores
    (or None) and the sinks' probabilities [G,Hkv,grp,R,1] (or None); rows that see
    no key are 0."""
    s, t = _cap(torch.matmul(qh, kh.transpose(-1, -2)) * scale, softcap)
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(s.dtype).reshape(1, kh.shape[1], -1, 1, 1)  # [1, Hkv, grp, 1, 1]
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    p_sink = None
    if sinks is not None:
        e_sink = torch.exp(sink - m)
        keyless = ~allowed.any(-1)[:, None, None, :, None]  # a row that sees no key stays zero, its sink too
        denom = denom + e_sink
        p_sink = torch.where(keyless, 0.0, e_sink / denom)
    return p / torch.where(denom > 0, denom, torch.ones_like(denom)), t, p_sink


def _chunks(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size=(-1, -1)):
    """Yield (qpos [G,R], qvalid, kpos [G,K], kvalid, allowed [G,R,K]) over every
    group of similar-length segments, in chunks of at most ``_BUDGET`` scores."""
    dev = q.device
    Hq = q.shape[1]
    left, right = _limits(causal, window_size)
    cuq = cu_seqlens_q.to("cpu", torch.int64)
    cuk = cu_seqlens_k.to("cpu", torch.int64)
    lq, lk = cuq[1:] - cuq[:-1], cuk[1:] - cuk[:-1]
    active = torch.nonzero((lq > 0) & (lk > 0)).flatten()
    if active.numel() == 0:
        return
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
            for r0 in range(0, Pq, row_chunk):
                r = torch.arange(r0, min(r0 + row_chunk, Pq), device=dev)
                qvalid = r[None, :] < seg_lq  # [G, R]
                qpos = torch.where(qvalid, cuq_d[ids][:, None] + r[None, :], 0)
                allowed = kvalid[:, None, :].expand(-1, r.numel(), -1)
                window = _window_mask(r[None, :, None], kr[None, None, :], (seg_lk - seg_lq)[:, :, None], left, right)
                if window is not None:
                    allowed = allowed & window
                yield qpos, qvalid, kpos, kvalid, allowed


def sees_key(cu_q, cu_k, rows: int, causal: bool, window_size=(-1, -1)) -> torch.Tensor:
    """Bool [rows]: whether each q row sees at least one key (rows past the layout: False).

    A row is blind when its k/v segment is empty or, bottom-right aligned, when
    it lies above the diagonal (shifted by the window's ``right``; causal: 0) of
    a segment with Lq > Lk. A window's ``left`` never blinds a row: row
    ``Lq - 1`` sits on key ``Lk - 1``.
    """
    _, right = _limits(causal, window_size)
    lq = (cu_q[1:] - cu_q[:-1]).long()
    lk = (cu_k[1:] - cu_k[:-1]).long()
    above = (lq - lk - right).clamp(min=0).minimum(lq) if right >= 0 else torch.zeros_like(lq)
    blind = torch.where(lk == 0, lq, above)
    # Per row: its segment's start plus blind count; a row sees a key iff its
    # position within the segment is >= the blind rows at the segment's top.
    seg = torch.repeat_interleave(torch.arange(lq.numel()), lq)
    pos = torch.arange(seg.numel()) - cu_q[:-1].long()[seg]
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[: seg.numel()] = pos >= blind[seg]
    return mask


def _rows(x, pos, valid):
    # Padding positions gather token 0, which may belong to another segment.
    # Select zeros there before any matmul: 0 * NaN is NaN, so masking products
    # afterwards (or by multiplying with 0) would carry its NaN/inf into this
    # segment's scores, outputs and gradients.
    return torch.where(valid[:, :, None, None], x[pos], 0)


def _gather_kv(k, v, kpos, kvalid):
    return _rows(k, kpos, kvalid), _rows(v, kpos, kvalid)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged attention, exact up to float32 rounding (float64 for float64 inputs).

    Same contract as :func:`ragged_compile.ragged_attention`; arguments are
    assumed valid. Causal masks are aligned bottom-right: query row ``i`` of a
    segment with ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq``.
    A row that sees no key is zero. Variants: see the module docstring.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    Tq, Hq, D = q.shape
    out = torch.zeros(Tq, Hq, D, dtype=q.dtype, device=q.device)
    for qpos, qvalid, kpos, kvalid, allowed in _chunks(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size):
        kg, vg = _gather_kv(k, v, kpos, kvalid)
        qh, kh, vh = _heads(_rows(q, qpos, qvalid), kg, vg, acc)
        p = _probs(qh, kh, allowed, scale, softcap, sinks)[0]
        o = _unheads(torch.matmul(p, vh), *qpos.shape, Hq, D)
        out[qpos[qvalid]] = o[qvalid].to(q.dtype)
    return out


def reference_attention_backward(
    grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, *, window_size=(-1, -1), softcap=0.0, sinks=None,
):
    """Exact gradients (dq, dk, dv) of :func:`reference_attention`, same cost; with
    ``sinks``, (dq, dk, dv, dsinks), dsinks in the sinks' dtype.

    Recomputes the probabilities P per chunk; with O = P V and dO given:
    dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)) * scale,
    dQ = dS K, dK = dS^T Q (GQA: summed over the query heads of a k/v head).
    Soft-capping multiplies dS by ``1 - tanh^2``; a sink's gradient is
    ``-sum_rows P_sink * rowsum(dO * O)``.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    Tq, Hq, D = q.shape
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    dsinks = None if sinks is None else torch.zeros(Hq, dtype=acc, device=q.device)
    for qpos, qvalid, kpos, kvalid, allowed in _chunks(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window_size):
        G, R = qpos.shape
        kg, vg = _gather_kv(k, v, kpos, kvalid)
        go = _rows(grad_out, qpos, qvalid)  # padding rows: no gradient
        qh, kh, vh = _heads(_rows(q, qpos, qvalid), kg, vg, acc)
        goh = _heads(go, kg, vg, acc)[0]
        p, t, p_sink = _probs(qh, kh, allowed, scale, softcap, sinks)
        o = torch.matmul(p, vh)
        dp = torch.matmul(goh, vh.transpose(-1, -2))
        d_row = (goh * o).sum(-1, keepdim=True)
        ds = p * (dp - d_row) * scale
        if t is not None:
            ds = ds * (1 - t * t)
        if dsinks is not None:
            dsinks -= (p_sink * d_row).sum((0, 3, 4)).reshape(Hq)
        dq_g = _unheads(torch.matmul(ds, kh), G, R, Hq, D)
        dk_g = torch.matmul(ds.transpose(-1, -2), qh).sum(2).permute(0, 2, 1, 3)  # [G,K,Hkv,D]
        dv_g = torch.matmul(p.transpose(-1, -2), goh).sum(2).permute(0, 2, 1, 3)
        dq.index_put_((qpos[qvalid],), dq_g[qvalid], accumulate=True)
        dk.index_put_((kpos[kvalid],), dk_g[kvalid], accumulate=True)
        dv.index_put_((kpos[kvalid],), dv_g[kvalid], accumulate=True)
    grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return grads if sinks is None else grads + (dsinks.to(sinks.dtype),)


def _dense_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dtype, device, window_size=(-1, -1), softcap=0.0):
    """Yield (q rows slice, k rows slice, scores [Hq, Lq, Lk], k and v [Lk, Hq, D],
    tanh of the capped scores or None) per non-empty segment, in ``dtype`` on
    ``device``; k/v heads repeated for GQA; masked scores are -inf."""
    grp = q.shape[1] // k.shape[1]
    left, right = (int(w) for w in window_size)
    cuq = cu_seqlens_q.tolist()
    cuk = cu_seqlens_k.tolist()
    for i in range(len(cuq) - 1):
        Lq, Lk = cuq[i + 1] - cuq[i], cuk[i + 1] - cuk[i]
        if Lq == 0 or Lk == 0:
            continue
        rows, keys = slice(cuq[i], cuq[i + 1]), slice(cuk[i], cuk[i + 1])
        qs = q[rows].to(device, dtype)
        ks = k[keys].to(device, dtype).repeat_interleave(grp, dim=1)
        vs = v[keys].to(device, dtype).repeat_interleave(grp, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        t = None
        if softcap:
            t = torch.tanh(s / softcap)
            s = softcap * t
        # Row i, in key coordinates i + Lk - Lq (bottom-right), sees key j when
        # j <= it (causal), j <= it + right and j >= it - left (a window).
        qi = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)
        kj = torch.arange(Lk, device=device)[None, :]
        hidden = torch.zeros(Lq, Lk, dtype=torch.bool, device=device)
        if causal:
            hidden |= kj > qi
        if right >= 0:
            hidden |= kj > qi + right
        if left >= 0:
            hidden |= kj < qi - left
        yield rows, keys, s.masked_fill(hidden, float("-inf")), ks, vs, t


def _softmax(s, sinks=None, *, with_sink: bool = False):
    """Softmax over keys; with sinks [Hq] a column per head joins the denominator
    (``with_sink``: also its probability [Hq, Lq, 1]). Rows with every key masked: 0."""
    if sinks is None:
        return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    col = sinks.to(s.device, s.dtype)[:, None, None].expand(-1, s.shape[1], 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)
    p = torch.where((s == -math.inf).all(-1, keepdim=True), 0.0, p)
    return (p[..., :-1], p[..., -1:]) if with_sink else p[..., :-1]


# -- attention dropout ------------------------------------------------------------------


def dropout_keep(seed: int, segment: int, shape, dropout_p: float, device) -> torch.Tensor:
    """The keep mask (bool ``shape``, ``[Hq, Lq, Lk]``) of the ``segment``-th non-empty
    segment of a call whose dropout seed is ``seed``: each segment draws from its
    own generator, so its mask depends on nothing else in the batch, and the
    backward draws it again."""
    g = torch.Generator(device=device).manual_seed((seed * 1_000_003 + segment) % (1 << 63))
    return torch.rand(shape, generator=g, device=device) >= dropout_p


def reference_dropout_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, dropout_p: float,
                                seed: int) -> torch.Tensor:
    """:func:`reference_attention` with attention dropout, as SDPA's: each probability
    is kept with probability ``1 - dropout_p`` (mask: :func:`dropout_keep`) and the
    kept ones scaled by ``1 / (1 - dropout_p)``. Differentiable (autograd gives
    :func:`reference_dropout_backward`). Per segment: exact, not fast."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    segments = _dense_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, acc, q.device)
    for i, (rows, _, s, _, vs, _) in enumerate(segments):
        p = _softmax(s)
        p = p * (dropout_keep(seed, i, p.shape, dropout_p, q.device).to(acc) / (1.0 - dropout_p))
        out[rows] = torch.einsum("hqk,khd->qhd", p, vs)
    return out.to(q.dtype)


def reference_dropout_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float,
                               dropout_p: float, seed: int):
    """(dq, dk, dv) of :func:`reference_dropout_attention` with the same ``seed``: the
    forward's masks again. With ``M`` the kept probabilities' scale (``keep / (1 -
    p)``), ``O = (P * M) V``: dV = (P M)^T dO, dP = (dO V^T) * M,
    dS = P * (dP - rowsum(dO * O)) * scale, dQ = dS K, dK = dS^T Q."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    grp = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    segments = _dense_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, acc, q.device)
    for i, (rows, keys, s, ks, vs, _) in enumerate(segments):
        p = _softmax(s)
        m = dropout_keep(seed, i, p.shape, dropout_p, q.device).to(acc) / (1.0 - dropout_p)
        go = grad_out[rows].to(acc)
        o = torch.einsum("hqk,khd->qhd", p * m, vs)
        dp = torch.einsum("qhd,khd->hqk", go, vs) * m
        ds = p * (dp - (go * o).sum(-1).t()[..., None]) * scale
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, ks)
        dk[keys] = torch.einsum("hqk,qhd->khd", ds, q[rows].to(acc)).unflatten(1, (-1, grp)).sum(2)
        dv[keys] = torch.einsum("hqk,qhd->khd", p * m, go).unflatten(1, (-1, grp)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    dtype: torch.dtype = torch.float64,
    *,
    device: str | torch.device = "cpu",
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: one dense softmax per segment, in ``dtype`` (float64) on ``device``.

    A Python loop over segments, obviously correct and slow: every kernel
    (:func:`reference_attention`, the CPU kernel, FlashInfer, the backwards) is
    tested against it on small layouts; pass ``device="cuda"`` for large ones
    (the GPU is fast in float64 too). GQA/MQA: each k/v head serves
    ``Hq // Hkv`` query heads. Causal masks are aligned bottom-right. Rows that
    see no key are zero. Variants (``window_size``, ``softcap``, ``sinks``) as
    the op's (module docstring). Differentiable (sinks too); for gradients call
    :func:`dense_gradients`. Returns ``dtype`` on ``device``.
    """
    out = torch.zeros(q.shape, dtype=dtype, device=device)
    segs = _dense_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dtype, device, window_size, softcap)
    for rows, _, s, _, vs, _ in segs:
        out[rows] = torch.einsum("hqk,khd->qhd", _softmax(s, sinks), vs)
    return out


def dense_lse(
    q, k, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, dtype: torch.dtype = torch.float64,
    *, device: str | torch.device = "cpu", window_size=(-1, -1), softcap: float = 0.0, sinks=None,
):
    """The oracle's log-sum-exp of the scaled (capped) scores: ``[Hq, Tq]`` in ``dtype``
    on ``device``, natural log, ``+inf`` for rows that see no key (aten's
    convention); with ``sinks`` each row's sink is in the sum."""
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=dtype, device=device)
    segs = _dense_segments(q, k, k, cu_seqlens_q, cu_seqlens_k, causal, scale, dtype, device, window_size, softcap)
    for rows, _, s, _, _, _ in segs:
        seg = torch.logsumexp(s, dim=-1)
        keyless = seg == -math.inf
        if sinks is not None:
            seg = torch.logaddexp(seg, sinks.to(device, dtype)[:, None])
        lse[:, rows] = seg.masked_fill(keyless, math.inf)
    return lse


def dense_gradients(
    grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, dtype=torch.float64,
    *, out: torch.Tensor | None = None, lse: torch.Tensor | None = None, device: str | torch.device = "cpu",
    window_size=(-1, -1), softcap: float = 0.0, sinks: torch.Tensor | None = None,
):
    """The oracle's output and gradients ``(out, dq, dk, dv)`` for ``grad_out``, in
    ``dtype`` on ``device``; with ``sinks`` also ``dsinks`` (a fifth). Rows and
    keys no query sees get zero gradients.

    By default: autograd through :func:`dense_attention` on ``dtype`` copies.

    With a saved forward, the flash-attention backward of that forward, as a
    FlashAttention kernel computes it from what it is handed (GQA gradients summed
    over the query heads of each k/v head):

    * ``out`` (``[Tq, Hq, D]``): ``D_i = sum_d dO_id * out_id`` is taken from it
      rather than from the exact output (with ``out`` rounded to bf16 that is
      the cancellation any flash backward sees);
    * ``lse`` (``[Hq, Tq]``, natural log, ``+inf`` for keyless rows; with sinks,
      their logits included): the probabilities are ``exp(S - lse)`` rather than
      the exact softmax.

    Then ``dS = P * (dO V^T - D) * scale`` (times ``1 - tanh^2`` under a softcap),
    ``dQ = dS K``, ``dK = dS^T Q``, ``dV = P^T dO``, ``dsinks = -sum_i P_sink D_i``,
    and the returned ``out`` is ``P V``.
    """
    variants = dict(window_size=window_size, softcap=softcap)
    if out is None and lse is None:
        leaves = [t.detach().to(device, dtype).requires_grad_(True) for t in (q, k, v)]
        if sinks is not None:
            leaves.append(sinks.detach().to(device, dtype).requires_grad_(True))
        with torch.enable_grad():
            o = dense_attention(
                *leaves[:3], cu_seqlens_q, cu_seqlens_k, causal, scale, dtype, device=device,
                sinks=None if sinks is None else leaves[3], **variants,
            )
            if not o.requires_grad:  # no row sees a key: nothing depends on q, k, v
                return (o,) + tuple(torch.zeros_like(t) for t in leaves)
            grads = torch.autograd.grad(o, leaves, grad_out.detach().to(device, dtype), allow_unused=True)
        return (o.detach(),) + tuple(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads))
    q, k, v, go = (t.detach().to(device, dtype) for t in (q, k, v, grad_out))
    hkv, grp = k.shape[1], q.shape[1] // k.shape[1]
    o = torch.zeros(q.shape, dtype=dtype, device=device)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(q.shape[1], dtype=dtype, device=device)
    segs = _dense_segments(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, dtype, device, **variants)
    for rows, keys, s, ks, vs, t in segs:
        if lse is None:
            p, p_sink = _softmax(s, sinks, with_sink=True) if sinks is not None else (_softmax(s), None)
        else:
            seg_lse = lse[:, rows].to(device, dtype)[..., None]
            p = torch.exp(s - seg_lse)
            p_sink = None if sinks is None else torch.exp(sinks.to(device, dtype)[:, None, None] - seg_lse)
        o[rows] = torch.einsum("hqk,khd->qhd", p, vs)
        o_for_d = o[rows] if out is None else out[rows].to(device, dtype)
        d_row = (go[rows] * o_for_d).sum(-1).t()[..., None]  # [Hq, Lq, 1]
        ds = p * (torch.einsum("qhd,khd->hqk", go[rows], vs) - d_row) * scale
        if t is not None:
            ds = ds * (1 - t * t)
        if dsinks is not None:
            dsinks -= (p_sink * d_row).sum((1, 2))
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, ks)
        dk[keys] = torch.einsum("hqk,qhd->khd", ds, q[rows]).unflatten(1, (hkv, grp)).sum(2)
        dv[keys] = torch.einsum("hqk,qhd->khd", p, go[rows]).unflatten(1, (hkv, grp)).sum(2)
    return (o, dq, dk, dv) if sinks is None else (o, dq, dk, dv, dsinks)


def reference_lse(
    q, k, cu_seqlens_q, cu_seqlens_k, causal: bool, scale: float, *, window_size=(-1, -1), softcap=0.0, sinks=None,
) -> torch.Tensor:
    """The reference kernel's LSE on q's device, in the layout and dtype the training
    backward takes (``[Hq, Tq]`` float32): :func:`dense_lse`, accumulated in float32
    (float64 for float64 inputs)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    variants = dict(window_size=window_size, softcap=softcap, sinks=sinks)
    return dense_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, scale, acc, **variants).to(q.device, torch.float32)
