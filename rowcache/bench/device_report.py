"""The device-path bench's document read back: sample statistics, the targets and the table.

Pure Python over the JSON that ``python -m rowcache.bench.device_path`` writes, so that the
targets and the table can be recomputed on a machine without a GPU
(``python -m rowcache.bench.plot_device_path`` prints the same table).
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = [
    "COPY_TARGETS",
    "TRACE_RATIO_MAX",
    "ZERO_MISS_US_MAX",
    "evaluate",
    "format_table",
    "sample_stats",
]

COPY_TARGETS: dict[str, float] = {"bf16": 0.90, "bf16_large": 0.90, "nvfp4": 0.85}
"""Fraction of the pinned copy ceiling each geometry must reach at every miss count >= 2."""

COPY_TARGET_MIN_MISSES = 2
ZERO_MISS_US_MAX = 8.0
"""A step with no misses (planner + gather + reader), device us per layer."""
TRACE_RATIO_MAX = 1.0
"""Trace replay: the device path's mean per-layer step over the host planner's mean step."""


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of sorted ``ordered``."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def sample_stats(values: list[float]) -> dict[str, float]:
    """Median, mean, min, max, p10 and p90 of ``values`` (at least one)."""
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": _quantile(ordered, 0.10),
        "p90": _quantile(ordered, 0.90),
    }


def _check(
    geometry: str, layout: str, check: str, measured: float | None, limit: float, *, upper: bool
) -> dict[str, Any]:
    """One target: ``measured <= limit`` when ``upper``, else ``measured >= limit``; a value
    that was not measured is missed."""
    if measured is None:
        met, ratio = False, None
    else:
        met = measured <= limit if upper else measured >= limit
        ratio = measured / limit if limit else None
    return {
        "geometry": geometry,
        "layout": layout,
        "check": check,
        "limit": limit,
        "measured": measured,
        "ratio_to_limit": ratio,
        "met": met,
    }


def evaluate(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target and regression check of the document, per geometry and slot layout."""
    results: list[dict[str, Any]] = []
    cells = document.get("device_cells", [])
    pairs = sorted({(c["geometry"], c["layout"]) for c in cells})
    traces = document.get("trace", [])
    for geometry, layout in pairs:
        mine = [c for c in cells if c["geometry"] == geometry and c["layout"] == layout]
        copying = [c for c in mine if c["misses"] >= COPY_TARGET_MIN_MISSES]
        fractions = [c["fraction"] for c in copying]
        worst = None if not fractions or None in fractions else min(fractions)
        results.append(
            _check(
                geometry,
                layout,
                f"copy >= {COPY_TARGETS.get(geometry, 0.90):.2f} of ceiling at >= "
                f"{COPY_TARGET_MIN_MISSES} misses (worst cell)",
                worst,
                COPY_TARGETS.get(geometry, 0.90),
                upper=False,
            )
        )
        zero = [c for c in mine if c["misses"] == 0]
        results.append(
            _check(
                geometry,
                layout,
                f"0 misses <= {ZERO_MISS_US_MAX:g} us per layer",
                zero[0]["device_us_per_layer"]["median"] if zero else None,
                ZERO_MISS_US_MAX,
                upper=True,
            )
        )
        device = [
            t
            for t in traces
            if t["geometry"] == geometry and t["planner"] == "device" and t["layout"] == layout
        ]
        host = [t for t in traces if t["geometry"] == geometry and t["planner"] == "host"]
        ratio = (
            device[0]["device_us_per_layer_mean"] / host[0]["device_us_mean"]
            if device and host and host[0]["device_us_mean"]
            else None
        )
        results.append(
            _check(
                geometry,
                layout,
                "trace: device mean / host mean <= 1",
                ratio,
                TRACE_RATIO_MAX,
                upper=True,
            )
        )
    return results


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(document: dict[str, Any]) -> str:
    """The short table the bench prints last: per layer device us by misses, the ratio to
    the ceiling, the fixed costs, the trace, then every check marked met or missed."""
    meta = document.get("meta", {})
    cells = document.get("device_cells", [])
    misses = sorted({c["misses"] for c in cells})
    pairs = sorted({(c["geometry"], c["layout"]) for c in cells})
    fixed = {(f["geometry"], f["layout"]): f for f in document.get("fixed_costs", [])}
    traces = document.get("trace", [])
    lines = [
        f"device path, a forward of {meta.get('layers', '?')} layers in one graph (per layer: "
        f"graph total / layers); {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
        f"triton {meta.get('triton', '?')}, commit {str(meta.get('commit', '?'))[:12]}",
        "us/layer (median) by misses " + "/".join(map(str, misses)) + "; ratio to ceiling; "
        "planner alone and pass at 0 misses; trace device/host mean us",
    ]
    for geometry, layout in pairs:
        mine = {
            c["misses"]: c for c in cells if c["geometry"] == geometry and c["layout"] == layout
        }
        times = " ".join(
            _number(mine[m]["device_us_per_layer"]["median"] if m in mine else None, 1).rjust(7)
            for m in misses
        )
        ratios = " ".join(
            _number(mine[m]["fraction"] if m in mine else None, 3).rjust(5) for m in misses if m > 0
        )
        costs = fixed.get((geometry, layout), {})
        device = [
            t
            for t in traces
            if t["geometry"] == geometry and t["planner"] == "device" and t["layout"] == layout
        ]
        host = [t for t in traces if t["geometry"] == geometry and t["planner"] == "host"]
        trace = (
            f"{_number(device[0]['device_us_per_layer_mean'] if device else None, 0)}/"
            f"{_number(host[0]['device_us_mean'] if host else None, 0)}"
        )
        lines.append(
            f"{geometry:<10} {layout:<8} |{times} | {ratios} | "
            f"{_number(costs.get('planner_us_per_layer'), 1)} "
            f"{_number(costs.get('pass_us_per_layer'), 1)} | {trace}"
        )
    checks = evaluate(document)
    for check in checks:
        verdict = "met" if check["met"] else "MISSED"
        lines.append(
            f"{verdict:<6} {check['geometry']:<10} {check['layout']:<8} {check['check']}: "
            f"{_number(check['measured'], 3)} (ratio to limit "
            f"{_number(check['ratio_to_limit'], 3)})"
        )
    met = sum(c["met"] for c in checks)
    lines.append(f"device-path bench: {met}/{len(checks)} checks met")
    return "\n".join(lines)
