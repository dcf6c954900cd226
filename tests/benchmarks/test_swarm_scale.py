"""``benchmarks.swarm_scale --peers-per-core``: each N gets ceil(N / D) of the cores, and asking for more cores
than the process may use is a one-line error before any peer starts."""

from __future__ import annotations

import os

import pytest

from benchmarks.swarm_scale import cores_for, main


def test_each_n_gets_the_same_share_of_the_cores():
    cores = list(range(16))
    assert [len(cores_for(n, 4, cores)) for n in (8, 16, 32, 64)] == [2, 4, 8, 16]
    assert cores_for(9, 4, [7, 3, 5, 1]) == [1, 3, 5]  # ceil(9 / 4) = 3, the lowest of those allowed
    with pytest.raises(ValueError, match="need 17 cores; this process may use 16"):
        cores_for(65, 4, cores)


def test_too_many_cores_is_refused_before_any_peer_starts(capsys, tmp_path):
    allowed = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as exit_:
        main(["--peers", "2", str(4 * allowed + 1), "--peers-per-core", "4", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"--peers-per-core: {4 * allowed + 1} peers at 4 a core need {allowed + 1} cores" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(SystemExit):
        main(["--peers", "2", "--peers-per-core", "-1"])
