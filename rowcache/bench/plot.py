"""PNG of miss-path GB/s against misses per step, one panel per geometry, one line per
provider (step GB/s, solid), its copy-path GB/s where measured (dotted, same colour), and the
pinned ceiling at the matching copy size (dashed grey)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(document: dict[str, Any], path: Path) -> None:
    """Write the plot to ``path``. Needs matplotlib (imported here, with the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in document["cells"] if c["misses"] > 0 and c["gbps"] is not None]
    geometries = sorted({c["geometry"] for c in cells})
    providers = sorted({c["provider"] for c in cells})
    figure, axes = plt.subplots(
        1, max(1, len(geometries)), figsize=(5.5 * max(1, len(geometries)), 4.2), squeeze=False
    )
    for axis, geometry in zip(axes[0], geometries, strict=False):
        rows = [c for c in cells if c["geometry"] == geometry]
        for provider in providers:
            mine = sorted((c for c in rows if c["provider"] == provider), key=lambda c: c["misses"])
            (line,) = axis.plot(
                [c["misses"] for c in mine], [c["gbps"] for c in mine], marker="o", label=provider
            )
            copied = [c for c in mine if c.get("copy_gbps") is not None]
            if copied:
                axis.plot(
                    [c["misses"] for c in copied],
                    [c["copy_gbps"] for c in copied],
                    marker="x",
                    linestyle=":",
                    color=line.get_color(),
                    label=f"{provider} (copy path)",
                )
        ceiling = sorted(
            {(c["misses"], c["ceiling_gbps"]) for c in rows if c["ceiling_gbps"] is not None}
        )
        if ceiling:
            axis.plot(
                [m for m, _ in ceiling],
                [g for _, g in ceiling],
                linestyle="--",
                color="gray",
                label="pinned ceiling (same bytes, one copy)",
            )
        axis.set_title(geometry)
        axis.set_xlabel("misses per step (top-8 of 128, 32 slots)")
        axis.set_ylabel("miss path GB/s")
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    meta = document.get("meta", {})
    figure.suptitle(f"rowcache.bench: {meta.get('gpu', '?')}, commit {meta.get('commit', '?')}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
