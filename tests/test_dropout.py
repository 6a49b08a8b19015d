"""Attention dropout on the op (``dropout_p``), as SDPA's: keep rate and scaling,
reproducible under ``torch.manual_seed``, exact gradients of the mask it drew,
segments independent; on CUDA through PyTorch's FlashAttention-2 (its mask read
back through an identity ``v``, so the gradients can be checked exactly).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ragged_compile as rc
from ragged_compile import testing
from ragged_compile.reference import dense_attention

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _params(devices):
    return [pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else []) for d in devices]


def _cu(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(device, torch.int32)


def _inputs(lq, lk=None, hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g).to(device, dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g).to(device, dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g).to(device, dtype)
    return q, k, v, _cu(lq, device), _cu(lk, device)


def _revealing_inputs(lengths, heads, device, dtype, seed=0):
    """q, k random; v one-hot per key position within its segment (head dim 64), so
    that ``out[i, h, j]`` is row i's probability of its segment's key j, as dropped."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = (2 * torch.randn(t, heads, 64, generator=g)).to(device, dtype)
    k = torch.randn(t, heads, 64, generator=g).to(device, dtype)
    v = torch.zeros(t, heads, 64)
    start = 0
    for n in lengths:
        v[start + torch.arange(n), :, torch.arange(n)] = 1.0
        start += n
    return q, k, v.to(device, dtype), _cu(lengths, device)


