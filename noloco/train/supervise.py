"""``run.restarts``: a run whose process dies is started again from its last checkpoint, imports kept.

``python train.py ... run.restarts=N`` makes the process a supervisor: it imports what a run needs (torch, the
backend's module and what it imports: hivemind for a swarm peer, torch's compiler stack), then forks the run. When
the run's process dies (a crash, an uncaught error, SIGKILL, the OOM killer, a stall: any exit but 0, 2 (bad
config, data or checkpoint: a restart would fail the same way) and 130 (Ctrl-C)), the supervisor forks it again
with ``resume=<its folder>/checkpoints/latest``, at most ``N`` times. The fork starts with those modules already
imported, so a restarted swarm peer is back in its swarm seconds sooner than a new process would be (the numbers
are in docs/results/scale.md); the rest of its start (the checkpoint's check, its DHT node, the GPU) is the
resume's, as with ``resume=``.

The run's process is a process group of its own (with its DHT process and p2pd), so that a signal to the run
stops all of it and leaves the supervisor: Ctrl-C, SIGTERM and SIGHUP to the supervisor are passed on to that
group and end supervision (the run exits as it would alone: 130 and the resume line after Ctrl-C); the run dies
with the supervisor (Linux: ``PR_SET_PDEATHSIG``). The supervisor learns the run's folder from the run itself
(:func:`report_folder`, called once the folder exists), and gives up, with the run's status, when the run died
before its first complete checkpoint (nothing to restart from) or ran out of restarts.

CUDA is never touched in the supervisor (a CUDA context does not survive a fork); the forked run starts its own.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

#: exit statuses a restart cannot mend: done, a bad config/data/checkpoint, interrupted (see noloco.train.cli)
FINAL = (0, 2, 130)
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_report_fd: int | None = None  # in a supervised run: the pipe its folder is written to


def report_folder(folder: Path) -> None:
    """Tell a supervisor, if any, which folder this run writes (its checkpoints are where a restart resumes)."""
    global _report_fd
    if _report_fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(_report_fd, (str(Path(folder).resolve()) + "\n").encode())
    with contextlib.suppress(OSError):
        os.close(_report_fd)
    _report_fd = None


def warm_imports(modules: tuple[str, ...]) -> float:
    """Import ``modules`` (a backend's module and what it imports late), the worker loop, TensorBoard's writer and
    torch's compiler stack; seconds taken. Nothing here touches CUDA, so the process may fork afterwards."""
    started = time.perf_counter()
    for module in (*modules, "noloco.train.loop", "torch.utils.tensorboard", "torch._dynamo"):
        with contextlib.suppress(ImportError):  # a missing extra: the run reports it itself, with its own error line
            importlib.import_module(module)
    return time.perf_counter() - started


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the supervisor dies (its DHT process follows: it watches its parent)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _child(run: Callable[[list[str]], int], extra: list[str], report: int, parent: int) -> None:
    """In the forked process: a process group of its own, the run, then exit with its status (never returns)."""
    global _report_fd
    code = 1
    try:
        os.setpgid(0, 0)
        _die_with_parent()
        if os.getppid() != parent:  # the supervisor died between the fork and the line above
            os._exit(1)
        for signum in _FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        _report_fd = report
        code = run(extra)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the run's own errors are its exit status, as in a process of its own
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()  # what a normal exit runs: multiprocessing stops its children (the DHT)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def describe(status: int) -> str:
    """A ``waitpid`` status in words: ``exit 1`` or ``SIGKILL``."""
    if os.WIFSIGNALED(status):
        try:
            return signal.Signals(os.WTERMSIG(status)).name
        except ValueError:
            return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def exit_code(status: int) -> int:
    """The shell's status for a ``waitpid`` status (128 + the signal of a killed process)."""
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def supervise(run: Callable[[list[str]], int], restarts: int, modules: tuple[str, ...], say=None) -> int:
    """Run ``run([])`` in a forked process and fork it again, ``run(["resume=<folder>/checkpoints/latest"])``, each
    time it dies with a status a restart may mend, at most ``restarts`` times; the last run's exit status.

    ``modules``: imported before the first fork (:func:`warm_imports`): the backend's. ``say``: where the
    supervisor's lines go (stderr)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    warm = warm_imports(modules)
    stop: list[int] = []  # a signal the supervisor was sent: passed on, and no restart after it
    child = 0

    def forward(signum, _frame) -> None:
        stop.append(signum)
        if child:
            with contextlib.suppress(OSError):
                os.killpg(child, signum)

    previous = {signum: signal.signal(signum, forward) for signum in _FORWARDED}
    try:
        extra: list[str] = []
        folder: Path | None = None
        for attempt in range(restarts + 1):
            read, write = os.pipe()
            parent = os.getpid()
            child = os.fork()
            if child == 0:
                os.close(read)
                _child(run, extra, write, parent)
            os.close(write)
            os.set_blocking(read, False)  # the run's DHT process, forked from it, may hold the pipe open
            with contextlib.suppress(OSError):
                os.setpgid(child, child)  # also here: a signal sent before the child's own call reaches its group
            say(f"noloco: supervising the run as process {child} (restarts left: {restarts - attempt}; each starts "
                f"with the {warm:.1f} s of imports done)")  # fmt: skip
            _, status = os.waitpid(child, 0)
            reported = _read_all(read)
            folder = Path(reported) if reported else folder
            code = exit_code(status)
            if stop or code in FINAL or attempt == restarts:
                if code not in FINAL and not stop:
                    say(f"noloco: the run died ({describe(status)}); no restarts left (run.restarts={restarts})")
                return code
            latest = folder / "checkpoints" / "latest" if folder else None
            if latest is None or not latest.exists():
                say(f"noloco: the run died ({describe(status)}) before its first complete checkpoint: nothing to "
                    "restart from")  # fmt: skip
                return code
            say(f"noloco: the run died ({describe(status)}); restarting it from {latest} "
                f"(restart {attempt + 1} of {restarts})")  # fmt: skip
            extra = [f"resume={latest}"]
        return 1  # not reached: the loop returns
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _read_all(fd: int) -> str:
    """What the run wrote to the supervisor's pipe (its folder), its last line; '' if nothing (read without
    waiting: the run wrote it long before it died)."""
    chunks = []
    with contextlib.suppress(OSError):  # BlockingIOError: nothing more
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    os.close(fd)
    lines = b"".join(chunks).decode("utf-8", "replace").split()
    return lines[-1] if lines else ""
