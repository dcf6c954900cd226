"""``noloco.train.plots`` on run folders written by hand (no training): labels, errors, inner DDP bytes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from noloco.train.metrics import read_metrics
from noloco.train.plots import eval_curves, main, plot_runs, run_labels

CONFIG = {
    "run": {"name": None, "dir": "runs", "seed": 0},
    "workers": 2,
    "backend": "local",
    "steps": 10,
    "inner": {"processes": 1},
    "outer": {"algo": "noloco", "every": 5, "momentum": 0.5},
    "comm": {"codec": "int4", "slow_codec": None},
    "log": {"plot": True},
    "resume": None,
}


def _yaml(tree: dict, indent: int = 0) -> str:
    """A tiny YAML writer (what config.yaml holds: nested mappings of scalars)."""
    lines = []
    for key, value in tree.items():
        if isinstance(value, dict):
            lines.append(f"{' ' * indent}{key}:")
            lines.append(_yaml(value, indent + 2))
        else:
            lines.append(f"{' ' * indent}{key}: {json.dumps(value)}")
    return "\n".join(lines)


def write_run(folder: Path, *, summary: dict | None = None, config: dict | None = None, ranks: int = 2,
              steps=(0, 5, 10), records=None, filename=lambda rank: "metrics.jsonl") -> Path:  # fmt: skip
    """A run folder: one eval record per rank and step (outer bytes 1 MB per step, loss falling), plus the
    summary and config given."""
    folder.mkdir(parents=True)
    if records is None:
        records = [
            {
                "worker": rank,
                "step": step,
                "loss": 5.0,
                "bytes_sent": step * 1_000_000,
                "bytes_received": 0,
                "wall": step * 0.1,
                "eval_loss": 6.0 - step / 10,
            }  # fmt: skip
            for step in steps
            for rank in range(ranks)
        ]
    for record in records:
        with (folder / filename(record["worker"])).open("a") as f:
            f.write(json.dumps(record) + "\n")
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (folder / "config.yaml").write_text(_yaml(config) + "\n")
    return folder


def with_(tree: dict, **dotted) -> dict:
    """A deep copy of ``tree`` with ``a__b=value`` set at ``a.b``."""
    tree = json.loads(json.dumps(tree))
    for key, value in dotted.items():
        node, *path = [tree, *key.split("__")]
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return tree


SUMMARY = {"algo": "noloco", "codec": "int4", "slow_codec": "int4", "backend": "local", "workers": 2, "steps": 10}


def test_peer_folder_without_workers_plots(tmp_path, capsys):
    # an older swarm peer's summary: no "workers" key; its config says workers: 4 (the swarm's), it is one worker
    old = {k: v for k, v in SUMMARY.items() if k != "workers"} | {"backend": "hivemind", "peer": "a", "rank": 3}
    peer = write_run(tmp_path / "swarm" / "peer-a", summary=old, config=with_(CONFIG, backend="hivemind", workers=4),
                     ranks=1)  # fmt: skip
    assert run_labels([peer]) == ["noloco int4 (w=1)"]
    out = tmp_path / "peer.png"
    assert main([str(peer), "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    # the swarm's folder itself holds no metrics: the error points at its peer folders
    assert main([str(tmp_path / "swarm"), "--out", str(tmp_path / "swarm.png")]) == 2
    assert "peer-a" in capsys.readouterr().err
    assert not (tmp_path / "swarm.png").exists()


def test_labels_without_summary_or_config(tmp_path):
    bare = write_run(tmp_path / "bare")
    config_only = write_run(tmp_path / "crashed", config=with_(CONFIG, comm__slow_codec="int8"))
    assert run_labels([bare, config_only]) == ["bare", "noloco int4/int8 (w=2)"]


@pytest.mark.parametrize("case", ["missing", "empty", "no-eval"])
def test_unplottable_folder_exits_2_and_writes_nothing(tmp_path, capsys, case):
    run = tmp_path / "run"
    if case == "empty":
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(SUMMARY))
    elif case == "no-eval":
        write_run(run, records=[{"worker": 0, "step": 1, "loss": 5.0, "bytes_sent": 0, "wall": 0.1}])
    good = write_run(tmp_path / "good", summary=SUMMARY)
    out = tmp_path / "plots" / "curves.png"
    assert main([str(good), str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("noloco-plot: error: ") and str(run) in err
    assert not out.exists() and not out.parent.exists()
    with pytest.raises(ValueError, match=re.escape(str(run))):
        plot_runs([run], out)


def test_same_label_runs_name_the_differing_key(tmp_path):
    runs = [
        write_run(tmp_path / "a", summary=SUMMARY, config=with_(CONFIG, run__name="a")),
        write_run(
            tmp_path / "b", summary=SUMMARY | {"backend": "torch"}, config=with_(CONFIG, run__name="b", backend="torch")
        ),  # fmt: skip
        write_run(tmp_path / "c", summary=SUMMARY, config=with_(CONFIG, run__name="c", outer__momentum=0.1)),
        write_run(tmp_path / "d", summary=SUMMARY | {"workers": 4}, config=with_(CONFIG, workers=4)),
    ]
    assert run_labels(runs) == [
        "noloco int4 (w=2) backend=local, outer.momentum=0.5",
        "noloco int4 (w=2) backend=torch, outer.momentum=0.5",
        "noloco int4 (w=2) backend=local, outer.momentum=0.1",
        "noloco int4 (w=4)",  # already distinct: nothing added
    ]
    assert run_labels(runs[:2]) == ["noloco int4 (w=2) backend=local", "noloco int4 (w=2) backend=torch"]


def test_same_configs_or_none_fall_back_to_folder_names(tmp_path):
    same = [write_run(tmp_path / n, summary=SUMMARY, config=with_(CONFIG, run__name=n)) for n in ("x", "y")]
    assert run_labels(same) == ["x", "y"]
    bare = [write_run(tmp_path / n / "peer-a", summary=SUMMARY) for n in ("s1", "s2")]
    assert run_labels(bare) == ["s1/peer-a", "s2/peer-a"]
    assert run_labels([same[0], same[0]]) == ["x #1", "x #2"]


def _torch_run(folder: Path, logged: bool) -> Path:
    """backend=torch, 2 workers × 2 processes: records keyed by rank; only each worker's first process
    exchanges (outer bytes); every process all-reduces gradients, 300 B per step."""
    records = []
    for step in (0, 5, 10):
        for rank in range(4):
            record = {"worker": rank, "step": step, "loss": 5.0, "bytes_sent": step * 1000 if rank % 2 == 0 else 0,
                      "bytes_received": 0, "wall": step * 0.1, "eval_loss": 6.0 - step / 10}  # fmt: skip
            if logged:
                record["inner_bytes_sent"] = step * 300
            records.append(record)
    summary = SUMMARY | {"backend": "torch", "processes_per_worker": 2, "inner_bytes_sent_per_process": [3000] * 4}
    return write_run(folder, summary=summary, config=with_(CONFIG, backend="torch", inner__processes=2),
                     records=records, filename=lambda rank: f"metrics.rank{rank}.jsonl")  # fmt: skip


@pytest.mark.parametrize("logged", [True, False], ids=["from-records", "from-summary"])
def test_inner_bytes_are_added_per_worker(tmp_path, logged):
    run = _torch_run(tmp_path / "torch", logged)
    per_worker, mean = eval_curves(run)
    assert sorted(per_worker) == [0, 1]  # ranks 0,1 → worker 0; ranks 2,3 → worker 1
    # a worker at step 10: its leader's 10 kB outer + 2 processes × 3 kB inner
    assert [p[2] for p in mean] == [0, 5000 + 3000, 10000 + 6000]
    assert [p[2] for p in eval_curves(run, inner=False)[1]] == [0, 5000, 10000]
    assert [p[3] for p in per_worker[1]] == pytest.approx([6.0, 5.5, 5.0])


def test_bytes_axis_says_outer_plus_inner(tmp_path, monkeypatch):
    import matplotlib.figure

    seen = []

    def savefig(fig, out, **kwargs):  # the bytes panel's axis label instead of a picture
        seen.append(fig.axes[2].get_xlabel())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_runs([_torch_run(tmp_path / "fallback", logged=False)], tmp_path / "a.png")
    plot_runs([_torch_run(tmp_path / "logged", logged=True)], tmp_path / "b.png")
    plot_runs([write_run(tmp_path / "local", summary=SUMMARY)], tmp_path / "c.png")
    assert seen == [
        "MB sent per worker (outer + inner, inner linear in step)",
        "MB sent per worker (outer + inner)",
        "MB sent per worker",
    ]


def test_several_runs_plot_and_truncated_last_line_is_skipped(tmp_path):
    a = write_run(tmp_path / "a", summary=SUMMARY, config=with_(CONFIG, run__name="a"))
    b = _torch_run(tmp_path / "b", logged=True)
    with (a / "metrics.jsonl").open("a") as f:
        f.write('{"worker": 0, "step": 11, "lo')  # the process died mid-line
    assert max(r["step"] for r in read_metrics(a)) == 10
    out = plot_runs([a, b], tmp_path / "both.png", title="t", target=5.2)
    assert out.stat().st_size > 0


def test_the_legend_of_several_runs_covers_no_panel(tmp_path, monkeypatch):
    import matplotlib.figure

    boxes = []

    def savefig(fig, out, **kwargs):  # where the legend and the panels are drawn, instead of a picture
        renderer = fig.canvas.get_renderer()
        boxes.append(([leg.get_window_extent(renderer) for leg in fig.legends + [ax.get_legend() for ax in fig.axes]
                       if leg is not None], [ax.get_window_extent(renderer) for ax in fig.axes]))  # fmt: skip

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    runs = [write_run(tmp_path / f"r{i}", summary=SUMMARY, config=with_(CONFIG, run__seed=i)) for i in range(6)]
    plot_runs(runs, tmp_path / "many.png", title="t", target=5.2)
    ((legends, panels),) = boxes
    assert len(legends) == 1
    assert not any(legends[0].overlaps(panel) for panel in panels)
