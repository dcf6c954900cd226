"""Injected faults on the in-process backend: dropped and delayed links, a crashing worker.

Runs use ``NOLOCO_FAULTS`` (noloco.comm.faults) exactly as an experiment would. The in-process
backend cannot SIGKILL one worker (it is a thread), so a crash is ``raise``; SIGKILL is tested on the
torch backend (test_torch_backend.py) and the swarm (tests/swarm).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from noloco.comm import LocalFabric, faults
from noloco.comm.base import CommAborted, CommError, CommTimeout
from noloco.models.llama import LLaMA, model_config
from noloco.optim.algorithms import NoLoCo
from noloco.train.backends.local import launch as run
from noloco.train.metrics import read_metrics

COMMON = ("steps=12", "outer.every=4", "workers=4", "threads=1", "log.tensorboard=false", "log.plot=false")


def _rounds(run_dir) -> dict[tuple[int, int], dict]:
    """(worker, step) → the metrics record of each outer round."""
    return {(r["worker"], r["step"]): r for r in read_metrics(run_dir) if "outer_round" in r}


def _losses(run_dir) -> dict[tuple[int, int], float]:
    return {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(run_dir)}


# ----------------------------------------------------------------------------------------- the spec


def test_fault_spec_knows_link_faults_and_every_point():
    assert faults.parse(
        "outer.exchange@4/1=drop, outer.exchange@8=delay:0.25, outer.send@4/2=kill, inner.step@3=raise"
    ) == {
        ("outer.exchange", 4, 1): "drop",
        ("outer.exchange", 8, None): "delay:0.25",
        ("outer.send", 4, 2): "kill",
        ("inner.step", 3, None): "raise",
    }
    for bad in ("outer.exchange@4=delay", "outer.exchange@4=delay:-1", "outer.exchange@4=delay:soon",
                "checkpoint.mid@4=drop", "outer.exchnage@4=kill", "outer.exchange@4=explode",
                "checkpoint.mid@4=sleep:-1", "checkpoint.mid@4=sleep:inf", "checkpoint.mid@4=sleep"):  # fmt: skip
        with pytest.raises(faults.FaultSpecError):
            faults.parse(bad)


def test_a_sleep_fault_holds_the_calling_thread_at_its_point_only(monkeypatch):
    monkeypatch.setenv("NOLOCO_FAULTS", "checkpoint.mid@5=sleep:0.3")
    started = time.monotonic()
    assert faults.fire("checkpoint.mid", 5) is None and time.monotonic() - started >= 0.3
    monkeypatch.setenv("NOLOCO_FAULTS", "checkpoint.mid@5=sleep:3600")  # step 6 must not sleep: no hour passes
    assert faults.fire("checkpoint.mid", 6) is None


def test_faulty_transport_drops_delays_and_fires_after_the_first_send(monkeypatch):
    fabric = LocalFabric(2)
    monkeypatch.setenv("NOLOCO_FAULTS", "outer.exchange@4/0=drop")
    link = faults.fire("outer.exchange", 4, 0)
    dropping = faults.exchange_transport(fabric.transports[0], link, 4, 0)
    dropping.send(1, "a", b"xyz")
    assert dropping.dropped == 1 and fabric.pending() == 0 and fabric.transports[0].counter.messages_sent == 0
    assert faults.fire("outer.exchange", 4, 1) is None  # another rank: nothing
    assert faults.exchange_transport(fabric.transports[1], None, 4, 1) is fabric.transports[1]

    monkeypatch.setenv("NOLOCO_FAULTS", "outer.exchange@4=delay:0.2")
    delayed = faults.exchange_transport(fabric.transports[0], faults.fire("outer.exchange", 4, 0), 4, 0)
    started = time.monotonic()
    delayed.send(1, "b", b"xyz")
    assert time.monotonic() - started >= 0.2 and fabric.transports[1].recv(0, "b", 1.0) == b"xyz"

    monkeypatch.setenv("NOLOCO_FAULTS", "outer.send@4/0=raise")
    crashing = faults.exchange_transport(fabric.transports[0], None, 4, 0)
    with pytest.raises(RuntimeError, match="injected fault at outer.send@4"):
        crashing.send(1, "c", b"first")  # delivered, then the worker "dies"
    assert fabric.transports[1].recv(0, "c", 1.0) == b"first"
    crashing.send(1, "d", b"second")  # fires once


# ----------------------------------------------------------------------------------------- link faults


def test_dropped_link_skips_that_round_for_its_group_only_and_everyone_finishes(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("NOLOCO_FAULTS", "outer.exchange@4/1=drop")
    summary = run(tiny_config(*COMMON[1:], "steps=16", "comm.timeout=2", "run.name=drop"), quiet=True)
    rounds = _rounds(tmp_path / "drop")
    group = rounds[(1, 4)]["group"]
    for worker in range(4):
        skipped = rounds[(worker, 4)].get("outer_skipped")
        if worker in group:  # rank 1 sent nothing: its partner timed out, then told rank 1 so
            assert skipped and "CommTimeout" in skipped
        else:
            assert skipped is None
    assert all(math.isfinite(loss) for loss in summary["final_eval_loss_per_worker"])
    assert max(step for _, step in rounds) == 16


def test_delay_shorter_than_the_timeout_completes_the_round_unchanged(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("NOLOCO_FAULTS", "outer.exchange@4/1=delay:0.3")
    delayed = run(tiny_config(*COMMON, "comm.timeout=10", "run.name=delay"), quiet=True)
    monkeypatch.delenv("NOLOCO_FAULTS")
    clean = run(tiny_config(*COMMON, "comm.timeout=10", "run.name=clean"), quiet=True)
    rounds = _rounds(tmp_path / "delay")
    assert not any("outer_skipped" in record for record in rounds.values())
    # the same trajectory, bit for bit: a slow link costs time, not correctness
    assert _losses(tmp_path / "delay") == _losses(tmp_path / "clean")
    assert delayed["final_eval_loss_per_worker"] == clean["final_eval_loss_per_worker"]
    # rank 1's sends leave one after another, each 0.3 s late: at least the reduce-scatter and the
    # all-gather message of its (default: one fused) reduction
    before = {r["step"]: r["wall"] for r in read_metrics(tmp_path / "delay") if r["worker"] == 1}
    assert before[4] - before[3] >= 2 * 0.3


def test_delay_longer_than_the_timeout_is_a_skipped_round(tiny_config, tmp_path, monkeypatch):
    """Rank 1's sends leave 1.5 s late, its partner waits 1 s: both skip the round. The partner then
    waits for the late worker in the following rounds (skipping while the lag exceeds the timeout,
    each skip halving it) until both are back in step: the last round and the final checkpoint succeed."""
    monkeypatch.setenv("NOLOCO_FAULTS", "outer.exchange@4/1=delay:1.5")
    summary = run(tiny_config("steps=24", "outer.every=4", "workers=2", *COMMON[3:], "comm.timeout=1",
                              "run.name=late"), quiet=True)  # fmt: skip
    rounds = _rounds(tmp_path / "late")
    assert "CommTimeout" in rounds[(0, 4)]["outer_skipped"] and rounds[(1, 4)].get("outer_skipped")
    assert "outer_skipped" not in rounds[(0, 24)] and "outer_skipped" not in rounds[(1, 24)]
    assert all(math.isfinite(loss) for loss in summary["final_eval_loss_per_worker"])


# ----------------------------------------------------------------------------------------- a crashing worker

MODEL = model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64)


def test_survivors_of_a_crashed_worker_skip_its_rounds_and_finish_with_finite_weights(monkeypatch):
    """``outer.exchange@4/1=raise``: rank 1 dies as its first outer step starts; nobody aborts the fabric
    (as with a crashed process). Each partner it would have had times out, skips that round and trains on.
    A skip costs ``timeout``, so the next partner of a worker that skipped may wait for it in vain too
    (a lag of about one timeout): such rounds are skipped as well, until the survivors are back in step."""
    monkeypatch.setenv("NOLOCO_FAULTS", "outer.exchange@4/1=raise")
    timeout, every, rounds = 1.0, 4, 6  # groups (seed 0): [1,3] [1,0] [1,3] [1,2] [1,2] [1,2]; [0,3] last

    def worker(transport):
        model = LLaMA(MODEL, seed=0)
        algo = NoLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), transport, every=every, group_size=2,
                      codec="int4", slow_codec="int8", timeout=timeout)  # fmt: skip
        gen = torch.Generator().manual_seed(transport.rank)
        infos = []
        try:
            for _ in range(every * rounds):
                x = torch.randint(0, 64, (2, 8), generator=gen)
                model(x, x)[1].backward()
                if (info := algo.step()) is not None:
                    infos.append(info)
        except RuntimeError as exc:
            return exc
        return algo.slow_weights(), infos

    results = LocalFabric(4).run(worker, timeout=120)  # a round waits at most one timeout: it returns at all
    assert isinstance(results[1], RuntimeError) and "injected fault" in str(results[1])
    for rank in (0, 2, 3):
        slow, infos = results[rank]
        assert bool(torch.isfinite(slow).all()) and len(infos) == rounds
        for info in infos:
            assert info.skipped is None or "CommTimeout" in info.skipped, (rank, info)
            if 1 in info.group:
                assert info.skipped is not None, (rank, info)
    assert results[0][1][-1].group == [0, 3] and results[0][1][-1].skipped is None  # back in step
    assert results[3][1][-1].skipped is None


def test_a_crash_on_the_local_backend_stops_the_run_at_once(tiny_config, tmp_path, monkeypatch):
    """A worker thread that raises aborts the fabric: the others get CommAborted and stop (they do not
    mistake it for a dead peer and train on), and the run raises the worker's error."""
    monkeypatch.setenv("NOLOCO_FAULTS", "inner.step@6/2=raise")
    with pytest.raises(RuntimeError, match="injected fault at inner.step@6"):
        run(tiny_config("steps=40", "outer.every=4", "workers=4", "threads=1", "log.tensorboard=false",
                        "log.plot=false", "run.name=crash"), quiet=True)  # fmt: skip
    last = max(r["step"] for r in read_metrics(tmp_path / "crash"))
    assert last <= 8  # stopped at the next outer round, not at step 40
    assert issubclass(CommAborted, CommError) and not issubclass(CommAborted, CommTimeout)
