"""The happens-before summary of the device, for exhaustive search at the full bounds.

The explicit model (`streams.queues`) keeps one FIFO per stream and explores every interleaving of
device steps. Its states remember the order of everything pending, so their number grows
with the product of host-call sequences and device progress. This model keeps, for every
pending device operation, only what any later verdict can depend on: its kind, what it touches,
and the set of *places* it happens before, as a bit mask. A place is a stream (every operation
enqueued on that stream from now on runs after it) or an event snapshot (every wait on that
event from now on orders it). The CUDA facts become bit operations:

    enqueue op on X      the new operation's mask is {X}
    record E on X        every operation before X's tail gains E; every other one loses E
    Y.wait_event(E)      every operation holding E gains Y
    X drains (host_sync) every operation holding X has run and is removed

So "r happens before c" is exactly "c's stream is in r's mask when c is enqueued", and each
ordering property is decided when its second operation is enqueued, for all interleavings at
once:

    P1  a copy into slot s on X: every pending read of s holds X
    P2  a read on X: every pending copy into its slots holds X, and the last copy enqueued into
        each slot is of the expert the forward map names
    P4  a resident-map upload on X: every pending upload holds X (uploads land in host order),
        and after every call the map that will be left once the device drains equals the host
        mirror, with every mapped slot's last copy being its expert (two copies into one slot
        must also be ordered)
    P8  a provider's host_sync on X: no pending read holds X

Device progress never has to be explored: an operation that already ran can only remove
violations (it is no longer pending), so "nothing ran" is the most adversarial schedule for
these properties, and the real device can always be that slow. The one thing the host observes
of progress is a staging buffer's reuse event (`event.query()`); there the model branches
between "not complete" (a fresh buffer) and "complete", which runs exactly the operations
before the event's snapshot and nothing else. P7 (no deadlock) is a property of the explicit
model: with snapshot waits the happens-before relation is acyclic by construction, and the
`wait_flag` kind that can break that is not expressible here.

The device half (the mask updates and the ordering verdicts) is `streams.program`: a call's
steps become a program of primitives, evaluated on the pending operations packed into ints.
This module adds the host-visible part of the state (the last copy into each slot, the last
resident-map upload, whether the forward map was read) and the host call of the summary,
`hb_host_call`, with every verdict's message.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from model_check.streams.interpreter import Outcome
from model_check.streams.program import (
    Compiled,
    NotExpressible,
    Packing,
    Pending,
    Places,
    ProgramKey,
    Recorder,
    keeps_reads,
    live_places,
    program_key,
    reduce_pending,
    run_program,
)
from model_check.table.host import Accepted, Pairs, Rejected, begin_call, finish_host
from model_check.table.properties import Violation
from model_check.table.reference import NO_SLOT, Bounds, Counters, Effect, HostState, initial_host
from model_check.table.schema import Operation, Table

__all__ = [
    "HbState",
    "HostPart",
    "NotExpressible",
    "Packing",
    "Pending",
    "Places",
    "check_drained",
    "compile_call",
    "hb_host_call",
    "initial_hb_state",
    "keeps_reads",
    "live_places",
    "packing",
    "replay_log",
]


class HbState(NamedTuple):
    host: HostState
    pending: frozenset[int]  # packed (`packing(bounds).decode` gives `Pending`s)
    last_copy: tuple[int, ...]  # per slot, expert of the last copy enqueued into it
    last_map: tuple[int, ...]  # content of the last resident-map upload enqueued
    read_issued: bool

    @property
    def part(self) -> HostPart:
        """Everything but the pending operations."""
        return HostPart(self.host, self.last_copy, self.last_map, self.read_issued)


class HostPart(NamedTuple):
    """The host-visible part of an `HbState`: what the host half of a call reads and writes."""

    host: HostState
    last_copy: tuple[int, ...]
    last_map: tuple[int, ...]
    read_issued: bool

    def with_pending(self, pending: frozenset[int]) -> HbState:
        return HbState(self.host, pending, self.last_copy, self.last_map, self.read_issued)


def initial_hb_state(bounds: Bounds) -> HbState:
    return HbState(
        host=initial_host(bounds),
        pending=frozenset(),
        last_copy=(NO_SLOT,) * bounds.capacity,
        last_map=(NO_SLOT,) * bounds.num_experts,
        read_issued=False,
    )


@lru_cache(maxsize=64)
def packing(bounds: Bounds) -> Packing:
    return Packing(bounds)


def compile_call(bounds: Bounds, op: Operation, begun: Accepted, stream: int) -> Compiled:
    """The device half of an accepted call: its steps resolved to a program."""
    recorder = Recorder(bounds, stream, begun.effect, begun.host, packing(bounds))
    recorder.run_steps(op)
    return recorder.compiled()


def check_drained(part: HostPart) -> Violation | None:
    """P4 on the state the device reaches once everything pending has run."""
    mirror = part.host.slot_of
    if part.last_map != mirror:
        return Violation(
            "P4_map_convergence",
            f"once drained the device resident map is {list(part.last_map)} "
            f"but the host mirror is {list(mirror)}",
        )
    for expert, slot in enumerate(mirror):
        if slot != NO_SLOT and part.last_copy[slot] != expert:
            return Violation(
                "P4_map_convergence",
                f"the map names expert {expert} in slot {slot}, last filled with expert "
                f"{part.last_copy[slot]}",
            )
    return None


class Replayed(NamedTuple):
    part: HostPart  # the host part after the call
    stale: Violation | None  # P2 on the content the call's reads find


def replay_log(
    op: Operation, effect: Effect, stream: int, log: tuple[tuple[object, ...], ...], part: HostPart
) -> Replayed:
    """The host part after an accepted call: its host-visible device effects `log` replayed
    on the last copy per slot, the last map upload and whether the forward map was read; with
    P2's verdict on the content the call's reads find (stale content)."""
    copies = list(part.last_copy)
    last_map = part.last_map
    read_issued = part.read_issued and op.name != "prepare"
    stale = None
    for entry in log:
        if entry[0] == "copy":
            slot, expert = entry[1], entry[2]
            assert isinstance(slot, int) and isinstance(expert, int)
            copies[slot] = expert
        elif entry[0] == "map":
            last_map = effect.host.slot_of
        else:
            pairs = entry[1]
            assert isinstance(pairs, tuple)
            read_issued = True
            stale = stale or _stale(pairs, copies)
    host = finish_host(op, effect, stream)
    return Replayed(HostPart(host, tuple(copies), last_map, read_issued), stale)


def _stale(pairs: Pairs, last_copy: list[int]) -> Violation | None:
    for expert, slot in pairs:
        if last_copy[slot] != expert:
            return Violation(
                "P2_no_stale_read",
                f"read of expert {expert} in slot {slot}, which was last filled with "
                f"expert {last_copy[slot]}",
            )
    return None


class Branch(NamedTuple):
    """One outcome of a program on a pending set: reduced, with its verdict and tags."""

    pending: frozenset[int]
    violation: Violation | None
    tags: frozenset[str]


DeviceCache = dict[tuple[frozenset[int], ProgramKey], list[Branch]]


def device_branches(
    bounds: Bounds,
    pending: frozenset[int],
    compiled: Compiled,
    *,
    keep_reads: bool,
    live: int,
    cache: DeviceCache | None = None,
) -> list[Branch]:
    """Every outcome of a compiled call on `pending`, with the verdicts' messages."""
    key = (pending, program_key(compiled.program))
    found = cache.get(key) if cache is not None else None
    if found is None:
        pk = packing(bounds)
        found = [
            Branch(
                reduce_pending(run.pending, pk, keep_reads, live),
                None if run.fault is None else compiled.describe[run.fault.at](run.fault),
                frozenset(run.tags),
            )
            for run in run_program(compiled.program, list(pending), pk)
        ]
        if cache is not None:
            cache[key] = found
    return found


