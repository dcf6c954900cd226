"""The local backend: N simulated workers as threads of one process over the in-process fabric.

:func:`run` prepares the data once, starts one :func:`~noloco.train.loop.train_worker` per rank,
shows progress, and finishes the run folder: ``summary.json``, ``curves.png`` and a printed table.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from noloco.comm import LocalFabric
from noloco.train.data import eval_batches, prepare_corpus
from noloco.train.loop import RunContext, WorkerResult, build_model, train_worker
from noloco.train.metrics import MetricsLogger
from noloco.train.plots import plot_runs


class Progress:
    """One tqdm bar over all workers' steps, showing the mean of the workers' latest losses."""

    def __init__(self, total: int, initial: int, workers: int, enabled: bool):
        from tqdm import tqdm

        self._lock = threading.Lock()
        self._losses = [float("nan")] * workers
        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            desc="training",
            mininterval=0.2 if sys.stderr.isatty() else 15.0,
        )

    def advance(self, rank: int, loss: float) -> None:
        with self._lock:
            self._losses[rank] = loss
            self._bar.update(1)
            finite = [x for x in self._losses if x == x]
            if finite:
                self._bar.set_postfix(loss=f"{sum(finite) / len(finite):.3f}", refresh=False)

    def close(self) -> None:
        self._bar.close()


def consensus_distance(slow: list[torch.Tensor]) -> float:
    """Relative spread of the workers' slow weights: sqrt(mean_i ||φ_i − φ̄||²) / ||φ̄||."""
    stacked = torch.stack([s.double() for s in slow])
    mean = stacked.mean(0)
    spread = (stacked - mean).pow(2).sum(1).mean().sqrt()
    return float(spread / mean.norm().clamp_min(1e-30))


def default_run_name(cfg: DictConfig) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{cfg.outer.algo}-{cfg.comm.codec}-w{cfg.workers}-{stamp}"


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, cgroups' cpusets, ``noloco-fleet
    --cpus-per-host``) where the OS reports one, else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS and Windows have no affinity call
        return os.cpu_count() or 1


