"""The transition table as text (`table_text`, `device_table_text` for its `[device]` section)
and as a picture (`table_diagram`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from model_check.render.draw import COLORS, lane_width, new_figure, save, staircase
from model_check.table.schema import HOST_ONLY_KINDS, DeviceTable, Operation, Step, Table

ROLE_LANES = ("host", "current", "owner", "copy")


def _step_lane(step: Step) -> str:
    if step.kind in HOST_ONLY_KINDS or step.kind == "host_sync":
        return "host"
    return step.stream


def _step_words(step: Step) -> list[str]:
    words = {
        "record_event": ["record", step.event],
        "wait_event": ["wait", step.event],
        "wait_flag": ["wait_flag", step.event],
        "write_staging": ["write_staging", step.ring],
        "upload_map": ["upload_map", step.ring],
        "release_staging": ["release_staging", step.ring],
        "host_sync": ["host_sync", step.stream],
    }.get(step.kind, [step.kind])
    if step.when != "always":
        words.append(f"[{step.when}]")
    return words


def _record_of(op: Operation, index: int) -> int:
    """Index of the record_event the wait at `index` waits for in the same operation (the
    latest earlier one of the same event), -1 when it is recorded by an earlier call."""
    step = op.steps[index]
    for k in range(index - 1, -1, -1):
        other = op.steps[k]
        if other.kind == "record_event" and other.event == step.event:
            return k
    return -1


def _op_header(op: Operation) -> str:
    parts = [f"{op.name}({', '.join(op.args)})"]
    if op.before_guard:
        parts.append("before guard " + ", ".join(op.before_guard))
    parts += [f"guard {op.guard}", f"effect {op.effect}"]
    if op.set_owner:
        parts.append(f"then owner := {op.set_owner}")
    if not op.provider:
        parts.append("(consumer operation)")
    return "   ".join(parts)


def table_text(table: Table, *, width: int = 100) -> str:
    """The transition table as plain text: per operation its guard and effect, then its steps
    in order, each in the column of the lane it runs on (host, or the stream role).
    `<N` after a wait names the step that recorded the event it waits for (`<prev` when an
    earlier call recorded it)."""
    out = [
        "streams: consumer " + ", ".join(table.consumer_streams) + "; provider copy",
        "roles: current = the calling stream; owner = the stream of the previous accepted "
        "prepare (current when none); copy = the provider's copy stream",
    ]
    out = [line for raw in out for line in textwrap.wrap(raw, width, subsequent_indent="  ")]
    header = list(ROLE_LANES)
    tables: list[list[tuple[str, int, str]]] = []
    for op in table.operations:
        rows: list[tuple[str, int, str]] = []
        for index, step in enumerate(op.steps):
            text = " ".join(_step_words(step))
            if step.kind in ("wait_event", "wait_flag"):
                rec = _record_of(op, index)
                text += f" <{rec + 1}" if rec >= 0 else " <prev"
            rows.append((str(index + 1), ROLE_LANES.index(_step_lane(step)), text))
        tables.append(rows)
    lane_w = lane_width(header, [row for rows in tables for row in rows], width, 3)
    for op, rows in zip(table.operations, tables, strict=True):
        out.append("")
        out += textwrap.wrap(_op_header(op), width, subsequent_indent="    ")
        if rows:
            out += staircase(header, rows, width, 3, lane_w)
        else:
            out.append("    (no steps)")
    return "\n".join(out) + "\n"


def table_diagram(table: Table, path: str | Path) -> Path:
    """Draw the table: one panel per operation, lanes host/current/owner/copy, the guard and
    effect as the first boxes on the host lane, then the steps in order on their lanes, with
    arrows from each record_event to the waits on the same event (dashed from the left edge
    when an earlier call recorded it)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    path = Path(path)
    col_w, lane_h, title_h, left = 1.25, 0.55, 0.45, 0.9
    ncols = max(len(op.steps) + 3 for op in table.operations)
    nlanes = len(ROLE_LANES)
    panel_h = nlanes + title_h / lane_h  # in lane units
    total_units = panel_h * len(table.operations)
    fig, ax = new_figure(left + col_w * ncols, lane_h * total_units + 0.2)
    x0 = -left / col_w - 0.5
    ax.set_xlim(x0, ncols - 0.5)
    ax.set_ylim(-total_units - 0.2 / lane_h, 0)
    ax.set_axis_off()
    kinds_color = {
        "record_event": COLORS["record"],
        "wait_event": COLORS["wait"],
        "wait_flag": COLORS["wait"],
        "copy_rows": COLORS["copy"],
        "upload_map": COLORS["upload"],
        "release_staging": COLORS["record"],
        "consumer_read": COLORS["read"],
    }
    for p, op in enumerate(table.operations):
        top = -p * panel_h
        ax.text(
            x0 + 0.1,
            top - title_h / lane_h / 2,
            _op_header(op),
            ha="left",
            va="center",
            fontsize=9,
            fontweight="bold",
        )
        lanes_top = top - title_h / lane_h

        def lane_y(name: str, lanes_top: float = lanes_top) -> float:
            return lanes_top - ROLE_LANES.index(name) - 0.5

        for k, name in enumerate(ROLE_LANES):
            ax.add_patch(
                Rectangle(
                    (x0, lanes_top - k - 1),
                    ncols - 0.5 - x0,
                    1,
                    color="#f4f4f4" if k % 2 else "#ffffff",
                    lw=0,
                )
            )
            ax.text(
                x0 + 0.1,
                lanes_top - k - 0.5,
                name,
                ha="left",
                va="center",
                fontsize=8,
                fontweight="bold",
            )
        boxes: list[tuple[int, str, str]] = [
            (0, "host", f"guard\n{op.guard}"),
            (1, "host", f"effect\n{op.effect}"),
        ]
        for index, step in enumerate(op.steps):
            boxes.append((index + 2, _step_lane(step), "\n".join(_step_words(step))))
        if op.set_owner:
            boxes.append((len(op.steps) + 2, "host", f"owner :=\n{op.set_owner}"))
        for x, lane, text in boxes:
            kind = op.steps[x - 2].kind if 2 <= x < len(op.steps) + 2 else "host"
            color = kinds_color.get(kind, COLORS["host"])
            y = lane_y(lane)
            ax.add_patch(
                Rectangle(
                    (x - 0.44, y - 0.4), 0.88, 0.8, facecolor="white", edgecolor=color, lw=1.2
                )
            )
            ax.text(x, y, text, ha="center", va="center", fontsize=6.5, linespacing=1.0)
            if kind != "host":
                ax.text(
                    x - 0.4, y + 0.36, str(x - 1), ha="left", va="top", fontsize=5, color="#666666"
                )
        for index, step in enumerate(op.steps):
            if step.kind not in ("wait_event", "wait_flag"):
                continue
            end = (float(index + 2), lane_y(_step_lane(step)))
            rec = _record_of(op, index)
            if rec >= 0:
                start = (float(rec + 2), lane_y(_step_lane(op.steps[rec])))
                ax.add_patch(
                    FancyArrowPatch(
                        start,
                        end,
                        arrowstyle="-|>",
                        mutation_scale=9,
                        color="#444444",
                        lw=1.0,
                        connectionstyle="arc3,rad=0.2",
                        shrinkA=8,
                        shrinkB=8,
                    )
                )
            else:
                ax.add_patch(
                    FancyArrowPatch(
                        (end[0] - 0.9, end[1] + 0.3),
                        end,
                        arrowstyle="-|>",
                        mutation_scale=9,
                        color="#444444",
                        lw=1.0,
                        linestyle="dashed",
                        shrinkA=0,
                        shrinkB=8,
                    )
                )
    save(fig, path)
    return path


