"""FlashInfer's ragged prefill (`BatchPrefillWithRaggedKVCacheWrapper`) as the
CUDA kernel of the op: wrapper construction, planning and running.

Host planning (`plan`) is kept apart from device work (`run`) so the runtime can
plan once per layout per forward, outside the compiled region, and every layer
only runs. Quirks handled here (see shared/NOTES.md):

* `q_data_type` defaults to float16 in FlashInfer: always pass the real dtype.
* FlashInfer's fa2 is wrong or crashes for head dims other than 64/128/256, and
  fa3 only has those: q/k/v are zero-padded to the next supported dim, planned
  with the true dim's scale, and the output sliced back.
* Rows that see no key (empty k/v segment, causal with Lq > Lk) must come out
  zero. FlashInfer writes them as zero itself (seen on the H200 for fa2 and
  fa3, plain and CUDA-graph wrappers, causal or not, into an output pre-filled
  with NaN), so nothing here touches them; a CUDA test
  (test_flashinfer_writes_zero_for_rows_that_see_no_key) holds that to account.
* Causal segments with more queries than keys came back wrong from fa2 (found by
  the CUDA fuzzer: one segment of 128 queries over 64 keys). Causal plans
  therefore never hold such a segment: where a layout has one,
  :func:`causal_indptr` splits each segment into its blind top rows (no keys)
  and a square bottom-right block (graph mode always splits: fixed buffers).
"""

from __future__ import annotations

import functools
import math
import re

import torch

from . import pad_head_dim

__all__ = [
    "PADDED_HEAD_DIMS",
    "available",
    "padded_head_dim",
    "supports",
    "choose_backend",
    "predicted_fa3_over_fa2",
    "causal_indptr",
    "make_wrapper",
    "workspace_shortfall",
    "plan",
    "run",
    "run_with_lse",
]

PADDED_HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
# Graph mode allows fa2 to split k/v segments across CTAs only from this mean
# k/v length on (cudagraph.py): below it the merge kernel costs as much as the
# attention it splits.
AUTO_FA2_BELOW_MEAN_KV = 256


@functools.cache
def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install underneath it
        return False
    return True


def padded_head_dim(head_dim: int) -> int | None:
    """The smallest FlashInfer head dim >= head_dim, or None above 256."""
    for d in PADDED_HEAD_DIMS:
        if head_dim <= d:
            return d
    return None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DTYPES and padded_head_dim(head_dim) is not None and available()


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


# fa3 time over fa2 time per call, measured on the H200 (bf16, ~33k tokens, both
# kernels through this module, causal split included; bench/sweep_backends.py,
# bench/results/sweep_backends.json), against the mean k/v tokens per segment.
# Keyed (head-dim table, GQA group size, causal). fa3 plans take 2-10x the host
# time of fa2 plans (0.6-9 ms against 0.2-0.8 ms), so fa3 must be predicted at
# least _FA3_MARGIN faster to be chosen; within that margin fa2 loses little.
_FA3_OVER_FA2 = {
    (64, 1, False): [(17, 1.21), (36, 2.12), (63, 1.43), (133, 1.01), (320, 0.85), (645, 0.76), (1066, 0.68), (2282, 0.64), (4382, 0.63), (8192, 0.63), (32768, 0.66)],
    (64, 1, True): [(17, 1.18), (36, 1.65), (63, 1.13), (133, 1.09), (320, 0.97), (645, 0.9), (1066, 0.78), (2282, 0.71), (4382, 0.66), (8192, 0.65), (32768, 0.65)],
    (128, 1, False): [(17, 1.01), (36, 1.54), (63, 1.08), (133, 1.05), (320, 0.86), (645, 0.68), (1066, 0.6), (2282, 0.54), (4382, 0.53), (8192, 0.53), (32768, 0.6)],
    (128, 1, True): [(17, 0.86), (36, 1.15), (63, 0.84), (133, 0.83), (320, 0.75), (645, 0.65), (1066, 0.58), (2282, 0.53), (4382, 0.5), (8192, 0.49), (32768, 0.56)],
    (128, 4, False): [(17, 5.32), (36, 3.34), (63, 1.82), (133, 1.29), (320, 0.93), (645, 0.74), (1066, 0.61), (2282, 0.57), (4382, 0.59), (8192, 0.61), (32768, 0.61)],
    (128, 4, True): [(17, 2.87), (36, 2.38), (63, 1.46), (133, 1.18), (320, 0.97), (645, 0.77), (1066, 0.66), (2282, 0.55), (4382, 0.55), (8192, 0.56), (32768, 0.6)],
    (128, 8, False): [(17, 6.67), (36, 3.51), (63, 1.89), (133, 1.25), (320, 0.93), (645, 0.77), (1066, 0.63), (2282, 0.56), (4382, 0.53), (8192, 0.5), (32768, 0.58)],
    (128, 8, True): [(17, 4.61), (36, 2.55), (63, 1.51), (133, 1.17), (320, 0.93), (645, 0.76), (1066, 0.63), (2282, 0.53), (4382, 0.5), (8192, 0.49), (32768, 0.49)],
}
_FA3_MARGIN = 0.98


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) through `points`, clamped at both ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


