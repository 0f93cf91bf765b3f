"""The device half of the happens-before summary, written once: programs and their evaluation.

A host call's steps, resolved by the shared interpreter (`DeviceCall.run_steps`: roles, `when`
conditions), become a *program*: a tuple of primitive operations (`Record`, `Wait`, `Copy`,
`Read`, `Stage`, `Upload`, `Release`, `Sync`) whose constants are already bit masks.
`Recorder` is the `DeviceCall` that writes it. `run_program` evaluates a program on a set of
pending operations and returns every outcome (several when the host asks whether a staging
buffer's reuse event completed); `reduce_pending` forgets what no later verdict can depend
on. `streams.hb.hb_host_call` (the reference host call of the summary, with its verdicts'
messages) and the memoized search (`search.memo`, through `search.models.HbModel`'s host and
device halves) both run this code, so the summary's semantics exist once.

A pending operation is one int (`Packing`): its mask of places in the low bits (streams,
events, staging reuse events, see `Places`), then one bit for its kind, then what it touches
(a copy its slot, a read the set of its slots, a map upload its ring and staging buffer).
Record, wait and the other mask updates are then plain bit operations on the int, and "same
kind, same thing" is equality of the high part. `Pending` is the readable form of one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from model_check.streams.interpreter import DeviceCall
from model_check.table.host import Pairs, pairs_text
from model_check.table.properties import Violation
from model_check.table.reference import Bounds, Effect, HostState
from model_check.table.schema import EVENTS, RINGS, Table


class NotExpressible(Exception):
    """The table uses a step kind this summary cannot represent (wait_flag)."""


class Places:
    """Bit positions of the places an operation can happen before: streams first, then
    events, then staging reuse events."""

    def __init__(self, bounds: Bounds) -> None:
        self.n_streams = bounds.consumer_streams + 1
        self.buffers = bounds.staging_buffers

    def stream(self, sid: int) -> int:
        return 1 << sid

    def event(self, name: str) -> int:
        return 1 << (self.n_streams + EVENTS.index(name))

    def reuse(self, ring: int, buffer: int) -> int:
        return 1 << (self.n_streams + len(EVENTS) + ring * self.buffers + buffer)

    @property
    def all_streams(self) -> int:
        return (1 << self.n_streams) - 1


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


def keeps_reads(table: Table) -> bool:
    """Some provider operation synchronizes the host: reads ordered before every stream still
    matter (to P8), so `reduce_pending` keeps every read."""
    return any(s.kind == "host_sync" for op in table.operations if op.provider for s in op.steps)


class Pending(NamedTuple):
    """A pending operation, readable: kind "read" (what: the slots it reads, sorted), "copy"
    (what: its slot) or "map" (what: (ring, staging buffer or -1)), and the places it happens
    before."""

    kind: str
    what: object
    mask: int


class Packing:
    """A `Pending` as one int and back (see the module docstring)."""

    def __init__(self, bounds: Bounds) -> None:
        self.places = Places(bounds)
        self.buffers = bounds.staging_buffers
        self.low_bits = self.places.n_streams + len(EVENTS) + len(RINGS) * self.buffers
        self.low = (1 << self.low_bits) - 1
        self.read = 1 << self.low_bits
        self.copy = 1 << (self.low_bits + 1)
        self.map = 1 << (self.low_bits + 2)
        self.what = self.low_bits + 3
        self.all_streams = self.places.all_streams
        self.map_buffered = 0  # map uploads from a tracked staging buffer
        for r in range(len(RINGS)):
            for b in range(self.buffers):
                self.map_buffered |= self.map_bit(r, b)

    def slot_bit(self, slot: int) -> int:
        return 1 << (self.what + slot)

    def map_bit(self, ring: int, buffer: int) -> int:
        return 1 << (self.what + ring * (self.buffers + 1) + buffer + 1)

    def ring_bits(self, ring: int) -> int:
        bits = 0
        for b in range(-1, self.buffers):
            bits |= self.map_bit(ring, b)
        return bits

    def encode(self, op: Pending) -> int:
        kind, what, mask = op
        if kind == "read":
            assert isinstance(what, tuple)
            bits = 0
            for slot in what:
                bits |= self.slot_bit(slot)
            return self.read | bits | mask
        if kind == "copy":
            assert isinstance(what, int)
            return self.copy | self.slot_bit(what) | mask
        assert kind == "map" and isinstance(what, tuple)
        return self.map | self.map_bit(what[0], what[1]) | mask

    def decode(self, e: int) -> Pending:
        mask = e & self.low
        bits = e >> self.what
        indices = [i for i in range(bits.bit_length()) if bits >> i & 1]
        if e & self.read:
            return Pending("read", tuple(indices), mask)
        if e & self.copy:
            return Pending("copy", indices[0], mask)
        ring, buffer = divmod(indices[0], self.buffers + 1)
        return Pending("map", (ring, buffer - 1), mask)


# ---------------------------------------------------------------- programs
#
# One primitive per device primitive of `DeviceCall`, its constants as bits (`Packing`).


class Record(NamedTuple):
    """record E on X: every operation holding X gains E, every other one loses it."""

    source: int  # X
    place: int  # E


class Wait(NamedTuple):
    """Y.wait_event(E): every operation holding E gains Y."""

    target: int  # Y
    event: int  # E
    release: bool  # the release event (tags a wait that depends on a pending read)


class Copy(NamedTuple):
    """A copy into a slot on X: P1 against pending reads of the slot, P4 against copies."""

    here: int  # X
    slot: int  # the slot's bit
    freed: bool  # the slot was not freed by this call's eviction (tags a refill under a read)
    new: int  # the pending operation it adds


class Read(NamedTuple):
    """The consumer's read on X: P2 against pending copies into its slots."""

    here: int
    slots: int
    new: int


