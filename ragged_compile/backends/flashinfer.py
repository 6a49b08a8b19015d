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
  therefore never hold such a segment: :func:`causal_indptr` splits each segment
  into its blind top rows (no keys) and a square bottom-right block.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

__all__ = [
    "PADDED_HEAD_DIMS",
    "available",
    "padded_head_dim",
    "supports",
    "choose_backend",
    "causal_indptr",
    "make_wrapper",
    "workspace_shortfall",
    "plan",
    "run",
]

PADDED_HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
# fa2 beat fa3 on many short segments (NOTES: ~250 segments of 16-256 tokens);
# fa3 wins clearly once segments are long. Mean k/v tokens per segment below
# this picks fa2 under backend="auto".
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


def choose_backend(requested: str, device: torch.device, n: int, total_k: int) -> str:
    """Resolve "auto" to "fa2" or "fa3" for one layout; pass others through."""
    if requested != "auto":
        return requested
    if not _is_sm90(device.index if device.index is not None else torch.cuda.current_device()):
        return "fa2"
    mean_kv = total_k / max(n, 1)
    return "fa2" if mean_kv < AUTO_FA2_BELOW_MEAN_KV else "fa3"


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


def plan(wrapper, cu_q_host, cu_k_host, hq, hkv, head_dim, dtype, causal, scale, *, split_kv=True) -> None:
    """Host-side planning; `cu_*_host` are int32 CPU offsets of the real layout.

    ``split_kv=False`` forbids fa2 from splitting long k/v segments across CTAs
    (fa3 never does). A CUDA-graph wrapper otherwise always splits, and the merge
    kernel that follows can cost as much as the attention itself.
    """
    if causal:
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


def _prepare(x: torch.Tensor, dp: int) -> torch.Tensor:
    if x.shape[-1] != dp:
        return F.pad(x, (0, dp - x.shape[-1]))
    if x.stride(-1) != 1:
        return x.contiguous()
    return x


def run(wrapper, q, k, v) -> torch.Tensor:
    """Device work only: no host sync, no planning."""
    d = q.shape[-1]
    dp = padded_head_dim(d)
    out = wrapper.run(_prepare(q, dp), _prepare(k, dp), _prepare(v, dp))
    if dp != d:
        out = out[..., :d].contiguous()
    return out
