"""The failure both paths' state machines raise when a property breaks (``machine``,
``device_machine``); ``run_machines`` turns it back into the violation found."""

from __future__ import annotations

from model_check.table.properties import Violation

__all__ = ["PropertyViolated"]


class PropertyViolated(AssertionError):
    """A state machine's step broke ``violation``, found by ``checker``."""

    def __init__(self, violation: Violation, checker: str) -> None:
        super().__init__(f"{checker}: {violation.prop}: {violation.detail}")
        self.violation = violation