@pytest.mark.parametrize("device", _params(DEVICES))
def test_reproducible_under_manual_seed_and_off_at_zero(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, cq, ck = _inputs([7, 0, 30, 1], [9, 3, 30, 2], dtype=dtype, device=device)
    plain = rc.ragged_attention(q, k, v, cq, ck, causal=True)
    torch.manual_seed(3)
    a = rc.ragged_attention(q, k, v, cq, ck, causal=True, dropout_p=0.3)
    torch.manual_seed(3)
    b = rc.ragged_attention(q, k, v, cq, ck, causal=True, dropout_p=0.3)
    c = rc.ragged_attention(q, k, v, cq, ck, causal=True, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, plain)
    torch.testing.assert_close(rc.ragged_attention(q, k, v, cq, ck, causal=True, dropout_p=0.0), plain)


@pytest.mark.parametrize("device", _params(DEVICES))
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_scaling_match_sdpa(device, p):
    """Each probability is kept with probability 1 - p and scaled by 1 / (1 - p):
    read through an identity v, against the same statistic of SDPA's dropout."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lengths = [64, 40, 64, 17]
    q, k, v, cu = _revealing_inputs(lengths, 8, device, dtype)
    torch.manual_seed(0)
    dropped = rc.ragged_attention(q, k, v, cu, dropout_p=p).float()
    probs = rc.ragged_attention(q, k, v, cu).float()
    sdpa_kept, ours_kept, n = 0, 0, 0
    start = 0
    for L in lengths:
        rows = slice(start, start + L)
        pr, dr = probs[rows, :, :L], dropped[rows, :, :L]
        kept = dr != 0
        ours_kept += int(kept.sum())
        n += pr.numel()
        # kept probabilities are scaled by 1 / (1 - p), dropped ones are 0
        torch.testing.assert_close(dr[kept], pr[kept] / (1 - p), rtol=2e-2, atol=1e-3)
        qs, ks, vs = (t[rows].transpose(0, 1)[None].float() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=p)[0].transpose(0, 1)[:, :, :L]
        sdpa_kept += int((ref != 0).sum())
        start += L
    assert abs(ours_kept / n - (1 - p)) < 0.01
    assert abs(ours_kept / n - sdpa_kept / n) < 0.015


def test_gradients_are_exact_for_the_mask_drawn():
    q, k, v, cq, ck = _inputs([3, 0, 5], [4, 2, 6], dtype=torch.float64)

    def fn(q, k, v):
        torch.manual_seed(11)  # the same mask at every evaluation
        return rc.ragged_attention(q, k, v, cq, ck, causal=True, dropout_p=0.4)

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


def test_segments_stay_independent():
    def fn(x, c):
        torch.manual_seed(0)
        return rc.ragged_attention(x[:, :4], x[:, 4:6], x[:, 6:], c, dropout_p=0.3)

    x = torch.randn(40 + 3 + 25, 8, 16)
    testing.check_segment_independence(fn, x, _cu([40, 3, 25]))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_and_backward_equal_eager_under_one_seed(backend):
    q, k, v, cq, ck = _inputs([5, 9, 1], dtype=torch.float32)

    def step(q, k, v):
        out = rc.ragged_attention(q, k, v, cq, ck, dropout_p=0.25)
        return out, torch.autograd.grad(out.square().sum(), (q, k, v))

    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(5)
    want = step(*leaves)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: rc.ragged_attention(q, k, v, cq, ck, dropout_p=0.25),
                             backend=backend, fullgraph=True)
    torch.manual_seed(5)
    out = compiled(*leaves)
    got = torch.autograd.grad(out.square().sum(), leaves)
    torch.testing.assert_close(out, want[0])
    for a, b in zip(got, want[1]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bad,err,match", [
    (1.0, ValueError, r"dropout_p must be in \[0, 1\)"), (-0.1, ValueError, r"\[0, 1\)"),
    ("0.1", TypeError, "dropout_p must be a float"), (True, TypeError, "dropout_p must be a float"),
])
def test_bad_dropout_names_the_argument(bad, err, match):
    q, k, v, cq, ck = _inputs([3, 2])
    with pytest.raises(err, match=match):
        rc.ragged_attention(q, k, v, cq, ck, dropout_p=bad)


def test_dropout_with_a_variant_says_what_to_drop():
    q, k, v, cq, ck = _inputs([3, 2])
    for kw in (dict(window_size=(2, 0)), dict(softcap=5.0), dict(sinks=torch.zeros(4))):
        with pytest.raises(ValueError, match="no kernel; drop one of them"):
            rc.ragged_attention(q, k, v, cq, ck, dropout_p=0.1, **kw)


def test_under_torch_func_dropout_says_so():
    q, k, v, cq, ck = _inputs([3, 2])
    with pytest.raises(RuntimeError, match="dropout_p > 0 under a torch.func transform"):
        torch.func.grad(lambda q: rc.ragged_attention(q, k, v, cq, ck, dropout_p=0.1).sum())(q)


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cq, ck = _inputs([3, 2])
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq, fck = (mode.from_tensor(t) for t in (q, k, v, cq, ck))
        out, lse, max_lens, rng = torch.ops.ragged_compile.ragged_attention_dropout(fq, fk, fv, fcq, fck, False, 0.25, 0.1)
    assert out.shape == q.shape and lse.shape == (4, 5) and max_lens.shape == (2,)
    assert rng.shape == (2,) and rng.dtype == torch.uint64


def test_transformers_training_dropout_runs_our_op_where_a_kernel_takes_it(monkeypatch):
    """BERT in training with attention dropout: where select says a kernel takes
    dropout (FlashAttention-2 on CUDA; here forced, on the reference), every layer
    runs our dropout op, reproducibly, and gradients flow; in eval it is off."""
    transformers = pytest.importorskip("transformers")
    from _hf_common import Count, pad_mask

    from ragged_compile import hf
    from ragged_compile.backends import select

    monkeypatch.setattr(select, "dropout_kernel", lambda device, dtype, head_dim: "fa2")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, attention_probs_dropout_prob=0.5,
                                  hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False)
    model.set_attn_implementation(hf.register())
    ids = torch.randint(1, 63, (3, 10))
    mask = pad_mask([10, 4, 7], 10)
    dropout_op = (torch.ops.ragged_compile.ragged_attention_dropout.default,)
    model.train()
    with Count(dropout_op) as c:
        torch.manual_seed(1)
        a = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.manual_seed(1)
    b = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert c.n == 2 and torch.equal(a, b)
    a[mask.bool()].square().sum().backward()
    assert all(p.grad is not None for p in model.encoder.parameters())
    model.eval()
    with Count(dropout_op) as c, torch.no_grad():
        e = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert c.n == 0 and not torch.equal(e[mask.bool()], a.detach()[mask.bool()])


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_gradients_are_exact_for_the_mask_flashattention2_drew(causal):
    """FlashAttention-2's mask, read back through an identity v, gives the exact
    gradients of that call (dense float64 with the mask), which its backward must
    match: the forward's rng state reached the backward."""
    lengths = [64, 0, 23, 1, 50]
    q, k, v, cu = _revealing_inputs(lengths, 4, "cuda", torch.bfloat16, seed=2)
    p = 0.3
    leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(4)
    out = rc.ragged_attention(*leaves, cu, causal=causal, dropout_p=p)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, go)
    probs = dense_attention(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), cu.cpu(), causal, 64**-0.5)  # [T, H, 64]
    keep = (out.detach().double().cpu() != 0) | (probs == 0)  # an undropped zero cannot show
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    start, outs = 0, []
    for L in lengths:
        rows = slice(start, start + L)
        if L:
            s = torch.einsum("qhd,khd->hqk", qd[rows], kd[rows]) * 64**-0.5
            if causal:
                s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
            pr = torch.softmax(s, -1) * keep[rows, :, :L].permute(1, 0, 2) / (1 - p)
            outs.append(torch.einsum("hqk,khd->qhd", pr, vd[rows]))
        start += L
    ref_out = torch.cat(outs)
    want = torch.autograd.grad(ref_out, (qd, kd, vd), go.double().cpu())
    torch.testing.assert_close(out.double().cpu(), ref_out.detach(), rtol=3e-2, atol=3e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double().cpu(), b, rtol=5e-2, atol=5e-2)


