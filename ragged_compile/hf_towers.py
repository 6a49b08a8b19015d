"""The one private part of transformers we rely on: vision/audio towers' cu_seqlens branch.

Supported: transformers >= 5.0, < 6 (read and tested on 5.17 and 5.24).

Vision and audio towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni, Qwen3-ASR
audio, GLM-4V, ... about 30 ``modeling_*.py`` files) do::

    if is_flash_attention_requested(self.config):
        attention_interface(..., cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, ...)
    else:
        # split q/k/v per image/window and call attention once per chunk

The test is ``"flash" in config._attn_implementation``, and a name containing
"flash" is loaded as a FlashAttention hub kernel, so no registered name can
take the first branch. The second costs one attention call (and, on CUDA, one
plan) per image or window per layer, plus a host sync per layer.

What we change: in those modules only (recognised by the source text of that
branch, :data:`PATTERN`), the module-global name ``is_flash_attention_requested``
is wrapped so it also answers True for configs whose implementation is one of
our registered names. Nothing else in transformers sees the wrapper; its other
uses in such a module only silence a "sliding window not implemented"
warning. Modules imported later are patched on import (a meta path finder).
``tests/test_hf.py::test_tower_patch_contract`` fails loudly if transformers
changes the branch.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading

__all__ = ["PATTERN", "install", "patched_modules"]

# Both strings must appear in a module's source for it to be patched.
PATTERN = ("is_flash_attention_requested(self.config)", "cu_seq_lens_q=cu_seqlens")
_NAME = "is_flash_attention_requested"
_PREFIX = "transformers.models."

_names: set[str] = set()
_patched: dict[str, object] = {}
_lock = threading.Lock()
_finder = None


def patched_modules() -> list[str]:
    return sorted(_patched)


def _wrap(original):
    def is_flash_attention_requested(config=None, requested_attention_implementation=None, version=None):
        # Our implementations take the cu_seqlens branch: one ragged call per layer.
        if version is None and requested_attention_implementation is None and config is not None:
            if getattr(config, "_attn_implementation", None) in _names:
                return True
        return original(config, requested_attention_implementation, version)

    is_flash_attention_requested.__wrapped__ = original
    is_flash_attention_requested._ragged_compile = True
    return is_flash_attention_requested


def _is_tower_module(module) -> bool:
    fn = module.__dict__.get(_NAME)
    path = getattr(module, "__file__", None)
    if fn is None or path is None or not path.endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            src = f.read()
    except OSError:
        return False
    return all(p in src for p in PATTERN)


def _patch(module) -> None:
    name = module.__name__
    with _lock:
        if name in _patched:
            return
        fn = module.__dict__.get(_NAME)
        if fn is None or getattr(fn, "_ragged_compile", False) or not _is_tower_module(module):
            return
        setattr(module, _NAME, _wrap(fn))
        _patched[name] = module


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch(module)

    def __getattr__(self, item):  # get_source, get_resource_reader, ...
        return getattr(self._loader, item)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches transformers model modules imported after :func:`install`."""

    def find_spec(self, fullname, path, target=None):
        if not (fullname.startswith(_PREFIX) and ".modeling_" in fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install(name: str) -> None:
    """Let towers hand `name` their cu_seqlens: patch loaded modules, watch new ones."""
    global _finder
    _names.add(name)
    with _lock:
        if _finder is None:
            _finder = _Finder()
            sys.meta_path.insert(0, _finder)
    for mod_name, module in list(sys.modules.items()):
        if module is not None and mod_name.startswith(_PREFIX) and ".modeling_" in mod_name:
            _patch(module)
