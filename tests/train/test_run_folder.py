"""A run folder holds one run: a new run under the name of an earlier one is refused with one line that names
the choices (resume it, another ``run.name``, ``run.overwrite=true``) and leaves the earlier run byte-identical;
``run.overwrite=true`` deletes the earlier run first, so two runs never mix in one folder. ``resume=`` takes a
run folder (its latest checkpoint), and ``python -m noloco.export`` names the path it was given, not a key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from noloco.comm.torchdist import free_port
from noloco.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, str(ROOT / "train.py")]


def _train(tiny_overrides, *extra: str) -> subprocess.CompletedProcess:
    args = [*tiny_overrides, "workers=2", "threads=1", "outer.every=3", "checkpoint.every=3", "log.plot=false", *extra]
    return subprocess.run([*TRAIN, *args], capture_output=True, text=True, timeout=600)


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: file bytes, link targets, folders."""
    out: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = f"-> {path.readlink()}" if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return out


def _error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    return lines[0]


def test_a_reused_run_name_is_refused_and_the_earlier_run_stays_as_it_was(tiny_overrides, tmp_path):
    first = _train(tiny_overrides, "run.name=mine", "steps=6")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "mine"
    before = _snapshot(run_dir)
    assert any(name.startswith("tensorboard/events.out.tfevents") for name in before)

    for backend in ("local", "torch"):
        line = _error_line(_train(tiny_overrides, "run.name=mine", "steps=3", f"backend={backend}"))
        assert f"resume={run_dir}" in line and "run.name=" in line and "run.overwrite=true" in line, line
        assert _snapshot(run_dir) == before, backend

    # the choice it names: resume=<run folder> continues the run from its latest checkpoint
    resumed = subprocess.run([*TRAIN, f"resume={run_dir}", "steps=9"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max(r["step"] for r in read_metrics(run_dir)) == 9


def test_overwrite_replaces_the_earlier_run_instead_of_mixing_the_two(tiny_overrides, tmp_path):
    assert _train(tiny_overrides, "run.name=mine", "steps=9").returncode == 0
    again = _train(tiny_overrides, "run.name=mine", "steps=3", "run.overwrite=true")
    assert again.returncode == 0, again.stderr[-3000:]
    run_dir = tmp_path / "mine"
    assert max(r["step"] for r in read_metrics(run_dir)) == 3  # the new run's records only
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000003"]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1


@pytest.mark.slow
def test_a_torchrun_rank_refuses_a_reused_run_name_on_every_rank(tiny_overrides, tmp_path):
    """Under torchrun (as in a fleet) rank 0 checks the folder and every rank refuses with its line."""
    assert _train(tiny_overrides, "run.name=mine", "steps=3").returncode == 0
    before = _snapshot(tmp_path / "mine")
    args = [*tiny_overrides, "threads=1", "backend=torch", "run.name=mine", "steps=3", "outer.every=3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    done = subprocess.run([*torchrun, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert done.stderr.count("error: run folder") == 2, done.stderr[-3000:]
    assert _snapshot(tmp_path / "mine") == before


def test_export_names_the_path_it_was_given(tiny_overrides, tmp_path):
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "noloco.export", str(tmp_path / "empty" / "checkpoints"), "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "resume=" not in done.stderr and str(tmp_path / "empty" / "checkpoints") in done.stderr, done.stderr


def test_checkpoint_keys_say_what_is_written_and_the_summary_counts_the_disk(tiny_config, tmp_path, capsys):
    """checkpoint.every=0 with checkpoint.final=false writes no checkpoint; final=true only the last step's; the
    summary and the closing table give the bytes the run folder holds."""
    from noloco.train.backends.local import launch
    from noloco.train.run import folder_bytes

    common = ("workers=2", "threads=1", "steps=6", "outer.every=3", "checkpoint.every=0", "log.plot=false")
    none = launch(tiny_config(*common, "checkpoint.final=false", "run.name=none"))
    assert not (tmp_path / "none" / "checkpoints").exists() or not any((tmp_path / "none" / "checkpoints").iterdir())
    assert none["checkpoint_bytes_per_worker"] is None
    summary_bytes = (tmp_path / "none" / "summary.json").stat().st_size
    assert 0 < none["disk_bytes"] == folder_bytes(tmp_path / "none") - summary_bytes
    assert f"({none['disk_bytes'] / 1e6:.1f} MB on disk)" in capsys.readouterr().out

    final = launch(tiny_config(*common, "run.name=final"), quiet=True)
    assert sorted(p.name for p in (tmp_path / "final" / "checkpoints").iterdir()) == ["latest", "step_000006"]
    assert final["disk_bytes"] > none["disk_bytes"] + 2 * final["checkpoint_bytes_per_worker"] * 0.99


def test_the_default_run_name_is_one_folder_even_for_a_top_k_codec(tiny_config, tmp_path):
    from noloco.train.run import default_run_name

    name = default_run_name(tiny_config("comm.codec=topk:64/4096+int2"))
    assert "/" not in name and name.startswith("noloco-topk:64-4096+int2-w")
