"""The op's CPU kernel: PyTorch's fused CPU flash attention over groups of segments.

Forward and backward run ``aten::_scaled_dot_product_flash_attention_for_cpu``
and its backward (blocked, so memory stays linear in the tokens; GQA native):

* A plan (host work, cached for the last few layouts so a backward finds its
  forward's) cuts every segment into *pieces*: the query rows that see a key,
  with the keys they may see. Pieces of one shape share a call. Longer than
  ``_TINY`` (32) tokens they run as views of the packed tensors (no copy): one call
  per run of back-to-back pieces (a uniform batch is a single call whose output
  is returned as is), else one per piece. Measured: the kernel's cost per
  segment hardly falls in a batch, while gathering copies every row. Tiny
  pieces are gathered into padded batches, a smaller shape joining a larger
  one while its padding costs less than a call.
* Padding goes at the end of each segment and is selected to finite zeros, so
  padded rows and keys carry no value of another segment; each segment is its
  own batch element of the fused kernel, which never mixes batch elements.
  Segments are independent bit for bit: a NaN in one reaches no other.
* Masks: none for causal pieces with as many queries as keys (padding at the
  end is invisible to real rows under the kernel's top-left ``is_causal``) nor
  for equal shapes; a key-padding row ``[B, 1, 1, Pk]`` for merged tiny shapes;
  a bottom-right mask only for causal pieces with fewer queries than keys,
  chunked by query rows so it never holds more than ``_BUDGET`` elements. Rows
  above the causal diagonal of a segment with ``Lq > Lk`` (and rows of an empty
  k/v segment) are never computed: their output and gradients are zero.
* bf16/fp16 compute in float32 (copied once) and round once at the end, as the
  reference kernel does: the kernel's low-precision path rounds probabilities
  to bf16 before P @ V, and this CPU (AVX2) has no bf16 matmul to gain from it.
* Gathered buffers stay small (``_GATHER`` elements): in cache, and below
  glibc's mmap threshold so freed ones are reused instead of faulted in anew.

Variants: a sliding window (``window_size``) is a band of keys per row. A
segment whose window binds is cut into chunks of rows (``_BAND_ROWS``), each
with the keys its rows may see and a mask of that piece's size (rows x keys,
never the segment's); equal chunks share a call. Sinks (per-head logits in
the softmax denominator) rescale each call's output by ``sigmoid(lse - sink)``
and join its log-sum-exp; the fused backward, handed that output and LSE,
gives the exact gradients, and ``d(sink) = -sum_rows exp(sink - lse) *
rowsum(dO * O)``. Soft-capping is not expressible in the fused kernel: the op
runs the reference kernel for it (backends/select.py).

The backward recomputes each call's forward (output and log-sum-exp) unless
the caller passes them: the op's autograd saves q, k, v only, and recomputing
costs ~1.25x forward+backward against a saved LSE (bench/results/cpu.md).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

__all__ = ["cpu_attention", "cpu_attention_backward", "plan", "Plan", "Call", "Piece"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# Sizes in elements. A gathered call's q (or k, v) stays in L2-sized pieces: the
# fused backward slows down per segment in large batches (B = 64 of 32 tokens:
# 2x); views cost no copy and may be larger. Under 16 MiB either way, below
# glibc's mmap threshold, so freed buffers are reused rather than faulted in.
_GATHER = 1 << 17
_VIEWS = 1 << 22
_BUDGET = 1 << 22  # elements of one causal mask chunk (rows x keys)
# A call costs ~40 us (kernel and Python); the fused kernel does ~1.3e4
# score-head-dims per us forward, ~3.5x that time forward+backward: padding
# that costs less than a call is ~1.5e5 score-head-dims.
_MERGE = 1.5e5
# Gathering copies q, k, v and the output (~0.3 us per row of 8 x 64 each);
# past ~32 tokens that costs more than the calls it saves, so longer pieces run
# as views. Measured on 2 cores, 256 segments of 1..32 tokens: 32 against 16
# took forward 10.9 against 15.7 ms, forward+backward 46 against 67 ms (8 and
# 2 were slower still); 24 segments of 0..456 tokens did not move.
_TINY = 32
_PLANS = 8  # layouts whose plans are kept
# Rows per chunk of a windowed segment: a chunk computes rows x (rows + window)
# scores for rows x window useful ones, against ~40 us a call; ~32-64 rows
# balance the two. A segment whose band covers most of it is one piece.
_BAND_ROWS = 2 * _TINY


class Piece(NamedTuple):
    """Query rows ``q0 : q0 + nq`` attending keys ``k0 : k0 + nk`` (packed indices).

    Row ``i`` sees key ``j`` iff ``j <= i + diag`` (``diag`` is None: every key)
    and ``j >= i + low`` (``low`` is None: no lower bound; windows only).
    """

    q0: int
    nq: int
    k0: int
    nk: int
    diag: int | None
    low: int | None = None


def _band(Lq, Lk, q0, k0, left, right):
    """Pieces of one segment under a window (``left``/``right`` bind, -1: unbounded):
    chunks of rows, each with the keys its rows see, rows that see no key left out."""
    shift = Lk - Lq
    first = 0 if right < 0 else min(Lq, max(0, Lq - Lk - right))  # rows above: blind
    span = left + right + 1 if left >= 0 and right >= 0 else Lk
    step = _TINY if span <= _TINY else _BAND_ROWS
    step = max(1, min(step, _BUDGET // min(Lk, step + span)))
    out = []
    for r0 in range(first, Lq, step):
        r1 = min(Lq, r0 + step)
        lo = max(0, r0 + shift - left) if left >= 0 else 0
        hi = min(Lk - 1, r1 - 1 + shift + right) if right >= 0 else Lk - 1
        diag = r0 + shift + right - lo if right >= 0 else None
        low = r0 + shift - left - lo if left >= 0 else None
        out.append(Piece(q0 + r0, r1 - r0, k0 + lo, hi - lo + 1, diag, low))
    if len(out) > 1 and 3 * sum(p.nq * p.nk for p in out) >= 2 * (Lq - first) * Lk and (Lq - first) * Lk <= _BUDGET:
        # the band covers most of the segment: one piece, one mask
        diag = first + shift + right if right >= 0 else None
        low = first + shift - left if left >= 0 else None
        out = [Piece(q0 + first, Lq - first, k0, Lk, diag, low)]
    return out


def _pieces(lq, lk, cuq, cuk, causal, hq, window=(-1, -1)):
    """Split segments into pieces of the four kinds; skip what sees no key."""
    free, square, masked, band = [], [], [], []
    left, right = window
    if causal:
        right = 0
    bands = 0  # segments cut into band pieces
    for i in range(len(lq)):
        Lq, Lk = lq[i], lk[i]
        if Lq == 0 or Lk == 0:
            continue
        # A bound binds a segment when some row it limits would otherwise see more.
        seg_left = left if 0 <= left < Lk - 1 else -1
        seg_right = right if right == 0 or 0 < right < Lq - 1 else -1
        if seg_left >= 0 or seg_right > 0:
            band += _band(Lq, Lk, cuq[i], cuk[i], seg_left, seg_right)
            bands += 1
            continue
        if seg_right < 0:
            free.append(Piece(cuq[i], Lq, cuk[i], Lk, None))
            continue
        blind = max(0, Lq - Lk)  # rows above the bottom-right diagonal
        rows, d0 = Lq - blind, Lk - (Lq - blind)
        if d0 == 0:
            square.append(Piece(cuq[i] + blind, rows, cuk[i], Lk, 0))
            continue
        # Fewer queries than keys: a mask of rows x keys, in chunks of rows.
        step = max(1, _BUDGET // Lk)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            masked.append(Piece(cuq[i] + r0, r1 - r0, cuk[i], min(Lk, r1 - 1 + d0 + 1), r0 + d0))
    return free, square, masked, band, len(band) > bands


def _runs(ps):
    """Split equal-shape pieces into runs that lie back to back in q and in k/v."""
    runs = [[ps[0]]]
    for p in ps[1:]:
        last = runs[-1][-1]
        if p.q0 == last.q0 + last.nq and p.k0 == last.k0 + last.nk:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _group(pieces, kind, hq, hkv, d):
    """Calls for pieces of one kind (see the module docstring for the why).

    Pieces of one shape share a call. A shape longer than ``_TINY`` runs as views
    (no copy): one call per run of pieces that lie back to back, else one per
    piece. Tiny shapes are gathered into padded batches, a smaller shape joining
    a larger one while its padding costs less than a call (``_MERGE``).
    """
    exact = {}
    for p in pieces:  # segment order within a shape: back-to-back runs stay views
        exact.setdefault((p.nq, p.nk, p.diag, p.low), []).append(p)
    groups = []  # [pieces, Pq, Pk, gathered]
    exact_masks = kind in ("masked", "band")
    tiny = 2 * _TINY if kind == "band" else _TINY  # band pieces of one segment overlap: never runs
    for nq, nk, diag, low in sorted(exact, key=lambda t: (t[1], t[0], t[2] or 0, t[3] or 0), reverse=True):
        ps = exact[(nq, nk, diag, low)]
        if max(nq, nk) > tiny:
            groups += [[run, nq, nk, False] for run in _runs(ps)]
            continue
        if groups and groups[-1][3] and not exact_masks:
            g, Pq, Pk, _ = groups[-1]
            pq = max(Pq, nq)
            extra = len(ps) * (pq * Pk - nq * nk) + len(g) * (pq - Pq) * Pk
            if extra * hq * d <= _MERGE:
                groups[-1] = [g + ps, pq, Pk, True]
                continue
        groups.append([ps, nq, nk, True])
    calls = []
    for ps, Pq, Pk, gathered in groups:
        per = max(Pq * hq, Pk * hkv) * d
        if exact_masks:
            per = max(per, Pq * Pk)
        step = max(1, (_GATHER if gathered else _VIEWS) // per)
        for s0 in range(0, len(ps), step):
            part = tuple(ps[s0 : s0 + step])
            if exact_masks:
                mask = "full"
            elif kind == "free" and any(p.nk != Pk for p in part):
                mask = "keys"
            else:
                mask = "none"
            calls.append((part, Pq, Pk, mask))
    return calls


class _Rows(NamedTuple):
    """Where one side (q or k) of a call reads and writes in the packed tensor."""

    start: int | None  # pieces back to back, unpadded: a view from here
    index: torch.Tensor | None  # [B * P] packed row per padded row (padding: 0)
    pad: torch.Tensor | None  # padded rows to zero-fill, or None
    src: torch.Tensor | None  # padded rows that hold real rows (None: all of them)
    dst: torch.Tensor | None  # their packed rows


def _rows(starts, lens, P) -> _Rows:
    B = len(starts)
    if all(n == P for n in lens) and all(starts[b] == starts[0] + b * P for b in range(B)):
        return _Rows(starts[0], None, None, None, None)
    st = torch.tensor(starts)[:, None]
    r = torch.arange(P)[None, :]
    valid = (r < torch.tensor(lens)[:, None]).flatten()
    index = torch.where(valid, (st + r).flatten(), 0)
    src = torch.nonzero(valid).flatten()
    pad = torch.nonzero(~valid).flatten()
    if pad.numel() == 0:
        return _Rows(None, index, None, None, index)
    return _Rows(None, index, pad, src, index[src])


def _mask(pieces, Pq, Pk, kind):
    """Additive float32 mask [B or 1, 1, Pq or 1, Pk], or None."""
    nk = torch.tensor([p.nk for p in pieces])[:, None, None, None]
    j = torch.arange(Pk)
    if kind == "keys":
        allowed = j < nk
    else:
        i = torch.arange(Pq)[:, None]
        allowed = j < nk
        if any(p.diag is not None for p in pieces):  # one shape per call: all or none
            allowed = allowed & (j <= i + torch.tensor([p.diag for p in pieces])[:, None, None, None])
        if any(p.low is not None for p in pieces):
            allowed = allowed & (j >= i + torch.tensor([p.low for p in pieces])[:, None, None, None])
    if bool(allowed.all(0).eq(allowed[0]).all()):  # one mask for the whole batch
        allowed = allowed[:1]
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


class Call(NamedTuple):
    """One fused kernel call: ``B`` pieces padded to ``Pq`` rows and ``Pk`` keys."""

    pieces: tuple[Piece, ...]
    B: int
    Pq: int
    Pk: int
    is_causal: bool  # kernel's top-left causal: exact for square pieces padded at the end
    mask: torch.Tensor | None
    q: _Rows
    k: _Rows


class Plan(NamedTuple):
    calls: list[Call]
    covered: bool  # every query row is in some call (else some rows see no key)
    shared_keys: bool  # some keys are in two calls (causal pieces chunked by rows)


_plans: OrderedDict = OrderedDict()
_plans_lock = threading.Lock()


def plan(cu_seqlens_q, cu_seqlens_k, causal, hq, hkv, d, window_size=(-1, -1)) -> Plan:
    """The kernel calls of one layout (host work only; offsets are CPU tensors).

    The last few plans are kept: the backward of a step finds its forward's.
    """
    cuq = cu_seqlens_q.tolist()
    cuk = cu_seqlens_k.tolist()
    window = tuple(int(w) for w in window_size)
    key = (tuple(cuq), tuple(cuk), causal, hq, hkv, d, window)
    with _plans_lock:
        found = _plans.get(key)
        if found is not None:
            _plans.move_to_end(key)
            return found
    lq = [b - a for a, b in zip(cuq[:-1], cuq[1:])]
    lk = [b - a for a, b in zip(cuk[:-1], cuk[1:])]
    free, square, masked, band, band_shared = _pieces(lq, lk, cuq, cuk, causal, hq, window)
    calls = []
    for kind, ps in (("free", free), ("square", square), ("masked", masked), ("band", band)):
        for part, Pq, Pk, mask_kind in _group(ps, kind, hq, hkv, d):
            qr = _rows([p.q0 for p in part], [p.nq for p in part], Pq)
            kr = _rows([p.k0 for p in part], [p.nk for p in part], Pk)
            mask = None if mask_kind == "none" else _mask(part, Pq, Pk, mask_kind)
            calls.append(Call(part, len(part), Pq, Pk, kind == "square", mask, qr, kr))
    covered = sum(p.nq for p in free + square + masked + band) == (cuq[-1] if cuq else 0)
    shared = len(masked) > len({p.k0 for p in masked}) or band_shared
    result = Plan(calls, covered, shared)
    with _plans_lock:
        _plans[key] = result
        while len(_plans) > _PLANS:
            _plans.popitem(last=False)
    return result


def _gather(x, rows: _Rows, B, P, fill=0.0):
    """[T, H, D] -> [B, H, P, D] (a view of the [B, P, H, D] layout the kernel wants)."""
    if rows.start is not None:
        g = x[rows.start : rows.start + B * P]
    else:
        g = x.index_select(0, rows.index)
        if rows.pad is not None:
            g.index_fill_(0, rows.pad, fill)  # a select: NaN in the gathered row cannot survive
    return g.view(B, P, *x.shape[1:]).transpose(1, 2)


def _scatter(dst, y, rows: _Rows, accumulate=False):
    """Write the real rows of [B, H, P, D] ``y`` into packed ``dst`` [T, H, D]."""
    y = y.transpose(1, 2)
    y = y.reshape(-1, *y.shape[2:])
    if rows.start is not None:
        part = dst[rows.start : rows.start + y.shape[0]]
        part.add_(y) if accumulate else part.copy_(y)
        return
    if rows.pad is not None:
        y = y.index_select(0, rows.src)
    y = y.to(dst.dtype)
    dst.index_add_(0, rows.dst, y) if accumulate else dst.index_copy_(0, rows.dst, y)


def _prepare(x):
    # float32 compute (see the docstring). The kernel reads [B, H, P, D] views of
    # [T, H, D] rows: dense heads, rows apart (fused qkv slices are; expanded
    # gradients are not).
    if x.dtype != torch.float32:
        x = x.float()
    T, H, D = x.shape
    rows_ok = x.stride(2) == 1 and (H == 1 or x.stride(1) == D) and (T <= 1 or x.stride(0) >= H * D)
    return x if rows_ok else x.contiguous()


def _inputs(c: Call, qf, kf, vf):
    return _gather(qf, c.q, c.B, c.Pq), _gather(kf, c.k, c.B, c.Pk), _gather(vf, c.k, c.B, c.Pk)


def _sink_rows(sinks):
    """[Hq] sinks as float32 [1, Hq, 1] (the kernel's [B, H, P] LSE layout), or None."""
    return None if sinks is None else sinks.detach().float().reshape(1, -1, 1)


def _with_sinks(o, l, sink):
    """A call's output and LSE with the sinks in the denominator: o * sigmoid(l - s),
    logaddexp(l, s). Rows' values are untouched: a sink adds no value."""
    if sink is None:
        return o, l
    return o * torch.sigmoid(l - sink)[..., None], torch.logaddexp(l, sink)


def _positive_scale(q, scale):
    """``(q, scale)`` with the same scores and ``scale > 0``.

    The fused kernel applies ``is_causal``'s ``-inf`` before scaling, so a scale
    <= 0 turns masked scores into +inf or NaN. Negation is exact, so ``(-q, -scale)``
    gives the same scores bit for bit; scale 0 gives zero scores, as zero q does.
    """
    if scale > 0:
        return q, scale
    if scale < 0:
        return -q, -scale
    return torch.zeros_like(q), 1.0


def cpu_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, return_lse=False, *, window_size=(-1, -1), sinks=None):
    """Ragged attention on CPU; same contract as the op (arguments assumed valid).

    With ``return_lse`` also the float32 log-sum-exp ``[Tq, Hq]`` (natural log,
    scale included, sinks too; +inf for rows that see no key), which
    :func:`cpu_attention_backward` takes to skip recomputing the forward.
    ``window_size`` and ``sinks`` as the op's (the module docstring says how).
    """
    Tq, Hq, D = q.shape
    p = plan(cu_seqlens_q, cu_seqlens_k, causal, Hq, k.shape[1], D, window_size)
    q, scale = _positive_scale(q, scale)
    qf, kf, vf = _prepare(q), _prepare(k), _prepare(v)
    sink = _sink_rows(sinks)
    lse = torch.full((Tq, Hq), math.inf) if return_lse else None
    if len(p.calls) == 1 and p.covered and q.dtype == torch.float32 and not return_lse:
        c = p.calls[0]
        if c.q.start == 0:  # one view in, the kernel's own output out: no copy at all
            o, l = _flash(*_inputs(c, qf, kf, vf), 0.0, c.is_causal, attn_mask=c.mask, scale=scale)
            return _with_sinks(o, l, sink)[0].transpose(1, 2).reshape(Tq, Hq, D)
    out = (torch.empty if p.covered else torch.zeros)(Tq, Hq, D, dtype=q.dtype)
    for c in p.calls:
        o, l = _with_sinks(*_flash(*_inputs(c, qf, kf, vf), 0.0, c.is_causal, attn_mask=c.mask, scale=scale), sink)
        _scatter(out, o, c.q)
        if return_lse:
            _scatter(lse[:, :, None], l[..., None], c.q)
    return (out, lse) if return_lse else out


