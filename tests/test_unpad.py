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

from ragged_compile import hf, hf_unpad  # noqa: E402

NAME = hf.register()
OURS = (torch.ops.ragged_compile.ragged_attention.default, torch.ops.ragged_compile.ragged_attention_lse.default)
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
    hf._warned.clear()
    hf_unpad._warned.clear()


def pad_mask(lengths, s, left=False):
    m = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            m[i, s - n:] = 1
        else:
            m[i, :n] = 1
    return m


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
    r = copy.copy(ref)
    r["cache"] = None
    compare(type(ref)(last_hidden_state=ref.last_hidden_state), type(out)(last_hidden_state=out.last_hidden_state),
            kw["attention_mask"].bool(), (family, "Model", "left"))
