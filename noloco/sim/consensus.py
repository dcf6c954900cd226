"""Quality at scale: N stacked workers of a small LLaMA, NoLoCo in groups against DiLoCo's global mean.

For each worker count N and method (``noloco-g2``, ``noloco-g4``: NoLoCo, arXiv 2506.10911, in seeded random
groups of 2 or 4; ``diloco``: DiLoCo, arXiv 2311.08105, one group of everyone) N workers train their own
replica of the same model on their own batches of the real corpus for H inner steps, then take the library's
outer step (:class:`noloco.sim.stacked.StackedOuter`). After each round it records the workers' mean held-out
loss and the consensus distance (:func:`noloco.sim.stacked.consensus_distance`) of the fast weights θ (end of
the inner steps) and of the slow weights φ (after the outer step).

Beside it, the pure averaging model: no training, ``x ← x + γ·(mean_G(x) − x)`` in seeded random groups,
which is the NoLoCo rule with β = 0 and μ = 0 (run through that same rule). It gives the rounds needed to
shrink the spread 100× against N; the same count with the rule's momentum μ; and, after training, the
rounds the trained workers need to shrink their spread 100× once training stops (H = 0).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from noloco.data.corpus import prepare_corpus
from noloco.gossip import GroupSchedule, round_seed
from noloco.models.llama import LLaMA, model_config
from noloco.optim import DiLoCoRule, NoLoCoRule, OuterRule
from noloco.sim.stacked import StackedOuter, StackedWorkers, consensus_distance, spread

METHODS = ("noloco-g2", "noloco-g4", "diloco")


@dataclass
class ConsensusConfig:
    """One consensus study. ``workers``: the N values; ``every``: inner steps H per outer round."""

    workers: list[int] = field(default_factory=lambda: [8, 32, 128, 512, 1024])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    rounds: int = 20
    every: int = 10
    batch_size: int = 4
    seq_len: int = 32
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    vocab_size: int = 512
    lr: float = 3e-3
    eval_batches: int = 8
    relax_rounds: int = 60
    pull: float = 0.7
    seed: int = 0
    source: str = "shakespeare"
    device: str = "cpu"
    chunk: int = 256  # workers per forward/backward pass (bounds activation memory at large N)
    averaging_workers: list[int] = field(default_factory=lambda: [8, 16, 64, 256, 1024, 4096])
    averaging_trials: int = 20

    def check(self) -> None:
        """Raise ValueError (one line) on a value the study cannot run with."""
        for name in (
            "rounds",
            "every",
            "batch_size",
            "seq_len",
            "dim",
            "n_layers",
            "eval_batches",
            "averaging_trials",
            "chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.workers or min(self.workers) < 1 or not self.averaging_workers or min(self.averaging_workers) < 1:
            raise ValueError("worker counts must be positive integers")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown method {unknown[0] if unknown else '(none)'}; known: {', '.join(METHODS)}")
        for n in self.workers:
            for method in self.methods:
                size = group_size(method, n)
                if size and n % size:
                    raise ValueError(f"{method}: groups of {size} do not divide {n} workers")
        if not 256 < self.vocab_size <= 1 << 20:
            raise ValueError(f"vocab-size must be in (256, {1 << 20}], got {self.vocab_size}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 < self.pull <= 1:
            raise ValueError(f"pull must be in (0, 1], got {self.pull}")
        if self.relax_rounds < 0:
            raise ValueError(f"relax-rounds must be >= 0, got {self.relax_rounds}")


def group_size(method: str, workers: int) -> int | None:
    """The method's group size at ``workers`` (None: everyone)."""
    return int(method.rsplit("-g", 1)[1]) if method.startswith("noloco-g") else None


def make_rule(method: str, pull: float = 0.7) -> OuterRule:
    """The library's rule of ``method`` with its defaults (NoLoCo β = 0.7, μ = 0.5; DiLoCo lr 0.7, μ 0.9)."""
    return NoLoCoRule(pull=pull) if method.startswith("noloco") else DiLoCoRule()


# --- the pure averaging model ------------------------------------------------------------------------


def averaging_rounds(workers: int, group: int, pull: float, momentum: float = 0.0, seed: int = 0,
                     dim: int = 16, shrink: float = 100.0, max_rounds: int = 500) -> int | None:  # fmt: skip
    """Rounds of pure group averaging until the spread of ``workers`` random points is ``shrink``× smaller.

    ``x ← x + m``, ``m ← μ·m + γ·(mean_G(x) − x)``: the library's :class:`NoLoCoRule` with β = 0 (no
    training), groups of ``group`` from the seeded schedule. Points: ``(workers, dim)`` standard normal from
    ``seed``. None if ``max_rounds`` do not reach it.
    """
    generator = torch.Generator().manual_seed(round_seed(seed, workers, "sim/averaging"))
    points = torch.randn(workers, dim, generator=generator)
    outer = StackedOuter(NoLoCoRule(lr=0.0, pull=pull, momentum=momentum), GroupSchedule(workers, group, seed), points)
    start = spread(outer.slow)
    for r in range(max_rounds):
        slow = outer.step(outer.slow, r)
        if spread(slow) <= start / shrink:
            return r + 1
    return None


def averaging_study(cfg: ConsensusConfig, momentum: float = 0.0) -> list[dict]:
    """Per N of ``cfg.averaging_workers`` and group size 2 and 4: rounds to shrink the spread 100× (mean and
    range over ``cfg.averaging_trials`` seeds), for the pull ``cfg.pull`` and outer momentum ``momentum``."""
    rows = []
    for n in cfg.averaging_workers:
        for group in (2, 4):
            if n % group or n < group:
                continue
            seeds = range(cfg.seed, cfg.seed + cfg.averaging_trials)
            counts = [averaging_rounds(n, group, cfg.pull, momentum, seed=s) for s in seeds]
            reached = [c for c in counts if c is not None]
            rows.append({"workers": n, "group_size": group, "pull": cfg.pull, "momentum": momentum,
                         "rounds_mean": float(np.mean(reached)) if reached else None,
                         "rounds_min": min(reached, default=None), "rounds_max": max(reached, default=None),
                         "trials": len(counts), "reached": len(reached)})  # fmt: skip
    return rows


