"""Where the host time of an all-hit ``prepare`` goes, on a CUDA device.

    PYTHONPATH=. python3 tools/profile_hit_path.py [--calls N]

Builds a small row provider (128 experts, 32 slots), makes the same top-8 request resident,
then times N all-hit ``prepare`` calls (median and 10th percentile of ``time.perf_counter``)
and each piece of the hit path on its own (mean over N calls with ``timeit``): the current
stream lookup, validation, the forward map's staging write (with the ring's event query), its
upload, and the staging reuse event. Calls are made on the current stream as the caller has
it: first on the legacy default stream, then on a created stream. Then the row provider and the
``cached`` baseline side by side, alternating calls, back to back and each right after a
device synchronization. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch

from rowcache import CachedWeightProvider, HostPlannedProvider
from rowcache.validation import requested_experts

NUM_EXPERTS, CAPACITY, TOP_K = 128, 32, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    calls = parser.parse_args().calls
    if not torch.cuda.is_available():
        raise SystemExit("profile_hit_path: needs a CUDA device")
    w13 = torch.zeros(NUM_EXPERTS, 64, 64).pin_memory()
    w2 = torch.zeros(NUM_EXPERTS, 64, 32).pin_memory()
    provider = HostPlannedProvider(w13, w2, capacity=CAPACITY, device="cuda", share_sources=True)
    ids = torch.arange(TOP_K).reshape(1, TOP_K)
    provider.prepare(ids)
    torch.cuda.synchronize()
    # The legacy default stream first, then a created stream (what an engine calls from).
    _profile(provider, ids, calls, "default stream")
    with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
        provider.prepare(ids)  # the owner changes hands once, outside the timed calls
        _profile(provider, ids, calls, "created stream")
    torch.cuda.synchronize()
    _side_by_side(
        provider,
        CachedWeightProvider(w13, w2, capacity=CAPACITY, device="cuda", share_sources=True),
        ids,
    )


def _side_by_side(
    row: HostPlannedProvider, cached: CachedWeightProvider, ids: torch.Tensor
) -> None:
    """Row against the cached baseline, interleaved call by call on one created stream, in
    two regimes: back to back (the device never drains), and right after the host waited for
    the device (as in the benchmark's isolated steps, and in an engine that copies topk_ids to
    the host before each layer's prepare)."""
    with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
        for p in (row, cached):
            p.prepare(ids)
        for regime in ("back to back", "after a device sync"):
            times: dict[str, list[float]] = {"row": [], "cached": []}
            for _ in range(2000):
                for name, p in (("row", row), ("cached", cached)):
                    if regime != "back to back":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    p.prepare(ids)
                    times[name].append(time.perf_counter() - start)
            medians = {name: sorted(t)[len(t) // 2] * 1e6 for name, t in times.items()}
            print(
                f"[{regime}] all-hit prepare median: row {medians['row']:.1f} us, cached "
                f"{medians['cached']:.1f} us, row/cached {medians['row'] / medians['cached']:.2f}"
            )
    torch.cuda.synchronize()


def _profile(provider: HostPlannedProvider, ids: torch.Tensor, calls: int, where: str) -> None:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        provider.prepare(ids)
        times.append(time.perf_counter() - start)
    times.sort()
    print(
        f"[{where}] all-hit prepare: median {times[len(times) // 2] * 1e6:.1f} us, "
        f"p10 {times[len(times) // 10] * 1e6:.1f} us ({calls} calls)"
    )

    backend = provider.backend
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream()
    forward = torch.frombuffer(bytearray(4 * NUM_EXPERTS), dtype=torch.int32)
    pieces = {
        "current_stream": lambda: backend.current_stream(),
        "validation": lambda: requested_experts(ids, None, NUM_EXPERTS, CAPACITY, device=device),
        "write_staging": lambda: backend.write_staging("forward", forward),
        "upload_map": lambda: backend.upload_map(stream, "forward"),
        "release_staging": lambda: backend.release_staging(stream, "forward"),
    }
    for name, piece in pieces.items():
        mean = timeit.timeit(piece, number=calls) / calls
        print(f"[{where}] {name}: {mean * 1e6:.2f} us")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
