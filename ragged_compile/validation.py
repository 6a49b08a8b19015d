"""Argument checks shared by the public function, the kernels and the runtime.

Two kinds of check live here:

* metadata checks (`check_inputs`) look only at dtypes, devices, ranks and
  sizes. They cost nothing, run on every call and work on fake tensors while
  Dynamo traces, so a compiled model fails at trace time with the same message.
* value checks (`check_cu_seqlens_values`) need the *contents* of
  ``cu_seqlens``. They run on host copies: the CPU kernel and the planner have
  those anyway. On a GPU, reading device-resident offsets costs a
  device-to-host sync, so the per-call hot path never does it unless
  ``RAGGED_COMPILE_DEBUG=1`` (or :func:`set_debug_checks`) asks for it (config.py).
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import torch

from . import config

__all__ = [
    "SUPPORTED_DTYPES", "check_inputs", "check_meta", "check_values", "check_cu_seqlens_values", "debug_checks", "set_debug_checks",
    "check_variants", "check_variants_meta",
]

# Dtypes the op computes (the reference kernel); FlashInfer takes fp16/bf16.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)
_DEBUG = config.flag(config.DEBUG)


def debug_checks() -> bool:
    """Whether device-resident ``cu_seqlens`` are checked on every call (costs a sync)."""
    return _DEBUG


def set_debug_checks(enabled: bool) -> None:
    """Turn per-call value checks of device-resident ``cu_seqlens`` on or off."""
    global _DEBUG
    _DEBUG = bool(enabled)


def _tracing() -> bool:
    """Whether ``torch.jit.trace`` is recording this call.

    Sizes of traced tensors are then 0-d tensors, and turning one into a Python
    bool or int records a constant in place of the size (a ``TracerWarning``).
    Checks of sizes and values are skipped here: the trace records the op, and
    the op's kernel, which tracing runs on plain tensors, checks them again, now
    on the example inputs and at every run of the trace, with the same messages.
    """
    return torch.jit.is_tracing()


def _check_cu_meta(cu: torch.Tensor, name: str, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32/int64 offsets, got {type(cu).__name__}")
    if cu.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"{name} must have dtype int32 or int64, got {cu.dtype}; "
            f"build it with torch.cumsum(lengths, 0) prefixed by 0 and .to(torch.int32)"
        )
    if cu.dim() != 1:
        raise ValueError(
            f"{name} must be 1-D of shape [num_segments + 1], got shape {tuple(cu.shape)}"
        )
    if not _tracing() and cu.shape[0] < 1:
        raise ValueError(f"{name} must hold at least one offset (the leading 0), got an empty tensor")
    if cu.device != device:
        raise ValueError(
            f"{name} is on {cu.device} but q is on {device}; move it with {name}.to(q.device)"
        )


_Tensor = torch.Tensor


def _plainly_valid(q, k, v, cu_q, cu_k, scale) -> bool:
    """The common valid call, recognised in a few microseconds: plain tensors (no
    subclass, no fake or symbolic sizes) that pass every check of
    :func:`check_inputs`. Anything else takes the full checks, which say what is wrong."""
    if torch.compiler.is_compiling():
        return False  # symbolic sizes and scales: the full checks trace, these would guard
    if not (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor
            and type(cu_q) is _Tensor and type(cu_k) is _Tensor) or q.is_nested or k.is_nested or v.is_nested:
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 3 or len(ks) != 3 or len(vs) != 3 or cu_q.dim() != 1 or cu_k.dim() != 1:
        return False
    dtype, device = q.dtype, q.device
    return (
        dtype in SUPPORTED_DTYPES and k.dtype == dtype and v.dtype == dtype
        and ks[0] == vs[0] and ks[1] == vs[1] and qs[2] == ks[2] == vs[2] > 0
        and qs[1] > 0 and ks[1] > 0 and qs[1] % ks[1] == 0
        and cu_q.dtype in _INDEX_DTYPES and cu_k.dtype in _INDEX_DTYPES
        and 1 <= cu_q.shape[0] == cu_k.shape[0]
        and k.device == device and v.device == device and cu_q.device == device and cu_k.device == device
        and (scale is None or (type(scale) is float and math.isfinite(scale)))
    )


def _check_qkv_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"k and v must have the same [tokens, heads], got k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(
            f"q, k and v must share head_dim, got q={q.shape[2]}, k={k.shape[2]}, v={v.shape[2]}"
        )
    hq, hkv = q.shape[1], k.shape[1]
    if hq == 0:
        raise ValueError(
            f"q has 0 heads (shape {tuple(q.shape)}); q must be [tokens, heads, head_dim] with "
            f"heads >= 1: check the reshape of the query projection"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q heads ({hq}) must be a positive multiple of k/v heads ({hkv}) for GQA/MQA; "
            f"repeat or regroup the k/v heads"
        )
    if q.shape[2] == 0:
        raise ValueError("head_dim must be positive, got 0")


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float | None,
) -> None:
    """Check everything that can be checked without reading tensor values."""
    tracing = _tracing()
    if not tracing and _plainly_valid(q, k, v, cu_seqlens_q, cu_seqlens_k, scale):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(
                f"{name} is a nested tensor; pass its packed values ({name}.values()) and "
                f"offsets, or run the model under ragged_compile.enable()"
            )
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be packed as [tokens, heads, head_dim], got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}, which ragged_attention does not compute (it takes "
                f"float16, bfloat16, float32, float64); cast q, k and v with .to(torch.bfloat16) "
                f"(FlashInfer on CUDA) or .to(torch.float32)"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}; "
            f"cast them with .to({q.dtype})"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if not tracing:
        _check_qkv_sizes(q, k, v)
    _check_cu_meta(cu_seqlens_q, "cu_seqlens_q", q.device)
    _check_cu_meta(cu_seqlens_k, "cu_seqlens_k", q.device)
    if not tracing and cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0] - 1} segments but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0] - 1}; segment i of q attends segment i of k/v, so both "
            f"layouts need the same number of segments (use zero-length segments to align them)"
        )
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if torch.compiler.is_compiling() or not isinstance(scale, numbers.Real):
            # A float attribute under torch.compile(dynamic=True) is symbolic there:
            # math.isfinite cannot trace, a comparison can (a runtime assertion).
            torch._check(abs(scale) < math.inf, lambda: "scale must be finite; pass None for head_dim ** -0.5")
        elif not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}; pass None for head_dim ** -0.5")


def check_cu_seqlens_values(
    cu: torch.Tensor, total: int, name: str, max_seqlen: int | None = None
) -> torch.Tensor:
    """Check a *host* copy of offsets; returns the per-segment lengths (int64, CPU)."""
    arg = "max_seqlen_q" if name.endswith("_q") else "max_seqlen_k"
    if max_seqlen is not None:
        try:
            if isinstance(max_seqlen, bool):
                raise TypeError
            max_seqlen = operator.index(max_seqlen)
        except TypeError:
            raise TypeError(f"{arg} must be an int or None, got {type(max_seqlen).__name__}") from None
    cu = cu.to("cpu", torch.int64)
    if _tracing():  # the op's kernel checks the offsets (see _tracing); max_seqlen never changes the result
        return cu[1:] - cu[:-1]
    # numpy: the planner checks every new layout, and torch's CPU ops cost microseconds each
    a = cu.numpy()
    if a.shape[0] and a[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(a[0])}; offsets start at the first token")
    lens = np.diff(a)
    if lens.shape[0] and (lens < 0).any():
        i = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i + 1}]={int(a[i + 1])} < "
            f"{name}[{i}]={int(a[i])}; offsets are the running sum of segment lengths"
        )
    if int(a[-1]) != total:
        tensor = "q" if name.endswith("_q") else "k/v"
        raise ValueError(
            f"{name}[-1] is {int(a[-1])} but {tensor} holds {total} tokens; the last offset "
            f"must equal the number of packed tokens"
        )
    if max_seqlen is not None and lens.shape[0] and int(lens.max()) > max_seqlen:
        raise ValueError(
            f"a segment of {name} has {int(lens.max())} tokens, more than "
            f"{arg}={max_seqlen}; pass the true maximum or None"
        )
    return torch.from_numpy(lens)


def check_values(q, k, cu_seqlens_q, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Value checks of both offsets on host copies (a sync for device tensors);
    returns the q and k segment lengths."""
    return (
        check_cu_seqlens_values(cu_seqlens_q, q.shape[0], "cu_seqlens_q"),
        check_cu_seqlens_values(cu_seqlens_k, k.shape[0], "cu_seqlens_k"),
    )


