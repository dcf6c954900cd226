"""Training on a CUDA GPU (``pytest -m gpu`` on a machine with one; skipped elsewhere).

Checks the promises of docs/design.md §8: a short NoLoCo run on CUDA lowers the held-out loss; the
same fp32 config on CUDA and on the CPU agree within a stated tolerance; resume on CUDA is
bit-exact; K local workers sharing one GPU match ``backend=torch``'s K processes on that GPU.
"""

from __future__ import annotations

import json

import pytest

from noloco.train.backends.local import launch as run

pytestmark = pytest.mark.gpu

GPU = ("device=cuda", "log.tensorboard=false", "log.plot=false")


def test_noloco_on_cuda_lowers_the_held_out_loss_in_bf16(tiny_config):
    summary = run(tiny_config(*GPU, "steps=60", "outer.every=10", "run.name=cuda"), quiet=True)
    assert summary["final_eval_loss"] < summary["unigram_eval_loss"]
    cfg = tiny_config(*GPU)
    assert cfg.device == "cuda"
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    first = next(r["eval_loss"] for r in records if r["step"] == 0)
    assert summary["final_eval_loss"] < first - 0.5
    assert any("gpu_peak_memory_gb" in r for r in records) and any("tokens_per_second" in r for r in records)


def test_cuda_and_cpu_fp32_runs_agree_within_tolerance(tiny_config):
    common = (
        "steps=20",
        "outer.every=10",
        "precision=fp32",
        "comm.codec=fp32",
        "log.tensorboard=false",
        "log.plot=false",
    )
    cpu = run(tiny_config(*common, "device=cpu", "run.name=cpu"), quiet=True)
    cuda = run(tiny_config(*common, "device=cuda", "run.name=gpu"), quiet=True)
    # different matmul kernels (cuBLAS vs the CPU's) round differently; 20 steps stay within 2e-3 nats
    assert abs(cpu["final_eval_loss"] - cuda["final_eval_loss"]) < 2e-3


def test_resume_on_cuda_is_bit_exact(tiny_config, tmp_path):
    from noloco.train import checkpoint

    full = run(tiny_config(*GPU, "steps=16", "outer.every=4", "checkpoint.every=8", "run.name=full"), quiet=True)
    part = run(
        tiny_config(*GPU, "steps=16", "outer.every=4", "checkpoint.every=8", "run.name=part"), stop_after=8, quiet=True
    )
    folder, run_dir, step = checkpoint.resolve(f"{part['run_dir']}/checkpoints/latest")
    cfg = tiny_config(*GPU, "steps=16", "outer.every=4", "checkpoint.every=8", "run.name=part")
    resumed = run(cfg, run_dir=run_dir, resume_from=folder, resume_step=step, quiet=True)
    assert resumed["final_eval_loss_per_worker"] == full["final_eval_loss_per_worker"]


@pytest.mark.parametrize("overlap", ["false", "true"])
def test_the_staggered_slow_term_on_cuda_resumes_bit_exactly_inside_a_cycle(tiny_config, overlap):
    """Top-k Δ and int4 slices of φ − φ_0 through the device reduction (a slice's residuals in the term's one
    error-feedback state), blocking and overlapped: a run stopped after round 5 of 9 (inside a cycle of 3) ends as
    the run that never stopped."""
    from noloco.train import checkpoint

    common = (
        *GPU,
        "steps=18",
        "outer.every=2",
        "checkpoint.every=10",
        "comm.codec=topk:64/4096+int2",
        "comm.slow_codec=int4",
        "outer.slow_every=3",
        "outer.slow_stagger=true",
        f"outer.overlap={overlap}",
    )
    full = run(tiny_config(*common, "run.name=full"), quiet=True)
    part = run(tiny_config(*common, "run.name=part"), stop_after=10, quiet=True)
    folder, run_dir, step = checkpoint.resolve(f"{part['run_dir']}/checkpoints/latest")
    resumed = run(tiny_config(*common, "run.name=part"), run_dir=run_dir, resume_from=folder, resume_step=step,
                  quiet=True)  # fmt: skip
    assert step == 10 and resumed["final_eval_loss_per_worker"] == full["final_eval_loss_per_worker"]


def test_a_checkpoint_saved_on_cuda_resumes_on_the_cpu(tiny_config):
    from noloco.train import checkpoint

    part = run(
        tiny_config(*GPU, "steps=8", "outer.every=4", "checkpoint.every=4", "precision=fp32", "run.name=move"),
        stop_after=4,
        quiet=True,
    )
    folder, run_dir, step = checkpoint.resolve(f"{part['run_dir']}/checkpoints/latest")
    cfg = tiny_config(
        "device=cpu",
        "steps=8",
        "outer.every=4",
        "precision=fp32",
        "log.tensorboard=false",
        "log.plot=false",
        "run.name=move",
    )
    resumed = run(cfg, run_dir=run_dir, resume_from=folder, resume_step=step, quiet=True)
    assert resumed["final_eval_loss"] < resumed["unigram_eval_loss"] + 1.0


def test_local_workers_sharing_a_gpu_match_torch_processes_on_it(tiny_config):
    from noloco.train.backends.distributed import launch as run_torch

    common = (
        "steps=12",
        "outer.every=4",
        "workers=2",
        "threads=1",
        "precision=fp32",
        "log.tensorboard=false",
        "log.plot=false",
    )
    local = run(tiny_config(*common, "device=cuda", "run.name=local"), quiet=True)
    torch_run = run_torch(tiny_config(*common, "device=cuda", "backend=torch", "run.name=torch"), quiet=True)
    # the same kernels on the same GPU: cuBLAS is deterministic for a fixed shape and stream, so the
    # trajectories agree to float32 rounding of the reductions (bit-identical on every run seen)
    assert torch_run["final_eval_loss_per_worker"] == pytest.approx(local["final_eval_loss_per_worker"], abs=1e-5)


