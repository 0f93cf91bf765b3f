"""The device-planned path's two device models as `Model`s (as `models` makes the host path's).

`DeviceQueueModel`: every host-call sequence and every interleaving of device steps on the
explicit queues (`streams.device_queues`), states interned as (host part, device part) with
both halves of a transition memoized. `DeviceHbModel`: host calls only, device order decided
by the happens-before summary (`streams.device_hb`), a `FactoredModel` for `memo.memo_search`.
Both share the host calls tried in every state (`streams.device_program.host_actions`), the
interpreter of a call (memoized per data and call) and the symmetry of the two consumer
streams (`search.model`).
"""

from __future__ import annotations

from model_check.search.model import (
    DeviceHalf,
    HostHalf,
    SummaryModel,
    swap_mask,
    swap_owner,
    swap_ref,
    swap_stream,
)
from model_check.streams.device_hb import HbState, Pend, Summary, device_program
from model_check.streams.device_program import (
    HostPart,
    Interpreter,
    Prim,
    host_actions,
    initial_host,
)
from model_check.streams.device_queues import (
    NO_COUNTERS,
    DevPart,
    _outcome,
    can_resume,
    deadlocked,
    device_step,
    execute,
    idle_verdict,
    initial_part,
    resume,
    runnable,
)
from model_check.streams.interpreter import Action, Outcome
from model_check.streams.queues import is_idle
from model_check.table.properties import (
    DEADLOCK,
    DEVICE_PROPERTIES,
    DEVICE_REACHABILITY,
    Violation,
    with_policy_tags,
)
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceTable


def swap_prim(prim: Prim) -> Prim:
    tag = prim[0]
    if tag in ("record", "wait"):
        x = prim[1]
        assert isinstance(x, int)
        return (tag, swap_stream(x), prim[2])
    if tag == "op":
        x = prim[2]
        assert isinstance(x, int)
        return (tag, prim[1], swap_stream(x), prim[3], prim[4])
    if tag == "sync":
        streams = prim[1]
        assert isinstance(streams, tuple)
        return (tag, tuple(sorted(swap_stream(s) for s in streams)), prim[2])
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
                    conflicts=tuple(sorted((swap_stream(c[0]), *c[1:]) for c in o.conflicts)),
                    wait=swap_ref(o.wait),
                )
                for o in q
            )
            for q in queues
        ),
        events=tuple(swap_ref(e) for e in part.events),
        look=swap_ref(part.look),
        blocked=blocked,
    )


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


class DeviceQueueModel:
    """Every host-call sequence, every interleaving of device steps: a
    `model_check.search.model.Model` that `bfs.bfs` explores.

    States are interned, (host part, device part) as two integers, and every half of a
    transition is memoized on them, so a host part is interpreted once per call and a device
    part runs a program or steps a stream once."""

    name = "interleavings"
    decides = tuple(DEVICE_PROPERTIES)
    expected_tags = frozenset(DEVICE_REACHABILITY)

    def __init__(self, table: DeviceTable, bounds: Bounds, only: str | None = None) -> None:
        self.table, self.bounds, self.only = table, bounds, only
        self.calls = host_actions(table, bounds)
        self.expected_tags = with_policy_tags(self.expected_tags, bounds.policy)
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
                self.hosts(swap_owner(self.host_of(state))),
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


class DeviceHbModel(SummaryModel):
    """Every host-call sequence; device order decided by the summary.

    A `model_check.search.model.FactoredModel`: the host part is `device_program.HostPart`,
    the device part the pending accesses, a program the call's primitives without payloads
    (`device_hb.device_program`); `memo.memo_search` explores it with both halves memoized,
    and its `Model.outcomes` is the composition of the two."""

    name = "happens-before"
    decides = tuple(p for p in DEVICE_PROPERTIES if p != "P7_no_deadlock")
    # The summary leaves device_synchronize, hence a drained device, to the explicit model.
    expected_tags = frozenset(DEVICE_REACHABILITY) - {"device_idle"}

    def __init__(self, table: DeviceTable, bounds: Bounds) -> None:
        self.table, self.bounds = table, bounds
        self.calls = [a for a in host_actions(table, bounds) if a.op != "device_synchronize"]
        self.expected_tags = with_policy_tags(self.expected_tags, bounds.policy)
        self.summary = Summary(table, bounds)
        self.interpret = Interpreter(table, bounds)
        self.symmetric = len(table.consumer_streams) == 2

    # ------------------------------------------------------------ Model

    def initial(self) -> HbState:
        return HbState(initial_host(self.bounds), frozenset())

    def outcomes(self, state: HbState, action: Action) -> list[Outcome[HbState]]:
        program = self.interpret(state.host, action)
        if program.rejected:
            return [Outcome(state, None, program.tags, (), NO_COUNTERS)]
        half = self.summary.run(state.pending, device_program(program.prims))
        # The static verdict (P8) first, then the ordering ones, then the data ones.
        violation = program.static or half.violation or program.data
        new = HbState(program.host, half.pending)
        return [Outcome(new, violation, program.tags | half.tags, (), NO_COUNTERS)]

    # ------------------------------------------------------------ FactoredModel

    def split(self, state: HbState) -> tuple[HostPart, frozenset[Pend]]:
        return state.host, state.pending

    def join(self, host: HostPart, device: frozenset[Pend]) -> HbState:
        return HbState(host, device)

    def host_half(self, host: HostPart, action: Action) -> HostHalf[HostPart, tuple[Prim, ...]]:
        program = self.interpret(host, action)
        if program.rejected:
            return HostHalf(None, host, False, program.tags, None)
        failed = program.static is not None or program.data is not None
        return HostHalf(device_program(program.prims), program.host, failed, program.tags, None)

    def device_half(
        self, device: frozenset[Pend], program: tuple[Prim, ...]
    ) -> list[DeviceHalf[frozenset[Pend]]]:
        half = self.summary.run(device, program)
        return [DeviceHalf(half.pending, half.violation is not None, half.tags)]

    def device_verdicts(
        self, device: frozenset[Pend], program: tuple[Prim, ...]
    ) -> list[tuple[bool, frozenset[str]]]:
        half = self.summary.run(device, program)
        return [(half.violation is not None, half.tags)]

    def forget(self, host: HostPart) -> HostPart:
        return host  # the interpreter's data half already forgot (device_program.forget_dead)

    def swap_host(self, host: HostPart) -> HostPart:
        return swap_owner(host)

    def swap_device(self, device: frozenset[Pend]) -> frozenset[Pend]:
        return frozenset((r, m, swap_mask(k)) for r, m, k in device)

    def host_order(self, host: HostPart) -> int:
        return host.owner  # a host part and its renaming differ only there

    def device_order(self, device: frozenset[Pend]) -> tuple[Pend, ...]:
        return tuple(sorted(device))
