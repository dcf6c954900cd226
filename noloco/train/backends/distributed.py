"""The ``torch`` backend: one process per worker over torch.distributed (gloo between workers).

Two ways in:

* under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set), each process is
  the rank it was given — the way a Docker fleet or a multi-host job runs it;
* ``python train.py backend=torch workers=N`` with no such variables launches N local processes
  joined over gloo on loopback.

A worker may itself be several processes (``inner.processes = k``, e.g. one per GPU): ranks
``w·k … w·k+k−1`` form worker ``w``. They train one replica by data parallelism — torch DDP whose
gradient all-reduce goes through noloco's quantized two-phase hook (``inner.grad_codec``, int8 by
default; docs/design.md §3.5) — and only the worker's first process takes part in the outer exchange, then
broadcasts the new slow weights to the others. On GPUs (``device=cuda``) a worker's processes form an NCCL
group, and the hook reduces on it with the on-device all-reduce (encoded tensors, no host copies); on the
CPU they form gloo groups and the hook's messages are bytes.

Every rank runs the same :func:`~noloco.train.loop.train_worker` as the local backend, with a
:class:`DistributedBackend` over a :class:`~noloco.comm.torchdist.TorchDistTransport` on its own gloo
group; so with the same config and ``threads`` the trajectory matches the local backend's. Each
rank writes its records to ``metrics.rank<r>.jsonl`` while it runs; rank 0 gathers the final numbers
(through torch.distributed collectives, not counted as traffic), merges the ranks' records into
``metrics.jsonl`` (also at a Ctrl-C stop and before a resumed run starts) and writes ``summary.json`` and
``curves.png``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from noloco.comm.torchdist import TorchDistTransport, free_port
from noloco.data.documents import DataError
from noloco.models.hf import ModelError
from noloco.optim import OuterAlgorithm
from noloco.train import checkpoint
from noloco.train.backends.base import WorkersReported
from noloco.train.backends.local import WorldBackend
from noloco.train.config import ConfigError
from noloco.train.device import local_index, worker_device
from noloco.train.interrupt import INTERRUPT, Interrupted, StoreStop, hard_exit
from noloco.train.loop import WorkerResult, train_worker
from noloco.train.metrics import merge_parts, part_name
from noloco.train.run import Run, finish, new_run_folder, relative_spread, weight_sketch
from noloco.train.stall import STALL_EXIT

#: exit codes of a rank that printed its own error line: a bad config, file or checkpoint, a full disk (2); a stall (3)
REPORTED = (2, STALL_EXIT)


def _under_launcher() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def launch(
    cfg: DictConfig,
    run_dir: Path | None = None,
    resume_from: Path | None = None,
    resume_step: int = 0,
    stop_after: int | None = None,
    quiet: bool = False,
) -> dict | None:
    """Run ``cfg`` with ``backend=torch``; returns the summary on rank 0 (and in the launching process)."""
    if _under_launcher():
        if cfg.run.restarts:
            raise ConfigError("run.restarts: under torchrun, let torchrun restart the ranks (--max-restarts)")
        return run_rank(
            OmegaConf.to_yaml(cfg),
            str(run_dir) if run_dir else None,
            str(resume_from) if resume_from else None,
            resume_step,
            stop_after,
            quiet,
        )
    world = cfg.workers * cfg.inner.processes
    run = Run(cfg, run_dir, resume_from, resume_step, stop_after, quiet=True)
    run.load_corpus(shards=(range(world), world))  # the data cache built and the stream's shards checked once
    run.check_resume(range(world))  # once, here: the ranks do not check again
    run_dir = run.create(writes=False, announce=False)  # (the ranks write config.yaml; rank 0 announces)
    if resume_from is not None:
        merge_parts(run_dir, keep_through=resume_step)  # one metrics.jsonl, cut back to the checkpoint step
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    # (step, complete) from each rank that stopped on Ctrl-C; pipes, not a queue: no semaphores to leak on a hard exit
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = []
    for rank in range(world):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        args = (
            env,
            pipes[rank][1],
            OmegaConf.to_yaml(cfg),
            str(run_dir),
            str(resume_from) if resume_from else None,
            resume_step,
            stop_after,
            quiet,
        )
        procs.append(ctx.Process(target=_spawned_rank, args=args, name=f"noloco-rank{rank}"))
    # Ctrl-C reaches the whole process group; the ranks ignore SIGINT and get it from here, once per Ctrl-C,
    # as SIGUSR1 (first: every rank stops at one step and saves it; second: they quit at once)
    interrupt = INTERRUPT
    interrupt.run_dir = run_dir
    interrupt.forward = lambda count: _signal_ranks(procs, signal.SIGUSR1)
    interrupt.hard = lambda: _quit_at_once(procs, run_dir)
    try:
        for proc in procs:
            proc.start()
        interrupt.armed = True
        for proc in procs:
            proc.join()
        interrupt.armed = False
        merge_parts(run_dir)  # (the ranks merged already unless one stopped before it could)
        _raise_for_exits([p.exitcode for p in procs], pipes[0][0], run_dir, interrupt.requested)
    finally:
        interrupt.armed, interrupt.forward, interrupt.hard = False, None, None
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
    return json.loads((run_dir / "summary.json").read_text())


def _raise_for_exits(codes: list[int], reader, run_dir: Path, interrupted: bool) -> None:
    """What the ranks' exit ``codes`` mean for the run: Interrupted (a Ctrl-C stop; ``reader``: rank 0's end of the
    pipe that says at which step, and whether its checkpoint is complete), WorkersReported (ranks that printed
    their own error line: a bad file, a full disk, a stall), RuntimeError (ranks that died otherwise), or
    nothing (every rank finished)."""
    if interrupted and set(codes) <= {0, 130} and 130 in codes:
        step, complete = reader.recv() if reader.poll() else (None, False)  # rank 0 completes checkpoints
        raise Interrupted(step, run_dir, complete)
    failed = [(i, code) for i, code in enumerate(codes) if code != 0]
    reported = [code for _, code in failed if code in REPORTED]
    if reported:  # each such rank printed its own error line
        raise WorkersReported(reported[0], [(i, code) for i, code in failed if code not in REPORTED])
    if failed:
        raise RuntimeError(f"backend=torch: worker processes failed (rank, exit code): {failed}")


def _signal_ranks(procs, signum: int) -> None:
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass


def _quit_at_once(procs, run_dir: Path) -> None:
    """A second Ctrl-C in the launcher: the ranks (told by SIGUSR1) quit; any still there after 5 s are
    killed; then their temporary files go and the launcher exits 130."""
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    checkpoint.remove_temporary_files(run_dir)
    hard_exit(130, run_dir)


def _spawned_rank(env: dict, stopped, *args) -> None:
    """A rank the local launcher started; ``stopped``: its end of a pipe for (step, complete) on Ctrl-C."""
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher passes Ctrl-C on as SIGUSR1
    interrupt = INTERRUPT
    interrupt.announce = False  # the launcher tells the user
    interrupt.install(signal.SIGUSR1)
    try:
        run_rank(*args, checked=True)  # (the launcher checked every rank's stream shard and a resume)
    except Interrupted as exc:
        stopped.send((exc.step, exc.complete))
        sys.exit(130)
    except KeyboardInterrupt:  # before training started
        sys.exit(130)
    except (ConfigError, DataError, ModelError, checkpoint.CheckpointError) as exc:  # one line, as train.py's
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr, flush=True)
        sys.exit(2)


class Replicas:
    """The processes of one worker: DDP with the quantized gradient hook, and the outer-step relay."""

    def __init__(self, ddp_group, hook_group, leader_rank: int, codec: str, error_feedback: bool, timeout: float):
        """``timeout``: seconds the gradient hook waits for any one message (``comm.recv_timeout``).

        ``hook_group`` None: the hook reduces on the DDP group itself with the on-device all-reduce
        (:func:`~noloco.collectives.device.allreduce_device`: encoded tensors through the group's own
        collectives, NCCL on GPUs); else a byte transport over that gloo group carries its messages.
        """
        from noloco.collectives.ddp_hook import QuantizedHookState

        self.ddp_group, self.leader_rank = ddp_group, leader_rank
        self.leader = dist.get_rank() == leader_rank
        if hook_group is None:
            self.hook_state = QuantizedHookState(None, codec=codec, error_feedback=error_feedback, timeout=timeout,
                                                 process_group=ddp_group, on_device=True)  # fmt: skip
        else:
            self.hook_state = QuantizedHookState(TorchDistTransport(hook_group, latency=0.0), codec=codec,
                                                 error_feedback=error_feedback, timeout=timeout)  # fmt: skip

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        from noloco.collectives.ddp_hook import quantized_allreduce_hook

        ddp = DistributedDataParallel(model, process_group=self.ddp_group)
        ddp.register_comm_hook(self.hook_state, quantized_allreduce_hook)
        return ddp

    def broadcast(self, tensor: torch.Tensor) -> None:
        """The leader's ``tensor`` into every process of the worker (in place)."""
        dist.broadcast(tensor, src=self.leader_rank, group=self.ddp_group)

    def close(self) -> None:
        if self.hook_state.transport is not None:
            self.hook_state.transport.close()


