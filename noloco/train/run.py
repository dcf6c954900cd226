"""One run's lifecycle, the same on every backend: :class:`Run`.

A backend's ``launch`` makes a :class:`Run` and supplies only where the workers run (threads, processes,
swarm peers) and what they exchange over. The run does the rest, once for every backend: the tokenized corpus
(:meth:`Run.load_corpus`), a resumed run's one check (:meth:`Run.check_resume`: every worker's state against
what this config builds, the corpus's vocabulary, φ₀'s seed, a stopped stream), the run folder with
``tokenizer.json``, ``config.yaml`` and ``metrics.jsonl`` cut back to the checkpoint step (:meth:`Run.create`),
the metrics, the :class:`Progress` bar, Ctrl-C armed around the workers (:meth:`Run.train`, then
:meth:`Run.raise_if_stopped`) and the end: :func:`finish` writes one :class:`RunSummary`-shaped
``summary.json`` (the same keys on every backend; the README lists them), ``curves.png`` and the printed table.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn.utils import parameters_to_vector

from noloco.data import stream_end
from noloco.data.corpus import prepare_corpus
from noloco.data.sampler import eval_batches
from noloco.data.stream import stream_summary
from noloco.data.stream_end import describe
from noloco.optim import slow_term_settings
from noloco.train import checkpoint
from noloco.train.device import usable_cores
from noloco.train.interrupt import INTERRUPT, Interrupted
from noloco.train.loop import RunContext, WorkerResult, build_inner_optimizer, build_model, model_parameters
from noloco.train.metrics import MetricsLogger, wandb_options
from noloco.train.plots import plot_runs
from noloco.train.state import WorkerState
from noloco.train.supervise import report_folder


class Progress:
    """One tqdm bar of a run's inner steps per worker (the slowest worker's), showing the mean latest loss.

    ``workers``: how many workers of this process report through :meth:`advance` (all of them on the
    local backend, this process's own on the others). A 200-step run of 4 workers shows 200 steps.
    A swarm peer also shows its last round (:meth:`note`), what it waits for (:meth:`status`: joining,
    finding partners) and its own lines above the bar (:meth:`write`).
    """

    def __init__(self, total: int, initial: int, workers: int, enabled: bool, desc: str = "training",
                 quiet_start: bool = False):  # fmt: skip
        from tqdm import tqdm

        if "_lock" not in vars(tqdm):  # tqdm's default lock is a process-shared semaphore: a rank killed on a second
            tqdm.set_lock(threading.RLock())  # Ctrl-C would leak it (resource_tracker's warning); one bar per process
        self._lock = threading.Lock()
        self._workers, self._initial, self._desc = workers, initial, desc
        self._steps: dict[int, int] = {}
        self._losses: dict[int, float] = {}
        self._notes: dict[str, str] = {}
        self._tty = enabled and sys.stderr.isatty()
        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
            desc=desc,
            mininterval=0.2 if sys.stderr.isatty() else 15.0,
            delay=1e-6 if quiet_start else 0.0,  # no line at 0 steps (a peer prints its joining lines first)
        )

    def advance(self, rank: int, loss: float) -> None:
        with self._lock:
            self._losses[rank] = loss
            self._show(refresh=False)
            self._add(rank, 1)

    def skip(self, rank: int, steps: int) -> None:
        """Worker ``rank`` skipped ``steps`` steps (a swarm peer catching up with its swarm): counted as done."""
        with self._lock:
            self._add(rank, steps)

    def _add(self, rank: int, steps: int) -> None:  # holds self._lock
        self._steps[rank] = self._steps.get(rank, self._initial) + steps
        done = min(self._steps.values()) if len(self._steps) >= self._workers else self._initial
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)

    def _show(self, refresh: bool) -> None:
        finite = [x for x in self._losses.values() if x == x]
        loss = {"loss": f"{sum(finite) / len(finite):.3f}"} if finite else {}
        self._bar.set_postfix({**loss, **self._notes}, refresh=refresh)

    def note(self, **fields: str) -> None:
        """Show ``fields`` beside the loss (a swarm peer's last round: ``round="3 with peer-1"``)."""
        with self._lock:
            self._notes.update(fields)
            self._show(refresh=self._tty)

    def status(self, text: str | None) -> None:
        """What the worker waits for now, shown in place of the bar's description (None: back to it).

        On a terminal the bar is redrawn at once; in a log (not a TTY) the next periodic line shows it.
        """
        with self._lock:
            self._bar.set_description_str(text or self._desc, refresh=self._tty)

    def write(self, line: str) -> None:
        """Print ``line`` on stdout above the bar (redrawn below it on a terminal)."""
        if self._tty:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line)
        sys.stdout.flush()

    def start_at(self, step: int) -> None:
        """The worker starts at ``step`` (a swarm peer that joined from a live peer's state)."""
        with self._lock:
            self._initial = step
            self._steps.clear()
            bar = self._bar
            bar.initial = bar.n = bar.last_print_n = step
            if not bar.disable:  # the rate counts from here
                bar.start_t = bar.last_print_t = bar._time()
            if self._tty:
                bar.refresh()

    def end_at(self, step: int, line: str | None = None) -> None:
        """The run ends at ``step``, before its last step (a data stream ran out): the bar's total becomes
        ``step``, so it ends full; ``line`` is printed above it (unless the bar is off)."""
        with self._lock:
            self._bar.total = step
            if self._tty:
                self._bar.refresh()
        if line and not self._bar.disable:
            self.write(line)

    def close(self) -> None:
        self._bar.delay = 0.0  # the last state is shown even if a quiet start never showed the bar
        self._bar.close()


#: buckets of the weight sketch the consensus distance is computed from (2^16 float64: 512 KiB per worker)
SKETCH_BUCKETS = 1 << 16
_SKETCH_CHUNK = 1 << 22


@torch.no_grad()
def weight_sketch(slow: torch.Tensor, buckets: int = SKETCH_BUCKETS, seed: int = 0) -> torch.Tensor:
    """A CountSketch of the flat weights: ``buckets`` float64 values, the same linear map on every worker.

    Element j goes to bucket h(j) with sign σ(j), both drawn from a generator seeded with ``seed``, so
    ``sketch(φ_i) − sketch(φ_k) = sketch(φ_i − φ_k)`` and E‖sketch(x)‖² = ‖x‖²: distances between workers
    survive with a relative error of about √(2 / buckets) (0.6% at 2^16), and a worker ships
    ``buckets`` numbers instead of its weights. Vectors no longer than ``buckets`` are returned as they
    are (exact).
    """
    flat = slow.detach().reshape(-1)
    if flat.numel() <= buckets:
        return flat.double().cpu()
    generator = torch.Generator().manual_seed(seed)
    out = torch.zeros(buckets, dtype=torch.float64)
    for start in range(0, flat.numel(), _SKETCH_CHUNK):
        chunk = flat[start : start + _SKETCH_CHUNK].double().cpu()
        index = torch.randint(0, buckets, (chunk.numel(),), generator=generator)
        sign = torch.randint(0, 2, (chunk.numel(),), generator=generator, dtype=torch.float64).mul_(2).sub_(1)
        out.index_add_(0, index, chunk * sign)
    return out


def relative_spread(mean: torch.Tensor, mean_squared_distance: torch.Tensor | float) -> float:
    """Consensus distance sqrt(mean_i ||φ_i − φ̄||²) / ||φ̄|| from φ̄ and mean_i ||φ_i − φ̄||² (float64)."""
    return float(torch.as_tensor(mean_squared_distance, dtype=torch.float64).sqrt() / mean.norm().clamp_min(1e-30))


def consensus_distance(slow: list[torch.Tensor]) -> float:
    """Relative spread of the workers' slow weights held by this process, from their :func:`weight_sketch`es
    (the torch backend computes the same from all-reduced sketches, so no worker ships its weights)."""
    stacked = torch.stack([weight_sketch(s) for s in slow])
    mean = stacked.mean(0)
    return relative_spread(mean, (stacked - mean).pow(2).sum(1).mean())


def default_run_name(cfg: DictConfig) -> str:
    """``<algo>-<codec>-w<workers>-<time>``, one folder name: a codec's ``/`` (``topk:64/4096+int2``) becomes ``-``."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    codec = str(cfg.comm.codec).replace("/", "-")
    return f"{cfg.outer.algo}-{codec}-w{cfg.workers}-{stamp}"


#: what a run writes into its folder (``noloco-fleet``'s ``fleet.h<i>.log`` of the launch under way are not in it)
RUN_ENTRIES = ("config.yaml", "summary.json", "summary.rank*.json", "metrics*.jsonl", "rounds.jsonl", "checkpoints",
               "tensorboard", "curves.png", "tokenizer.json", "maddrs.json", "wandb", "peer-*",
               "fleet.json")  # fmt: skip


def run_entries(folder: Path) -> list[Path]:
    """The entries of ``folder`` that belong to a run (:data:`RUN_ENTRIES`), sorted; [] for a new folder."""
    if not folder.is_dir():
        return []
    return sorted({path for pattern in RUN_ENTRIES for path in folder.glob(pattern)})


def new_run_folder(cfg: DictConfig, folder: Path | None = None) -> Path:
    """The folder of a new (not resumed) run: ``folder``, else ``run.dir/run.name`` (default: a timestamped name,
    numbered ``-2``, ``-3``, ... when a run of the same second has it).

    A folder that already holds a run is refused with a ConfigError naming the choices (resume it, another
    ``run.name``, ``run.overwrite=true``), so that two runs never share a folder; with ``run.overwrite`` the
    old run's entries (:data:`RUN_ENTRIES`) are deleted first. Nothing is created here.
    """
    from noloco.train.config import ConfigError

    if folder is None and not cfg.run.name:  # a default name is never taken: -2, -3, ... within one second
        base = Path(cfg.run.dir) / default_run_name(cfg)
        folder = next(path for path in (base.with_name(f"{base.name}-{n}") if n > 1 else base for n in range(1, 10**6))
                      if not path.exists())  # fmt: skip
    folder = Path(folder or Path(cfg.run.dir) / cfg.run.name)
    old = run_entries(folder)
    if old and not cfg.run.get("overwrite", False):
        names = ", ".join(p.name for p in old[:3]) + (", ..." if len(old) > 3 else "")
        resume = (f"resume it with resume={folder}, " if (folder / "checkpoints" / "latest").exists()
                  else "")  # fmt: skip
        raise ConfigError(f"run folder {folder} already holds a run ({names}): {resume}pick another run.name=, "
                          f"or replace it with run.overwrite=true")  # fmt: skip
    for path in old:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return folder


def load_corpus(cfg: DictConfig):
    """The run's tokenized corpus from ``cfg.data`` (bundled, files, or a ``datasets`` source; cached)."""
    from noloco.data.corpus import corpus_options

    data = cfg.data
    return prepare_corpus(data.source, data.path, data.vocab_size, data.eval_fraction, data.cache_dir,
                          **corpus_options(data))  # fmt: skip


class Run:
    """One run (or, on a swarm, one peer's run of one worker) from its corpus to its summary.

    ``run_dir``: the folder (a resumed run's, or one a launcher chose); None: :meth:`create` picks a new one.
    ``resume_from``/``resume_step``: the checkpoint a resumed run continues from. ``stop_after``: a testing
    hook (return after that step, as if killed). ``quiet``: no announcement, table or bar.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path | None = None, resume_from: Path | None = None,
                 resume_step: int = 0, stop_after: int | None = None, quiet: bool = False):  # fmt: skip
        self.cfg, self.quiet, self.stop_after = cfg, quiet, stop_after
        self.folder = Path(run_dir) if run_dir else None
        self.resume_from = Path(resume_from) if resume_from else None
        self.resume_step = int(resume_step) if resume_from else 0
        self.started = time.perf_counter()
        self.corpus, self.params = None, 0
        # a one-worker process's resume (a swarm peer): the state and the seed's model check_resume read and built,
        # handed to the worker (RunContext) instead of being read and built a second time
        self.resumed_states: dict[int, dict] = {}
        self.seed_models: list[torch.nn.Module] = []

    def load_corpus(self, shards: tuple[Iterable[int], int] | None = None):
        """The run's tokenized corpus (bundled, files, or a ``datasets`` source; cached) and the model's size.

        ``shards``: ``(ranks, world)`` of a streamed corpus (``data.streaming``) whose shards must each hold a
        training document; checked here, before the run folder exists (None: not checked by this process)."""
        cfg = self.cfg
        self.corpus = load_corpus(cfg)
        if shards is not None and hasattr(self.corpus, "check_shards"):
            self.corpus.check_shards(*shards)
        self.params = model_parameters(cfg, self.corpus.vocab_size)  # checked before the run folder exists
        return self.corpus

    def check_resume(self, ranks: Iterable[int]) -> None:
        """The one check of a resumed run, all or nothing, before anything of the run is written: every one of
        ``ranks`` (the workers the backend places) has its state in the checkpoint, loaded one at a time and
        checked against the model, AdamW and algorithm this config builds (their state owners,
        :class:`~noloco.train.state.WorkerState`, on the meta device or, where it is kept, the seed's own model),
        the corpus's vocabulary and ``run.seed``'s initial weights; a run that stopped as its stream ran out stays
        stopped. CheckpointError if any fails.
        Nothing happens for a fresh run. Where ``ranks`` is one worker, its checked state and the model built from
        ``run.seed`` for the check are kept for the worker (:meth:`context`), which then reads and builds neither."""
        if self.resume_from is None:
            return
        ranks = list(ranks)
        stream_ends: dict[int, list[int]] = {}  # data.streaming: the steps each worker's shard ended at
        check = _StateCheck(self, stream_ends, keep=len(ranks) == 1)
        checkpoint.load_run(self.resume_from, self.resume_step, ranks, check)
        stream_end.check_resume(self.cfg, self.resume_from, self.resume_step, stream_ends)

    def create(self, folder: Path | None = None, writes: bool = True, announce: bool = True,
               workers_here: int = 1, threads: int | None = None) -> Path:  # fmt: skip
        """The run folder: ``folder``, else the one given, else a new one (:func:`new_run_folder`); made, with
        ``tokenizer.json``; torch threads (``threads``, else ``cfg.threads``, else the cores split between the
        ``workers_here`` workers of this process's host); the
        announcement line (``announce``). ``writes``: this process writes ``config.yaml`` (one process per folder).
        A resumed run's ``metrics.jsonl`` is cut back to the checkpoint step by :meth:`metrics` (the parts of a
        run of several processes are merged first, by :func:`~noloco.train.metrics.merge_parts`)."""
        cfg, corpus = self.cfg, self.corpus
        self.folder = Path(folder or self.folder or new_run_folder(cfg))
        self.folder.mkdir(parents=True, exist_ok=True)
        report_folder(self.folder)  # a supervisor (run.restarts) resumes a dead run from this folder's checkpoints
        if getattr(corpus, "tokenizer_path", None) and Path(corpus.tokenizer_path).is_file():
            shutil.copyfile(corpus.tokenizer_path, self.folder / "tokenizer.json")  # export and sample read it here
        torch.set_num_threads(threads or cfg.threads or max(1, usable_cores() // workers_here))
        if announce and not self.quiet:
            print(f"noloco: {cfg.outer.algo} ({cfg.comm.codec}) · {cfg.workers} workers ({cfg.backend}) · "
                  f"{self.params / 1e6:.2f}M params · {cfg.steps} steps · data {cfg.data.source}: "
                  f"{corpus.train.size:,} train / {corpus.val.size:,} held-out tokens · {self.folder}",
                  flush=True)  # fmt: skip
        if writes:
            (self.folder / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        return self.folder

    def metrics(self, filename: str = "metrics.jsonl", wandb_name: str | None = None,
                wandb_group: str | None = None) -> MetricsLogger:  # fmt: skip
        """The run's metrics logger (``filename``: a part, for one process of several); a resumed run's file is
        cut back to the checkpoint step and TensorBoard purges what followed it."""
        cfg, folder = self.cfg, self.folder
        return MetricsLogger(folder, tensorboard=cfg.log.tensorboard, filename=filename,
                             resume_step=self.resume_step if self.resume_from else None,
                             wandb=wandb_options(cfg, wandb_group or folder.name, wandb_name))  # fmt: skip

    def context(self, metrics: MetricsLogger, workers: int, show: bool = True, stop=None,
                **progress) -> RunContext:  # fmt: skip
        """What this process's ``workers`` workers share (:class:`RunContext`), with a step bar (``show``: this
        process shows one) and ``stop``, the Ctrl-C agreement of the run's workers (None: one worker alone)."""
        cfg = self.cfg
        bar = Progress(cfg.steps, self.resume_step, workers, cfg.log.progress and show and not self.quiet,
                       **progress)  # fmt: skip
        ctx = RunContext(cfg, self.corpus, self.folder, metrics, self.resume_from, self.resume_step, bar,
                         self.stop_after)  # fmt: skip
        ctx.stop = stop
        ctx.resumed_states, ctx.seed_models = self.resumed_states, self.seed_models
        return ctx

    def train(self, ctx: RunContext, workers: Callable[[], object], arm: bool = True):
        """Run ``workers`` (the backend's placement: it starts :func:`~noloco.train.loop.train_worker` for each
        worker of this process and returns their results) with Ctrl-C armed (``arm``; else Ctrl-C is armed at the
        first step boundary, and before it stays a KeyboardInterrupt: a swarm peer joining); the bar, the Ctrl-C
        agreement and the metrics are closed whatever happens."""
        interrupt = INTERRUPT
        if arm:
            interrupt.run_dir, interrupt.armed = ctx.run_dir, True
        try:
            return workers()
        finally:
            if arm:
                interrupt.armed = False
            if hasattr(ctx.stop, "close"):
                ctx.stop.close()
            ctx.progress.close()
            ctx.metrics.close()

    def raise_if_stopped(self, ctx: RunContext, quiet: bool = False, kind: type = Interrupted) -> None:
        """A Ctrl-C stop before the last step: the run is not finished, so no summary (``kind`` raised, with the
        stop step and whether its checkpoint is complete). At the last step the run is complete."""
        target = ctx.stop.target if ctx.stop is not None else INTERRUPT.solo.target
        if target is not None and target < self.cfg.steps:
            complete = (checkpoint.step_dir(ctx.run_dir, target) / checkpoint.COMPLETE).exists()
            raise kind(target, ctx.run_dir, complete, quiet=quiet)

    def summary(self, results: list[WorkerResult], consensus: float | None, folder: Path | None = None,
                start: int | None = None, extra: dict | None = None) -> RunSummary:  # fmt: skip
        """The :class:`RunSummary` of ``results`` (one per worker, in worker order) in ``folder`` (the run's);
        ``start``: the step this process's workers started at (a resumed run's checkpoint step by default)."""
        return summarize(self.cfg, folder or self.folder, self.corpus, self.params, results, consensus,
                         time.perf_counter() - self.started, self.stop_after or self.cfg.steps,
                         self.resume_step if start is None else start, extra)  # fmt: skip


class _StateCheck:
    """:meth:`Run.check_resume`'s check of one worker's state (called by :func:`checkpoint.load_run`)."""

    def __init__(self, run: Run, stream_ends: dict[int, list[int]], keep: bool = False):
        self.run, self.stream_ends, self.keep = run, stream_ends, keep
        self.layouts: dict[int | None, WorkerState] = {}
        self.seed_digests: dict[int | None, str] = {}
        self.seed = None  # keep: the worker's own model, built by a thread beside the checkpoint's read and checksum
        if keep:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="noloco-seed")
            self.seed = pool.submit(self._build_seed, run.corpus.vocab_size)
            pool.shutdown(wait=False)

    def _build_seed(self, vocab: int) -> tuple[torch.nn.Module, WorkerState, str]:
        """The model ``run.seed`` gives (the corpus's vocabulary), the state layout it checks, and φ₀'s digest."""
        cfg = self.run.cfg
        model = build_model(cfg, vocab)
        opt, schedule = build_inner_optimizer(cfg, model)
        layout = WorkerState.for_check(model, opt, schedule, outer=cfg.outer.algo != "ddp")
        return model, layout, checkpoint.digest(parameters_to_vector(model.parameters()))

    def __call__(self, state: dict, rank: int) -> None:
        cfg, folder = self.run.cfg, self.run.resume_from
        where = f"{folder}/worker_{rank}"
        vocab = checkpoint.state_vocab_size(state)
        if vocab is not None and not 2 <= vocab <= cfg.data.max_vocab_size:  # before a model is built from it
            raise checkpoint.CheckpointError(f"{where}: a vocabulary of {vocab}, not in [2, data.max_vocab_size="
                                             f"{cfg.data.max_vocab_size}] (raise it if this is right)")  # fmt: skip
        corpus_vocab = self.run.corpus.vocab_size
        if vocab is not None and vocab != corpus_vocab:
            raise checkpoint.CheckpointError(f"resume={folder}: its models have a vocabulary of {vocab}, this run's "
                                             f"data {corpus_vocab} (were data.* overrides given?)")  # fmt: skip
        seed_model = None
        if self.seed is not None and vocab == corpus_vocab:
            seed_model, self.layouts[vocab], self.seed_digests[vocab] = self.seed.result()
        if vocab not in self.layouts:
            with torch.device("meta"):  # shapes only: nothing allocated
                model = build_model(cfg, vocab or cfg.data.vocab_size)
                opt, schedule = build_inner_optimizer(cfg, model)
            self.layouts[vocab] = WorkerState.for_check(model, opt, schedule, outer=cfg.outer.algo != "ddp")
        self.layouts[vocab].check(state, self.run.resume_step, where)
        if isinstance(state.get("sampler"), dict):
            self.stream_ends[rank] = [int(s) for s in state["sampler"].get("ends", [])]
        reference = state["algorithm"].get("reference")
        if isinstance(reference, dict):  # φ₀ is rebuilt from run.seed: the seed's initial weights must match
            if vocab not in self.seed_digests:
                model = build_model(cfg, vocab or cfg.data.vocab_size)
                self.seed_digests[vocab] = checkpoint.digest(parameters_to_vector(model.parameters()))
                del model
            if self.seed_digests[vocab] != reference["sha256"]:
                raise checkpoint.CheckpointError(f"{where}: its initial weights are not those of run.seed="
                                                 f"{cfg.run.seed} (was run.seed or the model changed?)")  # fmt: skip
        if self.keep:  # checked: the worker loads this state (and trains this model, where it was built: RunContext)
            self.run.resumed_states[rank], self.run.seed_models[:] = state, [] if seed_model is None else [seed_model]


