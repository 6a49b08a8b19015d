"""ragged_compile.hf.unpad: padded calls as one packed row. Every family against the
same weights run padded on "sdpa" (fp32, every output at valid positions, zeros at
padded ones), the packed path seen at our op (T tokens, not B * S), and every
fallback reason with its WARNING and the padded call's values."""

import copy
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from _hf_common import Count, pad_mask  # noqa: E402
from ragged_compile import hf, hf_unpad, logs  # noqa: E402
from test_host_reads import HostReads  # noqa: E402  (scalar reads outside our op)

NAME = hf.register()
OURS = (
    torch.ops.ragged_compile.ragged_attention.default,
    torch.ops.ragged_compile.ragged_attention_lse.default,
    torch.ops.ragged_compile.ragged_attention_dropout.default,
)
TOL = 1e-5


class Tokens(TorchDispatchMode):
    """Query rows of each call of our op (packed: T; padded: B * S)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in OURS:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_warnings():
    logs._seen.clear()


# -- models -----------------------------------------------------------------------------

V = 64
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
ENC = dict(vocab_size=V, max_position_embeddings=64, **SMALL)


def _config(family, **extra):
    from transformers import (BertConfig, DistilBertConfig, ElectraConfig, LlamaConfig, MistralConfig,
                              ModernBertConfig, Qwen2Config, Qwen3Config, RobertaConfig, XLMRobertaConfig)

    zero = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    dec = dict(vocab_size=V, max_position_embeddings=128, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
               eos_token_id=V - 1, **SMALL)
    kw = {
        "bert": lambda: BertConfig(**ENC, **zero),
        "roberta": lambda: RobertaConfig(**ENC, **zero, pad_token_id=1),
        "xlm-roberta": lambda: XLMRobertaConfig(**ENC, **zero, pad_token_id=1),
        "electra": lambda: ElectraConfig(**ENC, **zero, embedding_size=16),
        "distilbert": lambda: DistilBertConfig(vocab_size=V, max_position_embeddings=64, dim=32, n_layers=2,
                                               n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0),
        "modernbert": lambda: ModernBertConfig(**ENC, pad_token_id=0, local_attention=16, global_attn_every_n_layers=2),
        "llama": lambda: LlamaConfig(**dec),
        "qwen2": lambda: Qwen2Config(**dec),
        "qwen3": lambda: Qwen3Config(**dec, head_dim=8),
        "mistral": lambda: MistralConfig(**dec, sliding_window=6),
    }[family]()
    for k, v in extra.items():
        setattr(kw, k, v)
    return kw


PREFIX = {f: fam.prefix for f, fam in hf_unpad.FAMILIES.items()}


def build(family, suffix="Model", seed=0, **extra):
    cfg = _config(family, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return getattr(transformers, PREFIX[family] + suffix)(cfg).eval()


def inputs(family, lengths, s, left=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = pad_mask(lengths, s, left)
    pad = {"roberta": 1, "xlm-roberta": 1}.get(family, 0)
    ids = torch.randint(2, V - 1, (len(lengths), s), generator=g)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))  # as a tokenizer pads
    kw = dict(input_ids=ids, attention_mask=mask)
    if family in ("bert", "electra"):
        kw["token_type_ids"] = (torch.rand(ids.shape, generator=g) > 0.5).long() * mask
    return kw


def run_both(model, fn, unpadded=True):
    """(padded "sdpa" result, unpadded result, our op's query rows per call)."""
    ref = fn(model)
    hf_unpad.unpad(model)
    with Tokens() as t:
        out = fn(model)
    hf_unpad.unpad(model, enabled=False)
    return ref, out, t.rows


DIFFS = {}


def compare(ref, out, valid, key=None):
    """Every tensor field: equal at valid positions, zeros at padded ones ([B, S, ...]);
    equal everywhere otherwise. Returns the max difference."""
    b, s = valid.shape
    worst = 0.0
    for k in ref.keys():
        if k in ("cache", "past_key_values"):
            continue  # the packed call returns none (see test_decoder_base_model_default_cache_flag)
        r, o = ref[k], out[k]
        for i, (a, c) in enumerate(zip(r, o) if isinstance(r, tuple) else [(r, o)]):
            if not isinstance(a, torch.Tensor):
                continue
            if a.dim() >= 2 and a.shape[:2] == (b, s):
                torch.testing.assert_close(c[valid], a[valid], atol=TOL, rtol=TOL, msg=lambda m: f"{k}[{i}]: {m}")
                assert not c[~valid].any(), f"{k}[{i}] not zero at padded positions"
                worst = max(worst, (c[valid] - a[valid]).abs().max().item())
            else:
                torch.testing.assert_close(c, a, atol=TOL, rtol=TOL, msg=lambda m: f"{k}[{i}]: {m}")
                worst = max(worst, (c - a).abs().max().item())
    if key is not None:
        DIFFS[key] = max(DIFFS.get(key, 0.0), worst)
    return worst


def packed(rows, valid, layers=2):
    return rows == [int(valid.sum())] * layers


# -- families -------------------------------------------------------------------------------

ENCODERS = ["bert", "roberta", "xlm-roberta", "electra", "distilbert"]
DECODERS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("left", [False, True])
def test_encoder_base_model(family, left):
    # A pooler reads position 0, a padded position under left padding: without it both paddings pack.
    extra = {"add_pooling_layer": False} if left and family in ("bert", "roberta", "xlm-roberta") else {}
    cfg = _config(family)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, PREFIX[family] + "Model")(cfg, **extra).eval()
    kw = inputs(family, [7, 3, 12, 1], 12, left)
    fn = lambda m: m(**kw, output_hidden_states=True)  # noqa: E731
    ref, out, rows = run_both(model, fn)
    valid = kw["attention_mask"].bool()
    assert packed(rows, valid)
    compare(ref, out, valid, (family, "Model", "left" if left else "right"))
    if not left and "pooler_output" in ref:
        assert out.pooler_output is not None


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("left", [False, True])
def test_decoder_scoring_and_last_token(family, left):
    model = build(family, "ForCausalLM")
    kw = inputs(family, [9, 4, 1, 6], 9, left)
    fn = lambda m: m(**kw, use_cache=False, output_hidden_states=True)  # noqa: E731
    ref, out, rows = run_both(model, fn)
    valid = kw["attention_mask"].bool()
    assert packed(rows, valid)
    compare(ref, out, valid, (family, "ForCausalLM", "left" if left else "right"))
    # last-token pooling (an embedding model's): the last valid token of every row
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)
    r, o = ref.hidden_states[-1], out.hidden_states[-1]
    i = torch.arange(len(last))
    torch.testing.assert_close(o[i, last], r[i, last], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_base_model_default_cache_flag(family):
    """use_cache left to the config (True): packed, and no cache is returned."""
    model = build(family, "Model")
    kw = inputs(family, [5, 8, 2], 8, left=True)
    ref, out, rows = run_both(model, lambda m: m(**kw))
    assert packed(rows, kw["attention_mask"].bool())
    assert ref.cache is not None and out.cache is None
    compare(ref, out, kw["attention_mask"].bool(), (family, "Model", "left"))


# -- heads ------------------------------------------------------------------------------------

HEADS = [(f, suffix) for f, fam in hf_unpad.FAMILIES.items() if f not in ("mistral", "modernbert") for suffix in fam.heads]


def _labels(family, suffix, kw, g):
    b, s = kw["attention_mask"].shape
    valid = kw["attention_mask"].bool()
    head = hf_unpad.FAMILIES[family].heads[suffix]
    out = {}
    if suffix == "ForPreTraining" and family == "electra":
        out["labels"] = (torch.rand(b, s, generator=g) > 0.5).long()  # the loss masks with attention_mask
    elif head.labels == "shifted":
        out["labels"] = kw["input_ids"].masked_fill(~valid, -100)
    elif head.labels == "tokens":
        out["labels"] = torch.randint(0, 2, (b, s), generator=g).masked_fill(~valid, -100)
    else:
        out["labels"] = torch.randint(0, 2, (b,), generator=g)
    if suffix == "ForPreTraining" and family == "bert":
        out["next_sentence_label"] = torch.randint(0, 2, (b,), generator=g)
    return out


@pytest.mark.parametrize("family,suffix", HEADS)
@pytest.mark.parametrize("left", [False, True])
def test_heads_with_labels(family, suffix, left):
    head = hf_unpad.FAMILIES[family].heads[suffix]
    model = build(family, suffix)
    kw = inputs(family, [6, 2, 8], 8, left)
    kw.update(_labels(family, suffix, kw, torch.Generator().manual_seed(3)))
    valid = kw["attention_mask"].bool()
    fn = lambda m: m(**kw, output_hidden_states=True)  # noqa: E731
    ref, out, rows = run_both(model, fn)
    # Left padding: [CLS] heads read position 0, and a causal loss scores the last padded
    # position's logits against the first token: both run padded.
    expect_packed = not left or (head.reads != "first" and head.labels != "shifted")
    assert packed(rows, valid) == expect_packed, rows
    if expect_packed:
        compare(ref, out, valid, (family, suffix, "left" if left else "right"))
        assert ref.loss is not None
    else:
        compare(ref, out, torch.ones_like(valid))  # the padded call itself, padded positions included


# -- fallbacks: the padded call itself, logged once ----------------------------------------------


def fallback(model, fn, reason, caplog, impl=NAME):
    """unpad(model) runs fn as the padded call (same values as without unpad, on `impl`),
    and says `reason` once at WARNING."""
    model.set_attn_implementation(impl)
    torch.manual_seed(0)
    ref = fn(model)
    hf_unpad.unpad(model)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"), Tokens() as t:
        torch.manual_seed(0)
        out = fn(model)
        fn(model)
    hf_unpad.unpad(model, enabled=False)
    ours = [r for r in caplog.records if r.name == "ragged_compile" and "unpad" in r.getMessage()]
    assert len(ours) == 1 and reason in ours[0].getMessage() and ours[0].levelno == logging.WARNING, \
        [r.getMessage() for r in ours]
    assert reason in hf_unpad.FALLBACKS
    for k in ref.keys():
        if isinstance(ref[k], torch.Tensor):
            torch.testing.assert_close(out[k], ref[k], atol=0, rtol=0)
    return t.rows[: len(t.rows) // 2]  # the first call's


def test_unknown_class_left_untouched(caplog):
    from transformers import BertForQuestionAnswering

    model = BertForQuestionAnswering(_config("bert")).eval()
    kw = inputs("bert", [5, 3], 6)
    ref = model(**kw)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        assert hf_unpad.unpad(model) is model
    assert "unknown model class" in caplog.text and "BertForQuestionAnswering" in caplog.text
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.__dict__
    out = model(**kw)
    torch.testing.assert_close(out.start_logits, ref.start_logits, atol=0, rtol=0)
    assert hf_unpad.unpad(model, enabled=False) is model


def test_fallback_attention_not_ours(caplog):
    model = build("bert", "Model")
    kw = inputs("bert", [5, 3], 6)
    ref = model(**kw)
    hf_unpad.unpad(model)
    model.set_attn_implementation("sdpa")  # after unpad: cu_seq_lens would mean nothing to sdpa
    with caplog.at_level(logging.WARNING, logger="ragged_compile"), Tokens() as t:
        out = model(**kw)
    assert t.rows == [] and "attention implementation is not ours" in caplog.text
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=0, rtol=0)


def test_fallback_use_cache(caplog):
    model = build("llama", "ForCausalLM")
    kw = inputs("llama", [5, 3], 6, left=True)
    rows = fallback(model, lambda m: m(**kw, use_cache=True), "use_cache / past_key_values", caplog)
    assert rows == [12, 12]


def test_generate_runs_padded(caplog):
    model = build("qwen2", "ForCausalLM")
    kw = inputs("qwen2", [6, 3, 5], 6, left=True)
    model.set_attn_implementation(NAME)
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = model.generate(**kw, **gen)
    hf_unpad.unpad(model)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        out = model.generate(**kw, **gen)
    assert torch.equal(ref, out) and "use_cache / past_key_values" in caplog.text


def test_fallback_output_attentions(caplog):
    model = build("bert", "Model")
    kw = inputs("bert", [5, 3], 6)
    fallback(model, lambda m: m(**kw, output_attentions=True), "output_attentions", caplog)


def test_fallback_dropout_in_training(caplog):
    """BERT's default attention dropout (0.1) in training: our attention runs stock SDPA
    per layer for it (hf.py's "dropout in training"), so unpad keeps the padded call."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(**ENC)
    assert cfg.attention_probs_dropout_prob == 0.1
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).train()
    kw = inputs("bert", [5, 3, 6], 6)
    kw["labels"] = kw["input_ids"].masked_fill(~kw["attention_mask"].bool(), -100)
    rows = fallback(model, lambda m: m(**kw), "attention dropout in training", caplog)
    assert rows == []  # stock SDPA in every layer (dropout), as without unpad
    # eval: the same model packs
    model.eval()
    with Tokens() as t:
        hf_unpad.unpad(model)(**kw)
    assert t.rows == [14, 14]


def test_fallback_decoder_config(caplog):
    model = build("bert", "Model", is_decoder=True)
    kw = inputs("bert", [5, 3], 6)
    fallback(model, lambda m: m(**kw, use_cache=False), "decoder / cross-attention config", caplog)


def test_fallback_4d_mask(caplog):
    model = build("bert", "Model")
    kw = inputs("bert", [5, 3], 6)
    kw["attention_mask"] = kw["attention_mask"].bool()[:, None, None, :].expand(2, 1, 6, 6)
    fallback(model, lambda m: m(**kw), "attention_mask is not a 2-D padding mask", caplog)


def test_fallback_mask_with_holes(caplog):
    model = build("bert", "Model")
    kw = inputs("bert", [6, 3], 6)
    kw["attention_mask"][0, 2] = 0
    rows = fallback(model, lambda m: m(**kw), "valid tokens are not one run per row", caplog)
    assert rows == []  # hf.py's own check: stock SDPA for a mask that is not padding


def test_fallback_pooler_on_left_padding(caplog):
    model = build("bert", "Model")
    kw = inputs("bert", [5, 3], 6, left=True)
    fallback(model, lambda m: m(**kw), "head reads a padded position", caplog)


def test_fallback_decoder_classifier_reads_padding(caplog):
    model = build("llama", "ForSequenceClassification")
    kw = inputs("llama", [5, 3], 6)
    kw["input_ids"] = kw["input_ids"].masked_fill(~kw["attention_mask"].bool(), 7)  # pads that are not pad_token_id
    fallback(model, lambda m: m(**kw), "head reads a padded position", caplog)


@pytest.mark.parametrize("family,suffix", [("bert", "ForMaskedLM"), ("llama", "ForCausalLM")])
def test_fallback_labels_at_padded_positions(family, suffix, caplog):
    model = build(family, suffix)
    kw = inputs(family, [5, 3], 6)
    kw["labels"] = kw["input_ids"].clone()  # not -100 at the padding
    fallback(model, lambda m: m(**kw), "labels at padded positions", caplog)


def test_mistral_window_shorter_than_a_sequence_packs():
    """Windows run on the op's kernels (the fused CPU kernel; FlashAttention-2 on
    CUDA), so a window shorter than a sequence packs too, each document windowed."""
    model = build("mistral", "ForCausalLM")  # window 6
    kw = inputs("mistral", [8, 3, 7], 8)
    ref, out, rows = run_both(model, lambda m: m(**kw, use_cache=False))
    valid = kw["attention_mask"].bool()
    assert packed(rows, valid)
    compare(ref, out, valid, ("mistral", "ForCausalLM", "short window"))


def test_fallback_sliding_window_where_no_kernel_takes_it(caplog, monkeypatch):
    from ragged_compile.backends import select

    real = select.unsupported_reason

    def no_window(device, dtype, head_dim, **kw):
        return "no window kernel" if select.WINDOW in kw.get("variant", ()) else real(device, dtype, head_dim, **kw)

    monkeypatch.setattr(select, "unsupported_reason", no_window)
    model = build("mistral", "ForCausalLM")  # window 6
    kw = inputs("mistral", [8, 3], 8)
    fallback(model, lambda m: m(**kw, use_cache=False), "sliding window shorter than a sequence", caplog)


def test_mistral_window_spanning_every_sequence_packs():
    model = build("mistral", "ForCausalLM")
    kw = inputs("mistral", [6, 3, 5], 8)
    ref, out, rows = run_both(model, lambda m: m(**kw, use_cache=False))
    valid = kw["attention_mask"].bool()
    assert packed(rows, valid)
    compare(ref, out, valid, ("mistral", "ForCausalLM", "right"))


def test_packed_call_runs_as_given(caplog):
    """Already packed (cu_seq_lens_q/k, as DataCollatorWithFlattening gives): nothing to unpad."""
    model = build("llama", "Model")
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    kw = dict(input_ids=torch.randint(2, 60, (1, 8)), attention_mask=torch.ones(1, 8, dtype=torch.long),
              position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=5, max_length_k=5, use_cache=False)
    model.set_attn_implementation(NAME)
    ref = model(**kw)
    with caplog.at_level(logging.WARNING, logger="ragged_compile"), Tokens() as t:
        out = hf_unpad.unpad(model)(**kw)
    assert t.rows == [8, 8] and "unpad" not in caplog.text
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=0, rtol=0)


def test_fallback_unknown_per_token_input(caplog):
    model = build("bert", "Model")
    kw = inputs("bert", [5, 3], 6)
    fallback(model, lambda m: m(**kw, per_token_extra=torch.zeros(2, 6)), "per-token input unpad does not know", caplog)


# -- API, autograd, compile -------------------------------------------------------------------


def test_idempotent_undo_and_attn_implementation():
    model = build("bert", "ForMaskedLM")
    base_forward = type(model.bert).forward
    assert model.config._attn_implementation == "sdpa"
    assert hf.unpad is hf_unpad.unpad and "unpad" in hf.__all__
    assert hf_unpad.unpad(model) is model and hf_unpad.unpad(model) is model
    assert hf_unpad.is_unpadded(model) and model.config._attn_implementation == NAME
    patched = model.forward
    hf_unpad.unpad(model)
    assert model.forward is patched  # not wrapped twice
    hf_unpad.unpad(model, enabled=False)
    assert not hf_unpad.is_unpadded(model) and model.config._attn_implementation == "sdpa"
    assert "forward" not in model.__dict__ and "forward" not in model.bert.__dict__
    assert model.bert.forward.__func__ is base_forward
    hf_unpad.unpad(model, enabled=False)  # undoing twice: nothing
    # A model already on our attention keeps it when undone.
    model.set_attn_implementation(NAME)
    hf_unpad.unpad(hf_unpad.unpad(model), enabled=False)
    assert model.config._attn_implementation == NAME
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf_unpad.unpad(torch.nn.Linear(2, 2))


def test_no_padding_skips_packing(caplog, monkeypatch):
    """Rows with nothing to remove run as the plain [B, S] call, silently. An encoder
    runs it without its all-ones mask, so its attention reads no mask a second time
    (on CUDA it then runs dense SDPA, as stock); a decoder keeps its mask (without
    it, the layout would come from a read of position_ids)."""
    reads = []
    real = hf._read_padded_layout
    monkeypatch.setattr(hf, "_read_padded_layout", lambda *a: reads.append(1) or real(*a))
    model = build("bert", "Model")
    kw = inputs("bert", [6, 6], 6)
    ref, out, rows = run_both(model, lambda m: m(**kw))
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        hf_unpad.unpad(model)(**kw)
    assert rows == [12, 12] and "unpad" not in caplog.text  # the plain [B, S] call, said nothing
    assert reads == []  # the attention got no mask
    compare(ref, out, kw["attention_mask"].bool())
    hf_unpad.unpad(model, enabled=False)
    model.set_attn_implementation(NAME)
    model(**kw)
    assert reads == [1]  # with our name alone it reads the mask (once per forward)
    out = model(input_ids=kw["input_ids"])  # no mask at all
    assert out.last_hidden_state.shape == (2, 6, 32)

    decoder = build("llama", "Model")
    kw = inputs("llama", [6, 6], 6)
    reads.clear()
    ref, out, rows = run_both(decoder, lambda m: m(**kw, use_cache=False))
    assert rows == [12, 12] and reads == [1]
    compare(ref, out, kw["attention_mask"].bool())


def test_signature_positional_tuple_and_inputs():
    import inspect

    model = build("bert", "ForTokenClassification")
    kw = inputs("bert", [5, 2, 6], 6)
    ref = model(**kw)
    hf_unpad.unpad(model)
    assert list(inspect.signature(model.forward).parameters)[:2] == ["input_ids", "attention_mask"]
    valid = kw["attention_mask"].bool()
    out = model(kw["input_ids"], kw["attention_mask"], kw["token_type_ids"], return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0][valid], ref.logits[valid], atol=TOL, rtol=TOL)
    # position_ids and token_type_ids broadcast over the batch ([1, S])
    pos = torch.arange(6)[None]
    tt = torch.zeros(1, 6, dtype=torch.long)
    model.set_attn_implementation("sdpa")
    hf_unpad.unpad(model, enabled=False)
    ref = model(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"], position_ids=pos + 3, token_type_ids=tt)
    hf_unpad.unpad(model)
    with Tokens() as t:
        out = model(input_ids=kw["input_ids"], attention_mask=kw["attention_mask"], position_ids=pos + 3,
                    token_type_ids=tt)
    assert packed(t.rows, valid)
    torch.testing.assert_close(out.logits[valid], ref.logits[valid], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("family", ["roberta", "llama"])
def test_inputs_embeds_and_their_gradient(family):
    model = build(family, "Model" if family == "llama" else "ForMaskedLM")
    kw = inputs(family, [5, 2, 6], 6, left=family == "llama")
    valid = kw["attention_mask"].bool()
    emb = model.get_input_embeddings()(kw.pop("input_ids")).detach()

    def run(m):
        x = emb.clone().requires_grad_()
        out = m(inputs_embeds=x, **kw)
        y = out[0]
        (y * valid[..., None]).square().sum().backward()
        return y.detach(), x.grad

    (ref, gref), (out, gout), rows = run_both(model, run)
    assert packed(rows, valid)
    torch.testing.assert_close(out[valid], ref[valid], atol=TOL, rtol=TOL)
    torch.testing.assert_close(gout, gref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("family,suffix", [("bert", "ForMaskedLM"), ("xlm-roberta", "ForSequenceClassification"),
                                           ("distilbert", "ForTokenClassification"), ("qwen3", "ForCausalLM")])
def test_training_gradients(family, suffix):
    """train() with the dropouts at 0: loss and every parameter's gradient as padded."""
    model = build(family, suffix).train()
    kw = inputs(family, [7, 3, 8, 1], 8)
    kw.update(_labels(family, suffix, kw, torch.Generator().manual_seed(5)))

    def run(m):
        m.zero_grad()
        out = m(**kw)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    (lref, gref), (lout, gout), rows = run_both(model, run)
    assert packed(rows, kw["attention_mask"].bool())
    torch.testing.assert_close(lout, lref, atol=TOL, rtol=TOL)
    assert gout.keys() == gref.keys()
    worst = max((gout[n] - gref[n]).abs().max().item() for n in gref)
    DIFFS[(family, suffix, "grad")] = worst
    for n in gref:
        torch.testing.assert_close(gout[n], gref[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_inference_mode_and_no_grad():
    model = build("bert", "Model")
    kw = inputs("bert", [7, 3, 8], 8)
    ref = model(**kw)
    hf_unpad.unpad(model)
    valid = kw["attention_mask"].bool()
    for ctx in (torch.inference_mode, torch.no_grad):
        with ctx(), Tokens() as t:
            out = model(**kw)
        assert packed(t.rows, valid)
        compare(ref, out, valid)


def _graphs():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sum(n.op == "call_function" and (n.target in OURS or any(n.target is op.overloadpacket for op in OURS))
                          for n in gm.graph.nodes))
        return gm.forward

    return graphs, backend


LAYOUTS = [([6, 2, 8], 8, False), ([5, 5, 1], 9, True), ([2, 7, 4], 7, False), ([9, 1, 4], 9, True)]


@pytest.mark.parametrize("family,suffix,compiler", [("bert", "Model", "torch"), ("llama", "ForCausalLM", "ragged")])
def test_compiled_across_layouts_and_a_fallback(family, suffix, compiler, caplog):
    """One graph break (the mask's read); new totals, lengths and widths compile no new
    graph after the second call; a fallback (BertModel's pooler under left padding) runs
    the padded call, logged."""
    import ragged_compile

    model = build(family, suffix)
    ref_model = build(family, suffix)
    hf_unpad.unpad(model)
    graphs, backend = _graphs()
    torch._dynamo.reset()
    compiled = (torch.compile if compiler == "torch" else ragged_compile.compile)(model, backend=backend)
    extra = dict(use_cache=False) if family in DECODERS else {}
    layouts = [(lengths, s, left and family != "bert") for lengths, s, left in LAYOUTS]
    counts = []
    for i, (lengths, s, left) in enumerate(layouts):
        kw = inputs(family, lengths, s, left, seed=i)
        out = compiled(**kw, **extra)  # (no dispatch mode here: Dynamo would not compile under one)
        compare(ref_model(**kw, **extra), out, kw["attention_mask"].bool())
        counts.append(len(graphs))
    # our op, in both layers, inside one graph: the first call's, and the dynamic one it
    # recompiles to on the second (new widths), which serves every layout after
    assert graphs.count(2) == 2 and counts[-1] == counts[1], (graphs, counts)
    if family == "bert":
        kw = inputs(family, [6, 2, 8], 8, left=True, seed=9)
        with caplog.at_level(logging.WARNING, logger="ragged_compile"):
            out = compiled(**kw)
        compare(ref_model(**kw), out, torch.ones_like(kw["attention_mask"].bool()))  # the padded call itself
        assert "head reads a padded position (position 0): BertModel runs the padded call" in caplog.text
        assert graphs.count(2) == 3  # the padded graph, on our op too


# -- buckets: the packed row padded to a few lengths --------------------------------------------


def test_bucket_lengths():
    """Every total goes to a length at least as long, at most 1/8 above it (16 tokens at
    least), eight lengths an octave; the fillers make up exactly the difference in
    segments of at most the given length, as many for every total of one bucket (so
    the offsets' shape is the bucket's)."""
    seen, slots = {}, {}
    for most in (hf_unpad.FILLER_SEGMENT, 40):
        for total in range(1, 20000):
            b = hf_unpad.bucket(total)
            assert total <= b <= max(total + 15, total * 9 // 8), total
            assert hf_unpad.bucket(b) == b, total
            fill = hf_unpad._fillers(total, most)
            assert fill.sum() == b - total and (fill >= 0).all() and (fill <= most).all(), total
            assert slots.setdefault((most, b), len(fill)) == len(fill), total
            seen.setdefault(total.bit_length(), set()).add(b)
    assert max(len(v) for v in seen.values()) <= 9  # eight an octave, plus the next octave's first


BUCKETED = [("bert", "Model", False), ("roberta", "ForMaskedLM", True), ("distilbert", "Model", False),
            ("llama", "ForCausalLM", True), ("qwen3", "Model", True), ("modernbert", "Model", False)]


@pytest.mark.parametrize("family,suffix,left", BUCKETED)
def test_buckets_pad_the_packed_row_and_change_no_output(family, suffix, left):
    """buckets=True: each layer's op sees the bucket's rows (total + fillers), every
    output at a valid position is the padded "sdpa" run's, zeros at padded ones."""
    model = build(family, suffix)
    # fillers of 5, 11 and 15 tokens; a total on its bucket (an empty filler slot)
    layouts = [([7, 3, 8, 1], 8), ([13, 2, 6], 13), ([5, 16, 16, 9, 3], 16), ([9, 16, 7], 16)]
    for i, (lengths, s) in enumerate(layouts):
        kw = inputs(family, lengths, s, left and family != "distilbert", seed=i)
        extra = dict(use_cache=False) if family in DECODERS else {}
        ref = model(**kw, **extra)
        hf_unpad.unpad(model, buckets=True)
        with Tokens() as t:
            out = model(**kw, **extra)
        hf_unpad.unpad(model, enabled=False)
        assert t.rows == [hf_unpad.bucket(sum(lengths))] * 2, (lengths, t.rows)
        compare(ref, out, kw["attention_mask"].bool(), key=(family, suffix, "buckets"))


def test_buckets_fillers_need_no_window(monkeypatch):
    """Fillers are no longer than the model's sliding window: where no kernel takes the
    window, a batch whose sequences the window spans still packs on the op (a 13-token
    filler split to the window's 6), equal to the padded run."""
    from ragged_compile.backends import select

    real = select.unsupported_reason

    def no_window(device, dtype, head_dim, **kw):
        return "no window kernel" if select.WINDOW in kw.get("variant", ()) else real(device, dtype, head_dim, **kw)

    monkeypatch.setattr(select, "unsupported_reason", no_window)
    monkeypatch.setattr(hf, "unsupported_reason", no_window)
    model = build("mistral", "ForCausalLM")  # window 6
    kw = inputs("mistral", [6, 6, 6, 6, 6, 5], 6)  # 35 tokens: bucket 48
    assert list(hf_unpad._fillers(35, 6)) == [6, 6, 1]
    ref = model(**kw, use_cache=False)
    hf_unpad.unpad(model, buckets=True)
    with Tokens() as t:
        out = model(**kw, use_cache=False)
    assert t.rows == [48] * 2
    compare(ref, out, kw["attention_mask"].bool())


def test_buckets_training_gradients_and_inputs_embeds():
    """Fillers take no part in the loss or any gradient: a training step's loss and
    every parameter's and input embedding's gradient as padded."""
    model = build("bert", "ForMaskedLM").train()
    kw = inputs("bert", [7, 3, 8, 1], 8)
    kw.update(_labels("bert", "ForMaskedLM", kw, torch.Generator().manual_seed(5)))
    emb = model.get_input_embeddings()(kw.pop("input_ids")).detach()

    def run(m):
        m.zero_grad()
        x = emb.clone().requires_grad_()
        out = m(inputs_embeds=x, **kw)
        out.loss.backward()
        return out.loss.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    lref, xref, gref = run(model)
    hf_unpad.unpad(model, buckets=True)
    with Tokens() as t:
        lout, xout, gout = run(model)
    assert t.rows == [hf_unpad.bucket(19)] * 2
    torch.testing.assert_close(lout, lref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(xout, xref, atol=TOL, rtol=TOL)
    assert gout.keys() == gref.keys()
    for n in gref:
        torch.testing.assert_close(gout[n], gref[n], atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_buckets_switch_and_undo():
    """unpad(model, buckets=...) again changes it; enabled=False undoes it all."""
    model = build("bert")
    kw = inputs("bert", [7, 3, 8], 8)
    for buckets, rows in ((True, hf_unpad.bucket(18)), (False, 18), (True, hf_unpad.bucket(18))):
        hf_unpad.unpad(model, buckets=buckets)
        with Tokens() as t:
            model(**kw)
        assert t.rows == [rows] * 2
    hf_unpad.unpad(model, enabled=False)
    with Tokens() as t:
        model(**kw)
    assert t.rows == [] and not hf_unpad.is_unpadded(model)  # "sdpa" again, as built


def test_compiled_buckets_one_packed_shape_across_layouts():
    """Under torch.compile, layouts of one bucket (other totals, lengths, widths and
    batch sizes) give the compiled packed model one input shape; nothing compiles
    after the recompiles that make the longest length and the batch size dynamic."""
    model = build("bert", "Model")
    ref_model = build("bert", "Model")
    hf_unpad.unpad(model, buckets=True)
    shapes = []

    def backend(gm, example_inputs):
        if any(n.op == "call_function" and (n.target in OURS or any(n.target is op.overloadpacket for op in OURS))
               for n in gm.graph.nodes):
            shapes.append(sorted(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)
                                 and x.dtype == torch.long and x.dim() == 2))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    layouts = [([6, 2, 9], 9), ([5, 5, 8], 9), ([2, 7, 4, 5, 1], 7), ([9, 1, 9], 9), ([3, 12, 6], 12),
               ([1, 1, 1, 1, 20], 20)]
    assert {hf_unpad.bucket(sum(lengths)) for lengths, _ in layouts} == {32}
    counts = []
    for i, (lengths, s) in enumerate(layouts):
        kw = inputs("bert", lengths, s, seed=i)
        compare(ref_model(**kw), compiled(**kw), kw["attention_mask"].bool())
        counts.append(len(shapes))
    assert counts[-1] == counts[2] <= 3, counts
    assert all(x == [(1, 32)] * 3 for x in shapes), shapes  # ids, token types, positions


@pytest.mark.parametrize("family,suffix,left", [("bert", "Model", False), ("llama", "ForCausalLM", True),
                                                ("mistral", "Model", False)])
def test_compiled_buckets_attention_in_the_graph(family, suffix, left, monkeypatch):
    """Compiled with buckets, attention runs flash_backward.in_graph (here its kernel a
    float64 reference of aten's FlashAttention-2 contract), not the op, and needs no
    other kernel of the op (FlashInfer made unavailable): every valid output as the
    padded "sdpa" run, the kernel given the bucket's offsets, window and scale."""
    import ragged_compile as rc
    from ragged_compile.backends import flash_backward

    seen = []

    def fa2(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, debug, *, scale, window_size_left,
            window_size_right):
        seen.append((tuple(cu_q.shape), causal, window_size_left, window_size_right, dropout_p))
        out = rc.reference_attention(q, k, v, cu_q, cu_k, causal, scale,
                                     window_size=(window_size_left, window_size_right)).to(q.dtype)
        return out, None, None, None, None

    monkeypatch.setattr(flash_backward, "unsupported_reason", lambda device, dtype, head_dim: None)
    monkeypatch.setattr(flash_backward, "_forward_kernel", fa2)
    monkeypatch.setattr(hf, "unsupported_reason",  # windows stay (a FlashAttention-2 variant)
                        lambda *a, **kw: None if kw.get("variant") else "FlashInfer is not installed")
    model = build(family, suffix)
    lengths = [7, 3, 8, 1]  # mistral: longer than its window of 6
    kw = inputs(family, lengths, 8, left)
    extra = dict(use_cache=False) if family in ("llama", "mistral") else {}
    ref = model(**kw, **extra)
    hf_unpad.unpad(model, buckets=True)
    graphs, backend = _graphs()
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(**kw, **extra)
    compare(ref, out, kw["attention_mask"].bool())
    total = sum(lengths)
    assert hf_unpad.bucket(total) > total
    segments = len(lengths) + len(hf_unpad._fillers(total, 6 if family == "mistral" else 64))
    causal = family != "bert"
    window = (5, 0) if family == "mistral" else (-1, -1)
    assert seen == [((segments + 1,), causal, *window, 0.0)] * 2, seen
    assert not any(graphs), graphs  # no graph calls our op


# -- ModernBERT: local layers are sliding-window attention -------------------------------------


@pytest.mark.parametrize("suffix", ["Model", "ForMaskedLM", "ForSequenceClassification"])
def test_modernbert_packs_where_the_window_spans_every_sequence(suffix):
    model = build("modernbert", suffix)  # local_attention 16: window 8 each side
    kw = inputs("modernbert", [8, 3, 5], 8)
    ref, out, rows = run_both(model, lambda m: m(**kw, output_hidden_states=True))
    valid = kw["attention_mask"].bool()
    assert packed(rows, valid)
    compare(ref, out, valid, ("modernbert", suffix, "right"))


@pytest.mark.parametrize("suffix", ["Model", "ForMaskedLM"])
def test_modernbert_packs_where_the_window_is_shorter(suffix):
    """Local layers' windows (8 each side) shorter than a sequence: packed, the
    window applied within each document, as on the padded call."""
    model = build("modernbert", suffix)
    kw = inputs("modernbert", [12, 3, 5], 12)
    ref, out, rows = run_both(model, lambda m: m(**kw, output_hidden_states=True))
    valid = kw["attention_mask"].bool()
    assert packed(rows, valid)
    compare(ref, out, valid, ("modernbert", suffix, "short window"))


def test_modernbert_mean_pooling_classifier_reads_the_mask():
    model = build("modernbert", "ForSequenceClassification", classifier_pooling="mean")
    kw = inputs("modernbert", [8, 3, 5], 8, left=True)
    ref, out, rows = run_both(model, lambda m: m(**kw))
    assert packed(rows, kw["attention_mask"].bool())
    compare(ref, out, kw["attention_mask"].bool())


# -- sentence-transformers --------------------------------------------------------------------

WORDS = "the a cat dog sat on mat ran far away quick brown fox jumps over lazy river bank money".split()
TEXTS = ["the cat sat on the mat", "a dog", "the quick brown fox jumps over the lazy dog far away",
         "river bank", "money", "the dog ran far away on the river bank"]


def _st_dir(tmp_path, family):
    """A tiny model and a WordPiece tokenizer built offline, saved as a local directory."""
    from transformers import BertTokenizerFast

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    tok = BertTokenizerFast(vocab_file=str(vocab))
    if family != "bert":
        tok.padding_side = "left"  # a decoder embedder: last-token pooling over left padding
    model = build(family, "Model", vocab_size=len(WORDS) + 5, pad_token_id=0)
    out = tmp_path / family
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("family,pooling", [("bert", "mean"), ("bert", "cls"), ("bert", "lasttoken"),
                                            ("qwen3", "lasttoken"), ("qwen3", "mean")])
def test_sentence_transformers_encode(tmp_path, family, pooling):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    import ragged_compile.hf

    path = _st_dir(tmp_path, family)

    def load(impl):
        t = Transformer(path, model_kwargs={"attn_implementation": impl})
        return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode=pooling)],
                                      device="cpu")

    ref = load("sdpa").encode(TEXTS, batch_size=4, convert_to_tensor=True)
    model = load("sdpa")
    ragged_compile.hf.unpad(model[0].auto_model)  # the one line
    assert model[0].auto_model.config._attn_implementation == NAME
    with Tokens() as t:
        out = model.encode(TEXTS, batch_size=4, convert_to_tensor=True)
    n_tokens = [len(model.tokenize([s])["input_ids"][0]) for s in TEXTS]
    by_length = sorted(n_tokens, reverse=True)  # encode() batches by length
    assert sorted(t.rows) == sorted([sum(by_length[:4]), sum(by_length[4:])] * 2), (t.rows, n_tokens)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    DIFFS[("sentence-transformers", family, pooling)] = (out - ref).abs().max().item()