def _process_groups(world: int, k: int, nccl: bool = False):
    """torch.distributed process groups (not the outer algorithm's groups, which it draws over the outer ones):
    (outer process groups by local index, DDP groups by worker, hook groups by worker or None); collective calls.

    The outer groups (the workers' leaders and their peers, a byte transport) are gloo. A worker's own
    processes form its DDP group: NCCL when its processes run on GPUs (``nccl``), and then the quantized hook
    reduces on that group directly (no hook groups); else gloo, with a second gloo group for the hook's byte
    transport (its always-posted receives must not share a group with DDP's collectives).
    """
    workers = world // k
    outer = [dist.new_group([w * k + local for w in range(workers)], backend="gloo") for local in range(k)]
    if k == 1:
        return outer, None, None
    ddp = [dist.new_group(list(range(w * k, w * k + k)), backend="nccl" if nccl else "gloo") for w in range(workers)]
    if nccl:
        return outer, ddp, [None] * workers
    hook = [dist.new_group(list(range(w * k, w * k + k)), backend="gloo") for w in range(workers)]
    return outer, ddp, hook


class DistributedBackend(WorldBackend):
    """A rank of a ``backend=torch`` run: the world's transport, and for a worker of several processes
    the DDP wrap with the quantized hook, the outer-step relay and a plain ``dist.barrier``."""

    name = "torch"

    def __init__(self, transport: TorchDistTransport, rank: int, replicas: Replicas | None, startup_timeout: float):
        super().__init__(transport, rank, startup_timeout)
        self.replicas = replicas

    def wrap(self, model: torch.nn.Module, algo) -> torch.nn.Module:
        if self.replicas is None:
            return model
        if isinstance(algo, OuterAlgorithm):
            algo.set_replicas(self.replicas)
        return self.replicas.wrap(model)  # DDP over the worker's processes, quantized gradient hook

    def barrier(self, step: int) -> bool:
        if self.replicas is None:
            return super().barrier(step)
        dist.barrier()
        return True

    def agree_stop(self, step: int, exhausted_at: int | None) -> tuple[int, int] | None:
        """One process per worker: over the world's transport (:class:`WorldBackend`); several: every process
        votes, in one all-reduce over the run's process group (gloo, whose timeout is ``comm.startup_timeout``),
        since the processes of a worker stream parts of their own and must stop together."""
        if self.replicas is None:
            return super().agree_stop(step, exhausted_at)
        votes = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        votes[dist.get_rank()] = 0 if exhausted_at is None else exhausted_at + 1  # 0: not exhausted
        dist.all_reduce(votes)
        exhausted = [(v - 1, rank) for rank, v in enumerate(votes.tolist()) if v > 0]
        return None if not exhausted else min(exhausted)[::-1]


