"""The torch seams table (``rowcache.torch_seams``) against the installed torch, and against the
code: every private torch name that ``rowcache/`` or ``tests/`` uses is a row, ``rowcache/``
takes its private names only through the table, and the checker names a seam that moved."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rowcache import torch_seams
from rowcache.torch_seams import (
    RAW_CURRENT_STREAM,
    SANITIZER,
    SANITIZER_ENABLED,
    SANITIZER_KERNEL_LAUNCH,
    SEAMS,
    TorchSeam,
    check_installed,
    check_seam,
    lookup,
)

ROOT = Path(__file__).resolve().parent.parent
TABLE = Path(torch_seams.__file__).resolve()
HERE = Path(__file__).resolve()


def test_every_seam_holds_in_the_installed_torch() -> None:
    failures = check_installed()
    assert not failures, (
        f"torch {torch.__version__}: {len(failures)} private name(s) rowcache relies on moved "
        "(rowcache/torch_seams.py):\n" + "\n".join(failures)
    )


def test_table_is_unique_and_described() -> None:
    assert len({str(seam) for seam in SEAMS}) == len(SEAMS)
    for seam in SEAMS:
        assert seam.module.startswith("torch"), seam
        assert seam.why and seam.breaks and seam.users, seam
        assert any(part.startswith("_") for part in (*seam.module.split("."), *seam.path)), (
            f"{seam}: not private, so not a seam"
        )
        for user in seam.users:
            assert (ROOT / user).is_file(), f"{seam}: user {user} does not exist"
    for seam in SEAMS:
        if seam.cuda_only:
            assert seam.module == "torch._C" and len(seam.path) == 1, seam


# -- the checker must name a seam that moved ------------------------------------------------------


def _one_failure(seam: TorchSeam, failures: list[str]) -> str:
    named = [f for f in failures if f.startswith(f"torch {torch.__version__}: {seam}: ")]
    assert len(failures) == 1 and len(named) == 1, failures
    assert seam.why in named[0] and seam.breaks in named[0]
    return named[0]


def _seam(name: str) -> TorchSeam:
    return next(s for s in SEAMS if s.name == name)


def test_a_removed_handler_method_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.cuda._sanitizer import EventHandler

    monkeypatch.delattr(EventHandler, "_handle_event_wait")
    failure = _one_failure(
        _seam("EventHandler._handle_event_wait(event, stream)"), check_installed()
    )
    assert "torch.cuda._sanitizer.EventHandler has no attribute '_handle_event_wait'" in failure


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.cuda._sanitizer import EventHandler

    def launch(self: Any, stream: int, read_only: Any, read_write: Any, operator: str) -> None: ...

    monkeypatch.setattr(EventHandler, "_handle_kernel_launch", launch)
    failures = check_installed()
    # The backend's row and the oracle's row both name the method.
    assert len(failures) == 2, failures
    oracle = _seam(
        "EventHandler._handle_kernel_launch(stream, read_only, read_write, outputs, operator, "
        "tensor_aliases)"
    )
    for seam in (SANITIZER_KERNEL_LAUNCH, oracle):
        (line,) = [f for f in failures if f.startswith(f"torch {torch.__version__}: {seam}: ")]
        assert "takes (stream, read_only, read_write, operator), not (stream, read_only" in line


def test_a_new_required_argument_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.cuda._sanitizer import EventHandler

    def record(self: Any, event: int, stream: int, *, when: float) -> None: ...

    monkeypatch.setattr(EventHandler, "_handle_event_record", record)
    failure = _one_failure(
        _seam("EventHandler._handle_event_record(event, stream)"), check_installed()
    )
    assert "needs more arguments than rowcache passes: when" in failure


def test_a_removed_module_level_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.cuda._sanitizer as csan

    monkeypatch.delattr(csan.cuda_sanitizer, "enabled")
    failure = _one_failure(SANITIZER_ENABLED, check_installed())
    assert "torch.cuda._sanitizer.cuda_sanitizer has no attribute 'enabled'" in failure


def test_a_missing_module_is_named() -> None:
    seam = TorchSeam("torch.cuda._gone", "thing", "why", "breaks", ("x",))
    problem = check_seam(seam)
    assert problem is not None
    assert problem.startswith(f"torch {torch.__version__}: torch.cuda._gone.thing: module ")
    assert "cannot be imported" in problem


def test_cuda_only_seam_on_a_cpu_build_checks_the_stub() -> None:
    # The installed stub declares it (the default check, CPU build or not):
    assert check_seam(RAW_CURRENT_STREAM, cuda_built=False) is None
    gone = check_seam(RAW_CURRENT_STREAM, cuda_built=False, stub="def _other(x: int) -> int: ...\n")
    assert gone is not None and gone.startswith(
        f"torch {torch.__version__}: {RAW_CURRENT_STREAM}: "
    )
    assert "not declared in torch/_C/__init__.pyi" in gone
    renamed = check_seam(
        RAW_CURRENT_STREAM,
        cuda_built=False,
        stub="def _cuda_getCurrentRawStream(stream: _int) -> _int: ...\n",
    )
    assert renamed is not None and "takes (stream), not (device) first" in renamed


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build defines the function")
def test_cuda_only_seam_must_resolve_on_a_cuda_build() -> None:
    """What a CUDA build of torch without the function would report (seeded: this CPU build,
    told it is a CUDA build)."""
    problem = check_seam(RAW_CURRENT_STREAM, cuda_built=True)
    assert problem is not None
    assert "torch._C has no attribute '_cuda_getCurrentRawStream' (a CUDA build" in problem


def test_cuda_only_seam_on_a_cuda_build_also_checks_the_stub(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A C function has no readable signature; its parameters are checked in the stub. Seeded
    on any build: a signature-less torch._C function stands in for the CUDA one."""
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", torch._C._get_tracing_state, raising=False
    )
    assert check_seam(RAW_CURRENT_STREAM, cuda_built=True) is None
    renamed = check_seam(
        RAW_CURRENT_STREAM,
        cuda_built=True,
        stub="def _cuda_getCurrentRawStream(stream: _int) -> _int: ...\n",
    )
    assert renamed is not None and "takes (stream), not (device) first" in renamed


