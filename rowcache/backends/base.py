"""The interface between the generated schedules and a device.

``rowcache/schedules/_generated.py`` is generated from ``spec/table.toml``: for each operation
of the table it calls the methods of a ``Backend`` in the table's step order, one method per
step kind, with stream roles already resolved through a ``Roles`` and ``when`` conditions tested
on a ``Plan``. A backend decides what a step means on its device: the CUDA backend enqueues
stream work, the CPU backend does the same work synchronously, the recording backend writes
the trace line the model (``model_check.streams.queues``) writes for that step.

Backends are bound to one provider (``bind``) and are not shared between providers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from torch import Tensor

from rowcache.sources import ExpertSources, SlotBuffers

__all__ = ["RINGS", "Backend", "ConsumerBackend", "MapContent", "Plan", "Roles", "S", "map_values"]

S = TypeVar("S")
"""A backend's stream type (``torch.cuda.Stream``, a label for the recording backend...)."""

RINGS = ("resident", "forward")
"""Map rings named by the table: the resident map (expert -> slot of every resident expert)
and the forward map (expert -> slot of the experts the last ``prepare`` exposes)."""


@dataclass(frozen=True, slots=True)
class Roles(Generic[S]):
    """The table's stream roles resolved for one host call.

    ``owner`` is the stream of the previous accepted ``prepare``, or ``current`` when there was
    none; ``copy`` is the provider's own copy stream.
    """

    current: S
    owner: S
    copy: S


MapContent = Sequence[int] | Tensor
"""A full map (one int32 entry per expert) as ``write_staging`` receives it: a sequence of
ints, or a CPU int32 tensor ``[E]`` (the provider passes views of its host mirrors, so that
staging a map is one memory copy, not a conversion of E Python ints)."""


def map_values(content: MapContent) -> list[int]:
    """The entries of a map as Python ints (for backends that keep a copy as a list)."""
    if isinstance(content, Tensor):
        values: list[int] = content.tolist()
        return values
    return list(content)


class Plan(NamedTuple):
    """What one accepted host call needs its steps to do (immutable; a tuple because one is
    built on every ``prepare``, where a frozen dataclass's constructor costs a microsecond).

    ``copies``: (expert, slot) for every miss, in copy order (ascending expert id); a step with
    ``when = "misses"`` runs when it is non-empty. ``changed``: the call changed the resident
    map (``when = "changed"``). ``resident`` and ``forward``: the full maps (one slot per expert,
    -1 elsewhere) that ``write_staging`` puts into the ``"resident"`` and ``"forward"`` rings;
    they may be live views of the provider's host mirrors, valid until the next host call.
    ``forward_pairs``: (expert, slot) of the exposed experts, ascending, for consumer steps.
    """

    copies: Sequence[tuple[int, int]] = ()
    changed: bool = False
    resident: MapContent = ()
    forward: MapContent = ()
    forward_pairs: Sequence[tuple[int, int]] = ()


class Backend(Protocol[S]):
    """One method per step kind of the table, plus binding and the stream handles.

    Every step method is non-blocking for the host except ``host_sync`` (and the CPU backend,
    whose device work is host work). ``content`` passed to ``write_staging`` is only valid for
    the duration of the call: a backend copies it.
    """

    def bind(self, sources: ExpertSources, slots: SlotBuffers) -> None:
        """Attach the provider's sources and slot buffers; called once, before any step."""
        ...

    @property
    def forward_map(self) -> Tensor:
        """The int32 ``[E]`` map the consumer indexes (written by forward-ring uploads)."""
        ...

    @property
    def resident_map(self) -> Tensor:
        """The int32 ``[E]`` device mirror of the resident map (resident-ring uploads)."""
        ...

    @property
    def copy_stream(self) -> S:
        """The provider-owned stream that the ``copy`` role names."""
        ...

    def current_stream(self) -> S:
        """The stream the host call is made on (the ``current`` role)."""
        ...

    def record_event(self, stream: S, event: str) -> None:
        """``event.record(stream)``: snapshot the work enqueued on ``stream`` so far."""
        ...

    def wait_event(self, stream: S, event: str) -> None:
        """``stream.wait_event(event)``: later work on ``stream`` waits for the snapshot."""
        ...

    def wait_flag(self, stream: S, event: str) -> None:
        """Wait on the event's latest snapshot at run time (a kind mutants use)."""
        ...

    def copy_rows(self, stream: S, copies: Sequence[tuple[int, int]]) -> None:
        """For each (expert, slot), copy the expert's rows of every source into the slot."""
        ...

    def write_staging(self, ring: str, content: MapContent) -> None:
        """Host write of ``content`` into a free staging buffer of ``ring`` (never blocking)."""
        ...

    def upload_map(self, stream: S, ring: str) -> None:
        """Non-blocking copy of ``ring``'s staged buffer into its device map, on ``stream``."""
        ...

    def release_staging(self, stream: S, ring: str) -> None:
        """Record the staged buffer's reuse event on ``stream`` (after its upload)."""
        ...

    def host_sync(self, stream: S | None, role: str) -> None:
        """Block the host until ``stream`` drains (every stream when ``None``); ``role`` is the
        table's name for it (``"all"`` for every stream)."""
        ...


class ConsumerBackend(Backend[S], Protocol[S]):
    """A backend that can also stand in for the consumer (tests and the recording backend)."""

    def consumer_read(self, stream: S, pairs: Sequence[tuple[int, int]]) -> None:
        """The consumer's kernels read the slots of ``pairs`` (expert, slot) on ``stream``."""
        ...
