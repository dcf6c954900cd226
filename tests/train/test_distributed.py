import json

from noloco.train.metrics import read_metrics
from noloco.train.runner import run


def test_torch_backend_matches_local_backend_exactly(tiny_config, tmp_path):
    """Same config, same single thread per worker: separate gloo processes give the local trajectory."""
    from noloco.train.distributed import run_distributed

    common = ("steps=12", "outer.every=4", "workers=2", "threads=1", "log.tensorboard=false")
    local = run(tiny_config(*common, "run.name=local"), quiet=True)
    torch_run = run_distributed(tiny_config(*common, "backend=torch", "run.name=torch"), quiet=True)
    assert torch_run["backend"] == "torch" and torch_run["workers"] == 2
    losses = lambda d: {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(d)}  # noqa: E731
    assert losses(tmp_path / "local") == losses(tmp_path / "torch")
    assert local["final_eval_loss_per_worker"] == torch_run["final_eval_loss_per_worker"]
    assert local["bytes_sent_by_worker"] == torch_run["bytes_sent_by_worker"]
    assert (
        json.loads((tmp_path / "torch" / "summary.json").read_text())["consensus_distance"]
        == local["consensus_distance"]
    )
    assert (tmp_path / "torch" / "metrics.rank1.jsonl").exists()
