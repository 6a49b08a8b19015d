"""Windowed, soft-capped, sink and dropout attention in transformers models: ours
against the model's best stock path, side by side in one process.

Rows (random weights, bf16 on CUDA; each model 8 layers unless said):

* ``mistral``: a Mistral-style decoder (hidden 2048, 16 heads of 128, GQA 16/8,
  window 4096), prefill of 16 packed documents of 1..16k tokens (``--smoke``:
  tiny), against ``"sdpa"`` on the same documents padded to a batch.
* ``gemma2``: Gemma2-style (soft-cap 50, window 4096 on every other layer),
  padded batch of 16 x 2048 at lengths L/2..L; stock is ``"eager"`` (transformers
  refuses SDPA for soft-capping).
* ``gpt_oss``: gpt-oss-style attention sinks (and windows on every other layer),
  padded 16 x 2048; stock ``"eager"`` (its sinks).
* ``modernbert``: ModernBERT-base (22 layers, local window 128), padded 64 x
  1024 at half padding, against ``"sdpa"``; ours padded and with ``hf.unpad``.
* ``bert_dropout``: a training step (forward, backward, AdamW) of BERT-base with
  attention dropout 0.1 on 64 x 256 at half padding, against ``"sdpa"``.
* ``mistral_train``, ``gemma2_train``, ``gpt_oss_train``: the same training step of
  the models above (64 x 256, lengths L/2..L), ours padded and with ``hf.unpad``,
  against their stock paths; ``gemma2_train_long``: Gemma2's at 8 x 2048.

Each row: forward ms (and a training step where said), max |diff| at valid
positions against stock (dropout rows: none, masks differ). Writes
``variants.json`` and ``variants.md`` to ``--out``.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from env import environment  # noqa: E402
from harness import model_cli  # noqa: E402
from timing import time_fn  # noqa: E402

from ragged_compile import hf  # noqa: E402


def _model(kind, smoke, attn, dev, dtype):
    import transformers as t

    big = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
               intermediate_size=4096, num_hidden_layers=8, vocab_size=32000, max_position_embeddings=32768)
    if smoke:
        big = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                   num_hidden_layers=2, vocab_size=128, max_position_embeddings=512)
    window = 16 if smoke else 4096
    if kind == "mistral":
        cls, cfg = t.MistralForCausalLM, t.MistralConfig(**big, sliding_window=window)
    elif kind == "gemma2":
        cls, cfg = t.Gemma2ForCausalLM, t.Gemma2Config(**big, sliding_window=window, attn_logit_softcapping=50.0,
                                                         query_pre_attn_scalar=big["head_dim"])
    elif kind == "gpt_oss":
        cls, cfg = t.GptOssForCausalLM, t.GptOssConfig(**big, sliding_window=window, num_local_experts=4,
                                                         num_experts_per_tok=2)
    elif kind == "modernbert":
        base = dict(hidden_size=768, num_attention_heads=12, intermediate_size=1152, num_hidden_layers=22,
                    local_attention=128, vocab_size=50368, max_position_embeddings=8192)
        if smoke:
            base = dict(hidden_size=64, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
                        local_attention=8, vocab_size=128, max_position_embeddings=512)
        cls, cfg = t.ModernBertModel, t.ModernBertConfig(**base, pad_token_id=0)
    else:  # bert_dropout
        base = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=12)
        if smoke:
            base = dict(hidden_size=64, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2)
        cls, cfg = t.BertModel, t.BertConfig(**base, vocab_size=30522, attention_probs_dropout_prob=0.1,
                                              hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    model = cls(cfg).to(dev, dtype)
    model.set_attn_implementation(attn)
    return model


def _padded(b, s, vocab, dev, seed=0, low=0.5):
    """Right-padded ids and mask, lengths uniform in ``low * s .. s`` (0.5: ~75% real
    tokens; 0: ~50%, half padding)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, int(s * low)), s + 1, (b,), generator=g)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = (torch.arange(s)[None, :] < lens[:, None]).long()
    return {"input_ids": (ids * mask).to(dev), "attention_mask": mask.to(dev)}


