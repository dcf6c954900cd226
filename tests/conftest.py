"""Shared pytest set-up.

Triton kernels run on the CPU through Triton's interpreter when no GPU is present: the variable must be
set before anything imports triton, so it is set here, at the top of the first conftest pytest loads.
GPU tests (``-m gpu``) are skipped on machines without CUDA.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The files that take longest on 2 cores, longest first (``--durations``, one file at a time, one worker): they
# start first. With one file per worker (``--dist loadfile``) a long file that starts late is the suite's tail,
# one core idle; longest first, the short files fill in at the end and the two workers finish together. The
# other files follow, the ones with most tests first (what pytest-xdist would do).
# Measured one file at a time on 2 cores (seconds of test time at load 3-20): hostile 994 (since split in two: attacks
# 1-7 about 265 s and 8-10 about 200 s quiet, so that no one file is the suite's tail), docs 573, interrupt 500,
# swarm training 381, streaming 234, overlap fragments 133, triton 88, device 87, peer interrupt 87, lone peer 78,
# files 68, torch backend 64, torchdist 48, fleet on host 40; overlap train about 200 at load 8-12. The straggler's
# one test (8 peers, 55-65 s, its last half-minute mostly one slow peer sleeping) stays last, where it has the cores
# to itself: started first, beside the swarm-training file, that file's four-peer test lost its rounds (one run);
# started mid-suite, its own fast peers were late to most rounds (one run of two). The two hostile files start
# together, one per worker (pytest-xdist hands worker 0 the first file, worker 1 the second); with the docs
# commands second instead, worker 0 running both hostile files beside them, the suite was no faster (15:33 and
# 16:02, against 15:48 in this order).
LONGEST_FIRST = [
    "swarm/test_hostile.py", "swarm/test_hostile_rounds.py", "test_docs_commands.py", "train/test_interrupt.py",
    "swarm/test_swarm_training.py", "train/test_overlap_train.py", "train/test_streaming.py",
    "swarm/test_overlap_fragments.py", "quant/test_triton_kernels.py", "collectives/test_device.py",
    "swarm/test_peer_interrupt.py", "swarm/test_lone_peer.py", "reliability/test_files.py",
    "reliability/test_torch_backend.py", "comm/test_torchdist.py", "docker/test_fleet_on_host.py",
]  # fmt: skip


def pytest_configure(config):
    # pytest-xdist's loadfile scheduler re-sorts files by their number of tests unless told not to: keep the
    # order above (a swarm file of 12 tests outlasts a kernel file of 265)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_of(item) -> str:
    return item.nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_collection_modifyitems(config, items):
    counts = collections.Counter(_file_of(item) for item in items)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # stable: the tests within a file keep their order, files of one count theirs
    items.sort(key=lambda item: (rank.get(_file_of(item), len(rank)), -counts[_file_of(item)]))
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
