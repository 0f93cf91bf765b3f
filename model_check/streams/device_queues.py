"""The explicit model of the device-planned path: FIFO queues, every interleaving.

A state is the host part (core.HostPart), one FIFO queue per stream (the consumer streams, then
the capture stream), the snapshot each event holds, and the device buffers (functions.Dev),
which an operation reads and writes when it RUNS: a plan runs the table's planner on the cache
state it finds, a gather copies what the miss list holds then, a read checks the forward map
and the slots it finds then. So two plans from two streams that the table leaves unordered can
run in either order, and the state they leave is whatever that order gives.

References to queue prefixes are relative, as in the host path's explicit model
(model_check/semantics.py): `(stream, k)` is "the first k operations now pending there", and
running a stream's head decrements every reference to it. An operation carries, from the time
it is enqueued, references to the earlier-enqueued operations it conflicts with (core's
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

from model_check.device.interpreter import Action, Outcome
from model_check.device_path.core import (
    PROPERTIES,
    REACHABILITY,
    HostPart,
    Interpreter,
    Prim,
    Violation,
    conflict_prop,
    host_actions,
    initial_host,
    interpret,
    read_verdict,
    report_text,
    resource_name,
)
from model_check.device_path.functions import (
    Dev,
    converged,
    free_fn,
    gather_fn,
    initial_dev,
    plan_fn,
    plan_verdict,
    run_gather,
)
from model_check.device_path.table import DeviceTable
from model_check.table.properties import DEADLOCK
from model_check.table.reference import NO_STREAM, Bounds, Counters

S = TypeVar("S")
Ref = tuple[int, int]
Conflict = tuple[int, int, str, int]  # (stream, k, property, resource)


class XOp(NamedTuple):
    kind: str  # "wait", "plan", "gather", "read", "free", "read_errors", "reset_errors"
    payload: tuple[object, ...]
    accesses: tuple[tuple[int, int], ...]
    conflicts: tuple[Conflict, ...]  # earlier-enqueued conflicting operations still pending
    wait: Ref | None  # for a wait: the snapshot it waits for
    glue: bool  # runs in one step with the operation before it


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


def _dec(ref: Ref | None, stream: int) -> Ref | None:
    if ref is None or ref[0] != stream:
        return ref
    return None if ref[1] == 1 else (stream, ref[1] - 1)


def _dec_op(op: XOp, stream: int) -> XOp:
    if not op.conflicts and op.wait is None:
        return op
    conflicts = tuple(
        c if c[0] != stream else (stream, c[1] - 1, c[2], c[3])
        for c in op.conflicts
        if c[0] != stream or c[1] > 1
    )
    return op._replace(conflicts=conflicts, wait=_dec(op.wait, stream))


def is_idle(part: DevPart) -> bool:
    return not any(part.queues)


def group_size(queue: tuple[XOp, ...]) -> int:
    n = 1
    while n < len(queue) and queue[n].glue:
        n += 1
    return n


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
        queues = list(part.queues)
        queues[stream] = queue[1:]
        part = part._replace(
            queues=tuple(tuple(_dec_op(o, stream) for o in q) for q in queues),
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
        glue = stream in self.open and op.kind != "wait"
        self.queues[stream].append(op._replace(glue=glue))
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

    def stuck(st: XState) -> Violation | None:
        if deadlocked(st.part):
            return DEADLOCK
        return None

    return replay_on(initial_state(table, bounds), moves, call, stuck, calls)


# ---------------------------------------------------------------- the search model


def _swap(x: int) -> int:
    return 1 - x if x in (0, 1) else x


def _swap_ref(r: Ref | None) -> Ref | None:
    return None if r is None else (_swap(r[0]), r[1])


def swap_prim(prim: Prim) -> Prim:
    tag = prim[0]
    if tag in ("record", "wait"):
        x = prim[1]
        assert isinstance(x, int)
        return (tag, _swap(x), prim[2])
    if tag == "op":
        x = prim[2]
        assert isinstance(x, int)
        return (tag, prim[1], _swap(x), prim[3], prim[4])
    if tag == "sync":
        streams = prim[1]
        assert isinstance(streams, tuple)
        return (tag, tuple(sorted(_swap(s) for s in streams)), prim[2])
    return prim


def swap_part(part: DevPart) -> DevPart:
    queues = list(part.queues)
    queues[0], queues[1] = queues[1], queues[0]
    blocked = part.blocked
    if blocked is not None:
        blocked = (tuple(swap_prim(p) for p in blocked[0]), blocked[1])
    return part._replace(
        queues=tuple(
            tuple(
                o._replace(
                    conflicts=tuple(sorted((_swap(c[0]), *c[1:]) for c in o.conflicts)),
                    wait=_swap_ref(o.wait),
                )
                for o in q
            )
            for q in queues
        ),
        events=tuple(_swap_ref(e) for e in part.events),
        look=_swap_ref(part.look),
        blocked=blocked,
    )


def swap_host(host: HostPart) -> HostPart:
    return host._replace(owner=_swap(host.owner) if host.owner != NO_STREAM else NO_STREAM)


class Interner:
    def __init__(self) -> None:
        self.values: list[object] = []
        self.ids: dict[object, int] = {}

    def __call__(self, value: object) -> int:
        i = self.ids.get(value)
        if i is None:
            i = self.ids[value] = len(self.values)
            self.values.append(value)
        return i


State = tuple[int, int]  # interned (host part, device part)


class ExplicitModel:
    """Every host-call sequence, every interleaving of device steps: a
    `model_check.search.model.Model` that `bfs.bfs` explores.

    States are interned, (host part, device part) as two integers, and every half of a
    transition is memoized on them, so a host part is interpreted once per call and a device
    part runs a program or steps a stream once."""

    name = "interleavings"
    decides = tuple(PROPERTIES)
    expected_tags = frozenset(REACHABILITY)

    def __init__(self, table: DeviceTable, bounds: Bounds, only: str | None = None) -> None:
        self.table, self.bounds, self.only = table, bounds, only
        self.calls = host_actions(table, bounds)
        self._index = {a: i for i, a in enumerate(self.calls)}
        self.interpret = Interpreter(table, bounds)
        # The capture stream is a third one: the two consumer streams stay interchangeable.
        self.symmetric = len(table.consumer_streams) == 2
        self.hosts = Interner()
        self.parts = Interner()
        self.prims = Interner()
        self._host_steps: dict[int, list[tuple[int, int, Violation | None, frozenset[str]]]] = {}
        self._executed: dict[tuple[int, int], tuple[int, Violation | None, frozenset[str]]] = {}
        self._moves: dict[int, dict[Action, tuple[int, Violation | None]]] = {}
        self._actions: dict[int, list[Action]] = {}
        self._idle: dict[tuple[int, int], Violation | None] = {}
        self._swapped: dict[State, State] = {}
        self._quiet_programs: dict[int, bool] = {}

    def initial(self) -> State:
        return (
            self.hosts(initial_host(self.bounds)),
            self.parts(initial_part(self.table, self.bounds)),
        )

    def host_of(self, state: State) -> HostPart:
        host = self.hosts.values[state[0]]
        assert isinstance(host, HostPart)
        return host

    def part_of(self, state: State) -> DevPart:
        part = self.parts.values[state[1]]
        assert isinstance(part, DevPart)
        return part

    def canonical(self, state: State) -> State:
        if not self.symmetric:
            return state
        swapped = self._swapped.get(state)
        if swapped is None:
            swapped = (
                self.hosts(swap_host(self.host_of(state))),
                self.parts(swap_part(self.part_of(state))),
            )
            self._swapped[state] = swapped
        return min(state, swapped)

    def stuck(self, state: State) -> Violation | None:
        if deadlocked(self.part_of(state)):
            return DEADLOCK
        return None

    def _device_moves(self, did: int) -> dict[Action, tuple[int, Violation | None]]:
        """The device part reached and the verdict of every device step and resume."""
        moves = self._moves.get(did)
        if moves is None:
            part = self.part_of((0, did))
            moves = {}
            for sid in range(len(part.queues)):
                if runnable(part, sid):
                    after, found = device_step(part, sid, self.bounds, self.only)
                    moves[Action("device", stream=sid)] = (self.parts(after), found)
            if can_resume(part):
                after, found = resume(part)
                moves[Action("resume")] = (self.parts(after), found)
            self._moves[did] = moves
        return moves

    def actions(self, state: State) -> list[Action]:
        found = self._actions.get(state[1])
        if found is None:
            found = list(self._device_moves(state[1]))
            if self.part_of(state).blocked is None:
                found += self.calls
            self._actions[state[1]] = found
        return found

    def _idle_verdict(self, hid: int, did: int) -> Violation | None:
        key = (hid, did)
        if key not in self._idle:
            self._idle[key] = idle_verdict(self.part_of((hid, did)), self.host_of((hid, did)))
        return self._idle[key]

    def _host_steps_of(self, hid: int) -> list[tuple[int, int, Violation | None, frozenset[str]]]:
        """Per host call: (host after, program id or -1 when rejected, static verdict, tags)."""
        steps = self._host_steps.get(hid)
        if steps is None:
            host = self.hosts.values[hid]
            assert isinstance(host, HostPart)
            steps = []
            for action in self.calls:
                program = self.interpret(host, action)
                if program.rejected:
                    steps.append((hid, -1, None, program.tags))
                else:
                    steps.append(
                        (
                            self.hosts(program.host),
                            self.prims(program.prims),
                            program.static,
                            program.tags,
                        )
                    )
            self._host_steps[hid] = steps
        return steps

    def _execute(self, did: int, pid: int) -> tuple[int, Violation | None, frozenset[str]]:
        key = (did, pid)
        done = self._executed.get(key)
        if done is None:
            prims = self.prims.values[pid]
            assert isinstance(prims, tuple)
            part, found, tags = execute(self.part_of((0, did)), prims)
            done = self._executed[key] = (self.parts(part), found, tags)
        return done

    def bound_verdicts(
        self, state: State, action: Action
    ) -> tuple[int, bool, frozenset[str]] | None:
        """`search.model.BoundVerdicts`: a host call that is rejected, or whose program only
        enqueues (`_quiet`), meets no verdict while being enqueued and leaves the device busy
        (no idle verdict), so at the depth bound its one outcome is known without running it."""
        _, pid, static, tags = self._host_steps_of(state[0])[self._index[action]]
        if pid < 0:
            return 1, False, tags
        if self._quiet(pid):
            return 1, static is not None, tags
        return None

    def _quiet(self, pid: int) -> bool:
        quiet = self._quiet_programs.get(pid)
        if quiet is None:
            prims = self.prims.values[pid]
            assert isinstance(prims, tuple)
            kinds = {p[0] for p in prims}
            quiet = self._quiet_programs[pid] = "op" in kinds and not kinds & {"report", "sync"}
        return quiet

    def outcomes(self, state: State, action: Action) -> list[Outcome[State]]:
        hid, did = state
        if action.kind != "host":
            after, found = self._device_moves(did)[action]
            violation = found or self._idle_verdict(hid, after)
            idle = is_idle(self.part_of((0, after)))
            return [_outcome((hid, after), violation, IDLE if idle else NONE)]
        steps = self._host_steps_of(hid)
        nhid, pid, static, tags = steps[self._index[action]]
        if pid < 0:
            return [_outcome(state, None, tags)]
        after, found, more = self._execute(did, pid)
        violation = static or found or self._idle_verdict(nhid, after)
        return [_outcome((nhid, after), violation, tags | more)]


IDLE = frozenset({"device_idle"})
NONE: frozenset[str] = frozenset()
