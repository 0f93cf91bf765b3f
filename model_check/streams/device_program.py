"""The host-call interpreter of the device-planned path, shared by its device models.

A host call of the device table is interpreted in host-call order into a *program*: the
primitive device operations its steps enqueue, with every stream role resolved and every
operation's accesses named (`Prim`). It happens in two halves. `DataInterp` runs the steps on
the data of the host part (`HostPart` without its owner): the reference applied in host-call
order (`ghost`, with `ghost_err`, the errors not yet reported), and `shadow`, the device
buffers as the table's functions leave them when every operation runs in host-call order; it
draws the data verdicts on them and hands over the steps with their roles unresolved. `resolve`
then decides the stream roles, the `when` conditions and P8 for one (owner, current stream).
The data half does not depend on the streams, so `Interpreter` memoizes it per (data, call).

When every two conflicting accesses are ordered by happens-before (P1, P2, P10), every
execution is equivalent to host-call order (conflict serializability), so the shadow is what
the device holds once it drains, and the data verdicts drawn on it hold for every interleaving;
the explicit model (device_queues.py) draws them again from its own device state, at the time each
operation runs.

Accesses are (resource, mode): the cache state S, the forward map F, the miss list M, the error
counters K, and slot s (resource 4 + s); mode R or W. Two accesses to one resource conflict
when one of them writes; the property an unordered pair violates is P1 (a slot written before
an earlier read finished), P2 (a slot read before an earlier write finished), P4 (two writes of
one slot: its final content is either) or P10 (the cache state, forward map, miss list or
counters).
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import NamedTuple, TypeVar

from model_check.streams.interpreter import Action
from model_check.table.device_functions import (
    GUARDS,
    Dev,
    Pairs,
    converged,
    empty_cache,
    free_fn,
    gather_fn,
    initial_dev,
    num_passes,
    pairs_text,
    plan_fn,
    plan_verdict,
    reference_free,
    reference_pass,
    run_gather,
)
from model_check.table.properties import Violation
from model_check.table.reference import NO_SLOT, NO_STREAM, Bounds, HostState
from model_check.table.schema import BLOCKING_KINDS, DeviceOp, DeviceStep, DeviceTable

S, F, M, K = 0, 1, 2, 3
SLOT0 = 4
R, W = 0, 1
RESOURCE_NAMES = ("cache state", "forward map", "miss list", "error counters")
LOOK = -1  # pseudo-resource: the look's counter read, pending until the host may read it


def resource_name(res: int) -> str:
    return RESOURCE_NAMES[res] if res < SLOT0 else f"rows in slot {res - SLOT0}"


def conflict_prop(res: int, earlier: int, later: int) -> str | None:
    """The property an unordered (earlier, later) pair of accesses to `res` violates."""
    if earlier == R and later == R:
        return None
    if res < SLOT0:
        return "P10_ordered_device_state"
    if earlier == R:
        return "P1_no_overwrite_under_reader"
    if later == R:
        return "P2_no_stale_read"
    return "P4_map_convergence"


Access = tuple[int, int]


class HostPart(NamedTuple):
    owner: int
    ghost: HostState  # the reference in host-call order; forward: the last pass's
    ghost_err: bool  # the reference counted an error not yet reported
    shadow: Dev  # the device buffers in host-call order, by the table's functions
    unread: bool  # the last eager pass's forward map is still to be read


def initial_host(bounds: Bounds) -> HostPart:
    return HostPart(NO_STREAM, empty_cache(bounds), False, initial_dev(bounds), False)


# A primitive of a program, a plain tuple:
#   ("record", stream, event)        ("wait", stream, event)
#   ("op", kind, stream, payload, accesses)
#   ("sync", streams, provider)      ("report", expected)
# payload: plan (fn, ids, pass, passes), gather (fn,), read (expected forward,),
#          free (fn, expert), read_errors / reset_errors ().
Prim = tuple[object, ...]


class Program(NamedTuple):
    host: HostPart  # after the call
    prims: tuple[Prim, ...]
    static: Violation | None  # P8 (and P9 for a rejected call): every model reports it
    data: Violation | None  # verdicts on the shadow, in host-call order (the summaries' P2-P5, P9)
    tags: frozenset[str]
    rejected: bool = False


class Item(NamedTuple):
    """A step of a call with its role unresolved: what the data half hands to `resolve`."""

    tag: str  # record, wait, op, sync, report
    role: str  # a role, "all" (sync), or "" (report)
    when: str  # "always" or "owner_change"
    prim: Prim  # the primitive, its stream to be filled in from the role (index 2 for op, 1 else)
    blocking: bool  # a host_sync or a device-state read (P8 on the hot path)


class DataProgram(NamedTuple):
    """The host-order half of a call: a function of the data of the host part (everything
    but the owner) and the call, not of the streams."""

    data: tuple[HostState, bool, Dev, bool]  # ghost, ghost_err, shadow, unread after the call
    items: tuple[Item, ...]
    violation: Violation | None
    tags: frozenset[str]


class DataInterp:
    """One call's data half (see the module docstring)."""

    def __init__(
        self,
        table: DeviceTable,
        bounds: Bounds,
        host: HostPart,
        op: DeviceOp,
        args: tuple[object, ...],
    ) -> None:
        self.table, self.bounds, self.op, self.args = table, bounds, op, args
        self.ghost, self.ghost_err, self.shadow = host.ghost, host.ghost_err, host.shadow
        self.unread = host.unread
        self.items: list[Item] = []
        self.data: Violation | None = None
        self.tags: set[str] = set()
        self.reading: bool | None = None  # what the call's read_errors finds, in host order

    def flag_data(self, prop: str, detail: str) -> None:
        if self.data is None:
            self.data = Violation(prop, detail)

    def arg(self, name: str) -> object:
        return self.args[self.op.args.index(name)]

    def run(self) -> DataProgram:
        op = self.op
        steps = list(op.steps)
        graph = [i for i, s in enumerate(steps) if s.graph]
        if graph:
            ids = self.arg("ids")
            assert isinstance(ids, tuple)
            total = num_passes(ids, self.bounds)
            if total > 1:
                self.tags.add("multi_pass_replay")
            body = steps[graph[0] : graph[-1] + 1]
            for step in steps[: graph[0]]:
                self.step(step, 0, 1)
            for p in range(total):
                for step in body:
                    self.step(step, p, total)
            for step in steps[graph[-1] + 1 :]:
                self.step(step, 0, 1)
        else:
            given = self.arg("pass") if "pass" in op.args else 0
            assert isinstance(given, int)
            named = self.arg("ids") if "ids" in op.args else ()
            assert isinstance(named, tuple)
            for step in steps:
                self.step(step, given, num_passes(named, self.bounds))
        self.unread = unread_after(op, self.unread)
        if self.data is None:
            found = converged(self.shadow, self.ghost)
            if found is not None:
                self.flag_data("P4_map_convergence", "once drained, " + found)
        host = forget_dead(
            HostPart(NO_STREAM, self.ghost, self.ghost_err, self.shadow, self.unread),
            self.table,
            self.bounds,
        )
        return DataProgram(
            (host.ghost, host.ghost_err, host.shadow, host.unread),
            tuple(self.items),
            self.data,
            frozenset(self.tags),
        )

    def emit(self, step: DeviceStep, prim: Prim) -> None:
        tag = str(prim[0])
        blocking = self.op.hot and step.kind in BLOCKING_KINDS
        self.items.append(
            Item(tag, step.stream if tag != "report" else "", step.when, prim, blocking)
        )

    def step(self, step: DeviceStep, p: int, passes: int) -> None:
        kind = step.kind
        if kind == "report":
            self.report(step)
            return
        if kind == "host_sync":
            self.emit(step, ("sync", (), self.op.provider))
            return
        event = self.table.events.index(step.event) if step.event else -1
        if kind == "record_event":
            self.emit(step, ("record", -1, event))
        elif kind == "wait_event":
            self.emit(step, ("wait", -1, event))
        elif kind == "plan":
            self.plan(step, p, passes)
        elif kind == "gather":
            copies = gather_fn(step.fn)(self.shadow)
            writes = tuple(sorted({(SLOT0 + s, W) for _, s in copies}))
            self.shadow = run_gather(gather_fn(step.fn), self.shadow)
            self.emit(step, ("op", "gather", -1, (step.fn,), ((M, R), *writes)))
        elif kind == "consumer_read":
            expected = self.ghost.forward or ()
            found = read_verdict(self.shadow, expected)
            if found is not None:
                self.flag_data(*found)
            reads = tuple(sorted({(SLOT0 + s, R) for _, s in self.shadow.fwd}))
            self.emit(step, ("op", "read", -1, (expected,), ((F, R), *reads)))
        elif kind == "free_slot":
            expert = self.arg("expert")
            assert isinstance(expert, int)
            if self.ghost.slot_of[expert] != NO_SLOT:
                self.tags.add("invalidate_resident")
            self.ghost = reference_free(self.ghost, expert, self.bounds)
            self.shadow = free_fn(step.fn)(self.shadow, expert, self.bounds)
            self.emit(step, ("op", "free", -1, (step.fn, expert), ((S, W),)))
        elif kind == "read_errors":
            self.emit(step, ("op", "read_errors", -1, (), ((K, R),)))
            self.reading = self.shadow.err
        elif kind == "reset_errors":
            self.shadow = self.shadow._replace(err=False)
            self.emit(step, ("op", "reset_errors", -1, (), ((K, W),)))

    def plan(self, step: DeviceStep, p: int, passes: int) -> None:
        ids = self.arg("ids")
        assert isinstance(ids, tuple)
        ghost, forward, error = reference_pass(self.ghost, ids, p, passes, self.bounds)
        if error:
            self.tags.add("error_counted")
        if not forward:
            self.tags.add("empty_pass")
        self.ghost = ghost._replace(forward=forward)
        self.ghost_err = self.ghost_err or error
        out = plan_fn(step.fn)(self.shadow, ids, p, passes, self.bounds)
        if out.victims:
            self.tags.add("eviction")
        if out.by_count:
            self.tags.add("victim_by_count")
        if out.halved:
            self.tags.add("counts_halved")
        found = plan_verdict(out, ids)
        if found is not None:
            self.flag_data(*found)
        self.shadow = out.dev
        self.emit(
            step, ("op", "plan", -1, (step.fn, ids, p, passes), ((S, W), (F, W), (M, W), (K, W)))
        )

    def report(self, step: DeviceStep) -> None:
        value = self.reading
        if value is None:
            self.flag_data("P9_device_errors_reported", "the host reports counters it never read")
            value = self.shadow.err
        if value != self.ghost_err:
            self.flag_data("P9_device_errors_reported", report_text(value, self.ghost_err))
        if self.ghost_err:
            self.tags.add("error_reported")
        self.emit(step, ("report", self.ghost_err))
        self.ghost_err = False


