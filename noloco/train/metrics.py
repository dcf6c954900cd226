"""Run metrics: one JSON line per (worker, step) in ``metrics.jsonl`` plus TensorBoard scalars, and
optionally the same scalars in Weights & Biases (``log.wandb.project``, the ``wandb`` extra).

Thread-safe, so simulated workers of one process share one logger. On resume, records after the
checkpoint step are dropped from ``metrics.jsonl`` and TensorBoard purges them, so the files read
as one uninterrupted run.

wandb: one wandb run per worker (a swarm peer: one per peer), all of a noloco run in one wandb group
(``log.wandb.group``, default the run's name), each run's x axis the inner ``step``; ``mode=offline``
writes them under ``runs/<run>/wandb/`` for ``wandb sync`` later. A resumed run continues each worker's
wandb run (its id is kept in ``wandb/<worker>.id``); the steps between the checkpoint and the stop are
logged again. wandb is imported only when a project is set (``noloco.train.config`` refuses the run
at start-up when it is not installed).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import sys
import threading
from pathlib import Path

WANDB_MODES = ("online", "offline", "disabled")


def wandb_options(cfg, group: str, name: str | None = None) -> dict | None:
    """What :class:`MetricsLogger` needs to log to wandb, from ``cfg.log.wandb``; None when no project is set.

    ``group``: the wandb group when ``log.wandb.group`` is null (the run's name); ``name``: the one wandb
    run's name of a process that logs a single worker under its own name (a swarm peer), else each
    worker's run is ``<group>/worker<w>``. The run's whole config is the wandb config."""
    from omegaconf import OmegaConf

    settings = cfg.log.get("wandb")
    if settings is None or not settings.get("project"):
        return None
    return {
        "project": str(settings.project),
        "entity": settings.get("entity"),
        "mode": str(settings.get("mode") or "online"),
        "group": str(settings.get("group") or group),
        "tags": [str(t) for t in settings.get("tags") or []],
        "name": name,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


class WandbRuns:
    """One wandb run per worker, started at the worker's first record (``reinit="create_new"``: several runs
    of one process at once, as the local backend's threads need). Not thread-safe: the caller holds a lock."""

    def __init__(self, run_dir: Path, options: dict, resume: bool):
        import wandb

        self.wandb, self.options, self.resume = wandb, options, resume
        self.folder = Path(run_dir) / "wandb"  # wandb writes its own files under <dir>/wandb/
        self.folder.mkdir(parents=True, exist_ok=True)
        self.runs: dict[int, object] = {}

    def _start(self, worker: int):
        opts = self.options
        id_file = self.folder / f"worker{worker}.id"
        run_id = id_file.read_text().strip() if self.resume and id_file.is_file() else None
        if run_id is None:
            run_id = secrets.token_hex(6)  # wandb ids: letters, digits, - and _
            id_file.write_text(run_id + "\n")
        name = opts["name"] or f"{opts['group']}/worker{worker}"
        run = self.wandb.init(
            project=opts["project"], entity=opts["entity"], group=opts["group"], name=name, tags=opts["tags"],
            id=run_id, resume="allow", mode=opts["mode"],
            dir=str(self.folder.parent), config={**opts["config"], "worker": worker}, reinit="create_new",
            settings=self.wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )  # fmt: skip
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return run

    def log(self, worker: int, step: int, scalars: dict) -> None:
        if worker not in self.runs:
            self.runs[worker] = self._start(worker)
        self.runs[worker].log({**scalars, "step": step})

    def close(self) -> None:
        for run in self.runs.values():
            run.finish()
        self.runs.clear()


#: records held back by a full disk beyond this many bytes fail the run (the disk stayed full)
_MAX_PENDING_BYTES = 16 << 20


class MetricsLogger:
    """``filename``: ``metrics.jsonl`` for one process; :func:`part_name` per process of a multi-process run,
    merged into ``metrics.jsonl`` when the run ends or stops (:func:`merge_parts`). ``wandb``:
    :func:`wandb_options` (None: no wandb)."""

    def __init__(
        self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None, filename: str = "metrics.jsonl",
        wandb: dict | None = None,
    ):  # fmt: skip
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        if resume_step is not None and self.path.exists():
            kept = [json.dumps(r) for r in _parse(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        # each record is written through at once (a crash loses no step), appended to whatever a full disk held back
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._pending = b""
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            folder = Path(run_dir) / "tensorboard"
            if filename != "metrics.jsonl":
                folder = folder / Path(filename).stem.removeprefix("metrics.")
            self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        self._wandb = WandbRuns(run_dir, wandb, resume=resume_step is not None) if wandb else None

    def log(self, record: dict) -> None:
        """``record`` must hold ``worker`` and ``step``; numeric fields also go to TensorBoard and wandb."""
        with self._lock:
            self._write((json.dumps(record) + "\n").encode())
            worker, step = record["worker"], record["step"]
            scalars = {key: value for key, value in record.items()
                       if key not in ("worker", "step") and isinstance(value, (int, float))}  # fmt: skip
            if self._writer is not None:
                for key, value in scalars.items():
                    self._writer.add_scalar(f"{key}/worker{worker}", value, step)
            if self._wandb is not None:
                self._wandb.log(worker, step, scalars)

    def _write(self, data: bytes) -> None:
        """Append ``data`` after what an earlier full disk held back. A full disk keeps the rest for the next record
        instead of failing the run: a checkpoint that fills the disk in another worker's thread reports it (one
        line, the previous checkpoint intact) and frees its partial file, after which the records follow."""
        self._pending += data
        try:
            while self._pending:
                self._pending = self._pending[os.write(self._fd, self._pending) :]
        except OSError as exc:
            if exc.errno != errno.ENOSPC or len(self._pending) > _MAX_PENDING_BYTES:
                raise

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):  # one more try for what a full disk held back
                    self._write(b"")
                if self._pending:  # the disk is still full: say what is missing rather than fail the cleanup
                    print(f"noloco: the last {len(self._pending):,} bytes of {self.path} could not be written: no "
                          f"space left on its disk", file=sys.stderr, flush=True)  # fmt: skip
                os.close(self._fd)
                self._fd = None
            if self._writer is not None:
                self._writer.close()
            if self._wandb is not None:
                self._wandb.close()


def metrics_files(run_dir: Path) -> list[Path]:
    """The metrics files of a run folder, in name order: ``metrics.jsonl``, the parts ``metrics.rank<r>.jsonl``
    of a multi-process run still under way (or one that died before :func:`merge_parts`),
    ``metrics.attempt-<k>.jsonl`` kept from a restarted swarm peer's earlier attempts (``metrics.attempt-*``
    sorts before ``metrics.jsonl``, so the latest attempt's records come last)."""
    return sorted(p for p in Path(run_dir).glob("metrics*.jsonl") if p.is_file())


def part_name(rank: int) -> str:
    """The file one process of a multi-process run writes its records to while it runs."""
    return f"metrics.rank{int(rank)}.jsonl"


def merge_parts(run_dir: Path, keep_through: int | None = None) -> Path:
    """Fold the parts of a multi-process run (``metrics.rank<r>.jsonl``) into ``metrics.jsonl``, then remove them.

    ``metrics.jsonl`` ends up as one run's file: its own records and the parts', ordered by step then worker
    (records of one step and worker keep their order), without the records after ``keep_through`` (a resumed
    run: the checkpoint step) where given. A record already in ``metrics.jsonl`` is not added twice (a merge
    cut short between writing the file and removing the parts). The file is replaced atomically (a temporary
    file, then a rename), so a kill leaves the old file or the new one. Call it when no process writes a part:
    before the ranks start and after they closed their loggers. Returns the path of ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    target = run_dir / "metrics.jsonl"
    parts = sorted(run_dir.glob("metrics.rank*.jsonl"))
    if not parts and keep_through is None:
        return target
    records = _parse(target) if target.is_file() else []
    seen = {json.dumps(r, sort_keys=True) for r in records}
    for path in parts:
        for record in _parse(path):
            key = json.dumps(record, sort_keys=True)
            if key not in seen:
                seen.add(key)
                records.append(record)
    if keep_through is not None:
        records = [r for r in records if r["step"] <= keep_through]
    records.sort(key=lambda r: (r["step"], r["worker"]))
    if target.is_file() or records:
        temporary = run_dir / f".metrics.jsonl.{secrets.token_hex(4)}.tmp"
        temporary.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        temporary.replace(target)
    for path in parts:
        path.unlink()
    return target


def _parse(path: Path) -> list[dict]:
    """The records of one metrics file. A last line cut short (the process died while writing it) is
    skipped; an unreadable line anywhere else raises ``ValueError`` naming the file and line."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a JSON record ({exc})") from None
    return records


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of a run folder (all ``metrics*.jsonl`` files, see :func:`metrics_files`), ordered by step
    then worker; records of the same step and worker keep file order. A truncated last line is skipped."""
    records = []
    for path in metrics_files(run_dir):
        records += _parse(path)
    return sorted(records, key=lambda r: (r["step"], r["worker"]))
