"""``benchmarks.link_probe`` on a real 2-host fleet: a message one way and both ways at once through ``tc tbf``.
Needs root, ``ip`` and ``tc`` (CI runs as root); skipped otherwise."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import link_probe
from noloco.fleet.netns import is_root, list_namespaces, missing_tools


def _own_namespaces() -> set[str]:
    """The namespaces of this process's fleets (``nlc<pid>...``): a test running beside it may build its own."""
    return {name for name in list_namespaces() if name.split("-")[0].split("x")[0] == f"nlc{os.getpid()}"}


@pytest.mark.skipif(not is_root() or bool(missing_tools()), reason="needs root and iproute2 (ip, tc)")
def test_the_probe_times_a_message_each_way_through_the_shaped_link_and_tears_the_fleet_down(tmp_path):
    before = _own_namespaces()
    assert link_probe.main(["--rate", "20mbit", "--bursts", "5ms", "--sizes", "250000", "--reps", "3",
                            "--idle", "0.2", "--out", str(tmp_path), "--name", "probe"]) == 0  # fmt: skip
    data = json.loads((tmp_path / "probe.json").read_text())
    rows = data["rows"]
    assert [r["both_ways"] for r in rows] == [False, True] and all(len(r["seconds"]) == 2 for r in rows)
    for r in rows:  # 250 kB at 20 Mbit/s is 0.1 s of payload: not faster than the bucket allows, not stalled
        assert 0.3 < r["efficiency"] < 1.3, r
    assert "| 5 ms | 0.25 MB | both ways |" in (tmp_path / "probe.md").read_text()
    assert _own_namespaces() == before  # every namespace it built is gone


@pytest.mark.skipif(not is_root() or bool(missing_tools()), reason="needs root and iproute2 (ip, tc)")
@pytest.mark.parametrize("pattern", ["ring", "two_phase"])
def test_the_all_reduce_probes_time_their_traffic_among_three_hosts_and_tear_the_fleet_down(tmp_path, pattern):
    before = _own_namespaces()
    flag = "--" + pattern.replace("_", "-")
    assert link_probe.main(["--rate", "20mbit", "--bursts", "5ms", "--sizes", "300000", "--reps", "3", "--idle",
                            "0.2", flag, "3", "--out", str(tmp_path), "--name", "probe"]) == 0  # fmt: skip
    (row,) = json.loads((tmp_path / "probe.json").read_text())["rows"]
    assert row["pattern"] == pattern and row["hosts"] == 3 and len(row["seconds"]) == 2
    # each host sends 2·2/3 of 300 kB (a ring in 4 steps, two-phase in 2 phases to both others at once): 0.16 s
    # of payload at 20 Mbit/s; not faster than the link, not stalled
    assert 0.3 < row["efficiency"] < 1.3, row
    report = (tmp_path / "probe.md").read_text()
    assert "| 5 ms | 0.30 MB |" in report
    assert ("one between every two hosts" in report) == (pattern == "two_phase")
    assert _own_namespaces() == before


def test_a_ring_of_one_host_or_too_many_is_refused_in_one_line(capsys):
    for bad in ("1", "17"):
        with pytest.raises(SystemExit) as exit_info:
            link_probe.main(["--ring", bad])
        assert exit_info.value.code == 2
        assert f"--ring {bad}: a ring of 2 to 16 hosts" in capsys.readouterr().err
        with pytest.raises(SystemExit) as exit_info:
            link_probe.main(["--two-phase", bad])
        assert exit_info.value.code == 2
        assert f"--two-phase {bad}: 2 to 16 hosts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        link_probe.main(["--ring", "3", "--two-phase", "3"])  # one pattern at a time
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