def hb_host_call(
    table: Table,
    bounds: Bounds,
    state: HbState,
    op_name: str,
    args: tuple[object, ...],
    stream: int,
    counters: Counters = Counters(),  # noqa: B008 - immutable NamedTuple
    *,
    keep_reads: bool = True,
    live: int = -1,
    cache: DeviceCache | None = None,
    begun: Accepted | Rejected | None = None,
    compiled: Compiled | None = None,
) -> list[Outcome[HbState]]:
    """Every outcome of one host call (several when staging reuse depends on progress).

    `keep_reads` and `live` are the reductions of `reduce_pending` (the defaults keep
    everything); `cache` (owned by the caller, valid for one set of bounds and one choice of
    reductions) memoizes the device half per (pending operations, program); `begun` and
    `compiled` are the host half and the program when the caller has them already."""
    if begun is None:
        begun = begin_call(table, bounds, state.host, counters, op_name, args, stream)
    if isinstance(begun, Rejected):
        new = state._replace(host=begun.host)
        return [Outcome(new, begun.violation, frozenset({"rejected_" + op_name}), (), counters)]
    op = table.op(op_name)
    effect = begun.effect
    if compiled is None:
        compiled = compile_call(bounds, op, begun, stream)
    after, stale = replay_log(op, effect, stream, compiled.log, state.part)
    drained = check_drained(after)
    outcomes = []
    for branch in device_branches(
        bounds, state.pending, compiled, keep_reads=keep_reads, live=live, cache=cache
    ):
        violation = begun.violation or branch.violation or stale or drained
        outcomes.append(
            Outcome(
                after.with_pending(branch.pending),
                violation,
                begun.tags | branch.tags,
                compiled.trace,
                effect.counters,
            )
        )
    return outcomes
