"""transformers models with sliding windows, soft-capping and sinks on our op, against
the same weights on their own eager attention (fp32, tight tolerance): padded,
left-padded and packed batches, gradients of the sinks; the fallback path (the
model's own eager attention) where the op does not take a call; and model
classes that are not on the attention interface."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_common import Count, pad_mask  # noqa: E402
from ragged_compile import hf, logs  # noqa: E402
from ragged_compile.backends import select  # noqa: E402

NAME = hf.register()
TOL = 5e-5


@pytest.fixture(autouse=True)
def _fresh_warnings():
    logs._seen.clear()


_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, max_position_embeddings=128, pad_token_id=0, eos_token_id=63, bos_token_id=1)


def _family(kind: str, window: int, seed: int = 0):
    """A tiny model of a family; `window` is its sliding window (ModernBERT: local_attention)."""
    t = transformers
    if kind == "mistral":
        cls, cfg = t.MistralForCausalLM, t.MistralConfig(**_BASE, sliding_window=window)
    elif kind == "phi3":
        cls, cfg = t.Phi3ForCausalLM, t.Phi3Config(**_BASE, sliding_window=window)
    elif kind == "qwen2":
        cls, cfg = t.Qwen2ForCausalLM, t.Qwen2Config(**_BASE, use_sliding_window=True, sliding_window=window,
                                                       max_window_layers=1)
    elif kind == "gemma2":
        cls, cfg = t.Gemma2ForCausalLM, t.Gemma2Config(**_BASE, head_dim=8, sliding_window=window,
                                                         attn_logit_softcapping=2.0, query_pre_attn_scalar=8)
    elif kind == "gemma3":
        # attn_logit_softcapping is in Gemma3's config but its attention never applies it:
        # the call carries no softcap, so neither does ours.
        cls, cfg = t.Gemma3ForCausalLM, t.Gemma3TextConfig(**_BASE, head_dim=8, sliding_window=window,
                                                             attn_logit_softcapping=2.0, query_pre_attn_scalar=8,
                                                             layer_types=["sliding_attention", "full_attention"])
    elif kind == "gpt_oss":
        cls, cfg = t.GptOssForCausalLM, t.GptOssConfig(**_BASE, head_dim=8, sliding_window=window, num_local_experts=2,
                                                         num_experts_per_tok=1)
    elif kind == "modernbert":
        cls, cfg = t.ModernBertModel, t.ModernBertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128, local_attention=window, global_attn_every_n_layers=2, pad_token_id=0)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    if kind == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(2 * torch.randn(cfg.num_attention_heads))
    return model


DECODERS = ["mistral", "phi3", "qwen2", "gemma2", "gemma3", "gpt_oss"]
FAMILIES = DECODERS + ["modernbert"]


def _out(model, **kw):
    res = model(**kw)
    return res.logits if hasattr(res, "logits") else res.last_hidden_state


def _padded(model, lengths, s, left, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 62, (len(lengths), s), generator=g)
    mask = pad_mask(lengths, s, left)
    kw = dict(input_ids=ids * mask, attention_mask=mask)
    if not isinstance(model, transformers.ModernBertModel):
        kw["use_cache"] = False
    model.set_attn_implementation("eager")
    ref = _out(model, **kw)
    model.set_attn_implementation(NAME)
    with Count() as c:
        out = _out(model, **kw)
    model.set_attn_implementation("eager")
    valid = mask.bool()
    return ref[valid], out[valid], c.n


def _packed(model, lengths, seed=1):
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    feats = [{"input_ids": torch.randint(2, 62, (n,), generator=g).tolist()} for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")(feats)
    batch.pop("labels", None)
    model.set_attn_implementation("eager")
    ref = torch.cat([_out(model, input_ids=torch.tensor([f["input_ids"]]), use_cache=False)[0] for f in feats])
    model.set_attn_implementation(NAME)
    with Count() as c:
        out = _out(model, **batch, use_cache=False)[0]
    model.set_attn_implementation("eager")
    return ref, out, c.n


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("window", [3, 64])
def test_padded_batches_match_eager(kind, left, window):
    model = _family(kind, window)
    ref, out, n = _padded(model, [11, 4, 1, 8], 11, left)
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    assert n == 2  # every layer on our op: sliding and full, soft-capped, with sinks


@pytest.mark.parametrize("kind", DECODERS)
@pytest.mark.parametrize("window", [3, 64])
def test_packed_batches_match_eager(kind, window):
    model = _family(kind, window)
    ref, out, n = _packed(model, [7, 1, 12, 4])
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    assert n == 2


def test_gpt_oss_sinks_get_their_gradient():
    model = _family("gpt_oss", 4)
    ids = torch.randint(2, 62, (3, 9))
    mask = pad_mask([9, 5, 7], 9)
    labels = torch.where(mask.bool(), ids, -100)
    grads = {}
    for impl in ("eager", NAME):
        model.zero_grad()
        model.set_attn_implementation(impl)
        model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        grads[impl] = [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]
        grads[impl] += [model.model.layers[0].self_attn.q_proj.weight.grad.clone()]
    for a, b in zip(grads["eager"], grads[NAME]):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_gemma2_generate_left_padding():
    model = _family("gemma2", 3)
    ids = torch.randint(2, 62, (3, 7))
    mask = pad_mask([7, 3, 5], 7, left=True)
    kw = dict(input_ids=ids * mask, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("eager")
    ref = model.generate(**kw)
    model.set_attn_implementation(NAME)
    with Count() as c:
        out = model.generate(**kw)
    assert torch.equal(ref, out) and c.n == 2 * 6


# -- the fallback: the model's own eager attention -------------------------------------


def _force_fallback(monkeypatch):
    """Make every variant call one the op would not take fast (as on CUDA today)."""
    real = hf.unsupported_reason

    def reason(device, dtype, head_dim, *, training=False, variant=()):
        return "forced for the test" if variant else real(device, dtype, head_dim, training=training)

    monkeypatch.setattr(hf, "unsupported_reason", reason)


@pytest.mark.parametrize("kind", FAMILIES)
def test_fallback_runs_the_models_own_attention(kind, monkeypatch, caplog):
    """gpt-oss' sinks and Gemma2's softcap were lost (or refused) by transformers' SDPA
    function; the model's eager attention keeps them."""
    _force_fallback(monkeypatch)
    model = _family(kind, 3)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        ref, out, n = _padded(model, [11, 4, 1, 8], 11, left=False)
        torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
        if kind != "modernbert":
            ref, out, _ = _packed(model, [7, 1, 12, 4])
            torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    assert "forced for the test" in caplog.text and "own (eager) attention" in caplog.text
    assert n < 2 or kind == "gemma3"  # gemma3's full layer carries no variant


