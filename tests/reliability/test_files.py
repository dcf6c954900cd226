"""Files and names from outside (issue #32): every number read from a file is bounded before it is used, every
failure a user or a file can cause is one ``error:`` line and exit 2, and names stay single folder names.

Each case is a real file or a real process: the CLI (``train.py``'s ``main``, ``python -m noloco.export`` /
``noloco.sample``) run on it, its exit status and stderr read, the folders it may touch compared before and
after.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from noloco.train.cli import main


def _snapshot(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(Path(folder).rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _one_error_line(err: str, match: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning:", "note:"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("key", ["run.name", "peer.run_id", "peer.name"])
@pytest.mark.parametrize("name", ["../x", "../../x", "/tmp/noloco-absolute-name", "a/../../x", "..", "."])
def test_a_name_that_is_not_a_single_folder_name_is_refused(tmp_path, capsys, key, name):
    """``run.name=../x`` wrote outside ``run.dir``; ``peer.run_id`` and ``peer.name`` name folders too."""
    root = tmp_path / "root"
    (root / "runs").mkdir(parents=True)
    before = _snapshot(root)
    code = main([f"run.dir={root / 'runs'}", f"{key}={name}", "steps=2", "log.progress=false"])
    assert code == 2
    _one_error_line(capsys.readouterr().err, f"{key}=")
    assert _snapshot(root) == before
    assert not Path("/tmp/noloco-absolute-name").exists()


TINY = ("workers=2", "threads=1", "steps=10", "outer.every=5", "checkpoint.every=5", "log.tensorboard=false",
        "log.plot=false")  # fmt: skip


def test_a_run_killed_between_its_last_checkpoint_and_its_summary_gets_the_summary_on_resume(
    smoke_overrides, data_cache, tmp_path, capsys
):
    """The last checkpoint holds everything the summary needs: resuming it writes ``summary.json`` (the same
    final losses, bytes and rejections) instead of asking for more steps; once written, a resume is refused."""
    common = [*smoke_overrides, f"data.cache_dir={data_cache}", f"run.dir={tmp_path}", "run.name=r", *TINY]
    assert main(common) == 0
    run_dir = tmp_path / "r"
    complete = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()  # what a kill after the final checkpoint leaves
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([f"resume={run_dir}/checkpoints/latest", "log.progress=false"]) == 0
    assert "summary.json is missing: writing the summary" in capsys.readouterr().err
    again = json.loads((run_dir / "summary.json").read_text())
    for key in ("final_eval_loss_per_worker", "bytes_sent_by_worker", "bytes_received_by_worker", "steps",
                "norm_rejections_by_worker", "consensus_distance", "unigram_eval_loss"):  # fmt: skip
        assert again[key] == complete[key], key
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics  # no step trained twice, nothing cut
    assert main([f"resume={run_dir}/checkpoints/latest", "log.progress=false"]) == 2
    _one_error_line(capsys.readouterr().err, "raise steps= to continue")
