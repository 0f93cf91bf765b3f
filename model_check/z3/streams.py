"""The happens-before summary of `streams.hb`, with symbolic state, as a `DeviceCall`.

`streams.hb` keeps every pending device operation with a bit mask of the *places* it happens before
(streams, event snapshots, staging reuse events) and decides each ordering property when its
second operation is enqueued. Every mask update acts on each pending operation on its own
(record E on X: E := X; Y waits E: Y |= E; a stream drains: the operations holding it are
gone), and every verdict compares one pending operation with the one being enqueued. So it is
enough to follow ONE pending operation of each kind, chosen nondeterministically: at every
enqueue of a kind a fresh boolean says whether this is the operation followed from now on
(the classic one-generic-element abstraction for parameterized systems). A violation in hb is
a violation for the one operation involved, which some choice follows; a violation here is one
for a real operation. Followed kinds: a consumer read, a copy into a slot, a map upload per
staging ring, and a `wait_flag` per event.

What is abstracted, each time towards more behaviours (so a proof here covers hb, and a
counterexample may need a replay to be trusted):
- Which slots a read and a copy touch: in the bounded check the host state is exact, so the
  followed read carries the slots of its forward map and the followed copy its slot (one of
  the call's copies, chosen), exactly as in hb. In the induction the host is abstract and
  the followed read and copy are assumed to share a slot (the worst case). The data verdicts
  (the last copy into a slot is the expert the map names) are decided on the symbolic host
  state, exactly, in the bounded check only.
- Staging reuse: hb reuses a buffer without choice when no pending operation holds its reuse
  event, and otherwise branches on whether the event completed. The operations not followed
  are not known here, so the choice is free every time (an extra "not complete" branch only
  takes a fresh buffer, which no verdict looks at).
- `wait_flag` (a wait for the event's latest record when the wait executes, the P7 mutant's
  kind; hb cannot express it): it orders nothing, except when the table records its event only
  on the copy stream, whose snapshots only grow, so that the latest record contains the one
  seen at enqueue and the flag orders at least what a wait_event would. P7: a followed flag
  operation that holds its own event's place is inside the snapshot it waits for: once
  everything not behind it ran, no stream can move (a deadlock). This is exact for cycles
  through one flag operation (or several on one event); a cycle that needs two flags on
  different events, neither inside its own snapshot, is missed (the mutants' deadlocks
  all have a flag inside its own snapshot, at two calls).

The roles `owner` and `current` resolve to a stream number in DeviceCall.role, so a call is
interpreted once per concrete (current stream, owner stream) pair by the shared interpreter
(`streams.interpreter.DeviceCall.run_step`) and the results are combined by the caller under
the condition that selects the pair. A step's `when` condition becomes a path condition: every
state update in it is an `ite` on the condition, every verdict is conjoined with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import z3

from model_check.streams.interpreter import DeviceCall
from model_check.table.host import Pairs
from model_check.table.reference import NO_SLOT, Bounds, Counters, Effect, HostState
from model_check.table.schema import EVENTS, RINGS, Operation, Step, Table
from model_check.z3.host import Bool, Int, conj, disj, ite, merge, neg, select

KINDS: tuple[str, ...] = (
    "read",
    "copy",
    *(f"map:{ring}" for ring in RINGS),
    *(f"flag:{event}" for event in EVENTS),
)
P1 = "P1_no_overwrite_under_reader"
P2 = "P2_no_stale_read"
P3 = "P3_forward_map_exact"
P4 = "P4_map_convergence"
P5 = "P5_victim_protection"
P6 = "P6_staging_lifetime"
P7 = "P7_no_deadlock"
P8 = "P8_no_host_block_on_reader"
P9 = "P9_validation_first"

ORDER_P1 = "a copy is enqueued that is not ordered after the pending read followed"
ORDER_P2 = "a read is enqueued that is not ordered after the pending copy followed"
DATA_P2 = "a read finds a slot whose last copy is not the expert its forward map names"
ORDER_P4_COPY = "a copy is enqueued that is not ordered after an earlier pending copy"
ORDER_P4_MAP = "a resident-map upload is not ordered after an earlier pending upload"
ORDER_P6 = "the host rewrites a staging buffer whose upload may still be pending"
ORDER_P8 = "a provider call blocks the host on a stream behind a pending consumer read"


class Layout:
    """Place indices: streams (consumer streams, then copy), events, staging reuse events."""

    def __init__(self, bounds: Bounds) -> None:
        self.n_streams = bounds.consumer_streams + 1
        self.buffers = bounds.staging_buffers
        self.size = self.n_streams + len(EVENTS) + len(RINGS) * self.buffers
        self.names = [f"s{i}" for i in range(bounds.consumer_streams)] + ["copy"]
        self.names += list(EVENTS)
        self.names += [f"reuse:{r}#{b}" for r in RINGS for b in range(self.buffers)]

    def stream(self, sid: int) -> int:
        return sid

    def event(self, name: str) -> int:
        return self.n_streams + EVENTS.index(name)

    def reuse(self, ring: str, buffer: int) -> int:
        return self.n_streams + len(EVENTS) + RINGS.index(ring) * self.buffers + buffer


class Tracked(NamedTuple):
    """The followed operation of one kind: pending or not, the places it happens before,
    for map uploads the staging buffer it reads (NO_SLOT for a fresh buffer), and for reads
    and copies the slots they touch (one flag per slot; empty where the host state is
    abstract, which stands for "shares a slot with everything")."""

    alive: Bool
    mask: tuple[Bool, ...]
    buf: Int
    slots: tuple[Bool, ...]


DevState = tuple[Tracked, ...]  # one per KINDS entry


def initial_dev(layout: Layout, slots: int = 0) -> DevState:
    return tuple(Tracked(False, (False,) * layout.size, NO_SLOT, (False,) * slots) for _ in KINDS)


def shares(a: tuple[Bool, ...], b: tuple[Bool, ...] | None) -> Bool:
    """Two slot sets intersect (always, when the slots are abstract or not given)."""
    if not a or not b:
        return True
    return disj(*(conj(x, y) for x, y in zip(a, b, strict=True)))


class Facts(NamedTuple):
    """The host plan's facts that `when` conditions read."""

    misses: Bool
    changed: Bool


