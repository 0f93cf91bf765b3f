"""The explicit model of the device-planned path: FIFO queues, every interleaving.

A state is the host part (device_program.HostPart), one FIFO queue per stream (the consumer
streams, then the capture stream), the snapshot each event holds, and the device buffers (Dev),
which an operation reads and writes when it RUNS: a plan runs the table's planner on the cache
state it finds, a gather copies what the miss list holds then, a read checks the forward map
and the slots it finds then. So two plans from two streams that the table leaves unordered can
run in either order, and the state they leave is whatever that order gives.

References to queue prefixes are relative, as in the host path's explicit model
(streams/queues.py): `(stream, k)` is "the first k operations now pending there", and
running a stream's head decrements every reference to it. An operation carries, from the time
it is enqueued, references to the earlier-enqueued operations it conflicts with (device_program's
accesses, named from the shadow) and the property an unordered pair breaks; running it while
one of them is pending is that violation. Operations one call enqueues back to back on one
stream with no event recorded between them, a wait only at the front, run as one step (the
argument of semantics.QueueCall.enqueue: a schedule that runs another stream's operation in
between runs into a race that a schedule taking the group whole also meets, and without a race
the order does not change the data).

Verdicts: P1, P2 (order), P4 (two writes of a slot) and P10 when an operation runs; P2 (data),
P3, P5 and P9 (out of bounds) from what the operation finds when it runs; P4 when the device is
idle; P7 when nothing can run; P8 and P9 (a rejected call) from the program; P9 (reporting)
when the host looks at the counters it read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeVar

from model_check.streams.device_program import (
    HostPart,
    Prim,
    Violation,
    conflict_prop,
    initial_host,
    interpret,
    read_verdict,
    report_text,
    resource_name,
)
from model_check.streams.interpreter import Action, Outcome
from model_check.streams.queues import Ref, _dec, group_size, is_idle, popped
from model_check.table.device_functions import (
    Dev,
    converged,
    free_fn,
    gather_fn,
    initial_dev,
    plan_fn,
    plan_verdict,
    run_gather,
)
from model_check.table.reference import Bounds, Counters
from model_check.table.schema import DeviceTable

S = TypeVar("S")
Conflict = tuple[int, int, str, int]  # (stream, k, property, resource)


class XOp(NamedTuple):
    kind: str  # "wait", "plan", "gather", "read", "free", "read_errors", "reset_errors"
    payload: tuple[object, ...]
    accesses: tuple[tuple[int, int], ...]
    conflicts: tuple[Conflict, ...]  # earlier-enqueued conflicting operations still pending
    wait: Ref | None  # for a wait: the snapshot it waits for
    glued: bool  # runs in one step with the operation before it


Blocked = tuple[tuple[Prim, ...], int]  # a call waiting in host_sync: its program, where to go on


class DevPart(NamedTuple):
    """Everything of an explicit state but the host part."""

    queues: tuple[tuple[XOp, ...], ...]  # the consumer streams, then the capture stream
    events: tuple[Ref | None, ...]
    dev: Dev
    reported: bool  # the host's copy of the counters (the last read_errors that ran)
    look: Ref | None  # the pending read_errors of the look in progress
    blocked: Blocked | None


class XState(NamedTuple):
    host: HostPart
    part: DevPart


NO_COUNTERS = Counters()


def _outcome(state: S, violation: Violation | None, tags: frozenset[str]) -> Outcome[S]:
    return Outcome(state, violation, tags, (), NO_COUNTERS)


def initial_part(table: DeviceTable, bounds: Bounds) -> DevPart:
    return DevPart(
        queues=((),) * (len(table.consumer_streams) + 1),
        events=(None,) * len(table.events),
        dev=initial_dev(bounds),
        reported=False,
        look=None,
        blocked=None,
    )


def initial_state(table: DeviceTable, bounds: Bounds) -> XState:
    return XState(initial_host(bounds), initial_part(table, bounds))


def _dec_op(op: XOp, stream: int) -> XOp:
    if not op.conflicts and op.wait is None:
        return op
    conflicts = tuple(
        c if c[0] != stream else (stream, c[1] - 1, c[2], c[3])
        for c in op.conflicts
        if c[0] != stream or c[1] > 1
    )
    return op._replace(conflicts=conflicts, wait=_dec(op.wait, stream))


def runnable(part: DevPart, stream: int) -> bool:
    queue = part.queues[stream]
    if not queue:
        return False
    return all(op.wait is None for op in queue[: group_size(queue)])


def deadlocked(part: DevPart) -> bool:
    return not is_idle(part) and not any(runnable(part, s) for s in range(len(part.queues)))


def idle_verdict(part: DevPart, host: HostPart) -> Violation | None:
    """P4 once the device is idle (and no call is waiting in host_sync)."""
    if part.blocked is not None or not is_idle(part):
        return None
    found = converged(part.dev, host.ghost)
    return None if found is None else Violation("P4_map_convergence", "device idle: " + found)


def _describe(op: XOp) -> str:
    if op.kind == "plan":
        return f"the plan of {op.payload[1]} (pass {op.payload[2]})"
    names = {
        "gather": "a gather",
        "read": "a read",
        "free": "invalidate's update",
        "read_errors": "the counters' read-back",
        "reset_errors": "the counters' reset",
    }
    return names.get(op.kind, op.kind)


def run_op(
    part: DevPart, op: XOp, bounds: Bounds, only: str | None = None
) -> tuple[DevPart, Violation | None]:
    """What one operation does to the device buffers when it runs, and what it finds."""
    dev, violation = part.dev, None
    if op.conflicts:
        chosen = op.conflicts[0]
        if only is not None:
            chosen = next((c for c in op.conflicts if c[2] == only), chosen)
        stream, _, prop, res = chosen
        earlier = "read" if prop == "P1_no_overwrite_under_reader" else "access"
        if prop in ("P2_no_stale_read", "P4_map_convergence"):
            earlier = "write"
        violation = Violation(
            prop,
            f"{_describe(op)} ran before an earlier-enqueued {earlier} of the "
            f"{resource_name(res)}, still pending on stream {stream}",
        )
    reported = part.reported
    kind, payload = op.kind, op.payload
    if kind == "plan":
        fn, ids, p, passes = payload
        assert isinstance(fn, str) and isinstance(ids, tuple)
        assert isinstance(p, int) and isinstance(passes, int)
        out = plan_fn(fn)(dev, ids, p, passes, bounds)
        found = plan_verdict(out, ids)
        if found is not None and violation is None:
            violation = Violation(*found)
        dev = out.dev
    elif kind == "gather":
        fn = payload[0]
        assert isinstance(fn, str)
        dev = run_gather(gather_fn(fn), dev)
    elif kind == "read":
        expected = payload[0]
        assert isinstance(expected, tuple)
        found = read_verdict(dev, expected)
        if found is not None and violation is None:
            violation = Violation(*found)
    elif kind == "free":
        fn, expert = payload
        assert isinstance(fn, str) and isinstance(expert, int)
        dev = free_fn(fn)(dev, expert, bounds)
    elif kind == "read_errors":
        reported = dev.err
    elif kind == "reset_errors":
        dev = dev._replace(err=False)
    return part._replace(dev=dev, reported=reported), violation


def device_step(
    part: DevPart, stream: int, bounds: Bounds, only: str | None = None
) -> tuple[DevPart, Violation | None]:
    """Run the head group of `stream` (which must be runnable). Its verdict is its first
    operation's violation; with `only`, the first of that property when there is one (a group
    runs as one step, so a later operation's violation must not hide behind an earlier one's)."""
    violation: Violation | None = None
    for _ in range(group_size(part.queues[stream])):
        queue = part.queues[stream]
        head = queue[0]
        if head.kind != "wait":
            part, found = run_op(part, head, bounds, only)
            if found is not None and (
                violation is None
                or (only is not None and violation.prop != only and found.prop == only)
            ):
                violation = found
        part = part._replace(
            queues=popped(part.queues, stream, _dec_op),
            events=tuple(_dec(e, stream) for e in part.events),
            look=_dec(part.look, stream),
        )
    return part, violation


class Enqueuer:
    """Runs a program's primitives on the queues."""

    def __init__(self, part: DevPart) -> None:
        self.queues = [list(q) for q in part.queues]
        self.events = list(part.events)
        self.look = part.look
        self.reported = part.reported
        self.open: set[int] = set()
        self.violation: Violation | None = None
        self.tags: set[str] = set()

    def flag(self, v: Violation) -> None:
        if self.violation is None:
            self.violation = v

    def snapshot(self, stream: int) -> Ref | None:
        self.open.discard(stream)
        n = len(self.queues[stream])
        return (stream, n) if n else None

    def enqueue(self, stream: int, op: XOp) -> None:
        """Glue the operation to the one before it when this call enqueued that one too,
        recorded no event on the stream since, and it is not a wait (see the module doc)."""
        glued = stream in self.open and op.kind != "wait"
        self.queues[stream].append(op._replace(glued=glued))
        self.open.add(stream)

    def conflicts(self, stream: int, accesses: tuple[tuple[int, int], ...]) -> tuple[Conflict, ...]:
        """The last pending conflicting operation on every other stream, per property."""
        out: dict[tuple[int, str], tuple[int, int]] = {}
        wanted = {res: mode for res, mode in accesses}
        for sid, queue in enumerate(self.queues):
            if sid == stream:
                continue
            for i, op in enumerate(queue):
                for res, mode in op.accesses:
                    later = wanted.get(res)
                    if later is None:
                        continue
                    prop = conflict_prop(res, mode, later)
                    if prop is not None:
                        out[(sid, prop)] = (i + 1, res)
        return tuple(sorted((sid, k, prop, res) for (sid, prop), (k, res) in out.items()))

    def run(self, prims: tuple[Prim, ...], start: int) -> int:
        """Run prims from `start`; the index after a blocking sync, or -1 when done."""
        for index in range(start, len(prims)):
            prim = prims[index]
            tag = prim[0]
            if tag == "record":
                x, e = prim[1], prim[2]
                assert isinstance(x, int) and isinstance(e, int)
                self.events[e] = self.snapshot(x)
            elif tag == "wait":
                y, e = prim[1], prim[2]
                assert isinstance(y, int) and isinstance(e, int)
                snap = self.events[e]
                if snap is not None and snap[0] != y:
                    self.enqueue(y, XOp("wait", (), (), (), snap, False))
            elif tag == "op":
                kind, x, payload, accesses = prim[1], prim[2], prim[3], prim[4]
                assert isinstance(kind, str) and isinstance(x, int)
                assert isinstance(payload, tuple) and isinstance(accesses, tuple)
                conflicts = self.conflicts(x, accesses)
                props = {c[2] for c in conflicts}
                if kind == "gather" and "P1_no_overwrite_under_reader" in props:
                    self.tags.add("gather_while_slot_read_pending")
                if kind in ("plan", "free") and "P10_ordered_device_state" in props:
                    self.tags.add("state_access_pending_elsewhere")
                self.enqueue(x, XOp(kind, payload, accesses, conflicts, None, False))
                if kind == "read_errors":
                    self.look = (x, len(self.queues[x]))
            elif tag == "sync":
                streams = prim[1]
                assert isinstance(streams, tuple)
                if any(self.queues[s] for s in streams):
                    return index + 1
            elif tag == "report":
                expected = prim[1]
                assert isinstance(expected, bool)
                if self.look is not None:
                    self.flag(
                        Violation(
                            "P9_device_errors_reported",
                            "the host read the counters before their copy landed",
                        )
                    )
                elif self.reported != expected:
                    self.flag(
                        Violation("P9_device_errors_reported", report_text(self.reported, expected))
                    )
                self.look = None
        return -1


