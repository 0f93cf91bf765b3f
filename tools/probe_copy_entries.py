"""How the copy-stream time of one ``cudaMemcpyBatchAsync`` grows with its number of entries.

    PYTHONPATH=. python3 tools/probe_copy_entries.py [--repeats N]

The NVFP4 expert of the benchmark is six byte ranges (1.5 MiB, 768 KiB, 192 KiB, 96 KiB and
two of 4 bytes). For 1, 2, 4 and 8 experts this times, on a created stream with CUDA events
around the call, the same bytes issued three ways: one entry per tensor per expert (the row
provider's separate slot tensors), one entry per expert (a packed layout holding each expert's
tensors in one range), and one entry for everything (the pinned ceiling). Prints the median
time of each and its rate as a fraction of the single copy, one line per expert count.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from rowcache.backends.batched_copy import load_runtime

TENSOR_BYTES = (1536 * 1024, 2048 * 384, 1536 * 128, 2048 * 48, 4, 4)
EXPERTS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    repeats = parser.parse_args().repeats
    if not torch.cuda.is_available():
        raise SystemExit("probe_copy_entries: needs a CUDA device")
    rt = load_runtime()
    expert_bytes = sum(TENSOR_BYTES)
    # Offsets of each tensor inside an expert, 256-byte aligned as a packed layout would be.
    offsets, at = [], 0
    for size in TENSOR_BYTES:
        offsets.append(at)
        at += (size + 255) // 256 * 256
    packed = at
    host = torch.empty(EXPERTS * packed, dtype=torch.uint8).pin_memory()
    device = torch.empty(EXPERTS * packed, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    handle = rt.cudaStream_t(stream.cuda_stream)
    attr = rt.cudaMemcpyAttributes()
    attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    hsrc, hdst = host.data_ptr(), device.data_ptr()

    def batch(entries: list[tuple[int, int, int]]) -> float:
        times: list[float] = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            dsts = [hdst + d for d, _, _ in entries]
            srcs = [hsrc + s for _, s, _ in entries]
            sizes = [n for _, _, n in entries]
            err = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attr], [0], 1, handle)
            if err[0] != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaMemcpyBatchAsync failed: {err[0]!r}")
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    print(
        f"{'experts':>7} {'bytes':>10} {'per-tensor us':>14} {'per-expert us':>14} "
        f"{'one copy us':>12} {'tensor/one':>10} {'expert/one':>10}"
    )
    for count in (1, 2, 4, 8):
        # Experts 0, 2, 4...: no two adjacent, so per-expert ranges cannot merge.
        chosen = [2 * i for i in range(count)]
        per_tensor = [
            (e * packed + off, e * packed + off, size)
            for e in chosen
            for off, size in zip(offsets, TENSOR_BYTES, strict=True)
        ]
        per_expert = [(e * packed, e * packed, expert_bytes) for e in chosen]
        one = [(0, 0, count * expert_bytes)]
        t_tensor, t_expert, t_one = batch(per_tensor), batch(per_expert), batch(one)
        print(
            f"{count:>7} {count * expert_bytes:>10} {t_tensor * 1e6:>14.1f} "
            f"{t_expert * 1e6:>14.1f} {t_one * 1e6:>12.1f} {t_one / t_tensor:>10.3f} "
            f"{t_one / t_expert:>10.3f}"
        )


if __name__ == "__main__":
    main()
