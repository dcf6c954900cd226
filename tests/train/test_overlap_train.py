"""``outer.overlap`` from train.py: a run lowers its loss, a checkpoint taken with an exchange in flight resumes
exactly, the torch backend matches the local one, and workers of several processes keep one replica."""

import json

import pytest

from noloco.train.backends.local import launch as run
from noloco.train.cli import main
from noloco.train.metrics import read_metrics


def _losses(run_dir):
    return {(r["worker"], r["step"]): (r.get("loss"), r.get("eval_loss")) for r in read_metrics(run_dir)}


@pytest.mark.parametrize("rule", ["provisional", "coded", "eager", "delayed"])
def test_resume_with_an_exchange_in_flight_reproduces_the_uninterrupted_run(tiny_config, tmp_path, rule):
    # outer.every=4: round 0's exchange leaves at step 4 and lands at step 8; the checkpoint at step 6 holds it
    common = ("steps=16", "outer.every=4", "checkpoint.every=6", f"outer.overlap={rule}", "comm.codec=int4")
    full = run(tiny_config(*common, "run.name=full"), quiet=True)
    run(tiny_config(*common, "run.name=killed"), quiet=True, stop_after=6)
    killed = tmp_path / "killed"
    assert (killed / "checkpoints" / "latest").resolve().name == "step_000006"
    assert main([f"resume={killed}/checkpoints/latest", "log.progress=false"]) == 0
    assert _losses(tmp_path / "full") == _losses(killed)
    resumed = json.loads((killed / "summary.json").read_text())
    assert resumed["final_eval_loss_per_worker"] == full["final_eval_loss_per_worker"]
    first = [r["eval_loss"] for r in read_metrics(tmp_path / "full") if r["step"] == 0]
    assert full["final_eval_loss"] < min(first) - 0.3  # it learns


@pytest.mark.parametrize("landing", [[], ["outer.overlap_steps=2"]], ids=["round", "tau2"])
def test_overlap_on_the_torch_backend_matches_the_local_backend(tiny_config, tmp_path, landing):
    from noloco.train.backends.distributed import launch as run_distributed

    common = ("steps=12", "outer.every=4", "workers=2", "threads=1", "log.tensorboard=false", "outer.overlap=true",
              *landing)  # fmt: skip
    local = run(tiny_config(*common, "run.name=local"), quiet=True)
    torch_run = run_distributed(tiny_config(*common, "backend=torch", "run.name=torch"), quiet=True)
    assert _losses(tmp_path / "local") == _losses(tmp_path / "torch")
    assert local["final_eval_loss_per_worker"] == torch_run["final_eval_loss_per_worker"]
    for summary in (local, torch_run):  # the loop's time split: inside outer steps (3 rounds) and the rest
        loops, outers = summary["loop_seconds_by_worker"], summary["outer_seconds_by_worker"]
        assert len(loops) == len(outers) == 2 and all(0 < o < lp for lp, o in zip(loops, outers))
        assert all(ms > 0 for ms in summary["outer_ms_mean_by_worker"])
        # the final checkpoint's write is timed apart (tokens/s and MFU leave it out)
        assert all(0 < c < lp for c, lp in zip(summary["checkpoint_seconds_by_worker"], loops))
    # what each worker waited for, in what order (not how long: durations belong in benchmarks/): round q leaves at
    # step 4(q + 1) and lands τ steps later (τ = 2, or the whole round), the last one at the run's last step
    tau = 2 if landing else 4
    expected = [(min(4 * (q + 1) + tau, 12), q) for q in range(3)]
    for run_dir in (tmp_path / "local", tmp_path / "torch"):
        landed = [r for r in read_metrics(run_dir) if "outer_round" in r]  # by step, then in the order logged
        for worker in (0, 1):
            assert [(r["step"], r["outer_round"]) for r in landed if r["worker"] == worker] == expected, run_dir
        assert all(r["exchange_ms"] > 0 and r["wait_ms"] >= 0 for r in landed)  # both measured, whatever the load