def run_rank(
    cfg_yaml: str,
    run_dir: str | None,
    resume_from: str | None,
    resume_step: int,
    stop_after: int | None,
    quiet: bool,
    checked: bool = False,
) -> dict | None:
    """One rank of a ``backend=torch`` run (environment as set by torchrun). Under torchrun every rank checks
    every rank's stream shard (``data.streaming``) and a resumed run's checkpoint, so all of them stop with the
    same error; a rank the local launcher started does not (``checked``: the launcher did)."""
    cfg = OmegaConf.create(cfg_yaml)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    k = int(cfg.inner.processes)
    if world % k:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of inner.processes={k}")
    cfg.workers = world // k
    run = Run(cfg, None, resume_from, resume_step, stop_after, quiet)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg.comm.startup_timeout))
    transport, replicas = None, None
    try:
        folder = _run_folder(run, rank, run_dir)
        run.load_corpus(shards=None if checked else (range(world), world))
        if not checked:
            run.check_resume(range(world))
        run.create(folder, writes=rank == 0, announce=rank == 0,
                   workers_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # fmt: skip
        transport, replicas = _place(cfg, rank, world, k)
        ctx = run.context(run.metrics(part_name(rank)), 1, show=rank == 0, stop=_store_stop(run, rank, world))
        interrupt = INTERRUPT
        interrupt.announce = interrupt.announce and rank == 0
        backend = DistributedBackend(transport, rank, replicas, cfg.comm.startup_timeout)
        result = run.train(ctx, lambda: train_worker(ctx, backend))
        run.raise_if_stopped(ctx, quiet=rank != 0)
        inner_bytes = replicas.hook_state.counter.bytes_sent if replicas else 0
        summary = _gather_summary(run, result, transport, inner_bytes, k)
        dist.barrier()
        return summary
    except _GatherFailed:
        return None
    finally:
        if replicas is not None:
            replicas.close()
        if transport is not None:
            transport.close()
        dist.destroy_process_group()


def _run_folder(run: Run, rank: int, run_dir: str | None) -> Path:
    """The run's folder, named by rank 0 (which checks that it holds no other run), so every rank writes into the
    same folder, or every rank refuses with the same line. A resumed run's metrics are merged and cut back to
    the checkpoint step by rank 0 first, before any rank writes a part of them (collective call)."""
    name: list = [run_dir, None]
    if rank == 0 and run_dir is None:
        try:
            name[0] = str(new_run_folder(run.cfg))
        except ConfigError as exc:
            name[1] = str(exc)
    elif rank == 0 and run.resume_from is not None:
        merge_parts(Path(run_dir), keep_through=run.resume_step)
    dist.broadcast_object_list(name, src=0)
    if name[1] is not None:
        raise ConfigError(name[1])
    return Path(name[0])


def _place(cfg: DictConfig, rank: int, world: int, k: int) -> tuple[TorchDistTransport, Replicas | None]:
    """This rank's device, its outer transport (its ranks are the workers) and, for a worker of ``k > 1``
    processes, its :class:`Replicas` (collective calls: every rank makes them in the same order)."""
    worker, local = divmod(rank, k)
    device = worker_device(str(cfg.device), local_index(rank))
    # NCCL needs a GPU of its own per process of a worker (placed round robin: cfg.device cuda or auto)
    spread = str(cfg.device) in ("cuda", "auto") and torch.cuda.device_count() >= k
    nccl = device.type == "cuda" and spread and dist.is_nccl_available()
    if nccl:
        torch.cuda.set_device(device)  # NCCL groups bind each process to its GPU
    outer_groups, ddp_groups, hook_groups = _process_groups(world, k, nccl)
    # NOLOCO_LINK_LATENCY (noloco-fleet --latency) applies to the outer links only
    transport = TorchDistTransport(outer_groups[local])
    if k == 1:
        return transport, None
    return transport, Replicas(ddp_groups[worker], hook_groups[worker], worker * k, cfg.inner.grad_codec,
                               cfg.inner.grad_error_feedback, cfg.comm.recv_timeout)  # fmt: skip


def _store_stop(run: Run, rank: int, world: int) -> StoreStop:
    """Ctrl-C: every rank stops at one step, agreed over the run's store (a client of its own, with a short
    timeout, so a dead store host costs a rank one timeout; keys fresh for each torchrun attempt)."""
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=10))  # fmt: skip
    store = dist.PrefixStore(f"noloco/stop/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", client)
    return StoreStop(store, rank, world, run.resume_step, run.cfg.comm.startup_timeout)


