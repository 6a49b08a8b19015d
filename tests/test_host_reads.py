"""Host reads on the padded transformers path: one per forward, none per layer.

On CUDA every host read of a device tensor is a device-to-host sync, and on
small batches the host decides the time. CPU: a dispatch mode counts the scalar
reads (``item``/``bool``/``equal``) made outside our kernels, and the runtime
(with a stand-in for FlashInfer) is checked to plan from host offsets it was
told, reading nothing back. CUDA: ``torch.cuda.set_sync_debug_mode`` counts the
syncs of whole forwards.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import _fake_flashinfer
import ragged_compile as rc

transformers = pytest.importorskip("transformers")

from _hf_common import OURS, Count, pad_mask  # noqa: E402
from ragged_compile import hf  # noqa: E402

NAME = hf.register()
_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.item.default,
}


def HostReads() -> Count:
    """Scalar reads of tensors, outside our op (a mode is off inside the ops it sees)."""
    return Count(_READS)


def _model(kind, device="cpu"):
    torch.manual_seed(0)
    if kind == "bert":
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)
        model = BertModel(cfg)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(NAME)
    return model.eval().to(device)


def _with_syncs(fn):
    """``fn()`` and the device-to-host syncs CUDA's sync debug mode saw in it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out, [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def _batch(lengths, s, left=False, device="cpu"):
    mask = pad_mask(lengths, s, left)
    ids = torch.randint(1, 63, (len(lengths), s))
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("kind,left", [("bert", False), ("bert", True), ("llama", True)])
@pytest.mark.parametrize("full", [False, True])
def test_padded_forward_reads_the_host_once(kind, left, full):
    model = _model(kind)
    ids, mask = _batch([12] * 3 if full else [7, 3, 12], 12, left=left)
    kw = {"use_cache": False} if kind == "llama" else {}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **kw)  # warm: lazy imports, caches
        with HostReads() as reads:
            model(input_ids=ids, attention_mask=mask, **kw)
    # The mask's one read is a copy to the host (a no-op for a CPU mask) that numpy
    # then reads, which the mode does not see: what it counts are reads made per layer.
    assert reads.n <= 1, f"{reads.n} host reads in one forward of {kind}"


def test_runtime_plans_from_offsets_it_was_told(monkeypatch):
    """know_offsets: a step that meets the device offsets plans from the host copy
    and counts no sync; an in-place edit of the offsets forgets it."""
    wrappers = _fake_flashinfer.install(monkeypatch)
    rt = rc.Runtime("cpu", backend="fa2", workspace_bytes=64)
    lens = [5, 0, 9, 2]
    cu = torch.tensor([0, 5, 5, 14, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 2, 8, generator=g) for _ in range(3))
    rt.know_offsets(cu, cu.clone())
    step = rt._step_for(cu, cu)
    out = step.attention(q, k, v, cu, cu, True, 0.3)
    assert rt.stats["syncs"] == 0 and rt.stats["plans"] == 1 and len(wrappers) == 1
    torch.testing.assert_close(out, rc.reference_attention(q, k, v, cu, cu, True, 0.3))
    cu.copy_(torch.tensor([0, 2, 7, 7, 16], dtype=torch.int32))  # edited in place: not known any more
    assert rt.known_offsets(cu) is None
    with rt.step():
        rt._step_for(cu, cu).attention(q, k, v, cu, cu, True, 0.3)
    assert rt.stats["syncs"] == 1, lens


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,left", [("bert", False), ("llama", True)])
def test_cuda_padded_forward_syncs_once(kind, left):
    model = _model(kind, "cuda").to(torch.bfloat16)
    ids, mask = _batch([40, 17, 64, 9], 64, left=left, device="cuda")
    kw = {"use_cache": False} if kind == "llama" else {}
    with torch.no_grad():
        for _ in range(2):
            model(input_ids=ids, attention_mask=mask, **kw)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                model(input_ids=ids, attention_mask=mask, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 1, syncs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,left,dense", [("bert", False, True), ("bert", True, True), ("llama", True, False),
                                            ("bert", False, False)])