def execute(
    part: DevPart, prims: tuple[Prim, ...], start: int = 0
) -> tuple[DevPart, Violation | None, frozenset[str]]:
    """Run a call's program (from `start` when resuming after a host_sync)."""
    run = Enqueuer(part)
    at = run.run(prims, start)
    new = part._replace(
        queues=tuple(tuple(q) for q in run.queues),
        events=tuple(run.events),
        look=run.look,
        blocked=None if at < 0 else (prims, at),
    )
    return new, run.violation, frozenset(run.tags)


def can_resume(part: DevPart) -> bool:
    if part.blocked is None:
        return False
    prims, at = part.blocked
    streams = prims[at - 1][1]
    assert isinstance(streams, tuple)
    return not any(part.queues[s] for s in streams)


def resume(part: DevPart) -> tuple[DevPart, Violation | None]:
    assert part.blocked is not None
    prims, at = part.blocked
    after, found, _ = execute(part._replace(blocked=None), prims, at)
    return after, found


# ---------------------------------------------------------------- whole states (machines, tests)


def host_call(table: DeviceTable, bounds: Bounds, state: XState, action: Action) -> Outcome[XState]:
    """One host call on an explicit state."""
    program = interpret(table, bounds, state.host, action.op, action.args, action.stream)
    if program.rejected:
        return _outcome(state, None, program.tags)
    part, found, tags = execute(state.part, program.prims)
    violation = program.static or found or idle_verdict(part, program.host)
    return _outcome(XState(program.host, part), violation, program.tags | tags)