class Stage(NamedTuple):
    """The host picks a staging buffer of `ring`: the first whose reuse event completed."""

    ring: int
    reuse: tuple[int, ...]  # the reuse place of each buffer
    fresh: str  # tag when no buffer is free
    reused: str  # tag when one is
    same: tuple[int, ...]  # per buffer, the high part of an upload from it (P6)


class Upload(NamedTuple):
    """A map upload on X from the chosen staging buffer (P4 order for the resident map)."""

    here: int
    ring: int
    resident: bool
    ring_bits: int  # every upload of the ring
    new: tuple[int, ...]  # the pending operation it adds, by chosen buffer + 1


class Release(NamedTuple):
    """The staging buffer's reuse event recorded on X (only map uploads carry reuse bits)."""

    source: int
    ring: int
    places: tuple[int, ...]  # reuse place per buffer


class Sync(NamedTuple):
    """host_sync of the streams in `streams` (P8 when a provider call does it)."""

    streams: int
    provider: bool


Prim = Record | Wait | Copy | Read | Stage | Upload | Release | Sync
Program = tuple[Prim, ...]
# Primitives of different kinds can be equal as tuples; programs are compared by this key.
ProgramKey = tuple[tuple[type, Prim], ...]


def program_key(program: Program) -> ProgramKey:
    return tuple((type(prim), prim) for prim in program)


class Fault(NamedTuple):
    """The first verdict of a run that failed: the primitive, the pending operation it
    conflicts with (-1: none), and the property."""

    at: int  # index of the primitive
    other: int
    prop: str


P1 = "P1_no_overwrite_under_reader"
P2 = "P2_no_stale_read"
P4 = "P4_map_convergence"
P6 = "P6_staging_lifetime"
P8 = "P8_no_host_block_on_reader"

Describe = Callable[[Fault], Violation]


class Compiled(NamedTuple):
    """What one accepted call does on the device side, for a given plan."""

    program: Program
    describe: tuple[Describe, ...]  # per primitive: the message of a fault at it
    log: tuple[tuple[object, ...], ...]  # host-visible effects: copies, reads, map uploads
    trace: tuple[str, ...]  # device calls in the recording format


