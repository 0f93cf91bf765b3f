"""The happens-before summary of the device-planned path, for search at the full bounds.

As in the host path's summary (streams/hb.py), every device operation that may not have run
keeps only what a later verdict depends on, here its accesses (device_program's (resource,
mode) pairs), each with the bit mask of the *places* it happens before: the streams (the
consumer streams and the capture stream) and the event snapshots. Record, wait and a host_sync
are bit operations; every conflict is decided when its second access is enqueued, for all
interleavings at once (an unordered pair is a violation: P1, P2, P4 or P10,
device_program.conflict_prop). Device progress is never explored: an operation that ran can
only remove verdicts, and the device can always be that slow. The data verdicts (P2's
content, P3, P4, P5, P9) are the interpreter's, drawn on the shadow in host-call order, which
is what every interleaving computes as long as no conflicting pair is unordered
(device_program's module docstring); the first unordered pair stops the search.

A transition is the composition of a host half, the interpreter on the host part alone
(memoized per (data, call) by device_program.Interpreter), and a device half, a function of
the pending accesses and of the program's primitives without payloads (memoized here).
Reductions, each argued where it is made: accesses ordered before every stream are dropped; of
two pending accesses of one kind, the one whose mask contains the other's is dropped; event
bits no call waits on before recording again are cleared between calls. `device_synchronize`
is left to the explicit model (it only retires pending work). P7 is the explicit model's: with
snapshot waits the happens-before relation is acyclic by construction. The search model over
it is `search.device_models.DeviceHbModel`.
"""

from __future__ import annotations

from typing import NamedTuple

from model_check.streams.device_program import (
    LOOK,
    HostPart,
    Prim,
    Violation,
    conflict_prop,
    resource_name,
)
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceTable

Pend = tuple[int, int, int]  # (resource, mode, mask); resource LOOK for a look's read-back


class HbState(NamedTuple):
    host: HostPart
    pending: frozenset[Pend]


class Half(NamedTuple):
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
        self.cache: dict[tuple[frozenset[Pend], tuple[Prim, ...]], Half] = {}

    def event(self, e: int) -> int:
        return 1 << (self.n_streams + e)

    def run(self, pending: frozenset[Pend], prims: tuple[Prim, ...]) -> Half:
        key = (pending, prims)
        done = self.cache.get(key)
        if done is None:
            done = self._run(pending, prims)
            self.cache[key] = done
        return done

    def _run(self, pending: frozenset[Pend], prims: tuple[Prim, ...]) -> Half:
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
        return Half(self.reduce(pend), violation, frozenset(tags))

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
