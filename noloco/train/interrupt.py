"""Ctrl-C: stop every worker of a run at one step, save it and exit 130; a second Ctrl-C quits at once.

The first SIGINT (:data:`INTERRUPT`, installed by ``noloco.train.cli``) asks every worker to stop at one
common step, chosen so that no worker has passed it and none waits for another: :class:`LocalStop` for the
threads of one process, :class:`StoreStop` over the torch.distributed store for processes, :class:`SoloStop`
(the next step) for a single swarm peer. Each worker then saves that step and the run raises
:class:`Interrupted`, whose :meth:`~Interrupted.line` says how to resume. A second SIGINT quits at once
(:func:`hard_exit`): ``noloco.train.checkpoint.close_writes`` removes this process's temporary files and its
unfinished step folder, and the last complete checkpoint is left as it was. docs/architecture.md, "Ctrl-C",
walks through the agreement.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from noloco.train import checkpoint

logger = logging.getLogger(__name__)


class Interrupted(Exception):
    """Training stopped early on Ctrl-C: every worker stopped at ``step`` and saved it (if ``complete``)."""

    def __init__(self, step: int | None, run_dir: Path | None, complete: bool, quiet: bool = False):
        super().__init__(step)
        self.step, self.run_dir, self.complete, self.quiet = step, run_dir, complete, quiet

    def line(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        if self.run_dir is None:
            return f"interrupted{where}"
        latest = Path(self.run_dir) / "checkpoints" / "latest"
        if self.complete:
            return f"interrupted{where}: resume with python train.py resume={latest}"
        try:
            _, _, last = checkpoint.resolve(latest)
        except checkpoint.CheckpointError:
            return f"interrupted{where}: its checkpoint is incomplete and there is no earlier one to resume from"
        return (f"interrupted{where}: its checkpoint is incomplete; resume from step {last} with "
                f"python train.py resume={latest}")  # fmt: skip


class _Interrupt:
    """Process-wide Ctrl-C state. ``armed`` while workers train; before and after, SIGINT is a
    KeyboardInterrupt. ``forward``: called with the count on every interrupt (the torch launcher passes
    it on to its ranks); ``hard``: what a second interrupt does instead of :func:`hard_exit`."""

    def __init__(self) -> None:
        self.count = 0
        self.requested = False
        self.armed = False
        self.announce = True
        self.run_dir: Path | None = None
        self.forward: Callable[[int], None] | None = None
        self.hard: Callable[[], None] | None = None
        self.solo = SoloStop()  # a process of one worker (a swarm peer): where it stopped

    def reset(self) -> None:
        self.__init__()

    def handler(self, signum, frame) -> None:
        self.count += 1
        if self.forward is not None:
            self.forward(self.count)
        if self.count == 1 and not self.armed:
            raise KeyboardInterrupt
        if self.count == 1:
            self.requested = True
            if self.announce:
                os.write(2, b"\nnoloco: stopping every worker at the next step to save a checkpoint "
                            b"(Ctrl-C again quits at once)\n")  # fmt: skip
            return
        if self.hard is not None:
            self.hard()
        hard_exit(130, self.run_dir, say=self.announce)

    def install(self, signum: int = signal.SIGINT) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, self.handler)


def hard_exit(code: int = 130, run_dir: Path | None = None, say: bool = True) -> None:
    """Quit at once: no more checkpoint files, remove this process's temporary files and (where this process
    completes checkpoints) the step folders it was writing that are not complete, then ``os._exit``."""
    checkpoint.close_writes()
    if say:
        try:
            os.write(2, (quit_line(run_dir) + "\n").encode())
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:  # release semaphores (tqdm's lock) as a normal exit would: no resource_tracker warning
        try:
            mp_util._run_finalizers(0)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


def quit_line(run_dir: Path | None) -> str:
    """The line a second Ctrl-C prints: where to resume from."""
    if run_dir is None:
        return "interrupted again: quit without saving"
    latest = Path(run_dir) / "checkpoints" / "latest"
    try:
        return (
            f"interrupted again: quit without saving; resume from step {checkpoint.resolve(latest)[2]} with "
            f"python train.py resume={latest}"
        )
    except checkpoint.CheckpointError:
        return "interrupted again: quit without saving; there is no complete checkpoint to resume from"


class LocalStop:
    """The step every worker of one process stops at on Ctrl-C (threads of the local backend).

    At each step boundary a worker reports its step (:meth:`__call__`, under a lock). The first worker to
    see the interrupt picks the stop step: its own step, or one past the furthest boundary another worker
    has already passed, whichever is later, so no worker has gone beyond it and none waits for another.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: dict[int, int] = {}
        self.target: int | None = None

    def __call__(self, rank: int, step: int) -> bool:
        with self.lock:
            if self.target is None and INTERRUPT.requested:
                self.target = max([step] + [s + 1 for r, s in self.done.items() if r != rank])
            self.done[rank] = step
            return self.target is not None and step >= self.target


