"""The worker loop: inner AdamW steps, the algorithm's step, evaluation, logging, checkpoints.

One call of :func:`train_worker` is one worker of a run, whatever the backend: the local backend
runs one per thread over the in-process fabric; other backends run one per process. What differs
between backends goes through the worker's :class:`~noloco.train.backends.base.Backend` (what to
exchange over, late join, per-step bookkeeping, checkpoint barriers). It reads top to bottom:
build, (resume or start), then for each step: batch → loss → backward → ``algo.sync_gradients``
→ clip → ``algo.step`` (inner step; outer step every H) → log → evaluate → checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from noloco.comm.base import Transport
from noloco.gossip.base import GroupSource
from noloco.optim import DDP, Algorithm, DiLoCo, NoLoCo, PeriodicAveraging
from noloco.train import checkpoint
from noloco.train.backends.base import Backend
from noloco.train.data import BatchSampler, TokenizedCorpus, eval_batches
from noloco.train.metrics import MetricsLogger
from noloco.train.model import LLaMA, model_config

logger = logging.getLogger(__name__)


@dataclass
class WorkerResult:
    rank: int
    final_eval_loss: float
    slow_weights: torch.Tensor
    bytes_sent: int
    bytes_received: int
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    nonfinite_events: int = 0
    norm_rejections: int = 0  # partners' contributions the outer exchange's norm bound refused


def build_model(cfg: DictConfig, vocab_size: int) -> LLaMA:
    overrides = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "preset"}
    if overrides.get("max_seq_len") is None:
        overrides["max_seq_len"] = max(1024, cfg.data.seq_len)
    return LLaMA(model_config(cfg.model.preset, vocab_size=vocab_size, **overrides), seed=cfg.run.seed)


def build_inner_optimizer(
    cfg: DictConfig, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (decay on matrices only) and a linear warm-up + cosine schedule down to ``inner.min_lr``."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    inner = cfg.inner
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
        foreach=True,
    )
    floor = inner.min_lr / inner.lr

    def factor(step: int) -> float:  # step = number of inner steps already taken
        if step < inner.warmup:
            return (step + 1) / inner.warmup
        progress = min(1.0, (step - inner.warmup) / max(1, cfg.steps - inner.warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def build_algorithm(
    cfg: DictConfig, model, opt, transport: Transport | GroupSource, skip_failed_rounds: bool = False
) -> Algorithm:
    """``transport`` is a fixed world's transport or, in an open swarm, a group source (then rounds may be skipped)."""
    outer, comm = cfg.outer, cfg.comm
    common = dict(codec=comm.codec, timeout=comm.recv_timeout, error_feedback=comm.error_feedback,
                  reduction=comm.reduction)  # fmt: skip
    if outer.algo == "ddp":
        return DDP(model, opt, transport, **common)
    common["slow_codec"] = comm.slow_codec
    common["max_norm_ratio"] = comm.max_norm_ratio
    common["group_timeout"] = comm.group_timeout
    if skip_failed_rounds:
        common["skip_failed_rounds"] = True
    if outer.algo == "noloco":
        return NoLoCo(
            model,
            opt,
            transport,
            every=outer.every,
            lr=outer.lr,
            pull=outer.pull,
            momentum=outer.momentum,
            group_size=outer.group_size,
            seed=cfg.run.seed,
            **common,
        )
    if outer.algo == "diloco":
        return DiLoCo(
            model,
            opt,
            transport,
            every=outer.every,
            lr=outer.lr,
            momentum=outer.momentum,
            nesterov=outer.nesterov,
            **common,
        )
    if outer.algo == "avg":
        return PeriodicAveraging(model, opt, transport, every=outer.every, **common)
    raise ValueError(f"unknown outer.algo {outer.algo!r}")


@torch.no_grad()
def evaluate(model: LLaMA, batches) -> float:
    """Mean cross-entropy (nats/token) over fixed held-out batches."""
    model.eval()
    total = sum(model(x, y)[1].item() for x, y in batches)
    model.train()
    return total / len(batches)


@dataclass
class RunContext:
    """What the workers of one run share: config, data, output folder, metrics, progress."""

    cfg: DictConfig
    corpus: TokenizedCorpus
    run_dir: Path
    metrics: MetricsLogger
    resume_from: Path | None = None
    resume_step: int = 0
    progress: object | None = None
    stop_after: int | None = None  # testing hook: return after this step, as if killed


@dataclass
class Worker:
    """One worker's live objects while it trains (built by :func:`build_worker`)."""

    rank: int
    model: LLaMA
    forward: torch.nn.Module
    opt: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    algo: Algorithm
    sampler: BatchSampler
    held_out: list
    start: int = 0
    wall_offset: float = 0.0
    history: list = field(default_factory=list)

    def state(self, step: int, wall: float) -> dict:
        """Everything a checkpoint of ``step`` holds for this worker."""
        return {
            "step": step,
            "model": self.model.state_dict(),
            "inner_opt": self.opt.state_dict(),
            "schedule": self.schedule.state_dict(),
            "algorithm": self.algo.state_dict(),
            "counter": self.algo.counter.state_dict(),
            "wall_seconds": wall,
            "eval_history": self.history,
        }

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["inner_opt"])
        self.schedule.load_state_dict(state["schedule"])
        self.algo.load_state_dict(state["algorithm"])
        self.algo.counter.load_state_dict(state["counter"])
        self.start, self.wall_offset, self.history = state["step"], state["wall_seconds"], state["eval_history"]


