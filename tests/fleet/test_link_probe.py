"""``benchmarks.link_probe`` on a real 2-host fleet: a message one way and both ways at once through ``tc tbf``.
Needs root, ``ip`` and ``tc`` (CI runs as root); skipped otherwise."""

from __future__ import annotations

import json

import pytest

from benchmarks import link_probe
from noloco.fleet.netns import is_root, list_namespaces, missing_tools


@pytest.mark.skipif(not is_root() or bool(missing_tools()), reason="needs root and iproute2 (ip, tc)")
def test_the_probe_times_a_message_each_way_through_the_shaped_link_and_tears_the_fleet_down(tmp_path):
    before = set(list_namespaces())
    assert link_probe.main(["--rate", "20mbit", "--bursts", "5ms", "--sizes", "250000", "--reps", "3",
                            "--idle", "0.2", "--out", str(tmp_path), "--name", "probe"]) == 0  # fmt: skip
    data = json.loads((tmp_path / "probe.json").read_text())
    rows = data["rows"]
    assert [r["both_ways"] for r in rows] == [False, True] and all(len(r["seconds"]) == 2 for r in rows)
    for r in rows:  # 250 kB at 20 Mbit/s is 0.1 s of payload: not faster than the bucket allows, not stalled
        assert 0.3 < r["efficiency"] < 1.3, r
    assert "| 5 ms | 0.25 MB | both ways |" in (tmp_path / "probe.md").read_text()
    assert set(list_namespaces()) == before  # every namespace it built is gone
