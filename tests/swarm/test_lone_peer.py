"""A peer alone in its swarm says once why its rounds wait: no ready partner within peer.matchmaking_timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_lone_peer_says_once_why_its_rounds_wait(smoke_overrides, data_cache, tmp_path):
    args = [
        *smoke_overrides,
        f"data.cache_dir={data_cache}",
        f"run.dir={tmp_path}",
        "backend=hivemind",
        "steps=9",
        "outer.every=3",
        "peer.matchmaking_timeout=2",
        "threads=1",
        "log.tensorboard=false",
        "log.plot=false",
    ]
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NOLOCO_RUN_KEY": "a-long-shared-secret-for-tests"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if "found no ready partner" in line]
    assert len(said) == 1 and "peer.matchmaking_timeout=2 s" in said[0], done.stdout[-3000:]
    assert "rounds joined 0/3" in done.stdout
