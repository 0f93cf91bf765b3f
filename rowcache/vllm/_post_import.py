"""Run a function once a package has finished importing, without importing it.

``call_after_import(name, callback)`` runs ``callback`` at once when ``name`` is already fully
imported; otherwise it puts a small finder at the front of ``sys.meta_path`` that, when the
import system looks for exactly ``name``, asks the other finders for the real spec and wraps
its loader's ``exec_module``: the real loader executes the module, then the callback runs,
before the importing statement gets the module. The finder removes itself once it has fired.

Why a package and not the submodule that defines what the callback needs: a package's
``__init__`` imports its submodules midway, so a hook on a submodule fires while the package is
partially initialised, and importing anything more from the package inside the callback would
hit the half-built package. Once the package's own code has finished, everything it imports is
complete. (The import system still marks the package as initialising while the callback runs;
its module lock is re-entrant, so imports from the callback proceed in the same thread.)

Never fatal: an exception from the callback is logged as one warning and never reaches the
statement that imported the package. An exception from the package's own code propagates as
usual and leaves the finder in place, so that a later import attempt still fires it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["PartiallyImportedError", "call_after_import", "forget", "fully_imported", "pending"]

logger = logging.getLogger("rowcache.vllm")

_lock = threading.Lock()


class PartiallyImportedError(ImportError):
    """The package is being imported right now (it is in ``sys.modules`` but its code has not
    finished): the finder would never see it again and the callback could not run safely."""


def fully_imported(name: str) -> bool:
    """Whether ``name`` is in ``sys.modules`` and its code has finished executing."""
    module = sys.modules.get(name)
    if module is None:
        return False
    # The import system sets spec._initializing while the module's code runs (CPython's
    # importlib._bootstrap uses it the same way to decide whether to wait for the module).
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _run(callback: Callable[[], None], name: str) -> None:
    try:
        callback()
    except Exception as exc:
        # Never let our failure surface in the middle of somebody else's import statement.
        logger.warning(
            "rowcache: the hook after importing %s failed, vLLM runs without the expert cache "
            "(%s: %s)",
            name,
            type(exc).__name__,
            exc,
        )


class _Loader(importlib.abc.Loader):
    """The real loader, with the callback run after ``exec_module``; otherwise transparent."""

    def __init__(self, loader: Any, hook: _AfterImport) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # Leave no trace on the module: code that inspects __loader__ or __spec__.loader (source
        # lookup, resource readers) sees the loader the import system chose.
        module.__loader__ = self._loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        self._hook.fire()

    def __getattr__(self, name: str) -> Any:
        # Everything else a loader offers (get_source, is_package, resource readers, ...).
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback
        self.fired = False
        self._looking = False

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        # Called for every import in the process until the package is imported: keep the
        # common case to one comparison.
        if fullname != self.name or self._looking or self.fired:
            return None
        self._looking = True
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            # Not found (the import fails as it would without us), a namespace package, or a
            # legacy loader: let the import system proceed without the hook.
            return None
        spec.loader = _Loader(spec.loader, self)
        return spec

    def _find_elsewhere(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None,
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def fire(self) -> None:
        with _lock:
            if self.fired:
                return
            self.fired = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        _run(self.callback, self.name)


def call_after_import(name: str, callback: Callable[[], None]) -> bool:
    """Run ``callback`` once ``name`` has finished importing; True when it ran at once.

    Idempotent: a second call with the same name and callback while the first is still waiting
    adds nothing. Raises ``PartiallyImportedError`` when ``name`` is being imported right now.
    ``callback`` exceptions are logged, never raised.
    """
    with _lock:
        # None in sys.modules blocks the import (it then fails without consulting finders);
        # waiting is harmless there.
        if sys.modules.get(name) is None:
            for finder in sys.meta_path:
                if (
                    isinstance(finder, _AfterImport)
                    and finder.name == name
                    and finder.callback == callback
                ):
                    return False
            sys.meta_path.insert(0, _AfterImport(name, callback))
            return False
        if not fully_imported(name):
            raise PartiallyImportedError(
                f"{name} is being imported while the hook is installed; it cannot wait for it"
            )
    _run(callback, name)
    return True


def pending(name: str) -> list[Callable[[], None]]:
    """The callbacks still waiting for ``name`` (for tests and diagnostics)."""
    return [
        finder.callback
        for finder in sys.meta_path
        if isinstance(finder, _AfterImport) and finder.name == name
    ]


def forget(name: str, callback: Callable[[], None]) -> None:
    """Stop waiting to run ``callback`` after ``name`` (nothing if it is not waiting)."""
    with _lock:
        for finder in list(sys.meta_path):
            if (
                isinstance(finder, _AfterImport)
                and finder.name == name
                and finder.callback == callback
            ):
                sys.meta_path.remove(finder)
