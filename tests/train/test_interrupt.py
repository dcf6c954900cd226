"""Ctrl-C (issue #15 item 2): the first SIGINT stops every worker at one step, saves it on every worker and
exits 130 with one line that says how to resume; a second one quits at once, keeping the last complete
checkpoint and leaving no temporary files. A resumed run ends exactly where an uninterrupted one does.

The stop step is agreed without waiting for anyone: at each step boundary a worker reports its step, and
the first to see the interrupt picks max(its step, 1 + the furthest step another worker has passed)
(:class:`~noloco.train.interrupt.LocalStop` for threads, :class:`~noloco.train.interrupt.StoreStop` over
the torch.distributed store for processes), so the agreement is tested here on its own too.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from noloco.train import checkpoint
from noloco.train import interrupt as ctrl_c
from noloco.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"interrupted at step (\d+): resume with python train\.py resume=(\S+)/checkpoints/latest$")
TRAIN = [sys.executable, str(ROOT / "train.py")]


@pytest.fixture
def interrupt():
    ctrl_c.INTERRUPT.reset()
    yield ctrl_c.INTERRUPT
    ctrl_c.INTERRUPT.reset()


# ------------------------------------------------------------------------------- agreeing on a step


def _race(make_stop, workers: int, seed: int, interrupt) -> dict[int, list[int]]:
    """``workers`` threads stepping at different speeds; the interrupt lands at a random moment. Returns the
    steps each worker finished (it stops after the step its agreement names)."""
    rng = random.Random(seed)
    delays = [rng.uniform(0.0005, 0.004) for _ in range(workers)]
    done: dict[int, list[int]] = {r: [] for r in range(workers)}

    def worker(rank: int) -> None:
        stop = make_stop(rank)
        for step in range(1, 2000):
            time.sleep(delays[rank] * (1 + rng.random()))
            done[rank].append(step)
            if stop(rank, step):
                return

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.02, 0.1))
    interrupt.requested = True
    for t in threads:
        t.join(30)
    return done


@pytest.mark.parametrize("seed", range(5))
def test_threads_stop_at_one_step_without_passing_it(interrupt, seed):
    stop = ctrl_c.LocalStop()
    done = _race(lambda rank: stop, 4, seed, interrupt)
    assert {steps[-1] for steps in done.values()} == {stop.target}
    assert stop.target < 1999


@pytest.mark.parametrize("seed", range(3))
def test_processes_agree_over_the_store(interrupt, seed):
    """The same over a real TCPStore, one client per rank (as processes would have)."""
    server, clients = _clients(3)
    stops = [ctrl_c.StoreStop(clients[r], r, 3, 0, 10.0) for r in range(3)]
    done = _race(lambda rank: stops[rank], 3, seed, interrupt)
    targets = {s.target for s in stops}
    assert len(targets) == 1
    assert {steps[-1] for steps in done.values()} == targets


class _FarStore:
    """A real TCPStore client ``delay`` seconds away: every request waits that long first, as across a slow
    or busy link. Keeps the names of the threads that made requests."""

    def __init__(self, store, delay: float):
        self.store, self.delay, self.threads = store, delay, set()

    def _call(self, name: str, *args):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return getattr(self.store, name)(*args)

    def set(self, *args):
        return self._call("set", *args)

    def get(self, *args):
        return self._call("get", *args)

    def check(self, *args):
        return self._call("check", *args)

    def compare_set(self, *args):
        return self._call("compare_set", *args)

    def wait(self, *args):
        return self._call("wait", *args)


def _clients(n: int, delay: float = 0.0):
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    clients = [dist.PrefixStore("noloco/stop/0/", dist.TCPStore("127.0.0.1", server.port, 1, False,
                                                                 timedelta(seconds=30))) for _ in range(n)]  # fmt: skip
    return server, [_FarStore(c, delay) for c in clients] if delay else clients


@pytest.mark.parametrize("seed", range(3))
def test_processes_agree_over_a_far_store(interrupt, seed):
    """A store several steps away: each rank promises steps ahead of where it is, and still none passes the
    agreed step. "Several steps away" is relative to the steps' pace, which load stretches (a 6 ms store was one
    step away at a load of 10 on 2 cores), so the store moves farther until the promises did run ahead."""
    for delay in (0.006, 0.03, 0.15):
        interrupt.reset()
        server, clients = _clients(3, delay=delay)
        stops = [ctrl_c.StoreStop(clients[r], r, 3, 0, 10.0) for r in range(3)]
        done = _race(lambda rank, stops=stops: stops[rank], 3, seed, interrupt)
        targets = {s.target for s in stops}
        assert len(targets) == 1
        assert {steps[-1] for steps in done.values()} == targets
        if max(s._lag() for s in stops) > 1:  # the promises did run ahead
            break
    assert max(s._lag() for s in stops) > 1, delay


def test_a_far_store_costs_the_boundaries_no_round_trips(interrupt):
    """Step boundaries do not wait on a store across a slow link: every request of 200 boundaries is the reporter
    thread's (which thread made them, not how long they took: a loaded machine stretches any time)."""
    server, (client,) = _clients(1, delay=0.02)
    stop = ctrl_c.StoreStop(client, 0, 1, 0, 10.0)
    for step in range(1, 201):
        time.sleep(0.002)
        assert not stop(0, step)
    stop.close()
    assert client.threads == {"noloco-stop0"}
    interrupt.requested = True
    assert stop(0, 201) and stop.target == 201 and "MainThread" in client.threads


