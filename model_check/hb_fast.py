"""The happens-before search of `explorer.explore` (model "hb"), made fast by memoization.

This module explores exactly the states and transitions `explorer.HbModel` defines, in the
same order, with the same canonicalization, and reports the same counts; it only avoids
recomputing what a transition depends on. A state of the summary splits into two parts:

    host part   (host state, last copy per slot, last map upload, read issued)
    device part (the pending operations and their masks)

and every transition is the composition of a host-side effect that depends only on the host
part and the action (guard, plan, the steps the table enqueues for that plan, the last-copy
and map bookkeeping, P3/P5/P9, P2's stale-content check and the drained P4 check) with a
device-side effect that depends only on the pending operations and the *program* of the call:
the sequence of primitive device operations (`record`, `wait`, `copy`, ...) the table's steps
resolve to for that plan. Host parts and pending sets are interned to small integers, the
program is recorded once per (host state, action) by running the table's steps through
`core.DeviceCall.run_steps` against a recorder (so the `when` conditions and stream roles are
the shared interpreter's, whatever the table says), and the device effect is memoized per
(pending set, program). The host half replays the call's log with `hb.replay_log` and
`hb.check_drained`; the device effect is evaluated by `_run`, which performs the operations
of `hb.HbCall` on pending operations packed into ints (`Packing`), with the same branching
over staging reuse in the same order as `hb._device_branches`.

Violations are not reported from here: as soon as any transition of a state shows a
violation (or could, as far as this fast path is concerned), the state is expanded again by
the reference code (`HbModel.successors`) and handled exactly as `explore` does, so the
verdict, its message and where the search stops are the reference's. The fast path therefore
only has to be exact about "no violation", successor states, transition counts and
reachability tags, and tests compare it with the reference on the real table and on every
mutant.
"""

from __future__ import annotations

import time
from typing import Any

from model_check.core import Accepted, DeviceCall, Pairs, Violation, finish_host
from model_check.explorer import HbModel, Result, forget_dead, swap_host, swap_pending
from model_check.hb import HbState, NotExpressible, Places, check_drained, replay_log
from model_check.reference import Bounds, Effect, HostState
from model_check.table import EVENTS, RINGS, Table

# Primitive device operations of a program, as tuples headed by one of these codes.
REC, WAIT, COPY, READ, STAGE, UPLOAD, RELEASE, SYNC = range(8)

Prim = tuple[Any, ...]
Program = tuple[Prim, ...]
HostPart = tuple[HostState, tuple[int, ...], tuple[int, ...], bool]
Pending = tuple[str, Any, int]
# A device outcome: (pending id after reduction, some violation, tags).
Branch = tuple[int, bool, frozenset[str]]
# What one (host part, action) does on the host side:
#   rejected: (-1, next host part, violation, tags, False, stream)
#   accepted: (program id, next host part, violation, tags, chains a read, stream)
Recipe = tuple[int, int, bool, frozenset[str], bool, int]
# Per action of a state: (program, read program or -1, canonical final host part, its swapped
# twin, order of the two) -- see `FastHb.host_info`.
Item = tuple[int, int, int, int, int]
HostInfo = tuple[bool, frozenset[str], tuple[Item, ...]]
Chain = tuple[tuple[int, ...], bool, frozenset[str]]
# The frontier (states at the depth bound, whose successors are not stored) needs per action only
# a count, whether some verdict failed and the tags; they are packed into one int: the count in
# the low 32 bits, then FAILED, then one bit per tag (`FastHb.tag_mask`).
COUNT = (1 << 32) - 1
FAILED = 1 << 32
TAG_SHIFT = 33
Frontier = tuple[bool, int, int, tuple[int, ...]]