def build_worker(ctx: RunContext, backend: Backend) -> Worker:
    """Model, inner optimizer, algorithm and data of one worker; resumed, or started through the backend."""
    cfg = ctx.cfg
    model = build_model(cfg, ctx.corpus.vocab_size)
    opt, schedule = build_inner_optimizer(cfg, model)
    algo = build_algorithm(cfg, model, opt, backend.groups(), skip_failed_rounds=backend.skip_failed_rounds)
    worker = Worker(
        rank=backend.rank,
        model=model,
        forward=backend.wrap(model, algo),
        opt=opt,
        schedule=schedule,
        algo=algo,
        sampler=BatchSampler(ctx.corpus.train, cfg.data.seq_len, cfg.data.batch_size, cfg.run.seed),
        held_out=eval_batches(ctx.corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.eval.batches),
    )
    if ctx.resume_from is not None:
        worker.load(checkpoint.load_worker(ctx.resume_from, worker.rank))
    else:
        worker.start = backend.start(algo, model)
        for _ in range(worker.start):  # the LR schedule continues where the live peers are
            schedule.step()
    return worker


def train_worker(ctx: RunContext, backend: Backend) -> WorkerResult:
    """One worker's whole run on ``backend``; returns its final numbers."""
    cfg = ctx.cfg
    worker = build_worker(ctx, backend)
    algo, tokens_per_step = worker.algo, cfg.data.batch_size * cfg.data.seq_len
    started = time.perf_counter()
    wall = lambda: worker.wall_offset + time.perf_counter() - started  # noqa: E731

    if ctx.resume_from is None:  # the curve starts at the initial loss (a late joiner's: the live weights)
        worker.history.append((worker.start, evaluate(worker.model, worker.held_out)))
        ctx.metrics.log({"worker": worker.rank, "step": worker.start, "tokens": worker.start * tokens_per_step,
                         "bytes_sent": 0, "bytes_received": 0, "wall": round(wall(), 4),
                         "eval_loss": worker.history[-1][1]})  # fmt: skip
    for step in range(worker.start + 1, cfg.steps + 1):
        loss, lr, outer_round = inner_step(cfg, worker, step)
        record = step_record(worker, step, loss, lr, outer_round, tokens_per_step, wall())
        if step % cfg.eval.every == 0 or step == cfg.steps:
            worker.history.append((step, evaluate(worker.model, worker.held_out)))
            record["eval_loss"] = worker.history[-1][1]
        ctx.metrics.log(record)
        if ctx.progress is not None:
            ctx.progress.advance(worker.rank, record["loss"])
        backend.after_step(step, algo)
        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
            save_checkpoint(ctx, backend, worker, step, wall())
        if ctx.stop_after is not None and step >= ctx.stop_after:
            break

    return WorkerResult(
        rank=worker.rank,
        final_eval_loss=worker.history[-1][1],
        slow_weights=algo.slow_weights(),
        bytes_sent=algo.counter.bytes_sent,
        bytes_received=algo.counter.bytes_received,
        eval_history=worker.history,
        nonfinite_events=algo.nonfinite_events,
        norm_rejections=algo.norm_rejections.total,
    )


def inner_step(cfg: DictConfig, worker: Worker, step: int):
    """batch → loss → backward → sync → clip → algorithm step (outer step every H); returns (loss, lr, round)."""
    inputs, targets = worker.sampler.batch(worker.rank, step)
    _, loss = worker.forward(inputs, targets)
    loss.backward()
    worker.algo.sync_gradients()
    if cfg.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(worker.model.parameters(), cfg.inner.grad_clip)
    lr = worker.schedule.get_last_lr()[0]
    outer_round = worker.algo.step()
    worker.schedule.step()
    return loss.item(), lr, outer_round


def step_record(worker: Worker, step: int, loss: float, lr: float, outer_round, tokens_per_step: int,
                wall: float) -> dict:
    """The ``metrics.jsonl`` line of one step (evaluation added by the caller)."""
    algo = worker.algo
    record = {
        "worker": worker.rank,
        "step": step,
        "loss": loss,
        "lr": lr,
        "tokens": step * tokens_per_step,
        "bytes_sent": algo.counter.bytes_sent,
        "bytes_received": algo.counter.bytes_received,
        "wall": round(wall, 4),
    }
    if outer_round is not None:
        record["outer_round"], record["group"] = outer_round.round, outer_round.group
        if outer_round.skipped:
            record["outer_skipped"] = outer_round.skipped
    if algo.nonfinite_events:
        record["nonfinite_events"] = algo.nonfinite_events
    if algo.norm_rejections.total:
        record["norm_rejections"] = algo.norm_rejections.total
    return record


def save_checkpoint(ctx: RunContext, backend: Backend, worker: Worker, step: int, wall: float) -> None:
    """Save this worker's state; once every worker has (the backend's barrier), mark the step complete."""
    checkpoint.save_worker(ctx.run_dir, step, worker.rank, worker.state(step, wall))
    if backend.barrier(step) and backend.marks_complete():
        checkpoint.mark_complete(ctx.run_dir, step, OmegaConf.to_yaml(ctx.cfg), ctx.cfg.checkpoint.keep)
