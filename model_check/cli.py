"""Command line: `python -m model_check [mutants | explain MUTANT | diagram] [--json]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from model_check.config import (
    CHECKS,
    MANIFEST_PATH,
    MUTANT_CHECKS,
    WRITE_COMMAND,
    Check,
    Pinned,
    load_manifest,
    manifest_text,
)
from model_check.device.program import NotExpressible
from model_check.search import Result, explore
from model_check.table.mutants import MUTANTS, Mutant, mutant
from model_check.table.properties import PROPERTIES, Violation
from model_check.table.reference import Bounds
from model_check.table.schema import Table, load_table

# Properties each explorer decides (the summary leaves P7 to the explicit model).
DECIDES = {
    "hb": [p for p in PROPERTIES if p != "P7_no_deadlock"],
    "interleavings": list(PROPERTIES),
}
MACHINE_BOUNDS = Bounds(num_experts=4, capacity=3)


@dataclass
class Column:
    """One checker's run: what it covered and what it found."""

    name: str
    states: int | None
    depth: int | None
    seconds: float
    decides: list[str]
    violation: Violation | None = None
    notes: list[str] = field(default_factory=list)
    reached: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return self.violation is None and not self.notes


# One unit of a full run, done in a worker process: an exhaustive exploration ("explore"), the
# z3 check of one configuration ("z3") or the hypothesis machine ("machine").
Job = tuple[str, Table, Check | None, int, int]


def _run_job(job: Job) -> Result | Column:
    kind, table, check, examples, steps = job
    if kind == "machine":
        return machine_column(table, examples, steps)
    assert check is not None
    if kind == "z3":
        return z3_column(table, check)
    return explore(table, check.bounds, check.depth, model=check.model)


def _pool_map(jobs: list[Job]) -> list[Result | Column]:
    """Results in the order of `jobs`; two workers (the CI machine has two cores) take the
    jobs in that order, so the longest go first and the workers finish together."""
    workers = min(len(jobs), os.cpu_count() or 1, 2)
    if workers <= 1:
        return [_run_job(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_run_job, jobs))


def _schedule(checks: Sequence[Check]) -> list[tuple[str, Check | None]]:
    """Every job of a full run, longest first: the largest happens-before search, the z3
    checks, the explicit interleavings, the hypothesis machine, the other summaries."""
    hb = sorted(
        (c for c in checks if c.model == "hb"),
        key=lambda c: (-c.bounds.num_experts, -c.bounds.capacity, -c.depth),
    )
    jobs: list[tuple[str, Check | None]] = [("explore", c) for c in hb[:1]]
    jobs += [("z3", c) for c in checks if c.model == "hb"]
    jobs += [("explore", c) for c in checks if c.model != "hb"]
    jobs.append(("machine", None))
    jobs += [("explore", c) for c in hb[1:]]
    return jobs


@dataclass
class FullRun:
    explorers: list[tuple[Check, Result]]
    z3: list[Column]
    machine: Column | None


def run_all(
    table: Table,
    checks: Sequence[Check] = CHECKS,
    *,
    examples: int = 300,
    steps: int = 30,
    z3: bool = True,
    machine: bool = True,
) -> FullRun:
    """Every checker of `python -m model_check`, spread over two processes; the results do not
    depend on the order they finish in."""
    plan = [
        (kind, check)
        for kind, check in _schedule(checks)
        if (kind != "z3" or z3) and (kind != "machine" or machine)
    ]
    results = _pool_map([(kind, table, check, examples, steps) for kind, check in plan])
    done = {
        (kind, None if c is None else c.key): r for (kind, c), r in zip(plan, results, strict=True)
    }
    explorers = []
    for c in checks:
        result = done[("explore", c.key)]
        assert isinstance(result, Result)
        explorers.append((c, result))
    z3_cols = []
    for c in checks:
        col = done.get(("z3", c.key))
        if col is not None:
            assert isinstance(col, Column)
            z3_cols.append(col)
    found = done.get(("machine", None))
    assert found is None or isinstance(found, Column)
    return FullRun(explorers, z3_cols, found)