def cpu_attention_backward(
    grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, out=None, lse=None, *, window_size=(-1, -1), sinks=None,
):
    """Gradients ``(dq, dk, dv)`` of :func:`cpu_attention`; with ``sinks``,
    ``(dq, dk, dv, dsinks)``, dsinks in the sinks' dtype.

    ``out`` and ``lse`` (from ``cpu_attention(..., return_lse=True)``, sinks
    included) save one forward per call; without them each call's forward is
    recomputed. Rows that see no key get zero gradients, and so do keys no row sees.
    """
    Tq, Hq, D = q.shape
    p = plan(cu_seqlens_q, cu_seqlens_k, causal, Hq, k.shape[1], D, window_size)
    sign = 1.0 if scale > 0 else -1.0 if scale < 0 else 0.0  # dq of the q _positive_scale gives
    q, scale = _positive_scale(q, scale)
    qf, kf, vf, gf = _prepare(q), _prepare(k), _prepare(v), _prepare(grad_out)
    sink = _sink_rows(sinks)
    if out is not None:
        of, lf = _prepare(out), lse[:, :, None]
    dq = (torch.empty if p.covered else torch.zeros)(Tq, Hq, D, dtype=q.dtype)
    # float32 accumulation only where pieces chunked by rows share keys
    acc = torch.float32 if p.shared_keys else k.dtype
    dk = torch.zeros(k.shape, dtype=acc)
    dv = torch.zeros(v.shape, dtype=acc)
    dsinks = None if sinks is None else torch.zeros(Hq)
    for c in p.calls:
        qg, kg, vg = _inputs(c, qf, kf, vf)
        if out is None:
            o, l = _with_sinks(*_flash(qg, kg, vg, 0.0, c.is_causal, attn_mask=c.mask, scale=scale), sink)
        else:
            o = _gather(of, c.q, c.B, c.Pq)
            # padded rows: lse +inf makes their probabilities exp(s - inf) = 0
            l = _gather(lf, c.q, c.B, c.Pq, fill=math.inf).squeeze(-1)
        g = _gather(gf, c.q, c.B, c.Pq)
        gq, gk, gv = _flash_bwd(g, qg, kg, vg, o, l, 0.0, c.is_causal, attn_mask=c.mask, scale=scale)
        if dsinks is not None:
            # padded rows: dO is zero there, so they add nothing
            dsinks -= (torch.exp(sink - l) * (g * o).sum(-1)).sum((0, 2))
        _scatter(dq, gq, c.q)
        _scatter(dk, gk, c.k, accumulate=p.shared_keys)
        _scatter(dv, gv, c.k, accumulate=p.shared_keys)
    if sign != 1.0:
        dq.mul_(sign)
    grads = dq, dk.to(k.dtype), dv.to(v.dtype)
    return grads if sinks is None else grads + (dsinks.to(sinks.dtype),)
