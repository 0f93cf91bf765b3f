"""The two device models of the table as `Model`s: what is explored, and what is identified.

`QueueModel` (explicit FIFO queues, every interleaving of device steps) and `HbModel` (the
happens-before summary, host calls only, a `FactoredModel`) share the host calls tried in every
state (`host_actions`), the host half of a call (`Plans`, computed once per host state and
call) and the symmetry of the two consumer streams.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

from model_check.search.model import (
    DeviceHalf,
    HostHalf,
    SummaryModel,
    swap_mask,
    swap_owner,
    swap_ref,
    swap_stream,
)
from model_check.streams.hb import (
    DeviceCache,
    HbState,
    HostPart,
    check_drained,
    compile_call,
    hb_host_call,
    initial_hb_state,
    packing,
    replay_log,
)
from model_check.streams.interpreter import Action, Outcome
from model_check.streams.program import (
    Compiled,
    Pending,
    Program,
    ProgramKey,
    keeps_reads,
    live_places,
    program_key,
    reduce_pending,
    run_program,
)
from model_check.streams.queues import (
    NO_COUNTS,
    QueuedOp,
    State,
    can_resume,
    deadlocked,
    device_step,
    host_call,
    initial_state,
    resume,
    runnable,
)
from model_check.table.host import Accepted, Rejected, begin_call
from model_check.table.properties import (
    DEADLOCK,
    PROPERTIES,
    REACHABILITY,
    Violation,
    with_policy_tags,
)
from model_check.table.reference import Bounds, HostState
from model_check.table.schema import Table


def host_actions(bounds: Bounds) -> list[Action]:
    """Every host call explored in every state, bad inputs included."""
    n, cap = bounds.num_experts, bounds.capacity
    actions: list[Action] = []
    for stream in range(bounds.consumer_streams):
        for size in range(1, cap + 1):
            for ids in combinations(range(n), size):
                actions.append(Action("host", "prepare", (ids,), stream))
        for e in range(n):
            actions.append(Action("host", "invalidate", (e,), stream))
        # One representative of each way validation can reject a call.
        actions.append(Action("host", "prepare", (tuple(range(cap + 1)),), stream))
        actions.append(Action("host", "invalidate", (n,), stream))
    actions.append(Action("host", "prepare", ((0, 0),), 0))
    actions.append(Action("host", "prepare", ((n,),), 0))
    actions.append(Action("host", "read", (), 0))
    actions.append(Action("host", "synchronize", (), 0))
    return actions


class Plans:
    """Guard and effect of host calls (`table.host.begin_call`), computed once per (host state,
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


# ---------------------------------------------------------------- explicit model


class QueueModel:
    """The explicit model: FIFO queues, every interleaving of device steps."""

    name = "interleavings"
    decides = tuple(PROPERTIES)
    expected_tags = frozenset(REACHABILITY)

    def __init__(self, table: Table, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.host_calls = host_actions(bounds)
        self.expected_tags = with_policy_tags(self.expected_tags, bounds.policy)
        self.plans = Plans(table, bounds)

    def initial(self) -> State:
        return initial_state(self.bounds)

    def actions(self, state: State) -> list[Action]:
        """Device steps of every runnable stream; then a resume of a host call blocked in
        host_sync, or, when none is blocked, every host call (one read per forward map bounds
        the consumer)."""
        out = [Action("device", stream=s) for s in range(len(state.queues)) if runnable(state, s)]
        if state.blocked is not None:
            if can_resume(state, self.bounds, self.table):
                out.append(Action("resume"))
            return out
        out += [a for a in self.host_calls if not (a.op == "read" and state.read_issued)]
        return out

    def outcomes(self, state: State, action: Action) -> list[Outcome[State]]:
        if action.kind == "device":
            return [device_step(state, action.stream)]
        if action.kind == "resume":
            return [resume(self.table, self.bounds, state)]
        begun = self.plans.get(state.host, action.op, action.args, action.stream)
        return [
            host_call(
                self.table, self.bounds, state, action.op, action.args, action.stream, begun=begun
            )
        ]

    def canonical(self, state: State) -> State:
        """The consumer streams are interchangeable: keep the smaller of the two namings, by
        their text (an injective order; `QueuedOp` prints as a plain tuple)."""
        if self.bounds.consumer_streams != 2:
            return state
        queues = list(state.queues)
        queues[0], queues[1] = queues[1], queues[0]
        blocked = state.blocked
        if blocked is not None:
            blocked = blocked._replace(
                stream=swap_stream(blocked.stream), before=swap_owner(blocked.before)
            )
        swapped = state._replace(
            host=swap_owner(state.host),
            queues=tuple(
                tuple(
                    QueuedOp(
                        o.kind,
                        o.what,
                        o.arg,
                        tuple((swap_stream(s), k) for s, k in o.after),
                        o.glued,
                    )
                    for o in q
                )
                for q in queues
            ),
            events=tuple(swap_ref(e) for e in state.events),
            staging=tuple(
                tuple(b._replace(reader=swap_ref(b.reader), reuse=swap_ref(b.reuse)) for b in ring)
                for ring in state.staging
            ),
            blocked=blocked,
        )
        return min(state, swapped, key=repr)

    def stuck(self, state: State) -> Violation | None:
        if deadlocked(state):
            return DEADLOCK
        return None


# ---------------------------------------------------------------- happens-before summary


def forget_dead(part: HostPart) -> HostPart:
    """Erase what no later step can read: a forward map already read (reads are one per
    forward), and the last copy into a slot that is neither mapped nor named by a forward map
    still to be read. A read of such a slot without a new copy is then reported as stale,
    which it is."""
    host = part.host
    live_slots = {s for s in host.slot_of if s >= 0}
    if part.read_issued:
        host = host._replace(forward=())
    elif host.forward is not None:
        live_slots |= {s for _, s in host.forward}
    last_copy = tuple(e if s in live_slots else -1 for s, e in enumerate(part.last_copy))
    return part._replace(host=host, last_copy=last_copy)


class HbModel(SummaryModel):
    """The happens-before summary: every host-call sequence, device order decided by masks.

    Host calls only; each accepted prepare is followed at once by the consumer's read. In
    the summary a pending read only ever adds verdicts against itself (masks evolve per
    operation), so a forward that is read is at least as adversarial as one that is not, and
    without host synchronization between a prepare and the next one the read's position
    among the calls in between changes nothing. The consumer's synchronize only retires
    pending work, which removes violations, and the staging branches already let the host see
    any progress, so it is left to the explicit model.

    As a `FactoredModel`: the host part is `HostPart`, the device part the packed pending
    operations, and a program is an int naming a compiled `streams.program.Program`.
    """

    name = "happens-before"
    decides = tuple(p for p in PROPERTIES if p != "P7_no_deadlock")
    # The summary leaves synchronize, hence a drained device, to the explicit model.
    expected_tags = frozenset(REACHABILITY) - {"device_idle"}

    def __init__(self, table: Table, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.calls = [a for a in host_actions(bounds) if a.op not in ("read", "synchronize")]
        self.expected_tags = with_policy_tags(self.expected_tags, bounds.policy)
        self.pk = packing(bounds)
        # Reads ordered before every stream matter only to P8, i.e. only if some provider
        # operation can block the host.
        self.keep_reads = keeps_reads(table)
        self.live = live_places(table, self.pk.places)
        self.cache: DeviceCache = {}
        self.plans = Plans(table, bounds)
        self.compiled: dict[tuple[object, ...], tuple[int, Compiled]] = {}
        self.program_ids: dict[ProgramKey, int] = {}
        self.programs: list[Program] = []
        self.symmetric = bounds.consumer_streams == 2

    # ------------------------------------------------------------ Model

    def initial(self) -> HbState:
        return initial_hb_state(self.bounds)

    def outcomes(self, state: HbState, action: Action) -> list[Outcome[HbState]]:
        out: list[Outcome[HbState]] = []
        for outcome in self._call(state, action):
            accepted = action.op == "prepare" and bool(outcome.trace)
            if accepted and outcome.violation is None:
                read = Action("host", "read", (), action.stream)
                out += [_chain(outcome, then) for then in self._call(outcome.state, read)]
            else:
                out.append(outcome)
        return out

    def _call(self, state: HbState, action: Action) -> list[Outcome[HbState]]:
        begun = self.plans.get(state.host, action.op, action.args, action.stream)
        compiled = None
        if isinstance(begun, Accepted):
            compiled = self._compile(state.host, begun, action)[1]
        return hb_host_call(
            self.table,
            self.bounds,
            state,
            action.op,
            action.args,
            action.stream,
            keep_reads=self.keep_reads,
            live=self.live,
            cache=self.cache,
            begun=begun,
            compiled=compiled,
        )

    # ------------------------------------------------------------ FactoredModel

    def split(self, state: HbState) -> tuple[HostPart, frozenset[int]]:
        return state.part, state.pending

    def join(self, host: HostPart, device: frozenset[int]) -> HbState:
        return host.with_pending(device)

    def _compile(self, host: HostState, begun: Accepted, action: Action) -> tuple[int, Compiled]:
        """The program of an accepted call (and its id), once per (host state, action)."""
        key = (host, action.op, action.args, action.stream)
        found = self.compiled.get(key)
        if found is None:
            compiled = compile_call(self.bounds, self.table.op(action.op), begun, action.stream)
            pkey = program_key(compiled.program)
            prog = self.program_ids.get(pkey)
            if prog is None:
                prog = len(self.programs)
                self.programs.append(compiled.program)
                self.program_ids[pkey] = prog
            found = (prog, compiled)
            self.compiled[key] = found
        return found

    def host_half(self, host: HostPart, action: Action) -> HostHalf[HostPart, int]:
        """As `hb_host_call` on the host part: guard, plan, P3/P5/P9, the last-copy and map
        bookkeeping, P2's stale content and the drained P4 check."""
        begun = self.plans.get(host.host, action.op, action.args, action.stream)
        if isinstance(begun, Rejected):
            return HostHalf(
                None,
                host._replace(host=begun.host),
                begun.violation is not None,
                frozenset({"rejected_" + action.op}),
                None,
            )
        prog, compiled = self._compile(host.host, begun, action)
        op = self.table.op(action.op)
        after, stale = replay_log(op, begun.effect, action.stream, compiled.log, host)
        violated = (
            begun.violation is not None or stale is not None or check_drained(after) is not None
        )
        then = None
        if action.op == "prepare" and compiled.trace:
            then = Action("host", "read", (), action.stream)
        return HostHalf(prog, after, violated, begun.tags, then)

    def device_half(self, device: frozenset[int], program: int) -> list[DeviceHalf[frozenset[int]]]:
        pk = self.pk
        return [
            DeviceHalf(
                reduce_pending(run.pending, pk, self.keep_reads, self.live),
                run.fault is not None,
                frozenset(run.tags),
            )
            for run in run_program(self.programs[program], list(device), pk)
        ]

    def device_verdicts(
        self, device: frozenset[int], program: int
    ) -> list[tuple[bool, frozenset[str]]]:
        return [
            (run.fault is not None, frozenset(run.tags))
            for run in run_program(self.programs[program], list(device), self.pk)
        ]

    def forget(self, host: HostPart) -> HostPart:
        return forget_dead(host)

    def swap_host(self, host: HostPart) -> HostPart:
        return host._replace(host=swap_owner(host.host))

    def swap_device(self, device: frozenset[int]) -> frozenset[int]:
        return frozenset(swap_mask(e) for e in device)

    def host_order(self, host: HostPart) -> Any:
        return host.host

    def device_order(self, device: frozenset[int]) -> Any:
        return sorted(self.pk.decode(e) for e in device)

    def pending(self, state: HbState) -> list[Pending]:
        """The pending operations of a state, readable."""
        return sorted(self.pk.decode(e) for e in state.pending)


def _chain(first: Outcome[HbState], then: Outcome[HbState]) -> Outcome[HbState]:
    return Outcome(
        then.state,
        then.violation,
        first.tags | then.tags,
        first.trace + then.trace,
        then.counters,
    )
