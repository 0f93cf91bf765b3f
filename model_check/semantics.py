"""Executable semantics of the transition table.

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

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from model_check.reference import (
    EFFECTS,
    GUARDS,
    NO_SLOT,
    NO_STREAM,
    PRE_GUARD_EFFECTS,
    Bounds,
    Counters,
    Effect,
    HostState,
    initial_host,
)
from model_check.table import EVENTS, RINGS, Operation, Step, Table

Ref = tuple[int, int]  # (stream index, number of its pending operations that must run first)

# Device operations are plain tuples for speed: (kind, a, b, refs).
#   ("wait",  0, 0, (ref,))          runs once ref has run
#   ("flag",  event, 0, ())          runs once the event's latest snapshot has run (mutant kind)
#   ("copy",  slot, expert, reads)   reads: refs to reads of the slot enqueued before it
#   ("read",  pairs, 0, copies)      pairs: (expert, slot); copies: refs to earlier copies
#   ("map",   content, ring, ())     map upload from a staging buffer of ring
# The last field is True when the operation is glued to the one before it (same group).
Op = tuple[str, object, int, tuple[Ref, ...], bool]


class Buffer(NamedTuple):
    reader: Ref | None  # the pending upload that reads this staging buffer
    reuse: Ref | None  # the buffer's reuse event snapshot


class State(NamedTuple):
    host: HostState
    queues: tuple[tuple[Op, ...], ...]  # consumer streams, then the copy stream
    events: tuple[Ref | None, ...]  # snapshot of each event in table.EVENTS
    staging: tuple[tuple[Buffer, ...], ...]  # per ring in table.RINGS
    slots: tuple[int, ...]  # expert whose rows each slot holds on the device
    dmap: tuple[int, ...]  # device resident map
    read_issued: bool  # the consumer already read the current forward map
    blocked: tuple[object, ...] | None  # a host call waiting in host_sync: its continuation


PROPERTIES: dict[str, str] = {
    "P1_no_overwrite_under_reader": "a copy into a slot never runs before an earlier-enqueued "
    "read of that slot finished",
    "P2_no_stale_read": "a read runs after every earlier-enqueued copy into its slots and finds "
    "exactly the experts its forward map names",
    "P3_forward_map_exact": "the forward map exposes exactly the requested experts, each in "
    "its own slot, and agrees with the resident map",
    "P4_map_convergence": "when the device is idle the device resident map equals the host "
    "mirror and every mapped slot holds its expert",
    "P5_victim_protection": "no expert requested by a call is evicted by it",
    "P6_staging_lifetime": "the host never rewrites a staging buffer an enqueued upload still "
    "reads",
    "P7_no_deadlock": "the device can always run some pending operation",
    "P8_no_host_block_on_reader": "no provider call blocks the host on consumer work",
    "P9_validation_first": "a rejected call leaves the whole state unchanged",
}


@dataclass(frozen=True)
class Violation:
    prop: str
    detail: str


class Action(NamedTuple):
    """A transition label: a host call (op, args, stream), a device step, or a resume."""

    kind: str  # "host", "device", "resume"
    op: str = ""
    args: tuple[object, ...] = ()
    stream: int = -1

    def __str__(self) -> str:
        if self.kind == "device":
            return f"device runs head of stream {self.stream}"
        if self.kind == "resume":
            return "host resumes after host_sync"
        shown = ", ".join(map(str, self.args))
        return f"{self.op}({shown}) on stream {self.stream}"


class Outcome(NamedTuple):
    state: State
    violation: Violation | None
    tags: frozenset[str]  # reachability observations ("sometimes" properties)
    trace: tuple[str, ...]  # device calls made by a host call, in the recording format
    counters: Counters


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


def _dec_op(op: Op, stream: int) -> Op:
    refs = op[3]
    if not refs:
        return op
    return (op[0], op[1], op[2], _dec_refs(refs, stream), op[4])


# ---------------------------------------------------------------- device steps


def is_idle(state: State) -> bool:
    return not any(state.queues)


def group_size(queue: tuple[Op, ...]) -> int:
    """Length of the head group: operations one host call enqueued back to back on a stream
    with no event recorded between them. They run as one step; see `_Call.enqueue`."""
    n = 1
    while n < len(queue) and queue[n][4]:
        n += 1
    return n


def runnable(state: State, stream: int) -> bool:
    queue = state.queues[stream]
    if not queue:
        return False
    for op in queue[: group_size(queue)]:
        if op[0] == "wait" and op[3]:
            return False
        if op[0] == "flag":
            assert isinstance(op[1], int)
            if state.events[op[1]] is not None:
                return False
    return True


def device_step(state: State, stream: int) -> Outcome:
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
    kind = head[0]
    violation: Violation | None = None
    slots = state.slots
    dmap = state.dmap
    if kind == "copy":
        slot, expert = head[1], head[2]
        assert isinstance(slot, int)
        if head[3]:
            violation = Violation(
                "P1_no_overwrite_under_reader",
                f"copy of expert {expert} into slot {slot} ran before an earlier read of the slot",
            )
        slots = (*slots[:slot], expert, *slots[slot + 1 :])
    elif kind == "read":
        pairs = head[1]
        assert isinstance(pairs, tuple)
        if head[3]:
            violation = Violation(
                "P2_no_stale_read",
                f"read of {_pairs(pairs)} ran before an earlier copy into its slots",
            )
        else:
            for expert, slot in pairs:
                if slots[slot] != expert:
                    violation = Violation(
                        "P2_no_stale_read",
                        f"read of expert {expert} in slot {slot} found expert {slots[slot]}",
                    )
                    break
    elif kind == "map" and head[2] == RINGS.index("resident"):
        content = head[1]
        assert isinstance(content, tuple)
        dmap = content
    queues = list(state.queues)
    queues[stream] = queue[1:]
    new = state._replace(
        queues=tuple(tuple(_dec_op(op, stream) for op in q) for q in queues),
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


def _pairs(pairs: tuple[tuple[int, int], ...]) -> str:
    return "{" + ", ".join(f"{e}->slot{s}" for e, s in pairs) + "}"


def _map(m: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in m) + "]"


# ---------------------------------------------------------------- host calls


class _Call:
    """Mutable scratch space for running one host call's steps."""

    def __init__(self, state: State, bounds: Bounds, stream: int, effect: Effect) -> None:
        self.bounds = bounds
        self.stream = stream
        self.copy_stream = bounds.consumer_streams
        self.effect = effect
        self.queues = [list(q) for q in state.queues]
        self.events = list(state.events)
        self.staging = [list(r) for r in state.staging]
        self.chosen = [-1] * len(RINGS)  # staging buffer chosen per ring in this call
        self.read_issued = state.read_issued
        self.violation: Violation | None = None
        self.tags: set[str] = set()
        self.trace: list[str] = []
        self.owner = state.host.owner
        self.open_groups: set[int] = set()

    def role(self, role: str) -> int:
        if role == "copy":
            return self.copy_stream
        if role == "owner" and self.owner != NO_STREAM:
            return self.owner
        return self.stream

    def enqueue(self, stream: int, kind: str, a: object, b: int, refs: tuple[Ref, ...]) -> None:
        """Append an operation; glue it to the previous one when this call enqueued that one
        too and recorded no event on the stream since. Nothing outside this call can tell the
        glued operations apart (no snapshot falls between them), and any schedule of the real
        device can be reordered, by delaying the earlier ones, into one that runs the group
        back to back, so running a group as one step loses no behaviour."""
        self.queues[stream].append((kind, a, b, refs, stream in self.open_groups))
        self.open_groups.add(stream)

    def snapshot(self, stream: int) -> Ref | None:
        self.open_groups.discard(stream)
        n = len(self.queues[stream])
        return (stream, n) if n else None

    def flag(self, violation: Violation) -> None:
        if self.violation is None:
            self.violation = violation

    def pending_refs(self, kind: str, slots: set[int]) -> tuple[Ref, ...]:
        """References to pending operations of `kind` touching any of `slots`."""
        refs: list[Ref] = []
        for sid, queue in enumerate(self.queues):
            last = 0
            for i, op in enumerate(queue):
                if op[0] != kind:
                    continue
                if kind == "copy":
                    touched = op[1] in slots
                else:
                    pairs = op[1]
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
                if op[0] == "read":
                    return True
                deps: list[Ref] = list(op[3]) if op[0] == "wait" else []
                if op[0] == "flag":
                    assert isinstance(op[1], int)
                    snap = self.events[op[1]]
                    if snap is not None:
                        deps.append(snap)
                for dep_stream, k in deps:
                    if need.get(dep_stream, 0) < k:
                        need[dep_stream] = k
                        frontier.append((dep_stream, k))
        return False