class Packing:
    """A pending operation `(kind, what, mask)` of `hb` packed into one int: the mask in the
    low bits (the places of `hb.Places`), then one bit per kind, then what the operation
    touches as bits: a copy its slot, a read the set of its slots, a map upload its
    (ring, staging buffer or -1). Record, wait and the other mask updates then apply to the
    packed int as they stand, and "same kind, same thing" is equality of the high part."""

    def __init__(self, bounds: Bounds, places: Places) -> None:
        self.places = places
        self.buffers = bounds.staging_buffers
        self.low_bits = places.n_streams + len(EVENTS) + len(RINGS) * self.buffers
        self.low = (1 << self.low_bits) - 1
        self.read = 1 << self.low_bits
        self.copy = 1 << (self.low_bits + 1)
        self.map = 1 << (self.low_bits + 2)
        self.what = self.low_bits + 3
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
            bits = 0
            for slot in what:
                bits |= self.slot_bit(slot)
            return self.read | bits | mask
        if kind == "copy":
            return self.copy | self.slot_bit(what) | mask
        assert kind == "map"
        return self.map | self.map_bit(what[0], what[1]) | mask

    def decode(self, e: int) -> Pending:
        mask = e & self.low
        bits = e >> self.what
        indices = [i for i in range(bits.bit_length()) if bits >> i & 1]
        if e & self.read:
            return ("read", tuple(indices), mask)
        if e & self.copy:
            return ("copy", indices[0], mask)
        ring, buffer = divmod(indices[0], self.buffers + 1)
        return ("map", (ring, buffer - 1), mask)


class _Recorder(DeviceCall):
    """Runs a call's table steps and records the device operations they resolve to, with
    their constants in `Packing` form."""

    def __init__(
        self, bounds: Bounds, stream: int, effect: Effect, before: HostState, packing: Packing
    ) -> None:
        super().__init__(bounds, stream, effect, before)
        self.pk = packing
        self.places = packing.places
        self.prims: list[Prim] = []
        self.log: list[tuple[object, ...]] = []

    def record(self, stream: int, event: str) -> None:
        self.prims.append((REC, self.places.stream(stream), self.places.event(event)))

    def wait(self, stream: int, event: str) -> None:
        target, bit = self.places.stream(stream), self.places.event(event)
        self.prims.append((WAIT, target, bit, event == "release"))

    def wait_flag(self, stream: int, event: str) -> None:
        raise NotExpressible("wait_flag waits for a future record; only the explicit model has it")

    def copy(self, stream: int, slot: int, expert: int) -> None:
        freed = slot not in {self.before.slot_of[v] for v in self.effect.victims}
        here, bit = self.places.stream(stream), self.pk.slot_bit(slot)
        self.prims.append((COPY, here, bit, freed, self.pk.copy | bit | here))
        self.log.append(("copy", slot, expert))

    def read(self, stream: int, pairs: Pairs) -> None:
        bits = 0
        for _, slot in pairs:
            bits |= self.pk.slot_bit(slot)
        here = self.places.stream(stream)
        self.prims.append((READ, here, bits, self.pk.read | bits | here))
        self.log.append(("read", pairs))

    def stage(self, ring: str) -> None:
        r = RINGS.index(ring)
        buffers = range(self.bounds.staging_buffers)
        bits = tuple(self.places.reuse(r, b) for b in buffers)
        codes = tuple(self.pk.map | self.pk.map_bit(r, b) for b in buffers)
        fresh, reused = f"staging_{ring}_fresh_buffer", f"staging_{ring}_buffer_reused"
        self.prims.append((STAGE, r, bits, fresh, reused, codes))

    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None:
        r = RINGS.index(ring)
        resident = ring == "resident"
        here = self.places.stream(stream)
        # The new operation per staging buffer chosen (-1: a fresh one), indexed by chosen + 1.
        new = tuple(
            self.pk.map | self.pk.map_bit(r, b) | here
            for b in range(-1, self.bounds.staging_buffers)
        )
        self.prims.append((UPLOAD, here, r, resident, self.pk.ring_bits(r), new))
        if resident:
            self.log.append(("map",))

    def release_staging(self, stream: int, ring: str) -> None:
        r = RINGS.index(ring)
        places = tuple(self.places.reuse(r, b) for b in range(self.bounds.staging_buffers))
        self.prims.append((RELEASE, self.places.stream(stream), r, places))

    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        mask = 0
        for s in streams:
            mask |= self.places.stream(s)
        self.prims.append((SYNC, mask, provider))
        return True


