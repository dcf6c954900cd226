"""Loss curves: held-out loss vs inner steps, vs wall-clock seconds and vs bytes sent per worker.

``python -m noloco.train.plots runs/a runs/b --out compare.png`` (or ``noloco-plot``) draws several
runs in one figure, one line per run (the mean over its workers); a single run also gets a faint
line per worker. Any run folder works: a local or torch run (``metrics.jsonl`` or
``metrics.rank<r>.jsonl``), a swarm peer's ``runs/<run>/peer-<name>/``, a folder without a summary
(a run still going, or one that crashed). A folder that is missing, holds no metrics or no held-out
evaluation yet is an error: one line on stderr, exit code 2, nothing written.

Legend: ``<algo> <codec> (w=<workers>)`` from ``summary.json`` (else ``config.yaml``); runs that would
share a label also name what differs between their ``config.yaml`` files (``backend=torch``,
``outer.momentum=0.1``), or failing that their folder names.

Bytes: a worker's bytes are what all of its processes sent: the outer exchange and, for a
``backend=torch`` worker of several processes (``inner.processes > 1``), its DDP gradient all-reduce
(``inner_bytes_sent`` of each metrics record; for runs whose records lack it, the summary's
``inner_bytes_sent_per_process`` totals spread linearly over the steps — every inner step all-reduces
the same gradient, so that is exact up to resumes — and the axis says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from noloco.train.metrics import metrics_files, read_metrics

#: config keys that say where or how a run was recorded, not what was trained (never named in labels);
#: a key also covers everything under it (``log`` covers ``log.plot``).
BOOKKEEPING = (
    "run.name",
    "run.dir",
    "resume",
    "log",
    "checkpoint",
    "data.cache_dir",
    "peer.run_key",
    "peer.initial_peers",
    "peer.host_maddrs",
    "peer.announce_maddrs",
)
_MAX_KEYS = 3  # differing config keys named in one label

Point = tuple  # (step, wall, bytes sent, eval loss)


def _summary(run_dir: Path) -> dict:
    """``summary.json`` of ``run_dir``, or {} when there is none (or it cannot be read)."""
    try:
        data = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _config(run_dir: Path) -> dict | None:
    """``config.yaml`` of ``run_dir`` flattened to dotted keys (``outer.momentum``), or None without one."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(path)
        try:
            tree = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 - an interpolation that no longer resolves: compare the raw text
            tree = OmegaConf.to_container(cfg, resolve=False)
    except Exception:  # noqa: BLE001 - unreadable YAML: treated as no config
        return None
    return _flatten(tree) if isinstance(tree, dict) else None


def _backend(summary: dict, config: dict):
    """The spec of the backend a run folder names (:data:`~noloco.train.backends.BACKENDS`; local's if none)."""
    from noloco.train.backends import BACKENDS

    return BACKENDS.get(str(summary.get("backend") or config.get("backend") or "local"), BACKENDS["local"])


def _processes(summary: dict, config: dict) -> int:
    """Processes per worker (``inner.processes`` of a torch run), 1 elsewhere."""
    k = summary.get("processes_per_worker")
    if k is None and _backend(summary, config).processes_per_worker:
        k = config.get("inner.processes")
    try:
        return max(1, int(k or 1))
    except (TypeError, ValueError):
        return 1


def _workers(summary: dict, config: dict) -> int | None:
    """Workers of the run: a swarm peer is a run of one worker (older peer summaries lack ``workers``)."""
    if isinstance(summary.get("workers"), int):
        return summary["workers"]
    if "peer" in summary or not _backend(summary, config).fixed_world:
        return 1
    for key in ("bytes_sent_by_worker", "final_eval_loss_per_worker"):
        if isinstance(summary.get(key), list) and summary[key]:
            return len(summary[key])
    return config.get("workers") if isinstance(config.get("workers"), int) else None


