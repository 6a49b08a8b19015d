"""CUDA fuzz: the op in bfloat16/float16 on a GPU against a float32 reference.

    RAGGED_FUZZ_CUDA_EXAMPLES=1000 python -m pytest -q -s fuzz/test_fuzz_cuda.py

The reference is ``reference_attention`` run on the *same* values cast to
float32 (on the GPU), so the only differences are the kernel's own rounding.
Skipped cleanly without a CUDA device.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

import ragged_compile
from ragged_compile.reference import reference_attention
from ragged_compile.testing import AttentionCase, Layout, attention_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_EXAMPLES = int(os.environ.get("RAGGED_FUZZ_CUDA_EXAMPLES", "200"))

# |out - ref| <= atol + rtol * |ref| against the float32 reference. Flash kernels
# round P to the input dtype before P @ V and round the output once.
TOLERANCES = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def _case(q_lens, kv_lens=None, hq=4, hkv=1, d=72, dtype=torch.bfloat16, causal=True, **kw):
    cross = kv_lens is not None
    layout = Layout(tuple(q_lens), tuple(kv_lens if cross else q_lens), cross)
    return AttentionCase(layout, hq, hkv, d, dtype, causal, kw.pop("scale", None), kw.pop("seed", 7), **kw)


# Always run, whatever the random draws cover: padded dims, GQA/MQA, cross,
# causal with Lq > Lk and Lq < Lk, zero-length and one-token segments.
EXAMPLES = [
    _case([5, 0, 1, 33], [0, 7, 1, 20], hq=8, hkv=2, d=72),
    _case([1, 1, 1, 200, 0], [64, 1, 0, 300, 5], hq=4, hkv=1, d=80, dtype=torch.float16),
    _case([17, 1, 0, 130], hq=8, hkv=8, d=96, causal=False, fused_qkv=True),
    _case([1] * 500 + [0] * 12, hq=8, hkv=1, d=128, dtype=torch.float16),
    _case([0, 0, 0], [3, 0, 2], d=64),
    _case([40, 3], [9, 100], hq=16, hkv=2, d=256, index_dtype=torch.int64, scale=0.05),
]


@pytest.mark.parametrize("backend", ["fa2", "fa3", "varlen"])
def test_cuda_matches_float32_reference(backend, monkeypatch):
    """Each CUDA forward the default runtime may pick (``auto`` picks among these per
    layout), forced for every example."""
    from ragged_compile.runtime import get_runtime

    if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs SM90")
    rt = get_runtime(torch.device("cuda", torch.cuda.current_device()))
    monkeypatch.setattr(rt, "backend", backend)
    before = rt.stats[backend if backend == "varlen" else "flashinfer"]
    ran = collections.Counter()

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        case=attention_cases(
            dtypes=(torch.bfloat16, torch.float16),
            max_len=512,
            max_elements=1 << 21,
            max_score_elements=1 << 28,
        )
    )
    def check(case: AttentionCase):
        x = case.tensors(device="cuda")
        out = ragged_compile.ragged_attention(**case.call_kwargs(x))
        torch.cuda.synchronize()
        assert out.shape == x.q.shape and out.dtype == case.dtype and out.is_cuda
        assert bool(torch.isfinite(out).all()), f"non-finite output for {case!r}"
        blind = case.no_key_rows().cuda()
        assert bool((out[blind] == 0).all()), f"rows that see no key are not zero for {case!r}"
        f32 = [t.float() for t in (x.q, x.k, x.v)]
        ref = reference_attention(
            *f32, x.cu_seqlens_q, x.cu_seqlens_k, case.causal, case.effective_scale
        )
        rtol, atol = TOLERANCES[case.dtype]
        err = (out.float() - ref).abs()
        bad = err > atol + rtol * ref.abs()
        assert not bool(bad.any()), (
            f"{int(bad.sum())} elements off, max err {err.max().item():.3g} for {case!r}"
        )
        ran["examples"] += 1
        ran[str(case.dtype)] += 1
        ran["cross" if case.layout.cross else "self"] += 1
        ran["causal"] += case.causal
        ran["gqa"] += case.hq != case.hkv
        ran["padded_dim"] += case.head_dim in (72, 80, 96)
        ran["empty_segment"] += 0 in case.q_lengths or 0 in case.k_lengths
        ran["one_token_segment"] += 1 in case.q_lengths or 1 in case.k_lengths

    for c in EXAMPLES:
        check = example(case=c)(check)
    check()
    print(f"\nCUDA fuzz: ran {ran['examples']} examples ({dict(ran)})")
    assert ran["examples"] >= min(MAX_EXAMPLES, len(EXAMPLES))
    assert rt.stats[backend if backend == "varlen" else "flashinfer"] - before >= ran["examples"] // 2
