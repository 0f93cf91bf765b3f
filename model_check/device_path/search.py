"""Breadth-first search over a model (initial, canonical, stuck, successors), as in
model_check/explorer.py: host calls cost one unit of depth, device steps none (a 0-1 BFS), so
the first violation found has the fewest host calls; its trace comes from parent links."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from model_check.device_path.core import Violation


class Model(Protocol):
    name: str

    def initial(self) -> Any: ...

    def canonical(self, state: Any) -> Any: ...

    def stuck(self, state: Any) -> Violation | None: ...

    def successors(self, state: Any) -> list[tuple[Any, ...]]: ...


@dataclass
class Result:
    depth: int
    model: str
    states: int = 0
    transitions: int = 0
    max_depth_reached: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    trace: list[tuple[Any, Any]] = field(default_factory=list)
    tags: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None


def search(
    model: Model,
    depth: int,
    *,
    only: str | None = None,
    stop_at_first: bool = True,
    symmetry: bool = True,
) -> Result:
    start = time.perf_counter()
    result = Result(depth=depth, model=model.name)
    canon = model.canonical if symmetry else (lambda s: s)
    init = canon(model.initial())
    best: dict[Any, int] = {init: 0}
    parent: dict[Any, tuple[Any, Any, Any] | None] = {init: None}
    work: deque[tuple[Any, int]] = deque([(init, 0)])
    while work:
        state, d = work.popleft()
        if best[state] < d:
            continue
        result.max_depth_reached = max(result.max_depth_reached, d)
        stuck = model.stuck(state)
        if stuck is not None and only in (None, stuck.prop):
            result.violation = stuck
            result.trace = _trace(parent, state)
            break
        # A model may know that transitions out of a state at the bound need only their
        # verdicts and tags (the states they reach are not stored).
        at_bound = getattr(model, "successors_at_bound", None)
        moves = (
            at_bound(state, only)
            if at_bound is not None and d == depth
            else model.successors(state)
        )
        for move in moves:
            action, outcome, cost = move[0], move[1], move[2]
            # A fourth element: the move stands for that many transitions (a model's summary
            # of the host calls out of a state at the bound; their states are not stored).
            result.transitions += move[3] if len(move) > 3 else 1
            result.tags |= outcome.tags
            found = outcome.violation
            if found is not None and only is not None and found.prop != only:
                found = None
            if found is not None and result.violation is None:
                result.violation = found
                result.trace = [*_trace(parent, state), (action, outcome)]
                if stop_at_first:
                    break
            nd = d + cost
            if nd > depth:
                continue
            nxt = canon(outcome.state)
            old = best.get(nxt)
            if old is None or nd < old:
                best[nxt] = nd
                parent[nxt] = (state, action, outcome)
                if cost:
                    work.append((nxt, nd))
                else:
                    work.appendleft((nxt, nd))
        if result.violation is not None and stop_at_first:
            break
    result.states = len(best)
    result.seconds = time.perf_counter() - start
    return result


def _trace(parent: dict[Any, tuple[Any, Any, Any] | None], state: Any) -> list[tuple[Any, Any]]:
    steps: list[tuple[Any, Any]] = []
    link = parent.get(state)
    while link is not None:
        prev, action, outcome = link
        steps.append((action, outcome))
        link = parent.get(prev)
    steps.reverse()
    return steps
