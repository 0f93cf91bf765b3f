"""The device-planned path inside a replayed CUDA graph of a whole forward, beside the host path.

``python -m rowcache.bench.device_path --out DIR`` writes ``device_path.json`` (and
``device_path.png`` when matplotlib is importable; else ``python -m
rowcache.bench.plot_device_path DIR/device_path.json`` draws it later, on any machine). Per
expert geometry and slot layout:

* **cells**: ``LAYERS`` (8) ``DevicePlannedProvider`` instances, one per layer, each with its
  own slots; a graph of one decode step of the whole forward (per layer: the planner, the
  gather and a one-kernel reader of the layer's slots) is captured once. Each measured step
  writes into every layer's captured ``topk_ids`` a request with exactly ``m`` misses for that
  layer (``rowcache.bench.steps.exact_miss_request``: the count is exact whatever slot a miss
  lands in), replays the graph, and is timed with CUDA events around the replay alone
  (``device``) and around the input write plus the replay (``step``). Per-layer figures are
  the graph's total divided by the number of layers, nothing subtracted; bytes copied per
  layer over the per-layer device time against the pinned ceiling at that copy size;
* **host path**: the same requests through ``RowCacheWeightProvider`` (copy engine, packed
  layout, one layer), timed like ``rowcache.bench.cells``, in the same run;
* **fixed costs** at 0 misses, in graphs of the same ``LAYERS`` layers: the planner alone, and
  the pass (planner + gather) without the reader; the host time of one graph launch;
* **trace**: the routing trace of ``rowcache.bench.trace``, every step written to every layer,
  replayed through the forward graph (slots emptied first) and through the host path.

Host memory: the separate slot layout shares one pinned copy of the experts among the layers
(``share_sources=True``); the packed layout packs its own copy per layer, so the 100 MB
geometry runs with ``--large-experts`` experts per layer (default 40: about 4 GB a layer).

The providers do no host work per replay: the host only launches the graph (``handoff()`` of
every layer, host-only, before the timed region).
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

from rowcache.bench.device_report import format_table, sample_stats
from rowcache.bench.geometry import GEOMETRIES, KNOWN_GEOMETRIES, make_sources
from rowcache.bench.steps import exact_miss_request
from rowcache.torch_seams import HOST_EMPTY_CACHE, lookup

__all__ = ["LAYERS", "main"]

MISSES = (0, 1, 2, 4, 8)
LAYERS = 8
QUICK = {"steps": 8, "warmup": 2, "trace_steps": 60, "fixed_replays": 10}
"""``--quick``: a smoke run (every cell, few steps)."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _release_pinned() -> None:
    """Hand cached pinned host blocks back (the host allocator keeps freed ones)."""
    gc.collect()
    torch.cuda.synchronize()
    empty = lookup(HOST_EMPTY_CACHE)
    if callable(empty):
        empty()
    torch.cuda.empty_cache()


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
    torch.cuda.synchronize()
    return graph


def _first_elements(weights: Tensor) -> Tensor:
    """``[slots]``: the first element of every slot (a strided view, never a copy)."""
    while weights.dim() > 1:
        weights = weights.select(1, 0)
    return weights


