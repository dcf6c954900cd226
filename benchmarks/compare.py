"""Compare training algorithms on one budget: same model, data, seeds and steps.

    python -m benchmarks.compare                         # noloco, diloco, ddp, avg on the default run
    python -m benchmarks.compare --algos noloco diloco -- steps=120 workers=8
    python -m benchmarks.compare --algos noloco/fp32 noloco/int8 noloco/int4/int8 --name codecs
    python -m benchmarks.compare --algos noloco/int4 noloco/int4/outer.lr=0.9 diloco/int4/outer.momentum=0.5 \\
        --target 5.1235 --name tuning -- steps=300
    python -m benchmarks.compare --out docs/results     # the committed docs/results/compare.*

Each entry is ``algo[/codec[/slow_codec]][/key=value...]`` (codec: ``comm.codec``; slow_codec:
``comm.slow_codec``; each ``key=value`` a config override of that entry alone, applied after the
overrides common to every run, as in :mod:`benchmarks.throttled`'s methods).

Runs each algorithm through the same entry point as ``train.py`` (the in-process backend), then
writes ``<out>/<name>.md`` (a table with the command and machine), ``<out>/<name>.json`` and
``<out>/<name>.png`` (held-out loss vs steps, wall-clock and bytes; one line per entry; past ten
entries, ``<name>-2.png``, … too, the entries split evenly over them, each figure repeating the first entry);
``<out>`` is ``runs/benchmarks/compare/`` unless ``--out`` says otherwise, ``<name>`` is ``compare`` unless
``--name`` does (without ``--name``, an earlier ``compare.md`` under ``runs/`` is kept: the new report is
``compare-<time>``). The default title names the budget: "on the default budget", or the common overrides.
``--target LOSS`` adds, per entry, the inner step at which the mean held-out loss over workers first
reaches LOSS (linear in between evaluations), with the wall-clock and MB sent per worker at that point,
and draws LOSS as a dashed line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/compare.py`: rerun as `python -m benchmarks.compare`, same arguments
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
    os.execv(sys.executable, [sys.executable, "-m", "benchmarks.compare", *sys.argv[1:]])

from benchmarks import common
from noloco.train.backends.local import launch as run
from noloco.train.config import ALGOS, ConfigError, load_config
from noloco.train.plots import eval_curves, plot_runs, reach

TITLE = "Algorithm comparison on the default budget"


def report_title(title: str | None, overrides: list[str]) -> str:
    """``title`` if given; else :data:`TITLE`, or, with overrides common to every run, the budget they set."""
    if title:
        return title
    return TITLE if not overrides else f"Algorithm comparison with {' '.join(overrides)}"


def report_name(name: str | None, out: Path, stamp: str) -> str:
    """``name`` if given; else ``compare``, unless a report of that name is in a folder outside docs/ (a run's
    folder, not the committed results): then ``compare-<stamp>``, so that no earlier report is overwritten."""
    if name:
        return name
    kept = (Path(out) / "compare.md").exists() and "docs" not in Path(out).parts
    return f"compare-{stamp}" if kept else "compare"


# Knobs an entry may vary (the seed, the outer optimizer's); --from-runs names a run by those that differ from the
# defaults.
KNOBS = (
    "run.seed",
    "outer.lr",
    "outer.pull",
    "outer.momentum",
    "outer.group_size",
    "outer.every",
    "outer.overlap",
    "outer.overlap_steps",
    "outer.fragments",
    "outer.slow_every",
)


def parse_entry(entry: str) -> list[str]:
    """``algo[/codec[/slow_codec]][/key=value...]`` → the config overrides of that entry.

    Raises ``ValueError`` with one line for an unknown algorithm, more than two codecs, a codec after an
    override, or an empty part (``noloco//int4``, ``noloco/int4/=3``).
    """
    algo, *parts = common.split_method(entry)
    if algo not in ALGOS:
        hint = " (config overrides common to every run go after --)" if "=" in algo else ""
        raise ValueError(f"entry {entry!r}: {algo!r} is not an algorithm ({', '.join(ALGOS)}){hint}")
    overrides = [f"outer.algo={algo}"]
    codecs, extra = [], []
    for part in parts:
        key, equals, _ = part.partition("=")
        if not key or (equals and not key.strip()):
            raise ValueError(f"entry {entry!r}: empty part; expected algo[/codec[/slow_codec]][/key=value...]")
        if equals:
            extra.append(part)
        elif extra:
            raise ValueError(f"entry {entry!r}: codec {part!r} after a key=value override; codecs come first")
        else:
            codecs.append(part)
    if len(codecs) > 2:
        raise ValueError(f"entry {entry!r}: {len(codecs)} codecs; at most two (codec and slow_codec)")
    overrides += [f"comm.{key}={codec}" for key, codec in zip(("codec", "slow_codec"), codecs)]
    return overrides + extra


def run_name(entry: str) -> str:
    """The run folder's name stem of an entry: ``noloco/int4/outer.lr=0.9`` → ``noloco-int4-outer.lr-0.9``."""
    return entry.replace("/", "-").replace(":", "").replace("=", "-")


def entry_of_run(run_dir: Path) -> str:
    """The entry that names a finished run: ``algo/codec[/slow_codec]`` from its summary (the slow codec when it
    differs from the codec), then ``/key=value`` for each of :data:`KNOBS` whose value in the run's
    ``config.yaml`` differs from the defaults of its algorithm."""
    summary = json.loads((run_dir / "summary.json").read_text())
    slow = summary.get("slow_codec")
    entry = f"{summary['algo']}/{summary['codec']}" + (f"/{slow}" if slow and slow != summary["codec"] else "")
    config = run_dir / "config.yaml"
    if not config.exists():
        return entry
    from omegaconf import OmegaConf

    ran, default = OmegaConf.load(config), load_config([f"outer.algo={summary['algo']}"])
    for key in KNOBS:
        value = OmegaConf.select(ran, key)
        if value is not None and value != OmegaConf.select(default, key):
            entry += f"/{key}={_knob(value)}"
    return entry


def _knob(value) -> str:
    """A knob's value as a command line writes it: ``0.9``, ``4``, ``true``, ``provisional``."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def figures(entries: int, per_figure: int = 10) -> list[list[int]]:
    """Entry indices per figure: one figure for up to ``per_figure`` entries (matplotlib's ten colours); past that,
    the entries after the first split evenly, in order, over the fewest figures of at most ``per_figure`` lines,
    each figure starting with entry 0 as the reference."""
    if entries <= per_figure:
        return [list(range(entries))]
    count = -(-(entries - 1) // (per_figure - 1))
    size, longer = divmod(entries - 1, count)
    chunks, start = [], 1
    for index in range(count):
        end = start + size + (index < longer)
        chunks.append([0, *range(start, end)])
        start = end
    return chunks


def _values(summaries: list[dict], key: str) -> str:
    """``summaries``' common value of ``key``, or each value and "per entry" when the entries differ."""
    values = sorted({s[key] for s in summaries})
    return str(values[0]) if len(values) == 1 else f"{', '.join(map(str, values))} (per entry)"


def rerun_args(args: argparse.Namespace) -> list[str]:
    """The arguments that rerun every entry of a ``--from-runs`` redraw (its entries named from the run folders)
    and write the same report."""
    default_out = common.RUNS / "compare"
    return [
        "--algos",
        *args.algos,
        "--name",
        args.name,
        *(["--title", args.title] if args.title != report_title(None, args.overrides) else []),
        *(["--runs", str(args.runs)] if args.runs != Path("runs/compare") else []),
        *(["--target", f"{args.target:g}"] if args.target is not None else []),
        *(["--out", str(args.out)] if Path(args.out) != default_out else []),
        *(["--", *args.overrides] if args.overrides else []),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--algos",
        nargs="+",
        default=["noloco", "diloco", "ddp", "avg"],
        help="entries algo[/codec[/slow_codec]][/key=value...]",
    )
    parser.add_argument("--name", default=None, help="output name: <out>/<name>.md/.png/.json (default: compare; "
                        "compare-<time> when runs/ holds one)")  # fmt: skip
    parser.add_argument("--title", default=None, help="heading of the markdown report (default: names the budget)")
    common.add_out(parser, "compare")
    parser.add_argument("--runs", type=Path, default=Path("runs/compare"))
    parser.add_argument("--note", default="", help="a sentence added under the table (e.g. about the machine)")
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        metavar="LOSS",
        help="report the step (and wall-clock, MB sent) at which each entry's held-out loss first reaches LOSS",
    )
    parser.add_argument(
        "--from-runs",
        nargs="+",
        type=Path,
        default=None,
        help="only redraw the table and plot from finished run folders",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = parser.parse_args()

    stamp = time.strftime("%Y%m%d-%H%M%S")
    summaries, run_dirs = [], []
    if args.from_runs:
        run_dirs = list(args.from_runs)
        summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs]
        args.algos = [entry_of_run(d) for d in run_dirs]
    else:
        configs = []
        for entry in args.algos:  # every entry checked before the first run starts
            try:
                extra = parse_entry(entry)
                configs.append(load_config([*args.overrides, *extra, f"run.dir={args.runs}",
                                            f"run.name={run_name(entry)}-{stamp}"]))  # fmt: skip
            except (ValueError, ConfigError) as exc:
                parser.error(f"{entry}: {exc}" if isinstance(exc, ConfigError) else str(exc))
        for entry, cfg in zip(args.algos, configs):
            print(f"== {entry}", flush=True)
            summaries.append(run(cfg))
            run_dirs.append(Path(summaries[-1]["run_dir"]))
    for entry, summary in zip(args.algos, summaries):
        summary["entry"] = entry

    out = common.out_dir(args.out)
    args.name, args.title = report_name(args.name, out, stamp), report_title(args.title, args.overrides)
    pictures = []
    for index, chunk in enumerate(figures(len(run_dirs))):
        png = out / (f"{args.name}.png" if index == 0 else f"{args.name}-{index + 1}.png")
        plot_runs([run_dirs[i] for i in chunk], png, title="held-out loss, same budget", target=args.target,
                  labels=[args.algos[i] for i in chunk])  # fmt: skip
        pictures.append(f"![held-out loss vs steps, wall-clock and bytes]({png.name})")
    command = common.command("compare", rerun_args(args) if args.from_runs else None)
    machine = common.machine()
    unigram = summaries[0]["unigram_eval_loss"]
    lines = [
        f"# {args.title}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Date: {time.strftime('%Y-%m-%d')}  ",
        f"Setting: {summaries[0]['workers']} workers, {_values(summaries, 'steps')} inner steps each, "
        f"H = {_values(summaries, 'outer_every')}, {summaries[0]['params'] / 1e6:.2f}M-parameter model. "
        f"Unigram baseline held-out loss: {unigram:.4f}.",
    ]
    header = "| entry | codec (Δ / φ) | final held-out loss | consensus distance | MB sent per worker | wall (s) |"
    if args.target is not None:
        lines += [
            "",
            f"Target: held-out loss {args.target:g}. Step at target = the first inner step at which the mean "
            "held-out loss over workers reaches it, interpolated linearly between evaluations; wall-clock "
            "(slowest worker) and MB sent per worker at that point likewise.",
        ]
        header += " step at target | wall at target (s) | MB sent at target |"
    lines += ["", header, "|---" * header.count(" | ") + "|---|"]
    for s, run_dir in zip(summaries, run_dirs):
        row = (
            f"| {s['entry']} | {s['codec']} / {s.get('slow_codec') or s['codec']} | {s['final_eval_loss']:.4f} | "
            f"{s['consensus_distance']:.2e} | {s['bytes_sent_per_worker'] / 1e6:.1f} | {s['wall_seconds']:.0f} |"
        )
        if args.target is not None:
            hit = reach(eval_curves(Path(run_dir))[1], args.target)
            s["target"] = args.target
            s["step_to_target"], s["wall_to_target"], s["bytes_to_target"] = hit or (None, None, None)
            row += " not reached | – | – |" if hit is None else f" {hit[0]:.0f} | {hit[1]:.1f} | {hit[2] / 1e6:.2f} |"
        lines.append(row)
    if args.from_runs:
        lines += ["", "Table and plot redrawn with `--from-runs` from finished run folders; the command above reruns "
                  "every entry (common overrides as given to the redraw)."]  # fmt: skip
    if args.note:
        lines += ["", args.note]
    lines += ["", *pictures, ""]
    common.write_report(out, args.name, lines, summaries, command=command, machine=machine)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
