"""The worker loop: inner AdamW steps, the algorithm's step, evaluation, logging, checkpoints.

One call of :func:`train_worker` is one worker of a run, whatever the backend: the local backend
runs one per thread over the in-process fabric; other backends run one per process. What differs
between backends goes through the worker's :class:`~noloco.train.backends.base.Backend` (what to
exchange over, late join, per-step bookkeeping, checkpoint barriers). It reads top to bottom:
build, (resume or start), then for each step: batch → loss → backward → ``algo.sync_gradients``
→ clip → ``algo.step`` (inner step; outer step every H) → log → evaluate → checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from noloco.comm.base import Transport
from noloco.data.sampler import BatchSampler, eval_batches
from noloco.data.stream_end import StreamEnd
from noloco.data.tokens import TokenizedCorpus
from noloco.gossip.base import GroupSource
from noloco.models.llama import LLaMA, ModelConfig, model_config
from noloco.optim import ALGORITHMS, Algorithm
from noloco.train import checkpoint
from noloco.train.backends.base import Backend
from noloco.train.config import ConfigError, evaluated_weights
from noloco.train.device import (
    CompiledForward,
    autocast,
    backward,
    check_model_memory,
    flops_per_token,
    local_index,
    peak_tflops,
    resolve_precision,
    synchronize,
    worker_device,
    worker_stream,
)
from noloco.train.interrupt import stop_here
from noloco.train.metrics import MetricsLogger
from noloco.train.stall import StallWatch
from noloco.train.state import WorkerState

logger = logging.getLogger(__name__)


# model.* keys that are not ModelConfig fields
MODEL_SOURCE_KEYS = ("preset", "source", "hf_path", "hf_weights", "max_memory_gb")


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
    peak_memory_bytes: int = 0  # peak GPU memory allocated by this worker's process (CUDA only)
    stream: dict | None = None  # data.streaming: its shard and where it ended (StreamSampler.report)
    stopped: dict | None = None  # data.stream_end=stop: why the run ended before steps (stream_end.stopped_record)
    timing: dict = field(default_factory=dict)  # StepLog.timing: loop and outer-step seconds, MFU


def build_model(cfg: DictConfig, vocab_size: int) -> LLaMA:
    if cfg.model.get("source", "noloco") == "hf":  # a transformers causal LM (noloco/models/hf.py)
        from noloco.models.hf import build_hf_model

        def check_memory(parameters: int, what: str) -> None:
            check_model_memory(cfg, parameters, copies=workers_per_process(cfg), what=what)

        return build_hf_model(cfg.model.hf_path, vocab_size, hf_weights=cfg.model.get("hf_weights", "auto"),
                              seq_len=cfg.data.seq_len, seed=int(cfg.run.seed), check_memory=check_memory)  # fmt: skip
    return LLaMA(model_spec(cfg, vocab_size), seed=cfg.run.seed)


def model_parameters(cfg: DictConfig, vocab_size: int) -> int:
    """Parameters of the model ``cfg`` builds, checked as :func:`build_model` checks it; nothing is allocated (a
    noloco model is counted from its config, a transformers one built on the meta device)."""
    if cfg.model.get("source", "noloco") == "hf":
        with torch.device("meta"):
            return build_model(cfg, vocab_size).num_parameters()
    return model_spec(cfg, vocab_size).num_parameters()


def model_spec(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    """The :class:`ModelConfig` of a noloco model from ``cfg.model`` (ConfigError if out of range or too large for
    the memory its workers share)."""
    overrides = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k not in MODEL_SOURCE_KEYS}
    if overrides.get("max_seq_len") is None:
        overrides["max_seq_len"] = max(1024, cfg.data.seq_len)
    try:
        mcfg = model_config(cfg.model.preset, vocab_size=vocab_size, **overrides)
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None
    for key in ("dim", "n_layers", "n_heads", "hidden_dim", "max_seq_len", "vocab_size"):
        value = getattr(mcfg, key)
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2**31):
            raise ConfigError(f"model.{key}={value!r} is not an integer in [1, 2^31)")
    check_model_memory(cfg, mcfg.num_parameters(), mcfg.buffer_numel(), copies=workers_per_process(cfg))
    return mcfg


def workers_per_process(cfg: DictConfig) -> int:
    """Workers whose models one process holds: all of them where they are threads of one process, else one."""
    from noloco.train.backends import spec

    return int(cfg.workers) if spec(cfg).workers_share_a_process else 1


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
        # CUDA: one fused kernel, which also skips a step with non-finite gradients on the device (found_inf)
        **({"fused": True} if decay and decay[0].is_cuda else {"foreach": True}),
    )
    floor = inner.min_lr / inner.lr

    def factor(step: int) -> float:  # step = number of inner steps already taken
        if step < inner.warmup:
            return (step + 1) / inner.warmup
        progress = min(1.0, (step - inner.warmup) / max(1, cfg.steps - inner.warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def build_algorithm(
    cfg: DictConfig, model, opt, peers: Transport | GroupSource, skip_failed_rounds: bool = False
) -> Algorithm:
    """``peers`` (:meth:`Backend.peers`): a fixed world's transport, whose groups the algorithm draws, or, in an open
    swarm, a group source (then rounds may be skipped).

    The algorithm ``outer.algo`` names reads its own settings from ``cfg`` (its ``SETTINGS``), so a new setting
    is a keyword of its class, a key of its config section and a line of ``defaults.yaml``, nothing here."""
    cls = ALGORITHMS[cfg.outer.algo]
    extra = {"skip_failed_rounds": True} if skip_failed_rounds else {}
    return cls(model, opt, peers, **cls.settings_from(cfg), **extra)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device | None = None, precision: str = "fp32") -> float:
    """Mean cross-entropy (nats/token) over fixed held-out batches (one host read at the end)."""
    model.eval()
    with autocast(device or torch.device("cpu"), precision):
        losses = [model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))[1].float()
                  for x, y in batches] if device is not None else [model(x, y)[1] for x, y in batches]  # fmt: skip
    model.train()
    if device is None:  # the CPU path sums Python floats in order (the default run's numbers)
        return sum(loss.item() for loss in losses) / len(batches)
    return sum(torch.stack(losses).tolist()) / len(batches)


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
    stop: object | None = None  # Ctrl-C: the step every worker stops at (interrupt.LocalStop / StoreStop)
    watch: StallWatch | None = None  # run.stall_timeout: made by the first worker that reports (mark)
    # what Run.check_resume read and built for a one-worker process: its checked state by rank, and the model built
    # from run.seed (each taken once by build_worker instead of read or built again)
    resumed_states: dict[int, dict] = field(default_factory=dict)
    seed_models: list = field(default_factory=list)

    def should_stop(self, rank: int, step: int) -> bool:
        """Ctrl-C: True once worker ``rank`` finished the step every worker of the run stops (and saves) at."""
        return stop_here(self.stop, rank, step, self.run_dir)

    def mark(self, rank: int, step: int, doing: str) -> None:
        """Worker ``rank`` finished ``step`` and now does ``doing``, for the stall detector (``run.stall_timeout``)."""
        timeout = self.cfg.run.get("stall_timeout", 0)
        if not timeout:
            return
        with _WATCH_LOCK:
            if self.watch is None:
                self.watch = StallWatch(timeout, self.run_dir)
        self.watch.mark(rank, step, doing)


_WATCH_LOCK = threading.Lock()


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
    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    eval_weights: str = "fast"  # fast (θ) or slow (φ): config.evaluated_weights
    start: int = 0
    wall_offset: float = 0.0
    history: list = field(default_factory=list)
    _owners: WorkerState | None = field(default=None, repr=False)

    def owners(self) -> WorkerState:
        """This worker's state owners (:mod:`noloco.train.state`): what a checkpoint stores, less what can be
        rebuilt exactly (φ₀, φ = φ₀, θ = φ)."""
        if self._owners is None:
            self._owners = WorkerState.of_worker(self.model, self.opt, self.schedule, self.algo, self.history,
                                                 self.sampler)  # fmt: skip
        return self._owners

    def state(self, step: int, wall: float) -> dict:
        """Everything a checkpoint of ``step`` holds for this worker (``wall``: seconds trained so far)."""
        return self.owners().state_dict(step, wall)

    def evaluate(self) -> float:
        """The held-out loss of the weights ``eval_weights`` names (θ is back in the model afterwards)."""
        with self.algo.slow_in_model() if self.eval_weights == "slow" else contextlib.nullcontext():
            if self.device.type == "cpu" and self.precision == "fp32":
                return evaluate(self.model, self.held_out)
            return evaluate(self.model, self.held_out, self.device, self.precision)

    def load(self, state: dict) -> None:
        """Continue from a checkpoint's state (checked by :meth:`WorkerState.check`); rebuilds what
        :meth:`state` left out. :class:`~noloco.train.checkpoint.CheckpointError` if it cannot be loaded."""
        try:
            self.owners().load_state_dict(state)
        except checkpoint.CheckpointError as exc:
            raise checkpoint.CheckpointError(f"worker {self.rank}: {exc}") from None
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise checkpoint.CheckpointError(f"worker {self.rank}: cannot load its state: {exc}") from None
        self.start, self.wall_offset = state["step"], state["wall_seconds"]


def build_worker(ctx: RunContext, backend: Backend) -> Worker:
    """Model, inner optimizer, algorithm and data of one worker; resumed, or started through the backend."""
    cfg = ctx.cfg
    device = worker_device(str(cfg.device), local_index(backend.rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:  # the model Run.check_resume built from run.seed (a resumed swarm peer), else a new one
        model = ctx.seed_models.pop()
    except IndexError:
        model = build_model(cfg, ctx.corpus.vocab_size)
    model = model.to(device)
    opt, schedule = build_inner_optimizer(cfg, model)
    algo = build_algorithm(cfg, model, opt, backend.peers(), skip_failed_rounds=backend.skip_failed_rounds)
    forward = backend.wrap(model, algo)
    worker = Worker(
        rank=backend.rank,
        model=model,
        forward=CompiledForward(forward) if cfg.compile else forward,
        opt=opt,
        schedule=schedule,
        algo=algo,
        sampler=BatchSampler(ctx.corpus.train, cfg.data.seq_len, cfg.data.batch_size, cfg.run.seed)
        if not hasattr(ctx.corpus, "sampler")  # data.streaming: this worker's shard (noloco/data/stream.py)
        else ctx.corpus.sampler(backend.rank, cfg.workers * cfg.inner.processes, cfg.data.seq_len, cfg.data.batch_size),
        held_out=eval_batches(ctx.corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.eval.batches),
        device=device,
        precision=resolve_precision(str(cfg.precision), device),
        eval_weights=evaluated_weights(cfg),
    )
    if ctx.resume_from is not None:  # checked as a whole (Run.check_resume) before the run wrote anything
        state = ctx.resumed_states.pop(worker.rank, None)
        if state is None:
            state = checkpoint.load_worker(ctx.resume_from, worker.rank, ctx.resume_step)
        worker.load(state)
        del state
    else:
        worker.start = backend.start(algo, model)
        advance_schedule(schedule, worker.start)  # the LR schedule continues where the live peers are
    return worker


def advance_schedule(schedule: torch.optim.lr_scheduler.LRScheduler, steps: int) -> None:
    """Step ``schedule`` ``steps`` times before any optimizer step (a late joiner starting at the swarm's step),
    without PyTorch's warning about a schedule stepped before its optimizer: here that order is meant."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        for _ in range(steps):
            schedule.step()


def skip_steps(ctx: RunContext, worker: Worker, log: StepLog, step: int, to: int) -> None:
    """Go on from step ``to`` instead of ``step`` without training the steps between (a resumed swarm peer
    joining its swarm's round: :meth:`~noloco.train.backends.base.Backend.next_step`): the algorithm's step,
    the LR schedule (where the swarm's is), the step log's token rate and the progress bar move with it."""
    worker.algo.skip_to(to)
    advance_schedule(worker.schedule, to - step)
    log.skip(to - step)
    if ctx.progress is not None:
        ctx.progress.skip(worker.rank, to - step)


def train_worker(ctx: RunContext, backend: Backend) -> WorkerResult:
    """One worker's whole run on ``backend``, on a CUDA stream of its own on a GPU; returns its final numbers."""
    try:
        with worker_stream(worker_device(str(ctx.cfg.device), local_index(backend.rank))):
            return _train(ctx, backend)
    finally:
        if ctx.watch is not None:  # finished, or failed: the stall detector no longer waits for it
            ctx.watch.done(backend.rank)


def _train(ctx: RunContext, backend: Backend) -> WorkerResult:
    cfg = ctx.cfg
    worker = build_worker(ctx, backend)
    algo = worker.algo
    log = StepLog(ctx, worker)
    stream_end = StreamEnd.of(cfg, worker.sampler, backend, ctx.progress)  # None unless data.stream_end=stop
    if ctx.resume_from is None:  # the curve starts at the initial loss (a late joiner's: the live weights)
        worker.history.append((worker.start, worker.evaluate()))
        log.first(worker.history[-1][1])
    elif worker.device.type == "cuda":
        # A new run's first GPU work is the eval above; a resumed one does it too, discarding the number. Several
        # workers' streams starting cold at once let cuBLAS pick other workspaces for one worker's first matmuls:
        # its first training step then differed in the last bits from the uninterrupted run's (docs/design.md §8).
        worker.evaluate()
    step = worker.start
    every = getattr(algo, "period", 0)
    while step < cfg.steps:
        following = backend.next_step(step, algo)  # step + 1, unless a swarm peer skips ahead to its swarm's step
        if following > step + 1:
            skip_steps(ctx, worker, log, step, following - 1)
        step = following
        exchange = bool(every) and (algo.inner_step + 1) % every == 0
        ctx.mark(worker.rank, step - 1, f"step {step} and its outer exchange" if exchange else f"step {step}")
        loss, lr, outer_round, outer_seconds = inner_step(cfg, worker, step, stream_end)
        log.add(step, loss, lr, outer_round, outer_seconds)
        last = step == cfg.steps or (stream_end is not None and stream_end.stopped is not None)  # a stream ran out
        evaluated = step % cfg.eval.every == 0 or last
        stop = ctx.should_stop(worker.rank, step)  # Ctrl-C: every worker stops and saves at one step
        periodic = cfg.checkpoint.every and step % cfg.checkpoint.every == 0
        checkpointed = stop or (cfg.checkpoint.final if last else periodic)  # (final=false: none of the last step)
        if evaluated:
            ctx.mark(worker.rank, step, "the held-out evaluation")
            worker.history.append((step, worker.evaluate()))
            log.evaluated(worker.history[-1][1])
        if evaluated or checkpointed or step % log.flush_every == 0 or algo.last_round is not None:
            log.flush()
        backend.after_step(step, algo)
        if checkpointed:
            ctx.mark(worker.rank, step, "its checkpoint (writing, then waiting for every worker's)")
            saving = time.perf_counter()
            save_checkpoint(ctx, backend, worker, step, log.wall())
            log.checkpoint_seconds += time.perf_counter() - saving
        if last or stop or (ctx.stop_after is not None and step >= ctx.stop_after):
            break
    log.flush()
    return WorkerResult(
        rank=worker.rank,
        final_eval_loss=worker.history[-1][1],
        slow_weights=algo.slow_weights(),
        bytes_sent=algo.counter.bytes_sent,
        bytes_received=algo.counter.bytes_received,
        eval_history=worker.history,
        nonfinite_events=algo.nonfinite_events,
        norm_rejections=algo.norm_rejections.total,
        peak_memory_bytes=torch.cuda.max_memory_allocated(worker.device) if worker.device.type == "cuda" else 0,
        stream=worker.sampler.report() if hasattr(worker.sampler, "report") else None,
        stopped=stream_end.stopped if stream_end is not None else None,
        timing=log.timing(step),
    )


class StepLog:
    """A worker's ``metrics.jsonl`` lines, written in batches: the loss stays on the device until a flush,
    so a GPU worker reads back to the host once every ``log.flush_every`` steps, not every step.

    Besides the per-step fields, a flushed line carries ``tokens_per_second`` (over the steps since the
    last flush), ``mfu`` (where a peak is known, docs/design.md §8), ``gpu_peak_memory_gb`` on CUDA and
    ``outer_ms`` on steps with an outer round.
    """

    def __init__(self, ctx: RunContext, worker: Worker):
        cfg = ctx.cfg
        self.ctx, self.worker = ctx, worker
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        default_flush = 10 if worker.device.type == "cuda" else 1
        self.flush_every = int(cfg.log.flush_every or default_flush)
        self.pending: list[tuple[dict, torch.Tensor]] = []
        self.started = time.perf_counter()
        self.window = (self.started, worker.start)
        model = worker.model
        embedding = model.embed.weight.numel() if hasattr(model, "embed") else 0
        mcfg = getattr(model, "cfg", None)
        self.flops = (
            None
            if mcfg is None
            else flops_per_token(
                sum(p.numel() for p in model.parameters()), embedding, mcfg.n_layers, mcfg.dim, cfg.data.seq_len
            )
        )
        self.peak = peak_tflops(worker.device, cfg.log.peak_tflops)
        self.outer_seconds, self.outer_steps = 0.0, 0  # the loop's time inside outer steps (blocked, not training)
        self.checkpoint_seconds = 0.0  # the loop's time writing checkpoints (not in tokens/s and MFU)
        self.skipped, self.skipped_in_window = 0, 0  # steps skipped, not trained (skip_steps): not in tokens/s

    def skip(self, steps: int) -> None:
        """``steps`` steps were skipped, not trained: the token rates leave them out."""
        self.skipped += steps
        self.skipped_in_window += steps

    def wall(self) -> float:
        return self.worker.wall_offset + time.perf_counter() - self.started

    def first(self, eval_loss: float) -> None:
        w = self.worker
        self.ctx.metrics.log({"worker": w.rank, "step": w.start, "tokens": w.start * self.tokens_per_step,
                              "bytes_sent": 0, "bytes_received": 0, "wall": round(self.wall(), 4),
                              "eval_loss": eval_loss})  # fmt: skip

    def add(self, step: int, loss: torch.Tensor, lr: float, outer_round, outer_seconds: float | None) -> None:
        """One step's line; ``outer_round`` may be a list (the last step of an overlapped run: the round merged
        there and the one that landed at the end), then one line per round, the step's loss on each."""
        rounds = outer_round if isinstance(outer_round, list) else [outer_round]
        for info in rounds:
            record = step_record(self.worker, step, lr, info, self.tokens_per_step, self.wall())
            if outer_seconds is not None:
                record["outer_ms"] = round(1e3 * outer_seconds, 3)
            self.pending.append((record, loss))
        if outer_seconds is not None:
            self.outer_seconds += outer_seconds
            self.outer_steps += 1

    def timing(self, last_step: int) -> dict:
        """This worker's run in numbers for ``summary.json``: ``loop_seconds`` (its training loop, start-up
        excluded), ``outer_seconds`` and ``outer_steps`` (time the loop spent inside outer steps, which includes
        waiting for an overlapped exchange), ``outer_ms_mean``, ``checkpoint_seconds`` (writing checkpoints),
        ``steps_skipped`` (not trained: a swarm peer catching up with its swarm), ``tokens_per_second`` over the
        loop less its checkpoint writes and, where the device's peak is known, ``mfu`` of that rate
        (docs/design.md §8)."""
        loop = time.perf_counter() - self.started
        trained = last_step - self.worker.start - self.skipped
        rate = trained * self.tokens_per_step / max(loop - self.checkpoint_seconds, 1e-9)
        out = {
            "loop_seconds": round(loop, 3),
            "outer_seconds": round(self.outer_seconds, 3),
            "checkpoint_seconds": round(self.checkpoint_seconds, 3),
            "outer_steps": self.outer_steps,
            "steps_skipped": self.skipped,
            "tokens_per_second": round(rate, 1),
            "outer_ms_mean": round(1e3 * self.outer_seconds / self.outer_steps, 3) if self.outer_steps else None,
        }
        if self.flops is not None and self.peak is not None:
            out["mfu"] = round(rate * self.flops / (self.peak * 1e12), 4)
        return out

    def evaluated(self, eval_loss: float) -> None:
        self.pending[-1][0]["eval_loss"] = eval_loss

    def flush(self) -> None:
        """Read the pending losses (one host sync) and write their lines."""
        if not self.pending:
            return
        losses = torch.stack([loss.detach().float() for _, loss in self.pending]).tolist()
        algo, now = self.worker.algo, time.perf_counter()
        last = self.pending[-1][0]
        steps = last["step"] - self.window[1] - self.skipped_in_window
        rate = steps * self.tokens_per_step / max(now - self.window[0], 1e-9)
        last["tokens_per_second"] = round(rate, 1)
        if self.flops is not None and self.peak is not None:
            last["mfu"] = round(rate * self.flops / (self.peak * 1e12), 4)
        if self.worker.device.type == "cuda":
            last["gpu_peak_memory_gb"] = round(torch.cuda.max_memory_allocated(self.worker.device) / 2**30, 3)
        if algo.nonfinite_events:
            last["nonfinite_events"] = algo.nonfinite_events
        advanced = None
        for (record, _), loss in zip(self.pending, losses):
            record["loss"] = loss
            self.ctx.metrics.log(record)
            if self.ctx.progress is not None and record["step"] != advanced:  # one tick per step, not per line
                self.ctx.progress.advance(self.worker.rank, loss)
                advanced = record["step"]
        self.window, self.skipped_in_window = (now, last["step"]), 0
        self.pending.clear()


def inner_step(cfg: DictConfig, worker: Worker, step: int, stream_end: StreamEnd | None = None):
    """batch → loss → backward → sync → clip → algorithm step (outer step every H).

    Returns (loss tensor, lr, outer round info or None, seconds the outer step took or None). Nothing
    here waits for the GPU except an outer step (its exchange needs the weights). ``stream_end``
    (``data.stream_end=stop``) may make this step the last one: its batch is drawn, so it knows.
    """
    if worker.device.type == "cpu":
        inputs, targets = worker.sampler.batch(worker.rank, step)
    else:  # pinned host buffer, non-blocking copy
        inputs, targets = worker.sampler.batch(worker.rank, step, device=worker.device)
    with autocast(worker.device, worker.precision):
        _, loss = worker.forward(inputs, targets)
    backward(worker.forward, loss)
    worker.algo.sync_gradients()
    if cfg.inner.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(worker.model.parameters(), cfg.inner.grad_clip)
    lr = worker.schedule.get_last_lr()[0]
    every = getattr(worker.algo, "period", 0)  # inner steps between exchanges: outer.every / outer.fragments
    boundary = bool(every) and (worker.algo.inner_step + 1) % every == 0
    if boundary:
        synchronize(worker.device)  # outer_ms then times the outer step, not this worker's queued inner steps
    started = time.perf_counter()
    outer_round = worker.algo.step()
    if step == cfg.steps or (stream_end is not None and stream_end.ends_here(step)):  # the last step:
        # an exchange still in flight (outer.overlap) lands before the final evaluation; both rounds are logged
        final = worker.algo.finish()
        if final is not None:
            outer_round = final if outer_round is None else [outer_round, final]
    outer_seconds = None
    if outer_round is not None or boundary:  # an overlapped first round returns nothing yet, and still costs time
        synchronize(worker.device)
        outer_seconds = time.perf_counter() - started
    worker.schedule.step()
    return loss.detach(), lr, outer_round, outer_seconds


def step_record(worker: Worker, step: int, lr: float, outer_round, tokens_per_step: int, wall: float) -> dict:
    """The ``metrics.jsonl`` line of one step (the loss and evaluation are added when it is flushed)."""
    algo = worker.algo
    record = {
        "worker": worker.rank,
        "step": step,
        "loss": None,
        "lr": lr,
        "tokens": step * tokens_per_step,
        "bytes_sent": algo.counter.bytes_sent,
        "bytes_received": algo.counter.bytes_received,
        "wall": round(wall, 4),
    }
    if outer_round is not None:
        record["outer_round"], record["group"] = outer_round.round, outer_round.group
        if outer_round.fragment is not None:  # outer.fragments > 1: which fragment this exchange carried
            record["fragment"] = outer_round.fragment
        if outer_round.skipped:
            record["outer_skipped"] = outer_round.skipped
        if outer_round.exchange_ms is not None:  # outer.overlap: the exchange's own time and the wait where it landed
            record["exchange_ms"] = outer_round.exchange_ms
        if outer_round.wait_ms is not None:
            record["wait_ms"] = outer_round.wait_ms
    if algo.norm_rejections.total:
        record["norm_rejections"] = algo.norm_rejections.total
    return record


def save_checkpoint(ctx: RunContext, backend: Backend, worker: Worker, step: int, wall: float) -> None:
    """Save this worker's state; once every worker has (the backend's barrier), mark the step complete."""
    if backend.marks_complete():
        checkpoint.completes_checkpoints()
    checkpoint.save_worker(ctx.run_dir, step, worker.rank, worker.state(step, wall))
    if not backend.barrier(step):
        checkpoint.saved(ctx.run_dir, step)  # left incomplete (a worker is gone)
    elif backend.marks_complete():
        checkpoint.mark_complete(ctx.run_dir, step, OmegaConf.to_yaml(ctx.cfg), ctx.cfg.checkpoint.keep)
