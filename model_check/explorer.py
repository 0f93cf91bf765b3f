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
from typing import Any

from model_check.core import (
    Accepted,
    Action,
    Outcome,
    Rejected,
    Violation,
    begin_call,
    host_actions,
)
from model_check.hb import (
    DeviceCache,
    HbState,
    Pending,
    Places,
    hb_host_call,
    initial_hb_state,
    live_places,
)
from model_check.reference import NO_STREAM, Bounds, HostState
from model_check.semantics import (
    NO_COUNTS,
    State,
    can_resume,
    deadlocked,
    device_step,
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
    model: str = "interleavings"
    trace: list[tuple[Action, Outcome[Any]]] = field(default_factory=list)
    tags: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None

    def missing_reachability(self) -> list[str]:
        expected = set(REACHABILITY)
        if self.model == "happens-before":
            expected.discard("device_idle")  # the summary leaves synchronize to the other model
        return sorted(expected - self.tags)


def _swap(x: int) -> int:
    return 1 - x if x in (0, 1) else x


def _swap_ref(r: tuple[int, int] | None) -> tuple[int, int] | None:
    return None if r is None else (_swap(r[0]), r[1])


def swap_host(host: HostState) -> HostState:
    """The host state with the two consumer streams renamed."""
    return host._replace(owner=_swap(host.owner) if host.owner != NO_STREAM else NO_STREAM)


def _swap_mask(m: int) -> int:
    return (m & ~3) | ((m & 1) << 1) | ((m & 2) >> 1)


def swap_pending(pending: frozenset[Pending]) -> frozenset[Pending]:
    """Pending operations with the two consumer streams' bits exchanged."""
    return frozenset((k, w, _swap_mask(m)) for k, w, m in pending)


class Plans:
    """Guard and effect of host calls (`core.begin_call`), computed once per (host state,
    operation, arguments, stream): they depend on nothing else, and few states differ there."""

    def __init__(self, table: Table, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.found: dict[tuple[object, ...], Accepted | Rejected] = {}

    def get(
        self, host: HostState, op: str, args: tuple[object, ...], stream: int
    ) -> Accepted | Rejected:
        key = (host, op, args, stream)
        begun = self.found.get(key)
        if begun is None:
            begun = begin_call(self.table, self.bounds, host, NO_COUNTS, op, args, stream)
            self.found[key] = begun
        return begun


class QueueModel:
    """The explicit model: FIFO queues, every interleaving of device steps."""

    name = "interleavings"

    def __init__(self, table: Table, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.actions = host_actions(bounds)
        self.plans = Plans(table, bounds)

    def initial(self) -> State:
        return initial_state(self.bounds)

    def canonical(self, state: State) -> State:
        """The consumer streams are interchangeable: keep the smaller of the two namings."""
        if self.bounds.consumer_streams != 2:
            return state
        queues = list(state.queues)
        queues[0], queues[1] = queues[1], queues[0]
        blocked = state.blocked
        if blocked is not None:
            blocked = (blocked[0], _swap(blocked[1]), *blocked[2:5], swap_host(blocked[5]))  # type: ignore[arg-type]
        swapped = state._replace(
            host=swap_host(state.host),
            queues=tuple(
                tuple((o[0], o[1], o[2], tuple((_swap(r[0]), r[1]) for r in o[3]), o[4]) for o in q)
                for q in queues
            ),
            events=tuple(_swap_ref(e) for e in state.events),
            staging=tuple(
                tuple(
                    b._replace(reader=_swap_ref(b.reader), reuse=_swap_ref(b.reuse)) for b in ring
                )
                for ring in state.staging
            ),
            blocked=blocked,
        )
        return min(state, swapped, key=repr)

    def stuck(self, state: State) -> Violation | None:
        if deadlocked(state):
            return Violation("P7_no_deadlock", "pending operations remain and none can run")
        return None

    def successors(self, state: State) -> list[tuple[Action, Outcome[State], int]]:
        """(action, outcome, cost): cost 1 for a host call, 0 for device steps and resumes."""
        out: list[tuple[Action, Outcome[State], int]] = []
        for sid in range(len(state.queues)):
            if runnable(state, sid):
                out.append((Action("device", stream=sid), device_step(state, sid), 0))
        if state.blocked is not None:
            if can_resume(state, self.bounds, self.table):
                out.append((Action("resume"), resume(self.table, self.bounds, state), 0))
            return out
        for action in self.actions:
            if action.op == "read" and state.read_issued:
                continue  # one read per forward map bounds the consumer
            begun = self.plans.get(state.host, action.op, action.args, action.stream)
            outcome = host_call(
                self.table, self.bounds, state, action.op, action.args, action.stream, begun=begun
            )
            out.append((action, outcome, 1))
        return out


def forget_dead(state: HbState) -> HbState:
    """Erase what no later step can read: a forward map already read (reads are one per
    forward), and the last copy into a slot that is neither mapped nor named by a forward map
    still to be read. A read of such a slot without a new copy is then reported as stale,
    which it is."""
    host = state.host
    live_slots = {s for s in host.slot_of if s >= 0}
    if state.read_issued:
        host = host._replace(forward=())
    elif host.forward is not None:
        live_slots |= {s for _, s in host.forward}
    last_copy = tuple(e if s in live_slots else -1 for s, e in enumerate(state.last_copy))
    return state._replace(host=host, last_copy=last_copy)


class HbModel:
    """The happens-before summary: every host-call sequence, device order decided by masks."""

    name = "happens-before"

    def __init__(self, table: Table, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.actions = [a for a in host_actions(bounds) if a.op not in ("read", "synchronize")]
        self.places = Places(bounds)
        # Reads ordered before every stream matter only to P8, i.e. only if some provider
        # operation can block the host.
        self.live = live_places(table, self.places)
        self.cache: DeviceCache = {}
        self.plans = Plans(table, bounds)
        self.keep_reads = any(
            step.kind == "host_sync" for op in table.operations if op.provider for step in op.steps
        )

    def initial(self) -> HbState:
        return initial_hb_state(self.bounds)

    def canonical(self, state: HbState) -> HbState:
        state = forget_dead(state)
        if self.bounds.consumer_streams != 2:
            return state

        swapped = state._replace(host=swap_host(state.host), pending=swap_pending(state.pending))
        return min(state, swapped, key=lambda s: (s.host, sorted(s.pending)))

    def stuck(self, state: HbState) -> Violation | None:
        return None

    def successors(self, state: HbState) -> list[tuple[Action, Outcome[HbState], int]]:
        """Host calls only; each accepted prepare is followed at once by the consumer's read.

        In the summary a pending read only ever adds verdicts against itself (masks evolve
        per operation), so a forward that is read is at least as adversarial as one that is
        not, and without host synchronization between a prepare and the next one the read's
        position among the calls in between changes nothing. The consumer's synchronize only
        retires pending work, which removes violations, and the staging branches already let
        the host see any progress, so it is left to the explicit model.
        """
        out: list[tuple[Action, Outcome[HbState], int]] = []
        for action in self.actions:
            for outcome in self._call(state, action.op, action.args, action.stream):
                accepted = action.op == "prepare" and bool(outcome.trace)
                if accepted and outcome.violation is None:
                    for read in self._call(outcome.state, "read", (), action.stream):
                        out.append((action, _chain(outcome, read), 1))
                else:
                    out.append((action, outcome, 1))
        return out

    def _call(
        self, state: HbState, op: str, args: tuple[object, ...], stream: int
    ) -> list[Outcome[HbState]]:
        return hb_host_call(
            self.table,
            self.bounds,
            state,
            op,
            args,
            stream,
            keep_reads=self.keep_reads,
            live=self.live,
            cache=self.cache,
            begun=self.plans.get(state.host, op, args, stream),
        )


def _chain(first: Outcome[HbState], then: Outcome[HbState]) -> Outcome[HbState]:
    return Outcome(
        then.state,
        then.violation,
        first.tags | then.tags,
        first.trace + then.trace,
        then.counters,
    )


def explore(
    table: Table,
    bounds: Bounds,
    depth: int,
    *,
    model: str = "interleavings",
    stop_at_first: bool = True,
    symmetry: bool = True,
    only: str | None = None,
    fast: bool = True,
) -> Result:
    """Explore every host-call sequence of up to `depth` calls with the chosen device model.

    With `only`, violations of other properties are ignored (used to show that a mutant
    breaks the property it was seeded against, not just some property).

    The happens-before model with symmetry runs through `hb_fast.explore_hb`, which explores
    the same states and transitions with memoized halves; `fast=False` runs this reference
    loop instead (the tests compare the two)."""
    if model != "interleavings" and symmetry and fast:
        from model_check.hb_fast import explore_hb

        return explore_hb(table, bounds, depth, stop_at_first=stop_at_first, only=only)
    m: Any = QueueModel(table, bounds) if model == "interleavings" else HbModel(table, bounds)
    start = time.perf_counter()
    result = Result(bounds=bounds, depth=depth, model=m.name)
    canon = m.canonical if symmetry else (lambda s: s)
    init = canon(m.initial())
    best: dict[Any, int] = {init: 0}
    parent: dict[Any, tuple[Any, Action, Outcome[Any]] | None] = {init: None}
    work: deque[tuple[Any, int]] = deque([(init, 0)])
    while work:
        state, d = work.popleft()
        if best[state] < d:
            continue
        result.max_depth_reached = max(result.max_depth_reached, d)
        stuck = m.stuck(state)
        if stuck is not None and only in (None, stuck.prop):
            result.violation = stuck
            result.trace = _trace(parent, state)
            break
        for action, outcome, cost in m.successors(state):
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
        # Parent links cross renamed states; search again without renaming for a trace that
        # reads straight (same violation depth, since renaming preserves it).
        plain = explore(table, bounds, depth, model=model, symmetry=False, only=only)
        result.trace, result.violation = plain.trace, plain.violation
    return result


def _trace(
    parent: dict[Any, tuple[Any, Action, Outcome[Any]] | None], state: Any
) -> list[tuple[Action, Outcome[Any]]]:
    steps: list[tuple[Action, Outcome[Any]]] = []
    link = parent.get(state)
    while link is not None:
        prev, action, outcome = link
        steps.append((action, outcome))
        link = parent.get(prev)
    steps.reverse()
    return steps
