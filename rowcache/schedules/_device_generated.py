"""Stream handoff of the device-planned provider: one function per provider operation
of the table's [device] section.

Generated from spec/table.toml by `python -m model_check.codegen`; do not edit.

Each `handoff_<op>(events, current, owner)` runs the operation's handoff steps (record
and wait an event) on the streams their roles name (`owner` is None before the first
owner; the owner role is then the current stream) and returns a `Takeover`: the stream
the operation's other steps run on (None: it has none), the owner after the call, and
whether the handoff ran. Capture is not the table's: a call during a CUDA graph capture
changes no owner, and the provider does not call these then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = [
    "PROVIDER_OPERATIONS",
    "Events",
    "Takeover",
    "handoff_check_errors",
    "handoff_device_invalidate",
    "handoff_device_prepare",
    "handoff_handoff",
]

S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)

PROVIDER_OPERATIONS: tuple[str, ...] = (
    "device_prepare",
    "handoff",
    "device_invalidate",
    "check_errors",
)


class Events(Protocol[S_contra]):
    """Record a named event on a stream; make a stream wait for it."""

    def record_event(self, stream: S_contra, event: str) -> None: ...

    def wait_event(self, stream: S_contra, event: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Takeover(Generic[S]):
    """The streams of one provider call after its handoff."""

    work: S | None  # the stream of the operation's other steps (None: it has none)
    owner: S | None  # the owner after the call
    handed_over: bool  # the handoff's steps ran


def handoff_device_prepare(events: Events[S], current: S, owner: S | None) -> Takeover[S]:
    """device_prepare(ids, pass): guard valid_pass; owner := current.

    Steps, in table order (the handoff here; the provider runs the others on `work`):
      0. record_event on owner event=handoff when=owner_change
      1. wait_event on current event=handoff when=owner_change
      2. plan on current fn=plan_pass
      3. gather on current fn=gather_listed
    """
    on_owner = current if owner is None else owner
    handed_over = owner is not None and owner != current
    if handed_over:
        events.record_event(on_owner, "handoff")
        events.wait_event(current, "handoff")
    return Takeover(current, current, handed_over)


def handoff_handoff(events: Events[S], current: S, owner: S | None) -> Takeover[S]:
    """handoff(): guard always; owner := current.

    Steps, in table order (the handoff here; the provider runs the others on `work`):
      0. record_event on owner event=handoff when=owner_change
      1. wait_event on current event=handoff when=owner_change
    """
    on_owner = current if owner is None else owner
    handed_over = owner is not None and owner != current
    if handed_over:
        events.record_event(on_owner, "handoff")
        events.wait_event(current, "handoff")
    return Takeover(None, current, handed_over)


def handoff_device_invalidate(events: Events[S], current: S, owner: S | None) -> Takeover[S]:
    """device_invalidate(expert): guard valid_invalidate; owner := current_if_none.

    Steps, in table order (the handoff here; the provider runs the others on `work`):
      0. free_slot on owner fn=free_expert
    """
    on_owner = current if owner is None else owner
    return Takeover(on_owner, on_owner, False)


def handoff_check_errors(events: Events[S], current: S, owner: S | None) -> Takeover[S]:
    """check_errors(): guard always; owner := current_if_none.

    Steps, in table order (the handoff here; the provider runs the others on `work`):
      0. read_errors on owner
      1. host_sync on owner
      2. reset_errors on owner
      3. report
    """
    on_owner = current if owner is None else owner
    return Takeover(on_owner, on_owner, False)
