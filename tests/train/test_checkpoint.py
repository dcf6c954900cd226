import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from noloco.comm import faults
from noloco.train import checkpoint
from noloco.train.metrics import read_metrics
from noloco.train.model import LLaMA, model_config

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


def test_damaged_checkpoint_is_refused(tmp_path):
    checkpoint.save_worker(tmp_path, 3, 0, _state())
    blob = checkpoint.step_dir(tmp_path, 3) / "worker_0.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
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
