"""Every outer round of a run reaches metrics.jsonl, the overlapped run's last one too."""

from __future__ import annotations

import pytest

from noloco.train.backends.local import launch as run
from noloco.train.metrics import read_metrics


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_every_outer_round_is_logged_once_per_worker(tiny_config, tmp_path, overlap):
    cfg = tiny_config("steps=12", "outer.every=4", "workers=2", f"outer.overlap={overlap}", "log.tensorboard=false",
                      f"run.name=r{overlap}")  # fmt: skip
    run(cfg, quiet=True)
    records = read_metrics(tmp_path / f"r{overlap}")
    for worker in (0, 1):
        rounds = [r["outer_round"] for r in records if r["worker"] == worker and "outer_round" in r]
        # with overlap round r is applied at the end of round r + 1: round 1 at step 12, where round 2 lands too
        assert sorted(rounds) == [0, 1, 2], (worker, rounds)
        steps = [r["step"] for r in records if r["worker"] == worker and "loss" in r]
        assert sorted(set(steps)) == list(range(1, 13))