def test_lookup_never_imports_and_tolerates_missing_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, SANITIZER, raising=False)
    assert lookup(SANITIZER_ENABLED) is None
    assert SANITIZER not in sys.modules
    assert lookup(SANITIZER_ENABLED, object()) is None
    import torch.cuda._sanitizer as csan

    assert lookup(SANITIZER_ENABLED, csan) is csan.cuda_sanitizer.enabled
    assert (
        lookup(SANITIZER_KERNEL_LAUNCH, csan)
        == csan.cuda_sanitizer.dispatch.event_handler._handle_kernel_launch
    )
    expected = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    assert lookup(RAW_CURRENT_STREAM) is expected


# -- the table is the single list: every private torch name in the code is a row ---------------

_TORCH_NAME = re.compile(r"\btorch(?:\.\w+)+")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _split(dotted: str) -> tuple[str, str] | None:
    """``torch.a._b.c.d`` -> (longest importable module prefix, the next name or "")."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            importlib.import_module(module)
        except ImportError:
            continue
        return module, parts[end] if end < len(parts) else ""
    return None


@dataclass
class Uses:
    """What one file uses of torch's private names."""

    names: set[tuple[str, str]] = field(default_factory=set)
    """(module, first name under it, "" for the module itself), private ones only."""
    attributes: set[str] = field(default_factory=set)
    """Every ``._name`` attribute the file reads (private names of torch objects among them)."""
    defined: set[str] = field(default_factory=set)
    """Private names the file defines itself (so not torch's)."""

    def add(self, dotted: str) -> None:
        if not dotted.startswith("torch.") or not any(map(_private, dotted.split("."))):
            return
        split = _split(dotted)
        if split is not None and (any(map(_private, split[0].split("."))) or _private(split[1])):
            self.names.add(split)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([bound.get(node.id, node.id), *reversed(parts)])


def _uses(path: Path, *, docstrings: bool = True) -> Uses:
    return _uses_source(path.read_text(), docstrings=docstrings)


def _uses_source(source: str, *, docstrings: bool = True) -> Uses:
    tree = ast.parse(source)
    uses = Uses()
    bound = {"torch": "torch"}
    skip = set() if docstrings else _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                uses.add(alias.name)
                if alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                uses.add(full)
                bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            uses.attributes.add(node.attr)
            if (dotted := _dotted(node, bound)) is not None:
                uses.add(dotted)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and (dotted := _dotted(node.args[0], bound)) is not None
        ):
            uses.add(f"{dotted}.{node.args[1].value}")
            uses.attributes.add(node.args[1].value)
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            for match in _TORCH_NAME.finditer(node.value):
                uses.add(match.group(0))
            if "import torch" in node.value:
                # A script run in a subprocess: scanned as code.
                try:
                    script = _uses_source(node.value)
                except SyntaxError:
                    continue
                uses.names |= script.names
                uses.attributes |= script.attributes
                uses.defined |= script.defined
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            uses.defined.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute):
                        uses.defined.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        uses.defined.add(sub.id)
    return uses


def _files(folder: str) -> Iterator[Path]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.resolve() not in (TABLE, HERE):
            yield path


