"""``RowCacheWeightProvider``: what the host-planned and the device-planned providers share.

The two providers are siblings below this class: ``rowcache.row_provider.HostPlannedProvider``
plans on the host and copies on a copy stream in the order the table's generated schedules
give; ``rowcache.device_plan.provider.DevicePlannedProvider`` plans and copies on the device,
inside CUDA graphs. Neither imports the other; each names its planner when it is defined
(``class HostPlannedProvider(RowCacheWeightProvider, planner="host")``), and
``RowCacheWeightProvider(..., planner=...)`` builds the provider of that planner (``"host"`` by
default), so ``isinstance(p, RowCacheWeightProvider)`` holds for both. A class that derives
from ``RowCacheWeightProvider`` without naming a planner (integration code written against the
contract) derives from ``HostPlannedProvider`` in its place.

Shared here: the slot set-up and the read-only shape properties (``SlotSurface``), the call
guard, the result every ``prepare`` returns, the owner stream, and the inspection surface
every provider of a planner implements (``SURFACE``: ``prepare``, ``invalidate``, ``stats``,
``resident_experts``, ``lru_order``, ``slot_of``, ``forward_pairs``), checked when the class is
defined. What only one planner has stays on its class: ``backend`` and ``step_groups`` on the
host-planned one; ``num_passes``, ``handoff``, ``check_errors``, ``kernels`` and ``state`` on
the device-planned one.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, overload

import torch
from torch import Tensor

from rowcache.backends.base import Backend
from rowcache.errors import InvalidInputError
from rowcache.guard import CallGuard
from rowcache.packing import Layout
from rowcache.policy import COUNT_MAX, Policy
from rowcache.surface import SlotSurface
from rowcache.types import ExpertWeightResult, Split, UniqueIds

__all__ = ["PLANNERS", "SURFACE", "Planner", "RowCacheWeightProvider"]

Planner = Literal["host", "device"]
PLANNERS: tuple[Planner, ...] = ("host", "device")
"""``host``: planning on the host, copies on a copy stream (``rowcache.row_provider``);
``device``: planning and copies on the device, capturable in CUDA graphs
(``rowcache.device_plan``)."""

SURFACE: tuple[str, ...] = (
    "prepare",
    "invalidate",
    "stats",
    "resident_experts",
    "lru_order",
    "slot_of",
    "forward_pairs",
    "policy",
    "request_counts",
)
"""The methods and properties a provider of a planner defines for itself."""

_BY_PLANNER: dict[str, type[RowCacheWeightProvider]] = {}
"""The provider class of each planner, filled as they are defined (``rowcache/__init__.py``
imports both)."""


class RowCacheWeightProvider(SlotSurface):
    """Expert-weight cache with ``capacity`` device slots: the base of the host-planned and
    the device-planned providers, and the constructor of either. A miss evicts the least
    recently used resident, or with ``policy="lfu"`` the one of fewest requests
    (``rowcache.policy``).

    ``RowCacheWeightProvider(w13, w2, ..., capacity=..., device=..., planner="host")`` builds a
    ``rowcache.row_provider.HostPlannedProvider`` (planning on the host, its device work ordered
    by the table's generated schedules); ``planner="device"`` builds a
    ``rowcache.device_plan.DevicePlannedProvider`` (the same policy planned and copied on the
    device, with fixed shapes and no host synchronization, so that a forward can be captured
    in a CUDA graph; it splits a step by passes over expert groups, and takes no ``backend`` or
    ``split="token"``). Each class's own docstring says what it takes and does.

    Same surface as ``rowcache.cached.CachedWeightProvider``, plus the inspection methods of
    ``SURFACE``. Host calls must be sequential (a concurrent call raises
    ``ConcurrentCallError``).
    """

    planner: ClassVar[Planner]
    """The planner of this class (``"host"`` or ``"device"``)."""

    _owner: Any
    _owner_changes: int
    _guard: CallGuard
    _result: ExpertWeightResult

    def __init_subclass__(cls, planner: Planner | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if planner is not None and planner not in PLANNERS:
            raise TypeError(
                f"{cls.__name__}: planner must be one of {list(PLANNERS)}, got {planner!r}"
            )
        inherited = cls._inherited_planner()
        if inherited is not None:
            # A subclass of a planner's class keeps that planner.
            if planner is not None and planner != inherited:
                raise TypeError(
                    f"{cls.__name__} derives from {_BY_PLANNER[inherited].__name__}, which plans"
                    f" on the {inherited}, but names planner={planner!r}"
                )
            return
        if planner is None:
            cls._derive_from_host_planner()
            return
        # A planner's own class (``HostPlannedProvider``, ``DevicePlannedProvider``).
        missing = [n for n in SURFACE if getattr(cls, n) is getattr(RowCacheWeightProvider, n)]
        if missing:
            raise TypeError(
                f"{cls.__name__} plans on the {planner} but does not define {missing}; a provider"
                " that reuses a planner derives from HostPlannedProvider or DevicePlannedProvider"
            )
        cls.planner = planner
        _BY_PLANNER[planner] = cls

    @classmethod
    def _inherited_planner(cls) -> Planner | None:
        """The planner of the planner's class that ``cls`` derives from, if any."""
        for name, planned in _BY_PLANNER.items():
            if planned in cls.__mro__[1:]:
                return name  # type: ignore[return-value]
        return None

    @classmethod
    def _derive_from_host_planner(cls) -> None:
        """Integration code written against the contract subclasses the contract's class
        (``class P(RowCacheWeightProvider)``, its ``__init__`` calling
        ``super().__init__(w13, w2, ..., capacity=..., device=...)``), as the base built the
        host-planned provider: such a class derives from ``HostPlannedProvider``, put in the
        contract class's place among its bases, so that ``super()`` reaches that provider's
        constructor and methods. A device-planned subclass derives from
        ``DevicePlannedProvider`` itself."""
        if "host" not in _BY_PLANNER:
            raise TypeError(
                f"{cls.__name__}: no host-planned provider is defined yet (import rowcache"
                " first); derive from HostPlannedProvider or DevicePlannedProvider"
            )
        provider = _BY_PLANNER["host"]
        bases = tuple(provider if b is RowCacheWeightProvider else b for b in cls.__bases__)
        if provider not in bases:
            raise TypeError(
                f"{cls.__name__} reaches RowCacheWeightProvider only through"
                f" {[b.__name__ for b in cls.__bases__]}: derive from HostPlannedProvider or"
                " DevicePlannedProvider"
            )
        cls.__bases__ = bases

    # The arguments of each planner's constructor (``HostPlannedProvider.__init__``,
    # ``DevicePlannedProvider.__init__``), for type checkers; written again here because this
    # module imports neither (no import cycle), so tests/test_provider_siblings.py checks that
    # they match.
    @overload
    def __new__(
        cls,
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
        planner: Literal["host"] = "host",
        policy: Policy = "lru",
        count_max: int = COUNT_MAX,
    ) -> RowCacheWeightProvider: ...

    @overload
    def __new__(
        cls,
        w13: Tensor,
        w2: Tensor,
        w13_scale: Tensor | None = None,
        w2_scale: Tensor | None = None,
        *,
        capacity: int,
        device: torch.device | str,
        w13_scale_2: Tensor | None = None,
        w2_scale_2: Tensor | None = None,
        w13_bias: Tensor | None = None,
        w2_bias: Tensor | None = None,
        layout: Layout = "separate",
        kernels: str | None = None,
        share_sources: bool = False,
        split: Split = "expert",
        compress: bool = False,
        planner: Literal["device"],
        policy: Policy = "lru",
        count_max: int = COUNT_MAX,
    ) -> RowCacheWeightProvider: ...

    def __new__(cls, *args: Any, planner: object = "host", **kwargs: Any) -> RowCacheWeightProvider:
        if planner not in PLANNERS:
            raise InvalidInputError(f"planner must be one of {list(PLANNERS)}, got {planner!r}")
        target: type[RowCacheWeightProvider] = cls
        if cls is RowCacheWeightProvider:
            if planner not in _BY_PLANNER:
                raise InvalidInputError(
                    f"no provider for planner {planner!r} is defined (import rowcache first)"
                )
            target = _BY_PLANNER[planner]
        return super().__new__(target)

    def _set_up_calls(self, expert_map: Tensor) -> None:
        """The call guard, no owner stream yet, and the result every ``prepare`` returns: the
        live slot buffers and ``expert_map`` (built once: they keep their addresses)."""
        self._owner = None
        self._owner_changes = 0
        self._guard = CallGuard(type(self).__name__)
        self._result = self._result_with(expert_map)

    def __repr__(self) -> str:
        # Robust to a half-built provider (a constructor that raised).
        num_experts = getattr(self, "_num_experts", "?")
        capacity = getattr(self, "_capacity", "?")
        device = getattr(self, "_device", "?")
        return f"{type(self).__name__}({num_experts=}, {capacity=}, device={device})"

    # -- the surface each planner's class defines (``SURFACE``) -------------------------

    def prepare(self, topk_ids: Tensor, unique_ids: UniqueIds | None = None) -> ExpertWeightResult:
        """Make the requested experts resident and return a map exposing exactly them."""
        raise NotImplementedError

    def invalidate(self, expert_id: int) -> None:
        """Free ``expert_id``'s slot so its next request copies it again."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Counters since construction, the slots in use, and what the last accepted
        ``prepare`` copied (``last_copies`` experts, ``last_copy_bytes`` bytes)."""
        raise NotImplementedError

    def resident_experts(self) -> dict[int, int]:
        """Resident expert id -> slot."""
        raise NotImplementedError

    def lru_order(self) -> tuple[int, ...]:
        """Resident experts, least recently used first."""
        raise NotImplementedError

    def slot_of(self) -> tuple[int, ...]:
        """The resident map: the slot of every expert, -1 when not resident."""
        raise NotImplementedError

    @property
    def policy(self) -> Policy:
        """The victim policy: ``lru`` or ``lfu`` (``rowcache.policy``)."""
        raise NotImplementedError

    def request_counts(self) -> tuple[int, ...]:
        """Every expert's request count under policy ``lfu``; () under ``lru``."""
        raise NotImplementedError

    @property
    def forward_pairs(self) -> tuple[tuple[int, int], ...] | None:
        """(expert, slot) exposed by the last accepted ``prepare``, ascending (None before
        the first)."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------

    @property
    def owner(self) -> Any:
        """The stream the provider's last work was ordered on (None before the first)."""
        return self._owner
