"""Honest comparisons: each method at its best, over seeds, at equal steps, bytes and modelled wall-clock (issue 34).

    python -m benchmarks.quality --parallel 8                     # GPU machine: the small preset, library corpus
    python -m benchmarks.quality --preset 125m --parallel 8 --gpus 8   # the 125M model, same plan, 8 GPUs
    python -m benchmarks.quality --preset tiny --parallel 2       # shortened, on a CPU box (not a quality result)
    python -m benchmarks.quality --dry-run                        # every run of the plan, none started
    python -m benchmarks.quality --report-only                    # the report from the runs already finished
    python -m benchmarks.quality --prepare-only                   # tokenize the corpus (before packing it)

The plan, one ``train.py`` process per run (``--parallel N`` at once, as :mod:`benchmarks.frontier`):

1. the sweep (seed ``--seeds[0]``, codec ``--sweep-codecs``, int4 by default; :data:`GRID`): DiLoCo at outer
   momentum μ ∈ {0.1, 0.3, 0.5, 0.9} and, at μ 0.3, outer lr 1.0; NoLoCo at μ ∈ {0, 0.1, 0.3, 0.5} and, at μ 0.1,
   γ 0.5 (β stays 0.7: two messages a round) and groups of 4. (``--grid quick``, the tiny preset's: μ 0.3 and 0.9
   for DiLoCo, 0.1 and 0.5 for NoLoCo; ``--grid narrow``, the 125m preset's: around the small preset's bests,
   DiLoCo μ 0.1 and 0.3, NoLoCo μ 0.1 in pairs and in groups of 4; ``--grid small-best``: no sweep, each at the
   small preset's best; ``--grid defaults``: each paper's μ, DiLoCo 0.9 and NoLoCo 0.5, beside the best, 0.3 and
   0.1.) DDP has no outer key to sweep: its seeds start with the sweep;
2. the best of each (algorithm, codec) by final held-out loss, for every codec of ``--codecs`` (int4 by default;
   ``--codecs fp32 int4`` adds exact messages: a codec not swept takes the knobs of the swept one's best), over
   every seed of ``--seeds`` (0 1 2);
3. the papers' comparison at their settings (fp32, each paper's outer momentum: NoLoCo 0.5, DiLoCo 0.9): NoLoCo at
   H = 50, DiLoCo at H = 100 and at H = 50 (``--paper-every``; NoLoCo arXiv 2506.10911, DiLoCo arXiv 2311.08105),
   seeds ``--paper-seeds`` (default: the first seed).

The first wave is DDP's seeds, the sweep and the papers' runs; the second, the other bests' seeds.

Resumable: the runs go to ``--runs`` (``runs/quality/<preset>/``), each named by its method, knobs, seed and a hash
of its whole config; a run whose ``summary.json`` exists is not run again, an unfinished one is started afresh, so a
killed call loses only the runs in flight. ``--deadline S``: no run starts after S seconds; the report says what
is missing, and the same command later completes it.

The report, ``<out>/<name>.md`` + ``.json`` + ``<name>.png`` (best of each) and ``<name>-paper.png``: the sweep; mean
± sample standard deviation over seeds of the final held-out loss (equal steps), bytes sent per worker and modelled
wall-clock; the loss at equal bytes and at equal modelled wall-clock; steps, bytes and modelled time to a target
loss (``--target``, default the highest final loss among the bests, so every best reaches it). Modelled
wall-clock at ``--rate`` (50 Mbit/s): step × compute seconds per step + the communication the link model
(:mod:`noloco.fleet.linkmodel`, full duplex, no latency) predicts for the bytes the run sent and received step by
step; compute seconds per step: ``--step-seconds``, default the median measured loop wall per step of all runs
(runs sharing one GPU are slower than alone, which the report says).

Presets: ``small`` (GPU: 4 workers, 1,000 steps, H = 10: 100 outer rounds, the library corpus at an 8192 vocabulary:
``python -m noloco.corpus``), ``125m`` (the same at the 125M model), ``tiny`` (a CPU box: the 64-wide model on
``shakespeare``, 40 steps, H = 5, H = 5/10 for the papers' comparison). ``--steps``, ``--every``, ``--workers``
change the budget; config overrides after ``--`` apply to every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # `python benchmarks/quality.py`: rerun as `python -m benchmarks.quality`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.quality", *sys.argv[1:]])

from benchmarks import common
from benchmarks.frontier import launch
from noloco.optim.algorithms import DiLoCo, NoLoCo
from noloco.train.config import ConfigError, load_config
from noloco.train.device import usable_cores

METHODS = ("ddp", "diloco", "noloco")
#: the sweep per algorithm: each variant a tuple of config overrides (the knobs of docs/results/noloco-tuning.md and
#: issue 34's table: μ matters most; NoLoCo's best μ was near 0.1, DiLoCo's near 0.3, the other knobs vary there)
GRID: dict[str, list[tuple[str, ...]]] = {
    "ddp": [()],
    "diloco": [*[(f"outer.momentum={m}",) for m in (0.1, 0.3, 0.5, 0.9)], ("outer.momentum=0.3", "outer.lr=1.0")],
    "noloco": [*[(f"outer.momentum={m}",) for m in (0, 0.1, 0.3, 0.5)],
               ("outer.momentum=0.1", "outer.pull=0.5"), ("outer.momentum=0.1", "outer.group_size=4")],
}  # fmt: skip
#: the shortened sweep (``--grid quick``, the tiny preset's default): two momenta per low-communication method
QUICK: dict[str, list[tuple[str, ...]]] = {
    "ddp": [()],
    "diloco": [("outer.momentum=0.3",), ("outer.momentum=0.9",)],
    "noloco": [("outer.momentum=0.1",), ("outer.momentum=0.5",)],
}
#: the sweep narrowed around the ``small`` preset's measured bests (docs/results/quality.md: DiLoCo μ 0.3, then 0.1;
#: NoLoCo μ 0.1 with groups of 4, then pairs): ``--grid narrow``, the 125m preset's default, where a run costs minutes
NARROW: dict[str, list[tuple[str, ...]]] = {
    "ddp": [()],
    "diloco": [("outer.momentum=0.1",), ("outer.momentum=0.3",)],
    "noloco": [("outer.momentum=0.1",), ("outer.momentum=0.1", "outer.group_size=4")],
}
#: no sweep: each method at the ``small`` preset's measured best (``--grid small-best``), its seeds in the first wave;
#: a later ``--grid narrow`` call reuses these runs (a run's name is its config) and checks the choice at this size
SMALL_BEST: dict[str, list[tuple[str, ...]]] = {
    "ddp": [()],
    "diloco": [("outer.momentum=0.3",)],
    "noloco": [("outer.momentum=0.1", "outer.group_size=4")],
}
#: the evidence for the μ defaults (``--grid defaults``): each paper's μ (NoLoCo 0.5, DiLoCo 0.9; the defaults until
#: 2026-12-05) beside the measured best (0.1, 0.3; the defaults since), everything else at its default (NoLoCo in pairs)
DEFAULTS: dict[str, list[tuple[str, ...]]] = {
    "ddp": [()],
    "diloco": [("outer.momentum=0.3",), ("outer.momentum=0.9",)],
    "noloco": [("outer.momentum=0.1",), ("outer.momentum=0.5",)],
}
GRIDS = {"full": GRID, "quick": QUICK, "narrow": NARROW, "small-best": SMALL_BEST, "defaults": DEFAULTS}
LIBRARY = Path("runs/library")
_GPU = ["device=auto", "data.source=files", f"data.path={LIBRARY / 'text'}", f"data.cache_dir={LIBRARY / 'cache'}",
        "data.vocab_size=8192", "data.seq_len=256", "data.batch_size=12", "workers=4", "steps=1000",
        "outer.every=10", "inner.warmup=50", "eval.every=50", "eval.batches=8"]  # fmt: skip
PRESETS: dict[str, dict] = {
    "small": {"budget": ["model.preset=small", *_GPU], "paper": (50, 100), "grid": "full"},
    "125m": {"budget": ["model.preset=125m", *_GPU], "paper": (50, 100), "grid": "narrow"},
    "tiny": {"budget": ["device=cpu", "data.source=shakespeare", "model.dim=64", "model.n_layers=2",
                        "model.n_heads=2", "data.vocab_size=512", "data.seq_len=32", "data.batch_size=4",
                        "eval.batches=4", "workers=2", "steps=40", "outer.every=5", "inner.warmup=5", "eval.every=5"],
             "paper": (5, 10), "grid": "quick"},
}  # fmt: skip
QUIET = ["checkpoint.final=false"]  # beside benchmarks.frontier's: no final checkpoint per run (GBs over a sweep)
RATE_BPS = 50e6
PLAN = "quality-plan.json"


@dataclass(frozen=True)
class Run:
    """One run: ``role`` (sweep, seed or paper), method ``algo/codec``, its knobs, seed, and all its overrides."""

    role: str
    method: str
    knobs: tuple[str, ...]
    seed: int
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        digest = hashlib.blake2b("\x00".join(self.overrides).encode(), digest_size=4).hexdigest()
        knobs = "-".join(k.removeprefix("outer.").replace("=", "") for k in self.knobs)
        return "-".join(filter(None, [self.method.replace("/", "-"), knobs, f"s{self.seed}", digest]))

    @property
    def config(self) -> str:
        """Method and knobs, the way the tables name a configuration: ``noloco/int4 outer.momentum=0.1``."""
        return " ".join([self.method, *self.knobs])


def make_run(role: str, method: str, knobs: tuple[str, ...], seed: int, budget: list[str]) -> Run:
    """A run of ``method`` (``algo/codec``) with ``knobs`` on ``budget`` at ``seed``; NoLoCo's slow-weight term goes
    through the same codec (the default fused exchange)."""
    algo, codec = method.split("/")
    return Run(role, method, tuple(knobs), seed, (*budget, f"outer.algo={algo}", f"comm.codec={codec}", *knobs,
                                                  f"run.seed={seed}", *QUIET))  # fmt: skip


def sweep_plan(methods: list[str], codecs: list[str], seed: int, budget: list[str], grid: dict = GRID) -> list[Run]:
    """Stage 1: every variant of ``grid`` (:data:`GRID` or :data:`QUICK`) of each method that has more than one, at
    each codec of ``codecs``, at ``seed``."""
    return [make_run("sweep", f"{algo}/{codec}", knobs, seed, budget)
            for algo in methods if len(grid[algo]) > 1 for codec in codecs for knobs in grid[algo]]  # fmt: skip


def fixed_knobs(methods: list[str], codecs: list[str], grid: dict = GRID) -> dict[str, tuple[str, ...]]:
    """The methods with nothing to sweep (DDP: no outer keys) and their one variant, per codec of ``codecs``: their
    best is known before any run, so their seeds start with the sweep."""
    return {f"{algo}/{codec}": grid[algo][0] for algo in methods if len(grid[algo]) == 1 for codec in codecs}


def best_knobs(results: dict[str, dict], sweep: list[Run]) -> dict[str, tuple[str, ...]]:
    """Per algorithm/codec swept, the knobs of the lowest final held-out loss among its finished sweep runs."""
    best: dict[str, tuple[float, tuple[str, ...]]] = {}
    for run in sweep:
        if run.name in results:
            loss = results[run.name]["final_loss"]
            if run.method not in best or loss < best[run.method][0]:
                best[run.method] = (loss, run.knobs)
    return {method: knobs for method, (_, knobs) in best.items()}


def seed_plan(best: dict[str, tuple[str, ...]], methods: list[str], codecs: list[str], seeds: list[int],
              budget: list[str]) -> list[Run]:  # fmt: skip
    """Stage 2: each method's best knobs at every codec (a codec not swept borrows them from a swept one) and
    every seed."""
    runs = []
    for algo in methods:
        knobs = next((best[f"{algo}/{c}"] for c in [*codecs, *(m.split("/")[1] for m in best)]
                      if f"{algo}/{c}" in best), None)  # fmt: skip
        if knobs is None:
            continue
        for codec in codecs:
            own = best.get(f"{algo}/{codec}", knobs)
            runs += [make_run("seed", f"{algo}/{codec}", own, seed, budget) for seed in seeds]
    return runs


def paper_plan(every: tuple[int, int], seeds: list[int], budget: list[str]) -> list[Run]:
    """Stage 3: the papers' settings (fp32, each paper's outer momentum, the other keys at their defaults): NoLoCo at
    H = every[0], DiLoCo at H = every[1] and at H = every[0]."""
    configs = [("noloco/fp32", every[0], NoLoCo), ("diloco/fp32", every[1], DiLoCo), ("diloco/fp32", every[0], DiLoCo)]
    return [make_run("paper", method, (f"outer.every={h}", f"outer.momentum={cls.PAPER_MOMENTUM}"), seed, budget)
            for method, h, cls in configs for seed in seeds]  # fmt: skip


# --- measuring ------------------------------------------------------------------------------------------------------


def measure(run: Run, folder: Path, rate_bps: float) -> dict:
    """A finished run's figures: final held-out loss, bytes sent per worker, the loop's wall time, the communication
    the link model predicts at ``rate_bps``, and its curve ``[step, bytes sent, modelled communication so far (s),
    mean held-out loss]`` per evaluation."""
    from noloco.fleet.linkmodel import predict, step_bytes
    from noloco.train.plots import eval_curves

    run_dir = folder / run.name
    summary = json.loads((run_dir / "summary.json").read_text())
    per_step, wall = step_bytes(run_dir)
    comm = predict(run_dir, rate_bps).per_step if per_step else {}
    curve, spent, done = [], 0.0, sorted(comm)
    for step, _, sent, loss in eval_curves(run_dir)[1]:
        while done and done[0] <= step:
            spent += comm[done.pop(0)]
        curve.append([step, sent, spent, loss])
    return {**asdict(run), "name": run.name, "config": run.config, "final_loss": summary["final_eval_loss"],
            "bytes": summary["bytes_sent_per_worker"], "params": summary["params"], "steps": summary["steps"],
            "workers": summary["workers"], "outer_every": summary["outer_every"], "loop_wall": wall,
            "comm_seconds": sum(comm.values()), "curve": curve}  # fmt: skip


def finished(run: Run, folder: Path) -> bool:
    return (folder / run.name / "summary.json").is_file()


def run_all(runs: list[Run], folder: Path, parallel: int, stop_at: float | None, rate_bps: float,
            gpus: int = 0) -> dict[str, dict]:  # fmt: skip
    """Train the runs not finished yet, ``parallel`` at once (an unfinished folder is removed first); none starts
    after ``stop_at`` (a :func:`time.monotonic` time). ``gpus`` > 0: run slot ``i`` sees GPU ``i mod gpus`` alone
    (``CUDA_VISIBLE_DEVICES``). Returns the figures of every run of ``runs`` that finished."""
    todo = [r for r in dict.fromkeys(runs) if not finished(r, folder)]
    for run in dict.fromkeys(runs):
        if run not in todo:
            print(f"   {run.name}: done before, kept", flush=True)
    if todo:
        folder.mkdir(parents=True, exist_ok=True)
        workers = max(load_config(list(r.overrides)).workers for r in todo)
        threads = max(1, usable_cores() // (min(parallel, len(todo)) * workers))

        slots: queue.Queue[int] = queue.Queue()
        for slot in range(parallel):
            slots.put(slot)

        def one(run: Run) -> None:
            if stop_at is not None and time.monotonic() > stop_at:
                print(f"   {run.name}: not started (--deadline)", flush=True)
                return
            shutil.rmtree(folder / run.name, ignore_errors=True)
            started, slot = time.monotonic(), slots.get()
            try:
                env = {"CUDA_VISIBLE_DEVICES": str(slot % gpus)} if gpus else None
                if launch(run, folder, threads, env) is not None:
                    print(f"== {run.name}: {time.monotonic() - started:.0f} s", flush=True)
            finally:
                slots.put(slot)

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(one, todo))
    return {r.name: measure(r, folder, rate_bps) for r in dict.fromkeys(runs) if finished(r, folder)}


# --- aggregating ----------------------------------------------------------------------------------------------------


def _spread(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def aggregate(items: list[dict], step_seconds: float) -> dict:
    """One configuration over its seeds: mean ± sd of the final loss, bytes and modelled wall-clock (steps ×
    ``step_seconds`` + modelled communication), and the mean curve ``[step, bytes, modelled s, loss, loss sd,
    loss min, loss max]`` over the evaluation steps every seed has."""
    loss, loss_sd = _spread([r["final_loss"] for r in items])
    modelled, modelled_sd = _spread([r["steps"] * step_seconds + r["comm_seconds"] for r in items])
    common_steps = set.intersection(*({p[0] for p in r["curve"]} for r in items))
    curve = []
    for step in sorted(common_steps):
        points = [next(p for p in r["curve"] if p[0] == step) for r in items]
        losses = [p[3] for p in points]
        curve.append([step, statistics.fmean(p[1] for p in points),
                      step * step_seconds + statistics.fmean(p[2] for p in points), statistics.fmean(losses),
                      statistics.stdev(losses) if len(losses) > 1 else 0.0, min(losses), max(losses)])  # fmt: skip
    first = items[0]
    return {"config": first["config"], "method": first["method"], "knobs": first["knobs"], "role": first["role"],
            "seeds": sorted(r["seed"] for r in items), "loss": loss, "loss_sd": loss_sd,
            "bytes": statistics.fmean(r["bytes"] for r in items), "modelled": modelled, "modelled_sd": modelled_sd,
            "bits": statistics.fmean(r["bytes"] * 8 / r["params"] / r["steps"] for r in items),
            "outer_every": first["outer_every"], "curve": curve}  # fmt: skip


def at(curve: list[list[float]], axis: int, budget: float) -> float | None:
    """The mean loss when ``curve``'s ``axis`` (1: bytes, 2: modelled seconds) reached ``budget``, linear between
    evaluations; the final loss when the run ended below the budget; None before the first evaluation."""
    if not curve or budget < curve[0][axis]:
        return None
    for before, after in zip(curve, curve[1:]):
        if before[axis] <= budget <= after[axis]:
            span = after[axis] - before[axis]
            return before[3] + (after[3] - before[3]) * ((budget - before[axis]) / span if span else 1.0)
    return curve[-1][3]


def to_target(curve: list[list[float]], target: float) -> tuple[float, float, float] | None:
    """``(step, bytes, modelled s)`` at which the mean loss first reaches ``target`` (linear), or None."""
    for before, after in zip([None, *curve], curve):
        if after[3] <= target:
            if before is None or before[3] == after[3]:
                return after[0], after[1], after[2]
            frac = (before[3] - target) / (before[3] - after[3])
            return tuple(a + (b - a) * frac for a, b in zip(before[:3], after[:3]))  # type: ignore[return-value]
    return None


def by_config(results: dict[str, dict], runs: list[Run], step_seconds: float) -> list[dict]:
    """``runs``' finished results grouped by configuration (first-seen order), each :func:`aggregate`-d."""
    groups: dict[str, list[dict]] = {}
    for run in dict.fromkeys(runs):
        if run.name in results:
            groups.setdefault(run.config, []).append(results[run.name])
    return [aggregate(items, step_seconds) for items in groups.values()]


