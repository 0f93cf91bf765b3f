"""The GPU run: ceilings, cells, trace replay, gathered into one JSON document."""

from __future__ import annotations

import datetime
import gc
import importlib.metadata
import platform
import sys
from typing import Any

import torch

from rowcache.bench.ceilings import MIB, measure_ceiling
from rowcache.bench.cells import fill, measure_cell
from rowcache.bench.geometry import GEOMETRIES, KNOWN_GEOMETRIES, make_sources
from rowcache.bench.providers import PROVIDERS, copy_path_of
from rowcache.bench.trace import TraceSpec, generate_trace, replay

__all__ = ["CEILING_MIB", "MISSES", "Settings", "run_benchmark"]

CEILING_MIB = (1, 4, 16, 64, 256)
MISSES = (0, 1, 2, 4, 8)


class Settings:
    def __init__(
        self,
        *,
        num_experts: int = 128,
        top_k: int = 8,
        capacity: int = 32,
        steps: int = 50,
        warmup: int = 5,
        ceiling_repeats: int = 20,
        trace: TraceSpec | None = None,
        geometries: tuple[str, ...] = tuple(GEOMETRIES),
        providers: tuple[str, ...] = tuple(PROVIDERS),
        misses: tuple[int, ...] = MISSES,
    ) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity = capacity
        self.steps = steps
        self.warmup = warmup
        self.ceiling_repeats = ceiling_repeats
        self.trace = trace if trace is not None else TraceSpec()
        self.geometries = geometries
        self.providers = providers
        self.misses = misses


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fraction(gbps: float | None, ceiling: float | None) -> float | None:
    return None if gbps is None or not ceiling else gbps / ceiling


def run_benchmark(settings: Settings, *, commit: str, command: str) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "command": command,
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cuda_bindings": _package_version("cuda-bindings"),
        "num_experts": settings.num_experts,
        "top_k": settings.top_k,
        "capacity": settings.capacity,
        "steps_per_cell": settings.steps,
        "warmup_steps": settings.warmup,
        "topk_ids": "CPU int64 tensor [1, top_k] (one decode token)",
    }
    step_bytes = sorted(
        {
            m * KNOWN_GEOMETRIES[g].expert_bytes
            for g in settings.geometries
            for m in settings.misses
            if m > 0
        }
    )
    sizes = sorted({mib * MIB for mib in CEILING_MIB} | set(step_bytes))
    ceilings: dict[int, float] = {}
    for size in sizes:
        ceilings[size] = measure_ceiling(size, repeats=settings.ceiling_repeats, device=device)
        _log(f"ceiling {size / MIB:8.2f} MiB: {ceilings[size]:.2f} GB/s")
    cells: list[dict[str, Any]] = []
    trace_rows: list[dict[str, Any]] = []
    trace = (
        generate_trace(settings.trace, settings.num_experts, settings.top_k)
        if settings.trace.steps > 0
        else None
    )
    for geometry_name in settings.geometries:
        geometry = KNOWN_GEOMETRIES[geometry_name]
        sources = make_sources(geometry, settings.num_experts, seed=7)
        for provider_name in settings.providers:
            factory = PROVIDERS[provider_name]
            provider = factory(sources, settings.capacity, device)
            fill(provider, settings.capacity, settings.top_k, settings.num_experts)
            copy_path = copy_path_of(provider)
            for misses in settings.misses:
                timing = measure_cell(
                    provider,
                    misses,
                    top_k=settings.top_k,
                    num_experts=settings.num_experts,
                    steps=settings.steps,
                    warmup=settings.warmup,
                    seed=100 + misses,
                    device=device,
                )
                copied = misses * geometry.expert_bytes
                device_us = timing["device_us_median"]
                copy_us = timing["copy_us_median"]
                gbps = copied / (device_us * 1e-6) / 1e9 if copied and device_us else None
                copy_gbps = copied / (copy_us * 1e-6) / 1e9 if copied and copy_us else None
                ceiling = ceilings.get(copied)
                cells.append(
                    {
                        "geometry": geometry_name,
                        "provider": provider_name,
                        "copy_path": copy_path,
                        "misses": misses,
                        "tensors_per_expert": len(geometry.tensors),
                        "expert_bytes": geometry.expert_bytes,
                        "bytes_per_step": copied,
                        **timing,
                        "gbps": gbps,
                        "ceiling_gbps": ceiling,
                        "fraction": _fraction(gbps, ceiling),
                        "copy_gbps": copy_gbps,
                        "copy_fraction": _fraction(copy_gbps, ceiling),
                    }
                )
                _log(f"{geometry_name} {provider_name} misses={misses}: {timing}")
            del provider
            gc.collect()
            if trace is not None:
                fresh = factory(sources, settings.capacity, device)
                row = replay(fresh, trace, device)
                trace_rows.append({"geometry": geometry_name, "provider": provider_name, **row})
                _log(f"trace {geometry_name} {provider_name}: {row}")
                del fresh
                gc.collect()
            torch.cuda.synchronize()
        del sources
        gc.collect()
    return {
        "meta": meta,
        "ceilings": [{"bytes": s, "mib": s / MIB, "gbps": ceilings[s]} for s in sizes],
        "cells": cells,
        "trace": None
        if trace is None
        else {
            "description": settings.trace.describe(settings.num_experts, settings.top_k),
            "spec": {
                "steps": settings.trace.steps,
                "keep": settings.trace.keep,
                "zipf_s": settings.trace.zipf_s,
                "seed": settings.trace.seed,
            },
            "results": trace_rows,
        },
    }
