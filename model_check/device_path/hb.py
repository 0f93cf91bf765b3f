"""The happens-before summary of the device-planned path, for search at the full bounds.

As in the host path's summary (model_check/hb.py), every device operation that may not have run
keeps only what a later verdict depends on, here its accesses (core's (resource, mode) pairs),
each with the bit mask of the *places* it happens before: the streams (the consumer streams and
the capture stream) and the event snapshots. Record, wait and a host_sync are bit operations;
every conflict is decided when its second access is enqueued, for all interleavings at once
(an unordered pair is a violation: P1, P2, P4 or P10, core.conflict_prop). Device progress is
never explored: an operation that ran can only remove verdicts, and the device can always be
that slow. The data verdicts (P2's content, P3, P4, P5, P9) are the interpreter's, drawn on the
shadow in host-call order, which is what every interleaving computes as long as no conflicting
pair is unordered (core's module docstring); the first unordered pair stops the search.

A transition is the composition of a host half, the interpreter on the host part alone
(memoized per (host part, call) by explicit.Programs), and a device half, a function of the
pending accesses and of the program's primitives without payloads (memoized here). Reductions,
each argued where it is made: accesses ordered before every stream are dropped; of two pending
accesses of one kind, the one whose mask contains the other's is dropped; event bits no call
waits on before recording again are cleared between calls. `device_synchronize` is left to the
explicit model (it only retires pending work). P7 is the explicit model's: with snapshot waits
the happens-before relation is acyclic by construction.
"""

from __future__ import annotations

from typing import NamedTuple

from model_check.device_path.core import (
    LOOK,
    Action,
    HostPart,
    Interpreter,
    Prim,
    Violation,
    conflict_prop,
    host_actions,
    initial_host,
    resource_name,
)
from model_check.device_path.explicit import _swap
from model_check.device_path.table import DeviceTable
from model_check.table.reference import NO_STREAM, Bounds

Pend = tuple[int, int, int]  # (resource, mode, mask); resource LOOK for a look's read-back


class HbState(NamedTuple):
    """Interned: the host part and the pending accesses, as indices into the model's tables."""

    host: int
    pending: int


class Outcome(NamedTuple):
    state: HbState
    violation: Violation | None
    tags: frozenset[str]


class DeviceHalf(NamedTuple):
    pending: frozenset[Pend]
    violation: Violation | None
    tags: frozenset[str]


def device_program(prims: tuple[Prim, ...]) -> tuple[Prim, ...]:
    """The primitives without what only the data needs."""
    out: list[Prim] = []
    for prim in prims:
        if prim[0] == "op":
            out.append(("op", prim[1], prim[2], prim[4]))
        elif prim[0] == "report":
            out.append(("report",))
        elif prim[0] == "sync":
            out.append(("sync", prim[1]))
        else:
            out.append(prim)
    return tuple(out)


def live_events(table: DeviceTable) -> set[int]:
    """Events some call waits on before recording them in the same call: their snapshot
    between calls can be looked at. The others' bits are cleared between calls."""
    live: set[int] = set()
    for e, name in enumerate(table.events):
        for op in table.operations:
            for step in op.steps:
                if step.event != name:
                    continue
                if step.kind == "wait_event":
                    live.add(e)
                break
    return live