# --- the report -----------------------------------------------------------------------------------------------------


def _pm(mean: float | None, sd: float | None, fmt: str) -> str:
    if mean is None:
        return "–"
    return format(mean, fmt) + ("" if sd is None else f" ± {format(sd, fmt)}")


def _opt(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def sweep_table(sweep: list[dict], best: dict[str, tuple[str, ...]]) -> list[str]:
    lines = [
        "| configuration | final held-out loss | MB sent per worker | modelled wall (s) | |",
        "|---|---|---|---|---|",
    ]
    for row in sweep:
        mark = "**best**" if best.get(row["method"]) == tuple(row["knobs"]) else ""
        lines.append(f"| `{row['config']}` | {row['loss']:.4f} | {row['bytes'] / 1e6:.2f} | {row['modelled']:.0f} "
                     f"| {mark} |")  # fmt: skip
    return lines


def best_table(rows: list[dict], target: float | None) -> list[str]:
    lines = ["| configuration | seeds | final held-out loss (equal steps) | MB sent per worker | bits/param/step | "
             "modelled wall (s) | step at target | MB at target | modelled s at target |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        hit = to_target(row["curve"], target) if target is not None else None
        reached = "not reached | – | –" if hit is None else f"{hit[0]:.0f} | {hit[1] / 1e6:.2f} | {hit[2]:.0f}"
        lines.append(f"| `{row['config']}` | {len(row['seeds'])} | {_pm(row['loss'], row['loss_sd'], '.4f')} | "
                     f"{row['bytes'] / 1e6:.2f} | {row['bits']:.4g} | {_pm(row['modelled'], row['modelled_sd'], '.0f')}"
                     f" | {reached} |")  # fmt: skip
    return lines


def equal_table(rows: list[dict], axis: int, budgets: list[float], unit: str, scale: float) -> list[str]:
    """Mean loss of each row at each budget of ``axis`` (1: bytes, 2: modelled s); ``*``: the run had ended below
    the budget (its final loss); ``–``: its first evaluation came after the budget."""
    head = " | ".join(f"{b / scale:.3g} {unit}" for b in budgets)
    lines = [f"| configuration | {head} |", "|---" * (len(budgets) + 1) + "|"]
    for row in rows:
        cells = []
        for budget in budgets:
            loss = at(row["curve"], axis, budget)
            ended = row["curve"] and budget > row["curve"][-1][axis]
            cells.append("–" if loss is None else f"{loss:.4f}{'*' if ended else ''}")
        lines.append(f"| `{row['config']}` | {' | '.join(cells)} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """NoLoCo's best against DiLoCo's best per codec at equal steps: the difference and the seed spread."""
    lines = []
    for codec in dict.fromkeys(r["method"].split("/")[1] for r in rows):
        pick = {r["method"].split("/")[0]: r for r in rows if r["method"].endswith(f"/{codec}")}
        if "noloco" not in pick or "diloco" not in pick:
            continue
        no, di = pick["noloco"], pick["diloco"]
        spread = max(no["loss_sd"] or 0.0, di["loss_sd"] or 0.0)
        gap = no["loss"] - di["loss"]
        word = "within" if abs(gap) <= spread else ("behind by more than" if gap > 0 else "ahead by more than")
        lines.append(f"- {codec}: NoLoCo at its best {no['loss']:.4f}, DiLoCo at its best {di['loss']:.4f} at equal "
                     f"steps: NoLoCo − DiLoCo = {gap:+.4f} ({gap / di['loss'] * 100:+.2f}%), {word} the larger seed "
                     f"standard deviation ({spread:.4f}; {len(no['seeds'])} and {len(di['seeds'])} seeds); NoLoCo "
                     f"sends {no['bytes'] / di['bytes'] * 100:.0f}% of DiLoCo's bytes.")  # fmt: skip
    return lines


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Mean held-out loss (band: min–max over seeds) against inner steps, MB sent per worker and modelled
    wall-clock, one line per configuration."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for row in rows:
        xs = list(zip(*row["curve"])) if row["curve"] else None
        if not xs:
            continue
        label = f"{row['config']} ({len(row['seeds'])} seeds)"
        for ax, axis, scale in ((axes[0], 0, 1), (axes[1], 1, 1e6), (axes[2], 2, 1)):
            x = [v / scale for v in xs[axis]]
            (line,) = ax.plot(x, xs[3], label=label)
            ax.fill_between(x, xs[5], xs[6], color=line.get_color(), alpha=0.2)
    for ax, name in zip(axes, ("inner steps", "MB sent per worker", "modelled wall-clock at 50 Mbit/s (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
    for ax in axes[1:]:
        ax.set_xscale("symlog", linthresh=1e-3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results: dict[str, dict], plan: dict[str, list[Run]], best: dict[str, tuple[str, ...]], args,
           budget: list[str], machine: str, command: str, out: Path) -> tuple[list[str], dict]:  # fmt: skip
    """The markdown lines and the JSON data of the report; draws ``<out>/<name>.png`` and ``<name>-paper.png``."""
    done = list(results.values())
    planned = list(dict.fromkeys(r.name for runs in plan.values() for r in runs))
    step_seconds = args.step_seconds if args.step_seconds is not None else statistics.median(
        r["loop_wall"] / r["steps"] for r in done)  # fmt: skip
    sweep = by_config(results, plan["sweep"], step_seconds)
    bests = by_config(results, plan["seed"], step_seconds)
    paper = by_config(results, plan["paper"], step_seconds)
    target = args.target if args.target is not None else max((r["loss"] for r in bests), default=None)
    chosen = "--target" if args.target is not None else "the highest final loss among these"
    first = done[0]
    tiny = args.preset == "tiny"
    measured = ("--step-seconds" if args.step_seconds is not None
                else "the median loop wall per step of these runs, which shared the machine")  # fmt: skip
    title = "Each method at its best, over seeds" + (" (shortened CPU run, tiny preset: not a quality result)"
                                                    if tiny else "")  # fmt: skip
    data_keys = [o for o in budget if o.startswith(("data.source=", "data.path=", "data.vocab_size="))]
    lines = [f"# {title}", "", f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Date: {time.strftime('%Y-%m-%d')}  ",
             f"Setting: preset `{args.preset}`, {first['workers']} workers, {first['steps']} inner steps, H = "
             f"{first['outer_every']} ({first['steps'] // first['outer_every']} outer rounds) unless a configuration "
             f"sets it, {first['params'] / 1e6:.2f}M parameters, {' '.join(data_keys) or 'data.source=shakespeare'}. "
             f"Runs: {len(done)} finished of {len(planned)} planned, under `{args.runs}`.",
             "",
             f"Modelled wall-clock = steps × {step_seconds * 1e3:.1f} ms of compute per step ({measured}) + the "
             "communication the link model predicts for each run's bytes, step by step, on links of "
             f"{args.rate / 1e6:g} Mbit/s each way (`noloco.fleet.linkmodel`, full duplex, no latency).", "",
             f"## The sweep (seed {args.seeds[0]}, codec {', '.join(args.sweep_codecs)})", "",
             *sweep_table(sweep, best), "",
             f"## Each method at its best, seeds {', '.join(map(str, args.seeds))}", "",
             "Mean ± sample standard deviation over seeds. Target: held-out loss "
             f"{_opt(target, '.4f')} ({chosen}); at target: where the mean curve first reaches it, linear between "
             "evaluations.", "",
             *best_table(bests, target), "", *verdicts(bests)]  # fmt: skip
    thrifty = [r for r in bests if not r["method"].startswith("ddp/")] or bests
    for axis, what, unit, scale in (
        (1, "bytes sent per worker", "MB", 1e6),
        (2, f"modelled wall-clock at {args.rate / 1e6:g} Mbit/s", "s", 1.0),
    ):
        budgets = sorted({r["curve"][-1][axis] for r in thrifty if r["curve"]})
        lines += ["", f"## At equal {what}", "", "Mean held-out loss once each had spent the budget of the column "
                  "(the final figure of one of the low-communication methods); `*`: its run had ended below that "
                  "budget (its final loss); `–`: its first evaluation came later.", "",
                  *equal_table(bests, axis, budgets, unit, scale)]  # fmt: skip
    lines += [
        "",
        "## The papers' comparison: their settings (fp32, each paper's outer momentum)",
        "",
        *best_table(paper, target),
    ]
    missing = [name for name in planned if name not in results]
    if missing:
        lines += ["", f"Not finished ({len(missing)}; the same command runs them): {', '.join(missing)}."]
    pictures = [
        plot(bests, out / f"{args.name}.png", "each method at its best (band: min–max over seeds)"),
        plot(paper, out / f"{args.name}-paper.png", "the papers' settings: NoLoCo H=50, DiLoCo H=100 and 50"),
    ]
    lines += ["", *[f"![held-out loss vs steps, bytes and modelled wall-clock]({p.name})" for p in pictures if p]]
    data = {"step_seconds": step_seconds, "rate_bps": args.rate, "target": target, "best": best,
            "sweep": sweep, "bests": bests, "paper": paper, "runs": done, "missing": missing}  # fmt: skip
    return lines, data


# --- the command ----------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--preset", choices=list(PRESETS), default="small")
    parser.add_argument(
        "--grid",
        choices=tuple(GRIDS),
        default=None,
        help="the sweep: full (GRID), quick (QUICK), narrow (NARROW) or none, each method at the small "
        "preset's best (small-best: SMALL_BEST), each paper's μ beside the best (defaults: DEFAULTS); default: "
        "the preset's",
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--codecs", nargs="+", default=["int4"], help="codecs of the best-of-each runs (fp32 int4: "
                        "exact messages too)")  # fmt: skip
    parser.add_argument("--sweep-codecs", nargs="+", default=["int4"], help="codecs the sweep runs at")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the first also seeds the sweep")
    parser.add_argument("--paper-seeds", nargs="*", type=int, default=None, help="default: the first seed; none: skip")
    parser.add_argument("--paper-every", nargs=2, type=int, default=None, metavar=("H_NOLOCO", "H_DILOCO"))
    parser.add_argument("--steps", type=int, default=None, help="inner steps per run (the preset's otherwise)")
    parser.add_argument("--every", type=int, default=None, help="H of the sweep and best-of-each runs")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at once")
    parser.add_argument("--gpus", type=int, default=0, metavar="N", help="spread the runs over N GPUs of this host "
                        "(CUDA_VISIBLE_DEVICES per run slot); 0: leave the device to each run")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=None, metavar="S", help="start no run after S seconds")
    parser.add_argument("--rate", type=float, default=RATE_BPS, help="link rate of the modelled wall-clock, bit/s")
    parser.add_argument("--step-seconds", type=float, default=None, help="compute seconds per inner step "
                        "(default: the median measured loop wall per step)")  # fmt: skip
    parser.add_argument("--target", type=float, default=None, metavar="LOSS")
    parser.add_argument("--runs", type=Path, default=None, help="the runs' folders (default: runs/quality/<preset>)")
    common.add_out(parser, "quality")
    parser.add_argument("--name", default="quality")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--prepare-only", action="store_true", help="tokenize the corpus into its cache, run nothing")
    parser.add_argument("--report-only", action="store_true", help="start no run; report the finished ones")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    return parser


def budget_of(args) -> list[str]:
    """The preset's overrides, then ``--steps``/``--every``/``--workers``, then the command line's."""
    extra = [f"{key}={value}" for key, value in (("steps", args.steps), ("outer.every", args.every),
                                                 ("workers", args.workers)) if value is not None]  # fmt: skip
    return [*PRESETS[args.preset]["budget"], *extra, *args.overrides]


def check_data(budget: list[str]) -> None:
    """``DataError`` (one line, saying how to get it) when the budget's ``data.source=files`` path is missing."""
    from omegaconf import OmegaConf

    from noloco.data.documents import DataError

    data = OmegaConf.from_dotlist([o for o in budget if o.startswith("data.")]).get("data", {})
    if data.get("source") == "files" and not Path(os.path.expanduser(str(data.get("path")))).exists():
        raise DataError(f"data.path={data.path} does not exist: build the library corpus (`python -m noloco.corpus "
                        f"fetch {LIBRARY}/packages && python -m noloco.corpus build {LIBRARY}`) or unpack it "
                        f"(`python -m noloco.corpus unpack library.tar.xz {LIBRARY}`)")  # fmt: skip


def prepare_data(budget: list[str]) -> None:
    """Tokenize the corpus once, before the runs (which then read the cache) start."""
    from noloco.data.corpus import prepare_corpus

    data = load_config(budget).data
    prepare_corpus(data.source, data.path, data.vocab_size, data.eval_fraction, data.cache_dir)


def collect(runs: list[Run], args, stop_at: float | None) -> dict[str, dict]:
    """The figures of ``runs``: trained first where not finished, unless ``--report-only``."""
    if args.report_only:
        return {r.name: measure(r, args.runs, args.rate) for r in dict.fromkeys(runs) if finished(r, args.runs)}
    return run_all(runs, args.runs, args.parallel, stop_at, args.rate, args.gpus)


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.parallel < 1 or args.gpus < 0 or not args.seeds or (args.steps is not None and args.steps < 1):
        parser.error("--parallel and --steps must be >= 1, --gpus >= 0, and --seeds must name one seed at least")
    args.runs = args.runs or Path("runs/quality") / args.preset
    budget = budget_of(args)
    paper_seeds = args.seeds[:1] if args.paper_seeds is None else args.paper_seeds
    from noloco.data.documents import DataError

    try:
        if not args.dry_run:
            check_data(budget)
        grid = GRIDS[args.grid or PRESETS[args.preset]["grid"]]
        fixed = fixed_knobs(args.methods, args.sweep_codecs, grid)
        plan = {
            "sweep": sweep_plan(args.methods, args.sweep_codecs, args.seeds[0], budget, grid),
            "seed": seed_plan(fixed, [m for m in args.methods if len(grid[m]) == 1], args.codecs, args.seeds, budget),
            "paper": paper_plan(tuple(args.paper_every or PRESETS[args.preset]["paper"]), paper_seeds, budget),
        }
        for run in [*plan["seed"], *plan["sweep"], *plan["paper"]]:
            load_config(list(run.overrides))
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    first_wave = [*plan["seed"], *plan["sweep"], *plan["paper"]]  # DDP, the slowest, first
    if args.dry_run:
        for run in first_wave:
            print(f"{run.role} {run.name}: train.py {' '.join(run.overrides)}")
        print(f"then the best of each of {', '.join(args.methods)} at {', '.join(args.codecs)}, seeds "
              f"{' '.join(map(str, args.seeds))}")  # fmt: skip
        return 0
    stop_at = None if args.deadline is None else time.monotonic() + args.deadline
    try:
        if not args.report_only:
            prepare_data(budget)
        if args.prepare_only:
            print(f"corpus tokenized: {' '.join(o for o in budget if o.startswith('data.'))}")
            return 0
        results = collect(first_wave, args, stop_at)
        best = {**fixed, **best_knobs(results, plan["sweep"])}
        plan["seed"] = seed_plan(best, args.methods, args.codecs, args.seeds, budget)
        results = {**collect(plan["seed"], args, stop_at), **results}  # a run of both stages keeps its first role
    except (DataError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not results:
        print("error: no run finished", file=sys.stderr)
        return 2
    out = common.out_dir(args.out)
    command, machine = common.command("quality"), common.machine()
    lines, data = report(results, plan, best, args, budget, machine, command, out)
    common.write_report(out, args.name, lines, data, command=command, machine=machine)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
