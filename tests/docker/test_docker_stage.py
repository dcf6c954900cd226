"""CI's whole Docker stage, ``bash scripts/docker_ci.sh``, end to end from pytest (issue 35): it installs and
starts an engine, builds the base and the image, runs tests/docker/test_engine.py on them (both compose fleets),
tears everything down, checks the host is as it was, and checks a namespace fleet still trains afterwards.

Opt-in (``NOLOCO_DOCKER_STAGE=1``, as root): ``.ci/run`` runs the script itself, once, after the suite, so that
the stage's minutes are not spent twice in CI; this test is the way to run it from pytest elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    if os.environ.get("NOLOCO_DOCKER_STAGE") != "1":
        return ("opt-in with NOLOCO_DOCKER_STAGE=1: .ci/run runs bash scripts/docker_ci.sh itself, once, after the "
                "suite")  # fmt: skip
    if os.geteuid() != 0:
        return "needs root: the stage starts dockerd and restores the host's iptables"
    if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
        return "no dockerd and no apt-get to install Debian's docker.io"
    return None


WHY_NOT = _why_not()


@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_the_docker_stage_builds_runs_both_fleets_and_restores_the_host(tmp_path):
    timings = tmp_path / "timings.tsv"
    env = {**os.environ, "NOLOCO_DOCKER_TIMINGS": str(timings)}
    env.pop("DOCKER_HOST", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "docker_ci.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert "host restored" in done.stdout, done.stdout[-3000:]
    names = {line.split("\t")[0] for line in timings.read_text().splitlines()}
    for name in ("base_build", "image_build_cold", "image_bytes", "fleet_fleet_seconds", "throttled_fleet_seconds",
                 "shaped_rate_measured_bps", "fleet_after", "stage_total"):  # fmt: skip
        assert name in names, (name, sorted(names))