Run = tuple[list[int], bool, set[str]]


def _run(
    prims: Program,
    i: int,
    pend: list[int],
    violated: bool,
    tags: set[str],
    chosen: list[int],
    pk: Packing,
    out: list[Run],
) -> None:
    """`hb.HbCall` on packed operations: run `prims[i:]` and append to `out` every outcome
    (the pending operations before reduction, whether some verdict failed, the tags).

    Where the host asks whether a staging buffer's reuse event completed, the run forks (see
    the STAGE case)."""
    is_read, is_copy, is_map = pk.read, pk.copy, pk.map
    n = len(prims)
    while i < n:
        prim = prims[i]
        i += 1
        code = prim[0]
        if code == REC:
            source, place = prim[1], prim[2]
            pend = [(e | place) if e & source else (e & ~place) for e in pend]
        elif code == WAIT:
            target, bit = prim[1], prim[2]
            if prim[3]:
                for e in pend:
                    if e & is_read and e & bit and not e & target:
                        tags.add("copy_waits_on_reader")
                        break
            pend = [(e | target) if e & bit else e for e in pend]
        elif code == COPY:
            here, slot = prim[1], prim[2]
            for e in pend:
                if not e & slot:
                    continue
                if e & is_read:
                    tags.add("copy_while_slot_read_pending")
                    if prim[3]:
                        tags.add("freed_slot_reused_while_read_pending")
                    if not e & here:
                        violated = True
                elif e & is_copy and not e & here:
                    violated = True
            pend.append(prim[4])
        elif code == READ:
            here, slots = prim[1], prim[2]
            for e in pend:
                if e & is_copy and e & slots and not e & here:
                    violated = True
            pend.append(prim[3])
        elif code == STAGE:
            # `HbCall.stage`: the host takes the first buffer whose reuse event completed (or
            # was never recorded); at each buffer before it the device may or may not have
            # reached the event, and reaching it runs the operations before it. The run forks
            # there; outcomes come in `hb._device_branches` order: "not yet" at every buffer
            # first, then a later buffer's "reached" before an earlier one's.
            r, bits = prim[1], prim[2]
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
                branch_violated = violated
                if index < 0:
                    branch_tags.add(prim[3])
                else:
                    branch_tags.add(prim[4])
                    same = prim[5][index]
                    branch_violated = violated or any(e & ~pk.low == same for e in after)
                branch_chosen = list(chosen)
                branch_chosen[r] = index
                _run(prims, i, after, branch_violated, branch_tags, branch_chosen, pk, out)
            return
        elif code == UPLOAD:
            here, r = prim[1], prim[2]
            if prim[3]:
                ring = prim[4]
                for e in pend:
                    if e & is_map and e & ring and not e & here:
                        violated = True
            if prim[3] or chosen[r] >= 0:
                pend.append(prim[5][chosen[r] + 1])
        elif code == RELEASE:
            source, r = prim[1], prim[2]
            if chosen[r] >= 0:
                place = prim[3][chosen[r]]
                pend = [
                    (((e | place) if e & source else (e & ~place)) if e & is_map else e)
                    for e in pend
                ]
        else:  # SYNC
            mask = prim[1]
            if prim[2]:
                for e in pend:
                    if e & is_read and e & mask:
                        violated = True
            pend = [e for e in pend if not e & mask]
            if not pend:
                tags.add("device_idle")
    out.append((pend, violated, tags))


def _reduce(
    pend: list[int], pk: Packing, keep_reads: bool, live: int, streams: int
) -> frozenset[int]:
    """`hb.reduce_pending` on packed operations (`streams`: the mask of every stream)."""
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