# -- CUDA: FlashInfer through the runtime -----------------------------------------------------------


def _cuda_model(family, suffix, **extra):
    # head dim 64 (FlashInfer's), bf16; positions for 64 tokens after RoBERTa's padding_idx + 1 offset
    kw = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=130, **extra)
    if family == "qwen3":
        kw["head_dim"] = 64
    return build(family, suffix, **kw).cuda().bfloat16()


def _cuda_inputs(family, lengths, s, left=False):
    return {k: v.cuda() for k, v in inputs(family, lengths, s, left).items()}


@pytest.mark.cuda
@pytest.mark.parametrize("family,suffix,left", [("bert", "Model", False), ("xlm-roberta", "ForMaskedLM", True),
                                                ("qwen3", "ForCausalLM", True), ("llama", "Model", False)])
def test_cuda_packed_one_plan_per_forward(family, suffix, left, monkeypatch):
    from ragged_compile.runtime import get_runtime

    model = _cuda_model(family, suffix)
    kw = _cuda_inputs(family, [37, 5, 64, 1, 20], 64, left)
    if family in DECODERS:
        kw["use_cache"] = False
    valid = kw["attention_mask"].bool()
    rt = get_runtime(torch.device("cuda"))
    monkeypatch.setattr(rt, "backend", "fa2")  # FlashInfer: what plans
    with torch.no_grad():
        ref = model(**kw)
        hf_unpad.unpad(model)
        with Tokens() as t:
            out = model(**kw)
        assert packed(t.rows, valid.cpu())
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                before = dict(rt.stats)
                model(**kw)
            # every layer on one plan; the offsets' host values came with the mask's read
            assert rt.stats["plans"] - before.get("plans", 0) == 1
            assert rt.stats["syncs"] - before.get("syncs", 0) == 0
    k = "logits" if "logits" in ref else "last_hidden_state"
    torch.testing.assert_close(out[k][valid].float(), ref[k][valid].float(), atol=5e-2, rtol=5e-2)
    assert not out[k][~valid].any()


