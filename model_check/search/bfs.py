"""Exhaustive breadth-first search of any `Model`.

Breadth-first over (host-call depth, device steps): host calls cost one unit of depth, device
steps cost none, so every host-call sequence up to the bound is combined with every
interleaving of device steps between and after the calls (a 0-1 BFS: each state is expanded
once, at the smallest host-call depth that reaches it). The first violation found is therefore
one with the fewest host calls, and its trace is rebuilt from parent links.

With symmetry, states are stored under `Model.canonical`; a violation's trace is then taken
from a second search without renaming, which reads straight (same violation depth, since
renaming preserves it).

A model may offer `bound_verdicts(state, action)` (`model.BoundVerdicts`): for a host call out
of a state at the depth bound, whose successors are not stored, the number of its outcomes,
whether some verdict may fail and their tags, without computing the states. The search takes
that instead of `Model.outcomes` where no verdict may fail, and `outcomes` everywhere else, so
counts, tags, verdicts and traces are those of the plain search.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterator
from typing import Any, TypeVar

from model_check.search.model import Model, Result, without_cycle_collection
from model_check.streams.interpreter import Action, Outcome

S = TypeVar("S", bound=Hashable)
Parents = dict[Any, tuple[Any, Action, Outcome[Any]] | None]


@without_cycle_collection()
def bfs(
    model: Model[S],
    depth: int,
    *,
    stop_at_first: bool = True,
    symmetry: bool = True,
    only: str | None = None,
) -> Result:
    """Explore every host-call sequence of up to `depth` calls.

    With `only`, violations of other properties are ignored (used to show that a mutant
    breaks the property it was seeded against, not just some property)."""
    start = time.perf_counter()
    result = Result(depth=depth, model=model.name, expected_tags=model.expected_tags)
    canon = model.canonical if symmetry else (lambda s: s)
    init = canon(model.initial())
    best: dict[Any, int] = {init: 0}
    parent: Parents = {init: None}
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
        for action, outcome, cost, known in _moves(model, state, d == depth):
            if outcome is None:
                result.transitions += known[0]
                result.tags |= known[2]
                continue
            result.transitions += 1
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
    if result.violation is not None and symmetry:
        straighten(result, model, depth, only)
    return result


Known = tuple[int, bool, frozenset[str]]


def _moves(
    model: Model[S], state: S, at_bound: bool
) -> Iterator[tuple[Action, Outcome[S] | None, int, Known]]:
    """`successors`, except that a host call out of a state at the bound that the model
    answers with `bound_verdicts`, and whose verdicts all hold, comes as one move without an
    outcome (its count and tags in `known`)."""
    light = getattr(model, "bound_verdicts", None) if at_bound else None
    for action in model.actions(state):
        cost = 1 if action.kind == "host" else 0
        if light is not None and cost:
            known = light(state, action)
            if known is not None and not known[1]:
                yield action, None, cost, known
                continue
        for outcome in model.outcomes(state, action):
            yield action, outcome, cost, NO_KNOWN


NO_KNOWN: Known = (0, False, frozenset())


def straighten(result: Result, model: Model[Any], depth: int, only: str | None) -> None:
    """Replace the trace (and violation) of a search with renaming by those of a search
    without: parent links cross renamed states, a plain search's trace reads straight."""
    plain = bfs(model, depth, symmetry=False, only=only)
    result.trace, result.violation = plain.trace, plain.violation


def _trace(parent: Parents, state: Any) -> list[tuple[Action, Outcome[Any]]]:
    steps: list[tuple[Action, Outcome[Any]]] = []
    link = parent.get(state)
    while link is not None:
        prev, action, outcome = link
        steps.append((action, outcome))
        link = parent.get(prev)
    steps.reverse()
    return steps