class FastHb:
    """Interned host parts and pending sets, and the memoized halves of every transition."""

    def __init__(self, table: Table, bounds: Bounds) -> None:
        self.model = HbModel(table, bounds)
        self.table, self.bounds = table, bounds
        self.places = self.model.places
        self.actions = self.model.actions
        self.swap_streams = bounds.consumer_streams == 2
        # Interning.
        self.hparts: list[HostPart] = []
        self.hpart_id: dict[HostPart, int] = {}
        self.pk = Packing(bounds, self.places)
        self.all_streams = (1 << self.places.n_streams) - 1
        self.pendings: list[frozenset[int]] = []  # packed
        self.pending_id: dict[frozenset[int], int] = {}
        self.programs: dict[Program, int] = {}
        self.program_list: list[Program] = []
        # Memo tables.
        self.recipes: dict[int, list[Recipe]] = {}
        self.read_recipes: dict[tuple[int, int], Recipe] = {}
        self.device: dict[int, tuple[Branch, ...]] = {}
        self.canon_h: dict[int, tuple[int, int, int]] = {}  # raw -> (canon, swapped, cmp)
        self.canon_p: dict[int, tuple[int, int]] = {}  # pending -> (swapped, cmp)
        self.infos: dict[int, HostInfo] = {}
        self.frontiers: dict[int, Frontier] = {}
        self.light: dict[int, int] = {}
        self.light_reads: dict[int, int] = {}
        self.tag_names: list[str] = []
        self.tag_index: dict[str, int] = {}
        self.tag_masks: dict[frozenset[str], int] = {}
        self.chains: dict[int, Chain] = {}
        self.compiled: dict[tuple[object, ...], tuple[int, tuple[tuple[object, ...], ...], bool]]
        self.compiled = {}

    # ------------------------------------------------------------ interning

    def hid(self, part: HostPart) -> int:
        found = self.hpart_id.get(part)
        if found is None:
            found = len(self.hparts)
            self.hparts.append(part)
            self.hpart_id[part] = found
        return found

    def pid(self, pending: frozenset[int]) -> int:
        found = self.pending_id.get(pending)
        if found is None:
            found = len(self.pendings)
            self.pendings.append(pending)
            self.pending_id[pending] = found
        return found

    def state(self, h: int, p: int) -> HbState:
        host, last_copy, last_map, read_issued = self.hparts[h]
        pending = frozenset(self.pk.decode(e) for e in self.pendings[p])
        return HbState(host, pending, last_copy, last_map, read_issued)

    def key_of(self, state: HbState) -> int:
        part = (state.host, state.last_copy, state.last_map, state.read_issued)
        pending = frozenset(self.pk.encode(op) for op in state.pending)
        return (self.hid(part) << 32) | self.pid(pending)

    # ------------------------------------------------------------ host side

    def _program(
        self, host: HostState, begun: Accepted, op_name: str, args: tuple[object, ...], stream: int
    ) -> tuple[int, tuple[tuple[object, ...], ...], bool]:
        """Program id, host-visible log and whether the call made any device call."""
        key = (host, op_name, args, stream)
        found = self.compiled.get(key)
        if found is None:
            recorder = _Recorder(self.bounds, stream, begun.effect, begun.host, self.pk)
            recorder.run_steps(self.table.op(op_name))
            prims = tuple(recorder.prims)
            prog = self.programs.get(prims)
            if prog is None:
                prog = len(self.program_list)
                assert prog < 1 << 20, "device memo keys hold 20 bits of program id"
                self.program_list.append(prims)
                self.programs[prims] = prog
            found = (prog, tuple(recorder.log), bool(recorder.trace))
            self.compiled[key] = found
        return found

    def _recipe(self, h: int, op_name: str, args: tuple[object, ...], stream: int) -> Recipe:
        """The host half of one host call from host part `h` (as `hb.hb_host_call`)."""
        host, last_copy, last_map, read_issued = self.hparts[h]
        begun = self.model.plans.get(host, op_name, args, stream)
        if not isinstance(begun, Accepted):
            nxt = self.hid((begun.host, last_copy, last_map, read_issued))
            tags = frozenset({"rejected_" + op_name})
            return (-1, nxt, begun.violation is not None, tags, False, stream)
        prog, log, traced = self._program(host, begun, op_name, args, stream)
        op = self.table.op(op_name)
        final_host = finish_host(op, begun.effect, stream)
        copies, new_map, issued, stale = replay_log(
            op, begun.effect, log, last_copy, last_map, read_issued
        )
        drained = check_drained(HbState(final_host, frozenset(), copies, new_map, issued))
        violated = begun.violation is not None or stale is not None or drained is not None
        nxt = self.hid((final_host, copies, new_map, issued))
        chains = op_name == "prepare" and traced
        return (prog, nxt, violated, begun.tags, chains, stream)

    def recipes_of(self, h: int) -> list[Recipe]:
        found = self.recipes.get(h)
        if found is None:
            found = [self._recipe(h, a.op, a.args, a.stream) for a in self.actions]
            self.recipes[h] = found
        return found

    def read_recipe(self, h: int, stream: int) -> Recipe:
        key = (h, stream)
        found = self.read_recipes.get(key)
        if found is None:
            found = self._recipe(h, "read", (), stream)
            self.read_recipes[key] = found
        return found

    # ------------------------------------------------------------ device side

    def _runs(self, p: int, prog: int) -> list[Run]:
        """Every outcome of program `prog` on pending set `p`, before reduction."""
        runs: list[Run] = []
        pend = list(self.pendings[p])
        _run(self.program_list[prog], 0, pend, False, set(), [-1] * len(RINGS), self.pk, runs)
        return runs

    def branches(self, p: int, prog: int) -> tuple[Branch, ...]:
        """Every outcome of program `prog` on pending set `p`, in `_device_branches` order."""
        key = (p << 20) | prog
        found = self.device.get(key)
        if found is not None:
            return found
        runs = self._runs(p, prog)
        model = self.model
        out = [
            (
                self.pid(_reduce(pend, self.pk, model.keep_reads, model.live, self.all_streams)),
                violated,
                frozenset(tags),
            )
            for pend, violated, tags in runs
        ]
        found = tuple(out)
        self.device[key] = found
        return found

    def host_info(self, h: int) -> HostInfo:
        """Everything a state's expansion needs from its host part `h`: whether some
        transition may violate a property on the host side, the tags of every host half, and
        per action the device work and the host part it ends in."""
        found = self.infos.get(h)
        if found is not None:
            return found
        violated = False
        tags: set[str] = set()
        items: list[Item] = []
        for prog, nh, rviolated, rtags, chains, stream in self.recipes_of(h):
            violated = violated or rviolated
            tags |= rtags
            then, final = -1, nh
            if chains:
                rprog, rh, rviolated, rtags, _, _ = self.read_recipe(nh, stream)
                violated = violated or rviolated
                tags |= rtags
                then, final = rprog, rh
            items.append((prog, then, *self.canon_host(final)))
        found = (violated, frozenset(tags), tuple(items))
        self.infos[h] = found
        return found

    def tag_mask(self, tags: frozenset[str]) -> int:
        found = self.tag_masks.get(tags)
        if found is None:
            found = 0
            for tag in sorted(tags):
                index = self.tag_index.get(tag)
                if index is None:
                    index = len(self.tag_names)
                    self.tag_names.append(tag)
                    self.tag_index[tag] = index
                found |= 1 << (TAG_SHIFT + index)
            self.tag_masks[tags] = found
        return found

    def tag_set(self, mask: int) -> set[str]:
        return {name for i, name in enumerate(self.tag_names) if mask >> (TAG_SHIFT + i) & 1}

    def frontier_info(self, h: int) -> Frontier:
        """`host_info` for a state at the depth bound: whether some host half may violate a
        property, the host tags as a mask, the number of rejected calls (one transition
        each, no device work) and a code `prog << 20 | then + 1` per accepted one."""
        found = self.frontiers.get(h)
        if found is None:
            violated, tags, items = self.host_info(h)
            rejected = sum(1 for item in items if item[0] < 0)
            codes = tuple((prog << 20) | (then + 1) for prog, then, *_ in items if prog >= 0)
            found = (violated, self.tag_mask(tags), rejected, codes)
            self.frontiers[h] = found
        return found

    def light_chain(self, p: int, code: int) -> int:
        """`chain` for the frontier, packed: transition count, FAILED and tag bits. The
        pending sets reached after the read are not needed there, so they are not reduced."""
        prog, then = code >> 20, (code & 0xFFFFF) - 1
        count = 0
        acc = 0
        for q, failed, qtags in self.branches(p, prog):
            acc |= self.tag_mask(qtags)
            if failed:
                acc |= FAILED
                count += 1
            elif then < 0:
                count += 1
            else:
                key = (q << 20) | then
                v = self.light_reads.get(key)
                if v is None:
                    runs = self._runs(q, then)
                    v = len(runs)
                    for _, rfailed, rtags in runs:
                        v |= (FAILED if rfailed else 0) | self.tag_mask(frozenset(rtags))
                    self.light_reads[key] = v
                count += v & COUNT
                acc |= v
        found = count | (acc & ~COUNT)
        self.light[(p << 40) | code] = found
        return found

    def chain(self, p: int, prog: int, then: int) -> Chain:
        """Program `prog` on pending set `p`, then program `then` (the consumer's read) on
        each outcome when `then` >= 0: the pending ids reached, in transition order, whether
        some verdict failed and the union of the device tags."""
        key = (p << 40) | (prog << 20) | (then + 1)
        found = self.chains.get(key)
        if found is not None:
            return found
        reached: list[int] = []
        violated = False
        tags: set[str] = set()
        for q, failed, qtags in self.branches(p, prog):
            tags |= qtags
            if failed:
                violated = True
                reached.append(q)
            elif then < 0:
                reached.append(q)
            else:
                for r, rfailed, rtags in self.branches(q, then):
                    violated = violated or rfailed
                    tags |= rtags
                    reached.append(r)
        found = (tuple(reached), violated, frozenset(tags))
        self.chains[key] = found
        return found

    # ------------------------------------------------------------ canonical form

    def canon_host(self, h: int) -> tuple[int, int, int]:
        """(canonical host part, its stream-swapped twin, order of the two hosts)."""
        ch = self.canon_h.get(h)
        if ch is None:
            ch = self._canon_host(h)
            self.canon_h[h] = ch
        return ch

    def canon_pending(self, p: int) -> tuple[int, int]:
        """(stream-swapped pending id, order of the sorted pending sets)."""
        cp = self.canon_p.get(p)
        if cp is None:
            cp = self._canon_pending(p)
            self.canon_p[p] = cp
        return cp

    def _canon_host(self, h: int) -> tuple[int, int, int]:
        host, last_copy, last_map, read_issued = self.hparts[h]
        live = forget_dead(HbState(host, frozenset(), last_copy, last_map, read_issued))
        canon = self.hid((live.host, live.last_copy, live.last_map, live.read_issued))
        if not self.swap_streams:
            return canon, canon, -1
        swapped_host = swap_host(live.host)
        swapped = self.hid((swapped_host, live.last_copy, live.last_map, live.read_issued))
        return canon, swapped, _order(live.host, swapped_host)

    def _canon_pending(self, p: int) -> tuple[int, int]:
        pending = frozenset(self.pk.decode(e) for e in self.pendings[p])
        swapped = swap_pending(pending)
        packed = frozenset(self.pk.encode(op) for op in swapped)
        return self.pid(packed), _order(sorted(pending), sorted(swapped))


