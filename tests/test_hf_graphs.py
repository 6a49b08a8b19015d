"""hf.graphed: transformers models called padded, under CUDA graphs over (batch, length)
buckets.

On CPU the same bookkeeping runs without a capture (buckets, static buffers, the
mask recipes, the output cuts) and every output equals the model on "sdpa" with the
same weights (fp32, valid positions). With a stand-in for FlashInfer
(_fake_flashinfer.py) the CUDA planning path runs on CPU as well: graph-mode
wrappers made once per recipe and planned from the host mask before every call,
each computing its output from its plan, so a stale plan shows up as a wrong
result. The CUDA tests capture and replay for real."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _fake_flashinfer  # noqa: E402
from test_unpad import TEXTS, _st_dir, build, inputs  # noqa: E402

import ragged_compile as rc  # noqa: E402
from ragged_compile import hf, hf_graphs, logs, validation  # noqa: E402
from ragged_compile.buckets import PaddedBucket, as_padded_buckets, choose_bucket, default_padded_buckets  # noqa: E402

TOL = 1e-5
BUCKETS = [(2, 8), (4, 16), (8, 24)]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    logs._seen.clear()


def lengths_for(b, s, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, s + 1, (b,), generator=g).tolist()


def both(family, suffix="Model", buckets=BUCKETS, **extra):
    """(the model on "sdpa", the same weights graphed)."""
    ref = build(family, suffix, **extra)
    return ref, hf.graphed(build(family, suffix, **extra), buckets)


def compare(ref, out, valid, tol=TOL):
    """Every tensor field of ``ref`` (a ModelOutput or tuple) in ``out``, same shape:
    equal at valid positions ([B, S, ...] fields), equal everywhere otherwise."""
    b, s = valid.shape
    pairs = ref.items() if hasattr(ref, "items") else enumerate(ref)
    for k, r in pairs:
        if k in ("past_key_values", "cache"):
            continue  # graph mode runs without a cache
        o = out[k]
        for i, (a, c) in enumerate(zip(r, o) if isinstance(r, tuple) else [(r, o)]):
            if not isinstance(a, torch.Tensor):
                continue
            assert c.shape == a.shape, (k, i, c.shape, a.shape)
            if a.dim() >= 2 and a.shape[:2] == (b, s):
                a, c = a[valid], c[valid]
            torch.testing.assert_close(c.float(), a.float(), atol=tol, rtol=tol, msg=lambda m: f"{k}[{i}]: {m}")


def expected_bucket(b, s, buckets=BUCKETS):
    fit = [PaddedBucket(*x) for x in buckets if b <= x[0] and s <= x[1]]
    return min(fit, key=lambda x: (x.batch * x.length, x.length), default=None)


# Calls: (batch, padded length) per call, with seeds; the same shape comes back with
# other masks, one call fits no bucket, one fills its bucket exactly.
CALLS = [(3, 12, 0), (3, 12, 1), (1, 5, 2), (2, 8, 3), (8, 24, 4), (5, 17, 5), (9, 10, 6), (4, 30, 7), (8, 24, 8)]


@pytest.mark.parametrize("family,suffix,left", [
    ("bert", "Model", False), ("bert", "ForMaskedLM", True), ("roberta", "Model", False),
    ("xlm-roberta", "ForTokenClassification", True), ("electra", "Model", False), ("distilbert", "Model", True),
    ("modernbert", "Model", False),  # local layers: window 9 < every bucket length: SDPA inside the graph
    ("llama", "Model", True), ("qwen3", "ForCausalLM", True), ("qwen2", "Model", False),
])
def test_outputs_equal_eager_across_layouts_and_buckets(family, suffix, left):
    ref, g = both(family, suffix)
    used, eager = set(), 0
    for b, s, seed in CALLS:
        kw = inputs(family, lengths_for(b, s, seed), s, left, seed=seed)
        out = g(**kw, output_hidden_states=True)
        with torch.no_grad():
            want = ref(**kw, output_hidden_states=True)
        assert type(out) is type(want)
        compare(want, out, kw["attention_mask"].bool())
        bucket = expected_bucket(b, s)
        if bucket is None:
            eager += 1
        else:
            used.add(bucket)
    assert {key[0] for key in g.entries} == used
    assert g.stats["eager"] == eager and g.stats["replays"] == len(CALLS) - eager
    assert g.stats["fallbacks"] == 0 and g.stats["syncs"] == 0  # CPU masks: no read


def test_same_shapes_other_masks_and_padding_rows():
    """Four calls of one shape, each mask another layout (equal totals among them), and
    a smaller batch in the same bucket: one entry, every result the new mask's."""
    ref, g = both("bert")
    for lens in ([12, 3, 7], [7, 12, 3], [3, 7, 12], [1, 1, 12]):
        kw = inputs("bert", lens, 12, seed=sum(lens))
        with torch.no_grad():
            want = ref(**kw)
        compare(want, g(**kw), kw["attention_mask"].bool())
    kw = inputs("bert", [16], 16)  # one row of a 4-row bucket: three padding rows
    with torch.no_grad():
        compare(ref(**kw), g(**kw), kw["attention_mask"].bool())
    assert len(g.entries) == 1 and g.stats["replays"] == 5


