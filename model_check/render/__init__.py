"""Pictures: swimlanes of counterexample traces (`swimlane`) and the transition table
(`table`), as text and as .svg/.png (`draw`)."""

from model_check.render.swimlane import (
    HOST,
    LaneEvent,
    OutcomeLike,
    TraceSteps,
    stream_names,
    swimlane_events,
    swimlane_svg,
    swimlane_text,
    trace_summary,
)
from model_check.render.table import device_table_text, table_diagram, table_text

__all__ = [
    "HOST",
    "LaneEvent",
    "OutcomeLike",
    "TraceSteps",
    "device_table_text",
    "stream_names",
    "swimlane_events",
    "swimlane_svg",
    "swimlane_text",
    "table_diagram",
    "table_text",
    "trace_summary",
]
