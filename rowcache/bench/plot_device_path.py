"""The device-path bench's plot and table from its JSON, on any machine (no GPU needed).

    python -m rowcache.bench.plot_device_path DIR/device_path.json [PNG]

PNG (default: the JSON's path with ``.png``): one panel per expert geometry, per-layer GB/s of
the device path against misses per step, one line per slot layout (solid), the host path's step
GB/s (dotted) and the pinned ceiling at the matching copy size (dashed grey). Needs matplotlib
(a development dependency). The table of ``rowcache.bench.device_report`` is printed too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rowcache.bench.device_report import format_table

__all__ = ["main", "plot"]


def plot(document: dict[str, Any], path: Path) -> None:
    """Write the plot to ``path``. Needs matplotlib (imported here, with the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in document["device_cells"] if c["misses"] > 0 and c["gbps"] is not None]
    geometries = sorted({c["geometry"] for c in cells})
    layouts = sorted({c["layout"] for c in cells})
    ceilings = {c["bytes"]: c["gbps"] for c in document.get("ceilings", [])}
    host_cells = [c for c in document.get("host_cells", []) if c["misses"] > 0]
    count = max(1, len(geometries))
    figure, axes = plt.subplots(1, count, figsize=(5.5 * count, 4.2), squeeze=False)
    for axis, geometry in zip(axes[0], geometries, strict=False):
        rows = [c for c in cells if c["geometry"] == geometry]
        for layout in layouts:
            mine = sorted((c for c in rows if c["layout"] == layout), key=lambda c: c["misses"])
            axis.plot(
                [c["misses"] for c in mine],
                [c["gbps"] for c in mine],
                marker="o",
                label=f"device, {layout}",
            )
        host = sorted(
            (c for c in host_cells if c["geometry"] == geometry and c.get("device_us_median")),
            key=lambda c: c["misses"],
        )
        if host:
            axis.plot(
                [c["misses"] for c in host],
                [c["bytes_per_step"] / (c["device_us_median"] * 1e-6) / 1e9 for c in host],
                marker="x",
                linestyle=":",
                label="host path (row_packed)",
            )
        sizes = sorted({c["misses"]: c["bytes_per_layer_step"] for c in rows}.items())
        marked = [(m, ceilings[b]) for m, b in sizes if b in ceilings]
        if marked:
            axis.plot(
                [m for m, _ in marked],
                [g for _, g in marked],
                linestyle="--",
                color="grey",
                label="pinned ceiling",
            )
        axis.set_title(geometry)
        axis.set_xlabel("misses per step per layer")
        axis.set_ylabel("GB/s per layer (graph total / layers)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    meta = document.get("meta", {})
    figure.suptitle(
        f"device path, {meta.get('layers', '?')}-layer forward in one graph; "
        f"{meta.get('gpu', '?')}, commit {str(meta.get('commit', '?'))[:12]}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rowcache.bench.plot_device_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("json", type=Path)
    parser.add_argument("png", type=Path, nargs="?", default=None)
    args = parser.parse_args(argv)
    document = json.loads(args.json.read_text())
    png = args.png or args.json.with_suffix(".png")
    plot(document, png)
    print(format_table(document))
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