def explorer_columns(runs: list[tuple[Check, Result]], manifest: dict[str, Pinned]) -> list[Column]:
    columns = []
    for check, result in runs:
        col = Column(
            name=check.key,
            states=result.states,
            depth=result.max_depth_reached,
            seconds=result.seconds,
            decides=DECIDES[check.model],
            violation=result.violation,
            reached=set(result.tags),
        )
        pinned = manifest.get(check.key)
        got = Pinned(result.states, result.transitions, result.max_depth_reached)
        if pinned is None:
            col.notes.append(f"{check.key} is not in {MANIFEST_PATH.name} ({WRITE_COMMAND})")
        elif pinned != got:
            col.notes.append(
                f"{check.key}: manifest pins {pinned}, this run found {got} "
                f"(re-pin on purpose with `{WRITE_COMMAND}`)"
            )
        columns.append(col)
    # Each device model must reach every "sometimes" observation in one of its runs.
    for model in sorted({check.model for check, _ in runs}):
        reached: set[str] = set()
        missing: set[str] = set()
        for check, result in runs:
            if check.model == model:
                reached |= result.tags
                missing |= set(result.missing_reachability())
        gaps = sorted(missing - reached)
        if gaps:
            owner = next(
                c for c, (check, _) in zip(columns, runs, strict=True) if check.model == model
            )
            owner.notes.append(f"{model}: never reached {', '.join(gaps)} (a vacuous pass?)")
    return columns