def prepare(cfg: DictConfig, run_dir: Path, quiet: bool = False):
    """Create the run folder, load or build the tokenized corpus, set torch threads, announce the run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    corpus = prepare_corpus(
        cfg.data.source, cfg.data.path, cfg.data.vocab_size, cfg.data.eval_fraction, cfg.data.cache_dir
    )
    # threads share the cores: local workers are threads of this process; torch workers are processes,
    # LOCAL_WORLD_SIZE of them on this host (set by torchrun and by the local launcher)
    per_process = cfg.workers if cfg.backend == "local" else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.threads or max(1, usable_cores() // per_process))
    params = build_model(cfg, corpus.vocab_size).num_parameters()
    if not quiet:
        print(
            f"noloco: {cfg.outer.algo} ({cfg.comm.codec}) · {cfg.workers} workers ({cfg.backend}) · "
            f"{params / 1e6:.2f}M params · {cfg.steps} steps · data {cfg.data.source}: {corpus.train.size:,} train / "
            f"{corpus.val.size:,} held-out tokens · {run_dir}",
            flush=True,
        )
    return corpus, params


def finish(
    cfg: DictConfig,
    run_dir: Path,
    corpus,
    params: int,
    final_losses: list[float],
    consensus: float,
    bytes_sent: list[int],
    bytes_received: list[int],
    seconds: float,
    resume_step: int = 0,
    stop_after: int | None = None,
    quiet: bool = False,
    extra: dict | None = None,
) -> dict:
    """Write ``summary.json`` and ``curves.png``, print the table; returns the summary."""
    targets = torch.cat(
        [y for _, y in eval_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.eval.batches)]
    )
    steps_done = stop_after if stop_after is not None else cfg.steps
    tokens = cfg.workers * (steps_done - resume_step) * cfg.data.batch_size * cfg.data.seq_len
    summary = {
        "algo": cfg.outer.algo,
        "codec": cfg.comm.codec,
        "slow_codec": cfg.comm.slow_codec or cfg.comm.codec,
        "backend": cfg.backend,
        "workers": cfg.workers,
        "steps": steps_done,
        "outer_every": cfg.outer.every,
        "group_size": cfg.outer.group_size if cfg.outer.algo == "noloco" else cfg.workers,
        "params": params,
        "final_eval_loss": sum(final_losses) / len(final_losses),
        "final_eval_loss_per_worker": list(final_losses),
        "unigram_eval_loss": corpus.unigram_loss(targets),
        "consensus_distance": consensus,
        "bytes_sent_per_worker": sum(bytes_sent) / len(bytes_sent),
        "bytes_sent_by_worker": list(bytes_sent),
        "bytes_received_by_worker": list(bytes_received),
        "wall_seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "run_dir": str(run_dir),
        **(extra or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if cfg.log.plot:
        plot_runs([run_dir], run_dir / "curves.png", title=run_dir.name)
    if not quiet:
        print(format_summary(summary), flush=True)
    return summary


def run(
    cfg: DictConfig,
    run_dir: Path | None = None,
    resume_from: Path | None = None,
    resume_step: int = 0,
    stop_after: int | None = None,
    quiet: bool = False,
) -> dict:
    """Run (or resume) the job described by ``cfg`` on the local backend; returns the summary dict."""
    started = time.perf_counter()
    run_dir = Path(run_dir or Path(cfg.run.dir) / (cfg.run.name or default_run_name(cfg)))
    corpus, params = prepare(cfg, run_dir, quiet)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))

    metrics = MetricsLogger(run_dir, tensorboard=cfg.log.tensorboard, resume_step=resume_step if resume_from else None)
    progress = Progress(cfg.steps * cfg.workers, resume_step * cfg.workers, cfg.workers, cfg.log.progress and not quiet)
    ctx = RunContext(cfg, corpus, run_dir, metrics, resume_from, resume_step, progress, stop_after)
    fabric = LocalFabric(cfg.workers)
    try:
        results: list[WorkerResult] = fabric.run(lambda transport: train_worker(ctx, transport))
    finally:
        progress.close()
        metrics.close()
    return finish(
        cfg,
        run_dir,
        corpus,
        params,
        final_losses=[r.final_eval_loss for r in results],
        consensus=consensus_distance([r.slow_weights for r in results]),
        bytes_sent=[r.bytes_sent for r in results],
        bytes_received=[r.bytes_received for r in results],
        seconds=time.perf_counter() - started,
        resume_step=resume_step,
        stop_after=stop_after,
        quiet=quiet,
        extra={
            "nonfinite_events_by_worker": [r.nonfinite_events for r in results],
            "norm_rejections_by_worker": [r.norm_rejections for r in results],
        },
    )


def format_summary(s: dict) -> str:
    lines = [
        "",
        f"{'worker':>8} {'held-out loss':>14} {'MB sent':>10} {'MB received':>12}",
    ]
    for rank, loss in enumerate(s["final_eval_loss_per_worker"]):
        lines.append(
            f"{rank:>8} {loss:>14.4f} {s['bytes_sent_by_worker'][rank] / 1e6:>10.2f} "
            f"{s['bytes_received_by_worker'][rank] / 1e6:>12.2f}"
        )
    lines += [
        f"{'mean':>8} {s['final_eval_loss']:>14.4f} {s['bytes_sent_per_worker'] / 1e6:>10.2f}",
        "",
        f"algo {s['algo']} · codec {s['codec']} · {s['steps']} steps · unigram baseline loss "
        f"{s['unigram_eval_loss']:.4f} · consensus distance {s['consensus_distance']:.2e}",
        f"wall {s['wall_seconds']:.1f} s · {s['tokens_per_second']:,.0f} tokens/s · results in {s['run_dir']}",
    ]
    return "\n".join(lines)
