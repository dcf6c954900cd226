"""The worker loop: inner AdamW steps, the algorithm's step, evaluation, logging, checkpoints.

One call of :func:`train_worker` is one worker of a run, whatever the backend: the local backend
runs one per thread over the in-process fabric; other backends run one per process. It reads top
to bottom: build, (resume), then for each step: batch → loss → backward → ``algo.sync_gradients``
→ clip → ``algo.step`` (inner step; outer step every H) → log → evaluate → checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from noloco.collectives import allreduce
from noloco.comm.base import CommAborted, CommError, Transport
from noloco.gossip.base import GroupSource
from noloco.train import checkpoint
from noloco.train.algorithms import DDP, Algorithm, DiLoCo, NoLoCo, PeriodicAveraging
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
    common = dict(codec=comm.codec, timeout=comm.timeout, error_feedback=comm.error_feedback, algorithm=comm.algorithm)
    if outer.algo == "ddp":
        return DDP(model, opt, transport, **common)
    common["slow_codec"] = comm.slow_codec
    common["max_norm_ratio"] = comm.max_norm_ratio
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
    # Open swarm (backend=hivemind): no world transport. ``groups`` forms each round's group (failed
    # rounds are skipped), ``rank`` picks the data stream, checkpoints need no barrier, and ``join``
    # may load a live peer's state before the first inner step (returns the step to start from).
    groups: GroupSource | None = None
    rank: int = 0
    join: Callable[[Algorithm, torch.nn.Module], int] | None = None
    after_step: Callable[[int, Algorithm], None] | None = None
    # A worker of several processes (backend=torch, inner.processes > 1): ``replicas`` wraps the model
    # in DDP with the quantized gradient hook and relays outer steps; ``rank`` is then the process's
    # global rank (its data stream and checkpoint file); ``barrier`` waits for every process.
    replicas: object | None = None
    barrier: Callable[[], None] | None = None


def train_worker(ctx: RunContext, transport: Transport | None) -> WorkerResult:
    """One worker's whole run. ``transport`` is the world's, or ``None`` in an open swarm (``ctx.groups``)."""
    cfg = ctx.cfg
    rank = transport.rank if transport is not None and ctx.replicas is None else ctx.rank
    model = build_model(cfg, ctx.corpus.vocab_size)
    opt, schedule = build_inner_optimizer(cfg, model)
    if ctx.groups is not None:
        algo = build_algorithm(cfg, model, opt, ctx.groups, skip_failed_rounds=True)
    else:
        algo = build_algorithm(cfg, model, opt, transport)
    forward = model
    if ctx.replicas is not None:
        forward = ctx.replicas.wrap(model)  # DDP over the worker's processes, quantized gradient hook
        algo.replicas = ctx.replicas
    sampler = BatchSampler(ctx.corpus.train, cfg.data.seq_len, cfg.data.batch_size, cfg.run.seed)
    held_out = eval_batches(ctx.corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.eval.batches)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len

    start, wall_offset, history = 0, 0.0, []
    if ctx.resume_from is not None:
        state = checkpoint.load_worker(ctx.resume_from, rank)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["inner_opt"])
        schedule.load_state_dict(state["schedule"])
        algo.load_state_dict(state["algorithm"])
        algo.counter.load_state_dict(state["counter"])
        start, wall_offset, history = state["step"], state["wall_seconds"], state["eval_history"]
    elif ctx.join is not None:
        start = ctx.join(algo, model)
        for _ in range(start):  # the LR schedule continues where the live peers are
            schedule.step()
    started = time.perf_counter()
    wall = lambda: wall_offset + time.perf_counter() - started  # noqa: E731

    if ctx.resume_from is None:  # the curve starts at the initial loss (a late joiner's: the live weights)
        eval_loss = evaluate(model, held_out)
        history.append((start, eval_loss))
        ctx.metrics.log(
            {
                "worker": rank,
                "step": start,
                "tokens": start * tokens_per_step,
                "bytes_sent": 0,
                "bytes_received": 0,
                "wall": round(wall(), 4),
                "eval_loss": eval_loss,
            }
        )
    eval_loss = history[-1][1]
    for step in range(start + 1, cfg.steps + 1):
        inputs, targets = sampler.batch(rank, step)
        _, loss = forward(inputs, targets)
        loss.backward()
        algo.sync_gradients()
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        lr = schedule.get_last_lr()[0]
        outer_round = algo.step()
        schedule.step()

        record = {
            "worker": rank,
            "step": step,
            "loss": loss.item(),
            "lr": lr,
            "tokens": step * tokens_per_step,
            "bytes_sent": algo.counter.bytes_sent,
            "bytes_received": algo.counter.bytes_received,
            "wall": round(wall(), 4),
        }
        if outer_round is not None:
            record["outer_round"], record["group"] = outer_round.round, outer_round.group
            if outer_round.skipped:
                record["outer_skipped"] = outer_round.skipped
        if algo.nonfinite_events:
            record["nonfinite_events"] = algo.nonfinite_events
        rejections = getattr(algo, "norm_rejections", None)
        if rejections is not None and rejections.total:
            record["norm_rejections"] = rejections.total
        if step % cfg.eval.every == 0 or step == cfg.steps:
            eval_loss = evaluate(model, held_out)
            history.append((step, eval_loss))
            record["eval_loss"] = eval_loss
        ctx.metrics.log(record)
        if ctx.progress is not None:
            ctx.progress.advance(rank, loss.item())
        if ctx.after_step is not None:
            ctx.after_step(step, algo)

        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
            state = {
                "step": step,
                "model": model.state_dict(),
                "inner_opt": opt.state_dict(),
                "schedule": schedule.state_dict(),
                "algorithm": algo.state_dict(),
                "counter": algo.counter.state_dict(),
                "wall_seconds": wall(),
                "eval_history": history,
            }
            checkpoint.save_worker(ctx.run_dir, step, rank, state)
            # Barrier: the checkpoint is complete only when every worker has saved. Not counted as traffic.
            # A swarm peer checkpoints on its own (its run folder is its own).
            complete = True
            if ctx.barrier is not None:
                ctx.barrier()
            elif transport is not None:
                try:
                    _barrier(transport, f"ckpt/{step}", cfg.comm.timeout)
                except CommAborted:
                    raise
                except CommError as exc:  # a worker is gone: this step's checkpoint stays incomplete
                    complete = False
                    logger.warning("worker %d: checkpoint of step %d left incomplete (%s)", rank, step, exc)
            if complete and (transport is None or rank == 0):
                checkpoint.mark_complete(ctx.run_dir, step, OmegaConf.to_yaml(cfg), cfg.checkpoint.keep)
        if ctx.stop_after is not None and step >= ctx.stop_after:
            break

    return WorkerResult(
        rank=rank,
        final_eval_loss=eval_loss,
        slow_weights=algo.slow_weights(),
        bytes_sent=algo.counter.bytes_sent,
        bytes_received=algo.counter.bytes_received,
        eval_history=history,
        nonfinite_events=algo.nonfinite_events,
        norm_rejections=algo.norm_rejections.total if hasattr(algo, "norm_rejections") else 0,
    )


def _barrier(transport: Transport, tag: str, timeout: float) -> None:
    if transport.world_size == 1:
        return
    before = transport.counter.state_dict()
    allreduce(torch.zeros(1), transport, tag=tag, timeout=timeout)
    transport.counter.load_state_dict(before)