def resolve(table: DeviceTable, op: DeviceOp, dp: DataProgram, owner: int, stream: int) -> Program:
    """The call's program on concrete streams: roles resolved (owner: the current stream when
    there is none; capture: the stream after the consumer streams), `when` decided, P8."""
    capture = len(table.consumer_streams)
    change = owner != NO_STREAM and owner != stream
    roles = {
        "current": stream,
        "owner": stream if owner == NO_STREAM else owner,
        "capture": capture,
    }
    prims: list[Prim] = []
    static: Violation | None = None
    for item in dp.items:
        if item.when == "owner_change" and not change:
            continue
        if item.blocking and static is None:
            what = "blocks the host on" if item.tag == "sync" else "reads device state back from"
            static = Violation("P8_hot_path_never_blocks", f"{op.name} {what} stream {item.role}")
        prim = item.prim
        if item.tag == "op":
            prims.append((prim[0], prim[1], roles[item.role], prim[3], prim[4]))
        elif item.tag == "sync":
            streams = tuple(range(capture + 1)) if item.role == "all" else (roles[item.role],)
            prims.append(("sync", streams, prim[2]))
        elif item.tag == "report":
            prims.append(prim)
        else:
            prims.append((prim[0], roles[item.role], prim[2]))
    tags = dp.tags
    if change and op.hot:
        tags = tags | {"owner_change"}
        if op.name == "replay":
            tags = tags | {"replay_on_other_stream"}
    ghost, ghost_err, shadow, unread = dp.data
    host = HostPart(op.owner_after(owner, stream), ghost, ghost_err, shadow, unread)
    return Program(host, tuple(prims), static, dp.violation, frozenset(tags))


