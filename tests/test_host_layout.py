"""The host work of a forward's first layer against its device (torch) twin.

A padded forward's layout is found on a host copy of the mask (numpy: hf's
``_host_runs`` and ``_layout_of_runs`` on arrays), and the runtime's host layout
and offset checks run in numpy too; the compiled and graph paths keep the torch
versions. Both must give the same answer on every mask: random masks, padding on
either side, empty rows, full rows, and masks that are not padding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ragged_compile.steps import HostLayout
from ragged_compile.validation import check_cu_seqlens_values

hf = pytest.importorskip("ragged_compile.hf")


def _masks(seed=0, count=300):
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        b, s = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        kind = i % 4
        if kind == 3:  # anything: mostly not padding
            yield (torch.rand(b, s, generator=g) < 0.6)
            continue
        start = torch.randint(0, s + 1, (b,), generator=g)
        n = (torch.rand(b, generator=g) * (s - start + 1)).long().clamp(max=s - start)
        if kind == 1:
            start = s - n  # left padding
        elif kind == 2:
            start = torch.zeros_like(n)  # right padding
        idx = torch.arange(s)
        yield (idx >= start[:, None]) & (idx < (start + n)[:, None])


@pytest.mark.parametrize("causal", [False, True])
def test_host_runs_and_offsets_match_the_device_version(causal):
    seen = {True: 0, False: 0}
    for valid in _masks():
        b, sk = valid.shape
        for sq in {sk, max(1, sk - 3)}:
            start, n, ok = hf._is_padding(valid, sq, causal)
            runs = hf._host_runs(valid.numpy(), sq, causal)
            assert (runs is not None) == bool(ok), (valid, sq)
            seen[bool(ok)] += 1
            if runs is None:
                continue
            assert np.array_equal(runs[0], start.numpy()) and np.array_equal(runs[1], n.numpy())
            want = hf._layout_of_runs(start, n, sq, sk, causal)
            got = hf._layout_of_runs(*runs, sq, sk, causal)
            assert got.cu_q.dtype == want.cu_q.dtype == torch.int32
            assert torch.equal(got.cu_q, want.cu_q) and torch.equal(got.cu_k, want.cu_k)
    assert seen[True] > 100 and seen[False] > 50  # both kinds of mask were met


def test_host_layout_and_offset_checks_match_torch():
    g = torch.Generator().manual_seed(1)
    for i in range(200):
        n = int(torch.randint(0, 12, (1,), generator=g))
        lq = torch.randint(0, 50, (n,), generator=g) * (torch.rand(n, generator=g) < 0.8)
        lk = torch.randint(0, 50, (n,), generator=g) * (torch.rand(n, generator=g) < 0.8)
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), lq.cumsum(0).to(torch.int32)])
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lk.cumsum(0).to(torch.int32)])
        lay = HostLayout(cu_q, cu_k)
        active = (lq > 0) & (lk > 0)
        assert (lay.n, lay.total_q, lay.total_k) == (n, int(lq.sum()), int(lk.sum()))
        assert lay.max_lens == ((int(lq.max()), int(lk.max())) if n else (0, 0))
        assert (lay.active, lay.active_k) == (int(active.sum()), int(lk[active].sum()))
        assert lay.pairs == int((lq * lk).sum())
        assert torch.equal(check_cu_seqlens_values(cu_q, int(lq.sum()), "cu_seqlens_q"), lq)
        if n:
            bad = cu_q.clone()
            j = int(torch.randint(1, n + 1, (1,), generator=g))
            bad[j] = bad[j - 1] - 1
            with pytest.raises(ValueError, match=f"non-decreasing, but cu_seqlens_q\\[{j}\\]"):
                check_cu_seqlens_values(bad, int(bad[-1]), "cu_seqlens_q")
