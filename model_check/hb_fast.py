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
(pending set, program). The device effect is evaluated by `_run`, which performs the
operations of `hb.HbCall` on plain tuples, with the same branching over staging reuse in the
same order as `hb._device_branches`.

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

from model_check.core import Accepted, Action, DeviceCall, Pairs, Violation, begin_call
from model_check.explorer import HbModel, Result, forget_dead, swap_host, swap_pending
from model_check.hb import HbState, NotExpressible, Places, reduce_pending
from model_check.reference import Bounds, Effect, HostState
from model_check.semantics import NO_COUNTS
from model_check.table import RINGS, Table

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


class _Recorder(DeviceCall):
    """Runs a call's table steps and records the device operations they resolve to."""

    def __init__(
        self, bounds: Bounds, stream: int, effect: Effect, before: HostState, places: Places
    ) -> None:
        super().__init__(bounds, stream, effect, before)
        self.places = places
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
        self.prims.append((COPY, self.places.stream(stream), slot, freed))
        self.log.append(("copy", slot, expert))

    def read(self, stream: int, pairs: Pairs) -> None:
        slots = frozenset(s for _, s in pairs)
        self.prims.append((READ, self.places.stream(stream), slots, tuple(sorted(slots))))
        self.log.append(("read", pairs))

    def stage(self, ring: str) -> None:
        r = RINGS.index(ring)
        bits = tuple(self.places.reuse(r, b) for b in range(self.bounds.staging_buffers))
        self.prims.append(
            (STAGE, r, bits, f"staging_{ring}_fresh_buffer", f"staging_{ring}_buffer_reused")
        )

    def upload(self, stream: int, ring: str, content: tuple[object, ...]) -> None:
        resident = ring == "resident"
        self.prims.append((UPLOAD, self.places.stream(stream), RINGS.index(ring), resident))
        if resident:
            self.log.append(("map",))

    def release_staging(self, stream: int, ring: str) -> None:
        self.prims.append((RELEASE, self.places.stream(stream), RINGS.index(ring)))

    def host_sync(self, streams: list[int], provider: bool, op_name: str) -> bool:
        mask = 0
        for s in streams:
            mask |= self.places.stream(s)
        self.prims.append((SYNC, mask, provider))
        return True


