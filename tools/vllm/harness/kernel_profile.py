"""Where the GPU time of one 2,048-token prompt step, and of a decode token, goes, by kernel.

Issue 18's time to first token is copy-bound: a cached engine moves 96 of 128 experts a layer
over PCIe, and beside that copy time the step holds what the passes add (their planners, MoE
kernels and the reduction of their outputs) and what no offload runs too. Whether overlapping
a pass's copies with the previous pass's kernels could pay depends on how long those kernels
are, so an engine whose workload asks (``Workload.ttft_kernel_profile``) profiles one more
prompt step after every timed measurement, under ``torch.profiler`` with CUPTI, and records
its device activities (kernels, copies and sets) here: the step's span (first start to last
end), its busy time (the union of the activities' intervals: less than their sum where some
ran at once), and the time of each category and of the longest kernels.

A decode token at batch 1 is the other question: where a cache engine's token goes beyond its
misses' bytes at the link's rate (the plan, the gather, the launches of every layer). An engine
whose workload asks (``Workload.decode_kernel_profile``) profiles the decode prompt twice, with
its first token alone and with some more, each after the same generation unprofiled (with LRU
victims: from one cache state) and with the cache's counters over it, and :func:`per_token`
takes their difference: a token's time and misses.

:func:`summarize` and :func:`per_token` are pure and take plain data; :func:`device_activities`
turns a profile's events into them, and :func:`profile_step` runs one generation under the
profiler (the only part that needs a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

ROWCACHE_KERNELS = {
    "gather_kernel": "rowcache gather",
    "decode_gather_kernel": "rowcache gather",
    "plan_kernel": "rowcache planner",
    "invalidate_kernel": "rowcache planner",
}
"""rowcache's Triton kernels, by their whole names as the profiler gives them (a fragment would
also take torch's ``at::native::vectorized_gather_kernel``, which engines without the cache
run: gpt-oss's, 2026-12-06)."""
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("MoE GEMM", ("fused_moe_kernel", "_matmul_ogs", "marlin_moe")),
    ("MoE align and sort", ("moe_align", "count_and_sort", "sort_")),
    ("MoE sum", ("moe_sum",)),
    ("attention", ("flash", "fmha", "attn")),
    ("dense GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("copy", ("memcpy",)),
    ("set", ("memset",)),
    ("elementwise", ("elementwise", "triton_poi", "triton_per", "triton_red", "vectorized")),
)
"""A device activity's category, after :data:`ROWCACHE_KERNELS`: the first whose fragments one
is in its lower-cased name; "other" when none is. Ordered: the MoE kernels' names (vLLM's
Triton kernel, the ``triton_kernels`` MXFP4 GEMM of gpt-oss's ``triton_unfused`` backend,
Marlin's) are matched before the generic fragments a name may also hold."""
OTHER = "other"
TOP = 15
"""Kernels listed by name, the longest in total first."""


@dataclass(frozen=True)
class Activity:
    """One device activity of the step: a kernel, a copy or a set, with its GPU timestamps."""

    name: str
    start_us: float
    end_us: float


def category(name: str) -> str:
    if name in ROWCACHE_KERNELS:
        return ROWCACHE_KERNELS[name]
    lower = name.lower()
    for label, fragments in CATEGORIES:
        if any(fragment in lower for fragment in fragments):
            return label
    return OTHER


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize(activities: Iterable[Activity]) -> dict[str, Any]:
    """The step's span, busy time and sum (ms), each category's time and count, and the
    :data:`TOP` kernels by total time (names cut to 160 characters)."""
    found = [a for a in activities if a.end_us >= a.start_us]
    if not found:
        return {"activities": 0}
    by_category: dict[str, dict[str, float]] = {}
    by_name: dict[str, dict[str, float]] = {}
    for a in found:
        took = a.end_us - a.start_us
        for table, key in ((by_category, category(a.name)), (by_name, a.name[:160])):
            entry = table.setdefault(key, {"ms": 0.0, "count": 0})
            entry["ms"] += took / 1000
            entry["count"] += 1
    top = sorted(by_name.items(), key=lambda item: -item[1]["ms"])[:TOP]
    return {
        "activities": len(found),
        "span_ms": round((max(a.end_us for a in found) - min(a.start_us for a in found)) / 1000, 3),
        "busy_ms": round(_union_us([(a.start_us, a.end_us) for a in found]) / 1000, 3),
        "sum_ms": round(sum(a.end_us - a.start_us for a in found) / 1000, 3),
        "by_category": {
            key: {"ms": round(v["ms"], 3), "count": int(v["count"])}
            for key, v in sorted(by_category.items(), key=lambda item: -item[1]["ms"])
        },
        "top": [
            {"name": name, "ms": round(v["ms"], 3), "count": int(v["count"])} for name, v in top
        ],
    }


def per_token(first: dict[str, Any], whole: dict[str, Any], tokens: int) -> dict[str, Any]:
    """A decode token's share of two summaries of one prompt's generation: ``whole`` with
    ``tokens`` more tokens than ``first`` (its prefill and first token). Each figure is their
    difference over ``tokens`` (ms), so what both share cancels; ``misses`` too, where both
    carry the cache's counters (``cache``: a cached engine's); no activity where either
    summary has none (a profile that failed, or saw nothing)."""
    if tokens <= 0 or "by_category" not in first or "by_category" not in whole:
        return {"activities": 0}
    cats = set(first["by_category"]) | set(whole["by_category"])

    def share(a: float, b: float) -> float:
        return round((b - a) / tokens, 4)

    found: dict[str, Any] = {
        "tokens": tokens,
        "span_ms": share(first["span_ms"], whole["span_ms"]),
        "busy_ms": share(first["busy_ms"], whole["busy_ms"]),
        "by_category": {
            c: {
                "ms": share(
                    first["by_category"].get(c, {}).get("ms", 0.0),
                    whole["by_category"].get(c, {}).get("ms", 0.0),
                )
            }
            for c in sorted(cats)
        },
    }
    if "cache" in first and "cache" in whole:
        found["misses"] = share(first["cache"]["misses"], whole["cache"]["misses"])
    return found


def device_activities(events: Iterable[Any], device: str = "CUDA") -> list[Activity]:
    """The activities among a profile's ``events`` (``torch.autograd.profiler_util``'s
    ``FunctionEvent``s, e.g. ``prof.events()``) that ran on ``device``: the name of their
    ``device_type`` (``DeviceType.CUDA`` for the GPU's kernels, copies and sets)."""
    return [
        Activity(str(e.name), float(e.time_range.start), float(e.time_range.end))
        for e in events
        if getattr(e.device_type, "name", None) == device
    ]


def profile_step(step: Callable[[], object]) -> dict[str, Any]:
    """:func:`summarize` of the GPU activities of ``step()`` (one generate call), run under
    ``torch.profiler`` with the CPU and CUDA activities (the CPU's attach each kernel to its
    launch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return summarize(device_activities(prof.events()))