def test_cuda_small_padded_batch_runs_without_a_plan(kind, left, dense, monkeypatch, caplog):
    """A small padded batch plans nothing: an encoder's goes to SDPA with its
    key-padding mask (no read of the mask at all), a decoder's (causal) runs
    FlashAttention-2, one kernel a layer, the layers after the first through the
    direct path; the model's own ``"sdpa"`` output on every valid row."""
    from ragged_compile.backends import select

    from ragged_compile.backends import flash_backward
    from ragged_compile.runtime import get_runtime

    rt = get_runtime(torch.device("cuda", torch.cuda.current_device()))
    monkeypatch.setattr(rt, "backend", "auto")
    if not dense:  # the encoder on the ragged path too
        monkeypatch.setattr(select, "_DENSE_MAX_FLOPS", 0)
    direct = []
    real = flash_backward.forward_unpadded
    monkeypatch.setattr(flash_backward, "forward_unpadded", lambda *a: direct.append(1) or real(*a))
    model = _model(kind, "cuda").to(torch.bfloat16)
    ids, mask = _batch([40, 17, 64, 9], 64, left=left, device="cuda")
    kw = {"use_cache": False} if kind == "llama" else {}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **kw)
        before, direct[:] = dict(rt.stats), []
        with caplog.at_level("WARNING", logger="ragged_compile"):
            out, syncs = _with_syncs(lambda: model(input_ids=ids, attention_mask=mask, **kw)[0])
        ran = {name: rt.stats[name] - before.get(name, 0) for name in ("varlen", "flashinfer", "plans")}
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids, attention_mask=mask, **kw)[0]
    assert "runs the model's own" not in caplog.text  # the route is not a fallback
    if dense:
        assert ran == {"varlen": 0, "flashinfer": 0, "plans": 0} and not syncs, (ran, syncs)
    else:
        assert ran == {"varlen": 4, "flashinfer": 0, "plans": 0} and len(syncs) <= 1, (ran, syncs)
        assert len(direct) == 3
    valid = mask.bool()
    torch.testing.assert_close(out[valid].float(), want[valid].float(), atol=3e-2, rtol=3e-2)


