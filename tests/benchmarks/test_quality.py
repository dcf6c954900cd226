"""benchmarks.quality end to end on the CPU, shortened: the sweep, the best of each over seeds, the papers' settings;
the report holds what the runs measured, a second call runs nothing again, bad input gets one ``error:`` line."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import quality

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--preset", "tiny", "--methods", "ddp", "noloco", "--codecs", "int4", "--seeds", "0", "1", "--steps", "10",
         "--paper-every", "5", "10", "--parallel", "2"]  # fmt: skip


def _quality(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "benchmarks.quality", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=1200)  # fmt: skip


def test_the_shortened_command_reports_what_its_runs_measured(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    done = _quality(*SHORT, "--runs", str(runs), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("quality.md", "quality.json", "quality.png", "quality-paper.png"):
        assert (out / name).is_file()
    data = json.loads((out / "quality.json").read_text())
    assert data["command"].startswith("python -m benchmarks.quality --preset tiny") and data["missing"] == []
    summaries = {p.parent.name: json.loads(p.read_text()) for p in runs.glob("*/summary.json")}
    # sweep: ddp (1) + noloco at two momenta; best of each: seed 1 more (seed 0 is the sweep's); papers': 3
    assert len(summaries) == 8 and {r["name"] for r in data["runs"]} == set(summaries)
    for run in data["runs"]:
        assert run["final_loss"] == summaries[run["name"]]["final_eval_loss"]
        assert run["bytes"] == summaries[run["name"]]["bytes_sent_per_worker"]
    sweep = [r for r in data["runs"] if r["role"] == "sweep" and r["method"] == "noloco/int4"]
    best = min(sweep, key=lambda r: r["final_loss"])
    assert data["best"]["noloco/int4"] == best["knobs"]
    row = next(r for r in data["bests"] if r["method"] == "noloco/int4")
    seeds = [r for r in data["runs"] if r["method"] == "noloco/int4" and r["knobs"] == best["knobs"]]
    assert sorted(r["seed"] for r in seeds) == row["seeds"] == [0, 1]
    assert row["loss"] == pytest.approx(statistics.fmean(r["final_loss"] for r in seeds))
    assert row["loss_sd"] == pytest.approx(statistics.stdev(r["final_loss"] for r in seeds))
    paper = {r["config"]: r for r in data["paper"]}
    # the papers' settings include their outer momentum, which are no longer the defaults
    assert set(paper) == {"noloco/fp32 outer.every=5 outer.momentum=0.5",
                          "diloco/fp32 outer.every=10 outer.momentum=0.9",
                          "diloco/fp32 outer.every=5 outer.momentum=0.9"}  # fmt: skip
    assert (paper["diloco/fp32 outer.every=10 outer.momentum=0.9"]["bytes"]
            < paper["diloco/fp32 outer.every=5 outer.momentum=0.9"]["bytes"])  # fmt: skip
    text = (out / "quality.md").read_text()
    assert "shortened CPU run" in text and f"{row['loss']:.4f} ± {row['loss_sd']:.4f}" in text
    assert "## At equal bytes sent per worker" in text and "## The papers' comparison" in text

    again = _quality(*SHORT, "--runs", str(runs), "--out", str(out))  # resumable: nothing is trained twice
    assert again.returncode == 0 and "done before, kept" in again.stdout and "== " not in again.stdout
    assert json.loads((out / "quality.json").read_text())["bests"] == data["bests"]


def test_a_missing_corpus_gets_one_error_line(tmp_path):
    done = _quality("--preset", "tiny", "--runs", str(tmp_path), "--out", str(tmp_path), "--",
                    "data.source=files", f"data.path={tmp_path / 'nowhere'}")  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error: data.path=") and done.stderr.count("\n") == 1
    assert "python -m noloco.corpus" in done.stderr


def test_equal_budget_and_target_readings_interpolate_between_evaluations():
    curve = [[0, 0.0, 0.0, 6.0], [10, 100.0, 5.0, 5.0], [20, 200.0, 10.0, 4.0]]
    assert quality.at(curve, 1, 150.0) == pytest.approx(4.5)
    assert quality.at(curve, 2, 50.0) == 4.0  # ended below the budget: its final loss
    assert quality.at(curve[1:], 1, 50.0) is None  # before its first evaluation
    assert quality.to_target(curve, 4.5) == pytest.approx((15, 150.0, 7.5))
    assert quality.to_target(curve, 3.0) is None


def test_the_125m_preset_sweeps_the_narrow_grid_and_a_grid_can_be_named():
    # the library corpus need not be there to print a plan: the runs read the shakespeare corpus instead
    plan = _quality("--preset", "125m", "--methods", "diloco", "noloco", "--dry-run", "--", "data.source=shakespeare")
    assert plan.returncode == 0, plan.stderr
    sweep = [line.split()[1] for line in plan.stdout.splitlines() if line.startswith("sweep ")]
    assert sorted(name.rsplit("-", 2)[0] for name in sweep) == ["diloco-int4-momentum0.1", "diloco-int4-momentum0.3",
                                                          "noloco-int4-momentum0.1",
                                                          "noloco-int4-momentum0.1-group_size4"]  # fmt: skip
    quick = _quality(
        "--preset", "125m", "--methods", "diloco", "--grid", "quick", "--dry-run", "--", "data.source=shakespeare"
    )
    assert sorted(line.split()[1].rsplit("-", 2)[0] for line in quick.stdout.splitlines()
                  if line.startswith("sweep ")) == ["diloco-int4-momentum0.3", "diloco-int4-momentum0.9"]  # fmt: skip
    defaults = _quality("--preset", "125m", "--grid", "defaults", "--dry-run", "--", "data.source=shakespeare")
    assert sorted(line.split()[1].rsplit("-", 2)[0] for line in defaults.stdout.splitlines()
                  if line.startswith("sweep ")) == ["diloco-int4-momentum0.3", "diloco-int4-momentum0.9",
                                                    "noloco-int4-momentum0.1", "noloco-int4-momentum0.5"]  # fmt: skip
