"""``outer.overlap=true`` from train.py: a run lowers its loss, and a checkpoint taken with an exchange in flight
resumes exactly."""

import json

from noloco.train.backends.local import launch as run
from noloco.train.cli import main
from noloco.train.metrics import read_metrics


def _losses(run_dir):
    return {(r["worker"], r["step"]): (r.get("loss"), r.get("eval_loss")) for r in read_metrics(run_dir)}


def test_resume_with_an_exchange_in_flight_reproduces_the_uninterrupted_run(tiny_config, tmp_path):
    # outer.every=4: round 0's exchange leaves at step 4 and lands at step 8; the checkpoint at step 6 holds it
    common = ("steps=16", "outer.every=4", "checkpoint.every=6", "outer.overlap=true", "comm.codec=int4")
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


def test_overlap_on_the_torch_backend_matches_the_local_backend(tiny_config, tmp_path):
    from noloco.train.backends.distributed import launch as run_distributed

    common = ("steps=12", "outer.every=4", "workers=2", "threads=1", "log.tensorboard=false", "outer.overlap=true")
    local = run(tiny_config(*common, "run.name=local"), quiet=True)
    torch_run = run_distributed(tiny_config(*common, "backend=torch", "run.name=torch"), quiet=True)
    assert _losses(tmp_path / "local") == _losses(tmp_path / "torch")
    assert local["final_eval_loss_per_worker"] == torch_run["final_eval_loss_per_worker"]
