"""Run the recompute kernels' checks under Triton's interpreter on the CPU, in a
child process: the interpreter applies to Triton's own library functions only
when TRITON_INTERPRET is set before Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PRELUDE = """
import sys, torch
sys.path.insert(0, {tests!r})
from ragged_compile.backends import segment_backward
segment_backward._kernels_run = lambda device: True
"""


def run_checks(code: str, expect: str) -> None:
    """Run ``code`` (test-module imports and checks) with the kernels forced on; it
    must print ``expect``."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = _PRELUDE.format(tests=os.path.dirname(os.path.abspath(__file__))) + textwrap.dedent(code)
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and expect in done.stdout, done.stderr[-3000:]