def test_fallback_without_a_module_eager_takes_every_argument():
    """An attention module whose module defines no eager_attention_forward: ours,
    with softcap, sinks, scaling, GQA and the mask."""
    model = _family("gpt_oss", 3)
    attn = model.model.layers[0].self_attn
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    sinks = torch.randn(4)
    mask = torch.zeros(2, 1, 6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    ours, _ = hf._eager_attention(attn, q, k, v, mask, scaling=0.4, s_aux=sinks)
    attn.sinks.data.copy_(sinks)
    ref, _ = gpt_oss_eager(attn, q, k, v, mask, scaling=0.4)
    torch.testing.assert_close(ours, ref)
    ours, _ = hf._eager_attention(attn, q, k, v, mask, scaling=0.4, softcap=1.5)
    ref, _ = gemma2_eager(attn, q, k, v, mask, scaling=0.4, softcap=1.5)
    torch.testing.assert_close(ours, ref)


def test_output_attentions_returns_the_models_weights():
    model = _family("gpt_oss", 4)
    ids = torch.randint(2, 62, (2, 6))
    model.set_attn_implementation("eager")
    ref = model(input_ids=ids, output_attentions=True, use_cache=False)
    model.set_attn_implementation(NAME)
    out = model(input_ids=ids, output_attentions=True, use_cache=False)
    for a, b in zip(ref.attentions, out.attentions):
        torch.testing.assert_close(b, a, rtol=TOL, atol=TOL)
    torch.testing.assert_close(out.logits, ref.logits, rtol=TOL, atol=TOL)


# -- the sweep ---------------------------------------------------------------------------


def test_sweep_no_wrong_answers_no_crashes(monkeypatch):
    """Every family x layout x window length x (our op, or the forced fallback): the
    model's own eager path works on each, and ours must equal it."""
    wrong, crashed, runs = [], [], 0
    layouts = [("right", [9, 4, 1, 6], 9), ("left", [9, 4, 1, 6], 9), ("packed", [5, 1, 9, 3], None)]
    for forced in (False, True):
        if forced:
            _force_fallback(monkeypatch)
        for kind in FAMILIES:
            for window in (2, 5, 100):
                model = _family(kind, window)
                for name, lengths, s in layouts:
                    if name == "packed" and kind == "modernbert":
                        continue
                    runs += 1
                    try:
                        if name == "packed":
                            ref, out, _ = _packed(model, lengths)
                        else:
                            ref, out, _ = _padded(model, lengths, s, name == "left")
                    except Exception as err:  # noqa: BLE001 - counted
                        crashed.append((kind, window, name, forced, repr(err)[:200]))
                        continue
                    if not torch.allclose(out, ref, rtol=TOL, atol=TOL):
                        wrong.append((kind, window, name, forced, float((out - ref).abs().max())))
    assert runs == 2 * (6 * 3 * 3 + 3 * 2)
    assert not crashed, crashed
    assert not wrong, wrong


# -- classes off the attention interface ----------------------------------------------------


def _off_interface(kind):
    t = transformers
    if kind == "falcon":
        cfg = t.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
        return t.FalconModel, cfg
    if kind == "mpnet":
        cfg = t.MPNetConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64)
        return t.MPNetModel, cfg
    cfg = t.DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64)
    return t.DebertaV2Model, cfg