def test_empty_rows_and_a_call_without_a_mask():
    ref, g = both("bert", add_pooling_layer=False)
    kw = inputs("bert", [0, 5, 0], 9)
    with torch.no_grad():
        want = ref(**kw)
    out = g(**kw)
    compare(want, out, kw["attention_mask"].bool())
    kw.pop("attention_mask")
    with torch.no_grad():
        want = ref(**kw)
    compare(want, g(**kw), torch.ones(3, 9, dtype=torch.bool))


def test_cuts_follow_the_batch_and_length_not_equal_sizes():
    """A hidden size and a label count equal to the bucket's length stay whole: the
    probe tells the length dim from a constant of the same size."""
    ref, g = both("bert", "ForSequenceClassification", buckets=[(4, 32)], num_labels=32)
    kw = inputs("bert", [5, 9], 10)  # hidden 32 == the bucket length
    with torch.no_grad():
        want = ref(**kw, output_hidden_states=True)
    out = g(**kw, output_hidden_states=True)
    assert out.logits.shape == (2, 32) and out.hidden_states[0].shape == (2, 10, 32)
    compare(want, out, kw["attention_mask"].bool())
    base_ref, base = both("bert", buckets=[(4, 32)])
    with torch.no_grad():
        want = base_ref(**kw, return_dict=False)
    out = base(**kw, return_dict=False)
    assert isinstance(out, tuple) and out[1].shape == (2, 32)  # pooler_output [B, H]
    compare(want, out, kw["attention_mask"].bool())


def test_positional_arguments_inputs_embeds_and_position_ids():
    ref, g = both("bert")
    kw = inputs("bert", [4, 11, 2], 11)
    with torch.no_grad():
        want = ref(kw["input_ids"], kw["attention_mask"], kw["token_type_ids"])
    compare(want, g(kw["input_ids"], kw["attention_mask"], kw["token_type_ids"]), kw["attention_mask"].bool())
    pos = torch.arange(11)[None]  # [1, S], broadcast over the batch
    embeds = ref.embeddings.word_embeddings(kw["input_ids"]).detach()
    with torch.no_grad():
        want = ref(inputs_embeds=embeds, attention_mask=kw["attention_mask"], position_ids=pos)
    out = g(inputs_embeds=embeds, attention_mask=kw["attention_mask"], position_ids=pos)
    compare(want, out, kw["attention_mask"].bool())
    assert g.stats["fallbacks"] == 0 and len(g.entries) == 2  # another set of inputs: another entry


def test_calls_in_and_out_of_inference_mode():
    """The first call (which makes the static buffers) under inference mode, later
    ones outside it and back: buffers written in place either way."""
    ref, g = both("bert")
    for i, mode in enumerate((torch.inference_mode, torch.no_grad, torch.enable_grad, torch.inference_mode)):
        kw = inputs("bert", lengths_for(3, 12, i), 12, seed=i)
        with mode():
            out = g(**kw)
        with torch.no_grad():
            compare(ref(**kw), out, kw["attention_mask"].bool())
    assert len(g.entries) == 1 and g.stats["replays"] == 4


def test_decoder_returns_no_cache_and_left_padding_keeps_positions():
    ref, g = both("llama", "ForCausalLM")
    kw = inputs("llama", [9, 4, 1, 6], 9, left=True)
    with torch.no_grad():
        want = ref(**kw)
    out = g(**kw)
    assert want.past_key_values is not None and out.past_key_values is None
    compare(want, out, kw["attention_mask"].bool())


# -- eager calls ------------------------------------------------------------------------


