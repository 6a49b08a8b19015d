"""Shared pytest setup for tests/ and fuzz/.

* Hypothesis profiles, picked by ``HYPOTHESIS_PROFILE`` (default ``dev``):
  ``ci`` (derandomized, bounded: the whole fuzz suite in a few minutes on two
  CPU cores), ``dev`` (random, Hypothesis' default budget), ``long``
  (thousands of examples, for soak runs).
* Tests marked ``cuda`` are skipped when no CUDA device is available.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# large_base_example: stateful machines of 50 steps, each drawing a layout, have a
# large minimal input by design.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=300,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    print_blob=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "long", max_examples=3000, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