class Summary:
    """The device half of a call on the pending accesses."""

    def __init__(self, table: DeviceTable, bounds: Bounds) -> None:
        self.n_streams = len(table.consumer_streams) + 1
        # Streams something can be enqueued on: the capture stream only when a step names it.
        used = len(table.consumer_streams) + (1 if table.uses_role("capture") else 0)
        self.all_streams = (1 << used) - 1
        live = live_events(table)
        self.live = self.all_streams
        for e in live:
            self.live |= self.event(e)
        self.cache: dict[tuple[frozenset[Pend], tuple[Prim, ...]], DeviceHalf] = {}

    def event(self, e: int) -> int:
        return 1 << (self.n_streams + e)

    def run(self, pending: frozenset[Pend], prims: tuple[Prim, ...]) -> DeviceHalf:
        key = (pending, prims)
        done = self.cache.get(key)
        if done is None:
            done = self._run(pending, prims)
            self.cache[key] = done
        return done

    def _run(self, pending: frozenset[Pend], prims: tuple[Prim, ...]) -> DeviceHalf:
        pend = set(pending)
        violation: Violation | None = None
        tags: set[str] = set()
        for prim in prims:
            tag = prim[0]
            if tag == "record":
                x, e = prim[1], prim[2]
                assert isinstance(x, int) and isinstance(e, int)
                source, place = 1 << x, self.event(e)
                pend = {(r, m, (k | place) if k & source else (k & ~place)) for r, m, k in pend}
            elif tag == "wait":
                y, e = prim[1], prim[2]
                assert isinstance(y, int) and isinstance(e, int)
                place, target = self.event(e), 1 << y
                pend = {(r, m, k | target) if k & place else (r, m, k) for r, m, k in pend}
            elif tag == "op":
                kind, x, accesses = prim[1], prim[2], prim[3]
                assert isinstance(kind, str) and isinstance(x, int) and isinstance(accesses, tuple)
                here = 1 << x
                others = self.all_streams & ~here
                for res, mode in accesses:
                    for r, m, k in pend:
                        if r != res or k & here:
                            continue
                        prop = conflict_prop(res, m, mode)
                        if prop is None:
                            continue
                        if violation is None:
                            violation = Violation(
                                prop,
                                f"{kind} on stream {x} is not ordered after a pending "
                                f"{'write' if m else 'read'} of the {resource_name(res)}",
                            )
                    # Reachability: a conflicting access pending on another stream that
                    # the table orders before this one (it holds this stream and another).
                    elsewhere = any(
                        r == res and conflict_prop(res, m, mode) and k & here and k & others
                        for r, m, k in pend
                    )
                    if elsewhere and kind == "gather" and res >= 4:
                        tags.add("gather_while_slot_read_pending")
                    if elsewhere and kind in ("plan", "free") and res == 0:
                        tags.add("state_access_pending_elsewhere")
                if kind == "free" and any(r == 1 and m == 0 for r, m, _ in pend):
                    tags.add("invalidate_while_read_pending")
                for res, mode in accesses:
                    pend.add((res, mode, here))
                if kind == "read_errors":
                    pend.add((LOOK, 0, here))
            elif tag == "sync":
                streams = prim[1]
                assert isinstance(streams, tuple)
                mask = 0
                for s in streams:
                    mask |= 1 << s
                pend = {p for p in pend if not p[2] & mask}
            elif tag == "report":
                if any(r == LOOK for r, _, _ in pend) and violation is None:
                    violation = Violation(
                        "P9_device_errors_reported",
                        "the host read the counters before their copy landed",
                    )
                pend = {p for p in pend if p[0] != LOOK}
        return DeviceHalf(self.reduce(pend), violation, frozenset(tags))

    def reduce(self, pend: set[Pend]) -> frozenset[Pend]:
        """Masks only change by monotone maps (record E on X: E := X; Y waits E: Y |= E; a
        sync removes what holds a stream), and every verdict is "this access's mask lacks the
        new access's stream". So an access ordered before every stream can never be the
        unordered side again, and of two accesses of one (resource, mode) the one with the
        larger mask fails every verdict the smaller one fails, later too: keep the minimal."""
        pend = {(r, m, k & self.live) for r, m, k in pend}
        out: set[Pend] = set()
        for p in pend:
            r, m, k = p
            if k & self.all_streams == self.all_streams and r != LOOK:
                continue
            if any(r2 == r and m2 == m and k2 != k and k2 & k == k2 for r2, m2, k2 in pend):
                continue
            out.add(p)
        return frozenset(out)


def _swap_mask(k: int) -> int:
    return (k & ~3) | ((k & 1) << 1) | ((k & 2) >> 1)


class Interned:
    """Host parts and pending sets interned to integers: states hash as two ints, and both
    halves of a transition are memoized on them."""

    def __init__(self) -> None:
        self.hosts: list[HostPart] = []
        self.host_ids: dict[HostPart, int] = {}
        self.pendings: list[frozenset[Pend]] = []
        self.pending_ids: dict[frozenset[Pend], int] = {}

    def host(self, host: HostPart) -> int:
        i = self.host_ids.get(host)
        if i is None:
            i = self.host_ids[host] = len(self.hosts)
            self.hosts.append(host)
        return i

    def pending(self, pending: frozenset[Pend]) -> int:
        i = self.pending_ids.get(pending)
        if i is None:
            i = self.pending_ids[pending] = len(self.pendings)
            self.pendings.append(pending)
        return i


class HostStep(NamedTuple):
    """The host half of one call from one host part."""

    host: int  # after the call
    program: int  # interned device program (-1: rejected)
    violation: Violation | None  # static and data verdicts
    tags: frozenset[str]


