"""Per-worker checkpoints: safetensors for tensors, JSON for the rest, checksummed, validated, written atomically.

Layout::

    runs/<run>/checkpoints/step_000120/worker_0.safetensors   # every stored tensor of the worker's state
    runs/<run>/checkpoints/step_000120/worker_0.json          # the rest, with the tensors' SHA-256
    runs/<run>/checkpoints/step_000120/config.yaml
    runs/<run>/checkpoints/step_000120/COMPLETE               # written once every worker has saved
    runs/<run>/checkpoints/latest -> step_000120               # symlink (a bare name beside it), replaced atomically

A worker's state is a nested structure of dicts, lists, tensors and plain values (model, AdamW
state, LR schedule, algorithm state, byte counters, wall-clock offset, eval history). Tensors go to
safetensors under their path in the structure (``inner_opt/state/3/exp_avg``); the structure itself,
with each tensor replaced by a reference, goes to JSON together with the SHA-256 of the
safetensors file. What can be rebuilt exactly is not stored (``noloco.train.loop.Worker.state``): the
outer algorithm's initial weights φ₀ (rebuilt from ``run.seed``; their SHA-256 is kept to check), the
slow weights before the first outer step (φ = φ₀) and, right after an outer step, the model weights
(θ = φ). AdamW moments, slow weights, momentum and residuals are fp32, as the run holds them.

Every file is written to a temporary name (``.<name>.<pid>.<random>.tmp``), fsynced and renamed, so
a crash mid-write leaves the previous checkpoint intact and ``latest`` pointing at it. Loading is
all-or-nothing: :func:`load_run` reads and checks every worker's state (checksum, JSON structure,
format, step, every tensor finite; with a :class:`Layout`, every entry's type, dtype and shape
against the model, optimizer and algorithm the run builds) before the caller writes anything, and
every malformed checkpoint is one :class:`CheckpointError` line. Pruning removes a checkpoint's
``COMPLETE`` first, so a kill mid-removal leaves an incomplete folder, which the next completed
checkpoint removes (with any stale temporary file).

A second Ctrl-C (``noloco.train.interrupt``) quits at once: :func:`close_writes` refuses every new file, removes
this process's temporary files and its unfinished step folder, and leaves the last complete checkpoint as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from noloco.comm import faults

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
FORMAT = "noloco-checkpoint-2"  # 2: rebuildable entries (φ₀, θ = φ) may be stored as markers
FORMATS = ("noloco-checkpoint-1", FORMAT)
STEP_NAME = re.compile(r"step_(\d{6,})")
# markers of what was not stored: {"__rebuilt__": "slow"} (model weights θ = φ), {"__rebuilt__": "reference"}
# (slow weights φ = φ₀), {"__rebuilt__": "seed", "sha256": ...} (φ₀: the initial weights of run.seed)
REBUILT = "__rebuilt__"
_MAX_DEPTH = 64


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete, damaged or does not match the run."""


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def _step_of(folder: Path) -> int | None:
    match = STEP_NAME.fullmatch(folder.name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------- writing


class _Writes:
    """What this process is writing, so that a second Ctrl-C can remove it (see :func:`hard_exit`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: the signal handler may run in the writing thread
        self.closing = False  # set by hard_exit: no new temporary file or folder from then on
        self.temps: set[str] = set()
        self.dirs: set[str] = set()
        self.folders: set[Path] = set()  # step folders being written, not yet complete
        self.commit = threading.Lock()  # held while COMPLETE, latest and pruning change
        self.commit_owner: int | None = None
        self.commits = False  # this process writes COMPLETE markers (a run's rank 0, a swarm peer)


_WRITES = _Writes()


class Closing(RuntimeError):
    """This process is quitting at once (a second Ctrl-C): no more checkpoint files."""


def atomic_write(path: Path, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write ``data`` (bytes, or an iterable of byte chunks written in turn) to a temporary file beside ``path``,
    fsync it, and rename it onto ``path``."""
    path = Path(path)
    with _WRITES.lock:
        if _WRITES.closing:
            raise Closing(f"not writing {path}: quitting")
        path.parent.mkdir(parents=True, exist_ok=True)
        _WRITES.dirs.add(str(path.parent))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
        _WRITES.temps.add(tmp)
    try:
        with os.fdopen(fd, "wb") as handle:
            for chunk in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        with _WRITES.lock:
            _WRITES.temps.discard(tmp)
        if os.path.exists(tmp):
            os.unlink(tmp)


def flatten(state, tensors: dict[str, torch.Tensor], path: str = ""):
    """Replace every tensor in ``state`` by ``{"__tensor__": key}``, collecting it in ``tensors``."""
    if isinstance(state, torch.Tensor):
        # tied weights (one tensor under two names) are stored once and referenced twice
        for key, saved in tensors.items():
            if (state.numel() and saved.data_ptr() == state.data_ptr() and saved.shape == state.shape
                    and saved.stride() == state.stride() and saved.dtype == state.dtype):  # fmt: skip
                return {"__tensor__": key}
        key = path or "root"
        tensors[key] = state.detach()  # copied to the host one at a time as it is written (safetensors_chunks)
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


class _Malformed(Exception):
    pass


def unflatten(node, tensors: dict[str, torch.Tensor], used: set[str] | None = None, depth: int = 0):
    """The structure :func:`flatten` wrote; :class:`_Malformed` for anything it cannot have written."""
    if depth > _MAX_DEPTH:
        raise _Malformed(f"nested deeper than {_MAX_DEPTH} levels")
    if isinstance(node, dict):
        if len(node) != 1:
            raise _Malformed(f"object with keys {sorted(node)[:4]} (expected one of __tensor__, __dict__, __tuple__)")
        ((marker, value),) = node.items()
        if marker == "__tensor__":
            if not isinstance(value, str) or value not in tensors:
                raise _Malformed(f"reference to a tensor {value!r} the safetensors file does not hold")
            if used is not None:
                used.add(value)
            return tensors[value]
        if marker == "__dict__":
            if not isinstance(value, list):
                raise _Malformed("__dict__ is not a list of [key, value] pairs")
            out = {}
            for item in value:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                        and not isinstance(item[0], bool)):  # fmt: skip
                    raise _Malformed(f"__dict__ entry {str(item)[:60]!r} is not a [key, value] pair")
                out[item[0]] = unflatten(item[1], tensors, used, depth + 1)
            return out
        if marker == "__tuple__":
            if not isinstance(value, list):
                raise _Malformed("__tuple__ is not a list")
            return tuple(unflatten(v, tensors, used, depth + 1) for v in value)
        raise _Malformed(f"unknown marker {marker!r}")
    if isinstance(node, list):
        return [unflatten(v, tensors, used, depth + 1) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise _Malformed(f"value of type {type(node).__name__}")


#: safetensors' names of the dtypes a checkpoint stores
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}  # fmt: skip
#: bytes of the state copied to the host at a time while it is written or hashed
_CHUNK_BYTES = 64 << 20


