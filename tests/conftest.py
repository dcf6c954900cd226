"""Shared pytest set-up.

Triton kernels run on the CPU through Triton's interpreter when no GPU is present: the variable must be
set before anything imports triton, so it is set here, at the top of the first conftest pytest loads.
GPU tests (``-m gpu``) are skipped on machines without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
