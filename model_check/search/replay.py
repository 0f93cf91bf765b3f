"""Replay host calls (a z3 counterexample's) on an explicit model: every interleaving of device
steps between the calls and after the last; the properties met on the way.

The model is given as three functions, so that a call outside the model's explored set (z3
picks any arguments) can be made: `moves(state)`, the outcomes of every device step and
resume; `call(state, op, args, stream)`, the host call's outcome (None where no host call can
be made, as while one is blocked in a host sync); `deadlocked(state)`, whether pending
operations remain and none can run (P7).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

from model_check.table.properties import DEADLOCK

S = TypeVar("S", bound=Hashable)
Call = tuple[str, tuple[object, ...], int]  # (operation, arguments, stream)

LIMIT = 100_000  # transitions per replay before giving up


def replay(
    initial: S,
    moves: Callable[[S], Sequence[Any]],
    call: Callable[[S, str, tuple[object, ...], int], Any],
    deadlocked: Callable[[S], bool],
    calls: Sequence[Call],
    limit: int = LIMIT,
) -> dict[str, str] | None:
    """Property -> the first detail met (None: more than `limit` transitions). Outcomes are
    anything with `state` and `violation`."""
    found: dict[str, str] = {}
    total = 0

    def close(frontier: set[S]) -> set[S] | None:
        nonlocal total
        seen = set(frontier)
        work = list(frontier)
        while work:
            st = work.pop()
            if deadlocked(st):
                found.setdefault(DEADLOCK.prop, DEADLOCK.detail)
            outs = moves(st)
            for out in outs:
                if out.violation is not None:
                    found.setdefault(out.violation.prop, out.violation.detail)
                if out.state not in seen:
                    seen.add(out.state)
                    work.append(out.state)
            total += len(outs)
            if total > limit:
                return None
        return seen

    frontier = {initial}
    for op, args, stream in calls:
        states = close(frontier)
        if states is None:
            return None
        frontier = set()
        for st in states:
            out = call(st, op, args, stream)
            if out is None:
                continue
            if out.violation is not None:
                found.setdefault(out.violation.prop, out.violation.detail)
            frontier.add(out.state)
    return None if close(frontier) is None else found


__all__ = ["LIMIT", "Call", "replay"]