@dataclass
class RunSummary:
    """The numbers of a finished run, the same keys on every backend (``summary.json``; README lists them).

    Per-worker lists are ordered by worker; a swarm peer's run folder is a run of one worker.
    ``extra`` holds what only one backend knows (processes per worker, swarm rounds, ...), written
    beside the common keys.
    """

    algo: str
    codec: str
    slow_codec: str
    backend: str
    workers: int
    steps: int
    outer_every: int
    group_size: int
    params: int
    final_eval_loss: float
    final_eval_loss_per_worker: list[float]
    unigram_eval_loss: float
    consensus_distance: float | None
    bytes_sent_per_worker: float
    bytes_sent_by_worker: list[int]
    bytes_received_by_worker: list[int]
    wall_seconds: float
    tokens_per_second: float
    run_dir: str
    nonfinite_events_by_worker: list[int]
    norm_rejections_by_worker: list[int]
    checkpoint_bytes_per_worker: int | None = None  # one worker's files in the latest checkpoint (None: none)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {**out, **self.extra}


def _slow_codec(cfg: DictConfig) -> str:
    """The codec NoLoCo's slow-weight term ran with (``comm.slow_codec`` null: chosen by ``comm.codec``)."""
    if cfg.outer.algo != "noloco":
        return cfg.comm.slow_codec or cfg.comm.codec
    return str(slow_term_settings(cfg.comm.codec, cfg.comm.slow_codec, cfg.outer.slow_every)[0])


