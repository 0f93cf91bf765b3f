"""Exhaustive explicit-state exploration of the table's semantics.

Breadth-first over (host-call depth, device steps): host calls cost one unit of depth, device
steps cost none, so every host-call sequence up to the bound is combined with every
interleaving of device steps between and after the calls (a 0-1 BFS: each state is expanded
once, at the smallest host-call depth that reaches it). The first violation found is therefore
one with the fewest host calls, and its trace is rebuilt from parent links.

Symmetry: the two consumer streams are interchangeable, so each state is stored under the
smaller of itself and its copy with the streams swapped (and the owner renamed).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from model_check.reference import NO_STREAM, Bounds
from model_check.semantics import (
    Action,
    Outcome,
    State,
    Violation,
    can_resume,
    deadlocked,
    device_step,
    host_actions,
    host_call,
    initial_state,
    resume,
    runnable,
)
from model_check.table import Table

REACHABILITY: dict[str, str] = {
    "eviction": "a prepare evicts a resident expert",
    "owner_change": "a prepare is called from a stream other than the owner",
    "prepare_all_hits": "a prepare finds every requested expert resident",
    "copy_while_slot_read_pending": "a copy into a slot is enqueued while a read of it is pending",
    "freed_slot_reused_while_read_pending": "a slot freed by invalidate is refilled while a "
    "reader of it is pending",
    "copy_waits_on_reader": "the copy stream's release wait depends on a pending read",
    "invalidate_resident": "invalidate removes a resident expert",
    "staging_resident_buffer_reused": "a resident-map staging buffer is reused",
    "staging_resident_fresh_buffer": "a resident-map staging buffer is still in flight, so a "
    "fresh one is taken",
    "rejected_prepare": "a prepare with bad input is rejected",
    "device_idle": "the device drains completely after work was enqueued",
}


@dataclass
class Result:
    bounds: Bounds
    depth: int
    states: int = 0
    transitions: int = 0
    max_depth_reached: int = 0
    seconds: float = 0.0
    violation: Violation | None = None
    trace: list[tuple[Action, Outcome]] = field(default_factory=list)
    tags: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def missing_reachability(self) -> list[str]:
        return sorted(set(REACHABILITY) - self.tags)


def _swap_streams(state: State, a: int, b: int) -> State:
    def s(x: int) -> int:
        return b if x == a else a if x == b else x

    def ref(r: tuple[int, int] | None) -> tuple[int, int] | None:
        return None if r is None else (s(r[0]), r[1])

    queues = list(state.queues)
    queues[a], queues[b] = queues[b], queues[a]
    queues = [
        tuple((op[0], op[1], op[2], tuple((s(r[0]), r[1]) for r in op[3]), op[4]) for op in q)
        for q in queues
    ]
    owner = state.host.owner
    blocked = state.blocked
    if blocked is not None:
        blocked = (blocked[0], s(blocked[1]), *blocked[2:])  # type: ignore[arg-type]
    return state._replace(
        host=state.host._replace(owner=s(owner) if owner != NO_STREAM else owner),
        queues=tuple(queues),
        events=tuple(ref(e) for e in state.events),
        staging=tuple(
            tuple(b._replace(reader=ref(b.reader), reuse=ref(b.reuse)) for b in ring)
            for ring in state.staging
        ),
        blocked=blocked,
    )


def canonical(state: State, bounds: Bounds) -> State:
    if bounds.consumer_streams != 2:
        return state
    swapped = _swap_streams(state, 0, 1)
    return min(state, swapped, key=repr) if swapped != state else state


def successors(table: Table, bounds: Bounds, state: State) -> list[tuple[Action, Outcome, int]]:
    """(action, outcome, cost): cost 1 for a host call, 0 for device steps and resumes."""
    out: list[tuple[Action, Outcome, int]] = []
    for sid in range(len(state.queues)):
        if runnable(state, sid):
            out.append((Action("device", stream=sid), device_step(state, sid), 0))
    if state.blocked is not None:
        if can_resume(state, bounds, table):
            out.append((Action("resume"), resume(table, bounds, state), 0))
        return out
    for action in host_actions(bounds):
        if action.op == "read" and state.read_issued:
            continue  # one read per forward map bounds the consumer
        outcome = host_call(table, bounds, state, action.op, action.args, action.stream)
        out.append((action, outcome, 1))
    return out


def explore(table: Table, bounds: Bounds, depth: int, *, stop_at_first: bool = True) -> Result:
    start = time.perf_counter()
    result = Result(bounds=bounds, depth=depth)
    init = canonical(initial_state(bounds), bounds)
    best: dict[State, int] = {init: 0}
    parent: dict[State, tuple[State, Action, Outcome] | None] = {init: None}
    work: deque[tuple[State, int]] = deque([(init, 0)])
    while work:
        state, d = work.popleft()
        if best[state] < d:
            continue
        result.max_depth_reached = max(result.max_depth_reached, d)
        if deadlocked(state):
            result.violation = Violation(
                "P7_no_deadlock", "pending operations remain and none can run"
            )
            result.trace = _trace(parent, state)
            break
        for action, outcome, cost in successors(table, bounds, state):
            result.transitions += 1
            result.tags |= outcome.tags
            if outcome.violation is not None and result.violation is None:
                result.violation = outcome.violation
                result.trace = [*_trace(parent, state), (action, outcome)]
                if stop_at_first:
                    break
            nd = d + cost
            if nd > depth:
                continue
            nxt = canonical(outcome.state, bounds)
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


def _trace(
    parent: dict[State, tuple[State, Action, Outcome] | None], state: State
) -> list[tuple[Action, Outcome]]:
    steps: list[tuple[Action, Outcome]] = []
    link = parent.get(state)
    while link is not None:
        prev, action, outcome = link
        steps.append((action, outcome))
        link = parent.get(prev)
    steps.reverse()
    return steps