def device_table_text(table: DeviceTable) -> str:
    """The device section at a glance (spec/README.md shows it)."""
    consumers = ", ".join(table.consumer_streams)
    lines = [
        f"device streams: consumer {consumers}; capture {table.capture_stream} (graphs are "
        "captured there)",
        "roles: current = the calling stream; owner = the stream of the previous eager prepare "
        "or handoff",
        "  (current when none); capture = the capture stream",
    ]
    for op in table.operations:
        args = ", ".join(op.args)
        marks = [m for m, on in (("hot", op.hot), ("consumer", not op.provider)) if on]
        head = f"{op.name}({args})   guard {op.guard}"
        if marks:
            head += f"   ({', '.join(marks)})"
        if op.set_owner == "current":
            head += "   then owner := current"
        elif op.set_owner == "current_if_none":
            head += "   then owner := current if none"
        lines += ["", head]
        for i, step in enumerate(op.steps):
            text = step.kind
            if step.stream:
                text += f" on {step.stream}"
            if step.event:
                text += f" {step.event}"
            if step.fn:
                text += f" ({step.fn})"
            if step.when != "always":
                text += f" [{step.when}]"
            if step.graph:
                text += "   captured, every pass"
            lines.append(f"  {i + 1:2d}  {text}")
    return "\n".join(lines)
