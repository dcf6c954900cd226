"""``run.restarts`` (issue #36, fast rejoin): ``train.py`` supervises its run in a forked process and starts it
again from its last checkpoint when it dies, with the imports kept. Real ``train.py`` processes, real SIGKILLs:
a killed run ends exactly as an uninterrupted one; a run that keeps dying stops when its restarts run out; one
that dies before its first checkpoint, or with a status a restart cannot mend (a bad config, Ctrl-C), is not
started again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers import children
from noloco.train import checkpoint
from noloco.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [sys.executable, str(ROOT / "train.py")]
STEPS = 40


def _args(tiny_overrides, *extra: str) -> list[str]:
    return [*tiny_overrides, "workers=2", "threads=1", f"steps={STEPS}", "outer.every=5", "checkpoint.every=5",
            "eval.every=20", "log.tensorboard=false", "log.plot=false", *extra]  # fmt: skip


def _wait(condition, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.02)


def _saved_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    try:
        return checkpoint.resolve(latest)[2] if latest.exists() else 0
    except checkpoint.CheckpointError:  # being written
        return 0


def _losses(run_dir: Path) -> dict:
    return {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(run_dir)}


@pytest.mark.parametrize(
    "device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]
)
def test_a_killed_run_is_restarted_from_its_last_checkpoint_and_ends_as_an_uninterrupted_one(
    tiny_overrides, tmp_path, device
):
    """On a GPU too: the supervisor checks the config (device=cuda) without initializing CUDA, which a forked
    run could not use then."""
    clean = subprocess.run([*TRAIN, *_args(tiny_overrides, "run.name=clean", f"device={device}")],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([*TRAIN, *_args(tiny_overrides, "run.name=killed", "run.restarts=1", f"device={device}")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait(lambda: _saved_step(run_dir) >= 10, proc)
        (child,) = children(proc.pid)
        assert os.getpgid(child) == child  # a group of its own: a kill of it leaves the supervisor
        os.killpg(child, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "the run died (SIGKILL); restarting it from" in err and "(restart 1 of 1)" in err, err[-3000:]
    assert _losses(run_dir) == _losses(tmp_path / "clean")  # bit-identical, every worker and step
    a, b = (json.loads((d / "summary.json").read_text()) for d in (run_dir, tmp_path / "clean"))
    assert a["final_eval_loss_per_worker"] == b["final_eval_loss_per_worker"]


def test_a_run_that_keeps_dying_stops_when_its_restarts_run_out(tiny_overrides, tmp_path):
    env = {**os.environ, "NOLOCO_FAULTS": "inner.step@8=kill"}  # every start from step 5 dies at step 8
    done = subprocess.run([*TRAIN, *_args(tiny_overrides, "run.name=dies", "run.restarts=2")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    assert done.stderr.count("restarting it from") == 2, done.stderr[-3000:]
    assert "the run died (SIGKILL); no restarts left (run.restarts=2)" in done.stderr
    assert _saved_step(tmp_path / "dies") == 5  # the checkpoint each restart resumed from, intact


def test_a_run_that_dies_before_its_first_checkpoint_is_not_restarted(tiny_overrides, tmp_path):
    env = {**os.environ, "NOLOCO_FAULTS": "inner.step@3=kill"}
    done = subprocess.run([*TRAIN, *_args(tiny_overrides, "run.name=early", "run.restarts=2")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    assert "before its first complete checkpoint: nothing to restart from" in done.stderr
    assert "restarting" not in done.stderr


def test_a_status_a_restart_cannot_mend_is_not_restarted(tiny_overrides, tmp_path):
    """A folder of no text as the data (found by the run, after the fork) ends the run with 2, once; a bad value
    of the key itself is a config error before anything starts; under torchrun the ranks are torchrun's to
    restart."""
    (tmp_path / "empty").mkdir()  # a folder of no text: the corpus refuses it
    done = subprocess.run([*TRAIN, *_args(tiny_overrides, "run.name=bad", "run.restarts=3", "data.source=files",
                                          f"data.path={tmp_path / 'empty'}")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("supervising the run") == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")
    for value in ("-1", "1.5", "true"):
        done = subprocess.run([*TRAIN, *_args(tiny_overrides, f"run.restarts={value}")], capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert done.returncode == 2 and "supervising" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("error: run.restarts must be an integer >= 0")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    done = subprocess.run([*TRAIN, *_args(tiny_overrides, "run.name=torchrun", "backend=torch", "run.restarts=1")],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 2 and "let torchrun restart the ranks" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_stops_a_supervised_run_as_it_stops_one_alone(tiny_overrides, tmp_path):
    """SIGINT to the supervisor reaches the run's process group: it saves its stop step and exits 130 with the
    resume line, and is not started again."""
    run_dir = tmp_path / "ctrl-c"
    proc = subprocess.Popen([*TRAIN, *_args(tiny_overrides, "run.name=ctrl-c", "run.restarts=2",
                                            "checkpoint.every=0", f"steps={10 * STEPS}")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait(lambda: any(r["step"] >= 12 for r in read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists()
              else False, proc)  # fmt: skip
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "restarting" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted at step ") and "resume with" in err, err[-2000:]
    assert 12 <= _saved_step(run_dir) < 10 * STEPS