def predicted_fa3_over_fa2(mean_kv: float, hq: int, hkv: int, head_dim: int, causal: bool) -> float:
    """fa3's predicted time over fa2's for a layout (see _FA3_OVER_FA2)."""
    group = max(1, hq // max(hkv, 1))
    # d <= 64 pads to 64, anything larger uses the 128 table (256 is unmeasured:
    # fa3's advantage there is no smaller). GQA was measured at d=128 only; it
    # favours fa2 on short segments far more than the head dim does.
    dim = 64 if padded_head_dim(head_dim) == 64 and group == 1 else 128
    mean_kv = max(mean_kv, 1.0)
    if group == 1 or dim == 64:
        return _interp_log(_FA3_OVER_FA2[(dim, 1, causal)], mean_kv)
    # between measured group sizes 1, 4, 8: linear in log2(group)
    at = {g: _interp_log(_FA3_OVER_FA2[(128, g, causal)], mean_kv) for g in (1, 4, 8)}
    lg = math.log2(group)
    if lg <= 2:
        return at[1] + (at[4] - at[1]) * lg / 2
    return at[4] + (at[8] - at[4]) * min(lg - 2, 1.0)


def choose_backend(
    requested: str,
    device: torch.device,
    n: int,
    total_k: int,
    *,
    hq: int = 1,
    hkv: int = 1,
    head_dim: int = 128,
    causal: bool = False,
) -> str:
    """Resolve "auto" to "fa2" or "fa3" for one layout; pass others through.

    fa3 exists on SM90 only. There, the measured cost table picks fa3 where it
    is predicted at least 2% faster than fa2 (long segments; short causal
    segments with one k/v head per query head), fa2 elsewhere (short
    segments, above all with GQA, where fa2 packs a group's heads into rows).
    """
    if requested != "auto":
        return requested
    if not _is_sm90(device.index if device.index is not None else torch.cuda.current_device()):
        return "fa2"
    mean_kv = total_k / max(n, 1)
    ratio = predicted_fa3_over_fa2(mean_kv, hq, hkv, head_dim, causal)
    return "fa3" if ratio < _FA3_MARGIN else "fa2"


def causal_indptr(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host indptrs for a causal plan: 2n segments for n, none with Lq > Lk.

    Segment i becomes (its first max(Lq - Lk, 0) rows, no keys), whose rows see
    no key under bottom-right alignment anyway, then (the remaining rows, all Lk
    keys). Always two per segment, so a graph's static buffers have a fixed size.
    """
    cq, ck = cu_q.long(), cu_k.long()
    blind = ((cq[1:] - cq[:-1]) - (ck[1:] - ck[:-1])).clamp(min=0)
    n = blind.numel()
    q = torch.zeros(2 * n + 1, dtype=torch.int32)
    k = torch.zeros(2 * n + 1, dtype=torch.int32)
    q[1::2], q[2::2] = cq[:-1] + blind, cq[1:]
    k[1::2], k[2::2] = ck[:-1], ck[1:]
    return q, k


_SHORTFALL = re.compile(r"with size (\d+) and alignment \d+, but only (\d+) bytes available")


def workspace_shortfall(err: Exception) -> int | None:
    """Bytes a plan asked for beyond the float workspace, from FlashInfer's error; None
    if `err` is something else. Graph-mode plans size split-KV buffers for the whole
    bucket, which can exceed a workspace that eager plans never fill."""
    m = _SHORTFALL.search(str(err))
    return int(m.group(1)) + int(m.group(2)) if m else None


def make_wrapper(
    workspace: torch.Tensor,
    backend: str,
    qo_indptr_buf: torch.Tensor | None = None,
    kv_indptr_buf: torch.Tensor | None = None,
):
    """A ragged prefill wrapper; CUDA-graph mode when static indptr buffers are given."""
    import flashinfer

    graph = qo_indptr_buf is not None
    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        workspace,
        kv_layout="NHD",
        backend=backend,
        use_cuda_graph=graph,
        qo_indptr_buf=qo_indptr_buf,
        kv_indptr_buf=kv_indptr_buf,
    )


def plan(
    wrapper, cu_q_host, cu_k_host, hq, hkv, head_dim, dtype, causal, scale, *, split_kv=True, causal_split=None
) -> None:
    """Host-side planning; `cu_*_host` are int32 CPU offsets of the real layout.

    ``split_kv=False`` forbids fa2 from splitting long k/v segments across CTAs
    (fa3 never does). A CUDA-graph wrapper otherwise always splits, and the merge
    kernel that follows can cost as much as the attention itself.

    ``causal_split``: plan causal segments through :func:`causal_indptr`. ``None``
    splits only layouts where some segment has more queries than keys (the case
    fa2 gets wrong); self-attention never needs it, and its empty halves cost
    fa3 time. Graph mode passes True: its static buffers hold 2n + 1 entries.
    """
    if causal and causal_split is None:
        causal_split = bool(((cu_q_host[1:] - cu_q_host[:-1]) > (cu_k_host[1:] - cu_k_host[:-1])).any())
    if causal and causal_split:
        cu_q_host, cu_k_host = causal_indptr(cu_q_host, cu_k_host)
    wrapper.plan(
        cu_q_host.pin_memory() if torch.cuda.is_available() else cu_q_host,
        cu_k_host.pin_memory() if torch.cuda.is_available() else cu_k_host,
        hq,
        hkv,
        padded_head_dim(head_dim),
        causal=causal,
        sm_scale=scale,  # the true dim's scale, not the padded one's
        q_data_type=dtype,
        kv_data_type=dtype,
        o_data_type=dtype,
        non_blocking=True,
        disable_split_kv=not split_kv,
    )


def run(wrapper, q, k, v) -> torch.Tensor:
    """Device work only: no host sync, no planning."""
    d = q.shape[-1]
    dp = padded_head_dim(d)
    out = wrapper.run(pad_head_dim(q, dp), pad_head_dim(k, dp), pad_head_dim(v, dp))
    if dp != d:
        out = out[..., :d].contiguous()
    return out


def run_with_lse(wrapper, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`run` plus FlashInfer's log-sum-exp: ``[Tq, Hq]`` fp32, base 2, softmax
    scale included, ``-inf`` for rows that see no key; zero head-dim padding leaves
    it unchanged. Only the default layout and base are asked for (every FlashInfer
    version has them); backends/flash_backward.py converts for the backward."""
    d = q.shape[-1]
    dp = padded_head_dim(d)
    out, lse = wrapper.run(pad_head_dim(q, dp), pad_head_dim(k, dp), pad_head_dim(v, dp), return_lse=True)
    if dp != d:
        out = out[..., :d].contiguous()
    return out, lse