def _host_bytes(tensor: torch.Tensor) -> Iterable[memoryview]:
    """``tensor``'s bytes in C order, copied to the host (where it is not there) at most 64 MiB at a time."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8) if tensor.numel() else None
    if flat is None:
        return
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        yield memoryview(flat[start : start + _CHUNK_BYTES].cpu().numpy())


def safetensors_chunks(tensors: dict[str, torch.Tensor], sha) -> Iterable[bytes | memoryview]:
    """The safetensors file of ``tensors``, as chunks to write in turn, each added to the hash ``sha``.

    The format's layout (an 8-byte little-endian header length, the JSON header padded with spaces to a
    multiple of 8 bytes, then every tensor's data in the header's order), written with no more than one
    64 MiB chunk of the state on the host at a time. Building the file with safetensors' ``save`` would copy
    the whole state to the host and then again into one ``bytes``: twice a 1.3B worker's 37.7 GB
    (docs/design.md §8). The safetensors library reads the file back (:func:`load_worker`)."""
    header: dict[str, dict] = {}
    offset = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in _ST_DTYPES:
            raise TypeError(f"cannot checkpoint a {tensor.dtype} tensor at {key!r}")
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    for chunk in (len(text).to_bytes(8, "little"), text):
        sha.update(chunk)
        yield chunk
    for tensor in tensors.values():
        for chunk in _host_bytes(tensor):
            sha.update(chunk)
            yield chunk


class DiskFull(CheckpointError):
    """No space left to write a checkpoint; the message says how much it needed and which checkpoint is intact."""


def _disk_full(run_dir: Path, step: int, what: str, need: int) -> DiskFull:
    folder = step_dir(run_dir, step)
    try:
        free = shutil.disk_usage(folder if folder.exists() else Path(run_dir)).free
    except OSError:
        free = 0
    latest = Path(run_dir) / "checkpoints" / "latest"
    try:
        intact = (f"the previous checkpoint (step {resolve(latest)[2]}) is intact: free space and resume with "
                  f"python train.py resume={latest}")  # fmt: skip
    except CheckpointError:
        intact = "there is no earlier complete checkpoint"
    return DiskFull(f"no space left on the disk of {folder} writing {what}: it needs {need / 1e6:,.1f} MB, "
                    f"{free / 1e6:,.1f} MB are free; step {step}'s checkpoint is incomplete, {intact}")  # fmt: skip


def save_worker(run_dir: Path, step: int, rank: int, state: dict) -> Path:
    """Write one worker's state for ``step``; returns the JSON file's path. :class:`DiskFull` (a
    :class:`CheckpointError`) if the disk fills up: the files being written are removed, the previous
    checkpoint is left as it was."""
    folder = step_dir(run_dir, step)
    with _WRITES.lock:
        _WRITES.folders.add(folder)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(state, tensors)
    sha = hashlib.sha256()
    blob = folder / f"worker_{rank}.safetensors"
    try:
        atomic_write(blob, safetensors_chunks(tensors, sha))
        faults.fire("checkpoint.mid", step, rank)
        meta = {"format": FORMAT, "step": step, "rank": rank, "sha256": sha.hexdigest(), "state": skeleton}
        path = folder / f"worker_{rank}.json"
        text = json.dumps(meta).encode()
        atomic_write(path, text)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + len(json.dumps(skeleton))
        raise _disk_full(run_dir, step, f"worker {rank}'s state", need) from None
    return path


def saved(run_dir: Path, step: int) -> None:
    """This process is done with ``step``'s folder (complete or left incomplete by a failed barrier)."""
    with _WRITES.lock:
        _WRITES.folders.discard(step_dir(run_dir, step))


