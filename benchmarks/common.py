"""What the benchmarks share: the machine they ran on, the command that reruns them, where they write.

- :func:`machine`: one line describing this machine, the same words in every report;
- :func:`command`: the command line that reruns a benchmark, ``python -m benchmarks.<name> <args>``;
- :func:`add_out` and :func:`out_dir`: the ``--out`` folder, by default ``runs/benchmarks/<name>/`` (ignored by
  git). The committed results are rewritten only when asked: ``--out docs/results``;
- :func:`write_report` (and :func:`write_json`): ``<out>/<name>.md`` and ``<out>/<name>.json``, the JSON
  carrying the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from noloco.train.device import usable_cores

ROOT = Path(__file__).resolve().parents[1]
#: the committed results (written only by ``--out docs/results``; read as the base of partial reports)
RESULTS = ROOT / "docs" / "results"
#: the default output folders, ``runs/benchmarks/<name>/``
RUNS = ROOT / "runs" / "benchmarks"


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows, else ``""``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, OSError, ValueError):
        return None


def _gpus() -> str:
    """``2× NVIDIA H200 (CUDA 13.0), Triton 3.6.0``, or ``no GPU``."""
    if not torch.cuda.is_available():
        return "no GPU"
    names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    gpus = " + ".join(f"{count}× {name}" for name, count in names.items())
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - informative only
        triton_version = "not importable"
    return f"{gpus} (CUDA {torch.version.cuda}), Triton {triton_version}"


def machine() -> str:
    """One line describing this machine, e.g. ``AMD EPYC (x86_64), 2 cores, 24 GiB memory, Linux 6.1, Python
    3.11.7, torch 2.13.0+cpu, no GPU``: CPU model and architecture, the cores this process may use (its affinity:
    ``2 of 16 cores`` when it is pinned to fewer than the machine has), memory, OS, Python, torch, and when CUDA
    is available the GPUs (count and name), CUDA and Triton versions instead of ``no GPU``.

    Every benchmark's report uses these words; a benchmark that must say more (a smoke run, NCCL's version) adds
    its own label around them."""
    arch = platform.machine()
    model = _cpu_model()
    cpu = f"{model} ({arch})" if model and model != arch else arch or "unknown CPU"
    usable, total = usable_cores(), os.cpu_count() or usable_cores()
    cores = f"{total} cores" if usable == total else f"{usable} of {total} cores"
    memory = _memory_gib()
    parts = [cpu, cores, *([f"{memory:.0f} GiB memory"] if memory else []), f"{platform.system()} "
             f"{platform.release().split('-')[0]}", f"Python {platform.python_version()}", f"torch {torch.__version__}",
             _gpus()]  # fmt: skip
    return ", ".join(parts)


def split_method(method: str) -> list[str]:
    """The ``/``-separated parts of a method or entry spelling (``algo/codec[/key=value...]``), with the ``/`` inside a
    top-k codec kept: ``noloco/topk:64/4096+int2/outer.overlap=true`` → ``noloco``, ``topk:64/4096+int2``,
    ``outer.overlap=true`` (a part that starts with a digit continues the one before it, as ``4096+int2`` does)."""
    parts: list[str] = []
    for part in method.split("/"):
        if parts and part[:1].isdigit():
            parts[-1] += "/" + part
        else:
            parts.append(part)
    return parts


def command(name: str, args: Sequence[str] | None = None) -> str:
    """The command line that reruns benchmark ``name``: ``python -m benchmarks.<name>`` and ``args`` (default: the
    arguments as typed, ``sys.argv[1:]``), each quoted for a POSIX shell where it needs it.

    Nothing is added: a run made as root shows no ``sudo``, and the output folder appears only if it was given."""
    args = sys.argv[1:] if args is None else list(args)
    return shlex.join(["python", "-m", f"benchmarks.{name}", *args])


def add_out(parser: argparse.ArgumentParser, name: str) -> None:
    """Add ``--out DIR`` to ``parser``: the report's folder, by default ``runs/benchmarks/<name>/``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=RUNS / name,
        metavar="DIR",
        help=f"folder of the report (default: runs/benchmarks/{name}/); "
        "--out docs/results rewrites the committed results",
    )


def out_dir(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path`, created (with its parents) if missing."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: str | Path, data, *, command: str, machine: str) -> Path:
    """Write ``data`` to ``path`` as JSON with ``command`` and ``machine`` first: a dict keeps its other keys (its
    own ``command``/``machine`` are replaced), anything else becomes ``{"command", "machine", "results": data}``."""
    head = {"command": command, "machine": machine}
    if isinstance(data, dict):
        body = {k: v for k, v in data.items() if k not in head}
    else:
        body = {"results": data}
    path = Path(path)
    path.write_text(json.dumps({**head, **body}, indent=1) + "\n")
    return path


def write_report(out: str | Path, name: str, markdown: str | Sequence[str], data, *, command: str,
                 machine: str) -> tuple[Path, Path]:  # fmt: skip
    """Write ``<out>/<name>.md`` (``markdown``: the text, or its lines) and ``<out>/<name>.json`` (``data`` with the
    command and machine, :func:`write_json`); ``out`` is created if missing. Returns both paths."""
    folder = out_dir(out)
    text = markdown if isinstance(markdown, str) else "\n".join(markdown)
    md = folder / f"{name}.md"
    md.write_text(text.rstrip("\n") + "\n")
    return md, write_json(folder / f"{name}.json", data, command=command, machine=machine)
