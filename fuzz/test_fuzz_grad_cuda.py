"""CUDA gradient fuzz: training forward + backward (flash-attn-4 when installed, else
FlashAttention-2; RAGGED_COMPILE_BACKWARD picks one) vs float64 autograd.

    RAGGED_FUZZ_GRAD_EXAMPLES=1000 python -m pytest -q -s fuzz/test_fuzz_grad_cuda.py

Each example draws a layout (self or cross, empty and one-token segments, all-empty
k, causal with Lq != Lk), GQA 1/2/4/8, head dims 32..256 (72/80/96 padded), bf16
or fp16, and compares out with a dense float64 per-segment reference and dq, dk,
dv with float64 gradients given the forward's rounded output (see _grads64), on
the GPU, on the *same* rounded inputs. Checked per tensor (norm-wise,
tight) and per token row (loose, so one wrong segment cannot hide among long ones).
Skipped without a CUDA device.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings

import ragged_compile
from ragged_compile.backends import select
from fuzz.strategies import AttentionCase, Layout, attention_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_EXAMPLES = int(os.environ.get("RAGGED_FUZZ_GRAD_EXAMPLES", "200"))
HEAD_DIMS = (32, 64, 72, 80, 96, 128, 256)
# (norm-wise relative, per-row relative) tolerances against float64.
TOLERANCES = {torch.bfloat16: (2e-2, 1e-1), torch.float16: (5e-3, 3e-2)}


def _case(q_lens, kv_lens=None, hq=4, hkv=1, d=72, dtype=torch.bfloat16, causal=True, **kw):
    cross = kv_lens is not None
    layout = Layout(tuple(q_lens), tuple(kv_lens if cross else q_lens), cross)
    return AttentionCase(layout, hq, hkv, d, dtype, causal, kw.pop("scale", None), kw.pop("seed", 7), **kw)


EXAMPLES = [
    _case([5, 0, 1, 33], [0, 7, 1, 20], hq=8, hkv=1, d=72),  # GQA 8, empty q and k, Lq > Lk
    _case([1, 1, 200, 0], [64, 0, 300, 5], hq=4, hkv=2, d=80, dtype=torch.float16),
    _case([17, 1, 0, 130], hq=8, hkv=8, d=96, causal=False, fused_qkv=True),
    _case([3, 9], [0, 0], hq=4, hkv=1, d=64),  # all-empty k
    _case([0, 0], [5, 2], hq=2, hkv=1, d=32),  # all-empty q
    _case([40, 3], [9, 100], hq=16, hkv=2, d=256, index_dtype=torch.int64, scale=0.05),
    _case([1] * 300, hq=8, hkv=1, d=128, dtype=torch.float16),
]


def _dense64(q, k, v, cu_q, cu_k, causal: bool, scale: float) -> torch.Tensor:
    """One dense float64 softmax per segment on q's device (the GPU: fast in float64)."""
    grp = q.shape[1] // k.shape[1]
    outs = [q[:0] * 0]  # in the graph even when no segment has queries
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0:
            continue
        if lk == 0:
            outs.append(qs * 0)  # keeps the graph: zero output, zero gradient
            continue
        ks, vs = ks.repeat_interleave(grp, dim=1), vs.repeat_interleave(grp, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            qi = torch.arange(lq, device=q.device)[:, None]
            kj = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(kj > qi + (lk - lq), float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # rows that see no key
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs)


def _grads64(q, k, v, cu_q, cu_k, causal: bool, scale: float, g, out):
    """float64 dq, dk, dv per segment, given the forward's *rounded* output.

    The backward's term ``D_i = sum_d dO_id O_id`` cancels against ``dP_ij``
    wherever a row's softmax is nearly one-hot (large scores, short segments);
    with O rounded to bf16 that cancellation is what any FlashAttention backward
    computes, stock PyTorch's included. Taking D from the output the forward
    returned isolates what the backward kernel itself gets right (the forward's
    output is checked against exact float64 separately).
    """
    grp = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks, vs = q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0 or lk == 0:
            continue
        go, o = g[cq[i] : cq[i + 1]], out[cq[i] : cq[i + 1]]
        ke, ve = ks.repeat_interleave(grp, dim=1), vs.repeat_interleave(grp, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ke) * scale
        if causal:
            qi = torch.arange(lq, device=q.device)[:, None]
            kj = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(kj > qi + (lk - lq), float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
        dp = torch.einsum("qhd,khd->hqk", go, ve)
        d_row = (go * o).sum(-1).transpose(0, 1)[..., None]  # [Hq, lq, 1]
        ds = p * (dp - d_row)
        dq[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", ds, ke) * scale
        hkv = k.shape[1]
        dk[ck[i] : ck[i + 1]] = (torch.einsum("hqk,qhd->khd", ds, qs) * scale).unflatten(1, (hkv, grp)).sum(2)
        dv[ck[i] : ck[i + 1]] = torch.einsum("hqk,qhd->khd", p, go).unflatten(1, (hkv, grp)).sum(2)
    return dq, dk, dv


def _check(name, got, want, dtype, case):
    assert got.shape == want.shape and got.dtype == dtype, (name, got.shape, want.shape)
    assert bool(torch.isfinite(got).all()), f"{name} not finite for {case!r}"
    if want.numel() == 0:
        return
    norm_tol, row_tol = TOLERANCES[dtype]
    got, ref = got.detach().double().cpu(), want.detach().double().cpu()
    err = got - ref
    # Exact zeros happen (one-token causal segments: dq = 0): a floor of 1e-3 rms.
    ref_norm = max(ref.norm().item(), 1e-3 * ref.numel() ** 0.5)
    rel = err.norm().item() / ref_norm
    assert rel < norm_tol, f"{name}: relative error {rel:.3g} >= {norm_tol} for {case!r}"
    row_err = err.flatten(1).norm(dim=1)
    row_ref = ref.flatten(1).norm(dim=1)
    floor = ref_norm / max(1, ref.shape[0]) ** 0.5  # the rms row norm
    bad = row_err > row_tol * torch.maximum(row_ref, torch.full_like(row_ref, floor))
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())} token rows off (first {bad.nonzero()[0].item()}) for {case!r}"
    )


