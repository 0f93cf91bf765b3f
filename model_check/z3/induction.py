"""An unbounded argument for the ordering properties: an inductive invariant checked by z3.

What is proved, and about what (spec/README.md states the same):

- The model is the happens-before summary (`streams.hb`) in the symbolic form of `z3.streams`:
  one followed pending operation per kind (a read, a copy, a map upload per staging ring, a
  `wait_flag` per event), each with its mask of places, with 2 consumer streams plus the copy
  stream and 1 staging buffer per ring (the bounds of every configuration), and an abstract
  host: the owner stream and whether an accepted prepare has happened (`prepared`, which is
  "a forward map exists"). A host call is any operation of the table on any consumer stream;
  what the steps read of the host plan is free, within facts the tests check against the
  reference functions on every reachable host state (`z3.host.EFFECT_FACTS`): a prepare may
  or may not copy, and changes the map only when it copies; an invalidate changes it only when
  an expert is resident, so only after a prepare; a read needs a forward map. The followed
  read and copy are taken to share a slot (the worst case). Nothing depends on the number of
  experts or slots, nor on the number of calls: that is what is unbounded.
- The properties are the ordering verdicts of the summary (`ORDERING`): P1 (a copy not
  ordered after a pending read), P2's ordering part (a read not ordered after a pending copy),
  P4's ordering parts (two copies into a slot, or two resident-map uploads, unordered), P6 (a
  staging buffer rewritten under its upload), P7 (a `wait_flag` inside the snapshot it waits
  for) and P8 (a provider host_sync behind a pending read). A property whose violation no step
  of the table can commit at all is reported as vacuous (`InductionResult.vacuous`): in the
  real table P7 (no `wait_flag` step) and P8 (no provider host_sync). The data parts of P2
  and P4 (stale content, the drained map) and P3, P5, P9 are not covered here; the bounded
  searches decide them.

The invariant is found, not written by hand. Candidate clauses come from a template, for every
followed kind K:  "K pending => a"  and  "K pending => a or b"  where a, b range over "happens
before place p" for every stream, event and staging reuse event, "happens before the owner
stream", and false; for map uploads also "from staging buffer b => inside b's reuse
snapshot"; and the host facts "prepared <=> there is an owner" and "K pending => prepared".
Houdini's algorithm keeps the clauses true initially and drops every clause some transition
from a state satisfying all kept clauses can falsify, until the set is inductive: the
strongest inductive invariant the template can express. It is then minimized greedily to the
clauses needed to stay inductive and to exclude every violation the transition can commit.

The minimized invariant is committed as data, `spec/invariant.toml` (as TLA+ proofs commit
`Inv`). `check_invariant` checks the committed clauses directly, for every operation of the
table on its own: Init => Inv, Inv and step(op) => Inv', Inv and step => no violation; and
`prove` reports whether Houdini's search found exactly the committed clauses, so that a change
of the table that changes the invariant fails until the file is re-pinned on purpose
(`python -m model_check.z3.check --write-invariant`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, NamedTuple, TypeVar

import z3

from model_check.table.reference import NO_SLOT, NO_STREAM, Bounds
from model_check.table.schema import Table
from model_check.z3.bmc import z3_bool
from model_check.z3.host import (
    EFFECT_FACTS,
    GUARD_ALWAYS,
    GUARD_NEEDS_FORWARD,
    Bool,
    Int,
    conj,
    disj,
    implies,
    neg,
)
from model_check.z3.streams import (
    KINDS,
    P1,
    P2,
    P4,
    P6,
    P7,
    P8,
    DevState,
    Facts,
    Layout,
    Tracked,
    flag_orders,
    initial_dev,
    interpret,
)

ORDERING = (P1, P2, P4, P6, P7, P8)


class AbsState(NamedTuple):
    owner: Int
    prepared: Bool
    dev: DevState


@dataclass
class InvariantCheck:
    """The committed invariant checked on the table (see `check_invariant`)."""

    initial: bool  # Init => Inv
    per_operation: dict[str, bool]  # Inv and step(op) => Inv', for each operation
    excludes: dict[str, bool]  # per ordering property: Inv and step => no violation
    unknown: list[str] = field(default_factory=list)  # clauses the template does not have

    @property
    def ok(self) -> bool:
        return (
            self.initial
            and not self.unknown
            and all(self.per_operation.values())
            and all(self.excludes.values())
        )


@dataclass
class InductionResult:
    proved: dict[str, bool]  # per ordering property: excluded for every number of calls
    invariant: list[str]  # the minimized inductive invariant, one clause a line
    per_operation: dict[str, bool]  # Inv and step(op) => Inv', for each operation
    seconds: float
    houdini_rounds: int = 0
    candidates: int = 0
    counterexample: str | None = None  # a transition from Inv that breaks a property
    vacuous: list[str] = field(default_factory=list)  # no step can commit these at all
    # The committed invariant (spec/invariant.toml): its own check, and whether the search
    # found exactly what the file pins (None: not compared; `notes` says what differs).
    committed: InvariantCheck | None = None
    matches_committed: bool | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            all(self.proved.values())
            and all(self.per_operation.values())
            and (self.committed is None or self.committed.ok)
            and self.matches_committed is not False
        )


def _abs_vars(layout: Layout, prefix: str) -> AbsState:
    dev = tuple(
        Tracked(
            z3.Bool(f"{prefix}_{k}_alive"),
            tuple(z3.Bool(f"{prefix}_{k}_{name}") for name in layout.names),
            z3.Int(f"{prefix}_{k}_buf"),
            (),
        )
        for k in KINDS
    )
    return AbsState(z3.Int(f"{prefix}_owner"), z3.Bool(f"{prefix}_prepared"), dev)


def _domain(s: AbsState, bounds: Bounds, layout: Layout) -> Bool:
    parts = [s.owner >= NO_STREAM, s.owner < bounds.consumer_streams]
    for t in s.dev:
        parts += [t.buf >= NO_SLOT, t.buf < layout.buffers]
    return conj(*parts)


class Transition(NamedTuple):
    op_sel: Int
    formula: Bool  # relates pre and post (and fresh choices)
    found: dict[str, Bool]  # violations committed during the transition


def transition(
    table: Table, bounds: Bounds, layout: Layout, pre: AbsState, post: AbsState, prefix: str
) -> Transition:
    orders = flag_orders(table)
    op_sel = z3.Int(f"{prefix}_op")
    cur = z3.Int(f"{prefix}_cur")
    constraints: list[Bool] = [
        op_sel >= 0,
        op_sel < len(table.operations),
        cur >= 0,
        cur < bounds.consumer_streams,
    ]
    results: list[tuple[Bool, AbsState]] = []
    found: dict[str, list[Bool]] = {}
    for i, op in enumerate(table.operations):
        if op.effect not in EFFECT_FACTS:
            raise KeyError(f"no abstract facts for effect {op.effect!r}")
        facts = EFFECT_FACTS[op.effect]
        sel = op_sel == i
        if op.guard in GUARD_ALWAYS:
            ok: Bool = True
        elif op.guard in GUARD_NEEDS_FORWARD:
            ok = conj(z3.Bool(f"{prefix}_ok{i}"), pre.prepared)
        else:
            ok = z3.Bool(f"{prefix}_ok{i}")
        misses = z3.Bool(f"{prefix}_misses{i}") if facts.may_copy else False
        changed: Bool = z3.Bool(f"{prefix}_changed{i}") if facts.may_change else False
        if facts.change_needs_forward:
            changed = conj(changed, pre.prepared)
        if facts.change_needs_copy:
            changed = conj(changed, misses)
        results.append((conj(sel, neg(ok)), pre))
        owner = cur if op.set_owner == "current" else pre.owner
        prepared = disj(pre.prepared, facts.sets_forward)
        for br in interpret(
            op,
            bounds,
            layout,
            pre.dev,
            pre.owner,
            cur,
            Facts(misses, changed),
            prefix,
            orders,
            None,
            constraints,
        ):
            c = conj(sel, ok, br.cond)
            results.append((c, AbsState(owner, prepared, tuple(br.call.dev))))
            for (prop, _), vs in br.call.found.items():
                found.setdefault(prop, []).append(conj(c, disj(*vs)))
    eqs: list[Bool] = []
    for cond, st in results:
        eqs.append(implies(cond, state_eq(post, st)))
    return Transition(op_sel, conj(*constraints, *eqs), {p: disj(*vs) for p, vs in found.items()})


def state_eq(a: Any, b: Any) -> Bool:
    """Two abstract states of either path are equal: the owner, the host flag the template
    reads as `prepared`, and every followed kind's liveness, mask and (the host path's map
    uploads) staging buffer."""
    parts: list[Bool] = [a.owner == b.owner, a.prepared == b.prepared]
    for x, y in zip(a.dev, b.dev, strict=True):
        parts.append(x.alive == y.alive)
        parts += [p == q for p, q in zip(x.mask, y.mask, strict=True)]
        if hasattr(x, "buf"):
            parts.append(x.buf == y.buf)
    return conj(*parts)


Atom = tuple[str, int]  # ("false" | "prepared" | "owned" | "owner" | "place", place index)


class Clause(NamedTuple):
    """`kind` pending (from staging buffer `buf`, when given) => one of `atoms`; kind -1 is
    a host clause: prepared <=> (or =>, with buf 1) there is an owner stream. Both paths'
    abstract states have an owner, followed kinds with masks, and a host flag read as
    `prepared` (the device-planned path's: a forward map is unread)."""

    text: str
    kind: int
    atoms: tuple[Atom, ...]
    buf: int | None = None

    def value(self, s: AbsState, streams: int) -> Bool:
        if self.kind < 0:
            owned = s.owner != NO_STREAM
            return implies(s.prepared, owned) if self.buf else s.prepared == owned
        t = s.dev[self.kind]
        premise = t.alive if self.buf is None else conj(t.alive, t.buf == self.buf)
        return implies(premise, disj(*(_atom(a, t, s, streams) for a in self.atoms)))


def _atom(atom: Atom, t: Tracked, s: AbsState, streams: int) -> Bool:
    name, place = atom
    if name == "false":
        return False
    if name == "prepared":
        return s.prepared
    if name == "owned":
        return s.owner != NO_STREAM
    if name == "owner":
        return disj(*(conj(s.owner == j, t.mask[j]) for j in range(streams)))
    return t.mask[place]


def template(
    kinds: Sequence[str], names: Sequence[str], host: tuple[str, str]
) -> Iterator[tuple[int, str, list[Clause]]]:
    """The template's clauses for every followed kind: "K pending => a" and "K pending => a
    or b" for a, b among false, the host atom `host` (name, text), "before the owner stream"
    and "before p" for every place p named in `names`; per kind (index, name, clauses)."""
    texts = {("owner", 0): "before the owner stream"}
    places: list[Atom] = [("owner", 0)]
    for p, name in enumerate(names):
        texts[("place", p)] = f"before {name}"
        places.append(("place", p))
    for k, kind in enumerate(kinds):
        out = [Clause(f"{kind} pending => false", k, (("false", 0),))]
        out.append(Clause(f"{kind} pending => {host[1]}", k, ((host[0], 0),)))
        for a in places:
            out.append(Clause(f"{kind} pending => {texts[a]}", k, (a,)))
        for a, b in combinations(places, 2):
            out.append(Clause(f"{kind} pending => {texts[a]} or {texts[b]}", k, (a, b)))
        yield k, kind, out


def candidates(layout: Layout) -> list[Clause]:
    out = [
        Clause("prepared <=> there is an owner stream", -1, ()),
        Clause("prepared => there is an owner stream", -1, (), 1),
    ]
    for k, kind, clauses in template(KINDS, layout.names, ("prepared", "prepared")):
        out += clauses
        if kind.startswith("map:"):
            ring = kind.split(":", 1)[1]
            for buf in range(layout.buffers):
                place = layout.reuse(ring, buf)
                out.append(
                    Clause(
                        f"{kind} pending from staging buffer {buf} => before {layout.names[place]}",
                        k,
                        (("place", place),),
                        buf,
                    )
                )
    return out


class _Setup(NamedTuple):
    """One transition from an abstract state satisfying the domain, in a solver."""

    layout: Layout
    streams: int
    init: AbsState
    pre: AbsState
    post: AbsState
    step: Transition
    solver: z3.Solver


def _setup(table: Table, bounds: Bounds) -> _Setup:
    layout = Layout(bounds)
    init = AbsState(NO_STREAM, False, initial_dev(layout))
    pre, post = _abs_vars(layout, "pre"), _abs_vars(layout, "post")
    step = transition(table, bounds, layout, pre, post, "step")
    solver = z3.Solver()
    solver.add(_domain(pre, bounds, layout), z3_bool(step.formula))
    return _Setup(layout, bounds.consumer_streams, init, pre, post, step, solver)


def vacuous(setup: _Setup) -> list[str]:
    """Ordering properties no step of the table can violate: not even from an arbitrary state
    in which only operations of kinds some step enqueues are pending (a `wait_flag` operation
    exists only if some step is a `wait_flag`). No invariant is needed for these."""
    solver, pre, post = setup.solver, setup.pre, setup.post
    never: list[Bool] = []
    for before, after in zip(pre.dev, post.dev, strict=True):
        solver.push()
        solver.add(z3.Not(z3_bool(before.alive)), z3_bool(after.alive))
        if solver.check() == z3.unsat:
            never.append(z3.Not(z3_bool(before.alive)))
        solver.pop()
    out = []
    for prop in ORDERING:
        solver.push()
        solver.add(*never, z3_bool(setup.step.found.get(prop, False)))
        if solver.check() == z3.unsat:
            out.append(prop)
        solver.pop()
    return out


def check_invariant(
    table: Table, bounds: Bounds, clauses: Sequence[str], setup: _Setup | None = None
) -> InvariantCheck:
    """The clauses (texts of the template's clauses, as `InductionResult.invariant` prints
    them) checked directly: Init => Inv, Inv and step(op) => Inv' for each operation, and
    Inv and step => no violation of each ordering property."""
    s = setup or _setup(table, bounds)
    by_text = {c.text: c for c in candidates(s.layout)}
    unknown = [text for text in clauses if text not in by_text]
    inv = [by_text[text] for text in clauses if text in by_text]
    solver, streams = s.solver, s.streams
    pre_inv = [z3_bool(c.value(s.pre, streams)) for c in inv]
    post_inv = z3.And(*[z3_bool(c.value(s.post, streams)) for c in inv] or [z3.BoolVal(True)])
    per_op: dict[str, bool] = {}
    for i, op in enumerate(table.operations):
        solver.push()
        solver.add(s.step.op_sel == i, *pre_inv, z3.Not(post_inv))
        per_op[op.name] = solver.check() == z3.unsat
        solver.pop()
    excludes: dict[str, bool] = {}
    for prop in ORDERING:
        solver.push()
        solver.add(*pre_inv, z3_bool(s.step.found.get(prop, False)))
        excludes[prop] = solver.check() == z3.unsat
        solver.pop()
    initial = all(_truth(c.value(s.init, streams)) for c in inv)
    return InvariantCheck(initial, per_op, excludes, unknown)


C = TypeVar("C")
Holds = Callable[[C], Any]  # a clause's z3 term in the pre- or the post-state


def houdini(
    solver: z3.Solver, cands: list[C], pre: Holds[C], post: Holds[C]
) -> tuple[list[C], int]:
    """Houdini: drop the clauses a step from a state satisfying all of them can falsify, until
    the conjunction is inductive; the clauses kept and the rounds."""
    rounds = 0
    while True:
        rounds += 1
        solver.push()
        solver.add(*[pre(c) for c in cands])
        solver.add(z3.Not(z3.And(*[post(c) for c in cands])))
        if solver.check() != z3.sat:
            solver.pop()
            return cands, rounds
        model = solver.model()
        keep = [c for c in cands if z3.is_true(model.eval(post(c), True))]
        solver.pop()
        assert len(keep) < len(cands)
        cands = keep


def excluded(
    solver: z3.Solver,
    inv: list[C],
    pre: Holds[C],
    bad: Callable[[str], Any],
    props: Sequence[str],
    describe: Callable[[z3.ModelRef, str], str],
) -> tuple[dict[str, bool], str | None]:
    """Which properties the invariant excludes; the first one it does not, described."""
    proved: dict[str, bool] = {}
    cex: str | None = None
    for prop in props:
        solver.push()
        solver.add(*[pre(c) for c in inv])
        solver.add(bad(prop))
        result = solver.check()
        proved[prop] = result == z3.unsat
        if result == z3.sat and cex is None:
            cex = describe(solver.model(), prop)
        solver.pop()
    return proved, cex


def minimized(
    solver: z3.Solver,
    cands: list[C],
    size: Callable[[C], int],
    pre: Holds[C],
    post: Holds[C],
    bad: Any,
) -> list[C]:
    """Drop each clause not needed for inductiveness and for excluding `bad` (larger clauses
    first, so that single-atom clauses are preferred)."""
    order = sorted(range(len(cands)), key=lambda i: -size(cands[i]))
    kept = set(range(len(cands)))
    for i in order:
        trial = [cands[j] for j in sorted(kept - {i})]
        solver.push()
        solver.add(*[pre(c) for c in trial])
        solver.add(z3.Or(z3.Not(z3.And(*[post(c) for c in trial] or [z3.BoolVal(True)])), bad))
        if solver.check() == z3.unsat:
            kept.discard(i)
        solver.pop()
    return [cands[j] for j in sorted(kept)]


def inductive_per_operation(
    solver: z3.Solver,
    op_sel: Any,
    names: Sequence[str],
    inv: list[C],
    pre: Holds[C],
    post: Holds[C],
) -> dict[str, bool]:
    """Per operation: a step of it from a state satisfying the invariant keeps it."""
    out: dict[str, bool] = {}
    for i, name in enumerate(names):
        solver.push()
        solver.add(op_sel == i)
        solver.add(*[pre(c) for c in inv])
        solver.add(z3.Not(z3.And(*[post(c) for c in inv] or [z3.BoolVal(True)])))
        out[name] = solver.check() == z3.unsat
        solver.pop()
    return out


def prove(
    table: Table,
    bounds: Bounds,
    *,
    minimize: bool = True,
    committed: Sequence[str] | None = None,
) -> InductionResult:
    """Houdini's search for the strongest inductive invariant the template expresses, the
    ordering properties it excludes, its minimization; with `committed` (the clauses of
    spec/invariant.toml), their own check and whether the search found exactly them."""
    start = time.perf_counter()
    setup = _setup(table, bounds)
    layout, streams, init, pre, post, step, base = setup

    def describe(model: z3.ModelRef, prop: str) -> str:
        return f"{prop}: from a state satisfying the invariant, " + _describe(
            model, table, step, pre, layout
        )

    names = [op.name for op in table.operations]
    result = find_invariant(
        base,
        candidates(layout),
        (init, pre, post, streams),
        step.found,
        ORDERING,
        describe,
        (step.op_sel, names),
        start,
        minimize=minimize,
    )
    if committed is not None:
        result.committed = check_invariant(table, bounds, committed, setup)
    result.vacuous = vacuous(setup)
    return result


def find_invariant(
    base: z3.Solver,
    template: list[Clause],
    states: tuple[Any, Any, Any, int],
    found: dict[str, Bool],
    props: Sequence[str],
    describe: Callable[[z3.ModelRef, str], str],
    operations: tuple[Any, Sequence[str]],
    start: float,
    *,
    minimize: bool = True,
) -> InductionResult:
    """The induction of either path, on `base` (a solver holding one transition from `pre` to
    `post`, with `found[p]` the violations of p it commits): the template's clauses true in
    `init`, Houdini's algorithm, the properties the invariant excludes (the first it does not,
    `describe`d), the invariant minimized, and whether it is inductive for each operation
    (`operations`: the selector's term and the operations' names)."""
    init, pre, post, streams = states

    def at_pre(c: Clause) -> Any:
        return z3_bool(c.value(pre, streams))

    def at_post(c: Clause) -> Any:
        return z3_bool(c.value(post, streams))

    cands = [c for c in template if _truth(c.value(init, streams))]
    n_cands = len(cands)
    cands, rounds = houdini(base, cands, at_pre, at_post)
    proved, cex = excluded(
        base, cands, at_pre, lambda p: z3_bool(found.get(p, False)), props, describe
    )
    final = cands
    if minimize:
        good = disj(*(found.get(p, False) for p in proved if proved[p]))
        final = minimized(base, cands, lambda c: len(c.atoms), at_pre, at_post, z3_bool(good))
    per_op = inductive_per_operation(base, *operations, final, at_pre, at_post)
    assert all(_truth(c.value(init, streams)) for c in final)
    return InductionResult(
        proved=proved,
        invariant=[c.text for c in final],
        per_operation=per_op,
        seconds=time.perf_counter() - start,
        houdini_rounds=rounds,
        candidates=n_cands,
        counterexample=cex,
    )


def _truth(x: Bool) -> bool:
    if isinstance(x, bool):
        return x
    simplified = z3.simplify(x)
    return bool(z3.is_true(simplified))


def _describe(
    model: z3.ModelRef, table: Table, step: Transition, pre: AbsState, layout: Layout
) -> str:
    op = table.operations[model.eval(step.op_sel, True).as_long()]
    owner = model.eval(pre.owner, True).as_long()
    cur = model.eval(z3.Int("step_cur"), True).as_long()
    pending = []
    for kind, t in zip(KINDS, pre.dev, strict=True):
        if z3.is_true(model.eval(z3_bool(t.alive), True)):
            places = [
                n
                for n, m in zip(layout.names, t.mask, strict=True)
                if z3.is_true(model.eval(m, True))
            ]
            pending.append(f"{kind} before {{{', '.join(places)}}}")
    return f"owner s{owner}, pending: {'; '.join(pending) or 'none'}; then {op.name} on s{cur}"


__all__ = [
    "InductionResult",
    "InvariantCheck",
    "check_invariant",
    "excluded",
    "find_invariant",
    "houdini",
    "inductive_per_operation",
    "minimized",
    "prove",
]
