"""``outer.fragments=k`` from train.py: each exchange carries one fragment, a checkpoint between fragments (with one
in flight under ``outer.overlap``) resumes exactly, the torch backend matches the local one, bad values are refused."""

import json

import pytest

from noloco.train.backends.local import launch as run
from noloco.train.cli import main
from noloco.train.config import ConfigError, load_config
from noloco.train.metrics import read_metrics


def _losses(run_dir):
    return {(r["worker"], r["step"]): (r.get("loss"), r.get("eval_loss")) for r in read_metrics(run_dir)}


@pytest.mark.parametrize("overlap", ["false", "true"], ids=["blocking", "overlap"])
def test_resume_between_fragments_reproduces_the_uninterrupted_run(tiny_config, tmp_path, overlap):
    # every=4, fragments=2: an exchange every 2 steps; the checkpoint at step 6 falls after fragment 1's exchange
    # (in flight with overlap: it left at step 6 and lands at step 8)
    common = ("steps=12", "outer.every=4", "outer.fragments=2", "checkpoint.every=6", f"outer.overlap={overlap}",
              "comm.codec=int4")  # fmt: skip
    full = run(tiny_config(*common, "run.name=full"), quiet=True)
    run(tiny_config(*common, "run.name=killed"), quiet=True, stop_after=6)
    killed = tmp_path / "killed"
    assert main([f"resume={killed}/checkpoints/latest", "log.progress=false"]) == 0
    assert _losses(tmp_path / "full") == _losses(killed)
    resumed = json.loads((killed / "summary.json").read_text())
    assert resumed["final_eval_loss_per_worker"] == full["final_eval_loss_per_worker"]
    rounds = [(r["step"], r["fragment"]) for r in read_metrics(tmp_path / "full") if r["worker"] == 0
              and "outer_round" in r]  # fmt: skip
    if overlap == "false":  # fragment (step / 2) mod 2 leaves and lands at every even step
        assert rounds == [(step, (step // 2) % 2) for step in range(2, 13, 2)]
    else:  # an exchange is reported when it lands, one exchange later; at step 12 both the one applied there and
        # the last one, which lands after the last step, are reported
        assert rounds == [(step, (step // 2 - 1) % 2) for step in range(4, 13, 2)] + [(12, 0)]


@pytest.mark.parametrize("overlap", ["false", "true"], ids=["blocking", "overlap"])
def test_fragments_on_the_torch_backend_match_the_local_backend(tiny_config, tmp_path, overlap):
    from noloco.train.backends.distributed import launch as run_distributed

    common = ("steps=8", "outer.every=4", "outer.fragments=4", "workers=2", "threads=1", "log.tensorboard=false",
              f"outer.overlap={overlap}")  # fmt: skip
    local = run(tiny_config(*common, "run.name=local"), quiet=True)
    torch_run = run_distributed(tiny_config(*common, "backend=torch", "run.name=torch"), quiet=True)
    assert _losses(tmp_path / "local") == _losses(tmp_path / "torch")
    assert local["final_eval_loss_per_worker"] == torch_run["final_eval_loss_per_worker"]


@pytest.mark.parametrize(
    "overrides, message",
    [(("outer.fragments=3",), "outer.fragments=3 does not divide outer.every=20"),
     (("outer.fragments=0",), "outer.fragments must be an integer >= 1, got 0"),
     (("outer.fragments=2", "outer.algo=ddp"), "outer.fragments is for the outer algorithms, not ddp")],
)  # fmt: skip
def test_bad_fragment_counts_are_refused_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(list(overrides))
