"""``CachedWeightProvider``: the LFRU baseline, after vLLM PR 37190.

Written from that proposal's public description (``--moe-expert-cache-size``):
a fixed number of device slots per layer, per-expert weights in pinned host
memory, misses copied into slots on the current stream, eviction by frequency
over recency. It is the baseline the row-level provider is measured against,
so it keeps the baseline's ordering model on purpose: everything is enqueued
on whatever stream is current, with no copy stream and no events. That is
only safe while every ``prepare`` and every reader of its slots run on one
stream; a change of stream between calls is not ordered (``owner_changes`` is
always 0 because ownership is not tracked).

Eviction (LFRU): each expert has a frequency (number of accepted ``prepare``
calls that requested it, kept across evictions) and an age (``prepare`` calls
since it was last requested, at least 1). When a call needs slots and none
are free, the victims are the resident experts *not requested by this call*
with the lowest ``frequency / age``; ties go to the least recently used, then
to the lowest expert id, so that eviction is deterministic.
"""

from __future__ import annotations

import heapq

import torch
from torch import Tensor

from rowcache.guard import CallGuard
from rowcache.surface import SlotSurface
from rowcache.types import ExpertWeightResult, Split, UniqueIds
from rowcache.validation import requested_experts

__all__ = ["CachedWeightProvider"]


