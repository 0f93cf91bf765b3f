"""The catalogue of seeded bugs.

Each mutant is a small change to the table (a step dropped, moved, or put on another stream;
a reference function swapped for its buggy twin) together with the property it is expected
to break. A checker's green run means something only because every mutant here turns it red;
`python -m model_check mutants` prints who kills which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from model_check.table.schema import Operation, Step, Table


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str  # the property the bug violates
    description: str
    apply: Callable[[Table], Table]


def _edit(op_name: str, edit: Callable[[Operation], Operation]) -> Callable[[Table], Table]:
    return lambda table: table.with_op(edit(table.op(op_name)))


def _steps(op_name: str, edit: Callable[[list[Step]], list[Step]]) -> Callable[[Table], Table]:
    return _edit(op_name, lambda op: replace(op, steps=tuple(edit(list(op.steps)))))


def _find(steps: list[Step], kind: str, **fields: str) -> int:
    for i, step in enumerate(steps):
        if step.kind == kind and all(getattr(step, k) == v for k, v in fields.items()):
            return i
    raise LookupError(f"no {kind} step with {fields} to mutate")


def _drop(kind: str, **fields: str) -> Callable[[list[Step]], list[Step]]:
    def edit(steps: list[Step]) -> list[Step]:
        del steps[_find(steps, kind, **fields)]
        return steps

    return edit


def _restream(kind: str, stream: str, **fields: str) -> Callable[[list[Step]], list[Step]]:
    def edit(steps: list[Step]) -> list[Step]:
        i = _find(steps, kind, **fields)
        steps[i] = replace(steps[i], stream=stream)
        return steps

    return edit


def _ready_before_copies(steps: list[Step]) -> list[Step]:
    ready = steps.pop(_find(steps, "record_event", event="ready"))
    steps.insert(_find(steps, "copy_rows"), ready)
    return steps


def _resident_map_first_on_current(steps: list[Step]) -> list[Step]:
    moved = [replace(s, stream="current") if s.stream else s for s in steps if s.ring == "resident"]
    return moved + [s for s in steps if s.ring != "resident"]


def _no_resident_reuse_event(steps: list[Step]) -> list[Step]:
    return [s for s in steps if not (s.kind == "release_staging" and s.ring == "resident")]


def _sync_owner_first(steps: list[Step]) -> list[Step]:
    return [Step(kind="host_sync", stream="owner"), *steps]


def _flag_wait_ready(steps: list[Step]) -> list[Step]:
    i = _find(steps, "wait_event", event="ready")
    steps[i] = replace(steps[i], kind="wait_flag")
    i = _find(steps, "wait_event", event="release")
    steps[i] = replace(steps[i], kind="wait_flag")
    return steps


def _hit_path_on_handoff(keep: tuple[str, ...]) -> Callable[[list[Step]], list[Step]]:
    """Steps guarded by misses_or_handoff run on misses only, except those of a kind in
    `keep`: an all-hit call from another stream skips (part of) the handoff."""

    def edit(steps: list[Step]) -> list[Step]:
        hits = [i for i, s in enumerate(steps) if s.when == "misses_or_handoff"]
        if not hits:
            raise LookupError("no misses_or_handoff step to mutate")
        for i in hits:
            if steps[i].kind not in keep and not (
                steps[i].kind == "wait_event" and steps[i].event in keep
            ):
                steps[i] = replace(steps[i], when="misses")
        return steps

    return edit


def _both(*edits: Callable[[Table], Table]) -> Callable[[Table], Table]:
    def apply(table: Table) -> Table:
        for edit in edits:
            table = edit(table)
        return table

    return apply


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "no_release_wait",
        "P1_no_overwrite_under_reader",
        "the copy stream does not wait on the release event before overwriting slots",
        _steps("prepare", _drop("wait_event", event="release")),
    ),
    Mutant(
        "release_on_current",
        "P1_no_overwrite_under_reader",
        "release is recorded on the current stream, not on the previous owner's",
        _steps("prepare", _restream("record_event", "current", event="release")),
    ),
    Mutant(
        "owner_not_updated",
        "P1_no_overwrite_under_reader",
        "prepare never makes the current stream the owner, so release is recorded on a "
        "stream the last forward may not have used",
        _edit("prepare", lambda op: replace(op, set_owner="")),
    ),
    Mutant(
        "hit_path_ignores_handoff",
        "P1_no_overwrite_under_reader",
        "an all-hit prepare from another stream skips the handoff too, so the next release, "
        "recorded on the new owner, does not cover the old owner's pending reads",
        _steps("prepare", _hit_path_on_handoff(keep=())),
    ),
    Mutant(
        "handoff_without_ready_wait",
        "P2_no_stale_read",
        "an all-hit prepare from another stream records release and ready but the current "
        "stream does not wait on ready, so its reads may overtake copies still in flight",
        _steps("prepare", _hit_path_on_handoff(keep=("record_event", "release"))),
    ),
    Mutant(
        "ready_before_copies",
        "P2_no_stale_read",
        "the ready event is recorded before the copies are enqueued",
        _steps("prepare", _ready_before_copies),
    ),
    Mutant(
        "no_ready_wait",
        "P2_no_stale_read",
        "the current stream does not wait on the ready event",
        _steps("prepare", _drop("wait_event", event="ready")),
    ),
    Mutant(
        "ready_on_current",
        "P2_no_stale_read",
        "ready is recorded on the current stream instead of the copy stream",
        _steps("prepare", _restream("record_event", "current", event="ready")),
    ),
    Mutant(
        "resident_map_on_current_first",
        "P4_map_convergence",
        "the resident map is uploaded on the current stream before the release wait",
        _steps("prepare", _resident_map_first_on_current),
    ),
    Mutant(
        "invalidate_map_on_current",
        "P4_map_convergence",
        "invalidate writes the resident map on the current stream, not the owner's",
        _steps(
            "invalidate",
            lambda s: _restream("release_staging", "current")(
                _restream("upload_map", "current")(s)
            ),
        ),
    ),
    Mutant(
        "keep_victim_mapped",
        "P4_map_convergence",
        "an evicted expert keeps its entry in the resident map",
        _edit("prepare", lambda op: replace(op, effect="plan_prepare_keep_victim_mapped")),
    ),
    Mutant(
        "victim_not_protected",
        "P5_victim_protection",
        "the LRU victim may be an expert the same call requested",
        _edit("prepare", lambda op: replace(op, effect="plan_prepare_unprotected_victim")),
    ),
    Mutant(
        "forward_map_from_resident",
        "P3_forward_map_exact",
        "the forward map exposes every resident expert, not just the requested ones",
        _edit("prepare", lambda op: replace(op, effect="plan_prepare_forward_from_resident")),
    ),
    Mutant(
        "staging_reuse_without_event",
        "P6_staging_lifetime",
        "no reuse event is recorded for resident-map staging buffers",
        _both(
            _steps("prepare", _no_resident_reuse_event),
            _steps("invalidate", _no_resident_reuse_event),
        ),
    ),
    Mutant(
        "forward_reuse_event_on_copy",
        "P6_staging_lifetime",
        "the forward-map staging buffer's reuse event is recorded on the copy stream, which "
        "reaches it before the upload on the current stream ran",
        _steps("prepare", _restream("release_staging", "copy", ring="forward")),
    ),
    Mutant(
        "host_sync_on_owner",
        "P8_no_host_block_on_reader",
        "prepare synchronizes the owner stream before enqueueing",
        _steps("prepare", _sync_owner_first),
    ),
    Mutant(
        "validate_after_touch",
        "P9_validation_first",
        "prepare refreshes the LRU position of requested experts before validating the call",
        _edit("prepare", lambda op: replace(op, before_guard=("touch_requested",))),
    ),
    Mutant(
        "wait_for_latest_record",
        "P7_no_deadlock",
        "the waits on release and ready wait for the event's latest record when they execute "
        "(a device-side flag), not for the snapshot taken when the wait was enqueued",
        _steps("prepare", _flag_wait_ready),
    ),
)


def mutant(name: str) -> Mutant:
    for m in MUTANTS:
        if m.name == name:
            return m
    raise KeyError(f"no mutant named {name!r}; known: {', '.join(m.name for m in MUTANTS)}")
