"""What keeping segments independent costs flash-attn-4's backward, side by side in
one process: per layout, the attention backward alone (ms):

* ``fa4_natural``: FA4's kernel on the packed layout as it is, no isolation (a NaN
  in one segment can reach its neighbour's gradients): the floor;
* ``fa4_copies`` / ``fa4_fused``: ``fa4_backward.backward`` with its isolation
  layout written by PyTorch's copies and by the fused Triton gather
  (``RAGGED_COMPILE_FA4_PAD``), and the padding alone (``pad_copies`` /
  ``pad_fused``: both sides in, gradients out);
* ``fa4_redo``: isolation by recompute (``RAGGED_COMPILE_FA4_PAD=redo``): the
  natural layout, then FlashAttention-2 over the segments whose gradients came
  out non-finite (none here: its cost when there is nothing to redo);
* ``fa2``: PyTorch's FlashAttention-2 backward, which needs no isolation.

Every row checks the fused gradients equal the copies' bit for bit. Needs CUDA,
flash-attn-4 and triton. Writes ``isolation.json`` / ``isolation.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from env import environment  # noqa: E402
from layouts import LAYOUT_SPECS, Case  # noqa: E402
from timing import time_fn  # noqa: E402

from ragged_compile import config  # noqa: E402
from ragged_compile.backends import fa4_backward, flash_backward, tile_pad  # noqa: E402

LAYOUTS = ("short250", "short250_causal", "vit42", "vit42_causal", "mixed16", "mixed16_causal", "long4x8192",
           "gqa32_8")


@contextlib.contextmanager
def pad_mode(mode: str):
    old = os.environ.get(config.FA4_PAD)
    os.environ[config.FA4_PAD] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(config.FA4_PAD, None)
        else:
            os.environ[config.FA4_PAD] = old


def row_for(name, dev, reps) -> dict:
    spec = {s[0]: s for s in LAYOUT_SPECS}[name]
    c = Case(*spec, dev=dev, smoke=False, seed=3)
    q, k, v, cu, causal, scale = c.q, c.k, c.v, c.cu, c.causal, c.scale
    out, lse = flash_backward.forward(q, k, v, cu, cu, c.max_len, c.max_len, causal, scale)
    go = torch.randn_like(out)
    dp = fa4_backward.fa4_head_dim(c.d)
    tile_m, tile_n = fa4_backward._tiles(dp, causal)
    fns = {
        "fa4_natural": lambda: fa4_backward._kernel(
            q, k, v, out, go, lse, softmax_scale=scale, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu),
        "fa2": lambda: flash_backward.backward(go, q, k, v, out, lse, cu, cu, c.max_len, c.max_len, causal, scale),
    }

    def padding():
        lq, lk = tile_pad.layout(cu, c.total, tile_m), tile_pad.layout(cu, c.total, tile_n)
        qp, op, gp = tile_pad.pad_rows((q, out, go), lq, dp)
        kp, vp = tile_pad.pad_rows((k, v), lk, dp)
        tile_pad.pad_lse(lse, lq)
        tile_pad.unpad_rows((qp,), lq, c.d)
        return tile_pad.unpad_rows((kp, vp), lk, c.d)

    row = {"layout": name, "segments": c.n, "tokens": c.total, "hq": c.hq, "hkv": c.hkv, "d": c.d, "causal": causal}
    grads = {}
    lens = (c.max_len, c.max_len)
    for mode in ("copies", "fused", "redo"):
        with pad_mode(mode):
            fns[f"fa4_{mode}"] = lambda: fa4_backward.backward(go, q, k, v, out, lse, cu, cu, causal, scale, lens)
            if mode != "redo":
                fns[f"pad_{mode}"] = padding
            grads[mode] = fns[f"fa4_{mode}"]()
            if mode == "copies":  # FA4's atomics: two runs of one layout differ in their last bits
                grads["copies_again"] = fns["fa4_copies"]()
            for key in (f"fa4_{mode}", f"pad_{mode}"):
                if key in fns:
                    row[f"{key}_ms"] = time_fn(fns[key], dev, warmup=2, min_reps=reps)["ms"]
    for key in ("fa4_natural", "fa2"):
        try:
            row[f"{key}_ms"] = time_fn(fns[key], dev, warmup=2, min_reps=reps)["ms"]
        except Exception as e:  # noqa: BLE001 - recorded, the others run
            row[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    def diff(a_run, b_run):
        return max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads[a_run], grads[b_run]))

    row["fused_equals_copies"] = all(torch.equal(a, b) for a, b in zip(grads["copies"], grads["fused"]))
    # what the layouts may differ by: the run-to-run difference of one layout
    row["max_diff_fused_vs_copies"], row["max_diff_copies_run_to_run"] = diff("copies", "fused"), diff("copies", "copies_again")
    row["max_diff_redo_vs_copies"] = diff("copies", "redo")
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--only", default=",".join(LAYOUTS))
    a = p.parse_args()
    dev = torch.device("cuda")
    rows = [row_for(name, dev, a.reps) for name in a.only.split(",")]
    res = {"environment": environment(), "rows": rows}
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "isolation.json").write_text(json.dumps(res, indent=1) + "\n")
    cols = ("fa4_natural", "fa4_copies", "fa4_fused", "fa4_redo", "pad_copies", "pad_fused", "fa2")
    lines = ["# flash-attn-4's backward: the cost of isolation", "", f"Environment: `{json.dumps(res['environment'])}`", "",
             "| layout | " + " | ".join(f"{c} ms" for c in cols)
             + " | fused == copies | max diff fused vs copies | max diff redo vs copies | max diff copies run to run |",
             "|---|" + "---|" * (len(cols) + 4)]
    for r in rows:
        cells = [f"{r[c + '_ms']:.3f}" if c + "_ms" in r else "error" for c in cols]
        lines.append(f"| {r['layout']} | " + " | ".join(cells) + f" | {r['fused_equals_copies']} | "
                     f"{r['max_diff_fused_vs_copies']:.2e} | {r['max_diff_redo_vs_copies']:.2e} | "
                     f"{r['max_diff_copies_run_to_run']:.2e} |")
    (out / "isolation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
