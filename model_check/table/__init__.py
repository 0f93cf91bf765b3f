"""The specification: the transition table (`schema`: loading and validating
spec/table.toml), the reference host functions it names (`reference`), the host half of a
call (`host`: guard, effect, P3/P5/P9), the properties (`properties`) and the seeded bugs
(`mutants`).

Nothing here knows about the device: the device semantics that interpret the table's steps
live in `model_check.device`.
"""

from model_check.table.schema import (
    EVENTS,
    HOST_ONLY_KINDS,
    RINGS,
    STEP_KINDS,
    STREAM_ROLES,
    TABLE_PATH,
    WHENS,
    Operation,
    Step,
    Table,
    TableError,
    load_table,
    parse_table,
)

__all__ = [
    "EVENTS",
    "HOST_ONLY_KINDS",
    "RINGS",
    "STEP_KINDS",
    "STREAM_ROLES",
    "TABLE_PATH",
    "WHENS",
    "Operation",
    "Step",
    "Table",
    "TableError",
    "load_table",
    "parse_table",
]
