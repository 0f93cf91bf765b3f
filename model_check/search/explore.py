"""`explore`: one exhaustive check of a table, by device model name."""

from __future__ import annotations

from model_check.search.bfs import bfs
from model_check.search.memo import memo_search
from model_check.search.model import Result
from model_check.search.models import HbModel, QueueModel
from model_check.table.reference import Bounds
from model_check.table.schema import Table

MODELS = ("interleavings", "hb")


def explore(
    table: Table,
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
    ("interleavings": `QueueModel`; "hb": `HbModel`).

    With `only`, violations of other properties are ignored (used to show that a mutant
    breaks the property it was seeded against, not just some property).

    The happens-before model with symmetry runs through the memoized search
    (`memo.memo_search`), which explores the same states and transitions as the plain one;
    `fast=False` runs the plain search (`bfs.bfs`) instead (the tests compare the two)."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is not one of {MODELS}")
    if model == "interleavings":
        return bfs(
            QueueModel(table, bounds),
            depth,
            stop_at_first=stop_at_first,
            symmetry=symmetry,
            only=only,
        )
    hb = HbModel(table, bounds)
    if symmetry and fast:
        return memo_search(hb, depth, stop_at_first=stop_at_first, only=only)
    return bfs(hb, depth, stop_at_first=stop_at_first, symmetry=symmetry, only=only)
