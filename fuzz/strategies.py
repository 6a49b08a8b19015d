"""The fuzz suite's Hypothesis strategies: now :mod:`ragged_compile.testing`.

Kept so that ``from fuzz.strategies import ...`` goes on working. New code
imports :mod:`ragged_compile.testing` directly. Two names differ there, and
keep their old shape here:

* :class:`Layout` here has ``q_lens`` / ``kv_lens`` as tuples of ints (the
  package's ``Layout.q_lens`` / ``k_lens`` are int32 tensors; its tuples are
  ``q_lengths`` / ``k_lengths``).
* :func:`layouts` here takes ``(max_segments, max_len, *, max_total=...,
  allow_many_tiny=..., max_tiny_segments=...)`` and may draw floods of tiny
  segments beyond ``max_segments``; :class:`AttentionCase` has ``q_lens`` /
  ``kv_lens`` tuples too.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from ragged_compile import testing as _t
from ragged_compile.testing import (  # noqa: F401  (re-exported)
    DTYPES,
    GQA_RATIOS,
    HEAD_DIMS,
    INDEX_DTYPES,
    PADDED_HEAD_DIMS,
    AttentionInputs,
    cu_seqlens,
    dtypes,
    head_configs,
    head_dims,
    index_dtypes,
    no_key_rows,
    scaled_examples,
    scales,
    segment_lengths,
    tiny_segment_lengths,
)

__all__ = [
    "HEAD_DIMS",
    "PADDED_HEAD_DIMS",
    "GQA_RATIOS",
    "DTYPES",
    "INDEX_DTYPES",
    "Layout",
    "AttentionCase",
    "AttentionInputs",
    "segment_lengths",
    "tiny_segment_lengths",
    "layouts",
    "head_configs",
    "head_dims",
    "scales",
    "dtypes",
    "index_dtypes",
    "attention_cases",
    "cu_seqlens",
    "no_key_rows",
    "scaled_examples",
]


class Layout(_t.Layout):
    """:class:`ragged_compile.testing.Layout` with ``q_lens`` / ``kv_lens`` as tuples."""

    @property
    def q_lens(self) -> tuple[int, ...]:
        return self.q_lengths

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return self.k_lengths


class AttentionCase(_t.AttentionCase):
    """:class:`ragged_compile.testing.AttentionCase` with ``q_lens`` / ``kv_lens`` tuples."""

    @property
    def q_lens(self) -> tuple[int, ...]:
        return self.q_lengths

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return self.k_lengths


def _old_layout(layout: _t.Layout) -> Layout:
    return Layout(layout.q_lengths, layout.k_lengths, layout.cross)


def layouts(
    max_segments: int = 64,
    max_len: int = 256,
    *,
    min_segments: int = 0,
    max_total: int | None = None,
    max_scores: int | None = None,
    allow_many_tiny: bool = True,
    max_tiny_segments: int = 4096,
    cross: bool | None = None,
) -> st.SearchStrategy[Layout]:
    """:func:`ragged_compile.testing.layouts` with the old arguments and :class:`Layout`."""
    return _t.layouts(
        max_segments=max_segments,
        max_tokens=max_total,
        max_len=max_len,
        min_segments=min_segments,
        max_scores=max_scores,
        tiny_segments=max_tiny_segments if allow_many_tiny else 0,
        cross=cross,
    ).map(_old_layout)


def attention_cases(**kwargs) -> st.SearchStrategy[AttentionCase]:
    """:func:`ragged_compile.testing.attention_cases`, as this module's :class:`AttentionCase`."""

    def old(case: _t.AttentionCase) -> AttentionCase:
        fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
        fields["layout"] = _old_layout(case.layout)
        return AttentionCase(**fields)

    return _t.attention_cases(**kwargs).map(old)
