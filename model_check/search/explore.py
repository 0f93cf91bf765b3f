"""`explore`: one exhaustive check of either path's table, by device model name."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from model_check.search.bfs import bfs
from model_check.search.device_models import DeviceHbModel, DeviceQueueModel
from model_check.search.memo import memo_search
from model_check.search.model import FactoredModel, Model, Result
from model_check.search.models import HbModel, QueueModel
from model_check.table.reference import Bounds
from model_check.table.schema import DeviceTable, Table

MODELS = ("interleavings", "hb")
S = TypeVar("S", bound=Hashable)
H = TypeVar("H", bound=Hashable)


def explore(
    table: Table | DeviceTable,
    bounds: Bounds,
    depth: int,
    *,
    model: str = "interleavings",
    stop_at_first: bool = True,
    symmetry: bool = True,
    only: str | None = None,
    fast: bool = True,
) -> Result:
    """Explore every host-call sequence of up to `depth` calls with the device model `model`
    ("interleavings": `QueueModel`, or `DeviceQueueModel` for the device-planned path's
    table; "hb": `HbModel` or `DeviceHbModel`).

    With `only`, violations of other properties are ignored (used to show that a mutant
    breaks the property it was seeded against, not just some property).

    The happens-before model with symmetry runs through the memoized search
    (`memo.memo_search`), which explores the same states and transitions as the plain one;
    `fast=False` runs the plain search (`bfs.bfs`) instead (the tests compare the two)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is not one of {MODELS}")
    how = (model, depth, stop_at_first, symmetry, only, fast)
    if isinstance(table, DeviceTable):
        device = table
        return _search(
            lambda: DeviceQueueModel(device, bounds, only),
            lambda: DeviceHbModel(device, bounds),
            *how,
        )
    host = table
    return _search(lambda: QueueModel(host, bounds), lambda: HbModel(host, bounds), *how)


def _search(
    queues: Callable[[], Model[S]],
    hb: Callable[[], FactoredModel[H, Any, Any, Any]],
    model: str,
    depth: int,
    stop_at_first: bool,
    symmetry: bool,
    only: str | None,
    fast: bool,
) -> Result:
    """The search of one path's models (each built only when it is searched)."""
    if model == "interleavings":
        return bfs(queues(), depth, stop_at_first=stop_at_first, symmetry=symmetry, only=only)
    if symmetry and fast:
        return memo_search(hb(), depth, stop_at_first=stop_at_first, only=only)
    return bfs(hb(), depth, stop_at_first=stop_at_first, symmetry=symmetry, only=only)
