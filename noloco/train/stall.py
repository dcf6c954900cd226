"""The stall detector: a run that stops making progress says so instead of hanging silently (issue #32).

Each worker reports what it is doing at every step (:meth:`StallWatch.mark`: the step it is at and what it
waits for: an inner step, its outer exchange, the evaluation, a checkpoint's barrier). A watcher thread
checks that some worker of this process has finished a step within ``run.stall_timeout`` seconds. When none
has, it writes every thread's stack (``faulthandler``) to ``<run>/stall-<pid>.txt`` with a line per worker
saying where it waits, prints one ``error:`` line that says the same and names the file, removes this
process's unfinished checkpoint files (the last complete checkpoint stays as it was: the same clean-up as a
second Ctrl-C) and exits with status :data:`STALL_EXIT`. ``run.stall_timeout=0`` turns it off.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from noloco.train import checkpoint
from noloco.train.interrupt import hard_exit

#: exit status of a process stopped by the stall detector
STALL_EXIT = 3


class StallWatch:
    """Where each worker of this process is, and a thread that ends the process when none advances.

    ``timeout``: seconds without any worker finishing a step; ``run_dir``: where the stacks go and whose
    checkpoints are reported. Workers that are :meth:`done` are not waited for; once all are, the thread ends.
    """

    def __init__(self, timeout: float, run_dir: Path):
        self.timeout, self.run_dir = float(timeout), Path(run_dir)
        self._lock = threading.Lock()
        self._where: dict[int, tuple[int, str, float]] = {}  # rank → (last step finished, what it does, since)
        self._done: set[int] = set()
        self._advanced = time.monotonic()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def mark(self, rank: int, step: int, doing: str) -> None:
        """Worker ``rank`` has finished ``step`` and now does ``doing`` (``"step 8 and its outer exchange"``)."""
        now = time.monotonic()
        with self._lock:
            previous = self._where.get(rank)
            if previous is None or step > previous[0]:
                self._advanced = now
            since = previous[2] if previous is not None and previous[1] == doing else now
            self._where[rank] = (step, doing, since)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="noloco-stall-watch", daemon=True)
                self._thread.start()

    def done(self, rank: int) -> None:
        """Worker ``rank`` has stopped training (finished or failed); once every worker has, the thread ends."""
        with self._lock:
            self._done.add(rank)
            if self._done >= set(self._where):
                self._closed.set()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(5.0, max(0.2, self.timeout / 5))):
            with self._lock:
                idle = time.monotonic() - self._advanced
            if idle > self.timeout:
                self._stalled(idle)

    def waits(self) -> list[str]:
        """One phrase per worker still training: where it is and for how long."""
        now = time.monotonic()
        with self._lock:
            where = sorted((r, w) for r, w in self._where.items() if r not in self._done)
        return [f"worker {rank} after step {step}: {doing} for {now - since:.0f} s"
                for rank, (step, doing, since) in where]  # fmt: skip

    def _stalled(self, idle: float) -> None:
        waits = self.waits()
        path = self.run_dir / f"stall-{os.getpid()}.txt"
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as handle:
                handle.write(f"no worker advanced for {idle:.0f} s (run.stall_timeout={self.timeout:g})\n")
                handle.writelines(line + "\n" for line in waits)
                handle.write("\n")
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
            stacks = f"every thread's stack in {path}"
        except OSError as exc:
            stacks = f"could not write the stacks to {path} ({exc.strerror})"
        latest = self.run_dir / "checkpoints" / "latest"
        try:
            intact = (f"the last checkpoint (step {checkpoint.resolve(latest)[2]}) is intact: resume with "
                      f"python train.py resume={latest}")  # fmt: skip
        except checkpoint.CheckpointError:
            intact = "there is no complete checkpoint"
        line = (f"error: no worker advanced for {idle:.0f} s (run.stall_timeout={self.timeout:g}): "
                f"{'; '.join(waits) or 'no worker is training'}; {stacks}; {intact}")  # fmt: skip
        try:
            sys.stdout.flush()
            os.write(2, ("\n" + line + "\n").encode())
        except OSError:
            pass
        hard_exit(STALL_EXIT, self.run_dir, say=False)