@pytest.mark.parametrize("case,reason", [
    ("labels", "tensor argument 'labels'"),
    ("training", "the model is in training mode"),
    ("holes", "valid tokens are not one run per row"),
    ("use_cache", "use_cache=True"),
    ("output_attentions", "output_attentions=True"),
])
def test_calls_graph_mode_does_not_take_run_eagerly(case, reason, caplog):
    ref, g = both("bert", "ForMaskedLM" if case == "labels" else "Model")
    kw = inputs("bert", [5, 8], 8)
    if case == "labels":
        kw["labels"] = torch.where(kw["attention_mask"].bool(), kw["input_ids"], -100)
    elif case == "training":
        ref.train()
        g.model.train()
    elif case == "holes":
        kw["attention_mask"][0, 2] = 0
    elif case in ("use_cache", "output_attentions"):
        kw[case] = True
    with caplog.at_level(logging.WARNING, logger="ragged_compile"):
        out = g(**kw)
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    with torch.no_grad():
        want = ref(**kw)
    for k in want.keys():
        if isinstance(want[k], torch.Tensor) and k != "loss":
            assert torch.allclose(out[k], want[k], atol=TOL, rtol=TOL), k
    assert g.stats["fallbacks"] == 1 and g.stats["replays"] == 0 and not g.entries


def test_a_model_that_changes_the_mask_on_its_way_to_attention_is_refused():
    """The host re-plans from the call's mask: a model whose attention sees another mask
    cannot be replayed; on CPU every call checks (on CUDA the warm-ups)."""
    _, g = both("bert")

    def drop_last_column(module, args, kwargs):
        mask = kwargs["attention_mask"].clone()
        mask[:, -1] = False
        kwargs["attention_mask"] = mask
        return args, kwargs

    g.model.encoder.register_forward_pre_hook(drop_last_column, with_kwargs=True)
    kw = inputs("bert", [16, 3], 16)
    with pytest.raises(RuntimeError, match="differs from the one the host computes"):
        g(**kw)


