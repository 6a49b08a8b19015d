"""Padded batches unpadded end to end (``hf.unpad``) where users meet them beyond
BERT classifiers, side by side in one process (BERT encoders: ``bench_host.py``):

* ``decoder``: a Qwen2-style 0.5B decoder (24 layers, hidden 896, 14 query / 2
  key-value heads) scoring left-padded batches with last-token pooling, as
  Qwen3-Embedding-style models embed: 32 x 512 and 128 x 128 at half padding
  (lengths 1..L). ``"sdpa"`` padded, ours padded (``register()`` only), ours
  unpadded; forward ms, max |diff| of the pooled embedding.
* ``st``: sentence-transformers ``encode()`` of 2,048 sentences of mixed length
  (lognormal, mean ~45 tokens, up to 510) on a BERT-base saved to a local
  directory, batch 64, mean pooling: ``"sdpa"``, ours (``register()``) and ours
  unpadded (``hf.unpad(model[0].auto_model)``, the one documented line), the
  sentences in random order and pre-sorted by length (``encode`` sorts each call's
  sentences itself; the input order decides nothing else). Seconds per encode,
  max |diff| of the embeddings.
* ``st_train``: a sentence-transformers fine-tuning step as its trainer feeds one:
  BERT-base with attention (and hidden) dropout 0.1, batches of 32 (anchor,
  positive) pairs of sentences in random order (so padded to the longest of each
  batch), mean pooling, in-batch negatives loss (MultipleNegativesRankingLoss),
  backward, fused AdamW (its trainer's default): ``"sdpa"``, ours and ours
  unpadded; ms per step, 8 batches in turn, in rotating rounds.
* ``st_train_compiled`` (not in the default ``--only``): the same step with
  ``"sdpa"`` and ours unpadded each compiled (``torch.compile``, as the trainer's
  ``torch_compile=True``), warmed over every batch first.
* ``st_train_ro`` (not in the default ``--only``): the step as a user runs it with
  CUDA graphs: ``"sdpa"`` and ours unpadded eager, beside ours unpadded with
  ``buckets=True`` and the transformer's forward compiled with
  ``mode="reduce-overhead"`` (``unpad_ro``), and ``"sdpa"`` compiled the same way (``sdpa_ro``); the
  compiled ones warmed over every batch first (their warm-up seconds and the
  packed lengths seen are in the row); ``ST_RO_KEYS=sdpa,unpad_ro`` times some.
* ``full``: rows with no padding at all (BERT-base 64 x 256, BERT-large 32 x 512):
  ``"sdpa"``, ours, ours unpadded (on CUDA also given the mask on the CPU:
  ``unpad_host``), forward ms: what an unpadded model costs where there is
  nothing to remove.

Random weights, bf16 on CUDA (float32 on CPU, where ``--smoke`` checks the
plumbing on tiny sizes). Writes ``unpad.json`` and ``unpad.md`` to ``--out``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host import _rounds, _sentences  # noqa: E402
from env import environment  # noqa: E402
from harness import model_cli  # noqa: E402
from timing import sync  # noqa: E402

from ragged_compile import hf, hf_unpad  # noqa: E402


def _left_padded(b, s, vocab, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None, :] >= (s - lens)[:, None]).long()
    ids = torch.randint(1, vocab, (b, s), generator=g) * mask
    return ids.to(dev), mask.to(dev)


def _time_forwards(row: dict, models: dict, forward, dev, target_s, extra=None) -> None:
    """Each model's forward ms into ``row`` (no grad), ours' speed and max |diff| against
    ``"sdpa"``, printed; ``extra``: more forwards by key, timed beside them."""
    with torch.no_grad():
        fns = {key: (lambda m=m: forward(m)) for key, m in models.items()}
        fns.update(extra or {})
        outs = {key: fn().float() for key, fn in fns.items()}
        for key, times in _rounds(fns, dev, target_s).items():  # rotating rounds: drift hits all alike
            row[f"{key}_ms"] = statistics.median(t[1] for t in times)
    for key in ("ours", "unpad", *(extra or {})):
        row[f"{key}_over_sdpa_speed"] = row["sdpa_ms"] / row[f"{key}_ms"]
        row[f"{key}_max_diff"] = (outs[key] - outs["sdpa"]).abs().max().item()
    print(json.dumps(row), flush=True)


def decoder_rows(dev, dtype, smoke, target_s) -> list[dict]:
    from transformers import Qwen2Config, Qwen2Model

    size = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096)
    if smoke:
        size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=128, max_position_embeddings=256)
    name = hf.register()
    models = {}
    for key, attn in (("sdpa", "sdpa"), ("ours", name), ("unpad", name)):
        torch.manual_seed(0)
        m = Qwen2Model(Qwen2Config(**size, attn_implementation=attn)).to(dev, dtype).eval()
        models[key] = hf.unpad(m) if key == "unpad" else m
    rows = []
    for b, s in ([(4, 16)] if smoke else [(32, 512), (128, 128)]):
        ids, mask = _left_padded(b, s, size["vocab_size"], dev)
        row = {"model": "qwen2-0.5b-style", "batch": b, "length": s, "padding": "left",
               "real_fraction": float(mask.float().mean())}
        _time_forwards(row, models, lambda m: m(input_ids=ids, attention_mask=mask, use_cache=False)
                       .last_hidden_state[:, -1], dev, target_s)
        rows.append(row)
    return rows


def st_rows(dev, dtype, smoke) -> list[dict]:
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    n, batch, words = (64, 16, 500) if smoke else (2048, 64, 30000)
    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if smoke else \
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    texts = _sentences(n, words)
    name = hf.register()
    with tempfile.TemporaryDirectory() as tmp:
        path, vocab = pathlib.Path(tmp) / "model", pathlib.Path(tmp) / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(words)]))
        tok = BertTokenizerFast(vocab_file=str(vocab), model_max_length=512)
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=words + 5, max_position_embeddings=512, attention_probs_dropout_prob=0.0,
                             **size)).save_pretrained(path)
        tok.save_pretrained(path)

        def load(attn):
            t = Transformer(str(path), model_kwargs={"attn_implementation": attn, "dtype": dtype})
            return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode="mean")],
                                          device=str(dev))

        models = {"sdpa": load("sdpa"), "ours": load(name), "unpad": load(name)}
    hf.unpad(models["unpad"][0].auto_model)  # the one line
    orders = {"random": texts, "sorted": sorted(texts, key=len)}
    rows = []
    for order, inputs in orders.items():
        row = {"sentences": n, "batch": batch, "order": order,
               "mean_tokens": sum(len(t.split()) + 2 for t in inputs) / n}
        emb = {}
        for key, m in models.items():
            m.encode(inputs[: 4 * batch], batch_size=batch)  # warm up
            times = []
            for _ in range(1 if smoke else 3):
                sync(dev)
                t0 = time.perf_counter()
                emb[key] = m.encode(inputs, batch_size=batch, convert_to_tensor=True)
                sync(dev)
                times.append(time.perf_counter() - t0)
            row[f"{key}_s"] = min(times)
        for key in ("ours", "unpad"):
            row[f"{key}_over_sdpa_speed"] = row["sdpa_s"] / row[f"{key}_s"]
            row[f"{key}_max_diff"] = (emb[key].float() - emb["sdpa"].float()).abs().max().item()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


ST_TRAIN, ST_TRAIN_SMOKE = (32, 8, 30000), (8, 2, 500)  # pairs a batch, batches, vocabulary words


def _st_model(path_dir, words, size, dropout):
    """A BERT sentence-transformer saved to ``path_dir`` (no hub), and its tokenizer."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path, vocab = pathlib.Path(path_dir) / "model", pathlib.Path(path_dir) / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(words)]))
    tok = BertTokenizerFast(vocab_file=str(vocab), model_max_length=512)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=words + 5, max_position_embeddings=512, attention_probs_dropout_prob=dropout,
                         hidden_dropout_prob=dropout, **size)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def st_train_steps(dev, dtype, smoke, compiled=False, warm: dict | None = None) -> list[tuple]:
    """``(key, step, features)`` for each implementation of the fine-tuning step:
    ``"sdpa"``, ours (not when ``compiled``) and ours unpadded; ``compiled=True``: each
    model compiled (``torch.compile``, as the trainer's ``torch_compile=True`` does),
    warmed over every batch first (a recompile per new length, then dynamic);
    ``compiled="ro"``: the ``st_train_ro`` keys (module docstring). ``warm``: each
    warmed key's warm-up seconds, filled in."""
    warm = {} if warm is None else warm
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:  # releases before the per-model packages
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    pairs, batches, words = ST_TRAIN_SMOKE if smoke else ST_TRAIN
    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if smoke else \
        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    texts = _sentences(2 * pairs * batches, words, seed=1)
    name = hf.register()
    with tempfile.TemporaryDirectory() as tmp:
        path = _st_model(tmp, words, size, 0.1)

        def load(attn):
            t = Transformer(str(path), model_kwargs={"attn_implementation": attn, "dtype": dtype})
            return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode="mean")],
                                          device=str(dev))

        ro = {"sdpa": "sdpa", "unpad": name, "unpad_ro": name, "sdpa_ro": "sdpa"}
        ro = {k: v for k, v in ro.items() if k in os.environ.get("ST_RO_KEYS", ",".join(ro)).split(",")}
        keys = ro if compiled == "ro" else \
            {"sdpa": "sdpa", "unpad": name} if compiled else {"sdpa": "sdpa", "ours": name, "unpad": name}
        models = {key: load(attn) for key, attn in keys.items()}
    for key, m in models.items():
        if key.startswith("unpad"):
            hf.unpad(m[0].auto_model, buckets=key == "unpad_ro")
        if key.endswith("_ro"):
            # the documented line (sentence-transformers calls the model's forward, not the
            # module): the transformer compiled, its CUDA graphs cut at our op
            m[0].auto_model.forward = torch.compile(m[0].auto_model.forward, mode="reduce-overhead")
    steps = []
    for key, m in models.items():
        m.train()
        loss_fn = MultipleNegativesRankingLoss(torch.compile(m) if compiled is True else m)
        # fused: the AdamW sentence-transformers' trainer (transformers' Trainer) runs by
        # default on torch >= 2.8 (optim="adamw_torch_fused")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
        feats = []
        for i in range(batches):
            chunk = texts[2 * pairs * i: 2 * pairs * (i + 1)]
            feats.append([{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in m.tokenize(chunk[j::2]).items()}
                          for j in (0, 1)])
        state = {"i": 0}

        def step(m=m, loss_fn=loss_fn, opt=opt, feats=feats, state=state):
            # fresh dicts, as the trainer's collator gives each step: forward writes its
            # outputs (token_embeddings, ...) into the dict it gets
            f = [dict(x) for x in feats[state["i"] % len(feats)]]
            state["i"] += 1
            loss = loss_fn(f, None)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if compiled is True or key.endswith("_ro"):
            t0 = time.perf_counter()
            for _ in range(2 * batches):
                step()
            sync(dev)
            warm[key] = time.perf_counter() - t0
            print(f"{key}: warmed in {warm[key]:.0f} s", flush=True)
        steps.append((key, step, feats))
    return steps