def _curves(run_dir: Path, inner: bool = True) -> tuple[dict[int, list[Point]], list[Point], str | None]:
    """:func:`eval_curves` plus where inner bytes came from: "records", "summary" (linear) or None."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        return {}, [], None
    summary, config = _summary(run_dir), _config(run_dir) or {}
    k = _processes(summary, config)
    # backend=torch records are keyed by process rank (worker w = ranks w·k … w·k+k−1)
    workers = _workers(summary, config)
    by_rank = k > 1 and (workers is None or max(r["worker"] for r in records) >= workers)
    totals = summary.get("inner_bytes_sent_per_process") if inner and k > 1 else None
    totals = totals if isinstance(totals, list) else None
    first = min(r["step"] for r in records)
    last = summary.get("steps") if isinstance(summary.get("steps"), int) else max(r["step"] for r in records)
    logged = inner and k > 1 and any("inner_bytes_sent" in r for r in records)  # the loop logs it: use it
    source = None

    def inner_bytes(record: dict, worker: int) -> float:
        nonlocal source
        if logged:
            sent = record.get("inner_bytes_sent") or 0
            source = source or ("records" if sent else None)
            return sent
        if totals is None:
            return 0
        ranks = [record["worker"]] if by_rank else range(worker * k, worker * k + k)
        total = sum(t for r, t in enumerate(totals) if r in ranks and isinstance(t, (int, float)))
        sent = total * (min(max(record["step"] - first, 0) / (last - first), 1.0) if last > first else 1.0)
        source = source or ("summary" if sent else None)
        return sent

    # worker -> step -> process -> point; a later record of the same process and step (a restarted swarm
    # peer's current attempt after metrics.attempt-<k>.jsonl) replaces the earlier one
    grouped: dict[int, dict[int, dict[int, Point]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        if r.get("eval_loss") is None:
            continue
        worker = r["worker"] // k if by_rank else r["worker"]
        sent = r["bytes_sent"] + inner_bytes(r, worker)
        grouped[worker][r["step"]][r["worker"]] = (r["step"], r["wall"], sent, r["eval_loss"])
    per_worker: dict[int, list[Point]] = {}
    for worker in sorted(grouped):
        per_worker[worker] = [
            (step, max(p[1] for p in pts), sum(p[2] for p in pts), sum(p[3] for p in pts) / len(pts))
            for step, pts in ((s, list(grouped[worker][s].values())) for s in sorted(grouped[worker]))
        ]
    by_step: dict[int, list[Point]] = defaultdict(list)
    for points in per_worker.values():
        for point in points:
            by_step[point[0]].append(point)
    mean = [
        (step, max(p[1] for p in pts), sum(p[2] for p in pts) / len(pts), sum(p[3] for p in pts) / len(pts))
        for step, pts in sorted(by_step.items())
    ]
    return per_worker, mean, source


def eval_curves(run_dir: Path, *, inner: bool = True) -> tuple[dict[int, list[tuple]], list[tuple]]:
    """Per-worker [(step, wall, bytes_sent, eval_loss)] and the mean over workers per step (wall: the slowest
    worker's). A worker's bytes are all its processes sent: the outer exchange plus, with ``inner`` (default),
    the inner DDP gradient all-reduce of a torch worker of several processes (module docstring). Empty for a
    folder without metrics."""
    per_worker, mean, _ = _curves(run_dir, inner)
    return per_worker, mean


def reach(points: list[tuple], target: float) -> tuple[float, float, float] | None:
    """``(step, wall, bytes sent)`` at which the mean held-out loss first reaches ``target``, linear in between
    evaluations, or None when it never does. ``points``: ``(step, wall, bytes sent, loss)`` per evaluation in step
    order, as the mean curve of :func:`eval_curves` gives them."""
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


def _base_label(summary: dict, config: dict) -> str | None:
    """``<algo> <codec>[/<slow codec>] (w=<workers>)``, or None when neither file names algorithm and codec."""
    algo = summary.get("algo") or config.get("outer.algo")
    codec = summary.get("codec") or config.get("comm.codec")
    if not algo or not codec:
        return None
    slow = summary.get("slow_codec") or config.get("comm.slow_codec")
    label = f"{algo} {codec}" + (f"/{slow}" if slow and slow != codec else "")
    workers = _workers(summary, config)
    return label + (f" (w={workers})" if workers is not None else "")


def _label(run_dir: Path) -> str:
    """The legend entry of one run on its own (algorithm, codec, workers; else the folder name)."""
    run_dir = Path(run_dir)
    return _base_label(_summary(run_dir), _config(run_dir) or {}) or run_dir.name


def _bookkeeping(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in BOOKKEEPING)


def _value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


_UNSET = object()


def _differences(configs: list[dict]) -> list[str]:
    """Keys (in config order, bookkeeping left out) whose values are not all equal across ``configs``."""
    keys = list(dict.fromkeys(key for cfg in configs for key in cfg))
    return [key for key in keys if not _bookkeeping(key) and len({repr(cfg.get(key, _UNSET)) for cfg in configs}) > 1]


def _folder_names(run_dirs: list[Path]) -> list[str]:
    """Each folder's name, with as many parent folders as it takes to tell it from the others."""
    parts = [Path(d).resolve().parts for d in run_dirs]
    names = []
    for index, mine in enumerate(parts):
        for depth in range(1, len(mine) + 1):
            name = "/".join(mine[-depth:])
            if all("/".join(p[-depth:]) != name for i, p in enumerate(parts) if i != index and p != mine):
                break
        names.append(name)
    return names


def run_labels(run_dirs: list[Path]) -> list[str]:
    """One distinct legend entry per run: ``<algo> <codec> (w=<workers>)``; runs that would share one also name
    the config keys that differ between them (``noloco int4 (w=4) backend=torch``), or get their folder names
    when their configs are missing or the same."""
    run_dirs = [Path(d) for d in run_dirs]
    summaries = [_summary(d) for d in run_dirs]
    configs = [_config(d) for d in run_dirs]
    folders = _folder_names(run_dirs)
    labels = [_base_label(s, c or {}) or f for s, c, f in zip(summaries, configs, folders)]
    groups: dict[str, list[int]] = defaultdict(list)
    for index, label in enumerate(labels):
        groups[label].append(index)
    for label, members in groups.items():
        if len(members) == 1:
            continue
        known = [i for i in members if configs[i] is not None]
        keys = _differences([configs[i] for i in known]) if len(known) > 1 else []
        for i in members:
            if i not in known or not keys:
                labels[i] = folders[i]
                continue
            shown = [f"{key}={_value(configs[i][key]) if key in configs[i] else 'unset'}" for key in keys[:_MAX_KEYS]]
            more = f" +{len(keys) - _MAX_KEYS} more" if len(keys) > _MAX_KEYS else ""
            labels[i] = f"{label} {', '.join(shown)}{more}"
    # still the same (configs that differ only past the keys shown, or the same folder twice): the folder name,
    # then a count
    labels = [folders[i] if labels.count(label) > 1 else label for i, label in enumerate(labels)]
    counts, seen = Counter(labels), Counter()
    for index, label in enumerate(labels):
        if counts[label] > 1:
            seen[label] += 1
            labels[index] = f"{label} #{seen[label]}"
    return labels


def _checked(run_dir: Path) -> tuple[dict[int, list[Point]], list[Point], str | None]:
    """:func:`_curves` of a run folder that has something to plot; ``ValueError`` naming it otherwise."""
    if not run_dir.exists():
        raise ValueError(f"{run_dir}: no such run folder")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a folder")
    if not metrics_files(run_dir):
        peers = sorted(p for p in run_dir.glob("peer-*") if p.is_dir())
        hint = f" (a swarm run: plot its peer folders, e.g. {peers[0]})" if peers else ""
        raise ValueError(f"{run_dir}: no metrics*.jsonl in the folder{hint}")
    try:
        curves = _curves(run_dir)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{run_dir}: unreadable metrics ({type(exc).__name__}: {exc})") from None
    if not curves[1]:
        raise ValueError(f"{run_dir}: no held-out evaluation (eval_loss) in its metrics yet")
    return curves


def plot_runs(
    run_dirs: list[Path],
    out: Path,
    title: str | None = None,
    target: float | None = None,
    labels: list[str] | None = None,
) -> Path:
    """Held-out loss vs steps, wall-clock and bytes, one line per run; ``target``: a dashed reference loss;
    ``labels``: one legend entry per run (default: :func:`run_labels`). Raises ``ValueError`` naming the folder
    when a run folder is missing or has no held-out evaluation to plot; then nothing is written."""
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("no run folders given")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run folders")
    curves = [_checked(d) for d in run_dirs]  # every folder checked before anything is drawn or written
    names = list(labels) if labels is not None else run_labels(run_dirs)
    sources = {source for _, _, source in curves if source}
    bytes_axis = "MB sent per worker"
    if sources:
        bytes_axis += " (outer + inner, inner linear in step)" if "summary" in sources else " (outer + inner)"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    xlabels = ("inner step", "wall-clock (s)", bytes_axis)
    for index, (per_worker, mean, _) in enumerate(curves):
        color = f"C{index}"
        if len(run_dirs) == 1:
            for n, (_, pts) in enumerate(sorted(per_worker.items())):
                for ax, col in zip(axes, (0, 1, 2)):
                    xs = [p[col] / (1e6 if col == 2 else 1) for p in pts]
                    ax.plot(
                        xs,
                        [p[3] for p in pts],
                        color=color,
                        alpha=0.25,
                        lw=1,
                        label="workers" if n == 0 and col == 0 else None,
                    )
        for ax, col in zip(axes, (0, 1, 2)):
            xs = [p[col] / (1e6 if col == 2 else 1) for p in mean]
            ax.plot(xs, [p[3] for p in mean], color=color, lw=2, marker="o", ms=3,
                    label=names[index] if col == 0 else None)  # fmt: skip
    for ax, xlabel in zip(axes, xlabels):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target, color="0.3", ls="--", lw=1, label=f"target {target:.3f}" if ax is axes[0] else None)
    # bytes differ by orders of magnitude between methods (DDP vs outer steps): log scale past 1 MB
    axes[2].set_xscale("symlog", linthresh=1.0)
    axes[2].set_xlim(left=0)
    axes[0].set_ylabel("held-out loss (nats/token)")
    if title:
        fig.suptitle(title)
    if len(run_dirs) == 1:
        axes[0].legend(fontsize=8)
        fig.tight_layout()
    else:  # several runs: the legend goes under the panels, where it covers no curve
        handles, entries = axes[0].get_legend_handles_labels()
        rows = -(-len(entries) // 4)
        fig.set_figheight(4.2 + 0.25 * rows)
        fig.legend(handles, entries, loc="lower center", ncol=min(4, len(entries)), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.25 * rows / fig.get_figheight() + 0.02, 1, 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """The ``noloco-plot`` command; returns 0, or 2 after one line on stderr when a run cannot be plotted."""
    parser = argparse.ArgumentParser(description="Plot held-out loss vs steps, wall-clock and bytes for runs.")
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (runs/<name>, runs/<name>/peer-<peer>)")
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        out = plot_runs(args.runs, args.out, args.title)
    except ValueError as exc:
        print(f"noloco-plot: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