def _run_step(call: _Call, step: Step, state: State, op: Operation) -> bool:
    """Run one step; returns False when the host must block (host_sync not yet satisfied)."""
    effect = call.effect
    if step.when == "misses" and not effect.copies:
        return True
    if step.when == "changed" and not effect.changed:
        return True
    kind = step.kind
    if kind == "record_event":
        sid = call.role(step.stream)
        call.events[EVENTS.index(step.event)] = call.snapshot(sid)
        call.trace.append(f"record {step.event} on {sid}")
    elif kind == "wait_event":
        sid = call.role(step.stream)
        snap = call.events[EVENTS.index(step.event)]
        call.trace.append(f"wait {step.event} on {sid}")
        if snap is not None and snap[0] != sid:
            call.enqueue(sid, "wait", 0, 0, (snap,))
            call.tags.add("wait_enqueued")
            if step.event == "release" and call.blocks_on_reader([snap[0]]):
                call.tags.add("copy_waits_on_reader")
    elif kind == "wait_flag":
        sid = call.role(step.stream)
        call.enqueue(sid, "flag", EVENTS.index(step.event), 0, ())
        call.trace.append(f"waitflag {step.event} on {sid}")
    elif kind == "copy_rows":
        sid = call.role(step.stream)
        for expert, slot in effect.copies:
            reads = call.pending_refs("read", {slot})
            if reads:
                call.tags.add("copy_while_slot_read_pending")
                if slot not in {state.host.slot_of[v] for v in effect.victims}:
                    call.tags.add("freed_slot_reused_while_read_pending")
            call.enqueue(sid, "copy", slot, expert, reads)
            call.trace.append(f"copy expert {expert} to slot {slot} on {sid}")
    elif kind == "write_staging":
        ring = RINGS.index(step.ring)
        buffers = call.staging[ring]
        index = next((i for i, b in enumerate(buffers) if b.reuse is None), -1)
        call.chosen[ring] = index
        if index == -1:
            call.tags.add(f"staging_{step.ring}_fresh_buffer")
        else:
            if buffers[index].reader is not None:
                call.flag(
                    Violation(
                        "P6_staging_lifetime",
                        f"host rewrote {step.ring} staging buffer {index} "
                        "while its upload is still pending",
                    )
                )
            call.tags.add(f"staging_{step.ring}_buffer_reused")
        call.trace.append(f"stage {step.ring}")
    elif kind == "upload_map":
        sid = call.role(step.stream)
        ring = RINGS.index(step.ring)
        content: tuple[object, ...]
        if step.ring == "resident":
            content = effect.host.slot_of
        else:
            assert effect.host.forward is not None
            content = effect.host.forward
        call.enqueue(sid, "map", content, ring, ())
        index = call.chosen[ring]
        if index >= 0:
            call.staging[ring][index] = call.staging[ring][index]._replace(
                reader=(sid, len(call.queues[sid]))
            )
        call.trace.append(f"upload {step.ring} map on {sid}")
    elif kind == "release_staging":
        sid = call.role(step.stream)
        ring = RINGS.index(step.ring)
        index = call.chosen[ring]
        if index >= 0:
            call.staging[ring][index] = call.staging[ring][index]._replace(
                reuse=call.snapshot(sid)
            )
        call.trace.append(f"record {step.ring} staging reuse on {sid}")
    elif kind == "consumer_read":
        sid = call.role(step.stream)
        pairs = effect.host.forward
        assert pairs is not None
        copies = call.pending_refs("copy", {s for _, s in pairs})
        call.enqueue(sid, "read", pairs, 0, copies)
        call.read_issued = True
        call.trace.append(f"read {_pairs(pairs)} on {sid}")
    elif kind == "host_sync":
        streams = (
            list(range(len(call.queues))) if step.stream == "all" else [call.role(step.stream)]
        )
        call.trace.append(f"host_sync {step.stream}")
        if op.provider and call.blocks_on_reader(streams):
            call.flag(
                Violation(
                    "P8_no_host_block_on_reader",
                    f"{op.name} blocks the host on stream(s) {streams} behind a consumer read",
                )
            )
        if any(call.queues[s] for s in streams):
            return False
    return True