@pytest.mark.cuda
@pytest.mark.parametrize("family,suffix", [("bert", "ForMaskedLM"), ("qwen2", "ForCausalLM")])
def test_cuda_training_gradients(family, suffix):
    model = _cuda_model(family, suffix).float().train()
    kw = _cuda_inputs(family, [30, 7, 48, 2], 48)
    kw.update({k: v.cuda() for k, v in _labels(family, suffix, {k: v.cpu() for k, v in kw.items()},
                                                 torch.Generator().manual_seed(5)).items()})

    def run(m):
        m.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(**kw).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    (lref, gref), (lout, gout), rows = run_both(model, run)
    assert packed(rows, kw["attention_mask"].bool().cpu())
    torch.testing.assert_close(lout, lref, atol=2e-2, rtol=2e-2)
    for n in gref:
        torch.testing.assert_close(gout[n], gref[n], atol=5e-2, rtol=5e-2, msg=lambda m: f"{n}: {m}")


def _cuda_syncs(fn) -> list[str]:
    """The device syncs of a call of ``fn`` (after two warm calls), by message."""
    import warnings

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # the first switch to debug mode in a process also warns that the mode is a prototype
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


@pytest.mark.cuda
@pytest.mark.parametrize("family,suffix,left", [("bert", "Model", False), ("qwen3", "ForCausalLM", True)])
def test_cuda_one_sync_per_forward(family, suffix, left):
    model = hf_unpad.unpad(_cuda_model(family, suffix))
    kw = _cuda_inputs(family, [40, 17, 64, 9], 64, left)
    if family in DECODERS:
        kw["use_cache"] = False
    with torch.no_grad():
        syncs = _cuda_syncs(lambda: model(**kw))
    assert len(syncs) <= 1, syncs


