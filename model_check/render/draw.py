"""Drawing helpers shared by the swimlanes and the table diagram: lane tables in text, and
matplotlib figures on the Agg canvas (never pyplot, so nothing global is touched), saved as
`.svg` (byte-for-byte deterministic) or `.png` by the path's suffix."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SALT = "rowcache-render"
COLORS = {
    "copy": "#4c72b0",
    "upload": "#55a868",
    "read": "#dd8452",
    "wait": "#8c8c8c",
    "waitflag": "#8c8c8c",
    "record": "#8172b3",
    "host": "#bbbbbb",
    "violation": "#d62728",
}


def clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    return text[: width - 1] + "…"


def lane_start(first: int, lane: int, lane_w: int) -> int:
    return first + 1 + lane * (lane_w + 3) + 2


def lane_width(header: list[str], rows: list[tuple[str, int, str]], width: int, first: int) -> int:
    """The widest lanes (at most 22, at least 8) with which every row fits in `width`."""
    for w in range(22, 7, -1):
        cells = [(k, t) for _, k, t in rows] + list(enumerate(header))
        if all(lane_start(first, k, w) + len(t) <= width for k, t in cells):
            return w
    return 8


def staircase(
    header: list[str],
    rows: list[tuple[str, int, str]],
    width: int,
    first: int,
    lane_w: int | None = None,
) -> list[str]:
    """Lines of a lane table with one cell per row: `rows` are (number, lane index, text).

    Every lane gets a column, and a row's text starts in its lane's column and may run on
    over the lanes to its right (they are empty on that row), so that it is clipped only at
    `width`."""
    if lane_w is None:
        lane_w = lane_width(header, rows, width, first)

    def line(num: str, lane: int, text: str) -> str:
        body = f"{num:>{first}} " + ("| " + " " * lane_w + " ") * lane + "| "
        return (body + clip(text, max(width - len(body), 1))).rstrip()

    out = [f"{'#':>{first}} " + "".join(f"| {h:<{lane_w}} " for h in header).rstrip()]
    out.append(("-" * (first + 1) + ("+" + "-" * (lane_w + 2)) * len(header))[:width])
    out += [line(num, k, t) for num, k, t in rows]
    return out


def save(fig: Figure, path: Path) -> None:
    import matplotlib

    suffix = path.suffix.lower()
    if suffix not in (".svg", ".png"):
        raise ValueError(f"{path}: the suffix must be .svg or .png")
    path.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.hashsalt": SALT, "svg.fonttype": "path"}):
        if suffix == ".svg":
            fig.savefig(path, format="svg", metadata={"Date": None})
        else:
            fig.savefig(path, format="png", dpi=110)


def new_figure(width: float, height: float) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_axes((0.0, 0.0, 1.0, 1.0))