def _order(a: Any, b: Any) -> int:
    """-1, 0 or 1 as `a` is smaller than, equal to or larger than `b`."""
    return -1 if a < b else (1 if a > b else 0)


def explore_hb(
    table: Table,
    bounds: Bounds,
    depth: int,
    *,
    stop_at_first: bool = True,
    only: str | None = None,
) -> Result:
    """`explorer.explore(..., model="hb")` with symmetry, computed with `FastHb`."""
    start = time.perf_counter()
    fast = FastHb(table, bounds)
    model = fast.model
    result = Result(bounds=bounds, depth=depth, model=model.name)
    init_state = model.canonical(model.initial())
    init = fast.key_of(init_state)
    seen: set[int] = {init}
    level = [init]
    tagsets: set[frozenset[str]] = set()
    tag_mask = 0
    d = 0
    stopped = False
    low = (1 << 32) - 1
    while level and not stopped:
        result.max_depth_reached = d
        grow = d < depth
        nxt_level: list[int] = []
        for key in level:
            h, p = key >> 32, key & low
            if not grow:
                counted = _count_frontier(fast, h, p)
                if counted is not None:
                    result.transitions += counted[0]
                    tag_mask |= counted[1]
                    continue
            found = _expand(fast, h, p, grow, tagsets)
            if found is None:
                stopped = _slow_expand(
                    fast, h, p, d, depth, result, seen, nxt_level, stop_at_first, only
                )
                if stopped:
                    break
                continue
            count, successors = found
            result.transitions += count
            for succ in successors:
                if succ not in seen:
                    seen.add(succ)
                    nxt_level.append(succ)
        level = nxt_level
        d += 1
    for tags in tagsets:
        result.tags |= tags
    result.tags |= fast.tag_set(tag_mask)
    result.states = len(seen)
    result.seconds = time.perf_counter() - start
    if result.violation is not None:
        # As `explore`: the trace comes from a search without renaming.
        from model_check.explorer import explore

        plain = explore(table, bounds, depth, model="hb", symmetry=False, only=only)
        result.trace, result.violation = plain.trace, plain.violation
    return result