class Recorder(DeviceCall):
    """Runs a call's table steps and records the primitives they resolve to."""

    def __init__(
        self, bounds: Bounds, stream: int, effect: Effect, before: HostState, packing: Packing
    ) -> None:
        super().__init__(bounds, stream, effect, before)
        self.pk = packing
        self.places = packing.places
        self.prims: list[Prim] = []
        self.notes: list[Describe] = []
        self.log: list[tuple[object, ...]] = []
        self.op_name = ""

    def compiled(self) -> Compiled:
        return Compiled(tuple(self.prims), tuple(self.notes), tuple(self.log), tuple(self.trace))

    def _add(self, prim: Prim, note: Describe) -> None:
        self.prims.append(prim)
        self.notes.append(note)

    def record(self, stream: int, event: str) -> None:
        self._add(Record(self.places.stream(stream), self.places.event(event)), _no_fault)

    def wait(self, stream: int, event: str) -> None:
        target, bit = self.places.stream(stream), self.places.event(event)
        self._add(Wait(target, bit, event == "release"), _no_fault)

    def wait_flag(self, stream: int, event: str) -> None:
        raise NotExpressible("wait_flag waits for a future record; only the explicit model has it")

    def copy(self, stream: int, slot: int, expert: int) -> None:
        freed = slot not in {self.before.slot_of[v] for v in self.effect.victims}
        here, bit = self.places.stream(stream), self.pk.slot_bit(slot)
        pk = self.pk

        def note(fault: Fault) -> Violation:
            if fault.prop == P1:
                read = pk.decode(fault.other).what
                assert isinstance(read, tuple)
                return Violation(
                    P1,
                    f"copy of expert {expert} into slot {slot} on stream {stream} is not "
                    f"ordered after the pending read of slot(s) {list(read)}",
                )
            return Violation(
                P4, f"two copies into slot {slot} are unordered; its final content is either expert"
            )

        self._add(Copy(here, bit, freed, pk.copy | bit | here), note)
        self.log.append(("copy", slot, expert))

    def read(self, stream: int, pairs: Pairs) -> None:
        bits = 0
        for _, slot in pairs:
            bits |= self.pk.slot_bit(slot)
        here = self.places.stream(stream)
        pk = self.pk

        def note(fault: Fault) -> Violation:
            return Violation(
                P2,
                f"read of {pairs_text(pairs)} on stream {stream} is not ordered after "
                f"the pending copy into slot {pk.decode(fault.other).what}",
            )

        self._add(Read(here, bits, pk.read | bits | here), note)
        self.log.append(("read", pairs))

    def stage(self, ring: str) -> None:
        r = RINGS.index(ring)
        buffers = range(self.bounds.staging_buffers)
        bits = tuple(self.places.reuse(r, b) for b in buffers)
        same = tuple(self.pk.map | self.pk.map_bit(r, b) for b in buffers)
        fresh, reused = f"staging_{ring}_fresh_buffer", f"staging_{ring}_buffer_reused"

        def note(fault: Fault) -> Violation:
            return Violation(
                P6,
                f"host rewrote {ring} staging buffer {fault.other} while its upload may be pending",
            )

        self._add(Stage(r, bits, fresh, reused, same), note)

    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None:
        r = RINGS.index(ring)
        resident = ring == "resident"
        here = self.places.stream(stream)
        new = tuple(
            self.pk.map | self.pk.map_bit(r, b) | here
            for b in range(-1, self.bounds.staging_buffers)
        )

        def note(fault: Fault) -> Violation:
            return Violation(
                P4,
                f"resident-map upload on stream {stream} is not ordered after an earlier "
                "pending upload, which may land last",
            )

        self._add(Upload(here, r, resident, self.pk.ring_bits(r), new), note)
        if resident:
            self.log.append(("map",))

    def release_staging(self, stream: int, ring: str) -> None:
        r = RINGS.index(ring)
        places = tuple(self.places.reuse(r, b) for b in range(self.bounds.staging_buffers))
        self._add(Release(self.places.stream(stream), r, places), _no_fault)

    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        mask = 0
        for s in streams:
            mask |= self.places.stream(s)

        def note(fault: Fault) -> Violation:
            return Violation(
                P8, f"{op_name} blocks the host on stream(s) {streams} behind a consumer read"
            )

        self._add(Sync(mask, provider), note)
        return True  # the summary never blocks: retiring work only removes violations


def _no_fault(fault: Fault) -> Violation:
    raise AssertionError(f"no verdict is decided at primitive {fault.at}")


# ---------------------------------------------------------------- evaluation


class Run(NamedTuple):
    """One outcome of a program: the pending operations (not reduced), the first failed
    verdict, the tags."""

    pending: list[int]
    fault: Fault | None
    tags: set[str]


def run_program(program: Program, pending: list[int], pk: Packing) -> list[Run]:
    """Every outcome of `program` on the pending operations `pending`, in order: where the
    host asks whether a staging buffer's reuse event completed, the run forks, "not yet" at
    every buffer first, then a later buffer's "reached" before an earlier one's."""
    out: list[Run] = []
    _run(program, 0, pending, None, set(), [-1] * len(RINGS), pk, out)
    return out


