"""Which kernel runs a call, and, where it is not the fastest, why.

The one place that decides, for every device and direction:

==================  =====================================================================
question            answer
==================  =====================================================================
forward             :func:`forward_kernel`: ``"cpu"`` (the fused CPU kernel, cpu.py),
                    ``"flashinfer"`` (CUDA, flashinfer.py; :func:`cuda_backend` may
                    run it on PyTorch's FlashAttention-2 instead), ``"fa2"`` (CUDA
                    windows, flash_backward.py; :func:`window_kernel`: short ones on
                    window_forward.py) or ``"reference"`` (reference.py: float64,
                    other devices, ``RAGGED_COMPILE_REFERENCE``, CUDA calls no fast
                    kernel takes)
CUDA kernel         :func:`cuda_backend`: ``"varlen"`` (PyTorch's FlashAttention-2, which
                    plans nothing) where a FlashInfer plan would cost more host time
                    than its kernel saves over a forward, else FlashInfer's ``"fa2"``
                    or ``"fa3"`` (:func:`flashinfer_backend`), from cost tables
                    measured on the H200
training            :func:`trains_with_lse`: whether a grad-requiring call runs the LSE
                    pair (a forward that saves its log-sum-exp for a fused backward);
                    :func:`training_forward`: ``"fa4"`` where its CUDA forward is
                    flash-attn-4's (fa4_forward.py)
backward            :func:`backward_kernel`: ``"fa4"`` (flash-attn-4, SM90) or ``"fa2"``
                    (PyTorch's FlashAttention-2) on CUDA; the CPU kernel's or the
                    reference's own backward elsewhere
dropout             :func:`dropout_kernel`: ``"fa2"`` on CUDA, else ``"reference"``
rewrites, hf.py     :func:`unsupported_reason`: why a call should stay with stock
                    PyTorch, or None
padded batches      :func:`padded_kernel`: ``"sdpa"`` (PyTorch's SDPA on the padded
                    tensors with the key-padding mask, no read of the mask) for a
                    padded encoder batch too small for a ragged kernel's host work
                    to pay, else ``"ragged"`` (the op)
variants            :func:`variant`: which of ``"window"``, ``"softcap"``, ``"sinks"`` a
                    call uses (a sorted tuple, ``()`` for plain attention); every
                    function above takes it as ``variant=``
==================  =====================================================================

Variants, where they run:

==========  ================================  =========================================
variant     CPU                               CUDA
==========  ================================  =========================================
window      the fused CPU kernel (a band      PyTorch's FlashAttention-2, forward and
            mask per piece)                   backward (both sides bounded); short
                                              windows' forward: window_forward.py
                                              (:func:`window_kernel`)
sinks       the fused CPU kernel (output and  a fused forward's output and LSE
            LSE rescaled; exact backward)     rescaled; FlashAttention-2's backward
softcap     the reference kernel (the fused   FlashInfer's forward (capped at plan
            kernel cannot cap scores)         time, a left window too) and its
                                              LSE; segment_backward.py's Triton
                                              backward
softcap +   the reference kernel              the reference kernel, said once at
sinks                                         WARNING
==========  ================================  =========================================

Each reason is one message, written once below. Kernels and variants plug in
here: a new kernel adds its support test to :func:`_cuda_forward_reason` (or
its own), a new choice a function beside these.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import config
from ..logs import warn_once
from ..validation import SUPPORTED_DTYPES
from . import fa4_backward, fa4_forward, flash_backward, segment_backward, window_forward
from . import flashinfer as fi

__all__ = [
    "WINDOW",
    "SOFTCAP",
    "SINKS",
    "variant",
    "cuda_runs_reference",
    "dropout_kernel",
    "flashinfer_window",
    "window_kernel",
    "forward_kernel",
    "forward_reason",
    "flashinfer_backend",
    "cuda_backend",
    "predicted_fa3_over_fa2",
    "trains_with_lse",
    "training_reason",
    "backward_kernel",
    "backward_work",
    "fa4_backward_pays",
    "fa4_failed",
    "unsupported_reason",
    "padded_kernel",
]

# -- variants ---------------------------------------------------------------------

WINDOW, SOFTCAP, SINKS = "window", "softcap", "sinks"


def variant(causal: bool, window_size=(-1, -1), softcap: float = 0.0, sinks=None) -> tuple[str, ...]:
    """The variants a call uses: a sorted tuple of :data:`SINKS`, :data:`SOFTCAP`,
    :data:`WINDOW`, ``()`` for plain (causal or not) attention.

    A window counts where it bounds more than causal does: ``left >= 0``, or
    ``right >= 0`` without causal (causal caps ``right`` at 0 itself).
    """
    left, right = window_size
    names = []
    if sinks is not None:
        names.append(SINKS)
    if softcap:
        names.append(SOFTCAP)
    if left >= 0 or (right >= 0 and not causal):
        names.append(WINDOW)
    return tuple(names)


def _variant_reason(
    device: torch.device, dtype: torch.dtype, head_dim, variant: tuple[str, ...], *, training: bool = False,
    causal: bool = False, window=(-1, -1),
) -> str | None:
    """Why a CUDA variant call runs the reference kernel, or None.

    Sliding windows run PyTorch's FlashAttention-2, forward and backward (both
    sides bounded; FlashInfer's ragged kernels bound the left only), the forward
    of short ones window_forward.py's (:func:`window_kernel`). Sinks
    rescale a fused forward's output by ``sigmoid(lse - sink)`` (FlashInfer's,
    or FlashAttention-2's with a window) and hand FlashAttention-2's backward
    that output and LSE, which gives their exact gradients
    (``flash_backward.with_sinks``). Soft-capped calls (with a left window or
    none, no sinks) run FlashInfer's forward, which caps at plan time, and train
    on its LSE with segment_backward.py's Triton backward (``training``: where
    that backward cannot run, the reference's gradients)."""
    if not variant:
        return None
    if not isinstance(head_dim, int):
        return "the head dim is symbolic"
    if SOFTCAP not in variant:  # windows and/or sinks
        why = None
        if WINDOW in variant or training:
            why = flash_backward.unsupported_reason(device, dtype, head_dim)
            why = None if why is None else f"{' / '.join(variant)} run FlashAttention-2 on CUDA, but {why}"
        if WINDOW not in variant:
            why = why or _cuda_forward_reason(dtype, head_dim)
        return why
    if SINKS not in variant:
        if flashinfer_window(causal, window) is None:
            return "FlashInfer soft-caps with a left window only, and this window bounds the right"
        why = _cuda_forward_reason(dtype, head_dim)
        if why is None and training:
            why = segment_backward.unsupported_reason(device, dtype, head_dim)
            why = None if why is None else f"soft-capped training runs a Triton backward, but {why}"
        return why
    return f"CUDA kernels for {' / '.join(variant)} are not wired yet (planned)"