def test_gradients_match_float64_autograd():
    ran = collections.Counter()

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        case=attention_cases(
            dtypes_=(torch.bfloat16, torch.float16),
            head_dims_=HEAD_DIMS,
            max_segments=48,
            max_len=512,
            max_elements=1 << 20,
            max_score_elements=1 << 26,
            max_tiny_segments=256,
        )
    )
    def check(case: AttentionCase):
        x = case.tensors(device="cuda")
        q, k, v = (t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v))
        kwargs = case.call_kwargs(x)
        kwargs.update(q=q, k=k, v=v)
        out = ragged_compile.ragged_attention(**kwargs)
        g = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(case.seed), device="cuda")
        out.backward(g.to(out.dtype))
        torch.cuda.synchronize()

        q64, k64, v64 = (t.detach().double() for t in (x.q, x.k, x.v))
        cu_q, cu_k, scale = x.cu_seqlens_q, x.cu_seqlens_k, case.effective_scale
        ref = _dense64(q64, k64, v64, cu_q, cu_k, case.causal, scale)
        _check("out", out.detach(), ref, case.dtype, case)
        g64, out64 = g.to(out.dtype).double(), out.detach().double()
        want = _grads64(q64, k64, v64, cu_q, cu_k, case.causal, scale, g64, out64)
        for name, a, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
            _check(name, a, b, case.dtype, case)
        ran["examples"] += 1
        layout = (len(case.q_lens), case.layout.total_q, case.layout.total_k)
        ran["backward_" + select.backward_kernel(q.device, q.dtype, q.shape[-1], layout)] += 1
        ran[str(case.dtype)] += 1
        ran[f"d{case.head_dim}"] += 1
        ran[f"gqa{case.hq // case.hkv}"] += 1
        ran["cross" if case.layout.cross else "self"] += 1
        ran["causal"] += case.causal
        ran["empty_segment"] += 0 in case.q_lens or 0 in case.kv_lens
        ran["all_k_empty"] += case.layout.total_k == 0
        ran["causal_lq_gt_lk"] += case.causal and any(a > b for a, b in zip(case.q_lens, case.kv_lens))
        if ran["examples"] % 100 == 0:  # progress that survives a time limit
            print(f"\n{ran['examples']} examples passed so far ({dict(ran)})", flush=True)

    for c in EXAMPLES:
        check = example(case=c)(check)
    check()
    print(f"\nCUDA gradient fuzz: ran {ran['examples']} examples ({dict(ran)})")
    assert ran["examples"] >= min(MAX_EXAMPLES, len(EXAMPLES))
