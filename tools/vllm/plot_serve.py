"""Latency against throughput for the serving benchmark (``tools/vllm/serve_bench.py``).

    python3 tools/vllm/plot_serve.py serve_bench.json [MORE.json ...] --out serve.svg

One panel per run kind: the records of one label, model and batch-invariant mode merged (servers
run in separate calls, ``--servers uva`` then ``--servers row``, share a panel; a skewed model or a
batch-invariant run never joins a plain one), two rows: median time per output token and
99th-percentile time to first token against output tokens a second, one line per server through
its concurrency levels (``c1`` ... ``c64``, each point labelled), the request rate levels as
separate points. Only levels whose every request was answered are drawn and compared. Prints the
points and issue 35's targets (``targets``), each met or missed: at concurrency 32 ``row``'s
output tok/s at least ``TARGET_C32`` times UVA's (1.5 on a label naming the skewed router, 1.0
otherwise), and ``row``'s TTFT p99 at most UVA's at every level both ran, each level's line
ending with the compilations each server logged during it where either logged any
(``compiled``); a ``row`` server whose log did not show the cache serving (``plugin_verdict``)
is compared with nothing. Needs matplotlib (a dev dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Point = tuple[str, float, float, float]
"""(level, output tok/s, TPOT p50 ms, TTFT p99 ms)."""


TARGET_C32 = {"plain": 1.0, "skew": 1.5}
"""Issue 35: ``row``'s output tok/s over UVA's at concurrency 32, by router."""


def complete(server: dict[str, Any], keys: tuple[str, ...]) -> dict[str, tuple[float, ...]]:
    """A server's ``keys`` figures at each level whose every request was answered (status
    ``ok``) and that has them all, the warm-ups left out, in the record's order."""
    out: dict[str, tuple[float, ...]] = {}
    for name, entry in server["levels"].items():
        fig = entry.get("figures") or {}
        if name.startswith("warmup") or entry.get("status", "ok") != "ok":
            continue
        if all(isinstance(fig.get(k), int | float) for k in keys):
            out[name] = tuple(float(fig[k]) for k in keys)
    return out


def points(record: dict[str, Any]) -> dict[str, list[Point]]:
    """Per server, the plotted figures of its complete levels (``complete``)."""
    keys = ("output_throughput", "median_tpot_ms", "p99_ttft_ms")
    return {
        server["name"]: [
            (name, tok_s, tpot, ttft)
            for name, (tok_s, tpot, ttft) in complete(server, keys).items()
        ]
        for server in record["servers"]
    }


def kind(record: dict[str, Any]) -> tuple[str, str, bool]:
    """What records may share a panel: the same label, model and batch-invariant mode."""
    return (
        str(record.get("label", "?")),
        str(record.get("model", "?")),
        bool(record.get("batch_invariant", False)),
    )


