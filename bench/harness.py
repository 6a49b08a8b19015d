"""What every section of bench_attention.py shares: ragged_compile imported
defensively, logging, error capture (Skip / Unsupported / time budget), JSON
sanitation, runtime statistics and the tolerances that decide "correct"."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
import traceback
from collections import Counter

import torch

from timing import sync

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ragged_compile is imported defensively: if it fails to import (another torch, a
# broken build), the baselines are still measured and every row of ours says why.
try:
    import ragged_compile as rc

    RC_IMPORT_ERROR = None
except Exception as _e:  # noqa: BLE001
    rc = None
    RC_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"
try:
    from ragged_compile.reference import dense_attention, reference_attention
except Exception:  # noqa: BLE001 - the oracle only needs torch: load the file itself
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_rc_reference", os.path.join(ROOT, "ragged_compile", "reference.py")
    )
    _ref = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_ref)
    dense_attention, reference_attention = _ref.dense_attention, _ref.reference_attention


DTYPE = torch.bfloat16
TOL = 2e-2  # max abs diff vs the float32 reference that still counts as correct (bf16)
E2E_REL_TOL = 5e-2  # e2e: max abs diff / max abs value vs ours_packed_eager
T_START = time.perf_counter()
# Known not to run on CPU: tried anyway in --smoke to exercise the plumbing.
CPU_EXPECTED_FAILURES = {
    "varlen_attn": "CUDA only: varlen_attn has no CPU kernel",
    "njt_sdpa_compiled": "NJT SDPA cannot be compiled on CPU (MATH path, no fake kernel)",
    "varlen_compiled": "CUDA only: varlen_attn has no CPU kernel",
}


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - T_START:7.1f}s] {msg}", flush=True)


def err_str(e: BaseException, limit: int = 700) -> str:
    s = f"{type(e).__name__}: {e}".strip()
    return s if len(s) <= limit else s[:limit] + " ...[truncated]"


def tb_tail(limit: int = 1500) -> str:
    s = traceback.format_exc()
    return s[-limit:]


def need_rc(attr: str | None = None):
    """ragged_compile (or one of its attributes), or an error that says why not."""
    if rc is None:
        raise RuntimeError(f"ragged_compile failed to import: {RC_IMPORT_ERROR}")
    if attr is not None and not hasattr(rc, attr):
        raise Skip(f"not available: ragged_compile.{attr} does not exist in this checkout")
    return rc if attr is None else getattr(rc, attr)


class Skip(Exception):
    """Not measured here, with the reason (status "skipped")."""

    status = "skipped"


class Unsupported(Skip):
    """The implementation cannot express this case (status "unsupported")."""

    status = "unsupported"


class Budget:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - T_START)

    def check(self, need: float = 15.0) -> None:
        if self.left() < need:
            raise Skip(f"time budget exhausted ({self.seconds:.0f} s, --time-budget-s)")


@contextlib.contextmanager
def recorded(rec: dict, name: str, dev):
    """Run one measurement into ``rec``: a Skip or an error becomes its status (a
    failure known on CPU a skip), and its wall time and whether CUDA still works
    afterwards are recorded. Nothing raised inside gets out."""
    t0 = time.perf_counter()
    try:
        yield
    except Skip as s:
        rec["status"], rec["reason"] = s.status, str(s)
    except Exception as e:  # noqa: BLE001
        if dev.type != "cuda" and name in CPU_EXPECTED_FAILURES:
            rec["status"] = "skipped"
            rec["reason"] = f"{CPU_EXPECTED_FAILURES[name]} (tried on CPU: {err_str(e, 200)})"
        else:
            rec.update(status="error", error=err_str(e), traceback=tb_tail())
    finally:
        rec["wall_s"] = time.perf_counter() - t0
        try:
            sync(dev)
        except Exception as e:  # noqa: BLE001 - a poisoned CUDA context: say so
            rec["cuda_error_after"] = err_str(e)


def has_kwarg(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def raise_recompile_limits() -> None:
    cfg = torch._dynamo.config
    for name, val in (
        ("recompile_limit", 64),
        ("cache_size_limit", 64),
        ("accumulated_recompile_limit", 1024),
        ("accumulated_cache_size_limit", 1024),
    ):
        if hasattr(cfg, name):
            with contextlib.suppress(Exception):
                setattr(cfg, name, max(int(getattr(cfg, name)), val))


def sanitize(o):
    """JSON-safe copy: non-finite floats become strings, unknown objects repr."""
    if isinstance(o, dict):
        return {str(k): sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize(v) for v in o]
    if isinstance(o, bool) or o is None or isinstance(o, (int, str)):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else str(o)
    if isinstance(o, torch.dtype):
        return str(o)
    try:
        return float(o)
    except Exception:  # noqa: BLE001
        return repr(o)


def all_runtime_stats(extra=()) -> Counter:
    """Sum of stats over every ragged_compile runtime we know of."""
    total: Counter = Counter()
    seen = set()
    rts = list(extra)
    with contextlib.suppress(Exception):
        rts += list(rc.runtime._runtimes.values())
    for rt in rts:
        if id(rt) in seen:
            continue
        seen.add(id(rt))
        with contextlib.suppress(Exception):
            total.update(rt.stats)
    return total


def stats_delta(after: Counter, before: Counter) -> dict:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)}


def auto_backend(dev: torch.device, n: int, total_k: int, **heads) -> str:
    """What ragged_compile's backend="auto" picks for a layout (its own rule if importable);
    ``heads``: hq, hkv, head_dim, causal, as select.flashinfer_backend takes them."""
    from ragged_compile.backends.select import flashinfer_backend

    return flashinfer_backend("auto", dev, n, total_k, **heads)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float().to(a.device)).abs().max().item())


def model_cli(doc: str, only: str):
    """The command line of the model benchmarks (``bench_host``, ``bench_unpad``,
    ``bench_variants``): ``(args, device, dtype)``, bf16 on CUDA, float32 on CPU."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--only", default=only, help=f"comma-separated sections (default {only})")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the plumbing")
    p.add_argument("--target-s", type=float, default=1.0)
    a = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return a, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32

