"""Compare training algorithms on one budget: same model, data, seeds and steps.

    python benchmarks/compare.py                         # noloco, diloco, ddp, avg on the default run
    python benchmarks/compare.py --algos noloco diloco -- steps=120 workers=8
    python benchmarks/compare.py --algos noloco/fp32 noloco/int8 noloco/int4/int8 --name codecs

Each entry is ``algo[/codec[/slow_codec]]`` (codec: ``comm.codec``; slow_codec: ``comm.slow_codec``).

Runs each algorithm through the same entry point as ``train.py`` (the in-process backend), then
writes ``docs/results/compare.md`` (a table with the command and machine) and
``docs/results/compare.png`` (held-out loss vs steps, wall-clock and bytes; one line per algorithm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from noloco.train.config import load_config
from noloco.train.plots import plot_runs
from noloco.train.runner import run


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--algos", nargs="+", default=["noloco", "diloco", "ddp", "avg"], help="entries algo[/codec[/slow_codec]]"
    )
    parser.add_argument("--name", default="compare", help="output name: docs/results/<name>.md/.png/.json")
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--runs", type=Path, default=Path("runs/compare"))
    parser.add_argument("--note", default="", help="a sentence added under the table (e.g. about the machine)")
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
        args.algos = [
            f"{s['algo']}/{s['codec']}" + (f"/{s['slow_codec']}" if s.get("slow_codec") else "") for s in summaries
        ]
    for entry in [] if args.from_runs else args.algos:
        algo, *codecs = entry.split("/")
        extra = [f"outer.algo={algo}"]
        if codecs:
            extra.append(f"comm.codec={codecs[0]}")
        if len(codecs) > 1:
            extra.append(f"comm.slow_codec={codecs[1]}")
        label = entry.replace("/", "-").replace(":", "")
        cfg = load_config([*args.overrides, *extra, f"run.dir={args.runs}", f"run.name={label}-{stamp}"])
        print(f"== {entry}", flush=True)
        summaries.append(run(cfg))
        run_dirs.append(Path(summaries[-1]["run_dir"]))

    args.out.mkdir(parents=True, exist_ok=True)
    plot_runs(run_dirs, args.out / f"{args.name}.png", title="held-out loss, same budget")
    command = "python benchmarks/compare.py " + " ".join(
        ["--algos", *args.algos, "--name", args.name, *(["--", *args.overrides] if args.overrides else [])]
    )
    unigram = summaries[0]["unigram_eval_loss"]
    lines = [
        "# Algorithm comparison on the default budget",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}  ",
        f"Date: {time.strftime('%Y-%m-%d')}  ",
        f"Setting: {summaries[0]['workers']} workers, {summaries[0]['steps']} inner steps each, "
        f"H = {summaries[0]['outer_every']}, {summaries[0]['params'] / 1e6:.2f}M-parameter model. "
        f"Unigram baseline held-out loss: {unigram:.4f}.",
        "",
        "| algorithm | codec (Δ / φ) | final held-out loss | consensus distance | MB sent per worker | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['algo']} | {s['codec']} / {s.get('slow_codec') or s['codec']} | {s['final_eval_loss']:.4f} | "
            f"{s['consensus_distance']:.2e} | {s['bytes_sent_per_worker'] / 1e6:.1f} | {s['wall_seconds']:.0f} |"
        )
    if args.note:
        lines += ["", args.note]
    lines += ["", f"![held-out loss vs steps, wall-clock and bytes]({args.name}.png)", ""]
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    (args.out / f"{args.name}.json").write_text(json.dumps(summaries, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