class _Commit:
    """The commit lock (COMPLETE, ``latest``, pruning), refused once this process is quitting."""

    def __enter__(self):
        _WRITES.commit.acquire()
        _WRITES.commit_owner = threading.get_ident()
        if _WRITES.closing:
            _WRITES.commit_owner = None
            _WRITES.commit.release()
            raise Closing("not completing a checkpoint: quitting")
        return self

    def __exit__(self, *exc):
        _WRITES.commit_owner = None
        _WRITES.commit.release()


def mark_complete(run_dir: Path, step: int, config_yaml: str, keep: int) -> Path:
    """Write the config and the COMPLETE marker, move ``latest``, prune old and stale checkpoints."""
    folder = step_dir(run_dir, step)
    with _Commit():
        try:
            atomic_write(folder / "config.yaml", config_yaml.encode())
            atomic_write(folder / COMPLETE, str(step).encode())
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise _disk_full(run_dir, step, "its config.yaml and COMPLETE marker", len(config_yaml) + 16) from None
        latest = folder.parent / "latest"
        tmp_link = folder.parent / f".latest.{os.getpid()}.link.tmp"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        os.symlink(folder.name, tmp_link)
        os.replace(tmp_link, latest)
        saved(run_dir, step)
        prune(folder.parent, step, keep)
    return folder


