"""FlashInfer's ragged prefill (`BatchPrefillWithRaggedKVCacheWrapper`) as the
CUDA kernel of the op: wrapper construction, planning and running.

Host planning (`plan`) is kept apart from device work (`run`) so the runtime can
plan once per layout per forward, outside the compiled region, and every layer
only runs. Which family (fa2 or fa3) runs a layout is decided in select.py.
Quirks handled here (read from ``flashinfer/prefill.py`` and seen on the H200):

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
import re

import torch

from . import pad_head_dim

__all__ = [
    "PADDED_HEAD_DIMS",
    "DTYPES",
    "available",
    "flashinfer_head_dim",
    "causal_indptr",
    "make_wrapper",
    "workspace_shortfall",
    "plan",
    "run",
    "run_with_lse",
    "replay",
    "staging_buffer",
    "set_staging_buffer",
]

PADDED_HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
# Graph mode allows fa2 to split k/v segments across CTAs only from this mean
# k/v length on (cudagraph.py): below it the merge kernel costs as much as the
# attention it splits.
AUTO_FA2_BELOW_MEAN_KV = 256


# A constant to torch.compile: a first call while tracing runs eagerly, not traced
# (an import that raises inside a trace is an internal compiler error, which the
# except below would not see).
@torch.compiler.assume_constant_result
def available() -> bool:
    return _importable()


@functools.cache
def _importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install underneath it
        return False
    return True


def flashinfer_head_dim(head_dim: int) -> int | None:
    """The head dim FlashInfer computes ``head_dim`` at: the smallest of
    ``PADDED_HEAD_DIMS`` that holds it (inputs are zero-padded to it), or None above 256."""
    for d in PADDED_HEAD_DIMS:
        if head_dim <= d:
            return d
    return None


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
    wrapper, cu_q_host, cu_k_host, hq, hkv, head_dim, dtype, causal, scale, *, split_kv=True, causal_split=None,
    window_left: int = -1, softcap: float = 0.0,
) -> None:
    """Host-side planning; `cu_*_host` are int32 CPU offsets of the real layout.

    ``window_left`` (-1: none) and ``softcap`` (0: none) are taken here, not by
    ``run``: FlashInfer ignores them there. Each combination is its own JIT module.

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
        flashinfer_head_dim(head_dim),
        causal=causal,
        sm_scale=scale,  # the true dim's scale, not the padded one's
        q_data_type=dtype,
        kv_data_type=dtype,
        o_data_type=dtype,
        non_blocking=True,
        disable_split_kv=not split_kv,
        window_left=window_left,
        logits_soft_cap=softcap if softcap > 0 else None,
    )


@functools.cache
def _pdl(device_index: int) -> bool:
    # What FlashInfer's run() works out per call when not told (programmatic
    # dependent launch from SM90 on), once per device.
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def run(wrapper, q, k, v) -> torch.Tensor:
    """Device work only: no host sync, no planning."""
    d = q.shape[-1]
    dp = flashinfer_head_dim(d)
    out = _replayed_run(wrapper, pad_head_dim(q, dp), pad_head_dim(k, dp), pad_head_dim(v, dp), False)
    if dp != d:
        out = out[..., :d].contiguous()
    return out


