"""rowcache: a GPU expert-weight cache for mixture-of-experts inference.

``RowCacheWeightProvider(..., planner=...)`` builds the row-level provider of a planner, and is
the base of both: ``HostPlannedProvider`` (``planner="host"``, the default), whose stream and
event ordering is generated from the model-checked transition table (``spec/table.toml``), and
``DevicePlannedProvider`` (``planner="device"``), which plans and copies on the device, inside
CUDA graphs. ``CachedWeightProvider`` is the LFRU baseline. All serve ``run_with_expert_cache``.

Both planners' modules are imported here, so that ``RowCacheWeightProvider`` knows them
(``rowcache.provider_base``).
"""

from rowcache.cached import CachedWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.device_plan.state import DeviceInputError
from rowcache.errors import ConcurrentCallError, InvalidInputError, RowCacheError
from rowcache.forward import run_with_expert_cache
from rowcache.planning import plan_chunks, plan_expert_groups
from rowcache.provider_base import RowCacheWeightProvider
from rowcache.row_provider import HostPlannedProvider
from rowcache.types import ExpertWeightProvider, ExpertWeightResult

__all__ = [
    "CachedWeightProvider",
    "ConcurrentCallError",
    "DeviceInputError",
    "DevicePlannedProvider",
    "ExpertWeightProvider",
    "ExpertWeightResult",
    "HostPlannedProvider",
    "InvalidInputError",
    "RowCacheError",
    "RowCacheWeightProvider",
    "plan_chunks",
    "plan_expert_groups",
    "run_with_expert_cache",
]