def prune(root: Path, step: int, keep: int) -> None:
    """After ``step`` completed: keep the ``keep`` newest complete checkpoints (0: all), remove incomplete
    step folders older than ``step`` and every temporary file up to it. Every worker has passed ``step``'s
    barrier, so nothing writes there any more. A checkpoint loses its COMPLETE marker before its files."""
    folders = sorted(((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and not p.is_symlink()
                      and p.is_dir()), key=lambda item: item[0])  # fmt: skip
    complete = [p for s, p in folders if (p / COMPLETE).exists()]
    for old in complete[:-keep] if keep > 0 else []:
        (old / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)
    for s, p in folders:
        if s < step and p.exists() and not (p / COMPLETE).exists():
            shutil.rmtree(p, ignore_errors=True)  # a kill mid-save or mid-prune left it
        elif s <= step and p.exists():
            for stale in p.glob(".*"):
                stale.unlink(missing_ok=True)  # temporary files of killed writers
    for stale in root.glob(".latest.*"):
        if stale.name != f".latest.{os.getpid()}.link.tmp":
            stale.unlink(missing_ok=True)


def bytes_per_worker(run_dir: Path) -> int | None:
    """Mean size on disk of one worker's files (safetensors + JSON) in ``run_dir``'s latest checkpoint."""
    latest = Path(run_dir) / "checkpoints" / "latest"
    try:
        folder, _, _ = resolve(latest)
    except CheckpointError:
        return None
    ranks = worker_ranks(folder)
    if not ranks:
        return None
    sizes = [sum((folder / f"worker_{r}{ext}").stat().st_size for ext in (".json", ".safetensors")) for r in ranks]
    return round(sum(sizes) / len(sizes))


# --------------------------------------------------------------------------------------- reading


def resolve(path: str | os.PathLike, key: str | None = "resume") -> tuple[Path, Path, int]:
    """Return (checkpoint folder, run folder, step) for a path given to ``resume=`` (``key``; None: a path given
    to a command, which errors name as it is): a step folder, or a run folder or its ``checkpoints/`` (their
    ``latest``).

    ``latest`` must be a link to a step folder beside it (a bare ``step_NNNNNN``): a link that leads
    anywhere else (another run's checkpoints, ``..``) is refused, so a resume never writes into or
    prunes another run. The run folder is the one that holds the checkpoint.
    """
    given = Path(path).expanduser()
    if given.name != "checkpoints" and (given / "checkpoints").is_dir() and not given.is_symlink():
        given = given / "checkpoints"  # a run folder
    if given.name == "checkpoints" and given.is_dir() and not given.is_symlink():
        given = given / "latest"
    path = f"{key}={path}" if key else str(path)
    if given.is_symlink():
        target = os.readlink(given)
        if not STEP_NAME.fullmatch(target):
            raise CheckpointError(f"{path}: {given.name} points to {target!r}, not to a step folder beside it "
                                  "in its own checkpoints/ folder; refusing to follow it")  # fmt: skip
        folder = given.parent / target
    elif given.name == "latest":
        if given.exists():
            raise CheckpointError(f"{path}: 'latest' is not a link to a step folder")
        raise CheckpointError(f"{path}: no such checkpoint")
    else:
        folder = given
    if folder.is_symlink():
        raise CheckpointError(f"{path}: {folder.name} is a link; a checkpoint must be a folder of its run")
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    step = _step_of(folder)
    real = folder.resolve()
    if step is None or real.parent.name != "checkpoints":
        raise CheckpointError(f"{path}: not a checkpoint folder (expected <run>/checkpoints/step_NNNNNN)")
    # every link resolved: the folder must be in its own run's checkpoints/ (a checkpoints/ that is a link into
    # another run would resume, write into and prune that run)
    run = Path(os.path.abspath(folder)).parent.parent
    if real != run.resolve() / "checkpoints" / folder.name:
        raise CheckpointError(f"{path}: leads to {real}, outside its run {run} (a link in the way); "
                              "refusing to follow it")  # fmt: skip
    marker = folder / COMPLETE
    if not marker.is_file():
        raise CheckpointError(f"{path}: checkpoint is incomplete (no {COMPLETE} marker)")
    try:
        written = int(marker.read_bytes().decode().strip())
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{marker}: not a step number: the checkpoint is damaged") from None
    if written != step:
        raise CheckpointError(f"{marker}: says step {written}, the folder is step {step}: the checkpoint is damaged")
    return real, real.parent.parent, step


def worker_ranks(folder: Path) -> list[int]:
    """The ranks whose state a checkpoint folder holds (a ``worker_<r>.json``), ascending."""
    ranks = []
    for meta in Path(folder).glob("worker_*.json"):
        suffix = meta.stem.removeprefix("worker_")
        if suffix.isdigit():
            ranks.append(int(suffix))
    return sorted(ranks)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_worker(folder: Path, rank: int, step: int | None = None) -> dict:
    """Read and verify one worker's state; :class:`CheckpointError` (one line) if missing, damaged or malformed.

    Checks the JSON (structure, format, ``step`` and ``rank``), the safetensors file's checksum and
    contents (every tensor referenced exactly as stored, none unreferenced) and that every floating
    tensor is finite. What the tensors must look like for a model is :meth:`Layout.check`.
    """
    meta_path, blob_path = Path(folder) / f"worker_{rank}.json", Path(folder) / f"worker_{rank}.safetensors"
    if not meta_path.is_file() or not blob_path.is_file():
        raise CheckpointError(f"{folder} has no state for worker {rank}")
    try:
        meta = json.loads(meta_path.read_bytes().decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: not a checkpoint (a JSON {type(meta).__name__}, not an object)")
    if meta.get("format") not in FORMATS:
        raise CheckpointError(f"{meta_path}: unknown checkpoint format {str(meta.get('format'))[:80]!r}")
    for key, check in (("step", _is_int), ("rank", _is_int), ("sha256", lambda v: isinstance(v, str)),
                       ("state", lambda v: isinstance(v, dict))):  # fmt: skip
        if not check(meta.get(key)):
            raise CheckpointError(f"{meta_path}: missing or malformed {key!r}")
    if step is not None and meta["step"] != step:
        raise CheckpointError(f"{meta_path}: holds step {meta['step']}, the checkpoint is of step {step}")
    if meta["rank"] != rank:
        raise CheckpointError(f"{meta_path}: holds worker {meta['rank']}, not worker {rank}")
    sha = hashlib.sha256()
    with open(blob_path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            sha.update(chunk)
    if sha.hexdigest() != meta["sha256"]:
        raise CheckpointError(f"{blob_path} does not match its checksum: the checkpoint is damaged")
    try:  # mapped, not read into memory: the state is on the host once (the tensors), not twice
        with safe_open(str(blob_path), framework="pt") as blob:
            tensors = {key: blob.get_tensor(key) for key in blob.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{blob_path}: not a safetensors file ({str(exc).splitlines()[0][:200]})") from None
    used: set[str] = set()
    try:
        state = unflatten(meta["state"], tensors, used)
    except (_Malformed, RecursionError) as exc:
        raise CheckpointError(f"{meta_path}: malformed state: {exc}") from None
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"{blob_path} holds tensors its JSON does not reference: {unused[:3]}")
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{blob_path}: tensor {key} holds NaN or Inf")
    if not isinstance(state, dict):
        raise CheckpointError(f"{meta_path}: the state is a {type(state).__name__}, not an object")
    return state


def state_vocab_size(state: dict) -> int | None:
    """The vocabulary size of the model a worker state was saved from (None where it cannot tell)."""
    vocab = state.get("vocab_size")
    if _is_int(vocab):
        return vocab
    embed = state.get("model", {}).get("embed.weight") if isinstance(state.get("model"), dict) else None
    return int(embed.shape[0]) if isinstance(embed, torch.Tensor) and embed.dim() == 2 else None


def load_run(folder: Path, step: int, ranks: Iterable[int], check: Callable[[dict, int], None] | None = None) -> int:
    """Read and check the state of every one of ``ranks`` (one at a time, so memory holds one worker's state)
    before anything of the run is written; returns the checkpoint's vocabulary size (None if unknown).

    A folder that holds workers the run does not have, or lacks one it has, is refused; ``check(state,
    rank)`` raises :class:`CheckpointError` for a state the run cannot load (see :class:`Layout`).
    """
    ranks = list(ranks)
    present = worker_ranks(folder)
    missing = sorted(set(ranks) - set(present))
    if missing:
        raise CheckpointError(f"{folder} has no state for worker {missing[0]}"
                              + (f" (nor {missing[1:]})" if len(missing) > 1 else ""))  # fmt: skip
    extra = sorted(set(present) - set(ranks))
    if extra:
        raise CheckpointError(f"{folder} holds workers {present}, this run has {len(ranks)} "
                              f"(a resume continues every worker; workers= must match)")  # fmt: skip
    vocab = None
    for rank in ranks:
        state = load_worker(folder, rank, step)
        size = state_vocab_size(state)
        if vocab is not None and size is not None and size != vocab:
            raise CheckpointError(f"{folder}: worker {rank} has a vocabulary of {size}, worker {ranks[0]} of {vocab}")
        vocab = vocab if size is None else size
        if check is not None:
            check(state, rank)
        del state
    return vocab


def checkpoint_vocab_size(folder: Path) -> int | None:
    """The vocabulary size a checkpoint's models have (from its first worker's JSON, or its tensors' header)."""
    ranks = worker_ranks(folder)
    if not ranks:
        return None
    try:
        meta = json.loads((Path(folder) / f"worker_{ranks[0]}.json").read_bytes().decode())
        for key, value in meta["state"]["__dict__"]:
            if key == "vocab_size" and _is_int(value):
                return value
        from safetensors import safe_open

        with safe_open(str(Path(folder) / f"worker_{ranks[0]}.safetensors"), "pt") as blob:
            if "model/embed.weight" in blob.keys():
                return int(blob.get_slice("model/embed.weight").get_shape()[0])
    except Exception:  # noqa: BLE001 - load_run has checked the files; this is a second look only
        return None
    return None


# ------------------------------------------------------------------------- what a state must hold


@dataclass
class Layout:
    """What one worker's checkpoint must hold for the run's model, AdamW and algorithm (shapes fp32).

    Build it with :meth:`of` from the objects the run builds (a model on the ``meta`` device is enough).
    """

    model: dict[str, tuple[int, ...]]  # model.state_dict() entries
    buffers: set[str]  # entries that are not parameters (stored even when the weights are rebuilt)
    opt_shapes: list[tuple[int, ...]]  # AdamW state, per parameter index
    opt_groups: list[list[int]]
    numel: int  # flat parameter count: slow weights, momentum, residuals
    outer: bool  # an outer algorithm (slow weights, rule, φ₀) rather than DDP
    vocab_size: int | None = None
    opt_settings: list[dict] | None = None  # the optimizer's param groups as the run builds them (less params)
    schedule_keys: set[str] | None = None  # the LR schedule's state_dict keys

    @classmethod
    def of(cls, model: torch.nn.Module, opt: torch.optim.Optimizer, outer: bool,
           schedule: torch.optim.lr_scheduler.LRScheduler | None = None) -> Layout:  # fmt: skip
        """``schedule``: the run's LR schedule; with it, every plain value of the optimizer's and the schedule's
        state is checked too (learning rates finite and within the run's, settings the run's own)."""
        params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        entries = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        by_index = [p for group in opt.param_groups for p in group["params"]]
        built = opt.state_dict()["param_groups"]
        groups = [list(g["params"]) for g in built]
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
        settings = None if schedule is None else [{k: v for k, v in g.items() if k != "params"} for g in built]
        keys = None if schedule is None else set(schedule.state_dict())
        return cls(entries, set(entries) - params, [tuple(p.shape) for p in by_index], groups, numel, outer, vocab,
                   settings, keys)  # fmt: skip

    def check(self, state: dict, step: int, where: str = "checkpoint") -> None:
        """:class:`CheckpointError` naming the first entry of ``state`` this run cannot load."""
        try:
            self._check(state, step)
        except _Malformed as exc:
            raise CheckpointError(f"{where}: {exc}") from None

    def _check(self, state: dict, step: int) -> None:
        _keys(state, "state", {"step", "model", "inner_opt", "schedule", "algorithm", "counter", "wall_seconds",
                               "eval_history"}, {"vocab_size", "sampler"})  # fmt: skip
        if "sampler" in state and not isinstance(state["sampler"], dict):
            raise _Malformed("sampler: not a stream position")
        if state["step"] != step or not _is_int(state["step"]):
            raise _Malformed(f"state is of step {state['step']!r}, the checkpoint of step {step}")
        if "vocab_size" in state and state["vocab_size"] != self.vocab_size:
            raise _Malformed(f"model has a vocabulary of {state['vocab_size']!r}, this run's has {self.vocab_size}")
        model = state["model"]
        if isinstance(model, dict) and REBUILT in model:
            if not self.outer or model.get(REBUILT) != "slow":
                raise _Malformed(f"model: cannot rebuild the weights from {model.get(REBUILT)!r}")
            _keys(model, "model", {REBUILT, "buffers"})
            _keys(model["buffers"], "model/buffers", self.buffers)
            for name in self.buffers:
                _tensor(model["buffers"][name], f"model/{name}", self.model[name])
        else:
            _keys(model, "model", set(self.model))
            for name, shape in self.model.items():
                _tensor(model[name], f"model/{name}", shape)
        self._check_optimizer(state["inner_opt"])
        schedule = state["schedule"]
        if not isinstance(schedule, dict) or schedule.get("last_epoch") != step:
            raise _Malformed(f"schedule: not at step {step}")
        if self.opt_settings is not None:
            self._check_schedule(state["inner_opt"]["param_groups"], schedule, step)
        self._check_algorithm(state["algorithm"], step)
        counter = state["counter"]
        if not isinstance(counter, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in counter.items()):
            raise _Malformed("counter: not a mapping of byte counts")
        wall = state["wall_seconds"]
        if not _is_number(wall) or not 0 <= wall <= MAX_SECONDS:
            raise _Malformed(f"wall_seconds: {wall!r} (not a number of seconds in [0, {MAX_SECONDS:.0e}])")
        history = state["eval_history"]
        if not isinstance(history, list) or not all(
            isinstance(h, (list, tuple)) and len(h) == 2 and _is_int(h[0]) and 0 <= h[0] <= step
            and _is_number(h[1]) and 0 <= h[1] <= MAX_LOSS for h in history
        ):  # fmt: skip
            raise _Malformed(f"eval_history: not a list of (step <= {step}, finite loss in [0, {MAX_LOSS:.0e}])")

    def _check_schedule(self, groups: list, schedule: dict, step: int) -> None:
        """Every plain value of the optimizer's param groups and of the LR schedule: the settings (betas, eps,
        weight decay, peak learning rate, flags) are those the run builds from its config, the current learning
        rate is finite and within [0, peak], and the schedule's own fields agree with it."""
        for index, (group, built) in enumerate(zip(groups, self.opt_settings, strict=True)):
            where = f"inner_opt/param_groups/{index}"
            _keys(group, where, set(built) | {"params"})
            for key, expected in built.items():
                value = group[key]
                if key == "lr":
                    peak = group["initial_lr"]
                    if not (_is_number(value) and _is_number(peak) and 0 <= value <= peak):
                        raise _Malformed(f"{where}/lr: {value!r} is not a learning rate in [0, {peak!r}]")
                elif key in ("fused", "foreach"):  # device-dependent (a GPU run's checkpoint resumes on CPU)
                    if value is not None and not isinstance(value, bool):
                        raise _Malformed(f"{where}/{key}: {value!r}, not true, false or null")
                elif not _same(value, expected):
                    hint = " (inner.lr)" if key == "initial_lr" else ""
                    raise _Malformed(f"{where}/{key}: {value!r}, this run builds {expected!r}{hint} from its config "
                                     "(the optimizer's settings do not change on resume)")  # fmt: skip
        n = len(self.opt_settings)
        _keys(schedule, "schedule", self.schedule_keys)
        if schedule["base_lrs"] != [g["initial_lr"] for g in groups]:
            raise _Malformed(f"schedule/base_lrs: {str(schedule['base_lrs'])[:80]}, not the groups' peak rates")
        if not (isinstance(schedule["_last_lr"], list) and len(schedule["_last_lr"]) == n
                and all(a == g["lr"] and _is_number(a) for a, g in zip(schedule["_last_lr"], groups))):  # fmt: skip
            raise _Malformed(f"schedule/_last_lr: {str(schedule['_last_lr'])[:80]}, not the groups' learning rates")
        if schedule["lr_lambdas"] != [None] * n:  # a dict here would be set on the schedule's functions
            raise _Malformed(f"schedule/lr_lambdas: {str(schedule['lr_lambdas'])[:80]}, expected {[None] * n}")
        count = schedule["_step_count"]
        if not (_is_int(count) and 1 <= count <= step + 1):
            raise _Malformed(f"schedule/_step_count: {count!r}, not a step count in [1, {step + 1}]")
        for key in self.schedule_keys - {"base_lrs", "last_epoch", "_last_lr", "lr_lambdas", "_step_count"}:
            if not isinstance(schedule[key], bool):
                raise _Malformed(f"schedule/{key}: {schedule[key]!r}, not true or false")

    def _check_optimizer(self, opt) -> None:
        _keys(opt, "inner_opt", {"state", "param_groups"})
        groups = opt["param_groups"]
        if not isinstance(groups, list) or [g.get("params") if isinstance(g, dict) else None
                                            for g in groups] != self.opt_groups:  # fmt: skip
            raise _Malformed("inner_opt/param_groups: not this model's parameter groups")
        states = opt["state"]
        if not isinstance(states, dict):
            raise _Malformed("inner_opt/state: not a mapping")
        for index, entry in states.items():
            where = f"inner_opt/state/{index}"
            if not _is_int(index) or not 0 <= index < len(self.opt_shapes):
                raise _Malformed(f"{where}: no such parameter")
            _keys(entry, where, {"step", "exp_avg", "exp_avg_sq"}, {"max_exp_avg_sq"})
            _tensor(entry["step"], f"{where}/step", ())
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in entry:
                    _tensor(entry[key], f"{where}/{key}", self.opt_shapes[index])

    def _slice_size(self, part, where: str) -> tuple[int]:
        """The size of a stored slice ``[start, stop)`` of φ (a fragment's exchange, outer.fragments)."""
        if not (isinstance(part, list) and len(part) == 2 and all(_is_int(b) for b in part)
                and 0 <= part[0] < part[1] <= self.numel):  # fmt: skip
            raise _Malformed(f"{where}: not a slice of the {self.numel} parameters")
        return (part[1] - part[0],)

    def _check_in_flight(self, pending) -> None:
        where = "algorithm/in_flight"
        _keys(pending, where, {"round", "snapshot", "info", "mean_delta", "mean_slow", "guarded"},
              {"part", "slow", "share", "rule"})  # fmt: skip
        if not isinstance(pending.get("rule", "delayed"), str):
            raise _Malformed(f"{where}/rule: not the name of an overlap rule")
        size = self._slice_size(pending["part"], f"{where}/part") if "part" in pending else (self.numel,)
        _tensor(pending["snapshot"], f"{where}/snapshot", size)
        for key in ("mean_delta", "mean_slow", "slow"):  # slow and share: the eager rule's
            if pending.get(key) is not None:
                _tensor(pending[key], f"{where}/{key}", size)
        share = pending.get("share")
        if (share is None) != (pending.get("slow") is None) or not (
            share is None or (isinstance(share, float) and 0 < share <= 1)
        ):
            raise _Malformed(f"{where}/share: not a share of a group mean (with the slow weights sent)")
        info = pending["info"]
        _keys(info, f"{where}/info", {"round", "group", "skipped", "rejected"})
        if not (_is_int(pending["round"]) and _is_int(info["round"]) and isinstance(info["group"], list)
                and all(_is_int(g) for g in info["group"]) and _is_int(info["rejected"])
                and (info["skipped"] is None or isinstance(info["skipped"], str))
                and isinstance(pending["guarded"], bool)):  # fmt: skip
            raise _Malformed(f"{where}: not an outer round's exchange")

    def _check_partners(self, partners) -> None:
        if not isinstance(partners, list):
            raise _Malformed("algorithm/partners: not a list")
        for index, entry in enumerate(partners):
            where = f"algorithm/partners/{index}"
            _keys(entry, where, {"part", "delta", "slow"})
            size = self._slice_size(entry["part"], f"{where}/part")
            _tensor(entry["delta"], f"{where}/delta", size)
            if entry["slow"] is not None:
                _tensor(entry["slow"], f"{where}/slow", size)

    def _check_algorithm(self, algo, step: int) -> None:
        n = (self.numel,)
        if not self.outer:
            _keys(algo, "algorithm", {"inner_step", "feedback"})
        else:
            _keys(algo, "algorithm", {"inner_step", "slow", "rule", "reference", "feedback"},
                  {"slow_feedback", "nonfinite_events", "norm_rejections", "in_flight", "partners"})  # fmt: skip
            if algo.get("in_flight") is not None:  # an overlapped round's exchange, finished before the save
                self._check_in_flight(algo["in_flight"])
            if algo.get("partners") is not None:  # the eager overlap's partners' shares not applied yet
                self._check_partners(algo["partners"])
            if isinstance(algo["slow"], dict):  # φ = φ₀
                _keys(algo["slow"], "algorithm/slow", {REBUILT})
                if algo["slow"][REBUILT] != "reference":
                    raise _Malformed("algorithm/slow: cannot rebuild the slow weights from it")
            else:
                _tensor(algo["slow"], "algorithm/slow", n)
            rule = algo["rule"]
            _keys(rule, "algorithm/rule", set(), {"velocity"})
            if rule.get("velocity") is not None:
                _tensor(rule["velocity"], "algorithm/rule/velocity", n)
            reference = algo["reference"]
            if isinstance(reference, dict):
                _keys(reference, "algorithm/reference", {REBUILT, "sha256"})
                if reference[REBUILT] != "seed" or not isinstance(reference["sha256"], str):
                    raise _Malformed("algorithm/reference: cannot rebuild the initial weights from it")
            else:
                _tensor(reference, "algorithm/reference", n)
            if not _is_count(algo.get("nonfinite_events", 0)):
                raise _Malformed("algorithm/nonfinite_events: not a count")
            rejections = algo.get("norm_rejections", {})
            by_rank = rejections.get("by_rank", {}) if isinstance(rejections, dict) else None
            if not (isinstance(rejections, dict) and set(rejections) <= {"contributions", "results", "by_rank"}
                    and all(_is_count(v) for k, v in rejections.items() if k != "by_rank")
                    and isinstance(by_rank, dict) and len(by_rank) <= 2**16
                    and all(isinstance(k, str) and k.isdigit() and _is_count(v)
                            for k, v in by_rank.items())):  # fmt: skip
                raise _Malformed("algorithm/norm_rejections: not a mapping of counts (and of counts by rank)")
        if algo["inner_step"] != step or not _is_int(algo["inner_step"]):
            raise _Malformed(f"algorithm: at inner step {algo['inner_step']!r}, the checkpoint is of step {step}")
        for key in ("feedback", "slow_feedback"):
            feedback = algo.get(key)
            if feedback is None:
                continue
            where = f"algorithm/{key}"
            _keys(feedback, where, {"version", "contribution", "result"})
            if not _is_int(feedback["version"]) or feedback["version"] != 1 or \
                    (feedback["contribution"] is None) != (feedback["result"] is None):
                raise _Malformed(f"{where}: not an error-feedback state")
            for part in ("contribution", "result"):
                if feedback[part] is not None:
                    _tensor(feedback[part], f"{where}/{part}", n)


#: the bounds of plain values in a worker's state: ten years of seconds; a held-out loss (cross-entropy: ln of the
#: vocabulary at the start of a run, under 15 for a vocabulary of a million); counts that fit an int64
MAX_SECONDS = 3.2e8
MAX_LOSS = 1e4


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _same(value, expected) -> bool:
    """``value`` read from a file is ``expected`` (a setting the run builds): same kind, equal."""
    if expected is None or isinstance(expected, bool):
        return value is expected
    if isinstance(expected, (int, float)):
        return _is_number(value) and value == expected
    if isinstance(expected, (list, tuple)):
        return (isinstance(value, (list, tuple)) and len(value) == len(expected)
                and all(_same(v, e) for v, e in zip(value, expected)))  # fmt: skip
    return type(value) is type(expected) and value == expected


def _is_count(value) -> bool:
    return _is_int(value) and 0 <= value < 2**63


def _keys(node, where: str, required: set, optional: Iterable = ()) -> None:
    if not isinstance(node, dict):
        raise _Malformed(f"{where}: a {type(node).__name__}, not a mapping")
    missing, extra = required - set(node), set(node) - required - set(optional)
    if missing:
        raise _Malformed(f"{where}: missing {sorted(map(str, missing))[:3]}")
    if extra:
        raise _Malformed(f"{where}: unexpected {sorted(map(str, extra))[:3]}")


def _tensor(value, where: str, shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise _Malformed(f"{where}: a {type(value).__name__}, not a tensor")
    if value.dtype != torch.float32:
        raise _Malformed(f"{where}: dtype {str(value.dtype).removeprefix('torch.')}, expected float32")
    if tuple(value.shape) != tuple(shape):
        raise _Malformed(f"{where}: shape {tuple(value.shape)}, expected {tuple(shape)}")


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's values (fp32, C order): how a rebuilt tensor is checked against the saved one.
    Hashed 64 MiB at a time (:func:`_host_bytes`), never a host copy of the whole tensor."""
    sha = hashlib.sha256()
    for chunk in _host_bytes(tensor.detach().float()):
        sha.update(chunk)
    return sha.hexdigest()


# ------------------------------------------------------------------------ quitting (a second Ctrl-C)


def remove_temporary_files(run_dir: Path | None = None) -> None:
    """This process's temporary checkpoint files (and, with ``run_dir``, any in its checkpoint folders)."""
    pid = os.getpid()
    with _WRITES.lock:
        for tmp in list(_WRITES.temps):
            Path(tmp).unlink(missing_ok=True)
        for folder in list(_WRITES.dirs):
            for tmp in Path(folder).glob(f".*.{pid}.*.tmp"):
                tmp.unlink(missing_ok=True)
    root = None if run_dir is None else Path(run_dir) / "checkpoints"
    if root is not None and root.is_dir():
        for tmp in [*root.glob(".latest.*"), *root.glob("step_*/.*")]:
            tmp.unlink(missing_ok=True)


def completes_checkpoints() -> None:
    """This process writes COMPLETE markers (so a second Ctrl-C may remove its unfinished step folders)."""
    _WRITES.commits = True


def close_writes() -> None:
    """This process is quitting at once: no new checkpoint file from now on; its temporary files are removed, and
    (where this process completes checkpoints) the step folders it was writing that are not complete."""
    with _WRITES.lock:
        _WRITES.closing = True
        remove_temporary_files()
        unfinished = list(_WRITES.folders)
    if _WRITES.commits and unfinished and _WRITES.commit_owner != threading.get_ident():
        if _WRITES.commit.acquire(timeout=10):  # held until exit: nobody completes a folder being removed
            for folder in unfinished:
                if not (folder / COMPLETE).exists():
                    shutil.rmtree(folder, ignore_errors=True)