def merge(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per kind (``kind``), in first-seen order: each kind's servers from all its
    records. A server that is in several (run again after a call ran out of time, or once for
    the concurrency levels and once for the rate sweep) has every level any of its runs has; a
    level in several runs keeps the entry with figures whose status is ``ok``, else the one with
    figures, else the first. Its plugin verdict is the first that is not ``ok`` among the runs
    whose figures it keeps (one such run whose log did not show the cache disqualifies the
    server; a run that gave no figure, one that never started, does not), or among all its
    runs where none gave a figure."""
    runs: dict[tuple[str, str, bool], dict[str, list[dict[str, Any]]]] = {}
    for record in records:
        by_name = runs.setdefault(kind(record), {})
        for server in record["servers"]:
            by_name.setdefault(server["name"], []).append(server)
    out = []
    for (label, model, invariant), by_name in runs.items():
        servers = [_merge_server(entries) for entries in by_name.values()]
        out.append(
            {"label": label, "model": model, "batch_invariant": invariant, "servers": servers}
        )
    return out


def _merge_server(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's runs as one (``merge``'s rules); the runs are left as they were."""
    levels: dict[str, dict[str, Any]] = {}
    owner: dict[str, int] = {}
    for at, server in enumerate(entries):
        for name, entry in server.get("levels", {}).items():
            if name not in levels or _rank(entry) > _rank(levels[name]):
                levels[name], owner[name] = entry, at
    kept = sorted({owner[name] for name, entry in levels.items() if _rank(entry) > 0})
    verdicts = [entries[at].get("plugin_verdict", "ok") for at in kept or range(len(entries))]
    return {
        **entries[0],
        "levels": levels,
        "plugin_verdict": next((v for v in verdicts if v != "ok"), "ok"),
    }


def _rank(entry: dict[str, Any]) -> int:
    """2: figures and every request answered; 1: figures; 0: none."""
    if not entry.get("figures"):
        return 0
    return 2 if entry.get("status", "ok") == "ok" else 1


def target_c32(label: str) -> float:
    """The c32 throughput target of a record's label: the skewed router's where the label
    names it (``skew``, ``skewed``, ``skew-bi``), else the plain one's."""
    return TARGET_C32["skew" if "skew" in label else "plain"]


def compiled(row: dict[str, Any], uva: dict[str, Any]) -> str:
    """The compilations each server logged while a level ran (``serve_bench``'s
    ``jit_compiles``; ``?`` for a record without the count), where either logged any. A
    compilation stalls its whole server for most of a second, and one request that waits for
    it dominates a small level's TTFT p99 and lowers its throughput, so the level's verdicts
    are then of compilations as much as of servers, and the line says so beside them."""
    counts = [entry.get("jit_compiles") for entry in (row, uva)]
    if not any(isinstance(n, int) and n > 0 for n in counts):
        return ""
    mine, theirs = ("?" if n is None else str(n) for n in counts)
    return f"; compilations during the level: row {mine}, UVA {theirs}"


def targets(record: dict[str, Any]) -> list[str]:
    """Issue 35's targets (module docstring), each met or missed with its ratio, at every level
    both ``row`` and UVA answered in full; why there is nothing to compare where there is
    not."""
    label = str(record.get("label", "?"))
    servers = {s["name"]: s for s in record["servers"]}
    if "row" not in servers or "uva" not in servers:
        return []
    verdict = servers["row"].get("plugin_verdict", "ok")
    if verdict != "ok":
        return [f"{label:6} row compared with nothing: its log did not show the cache ({verdict})"]
    keys = ("output_throughput", "p99_ttft_ms")
    row, uva = complete(servers["row"], keys), complete(servers["uva"], keys)
    lines = []
    for level in [name for name in row if name in uva]:
        (mine, mine_ttft), (theirs, theirs_ttft) = row[level], uva[level]
        ratio = mine / theirs
        line = f"{label:6} {level:4} row / UVA output tok/s {ratio:.3f}"
        if level == "c32":
            goal = target_c32(label)
            line += f" ({'met' if ratio >= goal else 'MISSED'}: >= {goal:.1f})"
        lines.append(
            f"{line}, TTFT p99 {mine_ttft:.1f} / {theirs_ttft:.1f} ms "
            f"({'met' if mine_ttft <= theirs_ttft else 'MISSED'}: row <= UVA)"
            + compiled(servers["row"]["levels"][level], servers["uva"]["levels"][level])
        )
    if "c32" in servers["row"]["levels"] and "c32" not in row:
        lines.append(f"{label:6} c32  row's level not complete: the c32 target not measured")
    return lines


def draw(records: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(
            f"plot_serve.py needs matplotlib (pip install -e '.[dev]'): {exc}"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "rowcache-serve"  # stable ids: diffable SVG
    fig, axes = plt.subplots(2, len(records), figsize=(6 * len(records), 8), squeeze=False)
    for column, record in enumerate(records):
        for name, found in points(record).items():
            closed = [p for p in found if p[0].startswith("c")]
            rates = [p for p in found if not p[0].startswith("c")]
            for row, (index, what) in enumerate(((2, "TPOT p50 ms"), (3, "TTFT p99 ms"))):
                ax = axes[row][column]
                line = ax.plot([p[1] for p in closed], [p[index] for p in closed], "o-", label=name)
                ax.plot(
                    [p[1] for p in rates],
                    [p[index] for p in rates],
                    "x",
                    color=line[0].get_color(),
                )
                for p in found:
                    ax.annotate(p[0], (p[1], p[index]), fontsize=7)
                ax.set_xlabel("output tok/s")
                ax.set_ylabel(what)
                ax.set_yscale("log")
                mode = ", batch-invariant" if record.get("batch_invariant") else ""
                ax.set_title(f"{record.get('label', '?')}{mode}: {what}")
                ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ns = ap.parse_args(argv)
    records = merge([json.loads(path.read_text()) for path in ns.records])
    for record in records:
        for name, found in points(record).items():
            for level, tok_s, tpot, ttft in found:
                print(
                    f"{record.get('label', '?'):6} {name:5} {level:4} {tok_s:9.1f} tok/s "
                    f"TPOT p50 {tpot:8.2f} ms TTFT p99 {ttft:9.1f} ms"
                )
        for line in targets(record):
            print(line)
    draw(records, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
