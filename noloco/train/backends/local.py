"""The local backend: N simulated workers as threads of one process over the in-process fabric.

:func:`launch` prepares the data once, starts one :func:`~noloco.train.loop.train_worker` per rank
(each with a :class:`LocalBackend` over its :class:`~noloco.comm.LocalTransport`), shows progress,
and finishes the run folder: ``summary.json``, ``curves.png`` and a printed table. The default
backend, and the one ``python train.py`` runs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from noloco.collectives import allreduce, barrier
from noloco.comm import LocalFabric
from noloco.comm.base import CommAborted, CommError, Transport
from noloco.train import checkpoint
from noloco.train.backends.base import Backend
from noloco.train.loop import RunContext, WorkerResult, train_worker
from noloco.train.metrics import MetricsLogger, wandb_options
from noloco.train.run import Progress, consensus_distance, finish, new_run_folder, prepare, summarize

logger = logging.getLogger(__name__)


class WorldBackend(Backend):
    """A worker of a fixed world (every rank reachable through ``transport``): in-process or torch.distributed.

    The checkpoint barrier is a tiny all-reduce over the world (not counted as traffic); a worker that
    is gone leaves that step's checkpoint incomplete instead of failing the run. The stream-end agreement
    (:meth:`agree_stop`) is one too: a worker whose peers cannot be reached decides alone.
    """

    name = "world"

    def __init__(self, transport: Transport, rank: int | None = None, startup_timeout: float = 120.0):
        super().__init__(transport.rank if rank is None else rank)
        self.transport, self.barrier_timeout = transport, float(startup_timeout)

    def groups(self) -> Transport:
        return self.transport

    def barrier(self, step: int) -> bool:
        try:
            barrier(self.transport, f"ckpt/{step}", self.barrier_timeout)
        except CommAborted:
            raise
        except CommError as exc:  # a worker is gone: this step's checkpoint stays incomplete
            logger.warning("worker %d: checkpoint of step %d left incomplete (%s)", self.rank, step, exc)
            return False
        return True

    def agree_stop(self, step: int, exhausted_at: int | None) -> tuple[int, int] | None:
        """Every worker's ``exhausted_at`` in one all-reduce (a sum of one-hot fp32 votes, exact for steps below
        2^24; not counted as traffic), so every worker picks the same first one."""
        transport = self.transport
        if transport.world_size == 1:
            return super().agree_stop(step, exhausted_at)
        votes = torch.zeros(transport.world_size)
        votes[transport.rank] = 0 if exhausted_at is None else exhausted_at + 1  # 0: not exhausted
        before = transport.counter.state_dict()
        try:
            votes = allreduce(votes, transport, op="sum", timeout=self.barrier_timeout, tag=f"stream_end/{step}")
        except CommAborted:
            raise
        except CommError as exc:  # a worker is gone: this one decides alone
            logger.warning("worker %d: no stream-end agreement at step %d (%s); deciding alone", self.rank, step, exc)
            return super().agree_stop(step, exhausted_at)
        finally:
            transport.counter.load_state_dict(before)
        exhausted = [(int(v) - 1, rank) for rank, v in enumerate(votes.tolist()) if v > 0]
        return None if not exhausted else min(exhausted)[::-1]


class LocalBackend(WorldBackend):
    name = "local"


def launch(
    cfg: DictConfig,
    run_dir: Path | None = None,
    resume_from: Path | None = None,
    resume_step: int = 0,
    stop_after: int | None = None,
    quiet: bool = False,
) -> dict:
    """Run (or resume) the job described by ``cfg`` on the local backend; returns the summary dict."""
    started = time.perf_counter()
    run_dir = Path(run_dir) if run_dir else new_run_folder(cfg)  # (a resume passes its own folder)
    corpus, params = prepare(cfg, run_dir, quiet)
    if resume_from is not None:  # before anything of the run is written (the CLI checked the rest)
        check_vocab(resume_from, corpus.vocab_size)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))

    metrics = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, resume_step=resume_step if resume_from else None,
                            wandb=wandb_options(cfg, run_dir.name))  # fmt: skip
    progress = Progress(cfg.steps, resume_step, cfg.workers, cfg.log.progress and not quiet)
    ctx = RunContext(cfg, corpus, run_dir, metrics, resume_from, resume_step, progress, stop_after)
    ctx.stop = checkpoint.LocalStop()  # Ctrl-C: one stop step for every worker
    interrupt = checkpoint.INTERRUPT
    interrupt.run_dir, interrupt.armed = run_dir, True
    fabric = LocalFabric(cfg.workers)
    try:
        results: list[WorkerResult] = fabric.run(
            lambda transport: train_worker(ctx, LocalBackend(transport, startup_timeout=cfg.comm.startup_timeout))
        )
    finally:
        interrupt.armed = False
        progress.close()
        metrics.close()
    if ctx.stop.target is not None and ctx.stop.target < cfg.steps:  # (at the last step the run is complete)
        complete = (checkpoint.step_dir(run_dir, ctx.stop.target) / checkpoint.COMPLETE).exists()
        raise checkpoint.Interrupted(ctx.stop.target, run_dir, complete)
    summary = summarize(cfg, run_dir, corpus, params, results, consensus_distance([r.slow_weights for r in results]),
                        time.perf_counter() - started, stop_after or cfg.steps, resume_step)  # fmt: skip
    return finish(cfg, summary, quiet)


def check_vocab(resume_from: Path, vocab_size: int) -> None:
    """CheckpointError unless the checkpoint's models have the corpus's vocabulary (a changed ``data.*``)."""
    saved = checkpoint.checkpoint_vocab_size(resume_from)
    if saved is not None and saved != vocab_size:
        raise checkpoint.CheckpointError(f"resume={resume_from}: its models have a vocabulary of {saved}, this run's "
                                         f"data {vocab_size} (were data.* overrides given?)")  # fmt: skip
