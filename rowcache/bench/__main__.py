"""``python -m rowcache.bench``: see ``rowcache.bench`` and ``docs/BENCHMARKS.md``.

Exit status: 0 done; 2 cannot run (no CUDA device, or no matplotlib for ``--plot-from``).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

NO_CUDA = (
    "rowcache.bench: cannot run: no CUDA device (torch.cuda.is_available() is False). "
    "The benchmark times pinned host-to-device copies and CUDA streams and events, so it "
    "needs a GPU; on this machine only --plot-from JSON works."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rowcache.bench", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder")
    parser.add_argument("--steps", type=int, default=50, help="measured steps per cell")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps per cell")
    parser.add_argument(
        "--trace-steps", type=int, default=1000, help="steps of the trace (0: no trace replay)"
    )
    parser.add_argument(
        "--geometries",
        default=None,
        metavar="A,B",
        help=(
            "comma-separated expert geometries (default: bf16, nvfp4, bf16_large; by name "
            "also fp8_block, mxfp4)"
        ),
    )
    parser.add_argument(
        "--providers",
        default=None,
        metavar="A,B",
        help="comma-separated providers (default: all: row, row_packed, row_pt, cached)",
    )
    parser.add_argument(
        "--misses",
        default=None,
        metavar="N,M",
        help="comma-separated misses per step (default: 0,1,2,4,8)",
    )
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    parser.add_argument(
        "--plot-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="render the PNG (and print the table) from a JSON of an earlier run; no GPU needed",
    )
    return parser


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def _choice(
    parser: argparse.ArgumentParser, option: str, value: str | None, known: tuple[str, ...]
) -> tuple[str, ...]:
    if value is None:
        return known
    chosen = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [v for v in chosen if v not in known]
    if unknown or not chosen:
        parser.error(f"{option}: unknown {unknown or value!r}; choose from {', '.join(known)}")
    return chosen


def _misses(parser: argparse.ArgumentParser, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        misses = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        parser.error(f"--misses: expected comma-separated integers, got {value!r}")
    if not misses or misses[0] < 0 or misses[-1] > 8:
        parser.error(f"--misses: each must be in 0..8 (top-8 steps), got {value!r}")
    return misses


def _plot(document: dict[str, Any], path: Path) -> bool:
    from rowcache.bench.plot import plot

    try:
        plot(document, path)
    except ImportError as error:
        print(f"rowcache.bench: no PNG: matplotlib is missing ({error})", file=sys.stderr)
        return False
    print(f"rowcache.bench: wrote {path}", file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from rowcache.bench.report import format_table, load, save

    if args.plot_from is not None:
        document = load(args.plot_from)
        png = args.plot_from.with_suffix(".png")
        if not _plot(document, png):
            return 2
        print(format_table(document))
        return 0

    from rowcache.bench.geometry import GEOMETRIES, KNOWN_GEOMETRIES
    from rowcache.bench.providers import PROVIDERS

    geometries = _choice(parser, "--geometries", args.geometries, tuple(KNOWN_GEOMETRIES))
    if args.geometries is None:
        geometries = tuple(GEOMETRIES)
    providers = _choice(parser, "--providers", args.providers, tuple(PROVIDERS))
    misses = _misses(parser, args.misses)

    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from rowcache.bench.run import MISSES, Settings, run_benchmark
    from rowcache.bench.trace import TraceSpec

    settings = Settings(
        steps=args.steps,
        warmup=args.warmup,
        trace=TraceSpec(steps=args.trace_steps),
        geometries=geometries,
        providers=providers,
        misses=MISSES if misses is None else misses,
    )
    command = "python -m rowcache.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    document = run_benchmark(settings, commit=args.commit or _commit(), command=command.strip())
    json_path = args.out / "bench.json"
    save(document, json_path)
    print(f"rowcache.bench: wrote {json_path}", file=sys.stderr)
    _plot(document, args.out / "bench.png")
    print(format_table(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
