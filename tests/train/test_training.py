import json

import pytest
import torch

from noloco.comm import LocalFabric
from noloco.models.llama import LLaMA, model_config
from noloco.optim.algorithms import DiLoCo, NoLoCo
from noloco.train.backends.local import launch as run
from noloco.train.cli import main
from noloco.train.metrics import read_metrics


def _losses(run_dir):
    return {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(run_dir)}


def test_short_noloco_run_lowers_held_out_loss_and_writes_outputs(tiny_config, tmp_path):
    cfg = tiny_config("steps=30", "outer.every=10", "run.name=short")
    summary = run(cfg, quiet=True)
    run_dir = tmp_path / "short"
    first = [r["eval_loss"] for r in read_metrics(run_dir) if r["step"] == 0]
    assert len(first) == 4
    assert summary["final_eval_loss"] < min(first) - 0.5
    assert summary["final_eval_loss"] < summary["unigram_eval_loss"] + 0.5
    assert summary["bytes_sent_per_worker"] > 0 and summary["consensus_distance"] > 0
    for name in ("metrics.jsonl", "summary.json", "curves.png", "config.yaml"):
        assert (run_dir / name).exists()
    assert any((run_dir / "tensorboard").iterdir())
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "algo",
        "codec",
        "workers",
        "steps",
        "final_eval_loss",
        "final_eval_loss_per_worker",
        "consensus_distance",
        "bytes_sent_per_worker",
        "wall_seconds",
        "tokens_per_second",
    ):
        assert key in on_disk
    groups = {tuple(r["group"]) for r in read_metrics(run_dir) if "group" in r}
    assert len(groups) >= 2


@pytest.mark.parametrize("algo", ["diloco", "ddp", "avg"])
def test_baselines_train_and_keep_replicas_identical(tiny_config, algo):
    summary = run(tiny_config(f"outer.algo={algo}", "steps=20", "outer.every=10", f"run.name={algo}"), quiet=True)
    assert summary["consensus_distance"] < 1e-6
    assert len(set(summary["final_eval_loss_per_worker"])) == 1


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_resume_reproduces_the_uninterrupted_run_exactly(tiny_config, tmp_path, codec):
    """Also with a lossy codec: error-feedback residuals are part of the checkpoint."""
    slow_codec = "fp32" if codec == "fp32" else "int8"
    common = (
        "steps=20",
        "outer.every=5",
        "checkpoint.every=10",
        f"comm.codec={codec}",
        f"comm.slow_codec={slow_codec}",
    )
    run(tiny_config(*common, "run.name=full"), quiet=True)
    run(tiny_config(*common, "run.name=killed"), quiet=True, stop_after=10)
    killed = tmp_path / "killed"
    assert (killed / "checkpoints" / "latest").resolve().name == "step_000010"
    assert main([f"resume={killed}/checkpoints/latest", "log.progress=false"]) == 0
    full, resumed = _losses(tmp_path / "full"), _losses(killed)
    assert full.keys() == resumed.keys()
    assert full == resumed
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((killed / "summary.json").read_text())
    assert a["final_eval_loss_per_worker"] == b["final_eval_loss_per_worker"]
    assert a["bytes_sent_by_worker"] == b["bytes_sent_by_worker"]


def test_incomplete_checkpoint_is_refused(tiny_config, tmp_path, capsys):
    run(tiny_config("steps=10", "outer.every=5", "checkpoint.every=5", "run.name=r"), quiet=True)
    (tmp_path / "r" / "checkpoints" / "step_000005" / "COMPLETE").unlink()
    assert main([f"resume={tmp_path}/r/checkpoints/step_000005"]) == 2
    assert "incomplete" in capsys.readouterr().err


