"""The frontier: held-out loss against bits sent per parameter per inner step, codec by codec (docs/design.md §10).

    python -m benchmarks.frontier                              # GPU machine: the small model, every codec, 3 seeds
    python -m benchmarks.frontier --tiny --codecs fp32 int4 int2 --seeds 0 --parallel 2   # a CPU box
    python -m benchmarks.frontier --dry-run                    # check every run's config, print the runs
    python -m benchmarks.frontier --from-runs runs/frontier/<stamp>   # redraw from finished runs

For each algorithm (``--algos``, default NoLoCo and DiLoCo) and each point of ``--codecs`` it trains one run per
seed (``--seeds``), through ``train.py`` in a process of its own (``--parallel N`` at once), and reads its
``summary.json``. A point is ``CODEC[@flag...]``: ``CODEC`` is a ``comm.codec`` spelling (``int2``, ``sign``,
``topk:64/4096+int2``, ...); flags: ``noef`` (``comm.error_feedback=false``), ``fused`` (NoLoCo: the slow-weight
term in the same message, ``comm.slow_codec`` = the codec and ``outer.slow_every=1``, the default run's exchange),
or any ``key=value`` config override (``topk:64/4096+int2@outer.slow_stagger=true``: the slow-weight term as a
rotating 1/k slice every round; ``...@outer.overlap=true``: overlapped). A codec this checkout does not know is
skipped with a line saying so.

NoLoCo's points other than ``fp32`` and ``fused`` ones send the pseudo-gradient Δ through the codec every round and
the slow-weight term φ − φ₀ through ``--slow-codec`` (default int4) once every ``--slow-every`` rounds (default
8; docs/design.md §3.2). ``fp32`` is the fused exact exchange, NoLoCo-fp32 the reference of every ratio: it is
always run.

Per point: x = bits/param/step = bytes sent per worker × 8 ÷ parameters ÷ inner steps; y = held-out loss ÷
NoLoCo-fp32's of the same seed; both as mean ± standard deviation over seeds. The targets of the table (issue
30): within +1.5% of NoLoCo-fp32 at ≥ 30× fewer bytes than NoLoCo-fp32, and at ≤ 0.0073 bits/param/step
(Covenant-72B's rate); only points run with 3 seeds decide a target (fewer: shown, marked "not decided"). Each
overlapped point (``@outer.overlap=...``) whose blocking twin (the same point without the overlap flags) ran gets
a line of overlap's loss cost: overlapped ÷ blocking of the same seed, against the ≤ +0.75% target at τ = H.
Writes ``<out>/<name>.md`` (the table, command and machine), ``<out>/<name>.json`` and
``<out>/<name>-<algo>.png`` (loss ratio against bits/param/step, log x), ``<out>`` being
``runs/benchmarks/frontier/`` unless ``--out`` says otherwise.

Budgets: by default the GPU machine's (``device=auto``: its GPU; the ``small`` preset, H = 10, 1,000 steps: 100 outer
rounds); ``--tiny`` a CPU box's (the 64-wide, 2-layer model, sequences of 32, H = 5, 500 steps: 100 rounds);
config overrides after ``--`` apply to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # `python benchmarks/frontier.py`: rerun as `python -m benchmarks.frontier`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.frontier", *sys.argv[1:]])

from benchmarks import common
from noloco.collectives import known_codecs
from noloco.train.config import ConfigError, load_config
from noloco.train.device import usable_cores

ALGOS = ("noloco", "diloco")
_TOPK = [f"topk:{k}/4096+{v}" for v in ("int2", "int4") for k in (64, 128, 256)]  # 1.6%, 3.1%, 6.25% density
_LOSSY = ["int8", "int4", "int3", "int2", "sign", *_TOPK]
#: the default points: fp32, every lossy codec with error feedback and without, the default run's fused int4, exact
#: messages with a pull every 8 rounds (the price of the rare pull alone), and the sparsest Δ with the slow-weight
#: term rarer or coarser than --slow-codec every --slow-every rounds
POINTS = ["fp32", *_LOSSY, *[f"{c}@noef" for c in _LOSSY], "int4@fused", "fp32@outer.slow_every=8",
          f"{_TOPK[0]}@outer.slow_every=16",
          f"{_TOPK[0]}@outer.slow_every=32", f"{_TOPK[0]}@comm.slow_codec=int2"]  # fmt: skip
GPU = ["device=auto", "model.preset=small", "workers=4", "steps=1000", "outer.every=10", "inner.warmup=50"]
TINY = ["device=cpu", "model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.vocab_size=512",
        "data.seq_len=32", "data.batch_size=4", "eval.batches=4", "workers=4", "steps=500", "outer.every=5",
        "inner.warmup=20"]  # fmt: skip
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot=false", "checkpoint.every=0"]
#: within +1.5% of NoLoCo-fp32 ...
LOSS_TARGET = 1.015
#: ... at >= 30x fewer bytes than NoLoCo-fp32; and at <= 0.0073 bits/param/step (Covenant-72B's rate)
BYTES_TARGET, BITS_TARGET = 30.0, 0.0073
#: a target is decided by points run with at least this many seeds (issue 30: three seeds decide); fewer: shown only
MIN_SEEDS = 3
#: overlap's loss cost at τ = H, overlapped ÷ blocking twin of the same seed, at most (the eager rule's +0.75%)
OVERLAP_TARGET = 1.0075
#: the flags that make a point overlapped; without them it is its blocking twin
OVERLAP_FLAGS = ("outer.overlap=", "outer.overlap_steps=")
REFERENCE = ("noloco", "fp32")
#: a point whose loss ratio is above this (a diverged run) is named under the plot, not drawn, so the rest stay legible
OFF_CHART = 1.5
PLAN = "frontier-plan.json"  # in a stamp folder: its runs (algo, point, seed, name) and the machine


@dataclass(frozen=True)
class Run:
    """One run of the plan: an algorithm at one point and seed, and the config overrides that make it."""

    algo: str
    point: str
    seed: int
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        return re.sub(r"[^A-Za-z0-9.=-]+", "-", f"{self.algo}-{self.point}-s{self.seed}").strip("-")


def point_overrides(algo: str, point: str, slow_codec: str, slow_every: int) -> list[str]:
    """The config overrides of ``point`` (``CODEC[@flag...]``) for ``algo``; ``ValueError`` for an empty codec or
    an unknown flag. NoLoCo's lossy points send φ − φ₀ at ``slow_codec`` every ``slow_every`` rounds unless
    ``fused``; fp32 is always fused (exact)."""
    codec, *flags = point.split("@")
    if not codec:
        raise ValueError(f"point {point!r}: no codec; expected CODEC[@noef][@fused][@key=value...]")
    overrides, fused, extra = [f"outer.algo={algo}", f"comm.codec={codec}"], codec == "fp32", []
    for flag in flags:
        if flag == "noef":
            overrides.append("comm.error_feedback=false")
        elif flag == "fused":
            fused = True
        elif "=" in flag and flag.split("=", 1)[0].strip():
            extra.append(flag)
        else:
            raise ValueError(f"point {point!r}: unknown flag {flag!r} (noef, fused or key=value)")
    if algo == "noloco":
        slow = [f"comm.slow_codec={codec}", "outer.slow_every=1"] if fused else [
            f"comm.slow_codec={slow_codec}", f"outer.slow_every={slow_every}"]  # fmt: skip
        overrides += slow
    return overrides + extra


def noloco_only(point: str) -> bool:
    """Whether ``point``'s flags shape NoLoCo's slow-weight term only (``fused``, ``outer.slow_every=``,
    ``outer.slow_stagger=``, ``comm.slow_codec=``): DiLoCo sends Δ alone, so such a point is the codec's plain point
    for it."""
    return any(flag == "fused" or flag.startswith(("outer.slow_every=", "outer.slow_stagger=", "comm.slow_codec="))
               for flag in point.split("@")[1:])  # fmt: skip


def plan_of(algos: list[str], points: list[str], seeds: list[int], slow_codec: str, slow_every: int,
            budget: list[str]) -> tuple[list[Run], list[str]]:  # fmt: skip
    """Every run the arguments ask for (NoLoCo-fp32 added first when missing), and one line per point skipped
    because its codec is unknown here. Each run's config is loaded (``ConfigError`` for a refused one)."""
    if "fp32" not in points:
        points = ["fp32", *points]
    runs, skipped = [], []
    for point in dict.fromkeys(points):
        codec = point.split("@")[0]
        if codec not in known_codecs():
            skipped.append(f"skipped {point}: codec {codec!r} is not available in this checkout")
            continue
        for algo in ALGOS:
            if (algo not in algos and (algo, point) != REFERENCE) or (algo != "noloco" and noloco_only(point)):
                continue
            for seed in seeds:
                overrides = (*budget, *point_overrides(algo, point, slow_codec, slow_every), f"run.seed={seed}")
                try:
                    load_config(list(overrides))
                except ConfigError as exc:
                    if "is not a codec" not in str(exc):
                        raise
                    skipped += [] if any(line.startswith(f"skipped {point}:") for line in skipped) else [
                        f"skipped {point}: {exc}"]  # fmt: skip
                    break
                runs.append(Run(algo, point, seed, overrides))
    return runs, skipped