def machine_column(table: Table, examples: int, steps: int) -> Column:
    from model_check.search.machine import run_machine

    start = time.perf_counter()
    found = run_machine(table, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    return Column(
        name=f"hypothesis/{MACHINE_BOUNDS.num_experts}e{MACHINE_BOUNDS.capacity}c",
        states=None,
        depth=steps,
        seconds=time.perf_counter() - start,
        decides=list(PROPERTIES),
        violation=found,
    )


def z3_column(table: Table, check: Check) -> Column:
    from model_check.z3 import check as z3_check

    report = z3_check.check_table(table, check.bounds, check.depth)
    col = Column(
        name=f"z3/{check.bounds.num_experts}e{check.bounds.capacity}c/d{check.depth}",
        states=None,
        depth=check.depth,
        seconds=report.seconds,
        decides=list(report.decides),
        violation=report.violation,
    )
    if report.vacuous:
        col.notes.append(f"{col.name}: never reached {', '.join(report.vacuous)}")
    if not report.ok and report.violation is None:
        col.notes.append(f"{col.name}: not proved:\n{report.text()}")
    return col


def verdict_table(columns: list[Column]) -> str:
    names = [c.name for c in columns]
    width = max(len(p) for p in PROPERTIES)
    cw = max(12, *(len(n) for n in names))
    lines = ["property".ljust(width) + "".join(n.rjust(cw + 2) for n in names)]
    for prop in PROPERTIES:
        cells = []
        for col in columns:
            if prop not in col.decides:
                cells.append("-")
            elif col.violation is not None and col.violation.prop == prop:
                cells.append("VIOLATED")
            elif col.violation is not None:
                cells.append("stopped")
            else:
                cells.append("holds")
        lines.append(prop.ljust(width) + "".join(c.rjust(cw + 2) for c in cells))
    lines.append("")
    rows: list[tuple[str, list[str]]] = [
        ("states", ["-" if c.states is None else str(c.states) for c in columns]),
        ("depth", ["-" if c.depth is None else str(c.depth) for c in columns]),
        ("seconds", [f"{c.seconds:.1f}" for c in columns]),
        ("verdict", ["pass" if c.ok else "FAIL" for c in columns]),
    ]
    for label, cells in rows:
        lines.append(label.ljust(width) + "".join(x.rjust(cw + 2) for x in cells))
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    table = load_table()
    manifest = load_manifest()
    full = run_all(table, examples=args.examples, steps=args.steps)
    runs = full.explorers
    if args.write_manifest:
        rows = [(c, Pinned(r.states, r.transitions, r.max_depth_reached)) for c, r in runs]
        MANIFEST_PATH.write_text(manifest_text(rows))
        manifest = load_manifest()
    columns = explorer_columns(runs, manifest)
    columns += full.z3
    assert full.machine is not None
    columns.append(full.machine)
    ok = all(c.ok for c in columns)
    if args.json:
        print(json.dumps({"ok": ok, "columns": [_column_json(c) for c in columns]}, indent=2))
    else:
        print(verdict_table(columns))
        for col in columns:
            if col.violation is not None:
                print(f"\n{col.name}: {col.violation.prop}: {col.violation.detail}")
            for note in col.notes:
                print(f"\n{note}")
        print("\nall properties hold" if ok else "\nFAILED")
    return 0 if ok else 1


def _column_json(col: Column) -> dict[str, Any]:
    return {
        "checker": col.name,
        "states": col.states,
        "depth": col.depth,
        "seconds": round(col.seconds, 3),
        "decides": col.decides,
        "violation": None if col.violation is None else vars(col.violation),
        "notes": col.notes,
        "ok": col.ok,
    }


@dataclass
class Kill:
    checker: str
    found: str | None  # property of the violation found, or None when the mutant survived
    seconds: float
    applicable: bool = True


def kill_row(m: Mutant, table: Table, examples: int, steps: int, use_z3: bool) -> list[Kill]:
    mutated = m.apply(table)
    row: list[Kill] = []
    for check in MUTANT_CHECKS:
        start = time.perf_counter()
        try:
            result = explore(mutated, check.bounds, check.depth, model=check.model)
        except NotExpressible:
            row.append(Kill(check.key, None, 0.0, applicable=False))
            continue
        found = result.violation.prop if result.violation else None
        row.append(Kill(check.key, found, time.perf_counter() - start))
    # The bug breaks the property it was seeded against, not just some property.
    start = time.perf_counter()
    target = next(c for c in MUTANT_CHECKS if c.model == "interleavings")
    result = explore(mutated, target.bounds, target.depth, model=target.model, only=m.breaks)
    row.append(
        Kill(
            "intended",
            result.violation.prop if result.violation else None,
            time.perf_counter() - start,
        )
    )
    if use_z3:
        row.append(z3_kill(mutated))
    from model_check.search.machine import run_machine

    start = time.perf_counter()
    found_h = run_machine(mutated, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    row.append(Kill("hypothesis", found_h.prop if found_h else None, time.perf_counter() - start))
    return row


def z3_kill(mutated: Table) -> Kill:
    from model_check.z3 import check as z3_check

    start = time.perf_counter()
    found_z3: str | None = None
    for check in CHECKS:
        if check.model == "hb":
            report = z3_check.check_table(
                mutated,
                check.bounds,
                check.depth,
                induction=False,
                reachability=False,
                replay_counterexamples=False,
                stop_at_first=True,
            )
            if report.violation is not None:
                found_z3 = report.violation.prop
                break
    return Kill("z3", found_z3, time.perf_counter() - start)


def _kill_job(job: tuple[str, Table, int, int, bool]) -> list[Kill]:
    name, table, examples, steps, use_z3 = job
    return kill_row(mutant(name), table, examples, steps, use_z3)


def cmd_mutants(args: argparse.Namespace) -> int:
    table = load_table()
    use_z3 = not args.no_z3
    # Rows are independent and printed in catalogue order. Each runs in a fresh process, with
    # one worker too: which property z3's first counterexample shows depends on the queries
    # the process made before, and a fresh process makes the matrix the same from run to run.
    workers = min(len(MUTANTS), os.cpu_count() or 1, 2)
    jobs = [(m.name, table, args.examples, args.steps, use_z3) for m in MUTANTS]
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        kills = list(pool.map(_kill_job, jobs))
    rows = list(zip(MUTANTS, kills, strict=True))
    survivors = [
        (m.name, k.checker)
        for m, row in rows
        for k in row
        if k.applicable and (k.found is None or (k.checker == "intended" and k.found != m.breaks))
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not survivors,
                    "mutants": [
                        {
                            "name": m.name,
                            "breaks": m.breaks,
                            "description": m.description,
                            "kills": [vars(k) for k in row],
                        }
                        for m, row in rows
                    ],
                },
                indent=2,
            )
        )
    else:
        checkers = [k.checker for k in rows[0][1]]
        nw = max(len(m.name) for m in MUTANTS)
        print("mutant".ljust(nw) + "  breaks" + "".join(c.rjust(22) for c in checkers))
        for m, row in rows:
            cells = [
                "n/a"
                if not k.applicable
                else (k.found[:2] if k.found else "SURVIVED") + f" {k.seconds:5.1f}s"
                for k in row
            ]
            print(
                m.name.ljust(nw)
                + "  "
                + m.breaks[:2].ljust(6)
                + "".join(c.rjust(22) for c in cells)
            )
        print(
            f"\n{len(MUTANTS)} mutants, "
            + (
                "every one killed by every applicable checker"
                if not survivors
                else f"SURVIVORS: {survivors}"
            )
        )
    return 0 if not survivors else 1


