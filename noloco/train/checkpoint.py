"""Per-worker checkpoints: safetensors for tensors, JSON for the rest, checksummed and written atomically.

Layout::

    runs/<run>/checkpoints/step_000120/worker_0.safetensors   # every tensor of the worker's state
    runs/<run>/checkpoints/step_000120/worker_0.json          # the rest, with the tensors' SHA-256
    runs/<run>/checkpoints/step_000120/config.yaml
    runs/<run>/checkpoints/step_000120/COMPLETE               # written once every worker has saved
    runs/<run>/checkpoints/latest -> step_000120               # symlink, replaced atomically

A worker's state is a nested structure of dicts, lists, tensors and plain values (model, AdamW
state, LR schedule, algorithm state, byte counters, wall-clock offset, eval history). Tensors go to
safetensors under their path in the structure (``inner_opt/state/3/exp_avg``); the structure itself,
with each tensor replaced by a reference, goes to JSON together with the SHA-256 of the
safetensors file. Every file is written to a temporary name, fsynced and renamed, so a crash
mid-write leaves the previous checkpoint intact and ``latest`` pointing at it; loading verifies the
checksum, so a damaged file is refused instead of silently resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from noloco.comm import faults

COMPLETE = "COMPLETE"
FORMAT = "noloco-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete, damaged or does not match the run."""


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, and rename it onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def flatten(state, tensors: dict[str, torch.Tensor], path: str = ""):
    """Replace every tensor in ``state`` by ``{"__tensor__": key}``, collecting it in ``tensors``."""
    if isinstance(state, torch.Tensor):
        # tied weights (one tensor under two names) are stored once and referenced twice
        for key, saved in tensors.items():
            if state.numel() and saved.data_ptr() == state.data_ptr() and saved.shape == state.shape:
                return {"__tensor__": key}
        key = path or "root"
        tensors[key] = state.detach().cpu()
        return {"__tensor__": key}
    if isinstance(state, dict):
        for key in state:
            if not isinstance(key, (str, int)):
                raise TypeError(f"checkpoint keys must be str or int, got {type(key).__name__} at {path!r}")
        # int keys (optimizer state) are kept as int: JSON objects only have str keys
        return {"__dict__": [[k, flatten(v, tensors, f"{path}/{k}" if path else str(k))] for k, v in state.items()]}
    if isinstance(state, (list, tuple)):
        items = [flatten(v, tensors, f"{path}/{i}" if path else str(i)) for i, v in enumerate(state)]
        return {"__tuple__": items} if isinstance(state, tuple) else items
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(f"cannot checkpoint a {type(state).__name__} at {path!r}")


def unflatten(node, tensors: dict[str, torch.Tensor]):
    if isinstance(node, dict):
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__dict__" in node:
            return {k: unflatten(v, tensors) for k, v in node["__dict__"]}
        if "__tuple__" in node:
            return tuple(unflatten(v, tensors) for v in node["__tuple__"])
    if isinstance(node, list):
        return [unflatten(v, tensors) for v in node]
    return node


def save_worker(run_dir: Path, step: int, rank: int, state: dict) -> Path:
    """Write one worker's state for ``step``; returns the JSON file's path."""
    folder = step_dir(run_dir, step)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(state, tensors)
    blob = save_tensors({key: tensor.contiguous() for key, tensor in tensors.items()})
    atomic_write(folder / f"worker_{rank}.safetensors", blob)
    faults.fire("checkpoint.mid", step, rank)
    meta = {"format": FORMAT, "step": step, "rank": rank, "sha256": hashlib.sha256(blob).hexdigest(), "state": skeleton}
    path = folder / f"worker_{rank}.json"
    atomic_write(path, json.dumps(meta).encode())
    return path


def mark_complete(run_dir: Path, step: int, config_yaml: str, keep: int) -> Path:
    """Write the config and the COMPLETE marker, move ``latest``, prune old checkpoints."""
    folder = step_dir(run_dir, step)
    atomic_write(folder / "config.yaml", config_yaml.encode())
    atomic_write(folder / COMPLETE, str(step).encode())
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


def worker_ranks(folder: Path) -> list[int]:
    """The ranks whose state a checkpoint folder holds, ascending."""
    ranks = []
    for meta in Path(folder).glob("worker_*.json"):
        suffix = meta.stem.removeprefix("worker_")
        if suffix.isdigit():
            ranks.append(int(suffix))
    return sorted(ranks)


def load_worker(folder: Path, rank: int) -> dict:
    """Read and verify one worker's state; :class:`CheckpointError` if missing or damaged."""
    meta_path, blob_path = Path(folder) / f"worker_{rank}.json", Path(folder) / f"worker_{rank}.safetensors"
    if not meta_path.exists() or not blob_path.exists():
        raise CheckpointError(f"{folder} has no state for worker {rank}")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: unknown checkpoint format {meta.get('format')!r}")
    blob = blob_path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{blob_path} does not match its checksum: the checkpoint is damaged")
    return unflatten(meta["state"], load_tensors(blob))