def _finish(call: _Call, state: State, op: Operation, start: int, tags: set[str]) -> Outcome:
    """Run op's steps from index `start` on; may stop in host_sync (blocked)."""
    for index in range(start, len(op.steps)):
        if not _run_step(call, op.steps[index], state, op):
            blocked = (op.name, call.stream, index, call.effect, tuple(call.chosen))
            return _outcome(call, state, op, blocked, tags, finished=False)
    return _outcome(call, state, op, None, tags, finished=True)


def _outcome(
    call: _Call,
    state: State,
    op: Operation,
    blocked: tuple[object, ...] | None,
    tags: set[str],
    *,
    finished: bool,
) -> Outcome:
    host = call.effect.host
    read_issued = call.read_issued
    if finished:
        if op.set_owner == "current":
            host = host._replace(owner=call.stream)
        if op.name == "prepare":
            read_issued = False
    new = State(
        host=host,
        queues=tuple(tuple(q) for q in call.queues),
        events=tuple(call.events),
        staging=tuple(tuple(r) for r in call.staging),
        slots=state.slots,
        dmap=state.dmap,
        read_issued=read_issued,
        blocked=blocked,
    )
    violation = call.violation
    if violation is None and finished and is_idle(new):
        violation = check_idle(new)
    return Outcome(new, violation, frozenset(tags | call.tags), tuple(call.trace),
                   call.effect.counters)