class Forward:
    """The layers' providers and their captured ``topk_ids`` (``[layers, 1, top_k]``)."""

    def __init__(self, layers: list[Any], top_k: int, num_experts: int) -> None:
        self.layers = layers
        self.top_k = top_k
        self.num_experts = num_experts
        self.ids = torch.zeros(len(layers), 1, top_k, dtype=torch.int64, device="cuda")
        self.staged = torch.zeros(len(layers), 1, top_k, dtype=torch.int64, pin_memory=True)
        self.sink = torch.zeros(len(layers), dtype=torch.float32, device="cuda")

    def counters(self) -> list[tuple[int, int]]:
        """(hits, misses) of every layer, read back (waits for the device)."""
        from rowcache.device_plan.state import COUNTERS

        hits, misses = COUNTERS.index("hits"), COUNTERS.index("misses")
        rows = torch.stack([p.state.counters for p in self.layers]).tolist()
        return [(int(r[hits]), int(r[misses])) for r in rows]

    def body(self, *, reader: bool = True, planner_only: bool = False) -> Callable[[], None]:
        """One decode step of the forward: every layer's passes, each followed by the reader."""

        def run() -> None:
            for index, provider in enumerate(self.layers):
                ids = self.ids[index]
                if planner_only:
                    provider._kernels.plan(provider.state, ids, 0, 1)
                    continue
                total = provider.num_passes(ids)
                for pass_index in range(total):
                    result = provider.prepare(ids, pass_index=pass_index, passes=total)
                    if reader:
                        torch.sum(
                            _first_elements(result.w1),
                            dim=0,
                            dtype=torch.float32,
                            out=self.sink[index],
                        )

        return run

    def capture(self, *, reader: bool = True, planner_only: bool = False) -> torch.cuda.CUDAGraph:
        """Run the step once eagerly (compiles every kernel specialization), then capture it."""
        body = self.body(reader=reader, planner_only=planner_only)
        body()
        torch.cuda.synchronize()
        return _captured(body)

    def write(self, requests: list[list[int]]) -> None:
        """Stage one request per layer (pinned; copied into ``ids`` by ``step``)."""
        self.staged.copy_(torch.tensor(requests, dtype=torch.int64).unsqueeze(1))

    def step(self, graph: torch.cuda.CUDAGraph) -> tuple[float, float]:
        """(replay ms, input write + replay ms) of the staged requests."""
        for provider in self.layers:
            provider.handoff()
        stream = torch.cuda.current_stream()
        begin, start, end = _event(), _event(), _event()
        begin.record(stream)
        self.ids.copy_(self.staged, non_blocking=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end), begin.elapsed_time(end)

    def requests(self, misses: int, rng: random.Random) -> list[list[int]]:
        return [
            exact_miss_request(
                provider, misses, top_k=self.top_k, num_experts=self.num_experts, rng=rng
            )
            for provider in self.layers
        ]

    def empty(self) -> None:
        """Free every layer's slots (eager invalidations, outside any graph)."""
        for provider in self.layers:
            for expert in sorted(provider.resident_experts()):
                provider.invalidate(expert)
        torch.cuda.synchronize()


def _layers(sources: dict[str, Tensor], settings: argparse.Namespace, layout: str) -> list[Any]:
    from rowcache.device_plan.provider import DevicePlannedProvider
    from rowcache.sources import SOURCE_NAMES

    return [
        DevicePlannedProvider(
            **{n: sources.get(n) for n in SOURCE_NAMES},  # type: ignore[arg-type]
            capacity=settings.capacity,
            device="cuda",
            layout=layout,  # type: ignore[arg-type]
            share_sources=layout == "separate",
        )
        for _ in range(settings.layers)
    ]


def _fill(forward: Forward, graph: torch.cuda.CUDAGraph, capacity: int) -> None:
    """Fill every layer's slots (all-miss steps through the graph) so that later steps evict."""
    rng = random.Random(0)
    while min(len(p.resident_experts()) for p in forward.layers) < capacity:
        forward.write(
            [
                exact_miss_request(
                    p,
                    min(forward.top_k, capacity - len(p.resident_experts())),
                    top_k=forward.top_k,
                    num_experts=forward.num_experts,
                    rng=rng,
                )
                for p in forward.layers
            ]
        )
        forward.step(graph)


def _per_layer_us(samples_ms: list[float], layers: int) -> dict[str, float]:
    return sample_stats([s * 1e3 / layers for s in samples_ms])