def _torch_private_attributes() -> set[str]:
    """Private names of the Python modules the table names, their classes and instances."""
    found: set[str] = set()
    for module_name in {seam.module for seam in SEAMS} - {"torch._C"}:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if _private(name):
                found.add(name)
            owner = value if isinstance(value, type) else type(value)
            if getattr(owner, "__module__", None) == module_name:
                found |= {n for n in vars(owner) if _private(n)}
                if not isinstance(value, type):
                    found |= {n for n in getattr(value, "__dict__", {}) if _private(n)}
    return found


def _listed() -> tuple[set[tuple[str, str]], set[str]]:
    names = {(seam.module, seam.path[0]) for seam in SEAMS}
    names |= {(seam.module, "") for seam in SEAMS}
    attributes = {part for seam in SEAMS for part in seam.path if _private(part)}
    return names, attributes


def test_every_private_torch_name_in_the_code_is_a_seam() -> None:
    corpus = {path: _uses(path) for folder in ("rowcache", "tests") for path in _files(folder)}
    ours = set().union(*(uses.defined for uses in corpus.values()))
    theirs = _torch_private_attributes() - ours
    names, attributes = _listed()
    missing = []
    for path, uses in corpus.items():
        rel = path.relative_to(ROOT)
        missing += [f"{rel}: {m}.{n}" if n else f"{rel}: {m}" for m, n in uses.names - names]
        missing += [f"{rel}: .{a}" for a in sorted((uses.attributes & theirs) - attributes)]
    assert not missing, (
        "private torch names used but not in rowcache/torch_seams.py:\n" + "\n".join(missing)
    )


def test_every_seam_is_used_where_the_table_says() -> None:
    constants = {id(v): k for k, v in vars(torch_seams).items() if isinstance(v, TorchSeam)}
    stale = []
    for seam in SEAMS:
        for user in seam.users:
            if user.startswith("rowcache/"):
                # rowcache takes the name through the table: it imports the row's constant.
                constant = constants.get(id(seam))
                imported = {
                    alias.name
                    for node in ast.walk(ast.parse((ROOT / user).read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module == "rowcache.torch_seams"
                    for alias in node.names
                }
                if constant is None or constant not in imported:
                    stale.append(f"{seam}: {user} does not import it from rowcache.torch_seams")
                continue
            uses = _uses(ROOT / user)
            # By its name under the module, or by the attributes under it read in a file that
            # uses the module (a private method of a handler object, a field of an error).
            rest = {part for part in seam.path[1:] if not part.startswith("__")}
            private = {part for part in rest if _private(part)}
            module_used = any(module == seam.module for module, _ in uses.names)
            if (seam.module, seam.path[0]) not in uses.names and not (
                module_used and rest and (rest <= uses.attributes or private & uses.attributes)
            ):
                stale.append(f"{seam}: {user} does not use it")
    assert not stale, "\n".join(stale)


def test_rowcache_takes_private_torch_names_only_through_the_table() -> None:
    direct = []
    for path in _files("rowcache"):
        uses = _uses(path, docstrings=False)
        direct += [f"{path.relative_to(ROOT)}: {m}.{n}" for m, n in sorted(uses.names)]
    assert not direct, "use rowcache.torch_seams (lookup) instead:\n" + "\n".join(direct)


def test_the_scanner_finds_the_forms_in_use(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "import torch.cuda._sanitizer as csan\n"
        "from torch.cuda import _sanitizer as alias\n"
        "from torch.cuda._sanitizer import EventHandler\n"
        "x = torch._C._cuda_getCurrentRawStream(0)\n"
        "y = getattr(torch._C, '_cuda_sleep', None)\n"
        "csan.cuda_sanitizer.enabled\n"
        "alias.enable_cuda_sanitizer()\n"
        "EventHandler()._handle_event_wait(1, 2)\n"
        "torch.cuda._sleep(5)\n"
        "z = 'torch.cuda._sanitizer.Access'\n"
        "torch.cuda.current_stream()\n"
    )
    uses = _uses(sample)
    assert uses.names == {
        ("torch.cuda._sanitizer", ""),
        ("torch.cuda._sanitizer", "EventHandler"),
        ("torch.cuda._sanitizer", "cuda_sanitizer"),
        ("torch.cuda._sanitizer", "enable_cuda_sanitizer"),
        ("torch.cuda._sanitizer", "Access"),
        ("torch._C", ""),
        ("torch._C", "_cuda_getCurrentRawStream"),
        ("torch._C", "_cuda_sleep"),
        ("torch.cuda", "_sleep"),
    }
    assert "_handle_event_wait" in uses.attributes & _torch_private_attributes()
