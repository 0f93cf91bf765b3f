"""Running either path's state machine (``machine`` for the host-planned path,
``device_machine`` for the device-planned one) under hypothesis, with the settings the model
check uses; the violation found (shrunk, unless only the kill counts), or None."""

from __future__ import annotations

from hypothesis.stateful import RuleBasedStateMachine

from model_check.search.device_machine import machine_for as device_machine_for
from model_check.search.machine import machine_for
from model_check.search.property_violated import PropertyViolated
from model_check.table.properties import Violation
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceTable, Table

__all__ = ["run", "run_machine"]


def run_machine(
    table: Table | DeviceTable,
    bounds: Bounds,
    *,
    max_examples: int,
    steps: int,
    derandomize: bool = True,
    lockstep: bool = True,
    shrink: bool = True,
) -> Violation | None:
    """Run the machine of either path's table (the device-planned path's is
    `device_machine.machine_for`); the violation it found, or None. ``shrink=False`` stops at
    the first failing example instead of shrinking it: where only whether the machine finds a
    violation counts (the kill matrix, the tests that a mutant is killed), shrinking took
    nearly all the time (no_release_wait: 26.8 s with it, 0.2 s without), and the property the
    unshrunk example breaks may differ from the shrunk one's."""
    if isinstance(table, DeviceTable):
        machine = device_machine_for(table, bounds)
    else:
        machine = machine_for(table, bounds, lockstep=lockstep)
    return run(
        machine, max_examples=max_examples, steps=steps, derandomize=derandomize, shrink=shrink
    )


def run(
    machine: type[RuleBasedStateMachine],
    *,
    max_examples: int,
    steps: int,
    derandomize: bool,
    shrink: bool = True,
) -> Violation | None:
    """Run a machine of either path; the violation it found (shrunk unless ``shrink=False``),
    or None."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    phases = [Phase.explicit, Phase.reuse, Phase.generate]

    config = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
        phases=[*phases, Phase.shrink] if shrink else phases,
    )
    try:
        run_state_machine_as_test(machine, settings=config)
    except PropertyViolated as found:
        return found.violation
    return None