def _cells(
    forward: Forward,
    graph: torch.cuda.CUDAGraph,
    geometry: str,
    layout: str,
    settings: argparse.Namespace,
    ceilings: dict[int, float],
) -> list[dict[str, Any]]:
    expert_bytes = KNOWN_GEOMETRIES[geometry].expert_bytes
    layers = len(forward.layers)
    rows = []
    for misses in settings.misses:
        rng = random.Random(100 + misses)
        replays: list[float] = []
        steps: list[float] = []
        for index in range(settings.warmup + settings.steps):
            forward.write(forward.requests(misses, rng))
            before = forward.counters()
            replay_ms, step_ms = forward.step(graph)
            after = forward.counters()
            made = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
            if any(m != misses for m in made):
                raise RuntimeError(f"a step made {made} misses per layer, expected {misses}")
            if index >= settings.warmup:
                replays.append(replay_ms)
                steps.append(step_ms)
        copied = misses * expert_bytes
        device = _per_layer_us(replays, layers)
        gbps = copied / (device["median"] * 1e-6) / 1e9 if copied else None
        ceiling = ceilings.get(copied)
        rows.append(
            {
                "geometry": geometry,
                "layout": layout,
                "misses": misses,
                "layers": layers,
                "bytes_per_layer_step": copied,
                "device_us_per_layer": device,
                "step_us_per_layer": _per_layer_us(steps, layers),
                "gbps": gbps,
                "ceiling_gbps": ceiling,
                "fraction": gbps / ceiling if gbps and ceiling else None,
                "replay_ms_samples": replays,
                "step_ms_samples": steps,
            }
        )
        _log(
            f"device {geometry} {layout} misses={misses}: "
            f"{device['median']:.1f} us/layer, fraction {rows[-1]['fraction']}"
        )
    return rows


def _replays(forward: Forward, graph: torch.cuda.CUDAGraph, count: int) -> list[float]:
    """ms of ``count`` replays of ``graph``, back to back, each timed alone."""
    for provider in forward.layers:
        provider.handoff()
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(count + 3):
        start, end = _event(), _event()
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times[3:]


def _fixed_costs(forward: Forward, settings: argparse.Namespace) -> dict[str, Any]:
    """The planner alone and the pass without the reader, at 0 misses, per layer."""
    rng = random.Random(5)
    forward.write(forward.requests(0, rng))
    forward.ids.copy_(forward.staged)
    before = forward.counters()
    passes = forward.capture(reader=False)
    planner = forward.capture(planner_only=True)
    pass_ms = _replays(forward, passes, settings.fixed_replays)
    planner_ms = _replays(forward, planner, settings.fixed_replays)
    made = [a[1] - b[1] for a, b in zip(forward.counters(), before, strict=True)]
    if any(made):
        raise RuntimeError(f"the 0-miss fixed-cost graphs made {made} misses per layer")
    host = []
    for _ in range(settings.fixed_replays):
        t0 = time.perf_counter()
        passes.replay()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    layers = len(forward.layers)
    pass_stats = _per_layer_us(pass_ms, layers)
    planner_stats = _per_layer_us(planner_ms, layers)
    del passes, planner
    return {
        "pass_us_per_layer": pass_stats["median"],
        "planner_us_per_layer": planner_stats["median"],
        "pass_us_per_layer_stats": pass_stats,
        "planner_us_per_layer_stats": planner_stats,
        "pass_ms_samples": pass_ms,
        "planner_ms_samples": planner_ms,
        "graph_launch_host_us_median": statistics.median(host) * 1e6,
    }


def _trace_device(
    forward: Forward, graph: torch.cuda.CUDAGraph, trace: list[list[int]]
) -> dict[str, Any]:
    forward.empty()
    before = forward.counters()
    replays, steps = [], []
    for ids in trace:
        forward.write([ids] * len(forward.layers))
        replay_ms, step_ms = forward.step(graph)
        replays.append(replay_ms)
        steps.append(step_ms)
    after = forward.counters()
    layers = len(forward.layers)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    misses = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    device = _per_layer_us(replays, layers)
    return {
        "steps": len(trace),
        "layers": layers,
        "hit_rate": hits / max(1, hits + misses),
        "misses_per_step_per_layer": misses / len(trace) / layers,
        "device_us_per_layer_mean": device["mean"],
        "device_us_per_layer": device,
        "step_us_per_layer": _per_layer_us(steps, layers),
        "host_us_per_replay_in_provider": 0.0,
        "replay_ms_samples": replays,
    }


