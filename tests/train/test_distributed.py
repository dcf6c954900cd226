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
    # one metrics.jsonl, as on the local backend: the ranks' parts were merged into it and are gone
    assert not list((tmp_path / "torch").glob("metrics.rank*.jsonl"))
    merged = [(r["step"], r["worker"]) for r in _records(tmp_path / "torch")]
    assert merged == sorted((r["step"], r["worker"]) for r in _records(tmp_path / "local"))  # ordered by step, worker


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resumed_torch_run_has_one_metrics_file_cut_back_to_its_checkpoint(tiny_config, tmp_path):
    """A 2-process run resumed from its step-4 checkpoint: metrics.jsonl is cut back to step 4, the resumed ranks'
    records are merged after it, and the file holds every (worker, step) once, with the uninterrupted run's losses."""
    from noloco.train.backends.distributed import launch as run_distributed
    from noloco.train.checkpoint import resolve

    common = ("steps=8", "outer.every=4", "workers=2", "threads=1", "log.tensorboard=false", "log.plot=false",
              "backend=torch", "checkpoint.every=4", "checkpoint.keep=2", "run.name=torch")  # fmt: skip
    run_distributed(tiny_config(*common), quiet=True)
    run_dir = tmp_path / "torch"
    clean = _records(run_dir)
    folder, _, step = resolve(run_dir / "checkpoints" / "step_000004")
    assert step == 4
    run_distributed(tiny_config(*common, f"resume={folder}"), run_dir=run_dir, resume_from=folder, resume_step=4,
                    quiet=True)  # fmt: skip
    resumed = _records(run_dir)
    assert not list(run_dir.glob("metrics.rank*.jsonl"))
    key = lambda r: (r["worker"], r["step"], r.get("loss"), r.get("eval_loss"), r["bytes_sent"])  # noqa: E731
    assert [key(r) for r in resumed] == [key(r) for r in clean]
    # the lines up to the checkpoint are the first run's, kept verbatim (recorded values, not a timing comparison)
    assert [r["wall"] for r in resumed if r["step"] <= 4] == [r["wall"] for r in clean if r["step"] <= 4]


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


def _replica_rank(rank: int, port: int, queue) -> None:
    """One of two processes of one worker: the same DDP steps through the byte hook and the on-device hook."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector

    from noloco.train.backends.distributed import Replicas, _process_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        _, ddp, hook = _process_groups(2, 2)
        results = {}
        for path, hook_group in (("bytes", hook[0]), ("device", None)):  # None: what an NCCL worker does
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
            replicas = Replicas(ddp[0], hook_group, 0, "int8", True, 30.0)
            wrapped = replicas.wrap(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(3):
                wrapped(torch.randn(16, 32, generator=gen)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            # a numpy copy is pickled by value: a tensor would travel as a shared-memory handle that the parent
            # fetches from this process, which may have exited by then (FileNotFoundError at load 9)
            results[path] = (parameters_to_vector(model.parameters()).detach().numpy().copy(),
                             replicas.hook_state.on_device, replicas.hook_state.counter.bytes_sent)  # fmt: skip
            replicas.close()
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


def test_a_worker_of_gpu_processes_reduces_its_gradients_on_the_ddp_group_itself():
    """The NCCL layout of a worker (no hook groups: the hook's on-device all-reduce on the DDP group), run on
    gloo: its replicas stay identical and match the byte hook's bit for bit (the same encodings)."""
    import torch.multiprocessing as mp

    from noloco.comm.torchdist import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_replica_rank, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    for path, on_device in (("bytes", False), ("device", True)):
        (a, a_on, a_sent), (b, b_on, b_sent) = results[0][path], results[1][path]
        assert a.tobytes() == b.tobytes() and a_on == b_on == on_device and a_sent > 0 and b_sent > 0  # bit for bit
    assert results[0]["device"][0].tobytes() == results[0]["bytes"][0].tobytes()