class DataCtx(NamedTuple):
    """Symbolic host data a call's device steps move (None in the induction's abstraction):
    the forward map after the effect, the copies, the resident-map mirror after the effect,
    and per slot the expert of the last copy enqueued / the last resident map uploaded."""

    fwd: tuple[Bool, ...]
    fwd_slot: tuple[Int, ...]
    miss: tuple[Bool, ...]
    dest: tuple[Int, ...]
    mirror: tuple[Int, ...]
    last_copy: tuple[Int, ...]
    last_map: tuple[Int, ...]


class Fresh:
    """Fresh z3 constants for one host call; names depend only on the call's index and the
    order of requests, so the interpretations of one call under different role resolutions
    share them (only one of those is ever selected)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.n = 0
        self.constraints: list[Bool] = []

    def _name(self, tag: str) -> str:
        self.n += 1
        return f"{self.prefix}_{tag}{self.n}"

    def bool(self, tag: str) -> Bool:
        return z3.Bool(self._name(tag))

    def int(self, tag: str, lo: int, hi: int) -> Int:
        v = z3.Int(self._name(tag))
        self.constraints.append(z3.And(v >= lo, v <= hi))
        return v


def flag_orders(table: Table) -> dict[str, bool]:
    """Per event: every record of it in the table is on the copy stream (see module doc)."""
    out: dict[str, bool] = {}
    for event in EVENTS:
        roles = {
            s.stream
            for op in table.operations
            for s in op.steps
            if s.kind == "record_event" and s.event == event
        }
        out[event] = roles == {"copy"}
    return out


_FAKE_HOST = HostState(lru=(), slot_of=(), owner=-1, forward=((0, 0),))


class Z3Call(DeviceCall):
    """One host call's effect on the symbolic summary, for one (current, owner) pair."""

    def __init__(
        self,
        layout: Layout,
        bounds: Bounds,
        stream: int,
        owner: int,
        dev: DevState,
        facts: Facts,
        fresh: Fresh,
        orders: dict[str, bool],
        data: DataCtx | None,
    ) -> None:
        # The concrete effect only drives the interpreter's loops: one generic copy per
        # copy_rows step, a forward map to read and upload. Its content is never looked at.
        before = _FAKE_HOST._replace(owner=owner)
        effect = Effect(before, ((0, 0),), (), (), True, Counters())
        super().__init__(bounds, stream, effect, before)
        self.layout = layout
        self.dev = list(dev)
        self.facts = facts
        self.fresh = fresh
        self.orders = orders
        self.data = data
        self.cond: Bool = True
        self.found: dict[tuple[str, str], list[Bool]] = {}
        self.seen: dict[str, list[Bool]] = {}
        self.chosen: dict[str, Int] = {ring: NO_SLOT for ring in RINGS}
        self.last_copy: tuple[Int, ...] = data.last_copy if data else ()
        self.last_map: tuple[Int, ...] = data.last_map if data else ()

    # ------------------------------------------------------------ helpers

    def _found(self, prop: str, part: str, v: Bool) -> None:
        self.found.setdefault((prop, part), []).append(conj(self.cond, v))

    def _seen(self, tag: str, v: Bool) -> None:
        self.seen.setdefault(tag, []).append(conj(self.cond, v))

    def _get(self, kind: str) -> Tracked:
        return self.dev[KINDS.index(kind)]

    def _set(self, kind: str, new: Tracked) -> None:
        i = KINDS.index(kind)
        self.dev[i] = Tracked(*merge(self.cond, tuple(new), tuple(self.dev[i])))

    def _born(
        self,
        kind: str,
        place: int,
        buf: Int = NO_SLOT,
        slots: tuple[Bool, ...] | None = None,
        possible: Bool = True,
    ) -> None:
        """An operation of `kind` is enqueued on stream `place`: maybe it is the one followed
        (when `possible`: a generic copy must be one of the call's copies)."""
        pick = conj(self.fresh.bool(f"born_{kind.replace(':', '_')}_"), possible)
        old = self._get(kind)
        mask = tuple(i == place for i in range(self.layout.size))
        new_slots = old.slots if slots is None else slots
        self._set(
            kind,
            Tracked(
                disj(pick, old.alive),
                tuple(ite(pick, a, b) for a, b in zip(mask, old.mask, strict=True)),
                ite(pick, buf, old.buf),
                tuple(ite(pick, a, b) for a, b in zip(new_slots, old.slots, strict=True)),
            ),
        )

    def _map_masks(self, kinds: Sequence[str], fn: Any) -> None:
        for kind in kinds:
            t = self._get(kind)
            self._set(kind, t._replace(mask=fn(t.mask)))

    def run_step(self, step: Step, op: Operation) -> bool:
        if step.when == "always":
            return super().run_step(step, op)
        conds: dict[str, Bool] = {
            "misses": self.facts.misses,
            "changed": self.facts.changed,
            # The streams are concrete in each branch (see `interpret`), so handoff is too.
            "misses_or_handoff": disj(self.facts.misses, self.handoff),
        }
        cond = conds[step.when]
        outer = self.cond
        self.cond = conj(outer, cond)
        try:
            return super().run_step(replace(step, when="always"), op)
        finally:
            self.cond = outer

    # ------------------------------------------------------------ device primitives

    def record(self, stream: int, event: str) -> None:
        x, e = self.layout.stream(stream), self.layout.event(event)
        self._map_masks(KINDS, lambda m: tuple(m[x] if i == e else b for i, b in enumerate(m)))

    def wait(self, stream: int, event: str) -> None:
        y, e = self.layout.stream(stream), self.layout.event(event)
        self._map_masks(
            KINDS, lambda m: tuple(disj(b, m[e]) if i == y else b for i, b in enumerate(m))
        )

    def wait_flag(self, stream: int, event: str) -> None:
        if self.orders[event]:
            self.wait(stream, event)
        self._born(f"flag:{event}", self.layout.stream(stream))

    def copy(self, stream: int, slot: int, expert: int) -> None:
        x = self.layout.stream(stream)
        r, c = self._get("read"), self._get("copy")
        d = self.data
        if d is None:
            targets: tuple[Bool, ...] = ()
            self._born("copy", x)
        else:
            # The call's copies, all enqueued here; the one followed is a chosen one of them.
            cap = len(self.last_copy)
            targets = tuple(
                disj(*(conj(d.miss[e], d.dest[e] == s) for e in range(len(d.miss))))
                for s in range(cap)
            )
            which = self.fresh.int("copy_which_", 0, len(d.miss) - 1)
            dest = select(which, d.dest, NO_SLOT)
            chosen = tuple(dest == s for s in range(cap))
            ok = select(which, d.miss, False)
        self._found(P1, ORDER_P1, conj(r.alive, neg(r.mask[x]), shares(r.slots, targets)))
        self._found(P4, ORDER_P4_COPY, conj(c.alive, neg(c.mask[x]), shares(c.slots, targets)))
        self._seen("copy_while_read_pending", conj(r.alive, shares(r.slots, targets)))
        if d is not None:
            self._born("copy", x, slots=chosen, possible=ok)
            last = list(self.last_copy)
            for s in range(len(last)):
                for e in range(len(d.miss)):
                    last[s] = ite(conj(d.miss[e], d.dest[e] == s), e, last[s])
            self.last_copy = merge(self.cond, tuple(last), self.last_copy)

    def read(self, stream: int, pairs: Pairs) -> None:
        x = self.layout.stream(stream)
        c = self._get("copy")
        d = self.data
        read: tuple[Bool, ...] = ()
        if d is not None:
            read = tuple(
                disj(*(conj(d.fwd[e], d.fwd_slot[e] == s) for e in range(len(d.fwd))))
                for s in range(len(self.last_copy))
            )
        self._found(P2, ORDER_P2, conj(c.alive, neg(c.mask[x]), shares(c.slots, read)))
        self._seen("read_while_copy_pending", conj(c.alive, shares(c.slots, read)))
        if d is not None:
            stale = [
                conj(d.fwd[e], select(d.fwd_slot[e], self.last_copy, NO_SLOT) != e)
                for e in range(len(d.fwd))
            ]
            self._found(P2, DATA_P2, disj(*stale))
        self._born("read", x, slots=read if d is not None else None)

    def stage(self, ring: str) -> None:
        idx = self.fresh.int(f"stage_{ring}_", NO_SLOT, self.layout.buffers - 1)
        m = self._get(f"map:{ring}")
        self._seen("staging_reuse_after_upload", conj(m.alive, m.buf == idx, idx >= 0))
        for kind in KINDS:
            t = self._get(kind)
            done = disj(
                *(
                    conj(idx == b, t.mask[self.layout.reuse(ring, b)])
                    for b in range(self.layout.buffers)
                )
            )
            self._set(kind, t._replace(alive=conj(t.alive, neg(done))))
        m = self._get(f"map:{ring}")
        self._found(P6, ORDER_P6, conj(m.alive, m.buf == idx, idx >= 0))
        self.chosen[ring] = ite(self.cond, idx, self.chosen[ring])

    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None:
        x = self.layout.stream(stream)
        if ring == "resident":
            m = self._get("map:resident")
            self._found(P4, ORDER_P4_MAP, conj(m.alive, neg(m.mask[x])))
            self._seen("upload_while_upload_pending", m.alive)
            if self.data is not None:
                self.last_map = merge(self.cond, self.data.mirror, self.last_map)
        self._born(f"map:{ring}", x, self.chosen[ring])

    def release_staging(self, stream: int, ring: str) -> None:
        x = self.layout.stream(stream)
        idx = self.chosen[ring]
        places = {self.layout.reuse(ring, b): b for b in range(self.layout.buffers)}

        def update(m: tuple[Bool, ...]) -> tuple[Bool, ...]:
            return tuple(
                ite(idx == places[i], m[x], v) if i in places else v for i, v in enumerate(m)
            )

        self._map_masks([k for k in KINDS if k.startswith("map:")], update)

    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        r = self._get("read")
        if provider:
            self._found(P8, ORDER_P8, conj(r.alive, disj(*(r.mask[s] for s in streams))))
            self._seen("provider_sync_with_read_pending", r.alive)
        for kind in KINDS:
            t = self._get(kind)
            held = disj(*(t.mask[self.layout.stream(s)] for s in streams))
            self._set(kind, t._replace(alive=conj(t.alive, neg(held))))
        return True

    def finish(self) -> None:
        """P7 once the call's steps are enqueued (the explorer checks between host calls)."""
        for event in EVENTS:
            f = self._get(f"flag:{event}")
            self._found(
                P7,
                f"a wait_flag on {event} is inside the {event} snapshot it waits for",
                conj(f.alive, f.mask[self.layout.event(event)]),
            )


class Branch(NamedTuple):
    cond: Bool
    call: Z3Call


def interpret(
    op: Operation,
    bounds: Bounds,
    layout: Layout,
    dev: DevState,
    owner: Int,
    cur: Int,
    facts: Facts,
    prefix: str,
    orders: dict[str, bool],
    data: DataCtx | None,
    fresh_constraints: list[Bool],
) -> list[Branch]:
    """Run op's steps once per (current, owner) pair; each branch with its condition."""
    out: list[Branch] = []
    streams = range(bounds.consumer_streams)
    for c in streams:
        for o in (-1, *streams):
            fresh = Fresh(prefix)
            call = Z3Call(layout, bounds, c, o, dev, facts, fresh, orders, data)
            call.run_steps(op)
            call.finish()
            fresh_constraints.extend(fresh.constraints)
            out.append(Branch(conj(cur == c, owner == o), call))
    return out
