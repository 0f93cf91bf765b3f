"""Swimlanes of counterexample traces, as text and as pictures.

Pure functions, no state: the text versions return strings, the image version writes one file
(`render.draw`).

A trace is what `model_check.search.explore` returns in `Result.trace`: a list of
`(Action, Outcome)` pairs. Every step is turned into timeline events (`swimlane_events`):

    host call      the call, on the host lane, then every device call it made, in order:
                   an enqueued operation on its stream's lane (+), an event or staging-reuse
                   record on its stream's lane (*), a wait that enqueued nothing because the
                   event was empty or recorded on the same stream (~), host-only steps
                   (staging writes, host_sync) on the host lane
    device step    every operation of the head group that ran, on its stream's lane (>)
    resume         the host leaving host_sync, then the rest of the call as above
    violation      last, on the lane where it was detected (!)

Stream names: consumer streams `s0 .. s{n-1}`, then `copy` (the last index).

Operations are followed from enqueue to run through the explicit model's queues
(`State.queues`), when the states have them and consecutive states chain; otherwise device
steps are drawn as "head group" and every wait as enqueued.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from model_check.render.draw import COLORS, clip, new_figure, save, staircase
from model_check.streams.interpreter import Action
from model_check.table.properties import Violation

__all__ = [
    "HOST",
    "LaneEvent",
    "OutcomeLike",
    "TraceSteps",
    "stream_names",
    "swimlane_events",
    "swimlane_svg",
    "swimlane_text",
    "trace_summary",
]

HOST = -1  # lane index of the host

# Event marks, and the prefix each has in the text swimlane.
MARKS: dict[str, str] = {
    "call": "",  # a host call
    "host": "  ",  # a host-only step of a call (staging write, host_sync)
    "resume": "",  # the host leaves host_sync
    "enqueue": "+",  # a device operation enqueued
    "record": "*",  # an event (or staging reuse event) recorded: a snapshot, no work
    "noop": "~",  # a wait that enqueued nothing
    "ran": ">",  # a device operation ran
    "violation": "!",
}
LEGEND = "+ enqueued   > ran   * event recorded   ~ wait with nothing to wait for   ! violation"


class OutcomeLike(Protocol):
    """What the renderer reads of an `Outcome` (of any device model)."""

    @property
    def state(self) -> object: ...

    @property
    def violation(self) -> Violation | None: ...

    @property
    def tags(self) -> frozenset[str]: ...

    @property
    def trace(self) -> tuple[str, ...]: ...


TraceSteps = Sequence[tuple[Action, OutcomeLike]]
_Queues = tuple[tuple[tuple[object, ...], ...], ...]


@dataclass(frozen=True)
class LaneEvent:
    """One row of a swimlane."""

    row: int  # position in time, 0-based
    lane: int  # HOST, or a stream index (the copy stream is the last)
    mark: str  # a key of MARKS
    text: str
    action: int  # index of the trace step that produced it (the violation: the last one)
    op_id: int = -1  # identity of a device operation: its "enqueue" and "ran" events share it
    after: int = -1  # for an enqueued wait: op_id of the operation it waits for
    # For an enqueued copy (read): op_id of the latest earlier-enqueued read of (copy into) its
    # slots still pending, which it must run after (P1, P2) whether or not a wait orders them.
    must_follow: int = -1


def stream_names(n_consumer_streams: int) -> list[str]:
    return [f"s{i}" for i in range(n_consumer_streams)] + ["copy"]


def _lane_name(lane: int, n_consumer_streams: int) -> str:
    if lane == HOST:
        return "host"
    if 0 <= lane <= n_consumer_streams:
        return stream_names(n_consumer_streams)[lane]
    return f"stream{lane}"


# ---------------------------------------------------------------- trace strings

_ON = re.compile(r"^(?P<body>.*) on (?P<stream>\d+)$")
_COPY = re.compile(r"^copy expert (?P<e>\S+) to slot (?P<s>\S+)$")

# Device-call words of the recording format -> the queue operation kind they enqueue.
_ENQUEUES = {"wait": "wait", "waitflag": "flag", "copy": "copy", "upload": "map", "read": "read"}


def _short(body: str) -> str:
    """Compact cell text for a device call (without its ' on N')."""
    m = _COPY.match(body)
    if m:
        return f"copy e{m['e']}->slot{m['s']}"
    if body.startswith("record ") and body.endswith(" staging reuse"):
        return f"record {body[len('record ') : -len(' staging reuse')]} reuse"
    return body


def _fmt_arg(arg: object) -> str:
    if isinstance(arg, tuple):
        return "[" + ", ".join(_fmt_arg(a) for a in arg) + "]"
    return str(arg)


def _call_text(action: Action, stream: int, n_consumer_streams: int) -> str:
    args = ", ".join(_fmt_arg(a) for a in action.args)
    return f"{action.op}({args}) on {_lane_name(stream, n_consumer_streams)}"


# ---------------------------------------------------------------- following queues


def _queues(state: object) -> _Queues | None:
    queues = getattr(state, "queues", None)
    if not isinstance(queues, tuple) or not all(isinstance(q, tuple) for q in queues):
        return None
    return queues


def _kinds(queue: Sequence[tuple[object, ...]]) -> list[object]:
    return [op[0] if op else None for op in queue]


def _consistent(action: Action, pre: _Queues, post: _Queues) -> bool:
    """Could `post` follow `pre` by `action`? (Host calls only append, device steps only pop
    the head of one stream.)"""
    if len(pre) != len(post):
        return False
    for sid, (a, b) in enumerate(zip(pre, post, strict=True)):
        ka, kb = _kinds(a), _kinds(b)
        if action.kind == "device" and sid == action.stream:
            ran = len(ka) - len(kb)
            if ran <= 0 or ka[ran:] != kb:
                return False
        elif action.kind == "device":
            if ka != kb:
                return False
        elif kb[: len(ka)] != ka:
            return False
    return True


@dataclass(frozen=True)
class _Traced:
    action: Action
    outcome: OutcomeLike
    pre: _Queues | None  # queues before the step; None if unknown
    post: _Queues | None


def _follow(trace: TraceSteps, n_consumer_streams: int) -> list[_Traced]:
    """Pair each step with the queues before and after it, when the states carry queues (the
    explicit model) and the steps chain (each state follows from the previous one)."""
    n = n_consumer_streams + 1
    plain = [_Traced(a, o, None, None) for a, o in trace]
    posts = [_queues(outcome.state) for _, outcome in trace]
    out: list[_Traced] = []
    pre: _Queues = ((),) * n
    for (action, outcome), post in zip(trace, posts, strict=True):
        if post is None or len(post) != n or not _consistent(action, pre, post):
            # A trace of another model, one that starts mid-way, or one whose states were
            # stored up to a renaming of the streams: draw the steps as recorded, without
            # tracking queue contents.
            return plain
        out.append(_Traced(action, outcome, pre, post))
        pre = post
    return out


# ---------------------------------------------------------------- timeline


def swimlane_events(
    trace: TraceSteps,
    n_consumer_streams: int,
    violation: Violation | None = None,
) -> list[LaneEvent]:
    """The trace as timeline events, in time order (see the module docstring).

    `violation` defaults to the last step's; pass `Result.violation` for violations that are
    not attached to a step (P7, a deadlock, is found on a state, not on a transition)."""
    steps = _follow(trace, n_consumer_streams)
    n = n_consumer_streams + 1
    events: list[LaneEvent] = []
    fifo: list[list[tuple[int, str]]] = [[] for _ in range(n)]  # pending (op_id, label)
    next_id = 0

    def add(
        lane: int,
        mark: str,
        text: str,
        action: int,
        op_id: int = -1,
        after: int = -1,
        must_follow: int = -1,
    ) -> None:
        events.append(LaneEvent(len(events), lane, mark, text, action, op_id, after, must_follow))

    def referenced(op: tuple[object, ...] | None) -> int:
        """op_id of the last operation named by the op's first reference, -1 if none."""
        refs = op[3] if op is not None and len(op) > 3 else ()
        if not isinstance(refs, tuple):
            return -1
        for ref in refs:
            if isinstance(ref, tuple) and len(ref) == 2:
                rs, rk = int(ref[0]), int(ref[1])
                if 0 <= rs < n and 0 < rk <= len(fifo[rs]):
                    return fifo[rs][rk - 1][0]
        return -1

    for index, st in enumerate(steps):
        action, outcome = st.action, st.outcome
        if action.kind == "device":
            lane = action.stream
            if st.pre is not None and st.post is not None and 0 <= lane < n:
                ran = len(st.pre[action.stream]) - len(st.post[action.stream])
                for _ in range(ran):
                    op_id, label = fifo[lane].pop(0) if fifo[lane] else (-1, "?")
                    add(lane, "ran", label, index, op_id)
            else:
                add(lane, "ran", "head group", index)
            continue
        if action.kind == "resume":
            add(HOST, "resume", "resume after host_sync", index)
        else:
            text = _call_text(action, action.stream, n_consumer_streams)
            if any(t.startswith("rejected") for t in outcome.tags):
                text += " rejected"
            add(HOST, "call", text, index)
        # Operations this call appended to each stream, to match with the recorded device
        # calls: a wait whose event was empty (or recorded on its own stream) enqueues nothing.
        new: list[list[tuple[object, ...]]] | None = None
        if st.pre is not None and st.post is not None:
            new = [list(q[len(p) :]) for p, q in zip(st.pre, st.post, strict=True)]
        blocked = getattr(outcome.state, "blocked", None) is not None
        for k, raw in enumerate(outcome.trace):
            m = _ON.match(raw)
            if m is None:
                note = " (host blocks)" if blocked and k == len(outcome.trace) - 1 else ""
                add(HOST, "host", raw + note, index)
                continue
            body, sid = m["body"], int(m["stream"])
            lane = sid if 0 <= sid < n else HOST
            word = body.split(" ", 1)[0]
            label = _short(body)
            if word == "record":
                add(lane, "record", label, index)
                continue
            kind = _ENQUEUES.get(word)
            if kind is None:
                add(lane, "host", label, index)
                continue
            op: tuple[object, ...] | None = None
            if new is not None and sid < len(new):
                if new[sid] and new[sid][0][0] == kind:
                    op = new[sid].pop(0)
                elif word == "wait":
                    add(lane, "noop", label, index)
                    continue
            after = referenced(op) if kind == "wait" else -1
            follow = referenced(op) if kind in ("copy", "read") else -1
            op_id = next_id
            next_id += 1
            if lane != HOST:
                fifo[lane].append((op_id, label))
            add(lane, "enqueue", label, index, op_id, after, follow)

    last = trace[-1][1].violation if trace else None
    found = violation if violation is not None else last
    if found is not None:
        # On the lane of the device step that exposed it; a violation of a state (a
        # deadlock) or of a host call goes on the host lane.
        lane = HOST
        if found == last and steps and steps[-1].action.kind == "device":
            lane = steps[-1].action.stream
        add(lane, "violation", f"{found.prop}: {found.detail}", len(steps) - 1)
    return events


