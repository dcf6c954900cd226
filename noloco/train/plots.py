"""Loss curves: held-out loss vs inner steps, vs wall-clock seconds and vs bytes sent per worker.

``python -m noloco.train.plots runs/a runs/b --out compare.png`` (or ``noloco-plot``) draws several
runs in one figure, one line per run (the mean over its workers); a single run also gets a faint
line per worker.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from noloco.train.metrics import read_metrics


def _eval_curves(run_dir: Path) -> tuple[dict[int, list[tuple]], list[tuple]]:
    """Per-worker [(step, wall, bytes_sent, eval_loss)] and the mean over workers per step."""
    per_worker: dict[int, list[tuple]] = defaultdict(list)
    for r in read_metrics(run_dir):
        if "eval_loss" in r:
            per_worker[r["worker"]].append((r["step"], r["wall"], r["bytes_sent"], r["eval_loss"]))
    by_step: dict[int, list[tuple]] = defaultdict(list)
    for points in per_worker.values():
        for point in points:
            by_step[point[0]].append(point)
    mean = []
    for step in sorted(by_step):
        pts = by_step[step]
        mean.append(
            (step, max(p[1] for p in pts), sum(p[2] for p in pts) / len(pts), sum(p[3] for p in pts) / len(pts))
        )
    return per_worker, mean


def reach(points: list[tuple], target: float) -> tuple[float, float, float] | None:
    """``(step, wall, bytes sent)`` at which the mean held-out loss first reaches ``target``, linear in between
    evaluations, or None when it never does. ``points``: ``(step, wall, bytes sent, loss)`` per evaluation in step
    order, as the mean curve of :func:`_eval_curves` gives them."""
    previous = None
    for point in points:
        loss = point[3]
        if loss <= target:
            if previous is None or previous[3] == loss:
                return point[0], point[1], point[2]
            frac = (previous[3] - target) / (previous[3] - loss)
            return tuple(a + (b - a) * frac for a, b in zip(previous[:3], point[:3]))  # type: ignore[return-value]
        previous = point
    return None


def _label(run_dir: Path) -> str:
    summary = Path(run_dir) / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        return f"{s['algo']} {s['codec']} (w={s['workers']})"
    return Path(run_dir).name


def plot_runs(run_dirs: list[Path], out: Path, title: str | None = None, target: float | None = None,
              labels: list[str] | None = None) -> Path:
    """Held-out loss vs steps, wall-clock and bytes, one line per run; ``target``: a dashed reference loss;
    ``labels``: one legend entry per run (default: algorithm, codec and workers from its summary)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    xlabels = ("inner step", "wall-clock (s)", "MB sent per worker")
    for index, run_dir in enumerate(run_dirs):
        per_worker, mean = _eval_curves(Path(run_dir))
        color = f"C{index}"
        if len(run_dirs) == 1:
            for worker, pts in sorted(per_worker.items()):
                for ax, col in zip(axes, (0, 1, 2)):
                    xs = [p[col] / (1e6 if col == 2 else 1) for p in pts]
                    ax.plot(
                        xs,
                        [p[3] for p in pts],
                        color=color,
                        alpha=0.25,
                        lw=1,
                        label="workers" if worker == 0 and col == 0 else None,
                    )
        for ax, col in zip(axes, (0, 1, 2)):
            xs = [p[col] / (1e6 if col == 2 else 1) for p in mean]
            ax.plot(
                xs,
                [p[3] for p in mean],
                color=color,
                lw=2,
                marker="o",
                ms=3,
                label=(labels[index] if labels else _label(Path(run_dir))) if col == 0 else None,
            )
    for ax, xlabel in zip(axes, xlabels):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target, color="0.3", ls="--", lw=1, label=f"target {target:.3f}" if ax is axes[0] else None)
    # bytes differ by orders of magnitude between methods (DDP vs outer steps): log scale past 1 MB
    axes[2].set_xscale("symlog", linthresh=1.0)
    axes[2].set_xlim(left=0)
    axes[0].set_ylabel("held-out loss (nats/token)")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot held-out loss vs steps, wall-clock and bytes for runs.")
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (runs/<name>)")
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    print(plot_runs(args.runs, args.out, args.title))


if __name__ == "__main__":
    main()