@pytest.mark.cuda
@pytest.mark.parametrize("family,suffix,left", [("bert", "Model", False), ("qwen3", "ForCausalLM", True),
                                                ("roberta", "ForMaskedLM", True)])
def test_cuda_mask_on_the_host_reads_nothing_back(family, suffix, left):
    """The mask on the CPU, the ids on the GPU: packed as with the mask on the GPU
    (the same output, bit for bit), with no device sync in the forward."""
    model = hf_unpad.unpad(_cuda_model(family, suffix))
    kw = _cuda_inputs(family, [40, 17, 64, 9], 64, left)
    if family in DECODERS:
        kw["use_cache"] = False
    host = {**kw, "attention_mask": kw["attention_mask"].cpu()}
    valid = host["attention_mask"].bool()
    with torch.no_grad():
        ref = model(**kw)
        with Tokens() as t:
            out = model(**host)
        assert packed(t.rows, valid)
        syncs = _cuda_syncs(lambda: model(**host))
    assert syncs == [], syncs
    k = "logits" if "logits" in ref else "last_hidden_state"
    assert torch.equal(out[k], ref[k])


@pytest.mark.cuda
def test_cuda_mask_on_the_host_in_training_and_in_a_padded_fallback():
    """Training with the mask on the host: the loss and every gradient of the packed
    step equal those with the mask on the GPU. A call that runs padded (a [CLS]
    classifier on a left-padded batch) gets the mask on the inputs' device."""
    model = _cuda_model("bert", "ForMaskedLM").train()
    hf_unpad.unpad(model)
    kw = _cuda_inputs("bert", [30, 7, 48, 2], 48)
    kw["labels"] = kw["input_ids"].masked_fill(~kw["attention_mask"].bool(), -100)

    def step(mask):
        model.zero_grad()
        with Tokens() as t:
            loss = model(**{**kw, "attention_mask": mask}).loss
        loss.backward()
        assert packed(t.rows, kw["attention_mask"].bool().cpu())
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lref, gref = step(kw["attention_mask"])
    lout, gout = step(kw["attention_mask"].cpu())
    # FlashAttention-2's backward accumulates dq in any order: equal up to that
    torch.testing.assert_close(lout, lref, atol=1e-3, rtol=1e-3)
    assert gout.keys() == gref.keys()
    for n in gref:
        torch.testing.assert_close(gout[n], gref[n], atol=2e-2, rtol=2e-2, msg=lambda m: f"{n}: {m}")

    cls = _cuda_model("bert", "ForSequenceClassification")
    ref_cls = copy.deepcopy(cls)
    hf_unpad.unpad(cls)
    kw = _cuda_inputs("bert", [30, 7, 48, 2], 48, left=True)
    with torch.no_grad():
        out = cls(**{**kw, "attention_mask": kw["attention_mask"].cpu()}).logits
        ref = ref_cls(**kw).logits
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_attention_dropout_in_training_runs_packed():
    """BERT's default attention dropout (0.1) in training on CUDA: packed, every
    layer on our dropout op (FlashAttention-2), reproducible under manual_seed,
    gradients for every parameter."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=V, max_position_embeddings=64, hidden_size=256, num_attention_heads=4,
                     num_hidden_layers=2, intermediate_size=512, hidden_dropout_prob=0.0)  # attention dropout 0.1
    model = hf_unpad.unpad(BertForMaskedLM(cfg).cuda().bfloat16().train())
    kw = _cuda_inputs("bert", [20, 5, 32], 32)
    kw["labels"] = kw["input_ids"].masked_fill(~kw["attention_mask"].bool(), -100)
    dropout_op = (torch.ops.ragged_compile.ragged_attention_dropout.default,)
    with Tokens() as t, Count(dropout_op) as c:
        torch.manual_seed(0)
        loss = model(**kw).loss
    assert packed(t.rows, kw["attention_mask"].bool().cpu()) and c.n == 2
    torch.manual_seed(0)
    assert torch.equal(model(**kw).loss, loss) and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "pooler" not in n)


@pytest.mark.cuda
def test_cuda_compiled_across_layouts():
    model = _cuda_model("qwen2", "ForCausalLM")
    ref_model = _cuda_model("qwen2", "ForCausalLM")
    hf_unpad.unpad(model)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with torch.no_grad():
        for i, (lengths, s, left) in enumerate([([30, 7, 48], 48, True), ([12, 40, 3], 40, True),
                                                ([64, 1, 9], 64, False)]):
            kw = _cuda_inputs("qwen2", lengths, s, left)
            out = compiled(**kw, use_cache=False).logits
            ref = ref_model(**kw, use_cache=False).logits
            valid = kw["attention_mask"].bool()
            torch.testing.assert_close(out[valid].float(), ref[valid].float(), atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("buckets", [False, True])
def test_cuda_training_under_reduce_overhead_across_layouts(buckets):
    """An unpadded model trained under torch.compile(mode="reduce-overhead"):
    Inductor graphs what surrounds our op (tagged cudagraph_unsafe) and replays
    those graphs at every step, the op plans each batch's layout, so every step's
    loss and gradients are the eager unpadded model's, across layouts of equal
    padded shape and of other shapes, with one sync (unpadding's mask read) a step;
    with buckets, layouts of one packed length replay one graph."""
    import warnings

    model = hf_unpad.unpad(_cuda_model("bert", "ForMaskedLM").float().train(), buckets=buckets)
    ref = hf_unpad.unpad(_cuda_model("bert", "ForMaskedLM").float().train())
    ref.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")

    def step(run, m, kw):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(**kw).loss
        loss.backward()
        return loss.detach().clone(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    layouts = [([30, 7, 48, 2], 48), ([48, 2, 30, 7], 48), ([30, 7, 48, 2], 48), ([12, 40, 3, 40], 40),
               ([64, 1, 9, 33], 64)]
    for i, (lengths, s) in enumerate(layouts):
        kw = _cuda_inputs("bert", lengths, s)
        kw["labels"] = kw["input_ids"].masked_fill(~kw["attention_mask"].bool(), -100)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1 if i == 2 else 0)  # a replayed step
            try:
                lout, gout = step(compiled, model, kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) <= 1, syncs
        lref, gref = step(ref, ref, kw)
        torch.testing.assert_close(lout, lref, atol=2e-2, rtol=2e-2, msg=lambda m: f"{lengths}: {m}")
        assert gout.keys() == gref.keys()
        for n in gref:
            torch.testing.assert_close(gout[n], gref[n], atol=5e-2, rtol=5e-2, msg=lambda m: f"{lengths} {n}: {m}")



@pytest.mark.cuda
def test_cuda_two_forwards_a_step_with_buckets_under_reduce_overhead():
    """A sentence-transformers style step (two forwards, anchors and positives, then
    one backward through an in-batch loss) of a BertModel unpadded with buckets and
    its forward compiled with mode="reduce-overhead", the attention dropout at 0:
    every step's loss and gradients are the eager padded "sdpa" model's, over
    batches of other layouts and lengths, replayed graphs included."""
    base = _cuda_model("bert", "Model").float().train()
    ref = copy.deepcopy(base)
    ref.set_attn_implementation("sdpa")
    hf_unpad.unpad(base, buckets=True)
    torch._dynamo.reset()
    base.forward = torch.compile(base.forward, mode="reduce-overhead")

    def step(m, batches):
        m.zero_grad(set_to_none=True)
        embs = []
        for kw in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = m.forward(**kw).last_hidden_state
            w = kw["attention_mask"][..., None].float()
            embs.append((h.float() * w).sum(1) / w.sum(1))
        scores = embs[0] @ embs[1].T
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(scores), device=scores.device))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    layouts = [([30, 7, 48, 2], 48), ([12, 40, 3, 40], 40), ([30, 7, 48, 2], 48), ([48, 2, 29, 9], 48),
               ([64, 1, 9, 33], 64), ([12, 40, 3, 40], 40)]
    for i in range(len(layouts) - 1):
        batches = [_cuda_inputs("bert", *layouts[i]), _cuda_inputs("bert", *layouts[i + 1])]
        lout, gout = step(base, batches)
        lref, gref = step(ref, batches)
        torch.testing.assert_close(lout, lref, atol=2e-2, rtol=2e-2, msg=lambda m: f"step {i}: {m}")
        # a compiled graph's backward gives zeros (not None) to parameters of outputs the
        # loss does not use (the packed pooler), as stock torch.compile does
        assert gref.keys() <= gout.keys() and not any(gout[n].any() for n in gout.keys() - gref.keys())
        for n in gref:
            torch.testing.assert_close(gout[n], gref[n], atol=5e-2, rtol=5e-2, msg=lambda m: f"step {i} {n}: {m}")


def _graph_targets(model, kw):
    """The call targets of every graph torch.compile traces for one training step."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = compiled(**kw).last_hidden_state
    h.float().square().mean().backward()
    return targets


@pytest.mark.cuda
@pytest.mark.parametrize("family,suffix,left", [("bert", "Model", False), ("qwen3", "ForCausalLM", True),
                                                ("xlm-roberta", "ForMaskedLM", True)])
@pytest.mark.parametrize("backend", ["fa2", "auto"])
def test_cuda_buckets_eager(family, suffix, left, backend, monkeypatch):
    """buckets=True run eagerly on CUDA: the op takes the bucket's rows (fillers and
    empty filler slots in the offsets) on FlashInfer and on the default choice, one
    plan a forward, no sync, and every valid output as without buckets (zeros at
    padded positions)."""
    from ragged_compile.runtime import get_runtime

    model = _cuda_model(family, suffix)
    rt = get_runtime(torch.device("cuda"))
    monkeypatch.setattr(rt, "backend", backend)
    for lengths in ([37, 5, 64, 1, 20], [37, 5, 64, 2, 20]):  # a one-token filler; an empty filler slot
        kw = _cuda_inputs(family, lengths, 64, left)
        if family in DECODERS:
            kw["use_cache"] = False
        valid = kw["attention_mask"].bool()
        with torch.no_grad():
            hf_unpad.unpad(model, buckets=False)
            ref = model(**kw)
            hf_unpad.unpad(model, buckets=True)
            with Tokens() as t:
                out = model(**kw)
            assert t.rows == [128] * 2 and hf_unpad.bucket(sum(lengths)) == 128
            before = dict(rt.stats)
            model(**kw)
            assert rt.stats["syncs"] - before.get("syncs", 0) == 0
            if backend == "fa2":
                assert rt.stats["plans"] - before.get("plans", 0) == 1
        k = "logits" if "logits" in ref else "last_hidden_state"
        torch.testing.assert_close(out[k][valid].float(), ref[k][valid].float(), atol=2e-2, rtol=2e-2)
        assert not out[k][~valid].any()


@pytest.mark.cuda
def test_cuda_buckets_put_attention_in_the_graph():
    """Compiled, an unpadded model with buckets calls aten's FlashAttention-2 forward in
    its graph (attention dropout passed on), not our op, which CUDA graphs cannot
    capture; without buckets it calls our op."""
    kw = _cuda_inputs("bert", [30, 7, 48, 2], 48)
    for buckets in (True, False):
        model = hf_unpad.unpad(_cuda_model("bert", "Model", attention_probs_dropout_prob=0.1).float().train(),
                               buckets=buckets)
        targets = _graph_targets(model, kw)
        flash = [t for t in targets if t is torch.ops.aten._flash_attention_forward.default]
        ours = [t for t in targets if t in OURS or any(t is op.overloadpacket for op in OURS)]
        assert (len(flash), len(ours)) == ((2, 0) if buckets else (0, 2)), (buckets, targets)


@pytest.mark.cuda
def test_cuda_buckets_dropout_under_reduce_overhead_is_seeded_and_fresh():
    """Attention dropout in the captured graphs draws from CUDA's generator at every
    replay: the same seed gives the same step, another seed another one."""
    model = hf_unpad.unpad(_cuda_model("bert", "Model", attention_probs_dropout_prob=0.3).float().train(),
                           buckets=True)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, mode="reduce-overhead")
    kw = _cuda_inputs("bert", [30, 7, 48, 2], 48)
    w = torch.randn(model.config.hidden_size, device="cuda")  # (a layer norm's output: its square mean is fixed)

    def step(seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = compiled(**kw).last_hidden_state
        loss = (h.float() @ w).sum()
        loss.backward()
        return loss.item(), model.embeddings.word_embeddings.weight.grad.clone()

    for _ in range(3):
        step(0)  # warm-up and recording
    (a, ga), (b, gb), (c, gc) = step(0), step(0), step(1)
    assert a == b  # (FlashAttention-2's backward adds dq up in any order: close, not equal)
    torch.testing.assert_close(ga, gb, atol=1e-3, rtol=1e-3)
    assert a != c and (ga - gc).abs().max() > 1e-2

@pytest.mark.parametrize("family,suffix,left,others", [("bert", "Model", False, 0), ("roberta", "ForMaskedLM", True, 0),
                                                       ("qwen3", "ForCausalLM", True, 0), ("llama", "ForCausalLM", True, 1)])
def test_one_host_read_per_forward_and_the_runtime_told_the_offsets(family, suffix, left, others, monkeypatch):
    """The mask's lengths, checks and totals come back in one read (a tolist, which no
    dispatch mode sees: no scalar read is left); on CUDA the runtime is told the
    offsets' host values from it (Runtime.know_offsets), so it reads nothing back:
    that code path here on CPU, whose op plans nothing. Llama (and Mistral) build
    their causal mask themselves, and transformers then reads the position ids once
    (find_packed_sequence_indices); Qwen2/3 take a mask per layer type, so none."""
    from ragged_compile.runtime import Runtime

    told = []
    real = Runtime.know_offsets

    def spy(self, cu, host):
        told.append((cu.clone(), host.clone()))
        return real(self, cu, host)

    monkeypatch.setattr(hf_unpad, "_KNOWN_OFFSETS_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(Runtime, "know_offsets", spy)
    model = hf_unpad.unpad(build(family, suffix))
    kw = inputs(family, [7, 3, 8, 1], 8, left)
    with torch.no_grad():
        model(**kw, **({"use_cache": False} if family in DECODERS else {}))  # warm
        told.clear()
        with HostReads() as reads, Tokens() as t:
            model(**kw, **({"use_cache": False} if family in DECODERS else {}))
    assert packed(t.rows, kw["attention_mask"].bool())
    assert reads.n == others, f"{reads.n} scalar host reads besides the mask's"
    assert len(told) == 1 and torch.equal(told[0][0], told[0][1])
    assert told[0][1].tolist() == [0, 7, 10, 18, 19]


# -- layouts -------------------------------------------------------------------------------------


def test_a_mask_on_another_device_than_the_inputs_and_not_the_cpu_is_an_error():
    """The mask may sit on the CPU with the inputs elsewhere (read for free); any other
    device apart from the inputs' says what to do."""
    model = hf_unpad.unpad(build("bert"))
    kw = inputs("bert", [5, 8], 8)
    with pytest.raises(ValueError, match=r"attention_mask is on meta.*on the inputs' device or on the CPU"):
        model(**{**kw, "attention_mask": kw["attention_mask"].to("meta")})


def test_packed_total_beyond_max_positions_mixed_sides_and_empty_rows():
    """T = 300 tokens > max_position_embeddings (64); rows padded on either side or both
    ([pad | tokens | pad]); an empty row (no valid position: zeros)."""
    model = build("bert", "ForMaskedLM")
    s, b = 60, 8
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(b, s, dtype=torch.long)
    spans = [(0, 60), (0, 45), (15, 60), (10, 50), (0, 0), (59, 60), (0, 55), (20, 44)]
    for i, (a, e) in enumerate(spans):
        mask[i, a:e] = 1
    ids = torch.randint(5, V, (b, s), generator=g) * mask
    kw = dict(input_ids=ids, attention_mask=mask)
    ref, out, rows = run_both(model, lambda m: m(**kw, output_hidden_states=True))
    valid = mask.bool()
    assert int(valid.sum()) > 64 and packed(rows, valid)
    compare(ref, out, valid, ("bert", "ForMaskedLM", "mixed"))


def test_deepcopy_and_gradient_checkpointing():
    import copy

    model = build("llama", "ForCausalLM").train()
    kw = inputs("llama", [7, 2, 5], 7)
    kw["labels"] = kw["input_ids"].masked_fill(~kw["attention_mask"].bool(), -100)
    ref = model(**kw).loss
    hf_unpad.unpad(model)
    twin = copy.deepcopy(model)
    assert hf_unpad.is_unpadded(twin) and twin.model.forward.args[0].base is twin.model
    twin.activation_checkpointing_enable()
    with Tokens() as t:
        loss = twin(**kw).loss
        loss.backward()
    assert t.rows[:2] == [14, 14]  # forward, then recomputed in backward
    torch.testing.assert_close(loss, ref, atol=TOL, rtol=TOL)
    hf_unpad.unpad(twin, enabled=False)
    assert hf_unpad.is_unpadded(model) and "forward" in model.model.__dict__


def test_logits_to_keep(caplog):
    model = build("llama", "ForCausalLM")
    kw = inputs("llama", [6, 2, 8], 8, left=True)
    ref, out, rows = run_both(model, lambda m: m(**kw, use_cache=False, logits_to_keep=1))
    assert packed(rows, kw["attention_mask"].bool()) and out.logits.shape[1] == 1
    torch.testing.assert_close(out.logits, ref.logits, atol=TOL, rtol=TOL)  # left padding: the last column is valid
    fallback(model, lambda m: m(**kw, use_cache=False, logits_to_keep=torch.tensor([0, 7])),
             "head reads a padded position", caplog)
