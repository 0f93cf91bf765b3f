"""Command line: `python -m model_check [--complete] [mutants | explain MUTANT | diagram] [--json]`.

Without a command, the check of the table: by default every exhaustive search (both models,
both paths, at the committed bounds, their state counts against the manifest) and both
hypothesis machines, which answer in about a minute on two cores; ``--complete`` adds the z3
columns (bounded model checking at the same bounds and the induction proofs of the ordering
invariants), about twice as long in all. ``scripts/test.sh`` runs the complete check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, NamedTuple

from model_check.config import (
    B32,
    CHECKS,
    DEVICE_CHECKS,
    DEVICE_INTENDED_CHECKS,
    DEVICE_MUTANT_CHECKS,
    INTENDED_CHECKS,
    MANIFEST_PATH,
    MUTANT_CHECKS,
    WRITE_COMMAND,
    Check,
    Pinned,
    load_manifest,
    manifest_text,
)
from model_check.report import (
    Column,
    Kill,
    column_json,
    kill_matrix_text,
    kills_json,
    search_columns,
    survivors,
    verdict_table,
)
from model_check.search import Result, explore
from model_check.streams.program import NotExpressible
from model_check.table.mutants import DEVICE_MUTANTS, MUTANTS, Mutant, device_mutant, mutant
from model_check.table.properties import DEVICE_PROPERTIES, PROPERTIES
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceTable, Table, load_device_table, load_table

MACHINE_BOUNDS = Bounds(num_experts=4, capacity=3)


def properties_of(table: Table | DeviceTable) -> dict[str, str]:
    return DEVICE_PROPERTIES if isinstance(table, DeviceTable) else PROPERTIES


def decides(properties: Sequence[str]) -> dict[str, list[str]]:
    """Properties each explorer decides (the summary leaves P7 to the explicit model)."""
    return {
        "hb": [p for p in properties if p != "P7_no_deadlock"],
        "interleavings": list(properties),
    }


# One unit of a full run, done in a worker process: an exhaustive exploration ("explore"), the
# z3 check of one configuration ("z3") or the hypothesis machine ("machine"), of the host
# path's operations, or of the device-planned path's ("device_explore", "device_z3",
# "device_machine", on the table's [device] section).
Job = tuple[str, Table | DeviceTable, Check | None, int, int]

# Seconds each job took on the 2-core development machine (spec/README.md, "Performance"),
# only to schedule the longest first.
ESTIMATES: dict[tuple[str, str], float] = {
    ("z3", "hb/3e2c/d6"): 36,
    ("z3", "hb/4e3c/d4"): 22,
    ("explore", "hb/4e3c/d4"): 21,
    ("device_z3", "device/hb/3e2c/d6"): 21,
    ("device_z3", "device/hb/4e3c/d4"): 19,
    ("device_explore", "device/interleavings/3e2c/d3"): 16,
    ("device_explore", "device/hb/4e3c/d4"): 12,
    ("device_machine", ""): 9,
    ("explore", "interleavings/3e2c/d3"): 6,
    ("machine", ""): 3,
    ("explore", "interleavings/4e3c/d2"): 2.5,
    ("device_explore", "device/interleavings/4e3c/d2"): 2,
    ("explore", "hb/3e2c/d6"): 1,
    ("device_explore", "device/hb/3e2c/d6"): 1,
}


def _run_job(job: Job) -> Result | Column:
    kind, table, check, examples, steps = job
    kind = kind.removeprefix("device_")  # the same job on the [device] section
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


def _z3_checks(check: Check) -> bool:
    return check.model == "hb" and check.bounds.policy == "lru"


def _schedule(
    checks: Sequence[Check], device: Sequence[Check] = ()
) -> list[tuple[str, Check | None]]:
    """Every job of a full run, longest first: the largest happens-before search, then the
    others by `ESTIMATES` (the z3 checks, the device path's, the explicit interleavings, the
    hypothesis machines, the other summaries)."""
    hb = sorted(
        (c for c in checks if c.model == "hb"),
        key=lambda c: (-c.bounds.num_experts, -c.bounds.capacity, -c.depth),
    )
    # z3 encodes the LRU victim order only (`z3.host._sym_plan_prepare`): the other policies'
    # bounds are the explicit searches'.
    rest: list[tuple[str, Check | None]] = [("z3", c) for c in checks if _z3_checks(c)]
    rest += [("explore", c) for c in checks if c.model != "hb"]
    rest.append(("machine", None))
    rest += [("explore", c) for c in hb[1:]]
    if device:
        rest += [("device_z3", c) for c in device if _z3_checks(c)]
        rest += [("device_explore", c) for c in device]
        rest.append(("device_machine", None))

    def estimate(job: tuple[str, Check | None]) -> float:
        return -ESTIMATES.get((job[0], "" if job[1] is None else job[1].key), 0.0)

    jobs: list[tuple[str, Check | None]] = [("explore", c) for c in hb[:1]]
    return jobs + sorted(rest, key=estimate)


class PathRun(NamedTuple):
    """One path's part of a full run: its searches, z3 columns and machine column."""

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
    device_table: DeviceTable | None = None,
    device: Sequence[Check] = (),
) -> dict[str, PathRun]:
    """Every checker of `python -m model_check`, spread over two processes; the results do not
    depend on the order they finish in. `device`: the device-planned path's checks to run too
    (on `device_table`, by default the table's [device] section). Per path ("host", "device")."""
    tables: dict[str, Table | DeviceTable | None] = {"": table, "device_": device_table}
    if device and device_table is None:
        tables["device_"] = load_device_table()
    plan = [
        (kind, check)
        for kind, check in _schedule(checks, device)
        if (not kind.endswith("z3") or z3) and (not kind.endswith("machine") or machine)
    ]
    jobs: list[Job] = []
    for kind, check in plan:
        source = tables["device_" if kind.startswith("device_") else ""]
        assert source is not None
        jobs.append((kind, source, check, examples, steps))
    results = _pool_map(jobs)
    done = {
        (kind, None if c is None else c.key): r for (kind, c), r in zip(plan, results, strict=True)
    }

    def path_run(prefix: str, of: Sequence[Check]) -> PathRun:
        searches: list[tuple[Check, Result]] = []
        for c in of:
            result = done[(prefix + "explore", c.key)]
            assert isinstance(result, Result)
            searches.append((c, result))
        columns = [col for c in of if isinstance(col := done.get((prefix + "z3", c.key)), Column)]
        found = done.get((prefix + "machine", None))
        assert found is None or isinstance(found, Column)
        return PathRun(searches, columns, found)

    return {"host": path_run("", checks), "device": path_run("device_", device)}


