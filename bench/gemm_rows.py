"""cuBLAS time of the encoder's four Linear layers against the row count M.

    python bench/gemm_rows.py [--out DIR]

Graph mode runs the model on a bucket's ceiling of rows, not the batch's own
count, and cuBLAS picks its kernel by M: this sweep shows which ceilings are
cheap (bf16, d=2048, MLP x4, as in bench_cudagraph.py). Writes
DIR/gemm_rows.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from env import environment  # noqa: E402
from timing import time_fn  # noqa: E402

SHAPES = {"qkv": (2048, 6144), "o": (2048, 2048), "mlp_in": (2048, 8192), "mlp_out": (8192, 2048)}
ROWS = [33792, 33864, 33993, 34000, 34048, 34176, 34304, 34560, 34816, 35000, 35328, 35840, 36864]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    layers = {n: torch.nn.Linear(i, o).to("cuda", torch.bfloat16) for n, (i, o) in SHAPES.items()}
    rows = []
    with torch.no_grad():
        for m in ROWS:
            row = {"M": m}
            for n, lin in layers.items():
                x = torch.randn(m, lin.in_features, device="cuda", dtype=torch.bfloat16)
                row[n] = round(time_fn(lambda: lin(x), "cuda", min_reps=20)["mean_ms"], 4)
            row["sum"] = round(sum(row[n] for n in SHAPES), 4)
            row["sum_per_1k_rows"] = round(row["sum"] / m * 1000, 5)
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_rows.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
