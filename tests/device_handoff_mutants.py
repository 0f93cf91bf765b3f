"""Test-only: the device-planned provider running the handoff generated from a mutated table.

The device-planned provider runs the handoff of each of its calls through the functions
``python -m model_check.codegen`` writes from the table's ``[device]`` section
(``rowcache/schedules/_device_generated.py``: ``handoff_<op>``), held on the provider as
``_handoff_<op>`` attributes. Here a mutated table goes through the very same generator
(``model_check.codegen.generate_device``), the module is compiled in memory and its functions
are installed on one provider instance: the provider then runs the mutant's order of records
and waits, on the mutant's streams. Nothing is written to disk, and nothing here is importable
from ``rowcache``.

``MUTANTS`` names the tables of the device handoff mutants a test installs: the catalogue's
(``model_check.table.mutants.device_mutant``) whose generated handoff differs from the real
one, and ``replay_without_handoff``, made here (see ``replay_without_handoff``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from model_check import codegen
from model_check.table.mutants import device_mutant
from model_check.table.schema import DeviceTable, load_device_table

HANDOFF_KINDS = ("record_event", "wait_event")
HANDOFF_OPS = ("handoff", "replay")


def replay_without_handoff(table: DeviceTable) -> DeviceTable:
    """The handoff before a replay records and waits for nothing: the ``handoff`` operation
    (the provider's ``handoff()``, whose code is generated) and the ``replay`` operation (the
    model's account of the consumer's replay, which begins with that call) lose their record
    and wait. A replay on another stream than the owner's then overwrites slots that a reader
    on the owner stream may not have read yet (P1)."""
    for name in HANDOFF_OPS:
        op = table.op(name)
        steps = tuple(s for s in op.steps if s.kind not in HANDOFF_KINDS)
        assert len(steps) < len(op.steps), f"{name} has no handoff to drop"
        table = table.with_op(replace(op, steps=steps))
    return table


def _catalogued(name: str) -> Callable[[DeviceTable], DeviceTable]:
    return lambda table: device_mutant(name).apply(table)


MUTANTS: dict[str, Callable[[DeviceTable], DeviceTable]] = {
    "replay_without_handoff": replay_without_handoff,
    "dp_prepare_skips_handoff": _catalogued("dp_prepare_skips_handoff"),
    "dp_invalidate_on_current": _catalogued("dp_invalidate_on_current"),
    "dp_invalidate_takes_no_owner": _catalogued("dp_invalidate_takes_no_owner"),
    "dp_check_errors_on_current": _catalogued("dp_check_errors_on_current"),
}
"""Mutant name -> the change of the table."""


def mutant_table(name: str) -> DeviceTable:
    """The device table of mutant ``name``."""
    return MUTANTS[name](load_device_table())


def handoffs_for(table: DeviceTable, label: str = "mutant") -> types.ModuleType:
    """The module ``model_check.codegen`` generates for ``table``, compiled in memory."""
    name = f"device_handoffs_of_{label}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while building the class
    try:
        source = codegen.generate_device(table)
        exec(compile(source, f"<handoff of {label}>", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


def install(provider: Any, table: DeviceTable, label: str = "mutant") -> Any:
    """Make ``provider`` (a ``DevicePlannedProvider``) run ``table``'s generated handoff."""
    module = handoffs_for(table, label)
    for op in module.PROVIDER_OPERATIONS:
        attribute = f"_handoff_{op}"
        assert hasattr(provider, attribute), f"the provider runs no generated {attribute}"
        setattr(provider, attribute, getattr(module, f"handoff_{op}"))
    return provider


def install_mutant(provider: Any, name: str) -> Any:
    """Make ``provider`` run the handoff generated from mutant ``name``'s table."""
    return install(provider, mutant_table(name), name)
