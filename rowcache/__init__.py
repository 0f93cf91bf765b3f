"""rowcache: a GPU expert-weight cache for mixture-of-experts inference.

``RowCacheWeightProvider`` is the row-level provider whose stream and event ordering is
generated from the model-checked transition table (``spec/table.toml``);
``CachedWeightProvider`` is the LFRU baseline; ``DevicePlannedProvider``
(``RowCacheWeightProvider(..., planner="device")``) plans and copies on the device, inside CUDA
graphs. All serve ``run_with_expert_cache``.
"""

from rowcache.cached import CachedWeightProvider
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.device_plan.state import DeviceInputError
from rowcache.errors import ConcurrentCallError, InvalidInputError, RowCacheError
from rowcache.forward import run_with_expert_cache
from rowcache.planning import plan_chunks, plan_expert_groups
from rowcache.row_provider import RowCacheWeightProvider
from rowcache.types import ExpertWeightProvider, ExpertWeightResult

__all__ = [
    "CachedWeightProvider",
    "ConcurrentCallError",
    "DeviceInputError",
    "DevicePlannedProvider",
    "ExpertWeightProvider",
    "ExpertWeightResult",
    "InvalidInputError",
    "RowCacheError",
    "RowCacheWeightProvider",
    "plan_chunks",
    "plan_expert_groups",
    "run_with_expert_cache",
]