def st_train_rows(dev, dtype, smoke, compiled=False) -> list[dict]:
    """The fine-tuning step of :func:`st_train_steps`, timed in rotating rounds."""
    pairs, batches, _ = ST_TRAIN_SMOKE if smoke else ST_TRAIN
    warm = {}
    packed_lengths = set()
    real_pack = hf_unpad._pack

    def seen(*a):
        out = real_pack(*a)
        packed_lengths.add(out["call"]["position_ids"].shape[1])
        return out

    hf_unpad._pack = seen
    try:
        steps = st_train_steps(dev, dtype, smoke, compiled, warm)
    finally:
        hf_unpad._pack = real_pack
    models = [key for key, _, _ in steps]
    row = {"model": "bert-base", "compiled": compiled, "pairs_per_batch": pairs, "dropout": 0.1,
           "warmup_s": warm, "packed_lengths_in_warmup": sorted(packed_lengths),
           "real_fraction": sum(float(x["attention_mask"].float().mean()) for f in steps[0][2] for x in f)
           / (2 * batches)}
    said = _Said()
    logging.getLogger("ragged_compile").addHandler(said)
    try:
        for key, times in _rounds({key: step for key, step, _ in steps}, dev, 0.05 if smoke else 4.0).items():
            row[f"{key}_ms"] = statistics.median(t[1] for t in times)  # wall ms a step, median of rotating rounds
    finally:
        logging.getLogger("ragged_compile").removeHandler(said)
    # what ragged_compile said while timing (a message said earlier in the process
    # would not show again)
    row["fallbacks"] = said.lines
    packed, real_pack = [], hf_unpad._pack
    hf_unpad._pack = lambda *a: packed.append(1) or real_pack(*a)
    try:
        for _ in range(2):
            fns = {k: fn for k, fn, _ in steps}
            fns["unpad" if "unpad" in fns else "unpad_ro"]()
    finally:
        hf_unpad._pack = real_pack
    row["unpadded_forwards_packed_of_4"] = len(packed)  # two steps, two forwards (anchors, positives) each
    for key in models:
        row[f"{key}_over_sdpa_speed"] = row["sdpa_ms"] / row[f"{key}_ms"]
    print(json.dumps(row), flush=True)
    return [row]