# --- training ----------------------------------------------------------------------------------------


def _batch(tokens: np.ndarray, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = starts.numpy()[..., None] + np.arange(seq_len + 1)
    windows = torch.from_numpy(tokens[index].astype(np.int64))
    return windows[..., :-1], windows[..., 1:]


def train_run(cfg: ConsensusConfig, method: str, workers: int, corpus, log=print) -> dict:
    """Train ``workers`` stacked workers with ``method`` for ``cfg.rounds`` rounds; the per-round history.

    Each worker's batch at step s: ``cfg.batch_size`` windows of the training split drawn from a generator
    seeded with (seed, s), one row per worker. Held-out loss: the mean over workers of each worker's loss on
    the same ``cfg.eval_batches × batch_size`` evenly spaced held-out windows.
    """
    device = torch.device(cfg.device)
    mcfg = model_config("tiny", dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                        vocab_size=corpus.vocab_size, max_seq_len=cfg.seq_len)  # fmt: skip
    stack = StackedWorkers(LLaMA(mcfg, seed=cfg.seed), workers, lr=cfg.lr, device=device, chunk=cfg.chunk)
    outer = StackedOuter(make_rule(method, cfg.pull), GroupSchedule(workers, group_size(method, workers), cfg.seed),
                         stack.flat())  # fmt: skip
    train = np.asarray(corpus.train)
    val = np.asarray(corpus.val)
    last = val.size - cfg.seq_len - 1
    val_x, val_y = _batch(val, torch.linspace(0, last, cfg.eval_batches * cfg.batch_size).long(), cfg.seq_len)
    val_x, val_y = val_x.to(device), val_y.to(device)
    history = [{"round": 0, "eval_loss": float(stack.eval_loss(val_x, val_y).mean()), "spread_fast": 0.0,
                "spread_slow": 0.0}]  # fmt: skip
    started = time.perf_counter()
    for r in range(cfg.rounds):
        for h in range(cfg.every):
            generator = torch.Generator().manual_seed(round_seed(cfg.seed, r * cfg.every + h, "sim/data"))
            starts = torch.randint(0, train.size - cfg.seq_len - 1, (workers, cfg.batch_size), generator=generator)
            x, y = _batch(train, starts, cfg.seq_len)
            losses = stack.inner_step(x.to(device), y.to(device))
        fast = stack.flat()
        slow = outer.step(fast, r)
        stack.load_flat(slow)
        history.append({"round": r + 1, "train_loss": float(losses.mean()),
                        "eval_loss": float(stack.eval_loss(val_x, val_y).mean()),
                        "spread_fast": consensus_distance(fast), "spread_slow": consensus_distance(slow)})  # fmt: skip
    seconds = time.perf_counter() - started
    relax = _relax(outer, cfg.relax_rounds) if method.startswith("noloco") else None
    log(
        f"  {method} N={workers}: eval {history[-1]['eval_loss']:.4f}, consensus θ {history[-1]['spread_fast']:.2e} "
        f"φ {history[-1]['spread_slow']:.2e}, relax 100x in {relax} rounds ({seconds:.1f} s)"
    )
    return {"method": method, "workers": workers, "group_size": group_size(method, workers),
            "parameters": stack.num_parameters(), "seconds": seconds, "history": history,
            "relax_rounds_100x": relax}  # fmt: skip


def _relax(outer: StackedOuter, rounds: int) -> int | None:
    """Rounds of outer steps with no training (θ = φ) until the slow weights' spread is 100× smaller (None: not
    within ``rounds``). Mutates ``outer`` (call after the run)."""
    start = spread(outer.slow)
    first = 10**6  # rounds after training draw groups of their own
    for k in range(rounds):
        outer.step(outer.slow.clone(), first + k)
        if spread(outer.slow) <= start / 100:
            return k + 1
    return None


def run_study(cfg: ConsensusConfig, log=print) -> dict:
    """The whole study: the averaging model (μ = 0 and the rule's μ = 0.5) and every (N, method) training run."""
    cfg.check()
    corpus = prepare_corpus(cfg.source, vocab_size=cfg.vocab_size)  # first: a data error ends the study at once
    log(f"averaging model: N in {cfg.averaging_workers}, γ = {cfg.pull}, {cfg.averaging_trials} seeds")
    averaging = averaging_study(cfg, 0.0) + averaging_study(cfg, NoLoCoRule().momentum)
    log(
        f"training: {cfg.source} (vocab {corpus.vocab_size}), N in {cfg.workers}, {cfg.rounds} rounds of "
        f"H = {cfg.every}"
    )
    runs = [train_run(cfg, method, n, corpus, log) for n in cfg.workers for method in cfg.methods]
    return {"config": asdict(cfg), "averaging": averaging, "runs": runs, "vocab_size": corpus.vocab_size,
            "predicted_rounds_large_n": large_n_rounds(cfg.pull)}  # fmt: skip


def large_n_rounds(pull: float, shrink: float = 100.0) -> float:
    """Rounds to shrink the spread ``shrink``× for pairs as N → ∞ (μ = 0): each round multiplies the expected
    squared spread by ``(1 − γ/2)² + (γ/2)² = 1 − γ + γ²/2``."""
    return math.log(shrink) / (-0.5 * math.log(1 - pull + pull * pull / 2))
