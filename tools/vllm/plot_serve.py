"""Latency against throughput for the serving benchmark (``tools/vllm/serve_bench.py``).

    python3 tools/vllm/plot_serve.py serve_bench.json [MORE.json ...] --out serve.svg

One panel per label (``plain``, ``skew``, ...: the records of one label merged, so servers run in
separate calls, ``--servers uva`` then ``--servers row``, share a panel), two rows: median time per
output token and 99th-percentile time to first token against output tokens a second, one line per
server through its concurrency levels (``c1`` ... ``c64``, each point labelled), the request rate
levels as separate points. Prints the points and, where a label has both, ``row`` against UVA at
every level (output tok/s, TTFT p99). Needs matplotlib (a dev dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Point = tuple[str, float, float, float]
"""(level, output tok/s, TPOT p50 ms, TTFT p99 ms)."""


def points(record: dict[str, Any]) -> dict[str, list[Point]]:
    """Per server, the levels with figures (the warm-up left out), in the record's order."""
    out: dict[str, list[Point]] = {}
    for server in record["servers"]:
        found: list[Point] = []
        for name, entry in server["levels"].items():
            fig = entry.get("figures") or {}
            keys = ("output_throughput", "median_tpot_ms", "p99_ttft_ms")
            if name == "warmup" or not all(isinstance(fig.get(k), int | float) for k in keys):
                continue
            found.append((name, *(float(fig[k]) for k in keys)))
        out[server["name"]] = found
    return out


def merge(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per label, in first-seen order: each label's servers from all its records;
    a server that is in several keeps its entry from the record whose levels have the most
    figures (a server run again after a call ran out of time replaces its empty entry)."""
    merged: dict[str, dict[str, Any]] = {}
    for record in records:
        label = str(record.get("label", "?"))
        into = merged.setdefault(label, {"label": label, "servers": []})
        for server in record["servers"]:
            names = [s["name"] for s in into["servers"]]
            if server["name"] not in names:
                into["servers"].append(server)
                continue
            at = names.index(server["name"])
            if _figures(server) > _figures(into["servers"][at]):
                into["servers"][at] = server
    return list(merged.values())


def _figures(server: dict[str, Any]) -> int:
    return sum(1 for entry in server.get("levels", {}).values() if entry.get("figures"))


def ratios(record: dict[str, Any]) -> list[str]:
    """``row`` against UVA at every level both have: output tok/s and TTFT p99."""
    found = points(record)
    row = {p[0]: p for p in found.get("row", [])}
    uva = {p[0]: p for p in found.get("uva", [])}
    lines = []
    for level in [name for name in row if name in uva]:
        mine, theirs = row[level], uva[level]
        lines.append(
            f"{record.get('label', '?'):6} {level:4} row / UVA output tok/s "
            f"{mine[1] / theirs[1]:.3f}, TTFT p99 {mine[3]:.1f} / {theirs[3]:.1f} ms "
            f"({'met' if mine[3] <= theirs[3] else 'missed'}: row <= UVA)"
        )
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
                ax.set_title(f"{record.get('label', '?')}: {what}")
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
        for line in ratios(record):
            print(line)
    draw(records, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
