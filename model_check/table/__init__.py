"""The specification: the transition table (`schema`: loading and validating
spec/table.toml, both sections), the reference host functions it names (`reference`; the
device-planned path's kernels and their reference, `device_functions`), the host half of a
call (`host`: guard, effect, P3/P5/P9), the properties (`properties`) and the seeded bugs
(`mutants`), of both paths.

Nothing here knows about streams: the semantics that interpret the table's steps live in
`model_check.streams`.
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
