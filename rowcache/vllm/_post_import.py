"""Run a function once a package has finished importing, without importing it.

``call_after_import(name, callback)`` runs ``callback`` at once when ``name`` is already fully
imported; otherwise it waits through ``wrapt.register_post_import_hook``: wrapt's finder (one
for the whole process, shared with every other wrapt user such as OpenTelemetry's
instrumentation) wraps the package loader's ``exec_module``, so the callback runs right after
the package's own code has executed, before the importing statement gets the module.

Why wrapt (issue 15; measured, ``docs/PLUGIN.md``, "Registration"): it fires at the same point
as the hand-written ``sys.meta_path`` finder this module held before (after the package's
code, whose ``__init__`` imports submodules midway, has completed; at once when already
imported), and the fake-package tests pass against it (one change: ``pending`` now lists
callbacks in registration order, the order they run). Its price is importing wrapt
in each process where the hook has to wait: about 4.5 ms (9 ms median on a busy machine) after
torch, which makes ``register()`` 5 to 10 ms instead of 1 to 1.5 ms; its finder stays on
``sys.meta_path`` (one dictionary lookup per later import, not measurable against the 100 us an
import takes). Against seconds of vLLM start-up that is no reason to keep 200 lines of import
machinery of our own. What this module adds, since wrapt gives neither: callbacks that never
raise into an import statement, idempotence and ``forget``, and the refusal below.

Why a package and not the submodule that defines what the callback needs: a package's
``__init__`` imports its submodules midway, so a hook on a submodule fires while the package is
partially initialised, and importing anything more from the package inside the callback would
hit the half-built package. Once the package's own code has finished, everything it imports is
complete. (The import system still marks the package as initialising while the callback runs;
its module lock is re-entrant, so imports from the callback proceed in the same thread.)

Never fatal: an exception from the callback is logged as one warning and never reaches the
statement that imported the package. An exception from the package's own code propagates as
usual and leaves the callback waiting, so that a later import attempt still fires it. A name
that is being imported right now (in ``sys.modules``, its code not finished) is refused
(``PartiallyImportedError``): wrapt would run the hook at once on the half-built module.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType

__all__ = ["PartiallyImportedError", "call_after_import", "forget", "fully_imported", "pending"]

logger = logging.getLogger("rowcache.vllm")

# Re-entrant: wrapt runs the hook at once (in this thread) when the package appeared between
# our check and the registration.
_lock = threading.RLock()
_waiting: dict[str, list[Callable[[], None]]] = {}
"""The callbacks waiting for each package name, in the order they were registered."""
_armed: set[str] = set()
"""Names with a wrapt hook registered that has not fired (wrapt has no way to remove one)."""


class PartiallyImportedError(ImportError):
    """The package is being imported right now (it is in ``sys.modules`` but its code has not
    finished): the callback could not run safely, and waiting would never fire."""


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


def _fire(module: ModuleType) -> None:
    """The wrapt hook: run what waits for the module, in registration order; never raises."""
    name = module.__name__
    with _lock:
        _armed.discard(name)
        callbacks = _waiting.pop(name, [])
    for callback in callbacks:
        _run(callback, name)


def call_after_import(name: str, callback: Callable[[], None]) -> bool:
    """Run ``callback`` once ``name`` has finished importing; True when it ran at once.

    Idempotent: a second call with the same name and callback while the first is still waiting
    adds nothing. Raises ``PartiallyImportedError`` when ``name`` is being imported right now,
    and ``ImportError`` when it has to wait and wrapt is not installed. ``callback`` exceptions
    are logged, never raised.
    """
    with _lock:
        # None in sys.modules blocks the import (it then fails without consulting finders);
        # waiting is harmless there, as wrapt treats it.
        if sys.modules.get(name) is None:
            waiting = _waiting.setdefault(name, [])
            if callback not in waiting:
                waiting.append(callback)
            if name not in _armed:
                try:
                    # Imported only when a hook has to wait (the package not imported yet).
                    from wrapt import register_post_import_hook
                except ImportError:
                    waiting.remove(callback)
                    raise
                _armed.add(name)
                register_post_import_hook(_fire, name)
            return False
        if not fully_imported(name):
            raise PartiallyImportedError(
                f"{name} is being imported while the hook is installed; it cannot wait for it"
            )
    _run(callback, name)
    return True


def pending(name: str) -> list[Callable[[], None]]:
    """The callbacks still waiting for ``name``, in registration order (tests, diagnostics)."""
    with _lock:
        return list(_waiting.get(name, ()))


def forget(name: str, callback: Callable[[], None]) -> None:
    """Stop waiting to run ``callback`` after ``name`` (nothing if it is not waiting)."""
    with _lock:
        waiting = _waiting.get(name, [])
        if callback in waiting:
            waiting.remove(callback)
