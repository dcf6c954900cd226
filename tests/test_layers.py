"""The package plan holds: imports point only downward between noloco's packages (docs/architecture.md).

Every ``import`` in ``noloco/`` is read from the source (lazy imports inside functions included), so a
package that reaches up — or two packages that reach each other — fails here with the file and line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "noloco"

#: bottom first; packages on the same floor must not import each other
FLOORS = {
    "quant": 0,
    "corpus": 0,
    "comm": 1,
    "collectives": 2,
    "gossip": 3,
    "swarm": 4,
    "optim": 4,
    "train": 5,
    "fleet": 6,
    "sim": 7,
}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute module names ``path`` imports (relative imports resolved), with line numbers."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
    return out


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "noloco" and parts[1] in FLOORS else None


def test_every_package_is_on_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOORS), f"packages without a floor in FLOORS (or gone): {packages ^ set(FLOORS)}"


def test_imports_point_only_downward_between_packages():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _package_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here is None:
            continue
        for module, line in _imports(path):
            there = _package_of(module)
            if there is None or there == here:
                continue
            if FLOORS[there] >= FLOORS[here]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {module} ({there})")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_gossip_and_the_local_backend_load_no_libp2p_code():
    code = (
        "import sys, noloco.gossip, noloco.optim, noloco.train.backends.local\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'multiaddr') or m == 'noloco.swarm')\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"modules loaded: {proc.stdout.strip()} {proc.stderr[-2000:]}"
