"""ragged_compile: ragged (packed, variable-length) attention for torch.compile."""

from .compiler import compile
from .njt import enable
from .ops import ragged_attention
from .reference import reference_attention
from .runtime import Runtime
from .validation import debug_checks, set_debug_checks

__all__ = ["compile", "enable", "ragged_attention", "reference_attention", "Runtime", "debug_checks", "set_debug_checks"]
__version__ = "0.4.0"


def __getattr__(name):
    # ``ragged_compile.testing`` needs Hypothesis (the ``test`` extra): imported on
    # first use, so ``import ragged_compile`` never pulls it in.
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'ragged_compile' has no attribute {name!r}")
