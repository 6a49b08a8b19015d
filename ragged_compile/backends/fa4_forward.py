"""flash-attn-4's varlen forward (CuTe DSL) as the training forward of the op on
SM90 where it beats FlashInfer's (``select.training_forward``): its LSE is the one
its backward takes, so none is converted.

Contract of ``flash_attn.cute.interface._flash_attn_fwd`` (4.0.0b36, read from its
source): q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, int32 offsets, host
``max_seqlen_q/k``; returns ``out`` and, with ``return_lse``, an fp32 ``[Hq, Tq]``
natural-log LSE, ``-inf`` for rows that see no key (ours: ``+inf``, converted
here). GQA native, causal bottom-right aligned. Head dims as its backward's
(fa4_backward.py): 64, 96, 128, 256.

**Its key tiles read outside a segment**, as its backward's do, and mask the
scores there, so those probabilities are exact zeros; a NaN or Inf in the v rows
read (0 * NaN) still reaches the segment's output, finite rows change nothing:

* the last key tile of segment i loads the first rows of segment i+1. Every query
  row whose window reaches that tile reads it, and the segment's last row always
  does (causal or not), so such a segment's last row is non-finite;
* a query tile that sees no key at all (``Lk == 0``, or causal with ``Lq > Lk``,
  whose first ``Lq - Lk`` rows see none) still runs one key tile, the one before
  the segment's first key: rows of the segment before it.

Segments stay independent by recompute: the segments whose last output row is
non-finite (``n x Hq x D`` values read, not the whole output) and those with rows
that see no key (from the offsets, on the device) are computed again from their
own rows (segment_forward.py), in place, with no sync.
"""

from __future__ import annotations

import torch

from . import fa4_backward, segment_backward, segment_forward

__all__ = ["unsupported_reason", "forward", "KernelFailed"]


class KernelFailed(RuntimeError):
    """FA4's forward kernel raised (a JIT or launch failure of the pre-release)."""


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA4's forward cannot take this training call, or None."""
    dims = fa4_backward._HEAD_DIMS  # its backward's verified head dims: one rule for the pair
    if head_dim not in dims:
        return f"flash-attn-4's forward takes head dims {', '.join(map(str, dims))} here, got {head_dim}"
    reason = fa4_backward.unsupported_reason(device, dtype, head_dim)
    if reason is not None:
        return reason
    if segment_backward.triton is None:
        return "triton is not installed (the isolation's recompute kernel)"
    if not hasattr(fa4_backward._interface(), "_flash_attn_fwd"):
        return "this flash-attn-4 lacks _flash_attn_fwd (verified with 4.0.0b36)"
    return None


def forward(q, k, v, cu_q, cu_k, causal: bool, scale: float, max_lens: tuple[int, int], keyless_rows: bool = True):
    """(out, lse) of ``ragged_attention(q, k, v, cu_q, cu_k, causal, scale)``, lse in
    aten's layout (``[Hq, Tq]`` fp32, natural log, ``+inf`` for keyless rows);
    ``max_lens``: the longest q and k segment (host ints); ``keyless_rows``: whether
    any query row sees no key (the host layout knows: False skips looking for them on
    the device). The caller checked :func:`unsupported_reason` and that both sides
    hold tokens."""
    cu_q32, cu_k32 = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
    q, k, v = (t.contiguous() for t in (q, k, v))
    try:
        out, lse = _kernel(
            q, k, v, cu_seqlens_q=cu_q32, cu_seqlens_k=cu_k32, max_seqlen_q=max_lens[0], max_seqlen_k=max_lens[1],
            softmax_scale=scale, causal=causal, return_lse=True,
        )[:2]
    except Exception as err:  # noqa: BLE001 - the caller decides: re-raise, or no FA4 from now on
        raise KernelFailed(f"{type(err).__name__}: {str(err)[:300]}") from err
    # rows that see no key: +inf, as FlashAttention-2's forward (which also gives +inf
    # to a row whose sum is NaN, where FA4 gives -inf)
    lse.masked_fill_(lse == float("-inf"), float("inf"))
    redo = _contaminated(out, cu_q32)
    if keyless_rows:
        redo |= _reads_before(cu_q32, cu_k32, causal)
    segment_forward.recompute(redo, q, k, v, cu_q32, cu_k32, causal, scale, max_lens, out, lse)
    return out, lse


def _contaminated(out: torch.Tensor, cu_q: torch.Tensor) -> torch.Tensor:
    """bool ``[n]``: the segments whose last output row holds a NaN or Inf (an empty
    segment reads its predecessor's: at worst a needless recompute)."""
    last = (cu_q[1:] - 1).clamp_min(0)
    sums = out.index_select(0, last).flatten(1).sum(1, dtype=torch.float32)
    return ~torch.isfinite(sums)


def _reads_before(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """bool ``[n]``: the segments with query rows that see no key, whose tiles read the
    key tile before the segment (self-attention has none: Lq == Lk)."""
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    keyless = (lk == 0) | (lq > lk) if causal else lk == 0
    return (lq > 0) & keyless


def _kernel(*args, **kwargs):
    # One seam for FA4: CPU tests put a model of its contract (the tile overrun
    # included) here.
    return fa4_backward._interface()._flash_attn_fwd(*args, **kwargs)
