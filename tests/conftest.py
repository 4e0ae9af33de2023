from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

import dls

# CI machines have 2 cores; keep each test process to its share and hypothesis deterministic there.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _reset_half_dtype() -> Iterator[None]:
    """Every test starts with the default half dtype, whatever an earlier test chose."""
    previous = dls.get_half_dtype_str()
    dls.set_half_dtype("float16")
    yield
    dls.set_half_dtype(previous)
