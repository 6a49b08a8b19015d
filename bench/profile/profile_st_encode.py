"""Where sentence-transformers ``encode()`` spends its time, batch by batch:
``"sdpa"`` against ours (``hf.register()``), same weights (BERT-base, bf16).

For each batch ``encode()`` would send (sentences sorted by length, batch 64, the
tokenizer's padding to the longest): its padded length, which path our attention
takes (``sdpa``: the small-batch route; ``ragged``: the op on the mask's layout),
and the model's forward wall ms on each implementation, measured in alternating
order. Then whole ``encode()`` calls in rotating rounds, and the model's share of
an encode (the forwards' sum against the encode's wall time).

    python bench/profile/profile_st_encode.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_host import _sentences  # noqa: E402
from env import environment  # noqa: E402
from timing import sync  # noqa: E402

from ragged_compile import hf  # noqa: E402
from ragged_compile.backends import select  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--sentences", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    size = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2) if a.smoke
            else dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12))
    n = 256 if a.smoke else a.sentences
    words = 30000
    texts = _sentences(n, words)
    with tempfile.TemporaryDirectory() as tmp:
        path, vocab = pathlib.Path(tmp) / "model", pathlib.Path(tmp) / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(words)]))
        BertTokenizerFast(vocab_file=str(vocab), model_max_length=512).save_pretrained(path)
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=words + 5, intermediate_size=4 * size["hidden_size"], max_position_embeddings=512,
                             attention_probs_dropout_prob=0.0, **size)).save_pretrained(path)

        def load(attn):
            t = Transformer(str(path), model_kwargs={"attn_implementation": attn, "dtype": dtype})
            return st.SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), pooling_mode="mean")],
                                          device=str(dev))

        models = {"sdpa": load("sdpa"), "ours": load(hf.register())}

    # the batches encode() sends: longest first, as it sorts
    order = sorted(range(n), key=lambda i: -len(texts[i]))
    batches = [[texts[i] for i in order[j:j + a.batch]] for j in range(0, n, a.batch)]
    rows = []
    cfg = models["sdpa"][0].auto_model.config
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    with torch.inference_mode():
        for chunk in batches:
            feats = models["sdpa"].tokenize(chunk)
            feats = {k: v.to(dev) for k, v in feats.items() if isinstance(v, torch.Tensor)}
            b, s = feats["input_ids"].shape
            row = {"batch": b, "length": s, "real": float(feats["attention_mask"].float().mean()),
                   "path": select.padded_kernel(b, s, s, heads, d, False) if dev.type == "cuda" else "cpu"}
            fns = {k: (lambda m=m: m[0].auto_model(**feats)) for k, m in models.items()}
            times = {k: [] for k in fns}
            for fn in fns.values():
                fn()
            for r in range(a.reps):
                for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    sync(dev)
                    t0 = time.perf_counter()
                    fns[k]()
                    sync(dev)
                    times[k].append((time.perf_counter() - t0) * 1e3)
            for k in fns:
                row[f"{k}_ms"] = statistics.median(times[k])
            row["ours_over_sdpa_speed"] = row["sdpa_ms"] / row["ours_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)

    def encode(m):
        sync(dev)
        t0 = time.perf_counter()
        m.encode(texts, batch_size=a.batch, convert_to_tensor=True)
        sync(dev)
        return time.perf_counter() - t0

    for m in models.values():
        encode(m)
    runs = {k: [] for k in models}
    for r in range(2 if a.smoke else a.rounds):
        for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
            runs[k].append(encode(models[k]))
    res = {"environment": environment(), "sentences": n, "batch": a.batch, "batches": rows,
           "encode_s": {k: v for k, v in runs.items()},
           "encode_median_s": {k: statistics.median(v) for k, v in runs.items()},
           "encode_min_s": {k: min(v) for k, v in runs.items()},
           "paired_ratios": [s / o for s, o in zip(runs["sdpa"], runs["ours"])]}
    res["encode_ours_over_sdpa_speed"] = res["encode_median_s"]["sdpa"] / res["encode_median_s"]["ours"]
    for k in models:
        res[f"model_share_{k}"] = sum(r[f"{k}_ms"] for r in rows) / 1e3 / res["encode_median_s"][k]
    by_path = {}
    for r in rows:
        g = by_path.setdefault(r["path"], {"batches": 0, "sdpa_ms": 0.0, "ours_ms": 0.0})
        g["batches"] += 1
        g["sdpa_ms"] += r["sdpa_ms"]
        g["ours_ms"] += r["ours_ms"]
    res["by_path"] = by_path
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_st_encode.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("batches", "environment")}, indent=1))


if __name__ == "__main__":
    main()
