"""Bad settings at start-up (issue 35, item 3): ``vllm serve`` with the plugin must refuse to
start, with one line naming the value and the limit, and never serve without the cache.

    python3 tools/vllm/serve_refusals.py --model DIR --out $OUT [--deadline S]

One server at a time (``serve_check.launch``), each with one bad setting (``CASES``): slots
below the model's top-k, a provider that does not exist, the host planner in one full graph
(``splitting_ops`` empty: no piece for the host-planned MoE op to run eagerly between). Each
must exit before it answers ``/health``, and its log must hold the plugin's line with the
expected words. Writes ``$OUT/serve_refusals.json``, ``$OUT/serve_refusals.txt`` and
``$OUT/serve_refusals_logs.tar.gz``; exit status 0 only when every server refused as expected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout on the path for tools.vllm
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from tools.vllm import serve_bench, serve_check


@dataclass(frozen=True)
class Case:
    """One bad setting: its ``vllm serve`` arguments and the words its refusal must hold."""

    name: str
    args: tuple[str, ...]
    expect: tuple[str, ...]


def _config(section: dict[str, Any]) -> tuple[str, str]:
    return "--additional-config", json.dumps({"rowcache": section})


CASES = (
    Case(
        "slots-below-top-k",
        _config({"moe_expert_cache_size": 4}),
        ("moe_expert_cache_size=4 is smaller than the model's top_k=8",),
    ),
    Case(
        "unknown-provider",
        _config({"moe_expert_cache_size": 32, "moe_expert_cache_provider": "rows"}),
        ("'rows' is not allowed; allowed values: row, cached",),
    ),
    Case(
        "host-planner-in-one-full-graph",
        (
            *_config({"moe_expert_cache_size": 32, "moe_expert_cache_planner": "host"}),
            "--compilation-config",
            json.dumps({"splitting_ops": []}),
        ),
        ("splitting_ops=[] (one full graph) cannot run the MoE op eagerly",),
    ),
)
"""The values are those of the 8-layer Qwen3-30B-A3B-shaped checkpoint (top-8)."""


def verdict(case: Case, status: str, log: str) -> dict[str, Any]:
    """Refused as expected: the server exited before answering, and every expected fragment
    is in its log; the first log line holding the first fragment is the refusal shown."""
    found = [fragment for fragment in case.expect if fragment in log]
    line = next((ln for ln in log.splitlines() if case.expect[0] in ln), None)
    refused = status == "exited" and len(found) == len(case.expect)
    return {"case": case.name, "status": status, "line": line, "refused": refused}


def run(
    model: str,
    out: Path,
    deadline_s: float,
    launcher: serve_check.Launcher = serve_check.launch,
    python: str = sys.executable,
) -> int:
    work = out / "serve_refusals_work"
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + deadline_s
    results = []
    for case in CASES:
        port = serve_check.free_port()
        log = work / f"server-{case.name}.log"
        args = case.args
        if not (Path(model) / "tokenizer.json").exists():
            # Else the server stops at its tokenizer, before the plugin could refuse anything.
            args = (*args, "--skip-tokenizer-init")
        server = serve_bench.BenchServer(case.name, case.name, args)
        command = serve_bench.serve_command(python, model, port, server)
        started = time.monotonic()
        process = launcher(command, dict(os.environ), log)
        handle = serve_check.Server(
            serve_check.ServerSpec(case.name), port, log, command, process, started
        )
        try:
            serve_check.wait_ready([handle], deadline)
        finally:
            serve_check.stop(process)
        text = log.read_text(errors="replace") if log.exists() else ""
        results.append(verdict(case, handle.status, text))
    lines = [
        f"{r['case']}: {r['status']}; {r['line'] or 'no refusal line'}: "
        f"{'met' if r['refused'] else 'MISSED'}"
        for r in results
    ]
    ok = all(r["refused"] for r in results)
    record = {
        "model": model,
        "results": results,
        "ok": ok,
        "commit": os.environ.get("ROWCACHE_COMMIT", "?"),
    }
    (out / "serve_refusals.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "serve_refusals.txt").write_text("\n".join(lines) + "\n")
    with tarfile.open(out / "serve_refusals_logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.glob("*.log")):
            tar.add(path, arcname=path.name)
    print("\n".join(lines), flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--deadline", type=float, default=600.0)
    ns = ap.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    return run(ns.model, ns.out, ns.deadline)


if __name__ == "__main__":
    serve_check.start_tool()
    sys.exit(main())