def cmd_explain(args: argparse.Namespace) -> int:
    from model_check.render import swimlane_svg, swimlane_text

    m = mutant(args.mutant)
    bounds = Bounds(num_experts=3, capacity=2)
    result = explore(
        m.apply(load_table()), bounds, args.depth, model="interleavings", only=m.breaks
    )
    if result.violation is None:
        print(f"{m.name}: no violation of {m.breaks} within depth {args.depth}")
        return 1
    print(f"{m.name}: {m.description}\n")
    print(swimlane_text(result.trace, bounds.consumer_streams, result.violation))
    if args.out:
        path = swimlane_svg(result.trace, bounds.consumer_streams, Path(args.out), result.violation)
        print(f"\nwrote {path}")
    return 0


def cmd_diagram(args: argparse.Namespace) -> int:
    from model_check.render import table_diagram, table_text

    table = load_table()
    print(table_text(table))
    if args.out:
        print(f"\nwrote {table_diagram(table, Path(args.out))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # The common options are accepted before or after the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    common.add_argument(
        "--examples", type=int, default=argparse.SUPPRESS, help="hypothesis examples (300)"
    )
    common.add_argument(
        "--steps", type=int, default=argparse.SUPPRESS, help="hypothesis steps per example (30)"
    )
    parser = argparse.ArgumentParser(
        prog="python -m model_check", description=__doc__, parents=[common]
    )
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check", parents=[common], help="model-check the table (the default)")
    check.add_argument("--write-manifest", action="store_true", help="re-pin the state counts")
    muts = sub.add_parser("mutants", parents=[common], help="print the kill matrix")
    muts.add_argument("--no-z3", action="store_true", help="skip the z3 column")
    explain = sub.add_parser("explain", help="shortest counterexample of a mutant")
    explain.add_argument("mutant", choices=[m.name for m in MUTANTS])
    explain.add_argument("--out", help="write the swimlane as .svg or .png")
    explain.add_argument("--depth", type=int, default=4)
    diagram = sub.add_parser("diagram", help="render the transition table")
    diagram.add_argument("--out", help="write the diagram as .svg or .png")
    return parser


COMMON_DEFAULTS = {"json": False, "examples": 300, "steps": 30}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    # Defaults are filled here, not on the parsers: their option objects are shared through
    # `parents`, so a parser-level default would override a value given before the command.
    for name, value in COMMON_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in (None, "check"):
        if args.command is None:
            args.write_manifest = False
        return cmd_check(args)
    if args.command == "mutants":
        return cmd_mutants(args)
    if args.command == "explain":
        return cmd_explain(args)
    return cmd_diagram(args)


if __name__ == "__main__":
    sys.exit(main())
