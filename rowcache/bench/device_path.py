"""The device-planned path inside a replayed CUDA graph, beside the copy-engine host path.

``python -m rowcache.bench.device_path --out DIR`` writes ``device_path.json``. Per expert
geometry and slot layout:

* **cells**: a graph of one decode step (one token, ``top_k`` experts: the planner, the gather
  and a trivial reader of the slots) is captured once; each measured step writes a request
  with exactly ``m`` misses into the captured input and replays the graph, timed with CUDA
  events around the replay alone (``device_us``) and around the input write plus the replay
  (``step_us``). Bytes copied over ``device_us`` against the pinned ceiling at that size;
* **host path**: the same requests through ``RowCacheWeightProvider`` (copy engine, packed
  layout), timed like ``rowcache.bench.cells``, in the same run;
* **fixed costs** at 0 misses: a graph of ``LAYERS`` consecutive passes (planner + gather, as
  ``LAYERS`` layers would run them) and of the planner alone, replayed back to back, divided
  by ``LAYERS``; and an empty pass (a second pass of a step whose experts all fit in the
  first);
* **trace**: the routing trace of ``rowcache.bench.trace``, replayed through the graph and
  through the host path: hit rate, mean step time.

The provider does no host work per replay: the host only launches the graph.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rowcache.bench.ceilings import measure_ceiling
from rowcache.bench.cells import consume, fill, measure_cell
from rowcache.bench.geometry import GEOMETRIES, make_sources
from rowcache.bench.providers import PROVIDERS
from rowcache.bench.steps import exact_miss_request
from rowcache.bench.trace import TraceSpec, generate_trace, replay
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.packing import Layout
from rowcache.sources import SOURCE_NAMES

__all__ = ["main"]

MISSES = (0, 1, 2, 4, 8)
LAYERS = 32


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e3  # event times are in ms


def _device_provider(
    sources: dict[str, Tensor], capacity: int, layout: Layout
) -> DevicePlannedProvider:
    return DevicePlannedProvider(
        **{n: sources.get(n) for n in SOURCE_NAMES},  # type: ignore[arg-type]
        capacity=capacity,
        device="cuda",
        layout=layout,
        share_sources=layout == "separate",
    )


def _captured(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``body`` captured in a new graph, with garbage collection held off during the capture
    (freeing pinned buffers queries their events, which a capture forbids)."""
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            body()
    finally:
        gc.enable()
    return graph


class OneStepGraph:
    """One decode step captured once: the passes, the gather and a reader of the slots."""

    def __init__(self, provider: DevicePlannedProvider, top_k: int, rows: int = 1) -> None:
        self.provider = provider
        self.ids = torch.zeros(rows, top_k, dtype=torch.int64, device="cuda")
        self.sink = torch.zeros((), device="cuda")
        total = provider.num_passes(self.ids)
        for index in range(total):  # compile every specialization before the capture
            provider.prepare(self.ids, pass_index=index, passes=total)
        torch.cuda.synchronize()

        def step() -> None:
            for index in range(total):
                result = provider.prepare(self.ids, pass_index=index, passes=total)
                self.sink.add_(consume(result, self.ids))

        self.graph = _captured(step)
        torch.cuda.synchronize()

    def step(self, ids: list[int], staged: Tensor) -> tuple[float, float]:
        """(replay ms, input write + replay ms) of one step requesting ``ids``."""
        staged.copy_(torch.tensor([ids], dtype=torch.int64))
        stream = torch.cuda.current_stream()
        begin, start, end = _event(), _event(), _event()
        begin.record(stream)
        self.ids.copy_(staged, non_blocking=True)
        start.record(stream)
        self.graph.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end), begin.elapsed_time(end)


def _fill(
    provider: DevicePlannedProvider, graph: OneStepGraph, settings: argparse.Namespace
) -> None:
    """Fill every slot (all-miss steps through the graph) so that later steps evict."""
    rng = random.Random(0)
    staged = torch.zeros(1, settings.top_k, dtype=torch.int64, pin_memory=True)
    while len(provider.resident_experts()) < settings.capacity:
        ids = exact_miss_request(
            provider, settings.top_k, top_k=settings.top_k, num_experts=settings.experts, rng=rng
        )
        graph.step(ids, staged)


