"""The layouts every benchmark here runs on: the layout classes of the per-op
table (also the training benchmark's), random lengths, offsets, and one layout's
tensors on the device (:class:`Case`)."""

from __future__ import annotations

import functools

import torch

from harness import DTYPE

LAYOUT_SPECS = [
    # name, kind, hq, hkv, d, causal. Each class causal and not: FlashInfer's fa2 and
    # fa3 kernels trade places with segment length, causality and head grouping, and
    # backend="auto" must pick the faster one on every row (bench/README.md).
    ("mixed16", "mixed", 16, 16, 128, False),
    ("mixed16_causal", "mixed", 16, 16, 128, True),
    ("short250", "short", 16, 16, 128, False),
    ("short250_causal", "short", 16, 16, 128, True),
    ("mid50", "mid", 16, 16, 128, False),
    ("mid50_causal", "mid", 16, 16, 128, True),
    ("long4x8192", "long", 16, 16, 128, False),
    ("long4x8192_causal", "long", 16, 16, 128, True),
    ("gqa32_8", "mixed", 32, 8, 128, False),
    ("gqa32_8_causal", "mixed", 32, 8, 128, True),
    ("short250_gqa32_8", "short", 32, 8, 128, False),
    ("short250_gqa32_8_causal", "short", 32, 8, 128, True),
    ("mixed16_d64", "mixed", 16, 16, 64, False),
    ("mixed16_d72", "mixed", 16, 16, 72, False),
    ("vit42", "vit", 16, 16, 128, False),
    ("vit42_causal", "vit", 16, 16, 128, True),
]


def random_lengths(n: int, lo: int, hi: int, gen, total: int | None = None) -> list[int]:
    """``n`` lengths in ``lo..hi`` from ``gen`` (a seed or a generator); with ``total``,
    rescaled to about that many tokens (every step then fits one bucket)."""
    if isinstance(gen, int):
        gen = torch.Generator().manual_seed(gen)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen)
    if total is not None:
        lens = (lens.double() * total / lens.sum()).floor().long().clamp(min=1)
    return lens.tolist()


def cu_seqlens(lens, device=None) -> torch.Tensor:
    """int32 offsets ``[n + 1]`` of segments with lengths ``lens``."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(lens, dtype=torch.int64), 0)
    return cu if device is None else cu.to(device)


@functools.cache
def lengths_for(kind: str, smoke: bool) -> tuple[int, ...]:
    if kind == "mixed":
        n, lo, hi, want = (4, 8, 64, (100, 220)) if smoke else (16, 64, 4096, (33000, 36000))
        for seed in range(10_000):
            g = torch.Generator().manual_seed(1000 + seed)
            lens = torch.randint(lo, hi + 1, (n,), generator=g)
            lens[0], lens[1] = lo, hi  # both ends of the range ride along
            lens = lens[torch.randperm(n, generator=g)]
            if want[0] <= int(lens.sum()) <= want[1]:
                return tuple(int(x) for x in lens)
        raise RuntimeError("no seed gave a mixed layout in range")
    if kind == "short":
        return tuple(random_lengths(*((12, 2, 16) if smoke else (250, 16, 256)), gen=2))
    if kind == "mid":
        return tuple(random_lengths(*((4, 16, 48) if smoke else (50, 256, 1024)), gen=3))
    if kind == "long":
        return (96, 96) if smoke else (8192,) * 4
    if kind == "vit":
        # native-resolution images: square patch grids of 14..37 patches a side (196..1369)
        sides = random_lengths(*((4, 2, 6) if smoke else (42, 14, 37)), gen=4)
        return tuple(side * side for side in sides)
    raise ValueError(kind)


def useful_pairs(lq: int, lk: int, causal: bool) -> int:
    """(query, key) pairs actually attended; causal aligned bottom-right."""
    if not causal:
        return lq * lk
    off = lk - lq
    return sum(min(lk, max(0, i + off + 1)) for i in range(lq))


class Case:
    """One layout's tensors and metadata, on the device."""

    def __init__(self, name, kind, hq, hkv, d, causal, dev, smoke, seed):
        self.name, self.kind, self.causal, self.dev = name, kind, causal, dev
        if smoke:
            hq, hkv = (4, 2) if hq != hkv else (2, 2)
        self.hq, self.hkv, self.d = hq, hkv, d
        self.lens = list(lengths_for(kind, smoke))
        self.n = len(self.lens)
        self.total = sum(self.lens)
        self.max_len, self.min_len = max(self.lens), min(self.lens)
        self.scale = d**-0.5
        self.cu_host = cu_seqlens(self.lens)
        self.cu = self.cu_host.to(dev)  # int32 offsets on the device
        self.cu64 = self.cu.long()
        g = torch.Generator(device=dev).manual_seed(seed)
        self.q = torch.randn(self.total, hq, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        self.k = torch.randn(self.total, hkv, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        self.v = torch.randn(self.total, hkv, d, device=dev, generator=g, dtype=torch.float32).to(DTYPE)
        self.pairs = sum(useful_pairs(L, L, causal) for L in self.lens)
        self.flops = 4 * self.pairs * hq * d
        self.ref: torch.Tensor | None = None
        self.ours: torch.Tensor | None = None

    def describe(self) -> dict:
        return {
            "segments": self.n,
            "tokens": self.total,
            "min_len": self.min_len,
            "max_len": self.max_len,
            "hq": self.hq,
            "hkv": self.hkv,
            "head_dim": self.d,
            "causal": self.causal,
            "dtype": str(DTYPE),
            "attended_pairs": self.pairs,
            "useful_flops": self.flops,
            "lengths": self.lens,
        }