def full_rows(dev, dtype, smoke, target_s) -> list[dict]:
    from transformers import BertConfig, BertModel

    configs = [("bert-base", 12, 768, 12, 64, 256), ("bert-large", 24, 1024, 16, 32, 512)]
    if smoke:
        configs = [("bert-tiny", 2, 64, 2, 4, 16)]
    name = hf.register()
    rows = []
    for label, layers, hidden, heads, b, s in configs:
        cfg = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                   intermediate_size=4 * hidden, vocab_size=30522, max_position_embeddings=512)
        models = {}
        for key, attn in (("sdpa", "sdpa"), ("ours", name), ("unpad", name)):
            torch.manual_seed(0)
            m = BertModel(BertConfig(**cfg, attn_implementation=attn)).to(dev, dtype).eval()
            models[key] = hf.unpad(m) if key == "unpad" else m
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, cfg["vocab_size"], (b, s), generator=g).to(dev)
        mask = torch.ones(b, s, dtype=torch.long, device=dev)
        row = {"model": label, "batch": b, "length": s, "real_fraction": 1.0}
        extra = {}
        if dev.type == "cuda":  # the mask as the tokenizer gives it: finding nothing to remove reads nothing back
            host_mask = mask.cpu()
            extra["unpad_host"] = lambda m=models["unpad"]: m(input_ids=ids, attention_mask=host_mask).last_hidden_state
        _time_forwards(row, models, lambda m: m(input_ids=ids, attention_mask=mask).last_hidden_state, dev, target_s,
                       extra)
        rows.append(row)
        del models
    return rows