def swimlane_text(
    trace: TraceSteps,
    n_consumer_streams: int,
    violation: Violation | None = None,
    *,
    width: int = 100,
) -> str:
    """A per-stream swimlane of the trace as text, at most `width` columns wide.

    One column per lane (host, s0 .., copy), one row per event; the first column numbers the
    trace steps (1-based) on the row where each starts. The violation comes last, in its lane
    and in full below the table."""
    events = swimlane_events(trace, n_consumer_streams, violation)
    lanes = [HOST, *range(n_consumer_streams + 1)]
    header = [_lane_name(lane, n_consumer_streams) for lane in lanes]
    rows: list[tuple[str, int, str]] = []
    last_action = -1
    for ev in events:
        num = ""
        if ev.action != last_action and ev.mark != "violation":
            num = str(ev.action + 1)
            last_action = ev.action
        text = ev.text if ev.mark != "violation" else ev.text.split(":", 1)[0]
        lane = lanes.index(ev.lane) if ev.lane in lanes else 0
        rows.append((num, lane, MARKS[ev.mark] + text))
    first = max(3, len(str(len(trace))))
    out = textwrap.wrap(f"legend: {LEGEND}", width, subsequent_indent="        ")
    out += staircase(header, rows, width, first)
    found = next((e for e in events if e.mark == "violation"), None)
    if found is not None:
        where = _lane_name(found.lane, n_consumer_streams)
        out.append("=" * width)
        out += textwrap.wrap(
            f"!! VIOLATION at step {found.action + 1} ({where}): {found.text}",
            width,
            subsequent_indent="   ",
        )
    return "\n".join(out) + "\n"


