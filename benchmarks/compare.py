"""Compare training algorithms on one budget: same model, data, seeds and steps.

    python benchmarks/compare.py                         # noloco, diloco, ddp, avg on the default run
    python benchmarks/compare.py --algos noloco diloco -- steps=120 workers=8

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
    parser.add_argument("--algos", nargs="+", default=["noloco", "diloco", "ddp", "avg"])
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--runs", type=Path, default=Path("runs/compare"))
    parser.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = parser.parse_args()

    stamp = time.strftime("%Y%m%d-%H%M%S")
    summaries, run_dirs = [], []
    for algo in args.algos:
        cfg = load_config([*args.overrides, f"outer.algo={algo}", f"run.dir={args.runs}", f"run.name={algo}-{stamp}"])
        print(f"== {algo}", flush=True)
        summaries.append(run(cfg))
        run_dirs.append(Path(summaries[-1]["run_dir"]))

    args.out.mkdir(parents=True, exist_ok=True)
    plot_runs(run_dirs, args.out / "compare.png", title="held-out loss, default budget")
    command = "python benchmarks/compare.py " + " ".join(
        ["--algos", *args.algos, *(["--", *args.overrides] if args.overrides else [])]
    )
    unigram = summaries[0]["unigram_eval_loss"]
    lines = [
        "# Algorithm comparison on the default budget",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine()}  ",
        f"Date: {time.strftime('%Y-%m-%d')}  ",
        f"Setting: {summaries[0]['workers']} workers, {summaries[0]['steps']} inner steps each, "
        f"H = {summaries[0]['outer_every']}, {summaries[0]['params'] / 1e6:.2f}M-parameter model, fp32 exchange. "
        f"Unigram baseline held-out loss: {unigram:.4f}.",
        "",
        "| algorithm | final held-out loss | consensus distance | MB sent per worker | wall (s) | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['algo']} | {s['final_eval_loss']:.4f} | {s['consensus_distance']:.2e} | "
            f"{s['bytes_sent_per_worker'] / 1e6:.1f} | {s['wall_seconds']:.0f} | {s['tokens_per_second']:,.0f} |"
        )
    lines += ["", "![held-out loss vs steps, wall-clock and bytes](compare.png)", ""]
    (args.out / "compare.md").write_text("\n".join(lines))
    (args.out / "compare.json").write_text(json.dumps(summaries, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