def host_call(
    table: Table,
    bounds: Bounds,
    state: State,
    op_name: str,
    args: tuple[object, ...],
    stream: int,
    counters: Counters = NO_COUNTS,
) -> Outcome:
    """Run one host call of the table on `state`."""
    op = table.op(op_name)
    host = state.host
    for name in op.before_guard:
        host = PRE_GUARD_EFFECTS[name](host, bounds, args)
    error = GUARDS[op.guard](host, bounds, args)
    if error is not None:
        new = state._replace(host=host)
        violation = None
        if new != state and op.provider:
            violation = Violation(
                "P9_validation_first", f"rejected {op.name}{args} ({error}) changed the state"
            )
        return Outcome(new, violation, frozenset({"rejected_" + op.name}), (), counters)
    effect = EFFECTS[op.effect](host, counters, bounds, args, stream)
    tags: set[str] = set()
    violation = _check_plan(op, effect, host, args)
    if op.name == "prepare":
        tags.add("prepare_all_hits" if not effect.copies else "prepare_with_misses")
        if effect.victims:
            tags.add("eviction")
        if host.owner not in (NO_STREAM, stream):
            tags.add("owner_change")
    if op.name == "invalidate" and effect.changed:
        tags.add("invalidate_resident")
    call = _Call(state._replace(host=host), bounds, stream, effect)
    if violation is not None:
        call.flag(violation)
    return _finish(call, state, op, 0, tags)


def resume(table: Table, bounds: Bounds, state: State) -> Outcome:
    """Continue a host call blocked in host_sync, once its streams drained."""
    assert state.blocked is not None
    name, stream, index, effect, chosen = state.blocked
    assert isinstance(name, str) and isinstance(stream, int) and isinstance(index, int)
    assert isinstance(effect, Effect) and isinstance(chosen, tuple)
    op = table.op(name)
    call = _Call(state, bounds, stream, effect)
    call.chosen = list(chosen)
    return _finish(call, state._replace(blocked=None), op, index + 1, {"host_resumed"})


def can_resume(state: State, bounds: Bounds, table: Table) -> bool:
    if state.blocked is None:
        return False
    name, stream, index, _effect, _chosen = state.blocked
    assert isinstance(name, str) and isinstance(stream, int) and isinstance(index, int)
    step = table.op(name).steps[index]
    owner = state.host.owner
    if step.stream == "all":
        return is_idle(state)
    role = {"copy": bounds.consumer_streams, "current": stream}.get(
        step.stream, owner if owner != NO_STREAM else stream
    )
    return not state.queues[role]


def _check_plan(
    op: Operation, effect: Effect, host: HostState, args: tuple[object, ...]
) -> Violation | None:
    if op.name != "prepare":
        return None
    ids = args[0]
    assert isinstance(ids, tuple)
    evicted = set(effect.victims) & set(ids)
    if evicted:
        return Violation(
            "P5_victim_protection", f"prepare{ids} evicted requested expert(s) {sorted(evicted)}"
        )
    forward = effect.host.forward
    assert forward is not None
    experts = [e for e, _ in forward]
    slots = [s for _, s in forward]
    if sorted(experts) != sorted(ids) or len(set(slots)) != len(slots):
        return Violation(
            "P3_forward_map_exact",
            f"prepare{ids} returned forward map {_pairs(forward)}",
        )
    for e, s in forward:
        if effect.host.slot_of[e] != s:
            return Violation(
                "P3_forward_map_exact",
                f"forward map puts expert {e} in slot {s}, resident map in "
                f"slot {effect.host.slot_of[e]}",
            )
    return None


def host_actions(bounds: Bounds) -> Iterator[Action]:
    """Every host call the explorer tries in every state, bad inputs included."""
    from itertools import combinations

    n, cap = bounds.num_experts, bounds.capacity
    for stream in range(bounds.consumer_streams):
        for size in range(1, cap + 1):
            for ids in combinations(range(n), size):
                yield Action("host", "prepare", (ids,), stream)
        for e in range(n):
            yield Action("host", "invalidate", (e,), stream)
        # One representative of each way validation can reject a call.
        yield Action("host", "prepare", (tuple(range(cap + 1)),), stream)
        yield Action("host", "invalidate", (n,), stream)
    yield Action("host", "prepare", ((0, 0),), 0)
    yield Action("host", "prepare", ((n,),), 0)
    yield Action("host", "read", (), 0)
    yield Action("host", "synchronize", (), 0)
