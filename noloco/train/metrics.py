"""Run metrics: one JSON line per (worker, step) in ``metrics.jsonl`` plus TensorBoard scalars.

Thread-safe, so simulated workers of one process share one logger. On resume, records after the
checkpoint step are dropped from ``metrics.jsonl`` and TensorBoard purges them, so the files read
as one uninterrupted run.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path


class MetricsLogger:
    """``filename``: ``metrics.jsonl`` for one process; ``metrics.rank<r>.jsonl`` per process of a
    multi-process run (all ``metrics*.jsonl`` of a run folder are read together)."""

    def __init__(
        self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None, filename: str = "metrics.jsonl"
    ):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        if resume_step is not None and self.path.exists():
            kept = [json.dumps(r) for r in _parse(self.path) if r["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered: a crash loses no step
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            folder = Path(run_dir) / "tensorboard"
            if filename != "metrics.jsonl":
                folder = folder / Path(filename).stem.removeprefix("metrics.")
            self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge)

    def log(self, record: dict) -> None:
        """``record`` must hold ``worker`` and ``step``; numeric fields also go to TensorBoard."""
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            if self._writer is not None:
                worker, step = record["worker"], record["step"]
                for key, value in record.items():
                    if key not in ("worker", "step") and isinstance(value, (int, float)):
                        self._writer.add_scalar(f"{key}/worker{worker}", value, step)

    def close(self) -> None:
        with self._lock:
            self._file.close()
            if self._writer is not None:
                self._writer.close()


def metrics_files(run_dir: Path) -> list[Path]:
    """The metrics files of a run folder, in name order: ``metrics.jsonl``, ``metrics.rank<r>.jsonl`` of a
    multi-process run, ``metrics.attempt-<k>.jsonl`` kept from a restarted swarm peer's earlier attempts
    (``metrics.attempt-*`` sorts before ``metrics.jsonl``, so the latest attempt's records come last)."""
    return sorted(p for p in Path(run_dir).glob("metrics*.jsonl") if p.is_file())


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