def trace_summary(
    trace: TraceSteps,
    n_consumer_streams: int | None = None,
    violation: Violation | None = None,
) -> list[str]:
    """One line per trace step: the host call and how many operations it enqueued on each
    stream, or the operations a device step ran; the violation on the last line."""
    if n_consumer_streams is None:
        n_consumer_streams = _infer_consumer_streams(trace)
    n = n_consumer_streams
    events = swimlane_events(trace, n, violation)
    lines: list[str] = []
    for index in range(len(trace)):
        mine = [e for e in events if e.action == index and e.mark != "violation"]
        head = next((e for e in mine if e.mark in ("call", "resume")), None)
        if head is None:
            ran = [e for e in mine if e.mark == "ran"]
            lane = _lane_name(ran[0].lane, n) if ran else "?"
            text = f"device {lane} ran " + ", ".join(e.text for e in ran)
        else:
            per: dict[int, int] = {}
            for e in mine:
                if e.mark == "enqueue":
                    per[e.lane] = per.get(e.lane, 0) + 1
            shown = ", ".join(f"{_lane_name(lane, n)} +{k}" for lane, k in sorted(per.items()))
            text = head.text + (f": enqueued {shown}" if shown else ": enqueued nothing")
            if any(e.mark == "host" and e.text.endswith("(host blocks)") for e in mine):
                text += "; host blocks in host_sync"
        lines.append(f"{index + 1}. {text}")
    found = next((e for e in events if e.mark == "violation"), None)
    if found is not None:
        lines.append(f"!! {found.text}")
    return lines


