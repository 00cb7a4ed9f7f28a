"""Test tiers: everything that loads the real model is ``slow`` (skipped by ``pytest -m "not slow"``).

Without a CUDA device, Triton (where installed) runs kernels in its interpreter: ``TRITON_INTERPRET`` must be
set before Triton is first imported (torch's dynamo imports it when transformers loads), hence here, before any
test module; tests/test_column_sums.py runs kvtool's kernels that way on a CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(pytest.mark.slow)
