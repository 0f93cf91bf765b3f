"""SM reads of host memory against the copy engine, on this machine:
``python -m rowcache.bench.link --out DIR``.

The device planner's gather reads each miss from pinned host memory with the GPU's SMs, and on
some H100 machines those reads ran at 0.62 of a pinned copy's rate where others ran at 0.93
(docs/LINK.md). This bench asks whether any launch or memory makes SM reads faster on a
machine: one buffer of ``--mib`` MiB of random words in host memory is read into device memory

* by the copy engine (``copy_`` of pinned memory on a side stream): the ceiling;
* by SM reads (``rowcache.bench.link_kernel``), for each launch of a sweep of programs per SM,
  words a load, warps and the load's cache modifier, the gather's own launch first;
* both again from write-combined host memory (``--write-combined``, CUDA only).

Every read is checked word for word against the source before its time counts (a read that is
fast and wrong is reported as wrong, not timed). Writes ``link.json`` (every launch's median
seconds, GB/s and fraction of the copy's rate) and prints a table. ``--device cpu`` runs the
same code under Triton's interpreter (``TRITON_INTERPRET=1``) at a tiny size with host timers:
a check of the bench itself, its times meaningless.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import itertools
import json
import os
import platform
import re
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from rowcache.bench.link_kernel import CACHE_MODIFIERS, read_kernel
from rowcache.bench.timing import one_call
from rowcache.device_plan.kernels import GATHER_PROGRAMS_PER_SM
from rowcache.device_plan.regions import CHUNK_BYTES

__all__ = ["Launch", "gather_launch", "launches", "main", "measure", "read_words", "write_combined"]

MAX_MIB = 4096
"""The largest buffer taken: pinned memory is the machine's, and 4 GiB times a copy is plenty
for a rate."""
MIN_MIB = 64
"""The smallest on a GPU: above an H100's 50 MiB of L2, so that no repeat reads from L2, and
large enough that a launch's host time does not count."""


class Launch(NamedTuple):
    """One SM read's launch: programs per SM, int64 words a load, warps, the load's modifier."""

    per_sm: int
    block: int
    warps: int
    cache: str

    def name(self) -> str:
        return f"{self.per_sm}/SM x {self.block * 8} B x {self.warps}w {self.cache or '-'}"


