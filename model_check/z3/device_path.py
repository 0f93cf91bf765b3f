"""z3 checks of the device-planned path: bounded model checking and an inductive invariant.

The encoding follows the host path's (model_check/z3/bmc.py, streams.py, induction.py):

- Each of k host calls is a symbolic choice of an operation of the device table, a consumer
  stream and arguments: `ids` as a set of in-range experts plus a flag for an id outside
  [-1, E) (the representative E) and one for -1 padding, the pass index, the expert of
  invalidate (E stands for out of range). Every sequence the explorers run is one of these.
- The data is exact and symbolic: the reference in host-call order (`ghost`, through the
  symbolic twin of the host path's plan_prepare in model_check/z3/host.py, on the pass's
  group) and the device buffers in host-call order by the table's functions (`shadow`: cache
  state, forward map, miss list and count, error flag, slot contents), as in
  streams/device_program.py. The data verdicts (P2's content, P3, P4, P5, P9) are drawn on them.
- The device is the happens-before summary with one followed access of each kind (resource,
  mode): the one-generic-element abstraction of z3_device, each with its mask of places and,
  for slots, the set of slots its operation touches (exact: a gather or a read is one
  operation). Every ordering verdict (P1, P2, P4, P10, and P9's "looked before the copy
  landed") is decided when the second access is enqueued, for every interleaving.
- Roles resolve per concrete (current stream, owner stream) pair; a step's `when` is then
  concrete too.

The induction proves the ordering properties for any number of calls: the abstract state is the
owner stream, whether a forward map is unread, and the followed accesses with their masks (the
slots abstract: every two slot sets may meet); the invariant comes from a template by Houdini's
algorithm, then is checked for every operation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import z3

from model_check.streams.device_program import SLOT0, conflict_prop, resource_name, unread_after
from model_check.table.properties import DEVICE_PROPERTIES as PROPERTIES
from model_check.table.properties import Violation
from model_check.table.reference import NO_SLOT, NO_STREAM, Bounds
from model_check.table.schema import BLOCKING_KINDS, DeviceOp, DeviceTable
from model_check.z3.bmc import (
    Call,
    Unrolled,
    chain,
    first_violated,
    reachable,
    shortest,
    z3_bool,
)
from model_check.z3.host import (
    Bool,
    Int,
    SymArgs,
    SymHost,
    _sym_plan_prepare,
    conj,
    count,
    disj,
    implies,
    initial_sym_host,
    ite,
    lru_order_equal,
    merge,
    neg,
    select,
    sym_plan_invalidate,
)
from model_check.z3.induction import Clause, InductionResult, find_invariant, state_eq, template
from model_check.z3.streams import shares

R_, W_ = 0, 1
# Followed kinds: (resource, mode); resource 4 stands for every slot, with a slot set.
KINDS: tuple[tuple[int, int], ...] = (
    (0, W_),
    (1, W_),
    (1, R_),
    (2, W_),
    (2, R_),
    (3, W_),
    (3, R_),
    (SLOT0, W_),
    (SLOT0, R_),
)
KIND_NAMES = ("S:W", "F:W", "F:R", "M:W", "M:R", "K:W", "K:R", "slot:W", "slot:R")


class Tracked(NamedTuple):
    alive: Bool
    mask: tuple[Bool, ...]
    slots: tuple[Bool, ...]  # for slot kinds in the bounded check; () = abstract (meets all)


DevState = tuple[Tracked, ...]


class Args(NamedTuple):
    req: tuple[Bool, ...]
    bad: Bool  # an id outside [-1, E) (the representative: E)
    pad: Bool  # a -1 entry
    p: Int  # pass index
    expert: Int  # invalidate's argument; E = out of range


class Data(NamedTuple):
    ghost: SymHost  # reference in host order; fwd / fwd_slot: the last pass's forward map
    gerr: Bool
    # The shadow's cache state (fwd / fwd_slot: the device forward map): a SymHost, or ()
    # while it is tied to the ghost (data_shape).
    cache: Any
    me: tuple[Int, ...]  # miss list experts
    ms: tuple[Int, ...]  # miss list slots
    n_miss: Int
    err: Bool
    slots: tuple[Int, ...]
    unread: Bool
    # The step's order as stored by its first pass (device_functions.select): each expert's
    # position, -1 when not stored; the ghost's, and the shadow's (() while tied).
    gstep: tuple[Int, ...]
    cstep: Any


class SymState(NamedTuple):
    owner: Int
    data: Data
    dev: DevState


def data_shape(table: DeviceTable) -> tuple[bool, bool]:
    """(tied, track_list). Tied: every function of the table leaves the cache state and the
    forward map as the reference does (device_functions.SAME_STATE_AS_REFERENCE, which the tests
    check on every reachable state), so the shadow's are the ghost's and are not kept twice.
    track_list: some gather can read a miss list entry another call wrote (else the gather is
    the copies of its call's plan)."""
    from model_check.streams.device_program import _dead_after_call
    from model_check.table.device_functions import SAME_STATE_AS_REFERENCE

    fns = {s.fn for op in table.operations for s in op.steps if s.kind in ("plan", "free_slot")}
    return fns <= SAME_STATE_AS_REFERENCE, not _dead_after_call(table)[1]


def initial_data(bounds: Bounds, table: DeviceTable) -> Data:
    cap = bounds.capacity
    host = initial_sym_host(bounds)
    tied, track = data_shape(table)
    listed: tuple[Int, ...] = (NO_SLOT,) * cap if track else ()
    return Data(
        host,
        False,
        () if tied else host,
        listed,
        listed,
        0,
        False,
        (NO_SLOT,) * cap,
        False,
        (NO_SLOT,) * bounds.num_experts,
        () if tied else (NO_SLOT,) * bounds.num_experts,
    )


def initial_dev(n_places: int, cap: int) -> DevState:
    return tuple(
        Tracked(False, (False,) * n_places, (False,) * cap if res == SLOT0 else ())
        for res, _ in KINDS
    )


def max_passes(bounds: Bounds) -> int:
    return -(-bounds.num_experts // bounds.capacity)


def pass_exists(args: Args, k: int, bounds: Bounds) -> Bool:
    """Pass k is among the passes of a step of these ids (device_functions.num_passes: by
    entries)."""
    if k == 0:
        return True
    numel = count(args.req) + ite(args.bad, 1, 0) + ite(args.pad, 1, 0)
    return numel > k * bounds.capacity


# ---------------------------------------------------------------- symbolic data (host order)

Found = dict[tuple[str, str], list[Bool]]


class Item(NamedTuple):
    """A role-level primitive: what the summary runs per (current, owner) pair."""

    tag: str  # record, wait, access, sync, report
    role: str
    event: int = -1
    accesses: tuple[tuple[int, int, tuple[Bool, ...] | None], ...] = ()
    cond: Bool = True
    owner_change: bool = False  # only when the call changes the owner
    kind: str = ""


# The accesses of each kind of step: (resource, mode). The slots a gather or a read touches
# (SLOT0) come from the data in the bounded check (`step_items`' slots; None: every slot set
# meets).
ACCESSES: dict[str, tuple[tuple[int, int], ...]] = {
    "plan": ((0, W_), (1, W_), (2, W_), (3, W_)),
    "gather": ((2, R_), (SLOT0, W_)),
    "consumer_read": ((1, R_), (SLOT0, R_)),
    "free_slot": ((0, W_),),
    "read_errors": ((3, R_),),
    "reset_errors": ((3, W_),),
}


def step_items(
    table: DeviceTable,
    op: DeviceOp,
    step: Any,
    cond: Bool = True,
    slots: tuple[Bool, ...] | None = None,
) -> list[Item]:
    """The role-level items of one step, under `cond` (a blocking step of a hot-path call
    first adds P8's); `slots`: the slots a gather or read touches."""
    kind, oc = step.kind, step.when == "owner_change"
    items: list[Item] = []
    if op.hot and kind in BLOCKING_KINDS:
        items.append(Item("p8", step.stream, cond=cond, owner_change=oc))
    if kind == "report":
        items.append(Item("report", "", cond=cond))
    elif kind == "host_sync":
        items.append(Item("sync", step.stream, cond=cond, owner_change=oc))
    elif kind in ("record_event", "wait_event"):
        tag = "record" if kind == "record_event" else "wait"
        e = table.events.index(step.event)
        items.append(Item(tag, step.stream, e, cond=cond, owner_change=oc))
    else:
        accesses = tuple((r, m, slots if r == SLOT0 else None) for r, m in ACCESSES[kind])
        items.append(
            Item("access", step.stream, accesses=accesses, cond=cond, owner_change=oc, kind=kind)
        )
    return items


class DataRun:
    """A call's data in host-call order, symbolically (device_program.DataInterp's twin)."""

    def __init__(
        self,
        table: DeviceTable,
        bounds: Bounds,
        op: DeviceOp,
        data: Data,
        args: Args,
        top: Int,
        acc: Bool,
    ) -> None:
        self.table, self.bounds, self.op, self.d, self.args, self.top = (
            table,
            bounds,
            op,
            data,
            args,
            top,
        )
        self.acc = acc
        self.found: Found = {}
        self.seen: dict[str, list[Bool]] = {}
        self.items: list[Item] = []
        self.crash: list[Bool] = []
        self.reading: Bool | None = None
        self.tied, self.track_list = data_shape(table)
        self.copies: tuple[tuple[Bool, ...], tuple[Int, ...], Bool] | None = None

    def flag(self, prop: str, detail: str, v: Bool) -> None:
        self.found.setdefault((prop, detail), []).append(conj(self.acc, v))

    def sight(self, tag: str, v: Bool) -> None:
        self.seen.setdefault(tag, []).append(conj(self.acc, v))

    def run(self) -> Data:
        op, bounds = self.op, self.bounds
        steps = list(op.steps)
        graph = [i for i, s in enumerate(steps) if s.graph]
        if graph:
            body = steps[graph[0] : graph[-1] + 1]
            for step in steps[: graph[0]]:
                self.step(step, 0, True)
            for k in range(max_passes(bounds)):
                exists = pass_exists(self.args, k, bounds)
                if k == 1:
                    self.sight("multi_pass_replay", exists)
                for step in body:
                    self.step(step, k, exists)
            for step in steps[graph[-1] + 1 :]:
                self.step(step, 0, True)
        else:
            for step in steps:
                self.step(step, self.args.p, True)
        self.d = self.d._replace(unread=unread_after(op, self.d.unread))
        return self.d

    def step(self, step: Any, p: Int, cond: Bool) -> None:
        """The step's data under `cond`, then its items."""
        kind = step.kind
        slots = None
        if kind == "report":
            self.report(cond)
        elif kind == "plan":
            self.plan(step.fn, p, cond)
        elif kind == "gather":
            slots = self.gather(step.fn, cond)
        elif kind == "consumer_read":
            slots = self.read(cond)
        elif kind == "free_slot":
            self.free(cond)
        elif kind == "read_errors":
            self.reading = (
                self.d.err if self.reading is None else ite(cond, self.d.err, self.reading)
            )
        elif kind == "reset_errors":
            self.d = self.d._replace(err=ite(cond, False, self.d.err))
        self.items += step_items(self.table, self.op, step, cond, slots)

    def cache(self) -> SymHost:
        """The shadow's cache state and forward map (the ghost's while they are tied)."""
        return self.d.ghost if self.tied else self.d.cache

    def order(
        self, h: SymHost, stored: tuple[Int, ...], p: Int, hits_first: bool
    ) -> tuple[tuple[Bool, ...], tuple[Bool, ...], tuple[Int, ...]]:
        """device_functions.select on the state `h` with the stored order `stored`: (the experts the
        pass exposes, the step's experts it protects, the order stored after it)."""
        n, cap, req = self.bounds.num_experts, self.bounds.capacity, self.args.req
        first = p == 0
        hit = [conj(req[e], h.slot[e] != NO_SLOT) if hits_first else False for e in range(n)]
        rest = [conj(req[e], neg(hit[e])) for e in range(n)]
        n_hit = count(hit)
        fresh = [ite(hit[e], count(hit[:e]), n_hit + count(rest[:e])) for e in range(n)]
        used = [ite(first, ite(req[e], fresh[e], NO_SLOT), stored[e]) for e in range(n)]
        long = count(req) > cap
        new = tuple(
            ite(first, ite(conj(long, req[e]), fresh[e], NO_SLOT), stored[e]) for e in range(n)
        )
        sel = tuple(conj(req[e], used[e] >= p * cap, used[e] < (p + 1) * cap) for e in range(n))
        kept = disj(*(x >= 0 for x in new))
        step = tuple(ite(kept, conj(new[e] >= 0, req[e]), sel[e]) for e in range(n))
        return sel, step, new

    def plan(self, fn: str, p: Int, cond: Bool) -> None:
        bounds, args, d = self.bounds, self.args, self.d
        n, cap = bounds.num_experts, bounds.capacity
        sel, gstep, gnew = self.order(d.ghost, d.gstep, p, True)
        error = conj(args.bad, p == 0)
        top = self.top + p * n  # above every rank given before this pass
        ghost = _sym_plan_prepare(d.ghost, SymArgs(sel, False, 0), bounds, top, step=gstep)
        self.crash.append(conj(cond, ghost.crash))
        self.sight("eviction", conj(cond, disj(*ghost.victim)))
        self.sight("error_counted", conj(cond, error))
        cnew: Any = d.cstep
        if self.tied:
            eff = ghost
            step = gstep
        else:
            # The reference's choice on the shadow's state (P3 and P5 below), and the shadow's.
            sel, step, _ = self.order(d.cache, d.cstep, p, True)
            by_id = ("plan_pass_hits_not_first", "plan_pass_protects_pass_only")
            csel, cstep, cnew = self.order(d.cache, d.cstep, p, fn not in by_id)
            eff = _sym_plan_prepare(
                d.cache,
                SymArgs(csel, False, 0),
                bounds,
                top,
                protect_requested=fn != "plan_pass_unprotected_victim",
                step=None
                if fn.startswith("plan_pass_protects_pass_only")
                or fn == "plan_pass_unprotected_victim"
                else cstep,
            )
            self.crash.append(conj(cond, eff.crash))
        new = eff.host
        if fn == "plan_pass_stale_forward":
            old = self.cache()
            new = new._replace(
                fwd=tuple(disj(sel[e], old.fwd[e]) for e in range(n)),
                fwd_slot=tuple(ite(sel[e], new.fwd_slot[e], old.fwd_slot[e]) for e in range(n)),
            )
        if fn == "plan_pass_unchecked_ids":
            n_req = count(args.req)
            self.flag(
                "P9_device_errors_reported",
                "a plan used an id outside [0, E) as an index",
                conj(cond, args.bad, n_req >= p * cap, n_req < (p + 1) * cap),
            )
        err = error if fn == "plan_pass_resets_errors" else disj(d.err, error)
        # P5 and P3 on the pass's result (device_functions.plan_verdict).
        self.flag(
            "P5_victim_protection",
            "a pass evicts an expert it exposes",
            conj(cond, disj(*(conj(eff.victim[e], sel[e]) for e in range(n)))),
        )
        self.flag(
            "P5_victim_protection",
            "a pass evicts an expert its step requests while one outside the step stays",
            conj(
                cond,
                disj(*(conj(eff.victim[e], step[e]) for e in range(n))),
                disj(*(conj(new.inlru[e], neg(step[e])) for e in range(n))),
            ),
        )
        self.flag(
            "P3_forward_map_exact",
            "the forward map does not expose exactly the pass's group",
            conj(cond, disj(*(new.fwd[e] != sel[e] for e in range(n)))),
        )
        dup = [
            conj(new.fwd[x], new.fwd[y], new.fwd_slot[x] == new.fwd_slot[y])
            for x in range(n)
            for y in range(x + 1, n)
        ]
        self.flag(
            "P3_forward_map_exact",
            "two experts of the forward map share a slot",
            conj(cond, disj(*dup)),
        )
        self.flag(
            "P3_forward_map_exact",
            "the forward map and the resident map disagree",
            conj(cond, disj(*(conj(new.fwd[e], new.fwd_slot[e] != new.slot[e]) for e in range(n)))),
        )
        self.copies = (eff.miss, eff.dest, cond)
        n_miss = count(eff.miss)
        me, ms, cnt = d.me, d.ms, d.n_miss
        if self.track_list:
            # The miss list: the k-th miss (in id order) at entry k; entries past the count stay.
            me_l, ms_l = list(d.me), list(d.ms)
            for k in range(cap):
                ex: Int = NO_SLOT
                sl: Int = NO_SLOT
                for e in reversed(range(n)):
                    at_k = conj(eff.miss[e], count(eff.miss[:e]) == k)
                    ex = ite(at_k, e, ex)
                    sl = ite(at_k, eff.dest[e], sl)
                me_l[k] = ite(conj(cond, k < n_miss), ex, me_l[k])
                ms_l[k] = ite(conj(cond, k < n_miss), sl, ms_l[k])
            me, ms, cnt = tuple(me_l), tuple(ms_l), ite(cond, n_miss, d.n_miss)
        self.d = d._replace(
            ghost=_mh(cond, ghost.host, d.ghost),
            gerr=ite(cond, disj(d.gerr, error), d.gerr),
            cache=d.cache if self.tied else _mh(cond, new, d.cache),
            gstep=tuple(merge(cond, x, y) for x, y in zip(gnew, d.gstep, strict=True)),
            cstep=d.cstep
            if self.tied
            else tuple(merge(cond, x, y) for x, y in zip(cnew, d.cstep, strict=True)),
            me=me,
            ms=ms,
            n_miss=cnt,
            err=ite(cond, err, d.err),
        )

    def gather(self, fn: str, cond: Bool) -> tuple[Bool, ...]:
        d, cap, n = self.d, self.bounds.capacity, self.bounds.num_experts
        slots = list(d.slots)
        writes: list[Bool] = [False] * cap
        if not self.track_list:
            # Every gather follows its call's plan and reads only the first `count` entries:
            # the plan's copies, in id order (device_program._dead_after_call).
            assert self.copies is not None
            miss, dest, planned = self.copies
            for e in range(n):
                for s in range(cap):
                    hit = conj(cond, planned, miss[e], dest[e] == s)
                    slots[s] = ite(hit, e, slots[s])
                    writes[s] = disj(writes[s], hit)
        else:
            for k in range(cap):
                active = d.me[k] >= 0 if fn == "gather_whole_list" else k < d.n_miss
                active = conj(cond, active)
                for s in range(cap):
                    hit = conj(active, d.ms[k] == s)
                    slots[s] = ite(hit, d.me[k], slots[s])
                    writes[s] = disj(writes[s], hit)
        self.d = d._replace(slots=tuple(slots))
        return tuple(writes)

    def read(self, cond: Bool) -> tuple[Bool, ...]:
        d, n, cap = self.d, self.bounds.num_experts, self.bounds.capacity
        g, c = d.ghost, self.cache()
        differ = disj(
            *(
                disj(g.fwd[e] != c.fwd[e], conj(c.fwd[e], g.fwd_slot[e] != c.fwd_slot[e]))
                for e in range(n)
            )
        )
        self.flag(
            "P2_no_stale_read",
            "a read finds another forward map than its pass's",
            conj(cond, differ),
        )
        stale = disj(
            *(conj(c.fwd[e], select(c.fwd_slot[e], d.slots, NO_SLOT) != e) for e in range(n))
        )
        self.flag(
            "P2_no_stale_read",
            "a read finds a slot holding another expert than its map names",
            conj(cond, stale),
        )
        return tuple(
            conj(cond, disj(*(conj(c.fwd[e], c.fwd_slot[e] == s) for e in range(n))))
            for s in range(cap)
        )

    def free(self, cond: Bool) -> None:
        d, bounds = self.d, self.bounds
        sargs = SymArgs((False,) * bounds.num_experts, False, self.args.expert)
        ghost = sym_plan_invalidate(d.ghost, sargs, bounds, 0)
        self.sight("invalidate_resident", conj(cond, ghost.changed))
        cache = d.cache
        if not self.tied:
            cache = _mh(cond, sym_plan_invalidate(d.cache, sargs, bounds, 0).host, d.cache)
        self.d = d._replace(ghost=_mh(cond, ghost.host, d.ghost), cache=cache)

    def report(self, cond: Bool) -> None:
        d = self.d
        if self.reading is None:
            self.flag("P9_device_errors_reported", "the host reports counters it never read", cond)
            reading: Bool = d.err
        else:
            reading = self.reading
        self.flag(
            "P9_device_errors_reported",
            "check_errors reports another error state than the passes counted",
            conj(cond, reading != d.gerr),
        )
        self.sight("error_reported", conj(cond, d.gerr))
        self.d = d._replace(gerr=ite(cond, False, d.gerr))


def _mh(c: Bool, a: SymHost, b: SymHost) -> SymHost:
    return SymHost(*(merge(c, x, y) for x, y in zip(a, b, strict=True)))


def wellformed(d: Data, bounds: Bounds, top: int) -> Bool:
    """What every reachable state satisfies (check() proves it step by step before assuming
    it): the ghost's and the shadow's maps are injective into the slots and agree with their
    LRU membership, LRU ranks are distinct and below the next call's, mapped slots hold their
    experts, and an unread forward map names slots holding its experts."""
    n, cap = bounds.num_experts, bounds.capacity
    parts: list[Bool] = []
    hosts = [d.ghost] if d.cache == () else [d.ghost, d.cache]
    for h in hosts:
        for e in range(n):
            parts.append(conj(h.slot[e] >= NO_SLOT, h.slot[e] < cap))
            parts.append(h.inlru[e] == (h.slot[e] != NO_SLOT))
            parts.append(implies(h.inlru[e], h.rank[e] < top))
            for f in range(e + 1, n):
                parts.append(implies(h.slot[e] != NO_SLOT, h.slot[e] != h.slot[f]))
                parts.append(implies(conj(h.inlru[e], h.inlru[f]), h.rank[e] != h.rank[f]))
    for order in [d.gstep] if d.cstep == () else [d.gstep, d.cstep]:
        for e in range(n):
            parts.append(conj(order[e] >= NO_SLOT, order[e] < n))
            for f in range(e + 1, n):
                parts.append(implies(order[e] >= 0, order[e] != order[f]))
    c = d.ghost if d.cache == () else d.cache
    for e in range(n):
        parts.append(implies(c.slot[e] != NO_SLOT, select(c.slot[e], d.slots, NO_SLOT) == e))
        parts.append(
            implies(
                conj(d.unread, c.fwd[e]),
                conj(c.fwd_slot[e] >= 0, select(c.fwd_slot[e], d.slots, NO_SLOT) == e),
            )
        )
    return conj(*parts)


def converged_terms(d: Data, bounds: Bounds) -> Bool:
    n = bounds.num_experts
    g = d.ghost
    same: Bool = True
    if d.cache != ():
        c = d.cache
        same = conj(*(g.slot[e] == c.slot[e] for e in range(n)), lru_order_equal(g, c))
    mapped = conj(
        *(implies(g.slot[e] != NO_SLOT, select(g.slot[e], d.slots, NO_SLOT) == e) for e in range(n))
    )
    return conj(same, mapped)


# ---------------------------------------------------------------- the summary, per stream pair


class Summary:
    """The followed accesses through one call's items, for one (current, owner) pair."""

    def __init__(
        self,
        dev: DevState,
        n_streams: int,
        n_events: int,
        cur: int,
        owner: int,
        prefix: str,
    ) -> None:
        self.dev = list(dev)
        self.n_streams = n_streams
        self.n_places = n_streams + n_events
        self.cur, self.owner = cur, owner
        self.prefix = prefix
        self.counter = 0
        self.found: Found = {}
        self.seen: dict[str, list[Bool]] = {}
        self.look_alive: Bool = False
        self.look_mask: tuple[Bool, ...] = (False,) * self.n_places

    def role(self, role: str) -> int:
        if role == "capture":
            return self.n_streams - 1
        if role == "owner" and self.owner != NO_STREAM:
            return self.owner
        return self.cur

    @property
    def owner_change(self) -> bool:
        return self.owner != NO_STREAM and self.owner != self.cur

    def fresh(self, tag: str) -> Bool:
        self.counter += 1
        return z3.Bool(f"{self.prefix}_{tag}{self.counter}")

    def flag(self, prop: str, detail: str, v: Bool) -> None:
        self.found.setdefault((prop, detail), []).append(v)

    def _masks(self, fn: Any, cond: Bool) -> None:
        for i, t in enumerate(self.dev):
            self.dev[i] = t._replace(mask=merge(cond, fn(t.mask), t.mask))
        self.look_mask = merge(cond, fn(self.look_mask), self.look_mask)

    def run(self, items: Sequence[Item]) -> None:
        for item in items:
            if item.owner_change and not self.owner_change:
                continue
            c = item.cond
            if item.tag == "p8":
                self.flag(
                    "P8_hot_path_never_blocks",
                    "a hot-path call blocks the host or reads device state",
                    c,
                )
            elif item.tag == "record":
                x, e = self.role(item.role), self.n_streams + item.event
                self._masks(
                    lambda m, x=x, e=e: tuple(m[x] if i == e else b for i, b in enumerate(m)), c
                )
            elif item.tag == "wait":
                y, e = self.role(item.role), self.n_streams + item.event
                self._masks(
                    lambda m, y=y, e=e: tuple(
                        disj(b, m[e]) if i == y else b for i, b in enumerate(m)
                    ),
                    c,
                )
            elif item.tag == "sync":
                streams = range(self.n_streams) if item.role == "all" else [self.role(item.role)]
                for i, t in enumerate(self.dev):
                    held = disj(*(t.mask[s] for s in streams))
                    self.dev[i] = t._replace(alive=ite(c, conj(t.alive, neg(held)), t.alive))
                held = disj(*(self.look_mask[s] for s in streams))
                self.look_alive = ite(c, conj(self.look_alive, neg(held)), self.look_alive)
            elif item.tag == "report":
                self.flag(
                    "P9_device_errors_reported",
                    "the host read the counters before their copy landed",
                    conj(c, self.look_alive),
                )
                self.look_alive = ite(c, False, self.look_alive)
            elif item.tag == "access":
                self.access(item, self.role(item.role))

    def access(self, item: Item, x: int) -> None:
        c = item.cond
        here = tuple(i == x for i in range(self.n_places))
        others = [s for s in range(self.n_streams) if s != x]
        for res, mode, slots in item.accesses:
            for k, (kres, kmode) in enumerate(KINDS):
                if kres != res:
                    continue
                prop = conflict_prop(res, kmode, mode)
                if prop is None:
                    continue
                t = self.dev[k]
                meet = shares(t.slots, slots) if res == SLOT0 else True
                self.flag(
                    prop,
                    f"{item.kind} on stream {x} is not ordered after a pending "
                    f"{'write' if kmode == W_ else 'read'} of "
                    f"{'a slot it touches' if res == SLOT0 else 'the ' + resource_name(res)}",
                    conj(c, t.alive, neg(t.mask[x]), meet),
                )
                if res in (0, SLOT0):
                    elsewhere = conj(
                        c, t.alive, t.mask[x], meet, disj(*(t.mask[s] for s in others))
                    )
                    tag = (
                        "state_access_pending_elsewhere"
                        if res == 0
                        else "slot_access_pending_elsewhere"
                    )
                    self.seen.setdefault(tag, []).append(elsewhere)
        for res, mode, slots in item.accesses:
            k = KINDS.index((res, mode))
            t = self.dev[k]
            pick = conj(c, self.fresh(f"born{k}_"))
            new_slots = (
                t.slots
                if slots is None or not t.slots
                else tuple(ite(pick, a, b) for a, b in zip(slots, t.slots, strict=True))
            )
            self.dev[k] = Tracked(
                disj(pick, t.alive),
                tuple(ite(pick, a, b) for a, b in zip(here, t.mask, strict=True)),
                new_slots,
            )
        if item.kind == "read_errors":
            self.look_alive = ite(c, True, self.look_alive)
            self.look_mask = merge(c, here, self.look_mask)


# ---------------------------------------------------------------- bounded model checking


Calls = list[Call]


class StepInfo(NamedTuple):
    op: Int
    cur: Int
    args: Args
    accepted: Bool
    found: dict[tuple[str, str], Bool]
    seen: dict[str, Bool]


class Unrolling(Unrolled):
    def __init__(self, table: DeviceTable, bounds: Bounds, depth: int) -> None:
        self.table, self.bounds, self.depth = table, bounds, depth
        self.n_streams = len(table.consumer_streams) + 1
        self.n_places = self.n_streams + len(table.events)
        self.solver = z3.Solver()
        dev = initial_dev(self.n_places, bounds.capacity)
        self._unroll(SymState(NO_STREAM, initial_data(bounds, table), dev))

    def top(self, t: int) -> int:
        """Above every LRU rank given by the first t calls."""
        return self.bounds.num_experts * (max_passes(self.bounds) + 1) * (t + 1)

    def inputs(self, t: int) -> tuple[Int, Int, Args]:
        n = self.bounds.num_experts
        args = Args(
            tuple(z3.Bool(f"t{t}_req{e}") for e in range(n)),
            z3.Bool(f"t{t}_bad"),
            z3.Bool(f"t{t}_pad"),
            z3.Int(f"t{t}_pass"),
            z3.Int(f"t{t}_expert"),
        )
        op, cur = z3.Int(f"t{t}_op"), z3.Int(f"t{t}_cur")
        numel = count(args.req) + ite(args.bad, 1, 0) + ite(args.pad, 1, 0)
        self.solver.add(
            op >= 0,
            op < len(self.table.operations),
            cur >= 0,
            cur < len(self.table.consumer_streams),
            args.p >= 0,
            args.p <= max_passes(self.bounds),
            args.expert >= 0,
            args.expert <= n,
            numel >= 1,
        )
        return op, cur, args

    def guard(self, op: DeviceOp, d: Data, args: Args) -> Bool:
        if op.guard == "valid_pass":
            return disj(
                *(
                    conj(args.p == k, pass_exists(args, k, self.bounds))
                    for k in range(max_passes(self.bounds))
                )
            )
        if op.guard == "valid_invalidate":
            return args.expert < self.bounds.num_experts
        if op.guard == "forward_unread":
            return d.unread
        return True

    def step(self, t: int, st: SymState) -> tuple[SymState, StepInfo]:
        op_sel, cur, args = self.inputs(t)
        top = self.top(t)
        results: list[tuple[Bool, SymState]] = []
        found: dict[tuple[str, str], list[Bool]] = {}
        seen: dict[str, list[Bool]] = {}
        accepted: list[Bool] = []
        streams = range(len(self.table.consumer_streams))
        n_events = len(self.table.events)
        for i, op in enumerate(self.table.operations):
            sel = op_sel == i
            ok = self.guard(op, st.data, args)
            acc = conj(sel, ok)
            accepted.append(acc)
            seen.setdefault(f"rejected_{op.name}", []).append(conj(sel, neg(ok)))
            run = DataRun(self.table, self.bounds, op, st.data, args, top, acc)
            data = run.run()
            self.solver.add(*(z3_bool(implies(acc, neg(c))) for c in run.crash))
            for key, vs in run.found.items():
                found.setdefault(key, []).extend(vs)
            for tag, vs in run.seen.items():
                seen.setdefault(tag, []).extend(vs)
            results.append((conj(sel, neg(ok)), st))
            for c in streams:
                for o in (NO_STREAM, *streams):
                    branch = conj(acc, cur == c, st.owner == o)
                    name = f"t{t}_{op.name}_{c}_{o}"
                    summary = Summary(st.dev, self.n_streams, n_events, c, o, name)
                    summary.run(run.items)
                    for key, vs in summary.found.items():
                        found.setdefault(key, []).append(conj(branch, disj(*vs)))
                    for tag, vs in summary.seen.items():
                        seen.setdefault(tag, []).append(conj(branch, disj(*vs)))
                    if summary.owner_change and op.hot:
                        seen.setdefault("owner_change", []).append(branch)
                        if op.name == "replay":
                            seen.setdefault("replay_on_other_stream", []).append(branch)
                    dev = tuple(summary.dev)
                    results.append((branch, SymState(op.owner_after(o, c), data, dev)))
            # P4 once drained, after every accepted call.
            found.setdefault(
                ("P4_map_convergence", "once drained, the device state is not the reference's"), []
            ).append(conj(acc, neg(converged_terms(data, self.bounds))))
        computed: SymState = chain(results[:-1], results[-1][1])
        nxt = self._fresh_state(computed, f"s{t + 1}")
        info = StepInfo(
            op_sel,
            cur,
            args,
            disj(*accepted),
            {k: disj(*v) for k, v in found.items()},
            {k: disj(*v) for k, v in seen.items()},
        )
        return nxt, info

    def _calls_at(self, ev: Any, info: StepInfo) -> list[Call]:
        """The step as a host call (operation, arguments as the explicit model takes them,
        stream)."""
        op = self.table.operations[ev(info.op).as_long()]
        args: list[object] = []
        if "ids" in op.args:
            ids = [e for e, r in enumerate(info.args.req) if z3.is_true(ev(r))]
            ids += [self.bounds.num_experts] if z3.is_true(ev(info.args.bad)) else []
            ids += [-1] if z3.is_true(ev(info.args.pad)) else []
            args.append(tuple(ids))
        if "pass" in op.args:
            args.append(ev(info.args.p).as_long())
        if "expert" in op.args:
            args.append(ev(info.args.expert).as_long())
        return [(op.name, tuple(args), ev(info.cur).as_long())]

    def _call_text(self, ev: Any, info: StepInfo) -> str:
        [(name, args, cur)] = self._calls_at(ev, info)
        return f"{name}({', '.join(str(a) for a in args)}) on s{cur}"


# ---------------------------------------------------------------- induction


ORDERING = (
    "P1_no_overwrite_under_reader",
    "P2_no_stale_read",
    "P4_map_convergence",
    "P8_hot_path_never_blocks",
    "P9_device_errors_reported",
    "P10_ordered_device_state",
)


class AbsState(NamedTuple):
    owner: Int
    unread: Bool
    dev: DevState

    @property
    def prepared(self) -> Bool:
        """The host flag the template's host clause reads (`induction.Clause`)."""
        return self.unread


def _abs_vars(n_places: int, prefix: str) -> AbsState:
    dev = tuple(
        Tracked(
            z3.Bool(f"{prefix}_{k}_alive"),
            tuple(z3.Bool(f"{prefix}_{k}_m{p}") for p in range(n_places)),
            (),
        )
        for k in range(len(KINDS))
    )
    return AbsState(z3.Int(f"{prefix}_owner"), z3.Bool(f"{prefix}_unread"), dev)


def prove(table: DeviceTable, bounds: Bounds) -> InductionResult:
    """The ordering properties for any number of calls: one transition from an abstract state
    (the owner, whether a forward map is unread, the followed accesses), the template's
    clauses (`induction.template`, with the host clause "a forward map is unread => there is
    an owner") through the induction of the host path (`induction.find_invariant`)."""
    start = time.perf_counter()
    n_streams = len(table.consumer_streams) + 1
    n_places = n_streams + len(table.events)
    consumers = len(table.consumer_streams)
    pre, post = _abs_vars(n_places, "pre"), _abs_vars(n_places, "post")
    op_sel, cur = z3.Int("op"), z3.Int("cur")
    base = z3.Solver()
    base.add(op_sel >= 0, op_sel < len(table.operations), cur >= 0, cur < consumers)
    base.add(pre.owner >= NO_STREAM, pre.owner < consumers)
    found: dict[str, list[Bool]] = {}
    eqs: list[Bool] = []
    for i, op in enumerate(table.operations):
        sel = op_sel == i
        ok: Bool = (
            pre.unread
            if op.guard == "forward_unread"
            else (True if op.guard == "always" else z3.Bool(f"ok{i}"))
        )
        eqs.append(implies(conj(sel, neg(ok)), state_eq(post, pre)))
        unread = unread_after(op, pre.unread)
        # The data abstract: every slot set meets. A graph's body is the same accesses
        # repeated: once covers every verdict of the summary (a repeated access on the same
        # stream is ordered after the first).
        items = [item for step in op.steps for item in step_items(table, op, step)]
        for c in range(consumers):
            for o in (NO_STREAM, *range(consumers)):
                branch = conj(sel, ok, cur == c, pre.owner == o)
                name = f"ind_{i}_{c}_{o}"
                summary = Summary(pre.dev, n_streams, len(table.events), c, o, name)
                summary.run(items)
                for (prop, _), vs in summary.found.items():
                    found.setdefault(prop, []).append(conj(branch, disj(*vs)))
                after = AbsState(op.owner_after(o, c), unread, tuple(summary.dev))
                eqs.append(implies(branch, state_eq(post, after)))
    base.add(z3_bool(conj(*eqs)))
    init = AbsState(NO_STREAM, False, initial_dev(n_places, 0))
    names = [f"s{i}" for i in range(consumers)] + ["capture"]
    names += [f"event{e}" for e in range(n_places - n_streams)]
    cands = [Clause("a forward map is unread => there is an owner", -1, (), 1)]
    for _, _, clauses in template(KIND_NAMES, names, ("owned", "there is an owner")):
        cands += clauses

    def describe(m: z3.ModelRef, prop: str) -> str:
        name = table.operations[m.eval(op_sel, True).as_long()].name
        return f"{prop}: then {name} on s{m.eval(cur, True)}"

    bad = {p: disj(*vs) for p, vs in found.items()}
    ops = (op_sel, [op.name for op in table.operations])
    states = (init, pre, post, consumers)
    return find_invariant(base, cands, states, bad, ORDERING, describe, ops, start)


# ---------------------------------------------------------------- the report


@dataclass
class Z3Report:
    bounds: Bounds
    depth: int
    verdicts: dict[str, str]  # property -> holds / violated / unknown / skipped
    counterexamples: dict[str, str]
    reached: dict[str, bool]
    induction: InductionResult | None
    seconds: float
    decides: tuple[str, ...] = tuple(p for p in PROPERTIES if p != "P7_no_deadlock")
    notes: list[str] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)
    # property -> its counterexample as host calls, up to the violating step
    calls: dict[str, Calls] = field(default_factory=dict)

    @property
    def violation(self) -> Violation | None:
        for prop in self.decides:
            if self.verdicts.get(prop) == "violated":
                return Violation(prop, self.counterexamples.get(prop, ""))
        return None

    @property
    def vacuous(self) -> list[str]:
        return sorted(t for t in REACHABILITY if not self.reached.get(t, False))

    @property
    def ok(self) -> bool:
        unknown = any(v == "unknown" for v in self.verdicts.values())
        proved = self.induction is None or self.induction.ok
        return self.violation is None and not unknown and proved


REACHABILITY: dict[str, str] = {
    "eviction": "a pass evicts a resident expert",
    "owner_change": "a hot-path call is made on another stream than the owner",
    "replay_on_other_stream": "a graph is replayed on another stream than the owner",
    "multi_pass_replay": "a replay runs more than one pass",
    "invalidate_resident": "invalidate frees a resident expert",
    "error_counted": "a pass counts an error",
    "error_reported": "check_errors reports an error",
    "state_access_pending_elsewhere": "a cache-state access is enqueued while one from another "
    "stream is pending, ordered by the handoff",
    "slot_access_pending_elsewhere": "a slot access is enqueued while a conflicting one from "
    "another stream is pending, ordered by the handoff",
    "rejected_device_prepare": "a prepare with a bad pass index is rejected",
}


def check(
    table: DeviceTable,
    bounds: Bounds,
    depth: int,
    *,
    induction: bool = True,
    reachability: bool = True,
    stop_at_first: bool = False,
) -> Z3Report:
    start = time.perf_counter()
    unrolling = Unrolling(table, bounds, depth)
    solver = unrolling.solver
    props = [p for p in PROPERTIES if p != "P7_no_deadlock"]
    verdicts: dict[str, str] = {}
    cexs: dict[str, str] = {}
    calls: dict[str, Calls] = {}
    timing: dict[str, float] = {"build": time.perf_counter() - start}
    if stop_at_first:
        found = first_violated(solver, unrolling, props, lambda p: p)
        if isinstance(found, tuple):
            prop, model = found
            model = shortest(solver, unrolling, prop, model, "short_{prop}_{k}")
            verdicts = {p: "skipped" for p in props}
            verdicts[prop] = "violated"
            cexs[prop], n = unrolling.describe(model, prop)
            calls[prop] = unrolling.calls(model, n)
        else:
            verdicts = {p: found for p in props}
    else:
        # Step by step: the properties at step k, each proved under the facts proved of the
        # steps before (no violation there, and the state lemmas of `wellformed`), then those
        # facts added. Sound, since each fact added was proved of every run to that step; it
        # keeps every query local to one step.
        for prop in props:
            verdicts[prop] = "holds"
        lemmas = 0
        for k, info in enumerate(unrolling.steps):
            # The state lemmas first: they make the data verdicts of this step local.
            lemma = wellformed(unrolling.states[k + 1].data, bounds, unrolling.top(k + 1))
            goal = z3.Bool(f"lemma_{k}")
            solver.add(z3.Implies(goal, z3_bool(neg(lemma))))
            t0 = time.perf_counter()
            if solver.check(goal) == z3.unsat:
                solver.add(z3_bool(lemma))
                lemmas += 1
            timing[f"lemma@{k}"] = time.perf_counter() - t0
            at: dict[str, Bool] = {}
            for prop in props:
                at[prop] = disj(*(v for (p, _), v in info.found.items() if p == prop))
            for prop in [p for p in props if verdicts[p] == "holds"]:
                goal = z3.Bool(f"goal_{prop}_{k}")
                solver.add(z3.Implies(goal, z3_bool(at[prop])))
                t0 = time.perf_counter()
                result = solver.check(goal)
                timing[f"{prop[:3]}@{k}"] = time.perf_counter() - t0
                if result == z3.sat:
                    verdicts[prop] = "violated"
                    model = solver.model()
                    cexs[prop], n = unrolling.describe(model, prop)
                    calls[prop] = unrolling.calls(model, n)
                elif result != z3.unsat:
                    verdicts[prop] = "unknown"
            solver.add(z3_bool(neg(disj(*(at[p] for p in props if verdicts[p] == "holds")))))
    reached = reachable(solver, unrolling, REACHABILITY, timing) if reachability else {}
    ind = prove(table, bounds) if induction else None
    report = Z3Report(bounds, depth, verdicts, cexs, reached, ind, time.perf_counter() - start)
    report.timing = timing
    report.calls = calls
    if not stop_at_first:
        report.notes.append(f"state lemmas proved and assumed at {lemmas} of {depth} steps")
    return report


__all__ = ["REACHABILITY", "Calls", "InductionResult", "Unrolling", "Z3Report", "check", "prove"]
_ = Any
