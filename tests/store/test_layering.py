"""Which module may import which: the storage modules import no module that imports them back (an import inside a
function counts), and replay, which computes over what a source hands it, imports nothing of the storage layers."""

from __future__ import annotations

import ast
from pathlib import Path

import trajectory_replay

PACKAGE = Path(trajectory_replay.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports anywhere in its text (at the top, in a function, for type
    checking only)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return out & set(modules) - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_storage_module_imports_one_that_imports_it_back():
    graph = _graph()
    storage = [m for m in graph if m.startswith(("trajectory_replay.backends", "trajectory_replay.store"))]
    assert len(storage) > 10
    pairs = sorted((a, b) for a in storage for b in graph[a] if a in graph.get(b, ()))
    assert pairs == []


def test_replay_imports_nothing_of_the_storage_layers():
    graph = _graph()
    replay = [m for m in graph if m.startswith("trajectory_replay.replay")]
    assert "trajectory_replay.replay.runner" in replay
    found = sorted((m, i) for m in replay for i in graph[m]
                   if i.startswith(("trajectory_replay.store", "trajectory_replay.backends")))
    assert found == []