@pytest.mark.parametrize("rule", ["provisional", "eager", "delayed outer.overlap_steps=1"])  # delayed lands at τ = 1
def test_workers_of_two_processes_overlap_and_keep_one_replica(tiny_config, tmp_path, rule):
    """2 workers × 2 processes: the leaders exchange in the background, and after each outer step every process
    of a worker holds the leader's φ and the same θ (fragments=2: one fragment's φ is relayed at a time). The points
    evaluate θ: the two workers' φ are alike here (their one group is both of them)."""
    from noloco.train.backends.distributed import launch as run_distributed

    common = ("steps=12", "outer.every=4", "outer.fragments=2", "workers=2", "inner.processes=2", "backend=torch",
              "threads=1", "log.tensorboard=false", f"outer.overlap={rule.split()[0]}", *rule.split()[1:],
              "eval.every=2", "eval.weights=fast")  # fmt: skip
    summary = run_distributed(tiny_config(*common, "run.name=multi"), quiet=True)
    per_process = summary["final_eval_loss_per_process"]
    assert per_process[0] == per_process[1] and per_process[2] == per_process[3]  # one replica per worker
    assert per_process[0] != per_process[2]  # two workers, not one
    evals = {}  # process rank -> step -> held-out loss of its weights
    for r in read_metrics(tmp_path / "multi"):
        if r.get("eval_loss") is not None:
            evals.setdefault(r["worker"], {})[r["step"]] = r["eval_loss"]
    assert len(evals[0]) >= 6 and evals[0] == evals[1] and evals[2] == evals[3]  # at every exchange, not only the last
    first = [r["eval_loss"] for r in read_metrics(tmp_path / "multi") if r["step"] == 0]
    assert summary["final_eval_loss"] < min(first) - 0.3
    assert summary["bytes_sent_by_worker"][0] > 0  # the leaders did the outer exchange


@pytest.mark.parametrize("overrides,message", [
    (["outer.overlap=eager", "outer.overlap_steps=1"], "for the provisional, coded and delayed rules"),
    (["outer.overlap=true", "outer.every=8", "outer.fragments=4", "outer.overlap_steps=3"], r"in \[1, 2\]"),
    (["outer.overlap_steps=2"], "needs outer.overlap"),
])  # fmt: skip
def test_a_bad_overlap_steps_fails_at_start_up_in_one_line(overrides, message):
    from noloco.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def _evals(run_dir, worker=0):
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir) if r["worker"] == worker and "eval_loss" in r}


def test_an_overlapped_run_evaluates_its_slow_weights_and_trains_alike_whatever_it_evaluates(tiny_config, tmp_path):
    """``eval.weights=auto`` with overlap evaluates φ: round 0's exchange leaves at step 4 and lands at step 8, so
    φ is φ₀ at steps 0-6 and every point there is the first one, bit for bit; θ's points (``fast``) differ, at the
    boundary too (the provisional step). Evaluating either leaves training as it was: the same training losses, and
    the same final point but for rounding (after the last exchange landed θ is φ, as θ + (φ − L) in floats)."""
    common = ("steps=12", "outer.every=4", "eval.every=2", "workers=2", "outer.overlap=provisional", "log.plot=false")
    slow = run(tiny_config(*common, "run.name=slow"), quiet=True)  # eval.weights=auto
    fast = run(tiny_config(*common, "eval.weights=fast", "run.name=fast"), quiet=True)
    trained = {k: loss for k, (loss, _) in _losses(tmp_path / "slow").items()}
    assert trained == {k: loss for k, (loss, _) in _losses(tmp_path / "fast").items()}
    assert slow["final_eval_loss_per_worker"] == pytest.approx(fast["final_eval_loss_per_worker"], rel=1e-6)
    for worker in (0, 1):
        on_phi, on_theta = _evals(tmp_path / "slow", worker), _evals(tmp_path / "fast", worker)
        assert on_phi[0] == on_phi[2] == on_phi[4] == on_phi[6] == on_theta[0], on_phi
        assert on_phi[8] != on_phi[0] and on_phi[12] == pytest.approx(on_theta[12], rel=1e-6)  # φ's first step; the end
        assert all(on_theta[s] != on_phi[s] for s in (2, 4, 6, 8)), (on_theta, on_phi)


def test_a_blocking_run_evaluates_the_same_weights_at_its_boundaries(tiny_config, tmp_path):
    """Blocking, θ is φ after each outer step: ``slow`` and ``fast`` read alike at the boundaries; between them
    ``slow`` reads the last outer step's φ (at step 2 the first point's) and ``fast`` the weights training."""
    common = ("steps=8", "outer.every=4", "eval.every=2", "log.plot=false")
    run(tiny_config(*common, "eval.weights=slow", "run.name=slow"), quiet=True)
    run(tiny_config(*common, "run.name=fast"), quiet=True)  # eval.weights=auto: fast without overlap
    on_phi, on_theta = _evals(tmp_path / "slow"), _evals(tmp_path / "fast")
    assert all(on_phi[s] == on_theta[s] for s in (0, 4, 8)), (on_phi, on_theta)
    assert on_phi[2] == on_phi[0] != on_theta[2] and on_phi[6] == on_phi[4] != on_theta[6]