def explorer_columns(
    runs: list[tuple[Check, Result]],
    manifest: dict[str, Pinned],
    properties: Sequence[str] = tuple(PROPERTIES),
) -> list[Column]:
    """The exhaustive searches' columns of either path (`properties`: the path's)."""
    return search_columns(
        runs,
        manifest,
        decides(properties),
        lambda _, result: set(result.missing_reachability()),
        MANIFEST_PATH.name,
        WRITE_COMMAND,
    )


def _prefix(table: Table | DeviceTable) -> str:
    return "device/" if isinstance(table, DeviceTable) else ""


def machine_column(table: Table | DeviceTable, examples: int, steps: int) -> Column:
    from model_check.search.run_machines import run_machine

    start = time.perf_counter()
    found = run_machine(table, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    b = MACHINE_BOUNDS
    return Column(
        name=f"{_prefix(table)}hypothesis/{b.num_experts}e{b.capacity}c",
        states=None,
        depth=steps,
        seconds=time.perf_counter() - start,
        decides=list(properties_of(table)),
        violation=found,
    )


def z3_column(table: Table | DeviceTable, check: Check) -> Column:
    from model_check.z3 import check as z3_check
    from model_check.z3 import device_path as z3_device

    b = check.bounds
    name = f"{_prefix(table)}z3/{b.num_experts}e{b.capacity}c/d{check.depth}"
    notes: list[str] = []
    if isinstance(table, DeviceTable):
        # The induction does not depend on the bounds: once, with the smaller ones.
        device = z3_device.check(table, b, check.depth, induction=b == B32)
        report: z3_check.Z3Report | z3_device.Z3Report = device
        unknown = [p for p, v in device.verdicts.items() if v == "unknown"]
        if unknown:
            notes.append(f"{name}: unknown: {', '.join(unknown)}")
        ind = device.induction
        if ind is not None and not ind.ok:
            notes.append(
                f"{name}: induction failed: {ind.proved}, {ind.per_operation}, {ind.counterexample}"
            )
    else:
        report = host = z3_check.check_table(table, b, check.depth)
        if not host.ok and host.violation is None:
            notes.append(f"{name}: not proved:\n{host.text()}")
    col = Column(name, None, check.depth, report.seconds, list(report.decides), report.violation)
    if report.vacuous:
        col.notes.append(f"{name}: never reached {', '.join(report.vacuous)}")
    col.notes += notes
    return col


NOT_COMPLETE = (
    "not run here: the z3 columns (bounded model checking at 3e2c/d6 and 4e3c/d4 and the "
    "induction proofs, both paths); `python -m model_check --complete` runs every column, and "
    "scripts/test.sh runs it"
)


def cmd_check(args: argparse.Namespace) -> int:
    manifest = load_manifest()
    full = run_all(
        load_table(),
        examples=args.examples,
        steps=args.steps,
        device=DEVICE_CHECKS,
        z3=args.complete,
    )
    if args.write_manifest:
        rows = [
            (c, Pinned(r.states, r.transitions, r.max_depth_reached))
            for run in full.values()
            for c, r in run.explorers
        ]
        MANIFEST_PATH.write_text(manifest_text(rows))
        manifest = load_manifest()
    props = {"host": PROPERTIES, "device": DEVICE_PROPERTIES}
    tables: dict[str, list[Column]] = {}
    for path, run in full.items():
        assert run.machine is not None
        searches = explorer_columns(run.explorers, manifest, tuple(props[path]))
        tables[path] = [*searches, *run.z3, run.machine]
    columns, device = tables["host"], tables["device"]
    ok = all(c.ok for c in [*columns, *device])
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "complete": args.complete,
                    "columns": [column_json(c) for c in columns],
                    "device_columns": [column_json(c) for c in device],
                },
                indent=2,
            )
        )
    else:
        print(verdict_table(columns, list(PROPERTIES)))
        print("\nthe device-planned path ([device] in spec/table.toml):\n")
        print(verdict_table(device, list(DEVICE_PROPERTIES)))
        for col in [*columns, *device]:
            if col.violation is not None:
                print(f"\n{col.name}: {col.violation.prop}: {col.violation.detail}")
            for note in col.notes:
                print(f"\n{note}")
        if not args.complete:
            print(f"\n{NOT_COMPLETE}")
        verdict = "all properties hold" if ok else "FAILED"
        print(f"\n{verdict}" + ("" if args.complete else " (every search and machine column)"))
    return 0 if ok else 1


