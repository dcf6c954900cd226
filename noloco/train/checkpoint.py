"""Per-worker checkpoints: safetensors for tensors, JSON for the rest, checksummed, written atomically.

Files::

    runs/<run>/checkpoints/step_000120/worker_0.safetensors   # every stored tensor of the worker's state
    runs/<run>/checkpoints/step_000120/worker_0.json          # the rest, with the tensors' checksum
    runs/<run>/checkpoints/step_000120/config.yaml
    runs/<run>/checkpoints/step_000120/COMPLETE               # written once every worker has saved
    runs/<run>/checkpoints/latest -> step_000120               # symlink (a bare name beside it), replaced atomically

A worker's state is a dict of its state owners' ``state_dict()`` (``noloco.train.state.WorkerState``:
model, AdamW state, LR schedule, algorithm state, byte counters, wall-clock offset, eval history, a
stream's position), a nested structure of dicts, lists, tensors and plain values; this module knows
nothing of what is in it and checks no entry (each owner's ``check_state`` does). Tensors go to
safetensors under their path in the structure (``inner_opt/state/3/exp_avg``); the structure itself,
with each tensor replaced by a reference, goes to JSON together with the checksum of the
safetensors file (:class:`PartHash`: the SHA-256 of its 64 MiB parts' SHA-256s, so that a reader hashes the
parts on every core at once; formats 1 and 2 stored the file's plain SHA-256). What can be rebuilt exactly
is stored by its owner as a marker, ``{REBUILT: ...}`` (``noloco.train.state``): φ₀, φ = φ₀ and θ = φ.

Every file is written to a temporary name (``.<name>.<pid>.<random>.tmp``), fsynced and renamed, so
a crash mid-write leaves the previous checkpoint intact and ``latest`` pointing at it. Loading is
all-or-nothing: :func:`load_run` reads and checks every worker's state (checksum, JSON structure,
format, step, every tensor finite; with the caller's ``check``, the state owners' checks of every
entry against the model, optimizer and algorithm the run builds) before the caller writes anything, and
every malformed checkpoint is one :class:`CheckpointError` line. Pruning removes a checkpoint's
``COMPLETE`` first, so a kill mid-removal leaves an incomplete folder, which the next completed
checkpoint removes (with any stale temporary file).

A second Ctrl-C (``noloco.train.interrupt``) quits at once: :func:`close_writes` refuses every new file, removes
this process's temporary files and its unfinished step folder, and leaves the last complete checkpoint as it was.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from noloco.comm import faults
from noloco.state import all_finite
from noloco.train.device import usable_cores

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
# 2: rebuildable entries (φ₀, θ = φ) may be stored as markers; 3: the checksum is a SHA-256 of the SHA-256s of
# the file's parts of ``sha256_part_bytes`` each, so that a resume hashes the parts on every core at once
FORMAT = "noloco-checkpoint-3"
FORMATS = ("noloco-checkpoint-1", "noloco-checkpoint-2", FORMAT)
#: the safetensors file is hashed in parts of this many bytes (format 3; a checkpoint says which it used)
PART_BYTES = 64 << 20
_PART_BOUNDS = (1 << 20, 1 << 30)  # a part size read from a checkpoint outside these is refused
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
    (docs/design.md §8). The safetensors library reads the file back (:func:`load_worker`). ``sha``: anything
    with ``update`` (:class:`PartHash`)."""
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


class PartHash:
    """The checksum of format 3, fed a byte stream in chunks of any size: the SHA-256 of the concatenated
    SHA-256 digests of the stream's consecutive parts of ``part_bytes`` (the last one shorter). The parts are
    independent, so a reader hashes them in parallel (:class:`_Checksum`)."""

    def __init__(self, part_bytes: int = PART_BYTES):
        self.part_bytes, self.filled, self.part, self.digests = part_bytes, 0, hashlib.sha256(), []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.part_bytes - self.filled)
            self.part.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.part_bytes:
                self.digests.append(self.part.digest())
                self.part, self.filled = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        tail = [self.part.digest()] if self.filled or not self.digests else []
        return hashlib.sha256(b"".join(self.digests + tail)).hexdigest()