class SoloStop:
    """A single worker (a swarm peer): stop at the next step boundary."""

    def __init__(self) -> None:
        self.target: int | None = None

    def __call__(self, rank: int, step: int) -> bool:
        if self.target is None and INTERRUPT.requested:
            self.target = step
        return self.target is not None and step >= self.target


class StoreStop:
    """The same rule as :class:`LocalStop` across processes, over a ``torch.distributed`` key-value store.

    The store sits on one rank's host, often across the link the exchanges use, so the training thread never
    waits for it while training goes on. A reporter thread of its own writes this rank's *promise* to
    ``at/<rank>``, then looks for ``requested``. A promise P means that this rank returns from no step boundary
    past P until a look issued after a write of a promise of at least that step has found nothing. The
    reporter promises ``step + lag``, where the lag covers four of the store's slowest recent round trips in
    steps (at least 1), so at steady state a boundary finds its look already made. It waits only when the
    store falls more than the lag behind. Promises never decrease, so the one the proposer reads is at least
    every promise a look has cleared before it.

    A rank that saw its interrupt first sets ``requested``, reads every rank's promise and proposes the stop
    step with a compare-and-set on ``target`` (the first proposal wins): its own step, or one past the highest
    promise, whichever is later. A rank whose promise was read looks again before passing that promise. The
    look comes after the proposer's ``requested``, so it sees it, and the rank then waits for ``target``.
    That is at most one past its promise, so no rank passes the target. A lag of 0 would be the plain rule:
    report each step, look, go on. If the store is gone (its host died), the rank goes on alone: it stops at
    its next step on Ctrl-C.
    """

    MAX_LAG = 256  # steps a promise may run ahead of the rank (a Ctrl-C stops at most this much later)

    def __init__(self, store, rank: int, world: int, start: int, timeout: float):
        self.store, self.rank, self.world, self.start, self.timeout = store, rank, world, start, timeout
        self.target: int | None = None
        self.proposed = False
        self.alone: SoloStop | None = None
        self._lock = threading.Lock()  # one request at a time on the store's client
        self._cond = threading.Condition()
        self._latest: int | None = None  # the last boundary the training thread reached
        self._cleared = start  # the highest promise a look after it found nothing for
        self._seen = False  # a look found ``requested``
        self._error: BaseException | None = None
        self._closed = False
        self._reporter: threading.Thread | None = None
        self._round_trips: collections.deque[float] = collections.deque(maxlen=16)  # seconds, recent write + look
        self._step_seconds: float | None = None  # moving mean of the time between boundaries
        self._last_call: float | None = None

    def __call__(self, rank: int, step: int) -> bool:
        if self.alone is not None:
            return self.alone(rank, step)
        if self.target is None:
            try:
                self._agree(step)
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: no agreement any more
                logger.warning("rank %d: the stop agreement's store is gone (%s); on Ctrl-C this rank stops alone",
                               self.rank, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
                self.close()
                self.alone = SoloStop()
                return self.alone(rank, step)
        if self.target is not None and step > self.target:
            logger.warning("rank %d: past the agreed stop step %d (at %d)", self.rank, self.target, step)
        return self.target is not None and step >= self.target

    def close(self) -> None:
        """Stop the reporter thread (the agreement stays as it is)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _agree(self, step: int) -> None:
        if INTERRUPT.requested and not self.proposed:
            self.proposed = True
            self._propose(step)
            return
        self._tick(step)
        with self._cond:
            self._latest = step
            if self._reporter is None:
                self._reporter = threading.Thread(target=self._report, name=f"noloco-stop{self.rank}", daemon=True)
                self._reporter.start()
            self._cond.notify_all()
            # a boundary past what a look has cleared waits for the next look (the promise of this step)
            deadline = time.monotonic() + self.timeout
            while not (self._seen or self._error is not None or step <= self._cleared):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer from the store within {self.timeout:.0f}s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error
            seen = self._seen
        if seen:
            self._await_target(step)

    def _tick(self, step: int) -> None:
        """Keep the moving mean of the seconds between boundaries, which sets the lag."""
        now = time.monotonic()
        if self._last_call is not None:
            gap = now - self._last_call
            self._step_seconds = gap if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * gap
        self._last_call = now

    def _lag(self) -> int:
        """Steps a promise runs ahead: four of the store's slowest recent round trips (a busy link's queue comes
        and goes) at the current step rate, at least 1."""
        if not self._step_seconds or not self._round_trips:
            return 1
        return max(1, min(self.MAX_LAG, math.ceil(4 * max(self._round_trips) / self._step_seconds)))

    def _report(self) -> None:
        """The reporter thread: write a promise, look for ``requested``, again whenever the rank moved on."""
        written, promise = None, self.start
        try:
            while True:
                with self._cond:
                    while not self._closed and self._latest == written:
                        self._cond.wait()
                    if self._closed:
                        return
                    written = self._latest
                promise = max(promise, written + self._lag())  # never lower: the proposer reads the latest one
                began = time.monotonic()
                with self._lock:
                    self.store.set(f"at/{self.rank}", str(promise))
                    seen = self.store.check(["requested"])
                self._round_trips.append(time.monotonic() - began)
                with self._cond:
                    if seen:
                        self._seen = True
                    else:
                        self._cleared = promise
                    self._cond.notify_all()
                if seen:
                    return
        except Exception as exc:  # noqa: BLE001 - handed to the training thread, which goes on alone
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _propose(self, step: int) -> None:
        """This rank saw its interrupt first: ask for a stop and propose one past every rank's promise."""
        with self._lock:
            store = self.store
            store.set("requested", "1")
            others = [int(store.get(f"at/{r}")) if store.check([f"at/{r}"]) else self.start
                      for r in range(self.world) if r != self.rank]  # fmt: skip
            proposal = max([step] + [p + 1 for p in others])
            self.target = int(store.compare_set("target", "", str(proposal)))
        self.close()

    def _await_target(self, step: int) -> None:
        from datetime import timedelta

        with self._lock:
            try:
                self.store.wait(["target"], timedelta(seconds=self.timeout))
            except Exception:  # noqa: BLE001 - the proposing rank died before proposing: stop here
                logger.warning("rank %d: no stop step agreed; stopping at step %d", self.rank, step)
                self.target = step
                return
            self.target = int(self.store.get("target"))


def stop_here(stop, rank: int, step: int, run_dir: Path | None = None) -> bool:
    """Whether the worker ``rank``, having finished ``step``, stops there (Ctrl-C); ``stop`` is the run's
    agreement (:class:`LocalStop`, :class:`StoreStop`) or None for a single worker per process. From a
    process's first step boundary on, Ctrl-C stops training instead of raising KeyboardInterrupt."""
    INTERRUPT.armed = True
    if INTERRUPT.run_dir is None and run_dir is not None:
        INTERRUPT.run_dir = Path(run_dir)
    if stop is None:
        if not INTERRUPT.requested:
            return False
        stop = INTERRUPT.solo
    return stop(rank, step)


INTERRUPT = _Interrupt()
