"""Buckets of CUDA-graph mode: which bucket a layout takes and how it is padded.

Pure host-side bookkeeping, no CUDA, so CI checks every rule of it on CPU.
Two kinds: :class:`Bucket` for packed models (``Runtime.graphed``, below) and
:class:`PaddedBucket`, a (batch, length) profile for padded transformers calls
(``hf.graphed``, hf_graphs.py), which pads rows and columns instead.

A bucket fixes what a captured graph can hold: at most ``max_segments``
segments, ``max_tokens_q`` query tokens and ``max_tokens_k`` key/value tokens.
A layout is padded to its bucket like this (S = max_segments, T = real tokens):

* offsets get ``S + 2`` entries: the real segments, zero-length segments up to S
  (the last real offset repeated), then one *padding segment* that holds the
  rows ``T .. ceiling``, so every offset array ends at the bucket's ceiling and
  matches the padded tensors the model sees. (The FlashInfer plan gives the
  padding segment no keys, so padding rows cost no attention work: cudagraph.py.)
* padding rows of the attention output are rows that see no key, which
  FlashInfer writes as zero (backends/flashinfer.py), so no NaN or stale value
  flows from padding into later layers (fa3 reads whole K/V tiles past a
  segment's end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Bucket", "PaddedBucket", "PaddedLayout", "as_buckets", "as_padded_buckets", "choose_bucket",
    "default_padded_buckets", "pad_layout",
]


@dataclass(frozen=True)
class Bucket:
    max_segments: int
    max_tokens_q: int
    max_tokens_k: int

    def __post_init__(self):
        for name in ("max_segments", "max_tokens_q", "max_tokens_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"bucket {name} must be >= 1, got {getattr(self, name)}")

    def fits(self, n: int, total_q: int, total_k: int) -> bool:
        return n <= self.max_segments and total_q <= self.max_tokens_q and total_k <= self.max_tokens_k

    @property
    def cost(self) -> tuple:
        return (self.max_tokens_q + self.max_tokens_k, self.max_segments)


@dataclass(frozen=True)
class PaddedBucket:
    """A profile of padded calls: ``[batch, length]`` inputs (hf_graphs.py)."""

    batch: int
    length: int

    def __post_init__(self):
        for name in ("batch", "length"):
            if getattr(self, name) < 1:
                raise ValueError(f"bucket {name} must be >= 1, got {getattr(self, name)}")

    def fits(self, batch: int, length: int) -> bool:
        return batch <= self.batch and length <= self.length

    @property
    def cost(self) -> tuple:
        # the padded tokens every layer computes, then the shorter rows (attention is
        # quadratic in the length)
        return (self.batch * self.length, self.length, self.batch)


def _sorted_unique(out: list) -> list:
    if not out:
        raise ValueError("buckets must name at least one bucket")
    return sorted(set(out), key=lambda b: b.cost)


def as_buckets(buckets) -> list[Bucket]:
    """Buckets from ``Bucket``s or tuples ``(max_segments, max_tokens_q[, max_tokens_k])``."""
    out = []
    for b in buckets:
        if isinstance(b, Bucket):
            out.append(b)
            continue
        b = tuple(int(x) for x in b)
        if len(b) not in (2, 3):
            raise ValueError(
                f"a bucket is (max_segments, max_tokens_q[, max_tokens_k]), got {b!r}"
            )
        out.append(Bucket(b[0], b[1], b[2] if len(b) == 3 else b[1]))
    return _sorted_unique(out)


def as_padded_buckets(buckets) -> list[PaddedBucket]:
    """Buckets from ``PaddedBucket``s or ``(batch, length)`` pairs."""
    out = []
    for b in buckets:
        if not isinstance(b, PaddedBucket):
            b = tuple(int(x) for x in b)
            if len(b) != 2:
                raise ValueError(f"a padded bucket is (batch, length), got {b!r}")
            b = PaddedBucket(*b)
        out.append(b)
    return _sorted_unique(out)


DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_LENGTHS = (16, 32, 64, 128, 256, 512)


def default_padded_buckets(max_length: int | None = None) -> list[PaddedBucket]:
    """Every (batch, length) of ``DEFAULT_BATCHES`` x ``DEFAULT_LENGTHS``, lengths up to
    ``max_length`` (the longest is kept at ``max_length`` where it cuts the ladder)."""
    lengths = list(DEFAULT_LENGTHS)
    if max_length is not None:
        lengths = [n for n in lengths if n < max_length] + [min(max_length, DEFAULT_LENGTHS[-1])]
    return as_padded_buckets((b, n) for b in DEFAULT_BATCHES for n in lengths)


def choose_bucket(buckets, *shape: int):
    """The cheapest bucket the call fits in (``bucket.fits(*shape)``), or None when it
    fits in none: ``shape`` is (segments, q tokens, k tokens) for a :class:`Bucket`,
    (batch, length) for a :class:`PaddedBucket`."""
    fitting = [b for b in buckets if b.fits(*shape)]
    return min(fitting, key=lambda b: b.cost) if fitting else None


@dataclass
class PaddedLayout:
    total_q: int
    total_k: int
    cu_q: torch.Tensor  # int32 [S + 2]
    cu_k: torch.Tensor  # int32 [S + 2]


def _pad_offsets(cu: torch.Tensor, slots: int, ceiling: int) -> torch.Tensor:
    out = torch.empty(slots + 2, dtype=torch.int32)
    n = cu.numel() - 1
    out[: n + 1] = cu
    out[n + 1 : slots + 1] = cu[-1]
    out[slots + 1] = ceiling
    return out


def pad_layout(bucket: Bucket, cu_q: torch.Tensor, cu_k: torch.Tensor) -> PaddedLayout:
    """Pad host offsets (int32/int64, CPU) to ``bucket``; the layout must fit."""
    n = cu_q.numel() - 1
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    if not bucket.fits(n, total_q, total_k):
        raise ValueError(
            f"layout of {n} segments, {total_q} q tokens and {total_k} k/v tokens does not fit "
            f"{bucket}; add a larger bucket"
        )
    S = bucket.max_segments
    pq = _pad_offsets(cu_q.to(torch.int32), S, bucket.max_tokens_q)
    pk = _pad_offsets(cu_k.to(torch.int32), S, bucket.max_tokens_k)
    return PaddedLayout(total_q, total_k, pq, pk)