def _speeds(r, unit, digits):
    """The cells every table shares: sdpa, ours, unpadded, and the two speed ratios."""
    ours = [f"{r['ours_' + unit]:.{digits}f}", f"{r['ours_over_sdpa_speed']:.2f}x"] if "ours_" + unit in r else ["", ""]
    unpad = [f"{r['unpad_' + unit]:.{digits}f}", f"{r['unpad_over_sdpa_speed']:.2f}x"] if "unpad_" + unit in r \
        else ["", ""]
    return [f"{r['sdpa_' + unit]:.{digits}f}", ours[0], unpad[0], ours[1], unpad[1]]


def _diff(r):
    return [f"{max(r['ours_max_diff'], r['unpad_max_diff']):.1e}"]


# section: (title, leading columns, their cells of a row, the time unit and digits, with a max diff)
_TABLES = {
    "decoder": ("Qwen2-style 0.5B decoder, left padding, last-token pooling (forward)", ["batch x L", "real tokens"],
                lambda r: [f"{r['batch']} x {r['length']}", f"{r['real_fraction']:.0%}"], ("ms", 2), True),
    "st": ("sentence-transformers encode(), BERT-base, mean pooling", ["sentences", "order"],
           lambda r: [f"{r['sentences']} (mean {r['mean_tokens']:.0f} tokens)", r["order"]], ("s", 3), True),
    "st_train": ("sentence-transformers fine-tuning step, BERT-base, dropout 0.1, in-batch negatives",
                 ["pairs a batch", "real tokens"],
                 lambda r: [str(r["pairs_per_batch"]), f"{r['real_fraction']:.0%}"], ("ms", 2), False),
    "st_train_compiled": ("the same step, each model compiled (torch.compile; ours padded not run)",
                          ["pairs a batch", "real tokens"],
                          lambda r: [str(r["pairs_per_batch"]), f"{r['real_fraction']:.0%}"], ("ms", 2), False),
    "st_train_ro": ("the same step, ours unpadded with buckets=True and compiled with mode=\"reduce-overhead\" "
                    "(`unpad_ro`); `\"sdpa\"` compiled the same way (`sdpa_ro`)", ["pairs a batch", "real tokens"],
                    lambda r: [str(r["pairs_per_batch"]), f"{r['real_fraction']:.0%}"], ("ms", 2), False),
    "full": ("Full rows (no padding), forward", ["model", "batch x L"],
             lambda r: [r["model"], f"{r['batch']} x {r['length']}"], ("ms", 2), True),
}


