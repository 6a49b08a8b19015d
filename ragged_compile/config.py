"""Every environment variable ragged_compile reads, parsed one way.

============================  =======================  ==========================================
variable                      values                   read
============================  =======================  ==========================================
``RAGGED_COMPILE_DEBUG``      flag                     at import; :func:`ragged_compile.set_debug_checks`
                                                       changes it later. Checks device-resident
                                                       ``cu_seqlens`` values on every call (a sync).
``RAGGED_COMPILE_REFERENCE``  flag                     at every call: the op runs the reference
                                                       kernel on CPU instead of the fused CPU kernel.
``RAGGED_COMPILE_BACKEND``    ``auto``/``fa2``/``fa3``/  when a :class:`~ragged_compile.Runtime` is made
                              ``varlen``/``fa4``       (the CUDA forward: FlashInfer's kernel
                                                       family, PyTorch's FlashAttention-2, or
                                                       flash-attn-4's for training calls).
``RAGGED_COMPILE_BACKWARD``   ``auto``/``fa2``/``fa4``   at every training backward on CUDA.
``RAGGED_COMPILE_FA4_PAD``    ``redo``/``fused``/      at every flash-attn-4 backward: how it
                             ``copies``               keeps segments independent. ``redo``:
                                                       no padding, the segments whose
                                                       gradients come out non-finite computed
                                                       again (backends/segment_backward.py;
                                                       head dims FA4 pads take ``fused``);
                                                       ``fused``/``copies``: a padded layout
                                                       written by one Triton gather a side,
                                                       or by PyTorch's copies
                                                       (backends/tile_pad.py).
============================  =======================  ==========================================

A flag is on for any value but ``""``, ``0``, ``false``, ``no`` and ``off``
(any case): ``RAGGED_COMPILE_REFERENCE=0`` is off.
"""

from __future__ import annotations

import os

__all__ = ["flag", "choice", "DEBUG", "REFERENCE", "BACKEND", "BACKWARD", "FA4_PAD", "BACKENDS", "BACKWARDS", "FA4_PADS"]

DEBUG = "RAGGED_COMPILE_DEBUG"
REFERENCE = "RAGGED_COMPILE_REFERENCE"
BACKEND = "RAGGED_COMPILE_BACKEND"
BACKWARD = "RAGGED_COMPILE_BACKWARD"
FA4_PAD = "RAGGED_COMPILE_FA4_PAD"

BACKENDS = ("auto", "fa2", "fa3", "varlen", "fa4")
BACKWARDS = ("auto", "fa2", "fa4")
FA4_PADS = ("redo", "fused", "copies")

_OFF = ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """Whether the flag variable ``name`` is on (unset is off)."""
    return os.environ.get(name, "").strip().lower() not in _OFF


def choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of ``name``, one of ``choices`` (unset or empty: the first)."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (or unset), got {value!r}")
    return value