def _expand(
    fast: FastHb, h: int, p: int, grow: bool, tagsets: set[frozenset[str]]
) -> tuple[int, list[int]] | None:
    """Transition count and canonical successors of state (h, p), or None when some
    transition may violate a property (the reference code then expands the state)."""
    violated, host_tags, items = fast.host_info(h)
    if violated:
        return None
    count = 0
    successors: list[int] = []
    chains = fast.chains
    chain = fast.chain
    canon_p = fast.canon_p
    canon_pending = fast.canon_pending
    for prog, then, canon, swapped, cmp in items:
        if prog < 0:  # rejected: the pending operations stay
            reached: tuple[int, ...] = (p,)
        else:
            found = chains.get((p << 40) | (prog << 20) | (then + 1))
            if found is None:
                found = chain(p, prog, then)
            reached, failed, tags = found
            if failed:
                return None
            tagsets.add(tags)
        count += len(reached)
        if not grow:
            continue
        # `HbModel.canonical` on interned parts: `canon_host` forgot the dead host data;
        # the stream-swapped twin is taken when its host, or with equal hosts its sorted
        # pending set, is the smaller.
        if cmp < 0:
            for q in reached:
                successors.append((canon << 32) | q)
            continue
        for q in reached:
            cp = canon_p.get(q)
            if cp is None:
                cp = canon_pending(q)
            if cmp > 0 or cp[1] > 0:
                successors.append((swapped << 32) | cp[0])
            else:
                successors.append((canon << 32) | q)
    tagsets.add(host_tags)
    return count, successors


