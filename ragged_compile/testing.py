"""Property testing for ragged (packed, variable-length) models, with Hypothesis.

Install with ``pip install "ragged-compile[test]"`` (brings Hypothesis and pytest).
``import ragged_compile`` never imports this module or Hypothesis; import it as
``from ragged_compile import testing`` or ``import ragged_compile.testing``.

What it holds:

* Strategies for **layouts**: :func:`layouts` draws a :class:`Layout` with empty
  and one-token segments, floods of tiny segments (when ``max_tiny_segments`` allows),
  uniform lengths, all-empty batches, cross layouts (independent q and k/v
  lengths) and, given a ``bucket``, layouts that fill the bucket exactly.
  :func:`segment_lengths` and :func:`tiny_segment_lengths` are the building blocks.
* Strategies for **attention calls**: :func:`attention_inputs` draws a dict of
  :func:`ragged_compile.ragged_attention` keyword arguments (random q/k/v, GQA
  ratios, head dims incl. 72/80/96, dtypes, causal, scale; on request sliding
  windows, soft-capping and attention sinks: ``window_size=True``,
  ``softcap=True``, ``sinks=True``, or a fixed value or strategy of them).
  :func:`attention_cases` draws the same as a reproducible :class:`AttentionCase`.
  :func:`window_sizes` and :func:`softcaps` are the variants' strategies.
* Every strategy keeps, in every draw, every bound it is given, and checks its
  arguments when it is made: a bad or contradictory one raises ``ValueError``
  naming it.
* **Checks**: :func:`assert_matches_reference` (a float64 per-segment oracle with
  dtype-aware tolerances), :func:`check_segment_independence` (perturb and
  poison one segment of your model's input: nothing else may move) and
  :func:`check_matches_per_segment` (your model on the packed batch against your
  model on each segment alone).

Example, a complete test of a packed model ``model(x, cu_seqlens)``::

    import torch
    from hypothesis import given, settings
    from ragged_compile import testing

    @settings(max_examples=50, deadline=None)
    @given(layout=testing.layouts(max_segments=32, max_tokens=512))
    def test_model_keeps_segments_apart(layout):
        x = torch.randn(layout.total_q, 64)
        testing.check_segment_independence(model, x, layout.cu_seqlens_q)
        testing.check_matches_per_segment(model, x, layout.cu_seqlens_q)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import random
from collections.abc import Iterable
from typing import Callable, NamedTuple

import torch

try:
    from hypothesis import settings
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ragged_compile.testing needs Hypothesis: pip install 'ragged-compile[test]' "
        "(or pip install hypothesis)"
    ) from e

from .reference import dense_attention, sees_key

__all__ = [
    # constants
    "HEAD_DIMS",
    "PADDED_HEAD_DIMS",
    "GQA_RATIOS",
    "DTYPES",
    "INDEX_DTYPES",
    # layouts
    "Layout",
    "layouts",
    "segment_lengths",
    "tiny_segment_lengths",
    "cu_seqlens",
    "no_key_rows",
    # attention calls
    "AttentionCase",
    "AttentionInputs",
    "AttentionArgs",
    "attention_inputs",
    "attention_cases",
    "head_configs",
    "head_dims",
    "window_sizes",
    "softcaps",
    "scales",
    "dtypes",
    "index_dtypes",
    # checks
    "tolerance",
    "assert_matches_reference",
    "check_segment_independence",
    "check_matches_per_segment",
    "scaled_examples",
]

HEAD_DIMS = (8, 16, 32, 64, 72, 80, 96, 128, 256)
PADDED_HEAD_DIMS = (72, 80, 96)  # not a power of two: kernels pad them
GQA_RATIOS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

# Beyond this many segments lengths come from one drawn seed, not one draw each:
# thousands of draws overrun Hypothesis' buffer and shrink no better.
_PER_SEGMENT_DRAWS = 256


# --------------------------------------------------------------------------- arguments


class _Default(int):
    """An int default that a ``bucket`` replaces (an explicit bound is combined with
    the bucket's, the tighter one holding); prints as the plain number."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)


def _count(name: str, value, *, minimum: int = 0, optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum`` (or None)."""
    if value is None and optional:
        return
    if not _int_at_least(value, minimum):
        also = " or None" if optional else ""
        raise ValueError(f"{name} must be an int >= {minimum}{also}, got {value!r}")


def _flag(name: str, value, *, optional: bool = True) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ValueError(f"{name} must be True, False{' or None' if optional else ''}, got {value!r}")


def _choices(name: str, values, ok: Callable[[object], bool], what: str) -> tuple:
    """``values`` as a non-empty tuple whose every item passes ``ok``, else a
    ``ValueError`` naming ``name`` and the first bad item."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a tuple of {what}, got {values!r}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must hold at least one of {what}, got ()")
    for x in values:
        if not ok(x):
            raise ValueError(f"{name} must hold only {what}, got {x!r} in {name}={values!r}")
    return values


def _segment_range(min_segments: int, max_segments: int, limit: str = "max_segments") -> None:
    if min_segments > max_segments:
        raise ValueError(
            f"min_segments ({min_segments}) > {limit} ({max_segments}): lower min_segments or raise {limit}"
        )


def _int_at_least(x, minimum: int) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= minimum


def _check_dtypes(name: str, values) -> tuple[torch.dtype, ...]:
    what = "floating dtypes of testing.DTYPES (float32, float64, bfloat16, float16)"
    return _choices(name, values, lambda d: isinstance(d, torch.dtype) and d in DTYPES, what)


def _check_index_dtypes(name: str, values) -> tuple[torch.dtype, ...]:
    what = "torch.int32 / torch.int64"
    return _choices(name, values, lambda d: isinstance(d, torch.dtype) and d in INDEX_DTYPES, what)


# --------------------------------------------------------------------------- lengths


def _fit(lengths, max_total: int | None) -> tuple[int, ...]:
    """Clamp lengths front to back so that their sum is at most ``max_total``."""
    if max_total is None:
        return tuple(lengths)
    out, left = [], max_total
    for n in lengths:
        n = min(n, left)
        out.append(n)
        left -= n
    return tuple(out)


def _fill(lengths, total: int, max_len: int | None) -> tuple[int, ...]:
    """Lengths summing to ``total``: clamp, then give the rest to the last segments,
    none beyond ``max_len`` (``None``: all of it to the last). Short of ``total``
    only when ``len(lengths) * max_len < total``."""
    out = list(_fit(lengths, total))
    rest = total - sum(out)
    for i in reversed(range(len(out))):
        add = rest if max_len is None else min(rest, max_len - out[i])
        out[i] += add
        rest -= add
    return tuple(out)


def tiny_segment_lengths(
    min_segments: int = 256, max_segments: int = 4096, max_len: int = 3
) -> st.SearchStrategy[tuple[int, ...]]:
    """Hundreds to thousands of segments of 0..``max_len`` tokens (mostly 0 and 1).

    Lengths come from a drawn seed rather than one draw per segment; the segment
    count and the mix of empty and one-token segments still shrink.

    >>> testing.tiny_segment_lengths(1000, 2000).example()  # doctest: +SKIP
    (1, 0, 1, 1, 3, 0, 1, ...)
    """
    _count("min_segments", min_segments)
    _count("max_segments", max_segments)
    _count("max_len", max_len)
    _segment_range(min_segments, max_segments)
    return _tiny_segment_lengths(min_segments, max_segments, max_len)


@st.composite
def _tiny_segment_lengths(draw, min_segments, max_segments, max_len) -> tuple[int, ...]:
    n = draw(st.integers(min_segments, max_segments))
    p_empty = draw(st.sampled_from((0.0, 0.1, 0.3, 0.6)))
    p_one = draw(st.sampled_from((0.3, 0.5, 0.8)))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    lengths = []
    for _ in range(n):
        u = rng.random()
        if u < p_empty:
            length = 0
        elif u < p_empty + (1 - p_empty) * p_one:
            length = 1
        else:
            length = rng.randint(2, max(2, max_len))
        lengths.append(min(length, max_len))
    return tuple(lengths)


def _one_length(max_len: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(0), st.just(min(1, max_len)), st.integers(0, min(8, max_len)), st.integers(0, max_len))


@st.composite
def _seeded_lengths(draw, count: int, max_len: int) -> tuple[int, ...]:
    """``count`` mixed lengths (0, 1, short, up to ``max_len``) from one drawn seed."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    short = min(8, max_len)
    pick = (lambda: 0, lambda: min(1, max_len), lambda: rng.randint(0, short), lambda: rng.randint(0, max_len))
    return tuple(rng.choice(pick)() for _ in range(count))


def _tiny_default(max_tiny_segments: int | None, max_segments: int) -> int:
    """The largest flood: as given, else ``max_segments`` from 256 up, else none."""
    if max_tiny_segments is not None:
        return max_tiny_segments
    return max_segments if max_segments >= 256 else 0


def _draw_lengths(draw, max_segments, max_len, min_segments, max_tokens, max_tiny_segments, n):
    """(lengths, whether they are a flood of tiny segments): :func:`segment_lengths`."""
    kinds = ["mixed"] * 8 + ["uniform"] * 2 + ["empty"]
    if max_tiny_segments >= 256 and n is None:
        kinds.append("many_tiny")
    kind = draw(st.sampled_from(kinds))
    if kind == "many_tiny":  # beyond max_segments only when max_tiny_segments is
        lo = max(min_segments, 256, max_segments + 1 if max_tiny_segments > max_segments else 0)
        hi = max(lo, max_tiny_segments if max_tokens is None else min(max_tiny_segments, max_tokens))
        return _fit(draw(_tiny_segment_lengths(lo, hi, min(3, max_len))), max_tokens), True
    if n is not None:
        count = n
    elif max_segments == 0 or (min_segments == 0 and draw(st.integers(0, 15)) == 0):
        count = 0  # n = 0 is a legal batch, but one draw in sixteen is enough
    else:
        count = draw(st.integers(max(1, min_segments), max_segments))
    if kind == "empty":
        return (0,) * count, False
    if kind == "uniform":  # one length everywhere: the layout padded kernels like best
        return _fit([draw(st.integers(0, max_len))] * count, max_tokens), False
    if count > _PER_SEGMENT_DRAWS:
        return _fit(draw(_seeded_lengths(count, max_len)), max_tokens), False
    return _fit(draw(st.lists(_one_length(max_len), min_size=count, max_size=count)), max_tokens), False


def segment_lengths(
    max_segments: int = 64,
    max_len: int = 256,
    *,
    min_segments: int = 0,
    max_tokens: int | None = None,
    max_tiny_segments: int | None = None,
    n: int | None = None,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Per-segment token counts, as a tuple of ints.

    Every draw has ``min_segments..max_segments`` segments (``n``: exactly ``n``;
    the k/v side of cross layouts uses it) of at most ``max_len`` tokens and at
    most ``max_tokens`` in all (later segments shrink first; ``None``: no bound).
    About one draw in twelve has every segment empty, one in six one length
    everywhere, one in sixteen no segment at all. About one in twelve is a flood
    of 256 to ``max_tiny_segments`` segments of 0-3 tokens when that is at least
    256 (default: ``max_segments`` from 256 up, else no flood; ``0``: none); a
    ``max_tiny_segments`` above ``max_segments`` lets floods exceed it.

    >>> testing.segment_lengths(8, 100).example()  # doctest: +SKIP
    (0, 1, 77, 3, 1)
    """
    for name, value in (("max_segments", max_segments), ("max_len", max_len), ("min_segments", min_segments)):
        _count(name, value)
    for name, value in (("max_tokens", max_tokens), ("max_tiny_segments", max_tiny_segments), ("n", n)):
        _count(name, value, optional=True)
    _segment_range(min_segments, max_segments)
    tiny = _tiny_default(max_tiny_segments, max_segments)

    @st.composite
    def lengths(draw):
        return _draw_lengths(draw, max_segments, max_len, min_segments, max_tokens, tiny, n)[0]

    return lengths()


def cu_seqlens(lengths, dtype: torch.dtype = torch.int32, device="cpu") -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as a 1-D tensor.

    >>> testing.cu_seqlens([3, 0, 2])
    tensor([0, 3, 3, 5], dtype=torch.int32)
    """
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype, device=device)


def no_key_rows(q_lengths, k_lengths, causal: bool, window_size=(-1, -1)) -> torch.Tensor:
    """Bool ``[Tq]``: query rows that see no key (empty k/v segment, or above the
    bottom-right causal diagonal, or the window's ``right`` bound, when ``Lq > Lk``).
    Their attention output is zero."""
    cu_q, cu_k = cu_seqlens(q_lengths, torch.int64), cu_seqlens(k_lengths, torch.int64)
    return ~sees_key(cu_q, cu_k, int(cu_q[-1]), causal, window_size)


@dataclasses.dataclass(frozen=True, repr=False)
class Layout:
    """Segment lengths of q and of k/v; ``cross`` is False when they are one layout.

    Tensors (int32, CPU, built fresh on each access so tests may modify them):

    ========================  ==========================================
    ``q_lens``, ``k_lens``      ``[n]`` tokens per segment of q, of k/v
    ``cu_seqlens_q/_k``         ``[n + 1]`` offsets: ``0, l0, l0 + l1, ...``
    ========================  ==========================================

    The same as plain ints: ``q_lengths``, ``k_lengths`` (tuples), ``n``,
    ``total_q``, ``total_k``.

    >>> layout = testing.Layout((3, 0, 1), (5, 2, 0), cross=True)
    >>> layout.cu_seqlens_k
    tensor([0, 5, 7, 7], dtype=torch.int32)
    """

    q_lengths: tuple[int, ...]
    k_lengths: tuple[int, ...]
    cross: bool

    def __post_init__(self):
        object.__setattr__(self, "q_lengths", tuple(int(x) for x in self.q_lengths))
        object.__setattr__(self, "k_lengths", tuple(int(x) for x in self.k_lengths))
        if len(self.q_lengths) != len(self.k_lengths):
            raise ValueError("q and k/v layouts need the same number of segments")
        if not self.cross and self.q_lengths != self.k_lengths:
            raise ValueError("a self-attention layout has one set of lengths (pass cross=True)")
        if any(x < 0 for x in self.q_lengths + self.k_lengths):
            raise ValueError("segment lengths must be >= 0")

    @property
    def q_lens(self) -> torch.Tensor:
        return torch.tensor(self.q_lengths, dtype=torch.int32)

    @property
    def k_lens(self) -> torch.Tensor:
        return torch.tensor(self.k_lengths, dtype=torch.int32)

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        return cu_seqlens(self.q_lengths)

    @property
    def cu_seqlens_k(self) -> torch.Tensor:
        return cu_seqlens(self.k_lengths)

    @property
    def n(self) -> int:
        return len(self.q_lengths)

    @property
    def total_q(self) -> int:
        return sum(self.q_lengths)

    @property
    def total_k(self) -> int:
        return sum(self.k_lengths)

    @property
    def score_elements(self) -> int:
        """``sum(Lq_i * Lk_i)``: score entries per head."""
        return sum(a * b for a, b in zip(self.q_lengths, self.k_lengths))

    def __repr__(self) -> str:  # short enough to read in a failure report
        def lens(t):
            return repr(t) if len(t) <= 40 else f"<{len(t)} segments, sum {sum(t)}>"

        if not self.cross:
            return f"Layout(q_lengths={lens(self.q_lengths)})"
        return f"Layout(q_lengths={lens(self.q_lengths)}, k_lengths={lens(self.k_lengths)}, cross=True)"


def _cap_scores(q_lens, kv_lens, max_scores, is_cross):
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    while sum(a * b for a, b in zip(q_lens, kv_lens)) > max_scores:
        i = max(range(len(q_lens)), key=lambda j: q_lens[j] * kv_lens[j])
        if is_cross:
            if q_lens[i] >= kv_lens[i]:
                q_lens[i] //= 2
            else:
                kv_lens[i] //= 2
        else:
            q_lens[i] = kv_lens[i] = q_lens[i] * 7 // 10
    return tuple(q_lens), tuple(kv_lens)


def layouts(
    *,
    max_segments: int = _Default(64),
    max_tokens: int | None = _Default(4096),
    cross: bool | None = None,
    bucket: tuple[int, ...] | None = None,
    min_segments: int = 0,
    max_len: int | None = None,
    max_k_tokens: int | None = None,
    max_scores: int | None = None,
    max_tiny_segments: int | None = None,
) -> st.SearchStrategy[Layout]:
    """A strategy of :class:`Layout`: self-attention, or cross (``cross=None``: either).

    Every drawn layout keeps every bound given (the property tests of
    ``tests/test_testing_api.py`` check each); contradictory bounds raise
    ``ValueError`` when the strategy is made, naming the argument.

    Args:
        max_segments: at most this many segments (``min_segments`` at least).
        max_tokens: at most this many q tokens (and k/v tokens unless
            ``max_k_tokens`` is given); ``None``: no bound.
        cross: ``True`` draws k/v lengths independently of q's (same segment
            count; half the time queries are 0-2 tokens, like chunked prefill);
            ``False`` one set of lengths; ``None`` either.
        bucket: ``(S, T)`` or ``(S, Tq, Tk)``: every layout fits the bucket
            (``n <= S``, ``total_q <= Tq``, ``total_k <= Tk``) and about one draw
            in four fills it exactly (``n == S``, ``total_q == Tq`` and, for
            cross layouts, ``total_k == Tk``; a self layout fills
            ``min(Tq, Tk)``), as a CUDA-graph bucket is filled. The bucket
            replaces the defaults of ``max_segments`` and ``max_tokens``; given
            explicitly as well, the tighter of each bound holds (and is what a
            full draw fills).
        max_len: longest segment (default ``min(max_tokens, 1024)``; filling a
            bucket may exceed the default, never a ``max_len`` given: then a
            full draw holds at most ``S * max_len`` tokens).
        max_scores: caps ``sum(Lq_i * Lk_i)`` (attention work) by shrinking the
            longest segments, full buckets included.
        max_tiny_segments: about one draw in twelve is a flood of 256 to this
            many segments of 0-3 tokens, when it is at least 256 (default:
            ``max_segments`` from 256 up, else no flood; ``0``: no flood).
            Above ``max_segments`` it lets floods, and only floods, exceed
            ``max_segments`` (never a bucket's ``S``).

    Every draw mixes the cases kernels get wrong: empty segments, one-token
    segments, one length everywhere, every segment empty, no segment at all.

    >>> from hypothesis import given
    >>> @given(layout=testing.layouts(max_segments=16, max_tokens=256, cross=True))
    ... def test_cross(layout):
    ...     assert layout.q_lens.dtype == torch.int32 and layout.cu_seqlens_k[-1] == layout.total_k
    """
    _count("max_segments", max_segments)
    _count("min_segments", min_segments)
    for name, value in (
        ("max_tokens", max_tokens), ("max_len", max_len), ("max_k_tokens", max_k_tokens),
        ("max_scores", max_scores), ("max_tiny_segments", max_tiny_segments),
    ):
        _count(name, value, optional=True)
    _flag("cross", cross)
    segments_given, tokens_given = not isinstance(max_segments, _Default), not isinstance(max_tokens, _Default)
    if max_k_tokens is None and tokens_given:
        max_k_tokens = max_tokens
    full = None
    if bucket is not None:
        bucket = tuple(bucket) if isinstance(bucket, (tuple, list)) else bucket
        if not isinstance(bucket, tuple) or len(bucket) not in (2, 3) or not all(_int_at_least(x, 0) for x in bucket):
            raise ValueError(
                f"bucket must be (segments, tokens) or (segments, q_tokens, kv_tokens) of ints >= 0, got {bucket!r}"
            )
        S, Tq, Tk = bucket[0], bucket[1], bucket[-1]
        max_segments = min(S, max_segments) if segments_given else S
        max_tokens = min(Tq, max_tokens) if tokens_given and max_tokens is not None else Tq
        max_k_tokens = Tk if max_k_tokens is None else min(Tk, max_k_tokens)
        max_tiny_segments = None if max_tiny_segments is None else min(max_tiny_segments, max_segments)
        full = max_segments
    if max_k_tokens is None:
        max_k_tokens = max_tokens
    limit = "the bucket's S or max_segments" if bucket is not None else "max_segments"
    _segment_range(min_segments, max_segments, limit)
    fill_cap = max_len  # a full bucket honours a max_len given, not the default
    if max_len is None:
        max_len = 1024 if max_tokens is None else min(max_tokens, 1024)
    tiny = _tiny_default(max_tiny_segments, max_segments)
    return _layouts(
        max_segments, max_tokens, max_k_tokens, cross, full, min_segments, max_len, fill_cap, max_scores, tiny
    )


@st.composite
def _layouts(
    draw, max_segments, max_tokens, max_k_tokens, cross, full, min_segments, max_len, fill_cap, max_scores, tiny
) -> Layout:
    is_cross = draw(st.booleans()) if cross is None else cross
    if not is_cross and max_k_tokens is not None:  # one set of lengths obeys both bounds
        max_tokens = max_k_tokens if max_tokens is None else min(max_tokens, max_k_tokens)
    if full and draw(st.integers(0, 3)) == 0:
        q_lens, kv_lens = _full_bucket(draw, full, max_tokens, max_k_tokens, max_len, fill_cap, is_cross)
    else:
        q_lens, many = _draw_lengths(draw, max_segments, max_len, min_segments, max_tokens, tiny, None)
        kv_lens = q_lens
        if is_cross:
            if draw(st.booleans()):  # short queries: decode / chunked-prefill shapes
                short = min(2, max_len)
                if len(q_lens) <= _PER_SEGMENT_DRAWS:
                    q_lens = draw(st.lists(st.integers(0, short), min_size=len(q_lens), max_size=len(q_lens)))
                else:
                    q_lens = draw(_seeded_lengths(len(q_lens), short))
                q_lens = _fit(q_lens, max_tokens)
            if many:
                kv_lens = _fit(draw(_tiny_segment_lengths(len(q_lens), len(q_lens), min(3, max_len))), max_k_tokens)
            else:
                kv_lens = _draw_lengths(draw, max_segments, max_len, 0, max_k_tokens, 0, len(q_lens))[0]
    if max_scores is not None:
        q_lens, kv_lens = _cap_scores(q_lens, kv_lens, max_scores, is_cross)
    return Layout(q_lens, kv_lens, is_cross)


def _full_bucket(draw, S, Tq, Tk, max_len, fill_cap, is_cross):
    """``S`` segments holding exactly ``Tq`` (and ``Tk``) tokens, with empty and short ones."""

    def lengths(total):
        if S > _PER_SEGMENT_DRAWS:
            ls = draw(_seeded_lengths(S, min(max_len, max(1, 2 * total // S + 1))))
        else:
            ls = draw(st.lists(_one_length(max_len), min_size=S, max_size=S))
        return _fill(ls, total, fill_cap)

    q = lengths(Tq)
    return q, (lengths(Tk) if is_cross else q)


# --------------------------------------------------------------------------- knobs


def head_configs(
    max_kv_heads: int = 4, gqa_ratios: tuple[int, ...] = GQA_RATIOS, max_q_heads: int = 32
) -> st.SearchStrategy[tuple[int, int]]:
    """``(Hq, Hkv)`` with ``Hq = ratio * Hkv``, ratio from ``gqa_ratios`` (MQA when
    Hkv == 1), ``Hkv <= max_kv_heads`` and ``Hq <= max_q_heads`` (ratios above
    ``max_q_heads`` are left out; at least one must fit)."""
    _count("max_kv_heads", max_kv_heads, minimum=1)
    _count("max_q_heads", max_q_heads, minimum=1)
    gqa_ratios = _choices("gqa_ratios", gqa_ratios, lambda r: _int_at_least(r, 1), "ints >= 1")
    if min(gqa_ratios) > max_q_heads:
        raise ValueError(
            f"no ratio of gqa_ratios={gqa_ratios} fits max_q_heads={max_q_heads}: raise max_q_heads "
            "or pass a ratio <= max_q_heads"
        )
    return _head_configs(max_kv_heads, gqa_ratios, max_q_heads)


@st.composite
def _head_configs(draw, max_kv_heads, gqa_ratios, max_q_heads) -> tuple[int, int]:
    ratio = draw(st.sampled_from([r for r in gqa_ratios if r <= max_q_heads]))
    hkv = draw(st.integers(1, max(1, min(max_kv_heads, max_q_heads // ratio))))
    return ratio * hkv, hkv


def head_dims(choices: tuple[int, ...] = HEAD_DIMS) -> st.SearchStrategy[int]:
    """Head dims, by default powers of two 8..256 and the padded 72/80/96."""
    return st.sampled_from(_choices("choices", choices, lambda d: _int_at_least(d, 1), "head dims (ints >= 1)"))


def scales(min_value: float = 1e-3, max_value: float = 1.0) -> st.SearchStrategy[float | None]:
    """``None`` (the default ``D ** -0.5``) or a finite positive float."""
    for name, value in (("min_value", min_value), ("max_value", max_value)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) > max_value ({max_value})")
    return st.one_of(st.none(), st.floats(min_value, max_value, allow_nan=False, allow_infinity=False))


def dtypes(choices: tuple[torch.dtype, ...] = DTYPES) -> st.SearchStrategy[torch.dtype]:
    """q/k/v dtypes, by default every one of :data:`DTYPES`."""
    return st.sampled_from(_check_dtypes("choices", choices))


def index_dtypes(choices: tuple[torch.dtype, ...] = INDEX_DTYPES) -> st.SearchStrategy[torch.dtype]:
    """Offset dtypes, by default int32 and int64."""
    return st.sampled_from(_check_index_dtypes("choices", choices))


# The strategies under other names, for functions whose parameters are called
# ``dtypes``, ``head_dims`` and ``index_dtypes``.
_dtype_strategy, _head_dim_strategy, _index_dtype_strategy = dtypes, head_dims, index_dtypes


# --------------------------------------------------------------------------- attention calls


class AttentionInputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor


class AttentionArgs(dict):
    """Keyword arguments of :func:`ragged_compile.ragged_attention` (a plain dict),
    with the :class:`AttentionCase` that made them as ``.case`` and a short repr."""

    case: AttentionCase

    def __repr__(self) -> str:
        return f"AttentionArgs(device={self['q'].device}, {self.case!r})"


@dataclasses.dataclass(frozen=True, repr=False)
class AttentionCase:
    """One ragged attention call, reproducible from its fields.

    ``fused_qkv``: q, k and v are slices of one ``[T, Hq + 2 Hkv, D]`` tensor
    (non-contiguous; self layouts only). ``pass_cu_k``: pass ``cu_seqlens_k``
    explicitly even for a self layout (otherwise ``None`` is passed for self).

    >>> case = testing.attention_cases(max_segments=8).example()  # doctest: +SKIP
    >>> out = ragged_compile.ragged_attention(**case.args())     # doctest: +SKIP
    """

    layout: Layout
    hq: int
    hkv: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    scale: float | None
    seed: int
    index_dtype: torch.dtype = torch.int32
    fused_qkv: bool = False
    pass_cu_k: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False

    @property
    def variants(self) -> dict:
        """The call's variant keywords (``window_size``, ``softcap``, ``sinks`` where
        set), ``sinks`` as :meth:`sink_logits` on the CPU."""
        out = {}
        if tuple(self.window_size) != (-1, -1):
            out["window_size"] = tuple(self.window_size)
        if self.softcap:
            out["softcap"] = self.softcap
        if self.sinks:
            out["sinks"] = self.sink_logits()
        return out

    def sink_logits(self, device="cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """The case's sinks ``[Hq]`` (normal, mean 0, std 2, from ``seed``), in the
        case's dtype unless ``dtype`` is given."""
        g = torch.Generator().manual_seed(self.seed + 7)
        return (2 * torch.randn(self.hq, generator=g)).to(device, self.dtype if dtype is None else dtype)

    @property
    def q_lengths(self) -> tuple[int, ...]:
        return self.layout.q_lengths

    @property
    def k_lengths(self) -> tuple[int, ...]:
        return self.layout.k_lengths

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def effective_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def tensors(self, device="cpu", dtype: torch.dtype | None = None) -> AttentionInputs:
        """Random q/k/v (standard normal from ``seed``, then cast) and offsets.

        ``dtype`` overrides the case's dtype (to cast exactly the same values as a
        low-precision run, cast the returned tensors instead).
        """
        dtype = self.dtype if dtype is None else dtype
        g = torch.Generator().manual_seed(self.seed)
        tq, tk, D = self.layout.total_q, self.layout.total_k, self.head_dim
        if self.fused_qkv:
            if self.layout.cross:
                raise ValueError("fused_qkv needs a self-attention layout")
            qkv = torch.randn(tq, self.hq + 2 * self.hkv, D, generator=g).to(device, dtype)
            q = qkv[:, : self.hq]
            k = qkv[:, self.hq : self.hq + self.hkv]
            v = qkv[:, self.hq + self.hkv :]
        else:
            q = torch.randn(tq, self.hq, D, generator=g).to(device, dtype)
            k = torch.randn(tk, self.hkv, D, generator=g).to(device, dtype)
            v = torch.randn(tk, self.hkv, D, generator=g).to(device, dtype)
        cu_q = cu_seqlens(self.q_lengths, self.index_dtype, device)
        cu_k = cu_seqlens(self.k_lengths, self.index_dtype, device)
        return AttentionInputs(q, k, v, cu_q, cu_k)

    def call_kwargs(self, inputs: AttentionInputs) -> AttentionArgs:
        """Arguments for :func:`ragged_compile.ragged_attention` from :meth:`tensors`."""
        cu_k = inputs.cu_seqlens_k if (self.layout.cross or self.pass_cu_k) else None
        args = AttentionArgs(
            q=inputs.q,
            k=inputs.k,
            v=inputs.v,
            cu_seqlens_q=inputs.cu_seqlens_q,
            cu_seqlens_k=cu_k,
            causal=self.causal,
            scale=self.scale,
        )
        args.update(self.variants)
        if self.sinks:
            args["sinks"] = self.sink_logits(inputs.q.device, inputs.q.dtype)
        args.case = self
        return args

    def args(self, device="cpu") -> AttentionArgs:
        """``call_kwargs(tensors(device))``."""
        return self.call_kwargs(self.tensors(device))

    def no_key_rows(self) -> torch.Tensor:
        return no_key_rows(self.q_lengths, self.k_lengths, self.causal, self.window_size)

    def __repr__(self) -> str:  # short enough to read in a failure report
        variants = "".join(
            f", {name}={getattr(self, name)!r}" for name, off in (("window_size", (-1, -1)), ("softcap", 0.0), ("sinks", False))
            if getattr(self, name) != off
        )
        return (
            f"AttentionCase({self.layout!r}, hq={self.hq}, hkv={self.hkv}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, causal={self.causal}, scale={self.scale}, seed={self.seed}, "
            f"index_dtype={self.index_dtype}, fused_qkv={self.fused_qkv}, pass_cu_k={self.pass_cu_k}{variants})"
        )


def window_sizes(max_len: int = 256) -> st.SearchStrategy[tuple[int, int]]:
    """``(left, right)`` sliding windows: each side -1 (unbounded), 0, or up to a
    little past ``max_len`` (a window longer than every segment), at least one
    side bounded."""
    _count("max_len", max_len)
    side = st.one_of(st.just(-1), st.just(0), st.integers(0, max_len + 2))
    return st.tuples(side, side).filter(lambda w: w != (-1, -1))


def softcaps(min_value: float = 0.5, max_value: float = 50.0) -> st.SearchStrategy[float]:
    """Soft-caps ``> 0``: small ones that bind the scores, up to Gemma2's 50."""
    if not (0 < min_value <= max_value < math.inf):
        raise ValueError(f"softcaps needs 0 < min_value <= max_value < inf, got {min_value}, {max_value}")
    return st.floats(min_value, max_value, allow_nan=False, allow_infinity=False)


def _variant_strategy(value, drawn: Callable[[], st.SearchStrategy], off):
    """A strategy for one variant argument of :func:`attention_cases`: ``False``/None
    (off), ``True`` (drawn, or off now and then), a fixed value or a strategy."""
    if value is None or value is False:
        return st.just(off)
    if value is True:
        return st.one_of(st.just(off), drawn())
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(value)



def attention_cases(
    *,
    layout: Layout | st.SearchStrategy[Layout] | None = None,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    gqa_ratios: tuple[int, ...] = GQA_RATIOS,
    max_segments: int = 64,
    min_segments: int = 0,
    max_len: int = 256,
    max_elements: int = 1 << 17,
    max_score_elements: int = 1 << 21,
    max_tiny_segments: int = 4096,
    cross: bool | None = None,
    causal: bool | None = None,
    index_dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
    fused_qkv: bool = True,
    window_size=False,
    softcap=False,
    sinks=False,
) -> st.SearchStrategy[AttentionCase]:
    """A complete :class:`AttentionCase` with bounded work.

    ``layout``: a fixed :class:`Layout` or a strategy of them; otherwise one is
    drawn by :func:`layouts` within ``max_elements`` (caps ``tokens * Hq * D`` of
    q and of k/v) and ``max_score_elements`` (caps ``sum(Lq_i * Lk_i) * Hq * D``,
    the matmul work), with ``max_segments``, ``min_segments``, ``max_len``,
    ``max_tiny_segments`` (floods of tiny segments beyond ``max_segments``;
    ``0``: none) and ``cross`` as there. Heads shrink first for long head dims
    (``Hq * D <= 1024`` unless the smallest of ``gqa_ratios`` needs more), so
    large D still gets real lengths; floods get one k/v head.
    ``dtypes``, ``head_dims``, ``gqa_ratios``, ``index_dtypes``: drawn from.
    ``causal``: ``None`` draws both. ``fused_qkv``: about one self layout in
    four has q, k and v as slices of one tensor.

    Variants, off by default: ``window_size`` (``True``: :func:`window_sizes`
    within ``max_len``, or none now and then; or a fixed ``(left, right)``, or a
    strategy), ``softcap`` (``True``: :func:`softcaps` or 0; or a float or a
    strategy), ``sinks`` (``True``: with or without; the logits come from the
    case's seed, :meth:`AttentionCase.sink_logits`).
    """
    dtypes = _check_dtypes("dtypes", dtypes)
    head_dims = _choices("head_dims", head_dims, lambda d: _int_at_least(d, 1), "head dims (ints >= 1)")
    gqa_ratios = _choices("gqa_ratios", gqa_ratios, lambda r: _int_at_least(r, 1), "ints >= 1")
    index_dtypes = _check_index_dtypes("index_dtypes", index_dtypes)
    for name, value in (("max_segments", max_segments), ("min_segments", min_segments), ("max_len", max_len),
                        ("max_tiny_segments", max_tiny_segments)):
        _count(name, value)
    _count("max_elements", max_elements, minimum=1)
    _count("max_score_elements", max_score_elements, minimum=1)
    _segment_range(min_segments, max_segments)
    _flag("cross", cross)
    _flag("causal", causal)
    _flag("fused_qkv", fused_qkv, optional=False)
    if not (layout is None or isinstance(layout, (Layout, st.SearchStrategy))):
        raise ValueError(f"layout must be a testing.Layout, a strategy of them or None, got {layout!r}")
    if not (isinstance(window_size, (bool, st.SearchStrategy)) or window_size is None):
        if not (isinstance(window_size, tuple) and len(window_size) == 2
                and all(_int_at_least(w, -1) for w in window_size)):
            raise ValueError(f"window_size must be a bool, a (left, right) tuple of ints >= -1 or a strategy, got {window_size!r}")
    if not (isinstance(softcap, (bool, st.SearchStrategy)) or softcap is None):
        if not (isinstance(softcap, numbers.Real) and 0 <= softcap < math.inf):
            raise ValueError(f"softcap must be a bool, a float >= 0 or a strategy, got {softcap!r}")
    if not isinstance(sinks, (bool, st.SearchStrategy)):
        raise ValueError(f"sinks must be a bool or a strategy of bools, got {sinks!r}")
    variants = (
        _variant_strategy(window_size, lambda: window_sizes(max_len), (-1, -1)),
        _variant_strategy(softcap, softcaps, 0.0),
        _variant_strategy(sinks, lambda: st.just(True), False),
    )
    return _attention_cases(
        layout, dtypes, head_dims, gqa_ratios, max_segments, min_segments, max_len, max_elements,
        max_score_elements, max_tiny_segments, cross, causal, index_dtypes, fused_qkv, variants,
    )


@st.composite
def _attention_cases(
    draw, layout, dtypes, head_dims, gqa_ratios, max_segments, min_segments, max_len, max_elements,
    max_score_elements, max_tiny_segments, cross, causal, index_dtypes, fused_qkv, variants,
) -> AttentionCase:
    dtype = draw(_dtype_strategy(dtypes))
    D = draw(_head_dim_strategy(head_dims))
    max_hq = max(min(gqa_ratios), min(32, 1024 // D))  # Hq * D <= 1024 where a ratio allows
    hq, hkv = draw(head_configs(max_kv_heads=4, gqa_ratios=gqa_ratios, max_q_heads=max_hq))
    per_token = hq * D
    if layout is None:
        layout = layouts(
            max_segments=max_segments,
            max_tokens=max(1, max_elements // per_token),
            max_len=max_len,
            min_segments=min_segments,
            max_scores=max(1, max_score_elements // per_token),
            max_tiny_segments=max_tiny_segments,
            cross=cross,
        )
    if isinstance(layout, st.SearchStrategy):
        layout = draw(layout)
    if layout.n > max_segments:  # a flood of tiny segments: one k/v head
        hq, hkv = hq // hkv, 1
    return AttentionCase(
        layout=layout,
        hq=hq,
        hkv=hkv,
        head_dim=D,
        dtype=dtype,
        causal=draw(st.booleans()) if causal is None else causal,
        scale=draw(scales()),
        seed=draw(st.integers(0, 2**31 - 1)),
        index_dtype=draw(_index_dtype_strategy(index_dtypes)),
        fused_qkv=fused_qkv and (not layout.cross) and draw(st.integers(0, 3)) == 0,
        pass_cu_k=draw(st.booleans()),
        window_size=tuple(draw(variants[0])),
        softcap=float(draw(variants[1])),
        sinks=bool(draw(variants[2])),
    )


def attention_inputs(
    layout: Layout | st.SearchStrategy[Layout] | None = None,
    *,
    device: str | torch.device = "cpu",
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    **options,
) -> st.SearchStrategy[AttentionArgs]:
    """A strategy of dicts of :func:`ragged_compile.ragged_attention` keyword arguments.

    Keys: ``q [Tq, Hq, D]``, ``k``/``v [Tk, Hkv, D]`` (standard normal, on
    ``device``), ``cu_seqlens_q``, ``cu_seqlens_k`` (int32 or int64; ``None``
    for some self layouts), ``causal``, ``scale`` (``None`` or a float). The
    dict's ``.case`` is the :class:`AttentionCase` that made it (its repr is
    what a failing example prints).

    Args:
        layout: a :class:`Layout`, a strategy of them (e.g. :func:`layouts`), or
            ``None``: drawn with at most ``max_segments`` segments (plus floods
            of tiny ones) and ``max_elements`` numbers in q.
        dtypes: drawn from (float64 is left out by default). On CUDA pass
            ``dtypes=(torch.bfloat16, torch.float16)``, the dtypes FlashInfer runs.
        options: any other keyword of :func:`attention_cases`, with the same
            names and defaults: ``head_dims``, ``gqa_ratios`` (``(1,)``: no
            GQA/MQA), ``causal`` (``None`` draws both), ``cross``,
            ``max_segments``, ``max_elements``, the variants ``window_size``,
            ``softcap``, ``sinks`` (off unless asked for), ...

    >>> from hypothesis import given
    >>> @given(inputs=testing.attention_inputs(head_dims=(64, 72, 80, 96)))
    ... def test_op(inputs):
    ...     out = ragged_compile.ragged_attention(**inputs)
    ...     testing.assert_matches_reference(out, **inputs)
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a device string such as 'cuda', got {device!r}") from e
    return attention_cases(layout=layout, dtypes=dtypes, **options).map(lambda case: case.args(device))


def scaled_examples(fraction: float = 1.0, minimum: int = 1) -> int:
    """``max_examples`` for a test ``1 / fraction`` times as expensive as a typical
    one: a fraction of the active Hypothesis profile's budget, so profiles scale
    every test together."""
    return max(minimum, int(settings().max_examples * fraction))


# --------------------------------------------------------------------------- checks

# (rtol, atol at unit logit scale) of an attention output against the float64
# oracle, loose enough for every kernel of the package: the CPU kernel rounds
# once; flash kernels (bf16/fp16 on CUDA) also round P to the input dtype.
_ATTENTION_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 4e-6),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype, head_dim: int, scale: float | None = None) -> tuple[float, float]:
    """``(rtol, atol)`` for an attention output of ``dtype`` against the float64 oracle.

    The float32/float64 ``atol`` grows with the typical logit size
    ``scale * sqrt(D)`` (standard-normal q and k), since their error comes from
    the logits; bf16/fp16 error is dominated by rounding the output.
    """
    if dtype not in _ATTENTION_TOL:
        raise ValueError(f"no tolerance for dtype {dtype}; pass rtol= and atol=")
    rtol, atol = _ATTENTION_TOL[dtype]
    s = head_dim**-0.5 if scale is None else scale
    if dtype in (torch.float32, torch.float64):
        atol *= 1 + s * math.sqrt(head_dim)
    return rtol, atol


def assert_matches_reference(
    out: torch.Tensor,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert ``out`` is ``ragged_attention(q, k, v, ...)`` up to ``out``'s dtype
    (variants included: ``window_size``, ``softcap``, ``sinks``).

    The oracle is one dense float64 softmax per segment (on the CPU). Checks
    shape, dtype and device, that every value is finite, that rows seeing no key
    are exactly zero, and ``|out - ref| <= atol + rtol * |ref|`` with
    :func:`tolerance` unless ``rtol``/``atol`` are given. Raises
    ``AssertionError`` naming the worst element and its segment.

    >>> inputs = testing.attention_inputs().example()  # doctest: +SKIP
    >>> testing.assert_matches_reference(ragged_compile.ragged_attention(**inputs), **inputs)  # doctest: +SKIP
    """
    del max_seqlen_q, max_seqlen_k  # bounds only; they never change the result
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    D = q.shape[-1]
    s = D**-0.5 if scale is None else scale
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise AssertionError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected q's "
            f"{tuple(q.shape)} {q.dtype} on {q.device}"
        )
    if out.numel() == 0:
        return
    d_rtol, d_atol = tolerance(q.dtype, D, scale)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    cu_q_host, cu_k_host = cu_seqlens_q.cpu().long(), cu_k.cpu().long()
    got = out.detach().cpu().double()
    seg = torch.searchsorted(cu_q_host[1:], torch.arange(q.shape[0]), right=True)
    if not bool(torch.isfinite(got).all()):
        row = int((~torch.isfinite(got)).flatten(1).any(1).nonzero()[0])
        raise AssertionError(f"out has a non-finite value at row {row} (segment {int(seg[row])})")
    blind = ~sees_key(cu_q_host, cu_k_host, q.shape[0], causal, window_size)
    if bool((got[blind] != 0).any()):
        row = int(blind.nonzero()[(got[blind] != 0).flatten(1).any(1)][0])
        raise AssertionError(
            f"row {row} (segment {int(seg[row])}) sees no key, so its output must be zero; "
            f"got max |out| {got[row].abs().max().item():.3g}"
        )
    variants = dict(window_size=window_size, softcap=softcap, sinks=None if sinks is None else sinks.detach().cpu())
    ref = dense_attention(q.detach(), k.detach(), v.detach(), cu_q_host, cu_k_host, causal, s, **variants)
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    if not bool((err <= bound).all()):
        worst = int(torch.argmax(err - bound))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
        raise AssertionError(
            f"out differs from the float64 reference at {idx} (segment {int(seg[idx[0]])}): "
            f"out={got[idx].item()!r} ref={ref[idx].item()!r} err={err[idx].item():.3g} > "
            f"atol + rtol * |ref| = {bound[idx].item():.3g} (rtol={rtol:.3g}, atol={atol:.3g}); "
            f"max err {err.max().item():.3g}"
        )


def _packed(fn, x, cu_seqlens):
    """(call(values, cu) -> packed output, values, cu) for a packed or a jagged-NJT input."""
    if getattr(x, "is_nested", False):
        if cu_seqlens is not None:
            raise ValueError("pass cu_seqlens only with a packed tensor; an NJT carries its offsets")

        def call(values, cu):
            out = fn(torch.nested.nested_tensor_from_jagged(values, cu.to(x.offsets().dtype)))
            return out.values() if getattr(out, "is_nested", False) else out

        return call, x.values(), x.offsets()
    if cu_seqlens is None:
        raise ValueError("pass cu_seqlens [n + 1] with a packed x [T, ...] (or pass a jagged NJT as x)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != x.shape[0]:
        raise ValueError(
            f"cu_seqlens must be 1-D offsets [0, ..., T] with T = x.shape[0] = {x.shape[0]}, "
            f"got {cu_seqlens.tolist()}"
        )
    return (lambda values, cu: fn(values, cu)), x, cu_seqlens


def _rows(out, T, what):
    if not isinstance(out, torch.Tensor) or out.shape[:1] != (T,):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"{what} must return one row per input token ([{T}, ...], packed like x), got {shape}; "
            "wrap fn to return the token-level output"
        )
    return out


def check_segment_independence(
    fn: Callable,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    segments=None,
    fills=("random", "nan", "inf"),
    seed: int = 0,
) -> None:
    """Assert that ``fn`` treats the segments of a packed batch independently.

    ``fn(x, cu_seqlens)`` takes a packed ``x [T, ...]`` (segment ``i`` is
    ``x[cu_seqlens[i]:cu_seqlens[i + 1]]``) and returns one row per token
    ``[T, ...]``. With a jagged NJT as ``x`` and no ``cu_seqlens``, ``fn(x)``
    takes and returns NJTs (or a packed ``[T, ...]`` tensor).

    For each chosen segment ``j`` (default: every non-empty one, at most 8) and
    each fill, segment ``j``'s rows of ``x`` are replaced (``"random"``: fresh
    noise three times as large, or for integer inputs such as token ids other
    values of ``x``; ``"nan"``/``"inf"``: poison, floating inputs only) and ``fn`` runs
    again: every other segment's output must stay **bit for bit** the same.
    A leak through a batch-wide statistic, a mask that lets a query see another
    segment, a padding row that is read, or a NaN that crosses segments fails with an
    ``AssertionError`` naming segment ``j`` and the segments that moved.

    Runs ``fn`` twice first and requires the same output (call ``model.eval()``
    and switch dropout off), then ``len(fills)`` times per segment.

    >>> model = lambda x, cu: x - x.mean(0)   # leaks: the mean spans the batch
    >>> testing.check_segment_independence(model, torch.randn(5, 4), torch.tensor([0, 2, 5]))
    Traceback (most recent call last):
    AssertionError: changing segment 0 (random) changed the output of segment 1 ...
    """
    call, values, cu = _packed(fn, x, cu_seqlens)
    values = values.detach()
    T = values.shape[0]
    bounds = cu.tolist()
    n = len(bounds) - 1
    with torch.no_grad():
        base = _rows(call(values, cu), T, "fn")
        again = call(values, cu)
    if not torch.equal(base, again):
        raise AssertionError("fn gives different outputs for the same input: call model.eval(), disable dropout")
    floating = values.is_floating_point() or values.is_complex()
    nonempty = [i for i in range(n) if bounds[i + 1] > bounds[i]]
    if segments is None:
        segments = nonempty if len(nonempty) <= 8 else random.Random(seed).sample(nonempty, 8)
    g = torch.Generator().manual_seed(seed)
    for j in segments:
        lo, hi = bounds[j], bounds[j + 1]
        if lo == hi:
            continue
        for fill in fills:
            x2 = values.clone()
            if fill not in ("random", "nan", "inf"):
                raise ValueError(f"fills are 'random', 'nan' or 'inf', got {fill!r}")
            if not floating and fill != "random":
                continue  # token ids and other integers cannot hold NaN or Inf
            if fill == "random" and floating:
                noise = 3 * torch.randn(x2[lo:hi].shape, generator=g, dtype=torch.float32)
                x2[lo:hi] = noise.to(x2.device, x2.dtype) + x2[lo:hi]
            elif fill == "random":  # integers (token ids): other values of x itself
                pick = torch.randint(0, T, (hi - lo,), generator=g).to(x2.device)
                x2[lo:hi] = values[pick]
            else:
                x2[lo:hi] = float(fill)
            with torch.no_grad():
                out = call(x2, cu)
            moved = []
            for i in range(n):
                a, b = bounds[i], bounds[i + 1]
                if i != j and a < b and not torch.equal(out[a:b], base[a:b]):
                    diff = (out[a:b].double() - base[a:b].double()).abs()
                    worst = diff.nan_to_num(nan=math.inf).max().item()
                    moved.append(f"segment {i} (rows {a}..{b - 1}, max |change| {worst:.3g})")
            if moved:
                raise AssertionError(
                    f"changing segment {j} ({fill}) changed the output of "
                    + ", ".join(moved)
                    + f"; segments must not see each other (layout {[bounds[i + 1] - bounds[i] for i in range(n)]})"
                )


_SEGMENT_TOL = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}


def check_matches_per_segment(
    fn: Callable,
    x: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert that ``fn`` on the packed batch equals ``fn`` on each segment alone.

    The dense per-segment run of the same module is the reference: segment ``i``
    is run as a batch of one (``fn(x[a:b], tensor([0, b - a]))``, or a one-segment
    NJT when ``x`` is an NJT) and compared with its rows of ``fn(x, cu_seqlens)``
    within ``rtol``/``atol`` (defaults by dtype: float32 1e-4/1e-5, bf16 3e-2,
    fp16 5e-3). Empty segments are skipped (no rows to compare). Catches what
    :func:`check_segment_independence` cannot: a batch computed right for
    segment 0 and wrong for the others (an offset off by one, a mask built for
    the whole batch, positions that do not restart per segment).

    >>> model = lambda x, cu: x.cumsum(0)     # positions do not restart per segment
    >>> testing.check_matches_per_segment(model, torch.randn(5, 4), torch.tensor([0, 2, 5]))
    Traceback (most recent call last):
    AssertionError: segment 1 (rows 2..4) of the packed run differs from the segment run alone ...
    """
    call, values, cu = _packed(fn, x, cu_seqlens)
    values = values.detach()
    with torch.no_grad():
        full = _rows(call(values, cu), values.shape[0], "fn")
    d_rtol, d_atol = _SEGMENT_TOL.get(full.dtype, (0.0, 0.0))
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    bounds = cu.tolist()
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        if a == b:
            continue
        with torch.no_grad():
            alone = _rows(call(values[a:b], torch.tensor([0, b - a], dtype=cu.dtype, device=cu.device)), b - a, "fn")
        got, want = full[a:b].double(), alone.double()
        ok = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(ok.all()):
            err = (got - want).abs().nan_to_num(nan=math.inf)
            raise AssertionError(
                f"segment {i} (rows {a}..{b - 1}) of the packed run differs from the segment run alone: "
                f"max |packed - alone| {err.max().item():.3g} > atol {atol:.3g} + rtol {rtol:.3g} * |alone| "
                f"(layout {[bounds[j + 1] - bounds[j] for j in range(len(bounds) - 1)]})"
            )
