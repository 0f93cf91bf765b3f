"""The happens-before summary of the device, for exhaustive search at the full bounds.

The explicit model (semantics.py) keeps one FIFO per stream and explores every interleaving of
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
"""

from __future__ import annotations

from typing import Any, NamedTuple

from model_check.core import (
    Accepted,
    DeviceCall,
    Outcome,
    Pairs,
    Rejected,
    Violation,
    begin_call,
    finish_host,
    pairs_text,
)
from model_check.reference import (
    NO_SLOT,
    Bounds,
    Counters,
    Effect,
    HostState,
    initial_host,
)
from model_check.table import EVENTS, RINGS, Operation, Table

# A device operation that may not have run yet, as a plain tuple for speed:
# (kind, what, mask) with kind "read" (what: the slots it reads), "copy" (what: slot) or
# "map" (what: (ring, staging buffer or -1)), and mask the places it happens before.
Pending = tuple[str, Any, int]


class HbState(NamedTuple):
    host: HostState
    pending: frozenset[Pending]
    last_copy: tuple[int, ...]  # per slot, expert of the last copy enqueued into it
    last_map: tuple[int, ...]  # content of the last resident-map upload enqueued
    read_issued: bool


class NotExpressible(Exception):
    """The table uses a step kind this summary cannot represent (wait_flag)."""


def initial_hb_state(bounds: Bounds) -> HbState:
    return HbState(
        host=initial_host(bounds),
        pending=frozenset(),
        last_copy=(NO_SLOT,) * bounds.capacity,
        last_map=(NO_SLOT,) * bounds.num_experts,
        read_issued=False,
    )


class Places:
    """Bit positions: streams first, then events, then staging reuse events."""

    def __init__(self, bounds: Bounds) -> None:
        self.n_streams = bounds.consumer_streams + 1
        self.buffers = bounds.staging_buffers

    def stream(self, sid: int) -> int:
        return 1 << sid

    def event(self, name: str) -> int:
        return 1 << (self.n_streams + EVENTS.index(name))

    def reuse(self, ring: int, buffer: int) -> int:
        return 1 << (self.n_streams + len(EVENTS) + ring * self.buffers + buffer)


def live_places(table: Table, places: Places) -> int:
    """Places whose value between host calls can matter: every stream and staging reuse
    event, and each event some operation waits on before recording it."""
    live = -1
    for name in EVENTS:
        read_first = False
        for op in table.operations:
            for step in op.steps:
                if step.event != name:
                    continue
                if step.kind in ("wait_event", "wait_flag"):
                    read_first = True
                break
        if not read_first:
            live &= ~places.event(name)
    return live


