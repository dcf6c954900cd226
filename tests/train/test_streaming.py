"""Streamed datasets (``data.streaming=true``) end to end, in real processes: every process of a torch-backend
worker (``inner.processes > 1``) and every hivemind peer reads its own part of the stream and resumes it exactly;
a stream that ends before ``steps`` stops the run at the end of that round, every worker at one step, with the
reason in ``summary.json`` (``data.stream_end=stop``), or starts its shard again (``restart``); an empty shard is
one error line at start-up. Offline: the datasets are small jsonl files written here."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from noloco.train import checkpoint  # noqa: E402
from noloco.train.cli import main  # noqa: E402
from noloco.train.config import load_config  # noqa: E402
from noloco.train.metrics import read_metrics  # noqa: E402
from noloco.train.run import load_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls sing of rivers stones and kings who "
         "ruled the northern hills in winter").split()  # fmt: skip
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=2", "data.seq_len=32", "data.batch_size=4",
        "eval.batches=2", "log.progress=false", "log.tensorboard=false", "log.plot=false", "inner.warmup=2",
        "threads=1"]  # fmt: skip


def write_shards(folder: Path, files: int, docs: int | list[int], words: tuple[int, int], seed: int = 0) -> Path:
    """``files`` jsonl files of ``docs`` documents (or ``docs[i]`` in file i) of random words each (their number
    drawn from ``words``)."""
    folder.mkdir(parents=True)
    for i in range(files):
        rng = random.Random(seed * 1000 + i)
        with (folder / f"part{i}.jsonl").open("w") as f:
            for _ in range(docs[i] if isinstance(docs, list) else docs):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))}) + "\n")
    return folder


def stream_overrides(folder: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [*TINY, "data.source=hf", "data.hf_path=json", f"data.hf_files={folder}/*.jsonl", "data.streaming=true",
            "data.stream_sample=1000", "data.vocab_size=300", "data.eval_fraction=0.2",
            f"data.cache_dir={tmp_path}/cache", f"run.dir={tmp_path}/runs", *extra]  # fmt: skip


def expected_position(overrides: list[str], rank: int, world: int, steps: int) -> dict:
    """The stream position of shard ``rank`` of ``world`` after ``steps`` batches, read here, in this process."""
    cfg = load_config(overrides)
    sampler = load_corpus(cfg).sampler(rank, world, cfg.data.seq_len, cfg.data.batch_size)
    for step in range(1, steps + 1):
        sampler.batch(rank, step)
    return json.loads(json.dumps(sampler.state_dict()))


def saved_position(folder: Path, rank: int, step: int) -> dict:
    return checkpoint.load_worker(folder, rank, step)["sampler"]


def losses(run_dir: Path) -> dict[tuple[int, int], float]:
    return {(r["worker"], r["step"]): r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None}


def test_with_stream_end_restart_a_stream_that_ends_before_steps_starts_its_shard_again_and_trains_to_steps(tmp_path):
    folder = write_shards(tmp_path / "data", files=2, docs=6, words=(40, 60))  # ~250 tokens a shard, 132 a step
    args = stream_overrides(folder, tmp_path, "workers=2", "steps=8", "outer.every=4", "checkpoint.every=4",
                            "run.name=short", "data.stream_end=restart")  # fmt: skip
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "short"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["workers"] == 2
    assert summary["stream_shards"] == [[0, 2], [1, 2]]
    ends = summary["stream_ends_by_worker"]
    assert all(ends) and all(0 < s <= 8 for worker in ends for s in worker), ends
    assert summary["stream_epochs_by_worker"] == [len(e) + 1 for e in ends]
    assert summary["stream_note"].startswith("data.streaming: 2 of 2 workers' shards ended before steps=8 and were "
                                             "started again (worker 0 at step")  # fmt: skip
    # nothing half-written: every checkpoint complete, no temporary file, one metrics line per worker and step
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000004", "step_000008"]
    assert (checkpoints / "latest").resolve().name == "step_000008"
    assert all((checkpoints / f"step_00000{s}" / checkpoint.COMPLETE).is_file() for s in (4, 8))
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
    records = read_metrics(run_dir)
    assert sorted((r["worker"], r["step"]) for r in records) == [(w, s) for w in (0, 1) for s in range(9)]
    assert all(r["loss"] is not None for r in records if r["step"] > 0)
    for rank in (0, 1):  # the checkpoint holds where the stream ended too, so a resume reports the same
        assert saved_position(checkpoints / "latest", rank, 8)["ends"] == ends[rank]
    assert "stopped" not in summary


def first_end(overrides: list[str], rank: int, world: int, steps: int) -> int | None:
    """The first step whose batch reaches the end of shard ``rank`` of ``world``, read here (None: not by ``steps``)."""
    cfg = load_config(overrides)
    sampler = load_corpus(cfg).sampler(rank, world, cfg.data.seq_len, cfg.data.batch_size)
    for step in range(1, steps + 1):
        sampler.batch(rank, step)
        if sampler.ends:
            return sampler.ends[0]
    return None


def assert_stopped_cleanly(run_dir: Path, ranks: range, ended: int, metrics_workers: range) -> None:
    """One complete checkpoint at ``ended`` holds every rank and is the latest; nothing after it, nothing half-written;
    every worker's metrics go to ``ended``, with its held-out loss there."""
    checkpoints = run_dir / "checkpoints"
    final = checkpoint.step_dir(run_dir, ended)
    assert (checkpoints / "latest").resolve() == final.resolve() and (final / checkpoint.COMPLETE).is_file()
    assert checkpoint.worker_ranks(final) == list(ranks)
    assert all(checkpoint.load_worker(final, rank, ended)["step"] == ended for rank in ranks)
    later = [p.name for p in checkpoints.glob("step_*") if int(p.name.split("_")[1]) > ended]
    assert not later and not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
    records = read_metrics(run_dir)
    for worker in metrics_workers:
        mine = [r for r in records if r["worker"] == worker]
        assert [r["step"] for r in mine] == list(range(ended + 1)), worker
        assert mine[-1].get("eval_loss") is not None


