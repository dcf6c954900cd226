"""A backend is known by name only inside noloco/train/backends/: the rest of the harness asks its spec."""

import re
from pathlib import Path

from noloco.train.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
NAMES = "|".join(BACKENDS)
# a comparison with a backend's name on a line about a backend: `cfg.backend == "torch"`, `!= "hivemind"`, ...
BRANCH = re.compile(rf"backend\b.*(==|!=|\bin\b)\s*\(?\s*[\"']({NAMES})[\"']")


def test_no_module_outside_the_backends_package_branches_on_a_backend_name():
    outside = [p for p in (ROOT / "noloco" / "train").rglob("*.py") if "backends" not in p.parts]
    outside += [ROOT / "noloco" / "export.py", ROOT / "noloco" / "sample.py", ROOT / "train.py"]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in outside
             for n, line in enumerate(p.read_text().splitlines(), 1) if BRANCH.search(line)]  # fmt: skip
    assert found == []


def test_the_pattern_finds_a_branch_on_a_name():
    assert BRANCH.search('    if cfg.backend == "hivemind":')
    assert BRANCH.search("per_process = cfg.workers if cfg.get('backend', 'local') == 'local' else 1")
    assert not BRANCH.search("    if BACKENDS[cfg.backend].fixed_world:")


def test_every_backend_spec_names_an_importable_module_with_a_launch():
    import importlib

    for name, spec in BACKENDS.items():
        module = importlib.import_module(spec.module)
        assert callable(module.launch), name