def summarize(
    cfg: DictConfig,
    run_dir: Path,
    corpus,
    params: int,
    results: list[WorkerResult],
    consensus: float | None,
    seconds: float,
    steps_done: int,
    resume_step: int = 0,
    extra: dict | None = None,
) -> RunSummary:
    """The :class:`RunSummary` of ``results`` (one per worker, in worker order)."""
    targets = torch.cat(
        [y for _, y in eval_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.eval.batches)]
    )
    losses = [r.final_eval_loss for r in results]
    sent = [r.bytes_sent for r in results]
    stopped = next((r.stopped for r in results if r.stopped), None)  # data.stream_end=stop: ended before steps
    if stopped is not None:
        steps_done = stopped["ended_at_step"]
    tokens = len(results) * (steps_done - resume_step) * cfg.data.batch_size * cfg.data.seq_len
    return RunSummary(
        algo=cfg.outer.algo,
        codec=cfg.comm.codec,
        slow_codec=_slow_codec(cfg),
        backend=cfg.backend,
        workers=len(results),
        steps=steps_done,
        outer_every=cfg.outer.every,
        group_size=cfg.outer.group_size if cfg.outer.algo == "noloco" else cfg.workers,
        params=params,
        final_eval_loss=sum(losses) / len(losses),
        final_eval_loss_per_worker=losses,
        unigram_eval_loss=corpus.unigram_loss(targets),
        consensus_distance=consensus,
        bytes_sent_per_worker=sum(sent) / len(sent),
        bytes_sent_by_worker=sent,
        bytes_received_by_worker=[r.bytes_received for r in results],
        wall_seconds=seconds,
        tokens_per_second=tokens / seconds,
        run_dir=str(run_dir),
        nonfinite_events_by_worker=[r.nonfinite_events for r in results],
        norm_rejections_by_worker=[r.norm_rejections for r in results],
        checkpoint_bytes_per_worker=checkpoint.bytes_per_worker(run_dir),
        extra={
            **stream_summary(cfg.steps, [r.stream for r in results], stopped),
            **timing_summary(results),
            **(extra or {}),
        },
    )