# -- the planning path, on a stand-in for FlashInfer ------------------------------------


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The op's CUDA path on CPU: every attention call goes to the active step, whose
    graph-mode wrappers (fakes) compute from their last plan."""
    wrappers = _fake_flashinfer.install(monkeypatch)

    def routed(q, k, v, cu_q, cu_k, causal=False, scale=None):
        step = rc.steps.current_step()
        return step.attention(q, k, v, cu_q, cu_k, causal, q.shape[-1] ** -0.5 if scale is None else scale)

    monkeypatch.setattr(hf_graphs, "ragged_attention", routed)
    return rc.Runtime("cpu", backend="fa2", workspace_bytes=64), wrappers


@pytest.mark.parametrize("family,left", [("bert", False), ("qwen3", True)])
def test_every_call_replans_every_wrapper_from_its_own_mask(fake_flashinfer, monkeypatch, family, left):
    rt, wrappers = fake_flashinfer
    ref = build(family)
    g = hf.graphed(build(family), BUCKETS, runtime=rt)
    shape_calls = [(3, 12, 0), (3, 12, 1), (3, 12, 2), (4, 16, 3), (2, 5, 4)]
    for b, s, seed in shape_calls:
        kw = inputs(family, lengths_for(b, s, seed), s, left, seed=seed)
        with torch.no_grad():
            want = ref(**kw)
        compare(want, g(**kw), kw["attention_mask"].bool())
    # One wrapper per recipe and head config (every layer shares it), made once per
    # entry, planned at its making and before every call of its entry.
    assert [len(e.slots) for e in g.entries.values()] == [1, 1] and len(wrappers) == 2
    # each planned once when made (a capture's first call) and before every later call
    assert g.stats["plans"] == len(shape_calls)

    # The control: without the re-plan a new mask of the same shape gets the old plan.
    monkeypatch.setattr(type(g), "plan", lambda self, slot, qo, kv: None)
    kw = inputs(family, [12, 1, 6], 12, left, seed=9)
    with torch.no_grad():
        want = ref(**kw)
    out = g(**kw)
    valid = kw["attention_mask"].bool()
    assert not torch.allclose(out.last_hidden_state[valid], want.last_hidden_state[valid], atol=1e-3)


def test_over_bucket_calls_on_cuda_plan_from_the_host_mask(fake_flashinfer):
    """The eager step of a call over every bucket: planned per recipe from the mask's
    host copy (what a CUDA call does to avoid a second read), on the stand-in."""
    rt, wrappers = fake_flashinfer
    ref = build("bert")
    g = hf.graphed(build("bert"), [(2, 8)], runtime=rt)
    kw = inputs("bert", [12, 3, 9], 12)
    layouts = hf_graphs._MaskLayouts(hf_graphs._HostMask.of(kw["attention_mask"].bool()), check=True)
    with torch.no_grad(), rt.run_step(hf_graphs._MaskEagerStep(rt, layouts)):
        out = g._forward(**kw)
    with torch.no_grad():
        want = ref(**kw)
    compare(want, out, kw["attention_mask"].bool())
    assert rt.stats["plans"] == 1 and rt.stats["syncs"] == 0 and len(wrappers) == 1
    assert rt.stats["flashinfer"] == 2  # both layers on the one plan


# -- sentence-transformers ------------------------------------------------------------------


@pytest.mark.parametrize("family,pooling", [("bert", "mean"), ("bert", "cls"), ("qwen3", "lasttoken")])
def test_sentence_transformers_encode(tmp_path, family, pooling):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    path = _st_dir(tmp_path, family)

    def load():
        t = Transformer(path, model_kwargs={"attn_implementation": "sdpa"})
        return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode=pooling)],
                                      device="cpu")

    texts = TEXTS * 3
    ref = load().encode(texts, batch_size=4, convert_to_tensor=True)
    model = load()
    model[0].auto_model.forward = hf.graphed(model[0].auto_model, [(4, 8), (4, 16)])  # the one line
    out = model.encode(texts, batch_size=4, convert_to_tensor=True)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    g = model[0].auto_model.forward
    assert g.stats["replays"] == 5 and g.stats["eager"] == 0 and len(g.entries) == 2


# -- buckets and arguments ------------------------------------------------------------------


def test_buckets_and_the_default_ladder():
    assert choose_bucket(as_padded_buckets(BUCKETS), 3, 5) == PaddedBucket(4, 16)
    assert choose_bucket(as_padded_buckets([(8, 8), (2, 32)]), 2, 8) == PaddedBucket(8, 8)  # equal tokens: the shorter
    assert choose_bucket(as_padded_buckets(BUCKETS), 9, 5) is None
    with pytest.raises(ValueError, match=r"\(batch, length\)"):
        as_padded_buckets([(1, 2, 3)])
    with pytest.raises(ValueError, match="batch must be >= 1"):
        as_padded_buckets([(0, 8)])
    ladder = default_padded_buckets(100)
    assert max(b.length for b in ladder) == 100 and max(b.batch for b in ladder) == 64
    assert max(b.length for b in default_padded_buckets()) == 512
    g = hf.graphed(build("roberta"))  # 64 positions, 2 of them before the first token
    assert max(b.length for b in g.buckets) == 62
    with pytest.raises(ValueError, match="exceeds the 62 positions"):
        hf.graphed(build("roberta"), [(4, 64)])


def test_what_graphed_takes():
    model = build("bert")
    with pytest.raises(TypeError, match="eager model"):
        hf.graphed(torch.compile(model))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.graphed(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="hf.unpad"):
        hf.graphed(hf.unpad(build("bert")))
    with pytest.raises(ValueError, match="split_kv"):
        hf.graphed(model, split_kv="yes")
    g = hf.graphed(model)
    assert model.config._attn_implementation == hf_graphs.GRAPH_NAME
    model.forward = g
    with pytest.raises(ValueError, match="already a graphed model"):
        hf.graphed(model)
    kw = inputs("bert", [3, 5], 5)
    assert model(**kw).last_hidden_state.shape == (2, 5, 32)  # nn.Module.__call__ -> g -> the model's own forward
    assert not model(**kw).last_hidden_state.requires_grad  # inference only, grad enabled or not


# -- capture and replay (CUDA), the same tests' bookkeeping on CPU ------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CUDA_BUCKETS = [(8, 32), (16, 64), (4, 128)]


def _device_model(device, family, suffix):
    """Head dim 64 (FlashInfer's), 128 positions; bf16 on CUDA, fp32 on CPU."""
    extra = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=128)
    if family == "qwen3":
        extra["head_dim"] = 64
    return build(family, suffix, **extra).to(device, torch.bfloat16 if device == "cuda" else torch.float32)


def _device_pair(device, family="bert", suffix="Model", buckets=CUDA_BUCKETS):
    """(the model on "sdpa", the same weights graphed), tolerance."""
    ref = _device_model(device, family, suffix)
    return ref, hf.graphed(_device_model(device, family, suffix), buckets), 5e-2 if device == "cuda" else TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("on_cpu", [True, False])  # the caller's tensors: from the tokenizer, or moved