def check_meta(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    """The ops' fake-kernel checks: metadata only, as ``torch._check`` so they
    hold on symbolic shapes under ``torch.compile``."""
    torch._check(q.dim() == 3, lambda: f"q must be [Tq, Hq, D], got {q.dim()}-D")
    torch._check(k.dim() == 3 and v.dim() == 3, lambda: "k and v must be [Tk, Hkv, D]")
    # One check per size: an `and` of symbolic sizes would guard on each (for k and
    # v built separately, one graph per outcome).
    torch._check(k.shape[0] == v.shape[0], lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in tokens")
    torch._check(k.shape[1] == v.shape[1], lambda: f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in heads")
    torch._check(k.shape[2] == q.shape[2], lambda: f"q, k, v head_dim differ: {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    torch._check(v.shape[2] == q.shape[2], lambda: f"q, k, v head_dim differ: {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    torch._check(
        k.shape[1] >= 1 and q.shape[1] >= 1,
        lambda: f"q heads ({q.shape[1]}) and k/v heads ({k.shape[1]}) must be >= 1",
    )
    torch._check(
        q.shape[1] % k.shape[1] == 0,
        lambda: f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})",
    )
    torch._check(
        cu_seqlens_q.dim() == 1 and cu_seqlens_k.dim() == 1,
        lambda: "cu_seqlens_q and cu_seqlens_k must be 1-D [n + 1]",
    )
    torch._check(
        cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0],
        lambda: "cu_seqlens_q and cu_seqlens_k must describe the same number of segments",
    )
    torch._check(
        q.dtype == k.dtype == v.dtype, lambda: f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    )
    torch._check(
        q.dtype in SUPPORTED_DTYPES,
        lambda: f"q has dtype {q.dtype}; ragged_attention takes float16, bfloat16, float32, "
        f"float64: cast q, k and v with .to(torch.bfloat16)",
    )


def _window_value(x, side: str) -> int:
    if type(x).__module__ == "numpy" and hasattr(x, "item"):
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        raise TypeError(
            f"window_size {side} must be an int (>= 0 tokens, or -1 for unbounded), got {type(x).__name__}; "
            f"pass window_size=(left, right), e.g. (sliding_window - 1, 0) for a causal sliding window"
        )
    if isinstance(x, numbers.Integral):
        x = int(x)
        if x < -1:
            raise ValueError(
                f"window_size {side} must be >= -1 (-1: unbounded), got {x}; pass window_size=(left, right)"
            )
    return x


def check_variants(q: torch.Tensor, window_size, softcap, sinks) -> tuple[int, int, float]:
    """Check the variant arguments of a call; returns ``(left, right, softcap)`` as
    ints and a float. ``sinks`` must be ``[Hq]`` floating on q's device, or None."""
    if sinks is None and type(softcap) is float and softcap == 0.0 and type(window_size) is tuple \
            and window_size == (-1, -1):
        return -1, -1, 0.0  # the plain call: nothing to check (a few us of the small-batch budget)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(
            f"window_size must be a 2-tuple (left, right) of ints, -1 for unbounded, got {window_size!r}; "
            f"e.g. window_size=(sliding_window - 1, 0) for a causal sliding window"
        )
    left, right = _window_value(window_size[0], "left"), _window_value(window_size[1], "right")
    if softcap is None:
        softcap = 0.0
    if type(softcap).__module__ == "numpy" and hasattr(softcap, "item"):
        softcap = softcap.item()
    if isinstance(softcap, bool) or not isinstance(softcap, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"softcap must be a float (0 for no cap), got {type(softcap).__name__}")
    if torch.compiler.is_compiling() or not isinstance(softcap, numbers.Real):
        # Symbolic under torch.compile(dynamic=True): a traceable check, as for scale.
        torch._check(softcap >= 0, lambda: "softcap must be >= 0 (0: no cap)")
        torch._check(softcap < math.inf, lambda: "softcap must be finite")
    else:
        softcap = float(softcap)
        if not math.isfinite(softcap) or softcap < 0:
            raise ValueError(
                f"softcap must be a finite float >= 0 (0: no cap; Gemma2 uses attn_logit_softcapping=50.0), "
                f"got {softcap}"
            )
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor of per-head logits [Hq] or None, got {type(sinks).__name__}")
        if not sinks.is_floating_point():
            raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}; cast it with .float()")
        if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            raise ValueError(
                f"sinks must be [Hq] = [{q.shape[1]}] (one logit per query head), got shape {tuple(sinks.shape)}; "
                f"reshape it with sinks.reshape({q.shape[1]})"
            )
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}; move it with sinks.to(q.device)")
    return left, right, softcap