def test_a_lag_that_shrinks_does_not_lower_the_promise(interrupt):
    """A busy link's round trips make a long lag, a quiet one a short lag. A promise written after the lag
    shrank must still cover the steps the long one cleared: if the link then stalls, the rank goes on through
    them while the proposer reads its last promise, and that must not be lower than where the rank is."""
    server, (far, near) = _clients(2, delay=0.02)
    near.delay = 0.0
    stop, proposer = ctrl_c.StoreStop(far, 0, 2, 0, 10.0), ctrl_c.StoreStop(near, 1, 2, 0, 10.0)
    step = 0
    for step in range(1, 61):  # a busy link: round trips of 40 ms against 2 ms steps
        time.sleep(0.002)
        assert not stop(0, step)
    long_lag = stop._lag()
    far.delay = 0.0
    # a quiet link: once the slow round trips have aged out, the lag is short. Steps of 10 ms here, so that round
    # trips of a few ms (a loaded machine's loopback) make a short lag too: with 2 ms steps, trips over 1 ms at load 15
    # kept the lag above 2 for 7,000 steps
    while stop._lag() > 2:
        step += 1
        time.sleep(0.01)
        assert not stop(0, step)
    for _ in range(5):  # promises written with the short lag
        step += 1
        time.sleep(0.002)
        assert not stop(0, step)
    assert long_lag > 10 and step < 1000
    far.delay = 0.3  # the link stalls: the reporter's next write takes 0.3 s to land
    for _ in range(10):  # steps the long lag cleared, taken while it is stuck
        step += 1
        assert not stop(0, step)
    interrupt.requested = True
    assert not proposer(1, 1)  # rank 1 proposes from the promises it reads; rank 0 then sees its own interrupt
    while not stop(0, step + 1):
        step += 1
    assert step + 1 == proposer.target == stop.target


def test_a_rank_whose_store_host_died_stops_alone(interrupt, caplog):
    host = subprocess.Popen([sys.executable, "-c", "import time, datetime, torch.distributed as d; "
                             "s = d.TCPStore('127.0.0.1', 0, 1, True, datetime.timedelta(seconds=30)); "
                             "print(s.port, flush=True); time.sleep(120)"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=5))
        stop = ctrl_c.StoreStop(client, 1, 2, 0, 10.0)
        assert not stop(1, 1) and not stop(1, 2)
        host.kill()
        host.wait()
        for step in range(3, 200):
            assert not stop(1, step)
            if stop.alone is not None:
                break
            time.sleep(0.01)
        assert stop.alone is not None and "stops alone" in caplog.text
        interrupt.requested = True
        assert stop(1, step + 1)
    finally:
        host.kill()


def test_a_single_worker_stops_at_its_next_step(interrupt):
    assert not ctrl_c.stop_here(None, 0, 4)
    interrupt.requested = True
    assert ctrl_c.stop_here(None, 0, 5) and interrupt.solo.target == 5


def test_second_interrupt_removes_temporary_files_and_the_unfinished_folder(tmp_path, monkeypatch):
    """What a second Ctrl-C leaves: the last complete checkpoint, no temporary file, no unfinished folder."""
    exits = []
    monkeypatch.setattr(checkpoint.os, "_exit", exits.append)
    monkeypatch.setattr(checkpoint, "_WRITES", checkpoint._Writes())
    checkpoint.save_worker(tmp_path, 5, 0, {"w": torch.ones(3)})
    checkpoint.completes_checkpoints()
    checkpoint.mark_complete(tmp_path, 5, "steps: 20\n", keep=2)
    checkpoint.save_worker(tmp_path, 10, 0, {"w": torch.ones(3)})  # the stop save, cut short:
    unfinished = checkpoint.step_dir(tmp_path, 10)
    tmp = checkpoint.step_dir(tmp_path, 5) / f".config.yaml.{os.getpid()}.x.tmp"  # a write still going on
    tmp.write_bytes(b"partial")
    checkpoint._WRITES.temps.add(str(tmp))
    ctrl_c.hard_exit(130, tmp_path)
    assert exits == [130] and not unfinished.exists() and not tmp.exists()
    assert checkpoint.resolve(tmp_path / "checkpoints" / "latest")[2] == 5
    with pytest.raises(checkpoint.Closing):  # nothing is written after it
        checkpoint.save_worker(tmp_path, 10, 1, {"w": torch.ones(3)})


