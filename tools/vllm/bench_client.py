"""vLLM's serving client (``vllm bench serve``) kept in one process for every level of a run.

A new ``vllm bench serve`` process per level spends about 30 s importing vLLM before its first
request (H200, 2026-12-05: a level's client log starts 31 s after the one before ended), five
times a server; that is a quarter of a device call. This driver imports vLLM's client once and
runs the levels it is given one after the other, each exactly as the command line would
(``vllm.benchmarks.serve``: its ``add_cli_args`` parser and its ``main``, which the ``vllm bench
serve`` subcommand calls).

Protocol (``PersistentClient`` is the other side): one JSON line on stdin per level,
``{"argv": [...the arguments after "bench serve"...], "log": PATH}``; while the level runs, the
process's stdout and stderr (file descriptors 1 and 2, so vLLM's own log handlers too) go to
``PATH``; then one JSON line ``{"rc": N}`` on the stdout the driver started with (0: done; 1: the
client raised, its traceback in the log; argparse's code for bad arguments). EOF on stdin ends
it. vLLM is imported on the first level, into that level's log.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, TextIO


def run_level(argv: list[str]) -> int:
    """One ``vllm bench serve`` run: the same parser and entry point as the command line."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    try:
        args = parser.parse_args(argv)
        bench_main(args)
    except SystemExit as exc:  # argparse's refusal, with its message already in the log
        return exc.code if isinstance(exc.code, int) else 2
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def serve(requests: TextIO, status: TextIO) -> None:
    """Run every level read from ``requests``; answer each on ``status``."""
    for line in requests:
        if not line.strip():
            continue
        request: dict[str, Any] = json.loads(line)
        with open(request["log"], "ab") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                rc = run_level([str(a) for a in request["argv"]])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
        status.write(json.dumps({"rc": rc}) + "\n")
        status.flush()


def main() -> int:
    # The status channel is the stdout the driver was started with; fds 1 and 2 are each
    # level's log from here on.
    status = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    serve(sys.stdin, status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
