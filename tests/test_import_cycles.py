"""No module of ``rowcache/``, ``model_check/`` or ``tools/`` imports a module that imports it
back, directly or through others.

Every module under the three packages is parsed with ``ast``; its edges are the modules of
the three it names in an ``import`` or ``from ... import`` anywhere in it (at module level, under
``TYPE_CHECKING``, or inside a function), relative imports resolved and ``from package import
module`` taken as the module. The package a named module lives in is not an edge of its own
(importing ``rowcache.x.y`` runs ``rowcache/x/__init__.py`` first, whatever imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("rowcache", "model_check", "tools")


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file, for every module and package under the three packages."""
    modules: dict[str, Path] = {}
    for path in sorted(p for package in PACKAGES for p in (repo / package).rglob("*.py")):
        parts = list(path.relative_to(repo).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the three packages ``name`` imports, anywhere in its source."""
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


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    modules = module_files(repo)
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
    assert "model_check.search.property_violated" in graph["model_check.search.machine"]
    assert "tools.vllm.harness.zygote" in graph["tools.vllm.harness.child"]
    assert {name.partition(".")[0] for name in graph} == set(PACKAGES)


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    pairs = sorted((a, b) for a, targets in graph.items() for b in targets if a in graph[b])
    assert pairs == []


def test_no_longer_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]


def _copy_packages(tmp_path: Path) -> Path:
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            target = tmp_path / path.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    return tmp_path


@pytest.mark.parametrize(
    ("module", "imported"),
    [
        ("rowcache/provider_base.py", "rowcache.row_provider"),
        ("model_check/search/device_machine.py", "model_check.search.run_machines"),
        ("tools/vllm/harness/zygote.py", "tools.vllm.harness.child"),
    ],
)
def test_a_seeded_circle_in_each_package_is_found(
    tmp_path: Path, module: str, imported: str
) -> None:
    """In a copy of the packages, a module imports (inside a function, as the circles these
    packages once had did) a module that imports it: the checks above fail on each."""
    repo = _copy_packages(tmp_path)
    path = repo / module
    path.write_text(path.read_text() + f"\n\ndef _seeded() -> None:\n    import {imported}\n")
    graph = import_graph(repo)
    name = module.removesuffix(".py").replace("/", ".")
    assert any(name in component and imported in component for component in cycles(graph))
    assert cycles(import_graph()) == []
