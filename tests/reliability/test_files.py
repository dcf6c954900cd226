"""Files and names from outside (issue #32): every number read from a file is bounded before it is used, every
failure a user or a file can cause is one ``error:`` line and exit 2, and names stay single folder names.

Each case is a real file or a real process: the CLI (``train.py``'s ``main``, ``python -m noloco.export`` /
``noloco.sample``) run on it, its exit status and stderr read, the folders it may touch compared before and
after.
"""

from __future__ import annotations

import hashlib
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
