"""``HostPlannedProvider``: the row-level provider planned on the host, whose device schedules
come from the table; what ``RowCacheWeightProvider(...)`` builds by default.

Two halves, each checked against the model:

* Host bookkeeping (this module): a plain LRU over a fixed set of slots, kept in an
  ``OrderedDict`` (least recently used first), a list ``slot_of`` (expert -> slot, -1 when not
  resident) and a heap of free slots. It computes exactly what
  ``model_check.table.reference.plan_prepare`` / ``plan_invalidate`` compute: misses are placed in
  ascending id order, each into the lowest free slot, then into the slot of the least recently
  used resident expert *not requested by this call*; the requested experts then become the
  most recently used, in ascending id order. The conformance tests compare the two step by
  step (LRU order, slots, maps, counters).
* Device work: the generated ``rowcache.schedules.run_prepare`` / ``run_invalidate``
  (``python -m model_check.codegen`` writes them from ``spec/table.toml``) call a ``Backend``
  in the table's step order: the release event on the previous owner's stream, the copy
  stream's wait on it, the copies and the resident-map upload on the copy stream, the ready
  event, the current stream's wait on it and the forward-map upload there. The stream a
  ``prepare`` is made on then becomes the owner (the table's ``set_owner``).

The backend is chosen by the device (CPU: synchronous copies; CUDA: streams and events) unless
one is given (tests pass ``rowcache.backends.RecordingBackend``).

``RowCacheWeightProvider`` (``rowcache.provider_base``, the base of this class and of the
device-planned ``rowcache.device_plan.provider.DevicePlannedProvider``), ``Planner`` and
``PLANNERS`` are importable from here as well.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rowcache.backends.base import Backend, Plan, Roles
from rowcache.backends.cpu import CpuBackend
from rowcache.errors import InvalidInputError
from rowcache.packing import Layout, check_layout
from rowcache.policy import COUNT_MAX, Policy, RequestCounts, check_policy
from rowcache.provider_base import PLANNERS, Planner, RowCacheWeightProvider
from rowcache.schedules import run_invalidate, run_prepare
from rowcache.types import ExpertWeightResult, Split, UniqueIds
from rowcache.validation import requested_and_routed

__all__ = [
    "PLANNERS",
    "HostPlannedProvider",
    "Planner",
    "RowCacheWeightProvider",
    "default_backend",
]


def default_backend(device: torch.device) -> Backend[Any]:
    """The backend for ``device``: CPU (synchronous) or CUDA (streams and events)."""
    if device.type == "cpu":
        return CpuBackend()
    if device.type == "cuda":
        from rowcache.backends.cuda import CudaBackend

        return CudaBackend(device)
    raise InvalidInputError(
        f"no backend for device {device} (supported: cpu, cuda); pass backend= explicitly"
    )


class HostPlannedProvider(RowCacheWeightProvider, planner="host"):
    """Expert-weight cache with ``capacity`` device slots, planned on the host and ordered
    by the table; what ``RowCacheWeightProvider(..., planner="host")`` (the default) builds.
    A miss evicts the least recently used resident, or with ``policy="lfu"`` the one of fewest
    requests (``rowcache.policy``; ``count_max`` the counts' saturation, 1 to 15).

    Same surface as ``rowcache.cached.CachedWeightProvider``. Host calls must be sequential
    (a concurrent call raises ``ConcurrentCallError``). Every consumer read of the buffers a
    ``prepare`` returns must be enqueued on the stream that ``prepare`` was called on, before
    the next ``prepare``; the calls themselves may come from any stream.

    ``layout="packed"`` keeps each expert's tensors in one byte range on the host and in every
    slot, so that a miss is one copy (``rowcache.packing``: the returned weight tensors are then
    strided views, not contiguous buffers); the default ``"separate"`` gives one contiguous
    buffer per tensor.

    ``compress=True`` holds bf16 ``w13`` and ``w2`` as lossless bf16 planes in host memory
    (``rowcache.compress``: about three quarters of the bytes); the copy step of a miss then
    decodes them into its slots on the copy stream, reading the planes over the link (the
    backend's ``copy_rows``: one decode launch a miss and source on a GPU, the miss passed as
    the launch's scalars; the table's steps and their order are unchanged).

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
        backend: Backend[Any] | None = None,
        layout: Layout = "separate",
        share_sources: bool = False,
        compress: bool = False,
        planner: Planner = "host",
        policy: Policy = "lru",
        count_max: int = COUNT_MAX,
    ) -> None:
        if planner != "host":  # RowCacheWeightProvider builds a DevicePlannedProvider then
            raise InvalidInputError(f"{type(self).__name__} plans on the host, got {planner!r}")
        self._policy, count_max = check_policy(policy, count_max)
        target = torch.device(device)
        check_layout(layout)  # before the backend, which allocates a stream and events
        # Chosen first: an unsupported device is rejected before any allocation.
        self._backend: Backend[Any] = default_backend(target) if backend is None else backend
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
            device=target,
            layout=layout,
            share_sources=share_sources,
            compress=compress,
        )
        num_experts = self._num_experts
        self._backend.bind(self._sources, self._slots)
        # The generated schedules, as attributes so that a test can substitute a mutant.
        self._run_prepare = run_prepare
        self._run_invalidate = run_invalidate

        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._counts = RequestCounts(num_experts, count_max) if self._policy == "lfu" else None
        # The host mirrors of both maps are int32 arrays with tensor views over the same
        # memory: a call updates O(requested) entries in place and stages a whole map with one
        # memory copy, with no loop over all E experts.
        self._slot_of = array("i", [-1]) * num_experts  # the resident-map host mirror
        self._forward_host = array("i", [-1]) * num_experts  # the last forward map
        self._resident_view = torch.frombuffer(self._slot_of, dtype=torch.int32)
        self._forward_view = torch.frombuffer(self._forward_host, dtype=torch.int32)
        self._free = list(range(capacity))  # a heap: lowest free slot first
        self._forward: tuple[tuple[int, int], ...] | None = None

        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._prepare_calls = 0
        self._invalidations = 0
        self._last_copies = 0  # experts the last accepted prepare copied
        # The owner (stream of the previous accepted prepare), the guard and the result.
        self._set_up_calls(self._backend.forward_map)

    # -- surface -----------------------------------------------------------

    @property
    def backend(self) -> Backend[Any]:
        return self._backend

    def prepare(self, topk_ids: Tensor, unique_ids: UniqueIds | None = None) -> ExpertWeightResult:
        """Make the requested experts resident and return a map exposing exactly them.

        The request is validated in full first (``rowcache.validation.requested_experts``); a
        rejected call changes nothing. The returned tensors are live buffers: reads of them
        must be enqueued on the current stream before the next ``prepare``.
        """
        with self._guard("prepare"):
            requested, routed = requested_and_routed(
                topk_ids, unique_ids, self._num_experts, self._capacity, device=self._device
            )
            backend = self._backend
            current = backend.current_stream()
            owner = self._owner
            plan = self._plan_prepare(requested, routed)
            if owner is not None and owner != current:
                self._owner_changes += 1
            roles = Roles(current, current if owner is None else owner, backend.copy_stream)
            try:
                new_owner = self._run_prepare(backend, roles, plan)
            except BaseException:
                self._forget(plan.copies)
                raise
            if new_owner is not None:
                self._owner = new_owner
            return self._result

    def invalidate(self, expert_id: int) -> None:
        """Free ``expert_id``'s slot so its next request copies it again.

        A non-resident expert is a no-op; an id outside ``[0, E)`` is rejected. The resident
        map is rewritten on the owner stream, behind the last forward's reads; the forward map
        the last ``prepare`` returned is left as it is (its slots keep their contents until the
        next ``prepare``, whose release event orders their reuse).
        """
        with self._guard("invalidate"):
            self._check_expert_id(expert_id)
            backend = self._backend
            current = backend.current_stream()
            slot = self._slot_of[expert_id]
            changed = slot >= 0
            if changed:
                self._slot_of[expert_id] = -1
                del self._lru[expert_id]
                heapq.heappush(self._free, slot)
                self._invalidations += 1
            owner = self._owner
            roles = Roles(current, current if owner is None else owner, backend.copy_stream)
            new_owner = self._run_invalidate(
                backend, roles, Plan(changed=changed, resident=self._resident_view)
            )
            if new_owner is not None:
                self._owner = new_owner

    def stats(self) -> dict[str, int]:
        """Counters since construction, the slots in use, and what the last accepted
        ``prepare`` copied: ``last_copies`` experts, ``last_copy_bytes`` bytes (0 for an
        all-hit one; a rejected call changes neither)."""
        return {
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
            "resident": len(self._lru),
            "capacity": self._capacity,
            "prepare_calls": self._prepare_calls,
            "owner_changes": self._owner_changes,
            "invalidations": self._invalidations,
            "last_copies": self._last_copies,
            "last_copy_bytes": self._last_copies * self._sources.expert_bytes,
            "slot_bytes": self._slots.slot_bytes,
            "host_bytes": self._sources.host_bytes,
        }

    # -- inspection (tests, debugging) ---------------------------------------

    def resident_experts(self) -> dict[int, int]:
        """Resident expert id -> slot."""
        return {e: self._slot_of[e] for e in self._lru}

    def lru_order(self) -> tuple[int, ...]:
        """Resident experts, least recently used first."""
        return tuple(self._lru)

    @property
    def policy(self) -> Policy:
        """The victim policy (``rowcache.policy``)."""
        return self._policy

    def request_counts(self) -> tuple[int, ...]:
        """Every expert's request count under policy ``lfu``; () under ``lru``."""
        return () if self._counts is None else self._counts.snapshot()

    def slot_of(self) -> tuple[int, ...]:
        """The resident-map host mirror: the slot of every expert, -1 when not resident."""
        return tuple(self._slot_of)

    @property
    def forward_pairs(self) -> tuple[tuple[int, int], ...] | None:
        """(expert, slot) exposed by the last accepted ``prepare``, ascending."""
        return self._forward

    # -- host bookkeeping ------------------------------------------------------

    def step_groups(self, topk_ids: Tensor) -> list[list[int]]:
        """The expert groups of a step, one ``prepare(topk_ids, unique_ids=group)`` each, in
        order: the routed experts resident now (the step's hits) first, then the others, each
        in ascending id order, cut into groups of ``capacity`` (each group ascending). The first
        group serves every hit before any copy can evict it; later groups only copy
        (``model_check.table.reference.step_order``). ``[]`` for a routing of only padding."""
        routed = requested_and_routed(
            topk_ids,
            None,
            self._num_experts,
            self._num_experts,
            device=self._device,
            op="step_groups",
        )[1]
        slot_of = self._slot_of
        order = [e for e in routed if slot_of[e] >= 0] + [e for e in routed if slot_of[e] < 0]
        cap = self._capacity
        return [sorted(order[i : i + cap]) for i in range(0, len(order), cap)]

    def _victims(self, count: int, requested: set[int], step: set[int]) -> list[int]:
        """The ``count`` residents that this call does not request, those outside its step
        first, then the step's experts that other calls expose; within each the least recently
        used first, or under ``lfu`` the fewest requests first (ties to the least recent)."""
        counts = self._counts
        if counts is not None:
            candidates = [e for e in self._lru if e not in requested]
            candidates.sort(key=lambda e: (e in step, counts[e]))  # stable: LRU among ties
            return candidates[:count]
        victims: list[int] = []
        for outside in (True, False):
            for expert in self._lru:
                if expert not in requested and (expert not in step) == outside:
                    victims.append(expert)
                    if len(victims) == count:
                        return victims
        return victims

    def _forward_pairs(self, requested: list[int]) -> tuple[tuple[int, int], ...]:
        """(expert, slot) that the forward map exposes: exactly the requested experts."""
        slot_of = self._slot_of
        return tuple((e, slot_of[e]) for e in requested)

    def _plan_prepare(self, requested: list[int], step: list[int]) -> Plan:
        """Commit the host side of an accepted ``prepare`` and return its plan. ``step``: every
        expert of the step this call is a group of (victims are taken outside it first)."""
        slot_of, lru, free = self._slot_of, self._lru, self._free
        if self._counts is not None:
            self._counts.add(requested)
        misses = [e for e in requested if slot_of[e] < 0]
        copies: list[tuple[int, int]] = []
        if misses:
            shortfall = len(misses) - len(free)
            victims = self._victims(shortfall, set(requested), set(step)) if shortfall > 0 else []
            self._evictions += len(victims)
            next_victim = iter(victims)
            for expert in misses:
                if free:
                    slot = heapq.heappop(free)
                else:
                    victim = next(next_victim)
                    slot = slot_of[victim]
                    slot_of[victim] = -1
                    del lru[victim]
                slot_of[expert] = slot
                copies.append((expert, slot))
        move_to_end = lru.move_to_end
        if misses:
            for expert in requested:
                if expert in lru:
                    move_to_end(expert)
                else:
                    lru[expert] = None
        else:
            for expert in requested:  # all resident: the hit path
                move_to_end(expert)
        # The forward map exposes exactly the requested experts: clear the previous call's
        # entries, then write this call's.
        forward = self._forward_host
        for expert, _ in self._forward or ():
            forward[expert] = -1
        forward_pairs = self._forward_pairs(requested)
        for expert, slot in forward_pairs:
            forward[expert] = slot
        self._forward = forward_pairs
        self._hits += len(requested) - len(misses)
        self._misses += len(misses)
        self._last_copies = len(copies)
        self._prepare_calls += 1
        # Consumer steps read their pairs from ``forward_pairs``; prepare has none.
        return Plan(copies, bool(misses), self._resident_view, self._forward_view)

    def _forget(self, copies: Sequence[tuple[int, int]]) -> None:
        """After a failed schedule: the copied experts' slots may hold anything, so they
        become free and their experts are copied again on their next request."""
        for expert, slot in copies:
            if self._slot_of[expert] == slot:
                self._slot_of[expert] = -1
                self._lru.pop(expert, None)
                heapq.heappush(self._free, slot)