def _out(res):
    return res.logits if hasattr(res, "logits") else res.last_hidden_state


def forward_row(kind, stock, smoke, dev, dtype, target_s, unpad=False):
    name = hf.register()
    models = {"stock": _model(kind, smoke, stock, dev, dtype), "ours": _model(kind, smoke, name, dev, dtype)}
    models["ours"].load_state_dict(models["stock"].state_dict())
    if unpad:
        models["unpad"] = hf.unpad(_model(kind, smoke, name, dev, dtype))
        models["unpad"].load_state_dict(models["stock"].state_dict())
    b, s = ((4, 32) if smoke else {"modernbert": (64, 1024)}.get(kind, (16, 2048)))
    kw = _padded(b, s, models["stock"].config.vocab_size, dev, low=0.0 if kind == "modernbert" else 0.5)
    if kind != "modernbert":
        kw["use_cache"] = False
    valid = kw["attention_mask"].bool()
    row = {"model": kind, "stock_impl": stock, "batch": b, "length": s, "real_tokens": int(valid.sum())}
    outs = {}
    with torch.no_grad():
        for impl, m in models.items():
            m.eval()
            fn = lambda m=m: _out(m(**kw))  # noqa: E731
            outs[impl] = fn().float()
            row[f"{impl}_ms"] = time_fn(fn, dev, warmup=2, min_reps=3, target_s=target_s)["wall_ms"]
    if dtype != torch.float32:
        # how far each bf16 run is from the stock model in float32: a mixture of experts
        # routes by top-k, so rounding alone can send a token to other experts
        ref = _model(kind, smoke, stock, dev, torch.float32)
        ref.load_state_dict(models["stock"].state_dict())
        with torch.no_grad():
            want = _out(ref.eval()(**kw)).float()
        del ref
        for impl in models:
            row[f"{impl}_max_diff_fp32"] = (outs[impl] - want)[valid].abs().max().item()
    for impl in models:
        if impl != "stock":
            row[f"{impl}_over_stock_speed"] = row["stock_ms"] / row[f"{impl}_ms"]
            row[f"{impl}_max_diff_valid"] = (outs[impl] - outs["stock"])[valid].abs().max().item()
    return row


def packed_row(smoke, dev, dtype, target_s):
    """Mistral prefill: ours on the packed documents, stock SDPA on them padded."""
    name = hf.register()
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, (48 if smoke else 16384) + 1, (16,), generator=g).tolist()
    stock, ours = _model("mistral", smoke, "sdpa", dev, dtype), _model("mistral", smoke, name, dev, dtype)
    ours.load_state_dict(stock.state_dict())
    vocab = stock.config.vocab_size
    ids = [torch.randint(1, vocab, (n,), generator=g) for n in lens]
    packed = {"input_ids": torch.cat(ids)[None].to(dev),
              "position_ids": torch.cat([torch.arange(n) for n in lens])[None].to(dev), "use_cache": False}
    padded = _padded(len(lens), max(lens), vocab, dev)
    for i, t in enumerate(ids):
        padded["input_ids"][i, : len(t)] = t.to(dev)
    padded["attention_mask"] = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long().to(dev)
    padded["use_cache"] = False
    row = {"model": "mistral_packed", "stock_impl": "sdpa (padded)", "documents": lens, "tokens": sum(lens)}
    # each side on its own: a failure of one (its traceback kept) still times the other
    for impl, fn in (("ours", lambda: ours(**packed)), ("stock", lambda: stock(**padded))):
        try:
            with torch.no_grad():
                row[f"{impl}_ms"] = time_fn(fn, dev, warmup=1, min_reps=3, target_s=target_s)["wall_ms"]
        except Exception as e:  # noqa: BLE001
            row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row[f"{impl}_traceback"] = traceback.format_exc().splitlines()[-16:]
            if dev.type == "cuda":
                torch.cuda.synchronize()
    if "stock_ms" in row and "ours_ms" in row:
        row["ours_over_stock_speed"] = row["stock_ms"] / row["ours_ms"]
    return row


