"""z3 checks of the transition table: bounded model checking and an inductive invariant.

`check_table(table, bounds, depth)` returns a `Z3Report`:
- per property P1..P9, whether some sequence of at most `depth` host calls violates it
  (`z3.bmc`: exact symbolic host state, the happens-before summary of `z3.streams` for the
  device), with the shortest counterexample as host calls, replayed on the explicit
  interleaving model (`streams.queues`) to say whether that model confirms it;
- reachability ("sometimes") checks, so that a pass is not vacuous;
- the unbounded result for the ordering properties (`z3.induction`): an inductive invariant,
  found by Houdini from a template and checked by z3 for every operation of the table.
Everything is built from the table: a mutant is a different table, nothing else.

`python -m model_check.z3.check` runs it on the real table at the explorer's bounds.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import z3

from model_check.table.properties import PROPERTIES, Violation
from model_check.table.reference import Bounds
from model_check.table.schema import Table, load_table
from model_check.z3.bmc import Unrolling, first_violated, reachable, shortest, z3_bool
from model_check.z3.induction import InductionResult, prove
from model_check.z3.invariant import (
    INVARIANT_PATH,
    WRITE_COMMAND,
    differences,
    invariant_text,
    load_invariant,
)

# Observations that must be reachable in the real table, or a pass says little.
REACHABILITY: dict[str, str] = {
    "eviction": "a prepare evicts a resident expert",
    "owner_change": "a prepare is called from a stream other than the owner",
    "prepare_all_hits": "a prepare finds every requested expert resident",
    "rejected_prepare": "a prepare with bad input is rejected",
    "invalidate_resident": "invalidate removes a resident expert",
    "copy_while_read_pending": "a copy is enqueued while the followed read is pending",
    "read_while_copy_pending": "a read is enqueued while the followed copy is pending",
    "upload_while_upload_pending": "a resident-map upload is enqueued while an earlier one is "
    "pending",
    "staging_reuse_after_upload": "a staging buffer is reused after an upload from it",
}
# Only some tables can reach these; they are reported, not required.
OPTIONAL_REACHABILITY: dict[str, str] = {
    "provider_sync_with_read_pending": "a provider call synchronizes while a read is pending",
}


@dataclass
class PropertyResult:
    prop: str
    verdict: str  # "holds" (no violation within the depth), "violated" or "unknown"
    seconds: float
    counterexample: str | None = None
    calls: list[tuple[str, tuple[object, ...], int]] = field(default_factory=list)
    # Replays of the calls on the other device models: model -> properties it finds.
    replayed: dict[str, list[str]] = field(default_factory=dict)

    @property
    def confirmed(self) -> bool | None:
        """Some replaying model finds this property on the same calls (None: not replayed)."""
        if not self.replayed:
            return None
        return any(self.prop in found for found in self.replayed.values())


@dataclass
class Z3Report:
    bounds: Bounds
    depth: int
    properties: dict[str, PropertyResult]
    reached: dict[str, bool]
    induction: InductionResult | None
    seconds: float
    decides: tuple[str, ...] = tuple(PROPERTIES)

    @property
    def violations(self) -> list[PropertyResult]:
        """Violated properties, most convincing first: confirmed by the replay, shortest."""
        found = [r for r in self.properties.values() if r.verdict == "violated"]
        return sorted(
            found,
            key=lambda r: (r.confirmed is False, len(r.calls), list(PROPERTIES).index(r.prop)),
        )

    @property
    def violation(self) -> Violation | None:
        found = self.violations
        if not found:
            return None
        first = found[0]
        return Violation(first.prop, first.counterexample or "")

    @property
    def vacuous(self) -> list[str]:
        return sorted(tag for tag in REACHABILITY if not self.reached.get(tag, False))

    @property
    def ok(self) -> bool:
        unknown = any(r.verdict == "unknown" for r in self.properties.values())
        proved = self.induction is None or self.induction.ok
        return self.violation is None and not unknown and proved

    def text(self) -> str:
        b = self.bounds
        lines = [
            f"z3: {b.num_experts} experts, capacity {b.capacity}, {b.consumer_streams} consumer "
            f"streams, up to {self.depth} host calls ({self.seconds:.1f} s)"
        ]
        for prop, r in self.properties.items():
            line = f"  {prop:<32} {r.verdict:<9} {r.seconds:6.2f} s"
            if r.verdict == "violated":
                if r.confirmed is None:
                    note = "not replayed"
                else:
                    note = "; ".join(
                        f"{model} finds {', '.join(p[:2] for p in found) or 'nothing'}"
                        for model, found in r.replayed.items()
                    )
                line += f"  {len(r.calls)} calls; replay: {note}"
            lines.append(line)
            if r.counterexample:
                lines.append(r.counterexample)
        missing = self.vacuous
        lines.append(
            "  reachable: " + ("all" if not missing else f"NOT REACHED: {', '.join(missing)}")
        )
        ind = self.induction
        if ind is not None:
            proved = [p for p, ok in ind.proved.items() if ok]
            failed = [p for p, ok in ind.proved.items() if not ok]
            lines.append(
                f"  induction ({ind.seconds:.1f} s, {ind.candidates} candidate clauses, "
                f"{ind.houdini_rounds} Houdini rounds): proved for any number of calls: "
                f"{', '.join(proved) or 'none'}"
                + (f"; NOT proved: {', '.join(failed)}" if failed else "")
            )
            lines.append(
                "  inductive for every operation: "
                + ", ".join(f"{op} {'yes' if ok else 'NO'}" for op, ok in ind.per_operation.items())
            )
            if ind.vacuous:
                lines.append(
                    "  vacuous (no step of the table can violate them): " + ", ".join(ind.vacuous)
                )
            lines.append("  invariant:")
            lines += [f"    {clause}" for clause in ind.invariant]
            if ind.committed is not None:
                c = ind.committed
                lines.append(
                    f"  committed invariant ({INVARIANT_PATH.name}): "
                    + ("checked" if c.ok else "NOT inductive or NOT excluding every violation")
                    + (
                        ""
                        if ind.matches_committed is None
                        else ("; the search finds the same" if ind.matches_committed else "")
                    )
                )
                if c.unknown:
                    lines.append(f"    clauses not in the template: {c.unknown}")
            if ind.matches_committed is False:
                lines.append(f"  the search differs from {INVARIANT_PATH.name}:")
                lines += [f"    {note}" for note in ind.notes]
                lines.append(f"    (re-pin on purpose with `{WRITE_COMMAND}`)")
            if ind.counterexample:
                lines.append(f"  induction counterexample: {ind.counterexample}")
        return "\n".join(lines)


Calls = list[tuple[str, tuple[object, ...], int]]


def replay_hb(table: Table, bounds: Bounds, calls: Calls) -> dict[str, str] | None:
    """Run the host calls on the happens-before summary (`streams.hb`), every staging branch; the
    properties it finds violated (None when the table is not expressible there)."""
    from model_check.streams.hb import NotExpressible, hb_host_call, initial_hb_state

    found: dict[str, str] = {}
    states = [initial_hb_state(bounds)]
    try:
        for op, args, stream in calls:
            nxt = []
            for st in states:
                for out in hb_host_call(table, bounds, st, op, args, stream):
                    if out.violation is not None:
                        found.setdefault(out.violation.prop, out.violation.detail)
                    nxt.append(out.state)
            states = list(dict.fromkeys(nxt))
    except NotExpressible:
        return None
    return found


def replay_explicit(table: Table, bounds: Bounds, calls: Calls) -> dict[str, str] | None:
    """Run the host calls on the explicit FIFO model, every interleaving of device steps
    between and after them; the properties it finds violated (None: too many states)."""
    from model_check.search.replay import replay as replay_on
    from model_check.streams.queues import (
        Outcome,
        State,
        can_resume,
        deadlocked,
        device_step,
        host_call,
        initial_state,
        resume,
        runnable,
    )

    def moves(st: State) -> list[Outcome[State]]:
        outs = [device_step(st, sid) for sid in range(len(st.queues)) if runnable(st, sid)]
        if st.blocked is not None and can_resume(st, bounds, table):
            outs.append(resume(table, bounds, st))
        return outs

    def call(st: State, op: str, args: tuple[object, ...], stream: int) -> Outcome[State] | None:
        return None if st.blocked is not None else host_call(table, bounds, st, op, args, stream)

    return replay_on(initial_state(bounds), moves, call, deadlocked, calls)


def replay(table: Table, bounds: Bounds, calls: Calls) -> dict[str, list[str]]:
    """Per device model (hb, interleavings) that could run the calls: what it finds."""
    out: dict[str, list[str]] = {}
    for name, fn in (("hb", replay_hb), ("interleavings", replay_explicit)):
        found = fn(table, bounds, calls)
        if found is not None:
            out[name] = sorted(found)
    return out


@functools.lru_cache(maxsize=32)
def _induction(table: Table, streams: int, buffers: int) -> InductionResult:
    """The induction, with the committed invariant checked and compared."""
    committed = load_invariant()
    # The abstraction does not depend on the number of experts or slots.
    bounds = Bounds(1, 1, consumer_streams=streams, staging_buffers=buffers)
    result = prove(table, bounds, committed=None if committed is None else committed.invariant)
    if committed is None:
        result.notes.append(f"{INVARIANT_PATH} is missing; write it with `{WRITE_COMMAND}`")
        result.matches_committed = False
    else:
        found = differences(committed, result, streams, buffers)
        result.notes += found
        result.matches_committed = not found
    return result


def check_table(
    table: Table,
    bounds: Bounds,
    depth: int,
    *,
    induction: bool = True,
    reachability: bool = True,
    replay_counterexamples: bool = True,
    properties: Sequence[str] = tuple(PROPERTIES),
    read_after_prepare: bool = True,
    stop_at_first: bool = False,
) -> Z3Report:
    """Bounded model checking of `properties` to `depth` host calls (a prepare and the
    consumer's read after it count as one, as in the explorer's happens-before model, unless
    read_after_prepare is False), the reachability checks, and the induction.

    With stop_at_first, one query asks for a violation of any of the properties; the first
    property violated on the counterexample gets the shortest counterexample, and the others
    are reported "skipped" (a mutant's kill in a fraction of the time)."""
    start = time.perf_counter()
    unrolling = Unrolling(table, bounds, depth, read_after_prepare=read_after_prepare)
    solver = unrolling.solver
    results: dict[str, PropertyResult] = {}

    def counterexample(prop: str, model: z3.ModelRef, t0: float) -> PropertyResult:
        model = shortest(solver, unrolling, prop, model, "goal_{prop}_{k}")
        text, length = unrolling.describe(model, prop)
        result = PropertyResult(prop, "violated", 0.0, text, unrolling.calls(model, length))
        if replay_counterexamples:
            result.replayed = replay(table, bounds, result.calls)
        result.seconds = time.perf_counter() - t0
        return result

    if stop_at_first:
        t0 = time.perf_counter()
        found = first_violated(solver, unrolling, properties, list(properties).index)
        if isinstance(found, tuple):
            results = {p: PropertyResult(p, "skipped", 0.0) for p in properties}
            results[found[0]] = counterexample(*found, t0)
        else:
            seconds = time.perf_counter() - t0
            results = {p: PropertyResult(p, found, seconds) for p in properties}
    else:
        for prop in properties:
            t0 = time.perf_counter()
            goal = z3.Bool(f"goal_{prop}")
            solver.add(z3.Implies(goal, z3_bool(unrolling.violation(prop))))
            verdict = solver.check(goal)
            if verdict == z3.sat:
                results[prop] = counterexample(prop, solver.model(), t0)
            else:
                word = "holds" if verdict == z3.unsat else "unknown"
                results[prop] = PropertyResult(prop, word, time.perf_counter() - t0)
    reached: dict[str, bool] = {}
    if reachability:
        reached = reachable(solver, unrolling, (*REACHABILITY, *OPTIONAL_REACHABILITY), {})
    ind = _induction(table, bounds.consumer_streams, bounds.staging_buffers) if induction else None
    return Z3Report(
        bounds=bounds,
        depth=depth,
        properties=results,
        reached=reached,
        induction=ind,
        seconds=time.perf_counter() - start,
    )


CONFIGURATIONS: tuple[tuple[Bounds, int], ...] = (
    (Bounds(num_experts=3, capacity=2), 6),
    (Bounds(num_experts=4, capacity=3), 4),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m model_check.z3.check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--depth", type=int, help="host calls (default: the explorer's)")
    parser.add_argument(
        "--write-invariant",
        action="store_true",
        help=f"run the induction on the real table and write {INVARIANT_PATH.name}",
    )
    return parser


def write_invariant(table: Table) -> int:
    # Every configuration has the same streams and staging buffers, the induction's bounds.
    [(streams, buffers)] = {(b.consumer_streams, b.staging_buffers) for b, _ in CONFIGURATIONS}
    result = prove(table, Bounds(1, 1, consumer_streams=streams, staging_buffers=buffers))
    if not result.ok:
        print(f"the induction does not prove the table; {INVARIANT_PATH} left as it is")
        return 1
    INVARIANT_PATH.write_text(invariant_text(result, streams, buffers))
    print(f"wrote {INVARIANT_PATH}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    table = load_table()
    if args.write_invariant:
        return write_invariant(table)
    ok = True
    for bounds, depth in CONFIGURATIONS:
        report = check_table(table, bounds, args.depth or depth)
        print(report.text())
        ok = ok and report.ok and not report.vacuous
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
