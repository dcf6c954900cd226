"""Real swarm peers for the benchmarks: ``python train.py backend=hivemind`` processes on loopback.

:class:`PeerSwarm` starts peers (each in its own session, so that the peer, its DHT process and its p2pd
daemon are one process group), finds a first peer's multiaddrs, waits for them to finish, reads their
``summary.json``, ``rounds.jsonl`` and ``metrics.jsonl``, kills a peer's whole group, and on exit kills every
group it started. Used by ``benchmarks/straggler.py`` and ``benchmarks/swarm_scale.py``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "benchmark-swarm-key-0123"

#: Every peer's overrides: a tiny model on the default corpus, loopback only, short matchmaking waits.
TINY = [
    "backend=hivemind", "device=cpu", "model.preset=tiny", "data.seq_len=32", "data.batch_size=4",
    "data.vocab_size=512", "eval.batches=1", "log.tensorboard=false", "log.plot=false", "log.progress=false",
    "threads=1",
    "checkpoint.final=false", 'peer.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', "peer.window=3.0", "peer.slack=0.5",
    "peer.confirm_timeout=4", "peer.matchmaking_timeout=8", "peer.live_timeout=20", "comm.recv_timeout=20",
    "comm.group_timeout=20", "comm.startup_timeout=300", "peer.join_timeout=600",
]  # fmt: skip


def slow_steps(steps: int, seconds: float, start: int = 1) -> str:
    """A ``NOLOCO_FAULTS`` value that sleeps ``seconds`` before each inner step ``start..steps``."""
    return ",".join(f"inner.step@{s}=sleep:{seconds:.4f}" for s in range(start, steps + 1))


def children(pid: int) -> list[int]:
    """The direct children of process ``pid`` (Linux ``/proc``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2 :].split()[1] == str(pid):  # after "pid (comm) ": state, ppid, ...
                out.append(int(entry))
    return out


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


class PeerSwarm:
    """Peers of one run (``run.name=swarm``) under ``folder``; ``close`` kills every process group started."""

    def __init__(self, folder: Path, overrides: list[str]):
        self.folder, self.overrides = Path(folder), list(overrides)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []

    def peer(self, name: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
        """Start peer ``name`` (``python train.py`` with the swarm's and these overrides)."""
        environ = {**os.environ, "NOLOCO_RUN_KEY": KEY, **(env or {})}
        environ.setdefault("OMP_NUM_THREADS", "1")
        args = [sys.executable, str(ROOT / "train.py"), *self.overrides, f"run.dir={self.folder}", "run.name=swarm",
                f"peer.name={name}", *overrides]  # fmt: skip
        log = (self.folder / f"{name}.log").open("a")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        self.procs[name] = proc
        self.started.append(proc)
        return proc

    def peer_dir(self, name: str) -> Path:
        return self.folder / "swarm" / f"peer-{name}"

    def maddr(self, name: str, timeout: float = 300) -> str:
        """The first multiaddr peer ``name`` listens on (once it has written ``maddrs.json``)."""
        path = self.peer_dir(name) / "maddrs.json"
        self.wait(path.exists, timeout, f"peer {name} did not start")
        return json.loads(path.read_text())["maddrs"][0]

    def wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f} s; see {self.folder}/*.log")
            time.sleep(0.1)

    def finish(self, names: list[str], timeout: float) -> dict[str, int]:
        """Wait for peers ``names``; their exit codes (a peer still running at ``timeout`` raises)."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"peer {name} did not finish within {timeout:.0f} s; see {self.folder}") from None
        return codes

    def summary(self, name: str) -> dict | None:
        path = self.peer_dir(name) / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def rounds(self, name: str) -> list[dict]:
        path = self.peer_dir(name) / "rounds.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def metrics(self, name: str) -> list[dict]:
        path = self.peer_dir(name) / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return out

    def kill(self, name: str) -> None:
        """SIGKILL peer ``name``'s process group (the peer, its DHT process, its p2pd) and reap it."""
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)

    def close(self) -> None:
        for proc in self.started:  # a supervised peer's run (run.restarts) leads a process group of its own
            for pid in [c for c in children(proc.pid) if _leads_group(c)] + [proc.pid]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> PeerSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tokens_per_second(summary: dict, tokens_per_step: int) -> float:
    """A peer's training tokens per second of its training loop (start-up and the wait for peers left out)."""
    tokens = (summary["steps"] - summary["eval_history"][0][0]) * tokens_per_step
    return tokens / summary["loop_seconds_by_worker"][0]


def joined_seconds(rounds: list[dict], key: str) -> float | None:
    """Median ``key`` (``matchmaking_seconds``, ``exchange_seconds``) over the rounds a peer joined."""
    values = [r[key] for r in rounds if r.get("outcome") == "joined"]
    return statistics.median(values) if values else None