class CachedWeightProvider(SlotSurface):
    """LFRU expert-weight cache with ``capacity`` device slots.

    Host calls must be sequential (a concurrent call raises
    ``ConcurrentCallError``), and all of a forward's reads of the returned
    buffers must be enqueued on the current stream before the next host call.

    Host memory: by default the provider copies the expert tensors it is given, once, into
    host memory it owns (pinned for CUDA), so that a later in-place write by the caller
    changes nothing a ``prepare`` serves; drop yours after construction to keep one host copy.
    ``share_sources=True`` keeps the caller's tensors instead (no copy: for CUDA they must
    already be pinned; not with ``layout="packed"``), and the caller then owns their contents
    (``rowcache.sources.ExpertSources`` says what an in-place write does then).
    """

    def __init__(
        self,
        w13: Tensor,
        w2: Tensor,
        w13_scale: Tensor | None = None,
        w2_scale: Tensor | None = None,
        *,
        capacity: int,
        split: Split = "token",
        device: torch.device | str,
        w13_scale_2: Tensor | None = None,
        w2_scale_2: Tensor | None = None,
        w13_bias: Tensor | None = None,
        w2_bias: Tensor | None = None,
        share_sources: bool = False,
    ) -> None:
        self._set_up_slots(
            w13,
            w2,
            w13_scale,
            w2_scale,
            w13_scale_2,
            w2_scale_2,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            capacity=capacity,
            split=split,
            device=torch.device(device),
            share_sources=share_sources,
        )
        num_experts = self._num_experts
        self._copy_pairs: list[tuple[Tensor, Tensor]] = [
            (buf, src)
            for buf, src in zip(self._slots.tensors(), self._sources.tensors(), strict=True)
            if buf is not None and src is not None
        ]

        self._slot_of = [-1] * num_experts
        self._expert_in_slot = [-1] * capacity
        # Popped from the end, so slot 0 fills first and a freed slot is reused next.
        self._free = list(range(capacity - 1, -1, -1))
        self._frequency = [0] * num_experts
        self._last_use = [0] * num_experts
        self._exposed: set[int] = set()

        # The host copy is rebuilt per call and uploaded whole: one transfer
        # instead of one per changed entry.
        self._host_map = torch.full((num_experts,), -1, dtype=torch.int32)
        self._expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=self._device)

        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._invalidations = 0
        self._prepare_calls = 0
        self._last_copies = 0  # experts the last accepted prepare copied
        self._guard = CallGuard(type(self).__name__)

    # -- surface -----------------------------------------------------------

    def prepare(self, topk_ids: Tensor, unique_ids: UniqueIds | None = None) -> ExpertWeightResult:
        """Make the requested experts resident and return a map exposing exactly them.

        The request is validated in full first (see
        ``rowcache.validation.requested_experts``); a rejected call changes
        nothing. The returned tensors are live buffers, valid until the next
        host call.
        """
        with self._guard("prepare"):
            requested = requested_experts(
                topk_ids, unique_ids, self._num_experts, self._capacity, device=self._device
            )
            self._prepare_calls += 1
            now = self._prepare_calls
            slot_of = self._slot_of
            misses = [e for e in requested if slot_of[e] < 0]
            self._hits += len(requested) - len(misses)
            self._misses += len(misses)
            self._last_copies = len(misses)
            for e in requested:
                self._frequency[e] += 1
                self._last_use[e] = now
            shortfall = len(misses) - len(self._free)
            if shortfall > 0:
                for victim in self._victims(shortfall, requested, now):
                    self._release(victim)
                    self._evictions += 1
            for e in misses:
                self._fill(e, self._free.pop())
            self._publish(requested)
            return ExpertWeightResult(
                w1=self._slots.w13,
                w2=self._slots.w2,
                expert_map=self._expert_map,
                w1_scale=self._slots.w13_scale,
                w2_scale=self._slots.w2_scale,
            )

    def invalidate(self, expert_id: int) -> None:
        """Free ``expert_id``'s slot so its next request copies it again.

        A non-resident expert is a no-op; an id outside ``[0, E)`` is rejected.
        If the last ``prepare`` exposed the expert, its map entry becomes -1.
        """
        with self._guard("invalidate"):
            self._check_expert_id(expert_id)
            if self._slot_of[expert_id] < 0:
                return
            self._release(expert_id)
            self._invalidations += 1
            if expert_id in self._exposed:
                self._exposed.discard(expert_id)
                self._host_map[expert_id] = -1
                self._expert_map.copy_(self._host_map)

    def stats(self) -> dict[str, int]:
        """Counters since construction, the slots in use, and what the last accepted
        ``prepare`` copied: ``last_copies`` experts, ``last_copy_bytes`` bytes (0 for an
        all-hit one; a rejected call changes neither)."""
        return {
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
            "resident": self._capacity - len(self._free),
            "capacity": self._capacity,
            "prepare_calls": self._prepare_calls,
            "owner_changes": 0,
            "invalidations": self._invalidations,
            "last_copies": self._last_copies,
            "last_copy_bytes": self._last_copies * self._sources.expert_bytes,
            "slot_bytes": self._slots.slot_bytes,
            "host_bytes": self._sources.host_bytes,
        }

    def resident_experts(self) -> dict[int, int]:
        """Resident expert id -> slot, for inspection and tests."""
        return {e: s for s, e in enumerate(self._expert_in_slot) if e >= 0}

    # -- internals ---------------------------------------------------------

    def _victims(self, count: int, requested: list[int], now: int) -> list[int]:
        protected = set(requested)
        candidates = [e for e in self._expert_in_slot if e >= 0 and e not in protected]
        frequency, last_use = self._frequency, self._last_use

        def key(e: int) -> tuple[float, int, int]:
            age = max(1, now - last_use[e])
            return (frequency[e] / age, last_use[e], e)

        # Enough candidates always exist: the request fits capacity and its
        # resident experts hold slots that are not candidates.
        return heapq.nsmallest(count, candidates, key=key)

    def _release(self, expert: int) -> None:
        slot = self._slot_of[expert]
        self._slot_of[expert] = -1
        self._expert_in_slot[slot] = -1
        self._free.append(slot)

    def _fill(self, expert: int, slot: int) -> None:
        self._slot_of[expert] = slot
        self._expert_in_slot[slot] = expert
        for buf, src in self._copy_pairs:
            # Asynchronous from pinned memory on CUDA, ordered by the current
            # stream behind earlier readers of the slot.
            buf[slot].copy_(src[expert], non_blocking=True)

    def _publish(self, requested: list[int]) -> None:
        host_map = self._host_map
        host_map.fill_(-1)
        if requested:
            slots = [self._slot_of[e] for e in requested]
            host_map[torch.tensor(requested)] = torch.tensor(slots, dtype=torch.int32)
        self._exposed = set(requested)
        # Blocking: the host map is rewritten by the next call, so the upload
        # must have consumed it before this returns.
        self._expert_map.copy_(host_map)
