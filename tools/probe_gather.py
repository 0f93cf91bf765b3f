"""Probe: the fused gather's rate inside a replayed CUDA graph, by work-item size, programs
per SM and warps, for 1 to 8 misses of the bench's bf16 and NVFP4 experts.

Each variant captures one graph of a single pass (planner + gather, no reader) and replays it
with requests of exactly ``m`` misses; the median replay time at ``m`` misses minus the median
at 0 misses is the miss path's time. Prints one line per (variant, geometry) and writes
``probe_gather.json`` to ``--out``.

    python tools/probe_gather.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

import torch

from rowcache.bench.geometry import GEOMETRIES, make_sources
from rowcache.bench.steps import exact_miss_request
from rowcache.device_plan.kernels import TritonKernels
from rowcache.device_plan.provider import DevicePlannedProvider
from rowcache.sources import SOURCE_NAMES

E, K, C = 128, 8, 32
VARIANTS = [
    (32768, 4, 4),
    (16384, 8, 4),
    (8192, 8, 4),
    (8192, 16, 4),
    (16384, 16, 8),
    (4096, 16, 4),
]


def _median_replay_ms(provider: DevicePlannedProvider, misses: int, steps: int) -> float:
    ids = torch.zeros(1, K, dtype=torch.int64, device="cuda")
    provider.prepare(ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        provider.prepare(ids)
    rng = random.Random(misses)
    times = []
    for _ in range(steps):
        chosen = exact_miss_request(provider, misses, top_k=K, num_experts=E, rng=rng)
        ids.copy_(torch.tensor([chosen]))
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    rows = []
    for name in ("bf16", "nvfp4"):
        geometry = GEOMETRIES[name]
        sources = make_sources(geometry, E, seed=7)
        for chunk, per_sm, warps in VARIANTS:
            provider = DevicePlannedProvider(
                **{n: sources.get(n) for n in SOURCE_NAMES},  # type: ignore[arg-type]
                capacity=C,
                device="cuda",
            )
            provider._kernels = TritonKernels(
                provider._sources,
                provider._slots,
                E,
                chunk_bytes=chunk,
                programs_per_sm=per_sm,
                gather_warps=warps,
            )
            rng = random.Random(0)
            while len(provider.resident_experts()) < C:
                ids = exact_miss_request(provider, K, top_k=K, num_experts=E, rng=rng)
                provider.prepare(torch.tensor([ids], device="cuda"))
            base = _median_replay_ms(provider, 0, args.steps)
            line = f"{name:6} chunk {chunk:6} per_sm {per_sm:3} warps {warps}: "
            line += f"0 miss {base * 1e3:6.1f} us"
            gbps_by_misses: dict[int, float] = {}
            row: dict[str, Any] = {
                "geometry": name,
                "chunk": chunk,
                "per_sm": per_sm,
                "warps": warps,
                "zero_us": base * 1e3,
                "gbps": gbps_by_misses,
            }
            for misses in (1, 2, 4, 8):
                ms = _median_replay_ms(provider, misses, args.steps)
                gbps = misses * geometry.expert_bytes / (ms * 1e-3) / 1e9
                gbps_by_misses[misses] = gbps
                line += f" | {misses}: {gbps:5.1f} GB/s"
            print(line, flush=True)
            rows.append(row)
            del provider
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_gather.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
