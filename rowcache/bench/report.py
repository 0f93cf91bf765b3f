"""The benchmark's JSON document and its text table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["format_table", "load", "save"]


def save(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


GEOMETRY = f"{'geometry':<10}"
PROVIDER = f"{'provider':<8}"


def _num(value: object, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(document: dict[str, Any]) -> str:
    """Ceilings, cells and trace replay as fixed-width text."""
    lines: list[str] = []
    meta = document.get("meta", {})
    lines.append(
        f"rowcache.bench  gpu={meta.get('gpu', '?')}  torch={meta.get('torch', '?')}  "
        f"commit={meta.get('commit', '?')}"
    )
    lines.append("")
    lines.append("pinned H2D ceiling (one copy, CUDA events, median)")
    lines.append(f"{'size':>12} {'GB/s':>8}")
    for row in document["ceilings"]:
        lines.append(f"{row['mib']:>8.2f} MiB {row['gbps']:>8.2f}")
    lines.append("")
    lines.append(
        "step: host us = prepare's host time; dev us = the step's latency on the current "
        "stream; GB/s = bytes / dev us"
    )
    lines.append(
        "copy: copy us = CUDA events on the copy stream around the copy call(s); "
        "copy GB/s = bytes / copy us; frac = against the ceiling at the same bytes"
    )
    header = (
        f"{GEOMETRY} {PROVIDER} {'miss':>4} {'MB/step':>8} {'host us':>9} "
        f"{'dev us':>9} {'GB/s':>7} {'ceil':>7} {'frac':>6} {'copy us':>9} {'copy GB/s':>9} "
        f"{'frac':>6}"
    )
    lines.append(header)
    for cell in document["cells"]:
        lines.append(
            f"{cell['geometry']:<10} {cell['provider']:<8} {cell['misses']:>4} "
            f"{cell['bytes_per_step'] / 1e6:>8.2f} {cell['host_us_median']:>9.1f} "
            f"{cell['device_us_median']:>9.1f} {_num(cell['gbps'], '7.2f'):>7} "
            f"{_num(cell['ceiling_gbps'], '7.2f'):>7} {_num(cell['fraction'], '6.1%'):>6} "
            f"{_num(cell.get('copy_us_median'), '9.1f'):>9} "
            f"{_num(cell.get('copy_gbps'), '9.2f'):>9} "
            f"{_num(cell.get('copy_fraction'), '6.1%'):>6}"
        )
    trace = document.get("trace")
    if trace:
        lines.append("")
        lines.append(f"trace: {trace['description']}")
        lines.append(
            f"{GEOMETRY} {PROVIDER} {'hit rate':>8} {'miss/st':>8} {'host us':>9} "
            f"{'dev us mean':>11} {'dev us med':>10}"
        )
        for row in trace["results"]:
            lines.append(
                f"{row['geometry']:<10} {row['provider']:<8} {row['hit_rate']:>8.1%} "
                f"{row['misses_per_step']:>8.2f} {row['host_us_median']:>9.1f} "
                f"{row['device_us_mean']:>11.1f} {row['device_us_median']:>10.1f}"
            )
    return "\n".join(lines)
