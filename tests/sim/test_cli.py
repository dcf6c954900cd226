"""``python -m noloco.sim``: bad arguments give one ``error:`` line and exit 2; tiny studies write their reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from noloco.sim.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    [],
    ["simulate"],
    ["consensus", "--workers", "0"],
    ["consensus", "--workers", "eight"],
    ["consensus", "--methods", "gossip"],
    ["consensus", "--workers", "6", "--methods", "noloco-g4"],
    ["consensus", "--rounds", "0"],
    ["consensus", "--dim", "30"],
    ["consensus", "--layers", "0"],
    ["consensus", "--lr", "-1"],
    ["consensus", "--vocab-size", "100"],
    ["consensus", "--device", "tpu:7"],
    ["time", "--bandwidth", "fast"],
    ["time", "--rtt", "soon"],
    ["time", "--codec", "int3x"],
    ["time", "--stragglers", "2"],
    ["time", "--workers", "1"],
    ["time", "--workers", "6", "--methods", "noloco-g4"],
    ["time", "--parameters", "0"],
])  # fmt: skip
def test_bad_arguments_give_one_error_line_and_exit_2(argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)] if argv and argv[0] in ("consensus", "time") else argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_is_one_error_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["consensus", "--device", "cuda", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --device cuda: CUDA is not available here"


def test_time_study_writes_its_report(tmp_path):
    assert main(["time", "--workers", "4,8", "--rounds", "2", "--parameters", "100000", "--stragglers", "0.25",
                 "--out", str(tmp_path), "--name", "t"]) == 0  # fmt: skip
    data = json.loads((tmp_path / "t.json").read_text())
    assert {r["workers"] for r in data["rows"]} == {4, 8}
    assert data["calibration"] and data["claim"]
    text = (tmp_path / "t.md").read_text()
    assert "python -m noloco.sim time" in text and "| 8 | swarm-g2 |" in text
    assert (tmp_path / "t.png").stat().st_size > 0


def test_consensus_study_runs_as_a_module_and_writes_its_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "noloco.sim", "consensus", "--workers", "4", "--methods", "noloco-g2", "diloco",
         "--rounds", "2", "--every", "1", "--eval-batches", "1", "--relax-rounds", "3", "--dim", "16",
         "--layers", "1", "--averaging-workers", "4,8", "--averaging-trials", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "consensus.json").read_text())
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"noloco-g2", "diloco"}
    for run in runs.values():
        assert [h["round"] for h in run["history"]] == [0, 1, 2]
        assert all(h["eval_loss"] > 0 for h in run["history"])
    assert runs["diloco"]["history"][-1]["spread_slow"] == pytest.approx(0.0, abs=1e-7)  # one mean for everyone
    assert runs["noloco-g2"]["history"][-1]["spread_fast"] > 0
    assert {(r["workers"], r["group_size"]) for r in data["averaging"]} >= {(4, 2), (8, 2), (8, 4), (4, 4)}
    for png in ("consensus-spread.png", "consensus-eval-loss.png"):
        assert (tmp_path / png).stat().st_size > 0
