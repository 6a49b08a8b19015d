"""Reusable Hypothesis strategies for ragged (packed, variable-length) attention.

Building blocks, each usable on its own:

* :func:`segment_lengths` -- per-segment token counts: 0 to ``max_segments``
  segments with lengths that often are 0 or 1, sometimes a flood of thousands
  of tiny segments, occasionally every segment empty.
* :func:`layouts` -- a :class:`Layout`: self-attention (q and k/v share one
  set of lengths) or cross-attention (independent q and k/v lengths, same
  segment count).
* :func:`head_configs`, :func:`head_dims`, :func:`scales`, :func:`dtypes`,
  :func:`index_dtypes` -- the other knobs of one call.
* :func:`attention_cases` -- everything at once, as an :class:`AttentionCase`
  whose :meth:`AttentionCase.tensors` materialises random inputs from its seed.

Work is bounded so a CPU run stays fast: the packed q tensor of a case holds
at most ``max_elements`` numbers (tokens * Hq * D) and ``sum(Lq_i * Lk_i)``
is capped as well; long head dims and many segments get fewer heads.

Pure lengths are plain Python tuples of ints so the strategies are usable
without a device (e.g. by CUDA-graph bucket state-machine tests).
"""

from __future__ import annotations

import dataclasses
import random
from typing import NamedTuple

import torch
from hypothesis import settings
from hypothesis import strategies as st

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

HEAD_DIMS = (8, 16, 32, 64, 72, 80, 96, 128, 256)
PADDED_HEAD_DIMS = (72, 80, 96)  # not a power of two: kernels pad them
GQA_RATIOS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- lengths


def _fit(lengths: list[int], max_total: int | None) -> tuple[int, ...]:
    """Clamp lengths front to back so that their sum is at most ``max_total``."""
    if max_total is None:
        return tuple(lengths)
    out, left = [], max_total
    for n in lengths:
        n = min(n, left)
        out.append(n)
        left -= n
    return tuple(out)


