"""Per-worker checkpoints written atomically, with a ``latest`` pointer that only moves when complete.

Layout::

    runs/<run>/checkpoints/step_000120/worker_0.pt   # model, inner optimizer, LR schedule, algorithm
    runs/<run>/checkpoints/step_000120/worker_1.pt   #   state, byte counters, wall-clock offset
    runs/<run>/checkpoints/step_000120/config.yaml
    runs/<run>/checkpoints/step_000120/COMPLETE      # written once every worker has saved
    runs/<run>/checkpoints/latest -> step_000120      # symlink, replaced atomically

Every file is written to a temporary name, fsynced and renamed, so a crash mid-write leaves the
previous checkpoint intact and ``latest`` pointing at it. Data position needs no state: batches are
a pure function of (seed, worker, step).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

COMPLETE = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete or does not match the run."""


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)``, fsync, and rename onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_worker(run_dir: Path, step: int, rank: int, state: dict) -> Path:
    path = step_dir(run_dir, step) / f"worker_{rank}.pt"
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path


def mark_complete(run_dir: Path, step: int, config_yaml: str, keep: int) -> Path:
    """Write the config and the COMPLETE marker, move ``latest``, prune old checkpoints."""
    folder = step_dir(run_dir, step)
    atomic_write(folder / "config.yaml", lambda tmp: Path(tmp).write_text(config_yaml))
    atomic_write(folder / COMPLETE, lambda tmp: Path(tmp).write_text(str(step)))
    latest = folder.parent / "latest"
    tmp_link = folder.parent / f".latest.{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    os.symlink(folder.name, tmp_link)
    os.replace(tmp_link, latest)
    complete = sorted(p for p in folder.parent.glob("step_*") if (p / COMPLETE).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def resolve(path: str | os.PathLike) -> tuple[Path, Path, int]:
    """Return (checkpoint folder, run folder, step) for a path given to ``resume=``."""
    folder = Path(path).expanduser()
    if folder.is_symlink() or folder.name == "latest":
        if not folder.exists():
            raise CheckpointError(f"resume={path}: no such checkpoint")
        folder = folder.resolve()
    if not folder.is_dir():
        raise CheckpointError(f"resume={path}: no such checkpoint folder")
    if not (folder / COMPLETE).exists():
        raise CheckpointError(f"resume={path}: checkpoint is incomplete (no {COMPLETE} marker)")
    step = int((folder / COMPLETE).read_text().strip())
    return folder, folder.parent.parent, step


def load_worker(folder: Path, rank: int) -> dict:
    path = Path(folder) / f"worker_{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"{folder} has no state for worker {rank}")
    return torch.load(path, map_location="cpu", weights_only=False)