def forget_dead(host: HostPart, table: DeviceTable, bounds: Bounds) -> HostPart:
    """Erase from the host part what no later call can read (fewer distinct states, the same
    verdicts):
    - the forward maps once read (`unread` false): the next read follows a plan, which writes
      both, unless some plan function of the table reads the previous one;
    - the miss list, when every gather of the table follows a plan in its call and reads only
      the entries that plan wrote;
    - the content of a slot neither mapped nor named by an unread forward map: the next read
      of it follows the gather that maps it.
    """
    forward_dead, misses_dead = _dead_after_call(table)
    ghost, shadow = _forget(host.ghost, host.shadow, host.unread, forward_dead, misses_dead)
    return host._replace(ghost=ghost, shadow=shadow)


@cache
def _forget(
    ghost: HostState, shadow: Dev, unread: bool, forward_dead: bool, misses_dead: bool
) -> tuple[HostState, Dev]:
    from model_check.table.device_functions import NO_ENTRY

    if not unread:
        ghost = ghost._replace(forward=None)
        if forward_dead:
            shadow = shadow._replace(fwd=())
    if misses_dead:
        shadow = shadow._replace(misses=(NO_ENTRY,) * len(shadow.misses), n_miss=0)
    live = {s for s in shadow.cache.slot_of if s != NO_SLOT} | {s for _, s in shadow.fwd}
    live |= {s for s in ghost.slot_of if s != NO_SLOT}
    slots = tuple(e if s in live else NO_SLOT for s, e in enumerate(shadow.slots))
    return ghost, shadow._replace(slots=slots)


