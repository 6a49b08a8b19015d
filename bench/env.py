"""The environment a benchmark or GPU run ran in, for its JSON."""

from __future__ import annotations

import platform

import torch


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception as e:  # noqa: BLE001 - record why, whatever it was
        env["flashinfer"] = f"unavailable: {e}"
    try:
        from importlib.metadata import version

        env["flash_attn_4"] = version("flash-attn-4")
    except Exception:  # noqa: BLE001 - not installed
        env["flash_attn_4"] = None
    return env
