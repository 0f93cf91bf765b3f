"""The decode of bf16 planes into slots against the pinned copy ceiling, in CUDA graphs:
``python -m rowcache.bench.decode_gather --out DIR``.

One layer of Qwen3-30B-A3B expert shapes (``--shape deepseek-v2-lite``: DeepSeek-V2-Lite's;
``E`` experts of w13 ``[2I, H]`` and w2 ``[H, I]`` in bf16, Gaussian weights as the checkpoint
builder makes them) is encoded into bf16 planes
(``rowcache.compress``) held in pinned host memory. For each miss count ``m`` (1, 2, 8, 32):

* **decode**: a CUDA graph of the two decode launches (w13 and w2) over a miss list of ``m``
  experts, reading the planes through unified addressing and writing decoded bf16 into slots,
  is captured once and replayed; each replay is timed with CUDA events, and the bytes
  *decoded* (``m`` experts' bf16 bytes) over the median time is the decoded rate;
* **ceiling**: one pinned host-to-device copy of the same ``m`` experts' bf16 bytes, timed the
  same way (what an uncompressed miss moves at best over the same link);
* **one by one**: the host planner's decode, one eager launch a miss and tensor with the miss
  as the launch's scalars, timed from the first launch to the last one's end (the host's
  launch time shows where the GPU waits for it);
* the slots after the decode are checked bit for bit against the source experts before any
  time is recorded (a decode that is fast and wrong is reported as wrong, not timed).

Writes ``decode_gather.json`` (per count: medians, the rates, their ratio, the planes' ratio
and the encode rate on the device and on the host) and prints a table. ``--device cpu`` runs
the same code under Triton's interpreter (``TRITON_INTERPRET=1``) at ``--quick`` shapes, with
host timers and no graphs: a check of the bench itself, its times meaningless.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rowcache.backends.cuda import DECODE_PROGRAMS_PER_SM
from rowcache.bench.timing import one_call
from rowcache.compress import Bf16Planes, encode
from rowcache.compress.bf16_planes import CODE_WIDTHS
from rowcache.device_plan.kernels import GATHER_PROGRAMS_PER_SM
from rowcache.sources import HELD_CODE_BITS

__all__ = ["main"]

MISSES = (1, 2, 8, 32)
QWEN3 = {"experts": 128, "hidden": 2048, "intermediate": 768}
DEEPSEEK_V2_LITE = {"experts": 64, "hidden": 2048, "intermediate": 1408}
SHAPES = {"qwen3": QWEN3, "deepseek-v2-lite": DEEPSEEK_V2_LITE}
"""The layers ``--shape`` names: Qwen3-30B-A3B's, and DeepSeek-V2-Lite's routed experts (wider;
on an H100 the decode ran at 0.79 to 0.80 x the pinned copy at these shapes, and inside the
engine at that same rate: docs/records/2026-12-06-bench-decode-gather-ds2.md)."""
QUICK = {"experts": 6, "hidden": 64, "intermediate": 24}
PROGRAMS_PER_SM = GATHER_PROGRAMS_PER_SM
"""The device planner's launch (``rowcache.device_plan.kernels``)."""


def launches(sweep: bool) -> tuple[tuple[int, int], ...]:
    """The decode launches timed (warps a program, programs an SM): the providers' first, then
    with ``sweep`` every other of 4, 8 and 16 warps by 4, 8 and 16 programs an SM."""
    from rowcache.compress.triton_decode import DECODE_WARPS  # Triton: only where it runs

    first = (DECODE_WARPS, PROGRAMS_PER_SM)
    if not sweep:
        return (first,)
    return (first, *((w, p) for w in (4, 8, 16) for p in (4, 8, 16) if (w, p) != first))


def _planes_on(planes: Bf16Planes, device: torch.device, pinned: bool) -> Bf16Planes:
    def placed(t: Tensor) -> Tensor:
        return t.cpu().pin_memory() if pinned else t.to(device)

    # The codebook, 16 bytes the kernel reads on every value, on the device.
    return replace(planes.map(placed), codebook=planes.codebook.to(device))


def _encode_rate(weights: Tensor, code_bits: int | None) -> dict[str, float]:
    """GB/s (bf16 bytes in) of ``encode`` where ``weights`` lives, and of the planes' ratio."""
    began = time.perf_counter()
    planes = encode(weights, code_bits)
    if weights.device.type == "cuda":
        torch.cuda.synchronize(weights.device)
    seconds = time.perf_counter() - began
    return {"gb_per_s": planes.raw_nbytes / seconds / 1e9, "ratio": planes.ratio}


