import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from noloco.comm import faults
from noloco.models.llama import LLaMA, model_config
from noloco.train import checkpoint
from noloco.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _state():
    model = LLaMA(model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (2, 8))
    model(x, x)[1].backward()
    opt.step()
    return {"step": 3, "model": model.state_dict(), "inner_opt": opt.state_dict(), "history": [(0, 1.5)], "x": None}


def test_state_round_trips_through_safetensors_and_json(tmp_path):
    state = _state()
    checkpoint.save_worker(tmp_path, 3, 0, state)
    back = checkpoint.load_worker(checkpoint.step_dir(tmp_path, 3), 0)
    assert back["history"] == [(0, 1.5)] and back["x"] is None
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert list(back["inner_opt"]["state"]) == list(state["inner_opt"]["state"])  # int keys stay int
    opt = torch.optim.AdamW(LLaMA(model_config("tiny", dim=32, n_layers=1, n_heads=2, vocab_size=64)).parameters())
    opt.load_state_dict(back["inner_opt"])


def test_the_streamed_file_is_safetensors_with_every_dtype_and_shape(tmp_path, monkeypatch):
    """The file written 16 bytes at a time reads back through the safetensors library, value for value, and
    hashes to its JSON's checksum; tied tensors are stored once."""
    monkeypatch.setattr(checkpoint, "_CHUNK_BYTES", 16)
    shared, square = torch.randn(5, 3), torch.randn(4, 4)
    state = {
        "f32": shared, "tied": shared, "t": shared.t(), "square": square, "square_t": square.t(),
        "bf16": torch.randn(7, dtype=torch.bfloat16),
        "f64": torch.randn(2, 2, dtype=torch.float64), "i64": torch.arange(9),
        "u8": torch.arange(33, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
    }  # fmt: skip
    meta_path = checkpoint.save_worker(tmp_path, 1, 0, state)
    blob = meta_path.with_suffix(".safetensors")
    stored = load_file(blob)
    assert "tied" not in stored and len(stored) == len(state) - 1
    back = checkpoint.load_worker(blob.parent, 0)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    meta = json.loads(meta_path.read_text())
    assert meta["format"] == checkpoint.FORMAT and meta["sha256_part_bytes"] == checkpoint.PART_BYTES
    # one part (the file is smaller than a part): the SHA-256 of the file's SHA-256
    assert meta["sha256"] == hashlib.sha256(hashlib.sha256(blob.read_bytes()).digest()).hexdigest()
    wide = torch.randn(40, 9)[:, ::2]  # not contiguous: hashed in C order, 4 values at a time
    assert checkpoint.digest(wide) == hashlib.sha256(wide.contiguous().numpy().tobytes()).hexdigest()


_PEAK_SCRIPT = """
import resource, sys, tempfile, torch
from noloco.train import checkpoint
state = {f"w{i}": torch.randn(16, 1 << 20) for i in range(6)}  # 6 x 64 MiB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with tempfile.TemporaryDirectory() as folder:
    checkpoint.save_worker(folder, 1, 0, state)
    saved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del state
    back = checkpoint.load_worker(checkpoint.step_dir(folder, 1), 0)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((saved - before) >> 10, (loaded - before) >> 10)
"""


def test_saving_and_loading_hold_the_state_on_the_host_once(tmp_path):
    """A 384 MiB state: saving adds at most a few chunks to the peak memory (whole-file safetensors ``save``
    added the state again), loading at most the state once (reading the file into memory, then parsing it,
    held it twice)."""
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    save_mib, load_mib = map(int, out.stdout.split())
    assert save_mib < 200 and load_mib < 384 + 200, (save_mib, load_mib)


def test_damaged_checkpoint_is_refused(tmp_path):
    checkpoint.save_worker(tmp_path, 3, 0, _state())
    blob = checkpoint.step_dir(tmp_path, 3) / "worker_0.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load_worker(blob.parent, 0)


def _parts_state() -> dict:  # 3.5 MiB of tensors whose sizes do not line up with 1 MiB parts
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randn(300_001, generator=gen), "b": torch.randn(7, 77_777, generator=gen).bfloat16(),
            "c": torch.arange(123_457, dtype=torch.int64)}  # fmt: skip