def kill_row(
    m: Mutant[Any], table: Table | DeviceTable, examples: int, steps: int, use_z3: bool
) -> list[Kill]:
    """The mutant's row of the kill matrix, of either path: both searches, one search for the
    intended property alone (`config.INTENDED_CHECKS`), z3 (first counterexample at either
    bound) and the machine."""
    mutated = m.apply(table)
    row: list[Kill] = []
    checks = DEVICE_MUTANT_CHECKS if isinstance(table, DeviceTable) else MUTANT_CHECKS
    for check in checks:
        start = time.perf_counter()
        try:
            result = explore(mutated, check.bounds, check.depth, model=check.model)
        except NotExpressible:
            row.append(Kill(check.key, None, 0.0, applicable=False))
            continue
        found = result.violation.prop if result.violation else None
        row.append(Kill(check.key, found, time.perf_counter() - start))
    # The bug breaks the property it was seeded against, not just some property: shown by a
    # search above that stopped at a violation of it, else by a search for it alone in the
    # first model that can express it (`config.INTENDED_CHECKS`).
    start = time.perf_counter()
    if any(k.found == m.breaks for k in row):
        found_intended: str | None = m.breaks
    else:
        intended = DEVICE_INTENDED_CHECKS if isinstance(table, DeviceTable) else INTENDED_CHECKS
        found_intended = intended_search(mutated, m.breaks, intended)
    row.append(Kill("intended", found_intended, time.perf_counter() - start))
    if use_z3:
        row.append(z3_kill(mutated))
    from model_check.search.run_machines import run_machine

    start = time.perf_counter()
    # A kill needs a failing example, not a short one (explain shows the shortest trace).
    found_h = run_machine(mutated, MACHINE_BOUNDS, max_examples=examples, steps=steps, shrink=False)
    row.append(Kill("hypothesis", found_h.prop if found_h else None, time.perf_counter() - start))
    return row


def intended_search(
    mutated: Table | DeviceTable, prop: str, checks: tuple[Check, ...]
) -> str | None:
    """The violation of `prop` alone (or None) in the first of `checks` whose model expresses
    it (`config.INTENDED_CHECKS`)."""
    for check in checks:
        try:
            result = explore(mutated, check.bounds, check.depth, model=check.model, only=prop)
        except NotExpressible:
            continue
        return result.violation.prop if result.violation else None
    return None


def z3_kill(mutated: Table | DeviceTable) -> Kill:
    """z3's first violation at either bound (`z3.check.CONFIGURATIONS`), in one query each."""
    from model_check.z3 import check as z3_check
    from model_check.z3 import device_path as z3_device

    start = time.perf_counter()
    found_z3: str | None = None
    for bounds, depth in z3_check.CONFIGURATIONS:
        report: z3_check.Z3Report | z3_device.Z3Report
        if isinstance(mutated, DeviceTable):
            report = z3_device.check(
                mutated, bounds, depth, induction=False, reachability=False, stop_at_first=True
            )
        else:
            report = z3_check.check_table(
                mutated,
                bounds,
                depth,
                induction=False,
                reachability=False,
                replay_counterexamples=False,
                stop_at_first=True,
            )
        if report.violation is not None:
            found_z3 = report.violation.prop
            break
    return Kill("z3", found_z3, time.perf_counter() - start)