def _cells(
    provider: DevicePlannedProvider,
    graph: OneStepGraph,
    geometry: str,
    layout: str,
    settings: argparse.Namespace,
    ceilings: dict[int, float],
) -> list[dict[str, Any]]:
    expert_bytes = GEOMETRIES[geometry].expert_bytes
    staged = torch.zeros(1, settings.top_k, dtype=torch.int64, pin_memory=True)
    rows = []
    for misses in settings.misses:
        rng = random.Random(100 + misses)
        replays: list[float] = []
        steps: list[float] = []
        for index in range(settings.warmup + settings.steps):
            ids = exact_miss_request(
                provider, misses, top_k=settings.top_k, num_experts=settings.experts, rng=rng
            )
            before = provider.state.counters[1].item()
            replay_ms, step_ms = graph.step(ids, staged)
            made = provider.state.counters[1].item() - before
            if made != misses:
                raise RuntimeError(f"a step made {made} misses, expected {misses}")
            if index >= settings.warmup:
                replays.append(replay_ms)
                steps.append(step_ms)
        copied = misses * expert_bytes
        device_us = _median_us(replays)
        gbps = copied / (device_us * 1e-6) / 1e9 if copied else None
        ceiling = ceilings.get(copied)
        rows.append(
            {
                "geometry": geometry,
                "layout": layout,
                "misses": misses,
                "bytes_per_step": copied,
                "device_us_median": device_us,
                "step_us_median": _median_us(steps),
                "gbps": gbps,
                "ceiling_gbps": ceiling,
                "fraction": gbps / ceiling if gbps and ceiling else None,
            }
        )
        _log(f"device {geometry} {layout} misses={misses}: {rows[-1]}")
    return rows


def _replayed_per_layer(body: Callable[[], object]) -> float:
    """Median us per layer of a graph of ``LAYERS`` repetitions of ``body``, replayed back
    to back."""
    body()
    torch.cuda.synchronize()

    def layers() -> None:
        for _ in range(LAYERS):
            body()

    graph = _captured(layers)
    torch.cuda.synchronize()
    times = []
    stream = torch.cuda.current_stream()
    for _ in range(30):
        start, end = _event(), _event()
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return _median_us(times) / LAYERS