def measure(
    shape: dict[str, int],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    code_bits: int | None = HELD_CODE_BITS,
    configs: tuple[tuple[int, int], ...] | None = None,
    on_row: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Each row's decode figures at ``configs[0]`` (warps a program, programs an SM: the
    providers' launch; None: that one alone), and every config's under ``configs``; the copy
    once a row. ``on_row`` gets the result so far after each row (the bench writes it, so that
    a run cut short keeps its rows). A launch of the sweep that decodes wrong bytes is recorded
    as such (``exact`` false) and not timed; a wrong decode of the providers' launches stops
    the bench (``SystemExit``)."""
    from rowcache.compress.triton_decode import SlotDecoder, decode_into_slots

    configs = configs or launches(sweep=False)

    experts, hidden, inter = shape["experts"], shape["hidden"], shape["intermediate"]
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(torch.bfloat16)
    on_gpu = device.type == "cuda"
    encode_host = _encode_rate(w13, code_bits)
    encode_device = _encode_rate(w13.to(device), code_bits) if on_gpu else None
    planes = [_planes_on(encode(w, code_bits), device, pinned=on_gpu) for w in (w13, w2)]
    capacity = max(MISSES) if experts >= max(MISSES) else experts
    slots = [torch.empty((capacity, *w.shape[1:]), dtype=w.dtype, device=device) for w in (w13, w2)]
    expert_bytes = sum(w[0].numel() * w.element_size() for w in (w13, w2))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
    timed = one_call(device)
    # The host planner's decoders, launched as its CUDA backend launches them.
    decoders = [
        SlotDecoder(p, s, grid=sms * DECODE_PROGRAMS_PER_SM)
        for p, s in zip(planes, slots, strict=True)
    ]
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "shape": shape,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "code_bits": code_bits,
        "held_code_bits": {"w13": planes[0].code_bits, "w2": planes[1].code_bits},
        "planes_ratio": {"w13": planes[0].ratio, "w2": planes[1].ratio},
        "encode_host": encode_host,
        "encode_device": encode_device,
        "repeats": repeats,
        "configs": [list(c) for c in configs],
        "rows": rows,
    }
    for misses in (m for m in MISSES if m <= capacity):
        chosen = torch.randperm(experts, generator=gen)[:misses]
        miss_experts = torch.full((capacity,), -1, dtype=torch.int32)
        miss_slots = torch.full((capacity,), -1, dtype=torch.int32)
        miss_experts[:misses] = chosen.to(torch.int32)
        miss_slots[:misses] = torch.arange(misses, dtype=torch.int32)
        lists = [t.to(device) for t in (miss_experts, miss_slots)]
        count = torch.tensor(misses, dtype=torch.int32, device=device)

        def check_exact(
            run: Callable[[], None], launch: str, stop: bool = True, chosen: Tensor = chosen
        ) -> bool:
            """Run ``run`` once into zeroed slots: whether they hold the chosen experts (with
            ``stop``, stop the bench unless they do)."""
            for s in slots:
                s.zero_()
            run()
            if on_gpu:
                torch.cuda.synchronize(device)
            m = len(chosen)
            for s, w in zip(slots, (w13, w2), strict=True):
                if not torch.equal(s[:m].cpu().view(torch.int16), w[chosen].view(torch.int16)):
                    message = f"decode_gather: {m} misses decoded wrong bytes ({launch})"
                    if stop:
                        raise SystemExit(message)
                    print(message, file=sys.stderr, flush=True)
                    return False
            return True

        timings: list[dict[str, Any]] = []
        for index, (warps, per_sm) in enumerate(configs):

            def decode(
                lists: list[Tensor] = lists,
                count: Tensor = count,
                warps: int = warps,
                grid: int = sms * per_sm,
            ) -> None:
                for p, s in zip(planes, slots, strict=True):
                    decode_into_slots(p, s, lists[0], lists[1], count, grid=grid, num_warps=warps)

            run: Callable[[], None] = decode
            if on_gpu:
                decode()  # compiles the kernel outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    decode()
                run = graph.replay
            # Each launch checked before it is timed; the providers' (the first) stops the bench.
            exact = check_exact(run, f"{warps} warps, {per_sm} programs an SM", stop=index == 0)
            timings.append(
                {
                    "num_warps": warps,
                    "programs_per_sm": per_sm,
                    "exact": exact,
                    "decode_s": [timed(run) for _ in range(warmup + repeats)][warmup:]
                    if exact
                    else [],
                }
            )
        # The host planner's decode: one eager launch a miss and tensor, the miss as the
        # launch's scalars, timed from the first launch's start to the last one's end, so that
        # the host's launch time shows wherever the GPU waits for it.
        pairs = [(int(e), slot) for slot, e in enumerate(chosen.tolist())]

        def one_by_one(pairs: list[tuple[int, int]] = pairs) -> None:
            for expert, slot in pairs:
                for decoder in decoders:
                    decoder.decode_one(expert, slot)

        check_exact(one_by_one, "one by one")
        one_s = [timed(one_by_one) for _ in range(warmup + repeats)][warmup:]
        raw = torch.empty(misses * expert_bytes, dtype=torch.uint8, pin_memory=on_gpu)
        target = torch.empty_like(raw, device=device)

        def copy(raw: Tensor = raw, target: Tensor = target) -> None:
            target.copy_(raw, non_blocking=True)

        copy_s = [timed(copy) for _ in range(warmup + repeats)][warmup:]
        decoded = misses * expert_bytes
        moved = sum(p.expert_nbytes(int(e)) for p in planes for e in chosen)
        for timing in timings:
            if not timing["exact"]:
                continue
            median = statistics.median(timing["decode_s"])
            timing["decode_s_median"] = median
            timing["decode_gb_per_s"] = decoded / median / 1e9
            timing["decode_over_copy"] = statistics.median(copy_s) / median
        decode_s = timings[0]["decode_s"]
        rows.append(
            {
                "misses": misses,
                "decoded_bytes": decoded,
                "compressed_bytes_read": moved,
                "decode_s_median": statistics.median(decode_s),
                "copy_s_median": statistics.median(copy_s),
                "decode_gb_per_s": decoded / statistics.median(decode_s) / 1e9,
                "copy_gb_per_s": decoded / statistics.median(copy_s) / 1e9,
                "decode_over_copy": statistics.median(copy_s) / statistics.median(decode_s),
                "decode_s": decode_s,
                "copy_s": copy_s,
                "configs": timings,
                "one_by_one_s": one_s,
                "one_by_one_s_median": statistics.median(one_s),
                "one_by_one_over_copy": statistics.median(copy_s) / statistics.median(one_s),
            }
        )
        on_row(result)
    return result


def format_rows(result: dict[str, Any]) -> str:
    lines = [
        f"{'misses':>7}{'decoded MB':>12}{'read MB':>10}{'decode us':>11}{'copy us':>10}"
        f"{'decode GB/s':>13}{'copy GB/s':>11}{'decode/copy':>13}"
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['misses']:>7}{r['decoded_bytes'] / 1e6:>12.2f}"
            f"{r['compressed_bytes_read'] / 1e6:>10.2f}{r['decode_s_median'] * 1e6:>11.1f}"
            f"{r['copy_s_median'] * 1e6:>10.1f}{r['decode_gb_per_s']:>13.2f}"
            f"{r['copy_gb_per_s']:>11.2f}{r['decode_over_copy']:>12.2f}x"
        )
    lines += ["", "one eager launch a miss and tensor (the host planner's decode):"]
    lines.append(f"{'misses':>7}{'decode us':>11}{'decode/copy':>13}")
    for r in result["rows"]:
        lines.append(
            f"{r['misses']:>7}{r['one_by_one_s_median'] * 1e6:>11.1f}"
            f"{r['one_by_one_over_copy']:>12.2f}x"
        )
    if len(result["configs"]) > 1:
        lines += ["", "decode/copy by launch (warps a program, programs an SM):"]
        lines.append(
            f"{'warps':>7}{'per SM':>8}" + "".join(f"{r['misses']:>8}" for r in result["rows"])
        )
        for i, (warps, per_sm) in enumerate(result["configs"]):
            ratios = "".join(
                f"{r['configs'][i]['decode_over_copy']:>7.2f}x"
                if r["configs"][i]["exact"]
                else f"{'WRONG':>8}"
                for r in result["rows"]
            )
            lines.append(f"{warps:>7}{per_sm:>8}{ratios}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rowcache.bench.decode_gather")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3",
        help="the layer's expert shapes (default qwen3; --quick and the CPU take tiny ones)",
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--code-bits",
        type=int,
        choices=CODE_WIDTHS,
        default=HELD_CODE_BITS,
        help="bits an exponent code (default: the width the providers hold, the encoder's "
        "choice per tensor)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time the decode at 4, 8 and 16 warps a program and 4, 8 and 16 programs "
        "an SM (the providers' launch first)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("decode_gather: --device cuda needs a CUDA device (none here)", file=sys.stderr)
        return 2
    quick = args.quick or device.type != "cuda"
    path = args.out / "decode_gather.json"

    def write(result: dict[str, Any]) -> None:  # after every row: a run cut short keeps them
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))

    result = measure(
        QUICK if quick else SHAPES[args.shape],
        device,
        repeats=3 if quick else args.repeats,
        warmup=1 if quick else 5,
        code_bits=args.code_bits,
        configs=launches(args.sweep),
        on_row=write,
    )
    write(result)
    print(format_rows(result))
    wrong = sum(not t["exact"] for r in result["rows"] for t in r["configs"])
    if wrong:
        print(f"decode_gather: {wrong} launches decoded wrong bytes (WRONG above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