class HbCall(DeviceCall):
    """One host call's effect on the happens-before summary."""

    def __init__(
        self,
        state: HbState,
        bounds: Bounds,
        stream: int,
        effect: Effect,
        choices: list[int],
        keep_reads: bool,
        live: int,
    ) -> None:
        super().__init__(bounds, stream, effect, state.host)
        self.keep_reads = keep_reads
        self.live = live
        self.places = Places(bounds)
        self.pending = set(state.pending)
        # Host-visible device effects in order, replayed on last_copy/last_map afterwards.
        self.log: list[tuple[object, ...]] = []
        self.chosen = [-1] * len(RINGS)
        self.choices = choices  # staging decisions to take, in order; extended on demand
        self.fixed = len(choices)  # decisions given by the caller; later ones are new
        self.decisions = 0
        self.branches: list[int] = []  # number of options at each decision taken

    def choose(self, options: int) -> int:
        if self.decisions == len(self.choices):
            self.choices.append(0)
        pick = self.choices[self.decisions]
        self.branches.append(options)
        self.decisions += 1
        return pick

    def _set_place(self, source: int, place: int) -> None:
        """Every pending operation holding `source` gains `place`; every other one loses it."""
        self.pending = {
            (k, w, (m | place) if m & source else (m & ~place)) for k, w, m in self.pending
        }

    def record(self, stream: int, event: str) -> None:
        self._set_place(self.places.stream(stream), self.places.event(event))

    def wait(self, stream: int, event: str) -> None:
        bit = self.places.event(event)
        target = self.places.stream(stream)
        if event == "release" and any(
            k == "read" and m & bit and not m & target for k, _, m in self.pending
        ):
            self.tags.add("copy_waits_on_reader")
        self.pending = {(k, w, m | target) if m & bit else (k, w, m) for k, w, m in self.pending}

    def wait_flag(self, stream: int, event: str) -> None:
        raise NotExpressible("wait_flag waits for a future record; only the explicit model has it")

    def copy(self, stream: int, slot: int, expert: int) -> None:
        here = self.places.stream(stream)
        for kind, what, mask in self.pending:
            if kind == "read" and slot in what:
                self.tags.add("copy_while_slot_read_pending")
                if slot not in {self.before.slot_of[v] for v in self.effect.victims}:
                    self.tags.add("freed_slot_reused_while_read_pending")
                if not mask & here:
                    self.flag(
                        Violation(
                            "P1_no_overwrite_under_reader",
                            f"copy of expert {expert} into slot {slot} on stream {stream} is not "
                            f"ordered after the pending read of slot(s) {list(what)}",
                        )
                    )
            if kind == "copy" and what == slot and not mask & here:
                self.flag(
                    Violation(
                        "P4_map_convergence",
                        f"two copies into slot {slot} are unordered; its final content is "
                        "either expert",
                    )
                )
        self.log.append(("copy", slot, expert))
        self.pending.add(("copy", slot, here))

    def read(self, stream: int, pairs: Pairs) -> None:
        here = self.places.stream(stream)
        slots = {s for _, s in pairs}
        for kind, what, mask in self.pending:
            if kind == "copy" and what in slots and not mask & here:
                self.flag(
                    Violation(
                        "P2_no_stale_read",
                        f"read of {pairs_text(pairs)} on stream {stream} is not ordered after "
                        f"the pending copy into slot {what}",
                    )
                )
        self.log.append(("read", pairs))
        # Later verdicts about a read depend only on the slots it reads.
        self.pending.add(("read", tuple(sorted(slots)), here))

    def stage(self, ring: str) -> None:
        r = RINGS.index(ring)
        index = -1
        for b in range(self.bounds.staging_buffers):
            bit = self.places.reuse(r, b)
            if not any(m & bit for _, _, m in self.pending):
                index = b  # its reuse event completed, or was never recorded
                break
            # The device may or may not have reached the event by now.
            if self.choose(2) == 1:
                self.pending = {p for p in self.pending if not p[2] & bit}
                index = b
                break
        self.chosen[r] = index
        if index < 0:
            self.tags.add(f"staging_{ring}_fresh_buffer")
            return
        self.tags.add(f"staging_{ring}_buffer_reused")
        if any(k == "map" and w == (r, index) for k, w, _ in self.pending):
            self.flag(
                Violation(
                    "P6_staging_lifetime",
                    f"host rewrote {ring} staging buffer {index} while its upload may be pending",
                )
            )

    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None:
        r = RINGS.index(ring)
        here = self.places.stream(stream)
        if ring == "resident":
            for kind, what, mask in self.pending:
                if kind == "map" and what[0] == r and not mask & here:
                    self.flag(
                        Violation(
                            "P4_map_convergence",
                            f"resident-map upload on stream {stream} is not ordered after an "
                            "earlier pending upload, which may land last",
                        )
                    )
            self.log.append(("map",))
        if ring == "resident" or self.chosen[r] >= 0:
            self.pending.add(("map", (r, self.chosen[r]), here))

    def release_staging(self, stream: int, ring: str) -> None:
        r = RINGS.index(ring)
        if self.chosen[r] >= 0:
            # Only map uploads carry reuse bits. Forcing the event complete then runs just the
            # uploads before it and leaves other operations pending, which can only add
            # violations (they are also pending in a schedule where the device is slower).
            source, place = self.places.stream(stream), self.places.reuse(r, self.chosen[r])
            self.pending = {
                (k, w, ((m | place) if m & source else (m & ~place)) if k == "map" else m)
                for k, w, m in self.pending
            }

    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        mask = 0
        for s in streams:
            mask |= self.places.stream(s)
        if provider and any(k == "read" and m & mask for k, _, m in self.pending):
            self.flag(
                Violation(
                    "P8_no_host_block_on_reader",
                    f"{op_name} blocks the host on stream(s) {streams} behind a consumer read",
                )
            )
        self.pending = {p for p in self.pending if not p[2] & mask}
        if not self.pending:
            self.tags.add("device_idle")
        return True

    def device_result(self) -> DeviceResult:
        return DeviceResult(
            reduce_pending(self.pending, self.places, self.keep_reads, self.live),
            self.violation,
            frozenset(self.tags),
            tuple(self.trace),
            tuple(self.log),
        )


class DeviceResult(NamedTuple):
    """What one branch of a host call did to the pending operations."""

    pending: frozenset[Pending]
    violation: Violation | None  # ordering verdicts (P1, P2 order, P4 order, P6, P8)
    tags: frozenset[str]
    trace: tuple[str, ...]
    log: tuple[tuple[object, ...], ...]