def file_checksum(path: Path, part_bytes: int | None = PART_BYTES, threads: int | None = None) -> str:
    """The checksum a checkpoint stores for the file at ``path``: format 3's part hash (:class:`PartHash`, the parts
    hashed by ``threads`` threads, default every usable core) or, with ``part_bytes=None``, the plain SHA-256 of
    formats 1 and 2. Hashed from a read-only mapping: no copy of the file's bytes (the page cache's are hashed)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if not size:
            return (hashlib.sha256() if part_bytes is None else PartHash(part_bytes)).hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                if part_bytes is None:
                    sha = hashlib.sha256()
                    for start in range(0, size, _CHUNK_BYTES):
                        sha.update(view[start : start + _CHUNK_BYTES])
                    return sha.hexdigest()
                starts = range(0, size, part_bytes)
                workers = max(1, min(len(starts), threads or usable_cores()))
                with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="noloco-hash") as pool:
                    # hashlib lets go of the GIL for large buffers: the parts are hashed on as many cores at once
                    digests = list(pool.map(lambda a: hashlib.sha256(view[a : a + part_bytes]).digest(), starts))
                return hashlib.sha256(b"".join(digests)).hexdigest()
            finally:
                view.release()


def save_worker(run_dir: Path, step: int, rank: int, state: dict) -> Path:
    """Write one worker's state for ``step``; returns the JSON file's path. :class:`DiskFull` (a
    :class:`CheckpointError`) if the disk fills up: the files being written are removed, the previous
    checkpoint is left as it was."""
    folder = step_dir(run_dir, step)
    with _WRITES.lock:
        _WRITES.folders.add(folder)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(state, tensors)
    sha = PartHash(PART_BYTES)
    blob = folder / f"worker_{rank}.safetensors"
    try:
        atomic_write(blob, safetensors_chunks(tensors, sha))
        faults.fire("checkpoint.mid", step, rank)
        meta = {"format": FORMAT, "step": step, "rank": rank, "sha256": sha.hexdigest(),
                "sha256_part_bytes": sha.part_bytes, "state": skeleton}  # fmt: skip
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
    tensor is finite. What the entries must look like is their owners' ``check_state``.
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
    part_bytes = None  # formats 1 and 2: the plain SHA-256 of the file
    if meta["format"] == FORMAT:
        part_bytes = meta.get("sha256_part_bytes")
        if not _is_int(part_bytes) or not _PART_BOUNDS[0] <= part_bytes <= _PART_BOUNDS[1]:
            raise CheckpointError(f"{meta_path}: missing or malformed 'sha256_part_bytes' (an integer in "
                                  f"[{_PART_BOUNDS[0]}, {_PART_BOUNDS[1]}])")  # fmt: skip
    # the checksum is computed beside the read (hashlib lets go of the GIL): a restart reads the file once in the
    # time of the slower of the two; nothing read is used unless the checksum matches
    checksum = _Checksum(blob_path, part_bytes)
    try:  # mapped, not read into memory: the state is on the host once (the tensors), not twice
        with safe_open(str(blob_path), framework="pt") as blob:
            tensors = {key: blob.get_tensor(key) for key in blob.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        checksum.verify(meta["sha256"])  # a damaged file says so first
        raise CheckpointError(f"{blob_path}: not a safetensors file ({str(exc).splitlines()[0][:200]})") from None
    nonfinite = next((key for key, tensor in tensors.items() if not all_finite(tensor)), None)
    checksum.verify(meta["sha256"])
    used: set[str] = set()
    try:
        state = unflatten(meta["state"], tensors, used)
    except (_Malformed, RecursionError) as exc:
        raise CheckpointError(f"{meta_path}: malformed state: {exc}") from None
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"{blob_path} holds tensors its JSON does not reference: {unused[:3]}")
    if nonfinite is not None:
        raise CheckpointError(f"{blob_path}: tensor {nonfinite} holds NaN or Inf")
    if not isinstance(state, dict):
        raise CheckpointError(f"{meta_path}: the state is a {type(state).__name__}, not an object")
    return state


class _Checksum:
    """A file's checksum (:func:`file_checksum`), computed from the moment this is made by a thread of its own
    (:meth:`verify` waits)."""

    def __init__(self, path: Path, part_bytes: int | None):
        self.path, self.part_bytes, self.digest, self.error = path, part_bytes, None, None
        self.thread = threading.Thread(target=self._run, name="noloco-checksum", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.digest = file_checksum(self.path, self.part_bytes)
        except (OSError, ValueError) as exc:
            self.error = exc

    def verify(self, expected: str) -> None:
        """Wait for the digest; CheckpointError unless the file could be read and its digest is ``expected``."""
        self.thread.join()
        if self.digest is None:
            raise CheckpointError(f"{self.path}: cannot be read ({self.error})")
        if self.digest != expected:
            raise CheckpointError(f"{self.path} does not match its checksum: the checkpoint is damaged")


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
    rank)`` raises :class:`CheckpointError` for a state the run cannot load (``noloco.train.state.WorkerState``).
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
