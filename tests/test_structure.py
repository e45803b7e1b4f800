"""The package's import graph: every module sits in one layer and imports only its own layer or those below it, and
no set of modules imports itself round a cycle. Imports inside functions count: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trajectory_replay"

LAYERS: dict[str, int] = {
    # the bottom: the package root (its version), errors, enumerations of words, outcomes, units and the host's CPUs,
    # which every layer uses
    "__init__": 0,
    "errors": 0,
    "words": 0,
    "outcome": 0,
    "units": 0,
    "cpus": 0,
    "_allocator": 0,
    "backends": 1,  # bytes at keys: local disk, S3, memory
    "store": 2,  # content-addressed objects, blobs, refs over a backend
    "bundle": 3,  # the bundle format over a store
    "replay": 4,  # offline side: reads bundles, recomputes
    "ops": 6,
    # training side: writes bundles, asking replay's registry what a plugin estimator reads; its flight recorder
    # promotes and evicts through cp's object copy and gc
    "capture": 6,
    "integrations": 6,  # framework adapters (verl): the recompute config and bundles of a framework's batch
    "html_plots": 6,
    "html_report": 6,
    "demo": 7,
    "cli": 7,
    "__main__": 8,
}
"""Layer of each top-level module or subpackage of trajectory_replay."""

APART = {"replay": ("backends", "store")}
"""Layers a layer must not import although they lie below it: replay computes over what a source hands it and
reads through the bundle layer, never storage itself."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its body, resolved to the longest known module name."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" for alias in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _layer_key(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    unplaced = sorted({_layer_key(m) for m in graph} - set(LAYERS))
    assert not unplaced, f"modules with no layer in LAYERS: {unplaced}"


def test_no_upward_import(graph: dict[str, set[str]]) -> None:
    upward = []
    for module, targets in graph.items():
        for target in targets:
            here, there = _layer_key(module), _layer_key(target)
            if LAYERS[there] > LAYERS[here]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_the_package_root_imports_nothing(graph: dict[str, set[str]]) -> None:
    """The root holds the version, which any layer may read, so it must stay at the bottom."""
    assert graph["trajectory_replay"] == set()


def test_replay_imports_nothing_of_the_storage_layers(graph: dict[str, set[str]]) -> None:
    found = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _layer_key(target) in APART.get(_layer_key(module), ())
    )
    assert not found, "imports of storage from replay:\n" + "\n".join(found)


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    """Tarjan's strongly connected components: any with more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The graph reader resolves relative and absolute imports, so the checks above cannot pass vacuously."""
    modules = _modules()
    known = set(modules)
    store_imports = _imports(
        "trajectory_replay.store.objectstore", modules["trajectory_replay.store.objectstore"], known
    )
    assert any(m.startswith("trajectory_replay.backends") for m in store_imports)
    assert any(
        m.startswith("trajectory_replay.bundle")
        for m in _imports("trajectory_replay.replay.runner", modules["trajectory_replay.replay.runner"], known)
    )
