import json

from noloco.train.backends.local import launch as run
from noloco.train.metrics import read_metrics


def test_torch_backend_matches_local_backend_exactly(tiny_config, tmp_path):
    """Same config, same single thread per worker: separate gloo processes give the local trajectory."""
    from noloco.train.backends.distributed import launch as run_distributed

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


def test_workers_of_two_processes_share_a_replica_through_the_quantized_ddp_hook(tiny_config, tmp_path):
    """2 workers × 2 processes: DDP inside each worker (int8 hook), NoLoCo between the workers."""
    from noloco.train.backends.distributed import launch as run_distributed

    cfg = tiny_config(
        "steps=12",
        "outer.every=4",
        "workers=2",
        "inner.processes=2",
        "backend=torch",
        "threads=1",
        "log.tensorboard=false",
        "run.name=multi",
    )
    summary = run_distributed(cfg, quiet=True)
    assert summary["workers"] == 2 and summary["processes_per_worker"] == 2
    per_process = summary["final_eval_loss_per_process"]
    assert per_process[0] == per_process[1] and per_process[2] == per_process[3]  # one replica per worker
    first = [r["eval_loss"] for r in read_metrics(tmp_path / "multi") if r["step"] == 0]
    assert summary["final_eval_loss"] < min(first) - 0.3
    # every process sent int8 gradients to its partner: about a quarter of fp32 (headers and scales aside)
    grads = sum(p.numel() for p in _model_params(cfg))
    for sent in summary["inner_bytes_sent_per_process"]:
        assert 0 < sent < 12 * grads * 4 * 0.35
    assert summary["bytes_sent_by_worker"][0] > 0  # the leaders did the outer exchange


def _model_params(cfg):
    from noloco.train.loop import build_model

    return list(build_model(cfg, cfg.data.vocab_size).parameters())
