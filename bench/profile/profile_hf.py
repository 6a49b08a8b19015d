"""Where a padded BERT forward's time goes: ``"sdpa"``, ours (``register()``),
ours unpadded (``hf.unpad``) and the same batch packed by hand (valid tokens
gathered, position ids restarting per row, ``cu_seq_lens_q/k`` kwargs), per
shape: wall ms back to back, the GPU time of one forward queued behind a sleep
(the host out of the way), the kernels' total and the top kernels, the CUDA
runtime calls per forward (launches, copies, syncs) and Python profiles.

The gap between ``unpad`` and ``hand_packed`` is what unpadding itself costs;
the gap between a row's wall and GPU time is the host's.

    python bench/profile/profile_hf.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_host import _bert, _padded_batch  # noqa: E402
from env import environment  # noqa: E402
from timing import gpu_queued_ms, kernel_times, time_fn  # noqa: E402


def _hand_packed(ids, mask):
    lens = mask.sum(1)
    valid = mask.bool()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lens.cumsum(0)
    pos = (valid.cumsum(1) - 1)[valid][None]
    m = int(lens.max())
    return dict(input_ids=ids[valid][None], position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=m, max_length_k=m)


def _python_profile(fn, dev, calls=20, lines=40) -> str:
    """Python's profiler over ``calls`` forwards, by own time: the host's share, function by function."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf)
    stats.sort_stats("tottime").print_stats(lines)
    # and by cumulative time, our functions and the attention they replace: what a
    # layer's call costs, inclusive
    stats.sort_stats("cumulative").print_stats(r"ragged_compile|flashinfer|sdpa_attention|modeling_bert", lines)
    return buf.getvalue()


def _runtime_calls(fn, steps=3) -> dict:
    """CUDA runtime and driver calls per forward (torch.profiler's CPU-side events
    named ``cuda*``/``cu*``): launches, copies, syncs, events, with their host us.
    A device-to-host copy or a synchronize here is a wait the wall time shows."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    calls = {}
    for ev in prof.key_averages():
        if ev.key.startswith(("cuda", "cu")) and not ev.key.startswith(("cudnn", "cutlass")):
            calls[ev.key] = {"per_forward": ev.count / steps, "host_us_per_forward": ev.cpu_time_total / steps}
    return dict(sorted(calls.items(), key=lambda kv: -kv[1]["host_us_per_forward"]))


def rows(dev, dtype, label, layers, hidden, heads, shapes, low, python_profile=False) -> list[dict]:
    from ragged_compile import hf

    name = hf.register()
    sdpa = _bert(dev, dtype, layers, hidden, heads, "sdpa")
    ours = _bert(dev, dtype, layers, hidden, heads, name)
    ours.load_state_dict(sdpa.state_dict())
    unpadded = hf.unpad(_bert(dev, dtype, layers, hidden, heads, name))
    unpadded.load_state_dict(sdpa.state_dict())
    out = []
    for b, s in shapes:
        ids, mask, lens = _padded_batch(b, s, dev, low=low)
        packed = _hand_packed(ids, mask)
        fns = {
            "sdpa": lambda: sdpa(input_ids=ids, attention_mask=mask).last_hidden_state,
            "ours": lambda: ours(input_ids=ids, attention_mask=mask).last_hidden_state,
            "unpad": lambda: unpadded(input_ids=ids, attention_mask=mask).last_hidden_state,
            "hand_packed": lambda: ours(**packed).last_hidden_state,
        }
        row = {"model": label, "batch": b, "length": s, "real_fraction": float(lens.sum()) / (b * s)}
        with torch.no_grad():
            for k, fn in fns.items():
                t = time_fn(fn, dev, warmup=3, min_reps=10)
                row[k] = {"wall_ms": round(t["wall_ms"], 3)}
                if dev.type == "cuda":
                    row[k].update(gpu_ms=gpu_queued_ms(fn), kernels=kernel_times(fn, steps=3, top=12),
                                  runtime_calls=_runtime_calls(fn))
            want = fns["sdpa"]()[mask.bool()].float()
            for k in ("ours", "unpad"):
                row[k]["max_diff"] = (fns[k]()[mask.bool()].float() - want).abs().max().item()
            row["hand_packed"]["max_diff"] = (fns["hand_packed"]()[0].float() - want).abs().max().item()
            if python_profile:
                for k, fn in fns.items():
                    row[k]["python_profile"] = _python_profile(fn, dev)
        for k in fns:
            row[k + "_speed_over_sdpa"] = round(row["sdpa"]["wall_ms"] / row[k]["wall_ms"], 3)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    res = {"environment": environment()}
    if a.smoke:
        res["rows"] = rows(dev, dtype, "tiny", 2, 64, 2, [(4, 16)], 0.5, python_profile=True)
    else:
        # the host-cost table's shapes (lengths L/2..L), then the unpadding ones (~50% padding)
        res["rows"] = rows(dev, dtype, "bert-base", 12, 768, 12, [(64, 128), (16, 512)], 0.5, python_profile=True)
        res["rows"] += rows(dev, dtype, "bert-large", 24, 1024, 16, [(64, 512)], 0.0)
    path = pathlib.Path(a.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "profile_hf.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
