"""The post-import hook (``rowcache.vllm._post_import``) on throwaway packages in a temp dir:
it fires once, after the package's own code has finished, or at once when the package is
already imported; a failing callback is logged, never raised into the import statement."""

from __future__ import annotations

import importlib
import itertools
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rowcache.vllm._post_import import (
    PartiallyImportedError,
    call_after_import,
    forget,
    fully_imported,
    pending,
)

_names = itertools.count()


class Pkg:
    """A package ``name`` in ``root``, its ``__init__`` importing a submodule midway."""

    def __init__(self, root: Path) -> None:
        self.name = f"rowcache_hook_pkg_{next(_names)}"
        self.root = root
        self.dir = root / self.name
        self.dir.mkdir()
        self.write_init("")
        (self.dir / "inner.py").write_text("VALUE = 42\n")
        (self.dir / "late.py").write_text("LATE = 'late'\n")

    def write_init(self, extra: str) -> None:
        lines = [
            f"from {self.name}.inner import VALUE",
            extra,
            "DONE = True  # the last line: set only once the package's code has finished",
        ]
        (self.dir / "__init__.py").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()

    def module(self) -> object:
        return sys.modules[self.name]

    def forget(self) -> None:
        for name in list(sys.modules):
            if name == self.name or name.startswith(self.name + "."):
                del sys.modules[name]


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pkg]:
    monkeypatch.syspath_prepend(str(tmp_path))
    made = Pkg(tmp_path)
    yield made
    for callback in pending(made.name):
        forget(made.name, callback)
    made.forget()


class Recorder:
    """A callback that records what it saw of the package when it ran."""

    def __init__(self, pkg: Pkg, also: Callable[[], None] | None = None) -> None:
        self.pkg = pkg
        self.seen: list[tuple[bool, int, bool]] = []
        self.also = also

    def __call__(self) -> None:
        module = self.pkg.module()
        self.seen.append(
            (getattr(module, "DONE", False), module.VALUE, fully_imported(f"{self.pkg.name}.inner"))  # type: ignore[attr-defined]
        )
        if self.also is not None:
            self.also()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "rowcache.vllm" and r.levelno >= logging.WARNING
    ]


def test_fires_once_after_the_package_executed(pkg: Pkg) -> None:
    record = Recorder(pkg)
    assert call_after_import(pkg.name, record) is False
    assert record.seen == [] and pending(pkg.name) == [record]
    module = importlib.import_module(pkg.name)
    # It ran after the package's last line, with its submodule complete.
    assert record.seen == [(True, 42, True)]
    assert pending(pkg.name) == []
    # No trace left on the module: its loader is the one the import system chose.
    assert module.__loader__ is module.__spec__.loader
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    # Importing again (cached, or afresh after being forgotten) does not fire again.
    importlib.import_module(pkg.name)
    pkg.forget()
    importlib.import_module(pkg.name)
    assert record.seen == [(True, 42, True)]


def test_fires_at_once_when_already_imported(pkg: Pkg) -> None:
    importlib.import_module(pkg.name)
    record = Recorder(pkg)
    assert call_after_import(pkg.name, record) is True
    assert record.seen == [(True, 42, True)] and pending(pkg.name) == []


def test_fires_for_a_submodule_import(pkg: Pkg) -> None:
    # Importing a submodule first imports (and completes) the package.
    record = Recorder(pkg)
    call_after_import(pkg.name, record)
    importlib.import_module(f"{pkg.name}.late")
    assert record.seen == [(True, 42, True)]


def test_callback_can_import_more_of_the_package(pkg: Pkg) -> None:
    got: list[str] = []

    def load_late() -> None:
        got.append(importlib.import_module(f"{pkg.name}.late").LATE)

    call_after_import(pkg.name, load_late)
    importlib.import_module(pkg.name)
    assert got == ["late"]


