"""wandb logging (``log.wandb.*``, noloco/train/metrics.py): offline runs of the real ``wandb`` package, one per
worker and grouped by the run's name, holding exactly the scalars TensorBoard got; without the package, a run
that asks for it is refused at start-up.

The offline runs are read back from wandb's own files (``run-<id>.wandb``: a leveldb-style log of protobuf
``Record`` messages, the format ``wandb sync`` uploads), so what is checked is what would reach wandb.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from noloco.train.cli import main  # noqa: E402
from noloco.train.metrics import read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32768  # the log's block size; a record's 7-byte header: crc32, length (little-endian u16), type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path):
    """The protobuf payloads of one ``.wandb`` file (a 7-byte ``:W&B`` header, then leveldb log records)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline wandb run under ``run_dir/wandb``: id, project, group, name, config and history rows."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        run = {"history": []}
        for payload in _records(log):
            record = pb.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                config = {item.key: json.loads(item.value_json) for item in r.config.update}
                run.update(id=r.run_id, project=r.project, group=r.run_group, name=r.display_name, config=config)
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                run["history"].append({k: v for k, v in row.items() if not k.startswith("_")})
        runs.append(run)
    return runs


def tensorboard_scalars(folder: Path) -> dict[tuple[str, int], dict[int, float]]:
    """{(tag, step): value} of every TensorBoard event file under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict = {}
    for events in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                out[(tag, event.step)] = event.value
    return out


def test_wandb_offline_logs_the_tensorboard_scalars_one_run_per_worker_grouped_by_run_name(tiny_overrides, tmp_path):
    code = main([*tiny_overrides, "workers=2", "steps=4", "outer.every=2", "run.name=wb", "log.wandb.project=myproj",
                 "log.wandb.mode=offline", "log.wandb.tags=[tiny]"])  # fmt: skip
    assert code == 0
    run_dir = tmp_path / "wb"
    runs = offline_runs(run_dir)
    assert sorted(r["name"] for r in runs) == ["wb/worker0", "wb/worker1"]
    assert {r["project"] for r in runs} == {"myproj"} and {r["group"] for r in runs} == {"wb"}
    assert len({r["id"] for r in runs}) == 2
    tensorboard = tensorboard_scalars(run_dir / "tensorboard")
    assert tensorboard
    logged = {}
    for run in runs:
        worker = int(run["name"].removeprefix("wb/worker"))
        assert run["config"]["worker"] == worker and run["config"]["steps"] == 4
        assert run["config"]["log"]["wandb"]["project"] == "myproj"
        for row in run["history"]:
            step = row.pop("step")
            for key, value in row.items():
                logged[(f"{key}/worker{worker}", step)] = value
    assert logged.keys() == tensorboard.keys()  # the same scalars, tag for tag and step for step
    for key, value in logged.items():
        assert value == pytest.approx(tensorboard[key], rel=1e-6, abs=1e-6), key  # TensorBoard keeps float32
    by_worker = defaultdict(dict)
    for record in read_metrics(run_dir):
        by_worker[record["worker"]][record["step"]] = record
    for (tag, step), value in logged.items():  # and they are metrics.jsonl's numbers, in full precision
        key, worker = tag.rsplit("/worker", 1)
        assert by_worker[int(worker)][step][key] == value, (tag, step)
    assert {tag.split("/")[0] for tag, _ in logged} >= {"loss", "lr", "eval_loss", "bytes_sent", "tokens_per_second"}


def test_wandb_runs_one_per_process_on_the_torch_backend(tiny_overrides, tmp_path):
    code = main([*tiny_overrides, "backend=torch", "workers=2", "steps=2", "outer.every=1", "run.name=wbt",
                 "log.wandb.project=myproj", "log.wandb.mode=offline", "log.wandb.group=mygroup"])  # fmt: skip
    assert code == 0
    runs = offline_runs(tmp_path / "wbt")
    assert sorted(r["name"] for r in runs) == ["mygroup/worker0", "mygroup/worker1"]
    assert {r["group"] for r in runs} == {"mygroup"}
    for run in runs:
        worker = int(run["name"].removeprefix("mygroup/worker"))
        losses = {row["step"]: row["loss"] for row in run["history"] if "loss" in row}
        jsonl = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "wbt") if r["worker"] == worker and "loss" in r}
        assert losses == jsonl and sorted(losses) == [1, 2]


def test_a_resumed_run_continues_each_workers_wandb_run(tiny_overrides, tmp_path):
    base = [*tiny_overrides, "workers=2", "outer.every=2", "run.name=wr", "log.wandb.project=myproj",
            "log.wandb.mode=offline"]  # fmt: skip
    assert main([*base, "steps=4", "checkpoint.every=2"]) == 0
    ids = {r["name"]: r["id"] for r in offline_runs(tmp_path / "wr")}
    assert main([f"resume={tmp_path}/wr/checkpoints/step_000002", "steps=6"]) == 0
    runs = offline_runs(tmp_path / "wr")
    assert len(runs) == 4 and {r["name"]: r["id"] for r in runs} == ids  # the same two wandb runs, continued
    resumed = [r for r in runs if any(row.get("step") == 6 for row in r["history"])]
    assert len(resumed) == 2 and all(min(row["step"] for row in r["history"]) == 3 for r in resumed)


def test_without_wandb_installed_a_run_asking_for_it_is_refused_at_start_up(tiny_overrides, tmp_path):
    blocked = (  # the real train.py, in a Python where `import wandb` fails as if it were not installed
        "import runpy, sys; sys.modules['wandb'] = None; sys.argv = ['train.py', *sys.argv[1:]]; "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    args = [*tiny_overrides, "run.name=nowb", "log.wandb.project=myproj", "log.wandb.mode=offline"]
    proc = subprocess.run([sys.executable, "-c", blocked, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: log.wandb.project='myproj' needs wandb, which is not installed: pip install "
                     "'noloco[wandb]' (or drop log.wandb.project)"], proc.stderr  # fmt: skip
    assert not (tmp_path / "nowb").exists()  # before any work: no run folder
    proc = subprocess.run([sys.executable, "-c", blocked, *args[:-2], "steps=1", "outer.every=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # without a project wandb is never imported
    assert (tmp_path / "nowb" / "summary.json").is_file() and not (tmp_path / "nowb" / "wandb").exists()


def test_a_bad_wandb_mode_is_one_config_line(tiny_overrides, capsys):
    assert main([*tiny_overrides, "log.wandb.mode=sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: log.wandb.mode='sometimes' is not one of online, offline, disabled"]