def test_the_part_hash_is_the_hash_of_the_parts_in_any_chunking_on_any_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "PART_BYTES", 1 << 20)
    meta_path = checkpoint.save_worker(tmp_path, 1, 0, _parts_state())
    blob = meta_path.with_suffix(".safetensors")
    data = blob.read_bytes()
    parts = [hashlib.sha256(data[a : a + (1 << 20)]).digest() for a in range(0, len(data), 1 << 20)]
    assert len(parts) == 4
    expected = hashlib.sha256(b"".join(parts)).hexdigest()
    assert json.loads(meta_path.read_text())["sha256"] == expected
    for threads in (1, 3, 8):
        assert checkpoint.file_checksum(blob, 1 << 20, threads) == expected
    fed = checkpoint.PartHash(1 << 20)
    for start in range(0, len(data), 333_333):  # chunks that straddle the parts
        fed.update(data[start : start + 333_333])
    assert fed.hexdigest() == expected
    whole = checkpoint.PartHash(len(data))  # a part size the file fills exactly: no empty tail part
    whole.update(data)
    assert whole.hexdigest() == hashlib.sha256(hashlib.sha256(data).digest()).hexdigest()
    assert checkpoint.file_checksum(blob, None) == hashlib.sha256(data).hexdigest()
    back = checkpoint.load_worker(blob.parent, 0)
    assert all(torch.equal(back[k], v) for k, v in _parts_state().items())


def test_a_damaged_part_or_a_lying_part_size_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "PART_BYTES", 1 << 20)
    meta_path = checkpoint.save_worker(tmp_path, 1, 0, _parts_state())
    blob = meta_path.with_suffix(".safetensors")
    good, meta = blob.read_bytes(), json.loads(meta_path.read_text())
    damaged = bytearray(good)
    damaged[(1 << 20) * 2 + 5] ^= 0x01  # in the third part
    blob.write_bytes(bytes(damaged))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its checksum"):
        checkpoint.load_worker(blob.parent, 0)
    blob.write_bytes(good)
    for lie, match in ((2 << 20, "does not match its checksum"), (1, "sha256_part_bytes"), (1 << 31, "sha256_part"),
                       ("1048576", "sha256_part_bytes"), (None, "sha256_part_bytes")):  # fmt: skip
        meta_path.write_text(json.dumps({**meta, "sha256_part_bytes": lie}))
        with pytest.raises(checkpoint.CheckpointError, match=match):
            checkpoint.load_worker(blob.parent, 0)


def test_a_format_2_checkpoint_still_loads_by_its_plain_sha256(tmp_path):
    meta_path = checkpoint.save_worker(tmp_path, 1, 0, _parts_state())
    blob = meta_path.with_suffix(".safetensors")
    meta = json.loads(meta_path.read_text())
    del meta["sha256_part_bytes"]
    meta.update(format="noloco-checkpoint-2", sha256=hashlib.sha256(blob.read_bytes()).hexdigest())
    meta_path.write_text(json.dumps(meta))
    assert torch.equal(checkpoint.load_worker(blob.parent, 0)["c"], _parts_state()["c"])
    meta["sha256"] = checkpoint.file_checksum(blob)  # format 3's checksum under format 2's name: refused
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its checksum"):
        checkpoint.load_worker(blob.parent, 0)


def test_fault_spec_parses_and_rejects_garbage():
    assert faults.parse("checkpoint.mid@10=kill, outer.exchange@4/2=stop") == {
        ("checkpoint.mid", 10, None): "kill",
        ("outer.exchange", 4, 2): "stop",
    }
    with pytest.raises(faults.FaultSpecError):
        faults.parse("checkpoint.mid@ten=kill")
    with pytest.raises(faults.FaultSpecError):
        faults.parse("checkpoint.mid@10=explode")


