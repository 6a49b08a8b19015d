"""transformers models on our op vs "sdpa", side by side in one process.

Cases (random weights from configs, bf16 on CUDA):

* vision: Qwen2.5-VL vision tower, 8 layers, hidden 1280, 16 heads of 80, window
  and full blocks, 16 images (~35.8k patches). "sdpa" loops per image/window;
  ours is one ragged call per layer. Target >= 2.5x.
* decoder: ~0.5B Qwen2-style decoder body (24 layers, 14/2 heads of 64), 16
  sequences of 32..2048 tokens: packed on ours (cu_seq_lens kwargs, as
  DataCollatorWithFlattening) vs padded on "sdpa". Target >= 2x tokens/s.
* encoder: BERT-large-style encoder (24 layers, 16 heads of 64) on a padded
  batch of mixed lengths, ours vs "sdpa" on the same padded inputs. Target >= 1x.

Each case checks ours against "sdpa" on the valid tokens (relative error) and
records the runtime's plans and offset reads per forward (CUDA).

    python bench/bench_hf.py --out bench/results/hf.json
    python bench/bench_hf.py --smoke --out /tmp/hf.json             # tiny, any device
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

from env import environment
from layouts import cu_seqlens
from ragged_compile import hf
from timing import call_ms, median, sync


def timed(fn, dev, iters):
    """Median wall ms per call (synchronised) after two warm-up calls, and every time."""
    times = call_ms(fn, dev, iters, warmup=2)
    return median(times), times


def build(cls, cfg, dev, dtype, **kw):
    """A model of random weights on "sdpa", initialised on the device (seconds, not tens of seconds)."""
    torch.manual_seed(0)
    cfg._attn_implementation = "sdpa"
    with dev:
        return cls(cfg, **kw).to(dtype).eval()


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def runtime_stats(dev):
    if dev.type != "cuda":
        return None
    from ragged_compile.runtime import get_runtime

    return dict(get_runtime(dev).stats)


def per_forward(dev, fn):
    """Runtime counters (plans, offset reads, FlashInfer calls) of one forward."""
    before = runtime_stats(dev)
    fn()
    sync(dev)
    after = runtime_stats(dev)
    if before is None:
        return None
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


def side_by_side(model, run_sdpa, run_ours, dev, iters, valid_sdpa=lambda o: o, valid_ours=lambda o: o):
    """"sdpa" then ours on one model: ms per forward, ours' relative error on the
    valid tokens (``valid_*`` pick them from each output), ours' runtime counters."""
    model.set_attn_implementation("sdpa")
    ref = valid_sdpa(run_sdpa())
    ms_sdpa, t_sdpa = timed(run_sdpa, dev, iters)
    model.set_attn_implementation(NAME)
    err = rel_err(valid_ours(run_ours()), ref)
    ms_ours, t_ours = timed(run_ours, dev, iters)
    counters = per_forward(dev, run_ours)
    return {"sdpa_ms": ms_sdpa, "ours_ms": ms_ours, "speedup": ms_sdpa / ms_ours, "rel_err": err,
            "sdpa_times_ms": t_sdpa, "ours_times_ms": t_ours, "ours_runtime_per_forward": counters}


# -- cases ------------------------------------------------------------------------------


