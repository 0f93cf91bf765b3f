"""Detection of overlapping host calls on one provider.

Providers order their device work assuming host calls are sequential. Two
threads inside one provider at once would interleave slot and map updates, so
the second caller gets a ``ConcurrentCallError`` instead: never a silent race,
and never a wait (a blocking lock could deadlock a caller that re-enters from a
callback, and would hide the contract violation).
"""

from __future__ import annotations

import threading
from types import TracebackType

from rowcache.errors import ConcurrentCallError

__all__ = ["CallGuard"]


class CallGuard:
    """One per provider instance; ``with guard("prepare"): ...`` around each host call."""

    __slots__ = ("_active", "_holder", "_lock", "_owner")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._active: str | None = None
        self._holder: int | None = None

    def __call__(self, op: str) -> _Held:
        # A plain context-manager object rather than @contextmanager: this runs on every
        # prepare, whose host time is measured in microseconds.
        return _Held(self, op)

    def enter(self, op: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise self._conflict(op)
        self._active = op
        self._holder = threading.get_ident()

    def leave(self) -> None:
        self._active = None
        self._holder = None
        self._lock.release()

    def _conflict(self, op: str) -> ConcurrentCallError:
        # Read once: the holder may leave between the failed acquire and here.
        active, holder = self._active, self._holder
        running = f"{self._owner}.{active}" if active is not None else f"another {self._owner} call"
        if holder == threading.get_ident():
            where = "re-entered from the same thread while"
        else:
            where = "called from another thread while"
        return ConcurrentCallError(
            f"{self._owner}.{op} {where} {running} was running; host calls on one "
            "provider must be sequential"
        )


class _Held:
    """The guard held for one call: entering acquires it, leaving releases it."""

    __slots__ = ("_guard", "_op")

    def __init__(self, guard: CallGuard, op: str) -> None:
        self._guard = guard
        self._op = op

    def __enter__(self) -> None:
        self._guard.enter(self._op)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._guard.leave()
