"""Bounded model checking of the table with z3: k host calls from the initial state.

Each call is a symbolic choice of an operation of the table, the stream it is made on and its
arguments (`ids` as a set of in-range experts plus a flag for an out-of-range or repeated
entry, `expert` in 0..num_experts where num_experts is out of range). Everything the call does
is read from the table: the before_guard, guard and effect names select the symbolic reference
functions (`z3.host`), set_owner updates the owner, and the steps run through the shared
interpreter on the symbolic happens-before summary (`z3.streams`), once per (current stream,
owner stream) pair. The host state is exact (symbolic LRU ranks, slot map, forward map); the
device summary follows one generic operation of each kind (see `z3.streams`).

The bound: every sequence of at most k steps, a step being one host call of any operation
(read and synchronize included, any number of reads per forward map) on any consumer stream,
where an accepted prepare may be followed by the consumer's read on the same stream within
the same step, as in the explorer's happens-before model (so k is the explorer's depth and
covers every sequence it explores, and more). Arguments: every one the explorer uses and more
(any set of experts with a bad entry for a rejected prepare); a valid prepare names at least
one expert, as in the explorer. Each ordering verdict covers every device interleaving at
once, as in `streams.hb`. A counterexample is a sequence of host calls; `z3.check.replay` runs it
on the other device models to confirm it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import z3

from model_check.table.reference import NO_SLOT, Bounds
from model_check.table.schema import Table
from model_check.z3.host import (
    SYM_EFFECTS,
    SYM_GUARDS,
    SYM_PRE_GUARD,
    Bool,
    Int,
    SymArgs,
    SymHost,
    conj,
    count,
    disj,
    host_equal,
    implies,
    initial_sym_host,
    ite,
    neg,
    select,
    sym_args_text,
)
from model_check.z3.streams import (
    P3,
    P4,
    P5,
    P9,
    DataCtx,
    DevState,
    Facts,
    Layout,
    flag_orders,
    initial_dev,
    interpret,
)

DATA_P3_SET = "the forward map does not expose exactly the requested experts"
DATA_P3_SLOTS = "two experts of the forward map share a slot"
DATA_P3_AGREE = "the forward map and the resident map put an expert in different slots"
DATA_P4_MAP = "once drained, the device resident map differs from the host mirror"
DATA_P4_SLOT = "once drained, a mapped slot was last filled with another expert"
DATA_P5 = "a prepare evicts an expert it requested"
DATA_P9 = "a rejected call changed the host state"


class SymState(NamedTuple):
    host: SymHost
    dev: DevState
    last_copy: tuple[Int, ...]  # per slot, the expert of the last copy enqueued into it
    last_map: tuple[Int, ...]  # the content of the last resident-map upload enqueued


class Inputs(NamedTuple):
    op: Int
    cur: Int
    args: SymArgs


class StepInfo(NamedTuple):
    inputs: Inputs
    accepted: Bool
    then_read: Bool  # the accepted prepare is followed by the consumer's read
    found: dict[tuple[str, str], Bool]
    seen: dict[str, Bool]


def initial_state(bounds: Bounds, layout: Layout) -> SymState:
    return SymState(
        initial_sym_host(bounds),
        initial_dev(layout, bounds.capacity),
        (NO_SLOT,) * bounds.capacity,
        (NO_SLOT,) * bounds.num_experts,
    )


def leaves(x: Any) -> list[Any]:
    if isinstance(x, tuple):
        out: list[Any] = []
        for y in x:
            out.extend(leaves(y))
        return out
    return [x]


def rebuild(template: Any, values: list[Any]) -> Any:
    """A structure shaped like template with its leaves taken from values, in order."""
    it = iter(values)

    def go(t: Any) -> Any:
        if isinstance(t, tuple):
            items = [go(y) for y in t]
            return type(t)(*items) if hasattr(t, "_fields") else tuple(items)
        return next(it)

    return go(template)


def is_bool_leaf(x: Any) -> bool:
    return isinstance(x, bool) or (isinstance(x, z3.ExprRef) and z3.is_bool(x))


def fresh_like(template: Any, prefix: str) -> Any:
    leaf = leaves(template)
    made = [
        z3.Bool(f"{prefix}_{i}") if is_bool_leaf(v) else z3.Int(f"{prefix}_{i}")
        for i, v in enumerate(leaf)
    ]
    return rebuild(template, made)


def chain(branches: Sequence[tuple[Bool, Any]], default: Any) -> Any:
    """The value of the first branch whose condition holds (nested ite on every leaf)."""
    out_leaves = leaves(default)
    for cond, value in reversed(branches):
        out_leaves = [ite(cond, a, b) for a, b in zip(leaves(value), out_leaves, strict=True)]
    return rebuild(default, out_leaves)


def drained_ok(state: SymState, bounds: Bounds) -> dict[str, Bool]:
    mirror = state.host.slot
    return {
        DATA_P4_MAP: conj(*(state.last_map[e] == mirror[e] for e in range(bounds.num_experts))),
        DATA_P4_SLOT: conj(
            *(
                implies(mirror[e] != NO_SLOT, select(mirror[e], state.last_copy, NO_SLOT) == e)
                for e in range(bounds.num_experts)
            )
        ),
    }


class CallResult(NamedTuple):
    computed: SymState  # the state after the call, as terms over the state before
    accepted: Bool
    found: dict[tuple[str, str], list[Bool]]
    seen: dict[str, list[Bool]]


Call = tuple[str, tuple[object, ...], int]  # (operation, arguments, stream)


class Unrolled:
    """What an unrolling of either path's transition relation offers its driver (`z3.check`,
    `z3.device_path`): `steps`, each with the verdicts it may commit (`found`, per (property,
    detail)), its reachability observations (`seen`) and whether its call is `accepted`;
    a subclass says what a step's call is (`_calls_at`) and how it reads (`_call_text`)."""

    solver: z3.Solver
    depth: int
    states: list[Any]
    steps: list[Any]

    def _unroll(self, initial: Any) -> None:
        """The states and steps of `depth` calls from `initial` (`step` is one call)."""
        self.states, self.steps = [initial], []
        for t in range(self.depth):
            nxt, info = self.step(t, self.states[-1])
            self.states.append(nxt)
            self.steps.append(info)

    def step(self, t: int, st: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def _fresh_state(self, computed: Any, name: str) -> Any:
        state = fresh_like(computed, name)
        for var, term in zip(leaves(state), leaves(computed), strict=True):
            self.solver.add(var == term)
        return state

    def violation(self, prop: str, upto: int | None = None) -> Bool:
        """Some step among the first `upto` (all by default) violates prop."""
        steps = self.steps[: self.depth if upto is None else upto]
        return disj(*(v for s in steps for (p, _), v in s.found.items() if p == prop))

    def sighting(self, tag: str) -> Bool:
        return disj(*(s.seen.get(tag, False) for s in self.steps))

    def _calls_at(self, ev: Any, info: Any) -> list[Call]:
        raise NotImplementedError

    def _call_text(self, ev: Any, info: Any) -> str:
        raise NotImplementedError

    def _after_text(self, ev: Any, t: int) -> str:
        return ""

    def first_violation(self, model: z3.ModelRef, prop: str) -> int | None:
        """The number of steps up to the first one that violates prop in `model`."""
        ev = _evaluator(model)
        for t, info in enumerate(self.steps):
            if any(p == prop and z3.is_true(ev(v)) for (p, _), v in info.found.items()):
                return t + 1
        return None

    def describe(self, model: z3.ModelRef, prop: str) -> tuple[str, int]:
        """The counterexample in `model` as host calls, up to the first violating step."""
        ev = _evaluator(model)
        lines: list[str] = []
        for t, info in enumerate(self.steps):
            text = self._call_text(ev, info)
            if not z3.is_true(ev(info.accepted)):
                text += " (rejected)"
            lines.append(f"  {t + 1}. {text}{self._after_text(ev, t)}")
            fired = [part for (p, part), v in info.found.items() if p == prop and z3.is_true(ev(v))]
            if fired:
                lines.append(f"     violation: {fired[0]}")
                return "\n".join(lines), t + 1
        return "\n".join(lines), len(self.steps)

    def calls(self, model: z3.ModelRef, upto: int) -> list[Call]:
        """The host calls of the first `upto` steps of the counterexample in `model`."""
        ev = _evaluator(model)
        out: list[Call] = []
        for info in self.steps[:upto]:
            out += self._calls_at(ev, info)
        return out


def first_violated(
    solver: z3.Solver, unrolling: Unrolled, props: Sequence[str], order: Callable[[str], Any]
) -> str | tuple[str, z3.ModelRef]:
    """One query for a violation of any of `props`: "holds" or "unknown", or the property
    violated first on the model found (ties by `order`) and the model."""
    goal = z3.Bool("goal_any")
    solver.add(z3.Implies(goal, z3.Or(*(z3_bool(unrolling.violation(p)) for p in props))))
    verdict = solver.check(goal)
    if verdict != z3.sat:
        return "holds" if verdict == z3.unsat else "unknown"
    model = solver.model()
    when = {p: unrolling.first_violation(model, p) for p in props}
    return min((p for p in props if when[p] is not None), key=lambda p: (when[p], order(p))), model


def shortest(
    solver: z3.Solver, unrolling: Unrolled, prop: str, model: z3.ModelRef, goal: str
) -> z3.ModelRef:
    """The shortest counterexample of prop: the first prefix length that admits one (queries
    named `goal` with `{prop}` and `{k}` filled in); `model` when none is shorter."""
    _, length = unrolling.describe(model, prop)
    for k in range(1, length):
        short = z3.Bool(goal.format(prop=prop, k=k))
        solver.add(z3.Implies(short, z3_bool(unrolling.violation(prop, k))))
        if solver.check(short) == z3.sat:
            return solver.model()
    return model


def reachable(
    solver: z3.Solver, unrolling: Unrolled, tags: Iterable[str], timing: dict[str, float]
) -> dict[str, bool]:
    """Whether some run of the unrolling makes each observation (the "sometimes" checks)."""
    reached: dict[str, bool] = {}
    for tag in tags:
        goal = z3.Bool(f"sight_{tag}")
        solver.add(z3.Implies(goal, z3_bool(unrolling.sighting(tag))))
        t0 = time.perf_counter()
        reached[tag] = solver.check(goal) == z3.sat
        timing[f"sight:{tag}"] = time.perf_counter() - t0
    return reached


class Unrolling(Unrolled):
    """The transition relation unrolled `depth` times into one incremental solver.

    With `read_after_prepare` (the default, as in the explorer's happens-before model), an
    accepted prepare may be followed by the consumer's read within the same step, so that a
    step is one of the explorer's host-call units; the read stays available on its own too.
    """

    FOLLOW = ("prepare", "read")  # (operation, the consumer operation that may follow it)

    def __init__(
        self, table: Table, bounds: Bounds, depth: int, *, read_after_prepare: bool = True
    ) -> None:
        self.table, self.bounds, self.depth = table, bounds, depth
        self.layout = Layout(bounds)
        self.orders = flag_orders(table)
        self.solver = z3.Solver()
        names = [op.name for op in table.operations]
        first, then = self.FOLLOW
        self.follow = (
            (names.index(first), names.index(then))
            if read_after_prepare and first in names and then in names
            else None
        )
        self._unroll(initial_state(bounds, self.layout))

    def inputs(self, t: int) -> Inputs:
        n = self.bounds.num_experts
        args = SymArgs(
            req=tuple(z3.Bool(f"t{t}_req{e}") for e in range(n)),
            bad=z3.Bool(f"t{t}_bad"),
            expert=z3.Int(f"t{t}_expert"),
        )
        inp = Inputs(z3.Int(f"t{t}_op"), z3.Int(f"t{t}_cur"), args)
        self.solver.add(
            inp.op >= 0,
            inp.op < len(self.table.operations),
            inp.cur >= 0,
            inp.cur < self.bounds.consumer_streams,
            args.expert >= 0,
            args.expert <= n,
            z3.Implies(z3.Not(args.bad), count(args.req) >= 1),
        )
        return inp

    def call(
        self, st: SymState, inp: Inputs, top: Int, prefix: str, only: int | None
    ) -> CallResult:
        """One host call from `st`: the operation selected by inp.op (or just `only`)."""
        bounds, layout, args = self.bounds, self.layout, inp.args
        results: list[tuple[Bool, SymState]] = []
        found: dict[tuple[str, str], list[Bool]] = {}
        seen: dict[str, list[Bool]] = {}
        accepted: list[Bool] = []
        constraints: list[Bool] = []

        def report(key: tuple[str, str], v: Bool) -> None:
            found.setdefault(key, []).append(v)

        for i, op in enumerate(self.table.operations):
            if only is not None and i != only:
                continue
            sel = True if only is not None else inp.op == i
            host = st.host
            for name in op.before_guard:
                host = SYM_PRE_GUARD[name](host, args, bounds, top)
            ok = SYM_GUARDS[op.guard](host, args, bounds)
            eff = SYM_EFFECTS[op.effect](host, args, bounds, top)
            rejected = conj(sel, neg(ok))
            if op.name == "prepare":
                seen.setdefault("rejected_prepare", []).append(rejected)
            if op.provider:
                report((P9, DATA_P9), conj(rejected, neg(host_equal(host, st.host))))
            results.append((rejected, st._replace(host=host)))
            acc = conj(sel, ok)
            accepted.append(acc)
            constraints.append(implies(acc, neg(eff.crash)))
            n_miss = disj(*eff.miss)
            if op.name == "prepare":
                self._plan_checks(report, acc, args, eff.host, eff.victim)
                tags = {
                    "eviction": disj(*eff.victim),
                    "owner_change": conj(host.owner != -1, host.owner != inp.cur),
                    "prepare_all_hits": neg(n_miss),
                }
                for tag, v in tags.items():
                    seen.setdefault(tag, []).append(conj(acc, v))
            if op.name == "invalidate":
                seen.setdefault("invalidate_resident", []).append(conj(acc, eff.changed))
            after = eff.host
            if op.set_owner == "current":
                after = after._replace(owner=inp.cur)
            data = DataCtx(
                eff.host.fwd,
                eff.host.fwd_slot,
                eff.miss,
                eff.dest,
                eff.host.slot,
                st.last_copy,
                st.last_map,
            )
            for br in interpret(
                op,
                bounds,
                layout,
                st.dev,
                host.owner,
                inp.cur,
                Facts(n_miss, eff.changed),
                prefix,
                self.orders,
                data,
                constraints,
            ):
                c = conj(acc, br.cond)
                res = br.call
                results.append((c, SymState(after, tuple(res.dev), res.last_copy, res.last_map)))
                for key, vs in res.found.items():
                    report(key, conj(c, disj(*vs)))
                for tag, vs in res.seen.items():
                    seen.setdefault(tag, []).append(conj(c, disj(*vs)))
        self.solver.add(*(z3_bool(c) for c in constraints))
        computed = chain(results[:-1], results[-1][1])
        return CallResult(computed, disj(*accepted), found, seen)

    @staticmethod
    def _plan_checks(
        report: Any, acc: Bool, args: SymArgs, new: SymHost, victim: tuple[Bool, ...]
    ) -> None:
        """`table.host.check_plan` for a prepare: P5 and P3 on the host plan."""
        n = len(victim)
        report((P5, DATA_P5), conj(acc, disj(*(conj(victim[e], args.req[e]) for e in range(n)))))
        report((P3, DATA_P3_SET), conj(acc, disj(*(new.fwd[e] != args.req[e] for e in range(n)))))
        dup = [
            conj(new.fwd[x], new.fwd[y], new.fwd_slot[x] == new.fwd_slot[y])
            for x in range(n)
            for y in range(x + 1, n)
        ]
        report((P3, DATA_P3_SLOTS), conj(acc, disj(*dup)))
        disagree = [conj(new.fwd[e], new.fwd_slot[e] != new.slot[e]) for e in range(n)]
        report((P3, DATA_P3_AGREE), conj(acc, disj(*disagree)))

    def step(self, t: int, st: SymState) -> tuple[SymState, StepInfo]:
        inp = self.inputs(t)
        top = self.bounds.num_experts * (t + 1)  # above every LRU rank given so far
        first = self.call(st, inp, top, f"t{t}", None)
        found = {k: disj(*v) for k, v in first.found.items()}
        seen = {k: disj(*v) for k, v in first.seen.items()}
        then: Bool = False
        nxt = self._fresh_state(first.computed, f"s{t + 1}")
        if self.follow is not None:
            mid = nxt
            then = conj(z3.Bool(f"t{t}_then_read"), inp.op == self.follow[0], first.accepted)
            second = self.call(mid, inp, top, f"t{t}r", self.follow[1])
            for key, vs in second.found.items():
                found[key] = disj(found.get(key, False), conj(then, disj(*vs)))
            for tag, vs in second.seen.items():
                seen[tag] = disj(seen.get(tag, False), conj(then, disj(*vs)))
            nxt = self._fresh_state(chain([(then, second.computed)], mid), f"s{t + 1}r")
        # P4 on the state the device reaches once drained, after every accepted call.
        for part, good in drained_ok(nxt, self.bounds).items():
            found[(P4, part)] = disj(found.get((P4, part), False), conj(first.accepted, neg(good)))
        return nxt, StepInfo(inp, first.accepted, then, found, seen)

    def _calls_at(self, ev: Any, info: StepInfo) -> list[Call]:
        op = self.table.operations[ev(info.inputs.op).as_long()]
        args = SymArgs(
            tuple(z3.is_true(ev(r)) for r in info.inputs.args.req),
            z3.is_true(ev(info.inputs.args.bad)),
            ev(info.inputs.args.expert).as_long(),
        )
        cur = ev(info.inputs.cur).as_long()
        out = [(op.name, sym_args_text(op.args, args, self.bounds), cur)]
        if z3.is_true(ev(info.then_read)) and self.follow is not None:
            out.append((self.table.operations[self.follow[1]].name, (), cur))
        return out

    def _call_text(self, ev: Any, info: StepInfo) -> str:
        calls = self._calls_at(ev, info)
        shown = " then ".join(f"{name}({', '.join(map(repr, args))})" for name, args, _ in calls)
        return f"{shown} on s{calls[0][2]}"

    def _after_text(self, ev: Any, t: int) -> str:
        slots = [ev(s).as_long() for s in self.states[t + 1].host.slot]
        mapped = ", ".join(f"{e}->slot{s}" for e, s in enumerate(slots) if s != NO_SLOT)
        return f"; resident {{{mapped}}}"


def z3_bool(x: Bool) -> Any:
    """A z3 term for a value that may be a plain bool."""
    return z3.BoolVal(x) if isinstance(x, bool) else x


def _evaluator(model: z3.ModelRef) -> Any:
    def ev(x: Any) -> Any:
        if isinstance(x, bool):
            return z3.BoolVal(x)
        if isinstance(x, int):
            return z3.IntVal(x)
        return model.eval(x, model_completion=True)

    return ev