def run_with_lse(wrapper, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`run` plus FlashInfer's log-sum-exp: ``[Tq, Hq]`` fp32, base 2, softmax
    scale included, ``-inf`` for rows that see no key; zero head-dim padding leaves
    it unchanged. Only the default layout and base are asked for (every FlashInfer
    version has them); backends/flash_backward.py converts for the backward."""
    d = q.shape[-1]
    dp = flashinfer_head_dim(d)
    out, lse = _replayed_run(wrapper, pad_head_dim(q, dp), pad_head_dim(k, dp), pad_head_dim(v, dp), True)
    if dp != d:
        out = out[..., :d].contiguous()
    return out, lse


# -- replaying run()'s kernel call ---------------------------------------------------------
#
# Much of ``wrapper.run``'s host time (Python's profiler of an H200 host's calls:
# bench/results/host.json) goes to Python that only depends on the plan:
# checks, argument defaults, the argument list of the JIT module's ``ragged_run``. Every layer of a forward runs the same plan, so the
# first run after a plan records that argument list, and later runs of the same
# plan call ``ragged_run`` with it, only the tensors of the call swapped in.
# Recording watches one real ``run`` (any FlashInfer version's arguments, in its
# own order), so nothing here rebuilds FlashInfer's argument list; a call it
# cannot replay exactly (the tensors not found once each, outputs FlashInfer
# post-processed) keeps calling ``run``.


class _Recorder:
    """Stands in for a wrapper's JIT module during one ``run``: keeps the arguments
    ``run`` hands ``ragged_run``, forwards everything."""

    def __init__(self, module):
        self._module, self.args = module, None

    def ragged_run(self, *args, **kwargs):
        self.args = None if kwargs else args  # keywords: a call this module does not replay
        return self._module.ragged_run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class _Replay:
    __slots__ = ("plan_info", "fn", "args", "slots", "lse", "out_dtype", "out_dim")

    def __init__(self, plan_info, fn, args, slots, lse, out):
        self.plan_info, self.fn, self.args, self.slots, self.lse = plan_info, fn, args, slots, lse
        self.out_dtype, self.out_dim = out.dtype, out.shape[-1]


_REPLAY = "_ragged_compile_replay"


def replay(wrapper, q, k, v, lse: bool = False):
    """:func:`run` (``lse``: :func:`run_with_lse`) for the calls of a plan after its
    first, when nothing needs adapting: head dim FlashInfer's own, contiguous q,
    unit last strides, and the kernel call recorded. None where :func:`run` must
    do it."""
    rec = getattr(wrapper, _REPLAY, None)
    if (
        rec is None or rec.lse != lse or rec.plan_info is not getattr(wrapper, "_plan_info", None)
        or rec.out_dim != q.shape[-1] or rec.out_dtype != q.dtype or not q.is_contiguous()
        or k.stride(-1) != 1 or v.stride(-1) != 1
    ):
        return None
    return _run_recorded(rec, q, k, v)


def _run_recorded(rec: _Replay, q, k, v):
    """The recorded call on fresh outputs: ``out`` (and, where it was recorded with
    one, the ``[Tq, Hq]`` fp32 LSE)."""
    out = torch.empty(q.shape[:-1] + (rec.out_dim,), dtype=rec.out_dtype, device=q.device)
    if not rec.lse:
        _call(rec, (q, k, v, out))
        return out
    lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    _call(rec, (q, k, v, out, lse))
    return out, lse


def _call(rec: _Replay, tensors: tuple) -> None:
    """The recorded kernel call with this call's q, k, v, out (and lse) in their places."""
    args = list(rec.args)
    for i, t in zip(rec.slots, tensors):
        args[i] = t
    rec.fn(*args)


def _replayed_run(wrapper, q, k, v, return_lse: bool):
    rec = getattr(wrapper, _REPLAY, None)
    plan_info = getattr(wrapper, "_plan_info", None)
    if rec is not None and rec.plan_info is plan_info and rec.lse == return_lse and plan_info is not None:
        return _run_recorded(rec, q, k, v)
    module = getattr(wrapper, "_cached_module", None)
    if module is None or plan_info is None or not hasattr(module, "ragged_run"):
        return wrapper.run(q, k, v, return_lse=return_lse, enable_pdl=_pdl(q.device.index))
    recorder = _Recorder(module)
    wrapper._cached_module = recorder
    try:
        res = wrapper.run(q, k, v, return_lse=return_lse, enable_pdl=_pdl(q.device.index))
    finally:
        wrapper._cached_module = module
    setattr(wrapper, _REPLAY, _recorded(wrapper, plan_info, module, recorder.args, (q, k, v), res, return_lse))
    return res


def _recorded(wrapper, plan_info, module, args, qkv, res, return_lse) -> _Replay | None:
    """The replay of one recorded ``run``, or None where replaying it would not be
    exactly that call: each tensor of the call (q, k, v, out, lse) found once among
    the arguments, the results returned as the kernel wrote them."""
    if args is None or getattr(wrapper, "_plan_info", None) is not plan_info:
        return None
    outs = tuple(res) if return_lse else (res,)
    slots = []
    for t in (*qkv, *outs):
        at = [i for i, a in enumerate(args) if a is t]
        if len(at) != 1 or not isinstance(t, torch.Tensor):
            return None
        slots.append(at[0])
    if len(set(slots)) != len(slots) or outs[0].shape[:-1] != qkv[0].shape[:-1] or not outs[0].is_contiguous():
        return None
    if return_lse and (outs[1].shape != qkv[0].shape[:2] or outs[1].dtype != torch.float32):
        return None
    kept = list(args)
    for i in slots:  # the call's own tensors are not kept alive until the next plan
        kept[i] = None
    return _Replay(plan_info, module.ragged_run, tuple(kept), tuple(slots), return_lse, outs[0])


# CUDA-graph mode double-buffers the pinned buffer a wrapper stages its plan in
# (cudagraph.py): FlashInfer keeps it in a private attribute, read in
# flashinfer/prefill.py (0.7.x). This pair is the only code that touches it.
_STAGING = "_pin_memory_int_workspace_buffer"


def staging_buffer(wrapper) -> torch.Tensor:
    """The pinned host buffer ``wrapper.plan`` writes its schedule into before the copy
    to the device."""
    buf = getattr(wrapper, _STAGING, None)
    if not isinstance(buf, torch.Tensor):
        import flashinfer

        raise RuntimeError(
            f"flashinfer {getattr(flashinfer, '__version__', '?')}'s ragged prefill wrapper has no "
            f"pinned plan buffer ({_STAGING}), which CUDA-graph mode double-buffers; this "
            f"ragged_compile supports flashinfer-python 0.7.x there"
        )
    return buf


def set_staging_buffer(wrapper, buf: torch.Tensor) -> None:
    """Make ``wrapper``'s next plan stage in ``buf`` (a pinned tensor shaped like
    :func:`staging_buffer`'s), so it never rewrites a buffer whose copy is in flight."""
    staging_buffer(wrapper)  # the version check
    setattr(wrapper, _STAGING, buf)
