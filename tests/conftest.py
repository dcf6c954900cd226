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


# The files that take longest on 2 cores (``--durations``: 2-6 minutes of test time each), run first: with one
# file per worker (``--dist loadfile``) a long file that starts last is the suite's tail, one core idle.
# The swarm files wait on peers' timeouts, the Triton file computes: they alternate, so that two swarm files do
# not start side by side.
LONGEST_FIRST = ["swarm/test_hostile.py", "quant/test_triton_kernels.py", "swarm/test_swarm_training.py",
                 "test_docs_commands.py", "train/test_interrupt.py", "train/test_streaming.py"]  # fmt: skip


def _file_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: the other files, and the tests within a file, keep their order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenized-corpus cache for the whole session (building it costs seconds)."""
    return tmp_path_factory.mktemp("data-cache")


# A seconds-long run on the real default corpus: for smoke tests of any backend.
SMOKE = (
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=2",
    "data.vocab_size=512",
    "data.seq_len=32",
    "data.batch_size=4",
    "eval.batches=2",
    "log.progress=false",
    "inner.warmup=5",
)


def _smoke() -> list[str]:
    return list(SMOKE)


@pytest.fixture(scope="session")
def smoke_overrides() -> list[str]:
    """:data:`SMOKE` as a list, for session-scoped fixtures of other folders."""
    return _smoke()


@pytest.fixture
def tiny_config(data_cache, tmp_path):
    """A seconds-long run on the real default corpus, writing under tmp_path."""
    from noloco.train.config import load_config

    def make(*overrides: str):
        return load_config([*_smoke(), f"data.cache_dir={data_cache}", f"run.dir={tmp_path}", *overrides])

    return make


@pytest.fixture
def tiny_overrides(data_cache, tmp_path):
    """The tiny run's overrides as command-line arguments (for `python train.py ...` subprocesses)."""
    return [*_smoke(), f"data.cache_dir={data_cache}", f"run.dir={tmp_path}"]