@st.composite
def tiny_segment_lengths(
    draw, min_segments: int = 256, max_segments: int = 4096, max_len: int = 3
) -> tuple[int, ...]:
    """Hundreds to thousands of segments of 0..``max_len`` tokens (mostly 0 and 1).

    Lengths come from a drawn seed rather than one draw per segment: thousands
    of draws would overrun Hypothesis' buffer and make shrinking useless anyway.
    The segment count and the mix still shrink.
    """
    n = draw(st.integers(min_segments, max_segments))
    p_empty = draw(st.sampled_from((0.0, 0.1, 0.3, 0.6)))
    p_one = draw(st.sampled_from((0.3, 0.5, 0.8)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
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
    return st.one_of(
        st.just(0),
        st.just(1),
        st.integers(0, min(8, max_len)),
        st.integers(0, max_len),
    )


@st.composite
def segment_lengths(
    draw,
    max_segments: int = 64,
    max_len: int = 256,
    *,
    min_segments: int = 0,
    max_total: int | None = None,
    allow_many_tiny: bool = True,
    max_tiny_segments: int = 4096,
    n: int | None = None,
) -> tuple[int, ...]:
    """Per-segment token counts.

    ``n`` fixes the segment count (used for the k/v side of cross layouts).
    Otherwise the count is ``min_segments..max_segments``, except that with
    ``allow_many_tiny`` about one draw in twelve is hundreds to
    ``max_tiny_segments`` segments of 0-3 tokens. About one in twelve draws is
    all segments empty.
    The total is clamped to ``max_total`` (later segments shrink first).
    """
    kinds = ["mixed"] * 8 + ["uniform"] * 2 + ["empty"]
    if allow_many_tiny and n is None:
        kinds.append("many_tiny")
    kind = draw(st.sampled_from(kinds))
    if kind == "many_tiny":
        lo = max(min_segments, max_segments + 1, 256)
        hi = max(lo, max_tiny_segments)
        if max_total is not None:
            hi = max(lo, min(hi, max_total))
        return _fit(list(draw(tiny_segment_lengths(lo, hi))), max_total)
    if n is not None:
        count = n
    elif min_segments == 0 and draw(st.integers(0, 15)) == 0:
        count = 0  # n = 0 is a legal batch, but one draw in sixteen is enough
    else:
        count = draw(st.integers(max(1, min_segments), max(1, max_segments)))
    if count > max_segments and kind != "empty":  # too many for one draw per segment
        return _fit(list(draw(tiny_segment_lengths(count, count, min(3, max_len)))), max_total)
    if kind == "empty":
        return (0,) * count
    if kind == "uniform":  # one length everywhere: the layout padded kernels like best
        return _fit([draw(st.integers(0, max_len))] * count, max_total)
    lengths = draw(st.lists(_one_length(max_len), min_size=count, max_size=count))
    return _fit(lengths, max_total)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Segment lengths of q and of k/v. ``cross`` is False when they are one layout."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    cross: bool

    def __post_init__(self):
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError("q and k/v layouts need the same number of segments")
        if not self.cross and self.q_lens != self.kv_lens:
            raise ValueError("a self-attention layout has one set of lengths")

    @property
    def n(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def total_k(self) -> int:
        return sum(self.kv_lens)

    @property
    def score_elements(self) -> int:
        """``sum(Lq_i * Lk_i)``: score entries per head."""
        return sum(a * b for a, b in zip(self.q_lens, self.kv_lens))


@st.composite
def layouts(
    draw,
    max_segments: int = 64,
    max_len: int = 256,
    *,
    min_segments: int = 0,
    max_total: int | None = None,
    max_scores: int | None = None,
    allow_many_tiny: bool = True,
    max_tiny_segments: int = 4096,
    cross: bool | None = None,
) -> Layout:
    """A self-attention or (``cross=None``: either) cross-attention :class:`Layout`.

    Cross layouts draw the k/v lengths independently with the same segment
    count; half of them use short queries (0-2 tokens: decode/chunked-prefill
    like shapes). ``max_scores`` caps ``sum(Lq_i * Lk_i)`` by shrinking long
    segments.
    """
    is_cross = draw(st.booleans()) if cross is None else cross
    q_lens = draw(
        segment_lengths(
            max_segments,
            max_len,
            min_segments=min_segments,
            max_total=max_total,
            allow_many_tiny=allow_many_tiny,
            max_tiny_segments=max_tiny_segments,
        )
    )
    if not is_cross:
        kv_lens = q_lens
    else:
        short_q = draw(st.booleans())
        if short_q and len(q_lens) <= max_segments:
            q_lens = _fit(
                draw(st.lists(st.integers(0, 2), min_size=len(q_lens), max_size=len(q_lens))),
                max_total,
            )
        kv_max = max_len if len(q_lens) <= max_segments else 3
        kv_lens = draw(segment_lengths(max_segments, kv_max, max_total=max_total, n=len(q_lens)))
    if max_scores is not None:
        q_lens, kv_lens = _cap_scores(list(q_lens), list(kv_lens), max_scores, is_cross)
    return Layout(tuple(q_lens), tuple(kv_lens), is_cross)


def _cap_scores(q_lens, kv_lens, max_scores, is_cross):
    while sum(a * b for a, b in zip(q_lens, kv_lens)) > max_scores:
        i = max(range(len(q_lens)), key=lambda j: q_lens[j] * kv_lens[j])
        if is_cross:
            if q_lens[i] >= kv_lens[i]:
                q_lens[i] //= 2
            else:
                kv_lens[i] //= 2
        else:
            q_lens[i] = kv_lens[i] = q_lens[i] * 7 // 10
    return q_lens, kv_lens


# --------------------------------------------------------------------------- knobs


@st.composite
def head_configs(
    draw, max_kv_heads: int = 4, ratios: tuple[int, ...] = GQA_RATIOS, max_q_heads: int = 32
) -> tuple[int, int]:
    """``(Hq, Hkv)`` with ``Hq = ratio * Hkv``, ratio from ``ratios`` (MQA when Hkv == 1)."""
    ratio = draw(st.sampled_from([r for r in ratios if r <= max_q_heads] or [1]))
    hkv = draw(st.integers(1, max(1, min(max_kv_heads, max_q_heads // ratio))))
    return ratio * hkv, hkv


def head_dims(choices: tuple[int, ...] = HEAD_DIMS) -> st.SearchStrategy[int]:
    return st.sampled_from(choices)


def scales(min_value: float = 1e-3, max_value: float = 1.0) -> st.SearchStrategy[float | None]:
    """``None`` (the default ``D ** -0.5``) or a finite positive float."""
    return st.one_of(
        st.none(),
        st.floats(min_value, max_value, allow_nan=False, allow_infinity=False),
    )


def dtypes(choices: tuple[torch.dtype, ...] = DTYPES) -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(choices)


def index_dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(INDEX_DTYPES)


# --------------------------------------------------------------------------- cases


class AttentionInputs(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor


def cu_seqlens(lengths, dtype: torch.dtype = torch.int32, device="cpu") -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as a 1-D tensor."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype, device=device)


def no_key_rows(q_lens, kv_lens, causal: bool) -> torch.Tensor:
    """Bool ``[Tq]``: query rows that see no key (empty k/v segment, or above the
    bottom-right causal diagonal when ``Lq > Lk``). Their output must be zero."""
    rows = []
    for lq, lk in zip(q_lens, kv_lens):
        for i in range(lq):
            rows.append(lk == 0 or (causal and i + lk - lq < 0))
    return torch.tensor(rows, dtype=torch.bool)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One ragged attention call, reproducible from its fields.

    ``fused_qkv``: q, k and v are slices of one ``[T, Hq + 2 Hkv, D]`` tensor
    (non-contiguous; self layouts only). ``pass_cu_k``: pass ``cu_seqlens_k``
    explicitly even for a self layout (otherwise ``None`` is passed for self).
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

    @property
    def q_lens(self) -> tuple[int, ...]:
        return self.layout.q_lens

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return self.layout.kv_lens

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def effective_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def tensors(self, device="cpu", dtype: torch.dtype | None = None) -> AttentionInputs:
        """Random q/k/v (standard normal from ``seed``, then cast) and offsets.

        ``dtype`` overrides the case's dtype (e.g. to build a float32 copy of the
        same values: cast the returned tensors instead to get *exactly* the
        same values as a low-precision run).
        """
        dtype = self.dtype if dtype is None else dtype
        g = torch.Generator().manual_seed(self.seed)
        tq, tk = self.layout.total_q, self.layout.total_k
        D = self.head_dim
        if self.fused_qkv:
            assert not self.layout.cross
            qkv = torch.randn(tq, self.hq + 2 * self.hkv, D, generator=g).to(device, dtype)
            q = qkv[:, : self.hq]
            k = qkv[:, self.hq : self.hq + self.hkv]
            v = qkv[:, self.hq + self.hkv :]
        else:
            q = torch.randn(tq, self.hq, D, generator=g).to(device, dtype)
            k = torch.randn(tk, self.hkv, D, generator=g).to(device, dtype)
            v = torch.randn(tk, self.hkv, D, generator=g).to(device, dtype)
        cu_q = cu_seqlens(self.q_lens, self.index_dtype, device)
        cu_k = cu_seqlens(self.kv_lens, self.index_dtype, device)
        return AttentionInputs(q, k, v, cu_q, cu_k)

    def call_kwargs(self, inputs: AttentionInputs) -> dict:
        """Arguments for :func:`ragged_compile.ragged_attention`."""
        cu_k = inputs.cu_seqlens_k if (self.layout.cross or self.pass_cu_k) else None
        return dict(
            q=inputs.q,
            k=inputs.k,
            v=inputs.v,
            cu_seqlens_q=inputs.cu_seqlens_q,
            cu_seqlens_k=cu_k,
            causal=self.causal,
            scale=self.scale,
        )

    def no_key_rows(self) -> torch.Tensor:
        return no_key_rows(self.q_lens, self.kv_lens, self.causal)

    def __repr__(self) -> str:  # short enough to read in a failure report
        def lens(t):
            return repr(t) if len(t) <= 40 else f"<{len(t)} segments, sum {sum(t)}>"

        return (
            f"AttentionCase(q_lens={lens(self.q_lens)}, kv_lens={lens(self.kv_lens)}, "
            f"cross={self.layout.cross}, hq={self.hq}, hkv={self.hkv}, head_dim={self.head_dim}, "
            f"dtype={self.dtype}, causal={self.causal}, scale={self.scale}, seed={self.seed}, "
            f"index_dtype={self.index_dtype}, fused_qkv={self.fused_qkv}, pass_cu_k={self.pass_cu_k})"
        )


@st.composite
def attention_cases(
    draw,
    *,
    dtypes_: tuple[torch.dtype, ...] = DTYPES,
    head_dims_: tuple[int, ...] = HEAD_DIMS,
    max_segments: int = 64,
    min_segments: int = 0,
    max_len: int = 256,
    max_elements: int = 1 << 17,
    max_score_elements: int = 1 << 21,
    allow_many_tiny: bool = True,
    max_tiny_segments: int = 4096,
    cross: bool | None = None,
    causal: bool | None = None,
) -> AttentionCase:
    """A complete :class:`AttentionCase` with bounded work.

    ``max_elements`` caps ``tokens * Hq * D`` of q and of k/v;
    ``max_score_elements`` caps ``sum(Lq_i * Lk_i) * Hq * D`` (the matmul work).
    Heads shrink first for long head dims, so large D still gets real lengths.
    """
    dtype = draw(dtypes(dtypes_))
    D = draw(head_dims(head_dims_))
    # Fewer heads for long head dims: keep Hq * D <= 1024.
    max_hq = max(1, min(32, 1024 // D))
    hq, hkv = draw(head_configs(max_kv_heads=4, max_q_heads=max_hq))
    per_token = hq * D
    max_total = max(1, max_elements // per_token)
    layout = draw(
        layouts(
            max_segments,
            max_len,
            min_segments=min_segments,
            max_total=max_total,
            max_scores=max(1, max_score_elements // per_token),
            allow_many_tiny=allow_many_tiny,
            max_tiny_segments=max_tiny_segments,
            cross=cross,
        )
    )
    if layout.n > max_segments:  # thousands of segments: one k/v head
        hq, hkv = hq // hkv, 1
    is_causal = draw(st.booleans()) if causal is None else causal
    scale = draw(scales())
    seed = draw(st.integers(0, 2**31 - 1))
    index_dtype = draw(index_dtypes())
    fused = (not layout.cross) and draw(st.integers(0, 3)) == 0
    pass_cu_k = draw(st.booleans())
    return AttentionCase(
        layout=layout,
        hq=hq,
        hkv=hkv,
        head_dim=D,
        dtype=dtype,
        causal=is_causal,
        scale=scale,
        seed=seed,
        index_dtype=index_dtype,
        fused_qkv=fused,
        pass_cu_k=pass_cu_k,
    )


def scaled_examples(fraction: float = 1.0, minimum: int = 1) -> int:
    """``max_examples`` for a test that is ``1 / fraction`` times as expensive as a
    typical one: a fraction of the active Hypothesis profile's budget, so the
    ``ci`` / ``dev`` / ``long`` profiles scale every test together."""
    return max(minimum, int(settings().max_examples * fraction))