def test_compiled_workers_sharing_a_gpu_compile_one_graph_and_train_like_eager(tiny_config):
    import torch._dynamo

    common = (*GPU, "steps=12", "outer.every=4", "precision=fp32", "eval.every=12")

    def compiled_graphs(workers):
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        result = run(
            tiny_config(*common, f"workers={workers}", "compile=true", f"run.name=compiled{workers}"), quiet=True
        )
        return torch._dynamo.utils.counters["stats"]["unique_graphs"] - before, result

    eager = run(tiny_config(*common, "workers=4", "run.name=eager"), quiet=True)
    alone, _ = compiled_graphs(1)
    graphs, compiled = compiled_graphs(4)
    print(f"unique graphs: 1 worker {alone}, 4 workers {graphs}")
    # four workers sharing a GPU compile what one worker compiles (one graph on torch 2.11 and 2.13), not one each
    assert alone >= 1 and graphs == alone, (alone, graphs)
    # inductor fuses the fp32 math differently from eager: the trajectories agree to rounding
    assert compiled["final_eval_loss_per_worker"] == pytest.approx(eager["final_eval_loss_per_worker"], abs=2e-3)


def test_offloaded_outer_state_trains_bit_identically_and_lives_in_pinned_host_memory(tiny_config):
    import torch

    from noloco.comm import LocalFabric
    from noloco.optim import NoLoCo

    common = (*GPU, "steps=12", "outer.every=4", "workers=2", "precision=fp32")
    kept = run(tiny_config(*common, "run.name=kept"), quiet=True)
    offloaded = run(tiny_config(*common, "outer.offload=true", "run.name=offloaded"), quiet=True)
    # the same math on the same device; only where the state waits between outer steps differs
    assert offloaded["final_eval_loss_per_worker"] == kept["final_eval_loss_per_worker"]

    def worker(transport):
        model = torch.nn.Linear(64, 64).cuda()
        with torch.no_grad():  # the same start on both (threads share torch's global generator)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        algo = NoLoCo(model, torch.optim.AdamW(model.parameters()), transport, every=1, codec="int4", offload=True)
        model(torch.randn(8, 64, device="cuda")).square().mean().backward()
        algo.step()  # an AdamW step and an outer step
        tensors = [algo.slow, algo.reference, algo.rule.velocity, algo.feedback.contribution]
        return all(t.device.type == "cpu" and t.is_pinned() for t in tensors), model.weight.is_cuda

    assert LocalFabric(2).run(worker) == [(True, True), (True, True)]


@pytest.mark.parametrize("rule", ["provisional", "delayed", "eager"])
def test_overlapped_exchange_on_cuda_matches_the_cpu_and_torch_processes(tiny_config, rule):
    """The overlapped exchange runs on a side stream of its own thread (``OverlappedRounds._exchange_after``):
    its means must be complete before the training stream reads them, on one process of K workers and on K."""
    from noloco.train.backends.distributed import launch as run_torch

    common = (
        "steps=16",
        "outer.every=4",
        "outer.fragments=2",
        f"outer.overlap={rule}",
        "workers=2",
        "threads=1",
        "precision=fp32",
        "comm.codec=int4",
        "log.tensorboard=false",
        "log.plot=false",
    )
    cpu = run(tiny_config(*common, "device=cpu", "run.name=cpu"), quiet=True)
    local = run(tiny_config(*common, "device=cuda", "run.name=local"), quiet=True)
    torch_run = run_torch(tiny_config(*common, "device=cuda", "backend=torch", "run.name=torch"), quiet=True)
    records = [json.loads(line) for line in open(f"{local['run_dir']}/metrics.jsonl")]
    assert local["final_eval_loss"] < next(r["eval_loss"] for r in records if r["step"] == 0) - 0.3
    # one GPU, the same kernels: the processes' trajectories equal the threads' to fp32 rounding of reductions
    assert torch_run["final_eval_loss_per_worker"] == pytest.approx(local["final_eval_loss_per_worker"], abs=1e-5)
    # int4 codes can flip at a rounding boundary between cuBLAS and the CPU; 16 steps stay within 1e-2 nats
    assert local["final_eval_loss"] == pytest.approx(cpu["final_eval_loss"], abs=1e-2)


def test_warm_device_starts_cuda_in_its_thread_for_the_worker_to_find():
    """A restarted swarm peer wakes its GPU beside its checkpoint check (``device.warm_device``): in a fresh
    process, the thread leaves CUDA initialized, a context on the GPU and torch's compiler stack imported, and a bf16
    matmul of the main thread runs."""
    import subprocess
    import sys

    script = (
        "import torch; from noloco.train.device import warm_device\n"
        "import sys; assert not torch.cuda.is_initialized() and 'torch._dynamo' not in sys.modules\n"
        "warm_device('cuda:0').join()\n"
        "assert torch.cuda.is_initialized() and torch.cuda.memory_reserved(0) > 0 and 'torch._dynamo' in sys.modules\n"
        "x = torch.ones(8, 8, device='cuda:0', dtype=torch.bfloat16); print(float((x @ x).sum()))\n"
        "warm_device('cpu').join()\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "512.0", out.stderr
