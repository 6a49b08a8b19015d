"""Every transformers model type a new user could name, through our attention name:
a tiny random model of each base model class with a text config, a right-padded,
left-padded or unpadded batch, our name against the model's own eager attention at valid positions (fp32).

Composite models (vision-language, audio-language) run on text alone. Where the
model's eager forward itself fails on these inputs (vision and audio encoders)
or a shrunk model is still large, the type is skipped. What
must hold for every other type: no crash, and outputs equal to eager, whether
the calls ran on our op or fell back (a fallback runs the model's own path).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES  # noqa: E402

from _hf_common import pad_mask  # noqa: E402
from ragged_compile import hf  # noqa: E402

NAME = hf.register()
TOL = 1e-4  # relative to the output's scale: fp32, random weights of std 0.3

# Shrunk where a config has the field (the names families use for the same thing).
SMALL = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
    vocab_size=99, head_dim=16, d_model=64, encoder_attention_heads=4, decoder_attention_heads=4, encoder_layers=2,
    decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64, n_head=4, n_layer=2, n_embd=64, num_layers=2,
    num_heads=4, d_kv=16, d_ff=64, max_position_embeddings=128, n_positions=128, dim=64, hidden_dim=64, n_heads=4,
    n_layers=2, ffn_dim=64, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
    n_routed_experts=4, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, sliding_window=5, local_attention=6, attention_dropout=0.0,
    attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, dropout=0.0,
)
MAX_PARAMS = 30e6


def _class_name(entry) -> str:
    return entry if isinstance(entry, str) else entry[0]


def _output(result) -> torch.Tensor:
    return result.last_hidden_state if hasattr(result, "last_hidden_state") else result[0]


def _shrink(cfg, depth: int = 0) -> None:
    """SMALL into a config and its sub-configs (text, vision, audio towers)."""
    for key, value in SMALL.items():
        if hasattr(cfg, key) and not isinstance(getattr(cfg, key), (list, dict)):
            setattr(cfg, key, value)
    for name in list(vars(cfg)):
        sub = getattr(cfg, name)
        if depth < 3 and isinstance(sub, transformers.PretrainedConfig):
            _shrink(sub, depth + 1)


def _build(model_type: str):
    cfg = AutoConfig.for_model(model_type)
    _shrink(cfg)
    cls = getattr(transformers, _class_name(MODEL_MAPPING_NAMES[model_type]))
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_PARAMS:
        pytest.skip(f"{n / 1e6:.0f}M parameters after shrinking")
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # attention far from uniform
    return model, cfg


@pytest.fixture(autouse=True)
def _quiet():
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.getLogger("transformers").setLevel(level)


@pytest.mark.parametrize("padding", ["right", "left", "none"])
@pytest.mark.parametrize("model_type", sorted(MODEL_MAPPING_NAMES))
def test_model_type_matches_its_eager_attention(model_type, padding):
    try:
        model, cfg = _build(model_type)
    except Exception as e:  # noqa: BLE001 - a type this generic recipe cannot build (skips pass through)
        pytest.skip(f"not built: {type(e).__name__}")
    g = torch.Generator().manual_seed(0)
    mask = pad_mask([11, 6, 8] if padding != "none" else [11] * 3, 11, padding == "left")
    kw = dict(input_ids=torch.randint(3, 90, (3, 11), generator=g) * mask, attention_mask=mask)
    if padding == "none":
        del kw["attention_mask"]  # the model makes its own (or none)
    valid = mask
    if getattr(cfg, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = kw["input_ids"][:, :7]
        valid = mask[:, :7]
        if padding != "none":
            kw["decoder_attention_mask"] = valid
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            torch.manual_seed(1)
            want = _output(model(**kw))
            torch.manual_seed(1)
            again = _output(model(**kw))
    except Exception as e:  # noqa: BLE001 - the model's own path fails on these inputs
        pytest.skip(f"eager fails here: {type(e).__name__}")
    if want.shape != again.shape or not torch.equal(want, again):
        pytest.skip("eager is not deterministic")
    model.set_attn_implementation(NAME)
    with torch.no_grad():
        torch.manual_seed(1)
        got = _output(model(**kw))
    assert got.shape == want.shape
    rows = valid.bool() if got.shape[:2] == valid.shape else torch.ones(got.shape[:2], dtype=torch.bool)
    err = (got - want)[rows].abs().max().item()
    assert err <= TOL * max(1.0, want[rows].abs().max().item()), f"{model_type}: max |diff| {err:.3g} at valid positions"


def _tiny(model_type, **extra):
    model, cfg = _build(model_type)
    for key, value in extra.items():
        setattr(model.config, key, value)
    return model


def _padded_encoder_decoder():
    g = torch.Generator().manual_seed(0)
    mask = pad_mask([11, 6, 8], 11)
    ids = torch.randint(3, 90, (3, 11), generator=g) * mask
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :7], decoder_attention_mask=mask[:, :7])


def test_pegasus_x_decoder_is_causal_as_its_mask_under_compile():
    """PegasusX's decoder self-attention says is_causal=False under a causal mask:
    compiled, the mask our mask function built still carries its pattern."""
    model = _tiny("pegasus_x")
    kw = _padded_encoder_decoder()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(**kw).last_hidden_state
    model.set_attn_implementation(NAME)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model)(**kw).last_hidden_state
    rows = kw["decoder_attention_mask"].bool()
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-4, atol=1e-4)


def test_a_model_without_flash_support_named_through_its_config():
    """Our name written straight into the config (no set_attn_implementation): a model
    that reworks its mask (BigBird-Pegasus' encoder) still gets its own mask kind."""
    model = _tiny("bigbird_pegasus")
    kw = _padded_encoder_decoder()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model(**kw).last_hidden_state
    for m in model.modules():
        if isinstance(m, transformers.PreTrainedModel):
            m.config._attn_implementation = NAME
    with torch.no_grad():
        got = model(**kw).last_hidden_state
    rows = kw["decoder_attention_mask"].bool()
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-4, atol=1e-4)


def test_graph_mode_refuses_a_model_without_flash_support():
    model = _tiny("splinter")
    with pytest.raises(ValueError, match="declare FlashAttention support.*SplinterModel"):
        hf.graphed(model, [(4, 16)])