@pytest.mark.slow
def test_sigkill_mid_checkpoint_resumes_from_the_previous_one_exactly(tiny_overrides, tmp_path):
    """A real process killed while writing step 10's checkpoint resumes from step 5 and ends as if never killed."""
    args = [
        *tiny_overrides,
        "steps=15",
        "outer.every=5",
        "checkpoint.every=5",
        "checkpoint.keep=3",
        "log.tensorboard=false",
        "log.plot=false",
    ]
    train = [sys.executable, str(ROOT / "train.py")]
    env = {**os.environ, "NOLOCO_FAULTS": "checkpoint.mid@10=kill"}
    killed = subprocess.run([*train, *args, "run.name=killed"], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    folder = tmp_path / "killed" / "checkpoints"
    assert (folder / "latest").resolve().name == "step_000005"
    assert not (folder / "step_000010" / "COMPLETE").exists()

    resumed = subprocess.run([*train, f"resume={folder}/latest"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    clean = subprocess.run([*train, *args, "run.name=clean"], capture_output=True, text=True, timeout=300)
    assert clean.returncode == 0, clean.stderr[-2000:]
    losses = lambda d: {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(d)}  # noqa: E731
    assert losses(tmp_path / "killed") == losses(tmp_path / "clean")
    a = json.loads((tmp_path / "killed" / "summary.json").read_text())
    b = json.loads((tmp_path / "clean" / "summary.json").read_text())
    assert a["final_eval_loss_per_worker"] == b["final_eval_loss_per_worker"]


# ------------------------------------------------------------------------- what a checkpoint stores


def _run(tiny_config, *overrides, **kwargs):
    from noloco.train.backends.local import launch

    common = ("workers=2", "threads=1", "steps=6", "outer.every=3", "log.tensorboard=false", "log.plot=false")
    return launch(tiny_config(*common, *overrides), quiet=True, **kwargs)


def test_checkpoint_stores_only_what_cannot_be_rebuilt(tiny_config, tmp_path):
    """φ₀ is never stored (rebuilt from run.seed); φ not before the first outer step (φ = φ₀); θ not right
    after one (θ = φ); the rest is fp32. The summary reports the size of the latest checkpoint."""
    summary = _run(tiny_config, "steps=4", "checkpoint.every=1", "checkpoint.keep=5", "run.name=kinds")
    run_dir = tmp_path / "kinds"
    numel = summary["params"]
    stored = {}
    for step in (1, 2, 3, 4):
        folder = checkpoint.step_dir(run_dir, step)
        tensors = load_file(folder / "worker_0.safetensors")
        assert all(t.dtype == torch.float32 for t in tensors.values())
        assert "algorithm/reference" not in tensors
        stored[step] = {"slow": "algorithm/slow" in tensors, "model": any(k.startswith("model/") for k in tensors)}
        vectors = sum(t.numel() for t in tensors.values()) / numel  # fp32 values per parameter
        expected = 2 + stored[step]["slow"] + stored[step]["model"] + 3 * (step >= 3)  # moments; momentum, residuals
        assert abs(vectors - expected) < 0.01, (step, vectors, expected)
    assert stored == {1: {"slow": False, "model": True}, 2: {"slow": False, "model": True},
                      3: {"slow": True, "model": False}, 4: {"slow": True, "model": True}}  # fmt: skip
    latest = checkpoint.step_dir(run_dir, 4)
    files = [latest / f"worker_{r}{ext}" for r in (0, 1) for ext in (".json", ".safetensors")]
    assert summary["checkpoint_bytes_per_worker"] == round(sum(f.stat().st_size for f in files) / 2)
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint_bytes_per_worker"] > 0


@pytest.mark.parametrize(
    "overrides, at",
    [(("outer.algo=noloco",), 2), (("outer.algo=noloco",), 3), (("outer.algo=noloco",), 4),
     (("outer.algo=diloco",), 3), (("outer.algo=ddp",), 4), (("outer.overlap=true",), 4),
     (("outer.slow_every=2", "steps=12"), 7), (("outer.slow_every=3", "outer.slow_stagger=true", "steps=12"), 7)],
    ids=["phi-is-phi0", "theta-is-phi", "mid-round", "diloco", "ddp", "overlap", "slow-every", "slow-stagger"],
)  # fmt: skip
def test_resume_from_each_kind_of_checkpoint_is_exact(tiny_config, tmp_path, overrides, at):
    """From a checkpoint whose φ (step 2: = φ₀) or θ (step 3: = φ) is rebuilt, or both stored (step 4)."""
    from noloco.train.cli import main

    common = (*overrides, "checkpoint.every=1")
    _run(tiny_config, *common, "run.name=full")
    _run(tiny_config, *common, "run.name=cut", stop_after=at)
    assert main([f"resume={tmp_path}/cut/checkpoints/step_{at:06d}", "log.progress=false"]) == 0
    losses = lambda d: {(r["worker"], r["step"]): r.get("loss") for r in read_metrics(d)}  # noqa: E731
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert a["final_eval_loss_per_worker"] == b["final_eval_loss_per_worker"]


def test_a_one_worker_resume_reads_its_checkpoint_and_builds_its_model_once(tiny_config, tmp_path, monkeypatch):
    """A resumed swarm peer (one worker per process): the state Run.check_resume read and checked, and the model it
    built from run.seed for the check, are the worker's; the worker is the one a second read would have built."""
    import shutil

    from noloco.comm.local import LocalFabric
    from noloco.train import loop
    from noloco.train.backends.local import LocalBackend
    from noloco.train.loop import RunContext, build_worker
    from noloco.train.run import Run

    _run(tiny_config, "outer.algo=noloco", "checkpoint.every=1", "run.name=cut", stop_after=4)
    src = checkpoint.step_dir(tmp_path / "cut", 4)
    folder = tmp_path / "peer" / "checkpoints" / src.name  # a peer's folder holds its own worker only
    folder.mkdir(parents=True)
    for name in ("worker_0.json", "worker_0.safetensors", checkpoint.COMPLETE):
        shutil.copy(src / name, folder / name)
    cfg = tiny_config("workers=2", "threads=1", "steps=6", "outer.every=3", "outer.algo=noloco")
    reads, builds = [], []
    load_worker, build_model = checkpoint.load_worker, loop.build_model
    monkeypatch.setattr(checkpoint, "load_worker", lambda *a: reads.append(a) or load_worker(*a))
    monkeypatch.setattr(loop, "build_model", lambda *a: builds.append(a) or build_model(*a))

    run = Run(cfg, tmp_path / "peer", folder, 4, quiet=True)
    run.load_corpus()
    run.check_resume([0])
    assert len(reads) == 1 and list(run.resumed_states) == [0] and len(run.seed_models) == 1
    seed_model = run.seed_models[0]
    backend = LocalBackend(LocalFabric(1).transports[0])  # this worker alone: no start agreement to wait for
    kept = RunContext(cfg, run.corpus, tmp_path / "peer", None, folder, 4)
    kept.resumed_states, kept.seed_models = run.resumed_states, run.seed_models
    reads.clear(), builds.clear()
    worker = build_worker(kept, backend)
    assert reads == [] and builds == [] and worker.model is seed_model  # neither read nor built again
    assert not run.resumed_states and not run.seed_models  # taken once: a second worker reads and builds its own
    again = build_worker(RunContext(cfg, run.corpus, tmp_path / "peer", None, folder, 4), backend)
    assert len(reads) == 1 and len(builds) == 1
    ta, tb = {}, {}
    assert checkpoint.flatten(worker.state(4, 0.0), ta) == checkpoint.flatten(again.state(4, 0.0), tb)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