def _fixed_costs(provider: DevicePlannedProvider, top_k: int) -> dict[str, float]:
    ids = torch.tensor([list(range(top_k))], dtype=torch.int64, device="cuda")
    provider.prepare(ids)
    kernels = provider._kernels
    state = provider.state
    # More entries than slots, all of them the first top_k experts: two passes, the second
    # one empty.
    rows = -(-(provider.capacity + 1) // top_k)
    two = torch.tensor([list(range(top_k))] * rows, device="cuda")
    passes = provider.num_passes(two)
    out = {
        "pass_us_per_layer_0_misses": _replayed_per_layer(lambda: provider.prepare(ids)),
        "planner_us_per_layer": _replayed_per_layer(lambda: kernels.plan(state, ids, 0, 1)),
    }
    if passes > 1:
        out["empty_pass_us"] = _replayed_per_layer(
            lambda: provider.prepare(two, pass_index=passes - 1, passes=passes)
        )
    host = []
    graph = OneStepGraph(provider, top_k)
    for _ in range(200):
        t0 = time.perf_counter()
        graph.graph.replay()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out["graph_launch_host_us_median"] = statistics.median(host) * 1e6
    return out


def _trace_device(
    provider: DevicePlannedProvider, trace: list[list[int]], top_k: int
) -> dict[str, float]:
    graph = OneStepGraph(provider, top_k)
    staged = torch.zeros(1, top_k, dtype=torch.int64, pin_memory=True)
    before = provider.state.counters.tolist()
    replays, steps = [], []
    for ids in trace:
        replay_ms, step_ms = graph.step(ids, staged)
        replays.append(replay_ms)
        steps.append(step_ms)
    after = provider.state.counters.tolist()
    hits, misses = after[0] - before[0], after[1] - before[1]
    return {
        "steps": len(trace),
        "hit_rate": hits / max(1, hits + misses),
        "misses_per_step": misses / len(trace),
        "device_us_mean": statistics.fmean(replays) * 1e3,
        "device_us_median": _median_us(replays),
        "step_us_mean": statistics.fmean(steps) * 1e3,
        "host_us_per_replay_in_provider": 0.0,
    }


def run(settings: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    trace = generate_trace(TraceSpec(steps=settings.trace_steps), settings.experts, settings.top_k)
    sizes = sorted(
        {m * GEOMETRIES[g].expert_bytes for g in settings.geometries for m in settings.misses} - {0}
    )
    ceilings = {s: measure_ceiling(s, repeats=20, device=device) for s in sizes}
    cells: list[dict[str, Any]] = []
    host_cells: list[dict[str, Any]] = []
    fixed: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    for geometry in settings.geometries:
        sources = make_sources(GEOMETRIES[geometry], settings.experts, seed=7)
        for layout in settings.layouts:
            provider = _device_provider(sources, settings.capacity, layout)
            graph = OneStepGraph(provider, settings.top_k)
            _fill(provider, graph, settings)
            cells += _cells(provider, graph, geometry, layout, settings, ceilings)
            fixed.append(
                {"geometry": geometry, "layout": layout, **_fixed_costs(provider, settings.top_k)}
            )
            _log(f"fixed {fixed[-1]}")
            del provider, graph
            gc.collect()
            fresh = _device_provider(sources, settings.capacity, layout)
            traces.append(
                {
                    "geometry": geometry,
                    "planner": "device",
                    "layout": layout,
                    **_trace_device(fresh, trace, settings.top_k),
                }
            )
            _log(f"trace {traces[-1]}")
            del fresh
            gc.collect()
        host = PROVIDERS["row_packed"](sources, settings.capacity, device)
        fill(host, settings.capacity, settings.top_k, settings.experts)
        for misses in settings.misses:
            timing = measure_cell(
                host,
                misses,
                top_k=settings.top_k,
                num_experts=settings.experts,
                steps=settings.steps,
                warmup=settings.warmup,
                seed=100 + misses,
                device=device,
            )
            copied = misses * GEOMETRIES[geometry].expert_bytes
            host_cells.append(
                {
                    "geometry": geometry,
                    "provider": "row_packed",
                    "misses": misses,
                    "bytes_per_step": copied,
                    **timing,
                }
            )
            _log(f"host {geometry} misses={misses}: {timing}")
        del host
        gc.collect()
        host = PROVIDERS["row_packed"](sources, settings.capacity, device)
        traces.append(
            {
                "geometry": geometry,
                "planner": "host",
                "layout": "packed",
                **replay(host, trace, device),
            }
        )
        _log(f"trace {traces[-1]}")
        del host, sources
        gc.collect()
        torch.cuda.synchronize()
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": settings.commit,
            "command": " ".join(sys.argv),
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "num_experts": settings.experts,
            "top_k": settings.top_k,
            "capacity": settings.capacity,
            "steps_per_cell": settings.steps,
            "layers_per_fixed_cost_graph": LAYERS,
        },
        "ceilings": [{"bytes": s, "gbps": g} for s, g in sorted(ceilings.items())],
        "device_cells": cells,
        "host_cells": host_cells,
        "fixed_costs": fixed,
        "trace": traces,
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rowcache.bench.device_path", description=__doc__
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--trace-steps", type=int, default=1000)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--geometries", default=",".join(GEOMETRIES))
    parser.add_argument("--layouts", default="separate,packed")
    parser.add_argument("--misses", default=",".join(map(str, MISSES)))
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)
    args.geometries = [g for g in args.geometries.split(",") if g]
    for name in args.geometries:
        if name not in GEOMETRIES:
            parser.error(f"unknown geometry {name!r} (known: {', '.join(GEOMETRIES)})")
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.misses = tuple(int(m) for m in args.misses.split(","))
    args.commit = args.commit or _commit()
    if not torch.cuda.is_available():
        parser.error("the device-path benchmark needs a CUDA device")
    document = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "device_path.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    _log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