def test_capture_once_per_bucket_and_replay_every_layout(device, on_cpu):
    ref, g, tol = _device_pair(device)
    rt = g.runtime
    shapes = [(8, 32), (8, 32), (8, 32), (3, 20), (16, 64), (11, 50), (16, 64), (4, 128), (2, 100), (4, 128), (1, 7)]
    used = set()
    before = rt.stats["syncs"]
    for seed, (b, s) in enumerate(shapes):
        kw = inputs("bert", lengths_for(b, s, seed), s, seed=seed)
        dev_kw = {k: v.to(device) for k, v in kw.items()}
        out = g(**(kw if on_cpu else dev_kw))
        with torch.no_grad():
            want = ref(**dev_kw)
        assert out.last_hidden_state.shape == (b, s, 256) and out.last_hidden_state.device.type == device
        assert torch.isfinite(out.last_hidden_state).all()
        compare(want, out, dev_kw["attention_mask"].bool(), tol=tol)
        used.add(expected_bucket(b, s, CUDA_BUCKETS))
    assert len(used) == 3 == len(g.entries)
    assert g.stats["captures"] == (3 if device == "cuda" else 0)  # never a capture per call
    assert g.stats["replays"] == len(shapes) and g.stats["eager"] == 0
    assert g.stats["syncs"] == (len(shapes) if device == "cuda" and not on_cpu else 0)  # one mask read at most
    assert rt.stats["syncs"] == before  # planning read nothing back
    if device == "cuda":
        assert g.stats["plans"] >= len(shapes)  # re-planned before every replay


@pytest.mark.parametrize("device", DEVICES)
def test_same_shape_other_masks_never_replay_the_captured_plan(device):
    ref, g, tol = _device_pair(device, buckets=[(8, 64)])
    layouts = ([64, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 64], [8] * 8, [33, 31, 2, 62, 5, 5, 40, 1],
               [64] * 8, [1, 64, 1, 64, 1, 64, 1, 64])
    for i, lens in enumerate(layouts):
        kw = {k: v.to(device) for k, v in inputs("bert", lens, 64, seed=i).items()}
        out = g(**kw)
        with torch.no_grad():
            want = ref(**kw)
        compare(want, out, kw["attention_mask"].bool(), tol=tol)
    assert len(g.entries) == 1 and g.stats["replays"] == len(layouts)
    assert g.stats["captures"] == (1 if device == "cuda" else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_left_padded_decoder_and_a_call_over_every_bucket(device):
    ref, g, tol = _device_pair(device, "qwen3", "ForCausalLM", buckets=[(4, 32), (8, 64)])
    rt = g.runtime
    for i, (lens, s) in enumerate([([30, 2, 17], 30), ([5, 64, 9, 1, 60], 64), ([40] * 9, 40), ([3, 30, 9], 30)]):
        kw = {k: v.to(device) for k, v in inputs("qwen3", lens, s, left=True, seed=i).items()}
        before = rt.stats["syncs"]
        out = g(**kw)
        assert rt.stats["syncs"] == before  # the eager call too plans from the mask's one read
        with torch.no_grad():
            want = ref(**kw, use_cache=False)
        compare(want, out, kw["attention_mask"].bool(), tol=tol)
    assert g.stats["eager"] == 1 and g.stats["replays"] == 3 and len(g.entries) == 2
    assert g.stats["captures"] == (2 if device == "cuda" else 0)


@pytest.mark.parametrize("device", DEVICES)
def test_debug_checks_every_replay_against_the_host(device, monkeypatch):
    monkeypatch.setattr(validation, "_DEBUG", True)
    ref, g, tol = _device_pair(device, buckets=[(8, 32)])
    for i, lens in enumerate(([32, 1, 5], [5, 32, 1], [1, 5, 32])):
        kw = {k: v.to(device) for k, v in inputs("bert", lens, 32, seed=i).items()}
        with torch.no_grad():
            want = ref(**kw)
        compare(want, g(**kw), kw["attention_mask"].bool(), tol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_sentence_transformers_encode_on_the_device(tmp_path, device):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    path = _st_dir(tmp_path, "bert")  # head dim 8: FlashInfer computes it zero-padded to 64
    dtype, tol = (torch.bfloat16, 5e-2) if device == "cuda" else (torch.float32, TOL)

    def load():
        t = Transformer(path, model_kwargs={"attn_implementation": "sdpa", "dtype": dtype})
        return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode="mean")],
                                      device=device)

    texts = TEXTS * 10
    ref = load().encode(texts, batch_size=8, convert_to_tensor=True)
    model = load()
    model[0].auto_model.forward = hf.graphed(model[0].auto_model, [(8, 16)])
    out = model.encode(texts, batch_size=8, convert_to_tensor=True)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    g = model[0].auto_model.forward
    assert g.stats["replays"] == 8 and len(g.entries) == 1
    assert g.stats["captures"] == (1 if device == "cuda" else 0)
    assert g.stats["syncs"] == (8 if device == "cuda" else 0)  # ST moves the mask to the device