@lru_cache(maxsize=64)
def _dead_after_call(table: DeviceTable) -> tuple[bool, bool]:
    """(the forward map is dead once read, the miss list is dead after every call)."""
    from model_check.table.device_functions import READS_FORWARD, READS_PAST_COUNT

    fns = {s.fn for op in table.operations for s in op.steps}
    follow = True
    for op in table.operations:
        planned = False
        for step in op.steps:
            if step.kind == "plan":
                planned = True
            elif step.kind == "gather" and not planned:
                follow = False
    return not fns & READS_FORWARD, follow and not fns & READS_PAST_COUNT


B = TypeVar("B")


def unread_after(op: DeviceOp, before: B) -> B | bool:
    """Whether a forward map is unread after the call (`before`: before it, a bool or a z3
    term): an eager plan leaves one to read, a replay reads its own, a read reads it."""
    if any(s.kind == "plan" for s in op.steps):
        return not any(s.graph for s in op.steps) and op.provider
    if any(s.kind == "consumer_read" for s in op.steps):
        return False
    return before


def report_text(seen: bool, expected: bool) -> str:
    if expected:
        return "check_errors found no error, but a pass before it counted one (the error is lost)"
    return "check_errors reported an error no pass since the last look counted"


def read_verdict(dev: Dev, expected: Pairs) -> tuple[str, str] | None:
    """P2 on what a read finds: its pass's forward map, and the experts it names."""
    if dev.fwd != expected:
        return (
            "P2_no_stale_read",
            f"a read found forward map {pairs_text(dev.fwd)}, its pass exposes "
            f"{pairs_text(expected)}",
        )
    for expert, slot in dev.fwd:
        if dev.slots[slot] != expert:
            return (
                "P2_no_stale_read",
                f"a read of expert {expert} in slot {slot} found expert {dev.slots[slot]}",
            )
    return None


def call(op: str, args: tuple[object, ...] = (), stream: int = 0) -> Action:
    """The action of a host call."""
    return Action("host", op, args, stream)


def interpret(
    table: DeviceTable,
    bounds: Bounds,
    host: HostPart,
    op_name: str,
    args: tuple[object, ...],
    stream: int,
) -> Program:
    """One host call on the host part: its program and verdicts (a rejected call: no program)."""
    return Interpreter(table, bounds)(host, call(op_name, args, stream))


class Interpreter:
    """The interpreter, with the data half memoized per (data, call): every owner and stream
    of a host part shares it."""

    def __init__(self, table: DeviceTable, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.data: dict[tuple[object, ...], DataProgram | str] = {}

    def __call__(self, host: HostPart, action: Action) -> Program:
        op = self.table.op(action.op)
        key = (host.ghost, host.ghost_err, host.shadow, host.unread, action.op, action.args)
        dp = self.data.get(key)
        if dp is None:
            error = GUARDS[op.guard](action.args, host.unread, self.bounds)
            dp = (
                error
                if error is not None
                else DataInterp(self.table, self.bounds, host, op, action.args).run()
            )
            self.data[key] = dp
        if isinstance(dp, str):
            return Program(
                host, (), None, None, frozenset({f"rejected_{action.op}"}), rejected=True
            )
        return resolve(self.table, op, dp, host.owner, action.stream)


def host_actions(table: DeviceTable, bounds: Bounds) -> list[Action]:
    """Every host call explored in every state, bad inputs included. A call whose stream
    cannot matter (no role resolves to it) is made on stream 0 only."""
    from itertools import combinations

    n = bounds.num_experts
    streams = range(len(table.consumer_streams))
    subsets = [ids for size in range(1, n + 1) for ids in combinations(range(n), size)]
    actions: list[Action] = []
    for op in table.operations:
        on = streams if op.uses_current else range(1)
        for s in on:
            if op.args == ("ids", "pass"):
                for ids in subsets:
                    for p in range(num_passes(ids, bounds)):
                        actions.append(Action("host", op.name, (ids, p), s))
                actions.append(Action("host", op.name, ((0, n), 0), s))  # a bad id, counted
                if s == 0:
                    actions.append(
                        Action("host", op.name, ((-1,), 0), s)
                    )  # all padding: an empty pass
                    actions.append(Action("host", op.name, ((0,), 1), s))
            elif op.args == ("ids",):
                for ids in subsets:
                    actions.append(Action("host", op.name, (ids,), s))
                actions.append(Action("host", op.name, ((0, n),), s))
            elif op.args == ("expert",):
                for e in range(n):
                    actions.append(Action("host", op.name, (e,), s))
                if s == 0:
                    actions.append(Action("host", op.name, (n,), s))  # rejected
            else:
                actions.append(Action("host", op.name, (), s))
    return actions


__all__ = [
    "Action",
    "HostPart",
    "Interpreter",
    "Program",
    "Violation",
    "conflict_prop",
    "host_actions",
    "initial_host",
    "interpret",
    "read_verdict",
    "resource_name",
]