@pytest.mark.parametrize("kind", ["falcon", "mpnet", "deberta_v2"])
@pytest.mark.parametrize("how", ["from_config", "from_pretrained", "set_attn_implementation"])
def test_classes_off_the_interface_keep_their_own_attention_and_say_so(kind, how, tmp_path, caplog):
    cls, cfg = _off_interface(kind)
    torch.manual_seed(0)
    base = cls(cfg).eval()
    ids = torch.randint(2, 62, (2, 7))
    mask = pad_mask([7, 4], 7)
    ref = base(input_ids=ids, attention_mask=mask).last_hidden_state
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        if how == "from_config":
            torch.manual_seed(0)
            model = cls._from_config(cfg, attn_implementation=NAME).eval()
        elif how == "from_pretrained":
            base.save_pretrained(tmp_path)
            model = cls.from_pretrained(tmp_path, attn_implementation=NAME).eval()
        else:
            model = base
            model.set_attn_implementation(NAME)
    ours = [r.getMessage() for r in caplog.records if r.name == "ragged_compile"]
    assert any(cls.__name__ in m and "keeps its own attention" in m for m in ours), ours
    assert model.config._attn_implementation in ("sdpa", "eager")
    with Count() as c:
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert c.n == 0
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=TOL, atol=TOL)


def test_classes_on_the_interface_say_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        model = _family("mistral", 4)
        model.set_attn_implementation(NAME)
        transformers.MistralForCausalLM._from_config(model.config, attn_implementation=NAME)
    assert "ragged_compile" not in caplog.text


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "modernbert"])
def test_graph_mode_keeps_softcap_and_sinks(kind):
    """hf.graphed (on CPU: its bookkeeping without a capture): softcap and sinks reach
    the op; windows shorter than a bucket run the model's eager attention."""
    model = _family(kind, 4)
    ids = torch.randint(2, 62, (3, 12))
    mask = pad_mask([12, 5, 9], 12)
    kw = dict(input_ids=ids * mask, attention_mask=mask)
    if kind != "modernbert":
        kw["use_cache"] = False
    with torch.no_grad():
        ref = _out(model, **kw)
    g = hf.graphed(model, [(4, 16)])
    with torch.no_grad():
        out = _out(g, **kw)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=TOL, atol=TOL)


# Every layer of each family on our op on CUDA: windows on FlashAttention-2, softcap
# on FlashInfer's forward, sinks rescaling a fused forward (gpt-oss).
CUDA_ON_OP = {"mistral": 2, "phi3": 2, "qwen2": 2, "gemma2": 2, "gemma3": 2, "modernbert": 2, "gpt_oss": 2}