# --------------------------------------------------------------------------------- a real train.py


# Long enough that Ctrl-C at step 12 lands mid-run on any machine (a tiny step is ~0.05 s here), and that the
# bigger model's ~1 s steps cannot all run within the tests' 60 s; each run's clean twin and resume train them all.
STEPS = 90


def _args(tiny_overrides, *extra: str) -> list[str]:
    return [*tiny_overrides, "workers=2", "threads=1", f"steps={STEPS}", "outer.every=5", "log.tensorboard=false",
            "log.plot=false", *extra]  # fmt: skip


def _wait_for_step(proc: subprocess.Popen, metrics: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists():
            try:
                if any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines() if line):
                    return
            except ValueError:  # a line being written
                pass
        time.sleep(0.02)
    raise AssertionError(f"no step {step} in {metrics} within {timeout}s")


def _losses(run_dir: Path) -> dict:
    return {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(run_dir)}


def _temporary_files(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / "checkpoints").rglob(".*")] if (run_dir / "checkpoints").exists() else []


_CLEAN: list[Path] = []


def _clean_run(tiny_overrides, tmp_path: Path) -> Path:
    """The uninterrupted local-backend run of the same config (once per session; kept beside the session's tmp
    folders, since a test's own tmp_path goes when it passes). The torch backend's run of it is the same bit for
    bit (tests/train/test_distributed.py), so it is the twin of a run on either backend."""
    if not _CLEAN:
        done = subprocess.run([*TRAIN, *_args(tiny_overrides, "backend=local", "run.name=clean")],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        _CLEAN.append(Path(tempfile.mkdtemp(prefix="clean-", dir=tmp_path.parent)) / "clean")
        shutil.copytree(tmp_path / "clean", _CLEAN[0], symlinks=True)
    return _CLEAN[0]


def _resume_matches_clean(latest: str, clean: Path, run_dir: Path) -> None:
    resumed = subprocess.run([*TRAIN, f"resume={latest}"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(run_dir) == _losses(clean)  # bit-identical, every worker and step
    a = json.loads((run_dir / "summary.json").read_text())
    b = json.loads((clean / "summary.json").read_text())
    assert a["final_eval_loss_per_worker"] == b["final_eval_loss_per_worker"]
    assert a["bytes_sent_by_worker"] == b["bytes_sent_by_worker"]


@pytest.mark.slow
def test_ctrl_c_saves_every_worker_at_one_step_and_resumes_exactly(tiny_overrides, tmp_path):
    """SIGINT mid-run with checkpoint.every=0: exit 130, the line, a complete checkpoint of the stop step on
    every worker, no temporary files; resuming it ends bit-identical to the uninterrupted run."""
    clean = _clean_run(tiny_overrides, tmp_path)
    run_dir = tmp_path / "ctrl-c"
    proc = subprocess.Popen([*TRAIN, *_args(tiny_overrides, "checkpoint.every=0", "run.name=ctrl-c")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for_step(proc, run_dir / "metrics.jsonl", 12)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    match = LINE.fullmatch(err.strip().splitlines()[-1])
    assert match, err[-2000:]
    step = int(match.group(1))
    assert 12 <= step < STEPS and Path(match.group(2)) == run_dir
    folder, _, saved = checkpoint.resolve(run_dir / "checkpoints" / "latest")
    assert saved == step and checkpoint.worker_ranks(folder) == [0, 1]
    assert max(r["step"] for r in read_metrics(run_dir)) == step  # every worker stopped there
    assert not _temporary_files(run_dir)
    assert not (run_dir / "summary.json").exists()  # an interrupted run has no summary yet
    _resume_matches_clean(f"{run_dir}/checkpoints/latest", clean, run_dir)


@pytest.mark.slow
def test_second_ctrl_c_quits_at_once_and_keeps_the_last_complete_checkpoint(tiny_overrides, tmp_path):
    """Two Ctrl-C 0.15 s apart, in a run whose steps take about a second (the default model's size): the
    second lands before or while the stop step is saved; the run quits at once with 130, the last periodic
    checkpoint is intact and resumes, nothing half-written or temporary is left."""
    bigger = ("model.dim=256", "model.n_layers=4", "model.n_heads=4", "data.seq_len=128", "data.batch_size=8")
    run_dir = tmp_path / "twice"
    proc = subprocess.Popen([*TRAIN, *_args(tiny_overrides, *bigger, "checkpoint.every=3", "run.name=twice")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for_step(proc, run_dir / "metrics.jsonl", 4)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.15)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]  # quit, not trained on (STEPS steps of about a second would not fit)
    assert "interrupted again: quit without saving; resume from step" in err.strip().splitlines()[-1], err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert not _temporary_files(run_dir)
    folders = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert folders and all((p / checkpoint.COMPLETE).exists() for p in folders), folders  # none half-written
    folder, _, step = checkpoint.resolve(run_dir / "checkpoints" / "latest")
    assert step >= 3 and checkpoint.load_run(folder, step, [0, 1]) == 512
    resumed = subprocess.run([*TRAIN, f"resume={run_dir}/checkpoints/latest", f"steps={step + 1}"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_on_the_torch_backend_stops_every_rank_at_one_step(tiny_overrides, tmp_path):
    """Ctrl-C reaches the launcher and its ranks (one process group, as from a terminal): the launcher passes
    it on once, the ranks agree on a step over the store, save it, and the run resumes exactly.

    The uninterrupted twin is the local backend's run of the same config (shared with the local Ctrl-C test): the
    torch backend gives the local trajectory bit for bit (tests/train/test_distributed.py), so the resumed torch
    run must end bit-identical to it."""
    clean = _clean_run(tiny_overrides, tmp_path)
    run_dir = tmp_path / "torch"
    proc = subprocess.Popen([*TRAIN, *_args(tiny_overrides, "backend=torch", "checkpoint.every=0", "run.name=torch")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        _wait_for_step(proc, run_dir / "metrics.rank1.jsonl", 12, timeout=300)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    match = LINE.fullmatch(err.strip().splitlines()[-1])
    assert match, err[-2000:]
    step = int(match.group(1))
    folder, _, saved = checkpoint.resolve(run_dir / "checkpoints" / "latest")
    assert saved == step and checkpoint.worker_ranks(folder) == [0, 1]
    assert {max(r["step"] for r in read_metrics(run_dir) if r["worker"] == w) for w in (0, 1)} == {step}
    assert (run_dir / "metrics.jsonl").is_file() and not list(run_dir.glob("metrics.rank*.jsonl"))  # merged
    assert not _temporary_files(run_dir)
    _resume_matches_clean(f"{run_dir}/checkpoints/latest", clean, run_dir)


def test_a_progress_bar_holds_no_semaphore_a_killed_rank_could_leak():
    """A rank still there 5 s after a second Ctrl-C is killed; tqdm's default lock is a process-shared semaphore,
    which a killed process never releases, and the resource tracker then printed a warning after the launcher's
    last line (seen at load 8). The bar's lock is a thread lock: no semaphore is registered, bar on or off."""
    code = (
        "import multiprocessing\n"
        "multiprocessing.set_start_method('spawn')  # as in a spawned rank: named semaphores, tracked\n"
        "from multiprocessing import resource_tracker as rt\n"
        "seen = []\n"
        "rt.register = lambda name, rtype: seen.append(rtype)\n"
        "from noloco.train.run import Progress\n"
        "for enabled in (False, True):\n"
        "    bar = Progress(10, 0, 2, enabled)\n"
        "    bar.advance(0, 1.0)\n"
        "print(seen)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow
def test_second_ctrl_c_on_the_torch_backend_quits_at_once(tiny_overrides, tmp_path):
    """The launcher passes the second Ctrl-C on, the ranks quit, the launcher exits 130 within seconds; the
    last periodic checkpoint is intact and nothing temporary is left.

    The stop checkpoint (a step after 4) is made slow (``sleep:3`` half-written), so that the second Ctrl-C
    always arrives while it is being written: on a busy machine a fast save could finish first."""
    bigger = ("model.dim=256", "model.n_layers=4", "model.n_heads=4", "data.seq_len=128", "data.batch_size=8")
    run_dir = tmp_path / "torch-twice"
    slow_saves = ",".join(f"checkpoint.mid@{step}=sleep:3" for step in range(5, 13))
    proc = subprocess.Popen([*TRAIN, *_args(tiny_overrides, *bigger, "backend=torch", "checkpoint.every=3",
                                            "run.name=torch-twice")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NOLOCO_FAULTS": slow_saves}, start_new_session=True)  # fmt: skip
    try:
        _wait_for_step(proc, run_dir / "metrics.rank1.jsonl", 4, timeout=300)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.15)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]  # quit, not trained on (STEPS steps of about a second would not fit)
    assert "interrupted again: quit without saving; resume from step" in err.strip().splitlines()[-1], err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert not _temporary_files(run_dir)
    folder, _, step = checkpoint.resolve(run_dir / "checkpoints" / "latest")
    assert step >= 3 and checkpoint.load_run(folder, step, [0, 1]) == 512