def gather_launch() -> Launch:
    """The device planner's gather launch (``DeviceGather``'s defaults)."""
    return Launch(GATHER_PROGRAMS_PER_SM, CHUNK_BYTES // 8, 4, "")


def _numbers(text: str, what: str, low: int, high: int, power_of_two: bool = False) -> list[int]:
    values = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{what}: {part!r} is not a whole number") from None
        if not low <= value <= high or (power_of_two and value & (value - 1)):
            two = " and a power of two" if power_of_two else ""
            raise ValueError(f"{what}: {value} must be from {low} to {high}{two}")
        values.append(value)
    return values


def launches(per_sm: str, blocks: str, warps: str, caches: str) -> list[Launch]:
    """The sweep: every combination of the comma-separated lists (``blocks`` in bytes a load,
    ``caches`` Triton's modifiers, ``none`` for none), the gather's own launch first."""
    if any(not c.strip() for c in caches.split(",")):
        raise ValueError(f"caches: {caches!r} has an empty item (write none for no modifier)")
    modifiers = ["" if c == "none" else c for c in caches.split(",")]
    for modifier in modifiers:
        if modifier not in CACHE_MODIFIERS:
            names = ", ".join(m or "none" for m in CACHE_MODIFIERS)
            raise ValueError(f"caches: {modifier!r} is not one of {names}")
    sweep = [
        Launch(p, b // 8, w, c)
        for p, b, w, c in itertools.product(
            _numbers(per_sm, "programs per SM", 1, 64),
            _numbers(blocks, "bytes a load", 64, 65536, power_of_two=True),
            _numbers(warps, "warps", 1, 32, power_of_two=True),
            modifiers,
        )
    ]
    first = gather_launch()
    return [first, *[launch for launch in sweep if launch != first]]


_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped (cuda_runtime_api.h)
_HOST_ALLOC_WRITE_COMBINED = 4  # cudaHostAllocWriteCombined: not snooped by the CPU's caches


def _cudart() -> Any:
    """``cuda.bindings.runtime`` (cuda-bindings), for what torch does not do: write-combined
    host memory and a copy from an address."""
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError as missing:
        raise RuntimeError(
            "write-combined host memory needs cuda-bindings (module cuda.bindings.runtime)"
        ) from missing


def read_words(
    src_addr: int, dst: torch.Tensor, *, programs: int, block: int, warps: int, cache: str
) -> list[str]:
    """Copy ``dst.numel()`` int64 words from the device-visible address ``src_addr`` into
    ``dst`` (int64, on the device) with ``programs`` programs of ``warps`` warps, each load
    ``block`` words with ``cache`` as its modifier. Returns the global loads the compiled
    kernel issues, from its PTX (what ran, not what was asked; none under the interpreter)."""
    if dst.dtype != torch.int64:
        raise ValueError(f"dst must be int64 words, got {dst.dtype}")
    if cache not in CACHE_MODIFIERS:
        raise ValueError(f"cache modifier {cache!r} is not one of {CACHE_MODIFIERS}")
    kernel = read_kernel[(programs,)](
        src_addr, dst, dst.numel(), BLOCK=block, CACHE=cache, num_warps=warps
    )
    ptx = (getattr(kernel, "asm", None) or {}).get("ptx") or ""
    return sorted(set(re.findall(r"ld\.global[\w.:]*", ptx)))


@contextmanager
def write_combined(data: torch.Tensor) -> Iterator[tuple[int, int]]:
    """``data``'s bytes (a CPU tensor) in write-combined, mapped host memory for the duration;
    yields its host address and its device-visible address."""
    cudart = _cudart()
    size = data.numel() * data.element_size()
    err, host = cudart.cudaHostAlloc(size, _HOST_ALLOC_MAPPED | _HOST_ALLOC_WRITE_COMBINED)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaHostAlloc of {size} write-combined bytes failed: {err}")
    try:
        ctypes.memmove(host, data.data_ptr(), size)
        err, device = cudart.cudaHostGetDevicePointer(host, 0)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
        yield int(host), int(device)
    finally:
        torch.cuda.synchronize()
        (err,) = cudart.cudaFreeHost(host)[:1]
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaFreeHost failed: {err}")


class _Timer:
    """Median seconds of a callable over ``repeats`` calls after ``warmup`` (``one_call``)."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.once, self.repeats, self.warmup = one_call(device), repeats, warmup

    def __call__(self, run: Callable[[], None]) -> float:
        times = [self.once(run) for _ in range(self.warmup + self.repeats)]
        return float(statistics.median(times[self.warmup :]))


def measure(
    device: torch.device,
    *,
    num_bytes: int,
    sweep: Sequence[Launch],
    repeats: int,
    warmup: int,
    memories: Sequence[str] = ("pinned",),
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The copy's and every launch's read of ``num_bytes`` from each of ``memories``
    (``pinned``, ``write_combined``), each checked against the source before it is timed;
    ``on_row`` gets the result after the copy and after every launch (a run cut short keeps
    what it measured; a row still going says ``"done": false``)."""
    if num_bytes % 8 or num_bytes <= 0:
        raise ValueError(f"num_bytes must be a positive multiple of 8, got {num_bytes}")
    for memory in memories:
        if memory not in ("pinned", "write_combined"):
            raise ValueError(f"memory {memory!r} is not pinned or write_combined")
        if memory == "write_combined" and device.type != "cuda":
            raise ValueError("write-combined host memory is CUDA's: --write-combined needs a GPU")
    sms = 2  # the interpreter's stand-in
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    generator = torch.Generator().manual_seed(0)
    source = torch.randint(
        -(2**62), 2**62, (num_bytes // 8,), dtype=torch.int64, generator=generator
    )
    reference = source.to(device)
    timer = _Timer(device, repeats, warmup)
    result: dict[str, Any] = {"bytes": num_bytes, "sms": sms, "memories": []}

    def report() -> None:
        if on_row is not None:
            on_row(result)

    for memory in memories:
        row: dict[str, Any] = {"memory": memory, "done": False, "launches": []}
        result["memories"].append(row)
        if memory == "write_combined":
            with write_combined(source) as (host, address):
                copy = _address_copy(host, num_bytes)
                _memory_row(row, address, copy, reference, sms, sweep, timer, report)
        else:
            pinned = source.pin_memory() if device.type == "cuda" else source.clone()
            copy = _tensor_copy(pinned, reference.device)
            _memory_row(row, pinned.data_ptr(), copy, reference, sms, sweep, timer, report)
            del pinned
        row["done"] = True
        report()
    return result


def _tensor_copy(pinned: torch.Tensor, device: torch.device) -> Callable[[torch.Tensor], None]:
    """The copy engine's read of ``pinned`` into a target, on a stream of its own as the
    providers' copies run, ordered between the timer's events on the current stream."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def copy(target: torch.Tensor) -> None:
        if stream is None:
            target.copy_(pinned)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            target.copy_(pinned, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    return copy


def _memory_row(
    row: dict[str, Any],
    address: int,
    copy: Callable[[torch.Tensor], None],
    reference: torch.Tensor,
    sms: int,
    sweep: Sequence[Launch],
    timer: _Timer,
    report: Callable[[], None],
) -> None:
    """The copy's and every launch's read from one host memory at ``address`` into ``row``;
    a launch that fails (a kernel that does not build, a CUDA error) is recorded as failed."""
    target = torch.empty_like(reference)
    row["copy"] = _timed(timer, lambda: copy(target), target, reference)
    report()
    for launch in sweep:
        loads: list[str] = []

        def read(launch: Launch = launch, loads: list[str] = loads) -> None:
            loads[:] = read_words(
                address,
                target,
                programs=sms * launch.per_sm,
                block=launch.block,
                warps=launch.warps,
                cache=launch.cache,
            )

        try:
            entry = _timed(timer, read, target, reference)
        except Exception as error:  # recorded, and the sweep goes on: one launch is one cell
            entry = {"exact": False, "error": f"{type(error).__name__}: {error}"}
        entry["launch"] = launch._asdict()
        entry["loads"] = list(loads)
        if entry["exact"] and row["copy"]["exact"]:
            entry["over_copy"] = row["copy"]["seconds"] / entry["seconds"]
        row["launches"].append(entry)
        report()


def _address_copy(host: int, num_bytes: int) -> Callable[[torch.Tensor], None]:
    """The copy engine's read of host memory that no tensor describes (write-combined) into a
    target, from its host address, on the current stream."""
    cudart = _cudart()
    kind = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice

    def copy(target: torch.Tensor) -> None:
        stream = cudart.cudaStream_t(torch.cuda.current_stream().cuda_stream)
        err = cudart.cudaMemcpyAsync(target.data_ptr(), host, num_bytes, kind, stream)[0]
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpyAsync of {num_bytes} bytes failed: {err}")

    return copy


def _timed(
    timer: _Timer, run: Callable[[], None], target: torch.Tensor, reference: torch.Tensor
) -> dict[str, Any]:
    target.zero_()
    run()
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    if not torch.equal(target, reference):
        return {"exact": False}
    seconds = timer(run)
    num_bytes = target.numel() * target.element_size()
    return {"exact": True, "seconds": seconds, "gbps": num_bytes / seconds / 1e9}


def format_rows(result: dict[str, Any]) -> str:
    lines = [
        f"the link, {result['bytes']:,} bytes from host memory ({result['sms']} SMs; "
        "GB/s, and the fraction of the copy engine's rate from the same memory)"
    ]
    for row in result["memories"]:
        copy = row.get("copy") or {"exact": False}
        rate = f"{copy['gbps']:.1f} GB/s" if copy["exact"] else "WRONG"
        lines.append(f"{row['memory']}: copy engine {rate}")
        for entry in row["launches"]:
            name = Launch(**entry["launch"]).name()
            if "error" in entry:
                lines.append(f"  {name:<28} FAILED: {entry['error']}")
                continue
            if not entry["exact"]:
                lines.append(f"  {name:<28} WRONG")
                continue
            over = f"{entry['over_copy']:.3f}" if "over_copy" in entry else "-"
            loads = " ".join(entry.get("loads") or [])
            lines.append(f"  {name:<28} {entry['gbps']:8.1f} GB/s  {over}  {loads}".rstrip())
        exact = [e for e in row["launches"] if e["exact"] and "over_copy" in e]
        if exact:
            best = max(exact, key=lambda e: e["over_copy"])
            first = row["launches"][0]
            first_over = f"{first['over_copy']:.3f}" if "over_copy" in first else "-"
            lines.append(
                f"  best: {Launch(**best['launch']).name()} at {best['over_copy']:.3f} of the "
                f"copy; the gather's launch at {first_over}"
            )
    return "\n".join(lines)


def _checked(args: argparse.Namespace) -> tuple[torch.device, list[Launch]]:
    """The device and the sweep, or ValueError naming the value and its limit."""
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r} must be cpu or cuda (the current GPU)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA device (none here)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--device cpu runs the kernel under Triton's interpreter: set TRITON_INTERPRET=1"
        )
    low = MIN_MIB if device.type == "cuda" else 1
    if not low <= args.mib <= MAX_MIB:
        raise ValueError(f"--mib {args.mib} must be from {low} to {MAX_MIB}")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be at least 1")
    if args.write_combined:
        if device.type != "cuda":
            raise ValueError("--write-combined reads CUDA's write-combined memory: needs a GPU")
        try:
            _cudart()
        except RuntimeError as missing:
            raise ValueError(f"--write-combined: {missing}") from None
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file, not a folder")
    return device, launches(args.per_sm, args.blocks, args.warps, args.caches)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rowcache.bench.link")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cuda (the current GPU) or cpu")
    parser.add_argument(
        "--mib", type=int, default=256, help=f"MiB read ({MIN_MIB} to {MAX_MIB} on a GPU)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--per-sm", default="2,8,32", help="programs per SM, comma-separated")
    parser.add_argument("--blocks", default="1024,16384", help="bytes a load, comma-separated")
    parser.add_argument("--warps", default="4,8", help="warps a program, comma-separated")
    parser.add_argument("--caches", default="none,.cg", help="load modifiers (none, .cg)")
    parser.add_argument(
        "--write-combined",
        action="store_true",
        help="also read from write-combined host memory (CUDA; needs cuda-bindings)",
    )
    args = parser.parse_args(argv)
    try:
        device, sweep = _checked(args)
    except ValueError as error:
        print(f"link: {error}", file=sys.stderr)
        return 2
    quick = device.type != "cuda"
    path = args.out / "link.json"
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m rowcache.bench.link " + " ".join(argv or sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": importlib.import_module("triton").__version__,
        "python": platform.python_version(),
    }

    def write(result: dict[str, Any]) -> None:  # after every launch: a run cut short keeps it
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, **result}, indent=1))

    result = measure(
        device,
        num_bytes=4096 if quick else args.mib << 20,
        sweep=sweep,
        repeats=2 if quick else args.repeats,
        warmup=1 if quick else 3,
        memories=("pinned", "write_combined") if args.write_combined else ("pinned",),
        on_row=write,
    )
    write(result)
    print(format_rows(result))
    wrong = sum(not e["exact"] for row in result["memories"] for e in row["launches"])
    wrong += sum(not row["copy"]["exact"] for row in result["memories"])
    if wrong:
        print(f"link: {wrong} reads wrong or failed (WRONG, FAILED above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
