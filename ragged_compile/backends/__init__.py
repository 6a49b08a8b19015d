"""Device kernels of the ragged attention op. `flashinfer` is the CUDA one."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def pad_head_dim(x: torch.Tensor, dp: int) -> torch.Tensor:
    """``x`` zero-padded to head dim ``dp`` with a unit last stride, as the fused
    kernels take it. Zero columns change no score and no output; callers pass
    the true head dim's scale."""
    if x.shape[-1] != dp:
        return F.pad(x, (0, dp - x.shape[-1]))
    if x.stride(-1) != 1:
        return x.contiguous()
    return x


def on_device(x: torch.Tensor):
    """A context in which ``x``'s CUDA device is the current one: Triton launches its
    kernels on the current device, not on their arguments' (a model on ``cuda:1``
    with ``cuda:0`` current would otherwise run on the wrong GPU)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