def measure(run: Run, summary: dict) -> dict:
    """One run's point: its held-out loss and bits/param/step (bytes sent per worker × 8 ÷ parameters ÷ steps)."""
    bits = summary["bytes_sent_per_worker"] * 8 / summary["params"] / summary["steps"]
    return {**asdict(run), "name": run.name, "loss": summary["final_eval_loss"], "bits": bits,
            "params": summary["params"], "steps": summary["steps"], "workers": summary["workers"],
            "outer_every": summary["outer_every"]}  # fmt: skip


def _spread(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def summarize(results: list[dict], min_seeds: int = MIN_SEEDS) -> list[dict]:
    """Per (algo, point), in first-seen order: mean ± sd over seeds of the loss, bits/param/step and loss ratio
    to NoLoCo-fp32 of the same seed (seeds without that reference leave the ratio out), the bytes reduction
    against NoLoCo-fp32, whether the means meet each target and whether the point decides (``decided``: at least
    ``min_seeds`` seeds with a ratio)."""
    reference = {r["seed"]: r for r in results if (r["algo"], r["point"]) == REFERENCE}
    ref_bits = statistics.fmean(r["bits"] for r in reference.values()) if reference else None
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["algo"], r["point"]), []).append(r)
    rows = []
    for (algo, point), runs in groups.items():
        ratios = [r["loss"] / reference[r["seed"]]["loss"] for r in runs if r["seed"] in reference]
        loss, loss_sd = _spread([r["loss"] for r in runs])
        bits, bits_sd = _spread([r["bits"] for r in runs])
        ratio, ratio_sd = _spread(ratios) if ratios else (None, None)
        fewer = ref_bits / bits if ref_bits and bits > 0 else None
        close = ratio is not None and ratio <= LOSS_TARGET
        rows.append({"algo": algo, "point": point, "seeds": sorted(r["seed"] for r in runs), "loss": loss,
                     "loss_sd": loss_sd, "bits": bits, "bits_sd": bits_sd, "ratio": ratio, "ratio_sd": ratio_sd,
                     "fewer_bytes": fewer, "target_30x": close and fewer is not None and fewer >= BYTES_TARGET,
                     "target_bits": close and bits <= BITS_TARGET, "decided": len(ratios) >= min_seeds})  # fmt: skip
    return rows


