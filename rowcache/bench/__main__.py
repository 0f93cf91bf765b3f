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
    parser.add_argument("--trace-steps", type=int, default=1000, help="steps of the trace")
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
    args = _parser().parse_args(argv)
    from rowcache.bench.report import format_table, load, save

    if args.plot_from is not None:
        document = load(args.plot_from)
        png = args.plot_from.with_suffix(".png")
        if not _plot(document, png):
            return 2
        print(format_table(document))
        return 0

    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from rowcache.bench.run import Settings, run_benchmark
    from rowcache.bench.trace import TraceSpec

    settings = Settings(
        steps=args.steps, warmup=args.warmup, trace=TraceSpec(steps=args.trace_steps)
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