def _train_replicas(make_algo, world=4, rounds=2, every=3):
    cfg = model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64)

    def fn(transport):
        torch.manual_seed(0)
        model = LLaMA(cfg, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        algo = make_algo(model, opt, transport)
        gen = torch.Generator().manual_seed(transport.rank)
        for _ in range(rounds * every):
            x = torch.randint(0, 64, (2, 8), generator=gen)
            model(x, x)[1].backward()
            algo.sync_gradients()
            algo.step()
        return algo.slow_weights()

    return LocalFabric(world).run(fn)


def test_noloco_with_full_group_and_no_pull_matches_diloco_averaging():
    noloco = _train_replicas(lambda m, o, t: NoLoCo(m, o, t, every=3, lr=0.7, pull=0.0, momentum=0.0, group_size=4))
    diloco = _train_replicas(lambda m, o, t: DiLoCo(m, o, t, every=3, lr=0.7, momentum=0.0))
    for a, b in zip(noloco, diloco):
        assert torch.allclose(a, b, atol=1e-6)


def test_worker_with_non_finite_weights_never_poisons_its_partner():
    cfg = model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64)

    def fn(transport):
        model = LLaMA(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        algo = NoLoCo(model, opt, transport, every=2, group_size=2)
        gen = torch.Generator().manual_seed(transport.rank)
        for step in range(4):
            x = torch.randint(0, 64, (2, 8), generator=gen)
            model(x, x)[1].backward()
            if transport.rank == 1 and step == 1:
                with torch.no_grad():
                    model.embed.weight[0, 0] = float("nan")  # a corrupted replica right before the outer step
            algo.sync_gradients()
            algo.step()
        return algo.slow_weights(), algo.nonfinite_events

    (slow0, events0), (slow1, events1) = LocalFabric(2).run(fn)
    assert torch.isfinite(slow0).all() and torch.isfinite(slow1).all()
    assert events0 == 0 and events1 >= 1


def test_non_finite_gradients_skip_the_inner_update_and_ddp_sends_zeros():
    cfg = model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64)

    def fn(transport):
        from noloco.optim.algorithms import DDP

        model = LLaMA(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        algo = DDP(model, opt, transport)
        x = torch.randint(0, 64, (2, 8))
        model(x, x)[1].backward()
        if transport.rank == 0:
            model.embed.weight.grad[0, 0] = float("inf")
        algo.sync_gradients()
        algo.step()
        return algo.slow_weights(), algo.nonfinite_events

    (w0, e0), (w1, e1) = LocalFabric(2).run(fn)
    assert torch.isfinite(w0).all() and torch.equal(w0, w1)
    assert e0 == 1 and e1 == 0


def test_compressed_exchange_trains_with_a_fraction_of_the_bytes(tiny_config):
    common = ("steps=30", "outer.every=5", "model.dim=128", "model.n_layers=1", "model.n_heads=2")
    exact = run(tiny_config(*common, "comm.codec=fp32", "comm.slow_codec=fp32", "run.name=fp32"), quiet=True)
    packed = run(tiny_config(*common, "comm.codec=int4", "comm.slow_codec=int8", "run.name=int4"), quiet=True)
    assert packed["bytes_sent_per_worker"] < exact["bytes_sent_per_worker"] / 2.5
    assert abs(packed["final_eval_loss"] - exact["final_eval_loss"]) < 0.05 * exact["final_eval_loss"]


def test_a_late_joiner_schedule_catches_up_without_pytorchs_order_warning(tiny_config):
    """A peer that joins at step 30 steps its fresh schedule 30 times before any optimizer step: it lands on the
    lr of step 30 and prints no `lr_scheduler.step() before optimizer.step()` warning (with a source path)."""
    import warnings

    from noloco.train.loop import advance_schedule, build_inner_optimizer, build_model

    cfg = tiny_config()
    _, reference = build_inner_optimizer(cfg, build_model(cfg, 512))
    _, joiner = build_inner_optimizer(cfg, build_model(cfg, 512))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(30):
            reference.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        advance_schedule(joiner, 30)
    assert [str(w.message) for w in caught] == []
    assert joiner.get_last_lr() == reference.get_last_lr() and joiner.last_epoch == 30
