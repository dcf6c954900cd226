"""Helpers for swarm tests: real peer processes (``python train.py backend=hivemind``) on loopback, and real DHT
nodes with endpoints inside the test process (``in_process_peers``) for matchmaking tests.

Every process is started in its own session; the fixture's teardown kills each of those process
groups (the peer, its forked DHT process and its p2pd daemon), whatever the test did.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from noloco.data.corpus import prepare_corpus
from noloco.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
KEY = "swarm-test-key-0123"
SWARM = [  # on top of the tests' smoke overrides
    "log.tensorboard=false",
    "log.plot=false",  # no swarm test reads curves.png; drawing it costs each peer about a CPU second at its end
    "threads=1",
    "comm.recv_timeout=15",
    "comm.group_timeout=15",
    "comm.startup_timeout=60",
    'peer.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "peer.window=3.0",
    "peer.slack=0.5",
    "peer.live_timeout=15",
    "peer.confirm_timeout=4",
    "peer.matchmaking_timeout=8",
]


@contextlib.contextmanager
def _in_process_peers(run: str, secret: str, count: int):
    """``count`` peers of run ``run``: each a DHT node under its own identity (the first bootstraps the others) and a
    ``SwarmEndpoint`` on its p2pd, all on loopback in this process; ``[(dht, endpoint), ...]``, shut down on exit."""
    from noloco.swarm import PeerIdentity, RunRecordValidator, SwarmEndpoint, run_key_from, start_peer_dht

    key = run_key_from(secret)
    peers: list[tuple] = []
    try:
        for _ in range(count):
            identity = PeerIdentity.generate()
            validator = RunRecordValidator.create(key, run, 600, identity)
            initial = [str(m) for m in peers[0][0].get_visible_maddrs()] if peers else []
            dht = start_peer_dht(initial, ["/ip4/127.0.0.1/tcp/0"], record_validators=[validator], identity=identity)
            peers.append((dht, SwarmEndpoint.from_dht(dht, run, key, send_timeout=10, identity=identity)))
        yield peers
    finally:
        for dht, endpoint in peers:
            endpoint.close()
            dht.shutdown()


@pytest.fixture(scope="session")
def in_process_peers():
    """``in_process_peers(run, secret, count)``: a context manager of real DHT peers in this process (a module's
    fixture holds one open for its tests)."""
    return _in_process_peers


def _form_rounds(makers, rounds: list[int], timeout: float, field: str, pause: float = 0.0,
                 join: float = 180.0) -> dict[tuple[int, int], tuple]:  # fmt: skip
    """Each of ``makers`` forms ``rounds`` in a thread of its own, pausing ``pause`` seconds after each round; its
    groups are released. ``{(peer, round): (sorted members or None, outcome, that round's record.<field>)}``."""
    results: dict[tuple[int, int], tuple] = {}

    def run(i: int) -> None:
        for r in rounds:
            group = makers[i].form(r, timeout)
            record = makers[i].rounds[-1]
            results[i, r] = (None if group is None else sorted(group.peer_ids), record.outcome, getattr(record, field))
            if group is not None:
                makers[i].release(group)
            time.sleep(pause)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(makers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join)
    return results


@pytest.fixture(scope="session")
def form_rounds():
    """``form_rounds(makers, rounds, timeout, field, pause=0, join=180)``: every matchmaking instance
    forms the rounds in its own thread; ``{(peer, round): (members or None, outcome, record.<field>)}``."""
    return _form_rounds


@pytest.fixture(scope="session")
def swarm_overrides(smoke_overrides) -> list[str]:
    """Every peer's overrides: the smoke run's plus loopback-only, short-timeout swarm settings."""
    return [*smoke_overrides, *SWARM]


@pytest.fixture(scope="session")
def swarm_cache(tmp_path_factory, swarm_overrides) -> Path:
    """The tokenized corpus, prepared once so that peer processes do not race to build it."""
    cache = tmp_path_factory.mktemp("swarm-data")
    cfg = load_config([*swarm_overrides, f"data.cache_dir={cache}"])
    prepare_corpus(cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir)
    return cache


class Swarm:
    """Starts peers and a hivemind-dht bootstrap; ``close`` kills whatever is still running."""

    key = KEY  # the run key every honest peer gets

    def __init__(self, run_dir: Path, cache: Path, overrides: list[str]):
        self.run_dir, self.cache, self.overrides = run_dir, cache, overrides
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []  # every process, also those a restart replaced in procs

    @staticmethod
    def paced(steps: int, seconds: float) -> dict[str, str]:
        """A peer's environment that makes it sleep ``seconds`` before each of its ``steps`` inner steps
        (``NOLOCO_FAULTS``): a floor under its pace, so that how fast a loaded machine runs each peer matters less."""
        return {"NOLOCO_FAULTS": ",".join(f"inner.step@{s}=sleep:{seconds}" for s in range(1, steps + 1))}

    def peer(self, name: str, *overrides: str, key: str | None = KEY, env: dict | None = None) -> subprocess.Popen:
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if k != "NOLOCO_RUN_KEY"}
        env.update(extra)
        if key is not None:
            env["NOLOCO_RUN_KEY"] = key
        args = [sys.executable, str(ROOT / "train.py"), "backend=hivemind", *self.overrides,
                f"data.cache_dir={self.cache}", f"run.dir={self.run_dir}", "run.name=swarm", f"peer.name={name}",
                *overrides]  # fmt: skip
        log = (self.run_dir / f"{name}.log").open("w")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        self.procs[name] = proc
        self.started.append(proc)
        return proc

    def attacker(self, name: str, attack: str, target: str, *args: str, key: str | None = None) -> Path:
        """Start ``tests/swarm/hostile.py <attack>`` against peer ``target``; returns its stats file."""
        out = self.run_dir / f"{name}.stats.json"
        env = {k: v for k, v in os.environ.items() if k != "NOLOCO_RUN_KEY"}
        if key is not None:
            env["NOLOCO_RUN_KEY"] = key
        command = [sys.executable, str(ROOT / "tests" / "swarm" / "hostile.py"), attack,
                   "--target", str(self.peer_dir(target) / "maddrs.json"), "--out", str(out), *args]  # fmt: skip
        log = (self.run_dir / f"{name}.log").open("w")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        self.procs[name] = proc
        self.started.append(proc)
        return out

    @staticmethod
    def stats(path: Path) -> dict:
        return json.loads(path.read_text()) if path.exists() else {}

    # the hostile-peer tests' honest side (test_hostile*.py): a pair of honest peers, the attacker's stats, the checks

    def pair(self, steps: int, every: int, *extra: str, attacker: bool = False, pace: float = 0.0) -> tuple[str, ...]:
        """Start honest peers a and b (b bootstrapped from a); both wait for each other before training, and with
        ``attacker`` also for a third live peer (up to 120 s): the attacker started next, which lists itself live.
        An attack that must meet both honest peers in its first rounds needs this on a loaded machine, where the
        attacker's start (imports, its DHT node) can take longer than the honest peers' first rounds. ``pace``:
        seconds each honest peer sleeps before every inner step (``NOLOCO_FAULTS``), so that a run lasts at least
        ``steps × pace`` however fast the machine: an attacker whose every group costs it seconds gets its rounds."""
        common = (f"steps={steps}", f"outer.every={every}", *extra)
        if attacker:
            common += ("peer.wait_for_peers=2", "peer.join_timeout=120")
        else:
            common += ("peer.wait_for_peers=1",)
        env = self.paced(steps, pace) if pace else None
        self.peer("a", *common, "peer.worker=0", env=env)
        join = f'peer.initial_peers=["{self.maddrs("a")[0]}"]'
        self.peer("b", *common, join, "peer.worker=1", env=env)
        return common + (join,)

    def wait_ready(self, stats_path: Path, timeout: float = 90) -> None:
        self.wait(lambda: self.stats(stats_path).get("ready") or self.stats(stats_path).get("done"), timeout,
                  "the attacker did not start")  # fmt: skip

    def outcome(self, names: tuple[str, ...], stats_path: Path, timeout: float) -> tuple[dict, dict, dict]:
        """Wait for ``names`` to exit 0; the attacker's stats and the summaries of honest peers a and b."""
        for name in names:
            assert self.finish(name, timeout=timeout) == 0, self.logs()
        return self.stats(stats_path), self.summary("a"), self.summary("b")

    def train_seconds(self, name: str) -> float:
        """Seconds of the peer's training loop (metrics' wall clock at its last step)."""
        lines = (self.peer_dir(name) / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["wall"]

    @staticmethod
    def check_rounds(s: dict, steps: int, period: int) -> None:
        """A peer's summary has one round per ``period`` steps from its first step, less the whole rounds its skips
        passed over (``peer.catch_up``: a peer behind the swarm's steps goes on from the swarm's step). A skip into a
        round's last step passes over the rounds of the steps it skips, rounded down (none, for a skip of fewer than
        ``period`` steps), so with several skips the count lies between that of their total and the count without."""
        whole = (steps - s["eval_history"][0][0]) // period
        skipped = sum(s["steps_skipped_by_worker"])
        assert whole - skipped // period <= s["rounds"] <= whole, (s["rounds"], whole, skipped, s["round_outcomes"])

    @staticmethod
    def check_trained(s: dict, min_joined: int) -> None:
        """An honest peer's summary: finite, its held-out loss fell, and it joined at least ``min_joined`` rounds."""
        first_loss = s["eval_history"][0][1]
        assert s["slow_weights_finite"] and math.isfinite(s["final_eval_loss"])
        assert s["final_eval_loss"] < first_loss - 0.5, s["eval_history"]
        assert s["rounds_joined"] >= min_joined, s["round_outcomes"]

    def group_rss_mb(self, name: str) -> float:
        """Resident memory (MB) of peer ``name``'s process group now: the peer, its DHT process and its p2pd."""
        total = 0
        for pid in self.group_members(self.procs[name].pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        return total / 1024

    def peer_dir(self, name: str) -> Path:
        return self.run_dir / "swarm" / f"peer-{name}"

    def maddrs(self, name: str, timeout: float = 60) -> list[str]:
        path = self.peer_dir(name) / "maddrs.json"
        self.wait(lambda: path.exists(), timeout, f"peer {name} did not start")
        return json.loads(path.read_text())["maddrs"]

    def bootstrap_dht(self, timeout: float = 60) -> str:
        """Start hivemind's own `hivemind-dht` and return a multiaddr peers can use as initial peer."""
        log_path = self.run_dir / "hivemind-dht.log"
        command = ["hivemind-dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"]
        log = log_path.open("w")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs["hivemind-dht"] = proc
        self.started.append(proc)
        found: list[str] = []

        def ready() -> bool:
            found[:] = re.findall(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", log_path.read_text())
            return bool(found)

        self.wait(ready, timeout, "hivemind-dht did not print its multiaddrs")
        return found[0]

    def wait(self, condition, timeout: float, message: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{message} within {timeout}s; logs: {self.logs()}")
            time.sleep(0.2)

    def finish(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"peer {name} did not finish within {timeout}s; logs: {self.logs()}") from None

    def summary(self, name: str) -> dict:
        return json.loads((self.peer_dir(name) / "summary.json").read_text())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.run_dir.glob("*.log")))

    @staticmethod
    def stopped(pid: int) -> bool:
        """Whether process ``pid`` is stopped (SIGSTOP)."""
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2] == "T"

    @staticmethod
    def group_members(pgid: int) -> list[int]:
        """Live processes (not zombies) of process group ``pgid``."""
        out = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
        return out

    def close(self) -> None:
        """Kill every started process *group* (a peer, its DHT process and its p2pd daemon)."""
        for proc in self.started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # each process leads its own session
            except ProcessLookupError:
                pass
        for proc in self.started:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def swarm(tmp_path, swarm_cache, swarm_overrides):
    swarm = Swarm(tmp_path, swarm_cache, swarm_overrides)
    try:
        yield swarm
    finally:
        swarm.close()
