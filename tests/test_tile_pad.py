"""The padded isolation layout of flash-attn-4's backward (backends/tile_pad.py): the
layout's invariants, PyTorch's implementation, and the fused Triton gather bit for
bit against it (under Triton's interpreter on CPU, natively on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from ragged_compile import config
from ragged_compile.backends import tile_pad

CASES = [  # (segment lengths, tile)
    ([5, 0, 9, 1], 4),
    ([0, 0], 8),
    ([128, 64, 1, 0, 200], 64),
    ([1] * 9, 16),
    ([300], 128),
    ([7, 0, 0, 13, 2, 64], 32),
]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def _rows(total, heads, d, dtype, seed, strided):
    g = torch.Generator().manual_seed(seed)
    if strided:  # [T, H, D] as a transposed view, as attention modules hand it over
        return torch.randn(heads, total, d, generator=g).to(dtype).transpose(0, 1)
    return torch.randn(total, heads, d, generator=g).to(dtype)


@pytest.mark.parametrize("lens,tile", CASES)
def test_segments_start_on_tiles_and_the_row_maps_invert(lens, tile):
    cu = _cu(lens)
    total = int(cu[-1])
    lay = tile_pad.layout(cu, total, tile)
    assert lay.rows == total + len(lens) * (tile - 1) + tile
    assert bool((lay.cu % tile == 0).all()) and lay.lens.tolist() == list(lens)
    assert int(lay.cu[-1]) + tile <= lay.rows  # a tile read past the last segment stays inside
    assert torch.equal(lay.src[lay.dst], torch.arange(total))
    assert int((lay.src >= 0).sum()) == total
    for i, n in enumerate(lens):  # segment i's rows, in order, at its padded start
        start = int(lay.cu[i])
        assert lay.src[start : start + n].tolist() == list(range(int(cu[i]), int(cu[i]) + n))
        assert bool((lay.src[start + n : int(lay.cu[i + 1])] == -1).all())


@pytest.mark.parametrize("lens,tile", CASES)
@pytest.mark.parametrize("d,dim", [(64, 64), (72, 96), (80, 96)])
def test_pytorch_padding_round_trips_and_pads_with_zeros(lens, tile, d, dim):
    cu = _cu(lens)
    total = int(cu[-1])
    lay = tile_pad.layout(cu, total, tile)
    xs = [_rows(total, 3, d, torch.float32, s, strided=s == 1) for s in range(3)]
    padded = tile_pad.pad_rows(xs, lay, dim)
    for x, p in zip(xs, padded):
        assert p.shape == (lay.rows, 3, dim) and p.is_contiguous()
        assert torch.equal(p[lay.dst, :, :d], x)
        assert not p[lay.src < 0].any() and not p[..., d:].any()
    back = tile_pad.unpad_rows(padded, lay, d)
    for x, b in zip(xs, back):
        assert torch.equal(b, x) and b.is_contiguous()
    lse = torch.randn(3, total)
    lp = tile_pad.pad_lse(lse, lay)
    assert torch.equal(lp[:, lay.dst], lse) and bool((lp[:, lay.src < 0] == float("inf")).all())


def test_the_fused_kernel_is_the_cuda_default_where_triton_is(monkeypatch):
    monkeypatch.delenv(config.FA4_PAD, raising=False)
    assert not tile_pad.fused(torch.device("cpu"))
    assert tile_pad.fused(torch.device("cuda")) == (tile_pad._triton() is not None)
    monkeypatch.setenv(config.FA4_PAD, "copies")
    assert not tile_pad.fused(torch.device("cuda"))
    monkeypatch.setenv(config.FA4_PAD, "fused")
    assert not tile_pad.fused(torch.device("cpu"))
    monkeypatch.setenv(config.FA4_PAD, "sideways")
    with pytest.raises(ValueError, match="RAGGED_COMPILE_FA4_PAD must be one of redo, fused, copies"):
        tile_pad.fused(torch.device("cuda"))


# -- the fused gather against PyTorch's, bit for bit ---------------------------------------

_GATHER_CASES = [  # (lens, tile, heads, d, dim, dtype, n tensors, strided)
    ([5, 0, 9, 1], 4, 2, 64, 64, torch.float32, 3, False),
    ([5, 0, 9, 1], 4, 3, 72, 96, torch.float16, 2, True),
    ([128, 64, 1, 0, 20], 64, 4, 80, 96, torch.bfloat16, 3, True),
    ([1] * 9, 16, 1, 128, 128, torch.bfloat16, 1, False),
    ([0, 0], 8, 2, 64, 64, torch.float16, 2, False),
    ([7, 0, 13, 2], 32, 16, 96, 96, torch.float32, 3, True),
    ([30], 128, 5, 256, 256, torch.float16, 2, False),
]


def _check_gather(device, lens, tile, heads, d, dim, dtype, n, strided):
    cu = _cu(lens).to(device)
    total = sum(lens)
    lay = tile_pad.layout(cu, total, tile)
    xs = [_rows(total, heads, d, dtype, s, strided and s != 1).to(device) for s in range(n)]
    want = [x.new_zeros((lay.rows, heads, dim)) for x in xs]
    for w, x in zip(want, xs):
        w[:, :, :d].index_copy_(0, lay.dst, x)
    got = tile_pad._gather(xs, lay.src, lay.rows, dim)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    back = tile_pad._gather(got, lay.dst, total, d)
    for b, x in zip(back, xs):
        assert torch.equal(b, x)


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tile_pad._triton.cache_clear()  # the kernel is made (interpreted) under the variable
    yield
    tile_pad._triton.cache_clear()


@pytest.mark.parametrize("case", _GATHER_CASES)
def test_the_fused_gather_equals_pytorchs_under_tritons_interpreter(interpreted, case):
    if case[5] == torch.bfloat16 and not _interpreter_takes_bf16():
        pytest.skip("this Triton's interpreter has no bfloat16")
    _check_gather("cpu", *case)


def _interpreter_takes_bf16() -> bool:
    try:
        _check_gather("cpu", [3], 4, 1, 64, 64, torch.bfloat16, 1, False)
    except Exception:  # noqa: BLE001 - numpy has no bfloat16 in some interpreters
        return False
    return True


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", _GATHER_CASES)
def test_cuda_the_fused_gather_equals_pytorchs(case):
    pytest.importorskip("triton")
    assert os.environ.get("TRITON_INTERPRET", "") in ("", "0")
    _check_gather("cuda", *case)