def flashinfer_window(causal: bool, window=(-1, -1)) -> int | None:
    """FlashInfer's ``window_left`` for a call's window (-1: none), or None where its
    mask cannot express the window: a right bound without causal."""
    left, right = window
    if right >= 0 and not causal:
        return None
    return left


def window_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, causal: bool, window=(-1, -1)) -> str:
    """The CUDA kernel of a windowed call (forward, and the training forward whose LSE
    FlashAttention-2's backward takes): ``"window"`` (window_forward.py: key tiles
    that start where the window does) for a short window with both sides bounded,
    ``"fa2"`` (PyTorch's FlashAttention-2) otherwise. The caller checked that
    :func:`forward_kernel` gives ``"fa2"``."""
    if window_forward.pays(causal, window, head_dim) and window_forward.unsupported_reason(device, dtype, head_dim) is None:
        return "window"
    return "fa2"


def cuda_runs_reference(
    device: torch.device, dtype: torch.dtype, head_dim: int, variant: tuple[str, ...], *, training: bool = False,
    causal: bool = False, window=(-1, -1),
) -> bool:
    """Whether a CUDA kernel of the op hands a variant call to the reference kernel
    (exact); says so once at WARNING. ``training``: the LSE pair's kernels."""
    if device.type != "cuda":
        return False
    reason = _variant_reason(device, dtype, head_dim, variant, training=training, causal=causal, window=window)
    if reason is None:
        return False
    warn_once(f"{reason}: CUDA ragged attention with {' / '.join(variant)} runs the (slow, exact) reference kernel")
    return True


# -- forward ----------------------------------------------------------------------


