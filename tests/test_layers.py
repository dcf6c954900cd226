"""The package plan holds: imports point only downward between noloco's packages (docs/architecture.md).

Every ``import`` in ``noloco/`` is read from the source (lazy imports inside functions included), so a
package that reaches up — or two packages that reach each other — fails here with the file and line. The
entry modules ``export.py`` and ``sample.py`` sit on floors of their own above the packages. A module imports
no ``_private`` name of another module, and the modules of one package do not import each other in a circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "noloco"

#: bottom first; packages (and the top-level entry modules) on the same floor must not import each other
FLOORS = {
    "state": -1,  # noloco/state.py: the state-owner protocol, imports nothing of noloco
    "quant": 0,
    "corpus": 0,
    "comm": 1,
    "collectives": 2,
    "gossip": 3,
    "swarm": 4,
    "optim": 4,
    "data": 5,
    "models": 5,
    "train": 6,
    "fleet": 7,
    "sim": 8,
    "export": 9,  # noloco/export.py
    "sample": 10,  # noloco/sample.py (reads a run through export's public functions)
}

#: the import circles a package may keep: quant's codec modules (base registers the codecs that import it)
ALLOWED_CIRCLES = [
    {"noloco.quant.base", "noloco.quant.intq", "noloco.quant.mx", "noloco.quant.signq", "noloco.quant.topk",
     "noloco.quant.wire"},
]  # fmt: skip


def _module(path: Path) -> str:
    """The module name of a file of ``noloco/`` (a package's ``__init__.py``: the package)."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(path): path for path in PACKAGE.rglob("*.py")}


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


def _imported_names(path: Path, module: str | None = None) -> list[tuple[str, str, int]]:
    """(module, name, line) of every ``from ... import name`` in ``path``, the module ``module`` (default: its
    place in ``noloco/``; relative imports resolved)."""
    module = module or _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            out += [(name, alias.name, node.lineno) for alias in node.names]
    return out


def _module_graph() -> dict[str, set[str]]:
    """Module -> the noloco modules it imports (``from a import b`` counts as importing ``a.b`` when that is a
    module)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {name for name, _ in _imports(path) if name in MODULES}
        targets |= {f"{name}.{alias}" for name, alias, _ in _imported_names(path) if f"{name}.{alias}" in MODULES}
        graph[module] = targets - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of module names."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            member = None
            while member != node:
                member = stack.pop()
                component.add(member)
            if len(component) > 1:
                out.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_every_package_is_on_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}  # the entry modules
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


#: packages and entry modules whose modules use no private name of any other module (every other module: of no
#: other package)
PUBLIC_ONLY = {"data", "models", "export", "sample"}
#: private names used across packages today, to be made public by their owners
ALLOWED_PRIVATE = {("noloco.collectives.device", "noloco.quant.ops._triton")}


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the noloco module it stands for (``from noloco.a import b [as c]``, ``import noloco.a as c``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("noloco"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    aliases[alias.asname] = alias.name
    return aliases


def _private_uses(module: str, path: Path) -> list[tuple[str, int]]:
    """(``other.module._name``, line) of each private name of another noloco module that ``path`` imports or
    reads as an attribute of an imported module."""
    out = []
    for name, alias, line in _imported_names(path, module):
        if name.startswith("noloco") and name != module and alias.startswith("_") and not alias.startswith("__"):
            out.append((f"{name}.{alias}", line))
    tree = ast.parse(path.read_text())
    aliases = _module_aliases(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and aliases[node.value.id] != module):  # fmt: skip
            out.append((f"{aliases[node.value.id]}.{node.attr}", node.lineno))
    return out


def test_no_module_imports_a_private_name_of_another():
    """Across packages nothing private is used; inside ``data/``, ``models/``, ``export.py`` and ``sample.py`` no
    module uses another's private names either."""
    private = []
    for module, path in MODULES.items():
        here = _package_of(module)
        for name, line in _private_uses(module, path):
            if (module, name) in ALLOWED_PRIVATE or (here not in PUBLIC_ONLY and _package_of(name) == here):
                continue
            private.append(f"{path.relative_to(ROOT)}:{line} uses {name}")
    assert not private, "private names used across modules:\n" + "\n".join(private)


def test_the_private_name_check_finds_one(tmp_path):
    """A module that imports a private name, or reads one off an imported module, is found."""
    path = tmp_path / "x.py"
    path.write_text("from noloco.data.tokens import _encode_to\nfrom noloco.data import tokens\ntokens._open_tokens\n")
    found = sorted(_private_uses("noloco.x", path))
    assert found == [("noloco.data.tokens._encode_to", 1), ("noloco.data.tokens._open_tokens", 3)]


def test_no_import_circle_inside_a_package():
    graph = _module_graph()
    circles = [sorted(c) for c in _circles(graph) if c not in ALLOWED_CIRCLES]
    assert not circles, "modules of one package that import each other in a circle:\n" + "\n".join(map(str, circles))


def test_the_circle_check_finds_a_circle():
    """The checks above can fail: a circle of three modules is found, a chain is not."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_gossip_and_the_local_backend_load_no_libp2p_code():
    code = (
        "import sys, noloco.gossip, noloco.optim, noloco.train.backends.local\n"
        "ok = ('noloco.swarm', 'noloco.swarm.settings')  # the peer section's check: no libp2p code\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hivemind', 'multiaddr')\n"
        "             or (m.startswith('noloco.swarm') and m not in ok))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, f"modules loaded: {proc.stdout.strip()} {proc.stderr[-2000:]}"
