"""Streamed datasets (``data.streaming=true``) end to end, in real processes: every process of a torch-backend
worker (``inner.processes > 1``) and every hivemind peer reads its own part of the stream and resumes it exactly;
a stream that ends before ``steps`` starts its shard again, and the run ends cleanly with the reason in
``summary.json``. Offline: the datasets are small jsonl files written here."""

from __future__ import annotations

import json
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


def write_shards(folder: Path, files: int, docs: int, words: tuple[int, int], seed: int = 0) -> Path:
    """``files`` jsonl files of ``docs`` documents of random words each (their number drawn from ``words``)."""
    folder.mkdir(parents=True)
    for i in range(files):
        rng = random.Random(seed * 1000 + i)
        with (folder / f"part{i}.jsonl").open("w") as f:
            for _ in range(docs):
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


def test_a_stream_that_ends_before_steps_starts_its_shard_again_and_the_run_ends_cleanly_saying_so(tmp_path):
    folder = write_shards(tmp_path / "data", files=2, docs=6, words=(40, 60))  # ~250 tokens a shard, 132 a step
    args = stream_overrides(folder, tmp_path, "workers=2", "steps=8", "outer.every=4", "checkpoint.every=4",
                            "run.name=short")  # fmt: skip
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
                [sys.executable, "train.py", *args, f"peer.rank={rank}"],
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