class _GatherFailed(Exception):
    """A rank died before the end-of-run gather; this survivor wrote its own summary."""


def _gather_summary(run: Run, result: WorkerResult, transport, inner_bytes: int, k: int) -> dict | None:
    """Gather every rank's numbers (plain torch.distributed collectives, not counted as traffic); rank 0 writes
    the run's summary. When a rank is gone, each survivor writes ``summary.rank<r>.json`` of its own instead."""
    cfg, folder = run.cfg, run.folder
    rank, world = dist.get_rank(), dist.get_world_size()
    results: list = [None] * world
    waits: list = [None] * world
    inner: list = [None] * world
    own = WorkerResult(**{**result.__dict__, "slow_weights": torch.empty(0)})  # the weights are reduced, not gathered
    try:
        dist.all_gather_object(results, own)
        dist.all_gather_object(waits, transport.wait_seconds)
        dist.all_gather_object(inner, inner_bytes)
        # a sketch of the weights, not the weights: on a shaped link this must not cost a model's worth of bytes
        sketch = weight_sketch(result.slow_weights)
        mean = sketch.clone()
        dist.all_reduce(mean)
        mean /= world
        spread = (sketch - mean).pow(2).sum().reshape(1)
        dist.all_reduce(spread)
        consensus = relative_spread(mean, spread / world)
    except Exception as exc:  # noqa: BLE001 - a rank died: this survivor reports on its own
        _write_own_summary(folder, rank, result, transport, exc)
        raise _GatherFailed from None
    if rank != 0:
        return None
    merge_parts(folder)  # every rank closed its part before the gather
    leaders = results[::k]  # one entry per worker: its first process (the others hold the same replica)
    extra = {
        "processes_per_worker": k,
        "final_eval_loss_per_process": [r.final_eval_loss for r in results],
        "inner_grad_codec": cfg.inner.grad_codec if k > 1 else None,
        "inner_bytes_sent_per_process": inner,
        # seconds each worker spent blocked waiting for peers' messages (the network or slower peers)
        "comm_wait_seconds_per_worker": [round(w, 3) for w in waits[::k]],
    }
    return finish(cfg, run.summary(leaders, consensus, extra=extra), run.quiet)


def _write_own_summary(folder: Path, rank: int, result: WorkerResult, transport, exc: BaseException) -> None:
    own = {
        "rank": rank,
        "final_eval_loss": result.final_eval_loss,
        "eval_history": result.eval_history,
        "slow_weights_finite": bool(torch.isfinite(result.slow_weights).all()),
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "comm_wait_seconds": round(transport.wait_seconds, 3),
        "nonfinite_events": result.nonfinite_events,
        "norm_rejections": result.norm_rejections,
        "error": f"final gather failed (a worker is gone?): {type(exc).__name__}: {exc}".splitlines()[0],
    }
    (folder / f"summary.rank{rank}.json").write_text(json.dumps(own, indent=1))
    print(f"noloco: rank {rank} finished training but could not gather the run's summary "
          f"({type(exc).__name__}); wrote {folder / f'summary.rank{rank}.json'}", flush=True)  # fmt: skip