def device(state: XState, stream: int, bounds: Bounds) -> Outcome[XState]:
    part, found = device_step(state.part, stream, bounds)
    return _outcome(XState(state.host, part), found or idle_verdict(part, state.host), frozenset())


def resume_host(state: XState) -> Outcome[XState]:
    part, found = resume(state.part)
    return _outcome(XState(state.host, part), found or idle_verdict(part, state.host), frozenset())


def replay(
    table: DeviceTable,
    bounds: Bounds,
    calls: Sequence[tuple[str, tuple[object, ...], int]],
    only: str | None = None,
) -> dict[str, str] | None:
    """Run host calls (a z3 counterexample's) on the explicit model, every interleaving of
    device steps between and after them (`search.replay`); the properties it finds violated
    (with `only`, a step that runs as a group reports that property where it meets it)."""
    from model_check.search.replay import replay as replay_on

    def step(st: XState, stream: int) -> Outcome[XState]:
        part, found = device_step(st.part, stream, bounds, only)
        idle = idle_verdict(part, st.host)
        if idle is not None and idle.prop == only:
            found = idle  # not hidden behind the step's own verdict
        return _outcome(XState(st.host, part), found or idle, frozenset())

    def moves(st: XState) -> list[Outcome[XState]]:
        outs = [step(st, s) for s in range(len(st.part.queues)) if runnable(st.part, s)]
        return [*outs, resume_host(st)] if can_resume(st.part) else outs

    def call(st: XState, op: str, args: tuple[object, ...], stream: int) -> Outcome[XState] | None:
        if st.part.blocked is not None:
            return None
        return host_call(table, bounds, st, Action("host", op, args, stream))

    return replay_on(
        initial_state(table, bounds), moves, call, lambda st: deadlocked(st.part), calls
    )