def _host_path(
    sources: dict[str, Tensor],
    geometry: str,
    settings: argparse.Namespace,
    trace: list[list[int]],
    device: torch.device,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from rowcache.bench.cells import fill, measure_cell
    from rowcache.bench.providers import PROVIDERS
    from rowcache.bench.trace import replay

    experts = settings.experts_of[geometry]
    host = PROVIDERS["row_packed"](sources, settings.capacity, device)
    fill(host, settings.capacity, settings.top_k, experts)
    cells = []
    for misses in settings.misses:
        timing = measure_cell(
            host,
            misses,
            top_k=settings.top_k,
            num_experts=experts,
            steps=settings.steps,
            warmup=settings.warmup,
            seed=100 + misses,
            device=device,
        )
        cells.append(
            {
                "geometry": geometry,
                "provider": "row_packed",
                "misses": misses,
                "bytes_per_step": misses * KNOWN_GEOMETRIES[geometry].expert_bytes,
                **timing,
            }
        )
        _log(f"host {geometry} misses={misses}: {timing}")
    del host
    gc.collect()
    host = PROVIDERS["row_packed"](sources, settings.capacity, device)
    traced: dict[str, Any] = {"geometry": geometry, "planner": "host", "layout": "packed"}
    traced.update(replay(host, trace, device))
    _log(f"trace host {geometry}: {traced}")
    del host
    gc.collect()
    return cells, traced


def _geometry(
    geometry: str,
    settings: argparse.Namespace,
    ceilings: dict[int, float],
    device: torch.device,
    document: dict[str, Any],
) -> None:
    from rowcache.bench.trace import TraceSpec, generate_trace

    experts = settings.experts_of[geometry]
    trace = generate_trace(TraceSpec(steps=settings.trace_steps), experts, settings.top_k)
    started = time.perf_counter()
    sources = make_sources(KNOWN_GEOMETRIES[geometry], experts, seed=7)
    _log(
        f"{geometry}: {experts} experts per layer, sources in {time.perf_counter() - started:.1f}s"
    )
    for layout in settings.layouts:
        started = time.perf_counter()
        forward = Forward(_layers(sources, settings, layout), settings.top_k, experts)
        graph = forward.capture()
        _log(
            f"{geometry} {layout}: {settings.layers} layers built and captured in "
            f"{time.perf_counter() - started:.1f}s"
        )
        _fill(forward, graph, settings.capacity)
        document["device_cells"] += _cells(forward, graph, geometry, layout, settings, ceilings)
        fixed = {"geometry": geometry, "layout": layout, **_fixed_costs(forward, settings)}
        document["fixed_costs"].append(fixed)
        _log(
            f"fixed {geometry} {layout}: planner {fixed['planner_us_per_layer']:.2f} us, pass "
            f"{fixed['pass_us_per_layer']:.2f} us per layer"
        )
        traced: dict[str, Any] = {"geometry": geometry, "planner": "device", "layout": layout}
        traced.update(_trace_device(forward, graph, trace))
        document["trace"].append(traced)
        _log(
            f"trace device {geometry} {layout}: hit rate {traced['hit_rate']:.3f}, "
            f"{traced['device_us_per_layer_mean']:.1f} us/layer"
        )
        del forward, graph
        _release_pinned()
    if not settings.no_host:
        cells, traced = _host_path(sources, geometry, settings, trace, device)
        document["host_cells"] += cells
        document["trace"].append(traced)
    del sources
    _release_pinned()


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version: str | None = str(triton.__version__)
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def _driver() -> str:
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[0]
        )
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def run(settings: argparse.Namespace, write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The whole bench; ``write`` is called with the document after every geometry."""
    from rowcache.bench.ceilings import measure_ceiling

    device = torch.device("cuda", torch.cuda.current_device())
    began = time.perf_counter()
    document: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": settings.commit,
            "command": " ".join(
                [Path(sys.executable).name, "-m", "rowcache.bench.device_path", *settings.argv]
            ),
            "gpu": torch.cuda.get_device_name(device),
            "driver": _driver(),
            **_versions(),
            "layers": settings.layers,
            "experts_per_layer": settings.experts_of,
            "top_k": settings.top_k,
            "capacity": settings.capacity,
            "steps_per_cell": settings.steps,
            "warmup_per_cell": settings.warmup,
            "trace_steps": settings.trace_steps,
            "fixed_replays": settings.fixed_replays,
            "host_sources": "separate: one pinned copy shared by the layers; packed: one per layer",
        },
        "ceilings": [],
        "device_cells": [],
        "host_cells": [],
        "fixed_costs": [],
        "trace": [],
    }
    sizes = sorted(
        {m * KNOWN_GEOMETRIES[g].expert_bytes for g in settings.geometries for m in settings.misses}
        - {0}
    )
    ceilings = {
        s: measure_ceiling(s, repeats=settings.ceiling_repeats, device=device) for s in sizes
    }
    document["ceilings"] = [{"bytes": s, "gbps": g} for s, g in sorted(ceilings.items())]
    _release_pinned()
    _log(f"ceilings measured: {document['ceilings']}")
    for geometry in settings.geometries:
        started = time.perf_counter()
        _geometry(geometry, settings, ceilings, device, document)
        document["meta"][f"seconds_{geometry}"] = round(time.perf_counter() - started, 1)
        document["meta"]["seconds_total"] = round(time.perf_counter() - began, 1)
        write(document)
        _log(f"{geometry} done in {document['meta'][f'seconds_{geometry}']}s")
    return document


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (checked; no device needed)."""
    parser = argparse.ArgumentParser(
        prog="python -m rowcache.bench.device_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: --steps 8 --warmup 2 --trace-steps 60, 10 fixed replays",
    )
    parser.add_argument("--steps", type=int, default=None, help="measured steps per cell (40)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per cell (5)")
    parser.add_argument("--trace-steps", type=int, default=None, help="trace steps (300)")
    parser.add_argument(
        "--fixed-replays", type=int, default=None, help="replays of each fixed-cost graph (50)"
    )
    parser.add_argument("--ceiling-repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--experts", type=int, default=128, help="experts per layer")
    parser.add_argument(
        "--large-experts",
        type=int,
        default=40,
        help="experts per layer of bf16_large (host memory: 100 MB each)",
    )
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=32)
    parser.add_argument("--geometries", default=",".join(GEOMETRIES))
    parser.add_argument("--layouts", default="separate,packed")
    parser.add_argument("--misses", default=",".join(map(str, MISSES)))
    parser.add_argument("--no-host", action="store_true", help="skip the host path")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)
    full = {"steps": 40, "warmup": 5, "trace_steps": 300, "fixed_replays": 50}
    for name, value in (QUICK if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.geometries = [g for g in args.geometries.split(",") if g]
    for name in args.geometries:
        if name not in KNOWN_GEOMETRIES:
            parser.error(f"unknown geometry {name!r} (known: {', '.join(KNOWN_GEOMETRIES)})")
    args.layouts = [x for x in args.layouts.split(",") if x]
    for layout in args.layouts:
        if layout not in ("separate", "packed"):
            parser.error(f"unknown layout {layout!r} (known: separate, packed)")
    try:
        args.misses = tuple(int(m) for m in args.misses.split(","))
    except ValueError:
        parser.error(f"--misses takes integers separated by commas, got {args.misses!r}")
    if any(not 0 <= m <= args.top_k for m in args.misses):
        parser.error(f"--misses must lie in [0, top_k={args.top_k}]")
    if args.steps < 1 or args.warmup < 0 or args.trace_steps < 1 or args.fixed_replays < 1:
        parser.error("--steps, --trace-steps and --fixed-replays must be >= 1, --warmup >= 0")
    if args.layers < 1:
        parser.error("--layers must be >= 1")
    args.experts_of = {
        g: (args.large_experts if g == "bf16_large" else args.experts) for g in args.geometries
    }
    for name, experts in args.experts_of.items():
        if experts < args.capacity + args.top_k:
            parser.error(
                f"{name}: {experts} experts per layer; exact-miss steps need at least capacity + "
                f"top_k = {args.capacity + args.top_k}"
            )
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.commit = args.commit or _commit()
    if not torch.cuda.is_available():
        parser.error(
            "the device-path benchmark needs a CUDA device (torch.cuda.is_available() is False); "
            "the table and plot of an existing JSON: python -m rowcache.bench.plot_device_path"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "device_path.json"

    def write(document: dict[str, Any]) -> None:
        path.write_text(json.dumps(document, indent=1) + "\n")

    document = run(args, write)
    write(document)
    _log(f"wrote {path}")
    if not args.no_plot:
        try:
            from rowcache.bench.plot_device_path import plot

            plot(document, path.with_suffix(".png"))
            _log(f"wrote {path.with_suffix('.png')}")
        except ImportError as error:
            _log(f"no plot ({error}): python -m rowcache.bench.plot_device_path {path}")
    print(format_table(document), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
