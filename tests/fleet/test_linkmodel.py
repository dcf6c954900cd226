"""The in-process link model: token-bucket arithmetic and replaying a run's bytes (no root needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from noloco.fleet.linkmodel import TokenBucket, predict, step_bytes
from noloco.fleet.netns import parse_duration, parse_rate


def test_rates_and_durations_parse_in_tc_units():
    assert parse_rate("50mbit") == 50e6
    assert parse_rate("500kbit") == 500e3
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("2mbps") == 16e6
    assert parse_duration("20ms") == pytest.approx(0.02)
    assert parse_duration("1.5s") == 1.5
    for bad in ("fast", "-3mbit", "0mbit", "10 parsecs"):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_token_bucket_sends_the_burst_at_once_then_at_the_rate():
    link = TokenBucket(rate_bps=8e6, burst=10_000, latency=0.02)  # 1 MB/s
    assert link.transmit(10_000, at=0.0) == pytest.approx(0.02)  # within the burst: only latency
    assert link.transmit(1_000_000, at=0.0) == pytest.approx(1.0 + 0.02)  # empty bucket: 1 MB at 1 MB/s
    # after 5 s idle the bucket is full again (capped at the burst)
    assert link.transmit(110_000, at=6.0) == pytest.approx(6.0 + 0.1 + 0.02)


def _write_metrics(folder: Path, workers: int, per_round: int, rounds: int, every: int) -> None:
    for worker in range(workers):
        lines, sent, wall = [], 0, 0.0
        for step in range(rounds * every + 1):
            if step and step % every == 0:
                sent += per_round
            wall += 0.01
            lines.append(
                json.dumps({"worker": worker, "step": step, "bytes_sent": sent, "bytes_received": sent, "wall": wall})
            )
        (folder / f"metrics.rank{worker}.jsonl").write_text("\n".join(lines) + "\n")


def test_prediction_is_bytes_over_rate_per_exchange(tmp_path):
    _write_metrics(tmp_path, workers=2, per_round=1_000_000, rounds=5, every=3)
    steps, wall = step_bytes(tmp_path)
    assert sorted(steps) == [3, 6, 9, 12, 15] and wall == pytest.approx(0.16)
    full = predict(tmp_path, 8e6, overhead=1.0, burst=0.0, duplex="full")
    assert full.exchanges == 5 and full.comm_seconds == pytest.approx(5.0)
    half = predict(tmp_path, 8e6, overhead=1.0, burst=0.0, duplex="half")
    assert half.comm_seconds == pytest.approx(10.0)
    slow = predict(tmp_path, 8e6, latency=0.05, phases=2, overhead=1.07, burst=0.0, duplex="full", baseline=tmp_path)
    assert slow.comm_seconds == pytest.approx(5 * (1.07 + 0.1))
    assert slow.wall_seconds == pytest.approx(0.16 + slow.comm_seconds)
    assert slow.bytes_sent == {0: 5_000_000, 1: 5_000_000}


def test_a_folder_without_metrics_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        predict(tmp_path, 8e6)
    with pytest.raises(ValueError):
        predict(tmp_path, 8e6, duplex="simplex")