def check_dropout(dropout_p, with_variant: bool) -> float:
    """``dropout_p`` as a float in [0, 1), or a clear error."""
    if type(dropout_p).__module__ == "numpy" and hasattr(dropout_p, "item"):
        dropout_p = dropout_p.item()
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (0: no dropout; pass 0 outside training), got {dropout_p}")
    if dropout_p and with_variant:
        raise ValueError(
            "dropout_p > 0 with window_size, softcap or sinks has no kernel; drop one of them (for inference "
            "pass dropout_p=0)"
        )
    return dropout_p


def check_variants_meta(q, window_left, window_right, softcap, sinks) -> None:
    """The ops' fake-kernel checks of the variant arguments (``torch._check``)."""
    torch._check(window_left >= -1, lambda: f"window_left must be >= -1 (-1: unbounded), got {window_left}")
    torch._check(window_right >= -1, lambda: f"window_right must be >= -1 (-1: unbounded), got {window_right}")
    torch._check(softcap >= 0, lambda: f"softcap must be >= 0 (0: no cap), got {softcap}")
    if sinks is not None:
        torch._check(sinks.dim() == 1, lambda: f"sinks must be [Hq], got {sinks.dim()}-D")
        torch._check(sinks.shape[0] == q.shape[1], lambda: f"sinks must be [Hq] = [{q.shape[1]}], got {tuple(sinks.shape)}")
        torch._check(sinks.dtype.is_floating_point, lambda: f"sinks must be floating, got {sinks.dtype}")
        torch._check(sinks.device == q.device, lambda: f"sinks is on {sinks.device} but q is on {q.device}")
