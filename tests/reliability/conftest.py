"""Fixtures of the reliability tests: tiny runs, and the fuzz case counts reported at the end of the session."""

from __future__ import annotations

import json
import os

import pytest

from noloco.train.config import SMOKE, load_config

from .fuzzing import ACCEPTED, COUNTS, SCALE


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture
def tiny_config(data_cache, tmp_path):
    """A seconds-long run on the real default corpus, writing under tmp_path."""

    def make(*overrides: str):
        return load_config([*SMOKE, f"data.cache_dir={data_cache}", f"run.dir={tmp_path}", *overrides])

    return make


@pytest.fixture
def tiny_overrides(data_cache, tmp_path):
    """The tiny run's overrides as command-line arguments (for `python train.py ...` subprocesses)."""
    return [*SMOKE, f"data.cache_dir={data_cache}", f"run.dir={tmp_path}"]


def pytest_terminal_summary(terminalreporter):
    if not COUNTS:
        return
    total = sum(COUNTS.values())
    terminalreporter.section("noloco fuzz cases executed")
    terminalreporter.write_line(f"{'decoder':<44} {'cases':>8} {'accepted':>9} {'rejected':>9}")
    for name, count in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{name:<44} {count:>8,} {ACCEPTED[name]:>9,} {count - ACCEPTED[name]:>9,}")
    terminalreporter.write_line(f"{'total':<44} {total:>8,}  (NOLOCO_FUZZ_SCALE={SCALE:g})")
    path = os.environ.get("NOLOCO_FUZZ_REPORT")
    if path:
        with open(path, "w") as handle:
            cases = {name: {"cases": count, "accepted": ACCEPTED[name]} for name, count in sorted(COUNTS.items())}
            json.dump({"scale": SCALE, "total": total, "decoders": cases}, handle, indent=1)