def _infer_consumer_streams(trace: TraceSteps) -> int:
    for _, outcome in trace:
        queues = _queues(outcome.state)
        if queues is not None:
            return len(queues) - 1
    top = 0
    for action, outcome in trace:
        top = max(top, action.stream)
        for raw in outcome.trace:
            m = _ON.match(raw)
            if m:
                top = max(top, int(m["stream"]))
    return max(top, 1)


# ---------------------------------------------------------------- images


def _color(text: str, mark: str) -> str:
    if mark == "violation":
        return COLORS["violation"]
    if mark == "record":
        return COLORS["record"]
    if mark in ("call", "host", "resume"):
        return COLORS["host"]
    return COLORS.get(text.split(" ", 1)[0], "#999999")


def swimlane_svg(
    trace: TraceSteps,
    n_consumer_streams: int,
    path: str | Path,
    violation: Violation | None = None,
) -> Path:
    """Draw the swimlane: lanes as horizontal bands (host on top), one box per event
    (dashed = enqueued, filled = ran), solid arrows from the record of the event a wait waits
    for to the wait, dotted arrows from a pending read (copy) to a later copy into (read of)
    its slot that must run after it, the violation in red. The file type follows the suffix
    (.svg or .png)."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    path = Path(path)
    events = swimlane_events(trace, n_consumer_streams, violation)
    lanes = [HOST, *range(n_consumer_streams + 1)]
    nrows = max(len(events), 1)
    lane_h, col_w, left = 1.5, 0.27, 0.8  # inches
    found = next((e for e in events if e.mark == "violation"), None)
    detail = textwrap.wrap(found.text, 110) if found else []
    line_u = 0.2 / lane_h  # one line of the violation text, in lane units
    top_u, foot_u = 0.3, (0.2 + line_u * len(detail)) if detail else 0.05
    width = max(6.0, left + col_w * (nrows + 1))
    fig, ax = new_figure(width, lane_h * (top_u + len(lanes) + foot_u))
    # Data coordinates: x counts events, y counts lanes downwards from 0 (host on top).
    x0 = -left / col_w
    ax.set_xlim(x0, nrows + 0.5)
    ax.set_ylim(-len(lanes) - foot_u, top_u)
    ax.set_axis_off()

    def lane_y(lane: int) -> float:
        return -float(lanes.index(lane) if lane in lanes else 0) - 0.5

    for k, lane in enumerate(lanes):
        ax.add_patch(
            Rectangle((x0, -k - 1), nrows + 0.5 - x0, 1, color="#f4f4f4" if k % 2 else "#ffffff")
        )
        ax.text(
            x0 + 0.3,
            -k - 0.5,
            _lane_name(lane, n_consumer_streams),
            va="center",
            ha="left",
            fontsize=9,
            fontweight="bold",
        )
    # Alternate a light band per trace step, numbered on top.
    for index in range(len(trace)):
        rows = [e.row for e in events if e.action == index and e.mark != "violation"]
        if not rows:
            continue
        lo, hi = min(rows), max(rows)
        if index % 2 == 0:
            ax.add_patch(
                Rectangle(
                    (lo - 0.5, -len(lanes)),
                    hi - lo + 1,
                    len(lanes),
                    color="#e8eef8",
                    alpha=0.6,
                    lw=0,
                )
            )
        ax.text((lo + hi) / 2, top_u / 2, str(index + 1), ha="center", va="center", fontsize=7)
    where: dict[int, tuple[float, float]] = {}  # enqueue box of each device operation
    recorded: dict[str, tuple[float, float]] = {}  # latest record box of each event
    for ev in events:
        x, y = float(ev.row), lane_y(ev.lane)
        color = _color(ev.text, ev.mark)
        text = ev.text if ev.mark != "violation" else ev.text.split(":", 1)[0]
        face, edge, style, fc = "white", color, "solid", "black"
        if found is not None and ev.action == found.action and ev.lane == found.lane:
            edge = COLORS["violation"]  # the step that exposed the violation
        if ev.mark == "ran":
            face, fc = color, "white"
        elif ev.mark == "enqueue":
            style = "dashed"
        elif ev.mark == "noop":
            style, fc = "dotted", "#777777"
        elif ev.mark == "record":
            face = "#ece8f6"
        elif ev.mark in ("call", "resume"):
            face = "#dddddd"
        elif ev.mark == "violation":
            face, fc = color, "white"
        box_h = 0.86
        ax.add_patch(
            Rectangle(
                (x - 0.42, y - box_h / 2),
                0.84,
                box_h,
                facecolor=face,
                edgecolor=edge,
                linestyle=style,
                lw=1.0,
            )
        )
        ax.text(
            x,
            y,
            clip(MARKS[ev.mark] + text, 23),
            rotation=90,
            ha="center",
            va="center",
            fontsize=6,
            color=fc,
            fontweight="bold" if ev.mark in ("call", "violation") else "normal",
        )
        if ev.mark == "record":
            recorded[ev.text.removeprefix("record ")] = (x, y)
        if ev.mark != "enqueue":
            continue
        where[ev.op_id] = (x, y)
        if ev.must_follow in where:
            # An ordering the properties need (a copy after the pending reads of its slot, a
            # read after the pending copies into its slots), dotted: nothing enforces it here.
            ax.add_patch(
                FancyArrowPatch(
                    where[ev.must_follow],
                    (x, y),
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color=COLORS["read"],
                    lw=0.8,
                    linestyle="dotted",
                    connectionstyle="arc3,rad=0.25",
                    shrinkA=4,
                    shrinkB=4,
                )
            )
        if ev.after in where:
            # The wait orders after the snapshot its event holds: draw the arrow from that
            # event's latest record, or from the operation itself when no record is drawn.
            name = ev.text.split(" ", 1)[1] if " " in ev.text else ""
            ax.add_patch(
                FancyArrowPatch(
                    recorded.get(name, where[ev.after]),
                    (x, y),
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color="#444444",
                    lw=0.8,
                    connectionstyle="arc3,rad=-0.25",
                    shrinkA=4,
                    shrinkB=4,
                )
            )
    for k, line in enumerate(detail):
        ax.text(
            x0 + 0.3,
            -len(lanes) - 0.1 - line_u * k,
            line,
            ha="left",
            va="top",
            fontsize=8,
            color=COLORS["violation"],
            fontweight="bold" if k == 0 else "normal",
        )
    save(fig, path)
    return path
