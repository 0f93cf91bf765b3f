"""The device-planned path's checks: bounds, runs, the mutant kill row, the verdict table.

`python -m model_check.device_path` runs every check of the real device table (the searches,
z3, the hypothesis machine) and prints property by checker; `... mutants` prints the kill
matrix of the device mutants. `DEVICE_CHECKS` are the exhaustive searches whose state counts
are pinned (`tests/test_device_path_model.py`, and the manifest once the table holds the
device section).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

from model_check.device_path.core import PROPERTIES, REACHABILITY, Violation
from model_check.device_path.explicit import ExplicitModel
from model_check.device_path.hb import HbModel
from model_check.device_path.mutants import DEVICE_MUTANTS, DeviceMutant, device_mutant
from model_check.device_path.table import DeviceTable, load_device_table
from model_check.search.bfs import bfs
from model_check.search.memo import memo_search
from model_check.search.model import Result
from model_check.table.reference import Bounds


@dataclass(frozen=True)
class DeviceCheck:
    model: str  # "hb" (happens-before summary) or "interleavings" (explicit FIFO model)
    bounds: Bounds
    depth: int

    @property
    def key(self) -> str:
        b = self.bounds
        return f"device/{self.model}/{b.num_experts}e{b.capacity}c/d{self.depth}"


B32 = Bounds(num_experts=3, capacity=2)
B43 = Bounds(num_experts=4, capacity=3)
DEVICE_CHECKS: tuple[DeviceCheck, ...] = (
    DeviceCheck("hb", B32, 6),
    DeviceCheck("hb", B43, 4),
    DeviceCheck("interleavings", B32, 3),
    DeviceCheck("interleavings", B43, 2),
)
DEVICE_MUTANT_CHECKS: tuple[DeviceCheck, ...] = (
    DeviceCheck("hb", B32, 6),
    DeviceCheck("interleavings", B32, 3),
)
Z3_CONFIGS: tuple[tuple[Bounds, int], ...] = ((B32, 6), (B43, 4))
MACHINE_BOUNDS = B43

# Properties each checker decides: P7 is the explicit model's (the summaries' waits are
# snapshot waits, so the happens-before relation is acyclic by construction).
DECIDES = {
    "hb": [p for p in PROPERTIES if p != "P7_no_deadlock"],
    "interleavings": list(PROPERTIES),
    "z3": [p for p in PROPERTIES if p != "P7_no_deadlock"],
    "hypothesis": list(PROPERTIES),
}
# Observations each model must reach in one of its runs.
EXPECTED_TAGS = {
    "hb": frozenset(REACHABILITY) - {"device_idle"},
    "interleavings": frozenset(REACHABILITY),
}


def explore(
    table: DeviceTable,
    check: DeviceCheck,
    *,
    only: str | None = None,
    stop_at_first: bool = True,
    symmetry: bool = True,
) -> Result:
    """One exhaustive check of the device table: the summary through the memoized search,
    the explicit model through the plain one (both `model_check.search`)."""
    if check.model == "hb":
        hb = HbModel(table, check.bounds)
        if symmetry:
            return memo_search(hb, check.depth, stop_at_first=stop_at_first, only=only)
        return bfs(hb, check.depth, stop_at_first=stop_at_first, symmetry=False, only=only)
    model = ExplicitModel(table, check.bounds, only)
    return bfs(model, check.depth, stop_at_first=stop_at_first, symmetry=symmetry, only=only)


@dataclass
class Column:
    name: str
    states: int | None
    depth: int | None
    seconds: float
    decides: list[str]
    violation: Violation | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.violation is None and not self.notes


def search_columns(
    runs: Sequence[tuple[DeviceCheck, Result]],
    pinned: dict[str, tuple[int, int, int]] | None = None,
) -> list[Column]:
    columns = []
    for check, result in runs:
        col = Column(
            check.key,
            result.states,
            result.max_depth_reached,
            result.seconds,
            DECIDES[check.model],
            result.violation,
        )
        got = (result.states, result.transitions, result.max_depth_reached)
        if pinned is not None and pinned.get(check.key) != got:
            col.notes.append(f"{check.key}: pinned {pinned.get(check.key)}, this run found {got}")
        columns.append(col)
    for model, expected in EXPECTED_TAGS.items():
        reached: set[str] = set()
        for check, result in runs:
            if check.model == model:
                reached |= result.tags
        gaps = sorted(expected - reached)
        owner = next((c for c, (k, _) in zip(columns, runs, strict=True) if k.model == model), None)
        if gaps and owner is not None:
            owner.notes.append(f"{model}: never reached {', '.join(gaps)} (a vacuous pass?)")
    return columns


def z3_column(table: DeviceTable, bounds: Bounds, depth: int, induction: bool) -> Column:
    from model_check.device_path.z3_check import check

    report = check(table, bounds, depth, induction=induction)
    found = report.violation
    col = Column(
        f"device/z3/{bounds.num_experts}e{bounds.capacity}c/d{depth}",
        None,
        depth,
        report.seconds,
        DECIDES["z3"],
        None if found is None else Violation(*found),
    )
    if report.vacuous:
        col.notes.append(f"{col.name}: never reached {', '.join(report.vacuous)}")
    unknown = [p for p, v in report.verdicts.items() if v == "unknown"]
    if unknown:
        col.notes.append(f"{col.name}: unknown: {', '.join(unknown)}")
    ind = report.induction
    if ind is not None and not ind.ok:
        col.notes.append(
            f"{col.name}: induction failed: {ind.proved}, {ind.per_operation}, {ind.counterexample}"
        )
    return col


def machine_column(table: DeviceTable, examples: int, steps: int) -> Column:
    from model_check.device_path.machine import run_machine

    start = time.perf_counter()
    found = run_machine(table, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    b = MACHINE_BOUNDS
    return Column(
        f"device/hypothesis/{b.num_experts}e{b.capacity}c",
        None,
        steps,
        time.perf_counter() - start,
        DECIDES["hypothesis"],
        found,
    )


Job = tuple[str, int, int, int]  # (kind, index, examples, steps)


def _run_job(job: Job) -> Result | Column:
    kind, index, examples, steps = job
    table = load_device_table()
    if kind == "search":
        return explore(table, DEVICE_CHECKS[index])
    if kind == "z3":
        bounds, depth = Z3_CONFIGS[index]
        return z3_column(table, bounds, depth, induction=index == 0)
    return machine_column(table, examples, steps)


def jobs(examples: int = 300, steps: int = 30) -> list[Job]:
    """Every job of a full device run, longest first."""
    out: list[Job] = [("z3", 1, 0, 0), ("z3", 0, 0, 0)]
    order = sorted(
        range(len(DEVICE_CHECKS)),
        key=lambda i: -DEVICE_CHECKS[i].depth * DEVICE_CHECKS[i].bounds.num_experts,
    )
    out += [("search", i, 0, 0) for i in order]
    out.append(("machine", 0, examples, steps))
    return out


def assemble(
    done: dict[Job, Result | Column], pinned: dict[str, tuple[int, int, int]] | None
) -> list[Column]:
    runs: list[tuple[DeviceCheck, Result]] = []
    for i, check in enumerate(DEVICE_CHECKS):
        result = next(r for j, r in done.items() if j[0] == "search" and j[1] == i)
        assert isinstance(result, Result)
        runs.append((check, result))
    columns = search_columns(runs, pinned)
    for i in range(len(Z3_CONFIGS)):
        col = next(r for j, r in done.items() if j[0] == "z3" and j[1] == i)
        assert isinstance(col, Column)
        columns.append(col)
    col = next(r for j, r in done.items() if j[0] == "machine")
    assert isinstance(col, Column)
    columns.append(col)
    return columns


def verdict_table(columns: list[Column]) -> str:
    width = max(len(p) for p in PROPERTIES)
    cw = max(12, *(len(c.name) for c in columns))
    lines = ["property".ljust(width) + "".join(c.name.rjust(cw + 2) for c in columns)]
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
        lines.append(prop.ljust(width) + "".join(x.rjust(cw + 2) for x in cells))
    lines.append("")
    for label, cells in (
        ("states", ["-" if c.states is None else str(c.states) for c in columns]),
        ("depth", ["-" if c.depth is None else str(c.depth) for c in columns]),
        ("seconds", [f"{c.seconds:.1f}" for c in columns]),
        ("verdict", ["pass" if c.ok else "FAIL" for c in columns]),
    ):
        lines.append(label.ljust(width) + "".join(x.rjust(cw + 2) for x in cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- mutants


@dataclass
class Kill:
    checker: str
    found: str | None
    seconds: float


def kill_row(m: DeviceMutant, examples: int, steps: int, use_z3: bool = True) -> list[Kill]:
    table = m.apply(load_device_table())
    row: list[Kill] = []
    for check in DEVICE_MUTANT_CHECKS:
        start = time.perf_counter()
        result = explore(table, check)
        row.append(
            Kill(
                check.key,
                result.violation.prop if result.violation else None,
                time.perf_counter() - start,
            )
        )
    start = time.perf_counter()
    target = next(c for c in DEVICE_MUTANT_CHECKS if c.model == "interleavings")
    result = explore(table, target, only=m.breaks)
    row.append(
        Kill(
            "intended",
            result.violation.prop if result.violation else None,
            time.perf_counter() - start,
        )
    )
    if use_z3:
        from model_check.device_path.z3_check import check as z3_check

        start = time.perf_counter()
        found: str | None = None
        for bounds, depth in Z3_CONFIGS:
            report = z3_check(
                table, bounds, depth, induction=False, reachability=False, stop_at_first=True
            )
            if report.violation is not None:
                found = report.violation[0]
                break
        row.append(Kill("z3", found, time.perf_counter() - start))
    from model_check.device_path.machine import run_machine

    start = time.perf_counter()
    found_h = run_machine(table, MACHINE_BOUNDS, max_examples=examples, steps=steps)
    row.append(Kill("hypothesis", found_h.prop if found_h else None, time.perf_counter() - start))
    return row


def survivors(m: DeviceMutant, row: list[Kill]) -> list[str]:
    return [
        k.checker
        for k in row
        if k.found is None or (k.checker == "intended" and k.found != m.breaks)
    ]


def _kill_job(job: tuple[str, int, int, bool]) -> list[Kill]:
    name, examples, steps, use_z3 = job
    return kill_row(device_mutant(name), examples, steps, use_z3)


def kill_matrix(
    examples: int = 300, steps: int = 30, use_z3: bool = True, workers: int = 2
) -> list[tuple[DeviceMutant, list[Kill]]]:
    jobs_ = [(m.name, examples, steps, use_z3) for m in DEVICE_MUTANTS]
    n = min(len(jobs_), os.cpu_count() or 1, workers)
    with ProcessPoolExecutor(
        max_workers=n, mp_context=get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        rows = list(pool.map(_kill_job, jobs_))
    return list(zip(DEVICE_MUTANTS, rows, strict=True))


def matrix_text(rows: list[tuple[DeviceMutant, list[Kill]]]) -> str:
    checkers = [k.checker for k in rows[0][1]]
    nw = max(len(m.name) for m, _ in rows)
    lines = ["mutant".ljust(nw) + "  breaks" + "".join(c.rjust(26) for c in checkers)]
    for m, row in rows:
        cells = [
            (k.found.split("_")[0] if k.found else "SURVIVED") + f" {k.seconds:5.1f}s" for k in row
        ]
        lines.append(
            m.name.ljust(nw)
            + "  "
            + m.breaks.split("_")[0].ljust(6)
            + "".join(c.rjust(26) for c in cells)
        )
    return "\n".join(lines)


def explain(name: str, depth: int = 3) -> str:
    """The shortest counterexample of a device mutant on the explicit model, as text: every
    host call and device step, each host call with the device operations it enqueued."""
    from model_check.device_path.explicit import ExplicitModel

    m = device_mutant(name)
    table = m.apply(load_device_table())
    model = ExplicitModel(table, B32, m.breaks)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_check.device_path", description=__doc__)
    parser.add_argument(
        "command", nargs="?", default="check", choices=("check", "mutants", "explain")
    )
    parser.add_argument("mutant", nargs="?", help="for explain: the device mutant")
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-z3", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "explain":
        print(explain(args.mutant))
        return 0
    if args.command == "mutants":
        rows = kill_matrix(args.examples, args.steps, not args.no_z3)
        print(matrix_text(rows))
        bad = [(m.name, survivors(m, row)) for m, row in rows if survivors(m, row)]
        print(
            f"\n{len(rows)} device mutants, "
            + (f"SURVIVORS: {bad}" if bad else "every one killed by every applicable checker")
        )
        return 1 if bad else 0
    plan = jobs(args.examples, args.steps)
    workers = min(len(plan), os.cpu_count() or 1, 2)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_run_job, plan))
    columns = assemble(dict(zip(plan, results, strict=True)), None)
    print(verdict_table(columns))
    ok = all(c.ok for c in columns)
    for col in columns:
        if col.violation is not None:
            print(f"\n{col.name}: {col.violation.prop}: {col.violation.detail}")
        for note in col.notes:
            print(f"\n{note}")
    print("\nall properties hold" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
