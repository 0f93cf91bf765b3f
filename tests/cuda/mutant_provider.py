"""Test-only switch: the real CUDA provider running schedules generated from a mutated table.

``model_check.table.mutants.mutant(name).apply(load_table())`` changes the table;
``model_check.codegen.generate`` turns it into schedule source exactly as it does for the
shipped ``rowcache/schedules/_generated.py``; the module is compiled in memory and installed on
one provider instance (its ``_run_prepare`` / ``_run_invalidate`` attributes, which exist for
this). Nothing here is importable from the ``rowcache`` package, and no mutant is ever written
to disk.

Which mutants run on the GPU: those that change a schedule (a step or the owner update). The
others change a reference function of the host bookkeeping (guard, effect, pre-guard), which
the provider implements by hand, not from the table: ``tests/test_conformance.py`` catches
those on the CPU. ``NOT_ON_GPU`` names the schedule mutants the CUDA backend cannot run.

A GPU mutant is the model mutant of the same name (``model_check.table.mutants.mutant(name)``):
``explain_calls(name)`` is the host-call sequence of the counterexample ``python -m model_check
explain NAME`` prints for it, which the CUDA machine's shrunk counterexamples are held to
(``host_call_machine.judge``).
"""

from __future__ import annotations

import functools
import types
from typing import Any

from model_check import codegen
from model_check.search import explore
from model_check.table import Step, Table, load_table
from model_check.table.mutants import MUTANTS, mutant
from model_check.table.reference import Bounds
from rowcache import RowCacheWeightProvider

HostCall = tuple[str, tuple[object, ...], int]
"""One host call as the models take it: (operation, arguments, consumer stream)."""

NOT_ON_GPU: dict[str, str] = {
    "wait_for_latest_record": "uses wait_flag, a wait on an event's future record: CUDA has no "
    "such call, and CudaBackend.wait_flag raises (the explicit model kills it as a deadlock)",
}

REQUIRED = ("no_release_wait", "no_ready_wait", "resident_map_on_current_first")
"""The mutants issue 6 names; each must be detected on the GPU."""


def _schedule(table: Table) -> tuple[tuple[str, tuple[Step, ...], str], ...]:
    return tuple((op.name, op.steps, op.set_owner) for op in table.operations)


def schedule_mutants() -> tuple[str, ...]:
    """Every catalogued mutant that changes a generated schedule (NOT_ON_GPU excluded)."""
    table = load_table()
    base = _schedule(table)
    return tuple(
        m.name for m in MUTANTS if _schedule(m.apply(table)) != base and m.name not in NOT_ON_GPU
    )


def host_mutants() -> tuple[str, ...]:
    """Mutants of the host bookkeeping only (their generated schedules are the real ones)."""
    table = load_table()
    base = _schedule(table)
    return tuple(m.name for m in MUTANTS if _schedule(m.apply(table)) == base)


def mutant_table(name: str) -> Table:
    """The table of model mutant ``name``."""
    return mutant(name).apply(load_table())


def schedules_for(name: str) -> types.ModuleType:
    """The schedules codegen writes for mutant ``name``'s table, as an in-memory module."""
    table = mutant_table(name)
    module = types.ModuleType(f"mutant_schedules_{name}")
    source = codegen.generate(table)
    exec(compile(source, f"<schedules of mutant {name}>", "exec"), module.__dict__)
    return module


def install(provider: RowCacheWeightProvider, name: str) -> RowCacheWeightProvider:
    """Make ``provider`` run mutant ``name``'s schedules from now on."""
    module = schedules_for(name)
    provider._run_prepare = module.run_prepare
    provider._run_invalidate = module.run_invalidate
    return provider


def mutant_provider(name: str, *args: Any, **kwargs: Any) -> RowCacheWeightProvider:
    """``RowCacheWeightProvider(*args, **kwargs)`` running mutant ``name``'s schedules."""
    return install(RowCacheWeightProvider(*args, **kwargs), name)


EXPLAIN_BOUNDS = Bounds(num_experts=3, capacity=2)
EXPLAIN_DEPTH = 4
"""The search ``python -m model_check explain MUTANT`` runs (``model_check.cli.cmd_explain``
and its ``--depth`` default): every interleaving, only the mutant's property, these bounds."""


@functools.cache
def explain_calls(name: str, depth: int = EXPLAIN_DEPTH) -> tuple[HostCall, ...] | None:
    """The host calls (device steps left out) of the counterexample ``python -m model_check
    explain NAME --depth DEPTH`` prints for model mutant ``name``; None where it finds none.

    The search is breadth-first by host calls: it expands states in the order of the number of
    host calls that reach them, and a violation found while expanding a state reached by d
    calls has d calls (a device step) or d + 1 (a host call). A smaller ``depth`` expands the
    same states in the same order up to it, so it finds the very counterexample of the default
    depth when that one is found at depth ``depth`` or less, and none otherwise."""
    m = mutant(name)
    found = explore(
        m.apply(load_table()), EXPLAIN_BOUNDS, depth, model="interleavings", only=m.breaks
    )
    if found.violation is None:
        return None
    return tuple((a.op, a.args, a.stream) for a, _ in found.trace if a.kind == "host")
