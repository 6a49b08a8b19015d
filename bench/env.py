"""The environment a benchmark ran in, for its JSON."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import version

import torch


def _version(dist: str):
    try:
        return version(dist)
    except Exception:  # noqa: BLE001 - not installed
        return None


def environment() -> dict:
    cuda = torch.cuda.is_available()
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "flash_attn_4": _version("flash-attn-4"),
        "triton": _version("triton"),
    }
    for name in ("ragged_compile", "flashinfer"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - record why, whatever it was
            env[name] = f"unavailable: {type(e).__name__}: {e}"
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        env["git_commit"] = git.stdout.strip() or None
    except Exception:  # noqa: BLE001 - not a checkout
        env["git_commit"] = None
    return env