def vision_case(dev, dtype, smoke, iters):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    if smoke:
        cfg = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                                     patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                                     fullatt_block_indexes=[1], in_channels=3)
        sizes = [(8, 12), (4, 8), (6, 6)]
    else:
        cfg = Qwen2_5_VLVisionConfig(depth=8, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                     out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                                     window_size=112, fullatt_block_indexes=[3, 7], in_channels=3)
        # 16 images, even grids (the 2x2 merge), 35.8k patches in all.
        sizes = [(64, 48), (36, 52), (72, 40), (28, 28), (56, 56), (40, 60), (48, 48), (24, 72),
                 (60, 44), (32, 40), (68, 52), (44, 36), (52, 64), (20, 36), (64, 64), (36, 28)]
    grid = torch.tensor([[1, h, w] for h, w in sizes], device=dev)
    tokens = int((grid[:, 1] * grid[:, 2]).sum())
    model = build(Qwen2_5_VisionTransformerPretrainedModel, cfg, dev, dtype)
    x = torch.randn(tokens, 3 * 2 * cfg.patch_size ** 2, device=dev, dtype=dtype)

    def run():
        return model(x, grid_thw=grid).pooler_output

    res = side_by_side(model, run, run, dev, iters)
    res.update(images=len(sizes), patches=tokens, layers=cfg.depth, heads=cfg.num_heads,
               head_dim=cfg.hidden_size // cfg.num_heads, target_speedup=2.5)
    return res


def decoder_case(dev, dtype, smoke, iters):
    from transformers import Qwen2Config, Qwen2Model

    if smoke:
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
        lengths = [32, 7, 64, 19]
    else:
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=4096,
                          tie_word_embeddings=True)
        g = torch.Generator().manual_seed(0)
        lengths = [32, 2048] + torch.randint(32, 2049, (14,), generator=g).tolist()
    model = build(Qwen2Model, cfg, dev, dtype)
    n, s = len(lengths), max(lengths)
    total = sum(lengths)
    ids = torch.randint(0, cfg.vocab_size, (total,), device=dev)
    # Padded (right) for "sdpa".
    padded = torch.zeros(n, s, dtype=torch.long, device=dev)
    mask = torch.zeros(n, s, dtype=torch.long, device=dev)
    cu = cu_seqlens(lengths, dev)
    starts = cu.tolist()
    for i, L in enumerate(lengths):
        padded[i, :L] = ids[starts[i]:starts[i + 1]]
        mask[i, :L] = 1
    # Packed for ours, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) builds it.
    pos = torch.cat([torch.arange(L, device=dev) for L in lengths])[None]
    packed = dict(input_ids=ids[None], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=s, max_length_k=s, use_cache=False)

    def run_sdpa():
        return model(input_ids=padded, attention_mask=mask, use_cache=False).last_hidden_state

    def run_ours():
        # Fresh offsets per forward, as a data loader gives: one plan per forward, not a cached one.
        fresh = cu.clone()
        return model(**{**packed, "cu_seq_lens_q": fresh, "cu_seq_lens_k": fresh}).last_hidden_state

    res = side_by_side(model, run_sdpa, run_ours, dev, iters, lambda o: o[mask.bool()], lambda o: o[0])
    res.update(sequences=n, tokens=total, padded_tokens=n * s, lengths=lengths,
               sdpa_tokens_per_s=total / res["sdpa_ms"] * 1e3, ours_tokens_per_s=total / res["ours_ms"] * 1e3,
               params=sum(p.numel() for p in model.parameters()), target_speedup=2.0)
    return res


def encoder_case(dev, dtype, smoke, iters):
    from transformers import BertConfig, BertModel

    if smoke:
        cfg = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=128)
        lengths = [16, 3, 40, 9]
    else:
        cfg = BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         intermediate_size=4096, max_position_embeddings=512)
        g = torch.Generator().manual_seed(1)
        lengths = [512, 16] + torch.randint(16, 513, (30,), generator=g).tolist()
    model = build(BertModel, cfg, dev, dtype, add_pooling_layer=False)
    n, s = len(lengths), max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (n, s), device=dev)
    mask = (torch.arange(s, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None]).long()

    def run():
        # A fresh mask per forward, as a data loader gives (no layout cached across forwards).
        return model(input_ids=ids, attention_mask=mask.clone()).last_hidden_state

    res = side_by_side(model, run, run, dev, iters, lambda o: o[mask.bool()], lambda o: o[mask.bool()])
    res.update(batch=n, seq=s, tokens=sum(lengths), padding_fraction=1 - sum(lengths) / (n * s),
               target_speedup=1.0)
    return res


NAME = None


def main():
    global NAME
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny models: check the script runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", default="vision,decoder,encoder")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    NAME = hf.register()
    import transformers

    env = environment()
    env["transformers"] = transformers.__version__
    result = {"environment": env, "device": str(dev), "dtype": str(dtype), "smoke": args.smoke, "cases": {}}
    t_start = time.perf_counter()
    for case in args.cases.split(","):
        fn = {"vision": vision_case, "decoder": decoder_case, "encoder": encoder_case}[case]
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                res = fn(dev, dtype, args.smoke, args.iters)
        except Exception as e:  # noqa: BLE001 - record and go on to the next case
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        res["case_seconds"] = time.perf_counter() - t0
        result["cases"][case] = res
        summary = {k: res[k] for k in ("sdpa_ms", "ours_ms", "speedup", "rel_err", "error") if k in res}
        print(case, json.dumps(summary), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result["total_seconds"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