def _count_frontier(fast: FastHb, h: int, p: int) -> tuple[int, int] | None:
    """Transition count and tag mask of state (h, p) at the depth bound, or None when some
    transition may violate a property."""
    violated, acc, count, codes = fast.frontier_info(h)
    if violated:
        return None
    shifted = p << 40
    light = fast.light
    for code in codes:
        v = light.get(shifted | code)
        if v is None:
            v = fast.light_chain(p, code)
        count += v & COUNT
        acc |= v
    if acc & FAILED:
        return None
    return count, acc


def _slow_expand(
    fast: FastHb,
    h: int,
    p: int,
    d: int,
    depth: int,
    result: Result,
    seen: set[int],
    nxt_level: list[int],
    stop_at_first: bool,
    only: str | None,
) -> bool:
    """The body of `explore`'s loop for one state, on the reference successors."""
    model = fast.model
    state = fast.state(h, p)
    for action, outcome, _cost in model.successors(state):
        result.transitions += 1
        result.tags |= outcome.tags
        found: Violation | None = outcome.violation
        if found is not None and only is not None and found.prop != only:
            found = None
        if found is not None and result.violation is None:
            result.violation = found
            result.trace = [(action, outcome)]
            if stop_at_first:
                return True
        if d + 1 > depth:
            continue
        succ = fast.key_of(model.canonical(outcome.state))
        if succ not in seen:
            seen.add(succ)
            nxt_level.append(succ)
    return result.violation is not None and stop_at_first


__all__ = ["FastHb", "explore_hb"]