def _kill_job(job: tuple[str, str, Table | DeviceTable, int, int, bool]) -> list[Kill]:
    path, name, table, examples, steps, use_z3 = job
    m: Mutant[Any] = device_mutant(name) if path == "device" else mutant(name)
    return kill_row(m, table, examples, steps, use_z3)


def cmd_mutants(args: argparse.Namespace) -> int:
    tables: dict[str, Table | DeviceTable] = {"host": load_table(), "device": load_device_table()}
    use_z3 = not args.no_z3
    # Rows are independent and printed in catalogue order. Each runs in a fresh process, with
    # one worker too: which property z3's first counterexample shows depends on the queries
    # the process made before, and a fresh process makes the matrix the same from run to run.
    # The device-planned path's mutants (`table.mutants.DEVICE_MUTANTS`) follow.
    names = [("host", m.name) for m in MUTANTS] + [("device", m.name) for m in DEVICE_MUTANTS]
    workers = min(len(names), os.cpu_count() or 1, 2)
    jobs = [(path, name, tables[path], args.examples, args.steps, use_z3) for path, name in names]
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        kills = list(pool.map(_kill_job, jobs))
    rows = list(zip(MUTANTS, kills[: len(MUTANTS)], strict=True))
    device_rows = list(zip(DEVICE_MUTANTS, kills[len(MUTANTS) :], strict=True))
    survived = survivors(rows) + survivors(device_rows)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": not survived,
                    "mutants": kills_json(rows),
                    "device_mutants": kills_json(device_rows),
                },
                indent=2,
            )
        )
    else:
        print(kill_matrix_text(rows))
        print("\nthe device-planned path:\n")
        print(kill_matrix_text(device_rows, width=30))
        total = len(rows) + len(device_rows)
        print(
            f"\n{total} mutants ({len(device_rows)} of the device path), "
            + (
                "every one killed by every applicable checker"
                if not survived
                else f"SURVIVORS: {survived}"
            )
        )
    return 0 if not survived else 1


def cmd_explain(args: argparse.Namespace) -> int:
    from model_check.render import swimlane_svg, swimlane_text

    if args.mutant in {m.name for m in DEVICE_MUTANTS}:
        print(explain_device(args.mutant, args.depth))
        if args.out:
            print("\n(no drawing for the device path's mutants: the text above is the trace)")
        return 0
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


def explain_device(name: str, depth: int = 3) -> str:
    """The shortest counterexample of a device mutant on the explicit model, as text: every
    host call and device step, each host call with the device operations it enqueued."""
    from model_check.search.bfs import bfs
    from model_check.search.device_models import DeviceQueueModel

    m = device_mutant(name)
    model = DeviceQueueModel(m.apply(load_device_table()), B32, m.breaks)
    result = bfs(model, depth, only=m.breaks, symmetry=False)
    if result.violation is None:
        return f"{m.name}: no violation of {m.breaks} within {depth} host calls"
    lines = [f"{m.name}: {m.description}", ""]
    for action, outcome in result.trace:
        if action.kind != "host":
            lines.append(f"    {action}")
            continue
        lines.append(f"  {action}")
        state = outcome.state
        part = model.part_of(state) if isinstance(state, tuple) else None
        if part is not None:
            for sid, queue in enumerate(part.queues):
                if queue:
                    shown = ", ".join(op.kind for op in queue)
                    lines.append(f"      pending on stream {sid}: {shown}")
    assert result.violation is not None
    lines.append(f"  => {result.violation.prop}: {result.violation.detail}")
    return "\n".join(lines)


def cmd_diagram(args: argparse.Namespace) -> int:
    from model_check.render import device_table_text, table_diagram, table_text

    table = load_table()
    print(table_text(table))
    print()
    print(device_table_text(load_device_table()))
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
    common.add_argument(
        "--complete",
        action="store_true",
        default=argparse.SUPPRESS,
        help="the check with its z3 columns too (what scripts/test.sh runs)",
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
    names = [m.name for m in MUTANTS] + [m.name for m in DEVICE_MUTANTS]
    explain.add_argument("mutant", choices=names)
    explain.add_argument("--out", help="write the swimlane as .svg or .png")
    explain.add_argument("--depth", type=int, default=4)
    diagram = sub.add_parser("diagram", help="render the transition table")
    diagram.add_argument("--out", help="write the diagram as .svg or .png")
    return parser


COMMON_DEFAULTS = {"json": False, "examples": 300, "steps": 30, "complete": False}


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
