"""The surface shared by every expert-weight provider.

Consumers (``run_with_expert_cache``, the vLLM integration, tests) are typed
against ``ExpertWeightProvider`` only, so the LFRU baseline and the row-level
provider are interchangeable behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias, runtime_checkable

from torch import Tensor

__all__ = ["ExpertWeightProvider", "ExpertWeightResult", "Split", "UniqueIds"]

Split: TypeAlias = Literal["token", "expert"]
"""How a forward that needs more experts than slots is broken up: by token rows
(each chunk's experts fit) or by expert groups (partial outputs are summed)."""

UniqueIds: TypeAlias = Tensor | Sequence[int]
"""Accepted forms of ``prepare``'s explicit expert set."""


@dataclass(frozen=True)
class ExpertWeightResult:
    """What a kernel needs for one forward over the slots.

    ``w1``/``w2`` (and the scales) are the provider's slot buffers themselves,
    indexed by slot, not by expert; ``expert_map`` translates a global expert id
    to its slot and holds -1 for every expert this call did not request (a -1
    entry of ``topk_ids`` is padding, not an expert: it is never mapped). The
    tensors are live buffers: they stay valid until the next host call on the
    provider, which may rewrite them.
    """

    w1: Tensor
    w2: Tensor
    expert_map: Tensor
    w1_scale: Tensor | None = None
    w2_scale: Tensor | None = None


@runtime_checkable
class ExpertWeightProvider(Protocol):
    """A fixed set of device slots caching per-expert weights held on the host.

    Read-only properties let implementations use plain attributes or
    properties alike. ``buf_*`` are allocated once and keep their address for
    the provider's lifetime, because kernels and quantization configs capture
    them.
    """

    @property
    def capacity(self) -> int: ...

    @property
    def split(self) -> Split: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def buf_w13(self) -> Tensor: ...

    @property
    def buf_w2(self) -> Tensor: ...

    @property
    def buf_w13_scale(self) -> Tensor | None: ...

    @property
    def buf_w2_scale(self) -> Tensor | None: ...

    @property
    def buf_w13_scale_2(self) -> Tensor | None: ...

    @property
    def buf_w2_scale_2(self) -> Tensor | None: ...

    @property
    def buf_w13_bias(self) -> Tensor | None: ...

    @property
    def buf_w2_bias(self) -> Tensor | None: ...

    def prepare(self, topk_ids: Tensor, unique_ids: UniqueIds | None = None) -> ExpertWeightResult:
        """Make the requested experts resident and expose exactly them.

        Without ``unique_ids`` the requested set is the distinct values of
        ``topk_ids``; with it, exactly ``unique_ids`` (see
        ``rowcache.validation.requested_experts``). In both, -1 is padding and
        requests nothing.
        """
        ...

    def invalidate(self, expert_id: int) -> None:
        """Forget ``expert_id``'s slot so its next use copies it again."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters, at least ``hits``, ``misses``, ``evictions``, ``resident``, ``capacity``,
        ``prepare_calls``, and what the last ``prepare`` copied: ``last_copies`` (experts)
        and ``last_copy_bytes`` (bytes; 0 for both before the first ``prepare``)."""
        ...