def reduce_pending(
    pending: set[Pending], places: Places, keep_reads: bool, live: int
) -> frozenset[Pending]:
    """Forget what cannot change any later verdict.

    Event bits outside `live` are cleared: no operation of the table waits on those events
    before recording them again, so their snapshots between calls are never looked at.

    Masks only ever change by monotone maps (record: E := X; wait: Y |= E), so if two pending
    operations of the same kind touch the same thing and one's mask contains the other's, the
    larger one is ordered before everything the smaller one is: any verdict it fails, the
    smaller one fails too, and forced progress that removes the smaller one removes it too.
    Keeping only minimal masks thus preserves every violation. An operation ordered before all
    streams can never be the unordered side of a verdict again. Reads are the exception when
    the table has a provider host_sync: P8 is violated by a read that IS ordered before the
    synchronized stream, so there every read is kept.
    """
    all_streams = (1 << places.n_streams) - 1
    pending = {(k, w, m & live) for k, w, m in pending}
    out: set[Pending] = set()
    for p in pending:
        kind, what, mask = p
        if kind == "read" and keep_reads:
            out.add(p)
            continue
        if mask & all_streams == all_streams and not (kind == "map" and what[1] >= 0):
            continue
        if any(k == kind and w == what and m != mask and m & mask == m for k, w, m in pending):
            continue
        out.add(p)
    return frozenset(out)


def check_drained(state: HbState) -> Violation | None:
    """P4 on the state the device reaches once everything pending has run."""
    mirror = state.host.slot_of
    if state.last_map != mirror:
        return Violation(
            "P4_map_convergence",
            f"once drained the device resident map is {list(state.last_map)} "
            f"but the host mirror is {list(mirror)}",
        )
    for expert, slot in enumerate(mirror):
        if slot != NO_SLOT and state.last_copy[slot] != expert:
            return Violation(
                "P4_map_convergence",
                f"the map names expert {expert} in slot {slot}, last filled with expert "
                f"{state.last_copy[slot]}",
            )
    return None


DeviceCache = dict[tuple[object, ...], list[DeviceResult]]


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
) -> list[Outcome[HbState]]:
    """Every outcome of one host call (several when staging reuse depends on progress).

    The device part depends only on the pending operations and on a few facts of the plan,
    so it is computed once per distinct combination (`cache`, owned by the caller and valid
    for one table and one set of bounds) and replayed on the host part.
    """
    if begun is None:
        begun = begin_call(table, bounds, state.host, counters, op_name, args, stream)
    if isinstance(begun, Rejected):
        new = state._replace(host=begun.host)
        return [Outcome(new, begun.violation, frozenset({"rejected_" + op_name}), (), counters)]
    op = table.op(op_name)
    effect = begun.effect
    host = begun.host
    key = (
        state.pending,
        host.owner,
        stream,
        op_name,
        effect.copies,
        effect.changed,
        effect.host.forward if op_name == "read" else None,
        tuple(host.slot_of[v] for v in effect.victims),
    )
    branches = cache.get(key) if cache is not None else None
    if branches is None:
        branches = _device_branches(state, bounds, stream, effect, host, op, keep_reads, live)
        if cache is not None:
            cache[key] = branches
    outcomes = []
    final_host = finish_host(op, effect, stream)
    for branch in branches:
        last_copy, last_map, read_issued, stale = replay_log(
            op, effect, branch.log, state.last_copy, state.last_map, state.read_issued
        )
        violation = begun.violation or branch.violation or stale
        new = HbState(final_host, branch.pending, last_copy, last_map, read_issued)
        outcomes.append(
            Outcome(
                new,
                violation or check_drained(new),
                begun.tags | branch.tags,
                branch.trace,
                effect.counters,
            )
        )
    return outcomes


def replay_log(
    op: Operation,
    effect: Effect,
    log: tuple[tuple[object, ...], ...],
    last_copy: tuple[int, ...],
    last_map: tuple[int, ...],
    read_issued: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], bool, Violation | None]:
    """The host-visible device effects `log` of one call replayed on the last copy per slot,
    the last map upload and whether the forward map was read; with P2's verdict on the
    content the call's reads find (stale content)."""
    copies = list(last_copy)
    read_issued = read_issued and op.name != "prepare"
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
    return tuple(copies), last_map, read_issued, stale


def _stale(pairs: Pairs, last_copy: list[int]) -> Violation | None:
    for expert, slot in pairs:
        if last_copy[slot] != expert:
            return Violation(
                "P2_no_stale_read",
                f"read of expert {expert} in slot {slot}, which was last filled with "
                f"expert {last_copy[slot]}",
            )
    return None


def _device_branches(
    state: HbState,
    bounds: Bounds,
    stream: int,
    effect: Effect,
    host: HostState,
    op: Operation,
    keep_reads: bool,
    live: int,
) -> list[DeviceResult]:
    branches: list[DeviceResult] = []
    pending_choices: list[list[int]] = [[]]
    while pending_choices:
        choices = pending_choices.pop()
        call = HbCall(state._replace(host=host), bounds, stream, effect, choices, keep_reads, live)
        call.run_steps(op)
        branches.append(call.device_result())
        pending_choices.extend(_alternatives(call))
    return branches


def _alternatives(call: HbCall) -> list[list[int]]:
    """Choice vectors for the options not yet taken at decisions this run made first."""
    out: list[list[int]] = []
    for depth in range(call.fixed, len(call.branches)):
        for option in range(call.choices[depth] + 1, call.branches[depth]):
            out.append([*call.choices[:depth], option])
    return out