def _run(
    prims: Program,
    i: int,
    pend: list[int],
    fault: Fault | None,
    tags: set[str],
    chosen: list[int],
    pk: Packing,
    out: list[Run],
) -> None:
    """Run `prims[i:]`, appending every outcome to `out`."""
    is_read, is_copy, is_map = pk.read, pk.copy, pk.map
    n = len(prims)
    while i < n:
        # The kind is dispatched on the class itself (`is` is cheaper than isinstance here,
        # the hottest loop of the search), so `prim` is typed Any.
        prim: Any = prims[i]
        i += 1
        cls = prim.__class__
        if cls is Record:
            source, place = prim
            pend = [(e | place) if e & source else (e & ~place) for e in pend]
        elif cls is Wait:
            target, bit, release = prim
            if release:
                for e in pend:
                    if e & is_read and e & bit and not e & target:
                        tags.add("copy_waits_on_reader")
                        break
            pend = [(e | target) if e & bit else e for e in pend]
        elif cls is Copy:
            here, slot, freed, new = prim
            for e in pend:
                if not e & slot:
                    continue
                if e & is_read:
                    tags.add("copy_while_slot_read_pending")
                    if freed:
                        tags.add("freed_slot_reused_while_read_pending")
                    if not e & here and fault is None:
                        fault = Fault(i - 1, e, P1)
                elif e & is_copy and not e & here and fault is None:
                    fault = Fault(i - 1, e, P4)
            pend.append(new)
        elif cls is Read:
            here, slots, new = prim
            if fault is None:
                for e in pend:
                    if e & is_copy and e & slots and not e & here:
                        fault = Fault(i - 1, e, P2)
                        break
            pend.append(new)
        elif cls is Stage:
            # The host takes the first buffer whose reuse event completed (or was never
            # recorded); at each buffer before it the device may or may not have reached the
            # event, and reaching it runs the operations before it (and nothing else, which
            # can only add violations: they are also pending when the device is slower).
            r, bits, fresh, reused, same = prim
            options: list[tuple[int, list[int]]] = []
            index = -1
            for b, bit in enumerate(bits):
                if not any(e & bit for e in pend):
                    index = b
                    break
                options.append((b, [e for e in pend if not e & bit]))
            options.append((index, pend))
            for index, after in reversed(options):
                branch_tags = set(tags)
                branch_fault = fault
                if index < 0:
                    branch_tags.add(fresh)
                else:
                    branch_tags.add(reused)
                    if branch_fault is None and any(e & ~pk.low == same[index] for e in after):
                        branch_fault = Fault(i - 1, index, P6)
                branch_chosen = list(chosen)
                branch_chosen[r] = index
                _run(prims, i, after, branch_fault, branch_tags, branch_chosen, pk, out)
            return
        elif cls is Upload:
            here, r, resident, ring, new_by_buffer = prim
            if resident and fault is None:
                for e in pend:
                    if e & is_map and e & ring and not e & here:
                        fault = Fault(i - 1, e, P4)
                        break
            if resident or chosen[r] >= 0:
                pend.append(new_by_buffer[chosen[r] + 1])
        elif cls is Release:
            source, r, places = prim
            if chosen[r] >= 0:
                place = places[chosen[r]]
                pend = [
                    (((e | place) if e & source else (e & ~place)) if e & is_map else e)
                    for e in pend
                ]
        else:
            mask, provider = prim
            if provider and fault is None:
                for e in pend:
                    if e & is_read and e & mask:
                        fault = Fault(i - 1, e, P8)
                        break
            pend = [e for e in pend if not e & mask]
            if not pend:
                tags.add("device_idle")
    out.append(Run(pend, fault, tags))


def reduce_pending(pend: list[int], pk: Packing, keep_reads: bool, live: int) -> frozenset[int]:
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
    streams = pk.all_streams
    ops = {e & live for e in pend}  # live clears only event bits
    out: set[int] = set()
    is_read, is_map, buffered, shift = pk.read, pk.map, pk.map_buffered, pk.low_bits
    if len({e >> shift for e in ops}) == len(ops):
        # No two operations of the same kind on the same thing: nothing is dominated.
        for e in ops:
            if (keep_reads and e & is_read) or not (
                e & streams == streams and not (e & is_map and e & buffered)
            ):
                out.add(e)
        return frozenset(out)
    for e in ops:
        if keep_reads and e & is_read:
            out.add(e)
            continue
        if e & streams == streams and not (e & is_map and e & buffered):
            continue
        # Dominated: another operation of the same kind on the same thing whose mask is a
        # proper subset of this one's.
        for f in ops:
            if f != e and not f & ~e and not (f ^ e) >> shift:
                break
        else:
            out.add(e)
    return frozenset(out)