def _markdown(res: dict) -> str:
    lines = ["# Unpadded end to end: decoders and sentence-transformers", "",
             f"Environment: `{json.dumps(res['environment'])}`", ""]
    for key, (title, lead, cells, (unit, digits), diff) in _TABLES.items():
        if key not in res:
            continue
        cols = lead + [f"sdpa {unit}", f"ours {unit}", f"unpadded {unit}", "ours / sdpa", "unpadded / sdpa"]
        cols += ["max diff"] if diff else []
        lines += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in res[key]:
            lines.append("| " + " | ".join(cells(r) + _speeds(r, unit, digits) + (_diff(r) if diff else [])) + " |")
        hosted = [r for r in res[key] if "unpad_host_ms" in r]
        if hosted:
            lines += ["", "Unpadded, the mask given on the CPU: " + ", ".join(
                f"{r['model']} {r['unpad_host_ms']:.2f} ms ({r['unpad_host_over_sdpa_speed']:.2f}x)" for r in hosted)]
        for r in res[key]:
            ro = [k for k in ("unpad_ro", "sdpa_ro") if f"{k}_ms" in r]
            if ro:
                lines += ["", "Compiled with `mode=\"reduce-overhead\"`: " + ", ".join(
                    f"`{k}` {r[k + '_ms']:.2f} ms ({r[k + '_over_sdpa_speed']:.2f}x `\"sdpa\"` eager, "
                    f"warm-up {r['warmup_s'].get(k, 0):.0f} s)" for k in ro)
                    + f"; packed lengths seen: {r['packed_lengths_in_warmup']}"]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    a, dev, dtype = model_cli(__doc__, "decoder,st,st_train,full")  # and st_train_compiled
    only = set(a.only.split(","))
    res: dict = {"environment": environment(), "device": str(dev), "dtype": str(dtype), "smoke": a.smoke}
    if "decoder" in only:
        res["decoder"] = decoder_rows(dev, dtype, a.smoke, 0.05 if a.smoke else a.target_s)
    if "st" in only:
        res["st"] = st_rows(dev, dtype, a.smoke)
    if "st_train" in only:
        res["st_train"] = st_train_rows(dev, dtype, a.smoke)
    if "st_train_compiled" in only:
        res["st_train_compiled"] = st_train_rows(dev, dtype, a.smoke, compiled=True)
    if "st_train_ro" in only:
        res["st_train_ro"] = st_train_rows(dev, dtype, a.smoke, compiled="ro")
    if "full" in only:
        res["full"] = full_rows(dev, dtype, a.smoke, 0.05 if a.smoke else a.target_s)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "unpad.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "unpad.md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