class _Watch(torch.utils._python_dispatch.TorchDispatchMode):
    """Any dispatch mode: the op's eager shortcuts step aside for the dispatcher."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 72])
def test_cuda_eager_dropout_equals_the_dispatched_pair(d):
    """An eager CUDA call with dropout runs aten's FlashAttention-2 under autograd (its
    own backward node redraws the mask); the same call through the dispatcher runs
    the op pair. Under one seed both draw the same mask (the same output, bit for
    bit) and give the same gradients, at head dims 64 and 72."""
    lengths = [64, 0, 23, 1, 50]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), 4, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    cu = _cu(lengths).cuda()
    go = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)

    def run():
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(11)
        out = rc.ragged_attention(*leaves, cu, causal=True, dropout_p=0.2)
        return out, torch.autograd.grad(out, leaves, go)

    eager = run()
    if d == 64:
        assert "FlashAttention" in eager[0].grad_fn.name(), eager[0].grad_fn.name()
    with _Watch():
        dispatched = run()
    assert "FlashAttention" not in dispatched[0].grad_fn.name()
    assert torch.equal(eager[0], dispatched[0])  # one mask
    for a, b in zip(eager[1], dispatched[1]):  # FA2's backward adds dq up atomically: last bits vary
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_njt_sdpa_dropout_runs_our_op_where_a_kernel_takes_it(monkeypatch):
    """NJT SDPA with dropout_p under enable(): our dropout op where select says a
    kernel takes it (FlashAttention-2 on CUDA; here forced, on the reference),
    reproducible under manual_seed; otherwise the CPU keeps dense SDPA with dropout."""
    from ragged_compile import njt

    def sdpa(x):
        h = x.unflatten(-1, (4, 16)).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h, dropout_p=0.3)

    g = torch.Generator().manual_seed(0)
    x = torch.nested.nested_tensor([torch.randn(n, 64, generator=g) for n in (5, 12, 1)], layout=torch.jagged)
    from _hf_common import Count

    dropout_op = torch.ops.ragged_compile.ragged_attention_dropout.default
    monkeypatch.setattr(njt, "dropout_kernel", lambda device, dtype, head_dim: "fa2")
    with rc.enable():
        with Count((dropout_op,)) as c:
            torch.manual_seed(2)
            a = sdpa(x)
        torch.manual_seed(2)
        b = sdpa(x)
    assert c.n == 1 and torch.equal(a.values(), b.values())
    monkeypatch.setattr(njt, "dropout_kernel", lambda device, dtype, head_dim: "reference")
    with rc.enable(), Count((dropout_op,)) as c:
        sdpa(x)
    assert c.n == 0  # CPU: dense SDPA with dropout over padded segments
