"""Device schedules of the row-level provider: one function per operation of the table.

Generated from spec/table.toml by `python -m model_check.codegen`; do not edit.

Each `run_<op>` calls the backend method of each of the operation's steps, in table
order, on the stream its role names, and returns the stream that becomes the owner
(None: the owner is unchanged).
"""

from __future__ import annotations

from rowcache.backends.base import Backend, ConsumerBackend, Plan, Roles, S

__all__ = [
    "CONSUMER_OPERATIONS",
    "PROVIDER_OPERATIONS",
    "run_invalidate",
    "run_prepare",
    "run_read",
    "run_synchronize",
]

PROVIDER_OPERATIONS: tuple[str, ...] = ("prepare", "invalidate")
CONSUMER_OPERATIONS: tuple[str, ...] = ("read", "synchronize")


def run_prepare(backend: Backend[S], ctx: Roles[S], plan: Plan) -> S | None:
    """prepare(ids): guard valid_prepare, effect plan_prepare; owner := current.

    Steps, in table order:
      0. record_event on owner event=release when=misses_or_handoff
      1. wait_event on copy event=release when=misses_or_handoff
      2. copy_rows on copy when=misses
      3. write_staging ring=resident when=changed
      4. upload_map on copy ring=resident when=changed
      5. release_staging on copy ring=resident when=changed
      6. record_event on copy event=ready when=misses_or_handoff
      7. wait_event on current event=ready when=misses_or_handoff
      8. write_staging ring=forward
      9. upload_map on current ring=forward
      10. release_staging on current ring=forward
    """
    if plan.copies or ctx.owner != ctx.current:
        backend.record_event(ctx.owner, "release")
        backend.wait_event(ctx.copy, "release")
    if plan.copies:
        backend.copy_rows(ctx.copy, plan.copies)
    if plan.changed:
        backend.write_staging("resident", plan.resident)
        backend.upload_map(ctx.copy, "resident")
        backend.release_staging(ctx.copy, "resident")
    if plan.copies or ctx.owner != ctx.current:
        backend.record_event(ctx.copy, "ready")
        backend.wait_event(ctx.current, "ready")
    backend.write_staging("forward", plan.forward)
    backend.upload_map(ctx.current, "forward")
    backend.release_staging(ctx.current, "forward")
    return ctx.current


def run_invalidate(backend: Backend[S], ctx: Roles[S], plan: Plan) -> S | None:
    """invalidate(expert): guard valid_invalidate, effect plan_invalidate.

    Steps, in table order:
      0. write_staging ring=resident when=changed
      1. upload_map on owner ring=resident when=changed
      2. release_staging on owner ring=resident when=changed
    """
    if plan.changed:
        backend.write_staging("resident", plan.resident)
        backend.upload_map(ctx.owner, "resident")
        backend.release_staging(ctx.owner, "resident")
    return None


def run_read(backend: ConsumerBackend[S], ctx: Roles[S], plan: Plan) -> S | None:
    """read(): guard has_forward, effect no_change.

    A consumer operation: the provider never runs it; tests use it.

    Steps, in table order:
      0. consumer_read on owner
    """
    backend.consumer_read(ctx.owner, plan.forward_pairs)
    return None


def run_synchronize(backend: Backend[S], ctx: Roles[S], plan: Plan) -> S | None:
    """synchronize(): guard always, effect no_change.

    A consumer operation: the provider never runs it; tests use it.

    Steps, in table order:
      0. host_sync on all
    """
    backend.host_sync(None, "all")
    return None
