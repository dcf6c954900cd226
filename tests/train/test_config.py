import subprocess
import sys
from pathlib import Path

import pytest

from noloco.train.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "override,message",
    [
        ("outer.nope=1", "unknown config key 'outer.nope'"),
        ("outer.group_size=3", "does not divide workers=4"),
        ("outer.algo=sgd", "outer.algo='sgd' is not one of"),
        ("comm.codec=int3", "comm.codec='int3'"),
        ("workers=0", "workers must be an integer >= 1"),
        ("model.preset=huge", "model.preset='huge'"),
    ],
)
def test_bad_config_fails_with_clear_message(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config([override])


def test_missing_data_path_fails(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["data.source=files", f"data.path={tmp_path}/missing.txt"])


def test_algorithm_dependent_defaults():
    assert load_config(["outer.algo=diloco"]).outer.momentum == 0.9
    assert load_config([]).outer.momentum == 0.5
    assert load_config(["outer.every=7"]).eval.every == 7


def test_config_file_and_overrides_merge(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("workers: 8\nouter:\n  algo: diloco\n")
    cfg = load_config(["outer.every=5"], [str(path)])
    assert (cfg.workers, cfg.outer.algo, cfg.outer.every) == (8, "diloco", 5)


def test_cli_prints_one_line_and_exits_2_before_any_work(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "outer.group_size=3", f"run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "does not divide" in result.stderr
    assert not any(tmp_path.iterdir())


def test_every_shipped_config_file_loads():
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        load_config([], [str(path)])
