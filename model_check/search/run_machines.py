"""Running either path's state machine (``machine`` for the host-planned path,
``device_machine`` for the device-planned one) under hypothesis, with the settings the model
check uses; the violation found after shrinking, or None."""

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
) -> Violation | None:
    """Run the machine of either path's table (the device-planned path's is
    `device_machine.machine_for`); the violation it found (after shrinking), or None."""
    if isinstance(table, DeviceTable):
        machine = device_machine_for(table, bounds)
    else:
        machine = machine_for(table, bounds, lockstep=lockstep)
    return run(machine, max_examples=max_examples, steps=steps, derandomize=derandomize)


def run(
    machine: type[RuleBasedStateMachine], *, max_examples: int, steps: int, derandomize: bool
) -> Violation | None:
    """Run a machine of either path; the violation it found (after shrinking), or None."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    config = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        report_multiple_bugs=False,
    )
    try:
        run_state_machine_as_test(machine, settings=config)
    except PropertyViolated as found:
        return found.violation
    return None