def _pm(mean: float | None, sd: float | None, fmt: str) -> str:
    if mean is None:
        return "–"
    return format(mean, fmt) + ("" if sd is None else f" ± {format(sd, fmt)}")


def table(rows: list[dict]) -> list[str]:
    """The markdown table of :func:`summarize`'s rows, best ratio first within each algorithm; targets marked."""
    lines = ["| algorithm | point | seeds | bits/param/step | × fewer bytes than NoLoCo-fp32 | held-out loss | "
             "loss ÷ NoLoCo-fp32 | targets |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for algo in dict.fromkeys(r["algo"] for r in rows):
        mine = sorted((r for r in rows if r["algo"] == algo), key=lambda r: r["bits"], reverse=True)
        for r in mine:
            marks = [m if r["decided"] else f"{m.strip('*')} ({len(r['seeds'])} seeds: not decided)"
                     for m, hit in (("**≥30× within +1.5%**", r["target_30x"]),
                                    ("**≤0.0073 within +1.5%**", r["target_bits"])) if hit]  # fmt: skip
            fewer = "–" if r["fewer_bytes"] is None else f"{r['fewer_bytes']:.1f}×"
            lines.append(f"| {algo} | `{r['point']}` | {len(r['seeds'])} | {_pm(r['bits'], r['bits_sd'], '.4g')} | "
                         f"{fewer} | {_pm(r['loss'], r['loss_sd'], '.4f')} | {_pm(r['ratio'], r['ratio_sd'], '.4f')} "
                         f"| {', '.join(marks)} |")  # fmt: skip
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """One line per target: the best NoLoCo point that meets it, or the closest figure when none does; only the
    points that decide (``decided``: enough seeds) count, and a line says when no point has enough seeds."""
    noloco = [r for r in rows if r["algo"] == "noloco" and r["ratio"] is not None and r["decided"]]
    lines = []
    if not noloco:
        return ["- No NoLoCo point has enough seeds (each with its NoLoCo-fp32) to decide a target."]
    for key, what in (
        ("target_30x", f"within +{(LOSS_TARGET - 1) * 100:.1f}% at ≥ {BYTES_TARGET:.0f}× fewer bytes"),
        ("target_bits", f"within +{(LOSS_TARGET - 1) * 100:.1f}% at ≤ {BITS_TARGET} bits/param/step"),
    ):
        hits = [r for r in noloco if r[key]]
        if hits:
            best = min(hits, key=lambda r: r["bits"])
            lines.append(f"- NoLoCo {what}: **met** by `{best['point']}` ({best['bits']:.4g} bits/param/step, "
                         f"loss ratio {best['ratio']:.4f}).")  # fmt: skip
            continue
        close = [r for r in noloco if r["ratio"] <= LOSS_TARGET]
        best = min(close, key=lambda r: r["bits"]) if close else None
        detail = "no point within the loss target" if best is None else (
            f"the fewest bits within the loss target: `{best['point']}`, {best['bits']:.4g} bits/param/step, "
            f"{best['fewer_bytes']:.1f}× fewer bytes")  # fmt: skip
        lines.append(f"- NoLoCo {what}: **not met** ({detail}).")
    return lines


def blocking_twin(point: str) -> str | None:
    """``point`` without its overlap flags (``outer.overlap=``, ``outer.overlap_steps=``): the blocking run it is
    measured against; None when ``point`` is not overlapped (no ``outer.overlap=`` other than false)."""
    codec, *flags = point.split("@")
    overlap = [f for f in flags if f.startswith("outer.overlap=")]
    if not overlap or overlap[-1].split("=", 1)[1].strip().lower() in ("false", "0", "no"):
        return None
    return "@".join([codec, *[f for f in flags if not f.startswith(OVERLAP_FLAGS)]])


def overlap_costs(results: list[dict], min_seeds: int = MIN_SEEDS) -> list[dict]:
    """Per overlapped point (algo, point) whose blocking twin (:func:`blocking_twin`) ran: the loss ratio
    overlapped ÷ blocking of the same seed, mean ± sd over the seeds both ran, and whether it is within
    ``OVERLAP_TARGET`` (decided with at least ``min_seeds`` seeds)."""
    by_key = {(r["algo"], r["point"], r["seed"]): r for r in results}
    rows = []
    for algo, point in dict.fromkeys((r["algo"], r["point"]) for r in results):
        twin = blocking_twin(point)
        if twin is None:
            continue
        ratios = [by_key[algo, point, seed]["loss"] / by_key[algo, twin, seed]["loss"]
                  for seed in sorted({r["seed"] for r in results}) if (algo, point, seed) in by_key
                  and (algo, twin, seed) in by_key]  # fmt: skip
        if not ratios:
            continue
        ratio, sd = _spread(ratios)
        rows.append({"algo": algo, "point": point, "twin": twin, "seeds": len(ratios), "ratio": ratio, "ratio_sd": sd,
                     "within": ratio <= OVERLAP_TARGET, "decided": len(ratios) >= min_seeds})  # fmt: skip
    return rows


def overlap_table(rows: list[dict]) -> list[str]:
    """The markdown lines of :func:`overlap_costs` (none when no overlapped point has its twin)."""
    if not rows:
        return []
    lines = ["Overlap's loss cost: each overlapped point against its blocking twin of the same seed (target: "
             f"≤ +{(OVERLAP_TARGET - 1) * 100:.2f}% at τ = H, {MIN_SEEDS} seeds).", "",
             "| algorithm | overlapped point | blocking twin | seeds | loss ÷ blocking | target |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        verdict = ("met" if r["within"] else "not met") if r["decided"] else f"{r['seeds']} seeds: not decided"
        lines.append(f"| {r['algo']} | `{r['point']}` | `{r['twin']}` | {r['seeds']} | "
                     f"{_pm(r['ratio'], r['ratio_sd'], '.4f')} | {verdict} |")  # fmt: skip
    return lines


def plot(rows: list[dict], out: Path, name: str) -> list[Path]:
    """One figure per algorithm, ``<out>/<name>-<algo>.png``: loss ratio to NoLoCo-fp32 (± sd) against
    bits/param/step on a log axis, each point labelled, the targets drawn as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ref_bits = next((r["bits"] for r in rows if (r["algo"], r["point"]) == REFERENCE), None)
    for algo in dict.fromkeys(r["algo"] for r in rows):
        mine = [r for r in rows if r["algo"] == algo and r["ratio"] is not None and r["bits"] > 0]
        off = [r for r in mine if r["ratio"] > OFF_CHART]
        mine = [r for r in mine if r["ratio"] <= OFF_CHART]
        if not mine:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in mine:
            ax.errorbar(r["bits"], r["ratio"], yerr=r["ratio_sd"] or 0, fmt="o", capsize=3,
                        color="tab:red" if "noef" in r["point"] else "tab:blue")  # fmt: skip
            ax.annotate(r["point"], (r["bits"], r["ratio"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(LOSS_TARGET, ls="--", color="gray", lw=1, label="+1.5% of NoLoCo-fp32")
        ax.axvline(BITS_TARGET, ls=":", color="green", lw=1, label=f"{BITS_TARGET} bits/param/step")
        if ref_bits:
            ax.axvline(ref_bits / BYTES_TARGET, ls="--", color="green", lw=1, label="30× fewer bytes than fp32")
        ax.set_xscale("log")
        ax.set_xlabel("bits / parameter / inner step (bytes sent per worker × 8 ÷ params ÷ steps)" + "".join(
            f"\noff the chart: {r['point']} (loss ratio {r['ratio']:.3g})" for r in off))  # fmt: skip
        ax.set_ylabel("held-out loss ÷ NoLoCo-fp32 (same seed)")
        ax.set_title(f"{algo}: loss against bits (blue: error feedback, red: none)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"{name}-{algo}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def launch(run: Run, folder: Path, threads: int | None, env: dict[str, str] | None = None) -> dict | None:
    """Train ``run`` through ``train.py`` in a process of its own under ``folder`` (its output in ``<name>.log``;
    ``env``: variables added to this process's, e.g. ``CUDA_VISIBLE_DEVICES``); its summary, or None when it failed
    (a line on stderr)."""
    extra = [f"threads={threads}"] if threads and not any(o.startswith("threads=") for o in run.overrides) else []
    args = [sys.executable, str(common.ROOT / "train.py"), *run.overrides, *QUIET, *extra, f"run.dir={folder}",
            f"run.name={run.name}"]  # fmt: skip
    with open(folder / f"{run.name}.log", "w") as log:
        code = subprocess.run(
            args, stdout=log, stderr=subprocess.STDOUT, cwd=common.ROOT, env={**os.environ, **env} if env else None
        ).returncode
    summary = folder / run.name / "summary.json"
    if code or not summary.exists():
        print(f"   {run.name} FAILED (exit {code}; see {folder / run.name}.log)", file=sys.stderr)
        return None
    return json.loads(summary.read_text())


def write_plan(folder: Path, runs: list[Run], settings: str, args: list[str]) -> Path:
    """``<folder>/frontier-plan.json`` (folder created): this machine, the settings sentence, the arguments that
    ran the plan and its runs, so that ``--from-runs`` can redraw the report from the folder alone."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = {"machine": common.machine(), "settings": settings, "args": list(args), "runs": [asdict(r) for r in runs]}
    (folder / PLAN).write_text(json.dumps(plan, indent=1) + "\n")
    return folder / PLAN


def run_plan(runs: list[Run], folder: Path, parallel: int, settings: str) -> list[dict]:
    """Train every run, ``parallel`` at once (each with cores ÷ (parallel × workers) threads), printing a line per
    finished run; the measured points of the runs that finished."""
    write_plan(folder, runs, settings, sys.argv[1:])
    workers = max(load_config(list(r.overrides)).workers for r in runs)
    threads = max(1, usable_cores() // (parallel * workers))
    started, results = time.monotonic(), []

    def one(run: Run) -> dict | None:
        summary = launch(run, folder, threads)
        if summary is None:
            return None
        point = measure(run, summary)
        print(f"== {run.name}: loss {point['loss']:.4f}, {point['bits']:.4g} bits/param/step "
              f"({time.monotonic() - started:.0f} s so far)", flush=True)  # fmt: skip
        return point

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        results = [p for p in pool.map(one, runs) if p is not None]
    return results


def from_runs(folder: Path) -> tuple[list[dict], str, str, list[str] | None]:
    """The measured points of a finished stamp folder (its plan's runs that wrote a summary), its machine, the
    sentence on its settings and the arguments that ran it (None: not recorded)."""
    plan = json.loads((folder / PLAN).read_text())
    results = []
    for entry in plan["runs"]:
        run = Run(entry["algo"], entry["point"], int(entry["seed"]), tuple(entry["overrides"]))
        summary = folder / run.name / "summary.json"
        if summary.exists():
            results.append(measure(run, json.loads(summary.read_text())))
    return results, plan["machine"], plan.get("settings", ""), plan.get("args")


def _without_out(args: list[str]) -> list[str]:
    """``args`` less ``--out DIR``, ``--name NAME`` and ``--dry-run`` (a redraw says where it writes)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--out", "--name"):
            skip = True
        elif arg != "--dry-run" and not arg.startswith(("--out=", "--name=")):
            kept.append(arg)
    return kept


def report(results: list[dict], skipped: list[str], command: str, machine: str, pictures: list[Path],
           settings: str) -> tuple[list[str], list[dict]]:  # fmt: skip
    """The markdown report's lines and the table's rows."""
    rows = summarize(results)
    first = results[0] if results else {}
    lines = ["# The frontier: held-out loss against bits per parameter per step", "",
             f"Command: `{command}`  ", f"Machine: {machine}  ", f"Date: {time.strftime('%Y-%m-%d')}  ",
             f"Setting: {first.get('workers')} workers, {first.get('steps')} inner steps, H = "
             f"{first.get('outer_every')} ({(first.get('steps') or 0) // (first.get('outer_every') or 1)} outer "
             f"rounds), {(first.get('params') or 0) / 1e6:.2f}M parameters. {settings}", "",
             "x = bits/param/step = bytes sent per worker × 8 ÷ parameters ÷ inner steps; y = held-out loss ÷ "
             "NoLoCo-fp32's (same seed); mean ± sample standard deviation over seeds. Targets: within +1.5% of "
             f"NoLoCo-fp32 at ≥ {BYTES_TARGET:.0f}× fewer bytes; at ≤ {BITS_TARGET} bits/param/step.", "",
             *table(rows), "", *verdicts(rows)]  # fmt: skip
    costs = overlap_table(overlap_costs(results))
    lines += ["", *costs] if costs else []
    if skipped:
        lines += ["", *[f"- {line}" for line in skipped]]
    lines += ["", *[f"![loss ratio against bits/param/step]({p.name})" for p in pictures]]
    return lines, rows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--codecs", nargs="+", default=POINTS, metavar="POINT", help="CODEC[@noef][@fused][@k=v]")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--slow-codec", default="int4", help="NoLoCo's slow-weight term (comm.slow_codec)")
    parser.add_argument("--slow-every", type=int, default=8, help="rounds per slow-term exchange (outer.slow_every)")
    parser.add_argument("--tiny", action="store_true", help="the CPU budget instead of the GPU machine's")
    parser.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at once")
    parser.add_argument("--runs", type=Path, default=Path("runs/frontier"), help="where the runs' folders go")
    common.add_out(parser, "frontier")
    parser.add_argument("--name", default="frontier")
    parser.add_argument("--from-runs", type=Path, default=None, help="only redraw from a finished stamp folder")
    parser.add_argument("--dry-run", action="store_true", help="check every run's config, print the runs, run none")
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.parallel < 1 or args.slow_every < 1:
        parser.error("--parallel and --slow-every must be >= 1")
    budget = [*(TINY if args.tiny else GPU), *args.overrides]
    settings = (
        f"NoLoCo's lossy points: Δ through the codec every round, φ − φ₀ through {args.slow_codec} every "
        f"{args.slow_every} rounds (`outer.slow_every`; `@outer.slow_stagger=true`: 1/{args.slow_every} of it "
        "every round); fp32 and `@fused`: one fused message per round."
    )
    skipped: list[str] = []
    command = common.command("frontier")
    if args.from_runs:
        if not (args.from_runs / PLAN).exists():
            parser.error(f"{args.from_runs} holds no {PLAN} (not a frontier stamp folder)")
        results, machine, settings, ran = from_runs(args.from_runs)
        if ran is not None:  # the command that reruns the runs, not the redraw (which the report says it is)
            where = [*(["--out", str(args.out)] if Path(args.out) != common.RUNS / "frontier" else []),
                     *(["--name", args.name] if args.name != "frontier" else [])]  # fmt: skip
            command = common.command("frontier", [*_without_out(ran), *where])
            settings += f" Redrawn from the runs under `{args.from_runs}`."
    else:
        try:
            runs, skipped = plan_of(args.algos, args.codecs, args.seeds, args.slow_codec, args.slow_every, budget)
        except (ValueError, ConfigError) as exc:
            parser.error(str(exc))
        for line in skipped:
            print(line, file=sys.stderr)
        if args.dry_run:
            for run in runs:
                print(f"{run.name}: train.py {' '.join(run.overrides)}")
            return 0
        folder = args.runs / time.strftime("%Y%m%d-%H%M%S")
        results, machine = run_plan(runs, folder, args.parallel, settings), common.machine()
    if not results:
        print("error: no run finished", file=sys.stderr)
        return 2
    out = common.out_dir(args.out)
    rows = summarize(results)
    pictures = plot(rows, out, args.name)
    lines, rows = report(results, skipped, command, machine, pictures, settings)
    common.write_report(out, args.name, lines, {"rows": rows, "overlap": overlap_costs(results), "runs": results},
                        command=command, machine=machine)  # fmt: skip
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
