"""The explicit device model: every interleaving of device steps, with FIFO queues.

A `State` is the host state plus the device: one FIFO queue of pending operations per stream,
the snapshot held by each CUDA event, the staging buffers, the slot contents and the device
resident map. Host calls run a table entry's steps in order (enqueueing device operations);
device steps run the head operation of any stream whose waits are satisfied.

Positions in queues are relative: a reference `(stream, k)` means "the first k operations now
pending on that stream". Executing the head of a stream decrements every reference to it and
drops those that reach zero, so a reference is pending exactly while the operations it names
have not run, and states that differ only in how much already ran are identical. This is what
CUDA events are: `record` captures the work enqueued so far on one stream (a prefix of its
FIFO), `wait` copies that snapshot at the time of the call, and an event whose work finished
(or that was never recorded) makes a wait do nothing.

Property checks happen where the property can first be decided, and are reported as
`Violation`s: P1 and P2 when a copy or read executes, P3 and P5 on the host plan, P4 when the
device is idle, P6 when the host writes a staging buffer, P7 when nothing can run, P8 when a
provider call blocks the host, P9 when a call is rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, TypeVar

from model_check.streams.interpreter import Action, DeviceCall, Outcome
from model_check.table.host import Accepted, Pairs, Rejected, begin_call, finish_host, pairs_text
from model_check.table.properties import PROPERTIES, Violation
from model_check.table.reference import (
    NO_SLOT,
    NO_STREAM,
    Bounds,
    Counters,
    Effect,
    HostState,
    initial_host,
)
from model_check.table.schema import EVENTS, RINGS, Operation, Table

__all__ = ["PROPERTIES", "Action", "Outcome", "State", "Violation", "host_call"]

Ref = tuple[int, int]  # (stream index, number of its pending operations that must run first)
Q = TypeVar("Q")


class QueuedOp(NamedTuple):
    """A device operation waiting in a stream's queue.

        kind    what            arg     after
        wait    0               0       (ref,): runs once ref has run
        flag    event index     0       (): runs once the event's latest snapshot has run
                                        (the P7 mutant's kind)
        copy    slot            expert  refs to reads of the slot enqueued before it
        read    pairs           0       refs to copies into its slots enqueued before it
        map     content         ring    (): a map upload from a staging buffer of ring

    `glued`: the operation runs in one step with the one before it (see `QueueCall.enqueue`).
    """

    kind: str
    what: object
    arg: int
    after: tuple[Ref, ...]
    glued: bool

    def __repr__(self) -> str:
        # `QueueModel.canonical` orders states by their text; an operation prints as the plain
        # tuple it is, so that order does not depend on this class's name.
        return tuple.__repr__(self)


# QueuedOp((kind, what, arg, after, glued)) without NamedTuple's own __new__, a Python function:
# the explicit model makes an operation at every enqueue and every device step.
make_op: Callable[[tuple[str, object, int, tuple[Ref, ...], bool]], QueuedOp] = partial(
    tuple.__new__, QueuedOp
)


class Blocked(NamedTuple):
    """A host call waiting in host_sync: what it needs to continue."""

    op: str
    stream: int
    step: int  # index of the host_sync step
    effect: Effect
    chosen: tuple[int, ...]  # staging buffer chosen per ring
    before: HostState  # host state at the start of the call


class Buffer(NamedTuple):
    reader: Ref | None  # the pending upload that reads this staging buffer
    reuse: Ref | None  # the buffer's reuse event snapshot


class State(NamedTuple):
    host: HostState
    queues: tuple[tuple[QueuedOp, ...], ...]  # consumer streams, then the copy stream
    events: tuple[Ref | None, ...]  # snapshot of each event in table.EVENTS
    staging: tuple[tuple[Buffer, ...], ...]  # per ring in table.RINGS
    slots: tuple[int, ...]  # expert whose rows each slot holds on the device
    dmap: tuple[int, ...]  # device resident map
    read_issued: bool  # the consumer already read the current forward map
    blocked: Blocked | None  # a host call waiting in host_sync


NO_COUNTS = Counters()


def initial_state(bounds: Bounds) -> State:
    n_streams = bounds.consumer_streams + 1
    return State(
        host=initial_host(bounds),
        queues=((),) * n_streams,
        events=(None,) * len(EVENTS),
        staging=tuple((Buffer(None, None),) * bounds.staging_buffers for _ in RINGS),
        slots=(NO_SLOT,) * bounds.capacity,
        dmap=(NO_SLOT,) * bounds.num_experts,
        read_issued=False,
        blocked=None,
    )


# ---------------------------------------------------------------- reference arithmetic


def _dec(ref: Ref | None, stream: int) -> Ref | None:
    if ref is None or ref[0] != stream:
        return ref
    return None if ref[1] == 1 else (stream, ref[1] - 1)


def _dec_refs(refs: tuple[Ref, ...], stream: int) -> tuple[Ref, ...]:
    if not refs:
        return refs
    out = []
    for r in refs:
        if r[0] != stream:
            out.append(r)
        elif r[1] > 1:
            out.append((stream, r[1] - 1))
    return tuple(out)


def _dec_op(op: QueuedOp, stream: int) -> QueuedOp:
    kind, what, arg, refs, glued = op
    if not refs:
        return op
    return make_op((kind, what, arg, _dec_refs(refs, stream), glued))


def popped(queues: tuple[tuple[Q, ...], ...], stream: int, dec: Callable[[Q, int], Q]) -> Any:
    """The queues (of either path) once the head of `stream` ran: it is gone, and every
    reference to `stream` in the others counts one operation less (`dec`)."""
    rest = [q[1:] if sid == stream else q for sid, q in enumerate(queues)]
    return tuple(tuple(dec(op, stream) for op in q) for q in rest)


# ---------------------------------------------------------------- device steps


def is_idle(state: State | Any) -> bool:
    """No operation pending (of either path's explicit state: anything with `queues`)."""
    return not any(state.queues)


def group_size(queue: tuple[Any, ...]) -> int:
    """Length of the head group: operations one host call enqueued back to back on a stream
    with no event recorded between them (`glued`, in either path's queues). They run as one
    step; see `QueueCall.enqueue`."""
    n = 1
    while n < len(queue) and queue[n].glued:
        n += 1
    return n


def runnable(state: State, stream: int) -> bool:
    queue = state.queues[stream]
    if not queue:
        return False
    for op in queue[: group_size(queue)]:
        if op.kind == "wait" and op.after:
            return False
        if op.kind == "flag":
            assert isinstance(op.what, int)
            if state.events[op.what] is not None:
                return False
    return True


def device_step(state: State, stream: int) -> Outcome[State]:
    """Run the head group of `stream` (which must be runnable)."""
    violation: Violation | None = None
    for _ in range(group_size(state.queues[stream])):
        state, found = _run_head(state, stream)
        violation = violation or found
    tags: set[str] = set()
    if violation is None and is_idle(state) and state.blocked is None:
        violation = check_idle(state)
        tags.add("device_idle")
    return Outcome(state, violation, frozenset(tags), (), Counters())


def _run_head(state: State, stream: int) -> tuple[State, Violation | None]:
    queue = state.queues[stream]
    head = queue[0]
    kind = head.kind
    violation: Violation | None = None
    slots = state.slots
    dmap = state.dmap
    if kind == "copy":
        slot, expert = head.what, head.arg
        assert isinstance(slot, int)
        if head.after:
            violation = Violation(
                "P1_no_overwrite_under_reader",
                f"copy of expert {expert} into slot {slot} ran before an earlier read of the slot",
            )
        slots = (*slots[:slot], expert, *slots[slot + 1 :])
    elif kind == "read":
        pairs = head.what
        assert isinstance(pairs, tuple)
        if head.after:
            violation = Violation(
                "P2_no_stale_read",
                f"read of {pairs_text(pairs)} ran before an earlier copy into its slots",
            )
        else:
            for expert, slot in pairs:
                if slots[slot] != expert:
                    violation = Violation(
                        "P2_no_stale_read",
                        f"read of expert {expert} in slot {slot} found expert {slots[slot]}",
                    )
                    break
    elif kind == "map" and head.arg == RINGS.index("resident"):
        content = head.what
        assert isinstance(content, tuple)
        dmap = content
    new = state._replace(
        queues=popped(state.queues, stream, _dec_op),
        events=tuple(_dec(e, stream) for e in state.events),
        staging=tuple(
            tuple(Buffer(_dec(b.reader, stream), _dec(b.reuse, stream)) for b in ring)
            for ring in state.staging
        ),
        slots=slots,
        dmap=dmap,
    )
    return new, violation


def check_idle(state: State) -> Violation | None:
    host = state.host
    if state.dmap != host.slot_of:
        return Violation(
            "P4_map_convergence",
            f"device idle with resident map {_map(state.dmap)} "
            f"but host mirror {_map(host.slot_of)}",
        )
    for expert, slot in enumerate(host.slot_of):
        if slot != NO_SLOT and state.slots[slot] != expert:
            return Violation(
                "P4_map_convergence",
                f"device idle, map names expert {expert} in slot {slot}, "
                f"which holds expert {state.slots[slot]}",
            )
    return None


def deadlocked(state: State) -> bool:
    return not is_idle(state) and not any(runnable(state, s) for s in range(len(state.queues)))


def _map(m: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in m) + "]"


# ---------------------------------------------------------------- host calls


class QueueCall(DeviceCall):
    """One host call's effect on the explicit FIFO device."""

    def __init__(self, state: State, bounds: Bounds, stream: int, effect: Effect) -> None:
        super().__init__(bounds, stream, effect, state.host)
        self.queues = [list(q) for q in state.queues]
        self.events = list(state.events)
        self.staging = [list(r) for r in state.staging]
        self.chosen = [-1] * len(RINGS)  # staging buffer chosen per ring in this call
        self.read_issued = state.read_issued
        self.open_groups: set[int] = set()

    def enqueue(self, stream: int, kind: str, a: object, b: int, refs: tuple[Ref, ...]) -> None:
        """Append an operation; glue it to the previous one when this call enqueued that one
        too, recorded no event on the stream since, and the new operation is not a wait.

        A group is therefore at most one wait followed by operations that wait for nothing,
        with no snapshot inside. Running it as one step loses no violation: the wait's
        completion is invisible, so it can always be taken as late as the operations after
        it; and another stream's operation that a real schedule runs between two of the
        group's operations sees, if the group is taken entirely after it, a superset of the
        pending operations it sees there (every verdict is "something it must follow is still
        pending"), and the group's operations see it pending in the other order. A wait is
        never glued after another operation: that would hold the earlier operation back
        until the wait is satisfied, which the device does not do."""
        glue = stream in self.open_groups and kind not in ("wait", "flag")
        self.queues[stream].append(make_op((kind, a, b, refs, glue)))
        self.open_groups.add(stream)

    def snapshot(self, stream: int) -> Ref | None:
        self.open_groups.discard(stream)
        n = len(self.queues[stream])
        return (stream, n) if n else None

    def pending_refs(self, kind: str, slots: set[int]) -> tuple[Ref, ...]:
        """References to pending operations of `kind` touching any of `slots`."""
        refs: list[Ref] = []
        for sid, queue in enumerate(self.queues):
            last = 0
            for i, op in enumerate(queue):
                if op.kind != kind:
                    continue
                if kind == "copy":
                    touched = op.what in slots
                else:
                    pairs = op.what
                    assert isinstance(pairs, tuple)
                    touched = any(s in slots for _, s in pairs)
                if touched:
                    last = i + 1
            if last:
                refs.append((sid, last))
        return tuple(refs)

    def blocks_on_reader(self, streams: list[int]) -> bool:
        """Would draining `streams` require a pending consumer read to run first?"""
        need = {s: len(self.queues[s]) for s in streams}
        frontier = list(need.items())
        while frontier:
            sid, upto = frontier.pop()
            for op in self.queues[sid][:upto]:
                if op.kind == "read":
                    return True
                deps: list[Ref] = list(op.after) if op.kind == "wait" else []
                if op.kind == "flag":
                    assert isinstance(op.what, int)
                    snap = self.events[op.what]
                    if snap is not None:
                        deps.append(snap)
                for dep_stream, k in deps:
                    if need.get(dep_stream, 0) < k:
                        need[dep_stream] = k
                        frontier.append((dep_stream, k))
        return False

    def record(self, stream: int, event: str) -> None:
        self.events[EVENTS.index(event)] = self.snapshot(stream)

    def wait(self, stream: int, event: str) -> None:
        snap = self.events[EVENTS.index(event)]
        if snap is not None and snap[0] != stream:
            self.enqueue(stream, "wait", 0, 0, (snap,))
            self.tags.add("wait_enqueued")
            if event == "release" and self.blocks_on_reader([snap[0]]):
                self.tags.add("copy_waits_on_reader")

    def wait_flag(self, stream: int, event: str) -> None:
        self.enqueue(stream, "flag", EVENTS.index(event), 0, ())

    def copy(self, stream: int, slot: int, expert: int) -> None:
        reads = self.pending_refs("read", {slot})
        if reads:
            self.tags.add("copy_while_slot_read_pending")
            if slot not in {self.before.slot_of[v] for v in self.effect.victims}:
                self.tags.add("freed_slot_reused_while_read_pending")
        self.enqueue(stream, "copy", slot, expert, reads)

    def read(self, stream: int, pairs: Pairs) -> None:
        copies = self.pending_refs("copy", {s for _, s in pairs})
        self.enqueue(stream, "read", pairs, 0, copies)
        self.read_issued = True

    def stage(self, ring: str) -> None:
        r = RINGS.index(ring)
        buffers = self.staging[r]
        index = next((i for i, b in enumerate(buffers) if b.reuse is None), -1)
        self.chosen[r] = index
        if index == -1:
            self.tags.add(f"staging_{ring}_fresh_buffer")
            return
        if buffers[index].reader is not None:
            self.flag(
                Violation(
                    "P6_staging_lifetime",
                    f"host rewrote {ring} staging buffer {index} while its upload is pending",
                )
            )
        self.tags.add(f"staging_{ring}_buffer_reused")

    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None:
        r = RINGS.index(ring)
        self.enqueue(stream, "map", content, r, ())
        index = self.chosen[r]
        if index >= 0:
            self.staging[r][index] = self.staging[r][index]._replace(
                reader=(stream, len(self.queues[stream]))
            )

    def release_staging(self, stream: int, ring: str) -> None:
        r = RINGS.index(ring)
        index = self.chosen[r]
        if index >= 0:
            self.staging[r][index] = self.staging[r][index]._replace(reuse=self.snapshot(stream))

    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        if provider and self.blocks_on_reader(streams):
            self.flag(
                Violation(
                    "P8_no_host_block_on_reader",
                    f"{op_name} blocks the host on stream(s) {streams} behind a consumer read",
                )
            )
        return not any(self.queues[s] for s in streams)

    def outcome(
        self, state: State, op: Operation, blocked_at: int, tags: frozenset[str]
    ) -> Outcome[State]:
        finished = blocked_at < 0
        host = finish_host(op, self.effect, self.stream) if finished else self.effect.host
        read_issued = self.read_issued and not (finished and op.name == "prepare")
        blocked = None
        if not finished:
            blocked = Blocked(
                op.name, self.stream, blocked_at, self.effect, tuple(self.chosen), self.before
            )
        new = State(
            host=host,
            queues=tuple(tuple(q) for q in self.queues),
            events=tuple(self.events),
            staging=tuple(tuple(r) for r in self.staging),
            slots=state.slots,
            dmap=state.dmap,
            read_issued=read_issued,
            blocked=blocked,
        )
        violation = self.violation
        if violation is None and finished and is_idle(new):
            violation = check_idle(new)
        return Outcome(
            new, violation, tags | frozenset(self.tags), tuple(self.trace), self.effect.counters
        )


def host_call(
    table: Table,
    bounds: Bounds,
    state: State,
    op_name: str,
    args: tuple[object, ...],
    stream: int,
    counters: Counters = NO_COUNTS,
    *,
    begun: Accepted | Rejected | None = None,
) -> Outcome[State]:
    """Run one host call of the table on `state` (`begun`: its `begin_call`, when the caller
    has it already)."""
    if begun is None:
        begun = begin_call(table, bounds, state.host, counters, op_name, args, stream)
    if isinstance(begun, Rejected):
        new = state._replace(host=begun.host)
        return Outcome(new, begun.violation, frozenset({"rejected_" + op_name}), (), counters)
    op = table.op(op_name)
    call = QueueCall(state._replace(host=begun.host), bounds, stream, begun.effect)
    if begun.violation is not None:
        call.flag(begun.violation)
    return call.outcome(state, op, call.run_steps(op), begun.tags)


def resume(table: Table, bounds: Bounds, state: State) -> Outcome[State]:
    """Continue a host call blocked in host_sync, once its streams drained."""
    assert state.blocked is not None
    name, stream, index, effect, chosen, before = state.blocked
    op = table.op(name)
    call = QueueCall(state._replace(host=before, blocked=None), bounds, stream, effect)
    call.chosen = list(chosen)
    return call.outcome(
        state._replace(blocked=None), op, call.run_steps(op, index + 1), frozenset({"host_resumed"})
    )


def can_resume(state: State, bounds: Bounds, table: Table) -> bool:
    if state.blocked is None:
        return False
    blocked = state.blocked
    stream = blocked.stream
    step = table.op(blocked.op).steps[blocked.step]
    if step.stream == "all":
        return is_idle(state)
    owner = blocked.before.owner
    role = {"copy": bounds.consumer_streams, "current": stream}.get(
        step.stream, owner if owner != NO_STREAM else stream
    )
    return not state.queues[role]