@functools.cache
def _cuda_forward_reason(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer cannot take a CUDA call, or None."""
    if not fi.available():
        return "flashinfer is not importable (pip install flashinfer-python)"
    if dtype not in fi.DTYPES:
        return f"FlashInfer takes float16/bfloat16, got {dtype}; cast q/k/v to bfloat16 for FlashInfer speed"
    if fi.flashinfer_head_dim(head_dim) is None:
        return f"FlashInfer takes head_dim <= 256, got {head_dim}"
    return None


_CPU_SOFTCAP = "the fused CPU kernel cannot soft-cap scores"


def forward_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, variant: tuple[str, ...] = ()) -> str:
    """The forward kernel of a call: ``"cpu"``, ``"flashinfer"``, ``"fa2"`` or
    ``"reference"``. ``variant``: :func:`variant` of the call (on CUDA windows run
    ``"fa2"``, which :func:`window_kernel` resolves to FlashAttention-2 or
    window_forward.py; softcap FlashInfer (with a left window: see
    :func:`cuda_runs_reference` for a two-sided one), sinks the reference; on CPU
    softcap the reference)."""
    if device.type == "cpu":
        if dtype == torch.float64 or config.flag(config.REFERENCE) or SOFTCAP in variant:
            return "reference"
        return "cpu"
    if device.type == "cuda":
        if variant:
            if _variant_reason(device, dtype, head_dim, variant) is not None:
                return "reference"
            return "fa2" if WINDOW in variant and SOFTCAP not in variant else "flashinfer"
        if _cuda_forward_reason(dtype, head_dim) is None:
            return "flashinfer"
    return "reference"


def forward_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, variant: tuple[str, ...] = ()
) -> str | None:
    """Why a call runs the (slow, exact) reference kernel, or None where it runs a fast one."""
    if device.type == "cuda":
        if variant:
            return _variant_reason(device, dtype, head_dim, variant)
        return _cuda_forward_reason(dtype, head_dim)
    if device.type == "cpu":
        if dtype == torch.float64:
            return None  # float64 is the reference's own precision: it is the kernel for it
        if config.flag(config.REFERENCE):
            return f"{config.REFERENCE} is set"
        if SOFTCAP in variant:
            return _CPU_SOFTCAP
        return None
    return f"no kernel of its own on {device.type}"


# fa3 time over fa2 time per call, measured on the H200 (bf16, ~33k tokens, both
# kernels through flashinfer.py, causal split included; bench/sweep_backends.py,
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
# fa3's plan costs more host time than fa2's, once per forward: ~0.4 ms plus ~2 us
# per segment more (sweep_backends.json: plan_fa3_ms against plan_fa2_ms). Where
# the host decides a forward's time (small batches) the plan is on its critical
# path, so fa3 must save that much over a forward's layers (a dozen, say).
_FA3_EXTRA_PLAN_S = (4e-4, 2e-6)
_LAYERS_PER_PLAN = 12
# fa2's useful throughput on large layouts on the H200 (~370 TFLOP/s at head dim
# 128, sweep_backends.json): an upper bound, so a call's time is never overestimated.
_FA2_FLOPS = 370e12


def _interp_log(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear in log(x) through ``points``, clamped at both ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + t * (y1 - y0)
    return points[-1][1]


def predicted_fa3_over_fa2(mean_kv: float, hq: int, hkv: int, head_dim: int, causal: bool) -> float:
    """fa3's predicted time over fa2's for a layout (see ``_FA3_OVER_FA2``)."""
    group = max(1, hq // max(hkv, 1))
    # d <= 64 pads to 64, anything larger uses the 128 table (256 is unmeasured:
    # fa3's advantage there is no smaller). GQA was measured at d=128 only; it
    # favours fa2 on short segments far more than the head dim does.
    dim = 64 if fi.flashinfer_head_dim(head_dim) == 64 and group == 1 else 128
    mean_kv = max(mean_kv, 1.0)
    if group == 1 or dim == 64:
        return _interp_log(_FA3_OVER_FA2[(dim, 1, causal)], mean_kv)
    # between measured group sizes 1, 4, 8: linear in log2(group)
    at = {g: _interp_log(_FA3_OVER_FA2[(128, g, causal)], mean_kv) for g in (1, 4, 8)}
    lg = math.log2(group)
    if lg <= 2:
        return at[1] + (at[4] - at[1]) * lg / 2
    return at[4] + (at[8] - at[4]) * min(lg - 2, 1.0)


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def flashinfer_backend(
    requested: str,
    device: torch.device,
    n: int,
    total_k: int,
    *,
    hq: int = 1,
    hkv: int = 1,
    head_dim: int = 128,
    causal: bool = False,
    pairs: int | None = None,
) -> str:
    """Resolve ``"auto"`` to ``"fa2"`` or ``"fa3"`` for one layout; pass ``"fa2"`` and
    ``"fa3"`` through. ``"varlen"`` (a runtime asking for PyTorch's
    FlashAttention-2, on a call that must plan FlashInfer: a layout it cannot
    take, a variant, a CUDA graph) resolves as ``"auto"``.

    fa3 exists on SM90 only. There, the measured cost table picks fa3 where it
    is predicted at least 2% faster than fa2 (long segments; short causal
    segments with one k/v head per query head), fa2 elsewhere (short
    segments, above all with GQA, where fa2 packs a group's heads into rows).
    ``pairs`` (the layout's query-key pairs per head, ``sum(Lq * Lk)``) bounds
    what fa3 can save per call; fa2 runs where that does not pay for fa3's
    costlier plan (``_FA3_EXTRA_PLAN_S``) over a forward's layers.
    """
    if requested not in ("auto", "varlen", "fa4"):
        return requested
    if not _is_sm90(device.index if device.index is not None else torch.cuda.current_device()):
        return "fa2"
    ratio = predicted_fa3_over_fa2(total_k / max(n, 1), hq, hkv, head_dim, causal)
    if ratio >= _FA3_MARGIN:
        return "fa2"
    if pairs is not None:
        fa2_s = 4 * pairs * hq * head_dim / _FA2_FLOPS / (2 if causal else 1)
        base, per_segment = _FA3_EXTRA_PLAN_S
        if (1 - ratio) * fa2_s * _LAYERS_PER_PLAN < base + per_segment * n:
            return "fa2"
    return "fa3"


# PyTorch's FlashAttention-2 varlen forward (``aten._flash_attention_forward``, what
# ``torch.nn.attention.varlen.varlen_attn`` runs) plans nothing: its grid comes from
# the host's longest segments, which the step's layout holds. FlashInfer must plan
# each layout once per forward, on the host, right after the forward's one offsets
# read, when the GPU has drained: ~0.15-0.8 ms of FlashInfer's plan
# (sweep_backends.json) plus the runtime's own bookkeeping. Its kernels are faster
# (varlen_attn's time over FlashInfer's best, H200, bf16, 16 heads of 128, ~33k
# tokens, against the mean k/v tokens per segment: 1.12x on 244 segments of
# 16..256, 1.76x on 16 of 64..4096, 1.80x on 4 x 8192), so the plan pays for
# itself wherever the forward's attention is more than a sliver of work; on a
# small batch, where the host decides the time, it does not. Where lengths come
# from the host (Runtime.step(lengths)) a GPU-bound forward hides the plan behind
# earlier work: the lower end of its cost is taken, so that only clearly small
# layouts leave FlashInfer.
_PLAN_S = 3e-4
_VARLEN_OVER_FLASHINFER = [(136, 1.12), (2128, 1.76), (8192, 1.80)]
# varlen_attn's useful throughput on the same layouts (FLOP/s): short segments
# fill its tiles less
_VARLEN_FLOPS = [(136, 150e12), (2128, 330e12), (8192, 357e12)]


@functools.lru_cache(maxsize=1024)
def _plan_pays(mean_kv: float, pairs: int, hq: int, head_dim: int, causal: bool) -> bool:
    flops = 4 * pairs * hq * head_dim / (2 if causal else 1)
    varlen_s = flops / _interp_log(_VARLEN_FLOPS, max(mean_kv, 1.0))
    saved_s = varlen_s * (1 - 1 / _interp_log(_VARLEN_OVER_FLASHINFER, max(mean_kv, 1.0)))
    return saved_s * _LAYERS_PER_PLAN >= _PLAN_S


def cuda_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    active: int,
    active_k: int,
    pairs: int,
    *,
    hq: int,
    hkv: int,
    head_dim: int,
    causal: bool,
    max_q: int,
    total_q: int,
) -> str:
    """The CUDA kernel of a plain (no variant) call on a layout: ``"varlen"``
    (PyTorch's FlashAttention-2, no plan), or FlashInfer's ``"fa2"`` / ``"fa3"``
    (planned once per layout and step).

    ``requested`` is the runtime's ``backend``: ``"auto"`` picks ``"varlen"``
    where FlashInfer's plan would cost more host time than its faster kernel
    saves over a forward's layers (``_PLAN_S``: small batches), FlashInfer
    elsewhere (:func:`flashinfer_backend`); ``"fa2"``/``"fa3"`` always plan
    FlashInfer; ``"varlen"`` always runs FlashAttention-2 where it can: the
    layout has at most ``MAX_SEGMENTS`` segments (its grid has a block row per
    segment) and FlashAttention-2 runs on this GPU, dtype and head dim.
    ``n``: segments; ``active``/``active_k``: those with work on both sides and
    their keys; ``pairs``: query-key pairs per head (``sum(Lq * Lk)``); ``max_q``
    and ``total_q``: the longest q segment and the q tokens. With GQA and at most
    one query a segment, FlashAttention-2's forward folds a group's query heads
    into rows, assuming every segment holds exactly one query: it fails on empty
    ones (a shape error, found by the CUDA fuzz), so such layouts plan FlashInfer.
    """
    if requested in ("fa2", "fa3"):
        return requested
    if requested == "fa4":  # flash-attn-4 takes training forwards (training_forward): others as auto
        requested = "auto"
    varlen_runs = (
        n <= flash_backward.MAX_SEGMENTS and not (max_q == 1 and hq > hkv and total_q != n)
        and flash_backward.unsupported_reason(device, dtype, head_dim) is None
    )
    if requested == "varlen" and varlen_runs:
        return "varlen"
    if requested == "auto" and varlen_runs and not _plan_pays(
        active_k / max(active, 1), pairs, hq, flash_backward.fa2_head_dim(head_dim), causal
    ):
        return "varlen"
    return flashinfer_backend(
        requested, device, max(active, 1), active_k, hq=hq, hkv=hkv, head_dim=head_dim, causal=causal, pairs=pairs,
    )


# -- training -----------------------------------------------------------------------


@functools.cache
def _cuda_training_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    return _cuda_forward_reason(dtype, head_dim) or flash_backward.unsupported_reason(device, dtype, head_dim)


def training_reason(device: torch.device, dtype: torch.dtype, head_dim) -> str | None:
    """Why a grad-requiring CUDA call cannot train on FlashInfer's forward and a fused
    backward (it runs the reference kernel's exact gradients), or None."""
    if device.type != "cuda":
        return "the fused training kernels are CUDA-only"
    if not isinstance(head_dim, int):
        return "the head dim is symbolic"
    return _cuda_training_reason(device, dtype, head_dim)


def trains_with_lse(device: torch.device, dtype: torch.dtype, head_dim: int, variant: tuple[str, ...] = ()) -> bool:
    """Whether a grad-requiring call runs the LSE pair: on CUDA where FlashInfer and a
    fused backward take it (else, said once, the reference; always for a variant);
    on CPU wherever the fused CPU kernel runs, whose backward then reuses the
    forward's LSE (windows and sinks too)."""
    if device.type == "cuda":
        if variant:
            # windows and sinks: fused forwards and FlashAttention-2's backward;
            # softcap FlashInfer's forward and segment_backward.py's backward
            return _variant_reason(device, dtype, head_dim, variant, training=True) is None
        reason = training_reason(device, dtype, head_dim)
        if reason is None:
            return True
        if isinstance(head_dim, int) and _cuda_forward_reason(dtype, head_dim) is None:
            # FlashInfer runs the forward; only the backward is the reference's. (A
            # forward FlashInfer cannot take says so itself, for both directions.)
            warn_once(f"a CUDA call needs gradients but {reason}: its backward runs the (slow, exact) reference kernel")
        return False
    return forward_kernel(device, dtype, head_dim, variant) == "cpu"


# flash-attn-4's backward (its isolation layout written by the fused gather included)
# against FlashAttention-2's, forward+backward on the H200 over layout classes x causal x
# GQA x head dims 64/80/128/256 (bench/results/train-bwd-sweep.json): FA4's kernel is
# up to ~2x faster, but isolating segments copies every row in and out, a cost per token
# that only enough work per copied row repays. The work: query-key pairs per head over
# the rows copied, weighted by heads (2*hq*pairs / (hq*Tq + hkv*Tk), halved when causal:
# self-attention's key pairs per query row, weighted by 2*hq/(hq+hkv), since GQA copies
# fewer k/v heads than it computes with; a cross-attention over many more keys than
# queries copies its keys too). FA4 from these thresholds, by the head dim FA4 computes
# at (80 runs at 96), and only where padding each segment to a tile at most doubles the
# rows of either side (fa4_backward.pads_little: its buffers are sized on the host by the
# segment slots, so a compiled packed layout with a slot per token would take ~128x T).
# The sweep times the backward after FlashAttention-2's forward; after FlashInfer's (the
# training forward wherever a plan pays), the attention benchmark measured FA4 slower
# on the ViT layout, causal (work 471 at d=128: 2.36-2.41 against FA2's 1.93 ms, three
# calls; bench/results/train-attn.json) where the sweep had it 5% faster. So FA4 only
# where the sweep has it >= 6-8% faster; its rows on either side, FA4's time over FA2's:
# d=64 1.05 at 941, 0.74 at 1450; d=96 0.97 at 655, 0.78 at 941; d=128 0.95 at 524,
# 0.91 at 655; d=256 1.02 at 655, 0.94 at 941 (taken: 6% off either way).
_FA4_MIN_WORK = ((64, 1200.0), (96, 800.0), (128, 600.0), (256, 900.0))
# Isolation by recompute (fa4_backward.redo_isolation, the default at head dims FA4
# computes as they are) copies nothing: on finite data it adds one read of each
# gradient and two near-empty launches to FA4's kernel, 0.0-0.3 ms at ~31-34k tokens
# of 16 heads of 128 (bench/results/isolation.json), so FA4 pays from less work. Fitted
# on bench/results/train-bwd-sweep-redo.json (FA4's column timed with it), each
# threshold between the rows either side, FA4's time over FA2's: d=64 1.49 at 655,
# 0.71 at 941 (its causal 471: 1.35); d=128 1.07 at 327, 0.84 at 471; d=256 1.10 at
# 327, 0.92 at 471. d=96 (not swept with it) between its neighbours.
_FA4_MIN_WORK_REDO = ((64, 700.0), (96, 500.0), (128, 400.0), (256, 450.0))


def backward_work(hq: int, hkv: int, total_q: int, total_k: int, pairs: int, causal: bool) -> float:
    """The work per copied row that :func:`backward_kernel` weighs (``pairs``: the
    layout's query-key pairs per head, ``sum(len_q * len_k)``)."""
    rows = hq * total_q + hkv * total_k
    if rows <= 0:
        return 0.0
    return 2.0 * hq * pairs / rows * (0.5 if causal else 1.0)


def fa4_backward_pays(head_dim: int, work: float) -> bool:
    """Whether flash-attn-4's backward, isolation included, beats FlashAttention-2's
    on a call of this head dim and :func:`backward_work` (False past the head dims
    it takes)."""
    if head_dim > _FA4_MIN_WORK[-1][0]:
        return False
    d = fa4_backward.fa4_head_dim(head_dim)
    table = _FA4_MIN_WORK_REDO if fa4_backward.redo_isolation(head_dim) else _FA4_MIN_WORK
    return work >= next(t for dim, t in table if dim >= d)


def backward_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, work: float | None = None,
    variant: tuple[str, ...] = (), slots: tuple[int, int, int] | None = None,
) -> str:
    """The CUDA backward of a training call: ``"fa4"`` (flash-attn-4 on SM90, when
    installed) or ``"fa2"`` (PyTorch's FlashAttention-2). ``work``: the call's
    :func:`backward_work`; ``slots``: (segment slots, total q, total k). ``auto``
    takes FA4 where it pays (:func:`fa4_backward_pays`; floods of short segments
    and ViT-sized layouts at small head dims stay on FA2) and, where it isolates
    segments by padding, its padded layout stays small
    (:func:`fa4_backward.pads_little`). Windows and sinks: FA2
    (flash-attn-4's variants are not wired), even where ``fa4`` is forced.

    ``RAGGED_COMPILE_BACKWARD=fa2|fa4`` forces one; ``fa4`` where it cannot run
    is an error that says why. Under ``torch.use_deterministic_algorithms(True)``
    it is FA2 (FA4's atomics make dq differ run to run in its last bits). If
    FA4's kernel fails once (a pre-release), FA2 from then on, with a WARNING
    (:func:`fa4_failed`)."""
    forced = config.choice(config.BACKWARD, config.BACKWARDS)
    if forced == "fa2" or variant:
        return "fa2"
    if torch.are_deterministic_algorithms_enabled():
        # FA4 accumulates dq (and GQA's dk/dv) with atomics; aten's FA2 backward
        # honours the flag itself.
        if forced == "fa4":
            raise RuntimeError(
                f"{config.BACKWARD}=fa4, but torch.use_deterministic_algorithms(True) is set and "
                "flash-attn-4's backward is not bitwise deterministic; unset one of them"
            )
        return "fa2"
    if forced == "auto" and (
        (work is not None and not fa4_backward_pays(head_dim, work))
        or (slots is not None and not fa4_backward.redo_isolation(head_dim)
            and not fa4_backward.pads_little(*slots))
    ):
        return "fa2"  # decided before anything imports flash-attn-4
    reason = fa4_backward.unsupported_reason(device, dtype, head_dim)
    if reason is None:
        return "fa4"
    if forced == "fa4":
        raise RuntimeError(f"{config.BACKWARD}=fa4, but {reason}; unset it to use FlashAttention-2's backward")
    if fa4_backward.installed():
        _warn_fa4(reason)
    return "fa2"


# flash-attn-4's forward (isolation by recompute included) against FlashInfer's training
# forward (its LSE converted), H200, bf16, ~29-34k tokens, short / ViT / mid / mixed /
# long layouts x causal x heads 16/16 x 128, 32/8 x 128, 16/16 x 64, 8/8 x 256
# (bench/results/train-fwd-sweep.json, the forward alone, FA4's time over FlashInfer's).
# Its kernel alone is about FlashInfer's fa3 on the ViT, mid and mixed layouts and
# faster only on long segments at head dim 256 (0.86 / 0.91 on 4 x 8192, causal or not;
# 1.04 / 1.50 on 16 x <= 4096), while its Python interface and the isolation's launches
# cost ~1 ms of host time a call, which shows wherever a call has less GPU work than
# that (1.3-8x on the short, ViT and mid layouts). At head dims 64 and 128 no rule
# monotone in the work finds a win on long segments: 0.97 (16/16 x 128) and 1.05
# (32/8 x 128) without causal, 1.01 and 0.95 causal, 1.00 and 1.34 at 16/16 x 64. So FA4's
# forward at head dim 256 only, from this many key pairs per query row (halved when
# causal: :func:`forward_work`; GQA does not change the forward's per-row work), between
# the mixed rows (2,900) and the long ones (4,096):
_FA4_FORWARD_MIN_WORK = ((256, 3500.0),)


def forward_work(total_q: int, pairs: int, causal: bool) -> float:
    """Key pairs per query row and head (``pairs``: the layout's ``sum(Lq * Lk)``),
    halved when causal: what :func:`fa4_forward_pays` weighs."""
    return pairs / max(total_q, 1) * (0.5 if causal else 1.0)


def fa4_forward_pays(head_dim: int, work: float) -> bool:
    """Whether flash-attn-4's forward, isolation included, beats FlashInfer's on a
    training call of this head dim and :func:`forward_work`."""
    return any(dim == head_dim and work >= t for dim, t in _FA4_FORWARD_MIN_WORK)


def training_forward(
    requested: str, device: torch.device, dtype: torch.dtype, head_dim: int, hq: int, hkv: int, pairs: int,
    causal: bool, slots: tuple[int, int, int],
) -> str | None:
    """``"fa4"`` where a plain training call's CUDA forward runs flash-attn-4's
    (backends/fa4_forward.py), else None (FlashInfer's or FlashAttention-2's,
    :func:`cuda_backend`). ``requested``: the runtime's backend; ``"fa4"`` takes
    it wherever it runs, ``"auto"`` where the forward pays
    (:func:`fa4_forward_pays`) and its backward is flash-attn-4's too
    (:func:`backward_kernel`: the pair shares the LSE as it is). ``pairs``: the
    layout's query-key pairs per head; ``slots``: (segment slots, total q, total k)."""
    if requested not in ("auto", "fa4") or device.type != "cuda":
        return None
    if requested == "auto":
        _, total_q, total_k = slots
        if not fa4_forward_pays(head_dim, forward_work(total_q, pairs, causal)):
            return None  # decided before anything imports flash-attn-4
        work = backward_work(hq, hkv, total_q, total_k, pairs, causal)
        try:
            if backward_kernel(device, dtype, head_dim, work, (), slots) != "fa4":
                return None
        except RuntimeError:
            return None  # a forced backward that cannot run raises in the backward, as before
    return "fa4" if fa4_forward.unsupported_reason(device, dtype, head_dim) is None else None


def fa4_failed(err: Exception, device: torch.device, dtype: torch.dtype, head_dim: int,
               direction: str = "backward", forced: bool = False) -> None:
    """FA4's kernel raised (a JIT or launch failure of the pre-release): re-raise where
    it was forced (``forced``: the forward by the runtime's backend), else use FA2
    (FlashInfer or FA2 for the forward) for the rest of the process, with a WARNING."""
    oom = isinstance(err, torch.OutOfMemoryError) or isinstance(err.__cause__, torch.OutOfMemoryError)
    if forced or config.choice(config.BACKWARD, config.BACKWARDS) == "fa4" or oom:
        raise err
    fa4_backward.disable(f"its {direction} failed ({type(err).__name__}: {str(err)[:300]})")
    _warn_fa4(fa4_backward.unsupported_reason(device, dtype, head_dim))


def _warn_fa4(reason: str) -> None:
    warn_once(f"flash-attn-4 is installed but {reason}: training uses FlashAttention-2's (slower) backward")


# -- attention dropout ---------------------------------------------------------------


def dropout_kernel(device: torch.device, dtype: torch.dtype, head_dim) -> str:
    """The kernel of a call with attention dropout, forward and backward: ``"fa2"``
    (PyTorch's FlashAttention-2, which draws the mask in the kernel; FlashInfer has
    no dropout) on CUDA where it runs, else ``"reference"`` (exact, per segment)."""
    if device.type == "cuda" and isinstance(head_dim, int) and flash_backward.unsupported_reason(device, dtype, head_dim) is None:
        return "fa2"
    return "reference"


# -- rewrites ------------------------------------------------------------------------


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, head_dim, *, training: bool = False, variant: tuple[str, ...] = (),
    dropout: bool = False,
) -> str | None:
    """Why a rewrite (the NJT handler, the Inductor passes, hf.py) should leave an
    attention call to stock PyTorch, or None to put it on the op.

    On CPU the op takes every supported dtype: its CPU kernel (or, for float64,
    the reference) is faster than stock, which on CPU has no fused kernel for
    NJTs. On CUDA the call must reach FlashInfer, and with ``training`` a fused
    backward too: stock fp32 or head_dim > 256 attention there is a fused kernel,
    and ours would be the reference.

    ``variant`` (:func:`variant`): on CPU every variant stays on the op (windows
    and sinks on the fused CPU kernel, softcap on the reference, all exact and
    skipping padding); on CUDA windows run FlashAttention-2 (forward and
    backward) and softcap FlashInfer's forward (not ``training``: its gradients
    would be the reference's), others the reference kernel for now, so the
    caller keeps those on its stock path where that path is exact (a rewritten
    SDPA call, a model's own eager attention). A two-sided window with softcap
    the caller cannot see here: the op runs the reference for it.
    """
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} is not supported"
    if dropout:  # FlashAttention-2 both ways, or nothing fast
        if variant:
            return "attention dropout with a window, softcap or sinks has no kernel"
        if dropout_kernel(device, dtype, head_dim) == "reference":
            return "attention dropout would run the (slow, exact) reference kernel here (FlashAttention-2 runs it on CUDA)"
        return None
    if device.type != "cuda":
        return None
    if not isinstance(head_dim, int):
        return "the head dim is symbolic"
    if variant:
        reason = _variant_reason(device, dtype, head_dim, variant, training=training)
    elif training:
        reason = _cuda_training_reason(device, dtype, head_dim)
    else:
        reason = _cuda_forward_reason(dtype, head_dim)
    if reason is not None:
        return f"{reason}, so the op would run the reference kernel on CUDA"
    return None


# -- padded batches (hf.py) -------------------------------------------------------------

# A padded batch whose attention is a sliver of work leaves an eager forward
# host-bound (BERT-base, 12 layers: ~5-6 ms of host time per forward on the H200's
# host, ~0.45 ms a layer, for any batch up to ~16 x 512 tokens). There the ragged
# path's host work (the mask read to the host once per forward, the layout, the
# op's per-call path) is what decides the time, and the padded keys SDPA computes
# cost nothing anybody waits for. Up to this many FLOPs of padded attention a
# call, the key-padding mask goes straight to SDPA (bench/results/host.md).
_DENSE_MAX_FLOPS = 2e10


def full_rows_kernel(hq: int, hkv: int, sq: int, sk: int, causal: bool) -> str:
    """How an eager call runs whose rows pad nothing (a 2-D padding mask, read once
    per forward, with every row full, or no mask and no packing): ``"sdpa"``,
    PyTorch's dense kernel without a mask, as
    stock transformers runs it (its mask function drops an all-ones mask). Dense
    rows of equal length are that kernel's own case; the op would only add its
    layout (measured on the H200: on full BERT-large 32 x 512 rows the op ran at
    0.91x the speed of ``"sdpa"``, this route at 0.98x). ``"ragged"`` where the
    dense call would not be the same attention (GQA, or causal with unequal
    query and key lengths: SDPA aligns top-left)."""
    if hq != hkv or (causal and sq != sk):
        return "ragged"
    return "sdpa"


def padded_kernel(batch: int, sq: int, sk: int, hq: int, head_dim: int, causal: bool) -> str:
    """How an eager, non-causal call on a padded batch (a 2-D key padding mask, no
    window or other variant; inference or training, whose dropout SDPA draws as
    stock does) runs: ``"sdpa"`` (PyTorch's
    ``scaled_dot_product_attention`` on the padded q/k/v with the mask as is:
    the kernel stock runs, without reading the mask to the host) where the batch
    is small enough that host work decides its time (``_DENSE_MAX_FLOPS``), else
    ``"ragged"`` (the op on the mask's layout). Causal calls are always ragged."""
    if causal:
        return "ragged"
    return "sdpa" if 4 * batch * sq * sk * hq * head_dim <= _DENSE_MAX_FLOPS else "ragged"