class HbModel:
    """Every host-call sequence; device order decided by the summary (core.Model's interface)."""

    name = "happens-before"

    def __init__(self, table: DeviceTable, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.actions = [a for a in host_actions(table, bounds) if a.op != "device_synchronize"]
        self.summary = Summary(table, bounds)
        self.interpret = Interpreter(table, bounds)
        self.symmetric = len(table.consumer_streams) == 2
        self.interned = Interned()
        self.programs: list[tuple[Prim, ...]] = []
        self.program_ids: dict[tuple[Prim, ...], int] = {}
        self.host_steps: dict[int, list[HostStep]] = {}
        self._host_tags: dict[int, frozenset[str]] = {}
        self.device_steps: dict[tuple[int, int], tuple[int, Violation | None, frozenset[str]]] = {}
        self.swapped_hosts: dict[int, int] = {}
        self.swapped_pendings: dict[int, int] = {}

    def initial(self) -> HbState:
        return HbState(
            self.interned.host(initial_host(self.bounds)), self.interned.pending(frozenset())
        )

    def canonical(self, state: HbState) -> HbState:
        if not self.symmetric:
            return state
        swapped = HbState(self._swap_host(state.host), self._swap_pending(state.pending))
        return min(state, swapped)

    def _swap_host(self, i: int) -> int:
        j = self.swapped_hosts.get(i)
        if j is None:
            host = self.interned.hosts[i]
            owner = _swap(host.owner) if host.owner != NO_STREAM else NO_STREAM
            j = self.swapped_hosts[i] = self.interned.host(host._replace(owner=owner))
        return j

    def _swap_pending(self, i: int) -> int:
        j = self.swapped_pendings.get(i)
        if j is None:
            pending = self.interned.pendings[i]
            j = self.interned.pending(frozenset((r, m, _swap_mask(k)) for r, m, k in pending))
            self.swapped_pendings[i] = j
        return j

    def stuck(self, state: HbState) -> Violation | None:
        return None

    def _host_steps(self, i: int) -> list[HostStep]:
        steps = self.host_steps.get(i)
        if steps is None:
            host = self.interned.hosts[i]
            steps = []
            for action in self.actions:
                program = self.interpret(host, action)
                if program.rejected:
                    steps.append(HostStep(i, -1, None, program.tags))
                    continue
                prims = device_program(program.prims)
                pid = self.program_ids.get(prims)
                if pid is None:
                    pid = self.program_ids[prims] = len(self.programs)
                    self.programs.append(prims)
                steps.append(
                    HostStep(
                        self.interned.host(program.host),
                        pid,
                        program.static or program.data,
                        program.tags,
                    )
                )
            self.host_steps[i] = steps
            self._host_tags[i] = frozenset().union(*(hs.tags for hs in steps))
        return steps

    def _device_step(
        self, pending: int, program: int
    ) -> tuple[int, Violation | None, frozenset[str]]:
        key = (pending, program)
        done = self.device_steps.get(key)
        if done is None:
            half = self.summary.run(self.interned.pendings[pending], self.programs[program])
            done = (self.interned.pending(half.pending), half.violation, half.tags)
            self.device_steps[key] = done
        return done

    def successors_at_bound(
        self, state: HbState, only: str | None = None
    ) -> list[tuple[object, ...]]:
        """At the depth bound only the verdict, the tags and the number of transitions count:
        one summary move stands for all of them (its violation is the first in action order,
        as the search would have met it)."""
        steps = self._host_steps(state.host)
        tags = set(self._host_tags[state.host])
        first: tuple[Action, Outcome] | None = None
        device_step, pending = self._device_step, state.pending
        for action, hs in zip(self.actions, steps, strict=True):
            if hs.program < 0:
                continue
            _, found, more = device_step(pending, hs.program)
            if more:
                tags |= more
            if first is None and (hs.violation is not None or found is not None):
                violation = hs.violation
                if found is not None and (
                    violation is None or violation.prop != "P8_hot_path_never_blocks"
                ):
                    violation = found
                if violation is not None and only in (None, violation.prop):
                    first = (action, Outcome(state, violation, frozenset()))
        if first is None:
            return [
                (
                    "host calls at the bound",
                    Outcome(state, None, frozenset(tags)),
                    1,
                    len(self.actions),
                )
            ]
        action, outcome = first
        return [(action, outcome._replace(tags=frozenset(tags)), 1, len(self.actions))]

    def successors(self, state: HbState) -> list[tuple[Action, Outcome, int]]:
        out: list[tuple[Action, Outcome, int]] = []
        for action, hs in zip(self.actions, self._host_steps(state.host), strict=True):
            if hs.program < 0:
                out.append((action, Outcome(state, None, hs.tags), 1))
                continue
            pending, found, tags = self._device_step(state.pending, hs.program)
            # The static verdict (P8) first, then the ordering ones, then the data ones.
            violation = hs.violation
            if found is not None and (
                violation is None or violation.prop != "P8_hot_path_never_blocks"
            ):
                violation = found
            out.append((action, Outcome(HbState(hs.host, pending), violation, hs.tags | tags), 1))
        return out
