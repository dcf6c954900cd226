"""The local backend: N simulated workers as threads of one process over the in-process fabric.

:func:`launch` drives the run's lifecycle (:class:`~noloco.train.run.Run`: data, resume check, folder,
metrics, progress, Ctrl-C, summary) and supplies its placement: one :func:`~noloco.train.loop.train_worker`
per rank in a thread of this process, each with a :class:`LocalBackend` over its
:class:`~noloco.comm.LocalTransport`. The default backend, and the one ``python train.py`` runs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from noloco.collectives import allreduce, barrier
from noloco.comm import LocalFabric
from noloco.comm.base import CommAborted, CommError, Transport
from noloco.train.backends.base import Backend
from noloco.train.interrupt import LocalStop
from noloco.train.loop import WorkerResult, train_worker
from noloco.train.run import Run, consensus_distance, finish

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

    def peers(self) -> Transport:
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
    """Run (or resume) the job described by ``cfg`` on the local backend; returns the summary dict.

    The placement: the run's workers are threads of this process, one per rank over a :class:`LocalFabric`,
    every one of them in this process's metrics, bar and Ctrl-C agreement (:class:`LocalStop`)."""
    run = Run(cfg, run_dir, resume_from, resume_step, stop_after, quiet)
    run.load_corpus(shards=(range(cfg.workers), cfg.workers))
    run.check_resume(range(cfg.workers))
    run.create(workers_here=cfg.workers)
    ctx = run.context(run.metrics(), cfg.workers, stop=LocalStop())
    fabric = LocalFabric(cfg.workers)
    results: list[WorkerResult] = run.train(
        ctx,
        lambda: fabric.run(
            lambda transport: train_worker(ctx, LocalBackend(transport, startup_timeout=cfg.comm.startup_timeout))
        ),
    )
    run.raise_if_stopped(ctx)
    return finish(cfg, run.summary(results, consensus_distance([r.slow_weights for r in results])), quiet)