def _run(
    prims: Program, pending: frozenset[Pending], choices: list[int], places: Places
) -> tuple[list[Pending], bool, set[str], list[int]]:
    """One branch of `hb.HbCall` on `pending`: what `run_steps` does, on plain tuples.

    Returns the pending operations (before reduction), whether some verdict failed, the tags,
    and the number of options at each staging decision taken (as `HbCall.branches`)."""
    pend = list(pending)
    violated = False
    tags: set[str] = set()
    chosen = [-1] * len(RINGS)
    decisions = 0
    branches: list[int] = []
    for prim in prims:
        code = prim[0]
        if code == REC:
            source, place = prim[1], prim[2]
            pend = [(k, w, (m | place) if m & source else (m & ~place)) for k, w, m in pend]
        elif code == WAIT:
            target, bit = prim[1], prim[2]
            if prim[3] and any(k == "read" and m & bit and not m & target for k, _, m in pend):
                tags.add("copy_waits_on_reader")
            pend = [(k, w, m | target) if m & bit else (k, w, m) for k, w, m in pend]
        elif code == COPY:
            here, slot = prim[1], prim[2]
            for k, w, m in pend:
                if k == "read":
                    if slot in w:
                        tags.add("copy_while_slot_read_pending")
                        if prim[3]:
                            tags.add("freed_slot_reused_while_read_pending")
                        if not m & here:
                            violated = True
                elif k == "copy" and w == slot and not m & here:
                    violated = True
            pend.append(("copy", slot, here))
        elif code == READ:
            here, slots = prim[1], prim[2]
            for k, w, m in pend:
                if k == "copy" and w in slots and not m & here:
                    violated = True
            pend.append(("read", prim[3], here))
        elif code == STAGE:
            r = prim[1]
            index = -1
            for b, bit in enumerate(prim[2]):
                if not any(m & bit for _, _, m in pend):
                    index = b
                    break
                if decisions == len(choices):
                    choices.append(0)
                pick = choices[decisions]
                branches.append(2)
                decisions += 1
                if pick == 1:
                    pend = [p for p in pend if not p[2] & bit]
                    index = b
                    break
            chosen[r] = index
            if index < 0:
                tags.add(prim[3])
                continue
            tags.add(prim[4])
            if any(k == "map" and w == (r, index) for k, w, _ in pend):
                violated = True
        elif code == UPLOAD:
            here, r = prim[1], prim[2]
            if prim[3] and any(k == "map" and w[0] == r and not m & here for k, w, m in pend):
                violated = True
            if prim[3] or chosen[r] >= 0:
                pend.append(("map", (r, chosen[r]), here))
        elif code == RELEASE:
            source, r = prim[1], prim[2]
            if chosen[r] >= 0:
                place = places.reuse(r, chosen[r])
                pend = [
                    (k, w, ((m | place) if m & source else (m & ~place)) if k == "map" else m)
                    for k, w, m in pend
                ]
        else:  # SYNC
            mask = prim[1]
            if prim[2] and any(k == "read" and m & mask for k, _, m in pend):
                violated = True
            pend = [p for p in pend if not p[2] & mask]
            if not pend:
                tags.add("device_idle")
    return pend, violated, tags, branches


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
        self.pendings: list[frozenset[Pending]] = []
        self.pending_id: dict[frozenset[Pending], int] = {}
        self.programs: dict[Program, int] = {}
        self.program_list: list[Program] = []
        # Memo tables.
        self.recipes: dict[int, list[Recipe]] = {}
        self.read_recipes: dict[tuple[int, int], Recipe] = {}
        self.device: dict[int, tuple[Branch, ...]] = {}
        self.canon_h: dict[int, tuple[int, int, int]] = {}  # raw -> (canon, swapped, cmp)
        self.canon_p: dict[int, tuple[int, int]] = {}  # pending -> (swapped, cmp)
        self.infos: dict[int, HostInfo] = {}
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

    def pid(self, pending: frozenset[Pending]) -> int:
        found = self.pending_id.get(pending)
        if found is None:
            found = len(self.pendings)
            self.pendings.append(pending)
            self.pending_id[pending] = found
        return found

    def state(self, h: int, p: int) -> HbState:
        host, last_copy, last_map, read_issued = self.hparts[h]
        return HbState(host, self.pendings[p], last_copy, last_map, read_issued)

    def key_of(self, state: HbState) -> int:
        part = (state.host, state.last_copy, state.last_map, state.read_issued)
        return (self.hid(part) << 32) | self.pid(state.pending)

    # ------------------------------------------------------------ host side

    def _program(
        self, host: HostState, begun: Accepted, op_name: str, args: tuple[object, ...], stream: int
    ) -> tuple[int, tuple[tuple[object, ...], ...], bool]:
        """Program id, host-visible log and whether the call made any device call."""
        key = (host, op_name, args, stream)
        found = self.compiled.get(key)
        if found is None:
            recorder = _Recorder(self.bounds, stream, begun.effect, begun.host, self.places)
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
        plan_key = (host, op_name, args, stream)
        begun = self.model.plans.get(plan_key)
        if begun is None:
            begun = begin_call(self.table, self.bounds, host, NO_COUNTS, op_name, args, stream)
            self.model.plans[plan_key] = begun
        if not isinstance(begun, Accepted):
            nxt = self.hid((begun.host, last_copy, last_map, read_issued))
            tags = frozenset({"rejected_" + op_name})
            return (-1, nxt, begun.violation is not None, tags, False, stream)
        prog, log, traced = self._program(host, begun, op_name, args, stream)
        op = self.table.op(op_name)
        effect = begun.effect
        final_host = effect.host
        if op.set_owner == "current":
            final_host = final_host._replace(owner=stream)
        violated = begun.violation is not None
        copies = list(last_copy)
        new_map = last_map
        issued = read_issued and op.name != "prepare"
        for entry in log:
            if entry[0] == "copy":
                slot, expert = entry[1], entry[2]
                assert isinstance(slot, int) and isinstance(expert, int)
                copies[slot] = expert
            elif entry[0] == "map":
                new_map = effect.host.slot_of
            else:
                pairs = entry[1]
                assert isinstance(pairs, tuple)
                issued = True
                if any(copies[slot] != expert for expert, slot in pairs):
                    violated = True  # P2: stale content
        if new_map != final_host.slot_of or any(
            slot >= 0 and copies[slot] != expert for expert, slot in enumerate(final_host.slot_of)
        ):
            violated = True  # P4 once drained
        nxt = self.hid((final_host, tuple(copies), new_map, issued))
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

    def branches(self, p: int, prog: int) -> tuple[Branch, ...]:
        """Every outcome of program `prog` on pending set `p`, in `_device_branches` order."""
        key = (p << 20) | prog
        found = self.device.get(key)
        if found is not None:
            return found
        prims = self.program_list[prog]
        pending = self.pendings[p]
        model = self.model
        out: list[Branch] = []
        stack: list[list[int]] = [[]]
        while stack:
            choices = stack.pop()
            fixed = len(choices)
            pend, violated, tags, counts = _run(prims, pending, choices, self.places)
            reduced = reduce_pending(set(pend), self.places, model.keep_reads, model.live)
            out.append((self.pid(reduced), violated, frozenset(tags)))
            for depth in range(fixed, len(counts)):
                for option in range(choices[depth] + 1, counts[depth]):
                    stack.append([*choices[:depth], option])
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

    def canonical(self, h: int, p: int) -> int:
        """`HbModel.canonical` on interned parts: forget dead data, then the stream swap."""
        canon, swapped, cmp = self.canon_host(h)
        if cmp < 0:
            return (canon << 32) | p
        cp = self.canon_pending(p)
        if cmp > 0 or cp[1] > 0:
            return (swapped << 32) | cp[0]
        return (canon << 32) | p

    def _canon_host(self, h: int) -> tuple[int, int, int]:
        host, last_copy, last_map, read_issued = self.hparts[h]
        live = forget_dead(HbState(host, frozenset(), last_copy, last_map, read_issued))
        canon = self.hid((live.host, live.last_copy, live.last_map, live.read_issued))
        if not self.swap_streams:
            return canon, canon, -1
        swapped_host = swap_host(live.host)
        swapped = self.hid((swapped_host, live.last_copy, live.last_map, live.read_issued))
        cmp = -1 if live.host < swapped_host else (1 if live.host > swapped_host else 0)
        return canon, swapped, cmp

    def _canon_pending(self, p: int) -> tuple[int, int]:
        pending = self.pendings[p]
        swapped = swap_pending(pending)
        a, b = sorted(pending), sorted(swapped)
        return self.pid(swapped), (-1 if a < b else (1 if a > b else 0))


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
    d = 0
    stopped = False
    low = (1 << 32) - 1
    while level and not stopped:
        result.max_depth_reached = d
        grow = d < depth
        nxt_level: list[int] = []
        for key in level:
            h, p = key >> 32, key & low
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
        # `FastHb.canonical`, inlined.
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


__all__ = ["Action", "FastHb", "explore_hb"]
