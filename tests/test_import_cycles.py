"""No module of ``rowcache/`` imports a module that imports it back.

Every module under ``rowcache/`` is parsed with ``ast``; its edges are the rowcache modules it
names in an ``import`` or ``from ... import`` anywhere in it (at module level, under
``TYPE_CHECKING``, or inside a function), relative imports resolved and ``from package import
module`` taken as the module. The package a named module lives in is not an edge of its own
(importing ``rowcache.x.y`` runs ``rowcache/x/__init__.py`` first, whatever imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rowcache"


def module_files() -> dict[str, Path]:
    """Dotted name -> file, for every module and package under ``rowcache/``."""
    modules: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The rowcache modules ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_at_every_level() -> None:
    graph = import_graph()
    # Module level, and inside a function (``default_backend`` imports the CUDA backend).
    assert "rowcache.provider_base" in graph["rowcache.row_provider"]
    assert "rowcache.backends.cuda" in graph["rowcache.row_provider"]
    assert "rowcache.provider_base" in graph["rowcache.device_plan.provider"]


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    pairs = sorted((a, b) for a, targets in graph.items() for b in targets if a in graph[b])
    assert pairs == []


def test_no_longer_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