def train_row(kind, stock, smoke, dev, dtype, target_s, shape=(64, 256)):
    name = hf.register()
    b, s = (4, 32) if smoke else shape
    row = {"model": kind if shape == (64, 256) else f"{kind} {b} x {s}", "stock_impl": stock, "batch": b, "length": s, "step": "forward, backward, AdamW"}
    for impl, attn in (("stock", stock), ("ours", name), ("unpad", name)):
        m = _model(kind, smoke, attn, dev, dtype).train()
        if impl == "unpad":
            hf.unpad(m)
        kw = _padded(b, s, m.config.vocab_size, dev, seed=1)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-5)

        def step(m=m, opt=opt):
            out = _out(m(**kw))
            (out.float() * kw["attention_mask"][..., None]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        row[f"{impl}_ms"] = time_fn(step, dev, warmup=2, min_reps=3, target_s=target_s)["wall_ms"]
    for impl in ("ours", "unpad"):
        row[f"{impl}_over_stock_speed"] = row["stock_ms"] / row[f"{impl}_ms"]
    return row


def main() -> None:
    a, dev, dtype = model_cli(__doc__, "mistral,gemma2,gpt_oss,modernbert,bert_dropout")  # *_train: on request
    target = 0.05 if a.smoke else a.target_s
    rows = []
    jobs = {
        "mistral": [lambda: packed_row(a.smoke, dev, dtype, target),
                    lambda: forward_row("mistral", "sdpa", a.smoke, dev, dtype, target)],
        "gemma2": [lambda: forward_row("gemma2", "eager", a.smoke, dev, dtype, target)],
        "gpt_oss": [lambda: forward_row("gpt_oss", "eager", a.smoke, dev, dtype, target)],
        "modernbert": [lambda: forward_row("modernbert", "sdpa", a.smoke, dev, dtype, target, unpad=True)],
        "bert_dropout": [lambda: train_row("bert_dropout", "sdpa", a.smoke, dev, dtype, target)],
        "mistral_train": [lambda: train_row("mistral", "sdpa", a.smoke, dev, dtype, target)],
        "gemma2_train": [lambda: train_row("gemma2", "eager", a.smoke, dev, dtype, target)],
        "gemma2_train_long": [lambda: train_row("gemma2", "eager", a.smoke, dev, dtype, target, (8, 2048))],
        "gpt_oss_train": [lambda: train_row("gpt_oss", "eager", a.smoke, dev, dtype, target)],
    }
    for kind in a.only.split(","):
        for job in jobs[kind]:
            try:
                rows.append(job())
            except Exception as e:  # noqa: BLE001 - a row that fails is recorded, the others run
                # the innermost frames say which model (stock or ours) and which kernel
                rows.append({"model": kind, "error": f"{type(e).__name__}: {str(e)[:500]}",
                             "traceback": traceback.format_exc().splitlines()[-16:]})
            print(json.dumps(rows[-1]), flush=True)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"environment": environment(), "device": str(dev), "dtype": str(dtype), "smoke": a.smoke, "rows": rows}
    (out / "variants.json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Variants in transformers models: ours against the model's stock path", "",
             f"Environment: `{json.dumps(res['environment'])}`", "",
             "| model | stock | stock ms | ours ms | ours / stock | unpadded ms | unpadded / stock | max diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r.get("error") or r.get("stock_error") or r.get("ours_error")
        if err or "ours_over_stock_speed" not in r:
            fmt = lambda k: "%.2f" % r[k] if k in r else ""  # noqa: E731
            lines.append(f"| {r['model']} | error: {' '.join(str(err).split())[:120]} | {fmt('stock_ms')} | "
                         f"{fmt('ours_ms')} | | | | |")
            continue
        unp, fmt = r.get("unpad_ms"), lambda x, f: "" if x is None else f % x  # noqa: E731
        lines.append(
            f"| {r['model']} | {r['stock_impl']} | {r['stock_ms']:.2f} | {r['ours_ms']:.2f} | "
            f"{r['ours_over_stock_speed']:.2f}x | {fmt(unp, '%.2f')} | {fmt(r.get('unpad_over_stock_speed'), '%.2fx')} | "
            f"{fmt(r.get('ours_max_diff_valid'), '%.1e')} |"
        )
    (out / "variants.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