def timing_summary(results: list[WorkerResult]) -> dict:
    """Per worker, in worker order: the training loop's seconds, the seconds and mean milliseconds of its outer
    steps (the loop blocked in them: the whole exchange when blocking, the wait and merge when overlapped), the
    seconds it spent writing checkpoints, the steps it skipped (a swarm peer catching up with its swarm), MFU
    (over the loop less those writes) where the device's peak is known, and on CUDA the peak GPU memory (GB,
    2**30 bytes)."""
    timings = [r.timing or {} for r in results]
    out = {
        f"{key}_by_worker": [t.get(key) for t in timings]
        for key in ("loop_seconds", "outer_seconds", "outer_ms_mean", "checkpoint_seconds", "steps_skipped")
    }
    if any("mfu" in t for t in timings):
        out["mfu_by_worker"] = [t.get("mfu") for t in timings]
    if any(r.peak_memory_bytes for r in results):
        out["gpu_peak_memory_gb_by_worker"] = [round(r.peak_memory_bytes / 2**30, 3) for r in results]
    return out


def finish(cfg: DictConfig, summary: RunSummary, quiet: bool = False) -> dict:
    """Write ``summary.json`` and ``curves.png``, print the table; returns the summary as a dict."""
    run_dir = Path(summary.run_dir)
    out = summary.to_dict()
    out["disk_bytes"] = folder_bytes(run_dir)  # everything the run wrote so far (summary.json and curves.png: KBs)
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1))
    if cfg.log.plot:
        plot_runs([run_dir], run_dir / "curves.png", title=run_dir.name)
    if not quiet:
        print(format_summary(out), flush=True)
    return out


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (links not followed): what a run keeps on disk."""
    return sum(p.lstat().st_size for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())


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
        f"{s['unigram_eval_loss']:.4f}"
        + (f" · consensus distance {s['consensus_distance']:.2e}" if s["consensus_distance"] is not None else ""),
        f"wall {s['wall_seconds']:.1f} s · {s['tokens_per_second']:,.0f} tokens/s · results in {s['run_dir']}"
        + (f" ({s['disk_bytes'] / 1e6:.1f} MB on disk)" if s.get("disk_bytes") is not None else ""),
    ]
    if s.get("stopped"):
        lines.append(describe(s["stopped"]))
    if s.get("checkpoint_bytes_per_worker") is not None:
        lines.append(f"checkpoint {s['checkpoint_bytes_per_worker'] / 1e6:.2f} MB per worker "
                     f"({s['run_dir']}/checkpoints/latest)")  # fmt: skip
    return "\n".join(lines)