@pytest.mark.cuda
@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("left", [False, True])
def test_cuda_padded_batches_match_eager_in_bf16(kind, left, monkeypatch):
    """The families on CUDA (bf16, head dim 64 so every fast kernel takes it) against
    their own eager attention in float32 on the same weights, padded and
    left-padded, with windows shorter than the rows."""
    # every layer on the op: the small-batch SDPA route would take ModernBERT's global
    # layers at this size (tests/test_host_reads.py covers the route)
    monkeypatch.setattr(select, "_DENSE_MAX_FLOPS", 0)
    model = _family(kind, 5)
    cfg = model.config
    if getattr(cfg, "head_dim", None) is not None:
        cfg.head_dim = 64
    model = type(model)(cfg).eval()  # rebuilt with head dim 64
    ref_model = model.cuda()
    g = torch.Generator().manual_seed(3)
    lengths, s = [40, 9, 1, 33], 40
    ids = torch.randint(2, 62, (len(lengths), s), generator=g)
    mask = pad_mask(lengths, s, left)
    kw = dict(input_ids=(ids * mask).cuda(), attention_mask=mask.cuda())
    if not isinstance(model, transformers.ModernBertModel):
        kw["use_cache"] = False
    with torch.no_grad():
        ref_model.set_attn_implementation("eager")
        ref = _out(ref_model, **kw).float()
        model = ref_model.to(torch.bfloat16)
        model.set_attn_implementation(NAME)
        with Count() as c:
            out = _out(model, **kw).float()
    valid = mask.bool().cuda()
    scale = ref[valid].abs().max()
    assert (out[valid] - ref[valid]).abs().max() <= 3e-2 * scale
    assert c.n == CUDA_ON_OP[kind]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_cuda_graph_mode_runs_softcap_and_sinks_on_the_models_attention(kind):
    """Graph plans take no variant: under hf.graphed on CUDA, soft-capped and sink
    layers run the model's own attention inside the graph, equal to eager."""
    model = _family(kind, 64).cuda()
    if kind == "gpt_oss":
        # its default experts (torch._grouped_mm) copy host offsets and its eager ones call
        # nonzero: neither can be captured; batched_mm can
        model.set_experts_implementation("batched_mm")
    ids = torch.randint(2, 62, (3, 12))
    mask = pad_mask([12, 5, 9], 12)
    kw = dict(input_ids=(ids * mask).cuda(), attention_mask=mask.cuda(), use_cache=False)
    with torch.no_grad():
        ref = _out(model, **kw)
    g = hf.graphed(model, [(4, 16)])
    with torch.no_grad():
        out = _out(g, **kw)
    valid = mask.bool().cuda()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_cuda_gemma2_trains_on_the_op():
    """Gemma2's soft-capped (and windowed) layers train on the op on CUDA (FlashInfer's
    capped forward, the Triton backward), every layer, with the gradients of its own
    eager attention in float32."""
    if select.unsupported_reason(torch.device("cuda"), torch.bfloat16, 64, training=True,
                                 variant=("softcap",)) is not None:
        pytest.skip("soft-capped training has no fused kernel here")
    model = _family("gemma2", 5)
    cfg = model.config
    cfg.head_dim = 64
    ref = type(model)(cfg).cuda().train()  # rebuilt with head dim 64
    ours = type(model)(cfg).cuda().to(torch.bfloat16).train()
    ours.load_state_dict(ref.state_dict())
    ours.set_attn_implementation(NAME)
    ids = torch.randint(2, 62, (4, 40), generator=torch.Generator().manual_seed(3))
    mask = pad_mask([40, 9, 1, 33], 40)
    kw = dict(input_ids=(ids * mask).cuda(), attention_mask=mask.cuda(), use_cache=False)
    valid = mask.bool().cuda()
    for m in (ref, ours):
        with Count(ops=(torch.ops.ragged_compile.ragged_attention_lse.default,)) as c:
            out = _out(m, **kw).float()
            (out[valid].square().mean()).backward()
        assert c.n == (cfg.num_hidden_layers if m is ours else 0)
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        if "self_attn" in name and a.grad is not None:
            scale = a.grad.abs().max().item()
            assert (b.grad.float() - a.grad).abs().max().item() <= 5e-2 * max(scale, 1e-6), name