@pytest.mark.parametrize("algo", ["noloco", "ddp"])
def test_a_stream_that_runs_out_stops_every_worker_at_the_end_of_its_round_with_the_reason_in_the_summary(
    tmp_path, capsys, algo
):
    folder = write_shards(tmp_path / "data", files=4, docs=[12, 3, 12, 12], words=(40, 60))  # worker 1's: short
    args = stream_overrides(folder, tmp_path, "workers=4", "steps=30", "outer.every=4", "checkpoint.every=3",
                            f"outer.algo={algo}", "run.name=stop")  # fmt: skip
    exhausted = {rank: first_end(args, rank, 4, 30) for rank in range(4)}
    assert exhausted[1] is not None and all(exhausted[r] is None or exhausted[r] > exhausted[1] for r in (0, 2, 3))
    every = 1 if algo == "ddp" else 4  # DDP has no rounds: it stops at the step its stream ran out
    ended = math.ceil(exhausted[1] / every) * every
    assert ended < 30
    assert main(args) == 0
    run_dir = tmp_path / "runs" / "stop"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == {"reason": "data stream exhausted", "worker": 1, "exhausted_at_step": exhausted[1],
                                  "ended_at_step": ended, "steps": 30}  # fmt: skip
    assert summary["steps"] == ended
    assert summary["stream_ends_by_worker"][1][0] == exhausted[1]  # started again for the rest of the round
    note = f"data.streaming: worker 1's shard ended at step {exhausted[1]}, so the run stopped at the end of that round"
    assert summary["stream_note"].startswith(f"{note}, step {ended} of steps=30"), summary["stream_note"]
    assert f"the run stopped at the end of that round, step {ended} of steps=30" in capsys.readouterr().out
    assert_stopped_cleanly(run_dir, range(4), ended, range(4))
    assert (run_dir / "curves.png").exists() is False  # (log.plot=false in these runs)

    # a resume of the stopped run would end at once: refused, one line, nothing of the run touched
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert main([f"resume={run_dir}/checkpoints/latest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: resume=") and "data.stream_end=restart" in err[0], err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # with data.stream_end=restart it trains on, its shard started over
    assert main([f"resume={run_dir}/checkpoints/latest", "data.stream_end=restart", f"steps={ended + 2}"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == ended + 2 and "stopped" not in summary


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_on_the_torch_backend_a_stream_that_runs_out_stops_every_process_at_the_end_of_its_round(tmp_path, processes):
    world = 2 * processes  # 2 workers; with 2 processes each, rank 1 (worker 0's second process) has the short part
    folder = write_shards(tmp_path / "data", files=world, docs=[12, 4, 12, 12][:world], words=(40, 60))
    args = stream_overrides(folder, tmp_path, "backend=torch", "workers=2", f"inner.processes={processes}",
                            "steps=30", "outer.every=4", "checkpoint.every=3", "run.name=stop")  # fmt: skip
    exhausted = {rank: first_end(args, rank, world, 30) for rank in range(world)}
    assert exhausted[1] is not None and all(exhausted[r] is None or exhausted[r] > exhausted[1] for r in exhausted
                                            if r != 1)  # fmt: skip
    ended = math.ceil(exhausted[1] / 4) * 4
    assert ended < 30
    assert main(args) == 0
    run_dir = tmp_path / "runs" / "stop"
    summary = json.loads((run_dir / "summary.json").read_text())
    worker = 1 // processes
    assert summary["stopped"] == {"reason": "data stream exhausted", "worker": worker,
                                  "exhausted_at_step": exhausted[1], "ended_at_step": ended, "steps": 30,
                                  **({"rank": 1} if processes > 1 else {})}  # fmt: skip
    assert summary["steps"] == ended
    assert_stopped_cleanly(run_dir, range(world), ended, range(world))


@pytest.mark.parametrize("backend", ["local", "torch"])
def test_a_worker_whose_shard_is_empty_fails_at_start_up_with_one_line_before_anything_is_written(
    tmp_path, capsys, backend
):
    folder = write_shards(tmp_path / "data", files=4, docs=[8, 8, 8, 0], words=(20, 40))  # worker 3: no file's worth
    args = stream_overrides(folder, tmp_path, f"backend={backend}", "workers=4", "steps=4", "outer.every=2",
                            "run.name=empty")  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: data.hf_path='json': worker 3's shard (of 4) holds no training documents (an empty file, "
                   "fewer rows than shards, or all of it held out): use fewer workers or more data"]  # fmt: skip
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_streaming_on_the_torch_backend_gives_each_process_of_a_worker_its_own_part_and_resumes_exactly(tmp_path):
    folder = write_shards(tmp_path / "data", files=4, docs=12, words=(30, 90))
    args = stream_overrides(folder, tmp_path, "backend=torch", "workers=2", "inner.processes=2", "steps=4",
                            "outer.every=2", "checkpoint.every=2", "run.name=dp")  # fmt: skip
    assert main(args) == 0
    run_dir = tmp_path / "runs" / "dp"
    positions = [saved_position(run_dir / "checkpoints" / "step_000004", rank, 4) for rank in range(4)]
    for rank, position in enumerate(positions):  # rank r = process r % 2 of worker r // 2 reads part r of 4
        assert position == expected_position(args, rank, 4, 4), rank
    assert len({json.dumps(p["position"]) + str(p["offset"]) for p in positions}) == 4  # four different parts
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["processes_per_worker"] == 2 and summary["stream_shards"] == [[0, 4], [2, 4]]
    uninterrupted = losses(run_dir)
    assert len(uninterrupted) == 16  # 4 ranks x 4 steps
    assert main([f"resume={run_dir}/checkpoints/step_000002"]) == 0
    resumed = losses(run_dir)
    # the stream continues where it was saved: each rank's step-3 batch is the same (its loss is computed before
    # any update, so equal bit for bit), and after step 4 every rank is at the same place in its part as before
    assert {k: resumed[k] for k in uninterrupted if k[1] == 3} == {k: v for k, v in uninterrupted.items() if k[1] == 3}
    for rank in range(4):
        assert saved_position(run_dir / "checkpoints" / "step_000004", rank, 4) == positions[rank]
    # (step 4's losses are close, not equal: a fresh DDP process all-reduces its first step's gradients in other
    # buckets than later steps, so the quantized hook rounds step 3's gradients a little differently)
    for key in uninterrupted:
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-4), key


@pytest.mark.slow
def test_streaming_on_hivemind_each_peer_reads_the_shard_of_its_rank(tmp_path):
    folder = write_shards(tmp_path / "data", files=2, docs=12, words=(30, 90))
    args = stream_overrides(folder, tmp_path, "backend=hivemind", "workers=2", "steps=4", "outer.every=2",
                            "checkpoint.every=4", "run.name=swarm", "peer.join=never", "peer.matchmaking_timeout=1",
                            'peer.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', "comm.startup_timeout=60")  # fmt: skip
    load_corpus(load_config(args))  # the token cache, built once here, so the peers do not race to build it
    env = {**os.environ, "NOLOCO_RUN_KEY": "stream-test-key-0123"}
    peers = {}
    try:
        for rank in (0, 1):
            log = (tmp_path / f"peer{rank}.log").open("w")
            peers[rank] = subprocess.Popen(
                [sys.executable, "train.py", *args, f"peer.worker={rank}"],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        codes = {rank: proc.wait(timeout=300) for rank, proc in peers.items()}
    finally:
        for proc in peers.values():  # the peer, its DHT process and its p2pd
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    logs = {rank: (tmp_path / f"peer{rank}.log").read_text()[-2000:] for rank in peers}
    assert codes == {0: 0, 1: 0}, logs
    positions = {}
    for rank in (0, 1):
        peer_dir = tmp_path / "runs" / "swarm" / f"peer-{rank}"
        positions[rank] = saved_position(peer_dir / "checkpoints" / "step_000004", rank, 4)
        assert positions[rank] == expected_position(args, rank, 2, 4), rank
        summary = json.loads((peer_dir / "summary.json").read_text())
        assert summary["stream_shards"] == [[rank, 2]]
    assert positions[0]["position"] != positions[1]["position"]