def test_mask_read_says_whether_it_pads_anything():
    """The one read of a 2-D mask per forward also says whether any row is padded
    (hf.py then runs SDPA without the mask where nothing is: select.full_rows_kernel)."""
    from ragged_compile.hf import _read_padded_layout

    full = torch.ones(3, 16, dtype=torch.bool)
    assert _read_padded_layout(full, 16, False).full and _read_padded_layout(full, 16, True).full
    padded = full.clone()
    padded[1, 12:] = False
    assert not _read_padded_layout(padded, 16, False).full
    left = full.clone()
    left[2, :1] = False
    assert not _read_padded_layout(left, 16, True).full


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_cuda_full_rows_run_sdpa_without_the_mask(kind, monkeypatch):
    """A batch whose mask pads nothing (every row full), too large for the small-batch
    route: SDPA without a mask, as stock's mask function makes it (no op call, no
    plan), reading the mask at most once; the model's own ``"sdpa"`` output. The
    Llama here is GQA (4 query, 2 key-value heads): it stays on the op."""
    from ragged_compile.runtime import get_runtime

    rt = get_runtime(torch.device("cuda", torch.cuda.current_device()))
    model = _model(kind, "cuda").to(torch.bfloat16)
    ids, mask = _batch([64] * 4, 64, device="cuda")
    assert bool(mask.bool().all())
    from ragged_compile.backends import select

    monkeypatch.setattr(select, "_DENSE_MAX_FLOPS", 0)  # not the small-batch route
    kw = {"use_cache": False} if kind == "llama" else {}
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **kw)
        before = dict(rt.stats)
        with Count(OURS) as c:
            out, syncs = _with_syncs(lambda: model(input_ids=ids, attention_mask=mask, **kw)[0])
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids, attention_mask=mask, **kw)[0]
    assert len(syncs) <= 1, syncs
    if kind == "bert":
        assert c.n == 0
        assert all(rt.stats.get(k, 0) == before.get(k, 0) for k in ("varlen", "flashinfer", "plans"))
    else:
        assert c.n == 4
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("how", ["no mask", "unpadded"])
def test_cuda_rows_without_padding_run_sdpa_without_a_mask(how, monkeypatch):
    """BERT called without a mask, or unpadded (hf.unpad) with a mask that pads
    nothing: SDPA without a mask as stock runs it, no op call, no plan, at most one
    sync (unpadding's read of the mask); the model's own ``"sdpa"`` output."""
    from ragged_compile import hf_unpad
    from ragged_compile.backends import select
    from ragged_compile.runtime import get_runtime

    rt = get_runtime(torch.device("cuda", torch.cuda.current_device()))
    model = _model("bert", "cuda").to(torch.bfloat16)
    ids, mask = _batch([64] * 4, 64, device="cuda")
    kw = {"input_ids": ids} if how == "no mask" else {"input_ids": ids, "attention_mask": mask}
    monkeypatch.setattr(select, "_DENSE_MAX_FLOPS", 0)  # not the small-batch route
    if how == "unpadded":
        hf_unpad.unpad(model)
    with torch.no_grad():
        model(**kw)
        before = dict(rt.stats)
        with Count(OURS) as c:
            out, syncs = _with_syncs(lambda: model(**kw)[0])
        if how == "unpadded":
            hf_unpad.unpad(model, enabled=False)
        model.set_attn_implementation("sdpa")
        want = model(**kw)[0]
    assert len(syncs) <= (1 if how == "unpadded" else 0), syncs
    assert c.n == 0
    assert all(rt.stats.get(k, 0) == before.get(k, 0) for k in ("varlen", "flashinfer", "plans"))
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])
def test_cuda_small_padded_training_runs_sdpa_with_the_mask(attention_dropout):
    """Training on a small padded batch takes the same route as inference: SDPA with
    the additive key-padding mask (its dropout SDPA's own, as stock's), no plan, no
    mask read, nothing through our op; loss and gradients those of "sdpa" without
    dropout, and reproducible under manual_seed with it."""
    from transformers import BertConfig, BertForMaskedLM

    from ragged_compile.runtime import get_runtime

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=attention_dropout)
    model = BertForMaskedLM(cfg).cuda().train()
    model.set_attn_implementation(NAME)
    ids, mask = _batch([40, 17, 64, 9], 64, device="cuda")
    labels = ids.masked_fill(~mask.bool(), -100)
    rt = get_runtime(torch.device("cuda", torch.cuda.current_device()))

    def step(watch=False, seed=1):
        model.zero_grad()
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            torch.cuda.set_sync_debug_mode(1 if watch else 0)  # the forward's syncs (the loss's are stock's)
            try:
                hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
            finally:
                torch.cuda.set_sync_debug_mode(0)
            logits = model.cls(hidden)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    step()
    before = dict(rt.stats)
    ours = (*OURS, torch.ops.ragged_compile.ragged_attention_dropout.default)
    with Count(ours) as c, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = step(watch=True)
    assert c.n == 0 and not [w for w in caught if "called a synchronizing" in str(w.message)]
    assert all(rt.stats.get(k, 0) == before.get(k, 0) for k in ("varlen", "flashinfer", "plans"))
    again, _ = step()
    assert torch.equal(again, loss) and torch.isfinite(loss)
    if attention_dropout:  # the dropout is drawn: another seed, another loss
        assert not torch.equal(step(seed=2)[0], loss)
    else:
        model.set_attn_implementation("sdpa")
        want, want_grads = step()
        torch.testing.assert_close(loss, want, atol=2e-2, rtol=2e-2)
        for n in want_grads:
            torch.testing.assert_close(grads[n], want_grads[n], atol=5e-2, rtol=5e-2, msg=lambda m: f"{n}: {m}")


def test_dense_routes_step_aside_in_steps_and_under_saved_tensor_hooks():
    """The dense SDPA routes (small padded batches, rows that pad nothing) take a call
    only outside runtime steps and saved-tensor hooks: non-reentrant checkpointing
    recomputes a layer under such hooks in the backward, where the forward's step is
    not active, and the forward and its recompute must run the same kernel."""
    from ragged_compile.runtime import get_runtime

    assert hf._dense_may_run()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not hf._dense_may_run()
    assert hf._dense_may_run()
    with get_runtime(torch.device("cpu")).step():
        assert not hf._dense_may_run()
    assert hf._dense_may_run()