def test_failing_callback_is_logged_not_raised(pkg: Pkg, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise AttributeError("no such seam")

    call_after_import(pkg.name, broken)
    module = importlib.import_module(pkg.name)  # the import statement succeeds
    assert module.DONE is True  # type: ignore[attr-defined]
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert pkg.name in warnings[0] and "AttributeError: no such seam" in warnings[0]
    assert pending(pkg.name) == []
    # At once, too.
    caplog.clear()
    assert call_after_import(pkg.name, broken) is True
    assert len(_warnings(caplog)) == 1


def test_idempotent_while_waiting(pkg: Pkg) -> None:
    record = Recorder(pkg)
    other = Recorder(pkg)
    for _ in range(3):
        call_after_import(pkg.name, record)
    call_after_import(pkg.name, other)
    assert pending(pkg.name) == [record, other]
    importlib.import_module(pkg.name)
    assert len(record.seen) == 1 and len(other.seen) == 1


def test_failing_package_keeps_the_hook_for_the_next_attempt(pkg: Pkg) -> None:
    record = Recorder(pkg)
    call_after_import(pkg.name, record)
    pkg.write_init("raise RuntimeError('broken package')")
    with pytest.raises(RuntimeError, match="broken package"):
        importlib.import_module(pkg.name)
    assert record.seen == [] and pending(pkg.name) == [record]
    pkg.forget()
    pkg.write_init("")
    importlib.import_module(pkg.name)
    assert record.seen == [(True, 42, True)]


def test_missing_package_fails_as_usual(pkg: Pkg) -> None:
    record = Recorder(pkg)
    missing = pkg.name + "_missing"
    call_after_import(missing, record)
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(missing)
        assert pending(missing) == [record]
    finally:
        forget(missing, record)
    assert pending(missing) == []


def test_other_imports_are_not_touched(pkg: Pkg) -> None:
    record = Recorder(pkg)
    call_after_import(pkg.name + "_other", record)
    try:
        module = importlib.import_module(pkg.name)
        assert record.seen == [] and module.__loader__ is module.__spec__.loader
    finally:
        forget(pkg.name + "_other", record)


def test_partially_imported_package_is_refused(pkg: Pkg) -> None:
    # The package's own code asks to wait for the package: it is neither absent nor complete.
    pkg.write_init(
        "from rowcache.vllm._post_import import call_after_import\n"
        "try:\n"
        "    call_after_import(__name__, lambda: None)\n"
        "except ImportError as exc:\n"
        "    REFUSED = exc\n"
    )
    module = importlib.import_module(pkg.name)
    refused = module.REFUSED  # type: ignore[attr-defined]
    assert isinstance(refused, PartiallyImportedError)
    assert "is being imported" in str(refused)
    assert fully_imported(pkg.name)


# -- wrapt underneath: when it fires, and what rowcache adds -------------------------------------


def test_a_hook_on_the_submodule_fires_midway(pkg: Pkg) -> None:
    """Why the plugin waits for the package: its __init__ imports the submodule on its first
    line, so a hook on the submodule runs while the package is half built; the package's own
    hook runs after its last line, with the submodule complete."""
    midway: list[tuple[bool, bool]] = []

    def on_inner() -> None:
        midway.append((getattr(pkg.module(), "DONE", False), fully_imported(pkg.name)))

    record = Recorder(pkg)
    call_after_import(f"{pkg.name}.inner", on_inner)
    call_after_import(pkg.name, record)
    importlib.import_module(pkg.name)
    assert midway == [(False, False)]
    assert record.seen == [(True, 42, True)]


def test_shares_wrapts_hooks_with_other_users(pkg: Pkg) -> None:
    """Another wrapt user (OpenTelemetry's instrumentation, say) waiting for the same package:
    both run once, in registration order, after the package's code."""
    import wrapt

    order: list[tuple[str, bool]] = []

    def other(module: object) -> None:
        order.append(("other", getattr(module, "DONE", False)))

    def ours() -> None:
        order.append(("rowcache", getattr(pkg.module(), "DONE", False)))

    wrapt.register_post_import_hook(other, pkg.name)
    call_after_import(pkg.name, ours)
    importlib.import_module(pkg.name)
    assert order == [("other", True), ("rowcache", True)]


def test_forgotten_callbacks_do_not_run(pkg: Pkg) -> None:
    record = Recorder(pkg)
    call_after_import(pkg.name, record)
    forget(pkg.name, record)
    assert pending(pkg.name) == []
    importlib.import_module(pkg.name)
    assert record.seen == []
    # Waiting again after the package was imported and forgotten by sys.modules works anew.
    pkg.forget()
    call_after_import(pkg.name, record)
    importlib.import_module(pkg.name)
    assert record.seen == [(True, 42, True)]


def test_without_wrapt_waiting_raises_and_leaves_nothing(
    pkg: Pkg, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wrapt", None)
    record = Recorder(pkg)
    with pytest.raises(ImportError):
        call_after_import(pkg.name, record)
    assert pending(pkg.name) == []
    # Running at once needs no wrapt.
    importlib.import_module(pkg.name)
    assert record.seen == []
    assert call_after_import(pkg.name, record) is True
    assert record.seen == [(True, 42, True)]
